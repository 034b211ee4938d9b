"""Batch-invariant arithmetic: the decoder's `arithmetic: batch_invariant` (exact mode).

A float sum's value depends on the order of its additions. XLA:CPU picks that order per program
and per shape: its dot products run another kernel for one row than for many and for 17 rows
than for 64 (every row of a `[M, 1024] × [1024, 1024]` float32 product differs in the last bits
between `M = 1` and `M = 2`, and even at `K = 64` under `--xla_backend_optimization_level=0`),
its row sums are trees, not left-to-right sums, and LLVM contracts a multiply and an add into an
FMA wherever they land in one fused kernel. So an engine decoding one token over a KV cache and a
trainer scoring the whole sequence at once, or one sequence alone and inside a batch, round
differently (`benchmarks/exact.py --probe` measures this machine's).

Here every float reduction of the forward is spelled out in one order, the same whatever the
batch, the row, the padding or the number of queries:

    ordered_sum(x)_i = (((0 + x_0) + x_1) + ...) + x_{n-1}      (left to right)
    matmul(x, w)_n    = ordered over k of  x_k · w_kn            (each product rounded, then added)

built of element-wise operations only (a multiply and an add per term, `_chain`), whose value per
element no program or shape can change. Zero terms leave a left-to-right sum unchanged (`a + 0 =
a`), so masked keys (probability exactly 0), left padding, other sequences of a packed row and a
longer attention window add nothing: a token's attention over its sequence is the same sum in an
engine's cache window and in a trainer's packed row. Maxima (`max`, `top_k`, `argmax`) are exact
in any order and stay XLA's.

Every product that an addition consumes passes a guard (`_rounded`, a select LLVM cannot see
through), so it is rounded before it is added: LLVM contracts a multiply and an add into an FMA
(one rounding) wherever both land in one fused kernel, and whether they do depends on how XLA
fuses each program (at LLVM's level 0 a 64-term sum fused with the `exp` after it came out
contracted, alone it did not). Square roots and reciprocals are IEEE's correctly rounded `sqrt`
and division (not XLA's `rsqrt`), and the sigmoid is `1 / (1 + exp(-x))`; `exp`, `log`, `sin` and
`cos` are XLA's, the same code in every kernel at one optimisation level.

A 16-bit compute dtype is emulated in float32 carriers, rounded to nearest-even
(`lax.reduce_precision`, which XLA never drops: `convert(convert(x, bf16), f32)` may be folded away
under XLA's default excess precision) wherever the default model's bfloat16 path rounds: after
every product (`Linear`, attention, the head), norm, RoPE, activation and residual add. Products of
two bfloat16 values are exact in float32, and accumulation is float32.

The programs that run this arithmetic compile with `COMPILER_OPTIONS`: LLVM's optimisation level
pinned (whatever `XLA_FLAGS` says: the test suite sets 0) and no fusion handed to a kernel
library. The tests check these sums bitwise against a NumPy loop, and the engine's decoding
against the trainer's pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ARITHMETICS = ("default", "batch_invariant")

# XLA options of every program computing with this arithmetic (`jax.jit(..., compiler_options=)`):
# LLVM's level pinned to XLA's default, 2, whatever `XLA_FLAGS` says (at 0, LLVM's fast instruction
# selector compiles some kernels and falls back to the full one in others: every kernel compiled
# alike is what makes XLA's own `exp` one function); and no fusion handed to a library (YNNPACK,
# XNNPACK, oneDNN), whose kernels XLA:CPU picks by shape and whose `exp` rounds otherwise than XLA's
# own (`exp(z - max z)` over `[3, 40, 64]` went to YNNPACK and differed in the last bit from the
# same rows computed alone). At level 2 the tiny model's exact step ran 0.67x the default's speed,
# at level 0 0.18x.
COMPILER_OPTIONS = {
  "xla_backend_optimization_level": 2,
  "xla_cpu_experimental_ynn_fusion_type": "",
  "xla_cpu_experimental_xnn_fusion_type": "",
  "xla_cpu_experimental_onednn_fusion_type": "",
}

# Terms of a left-to-right sum per iteration of its loop: the programs stay small and fast (the tiny
# model's sampler compiled in 5 s and decoded 8 rows × 16 tokens in 6 ms with 2; 15 s and 14 ms with
# every sum of up to 64 terms written out).
_UNROLL = 2
_MASKED = float(jnp.finfo(jnp.float32).min)


def check_arithmetic(arithmetic: str) -> str:
  if arithmetic not in ARITHMETICS:
    raise ValueError(f"arithmetic={arithmetic!r}; allowed: {', '.join(ARITHMETICS)}")
  return arithmetic


def round_to(x: jax.Array, dtype) -> jax.Array:
  """float32 `x` rounded to the nearest `dtype` value (ties to even), kept in float32."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x
  finfo = jnp.finfo(dtype)
  return lax.reduce_precision(x, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)


def carried(x: jax.Array, dtype) -> jax.Array:
  """`x` (any float dtype) as a float32 carrier of `dtype` values: `round_to(float32(x), dtype)`."""
  return round_to(x.astype(jnp.float32), dtype)


def _expand(x: jax.Array, ndim: int) -> jax.Array:
  return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _rounded(x: jax.Array) -> jax.Array:
  """`x`, as a value an addition cannot absorb unrounded: a select on `x`'s own NaN-ness (the
  same value, NaN included) between a product and the add that consumes it, so LLVM cannot
  contract the two into an FMA (XLA keeps the select; a `reduce_precision` to float32 or a bit
  trick it or LLVM folds away)."""
  return jnp.where(x != x, jnp.nan, x)


def _chain(term, n: int, init: jax.Array) -> jax.Array:
  """`init + term(0) + term(1) + ... + term(n - 1)`, left to right, each term rounded first
  (`_rounded`): a `fori_loop` over blocks of `_UNROLL` terms, the rest written out (the same order)."""
  acc = init
  start = 0
  if n > _UNROLL:
    blocks = n // _UNROLL

    def body(b, acc):
      for j in range(_UNROLL):
        acc = acc + _rounded(term(b * _UNROLL + j))
      return acc

    acc = lax.fori_loop(0, blocks, body, acc)
    start = blocks * _UNROLL
  for i in range(start, n):
    acc = acc + _rounded(term(i))
  return acc


def _at(x: jax.Array, i) -> jax.Array:
  return lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def ordered_contract(a: jax.Array, b: jax.Array) -> jax.Array:
  """`Σ_i a[i] · b[i]` over the leading axis, left to right, float32 (`a[i]`, `b[i]` broadcast
  against each other: same ranks)."""
  if a.shape[0] != b.shape[0]:
    raise ValueError(f"contracted axes differ: {a.shape} vs {b.shape}")
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  shape = jnp.broadcast_shapes(a.shape[1:], b.shape[1:])
  return _chain(lambda i: _at(a, i) * _at(b, i), a.shape[0], jnp.zeros(shape, jnp.float32))


def ordered_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """`Σ x` over `axis`, left to right, float32."""
  x = jnp.moveaxis(x.astype(jnp.float32), axis, 0)
  return _chain(lambda i: _at(x, i), x.shape[0], jnp.zeros(x.shape[1:], jnp.float32))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x [..., K] @ w [K, N]` in float32, each output `Σ_k x_k w_kn` left to right over `k`."""
  if x.shape[-1] != w.shape[0] or w.ndim != 2:
    raise ValueError(f"matmul of {x.shape} and {w.shape}")
  lead = x.shape[:-1]
  xs = jnp.moveaxis(x, -1, 0)[..., None]  # [K, ..., 1]
  ws = w.reshape((w.shape[0],) + (1,) * len(lead) + (w.shape[1],))  # [K, 1.., N]
  return ordered_contract(xs, ws)


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
  """A `Linear` layer in `dtype`: `round(x @ round(kernel))`, then `round(· + round(bias))`."""
  y = round_to(matmul(x, carried(kernel, dtype)), dtype)
  if bias is not None:
    y = round_to(y + _expand(carried(bias, dtype), y.ndim), dtype)
  return y


def reciprocal_sqrt(v: jax.Array) -> jax.Array:
  """`1 / sqrt(v)`: IEEE's correctly rounded square root, then division (XLA's `rsqrt` differs from
  kernel to kernel; the guard keeps XLA from rewriting `1 / sqrt` into it)."""
  return 1.0 / _rounded(jnp.sqrt(v))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
  """`round(round(w) · round(x · 1/sqrt(Σ x² · (1/D) + eps)))`, the sum over the last axis ordered."""
  mean_sq = _rounded(ordered_sum(x * x, -1) * np.float32(1.0 / x.shape[-1]))
  y = round_to(x * reciprocal_sqrt(mean_sq + np.float32(eps))[..., None], dtype)
  return round_to(_expand(carried(weight, dtype), x.ndim) * y, dtype)


def sigmoid(x: jax.Array) -> jax.Array:
  """`1 / (1 + exp(-x))` (XLA's `logistic` is not one formula across kernels)."""
  return 1.0 / (1.0 + _rounded(jnp.exp(-x)))


def silu(x: jax.Array) -> jax.Array:
  """`x · sigmoid(x)`."""
  return x * sigmoid(x)


def logsumexp(z: jax.Array) -> jax.Array:
  """`m + log Σ exp(z - m)` over the last axis (`m` its max; `-inf` entries add 0), the sum ordered."""
  m = jnp.max(z, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return m[..., 0] + jnp.log(ordered_sum(jnp.exp(z - m), -1))


def log_softmax(z: jax.Array) -> jax.Array:
  """`z - m - log Σ exp(z - m)` over the last axis, the sum ordered."""
  shifted = z - jnp.max(z, axis=-1, keepdims=True)
  return shifted - jnp.log(ordered_sum(jnp.exp(shifted), -1))[..., None]


def softmax(z: jax.Array) -> jax.Array:
  """`exp(z - m) / Σ exp(z - m)` over the last axis, the sum ordered."""
  e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
  return e / ordered_sum(e, -1)[..., None]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype) -> jax.Array:
  """`dense_attention`'s formula (`trainers.models.attention`) with ordered sums: `q [B, T, H, D]`,
  `k, v [B, S, KV, D]` float32 carriers, `mask [B, T, S]`; scores `Σ_d q_d k_d · D^-½` and the
  softmax in float32, the probabilities rounded to `dtype`, `out = round(Σ_s p_s v_s)` over the
  keys in slot order (masked keys have `p = 0` exactly and add nothing)."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  qs = jnp.transpose(q.reshape(b, t, kvh, g, d), (4, 0, 2, 3, 1))[..., None]  # [D, B, KV, G, T, 1]
  ks = jnp.transpose(k, (3, 0, 2, 1))[:, :, :, None, None, :]  # [D, B, KV, 1, 1, S]
  scores = _rounded(ordered_contract(qs, ks) * np.float32(d**-0.5))  # [B, KV, G, T, S]
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
  probs = round_to(softmax(scores), dtype)
  ps = jnp.moveaxis(probs, -1, 0)[..., None]  # [S, B, KV, G, T, 1]
  vs = jnp.transpose(v, (1, 0, 2, 3))[:, :, :, None, None, :]  # [S, B, KV, 1, 1, D]
  out = round_to(ordered_contract(ps, vs), dtype)  # [B, KV, G, T, D]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, dtype) -> jax.Array:
  """The decoder's RoPE (`decoder.rope`) in `dtype`: `round(round(x·cos) + round(rotate_half(x)·sin))`,
  `cos, sin` of `positions · inv_freq` rounded to `dtype`; `inv_freq` a NumPy constant."""
  freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = round_to(jnp.cos(emb), dtype), round_to(jnp.sin(emb), dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return round_to(_rounded(round_to(x * cos, dtype)) + _rounded(round_to(rotated * sin, dtype)), dtype)


def temperature_log_softmax(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """`log_softmax(logits / T)` as exact mode's sampler and trainer both compute it: `logits · (1/T)`
  (`temperature`: float32, a scalar or one per leading row), then `log_softmax` with its sum ordered."""
  inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
  return log_softmax(_rounded(logits * inv_t.reshape(inv_t.shape + (1,) * (logits.ndim - inv_t.ndim))))
