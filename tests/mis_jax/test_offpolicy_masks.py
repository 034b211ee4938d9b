"""Off-policy masks of recent papers (contract §4.2), each against an independent NumPy loop over
sequences: OPSM (DeepSeek-V3.2) and M2PO (AReaL), alone, composed with the other rejections and
the threshold controller, under decoupled PPO and REINFORCE + IS (8 devices == 1: with the
controller's in tests/mis_jax/test_controller.py)."""

import functools

import jax
import numpy as np
import pytest

import mis_jax
from helpers import pack, random_seqs

SEEDS = range(5)


def _seqs(seed, mismatch=0.5):
  return random_seqs(np.random.default_rng(seed), n_seqs=10, mismatch=mismatch)


def _batch(seqs):
  return pack(seqs, row_len=16, num_rows=8)[0]


@functools.lru_cache(maxsize=None)
def _jitted(cfg):
  return jax.jit(
    lambda b: mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      cfg,
      num_segments=b.num_segments,
      metric_reduction="token-mean",
      advantages=b.advantages,
    )
  )


def opsm_oracle(seqs, delta):
  """Per sequence: masked iff live, its advantage negative and mean(q - o) over trained tokens > δ."""
  out = []
  for s in seqs:
    m = s["m"].astype(bool)
    if not m.any():
      out.append(False)
      continue
    adv = float(np.sum(s["adv"][m]))
    divergence = float(np.mean(s["q"][m].astype(np.float64) - s["o"][m].astype(np.float64)))
    out.append(adv < 0 and divergence > delta)
  return np.array(out)


def m2po_oracle(seqs, tau):
  """The trained tokens kept: drop the largest squared log-ratios (ties together) while the mean
  of those left is above τ."""
  r2 = np.concatenate(
    [
      (s["o"][s["m"].astype(bool)].astype(np.float64) - s["q"][s["m"].astype(bool)].astype(np.float64)) ** 2
      for s in seqs
    ]
  )
  values = np.sort(np.unique(r2))[::-1]
  cutoff = np.inf
  for v in values:
    kept = r2[r2 <= min(cutoff, np.inf)]
    if kept.size == 0 or kept.mean() <= tau:
      break
    cutoff = np.nextafter(v, -np.inf)  # v and its ties go
  keep = r2 <= cutoff
  per_seq, i = [], 0
  for s in seqs:
    n = int(s["m"].astype(bool).sum())
    per_seq.append(keep[i : i + n])
    i += n
  return per_seq, float(r2[keep].mean()) if keep.any() else 0.0


def _kept_by_sequence(batch, kept, seqs):
  """The library's kept mask back per sequence, over each sequence's trained tokens."""
  ids = np.asarray(batch.segment_ids).reshape(-1)
  m = np.asarray(batch.loss_mask).reshape(-1).astype(bool)
  kept = np.asarray(kept).reshape(-1).astype(bool)
  return [kept[(ids == i) & m] for i in range(len(seqs))]


@pytest.mark.parametrize("delta", [-0.05, 0.0, 0.1])
def test_opsm_masks_negative_off_policy_sequences(delta):
  for seed in SEEDS:
    seqs = _seqs(seed)
    batch = _batch(seqs)
    w, kept, metrics = _jitted(mis_jax.MISConfig(tis_upper_bound=3.0, opsm_delta=delta))(batch)
    masked = opsm_oracle(seqs, delta)
    for i, (got, s) in enumerate(zip(_kept_by_sequence(batch, kept, seqs), seqs)):
      assert np.all(got == (not masked[i])), f"seed {seed} sequence {i}"
    live = np.array([s["m"].astype(bool).any() for s in seqs])
    assert float(metrics["mis_opsm_masked_seq_fraction"]) == pytest.approx(masked.sum() / live.sum(), abs=1e-7)
  # The sweep exercised both outcomes.
  assert any(opsm_oracle(_seqs(seed), delta).any() for seed in SEEDS)


@pytest.mark.parametrize("tau", [0.01, 0.04, 0.5])
def test_m2po_drops_the_largest_squared_log_ratios_until_the_second_moment_fits(tau):
  for seed in SEEDS:
    seqs = _seqs(seed)
    batch = _batch(seqs)
    _, kept, metrics = _jitted(mis_jax.MISConfig(tis_upper_bound=3.0, m2po_threshold=tau))(batch)
    want, second_moment = m2po_oracle(seqs, tau)
    for i, (got, w) in enumerate(zip(_kept_by_sequence(batch, kept, seqs), want)):
      np.testing.assert_array_equal(got, w, err_msg=f"seed {seed} sequence {i}")
    assert float(metrics["mis_m2po_second_moment"]) <= np.float32(tau)
    np.testing.assert_allclose(float(metrics["mis_m2po_second_moment"]), second_moment, rtol=1e-5, atol=1e-9)
    n = sum(len(w) for w in want)
    assert float(metrics["mis_m2po_masked_fraction"]) == pytest.approx(1 - sum(w.sum() for w in want) / n, abs=1e-7)


def test_masks_compose_with_the_controller_and_reinforce():
  """OPSM and M2PO with the veto and an auto truncation bound: the kept mask is the AND of the
  oracles', and the ESS target holds over what they keep; REINFORCE + IS reads sg(lp) as the
  trainer's log-probs, so its OPSM is the oracle's of lp."""
  seqs = _seqs(2, mismatch=0.8)
  batch = _batch(seqs)
  cfg = mis_jax.MISConfig(
    tis_upper_bound="auto", target_ess_ratio=0.9, opsm_delta=0.0, m2po_threshold=0.1, rs_veto_threshold=1e-4
  )
  _, kept, metrics = _jitted(cfg)(batch)
  masked = opsm_oracle(seqs, 0.0)
  m2po, _ = m2po_oracle(seqs, 0.1)
  for i, (got, s) in enumerate(zip(_kept_by_sequence(batch, kept, seqs), seqs)):
    m = s["m"].astype(bool)
    vetoed = np.any(s["o"][m].astype(np.float64) - s["q"][m] < np.log(1e-4))
    np.testing.assert_array_equal(got, m2po[i] & (not masked[i]) & (not vetoed), err_msg=f"sequence {i}")
  assert float(metrics["mis_auto_target_met"]) == 1 and float(metrics["mis_ess_ratio"]) >= np.float32(0.9) - 1e-6
  # REINFORCE + IS: the correction runs in the loss with sg(lp) as the trainer's log-probs.
  lp = pack(seqs, row_len=16, num_rows=8)[1]["lp"]
  loss_cfg = mis_jax.LossConfig(
    use_tis=True,
    use_rollout_logprobs=True,
    denominator="original",
    mis=mis_jax.MISConfig(tis_upper_bound=3.0, opsm_delta=0.0),
  )
  _, metrics = jax.jit(lambda lp, b: mis_jax.policy_loss(lp, b, loss_cfg))(lp, batch)
  with_lp = [dict(s, o=s["lp"]) for s in seqs]
  live = sum(s["m"].astype(bool).any() for s in seqs)
  assert float(metrics["mis_opsm_masked_seq_fraction"]) == pytest.approx(opsm_oracle(with_lp, 0.0).sum() / live)


def test_opsm_needs_the_advantages():
  batch = _batch(_seqs(0))
  with pytest.raises(ValueError, match="opsm_delta.*pass advantages="):
    mis_jax.compute_mis_weights(
      batch.old_logprobs,
      batch.rollout_logprobs,
      batch.loss_mask,
      batch.segment_ids,
      mis_jax.MISConfig(opsm_delta=0.1),
      num_segments=batch.num_segments,
    )
  with pytest.raises(mis_jax.ConfigError, match="m2po_threshold.*must be > 0"):
    mis_jax.MISConfig(m2po_threshold=0.0)
