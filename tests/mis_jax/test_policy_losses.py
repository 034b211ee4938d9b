"""verl's policy-loss forms (contract §6.2) composed with the algorithms and corrections: against
the NumPy oracle (written from the papers' formulas), finite differences, micro-batches, 8
devices and jit; the combinations that mean nothing are refused before tracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import mis_jax
import oracle
from helpers import assert_metrics_close, loss_keys, pack, random_seqs

SEQS = random_seqs(
  np.random.default_rng(7), n_seqs=10, mismatch=0.3, catastrophic=0.03, with_ref=True, with_entropy=True, lp_noise=0.25
)
BATCH, EXTRA, PACKING = pack(SEQS, row_len=16, num_rows=4)
REFERENCE = mis_jax.MISConfig.from_yaml("configs/mis.yaml")
ALGOS = {"ppo": (False, False), "bypass_ppo": (True, False), "decoupled_ppo": (False, True)}
# Each form's own keys, set away from their defaults where the defaults would select nothing
# on a batch this small (clip_cov / kl_cov pick 0.02 % of the tokens by default).
FORM_KEYS = {
  "vanilla": {"eps_clip_c": 3.0},
  "dppo_tv": {"eps_clip_c": 1.5},
  "dppo_kl": {},
  "gspo": {},
  "sapo": {"tau_pos": 1.2, "tau_neg": 2.0},
  "gpg": {},
  "geo_mean": {},
  "dro": {"dro_beta": 0.3},
  "cispo": {},
  "clip_cov": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0},
  "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5},
}
assert set(FORM_KEYS) == set(mis_jax.forms.POLICY_LOSSES)
KEY = jax.random.key(3)


def cfg_of(form, algo, mis=REFERENCE, **kw):
  roll, tis = ALGOS[algo]
  return mis_jax.LossConfig(
    use_rollout_logprobs=roll,
    use_tis=tis,
    mis=mis if tis else None,
    policy_loss={"name": form, **FORM_KEYS[form]},
    eps_clip_high=0.28,
    kl_coef=0.05,
    entropy_coef=0.01,
    **kw,
  )


def oracle_cfg(cfg, correction=None):
  d = loss_keys(cfg)
  if correction is not None and correction.cov_selected is not None:
    d["cov_selected"] = PACKING.unpack(np.asarray(correction.cov_selected))
  return d


def run(cfg, lp=EXTRA["lp"], batch=BATCH, **kw):
  return mis_jax.policy_loss(lp, batch, cfg, entropy=EXTRA["ent"], key=KEY, **kw)


def prepared(cfg):
  """The step's correction without its denominators where it selects tokens (clip_cov needs the
  selection for the oracle), else None."""
  return mis_jax.prepare_step(BATCH, cfg, key=KEY)[0].replace(denominators=None) if cfg.uses_cov_selection else None


CASES = [(f, a) for f in mis_jax.forms.POLICY_LOSSES for a in ALGOS]


@pytest.mark.parametrize("form,algo", CASES)
def test_form_matches_oracle(form, algo):
  cfg = cfg_of(form, algo)
  correction = prepared(cfg)
  if correction is not None:  # the selection alone: the weights are the loss's own
    correction = mis_jax.Correction(cov_selected=correction.cov_selected)
  loss, metrics = run(cfg, correction=correction)
  want_loss, want, _, _ = oracle.policy_loss(SEQS, oracle_cfg(cfg, correction))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("form", ["gspo", "geo_mean", "dppo_kl", "kl_cov"])
def test_form_matches_oracle_in_every_mode(form, mode):
  cfg = cfg_of(
    form, "decoupled_ppo", loss_agg_mode=mode, loss_scale_factor=12.0 if mode == "seq-mean-token-sum-norm" else None
  )
  loss, metrics = run(cfg)
  want_loss, want, _, _ = oracle.policy_loss(SEQS, oracle_cfg(cfg))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want)


def test_kl_cov_selection_is_the_top_covariance_tokens():
  cfg = cfg_of("kl_cov", "ppo")
  selected = np.asarray(mis_jax.prepare_step(BATCH, cfg)[0].cov_selected)
  want = oracle.cov_selection(
    SEQS, [np.where(s["m"], s["o"], 0.0) for s in SEQS], [s["m"] for s in SEQS], oracle_cfg(cfg)
  )
  for got, w in zip(PACKING.unpack(selected), want):
    np.testing.assert_array_equal(got, w)
  assert 0 < selected.sum() == max(int(0.1 * sum(s["m"].sum() for s in SEQS)), 1)


def test_clip_cov_selection_draws_k_candidates_by_key():
  """clip_cov keeps ⌊ratio·n⌋ (≥ 1) of its candidates (covariance strictly inside the band) at
  random: always candidates, exactly that many while there are enough, all of them when not;
  another key draws other tokens."""
  n = sum(int(s["m"].sum()) for s in SEQS)
  flat = [(i, t) for i, s in enumerate(SEQS) for t in np.flatnonzero(s["m"])]
  adv = np.array([SEQS[i]["adv"][t] for i, t in flat])
  anchor = np.array([SEQS[i]["o"][t] for i, t in flat])
  cov = (adv - adv.mean()) * (anchor - anchor.mean())
  draws = set()
  for ratio, (lb, ub) in [(0.1, (0.05, 2.0)), (0.5, (0.05, 2.0)), (0.1, (3.0, 4.0))]:
    cfg = dataclasses.replace(
      cfg_of("clip_cov", "ppo"),
      policy_loss={"name": "clip_cov", "clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub},
    )
    candidates = {flat[j] for j in np.flatnonzero((cov > lb) & (cov < ub))}
    for seed in (0, 1):
      sel = PACKING.unpack(np.asarray(mis_jax.prepare_step(BATCH, cfg, key=jax.random.key(seed))[0].cov_selected))
      picked = {(i, t) for i, s in enumerate(sel) for t in np.flatnonzero(s)}
      assert picked <= candidates
      assert len(picked) == min(max(int(np.floor(ratio * n)), 1), len(candidates))
      draws.add(frozenset(picked))
  assert len(draws) >= 3, "the key does not change the draw"


@pytest.mark.parametrize("form", mis_jax.forms.POLICY_LOSSES)
def test_gradient_matches_finite_differences(form):
  algo = "ppo" if form == "vanilla" else "decoupled_ppo"
  cfg = cfg_of(form, algo, mis=mis_jax.MISConfig(tis_level="token", tis_mode="clip", tis_upper_bound=1.5))
  correction = prepared(cfg)
  grads = PACKING.unpack(
    np.asarray(jax.grad(lambda lp: run(cfg, lp, correction=correction)[0])(jnp.asarray(EXTRA["lp"])))
  )
  ocfg = oracle_cfg(cfg, correction)
  eps = 1e-4
  for i, s in enumerate(SEQS):
    for t in np.flatnonzero(s["m"]):

      def f(delta):
        seqs = [dict(x) for x in SEQS]
        seqs[i] = dict(seqs[i], lp_sg=SEQS[i]["lp"], lp=SEQS[i]["lp"].copy())
        seqs[i]["lp"][t] += delta
        return oracle.policy_loss(seqs, ocfg)[0]

      fd = (f(eps) - f(-eps)) / (2 * eps)
      np.testing.assert_allclose(grads[i][t], fd, rtol=3e-3, atol=3e-5, err_msg=f"{form}: seq {i} token {t}")
    assert not grads[i][~s["m"]].any(), "gradient leaked into masked tokens"


@pytest.mark.parametrize("form", mis_jax.forms.POLICY_LOSSES)
def test_microbatches_and_jit_equal_one_batch(form):
  cfg = cfg_of(form, "decoupled_ppo")
  full, full_metrics = run(cfg)
  grad_full = jax.grad(lambda lp: run(cfg, lp)[0])(jnp.asarray(EXTRA["lp"]))
  correction, _ = mis_jax.prepare_step(BATCH, cfg, key=KEY)
  step = jax.jit(
    jax.value_and_grad(lambda lp, mb, ent, c: mis_jax.policy_loss(lp, mb, cfg, entropy=ent, correction=c)[0])
  )
  total, grads = 0.0, []
  for mb, c, lp, ent in zip(
    mis_jax.split_microbatches(BATCH, 4),
    mis_jax.split_microbatches(correction, 4),
    np.split(EXTRA["lp"], 4),
    np.split(EXTRA["ent"], 4),
  ):
    loss, g = step(jnp.asarray(lp), mb, ent, c)
    total += float(loss)
    grads.append(np.asarray(g))
  np.testing.assert_allclose(total, float(full), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(grads), np.asarray(grad_full), rtol=1e-5, atol=1e-7)
  jitted, jit_metrics = jax.jit(lambda lp: run(cfg, lp))(EXTRA["lp"])
  np.testing.assert_allclose(float(jitted), float(full), rtol=1e-6, atol=1e-7)
  assert_metrics_close(jit_metrics, {k: float(v) for k, v in full_metrics.items()})


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["4x2-seq"])
def test_eight_devices_equal_one(layout):
  shape, names, data_axis, seq_axis = {
    "8-data": ((8,), ("data",), "data", None),
    "4x2-seq": ((4, 2), ("data", "seq"), "data", "seq"),
  }[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  seqs = random_seqs(np.random.default_rng(11), n_seqs=12, with_ref=True, with_entropy=True, lp_noise=0.25)
  batch, extra, _ = pack(seqs, row_len=16, num_rows=8)
  sharded_batch, lp, ent = mis_jax.shard_batch(
    mesh, (batch, extra["lp"], extra["ent"]), data_axis=data_axis, seq_axis=seq_axis
  )
  for form in mis_jax.forms.POLICY_LOSSES:
    cfg = cfg_of(form, "decoupled_ppo")
    f = lambda lp, b, ent: mis_jax.policy_loss(lp, b, cfg, entropy=ent, key=KEY)
    (loss0, metrics0), grad0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(extra["lp"]), batch, extra["ent"])
    sharded = mis_jax.sharded_policy_loss(mesh, cfg, data_axis=data_axis, seq_axis=seq_axis)
    with jax.set_mesh(mesh):
      (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda lp, b, e: sharded(lp, b, e, KEY), has_aux=True))(
        lp, sharded_batch, ent
      )
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5, atol=1e-7, err_msg=form)
    assert set(metrics) == set(metrics0)
    for k in metrics0:
      np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=f"{form} {k}")
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad0), rtol=1e-5, atol=1e-7, err_msg=form)


def test_reinforce_is_takes_the_ratio_free_forms():
  """REINFORCE + IS is `-w·A·lp`: vanilla and gpg name it; a form with a ratio has no anchor there."""
  base = dict(use_rollout_logprobs=True, use_tis=True, mis=REFERENCE, denominator="original")
  a = run(mis_jax.LossConfig(**base))[0]
  b = run(mis_jax.LossConfig(**base, policy_loss="gpg"))[0]
  np.testing.assert_allclose(float(a), float(b), rtol=1e-7)
  for form in set(mis_jax.forms.POLICY_LOSSES) - {"vanilla", "gpg"}:
    with pytest.raises(mis_jax.ConfigError, match=f"policy_loss '{form}' forms a ratio.*REINFORCE"):
      mis_jax.LossConfig(**base, policy_loss={"name": form, **FORM_KEYS[form]})


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(policy_loss="dro"), "needs key 'dro_beta'"),
    (
      dict(policy_loss={"name": "gspo", "eps_clip_c": 3.0}),
      "key 'policy_loss.eps_clip_c' is a key of policy_loss vanilla / dppo_tv / dppo_kl, not of gspo",
    ),
    (
      dict(policy_loss={"name": "clip_cov", "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}),
      "'policy_loss.clip_cov_lb' .* must be below",
    ),
    (dict(loss_agg_mode="seq-mean-token-sum-norm"), "needs key 'loss_scale_factor'"),
    (dict(loss_scale_factor=100.0), "only by loss_agg_mode 'seq-mean-token-sum-norm'"),
    (dict(policy_loss="ppo"), "key 'policy_loss'.*'ppo'"),
    (dict(policy_loss={"name": "sapo", "tau_neg": 0.0}), "key 'policy_loss.tau_neg' must be > 0"),
  ],
)
def test_meaningless_settings_are_refused(kw, match):
  with pytest.raises(mis_jax.ConfigError, match=match):
    mis_jax.LossConfig(**kw)


def test_clip_cov_without_a_key_is_refused_before_tracing():
  cfg = cfg_of("clip_cov", "ppo")
  with pytest.raises(ValueError, match="picks its tokens at random: pass key="):
    mis_jax.policy_loss(EXTRA["lp"], BATCH, cfg, entropy=EXTRA["ent"])
  with pytest.raises(ValueError, match="pass key="):
    mis_jax.prepare_step(BATCH, cfg)
  selected = mis_jax.prepare_step(BATCH, cfg, key=KEY)[0]
  mis_jax.policy_loss(
    EXTRA["lp"], BATCH, cfg, entropy=EXTRA["ent"], correction=selected
  )  # the step's selection needs no key
