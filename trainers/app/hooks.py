"""The loop's side jobs after each step, composed by the root: each has `after_step(done) -> dict`
(metrics to log; `done` is the step's `StepDone`). The rollout records (`Records`), an agent run's
mismatch by turn (`trainers.agents.episodes.TurnMismatch`), the weight push (`WeightPush`). Also the
watch over steps that trained on nothing (`MaskedSteps`)."""

from __future__ import annotations

import dataclasses

import mis_jax
from trainers.learner.batch import StepBatch
from trainers.learner.plan import StepOutcome
from trainers.runtime import distributed
from trainers.runtime.errors import TrainingError

# contract §8.4: a step whose share of trained tokens with a non-finite rollout log-prob exceeds
# this is a warning (the tokens are masked; the validation rejects such samples from the engine).
NONFINITE_WARN_FRACTION = 0.01


@dataclasses.dataclass(frozen=True)
class StepDone:
  """A finished step as the side jobs see it: its number (`step`, counted from 1), its batch, its
  rollout, its outcome and the learner (holding the updated weights)."""

  step: int
  sb: StepBatch
  rollout: object
  outcome: StepOutcome
  learner: object


class Records:
  """Each step's rollouts as Parquet records (`rollout.records.save_dir`; a `NoRecords` writes none)."""

  def __init__(self, writer):
    self.writer = writer

  def after_step(self, done: StepDone) -> dict:
    self.writer.write(done.step, done.sb, done.rollout, done.outcome.old_logprobs)
    return {}


class WeightPush:
  """The step's weights to the servers (every `rollout.sync.sync_every` steps); its phase times.
  A stop asked while the servers are away (`preempted()`) ends the wait."""

  def __init__(self, servers, preempted):
    self.servers, self.preempted = servers, preempted

  def after_step(self, done: StepDone) -> dict:
    return self.servers.sync(done.learner.params, done.step, preempted=self.preempted)


class MaskedSteps:
  """contract §8.2's `mis_masked_whole_batch`: a step whose correction keeps no token trains on
  nothing (loss 0), as does one whose every token `rollout.sync.max_token_staleness` masked. Each
  one is a warning; `train.max_consecutive_masked_steps` in a row stop the run, naming the setting
  and the ratios seen (the outcome's `masked_ratio_range`). Also warns of non-finite rollout
  log-probs (contract §8.4)."""

  def __init__(self, cfg):
    self.cfg, self.in_a_row = cfg, 0

  def after_step(self, step: int, metrics: dict, ratio_range, log=print) -> None:
    nonfinite = metrics.get("mis_nonfinite_rollout_logprob_fraction", 0.0)
    if nonfinite > NONFINITE_WARN_FRACTION and distributed.is_primary():  # contract §8.4
      log(
        f"warning: step {step}: {nonfinite:.2%} of the trained tokens had a NaN/inf rollout log-prob and "
        f"were masked (mis_nonfinite_rollout_logprob_count "
        f"{metrics.get('mis_nonfinite_rollout_logprob_count', 0):.0f}); look at the engine's log-probs"
      )
    all_stale = metrics.get("rollout/stale_token_fraction", 0.0) >= 1.0  # max_token_staleness left nothing
    if metrics.get("mis_masked_whole_batch", 0.0) < 1.0 and not all_stale:
      self.in_a_row = 0
      return
    self.in_a_row += 1
    what, advice = self._why(step, all_stale, ratio_range)
    limit = self.cfg.train.max_consecutive_masked_steps
    if self.in_a_row >= limit:
      raise TrainingError(
        f"{what}; {limit} steps in a row kept no token (train.max_consecutive_masked_steps): stopping. {advice}"
      )
    if distributed.is_primary():
      log(f"warning: {what} ({self.in_a_row} in a row; the run stops at {limit})")

  def _why(self, step: int, all_stale: bool, ratio_range) -> tuple[str, str]:
    if all_stale:
      return (
        f"step {step}: no response token was generated within rollout.sync.max_token_staleness "
        f"({self.cfg.rollout.sync.max_token_staleness}) versions of the weights trained",
        "Raise rollout.sync.max_token_staleness, or lower rollout.sync.max_staleness / sync_every",
      )
    mis = self.cfg.loss.mis
    defaults = mis_jax.MISConfig().to_dict()
    setting = (
      ", ".join(f"{k} {v}" for k, v in mis.to_dict().items() if v != defaults[k]) if mis is not None else "vanilla TIS"
    )
    lo, hi = ratio_range
    return (
      f"step {step}: the correction kept no token (loss.mis: {setting or 'the defaults'}); the step's "
      f"raw IS ratios pi_train/pi_rollout lay in [{lo:.3g}, {hi:.3g}]",
      "Loosen the bounds or look at the engine's log-probs",
    )
