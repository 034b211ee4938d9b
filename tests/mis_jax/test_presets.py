"""Named presets (docs/reference/presets.md): each expansion against the framework's own formula,
written here in NumPy from the source the table cites, on random packed batches."""

import math

import numpy as np
import pytest

import mis_jax
from mis_jax.config import loss_config_from_args


def _batch(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, 14, size=24)
  seg = np.repeat(np.arange(lengths.size), lengths).astype(np.int32)
  seg = np.concatenate([seg, -np.ones(5, np.int32)])  # padding
  t = seg.size
  mask = (rng.uniform(size=t) < 0.85) & (seg >= 0)
  sigma = rng.uniform(0.02, 0.9, size=lengths.size)[np.maximum(seg, 0)]  # per-sequence mismatch
  o = (-rng.uniform(0.1, 3.0, t)).astype(np.float32)
  drift = rng.normal(0.0, 0.8, size=lengths.size)[np.maximum(seg, 0)]  # per-sequence mean log-ratio
  q = (o - drift - rng.normal(0.0, 1.0, t) * sigma).astype(np.float32)
  adv = rng.normal(size=lengths.size)[np.maximum(seg, 0)].astype(np.float32)
  lp = (o + rng.normal(0, 0.1, t)).astype(np.float32)
  return seg, mask, o, q, adv, lp, lengths.size


# --- each framework's formula, per sequence, from its source (r = o - q, token ratios exp(r)) ---


def _per_sequence(seg, mask, o, q, fn):
  w = np.zeros(seg.size, np.float64)
  for s in np.unique(seg[seg >= 0]):
    idx = np.where((seg == s) & mask)[0]
    if idx.size:
      w[idx] = fn(o[idx].astype(np.float64) - q[idx].astype(np.float64))
  return w


def openrlhf(kind, low=0.5, high=5.0):
  """openrlhf/models/loss.py PolicyLoss.forward, --vllm_is_truncated_threshold [low, high]."""

  def fn(r):
    ratio = np.exp(r)
    if kind == "tis":
      return np.clip(ratio, low, high)
    if kind == "icepop":
      return ratio * ((ratio >= low) & (ratio <= high))
    seq_is = math.exp(r.mean())  # seq-mask-tis: masked_mean(log_ratio) over the action mask
    return ratio * (low <= seq_is <= high)

  return fn


def trl(mode, cap=3.0):
  """trl/trainer/grpo_trainer.py: ratio = exp(Σ(o - q)) (sequence) or exp(o - q) (token); truncate
  clamps at C, mask sets ratios > C to 0 (no lower bound by default)."""

  def fn(r):
    ratio = np.full_like(r, math.exp(r.sum())) if mode.startswith("sequence") else np.exp(r)
    return np.minimum(ratio, cap) if mode.endswith("truncate") else np.where(ratio > cap, 0.0, ratio)

  return fn


def ms_swift(mode, threshold=2.0):
  """swift/trainers/rlhf_trainer/grpo_trainer.py _apply_rollout_importance_sampling: token ratios
  exp(clamp(r, ±20)); the sequence ratio is their geometric mean; sequence_mask keeps the token ratios."""

  def fn(r):
    ratio = np.exp(np.clip(r, -20, 20))
    seq = math.exp(np.log(np.maximum(ratio, 1e-10)).mean())
    if mode == "token_truncate":
      return np.minimum(ratio, threshold)
    if mode == "token_mask":
      return np.where(ratio <= threshold, ratio, 0.0)
    if mode == "sequence_truncate":
      return np.full_like(r, min(seq, threshold))
    return ratio * (seq <= threshold)

  return fn


FORMULAS = {
  "tis": openrlhf("tis"),
  "icepop": openrlhf("icepop"),
  "seq-mask-tis": openrlhf("seq-mask-tis"),
  **{f"trl:{m}": trl(m) for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
  **{f"ms-swift:{m}": ms_swift(m) for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
}


def test_every_preset_has_a_formula_and_a_source():
  assert set(FORMULAS) == set(mis_jax.config.PRESET_NAMES)
  for p in mis_jax.config.PRESETS.values():
    assert p.sources and all(s.startswith("https://") for s in p.sources)


@pytest.mark.parametrize("name", sorted(FORMULAS))
@pytest.mark.parametrize("seed", [0, 1])
def test_expansion_matches_the_framework(name, seed):
  seg, mask, o, q, adv, lp, n = _batch(seed)
  expected = _per_sequence(seg, mask, o, q, FORMULAS[name])
  cfg = mis_jax.preset(name)
  w, kept, _ = mis_jax.compute_mis_weights(o, q, mask, seg, cfg.mis, num_segments=n)
  w, kept = np.asarray(w), np.asarray(kept)
  applied = np.where(kept, w, 0.0)
  np.testing.assert_allclose(applied, expected, rtol=2e-5, atol=1e-7)
  if "mask" in name or name in ("icepop",):  # the data reach both sides of each mask
    assert 0 < np.sum(mask & (expected == 0)) < np.sum(mask)
  # The loss: each framework multiplies its per-token PPO loss by the weight and keeps a masked
  # token in the denominator (a token-mean over the trained tokens here).
  batch = mis_jax.PackedBatch(
    segment_ids=seg, loss_mask=mask, advantages=adv, rollout_logprobs=q, old_logprobs=o, num_segments=n
  )
  cfg = mis_jax.preset(name, loss_agg_mode="token-mean")
  loss, _ = mis_jax.policy_loss(lp, batch, cfg)
  ratio = np.exp(lp.astype(np.float64) - o)
  ppo = np.maximum(-ratio * adv, -np.clip(ratio, 0.8, 1.2) * adv)
  want = np.sum(np.where(mask, expected * ppo, 0.0)) / mask.sum()
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)


def test_factories_overrides_and_unknown_names():
  assert mis_jax.LossConfig.from_preset("icepop") == mis_jax.preset("icepop")
  assert mis_jax.MISConfig.from_preset("icepop") == mis_jax.preset("icepop").mis
  cfg = mis_jax.preset("trl:sequence_mask", tis_upper_bound=2.0, loss_agg_mode="token-mean")
  assert cfg.mis.tis_upper_bound == 2.0 and cfg.loss_agg_mode == "token-mean" and cfg.mis.tis_level == "sequence"
  assert mis_jax.MISConfig.from_preset("seq-mask-tis", rs_lower_bound=0.999, rs_upper_bound=1.002).rs_upper == 1.002
  with pytest.raises(
    mis_jax.ConfigError, match="unknown preset 'icepopp'. Did you mean 'icepop'.*Valid presets: tis, icepop"
  ):
    mis_jax.preset("icepopp")
  with pytest.raises(mis_jax.ConfigError, match="ambiguous.*'trl:sequence_mask'.*'ms-swift:sequence_mask'"):
    mis_jax.MISConfig.from_preset("sequence_mask")
  with pytest.raises(mis_jax.ConfigError, match="unknown key 'tis_uper_bound'"):
    mis_jax.preset("tis", tis_uper_bound=3.0)


def test_preset_by_name_in_flags_and_trainer_config():
  assert loss_config_from_args({"preset": "ms-swift:sequence_mask"}) == mis_jax.preset("ms-swift:sequence_mask")
  # explicit keys override the preset
  cfg = loss_config_from_args({"preset": "icepop", "denominator": "kept"})
  assert cfg == mis_jax.preset("icepop", denominator="kept")
  with pytest.raises(mis_jax.ConfigError, match="Valid presets"):
    loss_config_from_args({"preset": "nope"})
  from trainers import config as tcfg

  assert tcfg.loss_config({"preset": "trl:sequence_mask"}) == mis_jax.preset("trl:sequence_mask")
  assert tcfg.loss_config({"preset": "tis", "loss_agg_mode": "token-mean"}) == mis_jax.preset(
    "tis", loss_agg_mode="token-mean"
  )
