"""Segment reductions over packed sequences, global across devices (contract §1, §8, §10).

Every per-token array is flattened to ``[T]``. Per-segment sums are scatter-adds over
``segment_ids`` (padding id ``-1`` is dropped), completed across mesh axes with ``psum`` (so a
segment may span devices: sequence parallelism) and broadcast back to tokens by indexing.
Every reduction returns the same value on every device.

Statistics of a mask that several consumers need (per-segment counts, total, live segments)
are a :class:`MaskStats` pytree: computed once (by :meth:`Segments.mask_stats`, or taken from
a pass that already counted the mask) and passed on as an argument.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mis_jax._engine import (
  HIGHEST,
  LOWEST,
  AxisName,
  PassOptions,
  SegMax,
  SegSum,
  Total,
  pass_options,
  pmax,
  pmin,
  psum,
  run_pass,
)

# Safety bound on log values before exp (the contract's notation B, docs/contract.md).
LOG_BOUND = 20.0

__all__ = ["LOG_BOUND", "MaskStats", "Segments", "masked_means", "per_segment_mean", "safe_exp"]


def safe_exp(log_x):
  """``exp(clip(log_x, -B, B))``: never inf, never overflows float32."""
  return jnp.exp(jnp.clip(log_x, -LOG_BOUND, LOG_BOUND))


@dataclasses.dataclass(frozen=True)
class MaskStats:
  """Global statistics of one mask over the segments of a batch (a pytree).

  Attributes:
    counts: ``[S]`` float32, ``n_s = Σ_{t∈s} mask_t`` over every device.
    total: ``Σ_s n_s``, the mask's token count.
    num_live: the number of segments with ``n_s > 0``.
  """

  counts: jax.Array
  total: jax.Array
  num_live: jax.Array

  @classmethod
  def from_counts(cls, counts: jax.Array) -> "MaskStats":
    """Stats from global per-segment counts (e.g. counted by a pass that ran anyway)."""
    counts = counts.astype(jnp.float32)
    return cls(counts=counts, total=jnp.sum(counts), num_live=jnp.sum((counts > 0).astype(jnp.float32)))

  @property
  def inverse(self) -> jax.Array:
    """``[S]``: ``1 / n_s`` where ``n_s > 0``, else 0."""
    return jnp.where(self.counts > 0, 1.0 / jnp.maximum(self.counts, 1.0), 0.0)


jax.tree_util.register_dataclass(MaskStats, data_fields=["counts", "total", "num_live"], meta_fields=[])


class Segments:
  """The segment layout of one packed (possibly sharded) batch: flat ids, their validity,
  the static segment count, the mesh axes and the :class:`PassOptions` of its passes.

  Args:
    segment_ids: int array, any shape; ``-1`` marks padding.
    num_segments: static upper bound on segment ids.
    axis_name: mesh axis name(s) over which the batch is sharded, or None.
    options: how passes run; default :func:`mis_jax.engine.pass_options` of ``segment_ids``.
  """

  def __init__(
    self, segment_ids: jax.Array, num_segments: int, axis_name: AxisName = None, options: PassOptions | None = None
  ):
    if options is None:
      options = pass_options(segment_ids, num_segments)
    if not isinstance(options, PassOptions):
      raise TypeError(f"pass options must be a mis_jax.engine.PassOptions, got {type(options).__name__}")
    self.options = options
    self.ids = jnp.reshape(segment_ids, (-1,)).astype(jnp.int32)
    self.num_segments = int(num_segments)
    self.axis_name = axis_name
    self.valid = self.ids >= 0
    # Index for gathering per-segment values back to tokens; padding reads segment 0 and
    # is masked by every caller.
    self.gather_ids = jnp.where(self.valid, self.ids, 0)

  def run_pass(self, arrays: dict, body) -> dict:
    """One fused pass of ``body`` over the tokens (see :func:`mis_jax._engine.run_pass`)."""
    return run_pass(self.options, self.ids, self.num_segments, self.axis_name, arrays, body)

  # --- per-segment reductions, global ---------------------------------------------------
  def sum(self, x) -> jax.Array:
    """Global float32 per-segment sums of a per-token ``[T]`` array, or of a list of them
    (``[S, K]``, completed with one ``psum``); padding is excluded."""
    many = isinstance(x, (list, tuple)) or x.ndim == 2
    cols = list(x) if isinstance(x, (list, tuple)) else [x] if x.ndim == 1 else [x[:, k] for k in range(x.shape[1])]
    names = [f"c{i}" for i in range(len(cols))]
    res = self.run_pass(dict(zip(names, cols)), lambda ch: {k: SegSum(ch[k]) for k in names})
    out = jnp.stack([res[k] for k in names], axis=-1)
    return out if many else out[:, 0]

  def max(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """``[S]`` global per-segment maxima of ``x`` over ``mask`` (float32 lowest where empty)."""
    x = jnp.where(mask, x.astype(jnp.float32), LOWEST)
    return self.run_pass({"x": x}, lambda ch: {"max": SegMax(ch["x"])})["max"]

  def mask_stats(self, mask: jax.Array) -> MaskStats:
    """:class:`MaskStats` of a flat bool ``mask``: one pass with one scatter (dropped by the
    compiler when only the total is used, as in token-mean reductions)."""
    res = self.run_pass({"m": mask & self.valid}, lambda ch: {"counts": SegSum(ch["m"]), "total": Total(ch["m"])})
    counts = res["counts"]
    return MaskStats(counts=counts, total=res["total"], num_live=jnp.sum((counts > 0).astype(jnp.float32)))

  def broadcast(self, seg_values: jax.Array) -> jax.Array:
    """Per-segment ``[S]`` values back to tokens (0 at padding)."""
    return jnp.where(self.valid, seg_values[self.gather_ids], jnp.zeros((), seg_values.dtype))

  # --- global token-level reductions ---------------------------------------------------
  def total(self, x) -> jax.Array:
    """Global sum over non-padding tokens of ``[T]`` (a scalar) or of a list of ``[T]``
    arrays (``[K]``, one ``psum``)."""
    cols = list(x) if isinstance(x, (list, tuple)) else [x]
    local = jnp.stack([jnp.sum(jnp.where(self.valid, c, jnp.zeros((), c.dtype))) for c in cols])
    out = psum(local, self.axis_name)
    return out if isinstance(x, (list, tuple)) else out[0]

  def masked_min(self, x: jax.Array, mask: jax.Array, stats: MaskStats) -> jax.Array:
    """True global minimum of ``x`` over ``mask`` (0 if the mask is empty)."""
    glob = pmin(jnp.min(jnp.where(mask, x, HIGHEST)), self.axis_name)
    return jnp.where(stats.total > 0, glob, 0.0)

  def masked_max(self, x: jax.Array, mask: jax.Array, stats: MaskStats) -> jax.Array:
    """True global maximum of ``x`` over ``mask`` (0 if the mask is empty)."""
    glob = pmax(jnp.max(jnp.where(mask, x, LOWEST)), self.axis_name)
    return jnp.where(stats.total > 0, glob, 0.0)

  # --- mask-aware means (contract §8 reduction R_mask) -------------------------------------
  def metric_weights(self, mask: jax.Array, stats: MaskStats, mode: str):
    """Per-token weights ``a_t`` and a global divisor ``N`` with ``R_mask(x) = Σ_t a_t x_t / N``.

    token-mean: ``a = m``, ``N = Σ m``. Seq-mean modes: ``a_t = m_t / n_{s(t)}`` with ``n_s``
    the segment's mask count, ``N`` the number of segments with ``n_s > 0``.
    """
    if mode == "token-mean":
      return jnp.where(mask & self.valid, 1.0, 0.0), stats.total
    return jnp.where(mask, self.broadcast(stats.inverse), 0.0), stats.num_live

  def reduce(self, x: jax.Array, mask: jax.Array, stats: MaskStats, mode: str) -> jax.Array:
    """``R_mask(x)`` of contract §8 (0 when the mask is empty).

    ``token-mean``: ``Σ x·mask / Σ mask``. Seq-mean modes: the mean, over segments with a
    non-empty mask, of each segment's masked mean.
    """
    return masked_means([(mask, stats, {"x": x})], self, mode)["x"]


def masked_means(groups, segs: Segments, mode: str) -> dict:
  """Many ``R_mask(x)`` (contract §8) at once, completed with a single ``psum``.

  Args:
    groups: a list of ``(mask, stats, {name: x})``: flat bool mask, its :class:`MaskStats`
      and the per-token values to reduce over it. Values of one group share its weights.
    segs: the batch's :class:`Segments`.
    mode: the reduction (``token-mean`` or a seq-mean mode).

  Returns:
    ``{name: scalar}`` in the order given.
  """
  names, local, divisors = [], [], []
  for mask, stats, values in groups:
    if not values:
      continue
    a, n = segs.metric_weights(mask, stats, mode)
    for name, x in values.items():
      names.append(name)
      local.append(jnp.sum(jnp.where(a != 0, jnp.asarray(x).astype(jnp.float32), 0.0) * a))
      divisors.append(n)
  if not names:
    return {}
  values = psum(jnp.stack(local), segs.axis_name) / jnp.maximum(jnp.stack(divisors), 1.0)
  return {name: values[i] for i, name in enumerate(names)}


def per_segment_mean(means: jax.Array, counts: jax.Array, mode: str) -> jax.Array:
  """``R_mask`` of a value given per segment: ``means[s]`` is segment ``s``'s masked mean,
  ``counts[s]`` its mask count. token-mean: ``Σ_s means_s n_s / Σ_s n_s``; seq-mean modes:
  the mean of ``means_s`` over segments with ``n_s > 0``."""
  present = counts > 0
  if mode == "token-mean":
    return jnp.sum(jnp.where(present, means * counts, 0.0)) / jnp.maximum(jnp.sum(counts), 1.0)
  n = jnp.sum(present.astype(jnp.float32))
  return jnp.sum(jnp.where(present, means, 0.0)) / jnp.maximum(n, 1.0)
