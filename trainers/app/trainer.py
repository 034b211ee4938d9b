"""The RL loop: rollouts → rewards → advantages → packed batch → jitted step on the mesh →
weight sync → records → Orbax checkpoints.

`Trainer` owns the policy, the optimiser state and the step, and runs the loop over a few
collaborators chosen once from the resolved config:

- the rollout backend, composed apart from the learner by `trainers.rollout.backend.build_rollout`:
  a rollout source (`trainers.rollout.sources`: the servers synchronously, the servers
  asynchronously with bounded staleness, or saved records) and the servers' side
  (`trainers.rollout.servers.Servers`: health, the initial push, the weight push after each step,
  the mismatch sanity check, the wait for a server that went away) — over HTTP or with the engine
  in this process; none when the rollouts are replayed from records;
- the run's per-token extras (`trainers.rollout.extras.active`: sampling supports, routed
  experts, ...), which the client asks for, the records keep, the batch packs and the model
  inputs carry — the loop passes them along without naming any;
- a record writer (`rollout_records.RecordWriter`, or `NoRecords`), the checkpoints
  (`checkpointing`), the metric sinks (`metric_logging`) and the preemption flag (`preemption`).

One step: the rollout batch; GRPO advantages per prompt group (contract §6.1); prompt+response
packed into micro-batched rows (`trainers.learner.batch`); then the step's plan
(`trainers.learner.plan`, decided once from the config: which passes it makes — old log-probs
only when the algorithm needs them — and which advantage stages follow the correction);
``ppo_epochs`` calls of the jitted step (`trainers.learner.step`: gradients accumulated over the
micro-batches with global denominators, contract §7, and the Optax update in one program). A step
returns a `plan.StepOutcome`. The config checks live in `trainers.app.checks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import mis_jax
from trainers.tasks.env import is_agent_task
from trainers.agents import rewards as agent_rewards
from trainers.agents.episodes import Episodes, turn_mismatch
from trainers.models import PRESETS, DTYPES, ModelConfig, init_checkpoint, load_hf_params
from trainers.models.attention import resolve_attention_backend
from trainers.models.decoder import resolve_layer_loop
from trainers.app import checkpointing, checks
from trainers.runtime import distributed, parallel
from trainers.rollout import extras as extras_lib
from trainers.learner import memory_plan, plan as plan_lib
from trainers.rollout.backend import build_rollout
from trainers.learner.batch import StepBatch, build_step_batch, fresh_tokens, token_staleness
from trainers.config import ModelSection, TrainConfig
from trainers.runtime.errors import NoServerUp, Preempted, TrainingError
from trainers.app.metric_logging import MetricLogger
from trainers.runtime.preemption import Preemption
from trainers.rollout.records import NoRecords, RecordWriter
from trainers.rollout.servers import NO_RESTARTS, Sampling
from trainers.rollout.sources import Rollout
from trainers.learner.plan import StageInput, StepOutcome, StepPlan
from trainers.learner.step import ROUTING, ModelInputs, StepFunctions, build_step_functions

__all__ = ["Trainer", "TrainingError", "initial_weights_dir", "print_summary", "routing_metrics"]


def initial_weights_dir(cfg: TrainConfig) -> str:
  """The HF directory of the starting weights: ``model.path``, or a preset initialised once
  into ``run_dir/weights/init`` (reused on resume)."""
  if cfg.model.path:
    return cfg.model.path
  path = os.path.join(os.path.abspath(cfg.run_dir), "weights", "init")
  if distributed.is_primary() and not os.path.isfile(os.path.join(path, "model.safetensors")):
    config = PRESETS[cfg.model.preset]
    if cfg.model.initializer_range is not None:
      config = dataclasses.replace(config, initializer_range=cfg.model.initializer_range)
    init_checkpoint(path, config=config, seed=cfg.model.init_seed)
  distributed.barrier(f"initial weights {path}")  # one writer; every process reads them
  return path


def routing_metrics(native: np.ndarray, recorded: np.ndarray) -> dict[str, float]:
  """Routing mismatch between the trainer's native top-k and the rollout's, over the positions
  with a record (`recorded[..., 0, 0] >= 0`); both `[..., num_layers, k]`. Experts are compared
  as sets: `routing_mismatch_frac` over (token, layer) choices, `routing_mismatch_token_frac`
  over tokens (any layer differs), and `routing_mismatch_layer/{l}` per layer."""
  has = recorded[..., 0, 0] >= 0
  a, b = np.sort(native[has], axis=-1), np.sort(recorded[has], axis=-1)  # [n, L, k]
  differ = np.any(a != b, axis=-1)  # [n, L]
  out = {"routing_mismatch_frac": float(differ.mean()) if differ.size else 0.0,
         "routing_mismatch_token_frac": float(differ.any(axis=-1).mean()) if differ.size else 0.0,
         "routing_positions": float(has.sum())}
  for layer in range(native.shape[-2]):
    out[f"routing_mismatch_layer/{layer}"] = float(differ[:, layer].mean()) if differ.size else 0.0
  return out



# contract §8.4: a step whose share of trained tokens with a non-finite rollout log-prob exceeds
# this is a warning (the tokens are masked; the validation rejects such samples from the engine).
NONFINITE_WARN_FRACTION = 0.01

class Trainer:
  """The RL loop over its collaborators; owns the policy, the optimiser state and the step.

  ``loss_cfg``, when given, replaces ``cfg.loss``. ``task``: the task
  :func:`checks.check_config` returned for ``cfg`` (else checked here). ``urls``: the SGLang
  servers (unused when the rollouts are replayed from records).
  """

  def __init__(self, cfg: TrainConfig, loss_cfg: mis_jax.LossConfig | None = None, *, urls: list[str],
               devices=None, task=None):
    cfg = self.cfg = cfg if loss_cfg is None else cfg.replace(loss=loss_cfg)
    self.task = task if task is not None else checks.check_config(cfg)
    if task is not None:  # a task given directly skips check_config; this check of it still runs
      checks.check_per_turn_rewards(cfg)
    self.mesh = checks.check_parallel(cfg, devices)
    self.run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    r = cfg.rollout
    self.temperature = r.sampling.temperature if r.sampling.temperature > 0 else 1.0  # greedy: SGLang reports T=1

    start_dir = initial_weights_dir(cfg)  # collective: every process, here
    model_cfg = self.model_config = ModelConfig.from_pretrained(start_dir)
    self.agent = is_agent_task(self.task)  # its prompts start multi-turn trajectories (`trainers.agents`)
    # The per-token extras the run asks for, records, packs, feeds (an agent run's `turn` among them).
    self.extras = extras_lib.active(r, model_cfg) + (Episodes.declared_extras(cfg.agent.per_turn_rewards)
                                                     if self.agent else ())
    self.routing_replay, self.routing_spec = checks.routing_setup(r, model_cfg)  # the plan's passes
    self.max_new_tokens = checks.max_new_tokens(r, self.task)
    self.plan: StepPlan = plan_lib.plan_step(cfg, self.routing_replay, self.routing_spec is not None)
    # `model.remat` / `model.attention` `auto`: the cheapest whose compiled step fits the device.
    self.model_choice = _model_choice(model_cfg, cfg.model, self.mesh, memory_plan.probe_shape(cfg.train, self.extras))
    # `model.layer_loop` `auto`: by depth (the model resolves it the same way); for the start-up line.
    self.layer_loop = resolve_layer_loop(cfg.model.layer_loop, model_cfg.num_hidden_layers)  # (loop, why)
    model_section = dataclasses.replace(cfg.model, remat=self.model_choice.remat,
                                        attention=self.model_choice.attention)
    self.fns = _step_functions(model_cfg, model_section, cfg.loss, self.temperature, cfg.train, self.mesh)
    # Each device reads its own shards of the HF tensors: no full copy anywhere.
    self.params = load_hf_params(start_dir, self.fns.abstract_params, self.fns.param_shardings, config=model_cfg)
    self.ref_params = jax.tree_util.tree_map(jnp.copy, self.params) if cfg.loss.kl_coef > 0 else None
    self.opt_state = self.fns.init_opt_state(self.params)
    self.step = 0
    self.batch_index = 0  # the rollout batch the next step takes (= step, unless stale batches were skipped)
    # Steps whose old log-probs the trainer computed (a separate pass, or the update's own forward
    # when fused); bypass and REINFORCE-IS never recompute (tested).
    self.num_old_logprob_passes = 0
    self.masked_in_a_row = 0  # steps in a row whose correction kept no token
    self.num_segments = r.prompts_per_step * r.n
    self.advantage_stages = plan_lib.compose_stages(
        self.plan, estimator=cfg.train.advantage_estimator, num_groups=r.prompts_per_step,
        num_segments=self.num_segments, place=self._on_mesh, prepare=self.fns.prepare)
    self.checkpoints = checkpointing.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                  max_to_keep=cfg.checkpoint.max_to_keep)
    self.preemption, self.preempted = Preemption(), False

    # The collaborators, chosen once.
    sampling = Sampling(self.sampling_params(), r.n, cfg.seed, self.extras)
    # The servers' side: None when the rollouts are replayed from records (no server at all).
    self.servers, self.source = build_rollout(cfg, urls=urls, start_dir=start_dir, model_config=model_cfg,
                                              sampling=sampling, mesh=self.mesh, prompts=self.prompts,
                                              episodes=self.episodes() if self.agent else None)
    self.records = (RecordWriter(r.records.save_dir, meta={"sampling_params": sampling.params, "temperature": self.temperature,
                                                   "config": cfg.to_dict(), "loss": cfg.loss.to_dict()},
                                 extras=self.extras)
                    if r.records.save_dir else NoRecords())

  # --- the loop --------------------------------------------------------------------------
  def run(self, *, resume: bool = False, progress: bool = True, log=print) -> list[dict]:
    """Trains from the last checkpoint (with `resume`) to `train.steps`, or until SIGTERM / SIGINT
    (then `self.preempted`, and the last finished step is checkpointed). The steps' metrics."""
    history = []
    with self.preemption, contextlib.ExitStack() as open_parts:
      log_metrics = self.start(resume=resume, progress=progress, log=log, open_parts=open_parts)
      while self.step < self.cfg.train.steps and not self.preemption.requested():
        t0 = time.perf_counter()
        rollout = self.next_rollout()
        if rollout is None:
          break  # a stop was asked while the servers were away: the step is abandoned
        t1 = time.perf_counter()
        sb = self.build_batch(rollout.prompts, rollout.result)
        outcome = self.train_on(sb)
        metrics = outcome.metrics
        if self.servers is not None:
          self.servers.check_mismatch(self.step, metrics, rollout.result)
        t2 = time.perf_counter()
        self.step += 1
        self.records.write(self.step, sb, rollout, outcome.old_logprobs)
        if self.agent and outcome.old_logprobs is not None:  # the mismatch by turn index
          metrics.update(turn_mismatch(sb, distributed.to_host(outcome.old_logprobs), self.cfg.agent.max_turns))
        if self.servers is not None:
          metrics.update(self.servers.sync(self.params, self.step, preempted=self.preemption.asked))
        metrics.update(self.step_metrics(sb, rollout, t0, t1, t2, time.perf_counter()))
        history.append(metrics)
        log_metrics(self.step, metrics)  # before the checkpoint: a step checkpointed is a step logged
        self.watch_masked(metrics, outcome.masked_ratio_range, log)
        if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.train.steps:
          self.save_checkpoint()
      self.preempted = self.step < self.cfg.train.steps
      if self.preempted and self.step > 0 and self.checkpoints.latest_step() != self.step:
        self.save_checkpoint()
    return history

  def start(self, *, resume: bool, progress: bool, log, open_parts: contextlib.ExitStack):
    """Before step 1: the checkpoint to resume from, the servers, the source, the records; every
    part is closed when the run ends, however it ends. Returns the step-metrics sink."""
    if resume and self.restore_latest():
      if distributed.is_primary():
        log(f"resumed from checkpoint at step {self.step} ({self.checkpoints.directory})")
    elif self.checkpoints.latest_step() is not None:
      raise TrainingError(f"{self.run_dir} already holds checkpoints (latest step "
                          f"{self.checkpoints.latest_step()}): pass --resume, or choose another run_dir")
    if self.servers is not None:
      open_parts.callback(self.servers.close)
    open_parts.callback(self.checkpoints.close)  # waits for an in-flight async save: the last checkpoint is whole
    open_parts.callback(self.source.close)
    if distributed.is_primary():
      self.describe(log)
    if self.servers is not None:
      self.servers.prepare(self.params, self.step, log=log)
    elif distributed.is_primary():
      log(f"replaying rollout records from {self.cfg.rollout.records.load_dir} (no server)")
    self.source.start(self.batch_index)
    self.records.start(self.step)
    if not distributed.is_primary():
      return lambda step, metrics: None
    # Rows past the restored step (a run stopped after logging them) are dropped: each step once.
    logger = MetricLogger(self.run_dir, self.cfg.logging, total_steps=self.cfg.train.steps, initial_step=self.step,
                          progress=progress)
    open_parts.callback(logger.close)
    return logger.log

  def next_rollout(self) -> Rollout | None:
    """This step's rollout. When no server can serve it, the servers are waited for
    (`rollout.transport.server_restart_timeout_s`), get the served weights back, and the step's batch is
    taken again from its start. None when a stop is asked meanwhile."""
    if self.servers is None:  # records
      return self.source.next(self.step)
    self.servers.readmit()
    while True:
      try:
        return self.source.next(self.step)
      except NoServerUp as e:
        try:
          self.servers.wait_for_restart(e, preempted=self.preemption.asked)
        except Preempted:
          return None
        self.source.restart()

  def step_metrics(self, sb: StepBatch, rollout: Rollout, t0, t1, t2, t3) -> dict:
    """What a step logs besides the loss's metrics: rewards, sample counts, phase times."""
    result = rollout.result
    trained = int(np.asarray(sb.batch.loss_mask).sum())
    return {"step": self.step, "reward_mean": float(sb.rewards.mean()), "reward_std": float(sb.rewards.std()),
            "response_length": float(sb.response_lengths.mean()), "num_samples": len(result.samples),
            "num_aborted": result.num_aborted, "num_rejected": result.num_rejected,
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
            "tokens_per_s": trained / max(t3 - t0, 1e-9),
            "server_weight_version": result.samples[0].weight_version, **rollout.metrics, **sb.metrics,
            **(self.servers.step_done() if self.servers is not None else NO_RESTARTS)}

  def describe(self, log) -> None:
    """The options that change what the loop does, said once before step 1."""
    log(self.model_line())
    log(self.plan.describe())
    if self.routing_replay == "r2" and not self.plan.compare_routing:
      log("routing replay R2: the old-log-prob pass's routing is replayed in every training forward")
    for extra in self.extras:
      said = extra.describe()
      if said:
        log(said)

  def model_line(self) -> str:
    """The start-up line of the model's options: dtypes, remat and attention, the layer loop, and
    why those."""
    m, choice = self.cfg.model, self.model_choice
    attention, fallback = resolve_attention_backend(choice.attention)
    loop, why = self.layer_loop
    return (f"model: {m.dtype} compute, {m.param_dtype} weights, remat {choice.remat}, attention {attention}"
            f"{f' ({fallback})' if fallback else ''} ({choice.reason()}), layers {loop} ({why})")

  # --- one step ------------------------------------------------------------------------
  def sampling_params(self) -> dict:
    r = self.cfg.rollout
    return {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p, "top_k": r.sampling.top_k, "min_p": r.sampling.min_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.task.stop_token_ids), "no_stop_trim": True, "skip_special_tokens": False}

  def episodes(self):
    """An agent task's multi-turn driver (its budgets: `agent.*`, a trajectory within a row) and
    its environments."""
    a, row = self.cfg.agent, self.cfg.train.row_len
    room = row + 1 - self.task.max_prompt_len  # a sequence of row_len + 1 tokens fills a row
    driver = Episodes(max_turns=a.max_turns, max_total_tokens=min(a.max_total_tokens or room, room),
                      max_context=row + 1, env_concurrency=a.env_concurrency, max_turn_retries=a.max_turn_retries,
                      rows_per_request=self.cfg.rollout.transport.prompts_per_request * self.cfg.rollout.n)
    return driver, self.task.environment

  def prompts(self, batch: int) -> list:
    """The prompts of rollout batch `batch` (a function of (seed, batch) only)."""
    return self.task.prompts(self.cfg.seed, batch, self.cfg.rollout.prompts_per_step)

  def build_batch(self, prompts, result) -> StepBatch:
    samples = result.samples
    if result.rewards is not None:  # replayed records carry their rewards
      rewards = np.asarray(result.rewards, np.float32)
    elif samples and all(s.reward is not None for s in samples):  # trajectories: their environment's rewards
      rewards = np.array([s.reward for s in samples], np.float32)
    else:
      rewards = np.array([self.task.reward(prompts[s.prompt_index], s.response_ids, s.text) for s in samples],
                         np.float32)
    groups = np.array([s.prompt_index for s in samples], np.int32)
    t = self.cfg.train
    lengths = np.array([len(s.response_ids) for s in samples], np.int32)
    trained, metrics = None, {}
    r = self.cfg.rollout
    staleness = (token_staleness(samples, self.step)  # the weights being trained are version `self.step`
                 if r.sync.max_token_staleness is not None or self.cfg.loss.proximal == "loglinear" else None)
    if r.sync.max_token_staleness is not None:
      trained, metrics = fresh_tokens(staleness, r.sync.max_token_staleness)
    trained = extras_lib.trainable(self.extras, samples, trained)  # e.g. a trajectory's model tokens only
    sb = build_step_batch(samples, rewards, self.advantages(rewards, groups, lengths), groups,
                          num_segments=self.num_segments, row_len=t.row_len,
                          tokens_per_micro_batch=t.tokens_per_micro_batch,
                          batch_devices=parallel.batch_devices(self.mesh), extras=self.extras,
                          trained_tokens=trained,
                          staleness=staleness if self.cfg.loss.proximal == "loglinear" else None)
    if self.cfg.agent.per_turn_rewards:  # each turn's return on its tokens (trainers/agents/rewards.py)
      sb.batch = sb.batch.replace(advantages=sb.tokens(
          agent_rewards.token_advantages(samples, rewards, sb.advantages, groups,
                                         estimator=t.advantage_estimator), 0.0, np.float32))
    sb.metrics.update(metrics)
    return sb

  def advantages(self, rewards, groups, lengths, in_baseline=None) -> np.ndarray:
    """Per-sequence advantages of `train.advantage_estimator` (`plan.sequence_advantages`)."""
    return plan_lib.sequence_advantages(rewards, groups, lengths, in_baseline,
                                        estimator=self.cfg.train.advantage_estimator,
                                        num_groups=self.cfg.rollout.prompts_per_step)

  def _on_mesh(self, x):
    """A host array (the same on every process) on the mesh: each process places only the
    rows of its own devices."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, parallel.batch_sharding(self.mesh, x.ndim), lambda idx: x[idx])

  def device_batch(self, sb: StepBatch) -> tuple[ModelInputs, mis_jax.PackedBatch]:
    """The step batch placed on the mesh (rows over `data × fsdp × expert`)."""
    inputs = ModelInputs(*(self._on_mesh(x) for x in (sb.input_ids, sb.positions, sb.targets)),
                         **extras_lib.model_inputs(self.extras, sb.extras, self._on_mesh))
    return inputs, jax.tree.map(self._on_mesh, sb.batch)

  def train_on(self, sb: StepBatch) -> StepOutcome:
    """One step of `self.plan` on `sb`: the policy's passes, the reference pass, the correction
    (prepared once: it depends only on o and q), the advantage stages, `ppo_epochs` updates; or,
    where the plan fuses them and the step has one micro-batch, the reference pass and one update
    whose own forward gives the old log-probs."""
    plan = self.plan
    fused = plan.fuses(sb.layout.micro_batches)
    inputs, batch = self.device_batch(sb)
    heads = {}
    for forward in plan.policy_passes if not fused else ():
      heads[forward] = self.fns.forward(forward)(self.params, inputs, batch.segment_ids)
      if forward == ROUTING and plan.replay_native_routing:  # R2: the native routing from here on
        inputs = inputs._replace(routing=heads[forward].routing)
    recorded = sb.extras.get(extras_lib.RoutedExperts.name)  # the routed experts the server recorded
    routing = routing_metrics(distributed.to_host(heads[ROUTING].routing), recorded) if plan.compare_routing else {}
    if plan.old_logprobs is not None:
      self.num_old_logprob_passes += 1
      if not fused:
        batch = batch.replace(old_logprobs=heads[plan.old_logprobs].logprobs)
    if plan.reference:  # the reference model routes natively
      batch = batch.replace(ref_logprobs=self.fns.logprobs(self.ref_params, inputs._replace(routing=None),
                                                           batch.segment_ids).logprobs)
    key = jax.random.fold_in(jax.random.key(self.cfg.seed), self.step)  # clip_cov's draw of this step
    if fused:
      self.params, self.opt_state, step_metrics, old = self.fns.train_fused(self.params, self.opt_state, inputs,
                                                                            batch, key)
      batch, stage_metrics = batch.replace(old_logprobs=old), {}
      metrics = {name: float(v) for name, v in jax.device_get(step_metrics).items()}  # one transfer
    else:
      metrics, stage_metrics = self.prepare_and_update(sb, inputs, batch, heads, key)
    metrics["micro_batches"] = sb.layout.micro_batches
    metrics["sampling_replay"] = float(inputs.support is not None)  # log-probs, entropy and KL over the support
    metrics.update(routing)
    metrics.update(stage_metrics)
    if not all(np.isfinite(v) for v in metrics.values()):
      bad = [k for k, v in metrics.items() if not np.isfinite(v)]
      raise TrainingError(f"step {self.step}: non-finite metrics {bad}; stopping before using these weights")
    ratio_range = None
    if metrics.get("mis_masked_whole_batch") == 1.0:  # what the ratios were, for the warning (rare: one pass)
      train_lp = batch.old_logprobs if batch.old_logprobs is not None else self.fns.logprobs(
          self.params, inputs, batch.segment_ids).logprobs
      ratio_range = _ratio_range(train_lp, batch)
    return StepOutcome(metrics, old_logprobs=batch.old_logprobs, masked_ratio_range=ratio_range)

  def prepare_and_update(self, sb: StepBatch, inputs, batch, heads: dict, key) -> tuple[dict, dict]:
    """The correction once (`prepare_step`), the advantage stages, then `ppo_epochs` updates of
    the separate path; the first epoch's metrics (with the correction's) and the stages'."""
    correction, step_metrics = self.fns.prepare(batch, key)
    prepared, correction, stage_metrics = plan_lib.run_stages(
        self.advantage_stages, StageInput(sb, heads.get(self.plan.token_baseline), key), batch, correction)
    metrics: dict = {}
    for _ in range(self.cfg.train.ppo_epochs):
      self.params, self.opt_state, epoch_metrics = self.fns.train(self.params, self.opt_state, inputs, prepared,
                                                                  correction)
      if not metrics:  # metrics of the first epoch: before any update of this step
        metrics = {name: float(v) for name, v in jax.device_get({**epoch_metrics, **step_metrics}).items()}  # one transfer
    return metrics, stage_metrics

  def watch_masked(self, metrics: dict, ratio_range, log):
    """contract §8.2's `mis_masked_whole_batch`: a step whose correction keeps no token trains on
    nothing (loss 0), as does one whose every token `rollout.sync.max_token_staleness` masked. Each one
    is a warning; `train.max_consecutive_masked_steps` in a row stop the run, naming the setting
    and the ratios seen (`ratio_range`: the step outcome's `masked_ratio_range`)."""
    nonfinite = metrics.get("mis_nonfinite_rollout_logprob_fraction", 0.0)
    if nonfinite > NONFINITE_WARN_FRACTION and distributed.is_primary():  # contract §8.4
      log(f"warning: step {self.step}: {nonfinite:.2%} of the trained tokens had a NaN/inf rollout log-prob and "
          f"were masked (mis_nonfinite_rollout_logprob_count {metrics.get('mis_nonfinite_rollout_logprob_count', 0):.0f}); "
          "look at the engine's log-probs")
    all_stale = metrics.get("rollout/stale_token_fraction", 0.0) >= 1.0  # rollout.sync.max_token_staleness left nothing
    if metrics.get("mis_masked_whole_batch", 0.0) < 1.0 and not all_stale:
      self.masked_in_a_row = 0
      return
    self.masked_in_a_row += 1
    mis = self.cfg.loss.mis
    defaults = mis_jax.MISConfig().to_dict()
    setting = (", ".join(f"{k} {v}" for k, v in mis.to_dict().items() if v != defaults[k]) if mis is not None
               else "vanilla TIS")
    if all_stale:
      what = (f"step {self.step}: no response token was generated within rollout.sync.max_token_staleness "
              f"({self.cfg.rollout.sync.max_token_staleness}) versions of the weights trained")
      advice = "Raise rollout.sync.max_token_staleness, or lower rollout.sync.max_staleness / sync_every"
    else:
      lo, hi = ratio_range
      what = (f"step {self.step}: the correction kept no token (loss.mis: {setting or 'the defaults'}); the step's "
              f"raw IS ratios pi_train/pi_rollout lay in [{lo:.3g}, {hi:.3g}]")
      advice = "Loosen the bounds or look at the engine's log-probs"
    limit = self.cfg.train.max_consecutive_masked_steps
    if self.masked_in_a_row >= limit:
      raise TrainingError(f"{what}; {limit} steps in a row kept no token (train.max_consecutive_masked_steps): "
                          f"stopping. {advice}")
    if distributed.is_primary():
      log(f"warning: {what} ({self.masked_in_a_row} in a row; the run stops at {limit})")

  # --- checkpoints ---------------------------------------------------------------------
  def save_checkpoint(self):
    self.checkpoints.save(self.step, {"params": self.params, "opt_state": self.opt_state},
                          {"step": self.step, "seed": self.cfg.seed, "num_old_logprob_passes": self.num_old_logprob_passes,
                           "batch_index": self.source.next_batch})

  def restore_latest(self) -> bool:
    restored = self.checkpoints.restore_latest({"params": self.params, "opt_state": self.opt_state})
    if restored is None:
      return False
    state, meta = restored
    self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(meta["step"])
    self.batch_index = int(meta.get("batch_index", self.step))
    return True


def _ratio_range(train_lp, batch: mis_jax.PackedBatch) -> tuple[float, float] | None:
  """(min, max) raw IS ratio `exp(log π_train - log π_rollout)` over the loss-mask tokens (None
  when there is none: all stale)."""
  log_ratio = distributed.to_host(train_lp - batch.rollout_logprobs)[distributed.to_host(batch.loss_mask)]
  return (None if log_ratio.size == 0 else
          tuple(float(np.exp(np.clip(x, -20, 20))) for x in (log_ratio.min(), log_ratio.max())))


@functools.lru_cache(maxsize=8)
def _model_choice(model_cfg: ModelConfig, model: ModelSection, mesh,
                  shape: memory_plan.ProbeShape) -> memory_plan.ModelChoice:
  """`memory_plan.choose` over the candidates' compiled steps, each with the probe's loss and
  optimiser (`memory_plan.PROBE_LOSS`): once per model, shape and mesh in a process, and one
  program for the persistent compilation cache whatever the run's loss."""
  def predict(remat: str, attention: str) -> int:
    fns = build_step_functions(model_cfg, mesh, memory_plan.PROBE_LOSS, memory_plan.PROBE_TRAIN,
                               **_model_options(dataclasses.replace(model, remat=remat, attention=attention),
                                                model_cfg))
    return memory_plan.step_bytes(fns, mesh, shape, within=budget.bytes)

  auto = memory_plan.AUTO in (model.remat, model.attention)
  budget = memory_plan.memory_budget(list(mesh.devices.flat), model.memory_budget_gb) if auto else None
  return memory_plan.choose(model.remat, model.attention, predict, budget)


@functools.lru_cache(maxsize=8)
def _step_functions(model_cfg: ModelConfig, model: ModelSection, loss_cfg: mis_jax.LossConfig,
                    temperature: float, train_cfg, mesh) -> StepFunctions:
  """The jitted step functions, shared by trainers with the same setup (so a resumed or
  repeated run in one process does not compile again)."""
  return build_step_functions(model_cfg, mesh, loss_cfg, train_cfg, temperature=temperature,
                              **_model_options(model, model_cfg))


def _model_options(model: ModelSection, model_cfg: ModelConfig) -> dict:
  """`build_step_functions`' options of the model section (remat and attention resolved; the layer
  loop as configured: the model resolves `auto`)."""
  return dict(logprob_chunk=model.logprob_chunk, dtype=DTYPES[model.dtype], param_dtype=DTYPES[model.param_dtype],
              attention=model.attention, remat=model.remat,
              layer_loop=model.layer_loop,
              **({"moe_dispatch": model.moe_dispatch} if model_cfg.is_moe else {}))


SUMMARY_KEYS = ["reward_mean", "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "entropy_loss",
                "mis_kl", "mis_k3_kl", "train_rollout_logprob_abs_diff", "mis_is_ratio_mean_final",
                "mis_kept_token_fraction", "tokens_per_s", "rollout_s", "train_s", "sync_s"]


def print_summary(history: list[dict], cfg: TrainConfig) -> None:
  if not history:
    print("nothing to do: the run had already reached train.steps")
    return
  rewards = [h["reward_mean"] for h in history]
  k = min(10, len(rewards))
  print(f"\nreward: first {k} steps mean {np.mean(rewards[:k]):.3f} -> last {k} steps mean {np.mean(rewards[-k:]):.3f}")
  last = history[-1]
  print(f"\nmetrics at step {last['step']}:")
  for key in SUMMARY_KEYS:
    if key in last:
      print(f"  {key:34s} {last[key]:.4g}")
  print(f"\nrun directory: {os.path.abspath(cfg.run_dir)} (metrics.jsonl, checkpoints/, weights/)")
