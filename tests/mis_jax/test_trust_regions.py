"""Trust regions on probabilities and the squared log-ratio KL (contract §4.3, §6.4): DPPO-Binary-TV
(sign-conditioned and symmetric) and KPop as masks of the correction, the KL as a loss term over
the trainable or the kept tokens. Each against the NumPy oracle (token loops) in every aggregation
mode, finite-difference gradients, micro-batches == one batch, 8 devices == 1, and against the
peers' own functions (prime-rl's default and ipo losses, verl's binary KL; tests/mis_jax/prime_rl_reference.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AxisType

import mis_jax
import oracle
import prime_rl_reference as ref
from helpers import (
  assert_metrics_close,
  assert_weights_match_oracle,
  loss_keys,
  pack,
  prepare_step_on_mesh,
  random_seqs,
)

SEQS = random_seqs(np.random.default_rng(5), n_seqs=12, mismatch=0.5, catastrophic=0.03, lp_noise=0.3)
BATCH, EXTRA, PACKING = pack(SEQS, row_len=16, num_rows=8)
MASKS = {  # the options, alone and together with the other rejections
  "tv": dict(dppo_tv_delta=0.05),
  "tv_low": dict(dppo_tv_delta=0.08, dppo_tv_delta_low=0.03),
  "tv_symmetric": dict(dppo_tv_delta=0.05, dppo_tv_symmetric=True),
  "kpop": dict(kpop_phi=0.01),
  "all": dict(dppo_tv_delta=0.06, kpop_phi=0.015, use_rs=True, rs_veto_threshold=1e-4, tis_mode="clip"),
}
MODES = mis_jax.config.LOSS_AGG_MODES


def mis_cfg(name, **kw):
  return mis_jax.MISConfig(tis_upper_bound=3.0, **{**MASKS[name], **kw})


@functools.lru_cache(maxsize=None)
def _weights_fn(cfg, mode):
  return jax.jit(
    lambda b: mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      cfg,
      num_segments=b.num_segments,
      metric_reduction=mode,
      advantages=b.advantages,
    )
  )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_match_the_oracle(name, mode):
  cfg = mis_cfg(name)
  w, kept, metrics = _weights_fn(cfg, mode)(BATCH)
  want = assert_weights_match_oracle(w, kept, metrics, SEQS, PACKING, cfg, mode)
  for key in ("mis_dppo_tv_masked_fraction", "mis_kpop_masked_fraction"):  # the sweep masks something, not all
    if key in want:
      assert 0.02 < want[key] < 0.6, (key, want[key])


def test_the_sign_decides_the_side():
  """Sign-conditioned: only upward moves are masked where A > 0, only downward ones elsewhere (A = 0
  included, as prime-rl's torch.where); symmetric: both, whatever A."""
  _, _, metrics = _weights_fn(mis_cfg("tv"), "token-mean")(BATCH)
  _, _, sym = _weights_fn(mis_cfg("tv_symmetric"), "token-mean")(BATCH)
  high, low = float(metrics["mis_dppo_tv_masked_fraction_high"]), float(metrics["mis_dppo_tv_masked_fraction_low"])
  assert high > 0 and low > 0
  assert float(sym["mis_dppo_tv_masked_fraction"]) > float(metrics["mis_dppo_tv_masked_fraction"])
  flat = [(s["o"][t], s["q"][t], s["adv"][t]) for s in SEQS for t in np.flatnonzero(s["m"])]
  up_pos = np.mean([np.exp(o) - np.exp(q) > 0.05 and a > 0 for o, q, a in flat])
  assert high == pytest.approx(up_pos, abs=1e-6)


def _loss_cfg(algo, masks, mode, sq=0.0, tokens="trainable", **kw):
  roll, tis = {"decoupled_ppo": (False, True), "reinforce_is": (True, True), "bypass_ppo": (True, False)}[algo]
  mis = mis_cfg(masks) if (tis and masks) else None
  return mis_jax.LossConfig(
    use_rollout_logprobs=roll,
    use_tis=tis,
    mis=mis,
    loss_agg_mode=mode,
    loss_scale_factor=12.0 if mode == "seq-mean-token-sum-norm" else None,
    sq_kl_coef=sq,
    sq_kl_tokens=tokens,
    eps_clip_high=0.28,
    **kw,
  )


def _oracle_cfg(cfg):
  return loss_keys(cfg)


CASES = [
  ("decoupled_ppo", "tv", 0.0, "trainable"),
  ("decoupled_ppo", "kpop", 0.3, "kept"),
  ("decoupled_ppo", "all", 0.3, "trainable"),
  ("reinforce_is", "tv_symmetric", 0.2, "kept"),
  ("reinforce_is", "tv_low", 0.2, "trainable"),
  ("bypass_ppo", None, 0.5, "trainable"),
  ("decoupled_ppo", None, 0.5, "kept"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo,masks,sq,tokens", CASES)
def test_loss_matches_the_oracle_in_every_mode(algo, masks, sq, tokens, mode):
  for denominator in ("kept", "original"):
    cfg = _loss_cfg(algo, masks, mode, sq, tokens, denominator=denominator)
    loss, metrics = mis_jax.policy_loss(EXTRA["lp"], BATCH, cfg)
    want_loss, want, _, _ = oracle.policy_loss(SEQS, _oracle_cfg(cfg))
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6, err_msg=denominator)
    assert_metrics_close(metrics, want)
    assert ("sq_kl_loss" in metrics) == (sq > 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("algo,masks,sq,tokens", [c for c in CASES if c[2] > 0])
def test_gradient_matches_finite_differences(algo, masks, sq, tokens, mode):
  cfg = _loss_cfg(algo, masks, mode, sq, tokens, denominator="original")
  grads = PACKING.unpack(
    np.asarray(jax.grad(lambda lp: mis_jax.policy_loss(lp, BATCH, cfg)[0])(jnp.asarray(EXTRA["lp"])))
  )
  ocfg, eps = _oracle_cfg(cfg), 1e-4
  for i, s in enumerate(SEQS):
    for t in np.flatnonzero(s["m"]):

      def f(delta):
        seqs = [dict(x) for x in SEQS]
        seqs[i] = dict(seqs[i], lp_sg=SEQS[i]["lp"], lp=SEQS[i]["lp"].copy())
        seqs[i]["lp"][t] += delta
        return oracle.policy_loss(seqs, ocfg)[0]

      np.testing.assert_allclose(
        grads[i][t], (f(eps) - f(-eps)) / (2 * eps), rtol=3e-3, atol=3e-5, err_msg=f"seq {i} token {t}"
      )
    assert not grads[i][~s["m"]].any(), "gradient leaked into masked tokens"


@pytest.mark.parametrize(
  "algo,masks,sq,tokens", [c for c in CASES if c[0] == "decoupled_ppo"] + [("reinforce_is", "all", 0.2, "kept")]
)
def test_microbatches_equal_one_batch(algo, masks, sq, tokens):
  """Per-token masks and a term aggregated with the step's denominators: k micro-batches add up to
  the batch (REINFORCE + IS runs the correction in each micro-batch: its denominators must be the
  original mask's, contract §7)."""
  cfg = _loss_cfg(
    algo, masks, "seq-mean-token-mean", sq, tokens, denominator="original" if algo == "reinforce_is" else "kept"
  )
  full_grad = jax.value_and_grad(lambda lp: mis_jax.policy_loss(lp, BATCH, cfg)[0])
  full, grad_full = full_grad(jnp.asarray(EXTRA["lp"]))
  correction, _ = mis_jax.prepare_step(BATCH, cfg)
  step = jax.jit(jax.value_and_grad(lambda lp, mb, c: mis_jax.policy_loss(lp, mb, cfg, correction=c)[0]))
  total, grads = 0.0, []
  for mb, c, lp in zip(
    mis_jax.split_microbatches(BATCH, 4), mis_jax.split_microbatches(correction, 4), np.split(EXTRA["lp"], 4)
  ):
    loss, g = step(jnp.asarray(lp), mb, c)
    total += float(loss)
    grads.append(np.asarray(g))
  np.testing.assert_allclose(total, float(full), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(grads), np.asarray(grad_full), rtol=1e-5, atol=1e-7)


def test_eight_devices_equal_one():
  for name in ("all", "tv_symmetric"):
    one, eight = prepare_step_on_mesh(BATCH, _loss_cfg("decoupled_ppo", name, "seq-mean-token-mean"))
    np.testing.assert_array_equal(np.asarray(one[0].kept_mask), np.asarray(eight[0].kept_mask))
    np.testing.assert_allclose(np.asarray(one[0].is_weights), np.asarray(eight[0].is_weights), rtol=1e-6)
    for k in one[1]:
      np.testing.assert_allclose(float(eight[1][k]), float(one[1][k]), rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
  mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  sharded_batch, lp = mis_jax.shard_batch(mesh, (BATCH, EXTRA["lp"]), data_axis="data", seq_axis="seq")
  for cfg in (
    _loss_cfg("decoupled_ppo", "all", "seq-mean-token-mean", 0.3, "kept"),
    _loss_cfg("reinforce_is", "tv", "token-mean", 0.3, "trainable"),
  ):
    (loss0, metrics0), grad0 = jax.value_and_grad(lambda lp: mis_jax.policy_loss(lp, BATCH, cfg), has_aux=True)(
      jnp.asarray(EXTRA["lp"])
    )
    sharded = mis_jax.sharded_policy_loss(mesh, cfg, data_axis="data", seq_axis="seq")
    with jax.set_mesh(mesh):
      (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda lp, b: sharded(lp, b, None), has_aux=True))(
        lp, sharded_batch
      )
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5, atol=1e-7)
    assert set(metrics) == set(metrics0)
    for k in metrics0:
      np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad0), rtol=1e-5, atol=1e-7)


def _flat(key):
  return np.concatenate([np.where(s["m"], s[key], 0.0) for s in SEQS])


@pytest.mark.parametrize("symmetric", [False, True])
def test_gradient_equals_prime_rls_loss(symmetric):
  """prime-rl's default (and ipo) loss is REINFORCE with the untruncated ratio, the DPPO-Binary-TV
  mask on (current p, p_q) and τ·(log r)² on every trainable token, summed: our REINFORCE + IS with
  an IS bound that never binds, that mask, sq_kl over the trainable tokens and token-sum has the
  same gradient (the loss values differ: -w·A·lp against -A·ratio) and masks the same tokens."""
  delta, tau = 0.05, 0.3
  masks = dict(dppo_tv_delta=delta, dppo_tv_symmetric=symmetric)
  cfg = mis_jax.LossConfig(
    use_rollout_logprobs=True,
    use_tis=True,
    loss_agg_mode="token-sum",
    denominator="original",
    sq_kl_coef=tau,
    mis=mis_jax.MISConfig(tis_upper_bound=1e30, **masks),
  )
  grad, metrics = jax.grad(lambda lp: mis_jax.policy_loss(lp, BATCH, cfg), has_aux=True)(jnp.asarray(EXTRA["lp"]))
  grad = np.concatenate(PACKING.unpack(np.asarray(grad)))
  m = np.concatenate([s["m"] for s in SEQS])
  lp = torch.tensor(_flat("lp"), dtype=torch.float64, requires_grad=True)
  args = (torch.tensor(_flat("q")), torch.tensor(_flat("adv")), torch.tensor(m))
  if symmetric:
    loss, masked = ref.prime_rl_ipo_loss(lp, *args, ipo_threshold=delta, kl_tau=tau)
  else:
    loss, masked = ref.prime_rl_default_loss(lp, *args, dppo_mask_high=delta, dppo_mask_low=delta, kl_tau=tau)
  loss.backward()
  np.testing.assert_allclose(grad, lp.grad.numpy(), rtol=1e-4, atol=1e-6)
  assert 0 < masked.sum() < m.sum()
  assert float(metrics["mis_dppo_tv_masked_fraction"]) == pytest.approx(masked.sum().item() / m.sum(), abs=1e-6)


def test_binary_kl_equals_verls():
  """Our KPop's binary KL against verl's (compute_policy_loss_dppo_kl): verl's D_B(p_old‖p) with
  1e-8 in the complements; ours clamps to [1e-6, 1 - 1e-6], which equals it away from 0 and 1."""
  from mis_jax import _correction

  rng = np.random.default_rng(0)
  lp, old = np.log(rng.uniform(1e-3, 0.99, 4096)), np.log(rng.uniform(1e-3, 0.99, 4096))
  want = ref.verl_binary_kl(torch.tensor(lp), torch.tensor(old)).numpy()
  got = np.asarray(_correction.binary_kl(jnp.asarray(old, jnp.float32), jnp.asarray(lp, jnp.float32)))
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-6)
  # Where the clamp binds, both stay finite and ours is the clamped probabilities' KL.
  edge = np.asarray(
    _correction.kpop_divergence(jnp.log(jnp.array([0.0, 1.0, 1e-9])), jnp.log(jnp.array([1.0, 0.0, 0.5])))
  )
  assert np.isfinite(edge).all()
  np.testing.assert_allclose(edge[2], max(oracle.bernoulli_kl(1e-6, 0.5), oracle.bernoulli_kl(0.5, 1e-6)), rtol=1e-5)


def test_sign_conditioned_mask_needs_the_advantages_and_settings_are_checked():
  with pytest.raises(ValueError, match="dppo_tv_delta.*pass advantages="):
    mis_jax.compute_mis_weights(
      BATCH.old_logprobs,
      BATCH.rollout_logprobs,
      BATCH.loss_mask,
      BATCH.segment_ids,
      mis_cfg("tv"),
      num_segments=BATCH.num_segments,
    )
  mis_jax.compute_mis_weights(
    BATCH.old_logprobs,
    BATCH.rollout_logprobs,
    BATCH.loss_mask,
    BATCH.segment_ids,
    mis_cfg("tv_symmetric"),
    num_segments=BATCH.num_segments,
  )  # no advantages needed
  for kw, match in [
    (dict(dppo_tv_delta_low=0.1), "dppo_tv_delta_low.*dppo_tv_delta is not"),
    (dict(dppo_tv_symmetric=True), "dppo_tv_symmetric.*dppo_tv_delta is not"),
    (dict(dppo_tv_delta=0.1, dppo_tv_symmetric=True, dppo_tv_delta_low=0.1), "whatever the advantage"),
    (dict(kpop_phi=0.0), "kpop_phi"),
    (dict(dppo_tv_delta=-0.1), "dppo_tv_delta"),
  ]:
    with pytest.raises(mis_jax.ConfigError, match=match):
      mis_jax.MISConfig(**kw)
  with pytest.raises(mis_jax.ConfigError, match="sq_kl_tokens"):
    mis_jax.LossConfig(sq_kl_coef=0.1, sq_kl_tokens="all")
  no_rollout = mis_jax.PackedBatch(
    segment_ids=BATCH.segment_ids,
    loss_mask=BATCH.loss_mask,
    advantages=BATCH.advantages,
    old_logprobs=BATCH.old_logprobs,
    num_segments=BATCH.num_segments,
  )
  with pytest.raises(ValueError, match="sq_kl_coef=0.1 > 0.*needs batch.rollout_logprobs"):
    mis_jax.policy_loss(EXTRA["lp"], no_rollout, mis_jax.LossConfig(sq_kl_coef=0.1))


def test_off_by_default():
  assert mis_jax.MISConfig() == mis_jax.MISConfig(dppo_tv_delta=None, kpop_phi=None)
  cfg = _loss_cfg("decoupled_ppo", None, "token-mean")
  assert "sq_kl_loss" not in mis_jax.policy_loss(EXTRA["lp"], BATCH, cfg)[1]
