"""mis_jax's rollout correction inside tunix's GRPO (``pip install 'mis_jax[tunix]'``).

tunix's :class:`GRPOLearner` drops the rollout engine's log-probs and recomputes the old
policy's at temperature 1, so the train–inference mismatch is invisible there. Two lines of a
tunix user's script change::

    from mis_jax.integrations import tunix as mis_tunix

    config = mis_tunix.MISGRPOConfig(num_generations=4, beta=0.0,          # was grpo_learner.GRPOConfig
                                     use_tis=True, mis="configs/mis.yaml")
    learner = mis_tunix.MISGRPOLearner(rl_cluster=cluster, algo_config=config,   # was GRPOLearner
                                       reward_fns=[reward])
    learner.train(dataset)

What :class:`MISGRPOLearner` does on top of tunix's learner:

* asks every rollout config for log-probs (``RolloutConfig.return_logprobs = True``) and keeps
  them, aligned with tunix's padded completion tokens (``q``); an engine that returns none is
  an error naming the engine, never a silent fallback to recomputed log-probs;
* recomputes the old policy's log-probs (``o``) with the trainer's current weights **at the
  sampling temperature** (tunix's own path ignores it), once per rollout batch;
* computes the loss with :func:`mis_jax.policy_loss` over tunix's padded batch (each row one
  segment, the completion mask the loss mask): any row of the contract §6 table — standard PPO,
  bypass PPO, decoupled PPO, REINFORCE + IS — with vanilla TIS or a ``mis.yaml`` correction,
  or standard PPO with mismatch metrics only;
* logs every metric :func:`mis_jax.policy_loss` returns (the names of contract §8: ``mis_k3_kl``,
  ``mis_is_ratio_mean_final``, ...) through tunix's metrics logger, plus tunix's ``kl``;
* keeps out of the loss every completion tunix cannot train as sampled (a sampled pad id
  followed by other tokens: :func:`untrainable_completions`), counted per step as
  ``completions/untrainable`` (:data:`UNTRAINABLE_METRIC`) beside tunix's ``completions/*``;
* refuses a model config whose ``rope_theta`` tunix's model ignores (:func:`check_rope_theta`:
  tunix 0.1.7's Qwen3 and Llama3 always use 1e6).

The loss is also registered in tunix's policy-loss registry as ``"mis_jax"``
(:data:`LOSS_NAME`). tunix's stock learner can select it (``GRPOConfig(policy_loss_fn=
"mis_jax")``) but never hands the loss the rollout log-probs, so there it is standard PPO with
mis_jax's aggregation; asking it for correction raises an error that says to use
:class:`MISGRPOLearner`.

tunix's settings map to mis_jax's: ``epsilon`` → ``eps_clip``, ``epsilon_high`` →
``eps_clip_high``, ``epsilon_c`` → the ``vanilla`` form's ``eps_clip_c``, ``beta`` → ``kl_coef``, ``kl_loss_mode``
``kl``/``mse_kl``/``low_var_kl`` → ``kl_type`` ``k1``/``k2``/``k3``, ``loss_agg_mode``
``token-mean``/``sequence-mean-token-mean``/``seq-mean-token-sum`` → ours of the same meaning.
Anything else (``gspo-token``, other aggregation modes, ``kl_clamp_value``, tunix's sequence
packing) is refused with an error naming the setting.

Semantics to know: each tunix micro-batch is one :func:`mis_jax.policy_loss` call, so loss
denominators and IS batch normalisation are per micro-batch, as tunix's own aggregation is
(the default micro-batch is the whole batch). Tested with google-tunix 0.1.7
(:data:`TESTED_TUNIX`); importing this module with a tunix outside ``>=0.1.7,<0.2`` raises
ImportError, because the learner follows 0.1.7's API (tunix's main branch renames
``RLCluster`` to ``RLEngine`` and the learner's ``rl_cluster`` argument to ``rl_engine``).
Set ``MIS_JAX_ALLOW_UNTESTED_TUNIX=1`` to import anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import re
import threading
from typing import Any, Mapping

import numpy as np

try:
  import flax
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tunix.rl import algo_core, common, function_registry
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
except ImportError as e:  # pragma: no cover - the message is the point
  raise ImportError(
    f"mis_jax.integrations.tunix needs google-tunix ({e}); install it with pip install 'mis_jax[tunix]'"
  ) from e

from mis_jax import ConfigError, LossConfig, MISConfig, PackedBatch, kl_penalty, microbatch_reduction, policy_loss

__all__ = [
  "LOSS_NAME",
  "ROPE_THETA_IGNORED",
  "TESTED_TUNIX",
  "UNTRAINABLE_METRIC",
  "MISGRPOConfig",
  "MISGRPOLearner",
  "MISTrainExample",
  "MissingRolloutLogprobs",
  "check_rope_theta",
  "loss_config_for",
  "mis_policy_loss_fn",
  "padded_batch",
  "rollout_logprobs",
  "rope_theta_computed",
  "untrainable_completions",
]

TESTED_TUNIX = "0.1.7"
# Logged per step (a count, summed over rollout micro-batches) beside tunix's completions/*.
UNTRAINABLE_METRIC = "completions/untrainable"
_SUPPORTED = ((0, 1, 7), (0, 2, 0))  # [low, high)
LOSS_NAME = "mis_jax"


def _check_tunix_version() -> None:
  try:
    version = importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:  # a source checkout: trust the API check below
    version = None
  if version is not None and os.environ.get("MIS_JAX_ALLOW_UNTESTED_TUNIX") != "1":
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    low, high = _SUPPORTED
    if not low <= parts < high:
      raise ImportError(
        f"mis_jax.integrations.tunix supports google-tunix >=0.1.7,<0.2 (tested: {TESTED_TUNIX}); "
        f"found {version}. Outside that range tunix's learner API differs (its main branch "
        "renames RLCluster to RLEngine and the learner argument rl_cluster to rl_engine). "
        "Install google-tunix==0.1.7, or set MIS_JAX_ALLOW_UNTESTED_TUNIX=1 to try anyway."
      )
  needed = {
    "tunix.rl.rl_cluster.RLCluster": getattr(rl_cluster_lib, "RLCluster", None),
    "tunix.rl.function_registry.register_policy_loss_fn": getattr(function_registry, "register_policy_loss_fn", None),
    "tunix.rl.common.compute_per_token_logps": getattr(common, "compute_per_token_logps", None),
    "GRPOLearner._generate_and_compute_advantage": getattr(
      grpo_learner.GRPOLearner, "_generate_and_compute_advantage", None
    ),
  }
  missing = [name for name, obj in needed.items() if obj is None]
  if missing:
    raise ImportError(
      f"this tunix ({version}) lacks {', '.join(missing)}, which "
      f"mis_jax.integrations.tunix uses (tested with google-tunix {TESTED_TUNIX})"
    )


_check_tunix_version()

# tunix's names for the settings mis_jax shares.
_AGG_MODES = {
  "token-mean": "token-mean",
  "sequence-mean-token-mean": "seq-mean-token-mean",
  "seq-mean-token-sum": "seq-mean-token-sum",
}
_KL_MODES = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}


# tunix 0.1.7's model ports whose attention calls `apply_rope` without the config's
# `rope_theta`, so RoPE always uses that function's default, 1e6, whatever the config says
# (tunix/models/qwen3/model.py, tunix/models/llama3/model.py; its Qwen2 and Gemma pass theirs).
ROPE_THETA_IGNORED = {"tunix.models.qwen3.model": 1_000_000.0, "tunix.models.llama3.model": 1_000_000.0}


def rope_theta_computed(model_config) -> float | None:
  """The RoPE theta tunix's model computes with for ``model_config``: 1e6 for the ports of
  :data:`ROPE_THETA_IGNORED` (tunix 0.1.7's Qwen3 and Llama3), else the config's ``rope_theta``;
  None for a config without one."""
  theta = getattr(model_config, "rope_theta", None)
  if theta is None:
    return None
  return float(ROPE_THETA_IGNORED.get(type(model_config).__module__, theta))


def prepare_cluster(rl_cluster, learner: str, rows: str) -> None:
  """What a mis_jax learner needs of a tunix cluster before tunix's own constructor runs: an actor
  whose ``rope_theta`` tunix computes with (:func:`check_rope_theta`), no sequence packing (the
  rollout log-probs are aligned with the padded ``rows``), and ``return_logprobs=True`` on every
  rollout config."""
  check_rope_theta(getattr(rl_cluster.actor_trainer.model, "config", None))
  training = rl_cluster.cluster_config.training_config
  if getattr(training, "max_seq_token_per_tpu", None) is not None:
    raise ConfigError(
      f"training_config.max_seq_token_per_tpu={training.max_seq_token_per_tpu}: tunix's sequence "
      f"packing is not supported by {learner} (the rollout log-probs are aligned with the padded {rows}); "
      "set it to None"
    )
  rollout_configs = rl_cluster.cluster_config.rollout_config
  for rc in rollout_configs.values() if isinstance(rollout_configs, dict) else [rollout_configs]:
    rc.return_logprobs = True


def check_rope_theta(model_config) -> None:
  """Raises :class:`mis_jax.ConfigError` when ``model_config.rope_theta`` is not the theta
  tunix's model computes with (:func:`rope_theta_computed`).

  tunix 0.1.7's Qwen3 ignores its config's ``rope_theta``; an engine given the same value
  (sglang-jax and vLLM read it from ``config.json``) then samples from another model than the
  one trained — 0.17 nats mean |Δ log p| on the example's tiny Qwen3 at theta 10000, in float32
  on both sides — and the correction would weigh that bug as if it were a train–inference
  mismatch.
  """
  theta, computed = getattr(model_config, "rope_theta", None), rope_theta_computed(model_config)
  if computed is not None and float(theta) != computed:
    raise ConfigError(
      f"{type(model_config).__module__}.{type(model_config).__name__}.rope_theta={theta:.10g}, but tunix's "
      f"model applies RoPE with theta {computed:.10g} whatever its config says (its attention never passes "
      "rope_theta to apply_rope): an engine reading the config's value samples from another model than "
      f"the one trained. Set rope_theta={computed:.10g} in the model config and in the engine's config.json "
      "(what tunix computes); a checkpoint trained with another theta cannot be trained faithfully by "
      "this tunix model port."
    )


def untrainable_completions(completion_ids, pad_id: int) -> np.ndarray:
  """``[B]`` bool: completions tunix cannot train as sampled, those with a pad id followed by a
  non-pad token.

  tunix takes ``tokens != pad_id`` as the completion mask and rebuilds positions and attention
  from it, so each token after a sampled pad id would be scored in a context the engine never
  saw. Pad ids only at the end (tunix's own padding, or the stop token where pad == eos) leave
  every trained token's context as sampled.
  """
  is_pad = np.asarray(completion_ids) == pad_id
  return np.any((np.cumsum(is_pad, axis=-1) > 0) & ~is_pad, axis=-1)


class MissingRolloutLogprobs(RuntimeError):
  """The rollout engine returned no log-probs, which rollout correction cannot do without."""


def _engine_name(cluster) -> str:
  engine = cluster.cluster_config.rollout_engine
  return engine if isinstance(engine, str) else getattr(engine, "__name__", repr(engine))


def _loss_config(
  algo_config,
  *,
  use_tis,
  use_rollout_logprobs,
  get_mismatch_metrics,
  mis,
  tis_clip,
  tis_clip_low,
  denominator,
  entropy_coef,
) -> LossConfig:
  """The :class:`LossConfig` of tunix's GRPO settings plus mis_jax's; errors name tunix's keys."""
  name = type(algo_config).__name__
  if getattr(algo_config, "loss_algo", "grpo") != "grpo":
    raise ConfigError(
      f"{name}.loss_algo={algo_config.loss_algo!r} is not supported by mis_jax's loss; "
      "use 'grpo' (sequence-level IS is tis_level: sequence in a mis.yaml)"
    )
  agg = algo_config.loss_agg_mode
  if agg not in _AGG_MODES:
    raise ConfigError(
      f"{name}.loss_agg_mode={agg!r} is not supported by mis_jax's loss; one of {', '.join(_AGG_MODES)}"
    )
  kl_mode = algo_config.kl_loss_mode
  if kl_mode not in _KL_MODES:
    raise ConfigError(f"{name}.kl_loss_mode={kl_mode!r} is not supported; one of {', '.join(_KL_MODES)}")
  if getattr(algo_config, "kl_clamp_value", None) is not None:
    raise ConfigError(
      f"{name}.kl_clamp_value={algo_config.kl_clamp_value!r} is not supported by "
      "mis_jax's loss (its k3 clips the log-ratio to ±20 instead); set it to None"
    )
  epsilon = algo_config.epsilon
  if not 0 < epsilon < 1:
    raise ConfigError(f"{name}.epsilon must be in (0, 1), got {epsilon!r}")
  high = getattr(algo_config, "epsilon_high", None)
  if high is not None and not high > 0:
    raise ConfigError(f"{name}.epsilon_high must be > 0 or None, got {high!r}")
  dual = getattr(algo_config, "epsilon_c", None)
  if dual is not None and not dual > 1:
    raise ConfigError(f"{name}.epsilon_c (dual clip) must be > 1 or None, got {dual!r}")
  beta = algo_config.beta
  if beta is None or beta < 0:
    raise ConfigError(f"{name}.beta must be >= 0, got {beta!r}")
  if isinstance(mis, (str, os.PathLike)):
    mis = MISConfig.from_yaml(mis)
  elif isinstance(mis, Mapping):
    mis = MISConfig.from_dict(mis)
  elif mis is not None and not isinstance(mis, MISConfig):
    raise ConfigError(
      f"{name}.mis must be a mis_jax.MISConfig, a mapping, the path of a mis.yaml or None, got {type(mis).__name__}"
    )
  return LossConfig(
    use_tis=use_tis,
    use_rollout_logprobs=use_rollout_logprobs,
    get_mismatch_metrics=get_mismatch_metrics,
    eps_clip=float(epsilon),
    eps_clip_high=None if high is None else float(high),
    policy_loss={"name": "vanilla", "eps_clip_c": None if dual is None else float(dual)},
    loss_agg_mode=_AGG_MODES[agg],
    denominator=denominator,
    tis_clip=tis_clip,
    tis_clip_low=tis_clip_low,
    mis=mis,
    entropy_coef=entropy_coef,
    kl_coef=float(beta),
    kl_type=_KL_MODES[kl_mode],
  )


@dataclasses.dataclass(kw_only=True)
class MISGRPOConfig(grpo_learner.GRPOConfig):
  """tunix's :class:`GRPOConfig` plus mis_jax's loss settings (contract §6–7, §9).

  Attributes (in addition to tunix's):
    use_rollout_logprobs: the rollout log-probs are the PPO anchor (bypass PPO, or REINFORCE +
      IS with ``use_tis``); else the recomputed old log-probs are (standard / decoupled PPO).
    use_tis: rollout correction on; None takes the MIS config's ``use_tis`` (False without one).
      On without ``mis`` it is vanilla token TIS (``tis_clip``, ``tis_clip_low``).
    mis: a :class:`mis_jax.MISConfig`, a mapping of its keys or the path of a ``mis.yaml``.
    get_mismatch_metrics: log the mismatch metrics (contract §8.1) even with correction off.
    tis_clip, tis_clip_low: vanilla TIS clip range.
    denominator: ``kept`` or ``original`` tokens as the loss denominator (contract §7).
    epsilon_high, epsilon_c: upper PPO clip and dual-clip constant (None: ``epsilon``, off).
    entropy_coef: entropy bonus coefficient (tunix's GRPO has none).

  ``policy_loss_fn`` is ``"mis_jax"``; the resolved :class:`mis_jax.LossConfig` is
  :attr:`loss_config`, built (and validated) at construction.
  """

  policy_loss_fn: str = LOSS_NAME
  use_rollout_logprobs: bool = False
  use_tis: bool | None = None
  mis: Any = None
  get_mismatch_metrics: bool = True
  tis_clip: float = 2.0
  tis_clip_low: float = 0.0
  denominator: str = "kept"
  epsilon_high: float | None = None
  epsilon_c: float | None = None
  entropy_coef: float = 0.0
  loss_config: LossConfig | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    if self.policy_loss_fn != LOSS_NAME:
      raise ConfigError(
        f"MISGRPOConfig.policy_loss_fn must be {LOSS_NAME!r} (mis_jax's loss), got "
        f"{self.policy_loss_fn!r}; use tunix's GRPOConfig for tunix's own losses"
      )
    self.loss_config = _loss_config(
      self,
      use_tis=self.use_tis,
      use_rollout_logprobs=self.use_rollout_logprobs,
      get_mismatch_metrics=self.get_mismatch_metrics,
      mis=self.mis,
      tis_clip=self.tis_clip,
      tis_clip_low=self.tis_clip_low,
      denominator=self.denominator,
      entropy_coef=self.entropy_coef,
    )


def loss_config_for(algo_config) -> LossConfig:
  """The :class:`mis_jax.LossConfig` of a tunix algorithm config: a :class:`MISGRPOConfig`'s
  own, or standard PPO with tunix's clip, KL and aggregation settings for a plain GRPOConfig."""
  cfg = getattr(algo_config, "loss_config", None)
  if isinstance(cfg, LossConfig):
    return cfg
  return _loss_config(
    algo_config,
    use_tis=False,
    use_rollout_logprobs=False,
    get_mismatch_metrics=False,
    mis=None,
    tis_clip=2.0,
    tis_clip_low=0.0,
    denominator="kept",
    entropy_coef=0.0,
  )


@flax.struct.dataclass(frozen=True)
class MISTrainExample(grpo_learner.TrainExample):
  """tunix's ``TrainExample`` plus the rollout engine's per-token log-probs ``q``
  (``[B, max_tokens_to_generate]`` float32, 0 past each completion)."""

  rollout_per_token_logps: jax.Array | None = None


def padded_batch(
  train_example, loss_cfg: LossConfig, *, rollout_logprobs=None, old_logprobs=None, ref_logprobs=None
) -> PackedBatch:
  """tunix's padded ``[B, L]`` completion batch as a :class:`mis_jax.PackedBatch`: row ``b`` is
  segment ``b`` over its completion mask, padding is segment ``-1``, the sequence advantage is
  broadcast to its tokens."""
  mask = jnp.asarray(train_example.completion_mask).astype(bool)
  rows, length = mask.shape
  segment_ids = jnp.where(mask, jnp.arange(rows, dtype=jnp.int32)[:, None], -1)
  adv = jnp.asarray(train_example.advantages).astype(jnp.float32)
  if adv.ndim == 1:
    adv = jnp.broadcast_to(adv[:, None], (rows, length))
  f32 = lambda x: None if x is None else jnp.asarray(x).astype(jnp.float32)
  return PackedBatch(
    segment_ids=segment_ids,
    loss_mask=mask,
    advantages=adv,
    rollout_logprobs=f32(rollout_logprobs),
    old_logprobs=f32(old_logprobs),
    ref_logprobs=f32(ref_logprobs) if loss_cfg.kl_coef > 0 else None,
    num_segments=rows,
  )


@function_registry.register_policy_loss_fn(LOSS_NAME)
def mis_policy_loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
  """tunix policy loss ``"mis_jax"``: :func:`mis_jax.policy_loss` over tunix's padded batch.

  The current log-probs are tunix's own (``compute_per_token_logps`` at the config's
  temperature). ``q`` is ``train_example.rollout_per_token_logps`` (set by
  :class:`MISGRPOLearner`); ``o`` is ``old_per_token_logps``, or the current log-probs
  without gradient when tunix left it unset (tunix's on-policy convention).

  Returns:
    ``(loss, aux)``: mis_jax's loss and metrics, plus tunix's ``kl`` (the token mean of the
    KL estimator to the reference, 0 without one).
  """
  del kwargs
  cfg = loss_config_for(algo_config)
  if getattr(train_example, "segment_ids", None) is not None:
    raise ValueError(
      "the mis_jax loss takes tunix's padded batches, not packed ones (set training_config.max_seq_token_per_tpu=None)"
    )
  q = getattr(train_example, "rollout_per_token_logps", None)
  if q is None and (cfg.algorithm != "ppo" or cfg.get_mismatch_metrics):
    raise MissingRolloutLogprobs(
      f"the mis_jax loss with algorithm {cfg.algorithm!r} (get_mismatch_metrics="
      f"{cfg.get_mismatch_metrics}) needs the rollout log-probs, and tunix's {type(train_example).__name__} "
      "has none: tunix's GRPOLearner drops them. Use mis_jax.integrations.tunix.MISGRPOLearner."
    )
  graphdef, state = nnx.split(model)
  lp, logits = common.compute_per_token_logps(
    graphdef,
    state,
    prompt_tokens=train_example.prompt_ids,
    completion_tokens=train_example.completion_ids,
    pad_id=pad_id,
    eos_id=eos_id,
    stop_gradient=False,
    return_logits=True,
    temperature=getattr(algo_config, "temperature", 1.0),
  )
  lp = lp.astype(jnp.float32)
  o = train_example.old_per_token_logps
  if o is None and cfg.needs_old_logprobs:
    o = jax.lax.stop_gradient(lp)
  ref = train_example.ref_per_token_logps
  if cfg.kl_coef > 0 and ref is None:
    raise ValueError(f"beta={cfg.kl_coef} > 0 needs tunix's reference log-probs, and the train example has none")
  entropy = algo_core.compute_entropy_from_logits(logits).astype(jnp.float32)
  batch = padded_batch(train_example, cfg, rollout_logprobs=q, old_logprobs=o, ref_logprobs=ref)
  loss, aux = policy_loss(lp, batch, cfg, entropy=entropy)
  aux = dict(aux)
  # tunix's GRPOLearner logs "kl": the token mean of the KL estimator (ours, the mapped kl_type).
  if batch.ref_logprobs is None:
    aux["kl"] = jnp.zeros((), jnp.float32)
  else:
    kl = kl_penalty(lp, batch.ref_logprobs, cfg.kl_type)
    aux["kl"] = jnp.sum(jnp.where(batch.loss_mask, kl, 0.0)) / jnp.maximum(jnp.sum(batch.loss_mask), 1)
  return loss, aux


def rollout_logprobs(output, completion_ids, *, engine: str = "rollout") -> np.ndarray:
  """The rollout's per-token log-probs aligned with tunix's padded completions ``[B, L]``.

  ``output.logprobs[b]`` must hold one finite log-prob per token of ``output.tokens[b]``;
  positions past the completion are 0 (masked). Raises :class:`MissingRolloutLogprobs` when
  the engine returned none, ValueError naming the sample on any misalignment.
  """
  if output is None or output.logprobs is None:
    hint = (
      "tunix 0.1.7's sglang_jax rollout never returns them; use rollout_engine="
      "mis_jax.integrations.tunix_sglang_jax.SglangJaxRollout (the same engine, its log-probs "
      "kept), 'vanilla' or 'vllm'"
      if engine == "sglang_jax"
      else "the engine must honour RolloutConfig.return_logprobs=True (tunix's vanilla and vllm engines do)"
    )
    raise MissingRolloutLogprobs(
      f"the {engine!r} rollout engine returned no log-probs (RolloutOutput.logprobs is None) "
      f"although RolloutConfig.return_logprobs was set: {hint}. mis_jax needs the sampler's own "
      "log-probs and never substitutes recomputed ones."
    )
  completion_ids = np.asarray(completion_ids)
  rows, length = completion_ids.shape
  if len(output.logprobs) != rows or len(output.tokens) != rows:
    raise ValueError(
      f"the {engine!r} rollout returned {len(output.logprobs)} log-prob rows and "
      f"{len(output.tokens)} token rows for a batch of {rows} completions"
    )
  q = np.zeros((rows, length), np.float32)
  for b, (lps, toks) in enumerate(zip(output.logprobs, output.tokens)):
    lps = np.asarray(lps, np.float32).reshape(-1)
    n = len(np.asarray(toks).reshape(-1))
    if lps.shape[0] != n:
      raise ValueError(
        f"completion {b}: the {engine!r} rollout returned {lps.shape[0]} log-probs for "
        f"{n} tokens; they must be one per generated token"
      )
    if n > length:
      raise ValueError(f"completion {b} has {n} tokens, more than the padded length {length}")
    if not np.all(np.isfinite(lps)):
      bad = int(np.flatnonzero(~np.isfinite(lps))[0])
      raise ValueError(f"completion {b}: the {engine!r} rollout's log-prob at token {bad} is {lps[bad]}")
    q[b, :n] = lps
  return q


class MISGRPOLearner(grpo_learner.GRPOLearner):
  """tunix's :class:`GRPOLearner` with mis_jax's loss, rollout log-probs and correction.

  A drop-in: the same constructor arguments and ``train``; ``algo_config`` must be a
  :class:`MISGRPOConfig`. At construction it checks the actor's ``rope_theta``
  (:func:`check_rope_theta`), sets ``return_logprobs=True`` on the cluster's
  rollout config(s), installs the loss and the metrics to log, and wraps two methods of the
  given ``rl_cluster`` instance: ``generate`` (to keep its log-probs, per thread) and
  ``get_old_per_token_logps`` (the trainer's weights at the sampling temperature). Each
  rollout batch's :func:`untrainable_completions` are out of the loss (completion mask 0) and
  counted as :data:`UNTRAINABLE_METRIC`.
  """

  def __init__(self, rl_cluster, algo_config, reward_fns, metric_fns=None, data_shuffle_seed=None):
    if not isinstance(algo_config, MISGRPOConfig):
      raise TypeError(
        f"MISGRPOLearner needs a mis_jax.integrations.tunix.MISGRPOConfig, got {type(algo_config).__name__}"
      )
    prepare_cluster(rl_cluster, "MISGRPOLearner", "completions")
    super().__init__(
      rl_cluster=rl_cluster,
      algo_config=algo_config,
      reward_fns=reward_fns,
      metric_fns=metric_fns,
      data_shuffle_seed=data_shuffle_seed,
    )
    cfg = algo_config.loss_config
    self._engine = _engine_name(rl_cluster)
    self._needs_old = cfg.needs_old_logprobs or algo_config.num_iterations > 1
    self.metric_names = _metric_names(cfg, with_old=self._needs_old)
    reductions = {"max": np.max, "min": np.min}
    how = lambda name: "mask" if name == "kl" else microbatch_reduction(name, cfg)  # "kl": tunix's own mean
    self.rl_cluster.actor_trainer.with_rl_metrics_to_log(
      {name: reductions.get(how(name), np.mean) for name in self.metric_names}
    )
    self._kept = threading.local()
    generate = rl_cluster.generate
    kept = self._kept

    def generate_keeping_logprobs(*args, **kwargs):
      out = generate(*args, **kwargs)
      kept.output = out
      return out

    rl_cluster.generate = generate_keeping_logprobs
    rl_cluster.get_old_per_token_logps = self.old_per_token_logps

  def old_per_token_logps(self, prompt_tokens, completion_tokens, micro_batch_size=None):
    """``o``: per-token log-probs of the completions under the actor's current weights at the
    rollout temperature, in micro-batches of ``micro_batch_size`` rows (no gradient)."""
    model = self.rl_cluster.actor_trainer.model
    graphdef, state = nnx.split(model)
    rows = prompt_tokens.shape[0]
    step = micro_batch_size or rows
    mesh_cm = getattr(self.rl_cluster, "_get_mesh_and_logical_axis_rules_cm", None)
    context = mesh_cm(rl_cluster_lib.Role.ACTOR) if mesh_cm is not None else contextlib.nullcontext()
    with context:
      outs = [
        common.compute_per_token_logps(
          graphdef,
          state,
          prompt_tokens=prompt_tokens[i : i + step],
          completion_tokens=completion_tokens[i : i + step],
          pad_id=self.rl_cluster.rollout.pad_id(),
          eos_id=self.rl_cluster.rollout.eos_id(),
          stop_gradient=True,
          temperature=self.algo_config.temperature,
        )
        for i in range(0, rows, step)
      ]
    return jnp.concatenate(outs, axis=0).astype(jnp.float32)

  def _generate_and_compute_advantage(self, training_input, mode=rl_cluster_lib.Mode.TRAIN):
    self._kept.output = None
    example = super()._generate_and_compute_advantage(training_input, mode)
    output = getattr(self._kept, "output", None)
    if output is None:
      raise RuntimeError(
        "tunix's learner did not call rl_cluster.generate; this tunix is not the "
        f"one mis_jax.integrations.tunix was tested with ({TESTED_TUNIX})"
      )
    q = rollout_logprobs(output, example.completion_ids, engine=self._engine)
    untrainable = untrainable_completions(example.completion_ids, self.rl_cluster.rollout.pad_id())
    self.rl_cluster.buffer_metrics({UNTRAINABLE_METRIC: (int(untrainable.sum()), np.sum)}, mode=mode)
    old = example.old_per_token_logps
    if old is None and self._needs_old:
      size = (self._compute_logps_micro_batch_size or 0) * self.algo_config.num_generations or None
      old = self.old_per_token_logps(example.prompt_ids, example.completion_ids, size)
    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    fields.update(old_per_token_logps=old, rollout_per_token_logps=jnp.asarray(q))
    if untrainable.any():  # out of the loss, never trained as a sequence the engine did not sample
      fields["completion_mask"] = jnp.asarray(example.completion_mask) & jnp.asarray(~untrainable)[:, None]
    return MISTrainExample(**fields)


def _metric_names(cfg: LossConfig, *, with_old: bool) -> list[str]:
  """The names of the metrics :func:`mis_policy_loss_fn` returns for this config that tunix
  must log (read off an abstract evaluation of the loss, so they are always the loss's own)."""
  shape = (2, 3)
  z = jnp.zeros(shape, jnp.float32)

  def run():
    batch = PackedBatch(
      segment_ids=jnp.zeros(shape, jnp.int32),
      loss_mask=jnp.ones(shape, bool),
      advantages=z,
      rollout_logprobs=z,
      old_logprobs=z if with_old else None,
      ref_logprobs=z if cfg.kl_coef > 0 else None,
      num_segments=2,
    )
    return policy_loss(z, batch, cfg, entropy=z)[1]

  # tunix's trainer logs "loss" itself.
  return sorted((set(jax.eval_shape(run)) | {"kl"}) - {"loss"})
