"""Score centering (contract §6.6): the policy gradient's sampled-token score minus the sampler-expected
score, estimated from the sampler's top-k with a proportional tail. The loss value and every metric
against the NumPy oracle (loops over sequences), the gradient on the logits against the oracle's
``g_t (e_y - q̂_t)`` and against finite differences of the written-out surrogate, the sampler's drift
gone in expectation, the invariants (k micro-batches, 8 devices, packed == padded, jit == eager), the
edge cases (sampled token in and out of the top-k, q_tail ≈ 0, k = 1, k = V) and every bad input;
and ``mis_jax.token_logprobs(..., extra_ids=)``, the gather inside the chunked pass."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
import oracle
from mis_jax import _centering
from helpers import assert_metrics_close

V, K = 12, 3
CENTRING_NAMES = (
  "score_centering_tv",
  "score_centering_tail_mass",
  "score_centering_drift",
  "score_centering_residual_bound",
)


def centring_seqs(rng, n_seqs=8, max_len=7, k=K, vocab=V, mismatch=0.6):
  """Sequences with per-token trainer logits ``z``, a sampler ``q = softmax(z + noise)``, the
  sampled ``y ~ q``, the sampler's top-k ``ids``/``qk``; prompt tokens, an untrained and an empty
  sequence, NaN in the masked float fields."""
  seqs = []
  for i in range(n_seqs):
    n = 0 if i == n_seqs - 1 else int(rng.integers(1, max_len + 1))
    m = rng.random(n) < 0.85
    if n and rng.random() < 0.5:
      m[: int(rng.integers(0, n))] = False
    if i == 1:
      m[:] = False
    z = rng.normal(0.0, 1.5, (n, vocab))
    log_q = oracle.log_softmax(z + rng.normal(0.0, mismatch, (n, vocab)))
    y = np.array([rng.choice(vocab, p=np.exp(row) / np.exp(row).sum()) for row in log_q], np.int64)
    ids = np.argsort(-log_q, axis=-1, kind="stable")[:, :k]
    lp = oracle.log_softmax(z)[np.arange(n), y]
    s = dict(
      m=m,
      z=z,
      y=y,
      ids=ids,
      qk=np.take_along_axis(log_q, ids, -1),
      lp=lp,
      q=log_q[np.arange(n), y],
      o=lp + rng.normal(0.0, 0.05, n),
      adv=np.full(n, rng.normal()),
    )
    for key in ("q", "o", "adv", "qk"):
      s[key] = np.where(m if s[key].ndim == 1 else m[:, None], s[key], np.nan)
    seqs.append(
      {
        key: (v.astype(np.float32).astype(np.float64) if v.dtype.kind == "f" and key != "z" else v)
        for key, v in s.items()
      }
    )
  return seqs


def pack(seqs, row_len=8, num_rows=None, packing=None):
  """The PackedBatch (with ``rollout_topk_logprobs``) and the model inputs: logits, targets, top-k ids."""
  packing = packing or mis_jax.plan_packing([len(s["m"]) for s in seqs], row_len, num_rows=num_rows)
  get = lambda key, pad=np.nan, dtype=np.float32: packing.pack([s[key].astype(dtype) for s in seqs], pad, dtype)
  batch = mis_jax.PackedBatch(
    segment_ids=packing.segment_ids,
    loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
    advantages=get("adv"),
    rollout_logprobs=get("q"),
    old_logprobs=get("o"),
    rollout_topk_logprobs=get("qk"),
    num_segments=len(seqs),
  )
  model = dict(z=get("z", 0.0), y=get("y", 0, np.int32), ids=get("ids", 0, np.int32))
  return batch, model, packing


def model_loss(z, batch, model, cfg, **kw):
  """The loss as a function of the logits ``z [..., V]``: ``lp`` of the targets, the log-probs of the
  sampler's top-k ids (what the chunked pass's ``extra_ids`` gathers)."""
  log_p = jax.nn.log_softmax(z, axis=-1)
  lp = jnp.take_along_axis(log_p, model["y"][..., None], axis=-1)[..., 0]
  topk = jnp.take_along_axis(log_p, model["ids"], axis=-1)
  return mis_jax.policy_loss(lp, batch, cfg, topk_logprobs=topk, **kw)


@functools.lru_cache(maxsize=None)
def _grad_fn(cfgs):
  """One jitted program for several configs: ``[((loss, metrics), dloss/dz) per config]``. A case
  group shares it (compiling once costs more than running nine losses)."""
  grads = [jax.value_and_grad(functools.partial(model_loss, cfg=cfg), has_aux=True) for cfg in cfgs]
  return jax.jit(lambda z, b, mdl: [g(z, b, mdl) for g in grads])


SEQS = centring_seqs(np.random.default_rng(3))
# Packed into the padded layout's shape [8, 8] (so both run one program), its rows spread over both
# halves (so each micro-batch and each data shard holds sequences).
_FIRST_FIT = mis_jax.plan_packing([len(s["m"]) for s in SEQS], 8, num_rows=len(SEQS))
BATCH, MODEL, PACKING = pack(SEQS, packing=dataclasses.replace(_FIRST_FIT, rows=_FIRST_FIT.rows * 3 % len(SEQS)))
MIS = dict(tis_upper_bound=2.0, tis_lower_bound=0.5, tis_mode="truncate")
ALGOS = {  # (use_rollout_logprobs, use_tis, mis)
  "reinforce_is": dict(use_rollout_logprobs=True, use_tis=True, mis=MIS),
  "reinforce_vanilla_tis": dict(use_rollout_logprobs=True, use_tis=True),
  "ppo": dict(),
  "bypass_ppo": dict(use_rollout_logprobs=True),
  "decoupled_ppo": dict(use_tis=True, mis=dict(MIS, use_rs=True, rs_upper_bound=1.6)),
}
# REINFORCE + IS in every aggregation mode; the other algorithms in one mode each (both metric
# reductions covered), a second mode under `repeat` (make test-all). Each group is one program.
ONCE = tuple(
  [("reinforce_is", mode) for mode in mis_jax.config.LOSS_AGG_MODES]
  + [
    ("ppo", "token-mean"),
    ("decoupled_ppo", "seq-mean-token-mean"),
    ("bypass_ppo", "token-sum"),
    ("reinforce_vanilla_tis", "seq-mean-token-sum"),
  ]
)
REPEATS = (
  ("ppo", "seq-mean-token-mean"),
  ("decoupled_ppo", "token-mean"),
  ("bypass_ppo", "seq-mean-token-mean"),
  ("reinforce_vanilla_tis", "token-mean"),
)
CASES = list(ONCE) + [pytest.param(algo, mode, marks=pytest.mark.repeat) for algo, mode in REPEATS]


def loss_cfg(algo, mode="token-mean", **kw):
  extra = {"loss_scale_factor": 5.0} if mode == "seq-mean-token-sum-norm" else {}
  return mis_jax.LossConfig(score_centering=True, loss_agg_mode=mode, eps_clip=0.1, **{**ALGOS[algo], **extra, **kw})


def group_fn(cases):
  return _grad_fn(tuple(loss_cfg(algo, mode) for algo, mode in cases))


@functools.lru_cache(maxsize=None)
def results(cases=ONCE):
  """``{(algo, mode): ((loss, metrics), dloss/dz)}`` on the module's batch, one program per group."""
  return dict(zip(cases, group_fn(cases)(jnp.asarray(MODEL["z"]), BATCH, MODEL)))


def result(algo, mode):
  return results(ONCE if (algo, mode) in ONCE else REPEATS)[algo, mode]


def test_the_batch_has_every_case():
  """Sampled tokens inside and outside the sampler's top-k, a tail of real mass, mismatch."""
  inside = [bool(np.isin(s["y"][t], s["ids"][t])) for s in SEQS for t in range(len(s["m"])) if s["m"][t]]
  assert 0.2 < np.mean(inside) < 0.9
  tails = [
    oracle.sampler_estimate(s["z"][t], s["ids"][t], s["qk"][t])[2]
    for s in SEQS
    for t in range(len(s["m"]))
    if s["m"][t]
  ]
  assert 0.05 < np.mean(tails) < 0.8


@pytest.mark.parametrize("algo,mode", CASES)
def test_loss_metrics_and_logit_gradient_match_the_oracle(algo, mode):
  """The loss value is the uncentred one (centring changes the gradient only), the metrics are the
  oracle's, and the gradient on the logits is ``g_t (e_y - q̂_t)`` with ``g_t = ∂ pg_loss / ∂ lp_t``."""
  cfg = loss_cfg(algo, mode)
  (loss, metrics), grad = result(algo, mode)
  lc = cfg.to_dict()
  want_loss, want, W, Kept = oracle.policy_loss(SEQS, lc)
  want.update(oracle.centring_metrics(SEQS, lc, W, Kept, cfg.metric_mode))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want, rtol=5e-5, atol=5e-6)
  want_grad = oracle.centred_logit_grads(SEQS, oracle.pg_lp_coefficients(SEQS, lc, W, Kept))
  got = PACKING.unpack(np.asarray(grad))
  for i, (g, w) in enumerate(zip(got, want_grad)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6, err_msg=f"sequence {i}")
  assert float(metrics["score_centering_drift"]) > 0


def test_finite_differences_of_the_written_out_surrogate():
  """The gradient equals finite differences (float64) of ``Σ agg(-w A [log p(y) - Σ_K q_v log p_v -
  q_tail log p_tail])`` with ``w``, ``q`` fixed, written out from the logits (the module's batch: its
  compiled gradient is the oracle case's)."""
  cfg = loss_cfg("reinforce_is", "seq-mean-token-mean")
  _, grad = result("reinforce_is", "seq-mean-token-mean")
  lc = cfg.to_dict()
  _, _, W, Kept = oracle.policy_loss(SEQS, lc)
  scales = oracle.token_scales(Kept, Kept, "seq-mean-token-mean")

  def surrogate(i, t, z_t):
    s = SEQS[i]
    log_p = oracle.log_softmax(z_t)
    q_k = np.exp(s["qk"][t])
    log_tail = np.log1p(-np.exp(log_p[s["ids"][t]]).sum())
    return (
      -scales[i][t] * W[i][t] * s["adv"][t] * (log_p[s["y"][t]] - q_k @ log_p[s["ids"][t]] - (1 - q_k.sum()) * log_tail)
    )

  got = PACKING.unpack(np.asarray(grad))
  checked = 0
  for i, s in enumerate(SEQS):
    for t in np.flatnonzero(Kept[i]):
      for v in range(V):
        e, h = np.zeros(V), 1e-6
        e[v] = h
        fd = (surrogate(i, t, s["z"][t] + e) - surrogate(i, t, s["z"][t] - e)) / (2 * h)
        np.testing.assert_allclose(got[i][t, v], fd, rtol=2e-4, atol=2e-6, err_msg=f"seq {i} token {t} id {v}")
        checked += 1
  assert checked >= V


def test_the_drift_vanishes_in_expectation():
  """At one prefix, every token ``y`` of the vocabulary as a sequence weighted by ``q(y)`` (token-sum):
  with a constant advantage the summed uncentred gradient is the drift ``q - p`` on the logits; with
  k = V centring removes it (exactly), with k < V what is left lies on the tail and its L1 is below the
  reported bound ``2 q_tail``."""
  rng = np.random.default_rng(2)
  z = rng.normal(0.0, 1.5, V)
  log_q = oracle.log_softmax(z + rng.normal(0.0, 0.8, V))
  p, q = np.exp(oracle.log_softmax(z)), np.exp(log_q)
  # The bare score -A·lp (gpg in standard PPO: no weights, no ratio), A = q(y) weighting each y.
  inputs = {}
  for k in (V, 4):
    ids = np.argsort(-log_q)[:k]
    seqs = [
      dict(
        m=np.ones(1, bool),
        z=z[None],
        y=np.array([v]),
        ids=ids[None],
        qk=log_q[ids][None],
        lp=oracle.log_softmax(z)[v : v + 1],
        q=log_q[v : v + 1],
        o=oracle.log_softmax(z)[v : v + 1],
        adv=np.array([q[v]]),
      )
      for v in range(V)
    ]
    inputs[k] = pack(seqs, row_len=1)[:2]

  def loss(zz, batch, model, on):
    cfg = mis_jax.LossConfig(score_centering=on, policy_loss="gpg", loss_agg_mode="token-sum")
    if on:
      return model_loss(zz, batch, model, cfg)
    log_p = jax.nn.log_softmax(zz, -1)
    return mis_jax.policy_loss(jnp.take_along_axis(log_p, model["y"][..., None], -1)[..., 0], batch, cfg)

  def every_case(inputs):  # one program: k in (V, 4), centring off and on
    return {
      (k, on): jax.value_and_grad(loss, has_aux=True)(jnp.asarray(m["z"]), b, m, on)
      for k, (b, m) in inputs.items()
      for on in (False, True)
    }

  outs = jax.jit(every_case)(inputs)
  for k in (V, 4):
    ids = np.argsort(-log_q)[:k]
    out = {on: (-np.asarray(outs[k, on][1]).reshape(V, V).sum(0), outs[k, on][0][1]) for on in (False, True)}
    drift, centred = out[False][0], out[True][0]
    np.testing.assert_allclose(drift, q - p, atol=1e-5)  # E_q[A ∇_z log p] with A ≡ 1: the drift q - p
    q_hat, _, q_tail = oracle.sampler_estimate(z, ids, log_q[ids])
    np.testing.assert_allclose(centred, q - q_hat, atol=1e-5)
    if k == V:
      np.testing.assert_allclose(centred, 0.0, atol=1e-5)
    else:
      assert np.abs(centred[ids]).max() < 1e-5 and 0 < np.abs(centred).sum() <= 2 * q_tail + 1e-6
    metrics = out[True][1]
    # per token |A| ‖q̂ - p‖₁ with A = q(y): summed (token-sum reduces metrics per token: a mean)
    np.testing.assert_allclose(
      float(metrics["score_centering_drift"]) * V, np.sum(q) * np.abs(q_hat - p).sum(), rtol=1e-5
    )


# --- invariants -------------------------------------------------------------------------------


def _per_sequence(grad, packing):
  return [np.asarray(g) for g in packing.unpack(np.asarray(grad))]


@pytest.mark.slow
def test_microbatches_devices_padding_and_jit_equal_one_batch():
  """Decoupled PPO with MIS (its correction once per step): 2 micro-batches add up to the batch; the
  loss under shard_map on a 2×4 mesh (segments split across devices) equals one device's; the padded
  layout (one sequence per row) equals the packed one; the centring itself (``centre``: the centred
  log-probs, its metric rows and their gradient) jitted equals eager. Losses, metrics and the gradient
  on the logits."""
  cfg = loss_cfg("decoupled_ppo", "seq-mean-token-mean")
  z = jnp.asarray(MODEL["z"])
  (loss, metrics), grad = result("decoupled_ppo", "seq-mean-token-mean")
  want = _per_sequence(grad, PACKING)
  want_metrics = {k: float(v) for k, v in metrics.items()}

  # k micro-batches == one batch
  correction, _ = mis_jax.prepare_step(BATCH, cfg)
  parts = zip(
    mis_jax.split_microbatches(BATCH, 2),
    mis_jax.split_microbatches(correction, 2),
    np.split(MODEL["z"], 2),
    *(np.split(MODEL[k], 2) for k in ("y", "ids")),
  )
  step = jax.jit(jax.value_and_grad(lambda zz, b, mdl, c: model_loss(zz, b, mdl, cfg, correction=c)[0]))
  total, grads = 0.0, []
  for b, c, zz, y, ids in parts:
    value, g = step(jnp.asarray(zz), b, dict(y=y, ids=ids), c)
    total, grads = total + float(value), grads + [np.asarray(g)]
  np.testing.assert_allclose(total, float(loss), rtol=1e-5, atol=1e-7)
  for a, b in zip(_per_sequence(np.concatenate(grads), PACKING), want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  # 8 devices == 1 (data × sequence parallelism)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded = mis_jax.sharded_policy_loss(mesh, cfg, seq_axis="seq")

  def on_mesh(zz):
    log_p = jax.nn.log_softmax(zz, axis=-1)
    lp = jnp.take_along_axis(log_p, MODEL["y"][..., None], axis=-1)[..., 0]
    return sharded(lp, BATCH, topk_logprobs=jnp.take_along_axis(log_p, MODEL["ids"], axis=-1))

  (loss8, metrics8), grad8 = jax.jit(jax.value_and_grad(on_mesh, has_aux=True))(z)
  np.testing.assert_allclose(float(loss8), float(loss), rtol=1e-5, atol=1e-7)
  assert_metrics_close(metrics8, want_metrics, rtol=1e-5, atol=1e-7)
  for a, b in zip(_per_sequence(grad8, PACKING), want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  # packed == padded (the same shape: the group's program, not compiled again)
  padding = mis_jax.Packing(
    row_len=8,
    num_rows=len(SEQS),
    rows=np.arange(len(SEQS)),
    offsets=np.zeros(len(SEQS), np.int64),
    lengths=np.array([len(s["m"]) for s in SEQS]),
  )
  padded, padded_model, _ = pack(SEQS, packing=padding)
  assert padded.loss_mask.shape == BATCH.loss_mask.shape
  padded_out = group_fn(ONCE)(jnp.asarray(padded_model["z"]), padded, padded_model)
  (loss_p, metrics_p), grad_p = padded_out[ONCE.index(("decoupled_ppo", "seq-mean-token-mean"))]
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5, atol=1e-7)
  assert_metrics_close(metrics_p, want_metrics, rtol=1e-5, atol=1e-7)
  for a, b in zip(_per_sequence(grad_p, padding), want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  # jit == eager, for what centring adds (the loss around it is checked jit == eager elsewhere)
  mask = jnp.asarray(BATCH.loss_mask).reshape(-1)
  log_p = jax.nn.log_softmax(z, axis=-1)
  lp = jnp.take_along_axis(log_p, MODEL["y"][..., None], axis=-1)[..., 0].reshape(-1)
  topk = jnp.take_along_axis(log_p, MODEL["ids"], axis=-1)
  coefficient = jnp.where(mask, jnp.abs(jnp.nan_to_num(jnp.asarray(BATCH.advantages).reshape(-1))), 0.0)
  cot = jnp.asarray(np.random.default_rng(0).normal(size=lp.shape), jnp.float32)

  def centring(lp, topk):
    out, rows = _centering.centre(lp, topk, BATCH.rollout_topk_logprobs, mask, coefficient)
    return jnp.sum(cot * out), (out, rows)

  eager = jax.value_and_grad(centring, argnums=(0, 1), has_aux=True)(lp, topk)
  jitted = jax.jit(jax.value_and_grad(centring, argnums=(0, 1), has_aux=True))(lp, topk)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  assert float(jnp.max(jnp.abs(eager[1][1]))) > 0  # the top-k log-probs get a gradient


CHAIN_RULE_CASES = {  # forms of other shapes, and the threshold controller choosing the IS bound each step
  "dppo_tv": dict(policy_loss="dppo_tv"),
  "gspo": dict(policy_loss="gspo"),
  "geo_mean": dict(policy_loss="geo_mean"),
  "controller": dict(
    mis=dict(tis_upper_bound="auto", target_ess_ratio=0.9, use_rs=True, rs_upper_bound="auto", max_masked_fraction=0.1)
  ),
  "sapo": dict(policy_loss="sapo"),
  "kl_cov": dict(policy_loss={"name": "kl_cov", "kl_cov_ratio": 0.2}),
  "dro": dict(policy_loss={"name": "dro", "dro_beta": 0.5}),
}


CHAIN_ONCE = ("dppo_tv", "gspo", "geo_mean", "controller")


@functools.lru_cache(maxsize=None)
def chain_rule_results(cases):
  """Per case, one program for the group: the uncentred loss and its ``∂L/∂lp``, the centred loss and
  its gradient on the logits."""
  cfgs = [loss_cfg("decoupled_ppo", "seq-mean-token-mean", **CHAIN_RULE_CASES[c]) for c in cases]
  plains = [mis_jax.LossConfig(**{**cfg.to_dict(), "score_centering": False, "mis": cfg.mis}) for cfg in cfgs]

  def every_case(z):
    log_p = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(log_p, MODEL["y"][..., None], axis=-1)[..., 0]
    return [
      (
        jax.value_and_grad(lambda x, c=plain: mis_jax.policy_loss(x, BATCH, c), has_aux=True)(lp),
        jax.value_and_grad(lambda zz, c=cfg: model_loss(zz, BATCH, MODEL, c), has_aux=True)(z),
      )
      for cfg, plain in zip(cfgs, plains)
    ]

  return dict(zip(cases, jax.jit(every_case)(jnp.asarray(MODEL["z"]))))


@pytest.mark.slow
@pytest.mark.parametrize(
  "case", [c if c in CHAIN_ONCE else pytest.param(c, marks=pytest.mark.repeat) for c in CHAIN_RULE_CASES]
)
def test_the_centred_score_takes_each_settings_own_coefficient(case):
  """Decoupled PPO with MIS weights: with each form of another shape (ratio truncation and trust
  region, a sequence ratio through sg, a sequence's geometric mean) and with the threshold controller,
  the centred gradient on the logits is ``g_t (e_y - q̂_t)`` where ``g_t`` is the uncentred loss's
  ``∂L/∂lp_t``; the loss and every other metric (the controller's bounds included) are the uncentred
  run's."""
  group = CHAIN_ONCE if case in CHAIN_ONCE else tuple(c for c in CHAIN_RULE_CASES if c not in CHAIN_ONCE)
  ((plain_loss, plain_metrics), g_lp), ((loss, metrics), grad) = chain_rule_results(group)[case]
  np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-5, atol=1e-7)
  assert_metrics_close(
    {k: v for k, v in metrics.items() if k not in CENTRING_NAMES},
    {k: float(v) for k, v in plain_metrics.items()},
    rtol=1e-5,
    atol=1e-7,
  )
  want = oracle.centred_logit_grads(SEQS, [np.asarray(g, np.float64) for g in PACKING.unpack(np.asarray(g_lp))])
  assert any(np.abs(w).max() > 0 for w in want)
  for a, b in zip(_per_sequence(grad, PACKING), want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# --- edge cases -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def k_results():
  """k = 1 and k = V on their own sequences, one program: ``{k: (seqs, packing, ((loss, metrics), grad))}``."""
  cases = {k: (centring_seqs(np.random.default_rng(7), n_seqs=4, max_len=5, k=k),) for k in (1, V)}
  cases = {k: (seqs, *pack(seqs, row_len=8)) for k, (seqs,) in cases.items()}
  grad = jax.value_and_grad(functools.partial(model_loss, cfg=loss_cfg("reinforce_is")), has_aux=True)
  outs = jax.jit(lambda inputs: {k: grad(jnp.asarray(m["z"]), b, m) for k, (b, m) in inputs.items()})(
    {k: (batch, model) for k, (_, batch, model, _) in cases.items()}
  )
  return {k: (seqs, packing, outs[k]) for k, (seqs, _, _, packing) in cases.items()}


@pytest.mark.slow  # k = V's exact expected score is also checked, in make test-fast, by the drift test
@pytest.mark.parametrize("k", [1, V])
def test_k_of_one_and_the_whole_vocabulary(k):
  """k = 1 (the sampler's argmax only, a large tail) and k = V (q_tail ≈ 0: the exact expected score,
  the residual bound 0): the oracle's loss, metrics and logit gradient."""
  seqs, packing, ((loss, metrics), grad) = k_results()[k]
  cfg = loss_cfg("reinforce_is")
  lc = cfg.to_dict()
  want_loss, want, W, Kept = oracle.policy_loss(seqs, lc)
  want.update(oracle.centring_metrics(seqs, lc, W, Kept, cfg.metric_mode))
  np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=2e-6)
  assert_metrics_close(metrics, want, rtol=5e-5, atol=5e-6)
  for g, w in zip(
    packing.unpack(np.asarray(grad)), oracle.centred_logit_grads(seqs, oracle.pg_lp_coefficients(seqs, lc, W, Kept))
  ):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6)
  if k == V:
    assert float(metrics["score_centering_residual_bound"]) < 1e-5
    assert float(metrics["score_centering_tail_mass"]) < 1e-6


def test_extreme_and_nonfinite_top_k_stay_finite():
  """A sampler's top-k holding -inf, NaN, a positive log-prob (clipped to 0: the tail is 0) and a
  trainer whose top-k holds all its mass (p_tail floored): the loss and gradient are finite."""
  a, b, c = np.flatnonzero(np.asarray(BATCH.loss_mask).any(-1))[:3]  # three rows that hold tokens
  batch = BATCH.replace(
    rollout_topk_logprobs=jnp.asarray(BATCH.rollout_topk_logprobs)
    .at[a, :, 0]
    .set(-jnp.inf)
    .at[b, :, 1]
    .set(jnp.nan)
    .at[c, :, 0]
    .set(0.5)
  )
  z = jnp.asarray(MODEL["z"]).at[b].set(jnp.zeros(V).at[MODEL["ids"][b, 0, 0]].set(60.0))
  (loss, metrics), grad = group_fn(ONCE)(z, batch, MODEL)[ONCE.index(("reinforce_is", "token-mean"))]
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  assert all(np.isfinite(float(v)) for v in metrics.values())


# --- bad input ---------------------------------------------------------------------------------------


def _lp_topk():
  log_p = jax.nn.log_softmax(jnp.asarray(MODEL["z"]), axis=-1)
  return (
    jnp.take_along_axis(log_p, MODEL["y"][..., None], axis=-1)[..., 0],
    jnp.take_along_axis(log_p, MODEL["ids"], axis=-1),
  )


@pytest.mark.parametrize(
  "case,match",
  [
    ("no_topk_arg", "score_centering needs topk_logprobs"),
    ("no_rollout_topk", "score_centering needs batch.rollout_topk_logprobs"),
    ("off_with_topk", "topk_logprobs was given but score_centering is off"),
    ("flat_topk", r"'topk_logprobs' has shape \(8, 8\), expected \(8, 8, 'k'\)"),
    ("k_zero", r"'batch.rollout_topk_logprobs' has shape \(8, 8, 0\)"),
    ("k_differs", r"'topk_logprobs' has shape \(8, 8, 2\) but 'batch.rollout_topk_logprobs' has \(8, 8, 3\)"),
    ("int_topk", "'topk_logprobs' must be a floating-point array"),
  ],
)
def test_bad_inputs_are_named_before_tracing(case, match):
  lp, topk = _lp_topk()
  batch, cfg, kw = BATCH, loss_cfg("reinforce_is"), dict(topk_logprobs=topk)
  if case == "no_topk_arg":
    kw = {}
  elif case == "no_rollout_topk":
    batch = BATCH.replace(rollout_topk_logprobs=None)
  elif case == "off_with_topk":
    cfg = mis_jax.LossConfig(use_rollout_logprobs=True, use_tis=True)
  elif case == "flat_topk":
    kw = dict(topk_logprobs=topk[..., 0])
  elif case == "k_zero":
    batch = BATCH.replace(rollout_topk_logprobs=jnp.zeros((8, 8, 0), jnp.float32))
  elif case == "k_differs":
    kw = dict(topk_logprobs=topk[..., :2])
  elif case == "int_topk":
    kw = dict(topk_logprobs=jnp.zeros(topk.shape, jnp.int32))
  with pytest.raises((ValueError, TypeError), match=match):
    mis_jax.policy_loss(lp, batch, cfg, **kw)


def test_the_config_key_is_a_bool():
  with pytest.raises(mis_jax.ConfigError, match="score_centering"):
    mis_jax.LossConfig(score_centering="yes")


# --- the chunked pass: log-probs of extra ids ------------------------------------------------------


@pytest.mark.parametrize("chunk_size,with_support", [(3, False), pytest.param(64, True, marks=pytest.mark.slow)])
def test_extra_ids_are_gathered_inside_the_chunked_pass(chunk_size, with_support):
  """``token_logprobs(..., extra_ids=)``'s ``[T, k]`` log-probs and their gradient (through hidden and
  the LM head, with the targets' log-probs and entropy in the same cotangent) equal the dense
  ``log_softmax`` over the whole vocabulary, with or without a sampling support, any chunk size."""
  rng = np.random.default_rng(0)
  T, D = 10, 6
  h = jnp.asarray(rng.normal(size=(2, T // 2, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.permutation(V)[:K] for _ in range(T)]).reshape(2, T // 2, K), jnp.int32)
  y = ids[..., 0]
  support = dict(support_ids=jnp.concatenate([ids, ids[..., :1]], -1)) if with_support else {}
  cot = jnp.asarray(rng.normal(size=(2, T // 2, K)), jnp.float32)

  def chunked(h, w):
    lp, ent, extra = mis_jax.token_logprobs(
      h, w, y, chunk_size=chunk_size, return_entropy=True, extra_ids=ids, temperature=0.7, **support
    )
    return jnp.sum(lp) + 0.3 * jnp.sum(ent) + jnp.sum(cot * extra), extra

  def dense(h, w):
    z = (h @ w) / 0.7
    log_p = jax.nn.log_softmax(z, -1)
    log_s = log_p
    if with_support:
      member = (
        jnp.zeros(z.shape, bool).at[jnp.arange(2)[:, None, None], jnp.arange(T // 2)[None, :, None], ids].set(True)
      )
      log_s = jnp.where(member, z - jax.nn.logsumexp(jnp.where(member, z, -jnp.inf), -1, keepdims=True), -jnp.inf)
    lp = jnp.take_along_axis(log_s, y[..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.where(jnp.isfinite(log_s), jnp.exp(log_s) * log_s, 0.0), -1)
    extra = jnp.take_along_axis(log_p, ids, -1)
    return jnp.sum(lp) + 0.3 * jnp.sum(ent) + jnp.sum(cot * extra), extra

  (v1, e1), g1 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(h, w)
  (v2, e2), g2 = jax.jit(jax.value_and_grad(dense, argnums=(0, 1), has_aux=True))(h, w)
  assert e1.shape == (2, T // 2, K)
  np.testing.assert_allclose(np.asarray(e1), np.asarray(e2), rtol=1e-5, atol=1e-6)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
  "ids,match",
  [
    (np.zeros((4, 2), np.float32), "'extra_ids' must be an integer array"),
    (np.zeros((4,), np.int32), r"'extra_ids' has shape \(4,\) but must be \[..., k\]"),
    (np.zeros((4, 0), np.int32), r"'extra_ids' has shape \(4, 0\)"),
    (np.full((4, 2), V, np.int32), r"'extra_ids' holds ids in \[12, 12\], outside \[0, V=12\)"),
  ],
)
def test_bad_extra_ids(ids, match):
  h, w = jnp.ones((4, 3), jnp.float32), jnp.ones((3, V), jnp.float32)
  with pytest.raises((ValueError, TypeError), match=match):
    mis_jax.token_logprobs(h, w, jnp.zeros(4, jnp.int32), extra_ids=ids)
