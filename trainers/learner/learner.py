"""The learner: the policy, its optimiser state, and the step of the plan on the mesh.

A step (`Learner.step`) runs the parts its plan (`trainers.learner.plan.StepPlan`) was composed into
once, at construction — the policy's passes, the routing comparison, the old log-probs, the
reference pass, then the update: the correction prepared once, the advantage stages and the epochs
(`separate`), or, for a step of one micro-batch where the plan fuses them, one update whose own
forward gives the old log-probs (`fused`). Each part reads and extends the step's `StepState`; the
step returns a `StepOutcome`, never results parked on the learner.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

import mis_jax
from trainers.learner import plan as plan_lib
from trainers.learner.batch import StepBatch
from trainers.learner.plan import StageInput, StepOutcome, StepPlan
from trainers.learner.step import Forward, Heads, ModelInputs, StepFunctions
from trainers.rollout import extras as extras_lib
from trainers.runtime import distributed, parallel
from trainers.runtime.errors import TrainingError

__all__ = ["Learner", "StepState", "routing_metrics"]

Part = Callable[["StepState"], None]


@dataclasses.dataclass
class StepState:
  """One step as its parts see it: the step batch, its inputs and loss batch on the mesh, the step's
  random key (clip_cov's draw), the passes' heads, the update's metrics and the others (the routing
  comparison's, the advantage stages')."""

  sb: StepBatch
  inputs: ModelInputs
  batch: mis_jax.PackedBatch
  key: jax.Array
  heads: dict[Forward, Heads] = dataclasses.field(default_factory=dict)
  metrics: dict = dataclasses.field(default_factory=dict)
  side_metrics: dict = dataclasses.field(default_factory=dict)


class Learner:
  """The policy (`params`), its optimiser state (`opt_state`), the reference weights (`ref_params`,
  None without a KL term) and the step of `plan` over the jitted functions `fns`; `extras`: the
  run's per-token extras (those that feed the model become its inputs)."""

  def __init__(
    self,
    fns: StepFunctions,
    plan: StepPlan,
    *,
    params,
    mesh,
    seed: int,
    ppo_epochs: int,
    estimator: str,
    num_groups: int,
    num_segments: int,
    extras=(),
    ref_params=None,
  ):
    self.fns, self.plan, self.mesh, self.seed, self.ppo_epochs = fns, plan, mesh, seed, ppo_epochs
    self.extras = extras
    self.params, self.ref_params = params, ref_params
    self.opt_state = fns.init_opt_state(params)
    # Steps whose old log-probs the trainer computed (a separate pass, or the update's own forward
    # when fused); bypass and REINFORCE-IS never recompute (tested).
    self.num_old_logprob_passes = 0
    self.stages = plan_lib.compose_stages(
      plan,
      estimator=estimator,
      num_groups=num_groups,
      num_segments=num_segments,
      place=self.on_mesh,
      prepare=fns.prepare,
    )
    before: list[Part] = [self._policy_pass(forward) for forward in plan.policy_passes]
    before += [self._compare_routing] * plan.compare_routing
    before += [self._old_logprobs] * (plan.old_logprobs is not None)
    reference: list[Part] = [self._reference] * plan.reference
    self.separate: tuple[Part, ...] = (*before, *reference, self._prepare_and_update)
    self.fused: tuple[Part, ...] = (*reference, self._fused_update)

  def step(self, sb: StepBatch, step: int) -> StepOutcome:
    """Step `step` of the plan on `sb`: its parts in order, then what the step reports."""
    inputs, batch = self.device_batch(sb)
    state = StepState(sb, inputs, batch, jax.random.fold_in(jax.random.key(self.seed), step))
    for part in self.fused if self.plan.fuses(sb.layout.micro_batches) else self.separate:
      part(state)
    self.num_old_logprob_passes += self.plan.old_logprobs is not None
    metrics = {
      **state.metrics,
      "micro_batches": sb.layout.micro_batches,
      "sampling_replay": float(inputs.support is not None),  # log-probs, entropy, KL over the support
      **state.side_metrics,
    }
    bad = [k for k, v in metrics.items() if not np.isfinite(v)]
    if bad:
      raise TrainingError(f"step {step}: non-finite metrics {bad}; stopping before using these weights")
    ratio_range = self._ratio_range(state) if metrics.get("mis_masked_whole_batch") == 1.0 else None
    return StepOutcome(metrics, old_logprobs=state.batch.old_logprobs, masked_ratio_range=ratio_range)

  # --- the parts ---------------------------------------------------------------------------
  def _policy_pass(self, forward: Forward) -> Part:
    replay_native = forward.routing and self.plan.replay_native_routing  # R2: the native routing from here on

    def run(state: StepState) -> None:
      state.heads[forward] = self.fns.forward(forward)(self.params, state.inputs, state.batch.segment_ids)
      if replay_native:
        state.inputs = state.inputs._replace(routing=state.heads[forward].routing)

    return run

  def _compare_routing(self, state: StepState) -> None:
    recorded = state.sb.extras.get(extras_lib.RoutedExperts.name)  # the routed experts the server recorded
    state.side_metrics.update(
      routing_metrics(distributed.to_host(state.heads[self.plan.routing_pass].routing), recorded)
    )

  def _old_logprobs(self, state: StepState) -> None:
    state.batch = state.batch.replace(old_logprobs=state.heads[self.plan.old_logprobs].logprobs)

  def _reference(self, state: StepState) -> None:  # the reference model routes natively
    ref = self.fns.logprobs(self.ref_params, state.inputs._replace(routing=None), state.batch.segment_ids)
    state.batch = state.batch.replace(ref_logprobs=ref.logprobs)

  def _fused_update(self, state: StepState) -> None:
    self.params, self.opt_state, metrics, old = self.fns.train_fused(
      self.params, self.opt_state, state.inputs, state.batch, state.key
    )
    state.batch = state.batch.replace(old_logprobs=old)
    state.metrics = {name: float(v) for name, v in jax.device_get(metrics).items()}  # one transfer

  def _prepare_and_update(self, state: StepState) -> None:
    """The correction once (`prepare_step`), the advantage stages, then `ppo_epochs` updates; the
    first epoch's metrics (with the correction's) and the stages'."""
    correction, step_metrics = self.fns.prepare(state.batch, state.key)
    prepared, correction, stage_metrics = plan_lib.run_stages(
      self.stages, StageInput(state.sb, state.heads.get(self.plan.token_baseline), state.key), state.batch, correction
    )
    for _ in range(self.ppo_epochs):
      self.params, self.opt_state, epoch_metrics = self.fns.train(
        self.params, self.opt_state, state.inputs, prepared, correction
      )
      if not state.metrics:  # metrics of the first epoch: before any update of this step
        state.metrics = {name: float(v) for name, v in jax.device_get({**epoch_metrics, **step_metrics}).items()}
    state.side_metrics.update(stage_metrics)

  def _ratio_range(self, state: StepState) -> tuple[float, float] | None:
    """(min, max) raw IS ratio `exp(log π_train - log π_rollout)` over the loss-mask tokens of a step
    whose correction kept no token (None when there is none: all stale), for the warning."""
    batch = state.batch
    train_lp = (
      batch.old_logprobs
      if batch.old_logprobs is not None
      else self.fns.logprobs(self.params, state.inputs, batch.segment_ids).logprobs
    )
    log_ratio = distributed.to_host(train_lp - batch.rollout_logprobs)[distributed.to_host(batch.loss_mask)]
    return (
      None
      if log_ratio.size == 0
      else tuple(float(np.exp(np.clip(x, -20, 20))) for x in (log_ratio.min(), log_ratio.max()))
    )

  # --- the batch on the mesh -------------------------------------------------------------------
  def on_mesh(self, x):
    """A host array (the same on every process) on the mesh: each process places only the rows of
    its own devices."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, parallel.batch_sharding(self.mesh, x.ndim), lambda idx: x[idx])

  def device_batch(self, sb: StepBatch) -> tuple[ModelInputs, mis_jax.PackedBatch]:
    """The step batch placed on the mesh (rows over `data × fsdp × expert`)."""
    inputs = ModelInputs(
      *(self.on_mesh(x) for x in (sb.input_ids, sb.positions, sb.targets)),
      **extras_lib.model_inputs(self.extras, sb.extras, self.on_mesh),
    )
    return inputs, jax.tree.map(self.on_mesh, sb.batch)


def routing_metrics(native: np.ndarray, recorded: np.ndarray) -> dict[str, float]:
  """Routing mismatch between the trainer's native top-k and the rollout's, over the positions
  with a record (`recorded[..., 0, 0] >= 0`); both `[..., num_layers, k]`. Experts are compared
  as sets: `routing_mismatch_frac` over (token, layer) choices, `routing_mismatch_token_frac`
  over tokens (any layer differs), and `routing_mismatch_layer/{l}` per layer."""
  has = recorded[..., 0, 0] >= 0
  a, b = np.sort(native[has], axis=-1), np.sort(recorded[has], axis=-1)  # [n, L, k]
  differ = np.any(a != b, axis=-1)  # [n, L]
  out = {
    "routing_mismatch_frac": float(differ.mean()) if differ.size else 0.0,
    "routing_mismatch_token_frac": float(differ.any(axis=-1).mean()) if differ.size else 0.0,
    "routing_positions": float(has.sum()),
  }
  for layer in range(native.shape[-2]):
    out[f"routing_mismatch_layer/{layer}"] = float(differ[:, layer].mean()) if differ.size else 0.0
  return out
