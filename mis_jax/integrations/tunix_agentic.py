"""mis_jax's rollout correction inside tunix's agentic GRPO (``pip install 'mis_jax[tunix]'``).

tunix 0.1.7's ``AgenticGRPOLearner`` (``tunix.rl.agentic.agentic_grpo_learner.GRPOLearner``)
trains multi-turn trajectories: the model's turns (the sampler's token ids, loss mask 1) and the
environment's (tokenized with the chat parser, loss mask 0) concatenated after the prompt. Its
only correction is ``sampler_is="token"`` (token TIS). Two lines change::

    from mis_jax.integrations import tunix_agentic as mis_agentic

    config = mis_agentic.MISAgenticGRPOConfig(num_generations=4, beta=0.0, max_response_length=512,
                                              mis="configs/mis.yaml")   # was agentic GRPOConfig
    learner = mis_agentic.MISAgenticGRPOLearner(rl_cluster, config, reward_fns, chat_parser=parser,
                                                env_class=MyEnv)       # was AgenticGRPOLearner
    learner.train(dataset)

The loss is :func:`mis_jax.integrations.tunix.mis_policy_loss_fn` (:func:`mis_jax.policy_loss`
over tunix's padded batch, each row one segment), so every IS/RS level, policy-loss form and
metric of :class:`MISGRPOLearner` applies; here the segment of a row is its **model tokens
only**: tunix's conversation mask (0 on the environment's tokens) is the loss mask, so the
environment's tokens are in no ratio, no sequence-level product, no metric and no denominator
(their rollout log-probs, which tunix sets to 0, can be anything). The rollout log-probs ``q``
are the sampler's own, per model token, as tunix's trajectory engine collected them turn by
turn; the old log-probs ``o`` are recomputed at the sampling temperature (see
:class:`MISAgenticGRPOLearner`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

import numpy as np

from mis_jax import ConfigError, microbatch_reduction
from mis_jax.integrations import tunix as mis_tunix

try:
  import flax
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tunix.rl import common
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.agentic import agentic_grpo_learner
  from tunix.rl.agentic import agentic_rl_learner
  from tunix.rl.agentic.agents import model_agent
  from tunix.rl.agentic.environments import task_environment
except ImportError as e:  # pragma: no cover - the message is the point
  raise ImportError(
    f"mis_jax.integrations.tunix_agentic needs google-tunix 0.1.7's agentic learner ({e}); "
    "install it with pip install 'mis_jax[tunix]'"
  ) from e

__all__ = ["MISAgenticGRPOConfig", "MISAgenticGRPOLearner", "MISAgenticTrainExample", "UNTRAINABLE_METRIC"]

UNTRAINABLE_METRIC = mis_tunix.UNTRAINABLE_METRIC


@dataclasses.dataclass(kw_only=True)
class MISAgenticGRPOConfig(agentic_grpo_learner.GRPOConfig):
  """tunix's agentic ``GRPOConfig`` plus mis_jax's loss settings, as :class:`MISGRPOConfig`.

  Attributes (in addition to tunix's): ``use_rollout_logprobs``, ``use_tis``, ``mis``,
  ``get_mismatch_metrics``, ``tis_clip``, ``tis_clip_low``, ``denominator``, ``epsilon_c``,
  ``entropy_coef``: as in :class:`mis_jax.integrations.tunix.MISGRPOConfig`. tunix's
  ``sampler_is`` must stay None (the correction is mis_jax's: ``use_tis`` / ``mis``), and
  ``use_rollout_logps`` True (the sampler's log-probs are what is corrected against). The
  resolved :class:`mis_jax.LossConfig` is :attr:`loss_config`.
  """

  policy_loss_fn: str = mis_tunix.LOSS_NAME
  use_rollout_logprobs: bool = False
  use_tis: bool | None = None
  mis: Any = None
  get_mismatch_metrics: bool = True
  tis_clip: float = 2.0
  tis_clip_low: float = 0.0
  denominator: str = "kept"
  epsilon_c: float | None = None
  entropy_coef: float = 0.0
  loss_config: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    name = type(self).__name__
    if self.policy_loss_fn != mis_tunix.LOSS_NAME:
      raise ConfigError(
        f"{name}.policy_loss_fn must be {mis_tunix.LOSS_NAME!r} (mis_jax's loss), got "
        f"{self.policy_loss_fn!r}; use tunix's agentic GRPOConfig for tunix's own losses"
      )
    if self.sampler_is is not None:
      raise ConfigError(
        f"{name}.sampler_is={self.sampler_is!r} is tunix's token TIS, which mis_jax's loss "
        "replaces: set use_tis=True (vanilla token TIS, tis_clip) or a mis config instead"
      )
    if not self.use_rollout_logps:
      raise ConfigError(
        f"{name}.use_rollout_logps=False drops the sampler's log-probs, which mis_jax's "
        "correction needs; leave it True (use_rollout_logprobs picks the PPO anchor)"
      )
    self.loss_config = mis_tunix._loss_config(  # pylint: disable=protected-access
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


@flax.struct.dataclass(frozen=True)
class MISAgenticTrainExample(agentic_rl_learner.TrainExample):
  """tunix's agentic ``TrainExample`` plus the sampler's per-token log-probs ``q``
  (``[B, max_response_length]`` float32; 0 on the environment's tokens and past the end)."""

  rollout_per_token_logps: jax.Array | None = None


class MISAgenticGRPOLearner(agentic_grpo_learner.GRPOLearner):
  """tunix's ``AgenticGRPOLearner`` with mis_jax's loss, rollout log-probs and correction.

  A drop-in: tunix's constructor arguments (``rl_cluster, algo_config, reward_fns, chat_parser,
  metric_fns, agent_class, agent_kwargs, env_class, env_kwargs``) and ``train``; ``algo_config``
  must be a :class:`MISAgenticGRPOConfig`. At construction it checks the actor's
  ``rope_theta``, refuses tunix's sequence packing, sets ``return_logprobs=True`` on the rollout
  config(s) and installs the loss and its metrics. Then, per group of trajectories:

  * ``q``: the sampler's log-probs of the model's tokens, exactly as tunix aligned them with
    the conversation (tunix's ``old_logprobs``); a turn whose engine returned no log-probs (or
    not one per token) stops the run with
    :class:`~mis_jax.integrations.tunix.MissingRolloutLogprobs` from ``train`` (tunix would
    silently put 0s there). Its group is refused where the rollout is produced, before it is
    queued, so neither it nor any later group reaches an update; and when the producer stops
    (for this or any reason) the micro-batch it leaves incomplete is dropped, not trained
    (tunix would train the groups already queued as a short micro-batch: a partial step).
    Updates made from earlier whole micro-batches stand, whatever order the groups finished in;
  * ``o`` (decoupled / standard PPO, or ``num_iterations`` > 1): the actor's log-probs at the
    sampling temperature, from the weights the engine sampled with: tunix's anchor (the
    weights of the last sync) when the engine has its own copy, the actor's current weights
    when it shares them (tunix 0.1.7 never refreshes the anchor then, so its own diagnostic
    ``sampler_trainer/*`` metrics compare against the initial weights; this learner's answer
    replaces it, for those metrics too);
  * a conversation with a sampled pad id before other tokens is out of the loss and counted
    (:data:`UNTRAINABLE_METRIC`), as in :class:`MISGRPOLearner`: tunix rebuilds positions
    and attention from ``tokens != pad_id``.

  With tunix's ``"vanilla"`` engine and no ``RolloutConfig.seed``, every engine call gets its
  own seed, a function of the trajectory (group id, index in the group) and the turn: tunix
  0.1.7's sampler otherwise uses ``PRNGKey(0)`` for every call, and the agentic learner makes
  one call per trajectory turn, so all trajectories of a group sample the same tokens and every
  GRPO advantage is 0.
  """

  def __init__(
    self,
    rl_cluster,
    algo_config,
    reward_fns=None,
    chat_parser=None,
    metric_fns=None,
    agent_class=model_agent.ModelAgent,
    agent_kwargs=None,
    env_class=task_environment.TaskEnvironment,
    env_kwargs=None,
  ):
    if not isinstance(algo_config, MISAgenticGRPOConfig):
      raise TypeError(
        "MISAgenticGRPOLearner needs a mis_jax.integrations.tunix_agentic.MISAgenticGRPOConfig, "
        f"got {type(algo_config).__name__}"
      )
    mis_tunix.prepare_cluster(rl_cluster, "MISAgenticGRPOLearner", "conversations")
    super().__init__(
      rl_cluster=rl_cluster,
      algo_config=algo_config,
      reward_fns=reward_fns,
      chat_parser=chat_parser,
      metric_fns=metric_fns,
      agent_class=agent_class,
      agent_kwargs=agent_kwargs,
      env_class=env_class,
      env_kwargs=env_kwargs,
    )
    cfg = algo_config.loss_config
    self._engine = mis_tunix._engine_name(rl_cluster)  # pylint: disable=protected-access
    self._needs_old = cfg.needs_old_logprobs or algo_config.num_iterations > 1
    self.metric_names = mis_tunix._metric_names(cfg, with_old=self._needs_old)  # pylint: disable=protected-access
    reductions = {"max": np.max, "min": np.min}
    how = lambda name: "mask" if name == "kl" else microbatch_reduction(name, cfg)  # "kl": tunix's own mean
    self.rl_cluster.actor_trainer.with_rl_metrics_to_log(
      {name: reductions.get(how(name), np.mean) for name in self.metric_names}
    )
    self._kept = threading.local()
    self._bad_turns: list[str] = []
    self._bad_lock = threading.Lock()
    self._producer_error: BaseException | None = None  # set before the producer ends the stream
    self._anchor_logps = rl_cluster.get_actor_per_token_logps
    rl_cluster.get_actor_per_token_logps = self.old_per_token_logps
    if self._engine == "vanilla":
      self._seed_every_call(rl_cluster)

  async def _producer(self, orchestrator, prompt_queue, train_data_queue):
    # tunix's producer ends the stream (puts None) in a `finally`, also when it fails; the
    # consumer would then train the groups already queued as a short micro-batch. Hold the end
    # back until the failure is recorded, so the consumer can tell a failed stream from a
    # finished one.
    stream = _HeldEnd(train_data_queue)
    self._producer_error = None
    try:
      await super()._producer(orchestrator, prompt_queue, stream)
    except BaseException as e:
      self._producer_error = e
      raise
    finally:
      stream.end()

  def _data_consumer_batch_generator(self, queue, batch_size):
    for batch in super()._data_consumer_batch_generator(queue, batch_size):
      if len(batch) < batch_size and self._producer_error is not None:
        return  # a micro-batch cut short by the producer's failure: never a partial step
      yield batch

  def _seed_every_call(self, rl_cluster):
    generate, counter, lock = rl_cluster.rollout.generate, itertools.count(1 << 30), threading.Lock()
    kept = self._kept

    def generate_with_own_seed(prompts, rollout_config, *args, **kwargs):
      if getattr(rollout_config, "seed", None) is None:
        seed = getattr(kept, "seed", None)  # set by _model_call in this thread
        kept.seed = None
        if seed is None:
          with lock:
            seed = next(counter)
        rollout_config = dataclasses.replace(rollout_config, seed=seed)
      return generate(prompts, rollout_config, *args, **kwargs)

    rl_cluster.rollout.generate = generate_with_own_seed

  def old_per_token_logps(
    self, prompt_tokens, completion_tokens, pad_id, eos_id, micro_batch_size=None, temperature=None
  ):
    """``o``: the conversations' per-token log-probs at the sampling temperature, no gradient,
    from the weights the engine sampled with (see the class docstring). Replaces the cluster's
    ``get_actor_per_token_logps``; the answer is kept for this thread's group."""
    if temperature is None:
      temperature = self.rl_cluster.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN).temperature
    if self.should_sync_weights:  # the engine holds the anchor's weights
      out = self._anchor_logps(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        pad_id=pad_id,
        eos_id=eos_id,
        micro_batch_size=micro_batch_size,
        temperature=temperature,
      )
    else:  # shared weights: the engine samples from the actor's current ones
      graphdef, state = nnx.split(self.rl_cluster.actor_trainer.model)
      rows = prompt_tokens.shape[0]
      step = micro_batch_size or rows
      mesh_cm = self.rl_cluster._get_mesh_and_logical_axis_rules_cm  # pylint: disable=protected-access
      with mesh_cm(rl_cluster_lib.Role.ACTOR):
        out = jnp.concatenate(
          [
            common.compute_per_token_logps(
              graphdef,
              state,
              prompt_tokens=prompt_tokens[i : i + step],
              completion_tokens=completion_tokens[i : i + step],
              pad_id=pad_id,
              eos_id=eos_id,
              stop_gradient=True,
              temperature=temperature,
            )
            for i in range(0, rows, step)
          ],
          axis=0,
        )
    out = jnp.asarray(out).astype(jnp.float32)
    self._kept.old = (np.asarray(completion_tokens), out)
    return out

  def _model_call(self, chat_lists, env=None, max_generation_steps=None):
    # The vanilla engine's seed for this turn: a function of the trajectory (group, index in the
    # group) and the turn, so runs are reproducible whatever order the turns run in.
    extra = getattr(env, "extra_kwargs", None) or {}
    if "group_id" in extra and "pair_index" in extra:
      self._kept.seed = ((int(extra["group_id"]) * 1009 + int(extra["pair_index"])) * 257 + len(chat_lists)) % (1 << 30)
    out = super()._model_call(chat_lists, env=env, max_generation_steps=max_generation_steps)
    # tunix's trajectory engine puts 0s where a turn has no log-probs, and an exception here would
    # stall its rollout: mark the turn's tokens NaN and fail in _process_results instead.
    tokens = out.tokens or []
    problem = None
    if out.logprobs is None:
      problem = "returned no log-probs (RolloutOutput.logprobs is None)"
    elif len(out.logprobs) != len(tokens) or any(
      np.asarray(lp).reshape(-1).shape[0] != np.asarray(t).reshape(-1).shape[0] for lp, t in zip(out.logprobs, tokens)
    ):
      problem = "returned log-probs that are not one per generated token"
    elif any(not np.all(np.isfinite(np.asarray(lp, np.float32))) for lp in out.logprobs):
      problem = "returned a non-finite log-prob"
    if problem is not None:
      with self._bad_lock:
        self._bad_turns.append(problem)
      out.logprobs = [np.full(np.asarray(t).reshape(-1).shape[0], np.nan, np.float32) for t in tokens]
    return out

  def _process_results(self, trajectories, mode=rl_cluster_lib.Mode.TRAIN, expected_step=None):
    self._kept.old = None
    examples = super()._process_results(trajectories, mode=mode, expected_step=expected_step)
    if len(examples) != 1:
      raise RuntimeError(
        f"tunix's agentic GRPO returned {len(examples)} train examples for a group; "
        f"mis_jax.integrations.tunix_agentic was tested with tunix {mis_tunix.TESTED_TUNIX} (1)"
      )
    example = examples[0]
    mask = np.asarray(example.completion_mask).astype(bool)
    q = example.old_per_token_logps  # tunix's padded rollout log-probs (use_rollout_logps, no sampler_is)
    if q is None:
      raise mis_tunix.MissingRolloutLogprobs(
        f"the {self._engine!r} rollout engine returned no log-probs for any turn of this group although "
        "RolloutConfig.return_logprobs was set; mis_jax needs the sampler's own log-probs and never "
        "substitutes recomputed ones"
      )
    q = np.asarray(q, np.float32)
    if not np.all(np.isfinite(q[mask])):
      with self._bad_lock:
        problem = self._bad_turns[0] if self._bad_turns else "returned a non-finite log-prob"
      raise mis_tunix.MissingRolloutLogprobs(
        f"the {self._engine!r} rollout engine {problem} for a model turn of this group, although "
        "RolloutConfig.return_logprobs was set; mis_jax needs the sampler's own log-probs of every model "
        "token and never substitutes recomputed ones (tunix's trajectory engine would train on 0s)"
      )
    q = np.where(mask, q, 0.0).astype(np.float32)
    pad_id = self.rl_cluster.rollout.pad_id()
    untrainable = mis_tunix.untrainable_completions(example.completion_ids, pad_id)
    self.rl_cluster.buffer_metrics_async(
      {UNTRAINABLE_METRIC: (int(untrainable.sum()), np.sum)}, mode=mode, step=expected_step
    )
    old = None
    if self._needs_old:
      kept = getattr(self._kept, "old", None)
      if kept is not None and np.array_equal(kept[0], np.asarray(example.completion_ids)):
        old = kept[1]  # tunix's own diagnostic pass asked for them: reuse
      else:
        old = self.old_per_token_logps(
          example.prompt_ids,
          example.completion_ids,
          pad_id,
          self.rl_cluster.rollout.eos_id(),
          self.rl_cluster.cluster_config.training_config.compute_logps_micro_batch_size,
        )
    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    fields.update(old_per_token_logps=old, rollout_per_token_logps=jnp.asarray(q))
    if untrainable.any():  # out of the loss, never trained as a sequence the engine did not sample
      fields["completion_mask"] = jnp.asarray(example.completion_mask) * jnp.asarray(~untrainable)[:, None].astype(
        jnp.asarray(example.completion_mask).dtype
      )
    return [MISAgenticTrainExample(**fields)]


class _HeldEnd:
  """A proxy of tunix's train-data queue that forwards every item but the end-of-stream None,
  which it puts only when :meth:`end` is called."""

  def __init__(self, queue):
    self._queue = queue

  def put(self, item, *args, **kwargs):
    if item is not None:
      self._queue.put(item, *args, **kwargs)

  def end(self):
    self._queue.put(None)

  def __getattr__(self, name):
    return getattr(self._queue, name)
