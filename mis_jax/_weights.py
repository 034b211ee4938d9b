"""Importance-sampling weights, rejection masks and their metrics (SPEC §2–5, §8).

``compute_mis_weights`` is the ``mis`` correction function; ``vanilla_tis_weights`` is the
built-in one used when no MIS config is given. Both are pure and jittable; configs are static.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mis_jax import _validation
from mis_jax._config import MISConfig
from mis_jax._segments import (_HIGHEST, _LOWEST, LOG_BOUND, AxisName, Max, Min, Out, PerSegment, Segments, SegMax,
                               SegSum, Total, safe_exp)

_EPS_NORM = 1e-8


def _divergence(r, crit):
  """Per-token divergence of a criterion: ``-r`` (k1), ``r²/2`` (k2), ``e^r - 1 - r`` (k3)."""
  if crit.metric == "k1":
    return -r
  if crit.metric == "k2":
    return 0.5 * r * r
  rc = jnp.clip(r, -LOG_BOUND, LOG_BOUND)
  return jnp.exp(rc) - 1.0 - rc


_MISMATCH_ORDER = ("mis_training_log_ppl", "mis_training_ppl", "mis_rollout_log_ppl", "mis_rollout_ppl", "mis_kl",
                   "mis_k3_kl", "mis_log_ppl_diff", "mis_log_ppl_abs_diff", "mis_ppl_ratio", "mis_chi2_token",
                   "mis_chi2_seq", "train_rollout_logprob_abs_diff")


def mis_core(o, q, mask, segs: Segments, cfg: MISConfig | None, mode: str, *, batch_norm_factor=None,
             mismatch: bool = True):
  """SPEC §2–5 and §8.1–8.2 on flat arrays, in two chunked passes over the tokens.

  Pass 1 collects what is per segment: mask counts, ``Σ m r`` (sequence/geometric levels and
  the mismatch metrics), ``Σ m q``, catastrophic-token counts (veto) and the sequence
  aggregates of divergence criteria. Pass 2 computes the weights and the kept mask token by
  token and accumulates every metric: means over the original mask as weighted totals
  (weight ``m_t / n_{s(t)}`` in the seq-mean modes), means over the kept mask from
  per-segment sums, and the batch-normalisation and ESS totals. The final division by the
  batch-normalisation factor is elementwise. See :meth:`Segments.run_pass`.

  Args:
    o, q: float32 ``[T]`` train/rollout log-probs (stop-gradient here).
    mask: bool ``[T]``, trained and non-padding.
    cfg: the :class:`MISConfig`, or None for the §8.1 mismatch metrics only (then
      ``weights = mask``, ``kept = mask``).
    mode: metric reduction (``token-mean`` or a seq-mean mode).
    batch_norm_factor: a precomputed batch-normalisation mean to use instead.
    mismatch: whether to compute the §8.1 mismatch metrics too.

  Returns:
    ``(weights, kept, metrics)``: stop-gradient float32 weights (0 outside ``mask``), the
    kept mask ``m'`` and a dict of float32 scalars.
  """
  o = jax.lax.stop_gradient(o)
  q = jax.lax.stop_gradient(q)
  seq_mode = mode != "token-mean"
  tis = cfg is not None
  veto = tis and cfg.rs_veto_threshold is not None
  log_veto = math.log(cfg.rs_veto_threshold) if veto else None
  crits = cfg.rs_criteria if tis else ()
  levels = ({cfg.tis_level} | ({cfg.rs_level_resolved} if cfg.use_rs else set())) if tis else set()
  need_sum_r = mismatch or bool(levels - {"token"})

  def ratio(ch):
    m = ch["mask"]
    return m, jnp.where(m, ch["o"] - ch["q"], 0.0)

  # Pass 1: per-segment sums over the original mask.
  def pass1(ch):
    m, r = ratio(ch)
    out = {"count": SegSum(m)}
    if need_sum_r:
      out["sum_r"] = SegSum(r)
    if mismatch:
      out["sum_q"] = SegSum(jnp.where(m, ch["q"], 0.0))
    if veto:
      out["cat"] = SegSum(m & (r < log_veto))
    for i, crit in enumerate(crits):
      if crit.agg in ("seq_sum", "seq_mean"):
        out[f"crit{i}"] = SegSum(jnp.where(m, _divergence(r, crit), 0.0))
      elif crit.agg == "seq_max":
        out[f"crit{i}"] = SegMax(jnp.where(m, _divergence(r, crit), _LOWEST))
    return out

  arrays = {"o": o, "q": q, "mask": mask}
  p1 = segs.run_pass(arrays, pass1)
  count = p1["count"]
  segs.remember_counts(mask, count)  # for other metrics over the mask
  n = jnp.maximum(count, 1.0)
  live = count > 0
  n_live = jnp.sum(live.astype(jnp.float32))
  n_trained = jnp.sum(count)
  divisor = jnp.maximum(n_live if seq_mode else n_trained, 1.0)
  inv = jnp.where(live, 1.0 / n, 0.0)
  seg_log = {"sequence": p1.get("sum_r"), "geometric": p1["sum_r"] / n if "sum_r" in p1 else None}
  crit_seg = {}
  for i, crit in enumerate(crits):
    if crit.agg != "token":
      agg = p1[f"crit{i}"] / n if crit.agg == "seq_mean" else p1[f"crit{i}"]
      crit_seg[i] = -agg if crit.metric == "k1" else agg
  seg_vetoed = p1["cat"] > 0 if veto else None
  # One gather serves both the metric weight 1/n and the veto: a vetoed segment (n > 0)
  # carries -1/n.
  packed = jnp.where(seg_vetoed, -inv, inv) if (veto and seq_mode) else None
  aliases = {}  # metric -> an identical metric computed in the pass
  item_names = []  # the means over the original mask computed in the pass
  kept_w_needed = tis and (seq_mode or (cfg.tis_batch_normalize and cfg.tis_level != "token"
                                        and batch_norm_factor is None))

  # Pass 2: weights, kept mask and every token-level metric.
  def pass2(ch):
    m, r = ratio(ch)
    if packed is not None:
      g = ch.broadcast(packed)
      a, vetoed = jnp.where(m, jnp.abs(g), 0.0), g < 0
    else:
      a = jnp.where(m, ch.broadcast(inv), 0.0) if seq_mode else m.astype(jnp.float32)
      vetoed = ch.broadcast(seg_vetoed) if veto else None
    out = {}
    fractions = {}

    def item(name, x):  # a mean over the original mask
      out[name] = Total(jnp.where(m, jnp.asarray(x, jnp.float32), 0.0) * a)
      if name not in item_names:
        item_names.append(name)

    def fraction(name, level, op, bound, w_level):  # share of w_level op bound; computed once
      key = (level, op, bound)
      if key in fractions:
        aliases[name] = fractions[key]
      else:
        fractions[key] = name
        item(name, w_level > bound if op == ">" else w_level < bound)

    if mismatch:
      rc = jnp.clip(r, -LOG_BOUND, LOG_BOUND)
      item("mis_k3_kl", jnp.exp(rc) - rc - 1.0)
      item("mis_chi2_token", jnp.exp(2.0 * rc) - 1.0)
      item("train_rollout_logprob_abs_diff", jnp.abs(r))
    if not tis:
      return out
    level_log = lambda level: r if level == "token" else ch.broadcast(seg_log[level])
    upper, lower = cfg.tis_upper_bound, cfg.lower

    # §3: IS weights.
    w_raw = safe_exp(level_log(cfg.tis_level))
    keep_is = None
    item("mis_tis_weight_before_bound", w_raw)
    if cfg.tis_mode == "truncate":
      w = jnp.minimum(w_raw, upper)
      fraction("mis_tis_truncate_fraction", cfg.tis_level, ">", upper, w_raw)
    elif cfg.tis_mode == "clip":
      w = jnp.clip(w_raw, lower, upper)
      fraction("mis_tis_clip_fraction_low", cfg.tis_level, "<", lower, w_raw)
      fraction("mis_tis_clip_fraction_high", cfg.tis_level, ">", upper, w_raw)
    elif cfg.tis_mode == "mask":
      w = w_raw
      keep_is = (w_raw >= lower) & (w_raw <= upper)
      fraction("mis_tis_mask_fraction_low", cfg.tis_level, "<", lower, w_raw)
      fraction("mis_tis_mask_fraction_high", cfg.tis_level, ">", upper, w_raw)
    else:  # "none": pure rejection, no reweighting.
      w = jnp.ones_like(w_raw)
    w = jnp.where(m, w, 0.0)
    if keep_is is None:
      item("mis_tis_weight_after_bound", w)
      kept = m
    else:
      kept = m & keep_is
      acc = SegSum if seq_mode else Total
      out["is_kept_w"], out["is_kept_n"] = acc(jnp.where(kept, w, 0.0)), acc(kept)

    # §4: rejection sampling on raw (pre-bound) weights at rs_level.
    if cfg.use_rs:
      rs_level = cfg.rs_level_resolved
      w_rs_raw = w_raw if rs_level == cfg.tis_level else safe_exp(level_log(rs_level))
      kept = kept & (w_rs_raw >= cfg.rs_lower) & (w_rs_raw <= cfg.rs_upper)
      fraction("mis_rs_mask_fraction_low", rs_level, "<", cfg.rs_lower, w_rs_raw)
      fraction("mis_rs_mask_fraction_high", rs_level, ">", cfg.rs_upper, w_rs_raw)

    # Extension: divergence-based rejection criteria (AND-combined).
    for i, crit in enumerate(crits):
      if crit.agg == "token":
        value = -_divergence(r, crit) if crit.metric == "k1" else _divergence(r, crit)
      else:
        value = ch.broadcast(crit_seg[i])
      keep = jnp.ones_like(m)
      if crit.lower is not None:
        keep = keep & (value >= crit.lower)
      if crit.upper is not None:
        keep = keep & (value <= crit.upper)
      kept = kept & keep
      prefix = f"mis_rs_{crit.name}"
      item(f"{prefix}_masked_fraction", ~keep)
      item(f"{prefix}_mean", value)
      out[f"{prefix}_max"] = Max(jnp.where(m, value, _LOWEST))

    # §4: veto on the raw, unclipped token log-ratio; a catastrophic token rejects its segment.
    if veto:
      kept = kept & ~vetoed
      item("mis_rs_catastrophic_token_fraction", m & (r < log_veto))

    wk = jnp.where(kept, w, 0.0)
    out["kept_n"] = SegSum(kept)
    if kept_w_needed:
      out["kept_w"] = SegSum(wk)
    if not kept_w_needed:  # else Σ w m' is the sum of the per-segment sums
      out["sum_w"] = Total(wk)
    out["sum_w2"] = Total(wk * w)
    out["w_min"], out["w_max"] = Min(jnp.where(kept, w, _HIGHEST)), Max(jnp.where(kept, w, _LOWEST))
    out["w"], out["kept"] = Out(w), Out(kept)
    return out

  p2 = segs.run_pass(arrays, pass2)
  metrics = {}
  if mismatch:
    mean_q = p1["sum_q"] / n
    mean_r = p1["sum_r"] / n
    mean_o = mean_q + mean_r
    per_seq = {
        "mis_training_log_ppl": -mean_o,
        "mis_training_ppl": safe_exp(-mean_o),
        "mis_rollout_log_ppl": -mean_q,
        "mis_rollout_ppl": safe_exp(-mean_q),
        "mis_kl": -mean_r,
        "mis_log_ppl_diff": -mean_r,
        "mis_log_ppl_abs_diff": jnp.abs(mean_r),
        "mis_ppl_ratio": safe_exp(-mean_r),
        "mis_chi2_seq": jnp.exp(2.0 * jnp.clip(p1["sum_r"], -LOG_BOUND, LOG_BOUND)) - 1.0,
    }
    for name in _MISMATCH_ORDER:
      metrics[name] = (Segments.reduce_per_segment(PerSegment(per_seq[name], count), mode) if name in per_seq
                       else p2[name] / divisor)
  if not tis:
    return mask.astype(jnp.float32), mask, metrics

  def kept_mean(w_key, n_key):  # a mean over a mask other than the original one
    if seq_mode:
      return Segments.reduce_per_segment(PerSegment(p2[w_key] / jnp.maximum(p2[n_key], 1.0), p2[n_key]), mode)
    return p2[w_key] / jnp.maximum(p2[n_key], 1.0)

  metrics.update({k: p2[k] / divisor for k in item_names if k not in metrics})
  metrics.update({k: metrics[v] for k, v in aliases.items()})
  if "is_kept_w" in p2:
    metrics["mis_tis_weight_after_bound"] = kept_mean("is_kept_w", "is_kept_n")
  for i, crit in enumerate(crits):
    key = f"mis_rs_{crit.name}_max"
    metrics[key] = jnp.where(n_trained > 0, p2[key], 0.0)
  if veto:
    metrics["mis_rs_catastrophic_seq_fraction"] = (
        jnp.sum((seg_vetoed & live).astype(jnp.float32)) / jnp.maximum(n_live, 1.0))

  # §5: batch normalisation over the kept mask, globally.
  kept_n = p2["kept_n"]
  n_kept = jnp.sum(kept_n)
  sum_w, sum_w2 = (jnp.sum(p2["kept_w"]) if kept_w_needed else p2["sum_w"]), p2["sum_w2"]
  if seq_mode:
    metrics["mis_is_ratio_mean_after_tis_rs"] = kept_mean("kept_w", "kept_n")
  else:
    metrics["mis_is_ratio_mean_after_tis_rs"] = sum_w / jnp.maximum(n_kept, 1.0)
  if batch_norm_factor is not None:
    mu = jnp.asarray(batch_norm_factor, jnp.float32)
  elif cfg.tis_batch_normalize and cfg.tis_level == "token":
    mu = sum_w / jnp.maximum(n_kept, 1.0)
  elif cfg.tis_batch_normalize:
    # Mean over segments with a kept token of the segment's common weight.
    has = kept_n > 0
    common = p2["kept_w"] / jnp.maximum(kept_n, 1.0)
    mu = jnp.sum(jnp.where(has, common, 0.0)) / jnp.maximum(jnp.sum(has.astype(jnp.float32)), 1.0)
  else:
    mu = jnp.ones((), jnp.float32)
  factor = jnp.where(mu > _EPS_NORM, mu, 1.0)
  metrics["mis_batch_norm_factor"] = factor

  # Statistics of the weights that multiply the loss (the kept weights over one factor),
  # over the kept mask (SPEC §8.2); the ESS ratio is scale-free.
  any_kept = n_kept > 0
  ess_den = n_kept * sum_w2
  metrics.update({
      "mis_is_ratio_mean_final": metrics["mis_is_ratio_mean_after_tis_rs"] / factor,
      "mis_is_ratio_min_final": jnp.where(any_kept, p2["w_min"], 0.0) / factor,
      "mis_is_ratio_max_final": jnp.where(any_kept, p2["w_max"], 0.0) / factor,
      "mis_ess_ratio": jnp.where(ess_den > 0, sum_w * sum_w / jnp.where(ess_den > 0, ess_den, 1.0), 0.0),
      "mis_kept_token_fraction": n_kept / jnp.maximum(n_trained, 1.0),
      "mis_kept_seq_fraction": jnp.sum((kept_n > 0).astype(jnp.float32)) / jnp.maximum(n_live, 1.0),
  })
  kept = p2["kept"]
  segs.remember_counts(kept, kept_n)  # for losses and metrics over m'
  return jax.lax.stop_gradient(p2["w"] / factor), kept, metrics


def mismatch_metrics(train_logprobs, rollout_logprobs, mask, segs: Segments, mode: str) -> dict:
  """The SPEC §8.1 mismatch-monitoring metrics alone (flat float32 inputs, original mask)."""
  return mis_core(train_logprobs, rollout_logprobs, mask, segs, None, mode)[2]


def compute_mis_weights(train_logprobs, rollout_logprobs, loss_mask, segment_ids, cfg: MISConfig, *,
                        num_segments: int, axis_name: AxisName = None,
                        metric_reduction: str = "seq-mean-token-mean",
                        batch_norm_factor=None):
  """The ``mis`` correction: IS weights, kept mask and metrics (SPEC §2–5, §8.1–8.2).

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
      reduction) or ``token-mean``: how per-token metrics are reduced (SPEC §8).
    batch_norm_factor: a precomputed batch-normalisation mean to use instead of computing it
      (for micro-batches whose weights depend on the current policy).

  Returns:
    ``(weights, kept_mask, metrics)``: float32 weights (stop-gradient, zero where
    ``loss_mask`` is 0), the kept mask in ``loss_mask``'s dtype, and a dict of float32
    scalars named as in SPEC §8.1–8.2.
  """
  arrays = _validation.check_token_arrays(
      {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs,
       "loss_mask": loss_mask, "segment_ids": segment_ids},
      float_keys=("train_logprobs", "rollout_logprobs"))
  _validation.check_segments(segment_ids, num_segments)
  if not isinstance(cfg, MISConfig):
    raise TypeError(f"cfg must be a mis_jax.MISConfig, got {type(cfg).__name__}")
  _validation.check_choice("metric_reduction", metric_reduction)
  shape = jnp.shape(loss_mask)
  segs = Segments(segment_ids, num_segments, axis_name)
  o, q, mask = _validation.flat_inputs(arrays, segs)
  weights, kept, metrics = mis_core(o, q, mask, segs, cfg if cfg.use_tis else None, metric_reduction,
                                    batch_norm_factor=batch_norm_factor)
  kept = kept.astype(jnp.asarray(loss_mask).dtype)
  return weights.reshape(shape), kept.reshape(shape), metrics


def vanilla_core(o, q, mask, tis_clip: float, tis_clip_low: float):
  """Built-in vanilla TIS on flat arrays: ``w = clip(exp(r), tis_clip_low, tis_clip)``.

  Returns ``(weights, kept_mask, items)``; the mask is unchanged.
  """
  r = jnp.where(mask, jax.lax.stop_gradient(o) - jax.lax.stop_gradient(q), 0.0)
  ratio = safe_exp(r)
  w = jnp.clip(ratio, tis_clip_low, tis_clip)
  items = [("tis", ratio, mask), ("tis_clipfrac", w != ratio, mask), ("tis_abs", jnp.abs(ratio - 1.0), mask)]
  return jax.lax.stop_gradient(jnp.where(mask, w, 0.0)), mask, items


def vanilla_tis_weights(train_logprobs, rollout_logprobs, loss_mask, *, tis_clip: float = 2.0,
                        tis_clip_low: float = 0.0, segment_ids=None, num_segments: int | None = None,
                        axis_name: AxisName = None, metric_reduction: str = "token-mean"):
  """Built-in vanilla truncated IS (SPEC §6): ``w = clip(exp(o - q), tis_clip_low, tis_clip)``.

  The mask is unchanged. Metrics: ``tis`` (mean raw ratio), ``tis_clipfrac`` (share of tokens
  whose value the clip changed), ``tis_abs`` (mean ``|exp(r) - 1|``), reduced over the mask by
  ``metric_reduction`` (seq-mean modes need ``segment_ids`` and ``num_segments``).

  Returns:
    ``(weights, metrics)``.
  """
  arrays = {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs,
            "loss_mask": loss_mask}
  if segment_ids is None:
    if metric_reduction != "token-mean":
      raise ValueError(f"metric_reduction={metric_reduction!r} needs segment_ids and num_segments")
    segment_ids = jnp.where(jnp.asarray(loss_mask) != 0, 0, -1).astype(jnp.int32)
    num_segments = 1
  else:
    if num_segments is None:
      raise ValueError("segment_ids given without num_segments")
    _validation.check_segments(segment_ids, num_segments)
  arrays["segment_ids"] = segment_ids
  arrays = _validation.check_token_arrays(arrays, float_keys=("train_logprobs", "rollout_logprobs"))
  _validation.check_choice("metric_reduction", metric_reduction)
  if not 0 <= tis_clip_low < tis_clip:
    raise ValueError(f"need 0 <= tis_clip_low < tis_clip, got tis_clip_low={tis_clip_low}, tis_clip={tis_clip}")
  shape = jnp.shape(loss_mask)
  segs = Segments(segment_ids, num_segments, axis_name)
  o, q, mask = _validation.flat_inputs(arrays, segs)
  w, _, items = vanilla_core(o, q, mask, tis_clip, tis_clip_low)
  return w.reshape(shape), segs.reduce_many(items, metric_reduction)
