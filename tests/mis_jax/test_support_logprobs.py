"""token_logprobs over a sampling support (sampling-mask replay): values against a float64 NumPy
loop over explicit supports, gradients against autodiff of the full-logits formula, chunking
invariance, and the input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax

T, D, V, K, CHUNK = 23, 8, 40, 6, 5


def _case(seed=0, temperature=0.8):
  """Random inputs and ragged supports: row t keeps its top-k_t tokens (k_t in 1..K, so the
  sampled token sits anywhere, the support's edge included), padded with -1 at random places;
  some rows have no support (the whole vocabulary)."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(T, D)).astype(np.float32)
  w = (0.7 * rng.normal(size=(D, V))).astype(np.float32)
  z = hidden.astype(np.float64) @ w / temperature
  support = np.full((T, K), -1, np.int32)
  targets = rng.integers(0, V, size=T).astype(np.int32)
  for t in range(T):
    if t % 7 == 3:
      continue  # empty row: untruncated
    k = int(rng.integers(1, K + 1))
    top = np.argsort(-z[t])[:k]
    targets[t] = top[-1] if t % 2 else top[int(rng.integers(0, k))]  # the edge on odd rows
    cols = rng.permutation(K)[:k]  # padding scattered between the ids, order shuffled
    support[t, cols] = rng.permutation(top)
  return hidden, w, targets, support


def numpy_support_oracle(hidden, w, targets, support, temperature):
  """float64 NumPy, one token at a time: log π_S(y), H(π_S) and log Σ_S π."""
  z_all = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64) / temperature
  lps, ents, masses = [], [], []
  for t in range(z_all.shape[0]):
    z = z_all[t]
    log_p = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    ids = sorted({int(v) for v in support[t] if v >= 0}) or list(range(len(z)))
    kept = log_p[ids]
    log_mass = kept.max() + np.log(np.exp(kept - kept.max()).sum())
    log_q = kept - log_mass
    lps.append(log_p[int(targets[t])] - log_mass)
    ents.append(-(np.exp(log_q) * log_q).sum())
    masses.append(log_mass)
  return np.array(lps), np.array(ents), np.array(masses)


def masked_full_logits(hidden, w, targets, support, temperature):
  """The same quantities from full [T, V] logits and a dense membership mask (autodiff)."""
  z = (hidden @ w) / temperature
  member = (
    jnp.zeros(z.shape, bool).at[jnp.arange(T)[:, None], jnp.where(support >= 0, support, V)].set(True, mode="drop")
  )
  member = member | ~jnp.any(support >= 0, axis=-1, keepdims=True)
  lse = jax.nn.logsumexp(z, axis=-1)
  lse_s = jax.nn.logsumexp(jnp.where(member, z, -jnp.inf), axis=-1)
  lp = jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0] - lse_s
  log_q = jnp.where(member, z - lse_s[:, None], 0.0)
  ent = -jnp.sum(jnp.where(member, jnp.exp(log_q) * log_q, 0.0), axis=-1)
  return lp, ent, lse_s - lse


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_values_match_numpy_loop(temperature):
  hidden, w, targets, support = _case(1, temperature)
  lp, ent, mass = jax.jit(
    lambda h, w: mis_jax.token_logprobs(
      h,
      w,
      targets,
      temperature=temperature,
      chunk_size=CHUNK,
      return_entropy=True,
      support_ids=support,
      return_kept_mass=True,
    )
  )(hidden, w)
  want = numpy_support_oracle(hidden, w, targets, support, temperature)
  for got, exp, name in zip((lp, ent, mass), want, ("logprobs", "entropy", "kept_logmass")):
    np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-5, atol=1e-5, err_msg=name)
  assert np.all(np.asarray(mass) <= 1e-6) and np.all(np.asarray(lp) <= 1e-6)
  empty = ~(support >= 0).any(-1)
  np.testing.assert_allclose(np.asarray(mass)[empty], 0.0, atol=1e-6)
  # Without a support: the full-vocabulary log-prob is log π_S + log M.
  full = mis_jax.token_logprobs(hidden, w, targets, temperature=temperature, chunk_size=CHUNK)
  np.testing.assert_allclose(np.asarray(full), np.asarray(lp + mass), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_gradients_match_autodiff_of_full_logits(layout):
  hidden, w, targets, support = _case(2)
  rng = np.random.default_rng(3)
  g = [rng.normal(size=T).astype(np.float32) for _ in range(3)]
  head = w if layout == "dv" else np.ascontiguousarray(w.T)

  def ours(h, head):
    out = mis_jax.token_logprobs(
      h,
      head,
      targets,
      temperature=0.8,
      chunk_size=CHUNK,
      return_entropy=True,
      support_ids=support,
      return_kept_mass=True,
      lm_head_layout=layout,
    )
    return sum(jnp.sum(o * gi) for o, gi in zip(out, g))

  def reference(h, head):
    out = masked_full_logits(h, head if layout == "dv" else head.T, targets, support, 0.8)
    return sum(jnp.sum(o * gi) for o, gi in zip(out, g))

  got = jax.jit(jax.grad(ours, (0, 1)))(hidden, head)
  want = jax.jit(jax.grad(reference, (0, 1)))(hidden, head)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_chunked_equals_one_chunk_and_mask_equals_minus_one_padding():
  hidden, w, targets, support = _case(4)
  one = mis_jax.token_logprobs(hidden, w, targets, chunk_size=T, return_entropy=True, support_ids=support)
  many = mis_jax.token_logprobs(hidden, w, targets, chunk_size=4, return_entropy=True, support_ids=support)
  # The same supports given as ids + mask (padding entries hold arbitrary ids).
  rng = np.random.default_rng(5)
  filled = np.where(support >= 0, support, rng.integers(0, V, size=support.shape)).astype(np.int32)
  masked = mis_jax.token_logprobs(
    hidden, w, targets, chunk_size=4, return_entropy=True, support_ids=filled, support_mask=support >= 0
  )
  for a, b, c in zip(one, many, masked):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


def test_leading_shape_and_bf16():
  hidden, w, targets, support = _case(6)
  lp = mis_jax.token_logprobs(
    hidden[:22].reshape(2, 11, D),
    w,
    targets[:22].reshape(2, 11),
    support_ids=support[:22].reshape(2, 11, K),
    chunk_size=CHUNK,
  )
  flat = mis_jax.token_logprobs(hidden[:22], w, targets[:22], support_ids=support[:22], chunk_size=CHUNK)
  assert lp.shape == (2, 11) and lp.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(lp).reshape(-1), np.asarray(flat))
  bf = mis_jax.token_logprobs(
    jnp.asarray(hidden[:22], jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), targets[:22], support_ids=support[:22]
  )
  assert bf.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(bf), np.asarray(flat), atol=0.1)


def test_input_checks():
  hidden, w, targets, support = _case(7)
  call = lambda **kw: mis_jax.token_logprobs(hidden, w, targets, **kw)
  with pytest.raises(ValueError, match="not in its support"):
    bad = support.copy()
    row = int(np.argmax((support >= 0).any(-1)))
    bad[row] = np.where(bad[row] == targets[row], -1, bad[row])
    call(support_ids=bad)
  with pytest.raises(ValueError, match=r"'support_ids' has shape \(23,\)"):
    call(support_ids=support[:, 0])
  with pytest.raises(ValueError, match="outside"):
    call(support_ids=np.where(support >= 0, support + V, -1))
  with pytest.raises(TypeError, match="'support_ids' must be an integer array"):
    call(support_ids=support.astype(np.float32))
  with pytest.raises(TypeError, match="'support_mask' must be a bool array"):
    call(support_ids=support, support_mask=(support >= 0).astype(np.int32))
  with pytest.raises(ValueError, match="without 'support_ids'"):
    call(support_mask=support >= 0)
  with pytest.raises(ValueError, match="width K=0"):
    call(support_ids=np.zeros((T, 0), np.int32))


def _numpy_sampling_metrics(lp_s, log_m, q, mask, seg, mode):
  """A NumPy loop over sequences of mis_jax.sampling_metrics' definitions (contract §8's R_m)."""
  values = {
    "sampling_kept_mass_mean": np.exp(log_m),
    "sampling_ratio_mean_replay": np.exp(lp_s - q),
    "sampling_ratio_mean_full": np.exp(lp_s + log_m - q),
  }
  values["sampling_ratio_outside_replay"] = (np.abs(values["sampling_ratio_mean_replay"] - 1) > 0.1) * 1.0
  values["sampling_ratio_outside_full"] = (np.abs(values["sampling_ratio_mean_full"] - 1) > 0.1) * 1.0
  r = lp_s + log_m - q
  values["sampling_k3_kl_full"] = np.exp(r) - r - 1
  out = {}
  for name, x in values.items():
    if mode == "token-mean":
      out[name] = x[mask].sum() / mask.sum()
    else:
      means = [x[(seg == s) & mask].mean() for s in np.unique(seg[seg >= 0]) if ((seg == s) & mask).any()]
      out[name] = np.mean(means)
  out["sampling_kept_mass_min"] = np.exp(log_m)[mask].min()
  return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sampling_metrics_match_a_numpy_loop(mode):
  rng = np.random.default_rng(8)
  seg = np.repeat(np.arange(6), [5, 9, 3, 7, 4, 8])
  seg = np.concatenate([seg, [-1, -1, -1]]).astype(np.int32)
  t = seg.size
  mask = (rng.uniform(size=t) < 0.8) & (seg >= 0)
  lp_s = -rng.uniform(0.0, 3.0, t).astype(np.float32)
  log_m = -rng.uniform(0.0, 0.5, t).astype(np.float32)
  q = (lp_s + rng.normal(0, 0.05, t)).astype(np.float32)
  got = jax.jit(lambda *a: mis_jax.sampling_metrics(*a, num_segments=6, metric_reduction=mode))(
    lp_s, log_m, q, mask, seg
  )
  want = _numpy_sampling_metrics(
    lp_s.astype(np.float64), log_m.astype(np.float64), q.astype(np.float64), mask, seg, mode
  )
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(float(got[name]), want[name], rtol=2e-5, atol=1e-6, err_msg=name)
  with pytest.raises(ValueError, match="shape mismatch: 'kept_logmass'"):
    mis_jax.sampling_metrics(lp_s, log_m[:-1], q, mask, seg, num_segments=6)
  with pytest.raises(ValueError, match="metric_reduction='mean' is invalid"):
    mis_jax.sampling_metrics(lp_s, log_m, q, mask, seg, num_segments=6, metric_reduction="mean")


def test_gradients_match_numpy_finite_differences():
  """d/dW and d/dh of Σ g·(lp, H, log M) against central differences of the float64 NumPy loop."""
  hidden, w, targets, support = _case(9)
  rng = np.random.default_rng(10)
  g = [rng.normal(size=T) for _ in range(3)]

  def objective(h, w_):
    return sum(np.dot(gi, o) for gi, o in zip(g, numpy_support_oracle(h, w_, targets, support, 0.8)))

  def ours(h, w_):
    out = mis_jax.token_logprobs(
      h, w_, targets, temperature=0.8, chunk_size=CHUNK, return_entropy=True, support_ids=support, return_kept_mass=True
    )
    return sum(jnp.sum(o * gi.astype(np.float32)) for o, gi in zip(out, g))

  dh, dw = jax.jit(jax.grad(ours, (0, 1)))(hidden, w)
  h64, w64, eps = hidden.astype(np.float64), w.astype(np.float64), 1e-5
  for _ in range(6):
    i, j = int(rng.integers(0, D)), int(rng.integers(0, V))
    e = np.zeros_like(w64)
    e[i, j] = eps
    fd = (objective(h64, w64 + e) - objective(h64, w64 - e)) / (2 * eps)
    np.testing.assert_allclose(float(dw[i, j]), fd, rtol=1e-3, atol=1e-4)
    t, k = int(rng.integers(0, T)), int(rng.integers(0, D))
    e = np.zeros_like(h64)
    e[t, k] = eps
    fd = (objective(h64 + e, w64) - objective(h64 - e, w64)) / (2 * eps)
    np.testing.assert_allclose(float(dh[t, k]), fd, rtol=1e-3, atol=1e-4)


def test_concrete_jax_arrays_closed_over_under_jit():
  """Supports held as (concrete) jax Arrays and closed over by a jitted function are checked and
  used as constants, as NumPy ones are."""
  hidden, w, targets, support = _case(11)
  want = mis_jax.token_logprobs(hidden, w, targets, support_ids=support, chunk_size=CHUNK)
  got = jax.jit(
    lambda h: mis_jax.token_logprobs(
      h,
      jnp.asarray(w),
      jnp.asarray(targets),
      chunk_size=CHUNK,
      support_ids=jnp.asarray(support),
      support_mask=jnp.asarray(support >= 0),
    )
  )(hidden)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
