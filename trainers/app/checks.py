"""The run's checks: everything that can be wrong with the resolved config, the files it names,
the mesh and the task, found before a server starts or anything compiles (a `ConfigError` naming
the key and the value). They only raise (or warn); what a run derives is `trainers.app.spec`'s."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import urllib.parse
import warnings

import jax

import mis_jax
from trainers.agents.rewards import ESTIMATOR_SCALE
from trainers.config import AgentSection, TrainConfig
from trainers.models import ModelConfig
from trainers.rollout import extras as extras_lib, records as rollout_records
from trainers.rollout.settings import RolloutSettings
from trainers.runtime import parallel


def check_sglang_jax(cfg) -> None:
  """`rollout.placement.engine: sglang-jax`: what it cannot do, before anything starts (ConfigError)."""
  r = cfg.rollout
  if r.placement.server_quantize != "none":
    raise mis_jax.ConfigError(
      f"rollout.placement.server_quantize {r.placement.server_quantize!r} is the embedded engine's; sglang-jax "
      "serves the checkpoint's dtype (rollout.placement.server_dtype): set server_quantize none"
    )
  if r.placement.server_dtype not in ("float32", "bfloat16"):
    raise mis_jax.ConfigError(
      f"rollout.placement.server_dtype {r.placement.server_dtype!r}: sglang-jax serves float32 or bfloat16"
    )
  if r.placement.mode == "colocated" and r.placement.colocated_devices == "mesh":
    raise mis_jax.ConfigError(
      "rollout.placement.colocated_devices mesh lays out the embedded engine; sglang-jax's Engine "
      "places itself (its own mesh and tp_size): set colocated_devices first"
    )
  if r.placement.mode == "colocated" and importlib.util.find_spec("sgl_jax") is None:
    raise mis_jax.ConfigError(
      "rollout.placement.mode colocated with rollout.placement.engine sglang-jax runs sglang-jax's Engine in the "
      "trainer's "
      f"process, but this Python ({sys.version.split()[0]}) has no sglang-jax (it needs Python >= 3.12 and pins "
      "its own jax/flax): run the trainer in its venv, e.g. `PYTHONPATH=. $(python -m trainers.serving.sglang_jax "
      "--prepare --trainer) -m trainers.cli train ...` (docs/guides/trainer.md, colocated rollouts)"
    )


def check_exact(cfg) -> None:
  """`rollout.placement.exact`: what exact mode cannot hold (ConfigError), and what it changes nothing for (a
  warning), before anything starts."""
  r, loss = cfg.rollout, cfg.loss
  if jax.default_backend() != "cpu":
    raise mis_jax.ConfigError(
      f"rollout.placement.exact is built and verified on XLA:CPU (its programs' compile options "
      f"and the kernels it was checked against); this run's backend is {jax.default_backend()}"
    )
  if r.placement.engine != "embedded":
    raise mis_jax.ConfigError(
      f"rollout.placement.exact needs rollout.placement.engine embedded (this package's engine "
      f"in batch-invariant arithmetic); {r.placement.engine} decodes with its own kernels, whose "
      "log-probs no trainer pass reproduces bit for bit"
    )
  if r.placement.server_quantize != "none":
    raise mis_jax.ConfigError(
      f"rollout.placement.exact serves unquantised weights: rollout.placement.server_quantize "
      f"{r.placement.server_quantize!r} runs XLA's quantised products; set it to none"
    )
  if not loss.needs_old_logprobs:
    warnings.warn(
      f"rollout.placement.exact with loss.algorithm {loss.algorithm}: the loss takes the rollout's "
      "log-probs as the old policy's and makes no old-log-prob pass, so exact mode only makes the "
      "rollouts batch-invariant (contract §13)"
    )


def check_config(
  cfg: TrainConfig, task, model_cfg: ModelConfig, rollout: RolloutSettings, *, max_new_tokens: int, agent: bool
) -> None:
  """Checks across sections (the loss among them), the files they name, the model and the task
  (`agent`: multi-turn), before anything is built or started: a `ConfigError` naming the key and
  the value. Sequences that would not fit a row are an error."""
  loss_cfg = cfg.loss
  if cfg.train.exclude_rejected_from_baseline and (
    loss_cfg.algorithm != "decoupled_ppo" or loss_cfg.mis is None or loss_cfg.correction_in_loss
  ):
    raise mis_jax.ConfigError(
      "train.exclude_rejected_from_baseline needs decoupled PPO with a MIS config "
      "(use_tis: true, use_rollout_logprobs: false, a mis section, loss.proximal: "
      "recompute): the rejection must be known before the step"
    )
  estimator = cfg.train.advantage_estimator
  if estimator == "optimal_token_baseline" and loss_cfg.proximal == "loglinear":
    raise mis_jax.ConfigError(
      "train.advantage_estimator optimal_token_baseline weighs tokens by the correction's "
      "weights before the step and needs the forward pass that loss.proximal loglinear "
      "skips; use loss.proximal: recompute"
    )
  if loss_cfg.proximal == "loglinear" and cfg.rollout.sync.max_staleness == 0 and cfg.rollout.sync.sync_every == 1:
    warnings.warn(
      "loss.proximal loglinear with rollout.sync.max_staleness 0 and sync_every 1: every token is sampled "
      "by the weights "
      "being trained, so the proximal log-probs are the rollout's and the loss is bypass PPO's "
      "(the correction's weights are 1; contract §6.3)"
    )
  if estimator == "optimal_token_baseline" and cfg.train.exclude_rejected_from_baseline:
    raise mis_jax.ConfigError(
      "train.exclude_rejected_from_baseline works with the per-sequence estimators; the "
      "optimal token baseline weighs every sequence of a group by its path variance"
    )
  if estimator == "gdpo":
    raise mis_jax.ConfigError(
      "train.advantage_estimator gdpo normalises several reward components one by one, "
      "and a trainer task gives one reward per sample (gdpo of one reward is grpo "
      "whitened over tokens); call mis_jax.compute_advantages(..., estimator='gdpo') "
      "with your reward components"
    )
  r = cfg.rollout
  if loss_cfg.score_centering and r.sampling.top_logprobs_num < 1:
    raise mis_jax.ConfigError(
      "loss.score_centering needs the sampler's top-k log-probs: set "
      "rollout.sampling.top_logprobs_num to k >= 1 (e.g. 20; contract §6.6)"
    )
  if loss_cfg.score_centering and rollout.sampling_replay_width:
    raise mis_jax.ConfigError(
      "loss.score_centering with sampling replay: the sampler's top-k log-probs are over "
      "the whole vocabulary while replay makes every trainer log-prob one over the "
      "truncated support; set rollout.sampling.sampling_replay: off, or turn centring off"
    )
  if estimator == "grpo_passk" and r.n < 2:
    raise mis_jax.ConfigError(
      f"train.advantage_estimator grpo_passk compares each group's best two samples: rollout.n must be >= 2, got {r.n}"
    )
  if r.sampling.top_logprobs_num > model_cfg.vocab_size:
    raise mis_jax.ConfigError(
      f"rollout.sampling.top_logprobs_num {r.sampling.top_logprobs_num} exceeds the model's "
      f"vocabulary ({model_cfg.vocab_size} tokens): the engine returns at most that many"
    )
  if cfg.train.router_aux_loss_coef > 0 and not model_cfg.is_moe:
    raise mis_jax.ConfigError("train.router_aux_loss_coef is for mixture-of-experts models; this one is dense")
  if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
    raise mis_jax.ConfigError(
      "logging.wandb is true but wandb is not installed: pip install wandb, or set logging.wandb: false"
    )
  if r.sync.max_staleness > 0 and r.sync.sync_every != 1:
    raise mis_jax.ConfigError(
      f"rollout.sync.max_staleness {r.sync.max_staleness} with rollout.sync.sync_every {r.sync.sync_every}: "
      "the asynchronous loop pushes weights every step and bounds the lag by "
      "max_staleness; set sync_every to 1"
    )
  if r.sync.max_staleness > 0 and loss_cfg.algorithm != "decoupled_ppo":
    warnings.warn(
      f"rollout.sync.max_staleness {r.sync.max_staleness} with {loss_cfg.algorithm}: only decoupled PPO "
      "(old log-probs recomputed, behaviour = the server's) corrects for stale rollouts; "
      "see docs/guides/multihost.md, asynchronous rollouts"
    )
  if r.placement.mode == "colocated":
    if r.records.load_dir:
      raise mis_jax.ConfigError(
        "rollout.placement.mode colocated generates rollouts in the trainer, and rollout.records.load_dir "
        "replays recorded ones: set one of them"
      )
    if jax.process_count() > 1:
      raise mis_jax.ConfigError(
        f"rollout.placement.mode colocated runs one engine in the trainer's process; with "
        f"{jax.process_count()} processes each would need its own share of the prompts, "
        "which is not supported yet: use rollout.placement.mode server (SGLang servers over HTTP)"
      )
  if r.placement.exact:
    check_exact(cfg)
  if r.placement.engine == "sglang-jax":
    check_sglang_jax(cfg)
  if os.path.isfile(cfg.run_dir):
    raise mis_jax.ConfigError(f"run_dir {cfg.run_dir!r} is a file; it must be a directory (or not exist yet)")
  if r.records.load_dir:
    check_records(cfg, model_cfg, rollout)
  max_new = max_new_tokens
  longest = getattr(task, "max_prompt_len", None)
  if longest is not None and longest + max_new - 1 > cfg.train.row_len:
    raise mis_jax.ConfigError(
      f"train.row_len ({cfg.train.row_len}) is shorter than the longest prompt ({longest} tokens) + "
      f"max_new_tokens ({max_new}) - 1: such a sequence could not be packed; raise train.row_len to "
      f">= {longest + max_new - 1} or lower rollout.sampling.max_new_tokens"
    )
  if cfg.agent != AgentSection() and not agent:
    changed = [k for k, v in dataclasses.asdict(cfg.agent).items() if v != getattr(AgentSection(), k)]
    raise mis_jax.ConfigError(
      f"agent.{changed[0]} is set but task {cfg.task.name!r} is single-turn: the agent "
      "section configures multi-turn tasks (lookup_digits, calculator)"
    )
  check_per_turn_rewards(cfg)


def check_per_turn_rewards(cfg: TrainConfig) -> None:
  """`agent.per_turn_rewards` places each turn's return on its tokens against a group baseline:
  defined for the group-baseline estimators, and per token from the start of the step."""
  if not cfg.agent.per_turn_rewards:
    return
  estimator = cfg.train.advantage_estimator
  if estimator not in ESTIMATOR_SCALE:
    raise mis_jax.ConfigError(
      f"agent.per_turn_rewards needs a group-baseline advantage estimator "
      f"({', '.join(ESTIMATOR_SCALE)}): train.advantage_estimator {estimator!r} is not one; "
      "set agent.per_turn_rewards: false or choose one of those"
    )
  if cfg.train.exclude_rejected_from_baseline:
    raise mis_jax.ConfigError(
      "agent.per_turn_rewards and train.exclude_rejected_from_baseline: true cannot be "
      "combined yet (the baseline is recomputed per sequence after the correction, "
      "which would drop the per-turn returns); set one of them"
    )


def check_records(cfg: TrainConfig, model_cfg: ModelConfig, rollout: RolloutSettings) -> None:
  """Every record file a replay will read exists and fits the model and the config (a
  `ConfigError` naming the file and the column otherwise), before anything is trained."""
  r = cfg.rollout
  if r.records.save_dir and os.path.abspath(r.records.save_dir) == os.path.abspath(r.records.load_dir):
    raise mis_jax.ConfigError(
      f"rollout.records.save_dir and rollout.records.load_dir are the same directory {r.records.load_dir!r}"
    )
  try:
    steps = rollout_records.list_steps(r.records.load_dir)
    missing = [k for k in range(1, cfg.train.steps + 1) if k not in steps]
    if missing:
      raise rollout_records.RecordError(
        f"rollout records {r.records.load_dir!r} have no "
        f"{os.path.basename(rollout_records.step_path(r.records.load_dir, missing[0]))} "
        f"(they cover steps {min(steps)}..{max(steps)}); lower train.steps to {missing[0] - 1} or less"
      )
    active = extras_lib.active(rollout, model_cfg)
    for k in range(1, cfg.train.steps + 1):
      cols, _ = rollout_records.read_step(steps[k])
      rollout_records.check_fits(
        steps[k],
        cols,
        vocab_size=model_cfg.vocab_size,
        row_len=cfg.train.row_len,
        max_samples=r.prompts_per_step * r.n,
        max_groups=r.prompts_per_step,
      )
      for extra in active:  # each extra the run uses, from its column
        values = cols.get(extra.name)
        if values is None:
          raise rollout_records.RecordError(f"{steps[k]}: missing column {extra.name!r}, {extra.missing_column}")
        for i, (v, p_ids, r_ids) in enumerate(zip(values, cols["prompt_ids"], cols["response_ids"])):
          problem = extra.check_record(v, len(p_ids), len(r_ids))
          if problem is not None:
            raise rollout_records.RecordError(f"{steps[k]} row {i}: {problem}")
  except rollout_records.RecordError as e:
    raise mis_jax.ConfigError(str(e)) from None


def check_url(url: str) -> None:
  """An SGLang base URL: http(s)://HOST[:PORT][/path]."""
  parsed = urllib.parse.urlparse(url)
  try:
    port = parsed.port
  except ValueError:
    port = -1
  if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
    raise mis_jax.ConfigError(f"--sglang-url {url!r} is not a valid server URL; expected http(s)://HOST:PORT")


def check_mesh(cfg: TrainConfig, mesh: jax.sharding.Mesh, model_cfg: ModelConfig) -> None:
  """The mesh of ``cfg.parallel`` against the model (a `ConfigError` otherwise) and the batch (a
  warning when some devices would get only padding)."""
  parallel.check_model(mesh, model_cfg)
  r = cfg.rollout
  if r.prompts_per_step * r.n < parallel.batch_devices(mesh):
    warnings.warn(
      f"rollout.prompts_per_step x n = {r.prompts_per_step * r.n} sequences for "
      f"{parallel.batch_devices(mesh)} batch devices (data x fsdp): some devices get only padding"
    )
