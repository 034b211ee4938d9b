"""policy_loss against the NumPy oracle, hand-worked numbers and invariants (contract §6–8)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
import oracle
from helpers import assert_metrics_close, loss_keys, pack, pad_one_per_row, random_seqs

ALGOS = {
  "ppo": (False, False),
  "bypass_ppo": (True, False),
  "decoupled_ppo": (False, True),
  "reinforce_is": (True, True),
}
MIS_CONFIGS = {
  "vanilla": None,
  "reference": mis_jax.MISConfig.from_yaml("configs/mis.yaml").to_dict(),
  "seq-mask-veto": dict(
    tis_level="sequence", tis_mode="mask", tis_upper_bound=3.0, tis_lower_bound=0.3, rs_veto_threshold=1e-4
  ),
  "geo-clip-bn": dict(
    tis_level="geometric", tis_mode="clip", use_rs=True, rs_level="token", rs_upper_bound=4.0, tis_batch_normalize=True
  ),
}
SEQS = random_seqs(
  np.random.default_rng(1), n_seqs=9, mismatch=0.35, catastrophic=0.04, with_ref=True, with_entropy=True
)
BATCH, EXTRA, PACKING = pack(SEQS, row_len=16, num_rows=4)


def loss_cfg(algo, correction="vanilla", **kw):
  roll, tis = ALGOS[algo]
  mis = MIS_CONFIGS[correction] if tis else None
  return mis_jax.LossConfig(use_rollout_logprobs=roll, use_tis=tis, mis=mis_jax.MISConfig(**mis) if mis else None, **kw)


def oracle_cfg(cfg: mis_jax.LossConfig):
  return loss_keys(cfg)


def run(cfg, batch=BATCH, extra=EXTRA, **kw):
  return mis_jax.policy_loss(extra["lp"], batch, cfg, entropy=extra.get("ent"), **kw)


SCALE_FACTOR = {"seq-mean-token-sum-norm": 7.0}
CASES = [
  (a, c, mode, den)
  for a in ALGOS
  for c in (MIS_CONFIGS if ALGOS[a][1] else ["vanilla"])
  for mode, den in itertools.product(mis_jax.config.LOSS_AGG_MODES, mis_jax.config.DENOMINATORS)
]


@pytest.mark.parametrize("algo,correction,mode,den", CASES)
def test_policy_loss_matches_oracle(algo, correction, mode, den):
  cfg = loss_cfg(
    algo,
    correction,
    loss_agg_mode=mode,
    denominator=den,
    entropy_coef=0.01,
    kl_coef=0.05,
    eps_clip_high=0.28,
    policy_loss={"name": "vanilla", "eps_clip_c": 3.0},
    loss_scale_factor=SCALE_FACTOR.get(mode),
  )
  loss, metrics = run(cfg)
  want_loss, want, _, _ = oracle.policy_loss(SEQS, oracle_cfg(cfg))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want)


@pytest.mark.parametrize("algo", ALGOS)
def test_gradient_matches_finite_differences_of_oracle(algo):
  cfg = loss_cfg(
    algo,
    "seq-mask-veto" if ALGOS[algo][1] else "vanilla",
    policy_loss={"name": "vanilla", "eps_clip_c": 3.0},
    kl_coef=0.1,
    loss_agg_mode="seq-mean-token-mean",
  )
  grad = np.asarray(jax.grad(lambda lp: run(cfg, extra={"lp": lp})[0])(jnp.asarray(EXTRA["lp"])))
  grads = PACKING.unpack(grad)
  ocfg = oracle_cfg(cfg)
  eps = 1e-4
  for i, s in enumerate(SEQS):
    for t in np.flatnonzero(s["m"]):

      def f(delta):
        seqs = [dict(x) for x in SEQS]
        seqs[i] = dict(seqs[i], lp_sg=SEQS[i]["lp"], lp=SEQS[i]["lp"].copy())
        seqs[i]["lp"][t] += delta
        return oracle.policy_loss(seqs, ocfg)[0]

      fd = (f(eps) - f(-eps)) / (2 * eps)
      np.testing.assert_allclose(grads[i][t], fd, rtol=2e-3, atol=2e-5, err_msg=f"seq {i} token {t}")
    assert not grads[i][~s["m"]].any(), "gradient leaked into masked tokens"


def test_hand_worked_decoupled_loss():
  """The three sequences of test_weights' hand-worked case, lp = o (ratio 1), A = +1, -1, +2.

  Weights after veto + batch norm (mu = 1.375): A [1, 2, .5]/mu, B [2]/mu, C rejected, so
  pg_t = -A·w: A [-1, -2, -.5]/mu, B [+2]/mu.
  """
  ln, q, mu = np.log, -1.0, 1.375
  o = np.array([[q, q + ln(4), q + ln(0.5), q + ln(2), np.nan], [q, q, q + ln(3), q + ln(0.25), np.nan]], np.float32)
  seg = np.array([[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]], np.int32)
  m = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], np.float32)
  adv = np.array([[1, 1, 1, -1, -1], [2, 2, 2, 2, 0]], np.float32)
  qa = np.where(seg >= 0, q, np.nan).astype(np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=seg, loss_mask=m, advantages=adv, rollout_logprobs=qa, old_logprobs=o, num_segments=3
  )
  mis = mis_jax.MISConfig(tis_upper_bound=2.0, rs_veto_threshold=0.3, tis_batch_normalize=True)
  a_sum, b_sum = -3.5 / mu, 2 / mu
  expected = {
    ("seq-mean-token-mean", "kept"): (a_sum / 3 + b_sum / 1) / 2,  # 0.303030
    ("seq-mean-token-mean", "original"): (a_sum / 3 + b_sum / 1 + 0) / 3,  # 0.202020
    ("token-mean", "kept"): (a_sum + b_sum) / 4,  # -0.272727
    ("token-mean", "original"): (a_sum + b_sum) / 8,  # -0.136364
    ("seq-mean-token-sum", "kept"): (a_sum + b_sum) / 2,
    ("seq-mean-token-sum", "original"): (a_sum + b_sum) / 3,
  }
  for (mode, den), want in expected.items():
    cfg = mis_jax.LossConfig(use_tis=True, mis=mis, loss_agg_mode=mode, denominator=den)
    loss, met = mis_jax.policy_loss(jnp.asarray(o), batch, cfg)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, err_msg=f"{mode}/{den}")
    np.testing.assert_allclose(float(met["ois"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(met["pg_clipfrac"]), 0.0)
  np.testing.assert_allclose(
    [0.303030303, 0.2020202, -0.27272727, -0.13636364], [expected[k] for k in list(expected)[:4]], rtol=1e-6
  )


@pytest.mark.parametrize("algo", ALGOS)
def test_packed_equals_padded(algo):
  cfg = loss_cfg(algo, "geo-clip-bn", kl_coef=0.1, entropy_coef=0.01)
  padded, pextra = pad_one_per_row(SEQS)
  loss_p, met_p = run(cfg)
  loss_u, met_u = run(cfg, padded, pextra)
  np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=1e-6)
  for k in met_p:
    np.testing.assert_allclose(float(met_p[k]), float(met_u[k]), rtol=1e-5, atol=1e-7, err_msg=k)
  g_p = jax.grad(lambda lp: run(cfg, extra={**EXTRA, "lp": lp})[0])(jnp.asarray(EXTRA["lp"]))
  g_u = jax.grad(lambda lp: run(cfg, padded, {**pextra, "lp": lp})[0])(jnp.asarray(pextra["lp"]))
  unpadded = [np.asarray(g_u)[i, : len(s["m"])] for i, s in enumerate(SEQS)]
  for a, b in zip(PACKING.unpack(np.asarray(g_p)), unpadded):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


MICRO_CASES = [
  ("ppo", "vanilla", "kept"),
  ("bypass_ppo", "vanilla", "kept"),
  ("decoupled_ppo", "reference", "kept"),
  ("decoupled_ppo", "geo-clip-bn", "original"),
  ("decoupled_ppo", "vanilla", "kept"),
  ("reinforce_is", "seq-mask-veto", "original"),
]


@pytest.mark.parametrize("algo,correction,den", MICRO_CASES)
@pytest.mark.parametrize("mode", mis_jax.config.LOSS_AGG_MODES)
@pytest.mark.slow
def test_microbatches_sum_to_full_batch(algo, correction, den, mode):
  cfg = loss_cfg(
    algo,
    correction,
    loss_agg_mode=mode,
    denominator=den,
    kl_coef=0.1,
    entropy_coef=0.01,
    loss_scale_factor=SCALE_FACTOR.get(mode),
  )
  full_loss, _ = run(cfg)
  grad_full = jax.grad(lambda lp: run(cfg, extra={**EXTRA, "lp": lp})[0])(jnp.asarray(EXTRA["lp"]))
  correction, _ = mis_jax.prepare_step(BATCH, cfg)
  assert correction.denominators is not None
  lp_parts = np.split(EXTRA["lp"], 4)
  ent_parts = np.split(EXTRA["ent"], 4)
  total, grads = 0.0, []
  for mb, c, lp, ent in zip(
    mis_jax.split_microbatches(BATCH, 4), mis_jax.split_microbatches(correction, 4), lp_parts, ent_parts
  ):
    f = lambda lp: mis_jax.policy_loss(lp, mb, cfg, entropy=ent, correction=c)[0]
    loss, g = jax.value_and_grad(f)(jnp.asarray(lp))
    total += float(loss)
    grads.append(np.asarray(g))
  # token-sum has no denominator: float32 sums of O(1) terms, in another order, cancel to O(1e-2).
  np.testing.assert_allclose(total, float(full_loss), rtol=1e-5, atol=1e-5 if mode == "token-sum" else 1e-6)
  np.testing.assert_allclose(np.concatenate(grads), np.asarray(grad_full), rtol=1e-5, atol=1e-7)


def test_jit_equals_eager():
  for algo in ALGOS:
    cfg = loss_cfg(algo, "reference", kl_coef=0.1, entropy_coef=0.01)
    eager = run(cfg)
    jitted = jax.jit(mis_jax.policy_loss, static_argnums=2)(EXTRA["lp"], BATCH, cfg, EXTRA["ent"])
    np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6)
    assert set(jitted[1]) == set(eager[1])
    for k in eager[1]:
      np.testing.assert_allclose(float(jitted[1][k]), float(eager[1][k]), rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("algo", ALGOS)
def test_gradient_only_through_logprobs(algo):
  cfg = loss_cfg(algo, "reference", kl_coef=0.1)
  fields = ("advantages", "rollout_logprobs", "old_logprobs")
  clean = {f: jnp.nan_to_num(jnp.asarray(getattr(BATCH, f))) for f in fields}

  def f(values):
    return mis_jax.policy_loss(jnp.nan_to_num(jnp.asarray(EXTRA["lp"])), BATCH.replace(**values), cfg)[0]

  grads = jax.grad(f)(clean)
  for k, g in grads.items():
    assert not np.asarray(g).any(), f"gradient flowed into {k}"


@pytest.mark.parametrize("correction", ["vanilla", "reference", "seq-mask-veto"])
def test_decoupled_with_o_equal_q_is_standard_ppo(correction):
  batch = BATCH.replace(rollout_logprobs=BATCH.old_logprobs)
  ppo_loss, _ = run(loss_cfg("ppo", kl_coef=0.1), batch)
  dec_loss, met = run(loss_cfg("decoupled_ppo", correction, kl_coef=0.1), batch)
  np.testing.assert_allclose(float(dec_loss), float(ppo_loss), rtol=1e-6)
  g1 = jax.grad(lambda lp: run(loss_cfg("ppo"), batch, {"lp": lp})[0])(jnp.asarray(EXTRA["lp"]))
  g2 = jax.grad(lambda lp: run(loss_cfg("decoupled_ppo", correction), batch, {"lp": lp})[0])(jnp.asarray(EXTRA["lp"]))
  np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-6, atol=1e-8)


def test_bypass_with_o_equal_q_is_standard_ppo():
  batch = BATCH.replace(rollout_logprobs=BATCH.old_logprobs)
  for mode in mis_jax.config.LOSS_AGG_MODES:
    a, ma = run(loss_cfg("ppo", loss_agg_mode=mode, loss_scale_factor=SCALE_FACTOR.get(mode)), batch)
    b, mb = run(loss_cfg("bypass_ppo", loss_agg_mode=mode, loss_scale_factor=SCALE_FACTOR.get(mode)), batch)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    assert set(ma) == set(mb)


def test_metric_key_sets_per_algorithm():
  base = {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss"}
  mismatch = {
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
    "mis_nonfinite_rollout_logprob_count",
    "mis_nonfinite_rollout_logprob_fraction",
  }  # whenever q is given
  vanilla = {"tis", "tis_clipfrac", "tis_abs"}
  assert set(run(loss_cfg("ppo", kl_coef=0.1))[1]) == base | mismatch
  assert set(run(loss_cfg("ppo", kl_coef=0.1), BATCH.replace(rollout_logprobs=None))[1]) == base
  assert set(run(loss_cfg("bypass_ppo", kl_coef=0.1))[1]) == base | mismatch
  assert set(run(loss_cfg("decoupled_ppo", kl_coef=0.1))[1]) == base | mismatch | vanilla | {"ois"}
  assert set(run(loss_cfg("reinforce_is", kl_coef=0.1))[1]) == base | mismatch | vanilla
  no_extras = run(loss_cfg("ppo"), BATCH.replace(ref_logprobs=None), {"lp": EXTRA["lp"]})[1]
  assert set(no_extras) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl"} | mismatch


def user_correction(train_logprobs, rollout_logprobs, loss_mask, segment_ids, cfg, *, num_segments, axis_name=None):
  """A user correction: keep tokens with |r| < 0.5, weight 1.5. Used by path below."""
  r = jnp.where(loss_mask, train_logprobs - rollout_logprobs, 0.0)
  kept = (jnp.abs(r) < 0.5) & jnp.asarray(loss_mask, bool)
  return jnp.where(kept, 1.5, 0.0), kept, {"user_kept": jnp.mean(kept.astype(jnp.float32))}


@pytest.mark.parametrize("spec", [user_correction, "test_losses.user_correction", "test_losses:user_correction"])
def test_user_correction_function(spec):
  cfg = mis_jax.LossConfig(use_tis=True, correction_fn=spec, loss_agg_mode="token-mean")
  loss, met = run(cfg)
  assert "user_kept" in met and "ois" in met
  # Independent value: token-mean over kept tokens of 1.5 * ppo_t.
  num, den = 0.0, 0
  for s in SEQS:
    m = s["m"]
    kept = m & (np.abs(np.where(m, s["o"] - s["q"], 0)) < 0.5)
    ratio = np.exp(s["lp"][kept] - s["o"][kept])
    a = s["adv"][kept]
    num += float(np.sum(1.5 * np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))))
    den += int(kept.sum())
  np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)


def test_the_loss_pass_traces_once_for_every_batch_of_a_shape():
  """chex guards the jitted loss pass (weights, masks, loss, metrics and its gradient): batches of
  one packed shape with other sequences, lengths, live counts and mismatches reuse one trace."""
  import chex

  cfg = loss_cfg("decoupled_ppo", "reference")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(lp, batch):
    return jax.value_and_grad(lambda x: mis_jax.policy_loss(x, batch, cfg), has_aux=True)(lp)

  for seed, n_seqs in ((2, 9), (3, 5), (4, 12)):
    seqs = random_seqs(np.random.default_rng(seed), n_seqs=n_seqs, mismatch=0.1 * seed, with_ref=True)
    batch, extra, _ = pack(seqs, row_len=16, num_rows=8, num_segments=16)
    (value, metrics), grad = step(extra["lp"], batch)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("algo", ["decoupled_ppo", "reinforce_is"])
def test_a_batch_masked_whole_gives_zero_loss_and_finite_gradients(algo):
  """A setting that keeps no token (every ratio e^5, outside the mask band [0.5, 2]): loss 0,
  gradients zero and finite, every metric finite, `mis_masked_whole_batch` 1, in every mode and
  denominator, and over micro-batches (the reduction keeps it 1); a batch that keeps a token: 0."""
  rng = np.random.default_rng(3)
  seg = np.repeat(np.arange(4), 8).astype(np.int32)
  q = -rng.uniform(0.1, 2.0, seg.size).astype(np.float32)
  mis = mis_jax.MISConfig(tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0)
  for mode, den in itertools.product(mis_jax.config.LOSS_AGG_MODES, mis_jax.config.DENOMINATORS):
    cfg = mis_jax.LossConfig(
      use_tis=True,
      mis=mis,
      loss_agg_mode=mode,
      denominator=den,
      use_rollout_logprobs=algo == "reinforce_is",
      loss_scale_factor=8.0 if mode == "seq-mean-token-sum-norm" else None,
    )
    for shift, whole in ((5.0, 1.0), (0.0, 0.0)):
      o = q + shift
      batch = mis_jax.PackedBatch(
        segment_ids=seg,
        loss_mask=np.ones(seg.size, bool),
        advantages=rng.normal(size=seg.size).astype(np.float32),
        rollout_logprobs=q,
        old_logprobs=None if algo == "reinforce_is" else o,
        num_segments=4,
      )
      correction, step_metrics = mis_jax.prepare_step(batch, cfg)
      (loss, metrics), grad = jax.value_and_grad(
        lambda lp: mis_jax.policy_loss(lp, batch, cfg, correction=correction), has_aux=True
      )(jnp.asarray(o))
      metrics = {**metrics, **step_metrics}
      assert all(np.isfinite(float(v)) for v in metrics.values()), (mode, den)
      assert float(metrics["mis_masked_whole_batch"]) == whole, (mode, den, shift)
      if whole:
        assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0), (mode, den)
  assert mis_jax.microbatch_reduction("mis_masked_whole_batch") == "min"


def test_k3_is_never_negative_and_accurate_at_tiny_mismatch():
  """`mis_k3_kl` = mean `exp(r) - r - 1`, computed as `expm1(r) - r`: at |r| ~ 1e-4 the float32 form
  `exp(r) - r - 1` goes negative (contract §8.1's k3 is >= 0); the value matches float64."""
  rng = np.random.default_rng(7)
  t = 64
  q = (-rng.uniform(0.5, 3.0, t)).astype(np.float32)
  o = (q + rng.choice([-1.0, 1.0], t) * rng.uniform(0.5e-4, 1.5e-4, t)).astype(np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=np.zeros(t, np.int32),
    loss_mask=np.ones(t, bool),
    advantages=np.ones(t, np.float32),
    rollout_logprobs=q,
    old_logprobs=o,
    num_segments=1,
  )
  cfg = mis_jax.LossConfig(get_mismatch_metrics=True, loss_agg_mode="token-mean")
  _, metrics = jax.jit(lambda lp: mis_jax.policy_loss(lp, batch, cfg))(jnp.asarray(o))
  r = o.astype(np.float64) - q.astype(np.float64)
  want = float(np.mean(np.expm1(r) - r))
  naive = float(np.mean(np.exp(r.astype(np.float32)) - r.astype(np.float32) - np.float32(1.0)))
  assert float(metrics["mis_k3_kl"]) >= 0.0
  np.testing.assert_allclose(float(metrics["mis_k3_kl"]), want, rtol=0.05)
  assert abs(naive - want) > abs(float(metrics["mis_k3_kl"]) - want)  # the old form was the worse one
