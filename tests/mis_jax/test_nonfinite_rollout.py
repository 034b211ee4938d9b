"""contract §8.4: a NaN or ±inf rollout log-prob on a trained token leaves the mask. The loss, its
gradient and every metric equal those of the same batch with that token's loss mask set to 0, in
every algorithm, level and bound mode; the tokens are counted."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax

N_SEG = 6


def _batches(seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([7, 5, 9, 3, 6, 8])
  seg = np.concatenate([np.repeat(np.arange(N_SEG), lengths), [-1, -1]]).astype(np.int32)
  t = seg.size
  mask = (seg >= 0) & (rng.uniform(size=t) < 0.9)
  o = (-rng.uniform(0.1, 3.0, t)).astype(np.float32)
  q = (o - rng.normal(0, 0.4, t)).astype(np.float32)
  adv = rng.normal(size=N_SEG)[np.maximum(seg, 0)].astype(np.float32)
  lp = (o + rng.normal(0, 0.1, t)).astype(np.float32)
  # Non-finite rollout log-probs: on trained tokens of three segments (all of segment 3's), and on
  # an untrained token and on padding (which change nothing).
  bad = np.zeros(t, bool)
  starts = np.concatenate([[0], np.cumsum(lengths)])
  for i, value in zip([starts[0] + 1, starts[2] + 4, starts[4] + 2], [np.nan, -np.inf, np.inf]):
    mask[i] = True
    bad[i] = True
    q[i] = value
  seg3 = np.arange(starts[3], starts[4])
  mask[seg3] = True
  bad[seg3] = True
  q[seg3] = np.nan
  mask[starts[5]] = False
  q[starts[5]] = -np.inf
  q[-1] = np.nan
  dirty = mis_jax.PackedBatch(
    segment_ids=seg,
    loss_mask=mask,
    advantages=adv,
    rollout_logprobs=q,
    old_logprobs=o,
    ref_logprobs=o - 0.05,
    num_segments=N_SEG,
  )
  clean = dataclasses.replace(
    dirty, loss_mask=mask & ~bad, rollout_logprobs=np.where(np.isfinite(q), q, o).astype(np.float32)
  )
  return dirty, clean, lp, int(bad.sum()), int(mask.sum())


MIS = {
  "none": None,
  "token_truncate": mis_jax.MISConfig(tis_level="token", tis_mode="truncate"),
  "token_mask_rs_veto": mis_jax.MISConfig(tis_level="token", tis_mode="mask", use_rs=True, rs_veto_threshold=1e-4),
  "sequence_truncate_bn": mis_jax.MISConfig(tis_level="sequence", tis_mode="truncate", tis_batch_normalize=True),
  "sequence_mask": mis_jax.MISConfig(tis_level="sequence", tis_mode="mask", tis_upper_bound=3.0),
  "geometric_mask_rs": mis_jax.MISConfig(tis_level="geometric", tis_mode="mask", use_rs=True, rs_level="geometric"),
  "geometric_clip_k3": mis_jax.MISConfig(
    tis_level="geometric", tis_mode="clip", rs_criteria=({"metric": "k3", "agg": "seq_max", "upper": 1.0},)
  ),
}

CASES = (
  [
    ("ppo", None, "seq-mean-token-mean"),
    ("bypass_ppo", None, "token-mean"),
    ("decoupled_ppo", "none", "token-mean"),
    ("reinforce_is", "none", "seq-mean-token-mean"),
  ]
  + [("decoupled_ppo", k, "seq-mean-token-mean") for k in MIS if k != "none"]
  + [("reinforce_is", k, "token-mean") for k in ("token_mask_rs_veto", "sequence_truncate_bn", "geometric_mask_rs")]
)


def _cfg(algo, mis, mode):
  use_rollout, use_tis = mis_jax.config.ALGORITHMS[algo]
  return mis_jax.LossConfig(
    use_tis=use_tis,
    use_rollout_logprobs=use_rollout,
    mis=None if mis in (None, "none") else MIS[mis],
    loss_agg_mode=mode,
    kl_coef=0.1,
    entropy_coef=0.01,
    get_mismatch_metrics=True,
  )


def _loss(cfg, batch, lp, prepared):
  correction = mis_jax.prepare_step(batch, cfg)[0] if prepared else None
  fn = lambda x: mis_jax.policy_loss(x, batch, cfg, entropy=-lp, correction=correction)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(lp))
  return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("algo,mis,mode", CASES)
def test_loss_grad_metrics_equal_the_masked_batch(algo, mis, mode):
  dirty, clean, lp, n_bad, n_trained = _batches()
  cfg = _cfg(algo, mis, mode)
  for prepared in (False, True) if algo == "decoupled_ppo" else (False,):
    loss, grad, metrics = _loss(cfg, dirty, lp, prepared)
    ref_loss, ref_grad, ref_metrics = _loss(cfg, clean, lp, prepared)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert metrics["mis_nonfinite_rollout_logprob_count"] == n_bad
    assert metrics["mis_nonfinite_rollout_logprob_fraction"] == pytest.approx(n_bad / n_trained)
    assert ref_metrics["mis_nonfinite_rollout_logprob_count"] == 0
    for k, v in ref_metrics.items():
      if not k.startswith("mis_nonfinite"):
        assert np.isfinite(metrics[k]), k
        np.testing.assert_allclose(metrics[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("name", [k for k in MIS if k != "none"])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean"])
def test_compute_mis_weights(name, reduction):
  dirty, clean, _, n_bad, n_trained = _batches(1)
  out = [
    mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      MIS[name],
      num_segments=N_SEG,
      metric_reduction=reduction,
      advantages=b.advantages,
    )
    for b in (dirty, clean)
  ]
  (w, kept, metrics), (ref_w, ref_kept, ref_metrics) = out
  assert np.array_equal(np.asarray(kept), np.asarray(ref_kept))
  np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-6, atol=0)
  assert float(metrics["mis_nonfinite_rollout_logprob_count"]) == n_bad
  assert float(metrics["mis_nonfinite_rollout_logprob_fraction"]) == pytest.approx(n_bad / n_trained)
  for k, v in ref_metrics.items():
    if not k.startswith("mis_nonfinite"):
      np.testing.assert_allclose(float(metrics[k]), float(v), rtol=1e-6, atol=1e-7, err_msg=k)


def test_vanilla_tis_weights_and_jit():
  dirty, clean, lp, n_bad, _ = _batches(2)
  w, m = mis_jax.vanilla_tis_weights(dirty.old_logprobs, dirty.rollout_logprobs, dirty.loss_mask)
  ref_w, ref_m = mis_jax.vanilla_tis_weights(clean.old_logprobs, clean.rollout_logprobs, clean.loss_mask)
  np.testing.assert_array_equal(np.asarray(w), np.asarray(ref_w))
  assert float(m["mis_nonfinite_rollout_logprob_count"]) == n_bad
  cfg = _cfg("reinforce_is", "geometric_mask_rs", "token-mean")
  loss_fn = jax.jit(lambda x, b: mis_jax.policy_loss(x, b, cfg, entropy=-lp)[0])
  grad = jax.grad(loss_fn)(jnp.asarray(lp), dirty)
  assert np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(float(loss_fn(jnp.asarray(lp), dirty)), float(loss_fn(jnp.asarray(lp), clean)), rtol=1e-6)


def test_trainer_warns_past_one_percent():
  from trainers.app.hooks import NONFINITE_WARN_FRACTION, MaskedSteps
  from trainers.config import TrainConfig

  lines = []
  watch = MaskedSteps(TrainConfig())
  metrics = {"mis_nonfinite_rollout_logprob_fraction": 0.02, "mis_nonfinite_rollout_logprob_count": 4.0}
  watch.after_step(7, metrics, None, lines.append)
  assert len(lines) == 1 and "step 7: 2.00% of the trained tokens had a NaN/inf rollout log-prob" in lines[0]
  watch.after_step(7, {"mis_nonfinite_rollout_logprob_fraction": NONFINITE_WARN_FRACTION}, None, lines.append)
  assert len(lines) == 1
