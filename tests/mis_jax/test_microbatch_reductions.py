"""Each metric's micro-batch reduction is declared beside the metrics (`mis_jax.engine.MICROBATCH_REDUCTIONS`):
every declared name is a metric the library emits, and the reductions are the ones the
trainer's step knows."""

import dataclasses
import functools

import pytest

import numpy as np

import mis_jax


@pytest.mark.slow  # every algorithm and form run eagerly (~15 s on 2 cores): `make test`, not test-fast
def test_declared_reductions_name_emitted_metrics():
  rng = np.random.default_rng(0)
  seg = np.repeat(np.arange(4), 8).astype(np.int32)
  t = seg.size
  o = (-rng.uniform(0.5, 3, t)).astype(np.float32)
  q = (o + rng.normal(0, 0.3, t)).astype(np.float32)
  mask = rng.uniform(size=t) < 0.8
  mis = mis_jax.MISConfig(
    use_rs=True,
    tis_mode="mask",
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
    rs_criteria=({"metric": "k3", "agg": "seq_max", "upper": 5.0},),
  )
  batch = mis_jax.PackedBatch(
    segment_ids=seg,
    loss_mask=mask,
    advantages=rng.normal(size=t).astype(np.float32),
    rollout_logprobs=q,
    old_logprobs=o,
    ref_logprobs=o,
    num_segments=4,
  )
  cfg = mis_jax.LossConfig(use_tis=True, mis=mis, kl_coef=0.1, entropy_coef=0.01)
  correction, step_metrics = mis_jax.prepare_step(batch, cfg)
  _, metrics = mis_jax.policy_loss(o, batch, cfg, entropy=-o, correction=correction)
  emitted = set(metrics) | set(step_metrics)
  for form in ("dppo_tv", "kl_cov"):  # the forms' own metrics (contract §6.2)
    form_cfg = dataclasses.replace(cfg, policy_loss=form)
    form_correction, _ = mis_jax.prepare_step(batch, form_cfg)
    emitted |= set(mis_jax.policy_loss(o, batch, form_cfg, entropy=-o, correction=form_correction)[1])
  emitted |= set(mis_jax.sampling_metrics(o, np.zeros_like(o), q, mask, seg, num_segments=4))
  auto = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(tis_upper_bound="auto", target_ess_ratio=0.9))
  emitted |= set(mis_jax.prepare_step(batch, auto)[1])  # the threshold controller's (contract §3.1)
  emitted |= _emitted_metrics()  # every config form's: the table declares every metric the library emits
  assert set(mis_jax.engine.MICROBATCH_REDUCTIONS) <= emitted, set(mis_jax.engine.MICROBATCH_REDUCTIONS) - emitted
  assert set(mis_jax.engine.MICROBATCH_REDUCTIONS.values()) <= {"sum", "min", "max", "mask", "kept", "seqs"}
  assert mis_jax.microbatch_reduction("mis_rs_k3_seq_max_max") == "max"
  assert mis_jax.microbatch_reduction("mis_rs_k3_seq_max_masked_fraction") == "mask"
  assert mis_jax.microbatch_reduction("mis_k3_kl") == "mask"


@functools.cache  # every config form run eagerly once per process: both tests below read it
def _emitted_metrics() -> frozenset:
  """Every metric name the library emits (names depend on the config only: each config is
  evaluated abstractly), over the config forms: the four algorithms, every policy-loss form,
  vanilla TIS and MIS configs covering every bound mode, RS, the veto, batch normalisation, every
  divergence criterion, OPSM, M2PO, DPPO-Binary-TV and KPop, the squared log-ratio KL, score centering, the threshold
  controller's targets, mismatch monitoring
  alone, `proximal: loglinear`, with prepare_step and without, and the sampling-replay metrics."""
  import itertools
  import jax

  rng = np.random.default_rng(0)
  seg = np.repeat(np.arange(4), 8).astype(np.int32)
  t = seg.size
  o = (-rng.uniform(0.5, 3, t)).astype(np.float32)
  q = (o + rng.normal(0, 0.3, t)).astype(np.float32)
  mask = rng.uniform(size=t) < 0.8
  batch = mis_jax.PackedBatch(
    segment_ids=seg,
    loss_mask=mask,
    advantages=rng.normal(size=t).astype(np.float32),
    rollout_logprobs=q,
    old_logprobs=o,
    ref_logprobs=o,
    rollout_staleness=np.ones(t, np.float32),
    num_segments=4,
  )
  aggs = mis_jax.config.AGGREGATIONS
  crits = tuple({"metric": m, "agg": a, "upper": 5.0} for m in mis_jax.config.DIVERGENCES for a in aggs)
  auto_crits = tuple({"metric": m, "agg": a, "upper": "auto"} for m in ("k2", "k3") for a in aggs)
  mis_cfgs = [
    mis_jax.MISConfig(),
    mis_jax.MISConfig(tis_mode="clip", use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
    mis_jax.MISConfig(tis_mode="mask", tis_level="sequence", opsm_delta=0.1, m2po_threshold=0.5, rs_criteria=crits),
    mis_jax.MISConfig(tis_mode="none", use_rs=True),
    mis_jax.MISConfig(tis_upper_bound="auto", target_ess_ratio=0.9),
    mis_jax.MISConfig(tis_mode="mask", tis_upper_bound="auto", max_masked_fraction=0.1),
    mis_jax.MISConfig(use_rs=True, rs_upper_bound="auto", max_masked_fraction=0.1, rs_criteria=auto_crits),
    mis_jax.MISConfig(dppo_tv_delta=0.1, kpop_phi=0.1),  # the trust regions on probabilities (contract §4.3)
  ]
  key = jax.random.key(0)
  names = set()

  def add(cfg, entropy=None):
    def step(b):
      correction, step_metrics = mis_jax.prepare_step(b, cfg, key=key)
      with_step = mis_jax.policy_loss(o, b, cfg, entropy=entropy, key=key, correction=correction)[1]
      return step_metrics, with_step, mis_jax.policy_loss(o, b, cfg, entropy=entropy, key=key)[1]

    for out in jax.eval_shape(step, batch):
      names.update(out)

  for roll, tis in itertools.product((False, True), repeat=2):
    forms = ("vanilla", "gpg") if roll and tis else mis_jax.forms.POLICY_LOSSES
    for form, mis in itertools.product(forms, mis_cfgs + [None] if tis else [None]):
      own = {"dro_beta": 0.1} if form == "dro" else {}
      add(
        mis_jax.LossConfig(
          use_rollout_logprobs=roll,
          use_tis=tis,
          mis=mis,
          policy_loss={"name": form, **own},
          kl_coef=0.1,
          entropy_coef=0.01,
          get_mismatch_metrics=True,
          denominator="original" if roll and tis else "kept",
        ),
        -o,
      )
  for mis in mis_cfgs[:5]:
    add(mis_jax.LossConfig(use_tis=True, mis=mis, proximal="loglinear"))
  add(mis_jax.LossConfig(use_rollout_logprobs=True, sq_kl_coef=0.1))  # the squared log-ratio KL (contract §6.4)
  topk = np.stack([o, o - 1.0], axis=-1)  # score centering (contract §6.6): a top-2 head
  centred = mis_jax.LossConfig(use_rollout_logprobs=True, use_tis=True, denominator="original", score_centering=True)
  names.update(
    jax.eval_shape(
      lambda b, t: mis_jax.policy_loss(o, b, centred, topk_logprobs=t)[1],
      batch.replace(rollout_topk_logprobs=topk),
      topk,
    )
  )
  add(mis_jax.LossConfig(use_tis=None, mis=mis_jax.MISConfig(use_tis=False), get_mismatch_metrics=True))
  names.update(mis_jax.sampling_metrics(o, np.zeros_like(o), q, mask, seg, num_segments=4))
  return frozenset(names)


def test_every_emitted_metric_declares_its_reduction():
  """Every metric the library emits, in every config form, has a declared micro-batch reduction
  (an undeclared one is an error, never a silent "mask"), and every declared one is emitted."""
  emitted = _emitted_metrics()
  undeclared = sorted(n for n in emitted if n not in mis_jax.engine.MICROBATCH_REDUCTIONS)
  assert undeclared == [], undeclared
  assert set(mis_jax.engine.MICROBATCH_REDUCTIONS) == emitted, set(mis_jax.engine.MICROBATCH_REDUCTIONS) - emitted
  with pytest.raises(KeyError, match="'not_a_metric' declares no micro-batch reduction"):
    mis_jax.microbatch_reduction("not_a_metric")


def test_a_correction_function_declares_its_own_metrics():
  def user(o, q, m, seg, cfg, *, num_segments, axis_name=None):
    return m.astype(np.float32), m, {"user_kept": np.float32(1.0)}

  cfg = mis_jax.LossConfig(use_tis=True, correction_fn=user)
  with pytest.raises(KeyError, match="'user_kept' declares no micro-batch reduction"):
    mis_jax.microbatch_reduction("user_kept", cfg)
  user.microbatch_reductions = {"user_kept": "seqs"}
  assert mis_jax.microbatch_reduction("user_kept", cfg) == "seqs"
  assert mis_jax.microbatch_reduction("loss", cfg) == "sum"


def test_a_metric_declared_twice_differently_is_an_error():
  from mis_jax import _metrics

  with pytest.raises(ValueError, match="'loss' declared with two micro-batch reductions"):
    _metrics.declare({"loss": "mask"})
  with pytest.raises(ValueError, match="unknown micro-batch reduction 'mean'"):
    _metrics.declare({"new_metric": "mean"})
  assert "new_metric" not in mis_jax.engine.MICROBATCH_REDUCTIONS


def _combine(values, weights, how):
  """The step's combination of one metric over micro-batches (trainers' `combine_metrics`): a mean
  weighted by each micro-batch's trained tokens ("mask", token-mean) or live sequences ("seqs")."""
  w = np.asarray(weights[how], np.float64)
  return float(np.sum(np.asarray(values, np.float64) * w) / max(np.sum(w), 1.0))


@pytest.mark.slow
def test_opsm_share_of_sequences_combines_over_microbatches_as_one_batch():
  """`mis_opsm_masked_seq_fraction` is a share of live sequences (contract §4.2), so it combines
  weighted by each micro-batch's live sequences ("seqs"): k micro-batches (the correction run in
  each, as REINFORCE + IS does) give the one batch's share, also in token-mean mode, where a
  weighting by trained tokens would not."""
  from helpers import pack, random_seqs

  assert mis_jax.microbatch_reduction("mis_opsm_masked_seq_fraction") == "seqs"
  rng = np.random.default_rng(3)
  seqs = random_seqs(rng, n_seqs=24, max_len=12, mismatch=0.6)
  cfg = mis_jax.MISConfig(opsm_delta=0.05)

  def run(part):
    b = pack(part, row_len=16)[0]
    _, _, met = mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      cfg,
      num_segments=b.num_segments,
      metric_reduction="token-mean",
      advantages=b.advantages,
    )
    live = sum(bool(s["m"].any()) for s in part)
    return float(met["mis_opsm_masked_seq_fraction"]), {"mask": sum(int(s["m"].sum()) for s in part), "seqs": live}

  whole, _ = run(seqs)
  assert 0.0 < whole < 1.0
  token_weighted_error = 0.0
  for cuts in ((12,), (5,), (8, 16), (3, 9, 20)):  # k = 2, 2, 3, 4 micro-batches, even and uneven
    parts = [run(list(p)) for p in np.split(np.array(seqs, dtype=object), cuts)]
    values = [v for v, _ in parts]
    weights = {how: [w[how] for _, w in parts] for how in ("mask", "seqs")}
    np.testing.assert_allclose(_combine(values, weights, "seqs"), whole, rtol=1e-6, err_msg=f"cuts={cuts}")
    token_weighted_error = max(token_weighted_error, abs(_combine(values, weights, "mask") - whole))
  assert token_weighted_error > 1e-2  # weighting by trained tokens (the old "mask") would be off
