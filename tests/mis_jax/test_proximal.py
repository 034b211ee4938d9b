"""Decoupled PPO with AReaL's approximate proximal policy, `proximal: loglinear` (contract §6.3),
against the NumPy oracle and its invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
import oracle
from helpers import assert_metrics_close, random_seqs
from test_losses import MIS_CONFIGS, SCALE_FACTOR, oracle_cfg


def stale_seqs(seed, n_seqs=9):
  """Sequences whose tokens lag the trained weights by 0–3 versions, fewer further on in the
  response (a response paused across updates: its later tokens are fresher)."""
  rng = np.random.default_rng(seed)
  seqs = random_seqs(rng, n_seqs=n_seqs, mismatch=0.35, catastrophic=0.04, with_ref=True, with_entropy=True)
  for s in seqs:
    n = len(s["m"])
    stale = np.sort(rng.integers(0, 4, n))[::-1].astype(np.float64)
    s["stale"] = np.where(s["m"], stale, np.nan)
  return seqs


def pack(seqs, row_len=16, num_rows=4):
  packing = mis_jax.plan_packing([len(s["m"]) for s in seqs], row_len, num_rows=num_rows)
  get = lambda k: packing.pack([s[k].astype(np.float32) for s in seqs], np.nan, np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    ref_logprobs=get("ref"),
    rollout_staleness=get("stale"),
    num_segments=len(seqs),
  )
  return batch, {"lp": get("lp"), "ent": get("ent")}, packing


SEQS = stale_seqs(5)
BATCH, EXTRA, PACKING = pack(SEQS)


def cfg_for(correction="reference", **kw):
  mis = MIS_CONFIGS[correction]
  return mis_jax.LossConfig(use_tis=True, proximal="loglinear", mis=mis_jax.MISConfig(**mis) if mis else None, **kw)


def run(cfg, batch=BATCH, lp=None, **kw):
  return mis_jax.policy_loss(EXTRA["lp"] if lp is None else lp, batch, cfg, entropy=EXTRA["ent"], **kw)


@pytest.mark.parametrize("correction", list(MIS_CONFIGS))
@pytest.mark.parametrize(
  "mode,den", [("seq-mean-token-mean", "kept"), ("token-mean", "original"), ("seq-mean-token-sum-norm", "kept")]
)
def test_loglinear_matches_oracle(correction, mode, den):
  cfg = cfg_for(
    correction,
    loss_agg_mode=mode,
    denominator=den,
    entropy_coef=0.01,
    kl_coef=0.05,
    eps_clip_high=0.28,
    policy_loss={"name": "vanilla", "eps_clip_c": 3.0},
    loss_scale_factor=SCALE_FACTOR.get(mode),
  )
  assert not cfg.needs_old_logprobs and cfg.correction_in_loss
  loss, metrics = run(cfg)
  seqs = [{k: v for k, v in s.items() if k != "o"} for s in SEQS]  # no old log-probs: none were computed
  want_loss, want, _, _ = oracle.policy_loss(seqs, dict(oracle_cfg(cfg), proximal="loglinear"))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want)


def test_loglinear_gradient_matches_finite_differences_of_oracle():
  """The proximal log-probs follow sg(lp): the gradient flows through the policy ratio only."""
  cfg = cfg_for("seq-mask-veto", policy_loss={"name": "vanilla", "eps_clip_c": 3.0}, kl_coef=0.1)
  grads = PACKING.unpack(np.asarray(jax.grad(lambda lp: run(cfg, lp=lp)[0])(jnp.asarray(EXTRA["lp"]))))
  ocfg = dict(oracle_cfg(cfg), proximal="loglinear")
  base = [{k: v for k, v in s.items() if k != "o"} for s in SEQS]
  eps = 1e-4
  for i, s in enumerate(base):
    for t in np.flatnonzero(s["m"]):

      def f(delta):
        seqs = [dict(x) for x in base]
        seqs[i] = dict(seqs[i], lp_sg=base[i]["lp"], lp=base[i]["lp"].copy())
        seqs[i]["lp"][t] += delta
        return oracle.policy_loss(seqs, ocfg)[0]

      np.testing.assert_allclose(
        grads[i][t], (f(eps) - f(-eps)) / (2 * eps), rtol=2e-3, atol=2e-5, err_msg=f"seq {i} token {t}"
      )
    assert not grads[i][~s["m"]].any()


def test_fresh_tokens_make_it_bypass_ppo():
  """Every token sampled by the weights being trained (staleness 0): the proximal policy is the
  behaviour policy, the correction's weights are 1 and the loss is bypass PPO's (AReaL's
  synchronous case)."""
  batch = BATCH.replace(rollout_staleness=jnp.zeros_like(BATCH.rollout_staleness))
  loglinear = cfg_for("vanilla", kl_coef=0.1)
  bypass = mis_jax.LossConfig(use_rollout_logprobs=True, kl_coef=0.1)
  (a, ma), ga = jax.value_and_grad(lambda lp: run(loglinear, batch, lp), has_aux=True)(jnp.asarray(EXTRA["lp"]))
  (b, mb), gb = jax.value_and_grad(lambda lp: run(bypass, batch, lp), has_aux=True)(jnp.asarray(EXTRA["lp"]))
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-6, atol=1e-9)
  assert float(ma["tis"]) == 1.0 and float(ma["tis_clipfrac"]) == 0.0
  np.testing.assert_allclose(float(ma["mis_k3_kl"]), float(mb["mis_k3_kl"]), rtol=1e-6)


def test_loglinear_microbatches_sum_to_full_batch():
  """Exactly micro-batch invariant with denominator original and no batch normalisation (as
  REINFORCE + IS, contract §7): prepare_step computes no weights, only the denominators."""
  cfg = cfg_for("seq-mask-veto", denominator="original", kl_coef=0.1, entropy_coef=0.01)
  correction, metrics = mis_jax.prepare_step(BATCH, cfg)
  assert correction.is_weights is None and correction.kept_mask is None and metrics == {}
  assert correction.denominators is not None
  assert mis_jax.prepare_step(BATCH, cfg_for("seq-mask-veto"))[0].denominators is None  # kept ones follow lp
  full, g_full = jax.value_and_grad(lambda lp: run(cfg, lp=lp)[0])(jnp.asarray(EXTRA["lp"]))
  total, grads = 0.0, []
  for mb, c, lp, ent in zip(
    mis_jax.split_microbatches(BATCH, 4),
    mis_jax.split_microbatches(correction, 4),
    np.split(EXTRA["lp"], 4),
    np.split(EXTRA["ent"], 4),
  ):
    loss, g = jax.value_and_grad(lambda x: mis_jax.policy_loss(x, mb, cfg, entropy=ent, correction=c)[0])(
      jnp.asarray(lp)
    )
    total += float(loss)
    grads.append(np.asarray(g))
  np.testing.assert_allclose(total, float(full), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(grads), np.asarray(g_full), rtol=1e-5, atol=1e-7)


def test_loglinear_jit_equals_eager_and_sets_auto_bounds():
  mis = mis_jax.MISConfig(tis_upper_bound="auto", target_ess_ratio=0.9)
  cfg = mis_jax.LossConfig(use_tis=True, proximal="loglinear", mis=mis)
  eager = run(cfg)
  jitted = jax.jit(lambda lp, b: run(cfg, b, lp))(EXTRA["lp"], BATCH)
  np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6)
  for k in eager[1]:
    np.testing.assert_allclose(float(jitted[1][k]), float(eager[1][k]), rtol=1e-5, atol=1e-7, err_msg=k)
  assert float(eager[1]["mis_auto_target_met"]) == 1.0 and float(eager[1]["mis_auto_ess_ratio"]) >= 0.9


def test_loglinear_refusals():
  with pytest.raises(mis_jax.ConfigError, match="proximal 'loglinear'.*algorithm 'ppo'"):
    mis_jax.LossConfig(proximal="loglinear")
  with pytest.raises(mis_jax.ConfigError, match="algorithm 'reinforce_is'"):
    mis_jax.LossConfig(proximal="loglinear", use_tis=True, use_rollout_logprobs=True)
  with pytest.raises(mis_jax.ConfigError, match="policy_loss 'kl_cov'.*proximal: recompute"):
    mis_jax.LossConfig(proximal="loglinear", use_tis=True, policy_loss="kl_cov")
  with pytest.raises(mis_jax.ConfigError, match="proximal"):
    mis_jax.LossConfig(proximal="linear", use_tis=True)
  cfg = cfg_for("vanilla")
  with pytest.raises(ValueError, match="needs batch.rollout_staleness"):
    run(cfg, BATCH.replace(rollout_staleness=None))
  bad = np.where(np.asarray(BATCH.loss_mask), -1.0, np.nan).astype(np.float32)
  with pytest.raises(ValueError, match="'rollout_staleness' must be finite and >= 0.*-1"):
    run(cfg, BATCH.replace(rollout_staleness=bad))
  with pytest.raises(ValueError, match="proximal='loglinear'"):
    run(cfg, correction=mis_jax.Correction(is_weights=BATCH.advantages, kept_mask=BATCH.loss_mask))
