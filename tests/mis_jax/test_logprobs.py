"""token_logprobs: chunked forward and custom VJP against the naive full-logits computation."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mis_jax import token_logprobs

T, D, V, CHUNK = 37, 16, 50, 8


def _inputs(seed=0, lead=(T,), d=D, v=V, scale=0.5):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=lead + (d,)).astype(np.float32)
  lm_head = (scale * rng.normal(size=(d, v))).astype(np.float32)
  targets = rng.integers(0, v, size=lead).astype(np.int32)
  g_lp = rng.normal(size=lead).astype(np.float32)
  g_ent = rng.normal(size=lead).astype(np.float32)
  return jnp.asarray(hidden), jnp.asarray(lm_head), jnp.asarray(targets), g_lp, g_ent


def naive(hidden, lm_head, targets, *, temperature=1.0, return_entropy=False, lm_head_layout="dv"):
  """The full-logits computation: ``log_softmax((h @ W) / τ)`` in float32."""
  w = lm_head.astype(jnp.float32)
  w = w if lm_head_layout == "dv" else w.T
  log_p = jax.nn.log_softmax((hidden.astype(jnp.float32) @ w) / temperature, axis=-1)
  lp = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
  if not return_entropy:
    return lp
  return lp, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def numpy_oracle(hidden, lm_head, targets, temperature):
  """float64 NumPy, one token at a time."""
  h, w, y = (np.asarray(x, np.float64) for x in (hidden, lm_head, targets))
  lps, ents = [], []
  for t in range(h.shape[0]):
    z = h[t] @ w / temperature
    log_p = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    lps.append(log_p[int(y[t])])
    ents.append(-(np.exp(log_p) * log_p).sum())
  return np.array(lps), np.array(ents)


def _loss(fn, g_lp, g_ent, return_entropy, **kw):
  """Scalar ``Σ g_lp·lp (+ Σ g_ent·H)``: random cotangents for both outputs at once."""

  def loss(hidden, lm_head, targets):
    out = fn(hidden, lm_head, targets, return_entropy=return_entropy, **kw)
    if not return_entropy:
      return jnp.sum(out * g_lp)
    return jnp.sum(out[0] * g_lp) + jnp.sum(out[1] * g_ent)

  return loss


def _outputs_and_grads(hidden, lm_head, targets, g_lp, g_ent, *, chunk_size=CHUNK, return_entropy=True, **kw):
  """``(outputs, (d hidden, d lm_head))`` of the chunked and the naive computation, under one
  jit (one compilation per case)."""

  def both(hidden, lm_head, targets):
    chunked = lambda *a, **k: token_logprobs(*a, chunk_size=chunk_size, **k)
    return tuple(
      (
        fn(hidden, lm_head, targets, return_entropy=return_entropy, **kw),
        jax.grad(_loss(fn, g_lp, g_ent, return_entropy, **kw), (0, 1))(hidden, lm_head, targets),
      )
      for fn in (chunked, naive)
    )

  return jax.jit(both)(hidden, lm_head, targets)


def _assert_close(got, want, rtol=1e-5, atol=1e-5, err_msg=""):
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol, err_msg=err_msg
  )


@pytest.mark.parametrize(
  "layout,temperature,return_entropy", [("dv", 1.0, False), ("dv", 0.7, True), ("vd", 1.0, True), ("vd", 1.6, False)]
)
def test_forward_and_gradients_match_naive(temperature, return_entropy, layout):
  hidden, lm_head, targets, g_lp, g_ent = _inputs()
  if layout == "vd":
    lm_head = lm_head.T
  kw = dict(temperature=temperature, lm_head_layout=layout, return_entropy=return_entropy)
  (got, grads), (want, want_grads) = _outputs_and_grads(hidden, lm_head, targets, g_lp, g_ent, **kw)
  oracle = numpy_oracle(hidden, lm_head if layout == "dv" else lm_head.T, targets, temperature)
  if not return_entropy:
    got, want, oracle = (got,), (want,), oracle[:1]
  for name, g, w, o in zip(("logprobs", "entropy"), got, want, oracle):
    assert g.dtype == jnp.float32 and g.shape == (T,)
    _assert_close(g, w, err_msg=name)
    _assert_close(g, o, err_msg=f"{name} vs float64 oracle")
  for name, g, w in zip(("d hidden", "d lm_head"), grads, want_grads):
    assert g.shape == w.shape and g.dtype == jnp.float32
    _assert_close(g, w, err_msg=name)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_any_chunk_size_batched_leading_shape(chunk_size):
  # [B, L] = [3, 13]: T = 39 tokens, a multiple of none of the chunk sizes but 1.
  hidden, lm_head, targets, g_lp, g_ent = _inputs(seed=1, lead=(3, 13))
  ((lp, ent), grads), ((want_lp, want_ent), want) = _outputs_and_grads(
    hidden, lm_head, targets, g_lp, g_ent, chunk_size=chunk_size
  )
  assert lp.shape == ent.shape == (3, 13)
  _assert_close(lp, want_lp)
  _assert_close(ent, want_ent)
  # Padded tail rows receive zero cotangents and must not leak into d lm_head.
  _assert_close(grads[0], want[0])
  _assert_close(grads[1], want[1])


def test_bf16_inputs():
  hidden, lm_head, targets, g_lp, g_ent = _inputs(seed=2)
  h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)
  # The oracle is the float32 computation on the upcast bf16 values.
  h32, w32 = h16.astype(jnp.float32), w16.astype(jnp.float32)
  ((lp, ent), grads), _ = _outputs_and_grads(h16, w16, targets, g_lp, g_ent, temperature=0.8)
  _, ((want_lp, want_ent), want) = _outputs_and_grads(h32, w32, targets, g_lp, g_ent, temperature=0.8)
  # bf16 products are exact in float32: only the summation order differs.
  assert lp.dtype == ent.dtype == jnp.float32
  _assert_close(lp, want_lp)
  _assert_close(ent, want_ent)
  for name, g, w in zip(("d hidden", "d lm_head"), grads, want):
    assert g.dtype == jnp.bfloat16, name
    # dz is rounded to bf16 before the matmuls and the result cast to bf16: a few bf16 ulps.
    scale = float(jnp.max(jnp.abs(w)))
    _assert_close(g, w, rtol=2e-2, atol=2e-2 * scale, err_msg=name)


def test_mixed_dtypes_promote_and_return_input_dtypes():
  hidden, lm_head, targets, g_lp, g_ent = _inputs(seed=3)
  h16 = hidden.astype(jnp.bfloat16)
  (lp, grads), (want_lp, _) = _outputs_and_grads(h16, lm_head, targets, g_lp, g_ent, return_entropy=False)
  _assert_close(lp, want_lp)
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32


def test_jit_equals_no_jit_and_vmap_equals_leading_shape():
  hidden, lm_head, targets, g_lp, g_ent = _inputs(seed=4, lead=(2, 11))
  fn = lambda h, w, y: token_logprobs(h, w, y, chunk_size=4, temperature=1.3, return_entropy=True)
  eager = fn(hidden, lm_head, targets)
  jitted = jax.jit(fn)(hidden, lm_head, targets)
  vmapped = jax.vmap(fn, in_axes=(0, None, 0))(hidden, lm_head, targets)
  for a, b, c in zip(eager, jitted, vmapped):
    _assert_close(b, a, rtol=1e-6, atol=1e-6)
    _assert_close(c, a, rtol=1e-6, atol=1e-6)
  loss = _loss(lambda *a, **k: fn(*a), g_lp, g_ent, True)
  for a, b in zip(
    jax.grad(loss, (0, 1))(hidden, lm_head, targets), jax.jit(jax.grad(loss, (0, 1)))(hidden, lm_head, targets)
  ):
    _assert_close(b, a, rtol=1e-6, atol=1e-6)


def _all_avals(jaxpr):
  """Output avals of every equation, recursing into scan/cond/custom-call sub-jaxprs."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield var.aval
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _all_avals(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _all_avals(sub)


def _largest_logits_like(fn, hidden, lm_head, targets):
  loss = lambda h, w: jnp.sum(sum(jnp.sum(x) for x in fn(h, w, targets)))
  closed = jax.make_jaxpr(jax.grad(loss, (0, 1)))(hidden, lm_head)
  shapes = [tuple(a.shape) for a in _all_avals(closed.jaxpr) if hasattr(a, "shape")]
  # Any array as large as the logits, or with a vocabulary axis and a token-sized axis.
  return [s for s in shapes if int(np.prod(s)) >= T * V or (V in s and any(d >= T for d in _drop_one(s, V)))]


def _drop_one(shape, dim):
  i = shape.index(dim)
  return shape[:i] + shape[i + 1 :]


def test_jaxpr_of_forward_and_backward_has_no_token_by_vocab_array():
  # The memory-bound proof: no intermediate of the traced forward + backward is [T, V]
  # (or as large); the biggest is a [chunk, V] logits block.
  hidden, lm_head, targets, _, _ = _inputs()
  chunked = lambda h, w, y: token_logprobs(h, w, y, chunk_size=CHUNK, return_entropy=True)
  assert _largest_logits_like(chunked, hidden, lm_head, targets) == []
  # The detector does find the naive computation's logits.
  full = lambda h, w, y: naive(h, w, y, return_entropy=True)
  assert (T, V) in _largest_logits_like(full, hidden, lm_head, targets)


def test_entropy_bounds_and_probabilities_sum_to_one():
  hidden, lm_head, _, _, _ = _inputs(seed=5, lead=(3,), v=7, scale=2.0)
  # All V targets for each of the 3 hidden states: exp(logprobs) sums to 1 over the vocabulary.
  every = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32)[None, :], (3, 7))
  h = jnp.broadcast_to(hidden[:, None, :], (3, 7, D))
  lp, ent = token_logprobs(h, lm_head, every, chunk_size=4, return_entropy=True)
  _assert_close(jnp.sum(jnp.exp(lp), axis=-1), np.ones(3))
  assert bool(jnp.all(ent >= 0)) and bool(jnp.all(ent <= np.log(7) + 1e-6))


@settings(max_examples=6)
@given(num_tokens=st.integers(1, 20), chunk_size=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_property_chunked_equals_naive(num_tokens, chunk_size, seed):
  hidden, lm_head, targets, g_lp, g_ent = _inputs(seed=seed, lead=(num_tokens,), d=4, v=6)
  (got, grads), (want, want_grads) = _outputs_and_grads(hidden, lm_head, targets, g_lp, g_ent, chunk_size=chunk_size)
  for a, b in zip(got + grads, want + want_grads):
    _assert_close(a, b)


def test_out_of_range_targets_raise_when_concrete_and_clip_under_jit():
  hidden, lm_head, targets, _, _ = _inputs()
  bad = targets.at[3].set(V).at[5].set(-100)
  with pytest.raises(ValueError, match="'targets' holds ids in \\[-100, 50\\]"):
    token_logprobs(hidden, lm_head, bad, chunk_size=CHUNK)
  got = jax.jit(lambda y: token_logprobs(hidden, lm_head, y, chunk_size=CHUNK))(bad)
  _assert_close(got, naive(hidden, lm_head, jnp.clip(bad, 0, V - 1)))


def test_empty_token_axis():
  _, lm_head, _, _, _ = _inputs()
  lp = token_logprobs(jnp.zeros((2, 0, D)), lm_head, jnp.zeros((2, 0), jnp.int32))
  assert lp.shape == (2, 0)


_H, _W, _Y, _, _ = _inputs()


@pytest.mark.parametrize(
  "args,kwargs,error,match",
  [
    ((_H.astype(jnp.int32), _W, _Y), {}, TypeError, "'hidden' must be a floating-point"),
    ((_H, _W.astype(jnp.int32), _Y), {}, TypeError, "'lm_head' must be a floating-point"),
    ((_H[0, 0], _W, _Y), {}, ValueError, "'hidden' must have shape"),
    ((_H, _W[None], _Y), {}, ValueError, "'lm_head' must have rank 2"),
    ((_H, _W.T, _Y), {}, ValueError, "lm_head_layout='vd'"),
    ((_H, _W, _Y), {"lm_head_layout": "vd"}, ValueError, "'hidden' has shape"),
    ((_H, _W, _Y), {"lm_head_layout": "VD"}, ValueError, "lm_head_layout='VD' is invalid"),
    ((_H, _W[:, :0], _Y[:0]), {}, ValueError, "empty vocabulary"),
    ((_H, _W, _Y.astype(jnp.float32)), {}, TypeError, "'targets' must be an integer"),
    ((_H, _W, _Y > 3), {}, TypeError, "'targets' must be an integer"),
    ((_H, _W, _Y[:-1]), {}, ValueError, "'targets' has shape \\(36,\\)"),
    ((_H, _W, _Y), {"temperature": 0.0}, ValueError, "temperature must be finite and > 0"),
    ((_H, _W, _Y), {"temperature": -1.0}, ValueError, "temperature must be finite and > 0"),
    ((_H, _W, _Y), {"temperature": float("inf")}, ValueError, "temperature must be finite"),
    ((_H, _W, _Y), {"temperature": "hot"}, TypeError, "temperature must be a Python float"),
    ((_H, _W, _Y), {"chunk_size": 0}, ValueError, "chunk_size must be > 0"),
    ((_H, _W, _Y), {"chunk_size": 8.0}, TypeError, "chunk_size must be a Python int"),
    ((_H, _W, _Y), {"return_entropy": "yes"}, TypeError, "return_entropy must be a bool"),
  ],
)
def test_bad_inputs_raise(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    token_logprobs(*args, **kwargs)


def test_traced_temperature_raises():
  with pytest.raises(TypeError, match="temperature must be a static Python float"):
    jax.jit(lambda t: token_logprobs(_H, _W, _Y, temperature=t))(1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_from_the_same_chunks(temperature):
  """OTB's Σ_v π_v², from the chunked pass, equals NumPy's over the full softmax (and over a
  renormalised support); it leaves the other outputs and their gradients unchanged."""
  hidden, lm_head, targets, _, _ = _inputs(seed=4)
  lp, ent, sum_sq = token_logprobs(
    hidden, lm_head, targets, temperature=temperature, chunk_size=CHUNK, return_entropy=True, return_sum_pi_squared=True
  )
  z = np.asarray(hidden, np.float64) @ np.asarray(lm_head, np.float64) / temperature
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(sum_sq), (p**2).sum(-1), rtol=1e-5)
  lp0, ent0 = token_logprobs(hidden, lm_head, targets, temperature=temperature, chunk_size=CHUNK, return_entropy=True)
  np.testing.assert_array_equal(np.asarray(lp), np.asarray(lp0))
  support = np.stack([np.asarray(targets), (np.asarray(targets) + 1) % V, (np.asarray(targets) + 5) % V], -1)
  _, sum_sq_s = token_logprobs(
    hidden, lm_head, targets, temperature=temperature, chunk_size=CHUNK, support_ids=support, return_sum_pi_squared=True
  )
  ps = np.take_along_axis(p, support, -1)
  ps /= ps.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(sum_sq_s), (ps**2).sum(-1), rtol=1e-5)
  grad = lambda f: jax.grad(lambda h: jnp.sum(f(h)[0]))(hidden)
  np.testing.assert_allclose(
    grad(lambda h: token_logprobs(h, lm_head, targets, chunk_size=CHUNK, return_sum_pi_squared=True)),
    grad(lambda h: (token_logprobs(h, lm_head, targets, chunk_size=CHUNK),)),
    rtol=1e-6,
  )
