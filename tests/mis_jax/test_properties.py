"""Hypothesis property tests on one bucketed shape ([4, 16], 8 segments): empty segments,
all-masked batches, length-1 sequences, log-ratios of ±1e4, NaN/inf in masked positions."""

import functools

import jax
import numpy as np
from hypothesis import given, strategies as st

import mis_jax
import oracle
from helpers import loss_keys

ROWS, ROW_LEN, NSEG = 4, 16, 8
CONFIGS = {
  "decoupled-reference": mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml")),
  "reinforce-seq-mask": mis_jax.LossConfig(
    use_tis=True,
    use_rollout_logprobs=True,
    loss_agg_mode="token-mean",
    mis=mis_jax.MISConfig(
      tis_level="sequence",
      tis_mode="mask",
      tis_upper_bound=5.0,
      use_rs=True,
      rs_level="geometric",
      rs_veto_threshold=1e-6,
      tis_batch_normalize=True,
    ),
  ),
  "decoupled-geo-clip": mis_jax.LossConfig(
    use_tis=True,
    denominator="original",
    loss_agg_mode="seq-mean-token-sum",
    policy_loss={"name": "vanilla", "eps_clip_c": 3.0},
    mis=mis_jax.MISConfig(tis_level="geometric", tis_mode="clip", tis_batch_normalize=True),
  ),
}


@functools.lru_cache(maxsize=None)
def loss_and_grad(name):
  cfg = CONFIGS[name]
  f = lambda lp, batch: mis_jax.policy_loss(lp, batch, cfg)
  return jax.jit(jax.value_and_grad(f, has_aux=True))


@st.composite
def packed_inputs(draw, extreme=False, all_masked=False):
  n = draw(st.integers(0, NSEG))
  lengths = draw(st.lists(st.integers(0, ROW_LEN), min_size=n, max_size=n))
  while True:  # keep within the bucket
    try:
      packing = mis_jax.plan_packing(lengths, ROW_LEN, num_rows=ROWS)
      break
    except ValueError:
      lengths[lengths.index(max(lengths))] //= 2
  big = st.sampled_from([1e4, -1e4, 50.0, -50.0, 0.0])
  small = st.floats(-3, 3, width=32, allow_subnormal=False)
  seqs = []
  for length in lengths:
    m = np.array(draw(st.lists(st.booleans(), min_size=length, max_size=length)), bool)
    if all_masked:
      m[:] = False
    q = np.array(draw(st.lists(st.floats(-8, 0, width=32, allow_subnormal=False), min_size=length, max_size=length)))
    r = np.array(draw(st.lists(big if extreme else small, min_size=length, max_size=length)))
    d = np.array(draw(st.lists(small, min_size=length, max_size=length))) * 0.1
    adv = round(draw(st.floats(-2, 2, width=32, allow_subnormal=False)), 3)  # no FTZ-sized values
    junk = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    seqs.append(
      dict(
        m=m,
        q=np.where(m, q, junk),
        o=np.where(m, q + r, junk),
        lp=np.where(m, q + r + d, junk),
        adv=np.where(m, adv, junk),
      )
    )
  get = lambda k: packing.pack([s[k].astype(np.float32) for s in seqs], np.nan, np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    old_logprobs=get("o"),
    num_segments=NSEG,
  )
  return seqs, batch, get("lp")


def _finite(tree):
  return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree_util.tree_leaves(tree))


def _sanitized(batch, lp):
  """The same inputs with masked/padding positions replaced by zeros."""
  m = np.asarray(batch.loss_mask)
  z = lambda x: np.where(m, x, 0.0).astype(np.float32)
  return batch.replace(
    advantages=z(batch.advantages), rollout_logprobs=z(batch.rollout_logprobs), old_logprobs=z(batch.old_logprobs)
  ), z(lp)


@given(packed_inputs(extreme=True), st.sampled_from(sorted(CONFIGS)))
def test_extreme_log_ratios_and_junk_in_masked_positions(data, name):
  _, batch, lp = data
  (loss, metrics), grad = loss_and_grad(name)(lp, batch)
  assert _finite((loss, metrics, grad))
  clean_batch, clean_lp = _sanitized(batch, lp)
  (loss2, metrics2), grad2 = loss_and_grad(name)(clean_lp, clean_batch)
  np.testing.assert_allclose(float(loss), float(loss2), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(grad2), rtol=1e-6, atol=1e-6)
  assert not np.asarray(grad)[~np.asarray(batch.loss_mask)].any()
  weights = np.asarray(
    mis_jax.compute_mis_weights(
      batch.old_logprobs,
      batch.rollout_logprobs,
      batch.loss_mask,
      batch.segment_ids,
      CONFIGS[name].mis,
      num_segments=NSEG,
    )[0]
  )
  assert np.isfinite(weights).all() and weights.max() <= np.exp(20) * 1.0001


@given(packed_inputs(all_masked=True), st.sampled_from(sorted(CONFIGS)))
def test_all_masked_batch_gives_zero_loss_and_defined_metrics(data, name):
  _, batch, lp = data
  (loss, metrics), grad = loss_and_grad(name)(lp, batch)
  assert float(loss) == 0.0
  assert _finite((metrics, grad)) and not np.asarray(grad).any()
  assert float(metrics["mis_batch_norm_factor"]) == 1.0
  assert float(metrics["mis_is_ratio_min_final"]) == 0.0 == float(metrics["mis_kept_seq_fraction"])


@given(packed_inputs(), st.sampled_from(sorted(CONFIGS)))
def test_moderate_inputs_match_oracle(data, name):
  seqs, batch, lp = data
  cfg = CONFIGS[name]
  (loss, metrics), _ = loss_and_grad(name)(lp, batch)
  ocfg = loss_keys(cfg)
  for s in seqs:
    s.update({k: s[k].astype(np.float32).astype(np.float64) for k in ("o", "q", "lp", "adv")})
  if not seqs:
    seqs = [dict(m=np.zeros(0, bool), o=np.zeros(0), q=np.zeros(0), lp=np.zeros(0), adv=np.zeros(0))]
  want_loss, want, _, _ = oracle.policy_loss(seqs, ocfg)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4, atol=1e-5)
  assert set(metrics) == set(want)
  for k in want:
    np.testing.assert_allclose(float(metrics[k]), want[k], rtol=1e-4, atol=1e-5, err_msg=k)


@given(st.lists(st.floats(-5, 5, width=32, allow_subnormal=False), min_size=1, max_size=NSEG))
def test_length_one_sequences_sequence_level_equals_token_level(r):
  """With every sequence of length 1, sequence and geometric levels equal the token level."""
  n = len(r)
  packing = mis_jax.plan_packing([1] * n, ROW_LEN, num_rows=ROWS)
  o = packing.pack([np.array([x], np.float32) for x in r], 0.0, np.float32)
  q = np.zeros_like(o)
  m = packing.segment_ids >= 0
  out = {}
  for level in mis_jax.config.LEVELS:
    cfg = mis_jax.MISConfig(tis_level=level, tis_mode="mask", use_rs=True, tis_batch_normalize=True)
    out[level] = _mis_jit(o, q, m, packing.segment_ids, cfg)
  for level in ("sequence", "geometric"):
    np.testing.assert_allclose(np.asarray(out[level][0]), np.asarray(out["token"][0]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[level][1]), np.asarray(out["token"][1]))


_mis_jit = jax.jit(functools.partial(mis_jax.compute_mis_weights, num_segments=NSEG), static_argnums=4)
