"""The RL loop: rollouts → rewards → advantages → packed batch → the learner's step on the mesh →
side jobs (records, the weight push, an agent run's metrics) → metrics → Orbax checkpoints.

`Trainer` is the composition root's run: the config resolved once (`trainers.app.spec.resolve` → a
`RunSpec`: every derived value, every check), its parts built from it (`trainers.app.build`: the
starting weights, the learner, the step batcher, an agent run's parts), the rollout backend
(`trainers.rollout.backend.build_rollout`: the source of each step's rollouts and the servers' side)
and the side jobs (`trainers.app.hooks`) — then the loop over them (`run`), which names none of
their options.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from trainers.app import build, hooks
from trainers.app.checkpointing import Checkpointer
from trainers.app.metric_logging import MetricLogger
from trainers.app.spec import RunSpec, resolve
from trainers.learner.batch import StepBatch
from trainers.learner.plan import StepOutcome
from trainers.rollout.backend import build_rollout
from trainers.rollout.records import NoRecords, RecordWriter
from trainers.rollout.servers import Sampling
from trainers.rollout.sources import Rollout
from trainers.runtime import distributed, faults
from trainers.runtime.errors import NoServerUp, Preempted, TrainingError
from trainers.runtime.preemption import Preemption

__all__ = ["Trainer", "TrainingError", "print_summary"]


class Trainer:
  """A run: `cfg` resolved (with `loss_cfg` replacing `cfg.loss` when given; `task` replacing the
  config's, `devices` the mesh's), or a `spec` resolved before; `urls`: the SGLang servers (none for
  records, colocated rollouts or a router). `run` trains."""

  def __init__(self, cfg=None, loss_cfg=None, *, urls: list[str], devices=None, task=None, spec: RunSpec | None = None):
    faults.check()  # the crash tests' hook, when set, is well formed
    if spec is None:
      spec = resolve(cfg if loss_cfg is None else cfg.replace(loss=loss_cfg), devices=devices, task=task)
    cfg = self.cfg = spec.cfg
    self.spec, self.task, self.mesh, self.plan, self.extras = spec, spec.task, spec.mesh, spec.plan, spec.extras
    self.run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    start_dir = build.initial_weights_dir(cfg)  # collective: every process, here
    self.learner, self.model_choice = build.build_learner(spec, start_dir)
    agent = build.agent_parts(spec)
    self.batcher = build.build_batcher(spec, agent.batch_stages)
    self.step = 0
    self.batch_index = 0  # the rollout batch the next step takes (= step, unless stale batches were skipped)
    self.checkpoints = Checkpointer(os.path.join(self.run_dir, "checkpoints"), max_to_keep=cfg.checkpoint.max_to_keep)
    self.preemption, self.preempted = Preemption(), False
    r = cfg.rollout
    sampling = Sampling(spec.sampling_params, r.n, cfg.seed, spec.extras)
    self.servers, self.source = build_rollout(
      cfg,
      urls=urls,
      start_dir=start_dir,
      model_config=spec.model_config,
      sampling=sampling,
      mesh=self.mesh,
      prompts=self.prompts,
      episodes=agent.episodes,
    )
    self.records = (
      RecordWriter(
        r.records.save_dir,
        extras=spec.extras,
        meta={
          "sampling_params": sampling.params,
          "temperature": spec.temperature,
          "config": cfg.to_dict(),
          "loss": cfg.loss.to_dict(),
        },
      )
      if r.records.save_dir
      else NoRecords()
    )
    self.hooks = (hooks.Records(self.records), *agent.hooks, hooks.WeightPush(self.servers, self.preemption.asked))
    self.masked = hooks.MaskedSteps(cfg)

  # --- the learner's state, as the checkpoints and the servers see it ---------------------------
  @property
  def params(self):
    return self.learner.params

  @property
  def opt_state(self):
    return self.learner.opt_state

  @property
  def fns(self):
    return self.learner.fns

  @property
  def num_old_logprob_passes(self) -> int:
    return self.learner.num_old_logprob_passes

  # --- the loop --------------------------------------------------------------------------
  def run(self, *, resume: bool = False, progress: bool = True, log=print) -> list[dict]:
    """Trains from the last checkpoint (with `resume`) to `train.steps`, or until SIGTERM / SIGINT
    (then `self.preempted`, and the last finished step is checkpointed). The steps' metrics."""
    history = []
    with self.preemption, contextlib.ExitStack() as open_parts:
      try:
        log_metrics = self.start(resume=resume, progress=progress, log=log, open_parts=open_parts)
      except Preempted:  # a stop asked while the first push waited for the servers: nothing more to do
        log_metrics = None
      while log_metrics is not None and self.step < self.cfg.train.steps and not self.preemption.requested():
        t0 = time.perf_counter()
        rollout = self.next_rollout()
        if rollout is None:
          break  # a stop was asked while the servers were away: the step is abandoned
        t1 = time.perf_counter()
        sb = self.build_batch(rollout.prompts, rollout.result)
        outcome = self.train_on(sb)
        metrics = outcome.metrics
        self.servers.check_mismatch(self.step, metrics, rollout.result)  # before anything is saved or pushed
        t2 = time.perf_counter()
        self.step += 1
        done = hooks.StepDone(self.step, sb, rollout, outcome, self.learner)
        for hook in self.hooks:
          metrics.update(hook.after_step(done))
        metrics.update(self.step_metrics(sb, rollout, t0, t1, t2, time.perf_counter()))
        history.append(metrics)
        log_metrics(self.step, metrics)  # before the checkpoint: a step checkpointed is a step logged
        faults.reached("metrics", self.step)
        self.masked.after_step(self.step, metrics, outcome.masked_ratio_range, log)
        if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.train.steps:
          self.save_checkpoint()
      self.preempted = self.step < self.cfg.train.steps
      if self.preempted and self.step > 0 and self.checkpoints.latest_step() != self.step:
        self.save_checkpoint()
    return history

  def start(self, *, resume: bool, progress: bool, log, open_parts: contextlib.ExitStack):
    """Before step 1: the checkpoint to resume from, the servers, the source, the records; every
    part is closed when the run ends, however it ends. Returns the step-metrics sink. `Preempted`:
    a stop was asked while the first weight push waited for the servers."""
    if resume and self.restore_latest():
      if distributed.is_primary():
        log(f"resumed from checkpoint at step {self.step} ({self.checkpoints.directory})")
    elif self.checkpoints.latest_step() is not None:
      raise TrainingError(
        f"{self.run_dir} already holds checkpoints (latest step "
        f"{self.checkpoints.latest_step()}): pass --resume, or choose another run_dir"
      )
    open_parts.callback(self.servers.close)
    open_parts.callback(self.checkpoints.close)  # waits for an in-flight async save: the last checkpoint is whole
    open_parts.callback(self.source.close)
    if distributed.is_primary():
      for line in [build.model_line(self.cfg.model, self.model_choice, self.spec.layer_loop), *self.spec.describe()]:
        log(line)
    self.servers.prepare(self.params, self.step, log=log, preempted=self.preemption.asked)
    self.source.start(self.batch_index)
    self.records.start(self.step)
    if not distributed.is_primary():
      return lambda step, metrics: None
    # Rows past the restored step (a run stopped after logging them) are dropped: each step once.
    logger = MetricLogger(
      self.run_dir, self.cfg.logging, total_steps=self.cfg.train.steps, initial_step=self.step, progress=progress
    )
    open_parts.callback(logger.close)
    return logger.log

  def next_rollout(self) -> Rollout | None:
    """This step's rollout. When no server can serve it, the servers are waited for
    (`rollout.transport.server_restart_timeout_s`), get the served weights back, and the step's batch is
    taken again from its start. None when a stop is asked meanwhile."""
    self.servers.readmit(self.step + 1)
    while True:
      try:
        return self.source.next(self.step)
      except NoServerUp as e:
        try:
          self.servers.wait_for_restart(e, preempted=self.preemption.asked)
        except Preempted:
          return None
        self.source.restart()

  def prompts(self, batch: int) -> list:
    """The prompts of rollout batch `batch` (a function of (seed, batch) only)."""
    return self.task.prompts(self.cfg.seed, batch, self.cfg.rollout.prompts_per_step)

  def build_batch(self, prompts, result) -> StepBatch:
    """The step's packed batch of `result` (`trainers.learner.batch.StepBatcher`)."""
    return self.batcher(prompts, result, self.step)

  def train_on(self, sb: StepBatch) -> StepOutcome:
    """The learner's step on `sb`."""
    return self.learner.step(sb, self.step)

  def step_metrics(self, sb: StepBatch, rollout: Rollout, t0, t1, t2, t3) -> dict:
    """What a step logs besides the loss's metrics: rewards, sample counts, phase times."""
    result = rollout.result
    trained = int(np.asarray(sb.batch.loss_mask).sum())
    return {
      "step": self.step,
      "reward_mean": float(sb.rewards.mean()),
      "reward_std": float(sb.rewards.std()),
      "response_length": float(sb.response_lengths.mean()),
      "num_samples": len(result.samples),
      "num_aborted": result.num_aborted,
      "num_rejected": result.num_rejected,
      "rollout_s": t1 - t0,
      "train_s": t2 - t1,
      "sync_s": t3 - t2,
      "step_s": t3 - t0,
      "tokens_per_s": trained / max(t3 - t0, 1e-9),
      "server_weight_version": result.samples[0].weight_version,
      **rollout.metrics,
      **sb.metrics,
      **self.servers.step_done(),
    }

  # --- checkpoints ---------------------------------------------------------------------
  def save_checkpoint(self):
    self.checkpoints.save(
      self.step,
      {"params": self.params, "opt_state": self.opt_state},
      {
        "step": self.step,
        "seed": self.cfg.seed,
        "num_old_logprob_passes": self.num_old_logprob_passes,
        "batch_index": self.source.next_batch,
      },
    )

  def restore_latest(self) -> bool:
    restored = self.checkpoints.restore_latest({"params": self.params, "opt_state": self.opt_state})
    if restored is None:
      return False
    state, meta = restored
    self.learner.params, self.learner.opt_state, self.step = state["params"], state["opt_state"], int(meta["step"])
    # The run's count, not this process's: the steps before the checkpoint computed theirs.
    self.learner.num_old_logprob_passes = int(meta.get("num_old_logprob_passes", 0))
    self.batch_index = int(meta.get("batch_index", self.step))
    return True


SUMMARY_KEYS = [
  "reward_mean",
  "loss",
  "pg_loss",
  "pg_clipfrac",
  "ppo_kl",
  "grad_norm",
  "entropy_loss",
  "mis_kl",
  "mis_k3_kl",
  "train_rollout_logprob_abs_diff",
  "mis_is_ratio_mean_final",
  "mis_kept_token_fraction",
  "tokens_per_s",
  "rollout_s",
  "train_s",
  "sync_s",
]


def print_summary(history: list[dict], cfg) -> None:
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
