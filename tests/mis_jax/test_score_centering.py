"""Score centering (contract §6.6): the policy gradient's sampled-token score minus the sampler-expected
score, estimated from the sampler's top-k with a proportional tail. The loss value and every metric
against the NumPy oracle (loops over sequences), the gradient on the logits against the oracle's
``g_t (e_y - q̂_t)`` and against finite differences of the written-out surrogate, the sampler's drift
gone in expectation, the invariants (k micro-batches, 8 devices, packed == padded, jit == eager), the
edge cases (sampled token in and out of the top-k, q_tail ≈ 0, k = 1, k = V) and every bad input;
and ``mis_jax.token_logprobs(..., extra_ids=)``, the gather inside the chunked pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
import oracle
from helpers import assert_metrics_close

V, K = 12, 3
CENTRING_NAMES = ("score_centering_tv", "score_centering_tail_mass", "score_centering_drift",
                  "score_centering_residual_bound")


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
    s = dict(m=m, z=z, y=y, ids=ids, qk=np.take_along_axis(log_q, ids, -1), lp=lp, q=log_q[np.arange(n), y],
             o=lp + rng.normal(0.0, 0.05, n), adv=np.full(n, rng.normal()))
    for key in ("q", "o", "adv", "qk"):
      s[key] = np.where(m if s[key].ndim == 1 else m[:, None], s[key], np.nan)
    seqs.append({key: (v.astype(np.float32).astype(np.float64) if v.dtype.kind == "f" and key != "z" else v)
                 for key, v in s.items()})
  return seqs


def pack(seqs, row_len=8, num_rows=None, packing=None):
  """The PackedBatch (with ``rollout_topk_logprobs``) and the model inputs: logits, targets, top-k ids."""
  packing = packing or mis_jax.plan_packing([len(s["m"]) for s in seqs], row_len, num_rows=num_rows)
  get = lambda key, pad=np.nan, dtype=np.float32: packing.pack([s[key].astype(dtype) for s in seqs], pad, dtype)
  batch = mis_jax.PackedBatch(
      segment_ids=packing.segment_ids, loss_mask=packing.pack([s["m"] for s in seqs], False, bool),
      advantages=get("adv"), rollout_logprobs=get("q"), old_logprobs=get("o"),
      rollout_topk_logprobs=get("qk"), num_segments=len(seqs))
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
def _grad_fn(cfg):
  return jax.jit(jax.value_and_grad(lambda z, b, mdl: model_loss(z, b, mdl, cfg), has_aux=True))


SEQS = centring_seqs(np.random.default_rng(3))
BATCH, MODEL, PACKING = pack(SEQS, row_len=8, num_rows=6)
MIS = dict(tis_upper_bound=2.0, tis_lower_bound=0.5, tis_mode="truncate")
ALGOS = {  # (use_rollout_logprobs, use_tis, mis)
    "reinforce_is": dict(use_rollout_logprobs=True, use_tis=True, mis=MIS),
    "reinforce_vanilla_tis": dict(use_rollout_logprobs=True, use_tis=True),
    "ppo": dict(),
    "bypass_ppo": dict(use_rollout_logprobs=True),
    "decoupled_ppo": dict(use_tis=True, mis=dict(MIS, use_rs=True, rs_upper_bound=1.6)),
}
CASES = ([("reinforce_is", mode) for mode in mis_jax.LOSS_AGG_MODES]
         + [(algo, mode) for algo in list(ALGOS)[1:] for mode in ("token-mean", "seq-mean-token-mean")])


def loss_cfg(algo, mode="token-mean", **kw):
  extra = {"loss_scale_factor": 5.0} if mode == "seq-mean-token-sum-norm" else {}
  return mis_jax.LossConfig(score_centering=True, loss_agg_mode=mode, eps_clip=0.1, **ALGOS[algo], **extra, **kw)


def test_the_batch_has_every_case():
  """Sampled tokens inside and outside the sampler's top-k, a tail of real mass, mismatch."""
  inside = [bool(np.isin(s["y"][t], s["ids"][t])) for s in SEQS for t in range(len(s["m"])) if s["m"][t]]
  assert 0.2 < np.mean(inside) < 0.9
  tails = [oracle.sampler_estimate(s["z"][t], s["ids"][t], s["qk"][t])[2] for s in SEQS for t in range(len(s["m"]))
           if s["m"][t]]
  assert 0.05 < np.mean(tails) < 0.8


@pytest.mark.parametrize("algo,mode", CASES)
def test_loss_metrics_and_logit_gradient_match_the_oracle(algo, mode):
  """The loss value is the uncentred one (centring changes the gradient only), the metrics are the
  oracle's, and the gradient on the logits is ``g_t (e_y - q̂_t)`` with ``g_t = ∂ pg_loss / ∂ lp_t``."""
  cfg = loss_cfg(algo, mode)
  (loss, metrics), grad = _grad_fn(cfg)(jnp.asarray(MODEL["z"]), BATCH, MODEL)
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
  q_tail log p_tail])`` with ``w``, ``q`` fixed, written out from the logits."""
  seqs = centring_seqs(np.random.default_rng(11), n_seqs=3, max_len=4)
  batch, model, packing = pack(seqs, row_len=8)
  cfg = loss_cfg("reinforce_is", "seq-mean-token-mean")
  _, grad = _grad_fn(cfg)(jnp.asarray(model["z"]), batch, model)
  lc = cfg.to_dict()
  _, _, W, Kept = oracle.policy_loss(seqs, lc)
  scales = oracle.token_scales(Kept, Kept, "seq-mean-token-mean")

  def surrogate(i, t, z_t):
    s = seqs[i]
    log_p = oracle.log_softmax(z_t)
    q_k = np.exp(s["qk"][t])
    log_tail = np.log1p(-np.exp(log_p[s["ids"][t]]).sum())
    return -scales[i][t] * W[i][t] * s["adv"][t] * (
        log_p[s["y"][t]] - q_k @ log_p[s["ids"][t]] - (1 - q_k.sum()) * log_tail)

  got = packing.unpack(np.asarray(grad))
  checked = 0
  for i, s in enumerate(seqs):
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
  for k in (V, 4):
    ids = np.argsort(-log_q)[:k]
    seqs = [dict(m=np.ones(1, bool), z=z[None], y=np.array([v]), ids=ids[None], qk=log_q[ids][None],
                 lp=oracle.log_softmax(z)[v:v + 1], q=log_q[v:v + 1], o=oracle.log_softmax(z)[v:v + 1],
                 adv=np.array([q[v]])) for v in range(V)]
    batch, model, _ = pack(seqs, row_len=1)
    out = {}
    for on in (False, True):
      cfg = mis_jax.LossConfig(score_centering=on, policy_loss="gpg", loss_agg_mode="token-sum")
      log_p = lambda zz: jax.nn.log_softmax(zz, -1)
      f = lambda zz: (model_loss(zz, batch, model, cfg) if on else mis_jax.policy_loss(
          jnp.take_along_axis(log_p(zz), model["y"][..., None], -1)[..., 0], batch, cfg))
      (_, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(model["z"]))
      out[on] = (-np.asarray(g).reshape(V, V).sum(0), metrics)
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
    np.testing.assert_allclose(float(metrics["score_centering_drift"]) * V,
                               np.sum(q) * np.abs(q_hat - p).sum(), rtol=1e-5)
