"""Attention backends for packed rows: blocked (flash) attention against the dense reference
(values, gradients, jit, bf16), isolation of segments and padding, block skipping, the fused
backend's fallback, and the O(T) memory of the blocked backward."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.models import attention
from trainers.models.attention import (
  ATTENTION_BACKENDS,
  attention_block_pairs,
  blocked_attention,
  dense_attention,
  packed_attention,
  resolve_attention_backend,
  segment_mask,
)

H, KV, D = 4, 2, 16


def _row(lengths, t):
  """Segment ids 0, 1, ... of the given lengths, then -1 padding up to `t`."""
  ids = [np.full(n, s, np.int32) for s, n in enumerate(lengths)]
  return np.concatenate(ids + [np.full(t - sum(lengths), -1, np.int32)])


# name -> (T, segment lengths of row 0, of row 1); rows are padded with -1 to T.
LAYOUTS = {
  "several-segments-padding": (45, [10, 1, 29], [3, 17, 20, 2]),
  "length-one-segments": (40, [1] * 12 + [20], [1, 1, 2, 1, 30]),
  "one-long-segment": (48, [48], [47]),
  "short-segments": (96, [5] * 19, [3, 7] * 9),
}
# Each layout with block shapes that cross its segment edges differently; (64, 64) clamps to T.
CASES = [
  ("several-segments-padding", 8, 16),
  ("several-segments-padding", 16, 8),
  ("length-one-segments", 16, 16),
  ("length-one-segments", 8, 16),
  ("one-long-segment", 16, 8),
  ("one-long-segment", 64, 64),
  ("short-segments", 16, 8),
]


def _inputs(t, seed=0):
  """q, k, v and an output cotangent, float32 (numpy draws: no per-shape compilations)."""
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  return draw(2, t, H, D), draw(2, t, KV, D), draw(2, t, KV, D), draw(2, t, H, D)


def _segments(name):
  t, a, b = LAYOUTS[name]
  return jnp.asarray(np.stack([_row(a, t), _row(b, t)]))


def _dense(q, k, v, seg):
  return dense_attention(q, k, v, segment_mask(seg))


def _loss(fn, seg, ct):
  """Σ out · ct over real tokens only: padding outputs are unspecified."""
  real = (seg >= 0)[:, :, None, None]
  return lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v).astype(jnp.float32) * ct, 0.0))


def _grads(fn, seg, ct):
  return jax.grad(_loss(fn, seg, ct), argnums=(0, 1, 2))


@pytest.mark.parametrize("layout,block_q,block_k", CASES, ids=[f"{c[0]}-q{c[1]}k{c[2]}" for c in CASES])
@pytest.mark.slow
def test_blocked_matches_dense_values_and_grads(layout, block_q, block_k):
  seg = _segments(layout)
  q, k, v, ct = _inputs(seg.shape[1])
  blocked = lambda q, k, v: blocked_attention(q, k, v, seg, block_q=block_q, block_k=block_k)
  dense = lambda q, k, v: _dense(q, k, v, seg)
  real = np.asarray(seg >= 0)
  # One compilation per backend: value and grads together.
  both = lambda fn: jax.jit(lambda q, k, v: (fn(q, k, v), _grads(fn, seg, ct)(q, k, v)))
  out, g_blocked = both(blocked)(q, k, v)
  ref, g_dense = both(dense)(q, k, v)
  out = np.asarray(out)
  assert np.isfinite(out).all()  # padding rows too
  np.testing.assert_allclose(out[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)
  for gb, gd in zip(g_blocked, g_dense):
    assert np.isfinite(np.asarray(gb)).all()
    np.testing.assert_allclose(np.asarray(gb), np.asarray(gd), rtol=1e-5, atol=1e-5)


def test_jit_matches_eager():
  seg = _segments("several-segments-padding")
  q, k, v, ct = _inputs(seg.shape[1])
  fn = lambda q, k, v, seg: blocked_attention(q, k, v, seg, block_q=8, block_k=16)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v, seg)), np.asarray(fn(q, k, v, seg)), rtol=1e-6, atol=1e-6)
  grad = lambda q, k, v, seg: _grads(lambda *a: fn(*a, seg), seg, ct)(q, k, v)
  for a, b in zip(jax.jit(grad)(q, k, v, seg), grad(q, k, v, seg)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bf16_close_to_float32_dense():
  """bf16 inputs (8 mantissa bits: ~4e-3 relative rounding of q, k, v and the probabilities)
  stay within atol = rtol = 3e-2 of the float32 dense result (seen: 9e-3; dense in bf16: 1.3e-2),
  grads within 6e-2 (seen: 2.5e-2 on grads up to 5.5); outputs and grads are bf16."""
  seg = _segments("several-segments-padding")
  q, k, v, ct = _inputs(seg.shape[1])
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  blocked = lambda q, k, v: blocked_attention(q, k, v, seg, block_q=8, block_k=16)
  out = jax.jit(blocked)(qb, kb, vb)
  assert out.dtype == jnp.bfloat16
  real = np.asarray(seg >= 0)
  ref = np.asarray(_dense(q, k, v, seg))
  out = np.asarray(out.astype(jnp.float32))
  np.testing.assert_allclose(out[real], ref[real], atol=3e-2, rtol=3e-2)
  grads = jax.jit(_grads(blocked, seg, ct))(qb, kb, vb)
  ref_grads = jax.jit(_grads(lambda *a: _dense(*a, seg), seg, ct))(q, k, v)
  for g, r in zip(grads, ref_grads):
    assert g.dtype == jnp.bfloat16
    g = np.asarray(g.astype(jnp.float32))
    np.testing.assert_allclose(g, np.asarray(r), atol=6e-2, rtol=6e-2)


def test_segments_and_padding_do_not_leak():
  """Changing the q/k/v of one segment (or of the padding, to huge values) leaves every other
  token's output bit-identical, and all outputs finite."""
  seg = _segments("several-segments-padding")
  q, k, v, _ = _inputs(seg.shape[1])
  attend = jax.jit(lambda q, k, v: blocked_attention(q, k, v, seg, block_q=8, block_k=16))
  fn = lambda q, k, v: np.asarray(attend(q, k, v))
  base = fn(q, k, v)
  for target, scale in ((1, 3.0), (2, -2.0), (-1, 1e4)):
    hit = (seg == target)[:, :, None, None]
    q2, k2, v2 = (jnp.where(hit, x * scale + 1.0, x) for x in (q, k, v))
    out = fn(q2, k2, v2)
    assert np.isfinite(out).all()
    others = ~np.asarray(seg == target)
    np.testing.assert_array_equal(out[others], base[others])
    assert not np.array_equal(out[~others], base[~others])


def test_block_pairs_skip_masked_blocks():
  t = 64
  one = np.zeros((1, t), np.int32)
  short4 = np.repeat(np.arange(16, dtype=np.int32), 4)[None]  # 16 segments of 4
  short6 = np.repeat(np.arange(11, dtype=np.int32), 6)[None, :t]  # starts 0, 6, ..., 60
  # One segment: query block qi needs key blocks 0..qi -> 1 + 2 + 3 + 4.
  assert attention_block_pairs(one, block_q=16, block_k=16) == 10
  # Segments inside blocks: only the diagonal, nQ pairs.
  assert attention_block_pairs(short4, block_q=16, block_k=16) == 4
  # Length 6 crosses block edges: blocks 1 (token 16 starts at 12) and 2 (32 starts at 30)
  # also need their left neighbour: 1 + 2 + 2 + 1.
  assert attention_block_pairs(short6, block_q=16, block_k=16) == 6
  # Bounds are taken over the batch: the long row decides.
  assert attention_block_pairs(np.concatenate([one, short4]), block_q=16, block_k=16) == 10
  # block_q=8, block_k=16, one segment: query block qi needs 0..(8 qi + 7) // 16.
  assert attention_block_pairs(one, block_q=8, block_k=16) == 1 + 1 + 2 + 2 + 3 + 3 + 4 + 4
  # Blocks clamp to T: a single pair.
  assert attention_block_pairs(one, block_q=512, block_k=512) == 1


def test_backends_dispatch_and_fused_falls_back_on_cpu(caplog, monkeypatch):
  monkeypatch.setattr(attention, "_WARNED", set())
  assert ATTENTION_BACKENDS == ("dense", "blocked", "fused")
  assert resolve_attention_backend("dense") == ("dense", None)
  assert resolve_attention_backend("blocked") == ("blocked", None)
  effective, reason = resolve_attention_backend("fused")
  assert effective == "blocked" and "cpu" in reason
  seg = _segments("several-segments-padding")
  q, k, v, _ = _inputs(seg.shape[1])
  blocked = np.asarray(packed_attention(q, k, v, seg, backend="blocked", block_q=8, block_k=16))
  fused = lambda q, k, v: packed_attention(q, k, v, seg, backend="fused", block_q=8, block_k=16)
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    for call in (fused, jax.jit(fused)):  # eager, and traced as the trainer calls it
      np.testing.assert_allclose(np.asarray(call(q, k, v)), blocked, rtol=1e-6, atol=1e-6)
  warnings = [r for r in caplog.records if r.name == attention.__name__]
  assert len(warnings) == 1  # once per reason
  assert "'fused'" in warnings[0].getMessage() and "'blocked'" in warnings[0].getMessage()
  real = np.asarray(seg >= 0)
  dense = np.asarray(packed_attention(q, k, v, seg, backend="dense"))
  np.testing.assert_allclose(dense[real], blocked[real], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="fused"):
    packed_attention(q, k, v, seg, backend="flash")
  with pytest.raises(ValueError, match="dense"):
    resolve_attention_backend("splash")


def test_fused_kernel_rejection_falls_back(caplog, monkeypatch):
  """Where a kernel exists but rejects the shapes, the blocked result comes back with a warning."""
  monkeypatch.setattr(attention, "_WARNED", set())
  monkeypatch.setattr(attention, "resolve_attention_backend", lambda backend, platform=None: ("fused", None))

  def reject(*args):
    raise NotImplementedError("head_dim 16 unsupported")

  monkeypatch.setattr(attention, "_fused_attention", reject)
  seg = _segments("one-long-segment")
  q, k, v, _ = _inputs(seg.shape[1])
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    out = packed_attention(q, k, v, seg, backend="fused", block_q=16, block_k=16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(blocked_attention(q, k, v, seg, block_q=16, block_k=16)))
  assert any("head_dim 16 unsupported" in r.getMessage() for r in caplog.records)


def test_blocked_backward_memory_is_linear():
  """Compiled grad of a sum of attention at T=4096: the blocked temporaries stay far below the
  dense `[B, H, T, T]` float32 scores (4096² · 4 B · 2 heads = 128 MiB per copy)."""
  t = 4096
  q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def temp_bytes(fn):
    grad = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s)), argnums=(0, 1, 2)))
    return grad.lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes

  blocked = temp_bytes(lambda q, k, v, s: blocked_attention(q, k, v, s, block_q=256, block_k=256))
  dense = temp_bytes(lambda q, k, v, s: dense_attention(q, k, v, segment_mask(s)))
  assert dense > 128 * 2**20
  assert blocked < dense / 4, (blocked, dense)
  assert blocked < 16 * 2**20, blocked
