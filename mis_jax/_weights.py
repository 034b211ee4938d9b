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
from mis_jax._segments import AxisName, PerSegment, Scaled, Segments, safe_exp

_EPS_NORM = 1e-8


def level_log_ratio(r: jax.Array, seq_sum, seq_count, segs: Segments, level: str) -> jax.Array:
  """Per-token level log-value ``L_t`` (SPEC §2), before the ±B clip.

  ``r`` is zero where the mask is false; ``seq_sum``/``seq_count`` are the per-segment
  ``Σ m r`` and ``Σ m`` (only needed for sequence and geometric levels).
  """
  if level == "token":
    return r
  if level == "sequence":
    return segs.broadcast(seq_sum)
  if level == "geometric":
    return segs.broadcast(seq_sum / jnp.maximum(seq_count, 1.0))
  raise ValueError(f"unknown level {level!r}")


def criterion_value(r, mask, seq_count, segs: Segments, crit) -> jax.Array:
  """Per-token value of a divergence criterion (see :class:`mis_jax.RSCriterion`): the
  aggregated divergence for k2/k3, the aggregated log-ratio ``-agg(k1)`` for k1."""
  if crit.metric == "k1":
    d = -r
  elif crit.metric == "k2":
    d = 0.5 * r * r
  else:
    rc = jnp.clip(r, -20.0, 20.0)
    d = jnp.exp(rc) - 1.0 - rc
  d = jnp.where(mask, d, 0.0)
  if crit.agg == "token":
    v = d
  elif crit.agg == "seq_max":
    v = segs.broadcast(segs.max(d, mask))
  else:
    seq = segs.sum(d)
    v = segs.broadcast(seq if crit.agg == "seq_sum" else seq / jnp.maximum(seq_count, 1.0))
  return -v if crit.metric == "k1" else v


def segment_log_ratio_sums(o, q, mask, segs: Segments) -> jax.Array:
  """``[S]`` per-segment ``Σ m (o - q)``, computed once per ``(o, q, mask)`` for a batch."""
  return segs.memo(("sum_r", id(o), id(q), id(mask)),
                   lambda: segs.sum(jnp.where(mask, jax.lax.stop_gradient(o - q), 0.0)), o, q, mask)


def mismatch_items(train_logprobs, rollout_logprobs, mask, segs: Segments) -> list:
  """SPEC §8.1 mismatch-monitoring metrics as ``(name, value, mask)`` items.

  Every one is a per-sequence mean of a per-token quantity, or a function of such means. The
  functions of the means ``Σ m q / n`` and ``Σ m r / n`` come from two segment sums and
  reduce over segments directly (:class:`PerSegment`); the three means of nonlinear per-token
  quantities are token items. Inputs are flat float32; ``mask`` is the original mask.
  """
  o, q = train_logprobs, rollout_logprobs
  count = segs.counts(mask)
  sum_r = segment_log_ratio_sums(o, q, mask, segs)
  n = jnp.maximum(count, 1.0)
  mean_q = segs.sum(jnp.where(mask, q, 0.0)) / n
  mean_r = sum_r / n
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
      "mis_chi2_seq": jnp.exp(2.0 * jnp.clip(sum_r, -20.0, 20.0)) - 1.0,
  }
  items = [(name, PerSegment(value, count), mask) for name, value in per_seq.items()]
  r = jnp.where(mask, o - q, 0.0)
  r_clip = jnp.clip(r, -20.0, 20.0)
  items += [("mis_k3_kl", jnp.exp(r_clip) - r_clip - 1.0, mask),
            ("mis_chi2_token", jnp.exp(2.0 * r_clip) - 1.0, mask),
            ("train_rollout_logprob_abs_diff", jnp.abs(r), mask)]
  order = ["mis_training_log_ppl", "mis_training_ppl", "mis_rollout_log_ppl", "mis_rollout_ppl", "mis_kl",
           "mis_k3_kl", "mis_log_ppl_diff", "mis_log_ppl_abs_diff", "mis_ppl_ratio", "mis_chi2_token",
           "mis_chi2_seq", "train_rollout_logprob_abs_diff"]
  by_name = {item[0]: item for item in items}
  return [by_name[name] for name in order]


def mis_core(o, q, mask, segs: Segments, cfg: MISConfig, batch_norm_factor=None):
  """SPEC §2–5 on flat arrays: returns ``(weights, kept_mask, items, scalars)``.

  ``o``, ``q`` float32 ``[T]``; ``mask`` bool ``[T]`` (trained and non-padding). Weights are
  stop-gradient, zero outside ``mask``; ``kept_mask`` is ``m'`` of SPEC §4. ``items`` are
  the mask-reduced §8.2 metrics as ``(name, per-token value, mask)`` (see
  :meth:`Segments.reduce_many`); ``scalars`` the metrics that are already scalars.
  """
  seq_sum, seq_count = segment_log_ratio_sums(o, q, mask, segs), segs.counts(mask)
  o = jax.lax.stop_gradient(o)
  q = jax.lax.stop_gradient(q)
  items, scalars = [], {}
  r = jnp.where(mask, o - q, 0.0)
  upper, lower = cfg.tis_upper_bound, cfg.lower
  veto = cfg.rs_veto_threshold is not None
  catastrophic = mask & (r < math.log(cfg.rs_veto_threshold)) if veto else None

  level_log = lambda level: level_log_ratio(r, seq_sum, seq_count, segs, level)

  # §3: IS weights.
  w_raw = safe_exp(level_log(cfg.tis_level))
  keep_is = None
  items.append(("mis_tis_weight_before_bound", w_raw, mask))
  if cfg.tis_mode == "truncate":
    w = jnp.minimum(w_raw, upper)
    items.append(("mis_tis_truncate_fraction", w_raw > upper, mask))
  elif cfg.tis_mode == "clip":
    w = jnp.clip(w_raw, lower, upper)
    items.append(("mis_tis_clip_fraction_low", w_raw < lower, mask))
    items.append(("mis_tis_clip_fraction_high", w_raw > upper, mask))
  elif cfg.tis_mode == "mask":
    w = w_raw
    keep_is = (w_raw >= lower) & (w_raw <= upper)
    items.append(("mis_tis_mask_fraction_low", w_raw < lower, mask))
    items.append(("mis_tis_mask_fraction_high", w_raw > upper, mask))
  else:  # "none": pure rejection, no reweighting.
    w = jnp.ones_like(w_raw)
  is_kept = mask if keep_is is None else mask & keep_is
  items.append(("mis_tis_weight_after_bound", w, is_kept))

  # §4: rejection sampling on raw (pre-bound) weights at rs_level.
  kept = is_kept
  if cfg.use_rs:
    rs_level = cfg.rs_level_resolved
    w_rs_raw = w_raw if rs_level == cfg.tis_level else safe_exp(level_log(rs_level))
    kept = kept & (w_rs_raw >= cfg.rs_lower) & (w_rs_raw <= cfg.rs_upper)
    items.append(("mis_rs_mask_fraction_low", w_rs_raw < cfg.rs_lower, mask))
    items.append(("mis_rs_mask_fraction_high", w_rs_raw > cfg.rs_upper, mask))

  # Extension: divergence-based rejection criteria (AND-combined).
  for crit in cfg.rs_criteria:
    value = criterion_value(r, mask, seq_count, segs, crit)
    keep = jnp.ones_like(mask)
    if crit.lower is not None:
      keep = keep & (value >= crit.lower)
    if crit.upper is not None:
      keep = keep & (value <= crit.upper)
    kept = kept & keep
    prefix = f"mis_rs_{crit.name}"
    items.append((f"{prefix}_masked_fraction", ~keep, mask))
    items.append((f"{prefix}_mean", value, mask))
    scalars[f"{prefix}_max"] = segs.masked_max(value, mask)

  # §4: veto on the raw, unclipped token log-ratio; a catastrophic token rejects its segment.
  live = seq_count > 0
  if veto:
    seg_vetoed = segs.sum(catastrophic.astype(jnp.float32)) > 0
    kept = kept & ~segs.broadcast(seg_vetoed)
    items.append(("mis_rs_catastrophic_token_fraction", catastrophic, mask))
    scalars["mis_rs_catastrophic_seq_fraction"] = (
        jnp.sum((seg_vetoed & live).astype(jnp.float32)) / jnp.maximum(jnp.sum(live.astype(jnp.float32)), 1.0))

  w = jnp.where(mask, w, 0.0)
  items.append(("mis_is_ratio_mean_after_tis_rs", w, kept))

  # §5: batch normalisation over the kept mask, globally. The token totals also give the
  # statistics of the final weights below (they are the kept weights over one factor).
  kept_count = segs.counts(kept)
  totals = segs.total([jnp.where(kept, w, 0.0), jnp.where(kept, w * w, 0.0), kept.astype(jnp.float32),
                       mask.astype(jnp.float32)])
  sum_w, sum_w2, n_kept, n_trained = (totals[i] for i in range(4))
  if batch_norm_factor is not None:
    mu = jnp.asarray(batch_norm_factor, jnp.float32)
  elif cfg.tis_batch_normalize and cfg.tis_level == "token":
    mu = sum_w / jnp.maximum(n_kept, 1.0)
  elif cfg.tis_batch_normalize:
    # Mean over segments with a kept token of the segment's common weight.
    has = kept_count > 0
    common = segs.sum(jnp.where(kept, w, 0.0)) / jnp.maximum(kept_count, 1.0)
    mu = jnp.sum(jnp.where(has, common, 0.0)) / jnp.maximum(jnp.sum(has.astype(jnp.float32)), 1.0)
  else:
    mu = jnp.ones((), jnp.float32)
  factor = jnp.where(mu > _EPS_NORM, mu, 1.0)
  w_min, w_max = segs.masked_min(w, kept, n_kept), segs.masked_max(w, kept, n_kept)
  w = w / factor
  scalars["mis_batch_norm_factor"] = factor

  # Statistics of the weights that multiply the loss, over the kept mask (SPEC §8.2); the
  # ESS ratio is scale-free.
  items.append(("mis_is_ratio_mean_final", Scaled("mis_is_ratio_mean_after_tis_rs", 1.0 / factor), kept))
  ess_den = n_kept * sum_w2
  n_live = jnp.sum(live.astype(jnp.float32))
  scalars.update({
      "mis_is_ratio_min_final": w_min / factor,
      "mis_is_ratio_max_final": w_max / factor,
      "mis_ess_ratio": jnp.where(ess_den > 0, sum_w * sum_w / jnp.where(ess_den > 0, ess_den, 1.0), 0.0),
      "mis_kept_token_fraction": n_kept / jnp.maximum(n_trained, 1.0),
      "mis_kept_seq_fraction": jnp.sum((kept_count > 0).astype(jnp.float32)) / jnp.maximum(n_live, 1.0),
  })
  return jax.lax.stop_gradient(w), kept, items, scalars


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
  items, scalars = mismatch_items(o, q, mask, segs), {}
  if not cfg.use_tis:
    weights, kept = mask.astype(jnp.float32), mask
  else:
    weights, kept, mis_items, scalars = mis_core(o, q, mask, segs, cfg, batch_norm_factor)
    items += mis_items
  metrics = {**segs.reduce_many(items, metric_reduction), **scalars}
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
