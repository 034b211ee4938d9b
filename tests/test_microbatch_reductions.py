"""Each metric's micro-batch reduction is declared beside the metrics (`mis_jax.MICROBATCH_REDUCTIONS`):
every declared name is a metric the library emits, and the reductions are the ones the
trainer's step knows."""

import dataclasses

import numpy as np

import mis_jax


def test_declared_reductions_name_emitted_metrics():
  rng = np.random.default_rng(0)
  seg = np.repeat(np.arange(4), 8).astype(np.int32)
  t = seg.size
  o = (-rng.uniform(0.5, 3, t)).astype(np.float32)
  q = (o + rng.normal(0, 0.3, t)).astype(np.float32)
  mask = rng.uniform(size=t) < 0.8
  mis = mis_jax.MISConfig(use_rs=True, tis_mode="mask", rs_veto_threshold=1e-4, tis_batch_normalize=True,
                          rs_criteria=({"metric": "k3", "agg": "seq_max", "upper": 5.0},))
  batch = mis_jax.PackedBatch(segment_ids=seg, loss_mask=mask, advantages=rng.normal(size=t).astype(np.float32),
                              rollout_logprobs=q, old_logprobs=o, ref_logprobs=o, num_segments=4)
  cfg = mis_jax.LossConfig(use_tis=True, mis=mis, kl_coef=0.1, entropy_coef=0.01)
  prepared, dens, step_metrics = mis_jax.prepare_step(batch, cfg)
  _, metrics = mis_jax.policy_loss(o, prepared, cfg, entropy=-o, denominators=dens)
  emitted = set(metrics) | set(step_metrics)
  for form in ("dppo_tv", "kl_cov"):  # the forms' own metrics (contract §6.2)
    form_cfg = dataclasses.replace(cfg, policy_loss=form)
    form_prepared, form_dens, _ = mis_jax.prepare_step(batch, form_cfg)
    emitted |= set(mis_jax.policy_loss(o, form_prepared, form_cfg, entropy=-o, denominators=form_dens)[1])
  emitted |= set(mis_jax.sampling_metrics(o, np.zeros_like(o), q, mask, seg, num_segments=4))
  auto = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(tis_upper_bound="auto", target_ess_ratio=0.9))
  emitted |= set(mis_jax.prepare_step(batch, auto)[2])  # the threshold controller's (contract §3.1)
  assert set(mis_jax.MICROBATCH_REDUCTIONS) <= emitted, set(mis_jax.MICROBATCH_REDUCTIONS) - emitted
  assert set(mis_jax.MICROBATCH_REDUCTIONS.values()) <= {"sum", "min", "max", "mask", "kept", "seqs"}
  assert mis_jax.microbatch_reduction("mis_rs_k3_seq_max_max") == "max"
  assert mis_jax.microbatch_reduction("mis_rs_k3_seq_max_masked_fraction") == "mask"
  assert mis_jax.microbatch_reduction("mis_k3_kl") == "mask"
