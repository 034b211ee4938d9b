"""How the correction is made fast: fused, chunked passes over the tokens (the pass engine).

Everything about speed lives here, behind one interface: :func:`run_pass` runs a *pass body*
(a function of one chunk of tokens that returns per-token contributions: :class:`SegSum`,
:class:`SegMax`, :class:`Total`, :class:`Max`, :class:`Min`, :class:`Out`) over the whole
batch and returns the global results. How it runs is fixed by a frozen, hashable
:class:`PassOptions` passed explicitly (a static argument, so part of every jit cache key);
:func:`pass_options` resolves it from where the inputs live and their shapes. Nothing here
reads the environment or keeps module-level state.

The tricks, each kept because it pays on ``make bench`` (docs/performance.md):

- chunks (``chunk_tokens``): on XLA:CPU a pass that runs chunk by chunk keeps every
  intermediate of its body in cache instead of materialising it over the batch (~3x);
  accelerators fuse the whole batch, so they run one chunk.
- lanes (``lanes``): consecutive tokens of a packed segment hit one accumulator, a serial
  read-add-write chain; token ``t`` of segment ``s`` adds into bucket ``s·P + t mod P``
  (summed at the end) instead, which breaks the chain (~2.5x per scatter on XLA:CPU).
- pairing (``paired``): two per-segment sums share one complex64 scatter-add as its real
  and imaginary parts (XLA:CPU: ~40 % less time per column), and two per-segment values
  one gather (:meth:`Chunk.broadcast_two`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

AxisName = str | Sequence[str] | None

# Identities of float32 max and min reductions.
LOWEST = float(np.finfo(np.float32).min)
HIGHEST = float(np.finfo(np.float32).max)

CPU_CHUNK_TOKENS = 8192
MAX_LANES = 8


def psum(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def pmax(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.pmax(x, axis_name)


def pmin(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.pmin(x, axis_name)


# --- options ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PassOptions:
  """How token passes run (static: hashable, part of the jit cache key).

  Attributes:
    chunk_tokens: tokens per chunk, or None for one chunk (the whole batch, fully fused).
    lanes: scatter lanes per segment, a power of two (1: a plain scatter).
    paired: whether per-segment sums are paired into complex64 scatters.
  """

  chunk_tokens: int | None = None
  lanes: int = 1
  paired: bool = False

  def __post_init__(self):
    n = self.chunk_tokens
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
      raise ValueError(f"PassOptions.chunk_tokens must be a positive int or None, got {n!r}")
    if (
      isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or self.lanes < 1 or self.lanes & (self.lanes - 1)
    ):
      raise ValueError(f"PassOptions.lanes must be a power of two >= 1, got {self.lanes!r}")
    if not isinstance(self.paired, bool):
      raise ValueError(f"PassOptions.paired must be a bool, got {self.paired!r}")


def platform_of(x) -> str:
  """The platform a computation on ``x`` runs on: the devices of a placed array; else the
  default device, where jit places NumPy inputs (and where a traced value's computation runs
  unless the caller says otherwise by passing :class:`PassOptions`)."""
  sharding = getattr(x, "sharding", None)  # None for NumPy arrays and for traced values
  devices = getattr(sharding, "device_set", None)
  if devices:
    return next(iter(devices)).platform
  device = jax.config.jax_default_device
  if device is None:
    return jax.devices()[0].platform
  return device if isinstance(device, str) else device.platform


def pass_options(segment_ids, num_segments: int, *, platform: str | None = None) -> PassOptions:
  """:class:`PassOptions` for a batch, from where ``segment_ids`` lives and its shape.

  CPU: chunks of :data:`CPU_CHUNK_TOKENS` and paired scatters; accelerators: one chunk,
  unpaired. Lanes (any platform) pay for long segments and cost cache for many short ones:
  a power of two, at most :data:`MAX_LANES`, at most a sixteenth of the mean segment length.
  Call it outside ``jit`` to tie the options to the data's devices.
  """
  cpu = (platform or platform_of(segment_ids)) == "cpu"
  n_tok = math.prod(np.shape(segment_ids))
  mean_len = n_tok // max(int(num_segments), 1)
  lanes = 1 << max(0, min(MAX_LANES, mean_len // 16).bit_length() - 1)
  return PassOptions(chunk_tokens=CPU_CHUNK_TOKENS if cpu else None, lanes=lanes, paired=cpu)


def chunking(n_tok: int, size: int | None):
  """``(chunk, num_chunks, tail)`` of a pass: one chunk when ``size`` is None or covers
  everything; else a divisor of ``n_tok`` near ``size`` when there is one (no tail: a free
  reshape into rows), else ``size`` with a smaller tail chunk."""
  if size is None or size >= n_tok:
    return n_tok, 1, 0
  best = max(
    (d for k in range(1, math.isqrt(n_tok) + 1) if n_tok % k == 0 for d in (k, n_tok // k) if d <= size), default=1
  )
  if best * 2 >= size:
    return best, n_tok // best, 0
  return size, n_tok // size, n_tok % size


# --- contributions of a pass body ------------------------------------------------------


class SegSum(NamedTuple):
  """A per-token contribution to a per-segment sum (float32)."""

  x: jax.Array


class SegMax(NamedTuple):
  """A per-token contribution to a per-segment maximum (float32; ``LOWEST`` where empty)."""

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


class Chunk:
  """The view of one chunk of tokens inside a pass body."""

  def __init__(self, arrays: dict, gather_ids, valid, paired: bool):
    self.arrays, self.gather_ids, self.valid, self.paired = arrays, gather_ids, valid, paired

  def __getitem__(self, name):
    return self.arrays[name]

  def broadcast(self, seg_values: jax.Array) -> jax.Array:
    """Per-segment ``[S]`` values at this chunk's tokens (0 at padding)."""
    return jnp.where(self.valid, seg_values[self.gather_ids], jnp.zeros((), seg_values.dtype))

  def broadcast_two(self, a: jax.Array, b: jax.Array):
    """Two per-segment ``[S]`` arrays (float32 or bool) at this chunk's tokens; with
    ``paired`` options one complex64 gather reads both (XLA:CPU: one gather instead of two)."""
    if not self.paired:
      return self.broadcast(a), self.broadcast(b)
    as_f32 = lambda x: x.astype(jnp.float32)
    both = self.broadcast(jax.lax.complex(as_f32(a), as_f32(b)))
    back = lambda x, like: x != 0 if like.dtype == jnp.bool_ else x
    return back(both.real, a), back(both.imag, b)


# --- the engine ------------------------------------------------------------------------


def _carry_key(group) -> str:  # scan carry keys must be strings
  return "segsum:" + ",".join(group)


class _Pass:
  """One pass's static plan: how a chunk's contributions are computed, accumulated in the
  carry (one bucket per segment and lane), and completed across lanes and devices."""

  def __init__(self, options: PassOptions, num_segments: int, axis_name: AxisName, body):
    self.options, self.num_segments, self.axis_name, self.body = options, num_segments, axis_name, body
    self.lanes = options.lanes
    self.num_buckets = num_segments * options.lanes

  def contributions(self, xs):
    """``body``'s contributions for one chunk of ``xs`` and the chunk's bucket indices.
    Buckets and gather indices are computed per chunk (never materialised over the batch);
    lanes are positions within the chunk modulo P (any fixed split works)."""
    ids = xs["_ids"]
    valid = ids >= 0
    lane = jax.lax.iota(jnp.int32, ids.shape[0]) & (self.lanes - 1) if self.lanes > 1 else 0
    aux = {"valid": valid, "idx": jnp.where(valid, ids * self.lanes + lane, self.num_buckets)}
    ch = Chunk(
      {k: v for k, v in xs.items() if not k.startswith("_")}, jnp.where(valid, ids, 0), valid, self.options.paired
    )
    out = self.body(ch)
    for name, c in out.items():
      if not isinstance(c, _REDUCERS):
        raise TypeError(f"pass contribution {name!r} must be one of {[r.__name__ for r in _REDUCERS]}")
    return out, aux

  def seg_groups(self, out):
    """Per-segment sums scattered together: pairs (one complex64 scatter) when paired."""
    names = [n for n, c in out.items() if isinstance(c, SegSum)]
    step = 2 if self.options.paired else 1
    return [tuple(names[i : i + step]) for i in range(0, len(names), step)]

  def varying(self, x):
    """Inside shard_map the accumulators vary over the mesh axes like the data they sum."""
    if self.axis_name is None:
      return x
    names = (self.axis_name,) if isinstance(self.axis_name, str) else tuple(self.axis_name)
    return jax.lax.pcast(x, names, to="varying")

  def init(self, out):
    carry = {
      _carry_key(g): jnp.zeros((self.num_buckets,), jnp.complex64 if len(g) == 2 else jnp.float32)
      for g in self.seg_groups(out)
    }
    for name, c in out.items():
      if isinstance(c, SegMax):
        carry[name] = jnp.full((self.num_buckets,), LOWEST, jnp.float32)
      elif isinstance(c, Total):
        carry[name] = jnp.zeros((), jnp.float32)
      elif isinstance(c, Max):
        carry[name] = jnp.asarray(LOWEST, jnp.float32)
      elif isinstance(c, Min):
        carry[name] = jnp.asarray(HIGHEST, jnp.float32)
    return jax.tree_util.tree_map(self.varying, carry)

  def reduce(self, carry, aux, out):
    """The carry after one chunk's contributions."""
    new = {}
    for group in self.seg_groups(out):
      vals = [out[n].x.astype(jnp.float32) for n in group]
      val = jax.lax.complex(*vals) if len(vals) == 2 else vals[0]
      new[_carry_key(group)] = carry[_carry_key(group)].at[aux["idx"]].add(val, mode="drop")
    for name, c in out.items():
      acc = carry.get(name)
      if isinstance(c, SegMax):
        new[name] = acc.at[aux["idx"]].max(c.x.astype(jnp.float32), mode="drop")
      elif isinstance(c, Total):
        new[name] = acc + jnp.sum(jnp.where(aux["valid"], c.x.astype(jnp.float32), 0.0))
      elif isinstance(c, Max):
        new[name] = jnp.maximum(acc, jnp.max(jnp.where(aux["valid"], c.x.astype(jnp.float32), LOWEST)))
      elif isinstance(c, Min):
        new[name] = jnp.minimum(acc, jnp.min(jnp.where(aux["valid"], c.x.astype(jnp.float32), HIGHEST)))
    return new

  @staticmethod
  def outputs(out):
    return {k: c.x for k, c in out.items() if isinstance(c, Out)}

  def complete(self, structure, carry) -> dict:
    """The accumulators summed over lanes and completed across devices, one collective per kind."""
    results = {}
    kinds = {SegSum: [], SegMax: [], Total: [], Max: [], Min: []}
    for name, c in structure.items():
      if not isinstance(c, Out):
        kinds[type(c)].append(name)
    shape = (self.num_segments, self.lanes)
    if kinds[SegSum]:
      names, cols = [], []
      for group in self.seg_groups(structure):
        total = jnp.sum(carry[_carry_key(group)].reshape(shape), axis=1)
        names += group
        cols += [total.real, total.imag] if len(group) == 2 else [total]
      seg = psum(jnp.stack(cols, axis=-1), self.axis_name)
      results.update({n: seg[:, i] for i, n in enumerate(names)})
    if kinds[SegMax]:
      seg = jnp.stack([jnp.max(carry[n].reshape(shape), axis=1) for n in kinds[SegMax]], axis=-1)
      seg = pmax(seg, self.axis_name)
      results.update({n: seg[:, i] for i, n in enumerate(kinds[SegMax])})
    for kind, op in ((Total, psum), (Max, pmax), (Min, pmin)):
      if kinds[kind]:
        vals = op(jnp.stack([carry[n] for n in kinds[kind]]), self.axis_name)
        results.update({n: vals[i] for i, n in enumerate(kinds[kind])})
    return results


def _one_chunk(plan: _Pass, base: dict):
  """The whole batch as one chunk (fully fused)."""
  structure, aux = plan.contributions(base)
  return structure, plan.reduce(plan.init(structure), aux, structure), plan.outputs(structure)


def _scanned_chunks(plan: _Pass, base: dict, size: int, num: int):
  """Chunks that divide the batch: rows of a free reshape, a ``lax.scan`` over them; outputs
  come back as the scan's stacked results."""
  xs = {k: v.reshape(num, size) for k, v in base.items()}
  structure, _ = plan.contributions({k: v[0] for k, v in xs.items()})  # shapes only; dead code

  def step(carry, x):
    out, aux = plan.contributions(x)
    return plan.reduce(carry, aux, out), plan.outputs(out)

  carry, ys = jax.lax.scan(step, plan.init(structure), xs)
  return structure, carry, {k: y.reshape(-1) for k, y in ys.items()}


def _sliced_chunks(plan: _Pass, base: dict, size: int, num: int, n_tok: int):
  """Chunks that do not divide the batch: dynamic slices (no padded copies) in a
  ``fori_loop`` and a smaller last chunk; outputs are written in place."""

  def piece(start, length):
    return {k: jax.lax.dynamic_slice_in_dim(v, start, length) for k, v in base.items()}

  structure, _ = plan.contributions(piece(0, size))  # shapes only; dead code
  bufs = {k: plan.varying(jnp.zeros((n_tok,), x.dtype)) for k, x in plan.outputs(structure).items()}

  def write(bufs, start, out):
    return {k: jax.lax.dynamic_update_slice_in_dim(b, out[k].x, start, 0) for k, b in bufs.items()}

  def step(i, state):
    carry, bufs = state
    out, aux = plan.contributions(piece(i * size, size))
    return plan.reduce(carry, aux, out), write(bufs, i * size, out)

  carry, bufs = jax.lax.fori_loop(0, num, step, (plan.init(structure), bufs))
  out, aux = plan.contributions({k: v[num * size :] for k, v in base.items()})
  return structure, plan.reduce(carry, aux, out), write(bufs, num * size, out)


def run_pass(options: PassOptions, segment_ids, num_segments: int, axis_name: AxisName, arrays: dict, body) -> dict:
  """One pass over the tokens: ``body(chunk)`` -> ``{name: contribution}``.

  Args:
    options: the static :class:`PassOptions`.
    segment_ids: flat int32 ``[T]`` (-1: padding).
    num_segments: static number of segments ``S``.
    axis_name: mesh axis name(s) inside ``shard_map``; every result is then global.
    arrays: flat ``[T]`` arrays the body reads as ``chunk[name]``.
    body: a pure function of a :class:`Chunk` returning a dict of contributions.

  Returns:
    ``{name: result}``: ``[S]`` for segment reductions, scalars for totals, ``[T]`` outputs.
  """
  plan = _Pass(options, num_segments, axis_name, body)
  base = {"_ids": segment_ids, **arrays}
  n_tok = segment_ids.shape[0]
  size, num, tail = chunking(n_tok, options.chunk_tokens)
  if num == 1 and not tail:
    structure, carry, outs = _one_chunk(plan, base)
  elif not tail:
    structure, carry, outs = _scanned_chunks(plan, base, size, num)
  else:
    structure, carry, outs = _sliced_chunks(plan, base, size, num, n_tok)
  return {**outs, **plan.complete(structure, carry)}
