"""Attention backends for packed rows.

Layout everywhere: `q: [B, T, H, D]`, `k, v: [B, S, KV, D]` with `H = KV * G` (grouped-query
attention: query head `h` uses kv head `h // G`), output `[B, T, H, D]` in q's dtype,

  `out = softmax(q kᵀ · D^-1/2 + mask) v`,

with scores, softmax statistics and accumulators in float32 whatever the input dtype.

- `dense_attention`: materialises the `[B, H, T, S]` scores under an explicit mask (used for
  the KV-cache decode, and as the reference);
- `blocked_attention`: flash-attention-style online softmax over key blocks with a
  `custom_vjp` backward, O(T) memory, skipping the block pairs the segment-causal mask empties;
- `packed_attention(..., backend=)`: dispatch by name; "fused" runs a Pallas kernel where the
  platform has one that takes segment ids and falls back to "blocked" elsewhere.

Packed rows: token `i` may attend to token `j` iff `segment_ids[i] == segment_ids[j]` and
`j <= i`. Segments are contiguous within a row; padding has segment id -1, attends only to
padding, and its outputs are unspecified (but finite).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("dense", "blocked", "fused")

_MASKED = float(jnp.finfo(jnp.float32).min)
# The Pallas kernels' default sequence block; rows are padded to a multiple of it for them.
_FUSED_BLOCK = 128


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """`softmax(q kᵀ / sqrt(D), masked to finfo.min where mask is False) v`, `mask: [B, T, S]`
  bool (True = may attend). Scores and softmax in float32; probabilities cast to v's dtype."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * d**-0.5
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
  return out.astype(q.dtype)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """`[B, T]` ids -> `[B, T, T]` bool: `mask[b, i, j] = seg[b, i] == seg[b, j] and j <= i`."""
  idx = jnp.arange(segment_ids.shape[1])
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & (idx[None, :, None] >= idx[None, None, :])


# ----------------------------------------------------------------------------------------------
# Blocked (flash) attention


def _run_starts(segment_ids: jax.Array) -> jax.Array:
  """`start[b, i]`: first index of the run of equal ids containing `i`, so token `i` attends
  within `[start(i), i]` (contiguous segments). A cummax of run-start indices: no positions."""
  b, t = segment_ids.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
  new_run = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return lax.cummax(jnp.where(new_run, idx, 0), axis=1)


def _key_block_ranges(segment_ids: jax.Array, block_q: int, block_k: int):
  """Per query block `qi`, the key blocks `[lo[qi], hi[qi]]` it needs:
  `lo = min_{b, i in qi} start(i) // block_k`, `hi = max_{b, i in qi} i // block_k`
  (over the batch rows too, so loop bounds are scalars). int32 `[nQ]` each."""
  b, t = segment_ids.shape
  n_q = -(-t // block_q)
  pad = n_q * block_q - t
  start = _run_starts(segment_ids)
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
  # Padded query rows must not widen the ranges: neutral values for min / max.
  start = jnp.pad(start, ((0, 0), (0, pad)), constant_values=t)
  idx = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
  lo = start.reshape(b, n_q, block_q).min(axis=(0, 2)) // block_k
  hi = idx.reshape(b, n_q, block_q).max(axis=(0, 2)) // block_k
  return lo, hi


def _query_block_ranges(lo: jax.Array, hi: jax.Array, n_k: int):
  """Per key block `kj`, the query blocks `[qlo[kj], qhi[kj]]` that visit it, from the tiny
  `[nQ, nK]` need matrix `lo[qi] <= kj <= hi[qi]`; an unneeded block gets an empty range."""
  n_q = lo.shape[0]
  kj = jnp.arange(n_k, dtype=jnp.int32)
  need = (kj[None, :] >= lo[:, None]) & (kj[None, :] <= hi[:, None])
  used = need.any(axis=0)
  first = jnp.argmax(need, axis=0).astype(jnp.int32)
  last = (n_q - 1 - jnp.argmax(need[::-1], axis=0)).astype(jnp.int32)
  return jnp.where(used, first, 0), jnp.where(used, last, -1)


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """`[B, T, ...]` -> block-major `[T // block, B, block, ...]` (a block is one dynamic index)."""
  b, t = x.shape[:2]
  return jnp.swapaxes(x.reshape((b, t // block, block) + x.shape[2:]), 0, 1)


def _unblocks(x: jax.Array) -> jax.Array:
  """Inverse of `_blocks`."""
  n, b, block = x.shape[:3]
  return jnp.swapaxes(x, 0, 1).reshape((b, n * block) + x.shape[3:])


def _block_scores(q_blk, k_blk, sq, sk, qi, kj, block_q, block_k, scale):
  """Scores `[B, KV, G, bq, bk]` (f32) of one block pair and its exact element mask
  `[B, 1, 1, bq, bk]` (same segment and causal, by absolute index)."""
  rows = qi * block_q + jnp.arange(block_q, dtype=jnp.int32)
  cols = kj * block_k + jnp.arange(block_k, dtype=jnp.int32)
  mask = (sq[:, :, None] == sk[:, None, :]) & (cols[None, None, :] <= rows[None, :, None])
  s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
  return s * scale, mask[:, None, None, :, :]


def _flash_forward(q, k, v, seg_q, seg_k, lo, hi, block_q, block_k):
  """Online softmax per query block over key blocks `lo[qi]..hi[qi]`:
  `m' = max(m, rowmax s)`, `l' = l e^{m-m'} + Σ e^{s-m'}`, `acc' = acc e^{m-m'} + e^{s-m'} v`;
  `out = acc / l`, `lse = m + log l`. Returns `out [B, Tq, H, D]` and `lse [nQ, B, KV, G, bq]`."""
  b, tq, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  scale = d**-0.5
  qb = _blocks(q.reshape(b, tq, kvh, g, d), block_q)
  kb, vb = _blocks(k, block_k), _blocks(v, block_k)
  sqb, skb = _blocks(seg_q, block_q), _blocks(seg_k, block_k)
  n_q = qb.shape[0]

  def one_query_block(xs):
    qi, q_blk, sq, lo_i, hi_i = xs

    def step(kj, carry):
      m, denom, acc = carry
      k_blk = lax.dynamic_index_in_dim(kb, kj, keepdims=False)
      v_blk = lax.dynamic_index_in_dim(vb, kj, keepdims=False)
      sk = lax.dynamic_index_in_dim(skb, kj, keepdims=False)
      s, mask = _block_scores(q_blk, k_blk, sq, sk, qi, kj, block_q, block_k, scale)
      s = jnp.where(mask, s, _MASKED)
      m_new = jnp.maximum(m, s.max(axis=-1))
      # where, not a product: a fully masked row so far has m_new == finfo.min and exp(0) = 1.
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      denom = denom * corr + p.sum(axis=-1)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
      return m_new, denom, acc * corr[..., None] + pv

    init = (
      jnp.full((b, kvh, g, block_q), _MASKED, jnp.float32),
      jnp.zeros((b, kvh, g, block_q), jnp.float32),
      jnp.zeros((b, kvh, g, block_q, d), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(lo_i, hi_i + 1, step, init)
    # denom == 0 only for rows that see nothing (internal query padding): keep them finite.
    seen = denom > 0
    safe_l = jnp.where(seen, denom, 1.0)
    out = (acc / safe_l[..., None]).astype(q.dtype)
    lse = jnp.where(seen, m + jnp.log(safe_l), 0.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)), lse

  # Sequential over query blocks (lax.map = scan): per-block traced bounds keep the skipping.
  out, lse = lax.map(one_query_block, (jnp.arange(n_q, dtype=jnp.int32), qb, sqb, lo, hi))
  return _unblocks(out).reshape(b, tq, h, d), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, seg_q, seg_k, lo, hi, block_q, block_k):
  return _flash_forward(q, k, v, seg_q, seg_k, lo, hi, block_q, block_k)[0]


def _flash_fwd(q, k, v, seg_q, seg_k, lo, hi, block_q, block_k):
  out, lse = _flash_forward(q, k, v, seg_q, seg_k, lo, hi, block_q, block_k)
  return out, (q, k, v, seg_q, seg_k, lo, hi, out, lse)


def _flash_bwd(block_q, block_k, res, d_out):
  """Flash-attention-2 backward, recomputing `p = exp(s - lse)` per visited block pair:
  `delta = rowsum(dO ∘ O)`, `dv = Σ pᵀ dO`, `dp = dO vᵀ`, `ds = p ∘ (dp - delta)`,
  `dq = Σ ds k · scale`, `dk = Σ dsᵀ q · scale` (summed over the G heads sharing a kv head).
  One loop over query blocks for dq, one over key blocks for dk / dv."""
  q, k, v, seg_q, seg_k, lo, hi, out, lse = res
  b, tq, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  scale = d**-0.5
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  # [nQ, B, KV, G, bq], the layout of lse.
  delta_b = jnp.transpose(_blocks(delta.reshape(b, tq, kvh, g), block_q), (0, 1, 3, 4, 2))
  qb = _blocks(q.reshape(b, tq, kvh, g, d), block_q)
  dob = _blocks(d_out.astype(q.dtype).reshape(b, tq, kvh, g, d), block_q)
  kb, vb = _blocks(k, block_k), _blocks(v, block_k)
  sqb, skb = _blocks(seg_q, block_q), _blocks(seg_k, block_k)
  n_q, n_k = qb.shape[0], kb.shape[0]
  index = lambda x, i: lax.dynamic_index_in_dim(x, i, keepdims=False)

  def pair(qi, kj, q_blk, do_blk, sq, lse_blk, delta_blk, k_blk, v_blk, sk):
    s, mask = _block_scores(q_blk, k_blk, sq, sk, qi, kj, block_q, block_k, scale)
    p = jnp.where(mask, jnp.exp(s - lse_blk[..., None]), 0.0)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
    return p, p * (dp - delta_blk[..., None])

  def dq_block(xs):
    qi, q_blk, do_blk, sq, lse_blk, delta_blk, lo_i, hi_i = xs

    def step(kj, dq):
      k_blk = index(kb, kj)
      _, ds = pair(qi, kj, q_blk, do_blk, sq, lse_blk, delta_blk, k_blk, index(vb, kj), index(skb, kj))
      return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(lo_i, hi_i + 1, step, jnp.zeros((b, block_q, kvh, g, d), jnp.float32))
    return dq * scale

  dq = lax.map(dq_block, (jnp.arange(n_q, dtype=jnp.int32), qb, dob, sqb, lse, delta_b, lo, hi))

  qlo, qhi = _query_block_ranges(lo, hi, n_k)

  def dkv_block(xs):
    kj, k_blk, v_blk, sk, qlo_j, qhi_j = xs

    def step(qi, carry):
      dk, dv = carry
      q_blk, do_blk = index(qb, qi), index(dob, qi)
      p, ds = pair(qi, kj, q_blk, do_blk, index(sqb, qi), index(lse, qi), index(delta_b, qi), k_blk, v_blk, sk)
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(d_out.dtype), do_blk, preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), q_blk, preferred_element_type=jnp.float32)
      return dk, dv

    zeros = jnp.zeros((b, block_k, kvh, d), jnp.float32)
    dk, dv = lax.fori_loop(qlo_j, qhi_j + 1, step, (zeros, zeros))
    return dk * scale, dv

  dk, dv = lax.map(dkv_block, (jnp.arange(n_k, dtype=jnp.int32), kb, vb, skb, qlo, qhi))
  dq = _unblocks(dq).reshape(b, tq, h, d)
  # Integer inputs (segment ids, block ranges) get no cotangent.
  return (dq.astype(q.dtype), _unblocks(dk).astype(k.dtype), _unblocks(dv).astype(v.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_shapes(q, k, v, segment_ids):
  b, t, h, d = q.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
    raise ValueError(f"self-attention needs k, v: [B, T, KV, D] matching q {q.shape}, got k {k.shape}, v {v.shape}")
  if h % k.shape[2]:
    raise ValueError(f"query heads {h} not a multiple of kv heads {k.shape[2]}")
  if segment_ids.shape != (b, t):
    raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}")


def _clamp_blocks(t: int, block_q: int, block_k: int) -> tuple[int, int]:
  if block_q < 1 or block_k < 1:
    raise ValueError(f"block sizes must be positive, got {block_q=}, {block_k=}")
  return min(block_q, t), min(block_k, t)


def blocked_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, block_q: int = 512, block_k: int = 512
) -> jax.Array:
  """Segment-causal self-attention over packed rows, flash-attention style, in pure JAX.

  Same result as `dense_attention(q, k, v, segment_mask(segment_ids))` at real tokens:
  `out_i = Σ_{j: seg_j = seg_i, j <= i} softmax_j(q_i·k_j / sqrt(D)) v_j`, with O(T) memory
  (residuals `out` and the per-query log-sum-exp; never a `[T, T]` array) in the forward and
  the `custom_vjp` backward. Query block `qi` visits only key blocks
  `min start(i) // block_k .. max i // block_k` over its tokens (and the batch), so a row of
  short segments costs about `nQ` block pairs instead of `nQ (nQ + 1) / 2`.

  Requires contiguous segments within a row (padding, id -1, typically a run at the end: its
  outputs are unspecified but finite). `T` need not be a multiple of the blocks (padded
  internally); blocks are clamped to `T`.
  """
  _check_shapes(q, k, v, segment_ids)
  b, t = segment_ids.shape
  block_q, block_k = _clamp_blocks(t, block_q, block_k)
  seg = segment_ids.astype(jnp.int32)
  lo, hi = _key_block_ranges(seg, block_q, block_k)
  pad_q, pad_k = -(-t // block_q) * block_q - t, -(-t // block_k) * block_k - t
  # Internal padding: ids below every real one, different for queries and keys, so padded
  # keys are never attended and padded query rows (sliced off) see nothing.
  floor = jnp.min(seg)
  seg_q = jnp.concatenate([seg, jnp.full((b, pad_q), floor - 2, jnp.int32)], axis=1)
  seg_k = jnp.concatenate([seg, jnp.full((b, pad_k), floor - 1, jnp.int32)], axis=1)
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))
  out = _flash(pad(q, pad_q), pad(k, pad_k), pad(v, pad_k), seg_q, seg_k, lo, hi, block_q, block_k)
  return out[:, :t]


def attention_block_pairs(segment_ids, *, block_q: int = 512, block_k: int = 512) -> int:
  """Number of (query block, key block) pairs `blocked_attention`'s forward visits for these
  concrete `[B, T]` segment ids: `Σ_qi hi[qi] - lo[qi] + 1` (the backward visits as many)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  block_q, block_k = _clamp_blocks(seg.shape[1], block_q, block_k)
  lo, hi = _key_block_ranges(seg, block_q, block_k)
  return int(np.sum(np.maximum(np.asarray(hi) - np.asarray(lo) + 1, 0)))


# ----------------------------------------------------------------------------------------------
# Fused kernels and dispatch

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    logger.warning(message)


def _platform(x=None) -> str:
  """Platform of a concrete input's devices, else of the default device (under tracing)."""
  try:
    return next(iter(x.devices())).platform
  except Exception:  # tracers, numpy arrays
    return jax.devices()[0].platform


def resolve_attention_backend(backend: str, platform: str | None = None) -> tuple[str, str | None]:
  """`(effective_backend, reason_or_None)`: what `packed_attention(backend=backend)` runs on
  this platform, and why it differs from the request (None when it does not). Shape-specific
  kernel rejections are only known at call time (`packed_attention` logs them)."""
  if backend not in ATTENTION_BACKENDS:
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")
  if backend != "fused":
    return backend, None
  platform = platform or _platform()
  try:
    if platform in ("gpu", "cuda", "rocm"):
      from jax.experimental.pallas.ops.gpu import attention as _  # noqa: F401
    elif platform == "tpu":
      from jax.experimental.pallas.ops.tpu import flash_attention as _  # noqa: F401,F811
    else:
      return "blocked", f"no fused attention kernel with segment ids on platform {platform!r}"
  except Exception as e:  # Pallas / Triton / Mosaic missing from this install
    return "blocked", f"fused attention kernel for {platform!r} unavailable: {e!r}"
  return "fused", None


def _fused_attention(q, k, v, segment_ids, platform: str) -> jax.Array:
  """Pallas segment-ids + causal kernel (GPU Triton `mha`, TPU `flash_attention`). Heads are
  repeated to H (the kernels need equal heads) and rows padded to a multiple of the kernel
  block with an id matching no real token. Raises ValueError / NotImplementedError for shapes
  or dtypes the kernel rejects."""
  b, t, h, d = q.shape
  g = h // k.shape[2]
  if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32) or not (k.dtype == v.dtype == q.dtype):
    raise NotImplementedError(f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}")
  pad = -(-t // _FUSED_BLOCK) * _FUSED_BLOCK - t
  seg = segment_ids.astype(jnp.int32)
  seg = jnp.concatenate([seg, jnp.full((b, pad), jnp.min(seg) - 1, jnp.int32)], axis=1)
  widths = ((0, 0), (0, pad), (0, 0), (0, 0))
  q = jnp.pad(q, widths)
  k, v = (jnp.pad(jnp.repeat(x, g, axis=2), widths) for x in (k, v))
  if platform == "tpu":
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa

    if d % 128:
      raise NotImplementedError(f"head_dim {d} is not a multiple of 128")
    heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
    out = tpu_fa.flash_attention(
      heads_first(q),
      heads_first(k),
      heads_first(v),
      segment_ids=tpu_fa.SegmentIds(seg, seg),
      causal=True,
      sm_scale=d**-0.5,
    )
    out = heads_first(out)
  else:
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    if d < 16 or d > 256:
      raise NotImplementedError(f"head_dim {d} outside the Triton kernel's 16..256")
    out = gpu_attention.mha(q, k, v, seg, sm_scale=d**-0.5, causal=True)
  return out[:, :t].astype(q.dtype)


def packed_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  backend: str,
  block_q: int = 512,
  block_k: int = 512,
) -> jax.Array:
  """Segment-causal self-attention over packed rows with the named backend (one of
  `ATTENTION_BACKENDS`); all give `dense_attention(q, k, v, segment_mask(segment_ids))` at
  real tokens. "fused" falls back to "blocked" (with one logged warning per reason) where no
  kernel exists or the kernel rejects the shapes / dtypes."""
  effective, reason = resolve_attention_backend(backend, _platform(q))
  if reason is not None:
    _warn_once(f"attention backend {backend!r} -> {effective!r}: {reason}")
  if effective == "dense":
    return dense_attention(q, k, v, segment_mask(segment_ids))
  if effective == "fused":
    _check_shapes(q, k, v, segment_ids)
    try:
      return _fused_attention(q, k, v, segment_ids, _platform(q))
    except (ValueError, NotImplementedError, TypeError) as e:
      _warn_once(f"attention backend 'fused' -> 'blocked': kernel rejected q {q.shape} {q.dtype}, k {k.shape}: {e}")
  return blocked_attention(q, k, v, segment_ids, block_q=block_q, block_k=block_k)
