"""The model's memory options chosen by need: `model.remat` and `model.attention` set to `auto`
are resolved once, before the first step, from the compiled training step's memory against the
device's.

Remat re-runs each layer's forward in the backward pass (about a third more work) and blocked
attention trades the `[T, T]` scores for a loop over key blocks; both only pay off when the step
would not fit without them. The candidates, cheapest in time first (`LADDER`):

  remat none + dense attention → none + blocked → dots + blocked → full + blocked

(an explicit value of one option keeps it fixed and the ladder runs over the other; explicit
values are never overridden, and with both explicit nothing is compiled). Each candidate's
training step — one micro-batch of `train.tokens_per_micro_batch // train.row_len` rows per
device at `train.row_len`, with the run's per-token extras, on the run's mesh — is lowered and
(unless a bound settles it, below) compiled with the probe's loss and optimiser (`PROBE_LOSS`:
one program per model, shape, extras and mesh), and its per-device bytes read from XLA's
`memory_analysis()`: arguments + outputs + temporaries − donated (aliased) bytes, as
`benchmarks/memory.py` reports them. The first
candidate within the budget is chosen, and the ladder stops there. A candidate is not compiled when
the lowered step's bound fits already: `BOUND_FACTOR` x its bytes accessed (every operand and result
of every op before XLA's optimisations; each buffer is one of them), computed in a few tenths of a
second against seconds for a compile, so a small step (the demo's, the tests') compiles nothing
extra. When none fits, the last one (the least memory) is taken and the start-up line says it
does not fit.

The budget per device (`memory_budget`): `model.memory_budget_gb` when set; else `SAFETY` × the
device's `memory_stats()["bytes_limit"]` (GPU, TPU); else, on CPU, `SAFETY` × the host's RAM
shared by the process's local devices.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import mis_jax
from trainers.runtime import parallel
from trainers.config import AUTO, TrainSection
from trainers.learner.step import ModelInputs

# Of a device's reported limit: headroom for what the step's program does not hold (the embedded
# engine, the batch being placed, fragmentation).
SAFETY = 0.9
# The probe's loss and optimiser: one program per model, shape, extras and mesh whatever the run's
# loss (the losses differ by a few [rows, row_len] float32 arrays beside the model's activations).
PROBE_LOSS = mis_jax.LossConfig(use_rollout_logprobs=True)
PROBE_TRAIN = TrainSection()
# (remat, attention), cheapest in time first.
LADDER = (("none", "dense"), ("none", "blocked"), ("dots", "blocked"), ("full", "blocked"))
REMAT_LADDER = ("none", "dots", "full")
ATTENTION_LADDER = ("dense", "blocked")


@dataclasses.dataclass(frozen=True)
class Budget:
  """Bytes per device the step may take, and where the figure comes from."""

  bytes: int
  source: str


@dataclasses.dataclass(frozen=True)
class ModelChoice:
  """The resolved `remat` and `attention`, and why: `measured` holds the candidates compiled, in
  order, with their predicted per-device bytes (empty when both were explicit)."""

  remat: str
  attention: str
  measured: tuple[tuple[str, str, int], ...] = ()
  budget: Budget | None = None

  @property
  def fits(self) -> bool:
    return not self.measured or self.measured[-1][2] <= self.budget.bytes

  def reason(self) -> str:
    """Why these values, for the start-up line."""
    if not self.measured:
      return "explicit"
    gb = lambda b: f"{b / 1e9:.2f}"
    predicted, budget = self.measured[-1][2], self.budget
    if not self.fits:
      return (
        f"auto: none fits, {gb(predicted)} GB predicted of {gb(budget.bytes)} GB per device, {budget.source}; "
        f"lower train.tokens_per_micro_batch"
      )
    skipped = "; ".join(f"{r}+{a} {gb(b)} GB" for r, a, b in self.measured[:-1])
    how = "at most {} GB (the lowered step's bound)" if isinstance(predicted, Bound) else "{} GB predicted"
    return f"auto: {how.format(gb(predicted))} of {gb(budget.bytes)} GB per device, {budget.source}" + (
      f"; too large: {skipped}" if skipped else ""
    )


def candidates(remat: str, attention: str) -> tuple[tuple[str, str], ...]:
  """The `(remat, attention)` pairs to try, in order, for the configured values (`auto` or explicit)."""
  if remat == AUTO and attention == AUTO:
    return LADDER
  if remat == AUTO:
    return tuple((r, attention) for r in REMAT_LADDER)
  if attention == AUTO:
    return tuple((remat, a) for a in ATTENTION_LADDER)
  return ((remat, attention),)


def choose(remat: str, attention: str, predict: Callable[[str, str], int], budget: Budget | None) -> ModelChoice:
  """The first candidate of `candidates(remat, attention)` whose `predict(remat, attention)`
  (per-device bytes) is within `budget`, else the last one; nothing is predicted when both are
  explicit."""
  ladder = candidates(remat, attention)
  if len(ladder) == 1 and AUTO not in (remat, attention):
    return ModelChoice(remat, attention)
  measured = []
  for r, a in ladder:
    measured.append((r, a, predict(r, a)))  # an int, or a `Bound`
    if measured[-1][2] <= budget.bytes:
      break
  return ModelChoice(measured[-1][0], measured[-1][1], tuple(measured), budget)


def memory_budget(devices: Sequence, budget_gb: float | None = None) -> Budget:
  """Bytes per device for the step: `budget_gb` when given, else `SAFETY` × the device's
  `bytes_limit`, else (CPU) `SAFETY` × the host's RAM over the local devices."""
  if budget_gb is not None:
    return Budget(int(budget_gb * 1e9), "model.memory_budget_gb")
  device = devices[0]
  stats = _memory_stats(device)
  if stats and stats.get("bytes_limit"):
    return Budget(int(SAFETY * stats["bytes_limit"]), f"{SAFETY:g} x {device.platform} bytes_limit")
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  local = max(1, sum(d.process_index == device.process_index for d in devices))
  return Budget(int(SAFETY * ram / local), f"{SAFETY:g} x host RAM / {local} local {device.platform} device(s)")


def _memory_stats(device) -> dict | None:
  try:
    return device.memory_stats()
  except Exception:  # a backend without memory statistics (CPU returns None; some raise)
    return None


def compiled_bytes(compiled) -> int:
  """Per-device bytes of a compiled program: arguments + outputs + temporaries − aliased."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class ProbeShape:
  """What a step's largest micro-batch holds, per the config: rows per device, the row length, and
  the per-token extras' trailing shapes by model input (`("support", (K,))`, `("routing", (L, k))`).
  The loss's own per-token fields (old, reference log-probs, staleness) are left out, as the loss
  is (`PROBE_LOSS`): a few `[rows, row_len]` arrays beside the model's activations."""

  rows_per_device: int
  row_len: int
  model_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()


class Bound(int):
  """Bytes that bound a step's memory from above without compiling it (`step_bytes`)."""


# A lowered step's bytes accessed (every operand and result of every op, before XLA's optimisations)
# bound its peak: each buffer is some op's result. Twice that, for the copies XLA may add.
BOUND_FACTOR = 2


def step_bytes(fns, mesh, shape: ProbeShape, *, within: int | None = None) -> int:
  """Per-device bytes of the step of `fns` (a `StepFunctions`) compiled for one micro-batch of `shape`
  on `mesh`, from abstract arguments (nothing is allocated or run). When the lowered step's bound
  (`BOUND_FACTOR` x its bytes accessed, a few tenths of a second) is `within` bytes already, that
  `Bound` instead, and nothing is compiled."""
  rows = shape.rows_per_device * parallel.batch_devices(mesh)
  rep = NamedSharding(mesh, P())

  def tokens(dtype, trailing=()):
    return jax.ShapeDtypeStruct(
      (1, rows, shape.row_len) + tuple(trailing), dtype, sharding=parallel.batch_sharding(mesh, 3 + len(trailing))
    )

  inputs = ModelInputs(
    tokens(jnp.int32),
    tokens(jnp.int32),
    tokens(jnp.int32),
    **{name: tokens(jnp.int32, trailing) for name, trailing in shape.model_inputs},
  )
  batch = mis_jax.PackedBatch(
    segment_ids=tokens(jnp.int32),
    loss_mask=tokens(jnp.bool_),
    advantages=tokens(jnp.float32),
    rollout_logprobs=tokens(jnp.float32),
    num_segments=rows,
  )  # one sequence per row: the probe's own count
  correction = fns.prepare_shapes(batch, jax.random.key(0))[0]
  correction = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=parallel.batch_sharding(mesh, x.ndim) if x.ndim >= 3 else rep
    ),
    correction,
  )
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), fns.abstract_params, fns.param_shardings
  )
  opt_state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(fns.optimizer.init, fns.abstract_params),
    fns.opt_shardings,
  )
  lowered = fns.lower_train(params, opt_state, inputs, batch, correction)
  if within is not None:
    bound = Bound(BOUND_FACTOR * int(_bytes_accessed(lowered)))
    if bound <= within:
      return bound
  return compiled_bytes(lowered.compile())


def _bytes_accessed(lowered) -> float:
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


def probe_shape(train, extras) -> ProbeShape:
  """The largest micro-batch a run with `train` (its section) and per-token `extras` trains on
  (`trainers.learner.batch.plan_layout`'s cap)."""
  trailing = {"support": lambda e: (e.width,), "routing": lambda e: (e.spec.num_layers, e.spec.top_k)}
  return ProbeShape(
    rows_per_device=max(1, train.tokens_per_micro_batch // train.row_len),
    row_len=train.row_len,
    model_inputs=tuple((e.model_input, trailing[e.model_input](e)) for e in extras if e.model_input in trailing),
  )
