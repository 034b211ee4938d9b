"""The ``mis`` correction (contract §2–5) with its metrics (contract §8.1–8.2), and vanilla TIS.

``compute_mis_weights`` is the ``mis`` correction function; ``vanilla_tis_weights`` is the
built-in one used when no MIS config is given. Both are pure and jittable; configs are static.

:func:`correct` composes the stages of :mod:`mis_jax._stages` (the IS bound and each mask: RS,
each divergence criterion, the veto, OPSM, M2PO, each with its auto bound) and the metric rows
of :mod:`mis_jax._metrics` into two fused passes of the pass engine (:mod:`mis_jax._engine`):

- pass 1, per segment over the original mask ``m``: ``n_s``, ``Σ m r`` (sequence/geometric
  levels, OPSM, ``mis_chi2_seq``), ``Σ m o`` and ``Σ m q`` (§8.1), and what each stage asks for
  (catastrophic-token counts, sequence aggregates of divergence criteria, advantage sums);
- between the passes, the threshold controller: each stage with a bound set from the step
  resolves it, in the stages' ``BOUND_ORDER`` (§3.1);
- pass 2, token by token: weights and kept mask (the stages in turn), and every metric: means
  over ``m`` as weighted totals (``R_m(x) = Σ_t a_t x_t / N``, ``a_t = m_t / n_{s(t)}`` in
  seq-mean modes), what the stages add, batch-normalisation and ESS totals.

The per-mask statistics it counted (:class:`MaskStats` of ``m`` and of ``m'``) come back with
the result, so the loss aggregation and later metrics reuse them instead of counting again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _correction as correction
from mis_jax import _metrics as metrics_lib
from mis_jax import _stages as stages_lib
from mis_jax import _validation
from mis_jax._config import MISConfig
from mis_jax._engine import HIGHEST, LOWEST, Max, Min, Out, PassOptions, SegSum, Total, psum
from mis_jax._segments import AxisName, MaskStats, Segments, masked_means, per_segment_mean, safe_exp


class Corrected(NamedTuple):
  """The result of a correction on flat ``[T]`` arrays.

  Attributes:
    weights: float32 stop-gradient weights, 0 outside the mask.
    kept: the kept mask ``m'`` (bool).
    metrics: dict of float32 scalars (contract §8 names).
    mask_stats: :class:`MaskStats` of the original mask ``m``.
    kept_stats: :class:`MaskStats` of ``m'``.
  """

  weights: jax.Array
  kept: jax.Array
  metrics: dict
  mask_stats: MaskStats
  kept_stats: MaskStats


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What one correction computes (static): the config's stages (:func:`mis_jax._stages.stages_of`),
  the metric reduction, and the switches of the composition derived from them."""

  cfg: MISConfig | None
  mode: str
  mismatch: bool
  given_batch_norm: bool  # a precomputed batch-normalisation mean is used

  @functools.cached_property
  def stages(self) -> tuple:
    return stages_lib.stages_of(self.cfg)

  @property
  def seq_mode(self) -> bool:
    return self.mode != "token-mean"

  @property
  def tis(self) -> bool:
    return self.cfg is not None

  @property
  def thresholds(self) -> bool:
    """Whether some stage's bound or cutoff is set from the step's ratios before pass 2 (§3.1, §4.2)."""
    return any(stage.sets_bound for stage in self.stages)

  @property
  def rejects_segments(self) -> bool:
    """Whether some stage rejects whole segments from pass 1's per-segment results (veto, OPSM)."""
    return any(stage.REJECTS_SEGMENTS for stage in self.stages)

  @property
  def need_sum_r(self) -> bool:
    """``Σ m r`` per segment: for the sequence/geometric levels, OPSM and ``mis_chi2_seq``."""
    return self.mismatch or any(stage.needs_sum_r for stage in self.stages)

  @property
  def kept_w_by_segment(self) -> bool:
    """Kept weights summed per segment (seq-mean metrics, sequence-level batch norm), else in total."""
    cfg = self.cfg
    return self.tis and (
      self.seq_mode or (cfg.tis_batch_normalize and cfg.tis_level != "token" and not self.given_batch_norm)
    )


class _SegmentStats(NamedTuple):
  """Per-segment results of pass 1 that pass 2 and the metrics read."""

  mask_stats: MaskStats
  divisor: jax.Array  # N of R_m: live segments (seq-mean modes) or trained tokens
  sum_r: jax.Array | None
  states: dict  # {stage name: its per-segment state}
  rejected: jax.Array | None  # segments some stage rejects whole (veto, OPSM)


# --- pass 1: per-segment sums over the original mask ---------------------------------------


def _segment_sums_body(plan: _Plan):
  """``n_s``, ``Σ m r``, ``Σ m o`` and ``Σ m q`` (§8.1), and what each stage reads per segment
  (catastrophic-token counts, sequence aggregates of divergence criteria, advantages)."""

  def body(ch):
    m = ch["mask"]
    r = correction.log_ratio(ch["o"], ch["q"], m)
    out = {"count": SegSum(m)}
    if plan.need_sum_r:
      out["sum_r"] = SegSum(r)
    if plan.mismatch:
      out["sum_o"] = SegSum(jnp.where(m, ch["o"], 0.0))
      out["sum_q"] = SegSum(jnp.where(m, ch["q"], 0.0))
    for stage in plan.stages:
      out.update({stages_lib.own_key(stage, k): c for k, c in stage.segment_sums(r, m, ch).items()})
    return out

  return body


def _segment_stats(plan: _Plan, p1: dict) -> _SegmentStats:
  mask_stats = MaskStats.from_counts(p1["count"])
  divisor = jnp.maximum(mask_stats.num_live if plan.seq_mode else mask_stats.total, 1.0)
  view = stages_lib.SegmentView(mask_stats, p1.get("sum_r"))
  states = {stage.name: stage.segments(stages_lib.own_results(stage, p1), view) for stage in plan.stages}
  parts = [stage.rejected(states[stage.name]) for stage in plan.stages if stage.REJECTS_SEGMENTS]
  rejected = functools.reduce(jnp.logical_or, parts) if parts else None
  return _SegmentStats(mask_stats, divisor, view.sum_r, states, rejected)


# --- pass 2: weights, kept mask and every token-level metric --------------------------------


def _kept_weight_sums(plan: _Plan, w, kept, out: dict) -> None:
  """Sums of the kept weights for batch normalisation, the final-weight metrics and ESS."""
  wk = jnp.where(kept, w, 0.0)
  out["kept_n"] = SegSum(kept)
  if plan.kept_w_by_segment:
    out["kept_w"] = SegSum(wk)
  else:
    out["sum_w"] = Total(wk)
  out["sum_w2"] = Total(wk * w)
  out["w_min"], out["w_max"] = Min(jnp.where(kept, w, HIGHEST)), Max(jnp.where(kept, w, LOWEST))
  out["w"], out["kept"] = Out(w), Out(kept)


def _token_body(plan: _Plan, seg: _SegmentStats, bounds: correction.Bounds):
  """Pass 2: per token, the weights and kept mask (the stages in turn) and every metric
  averaged over ``m`` as a weighted total (``R_m(x) = Σ_t a_t x_t / N``, ``a_t = m_t / n_{s(t)}``
  in seq-mean modes)."""

  def body(ch):
    m = ch["mask"]
    r = correction.log_ratio(ch["o"], ch["q"], m)
    if plan.seq_mode and plan.rejects_segments:
      inverse, rejected_at = ch.broadcast_two(seg.mask_stats.inverse, seg.rejected)
    else:
      inverse = ch.broadcast(seg.mask_stats.inverse) if plan.seq_mode else None
      rejected_at = ch.broadcast(seg.rejected) if plan.rejects_segments else None
    a = jnp.where(m, inverse, 0.0) if plan.seq_mode else jnp.where(m, 1.0, 0.0)  # R_m weights
    rows = stages_lib.Rows(plan.seq_mode)
    if plan.mismatch:  # per-token values, R_m-averaged
      rows.means.update(metrics_lib.mismatch_token_values(r))
    out = {}
    if plan.tis:
      tokens = stages_lib.Tokens(r, m, ch.broadcast, seg.sum_r, seg.mask_stats.counts, inputs=ch)
      stages_lib.compose(plan.stages, tokens, bounds, seg.states, rejected_at, rows)
      out.update(rows.out)
      _kept_weight_sums(plan, tokens.w, tokens.kept, out)
    for name, x in rows.means.items():
      out[_MEAN + name] = Total(jnp.where(m, x.astype(jnp.float32), 0.0) * a)
    return out

  return body


_MEAN = "mean/"  # pass 2's key of a per-token row averaged over m


# --- the threshold controller: auto bounds, set from the step's own weights (§3.1) ---------


def _step_thresholds(plan: _Plan, seg: _SegmentStats, segs: Segments, o, q, m, inputs=None):
  """contract §3.1 and §4.2: the step's bounds, with the auto ones and M2PO's cutoff set by
  their stages, and their metrics.

  Order (each stage's ``BOUND_ORDER``): M2PO's cutoff (over the trained tokens), the criteria's
  auto upper bounds (each its masked share of its units), the RS band (its masked share, on the
  raw weights at ``rs_level``), then the IS bound — a masking band by its masked share, or a
  truncate/clip bound by the ESS over the tokens every other stage keeps (they do not move with it)."""
  r = correction.log_ratio(o, q, m)

  def kept_without(stage, bounds):
    rejected_at = segs.broadcast(seg.rejected) if plan.rejects_segments else None
    tokens = stages_lib.Tokens(r, m, segs.broadcast, seg.sum_r, seg.mask_stats.counts, inputs=inputs)
    others = [s for s in plan.stages if s is not stage]
    return stages_lib.compose(others, tokens, bounds, seg.states, rejected_at).kept

  step = stages_lib.Step(plan.cfg, seg, segs, r, m, stages_lib.fixed_bounds(plan.cfg), kept_without)
  for stage in sorted(plan.stages, key=lambda stage: stage.BOUND_ORDER):
    stage.resolve(step)
  if step.has_target:
    step.metrics["mis_auto_target_met"] = step.met.astype(jnp.float32)
  return step.bounds, step.metrics


# --- after the passes: metrics over other masks, batch normalisation ------------------------


def _kept_mean(plan: _Plan, w_sum, n_sum):
  """``R`` over a mask other than ``m``, from its per-segment or total sums."""
  if plan.seq_mode:
    return per_segment_mean(w_sum / jnp.maximum(n_sum, 1.0), n_sum, plan.mode)
  return w_sum / jnp.maximum(n_sum, 1.0)


def _batch_norm_mean(plan: _Plan, p2: dict, sum_w, kept_stats: MaskStats, batch_norm_factor):
  """§5: the batch-normalisation mean over the kept mask, globally (1 when off)."""
  cfg = plan.cfg
  if batch_norm_factor is not None:
    return batch_norm_factor
  if cfg.tis_batch_normalize and cfg.tis_level == "token":
    return correction.batch_norm_mean_token(sum_w, kept_stats.total)
  if cfg.tis_batch_normalize:
    return correction.batch_norm_mean_sequence(p2["kept_w"], kept_stats.counts)
  return 1.0


def _stage_metrics(plan: _Plan, seg: _SegmentStats, p2: dict, metrics: dict) -> None:
  """Each stage's metrics after the passes (means over other masks, maxima, segment shares)."""
  after = stages_lib.After(seg.mask_stats, functools.partial(_kept_mean, plan))
  for stage in plan.stages:
    metrics.update(stage.results(stages_lib.own_results(stage, p2), seg.states[stage.name], after))


def correct(
  o,
  q,
  mask,
  segs: Segments,
  cfg: MISConfig | None,
  mode: str,
  *,
  batch_norm_factor=None,
  mismatch: bool = True,
  adv=None,
) -> Corrected:
  """contract §2–5 and §8.1–8.2 on flat arrays, in two fused passes over the tokens.

  Args:
    o, q: float32 ``[T]`` train/rollout log-probs (stop-gradient here).
    mask: bool ``[T]``, trained and non-padding.
    segs: the batch's :class:`Segments` (layout and pass options).
    cfg: the :class:`MISConfig`, or None for the §8.1 mismatch metrics only (then
      ``weights = mask``, ``kept = mask``).
    mode: metric reduction (``token-mean`` or a seq-mean mode).
    batch_norm_factor: a precomputed batch-normalisation mean to use instead.
    mismatch: whether to compute the §8.1 mismatch metrics too.
    adv: float32 ``[T]`` advantages, for OPSM (§4.2) and the sign-conditioned DPPO-Binary-TV mask (§4.3).
  """
  plan = _Plan(cfg, mode, mismatch, batch_norm_factor is not None)
  arrays = {"o": jax.lax.stop_gradient(o), "q": jax.lax.stop_gradient(q), "mask": mask}
  for stage in plan.stages:  # the per-token inputs a stage reads beside o, q and m
    arrays.update(stage.inputs(mask, adv))
  p1 = segs.run_pass(arrays, _segment_sums_body(plan))
  seg = _segment_stats(plan, p1)
  mask_stats, count = seg.mask_stats, seg.mask_stats.counts
  auto_metrics = {}
  if plan.thresholds:
    bounds, auto_metrics = _step_thresholds(plan, seg, segs, arrays["o"], arrays["q"], mask, inputs=arrays)
  else:
    bounds = stages_lib.fixed_bounds(cfg) if plan.tis else None
  p2 = segs.run_pass(arrays, _token_body(plan, seg, bounds))
  token_means = {k[len(_MEAN) :]: v / seg.divisor for k, v in p2.items() if k.startswith(_MEAN)}
  metrics = {}
  if mismatch:
    seg_values = metrics_lib.mismatch_segment_values(p1["sum_o"], p1["sum_q"], seg.sum_r, count)
    metrics.update(metrics_lib.mismatch_metrics(seg_values, token_means, count, mode))
  if not plan.tis:
    return Corrected(mask.astype(jnp.float32), mask, metrics, mask_stats, mask_stats)

  metrics.update({k: v for k, v in token_means.items() if k not in metrics})
  metrics.update(auto_metrics)
  _stage_metrics(plan, seg, p2, metrics)
  kept_stats = MaskStats.from_counts(p2["kept_n"])
  sum_w = jnp.sum(p2["kept_w"]) if plan.kept_w_by_segment else p2["sum_w"]
  mean_after = (
    _kept_mean(plan, p2["kept_w"], kept_stats.counts) if plan.seq_mode else _kept_mean(plan, sum_w, kept_stats.total)
  )
  factor = correction.batch_norm_factor(_batch_norm_mean(plan, p2, sum_w, kept_stats, batch_norm_factor))
  metrics.update(
    metrics_lib.final_weight_metrics(
      mean_after_tis_rs=mean_after,
      factor=factor,
      w_min=p2["w_min"],
      w_max=p2["w_max"],
      sum_w=sum_w,
      sum_w2=p2["sum_w2"],
      num_kept=kept_stats.total,
      num_trained=mask_stats.total,
      seg_kept_counts=kept_stats.counts,
      num_live=mask_stats.num_live,
    )
  )
  weights = jax.lax.stop_gradient(p2["w"] / factor)
  return Corrected(weights, p2["kept"], metrics, mask_stats, kept_stats)


def mismatch_metrics(train_logprobs, rollout_logprobs, mask, segs: Segments, mode: str):
  """The contract §8.1 mismatch-monitoring metrics alone (flat float32 inputs, original mask).

  Returns ``(metrics, mask_stats)``: the metrics and the :class:`MaskStats` of ``mask``
  counted on the way.
  """
  result = correct(train_logprobs, rollout_logprobs, mask, segs, None, mode)
  return result.metrics, result.mask_stats


# contract §8.4: rollout log-probs the engine reported as NaN or ±inf on trained tokens.
NONFINITE_FRACTION = "mis_nonfinite_rollout_logprob_fraction"
NONFINITE_COUNT = "mis_nonfinite_rollout_logprob_count"
metrics_lib.declare({NONFINITE_FRACTION: "mask", NONFINITE_COUNT: "sum"})


def drop_nonfinite_rollout(q, mask, axis_name: AxisName = None):
  """contract §8.4: a trained token whose rollout log-prob ``q`` is NaN or ±inf leaves the mask
  (``m ← m ∧ isfinite(q)``), so it leaves the loss, the correction and every metric's mask; every
  later use of ``q`` selects on the mask (``jnp.where``), so its value never reaches a sum or a
  gradient. Returns the narrowed mask and the count and share of such tokens among the trained ones
  (global over ``axis_name``)."""
  finite = jnp.isfinite(q)
  bad = psum(jnp.sum(jnp.where(mask & ~finite, 1.0, 0.0)), axis_name)
  trained = psum(jnp.sum(jnp.where(mask, 1.0, 0.0)), axis_name)
  return mask & finite, {NONFINITE_FRACTION: bad / jnp.maximum(trained, 1.0), NONFINITE_COUNT: bad}


def compute_mis_weights(
  train_logprobs,
  rollout_logprobs,
  loss_mask,
  segment_ids,
  cfg: MISConfig,
  *,
  num_segments: int,
  axis_name: AxisName = None,
  metric_reduction: str = "seq-mean-token-mean",
  batch_norm_factor=None,
  pass_options: PassOptions | None = None,
  advantages=None,
):
  """The ``mis`` correction: IS weights, kept mask and metrics (contract §2–5, §8.1–8.2).

  With ``r_t = o_t - q_t`` and the level log-value ``L_t`` (token: ``r_t``; sequence:
  ``Σ_s m r``; geometric: ``Σ_s m r / max(Σ_s m, 1)``), ``w_raw = exp(clip(L, ±20))`` is
  bounded by ``tis_mode`` (truncate ``min(w, U)``; clip ``clip(w, Lo, U)``; mask keeps tokens
  with ``Lo <= w_raw <= U``; none ``1``). Rejection sampling keeps tokens whose raw weight at
  ``rs_level`` lies in ``[rs_lower, rs_upper]``; the veto rejects every segment holding a
  trained token with ``r_t < log(rs_veto_threshold)``. The kept mask is
  ``m' = m · keep_IS · keep_RS · (1 - vetoed)``; with ``tis_batch_normalize`` the weights are
  divided by their mean over ``m'`` (token level) or over kept segments (sequence/geometric).

  Args:
    train_logprobs: log-probs ``o`` under the training engine (any shape, float).
    rollout_logprobs: log-probs ``q`` reported by the rollout engine (same shape).
    loss_mask: 1 for trained response tokens (same shape; bool, int or float).
    segment_ids: int segment of every token, ``-1`` for padding (same shape).
    cfg: a :class:`MISConfig`. With ``cfg.use_tis`` false only the §8.1 metrics are
      computed and ``weights = loss_mask``, ``kept_mask = loss_mask`` (as in miles).
    num_segments: static upper bound on segment ids.
    axis_name: mesh axis name(s) when called inside ``shard_map``; reductions are global.
    metric_reduction: ``seq-mean-token-mean`` (default), ``seq-mean-token-sum`` (same
      reduction) or ``token-mean``: how per-token metrics are reduced (contract §8).
    batch_norm_factor: a precomputed batch-normalisation mean to use instead of computing it
      (for micro-batches whose weights depend on the current policy).
    pass_options: how the token passes run (static); default
      :func:`mis_jax.engine.pass_options` of ``segment_ids`` (pass it explicitly under ``jit`` to tie
      it to where the data lives).
    advantages: per-token advantages (same shape), needed by ``opsm_delta`` (OPSM masks
      sequences by their advantage's sign, contract §4.2).

  Returns:
    ``(weights, kept_mask, metrics)``: float32 weights (stop-gradient, zero where
    ``loss_mask`` is 0), the kept mask in ``loss_mask``'s dtype, and a dict of float32
    scalars named as in contract §8.1–8.2.
  """
  arrays = _validation.check_token_arrays(
    {
      "train_logprobs": train_logprobs,
      "rollout_logprobs": rollout_logprobs,
      "loss_mask": loss_mask,
      "segment_ids": segment_ids,
      "advantages": advantages,
    },
    float_keys=("train_logprobs", "rollout_logprobs", "advantages"),
  )
  _validation.check_segments(segment_ids, num_segments)
  if not isinstance(cfg, MISConfig):
    raise TypeError(f"cfg must be a mis_jax.MISConfig, got {type(cfg).__name__}")
  metric_reduction = _validation.metric_reduction(metric_reduction)
  shape = jnp.shape(loss_mask)
  segs = Segments(segment_ids, num_segments, axis_name, pass_options)
  o, q, mask = _validation.flat_inputs(arrays, segs)
  mask, nonfinite = drop_nonfinite_rollout(q, mask, axis_name)
  adv = None if advantages is None else _validation.flat_float(arrays["advantages"])
  weights, kept, metrics, _, _ = correct(
    o, q, mask, segs, cfg if cfg.use_tis else None, metric_reduction, batch_norm_factor=batch_norm_factor, adv=adv
  )
  kept = kept.astype(jnp.asarray(loss_mask).dtype)
  return weights.reshape(shape), kept.reshape(shape), {**metrics, **nonfinite}


# Vanilla TIS's metrics (contract §8.3): means over the mask.
metrics_lib.declare({"tis": "mask", "tis_clipfrac": "mask", "tis_abs": "mask"})


def vanilla_core(o, q, mask, tis_clip: float, tis_clip_low: float):
  """Built-in vanilla TIS on flat arrays (contract §6): ``w = clip(exp(r), tis_clip_low, tis_clip)``.

  Returns ``(weights, values)``: the mask is unchanged; ``values`` are the per-token rows of
  the metrics ``tis`` (``exp(r)``), ``tis_clipfrac`` (``[w != exp(r)]``) and ``tis_abs``
  (``|exp(r) - 1|``), to be reduced over the mask.
  """
  r = correction.log_ratio(jax.lax.stop_gradient(o), jax.lax.stop_gradient(q), mask)
  ratio = safe_exp(r)
  w = jnp.clip(ratio, tis_clip_low, tis_clip)
  values = {"tis": ratio, "tis_clipfrac": w != ratio, "tis_abs": jnp.abs(ratio - 1.0)}
  return correction.stop_gradient_weights(w, mask), values


def vanilla_tis_weights(
  train_logprobs,
  rollout_logprobs,
  loss_mask,
  *,
  tis_clip: float = 2.0,
  tis_clip_low: float = 0.0,
  segment_ids=None,
  num_segments: int | None = None,
  axis_name: AxisName = None,
  metric_reduction: str = "token-mean",
  pass_options: PassOptions | None = None,
):
  """Built-in vanilla truncated IS (contract §6): ``w = clip(exp(o - q), tis_clip_low, tis_clip)``.

  The mask is unchanged. Metrics: ``tis`` (mean raw ratio), ``tis_clipfrac`` (share of tokens
  whose value the clip changed), ``tis_abs`` (mean ``|exp(r) - 1|``), reduced over the mask by
  ``metric_reduction`` (seq-mean modes need ``segment_ids`` and ``num_segments``).

  Returns:
    ``(weights, metrics)``.
  """
  arrays = {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs, "loss_mask": loss_mask}
  if segment_ids is None:
    if _validation.metric_reduction(metric_reduction) != "token-mean":
      raise ValueError(f"metric_reduction={metric_reduction!r} needs segment_ids and num_segments")
    segment_ids = jnp.where(_validation.as_bool(loss_mask), 0, -1).astype(jnp.int32)
    num_segments = 1
  else:
    if num_segments is None:
      raise ValueError("segment_ids given without num_segments")
    _validation.check_segments(segment_ids, num_segments)
  arrays["segment_ids"] = segment_ids
  arrays = _validation.check_token_arrays(arrays, float_keys=("train_logprobs", "rollout_logprobs"))
  metric_reduction = _validation.metric_reduction(metric_reduction)
  if not 0 <= tis_clip_low < tis_clip:
    raise ValueError(f"need 0 <= tis_clip_low < tis_clip, got tis_clip_low={tis_clip_low}, tis_clip={tis_clip}")
  shape = jnp.shape(loss_mask)
  segs = Segments(segment_ids, num_segments, axis_name, pass_options)
  o, q, mask = _validation.flat_inputs(arrays, segs)
  mask, nonfinite = drop_nonfinite_rollout(q, mask, axis_name)
  w, values = vanilla_core(o, q, mask, tis_clip, tis_clip_low)
  metrics = masked_means([(mask, segs.mask_stats(mask), values)], segs, metric_reduction)
  return w.reshape(shape), {**metrics, **nonfinite}
