"""A step as a plan: which passes a step makes, what each yields, and the advantage stages after
the correction — decided once from the resolved config (`plan_step`), never re-decided by flags
inside the loop.

A step (`Trainer.train_on`) runs its plan: the policy's passes before the update (`policy_passes`,
each a `step.Forward`: the old log-probs, `Σπ²` for the optimal token baseline, the native routed
experts), the reference pass, `mis_jax.prepare_step` once, then the advantage stages in order
(`advantage_stages`: exclude rejected sequences from their group's baseline → the optimal token
baseline → re-select the covariance forms' tokens from the final advantages), then the epochs.
Where that is exact (`old_logprobs_source`: one epoch, the plain pass the only policy pass, no
advantage stage) and the step has one micro-batch, the old log-probs are the update's own
forward's instead (`fused_old_logprobs`: `StepFunctions.train_fused`, with `prepare_step` inside;
no separate pass), as verl does on policy. In exact mode (`rollout.placement.exact`) the old log-probs
come from the exact pass (`EXACT`: the engine's arithmetic on its copy of the weights), never from
the update's forward. It returns a `StepOutcome`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import numpy as np

import mis_jax
from trainers.runtime import distributed
from trainers.learner.batch import StepBatch
from trainers.learner.step import EXACT, EXACT_ROUTING, LOGPROBS, ROUTING, SUM_SQ, Forward, Heads

__all__ = [
  "StepPlan",
  "StepOutcome",
  "StageInput",
  "Stage",
  "plan_step",
  "old_logprobs_source",
  "compose_stages",
  "run_stages",
  "sequence_advantages",
  "exclude_rejected",
  "token_baseline",
  "reselect_covariance",
]


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The passes of one step and what each yields.

  `policy_passes`: the forwards of the step's policy before its update, in order (each names
  its heads). `old_logprobs`: the one of them whose log-probs are the loss's old log-probs, None
  when the algorithm needs none (bypass, REINFORCE-IS, `proximal: loglinear`: no pass at all).
  `compare_routing`: the rollout carries routed experts, compared with the trainer's native ones
  (`routing_mismatch_*` metrics). `fused_old_logprobs`: the old log-probs are the update's
  own forward's when a step has one micro-batch (`train.old_logprobs`; `old_logprobs_reason`
  says why or why not). `replay_native_routing` (R2): the routing pass's native experts
  are replayed in the passes after it and in every training forward. `reference`: the KL
  reference pass (reference parameters, native routing). `advantage_stages`: the names of the
  post-processing stages after `prepare_step`, in order."""

  policy_passes: tuple[Forward, ...] = ()
  old_logprobs: Forward | None = None
  compare_routing: bool = False
  replay_native_routing: bool = False
  reference: bool = False
  advantage_stages: tuple[str, ...] = ()
  fused_old_logprobs: bool = False
  old_logprobs_reason: str = "the algorithm uses none"

  def fuses(self, micro_batches: int) -> bool:
    """Whether a step of `micro_batches` takes its old log-probs from the update's own forward
    (`StepFunctions.train_fused`): planned, and the step has one micro-batch."""
    return self.fused_old_logprobs and micro_batches == 1

  def describe(self) -> str:
    """The start-up line of where the old log-probs come from, and why."""
    if self.old_logprobs is None:
      return f"old log-probs: none ({self.old_logprobs_reason})"
    if self.fused_old_logprobs:
      return (
        "old log-probs: the update's own forward when a step has one micro-batch, else a separate pass "
        f"({self.old_logprobs_reason})"
      )
    return f"old log-probs: a separate {self.old_logprobs.name} pass ({self.old_logprobs_reason})"

  @property
  def routing_pass(self) -> Forward | None:
    """The pass giving the native routed experts (`ROUTING`, or exact mode's `EXACT_ROUTING`; None: none)."""
    return next((forward for forward in self.policy_passes if forward.routing), None)

  @property
  def token_baseline(self) -> Forward | None:
    """The pass giving the optimal token baseline its `π` and `Σπ²` (None: no token baseline)."""
    return SUM_SQ if SUM_SQ in self.policy_passes else None


def plan_step(cfg, routing_replay: str, records_routing: bool) -> StepPlan:
  """The plan of every step of `cfg` (a resolved `TrainConfig`), with the routing facts of
  `checks.routing_setup` (`routing_replay`, and `records_routing`: the server records routed
  experts). A `ConfigError` where `train.old_logprobs` asks for what is not exact."""
  loss, t = cfg.loss, cfg.train
  otb = t.advantage_estimator == "optimal_token_baseline"
  routing = routing_replay == "r2" or records_routing
  exact = cfg.rollout.placement.exact and loss.needs_old_logprobs
  passes = []
  if exact:  # the old log-probs (and the native routing) as the engine computes them
    passes.append(EXACT_ROUTING if routing else EXACT)
  elif routing:  # one pass: the old log-probs (r3: under the rollout's routing) and the native routing
    passes.append(ROUTING)
  elif loss.needs_old_logprobs and not otb:
    passes.append(LOGPROBS)
  if otb:  # π and Σπ²; the old log-probs too where no other pass gives them
    passes.append(SUM_SQ)
  stages = ("exclude_rejected",) * t.exclude_rejected_from_baseline + ("token_baseline",) * otb
  if stages and loss.uses_cov_selection:  # selected from the final advantages
    stages += ("reselect_covariance",)
  old = passes[0] if loss.needs_old_logprobs else None
  fused, reason = old_logprobs_source(t, old, tuple(passes), stages)
  return StepPlan(
    policy_passes=tuple(passes),
    old_logprobs=old,
    compare_routing=records_routing,
    replay_native_routing=routing_replay == "r2",
    reference=loss.kl_coef > 0,
    advantage_stages=stages,
    fused_old_logprobs=fused,
    old_logprobs_reason=reason,
  )


def old_logprobs_source(
  train, old: Forward | None, passes: tuple[Forward, ...], stages: tuple[str, ...]
) -> tuple[bool, str]:
  """`train.old_logprobs` resolved: whether the old log-probs come from the update's own forward
  (stop-gradient) when a step has one micro-batch, and why. That is exact only when the parameters
  being updated are the old policy for the whole step (one epoch) and nothing between the pass and
  the update reads the old log-probs or another head of that pass (the plain pass the only policy
  pass, no advantage stage); `from_update` where it is not is a `ConfigError` naming the key."""
  choice = train.old_logprobs
  if old is None:
    if choice == "from_update":
      raise mis_jax.ConfigError(
        "train.old_logprobs: from_update needs an algorithm with old log-probs (standard or "
        "decoupled PPO, proximal: recompute); this one uses none"
      )
    return False, "the algorithm uses none"
  if old is not None and old.exact:
    if choice == "from_update":
      raise mis_jax.ConfigError(
        "train.old_logprobs: from_update with rollout.placement.exact: exact mode's old log-probs "
        "are the engine's arithmetic on its copy of the weights (the exact pass), not the "
        "update's float32 forward; set train.old_logprobs: auto or separate"
      )
    return False, "rollout.placement.exact: the engine's arithmetic on its copy of the weights"
  if choice == "separate":
    return False, "train.old_logprobs: separate"
  why_not = []
  if train.ppo_epochs != 1:
    why_not.append(f"train.ppo_epochs {train.ppo_epochs}: the epochs after the first update moved the parameters")
  if passes != (LOGPROBS,):
    why_not.append(
      f"the {old.name} pass yields more than the old log-probs (R2/R3 routing, the optimal token baseline's Σπ²)"
    )
  if stages:
    why_not.append(f"the advantage stages ({', '.join(stages)}) read the correction before the update")
  if why_not and choice == "from_update":
    raise mis_jax.ConfigError(
      "train.old_logprobs: from_update is exact only with one epoch, the plain log-prob pass and "
      "no advantage stage: " + "; ".join(why_not)
    )
  if why_not:
    return False, "train.old_logprobs auto: " + "; ".join(why_not)
  return True, (
    f"train.old_logprobs {choice}: one epoch, the plain pass the only one, no advantage stage: the "
    "parameters being updated are the old policy"
  )


class StepOutcome(NamedTuple):
  """What a step leaves for the loop: its `metrics` (floats, first epoch), the `old_logprobs` it
  trained with (device `[micro_batches, rows, row_len]`, None without; the records' column), and
  `masked_ratio_range`, the (min, max) raw IS ratio when the correction kept no token (None
  otherwise, or when no token was left to train on)."""

  metrics: dict
  old_logprobs: jax.Array | None = None
  masked_ratio_range: tuple[float, float] | None = None


# --- advantage stages -----------------------------------------------------------------------
class StageInput(NamedTuple):
  """What an advantage stage reads of its step: the step batch, the token-baseline pass's heads
  (`π`, `Σπ²`; None without), and the step's random key (clip_cov's draw)."""

  sb: StepBatch
  policy: Heads | None = None
  key: jax.Array | None = None


class Stage(NamedTuple):
  """A named advantage stage: `apply(step, batch, correction) -> (batch, correction, metrics)` (the
  batch's inputs and the step's `mis_jax.Correction`, from `mis_jax.prepare_step`)."""

  name: str
  apply: Callable


_group_advantages = jax.jit(mis_jax.compute_advantages, static_argnames=("num_groups", "estimator", "norm_by_std"))
_token_baseline = jax.jit(mis_jax.optimal_token_baseline, static_argnames=("num_groups", "num_segments"))


def sequence_advantages(rewards, groups, lengths, in_baseline=None, *, estimator: str, num_groups: int) -> np.ndarray:
  """Per-sequence advantages of `estimator` over the prompt groups (contract §6.1); the optimal
  token baseline's are per token, computed after the old-log-prob pass (`token_baseline`):
  here the returns `R`. Compiled once per batch size (eager, their few segment sums dispatch op
  by op: several milliseconds a step at small shapes)."""
  if estimator == "optimal_token_baseline":
    return np.asarray(rewards, np.float32)
  return np.asarray(
    _group_advantages(
      rewards, groups, num_groups=num_groups, estimator=estimator, in_baseline=in_baseline, lengths=lengths
    )
  )


def exclude_rejected(
  step: StageInput, batch: mis_jax.PackedBatch, correction: mis_jax.Correction, *, advantages, place
):
  """contract §6.1 option: sequences the correction rejects whole leave their group's baseline.

  ``correction`` comes from :func:`mis_jax.prepare_step` (its ``kept_mask`` is the step's).
  The rejected sequences' own advantage no longer matters (they carry no kept token); the
  others' baseline stops leaking the rejected rewards (verl PR #6452). `advantages`: the
  per-sequence estimator (`sequence_advantages` with its options); `place`: a host array onto
  the mesh."""
  sb = step.sb
  in_baseline = np.array([k.any() for k in sb.per_sequence(distributed.to_host(correction.kept_mask))])
  adv = advantages(sb.rewards, sb.groups, sb.response_lengths, in_baseline)
  token_adv = sb.tokens([np.full(n, a, np.float32) for n, a in zip(sb.packing.lengths, adv)], 0.0, np.float32)
  return (
    batch.replace(advantages=place(token_adv)),
    correction,
    {"num_excluded_from_baseline": int((~in_baseline).sum())},
  )


def token_baseline(
  step: StageInput, batch: mis_jax.PackedBatch, correction: mis_jax.Correction, *, num_groups: int, num_segments: int
):
  """The optimal token baseline's per-token advantages (`Σπ²` and `π` from this step's policy;
  the correction's weights, squared, under decoupled PPO), for the whole step."""
  sb = step.sb
  pad = num_segments - len(sb.rewards)
  adv = _token_baseline(
    np.pad(sb.rewards, (0, pad)),
    np.pad(sb.groups, (0, pad)),
    batch.segment_ids,
    batch.loss_mask,
    step.policy.logprobs,
    step.policy.sum_sq,
    is_weights=correction.is_weights,
    num_groups=num_groups,
    num_segments=num_segments,
  )
  return batch.replace(advantages=adv), correction, {}


def reselect_covariance(step: StageInput, batch: mis_jax.PackedBatch, correction: mis_jax.Correction, *, prepare):
  """The covariance forms (clip_cov, kl_cov) select their tokens from the advantages: again,
  from the final ones (`prepare`: the jitted `mis_jax.prepare_step`, with the step's key). The
  step keeps its denominators (its metrics too: they are the first preparation's)."""
  again, _ = prepare(batch, step.key)
  return batch, again.replace(denominators=correction.denominators), {}


def compose_stages(
  plan: StepPlan, *, estimator: str, num_groups: int, num_segments: int, place, prepare
) -> tuple[Stage, ...]:
  """The plan's advantage stages, each bound once to the options it needs."""
  table = {
    "exclude_rejected": functools.partial(
      exclude_rejected,
      place=place,
      advantages=functools.partial(sequence_advantages, estimator=estimator, num_groups=num_groups),
    ),
    "token_baseline": functools.partial(token_baseline, num_groups=num_groups, num_segments=num_segments),
    "reselect_covariance": functools.partial(reselect_covariance, prepare=prepare),
  }
  return tuple(Stage(name, table[name]) for name in plan.advantage_stages)


def run_stages(stages: tuple[Stage, ...], step: StageInput, batch: mis_jax.PackedBatch, correction: mis_jax.Correction):
  """`batch` and `correction` through each stage in order; the stages' metrics, merged."""
  metrics = {}
  for stage in stages:
    batch, correction, m = stage.apply(step, batch, correction)
    metrics.update(m)
  return batch, correction, metrics
