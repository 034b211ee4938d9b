"""Segment reductions over packed sequences, global across devices (SPEC §1, §8, §10).

Every per-token array is flattened to ``[T]``. Per-segment sums use ``jax.ops.segment_sum``
over ``segment_ids`` (padding id ``-1`` is dropped), are completed across mesh axes with
``psum`` (so a segment may span devices: sequence parallelism) and are broadcast back to
tokens by indexing. Every public reduction returns the same value on every device.
Mask-aware means over segments need no per-metric scatter: they are weighted totals with
per-token weights ``m_t / n_{s(t)}`` (:meth:`Segments.token_weights`).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

AxisName = str | Sequence[str] | None

# Safety bound on log values before exp (SPEC notation B).
LOG_BOUND = 20.0

# Identities of float32 max and min reductions.
_LOWEST = float(np.finfo(np.float32).min)
_HIGHEST = float(np.finfo(np.float32).max)

# Scatter lanes per segment (see Segments).
_LANES = 8


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

  Per-segment sums are scatter-adds, the one costly primitive here. Two things keep them
  cheap. (1) Lanes: consecutive tokens of a packed segment hit the same accumulator, so a
  plain scatter-add is a serial read-add-write chain; token ``t`` of segment ``s`` is added
  to bucket ``s·P + t mod P`` instead (``P`` lanes, summed at the end), which breaks the
  chain (about 2.5x faster on XLA:CPU). (2) Few scatters: per-segment mask counts are cached
  per mask (:meth:`counts`), and mask-aware means over segments are computed as one weighted
  total per metric, ``Σ_t x_t m_t / n_{s(t)} / N``, so a whole metric table needs one count
  scatter per distinct mask instead of a scatter per metric.

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
    # Lanes pay off for long segments (long same-bucket chains) and cost cache for many
    # short ones: a power of two, at most _LANES, at most a sixteenth of the mean length.
    mean_len = self.ids.shape[0] // max(self.num_segments, 1)
    self.lanes = 1 << max(0, min(_LANES, mean_len // 16).bit_length() - 1)
    self._memo: dict[tuple, tuple] = {}

  def memo(self, key: tuple, fn, *keep):
    """``fn()``, computed once per ``key`` for this batch. ``key`` usually holds ``id`` s of
    the arrays it depends on; pass those arrays as ``keep`` so the ids stay theirs."""
    hit = self._memo.get(key)
    if hit is None:
      hit = self._memo[key] = (keep, fn())
    return hit[1]

  # --- per-segment sums, global --------------------------------------------------------
  def sum(self, x) -> jax.Array:
    """Global float32 per-segment sums of a per-token ``[T]`` array, or of a list of them.

    Returns ``[S]`` (or ``[S, K]`` for a list of K arrays or a ``[T, K]`` array, completed
    with one ``psum``); padding is excluded. A one-contribution :meth:`run_pass`. Pass
    several quantities as a list rather than stacking them into ``[T, K]``: interleaving
    columns costs more on XLA:CPU than the scatters themselves.
    """
    many = isinstance(x, (list, tuple)) or x.ndim == 2
    cols = list(x) if isinstance(x, (list, tuple)) else [x] if x.ndim == 1 else [x[:, k] for k in range(x.shape[1])]
    names = [f"c{i}" for i in range(len(cols))]
    res = self.run_pass(dict(zip(names, cols)), lambda ch: {k: SegSum(ch[k]) for k in names})
    out = jnp.stack([res[k] for k in names], axis=-1)
    return out if many else out[:, 0]

  def max(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """``[S]`` global per-segment maxima of ``x`` over ``mask`` (float32 lowest where empty)."""
    x = jnp.where(mask, x.astype(jnp.float32), _LOWEST)
    return self.run_pass({"x": x}, lambda ch: {"max": SegMax(ch["x"])})["max"]

  def counts(self, mask: jax.Array) -> jax.Array:
    """``[S]`` global per-segment counts of a bool ``mask``; cached per mask object."""
    return self.memo(("counts", id(mask)), lambda: self.sum(mask.astype(jnp.float32)), mask)

  def remember_counts(self, mask: jax.Array, counts: jax.Array) -> None:
    """Records ``counts`` as :meth:`counts` of ``mask`` (computed elsewhere, e.g. in a pass)."""
    self.memo(("counts", id(mask)), lambda: counts, mask)

  def inverse_counts(self, counts: jax.Array) -> jax.Array:
    """``1 / max(counts, 1)`` at every token (0 at padding): one gather per counts array."""
    inv = self.memo(("inverse", id(counts)), lambda: 1.0 / jnp.maximum(counts, 1.0), counts)
    return self.broadcast(inv)

  def broadcast(self, seg_values: jax.Array) -> jax.Array:
    """Per-segment ``[S]`` values back to tokens (0 at padding); cached per array object.

    ``[S, K]`` is gathered column by column (a K-wide gather is far slower on XLA:CPU).
    """
    def gather():
      if seg_values.ndim == 1:
        return jnp.where(self.valid, seg_values[self.gather_ids], jnp.zeros((), seg_values.dtype))
      return jnp.stack([self.broadcast(seg_values[:, k]) for k in range(seg_values.shape[1])], axis=-1)
    return self.memo(("broadcast", id(seg_values)), gather, seg_values)

  def run_pass(self, arrays: dict, body) -> dict:
    """One pass over the tokens, chunk by chunk: ``body(chunk)`` returns a dict of
    contributions (:class:`SegSum`, :class:`SegMax`, :class:`Total`, :class:`Max`,
    :class:`Min`, :class:`Out`) computed from ``chunk[name]`` (``[C]`` slices of the flat
    ``[T]`` ``arrays``) and ``chunk.broadcast(per_segment)``. Returns the global results by
    name: ``[S]`` for segment reductions, scalars, and ``[T]`` outputs.

    On XLA:CPU every intermediate of the body then lives in cache, which is several times
    faster than materialising each over the whole batch (see :func:`set_chunk_tokens`).
    """
    return _run_pass(self, arrays, body)

  # --- global token-level reductions ---------------------------------------------------
  def total(self, x) -> jax.Array:
    """Global sum over non-padding tokens of ``[T]`` (a scalar) or of a list of ``[T]``
    arrays (``[K]``, one ``psum``)."""
    cols = list(x) if isinstance(x, (list, tuple)) else [x]
    local = jnp.stack([jnp.sum(jnp.where(self.valid, c, jnp.zeros((), c.dtype))) for c in cols])
    out = psum(local, self.axis_name)
    return out if isinstance(x, (list, tuple)) else out[0]

  def masked_min(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """True global minimum of ``x`` over ``mask`` (0 if the mask is empty)."""
    glob = pmin(jnp.min(jnp.where(mask, x, _HIGHEST)), self.axis_name)
    return jnp.where(self.count(mask) > 0, glob, 0.0)

  def masked_max(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """True global maximum of ``x`` over ``mask`` (0 if the mask is empty)."""
    glob = pmax(jnp.max(jnp.where(mask, x, _LOWEST)), self.axis_name)
    return jnp.where(self.count(mask) > 0, glob, 0.0)

  def count(self, mask: jax.Array) -> jax.Array:
    """Global number of non-padding tokens in ``mask``; cached per mask object."""
    return self.memo(("count", id(mask)), lambda: self.total(mask.astype(jnp.float32)), mask)

  # --- mask-aware means (SPEC §8 reduction R_mask) -------------------------------------
  def reduce(self, x: jax.Array, mask: jax.Array, mode: str) -> jax.Array:
    """``R_mask(x)`` of SPEC §8 (0 when the mask is empty).

    ``token-mean``: ``Σ x·mask / Σ mask``. Seq-mean modes: the mean, over segments with a
    non-empty mask, of each segment's masked mean.
    """
    return self.reduce_many([("x", x, mask)], mode)["x"]

  def token_weights(self, mask: jax.Array, mode: str):
    """Per-token weights ``a_t`` and a global divisor ``N`` with ``R_mask(x) = Σ_t a_t x_t / N``.

    token-mean: ``a = m``, ``N = Σ m``. Seq-mean modes: ``a_t = m_t / n_{s(t)}`` with ``n_s``
    the segment's mask count, ``N`` the number of segments with ``n_s > 0``.
    """
    if mode == "token-mean":
      return jnp.where(mask & self.valid, 1.0, 0.0), self.count(mask)
    n = self.counts(mask)  # > 0 wherever mask is set
    return jnp.where(mask, self.inverse_counts(n), 0.0), jnp.sum((n > 0).astype(jnp.float32))

  def reduce_many(self, items, mode: str) -> dict:
    """Many ``R_mask(x)`` at once: ``items`` is a list of ``(name, x, mask)``.

    Items sharing one mask object share its per-token weights (:meth:`token_weights`), so a
    metric costs one weighted total, completed for all items with a single ``psum``.
    Returns ``{name: scalar}`` in the order given.
    """
    out, names, local, divisors = {}, [], [], []
    weights: dict[int, tuple] = {}
    for name, x, mask in items:
      if isinstance(x, PerSegment):
        out[name] = self.reduce_per_segment(x, mode)
        continue
      if id(mask) not in weights:
        weights[id(mask)] = (mask, *self.token_weights(mask, mode))
      _, a, n = weights[id(mask)]
      names.append(name)
      local.append(jnp.sum(jnp.where(a != 0, jnp.asarray(x, jnp.float32), 0.0) * a))
      divisors.append(n)
    if names:
      values = psum(jnp.stack(local), self.axis_name) / jnp.maximum(jnp.stack(divisors), 1.0)
      out.update(zip(names, (values[i] for i in range(len(names)))))
    return {name: out[name] for name, _, _ in items}

  @staticmethod
  def reduce_per_segment(x: PerSegment, mode: str) -> jax.Array:
    """``R_mask`` of a metric given per segment (no pass over tokens)."""
    present = x.counts > 0
    if mode == "token-mean":  # Σ_s mean_s n_s / Σ_s n_s = Σ x·mask / Σ mask
      return jnp.sum(jnp.where(present, x.means * x.counts, 0.0)) / jnp.maximum(jnp.sum(x.counts), 1.0)
    n = jnp.sum(present.astype(jnp.float32))
    return jnp.sum(jnp.where(present, x.means, 0.0)) / jnp.maximum(n, 1.0)


# --- chunked passes over tokens ----------------------------------------------------------

class SegSum(NamedTuple):
  """A per-token contribution to a per-segment sum (see :meth:`Segments.run_pass`)."""
  x: jax.Array


class SegMax(NamedTuple):
  """A per-token contribution to a per-segment maximum (float32; ``lowest`` where empty)."""
  x: jax.Array


class Total(NamedTuple):
  """A per-token contribution to a global sum."""
  x: jax.Array


class Max(NamedTuple):
  """A per-token contribution to a global maximum."""
  x: jax.Array


class Min(NamedTuple):
  """A per-token contribution to a global minimum."""
  x: jax.Array


class Out(NamedTuple):
  """A per-token output of the pass."""
  x: jax.Array


_REDUCERS = (SegSum, SegMax, Total, Max, Min, Out)

# Tokens per chunk of a pass; None: one chunk on accelerators, CHUNK_TOKENS_CPU on CPU.
_chunk_tokens: int | None = int(os.environ["MIS_JAX_CHUNK_TOKENS"]) if os.environ.get("MIS_JAX_CHUNK_TOKENS") else None
CHUNK_TOKENS_CPU = 8192


def set_chunk_tokens(n: int | None) -> None:
  """Sets the chunk size of token passes (static: affects functions traced afterwards).

  On XLA:CPU a pass that runs chunk by chunk keeps its intermediates in cache (several times
  faster than materialising each one over the whole batch); on GPU/TPU one chunk (the whole
  batch, fully fused) is best. ``None`` restores that default; the environment variable
  ``MIS_JAX_CHUNK_TOKENS`` sets it at import.
  """
  global _chunk_tokens
  if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
    raise ValueError(f"chunk tokens must be a positive int or None, got {n!r}")
  _chunk_tokens = n


# Whether passes pair per-segment sums into complex64 scatters; None: on CPU only.
_pair: bool | None = None


def _pair_scatters() -> bool:
  return _pair if _pair is not None else jax.default_backend() == "cpu"


def chunk_tokens() -> int | None:
  """The current chunk size of token passes (None: one chunk)."""
  if _chunk_tokens is not None:
    return _chunk_tokens
  return CHUNK_TOKENS_CPU if jax.default_backend() == "cpu" else None


class Chunk:
  """The view of one chunk of tokens inside :meth:`Segments.run_pass`."""

  def __init__(self, arrays: dict, gather_ids, valid):
    self.arrays, self.gather_ids, self.valid = arrays, gather_ids, valid

  def __getitem__(self, name):
    return self.arrays[name]

  def broadcast(self, seg_values: jax.Array) -> jax.Array:
    """Per-segment ``[S]`` values at this chunk's tokens (0 at padding)."""
    return jnp.where(self.valid, seg_values[self.gather_ids], jnp.zeros((), seg_values.dtype))


def _chunking(n_tok: int, size: int | None):
  """``(chunk, num_chunks, tail)`` for a pass: one chunk when ``size`` is None or covers
  everything; else a divisor of ``n_tok`` near ``size`` when there is one (no tail), else
  ``size`` with a smaller tail chunk."""
  if size is None or size >= n_tok:
    return n_tok, 1, 0
  best = max((d for k in range(1, math.isqrt(n_tok) + 1) if n_tok % k == 0
              for d in (k, n_tok // k) if d <= size), default=1)
  if best * 2 >= size:
    return best, n_tok // best, 0
  return size, n_tok // size, n_tok % size


def _run_pass(segs: "Segments", arrays: dict, body) -> dict:
  n_tok = segs.ids.shape[0]
  lanes = segs.lanes
  num_buckets = segs.num_segments * lanes
  base = {"_ids": segs.ids, **arrays}

  def contributions(xs):
    # Scatter buckets and gather indices are computed per chunk (never materialised over
    # the batch); lanes are positions within the chunk modulo P (any fixed split works).
    ids = xs["_ids"]
    valid = ids >= 0
    lane = jax.lax.iota(jnp.int32, ids.shape[0]) & (lanes - 1) if lanes > 1 else 0
    aux = {"valid": valid, "idx": jnp.where(valid, ids * lanes + lane, num_buckets)}
    ch = Chunk({k: v for k, v in xs.items() if not k.startswith("_")}, jnp.where(valid, ids, 0), valid)
    out = body(ch)
    for name, c in out.items():
      if not isinstance(c, _REDUCERS):
        raise TypeError(f"pass contribution {name!r} must be one of {[r.__name__ for r in _REDUCERS]}")
    return out, aux

  _key = lambda group: "segsum:" + ",".join(group)  # carry keys must be strings (sorted)

  def seg_groups(out):
    """Per-segment sums share scatters two by two as the real and imaginary parts of one
    complex64 scatter-add where that is faster (XLA:CPU: ~40 % less time per column)."""
    names = [n for n, c in out.items() if isinstance(c, SegSum)]
    step = 2 if _pair_scatters() else 1
    return [tuple(names[i:i + step]) for i in range(0, len(names), step)]

  def reduce(carry, aux, out):
    new = {}
    for group in seg_groups(out):
      vals = [out[n].x.astype(jnp.float32) for n in group]
      val = jax.lax.complex(*vals) if len(vals) == 2 else vals[0]
      new[_key(group)] = carry[_key(group)].at[aux["idx"]].add(val, mode="drop")
    for name, c in out.items():
      if isinstance(c, (Out, SegSum)):
        continue
      acc = carry[name]
      if isinstance(c, SegMax):
        new[name] = acc.at[aux["idx"]].max(c.x.astype(jnp.float32), mode="drop")
      elif isinstance(c, Total):
        new[name] = acc + jnp.sum(jnp.where(aux["valid"], c.x, 0).astype(jnp.float32))
      elif isinstance(c, Max):
        new[name] = jnp.maximum(acc, jnp.max(jnp.where(aux["valid"], c.x.astype(jnp.float32), _LOWEST)))
      elif isinstance(c, Min):
        new[name] = jnp.minimum(acc, jnp.min(jnp.where(aux["valid"], c.x.astype(jnp.float32), _HIGHEST)))
    return new

  def _varying(x):
    # Inside shard_map the accumulators vary over the mesh axes like the data they sum.
    if segs.axis_name is None:
      return x
    names = (segs.axis_name,) if isinstance(segs.axis_name, str) else tuple(segs.axis_name)
    return jax.lax.pcast(x, names, to="varying")

  def init(out):
    return jax.tree_util.tree_map(_varying, init_values(out))

  def init_values(out):
    carry = {_key(g): jnp.zeros((num_buckets,), jnp.complex64 if len(g) == 2 else jnp.float32)
             for g in seg_groups(out)}
    for name, c in out.items():
      if isinstance(c, SegMax):
        carry[name] = jnp.full((num_buckets,), _LOWEST, jnp.float32)
      elif isinstance(c, Total):
        carry[name] = jnp.zeros((), jnp.float32)
      elif isinstance(c, Max):
        carry[name] = jnp.asarray(_LOWEST, jnp.float32)
      elif isinstance(c, Min):
        carry[name] = jnp.asarray(_HIGHEST, jnp.float32)
    return carry

  def outputs(out):
    return {k: c.x for k, c in out.items() if isinstance(c, Out)}

  # Chunk loops only under a trace: executed eagerly, a loop would be compiled on every call.
  traced = isinstance(segs.ids, jax.core.Tracer)
  size, num, tail = _chunking(n_tok, chunk_tokens() if traced else None)
  if num == 1 and not tail:
    structure, aux = contributions(base)
    carry, outs = reduce(init(structure), aux, structure), outputs(structure)
  elif not tail:
    # Chunks are rows of a free reshape; outputs come back as the scan's stacked results.
    xs = {k: v.reshape(num, size) for k, v in base.items()}
    structure, _ = contributions({k: v[0] for k, v in xs.items()})  # shapes only; dead code

    def step(carry, x):
      out, aux = contributions(x)
      return reduce(carry, aux, out), outputs(out)

    carry, ys = jax.lax.scan(step, init(structure), xs)
    outs = {k: y.reshape(-1) for k, y in ys.items()}
  else:
    # Chunks are dynamic slices (no padded copies) and a smaller last chunk; outputs are
    # written in place.
    piece = lambda start, length: {k: jax.lax.dynamic_slice_in_dim(v, start, length) for k, v in base.items()}
    structure, _ = contributions(piece(0, size))  # shapes only; dead code
    bufs = {k: _varying(jnp.zeros((n_tok,), x.dtype)) for k, x in outputs(structure).items()}

    def write(bufs, start, out):
      return {k: jax.lax.dynamic_update_slice_in_dim(b, out[k].x, start, 0) for k, b in bufs.items()}

    def step(i, state):
      carry, bufs = state
      out, aux = contributions(piece(i * size, size))
      return reduce(carry, aux, out), write(bufs, i * size, out)

    carry, bufs = jax.lax.fori_loop(0, num, step, (init(structure), bufs))
    out, aux = contributions({k: v[num * size:] for k, v in base.items()})
    carry, outs = reduce(carry, aux, out), write(bufs, num * size, out)

  # Complete across lanes and devices, one collective per kind.
  results = dict(outs)
  groups = {SegSum: [], SegMax: [], Total: [], Max: [], Min: []}
  for name, c in structure.items():
    if not isinstance(c, Out):
      groups[type(c)].append(name)
  shape = (segs.num_segments, lanes)
  if groups[SegSum]:
    names, cols = [], []
    for group in seg_groups(structure):
      total = jnp.sum(carry[_key(group)].reshape(shape), axis=1)
      names += group
      cols += [total.real, total.imag] if len(group) == 2 else [total]
    seg = psum(jnp.stack(cols, axis=-1), segs.axis_name)
    results.update({n: seg[:, i] for i, n in enumerate(names)})
  if groups[SegMax]:
    seg = jnp.stack([jnp.max(carry[n].reshape(shape), axis=1) for n in groups[SegMax]], axis=-1)
    seg = pmax(seg, segs.axis_name)
    results.update({n: seg[:, i] for i, n in enumerate(groups[SegMax])})
  for kind, op in ((Total, psum), (Max, pmax), (Min, pmin)):
    if groups[kind]:
      vals = op(jnp.stack([carry[n] for n in groups[kind]]), segs.axis_name)
      results.update({n: vals[i] for i, n in enumerate(groups[kind])})
  return results
