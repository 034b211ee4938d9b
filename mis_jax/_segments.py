"""Segment reductions over packed sequences, global across devices (SPEC §1, §8, §10).

Every per-token array is flattened to ``[T]``. Per-segment sums use ``jax.ops.segment_sum``
over ``segment_ids`` (padding id ``-1`` is dropped), are completed across mesh axes with
``psum`` (so a segment may span devices: sequence parallelism) and are broadcast back to
tokens by indexing. Every public reduction returns the same value on every device.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

AxisName = str | Sequence[str] | None

# Safety bound on log values before exp (SPEC notation B).
LOG_BOUND = 20.0


def psum(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def pmax(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.pmax(x, axis_name)


def pmin(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.pmin(x, axis_name)


def safe_exp(log_x):
  """``exp(clip(log_x, -B, B))``: never inf, never overflows float32."""
  return jnp.exp(jnp.clip(log_x, -LOG_BOUND, LOG_BOUND))


class PerSegment(NamedTuple):
  """A metric already reduced per segment: ``means[s]`` is the segment's masked mean and
  ``counts[s]`` the size of its mask. :meth:`Segments.reduce_many` reduces it with no scatter."""

  means: jax.Array
  counts: jax.Array


class Segments:
  """Segment bookkeeping of one packed (possibly sharded) batch.

  Args:
    segment_ids: int array, any shape; ``-1`` marks padding.
    num_segments: static upper bound on segment ids.
    axis_name: mesh axis name(s) over which the batch is sharded, or None.
  """

  def __init__(self, segment_ids: jax.Array, num_segments: int, axis_name: AxisName = None):
    self.ids = jnp.reshape(segment_ids, (-1,)).astype(jnp.int32)
    self.num_segments = int(num_segments)
    self.axis_name = axis_name
    self.valid = self.ids >= 0
    # Index for gathering per-segment values back to tokens; padding reads segment 0 and
    # is masked by every caller.
    self.gather_ids = jnp.where(self.valid, self.ids, 0)

  # --- per-segment sums, global --------------------------------------------------------
  def sum(self, x: jax.Array) -> jax.Array:
    """Global per-segment sums of a per-token ``[T]`` (or stacked ``[T, K]``) array.

    Returns ``[S]`` (or ``[S, K]``); padding is excluded. Stack several per-token quantities
    into one ``[T, K]`` call where possible: one scatter of K columns costs little more than
    one of a single column.
    """
    valid = self.valid if x.ndim == 1 else self.valid[:, None]
    x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    seg = jax.ops.segment_sum(x, self.ids, num_segments=self.num_segments)
    return psum(seg, self.axis_name)

  def max(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """``[S]`` global per-segment maxima of ``x`` over ``mask`` (float32 lowest where empty)."""
    lowest = jnp.asarray(jnp.finfo(jnp.float32).min, jnp.float32)
    x = jnp.where(mask & self.valid, x.astype(jnp.float32), lowest)
    seg = jax.ops.segment_max(x, self.ids, num_segments=self.num_segments)
    return pmax(jnp.maximum(seg, lowest), self.axis_name)

  def broadcast(self, seg_values: jax.Array) -> jax.Array:
    """Per-segment ``[S]`` (or ``[S, K]``) values back to tokens (0 at padding)."""
    out = seg_values[self.gather_ids]
    valid = self.valid if out.ndim == 1 else self.valid[:, None]
    return jnp.where(valid, out, jnp.zeros((), out.dtype))

  # --- global token-level reductions ---------------------------------------------------
  def total(self, x: jax.Array) -> jax.Array:
    """Global sum over non-padding tokens of ``[T]`` (a scalar) or ``[T, K]`` (``[K]``)."""
    valid = self.valid if x.ndim == 1 else self.valid[:, None]
    return psum(jnp.sum(jnp.where(valid, x, jnp.zeros((), x.dtype)), axis=0), self.axis_name)

  def masked_min(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """True global minimum of ``x`` over ``mask`` (0 if the mask is empty)."""
    big = jnp.asarray(jnp.finfo(jnp.float32).max, jnp.float32)
    local = jnp.min(jnp.where(mask, x, big))
    glob = pmin(local, self.axis_name)
    return jnp.where(self.count(mask) > 0, glob, 0.0)

  def masked_max(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """True global maximum of ``x`` over ``mask`` (0 if the mask is empty)."""
    small = jnp.asarray(jnp.finfo(jnp.float32).min, jnp.float32)
    local = jnp.max(jnp.where(mask, x, small))
    glob = pmax(local, self.axis_name)
    return jnp.where(self.count(mask) > 0, glob, 0.0)

  def count(self, mask: jax.Array) -> jax.Array:
    return self.total(mask.astype(jnp.float32))

  # --- mask-aware means (SPEC §8 reduction R_mask) -------------------------------------
  def reduce(self, x: jax.Array, mask: jax.Array, mode: str) -> jax.Array:
    """``R_mask(x)`` of SPEC §8 (0 when the mask is empty).

    ``token-mean``: ``Σ x·mask / Σ mask``. Seq-mean modes: the mean, over segments with a
    non-empty mask, of each segment's masked mean.
    """
    return self.reduce_many([("x", x, mask)], mode)["x"]

  def reduce_many(self, items, mode: str) -> dict:
    """Many ``R_mask(x)`` at once: ``items`` is a list of ``(name, x, mask)``.

    Items sharing one mask object are stacked into a single ``[T, K + 1]`` reduction (the
    last column counts the mask), so a whole metric table costs a few scatters, not dozens.
    Returns ``{name: scalar}`` in the order given.
    """
    groups: dict[int, tuple] = {}
    out = {}
    for name, x, mask in items:
      if isinstance(x, PerSegment):
        out[name] = self._reduce_per_segment(x, mode)
      else:
        groups.setdefault(id(mask), (mask, []))[1].append((name, x))
    for mask, entries in groups.values():
      cols = [jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0) for _, x in entries]
      stacked = jnp.stack(cols + [mask.astype(jnp.float32)], axis=-1)
      if mode == "token-mean":
        sums = psum(jnp.sum(jnp.where(self.valid[:, None], stacked, 0.0), axis=0), self.axis_name)
        values = sums[:-1] / jnp.maximum(sums[-1], 1.0)
      else:
        seg = self.sum(stacked)
        count = seg[:, -1:]
        means = seg[:, :-1] / jnp.maximum(count, 1.0)
        present = count > 0
        n = jnp.sum(present.astype(jnp.float32))
        values = jnp.sum(jnp.where(present, means, 0.0), axis=0) / jnp.maximum(n, 1.0)
      for i, (name, _) in enumerate(entries):
        out[name] = values[i]
    return {name: out[name] for name, _, _ in items}

  @staticmethod
  def _reduce_per_segment(x: PerSegment, mode: str) -> jax.Array:
    present = x.counts > 0
    if mode == "token-mean":  # Σ_s mean_s n_s / Σ_s n_s = Σ x·mask / Σ mask
      return jnp.sum(jnp.where(present, x.means * x.counts, 0.0)) / jnp.maximum(jnp.sum(x.counts), 1.0)
    n = jnp.sum(present.astype(jnp.float32))
    return jnp.sum(jnp.where(present, x.means, 0.0)) / jnp.maximum(n, 1.0)
