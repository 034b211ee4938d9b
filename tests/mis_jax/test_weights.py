"""compute_mis_weights / vanilla_tis_weights against the NumPy oracle (contract §2–5, §8)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
import oracle
from helpers import assert_metrics_close, assert_weights_match_oracle, pack, random_seqs

SEQS = random_seqs(np.random.default_rng(0), n_seqs=9, mismatch=0.4, catastrophic=0.04)
BATCH, EXTRA, PACKING = pack(SEQS, row_len=16)
MISMATCH_KEYS = {
  "mis_training_log_ppl",
  "mis_training_ppl",
  "mis_rollout_log_ppl",
  "mis_rollout_ppl",
  "mis_kl",
  "mis_k3_kl",
  "mis_log_ppl_diff",
  "mis_log_ppl_abs_diff",
  "mis_ppl_ratio",
  "mis_chi2_token",
  "mis_chi2_seq",
  "train_rollout_logprob_abs_diff",
}
FINAL_KEYS = {
  "mis_is_ratio_mean_after_tis_rs",
  "mis_batch_norm_factor",
  "mis_is_ratio_mean_final",
  "mis_is_ratio_min_final",
  "mis_is_ratio_max_final",
  "mis_ess_ratio",
  "mis_kept_token_fraction",
  "mis_kept_seq_fraction",
  "mis_masked_whole_batch",
  "mis_tis_weight_before_bound",
  "mis_tis_weight_after_bound",
  "mis_nonfinite_rollout_logprob_count",
  "mis_nonfinite_rollout_logprob_fraction",
}
MODE_KEYS = {
  "truncate": {"mis_tis_truncate_fraction"},
  "clip": {"mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high"},
  "mask": {"mis_tis_mask_fraction_low", "mis_tis_mask_fraction_high"},
  "none": set(),
}

RS_OPTIONS = {
  "off": {},
  "same-level": {"use_rs": True},
  "token-rs": {"use_rs": True, "rs_level": "token", "rs_lower_bound": 0.3, "rs_upper_bound": 3.0},
  "geo-rs": {"use_rs": True, "rs_level": "geometric", "rs_lower_bound": 0.8, "rs_upper_bound": 1.25},
}


def _run(cfg, mode="seq-mean-token-mean", batch=BATCH):
  return mis_jax.compute_mis_weights(
    batch.old_logprobs,
    batch.rollout_logprobs,
    batch.loss_mask,
    batch.segment_ids,
    cfg,
    num_segments=batch.num_segments,
    metric_reduction=mode,
  )


def _check_against_oracle(cfg, mode):
  w, kept, metrics = _run(cfg, mode)
  assert_weights_match_oracle(w, kept, metrics, SEQS, PACKING, cfg, mode)
  # Padding carries neither weight nor kept tokens.
  pad = np.asarray(BATCH.segment_ids) < 0
  assert not np.asarray(w)[pad].any() and not np.asarray(kept)[pad].any()
  return metrics


@pytest.mark.parametrize(
  "level,tis_mode,rs,veto,bn",
  list(itertools.product(mis_jax.config.LEVELS, mis_jax.config.TIS_MODES, RS_OPTIONS, [None, 1e-4], [False, True])),
)
def test_mis_matches_oracle(level, tis_mode, rs, veto, bn):
  cfg = mis_jax.MISConfig(
    tis_level=level,
    tis_mode=tis_mode,
    tis_upper_bound=2.5,
    tis_lower_bound=0.4,
    rs_veto_threshold=veto,
    tis_batch_normalize=bn,
    **RS_OPTIONS[rs],
  )
  metrics = _check_against_oracle(cfg, "seq-mean-token-mean")
  expected = MISMATCH_KEYS | FINAL_KEYS | MODE_KEYS[tis_mode]
  if rs != "off":
    expected |= {"mis_rs_mask_fraction_low", "mis_rs_mask_fraction_high"}
  if veto is not None:
    expected |= {"mis_rs_catastrophic_token_fraction", "mis_rs_catastrophic_seq_fraction"}
  assert set(metrics) == expected


@pytest.mark.parametrize("mode", mis_jax.config.LOSS_AGG_MODES)
@pytest.mark.parametrize("level", mis_jax.config.LEVELS)
def test_metric_reductions_match_oracle(mode, level):
  cfg = mis_jax.MISConfig(
    tis_level=level, tis_mode="clip", use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True
  )
  _check_against_oracle(cfg, mode)


def test_reference_config_matches_oracle():
  cfg = mis_jax.MISConfig.from_yaml("configs/mis.yaml")
  _check_against_oracle(cfg, "seq-mean-token-mean")
  _check_against_oracle(cfg, "token-mean")


def test_use_tis_false_returns_mask_and_mismatch_metrics_only():
  cfg = mis_jax.MISConfig(use_tis=False, use_rs=True, rs_veto_threshold=1e-4)
  w, kept, metrics = _run(cfg)
  assert set(metrics) == MISMATCH_KEYS | {
    "mis_nonfinite_rollout_logprob_count",
    "mis_nonfinite_rollout_logprob_fraction",
  }
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(BATCH.loss_mask))
  np.testing.assert_array_equal(np.asarray(w), np.asarray(BATCH.loss_mask, np.float32))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_vanilla_matches_oracle(mode):
  kwargs = {} if mode == "token-mean" else dict(segment_ids=BATCH.segment_ids, num_segments=BATCH.num_segments)
  w, metrics = mis_jax.vanilla_tis_weights(
    BATCH.old_logprobs,
    BATCH.rollout_logprobs,
    BATCH.loss_mask,
    tis_clip=1.5,
    tis_clip_low=0.5,
    metric_reduction=mode,
    **kwargs,
  )
  W, _, want = oracle.vanilla(SEQS, 1.5, 0.5, mode)
  assert_metrics_close(metrics, want)
  for wj, wo in zip(PACKING.unpack(np.asarray(w)), W):
    np.testing.assert_allclose(wj, wo, rtol=1e-6)


def test_hand_worked_token_truncate_veto_batchnorm():
  """Three sequences of lengths 3/2/4, one masked token; values worked out by hand.

  r = o - q: A = [0, ln 4, ln 0.5]; B = [ln 2, (masked, NaN)]; C = [0, 0, ln 3, ln 0.25].
  Truncate at U = 2: w = A [1, 2, .5], B [2], C [1, 1, 2, .25]. Veto at 0.3: ln .25 < ln .3,
  so C is rejected. Batch norm over kept tokens: mu = (1 + 2 + .5 + 2) / 4 = 1.375.
  """
  ln = np.log
  r = [[0.0, ln(4), ln(0.5)], [ln(2), np.nan], [0.0, 0.0, ln(3), ln(0.25)]]
  q = -1.0
  o = np.array(
    [[q + x for x in r[0]] + [q + x for x in r[1]]] + [[q + x for x in r[2]] + [0.0]], np.float32
  )  # packed: row 0 = A|B, row 1 = C|pad
  seg = np.array([[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]], np.int32)
  m = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], np.float32)
  qa = np.where(seg >= 0, q, np.nan).astype(np.float32)
  cfg = mis_jax.MISConfig(tis_mode="truncate", tis_upper_bound=2.0, rs_veto_threshold=0.3, tis_batch_normalize=True)
  w, kept, met = mis_jax.compute_mis_weights(o, qa, m, seg, cfg, num_segments=3)
  mu = 1.375
  np.testing.assert_allclose(
    np.asarray(w), np.array([[1 / mu, 2 / mu, 0.5 / mu, 2 / mu, 0], [1 / mu, 1 / mu, 2 / mu, 0.25 / mu, 0]]), rtol=1e-6
  )
  np.testing.assert_array_equal(np.asarray(kept), [[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
  expect = {
    "mis_tis_weight_before_bound": (5.5 / 3 + 2 + 5.25 / 4) / 3,  # 1.715278
    "mis_tis_truncate_fraction": (1 / 3 + 0 + 1 / 4) / 3,  # 7/36
    "mis_tis_weight_after_bound": (3.5 / 3 + 2 + 4.25 / 4) / 3,  # 1.409722
    "mis_rs_catastrophic_token_fraction": (0 + 0 + 1 / 4) / 3,  # 1/12
    "mis_rs_catastrophic_seq_fraction": 1 / 3,
    "mis_is_ratio_mean_after_tis_rs": (3.5 / 3 + 2) / 2,  # 1.583333
    "mis_batch_norm_factor": 1.375,
    "mis_is_ratio_mean_final": (3.5 / 3 / mu + 2 / mu) / 2,  # 1.151515
    "mis_is_ratio_min_final": 0.5 / mu,
    "mis_is_ratio_max_final": 2 / mu,
    "mis_kept_token_fraction": 4 / 8,
    "mis_kept_seq_fraction": 2 / 3,
    "mis_ess_ratio": 5.5**2 / (4 * (1 + 4 + 0.25 + 4)),
  }
  for k, v in expect.items():
    np.testing.assert_allclose(float(met[k]), v, rtol=1e-5, err_msg=k)
  # Same case, token-mean reduction: truncation hits 2 of 8 trained tokens.
  _, _, met_tok = mis_jax.compute_mis_weights(o, qa, m, seg, cfg, num_segments=3, metric_reduction="token-mean")
  np.testing.assert_allclose(float(met_tok["mis_tis_truncate_fraction"]), 2 / 8, rtol=1e-6)
  np.testing.assert_allclose(float(met_tok["mis_is_ratio_mean_final"]), 5.5 / mu / 4, rtol=1e-6)


def test_sequence_and_geometric_levels_hand_worked():
  """One sequence r = [ln 2, ln 2, ln 0.5]: sequence weight 2, geometric weight 2^(1/3)."""
  o = np.log(np.array([2.0, 2.0, 0.5], np.float32))
  q = np.zeros(3, np.float32)
  m = np.ones(3, bool)
  seg = np.zeros(3, np.int32)
  for level, want in [("sequence", 2.0), ("geometric", 2 ** (1 / 3))]:
    cfg = mis_jax.MISConfig(tis_level=level, tis_upper_bound=10.0)
    w, _, _ = mis_jax.compute_mis_weights(o, q, m, seg, cfg, num_segments=1)
    np.testing.assert_allclose(np.asarray(w), [want] * 3, rtol=1e-6)


def test_jit_equals_eager_and_any_shape():
  cfg = mis_jax.MISConfig(
    tis_level="geometric",
    tis_mode="mask",
    use_rs=True,
    rs_level="token",
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
  )
  eager = _run(cfg)
  fn = jax.jit(mis_jax.compute_mis_weights, static_argnames=("cfg", "num_segments", "metric_reduction"))
  jitted = fn(
    BATCH.old_logprobs, BATCH.rollout_logprobs, BATCH.loss_mask, BATCH.segment_ids, cfg, num_segments=BATCH.num_segments
  )
  np.testing.assert_allclose(np.asarray(jitted[0]), np.asarray(eager[0]), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(jitted[1]), np.asarray(eager[1]))
  for k in eager[2]:
    np.testing.assert_allclose(float(jitted[2][k]), float(eager[2][k]), rtol=1e-6, err_msg=k)
  # Flat [T] layout gives the same answer as [rows, row_len].
  flat = [
    jnp.reshape(x, (-1,)) for x in (BATCH.old_logprobs, BATCH.rollout_logprobs, BATCH.loss_mask, BATCH.segment_ids)
  ]
  w_flat, _, m_flat = mis_jax.compute_mis_weights(*flat, cfg, num_segments=BATCH.num_segments)
  np.testing.assert_allclose(np.asarray(w_flat), np.asarray(eager[0]).reshape(-1), rtol=1e-6)
  for k in eager[2]:
    np.testing.assert_allclose(float(m_flat[k]), float(eager[2][k]), rtol=1e-6, err_msg=k)


def test_weights_carry_no_gradient():
  cfg = mis_jax.MISConfig(tis_level="sequence", tis_mode="clip", tis_upper_bound=5.0)
  o = jnp.nan_to_num(jnp.asarray(BATCH.old_logprobs))
  q = jnp.nan_to_num(jnp.asarray(BATCH.rollout_logprobs))
  g = jax.grad(
    lambda o: jnp.sum(
      mis_jax.compute_mis_weights(o, q, BATCH.loss_mask, BATCH.segment_ids, cfg, num_segments=BATCH.num_segments)[0]
    )
  )(o)
  assert not np.asarray(g).any()


CRITERIA = [
  {"metric": "k1", "agg": "token", "lower": -0.5, "upper": 0.6},
  {"metric": "k1", "agg": "seq_max", "lower": float(np.log(1e-4))},  # = the veto
  {"metric": "k1", "agg": "seq_mean", "lower": -0.3, "upper": 0.3},
  {"metric": "k2", "agg": "seq_sum", "upper": 1.0},
  {"metric": "k2", "agg": "token", "upper": 0.1},
  {"metric": "k3", "agg": "seq_mean", "upper": 0.05},
  {"metric": "k3", "agg": "seq_max", "upper": 0.5},
  {"metric": "k3", "agg": "token", "lower": 0.001, "upper": 0.3},
]


@pytest.mark.parametrize("crit", CRITERIA, ids=lambda c: f"{c['metric']}-{c['agg']}")
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_divergence_criteria_match_oracle(crit, mode):
  cfg = mis_jax.MISConfig(tis_mode="none", rs_criteria=[crit])
  metrics = _check_against_oracle(cfg, mode)
  name = f"mis_rs_{crit['metric']}_{crit['agg']}"
  assert {f"{name}_masked_fraction", f"{name}_mean", f"{name}_max"} <= set(metrics)
  assert 0.0 < float(metrics[f"{name}_masked_fraction"]) < 1.0, "the criterion should bite on this data"


def test_criteria_combine_with_and_and_with_rs_and_veto():
  cfg = mis_jax.MISConfig(tis_mode="clip", use_rs=True, rs_veto_threshold=1e-4, rs_criteria=CRITERIA[3:6])
  _check_against_oracle(cfg, "seq-mean-token-mean")
  _, kept, _ = _run(cfg)
  singles = [np.asarray(_run(mis_jax.MISConfig(tis_mode="clip", rs_criteria=[c]))[1]) for c in CRITERIA[3:6]]
  base = np.asarray(_run(mis_jax.MISConfig(tis_mode="clip", use_rs=True, rs_veto_threshold=1e-4))[1])
  np.testing.assert_array_equal(np.asarray(kept), base & singles[0] & singles[1] & singles[2])


def test_k1_seq_max_lower_bound_is_the_veto():
  veto = _run(mis_jax.MISConfig(tis_mode="none", rs_veto_threshold=1e-4))[1]
  crit = _run(mis_jax.MISConfig(tis_mode="none", rs_criteria=[CRITERIA[1]]))[1]
  np.testing.assert_array_equal(np.asarray(veto), np.asarray(crit))


@pytest.mark.parametrize(
  "bad,pattern",
  [
    ([{"metric": "k4", "upper": 1}], r"rs_criteria\[0\].*'k4'.*k1, k2, k3"),
    ([{"metric": "k3", "agg": "seq_median", "upper": 1}], r"'seq_median'.*token, seq_sum, seq_mean, seq_max"),
    ([{"metric": "k3"}], r"needs a 'lower' or an 'upper' bound"),
    ([{"metric": "k3", "uper": 1}], r"unknown key 'uper'.*Did you mean 'upper'"),
    ([{"metric": "k2", "upper": -1}], r"upper must be >= 0"),
    ([{"metric": "k1", "lower": 1, "upper": 0}], r"lower \(1.0\) > upper \(0.0\)"),
    ({"metric": "k1"}, r"must be a list of criteria"),
    ([{"metric": "k3", "upper": 1}, {"metric": "k3", "upper": 2}], r"lists a metric/agg pair twice"),
  ],
)
def test_invalid_criteria(bad, pattern):
  with pytest.raises(mis_jax.ConfigError, match=pattern):
    mis_jax.MISConfig(rs_criteria=bad)
