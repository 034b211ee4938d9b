"""The ``mis`` correction (contract §2–5) with its metrics (contract §8.1–8.2), and vanilla TIS.

``compute_mis_weights`` is the ``mis`` correction function; ``vanilla_tis_weights`` is the
built-in one used when no MIS config is given. Both are pure and jittable; configs are static.

:func:`correct` composes the formulas of :mod:`mis_jax._correction` and the metric rows of
:mod:`mis_jax._metrics` into two fused passes of the pass engine (:mod:`mis_jax._engine`):

- pass 1, per segment over the original mask ``m``: ``n_s``, ``Σ m r`` (sequence/geometric
  levels, ``mis_chi2_seq``), ``Σ m o`` and ``Σ m q`` (§8.1), catastrophic-token counts (veto)
  and the sequence aggregates of divergence criteria;
- pass 2, token by token: weights and kept mask, and every metric: means over ``m`` as
  weighted totals (``R_m(x) = Σ_t a_t x_t / N``, ``a_t = m_t / n_{s(t)}`` in seq-mean modes),
  means over other masks from per-segment sums, batch-normalisation and ESS totals.

The per-mask statistics it counted (:class:`MaskStats` of ``m`` and of ``m'``) come back with
the result, so the loss aggregation and later metrics reuse them instead of counting again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _controller as controller
from mis_jax import _correction as correction
from mis_jax import _metrics as metrics_lib
from mis_jax import _validation
from mis_jax._config import MISConfig
from mis_jax._engine import HIGHEST, LOWEST, Max, Min, Out, PassOptions, SegMax, SegSum, Total
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
  """What one correction computes (static): the config, the metric reduction, and the
  switches derived from them."""

  cfg: MISConfig | None
  mode: str
  mismatch: bool
  given_batch_norm: bool  # a precomputed batch-normalisation mean is used

  @property
  def seq_mode(self) -> bool:
    return self.mode != "token-mean"

  @property
  def tis(self) -> bool:
    return self.cfg is not None

  @property
  def veto(self) -> bool:
    return self.tis and self.cfg.rs_veto_threshold is not None

  @property
  def opsm(self) -> bool:
    return self.tis and self.cfg.opsm_delta is not None

  @property
  def m2po(self) -> bool:
    return self.tis and self.cfg.m2po_threshold is not None

  @property
  def thresholds(self) -> bool:
    """Whether some bound or cutoff is set from the step's ratios before pass 2 (§3.1, §4.2)."""
    return self.tis and (self.cfg.tis_auto or self.cfg.rs_auto or self.cfg.criteria_auto or self.m2po)

  @property
  def rejects_segments(self) -> bool:
    """Whether whole segments are rejected by pass 1's per-segment results (veto, OPSM)."""
    return self.veto or self.opsm

  @property
  def crits(self) -> tuple:
    return self.cfg.rs_criteria if self.tis else ()

  @property
  def need_sum_r(self) -> bool:
    """``Σ m r`` per segment: for the sequence/geometric levels and ``mis_chi2_seq``."""
    if not self.tis:
      return self.mismatch
    levels = {self.cfg.tis_level} | ({self.cfg.rs_level_resolved} if self.cfg.use_rs else set())
    return self.mismatch or self.opsm or bool(levels - {"token"})

  @property
  def kept_w_by_segment(self) -> bool:
    """Kept weights summed per segment (seq-mean metrics, sequence-level batch norm), else in total."""
    cfg = self.cfg
    return self.tis and (self.seq_mode or (cfg.tis_batch_normalize and cfg.tis_level != "token"
                                           and not self.given_batch_norm))


class _SegmentStats(NamedTuple):
  """Per-segment results of pass 1 that pass 2 and the metrics read."""
  mask_stats: MaskStats
  divisor: jax.Array  # N of R_m: live segments (seq-mean modes) or trained tokens
  sum_r: jax.Array | None
  vetoed: jax.Array | None
  opsm: jax.Array | None  # segments OPSM masks (§4.2)
  criteria: dict  # {criterion index: per-segment value} for sequence-aggregated criteria

  @property
  def rejected(self):
    """Segments rejected whole by the veto or OPSM."""
    parts = [x for x in (self.vetoed, self.opsm) if x is not None]
    return functools.reduce(jnp.logical_or, parts) if parts else None


# --- pass 1: per-segment sums over the original mask ---------------------------------------

def _segment_sums_body(plan: _Plan):
  """``n_s``, ``Σ m r``, ``Σ m o`` and ``Σ m q`` (§8.1), catastrophic-token counts (veto) and
  the sequence aggregates of divergence criteria, per segment."""
  cfg = plan.cfg

  def body(ch):
    m = ch["mask"]
    r = correction.log_ratio(ch["o"], ch["q"], m)
    out = {"count": SegSum(m)}
    if plan.need_sum_r:
      out["sum_r"] = SegSum(r)
    if plan.mismatch:
      out["sum_o"] = SegSum(jnp.where(m, ch["o"], 0.0))
      out["sum_q"] = SegSum(jnp.where(m, ch["q"], 0.0))
    if plan.veto:
      out["catastrophic"] = SegSum(correction.catastrophic_tokens(r, m, cfg.rs_veto_threshold))
    if plan.opsm:
      out["sum_adv"] = SegSum(jnp.where(m, ch["adv"], 0.0))
    for i, crit in enumerate(plan.crits):
      d = correction.divergence(crit.metric, r)
      per_segment = correction.AGGREGATIONS[crit.agg]
      if per_segment == "sum":
        out[f"crit{i}"] = SegSum(jnp.where(m, d, 0.0))
      elif per_segment == "max":
        out[f"crit{i}"] = SegMax(jnp.where(m, d, LOWEST))
    return out

  return body


def _segment_stats(plan: _Plan, p1: dict) -> _SegmentStats:
  mask_stats = MaskStats.from_counts(p1["count"])
  divisor = jnp.maximum(mask_stats.num_live if plan.seq_mode else mask_stats.total, 1.0)
  vetoed = correction.vetoed_segments(p1["catastrophic"]) if plan.veto else None
  criteria = {i: correction.criterion_value(crit, correction.segment_divergence(crit, p1[f"crit{i}"],
                                                                                mask_stats.counts))
              for i, crit in enumerate(plan.crits) if crit.agg != "token"}
  opsm = (correction.opsm_segments(p1["sum_r"], mask_stats.counts, p1["sum_adv"], plan.cfg.opsm_delta)
          if plan.opsm else None)
  return _SegmentStats(mask_stats, divisor, p1.get("sum_r"), vetoed, opsm, criteria)


# --- pass 2: weights, kept mask and every token-level metric --------------------------------

def _is_weights(cfg: MISConfig, bounds: correction.Bounds, log_values, m, seq_mode: bool, out: dict):
  """§3: raw and bounded IS weights, and the tokens IS keeps (with their sums for
  ``mis_tis_weight_after_bound``)."""
  w_raw = correction.raw_weights(log_values(cfg.tis_level))
  w, keep_is = correction.bounded_weights(w_raw, cfg, bounds)
  w = jnp.where(m, w, 0.0)
  kept = m if keep_is is None else m & keep_is
  if keep_is is not None:
    acc = SegSum if seq_mode else Total
    out["is_kept_w"], out["is_kept_n"] = acc(jnp.where(kept, w, 0.0)), acc(kept)
  return w_raw, w, keep_is, kept


def _criterion_values(plan: _Plan, seg: _SegmentStats, r, to_tokens, uppers):
  """§4.1: each divergence criterion's value at every token, with whether the token is in its
  band (``uppers``: the criteria's upper bounds, auto ones resolved)."""
  for i, crit in enumerate(plan.crits):
    if crit.agg == "token":
      value = correction.criterion_value(crit, correction.divergence(crit.metric, r))
    else:
      value = to_tokens(seg.criteria[i])
    yield crit, value, correction.in_band(value, crit.lower, uppers[i])


def _rejections(plan: _Plan, seg: _SegmentStats, bounds: correction.Bounds, r, kept, log_values, to_tokens,
                rejected_at, w_raw=None, on_criterion=None):
  """``kept`` ANDed with what rejection keeps: RS on the raw weights at ``rs_level`` (§4), the
  divergence criteria (§4.1), the segments the veto or OPSM reject (§4, §4.2) and M2PO's cutoff
  (§4.2) — the one composition pass 2 and the controller's ESS bound (§3.1) share.

  ``w_raw``: the raw IS weights, reused when RS is at ``tis_level``; ``on_criterion(crit, value,
  keep)`` sees each criterion (pass 2's metric rows). Returns ``(kept, w_rs_raw)`` (None without RS).
  """
  cfg, w_rs_raw = plan.cfg, None
  if cfg.use_rs:
    rs_level = cfg.rs_level_resolved
    w_rs_raw = (w_raw if w_raw is not None and rs_level == cfg.tis_level
                else correction.raw_weights(log_values(rs_level)))
    kept = kept & correction.rs_keep(w_rs_raw, bounds)
  for crit, value, keep in _criterion_values(plan, seg, r, to_tokens, bounds.criteria_upper):
    kept = kept & keep
    if on_criterion is not None:
      on_criterion(crit, value, keep)
  if rejected_at is not None:
    kept = kept & ~rejected_at
  if plan.m2po:  # §4.2: the largest squared log-ratios go
    kept = kept & (r * r <= bounds.m2_max)
  return kept, w_rs_raw


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
  """Pass 2: per token, the weights and kept mask (IS, RS, criteria, veto) and every metric
  averaged over ``m`` as a weighted total (``R_m(x) = Σ_t a_t x_t / N``, ``a_t = m_t / n_{s(t)}``
  in seq-mean modes)."""
  cfg, count = plan.cfg, seg.mask_stats.counts

  def body(ch):
    m = ch["mask"]
    r = correction.log_ratio(ch["o"], ch["q"], m)
    if plan.seq_mode and plan.rejects_segments:
      inverse, rejected_at = ch.broadcast_two(seg.mask_stats.inverse, seg.rejected)
    else:
      inverse = ch.broadcast(seg.mask_stats.inverse) if plan.seq_mode else None
      rejected_at = ch.broadcast(seg.rejected) if plan.rejects_segments else None
    a = jnp.where(m, inverse, 0.0) if plan.seq_mode else jnp.where(m, 1.0, 0.0)  # R_m weights
    means = metrics_lib.mismatch_token_values(r) if plan.mismatch else {}  # per-token values, R_m-averaged
    out = {}
    if plan.tis:
      log_values = lambda level: correction.level_log_values(level, r, seg.sum_r, count, ch.broadcast)
      w_raw, w, keep_is, kept = _is_weights(cfg, bounds, log_values, m, plan.seq_mode, out)

      def criterion_rows(crit, value, keep):  # §4.1's metric rows
        means.update(metrics_lib.criterion_token_values(crit, value, keep))
        out[f"max:mis_rs_{crit.name}_max"] = Max(jnp.where(m, value, LOWEST))
      kept, w_rs_raw = _rejections(plan, seg, bounds, r, kept, log_values, ch.broadcast, rejected_at, w_raw,
                                   criterion_rows)
      catastrophic = correction.catastrophic_tokens(r, m, cfg.rs_veto_threshold) if plan.veto else None
      means.update(metrics_lib.correction_token_values(cfg, bounds, w_raw, w, keep_is, w_rs_raw, catastrophic))
      _kept_weight_sums(plan, w, kept, out)
    for name, x in means.items():
      out["mean:" + name] = Total(jnp.where(m, x.astype(jnp.float32), 0.0) * a)
    return out

  return body


# --- the threshold controller: auto bounds, set from the step's own weights (§3.1) ---------

def _controller_units(plan: _Plan, seg: _SegmentStats, segs: Segments, r, m, level: str, kept=None):
  """The units a bound at ``level`` acts on: tokens (sharded) or segments (already global), with
  their raw weights, trained multiplicity and kept multiplicity (``kept`` tokens; default ``m``)."""
  kept = (m if kept is None else kept).astype(jnp.float32)
  if level == "token":
    return controller.Units(correction.raw_weights(r), m.astype(jnp.float32), kept, segs.axis_name)
  count = seg.mask_stats.counts
  x = correction.raw_weights(correction.segment_log_values(level, seg.sum_r, count))
  return controller.Units(x, (count > 0).astype(jnp.float32), segs.sum(kept), None)


def _step_thresholds(plan: _Plan, seg: _SegmentStats, segs: Segments, o, q, m):
  """contract §3.1 and §4.2: the step's bounds, with the auto ones set by the controller and
  M2PO's cutoff, and their metrics.

  Order: M2PO's cutoff (over the trained tokens), the criteria's auto upper bounds (each its
  masked share of its units), the RS band (its masked share, on the raw weights at
  ``rs_level``), then the IS bound — a masking band by its masked share, or a
  truncate/clip bound by the ESS over the tokens the RS band, the criteria, the veto, OPSM and
  M2PO keep (they do not move with it)."""
  cfg, fixed = plan.cfg, correction.Bounds.of(plan.cfg)
  r = correction.log_ratio(o, q, m)
  units = functools.partial(_controller_units, plan, seg, segs, r, m)
  trained = m.astype(jnp.float32)
  token_units = lambda x: controller.Units(x, trained, trained, segs.axis_name)
  metrics, met = {}, jnp.bool_(True)
  m2_max = None
  if plan.m2po:
    m2_max, second_moment, share = controller.m2po_cutoff(token_units(r * r), cfg.m2po_threshold)
    metrics.update(mis_m2po_max_sq_log_ratio=m2_max, mis_m2po_second_moment=second_moment,
                   mis_m2po_masked_fraction=share)
  uppers = list(fixed.criteria_upper)
  for i, crit in enumerate(plan.crits):  # a criterion's auto upper bound: its masked share of its units
    if not crit.auto:
      continue
    if crit.agg == "token":
      units_i = token_units(correction.criterion_value(crit, correction.divergence(crit.metric, r)))
    else:
      live = (seg.mask_stats.counts > 0).astype(jnp.float32)
      units_i = controller.Units(seg.criteria[i], live, live, None)
    uppers[i], _, ok = controller.masking_bound(units_i, crit.lower, cfg.max_masked_fraction, reciprocal=False)
    metrics[f"mis_auto_rs_{crit.name}_upper"] = uppers[i]
    met = met & ok
  fixed = fixed._replace(m2_max=m2_max, criteria_upper=tuple(uppers))
  if not (cfg.tis_auto or cfg.rs_auto):
    if cfg.criteria_auto:
      metrics["mis_auto_target_met"] = met.astype(jnp.float32)
    return fixed, metrics
  rs_lower, rs_upper = fixed.rs_lower, fixed.rs_upper
  if cfg.rs_auto:
    rs_upper, share, ok = controller.masking_bound(units(cfg.rs_level_resolved), cfg.rs_lower_bound,
                                                   cfg.max_masked_fraction)
    metrics.update(mis_auto_rs_upper_bound=rs_upper, mis_auto_rs_masked_fraction=share)
    met = met & ok
  if rs_upper is not None and rs_lower is None:  # an unset RS lower bound is 1/(RS upper bound)
    rs_lower = 1.0 / rs_upper
  tis_lower, tis_upper = fixed.tis_lower, fixed.tis_upper
  if cfg.tis_auto and cfg.tis_mode == "mask":
    tis_upper, share, ok = controller.masking_bound(units(cfg.tis_level), cfg.tis_lower_bound,
                                                    cfg.max_masked_fraction)
    metrics["mis_auto_tis_masked_fraction"] = share
    met = met & ok
  elif cfg.tis_auto:  # the ESS over what rejection keeps, as pass 2 composes it
    log_values = lambda level: correction.level_log_values(level, r, seg.sum_r, seg.mask_stats.counts,
                                                           segs.broadcast)
    rejected_at = segs.broadcast(seg.rejected) if plan.rejects_segments else None
    kept, _ = _rejections(plan, seg, fixed._replace(rs_lower=rs_lower, rs_upper=rs_upper), r, m, log_values,
                          segs.broadcast, rejected_at)
    tis_upper, ess, ok = controller.ess_bound(units(cfg.tis_level, kept), cfg.tis_mode, cfg.tis_lower_bound,
                                              cfg.target_ess_ratio)
    metrics["mis_auto_ess_ratio"] = ess
    met = met & ok
  if cfg.tis_auto:
    tis_lower = 1.0 / tis_upper if cfg.tis_lower_bound is None else cfg.tis_lower_bound
    metrics["mis_auto_tis_upper_bound"] = tis_upper
    if cfg.use_rs and cfg.rs_upper_bound is None:  # the RS band follows the IS band (mask mode)
      rs_upper = tis_upper
      rs_lower = tis_lower if cfg.rs_lower_bound is None else cfg.rs_lower_bound
  metrics["mis_auto_target_met"] = met.astype(jnp.float32)
  return correction.Bounds(tis_lower, tis_upper, rs_lower, rs_upper, m2_max, fixed.criteria_upper), metrics


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


def _correction_metrics(plan: _Plan, seg: _SegmentStats, p2: dict, metrics: dict) -> None:
  """The §8.2 metrics not averaged over ``m`` token by token."""
  mask_stats = seg.mask_stats
  if "is_kept_w" in p2:
    metrics["mis_tis_weight_after_bound"] = _kept_mean(plan, p2["is_kept_w"], p2["is_kept_n"])
  for k, v in p2.items():
    if k.startswith("max:"):
      metrics[k[len("max:"):]] = jnp.where(mask_stats.total > 0, v, 0.0)
  live_share = lambda segments: (jnp.sum((segments & (mask_stats.counts > 0)).astype(jnp.float32))
                                 / jnp.maximum(mask_stats.num_live, 1.0))
  if plan.veto:
    metrics["mis_rs_catastrophic_seq_fraction"] = live_share(seg.vetoed)
  if plan.opsm:
    metrics["mis_opsm_masked_seq_fraction"] = live_share(seg.opsm)


def correct(o, q, mask, segs: Segments, cfg: MISConfig | None, mode: str, *, batch_norm_factor=None,
            mismatch: bool = True, adv=None) -> Corrected:
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
    adv: float32 ``[T]`` advantages, for OPSM (§4.2).
  """
  plan = _Plan(cfg, mode, mismatch, batch_norm_factor is not None)
  arrays = {"o": jax.lax.stop_gradient(o), "q": jax.lax.stop_gradient(q), "mask": mask}
  if plan.opsm:
    if adv is None:
      raise ValueError(f"opsm_delta={cfg.opsm_delta} (OPSM) masks negative-advantage sequences: pass advantages= "
                       "(the losses pass the batch's)")
    arrays["adv"] = jnp.where(mask, jax.lax.stop_gradient(adv), 0.0)
  p1 = segs.run_pass(arrays, _segment_sums_body(plan))
  seg = _segment_stats(plan, p1)
  mask_stats, count = seg.mask_stats, seg.mask_stats.counts
  auto_metrics = {}
  if plan.thresholds:
    bounds, auto_metrics = _step_thresholds(plan, seg, segs, arrays["o"], arrays["q"], mask)
  else:
    bounds = correction.Bounds.of(cfg) if plan.tis else None
  p2 = segs.run_pass(arrays, _token_body(plan, seg, bounds))
  token_means = {k[len("mean:"):]: v / seg.divisor for k, v in p2.items() if k.startswith("mean:")}
  metrics = {}
  if mismatch:
    seg_values = metrics_lib.mismatch_segment_values(p1["sum_o"], p1["sum_q"], seg.sum_r, count)
    metrics.update(metrics_lib.mismatch_metrics(seg_values, token_means, count, mode))
  if not plan.tis:
    return Corrected(mask.astype(jnp.float32), mask, metrics, mask_stats, mask_stats)

  metrics.update({k: v for k, v in token_means.items() if k not in metrics})
  metrics.update(auto_metrics)
  _correction_metrics(plan, seg, p2, metrics)
  kept_stats = MaskStats.from_counts(p2["kept_n"])
  sum_w = jnp.sum(p2["kept_w"]) if plan.kept_w_by_segment else p2["sum_w"]
  mean_after = (_kept_mean(plan, p2["kept_w"], kept_stats.counts) if plan.seq_mode
                else _kept_mean(plan, sum_w, kept_stats.total))
  factor = correction.batch_norm_factor(_batch_norm_mean(plan, p2, sum_w, kept_stats, batch_norm_factor))
  metrics.update(metrics_lib.final_weight_metrics(
      mean_after_tis_rs=mean_after, factor=factor, w_min=p2["w_min"], w_max=p2["w_max"], sum_w=sum_w,
      sum_w2=p2["sum_w2"], num_kept=kept_stats.total, num_trained=mask_stats.total,
      seg_kept_counts=kept_stats.counts, num_live=mask_stats.num_live))
  weights = jax.lax.stop_gradient(p2["w"] / factor)
  return Corrected(weights, p2["kept"], metrics, mask_stats, kept_stats)


def mismatch_metrics(train_logprobs, rollout_logprobs, mask, segs: Segments, mode: str):
  """The contract §8.1 mismatch-monitoring metrics alone (flat float32 inputs, original mask).

  Returns ``(metrics, mask_stats)``: the metrics and the :class:`MaskStats` of ``mask``
  counted on the way.
  """
  result = correct(train_logprobs, rollout_logprobs, mask, segs, None, mode)
  return result.metrics, result.mask_stats

def compute_mis_weights(train_logprobs, rollout_logprobs, loss_mask, segment_ids, cfg: MISConfig, *,
                        num_segments: int, axis_name: AxisName = None,
                        metric_reduction: str = "seq-mean-token-mean",
                        batch_norm_factor=None, pass_options: PassOptions | None = None, advantages=None):
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
      :func:`mis_jax.pass_options` of ``segment_ids`` (pass it explicitly under ``jit`` to tie
      it to where the data lives).
    advantages: per-token advantages (same shape), needed by ``opsm_delta`` (OPSM masks
      sequences by their advantage's sign, contract §4.2).

  Returns:
    ``(weights, kept_mask, metrics)``: float32 weights (stop-gradient, zero where
    ``loss_mask`` is 0), the kept mask in ``loss_mask``'s dtype, and a dict of float32
    scalars named as in contract §8.1–8.2.
  """
  arrays = _validation.check_token_arrays(
      {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs,
       "loss_mask": loss_mask, "segment_ids": segment_ids, "advantages": advantages},
      float_keys=("train_logprobs", "rollout_logprobs", "advantages"))
  _validation.check_segments(segment_ids, num_segments)
  if not isinstance(cfg, MISConfig):
    raise TypeError(f"cfg must be a mis_jax.MISConfig, got {type(cfg).__name__}")
  metric_reduction = _validation.metric_reduction(metric_reduction)
  shape = jnp.shape(loss_mask)
  segs = Segments(segment_ids, num_segments, axis_name, pass_options)
  o, q, mask = _validation.flat_inputs(arrays, segs)
  adv = None if advantages is None else _validation.flat_float(arrays["advantages"])
  weights, kept, metrics, _, _ = correct(o, q, mask, segs, cfg if cfg.use_tis else None, metric_reduction,
                                         batch_norm_factor=batch_norm_factor, adv=adv)
  kept = kept.astype(jnp.asarray(loss_mask).dtype)
  return weights.reshape(shape), kept.reshape(shape), metrics


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


def vanilla_tis_weights(train_logprobs, rollout_logprobs, loss_mask, *, tis_clip: float = 2.0,
                        tis_clip_low: float = 0.0, segment_ids=None, num_segments: int | None = None,
                        axis_name: AxisName = None, metric_reduction: str = "token-mean",
                        pass_options: PassOptions | None = None):
  """Built-in vanilla truncated IS (contract §6): ``w = clip(exp(o - q), tis_clip_low, tis_clip)``.

  The mask is unchanged. Metrics: ``tis`` (mean raw ratio), ``tis_clipfrac`` (share of tokens
  whose value the clip changed), ``tis_abs`` (mean ``|exp(r) - 1|``), reduced over the mask by
  ``metric_reduction`` (seq-mean modes need ``segment_ids`` and ``num_segments``).

  Returns:
    ``(weights, metrics)``.
  """
  arrays = {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs,
            "loss_mask": loss_mask}
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
  w, values = vanilla_core(o, q, mask, tis_clip, tis_clip_low)
  return w.reshape(shape), masked_means([(mask, segs.mask_stats(mask), values)], segs, metric_reduction)
