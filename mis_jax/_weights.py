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
from mis_jax._segments import AxisName, Segments, safe_exp

_EPS_NORM = 1e-8


def level_log_ratio(r: jax.Array, mask: jax.Array, segs: Segments, level: str) -> jax.Array:
  """Per-token level log-value ``L_t`` (SPEC §2), before the ±B clip.

  ``r`` must already be zero where ``mask`` is false.
  """
  if level == "token":
    return r
  seq_sum = segs.sum(r)
  if level == "sequence":
    return segs.broadcast(seq_sum)
  if level == "geometric":
    n = segs.sum(mask.astype(jnp.float32))
    return segs.broadcast(seq_sum / jnp.maximum(n, 1.0))
  raise ValueError(f"unknown level {level!r}")


def mismatch_metrics(train_logprobs, rollout_logprobs, mask, segs: Segments, mode: str) -> dict:
  """SPEC §8.1 mismatch-monitoring metrics over the original mask (flat float32 inputs)."""
  o = jnp.where(mask, train_logprobs, 0.0)
  q = jnp.where(mask, rollout_logprobs, 0.0)
  r = o - q
  mean_o, _ = segs.seq_mean_per_segment(o, mask)
  mean_q, _ = segs.seq_mean_per_segment(q, mask)
  mean_o_t, mean_q_t = segs.broadcast(mean_o), segs.broadcast(mean_q)
  r_clip = jnp.clip(r, -20.0, 20.0)
  chi2_token = segs.broadcast(segs.seq_mean_per_segment(jnp.exp(r_clip) ** 2, mask)[0]) - 1.0
  chi2_seq = segs.broadcast(jnp.exp(2.0 * jnp.clip(segs.sum(r), -20.0, 20.0))) - 1.0
  diff = mean_q_t - mean_o_t
  per_token = {
      "mis_training_log_ppl": -mean_o_t,
      "mis_training_ppl": safe_exp(-mean_o_t),
      "mis_rollout_log_ppl": -mean_q_t,
      "mis_rollout_ppl": safe_exp(-mean_q_t),
      "mis_kl": q - o,
      "mis_k3_kl": jnp.exp(r_clip) - r_clip - 1.0,
      "mis_log_ppl_diff": diff,
      "mis_log_ppl_abs_diff": jnp.abs(diff),
      "mis_ppl_ratio": safe_exp(diff),
      "mis_chi2_token": chi2_token,
      "mis_chi2_seq": chi2_seq,
      "train_rollout_logprob_abs_diff": jnp.abs(r),
  }
  return {k: segs.reduce(v, mask, mode) for k, v in per_token.items()}


def _fraction(segs: Segments, pred, mask, mode):
  return segs.reduce(pred.astype(jnp.float32), mask, mode)


def mis_core(o, q, mask, segs: Segments, cfg: MISConfig, mode: str,
             batch_norm_factor=None):
  """SPEC §2–5 on flat arrays: returns ``(weights, kept_mask, correction_metrics)``.

  ``o``, ``q`` float32 ``[T]``; ``mask`` bool ``[T]`` (trained and non-padding). Weights are
  stop-gradient, zero outside ``mask``; ``kept_mask`` is ``m'`` of SPEC §4.
  """
  o = jax.lax.stop_gradient(o)
  q = jax.lax.stop_gradient(q)
  metrics = {}
  r = jnp.where(mask, o - q, 0.0)
  upper, lower = cfg.tis_upper_bound, cfg.lower

  # §3: IS weights.
  log_tis = level_log_ratio(r, mask, segs, cfg.tis_level)
  w_raw = safe_exp(log_tis)
  keep_is = jnp.ones_like(mask)
  metrics["mis_tis_weight_before_bound"] = segs.reduce(w_raw, mask, mode)
  if cfg.tis_mode == "truncate":
    w = jnp.minimum(w_raw, upper)
    metrics["mis_tis_truncate_fraction"] = _fraction(segs, w_raw > upper, mask, mode)
  elif cfg.tis_mode == "clip":
    w = jnp.clip(w_raw, lower, upper)
    metrics["mis_tis_clip_fraction_low"] = _fraction(segs, w_raw < lower, mask, mode)
    metrics["mis_tis_clip_fraction_high"] = _fraction(segs, w_raw > upper, mask, mode)
  elif cfg.tis_mode == "mask":
    w = w_raw
    keep_is = (w_raw >= lower) & (w_raw <= upper)
    metrics["mis_tis_mask_fraction_low"] = _fraction(segs, w_raw < lower, mask, mode)
    metrics["mis_tis_mask_fraction_high"] = _fraction(segs, w_raw > upper, mask, mode)
  else:  # "none": pure rejection, no reweighting.
    w = jnp.ones_like(w_raw)
  metrics["mis_tis_weight_after_bound"] = segs.reduce(w, mask & keep_is, mode)

  # §4: rejection sampling on raw (pre-bound) weights at rs_level.
  keep_rs = jnp.ones_like(mask)
  if cfg.use_rs:
    rs_level = cfg.rs_level_resolved
    w_rs_raw = w_raw if rs_level == cfg.tis_level else safe_exp(level_log_ratio(r, mask, segs, rs_level))
    keep_rs = (w_rs_raw >= cfg.rs_lower) & (w_rs_raw <= cfg.rs_upper)
    metrics["mis_rs_mask_fraction_low"] = _fraction(segs, w_rs_raw < cfg.rs_lower, mask, mode)
    metrics["mis_rs_mask_fraction_high"] = _fraction(segs, w_rs_raw > cfg.rs_upper, mask, mode)

  # §4: veto on the raw, unclipped token log-ratio; a catastrophic token rejects its segment.
  vetoed = jnp.zeros_like(mask)
  if cfg.rs_veto_threshold is not None:
    catastrophic = mask & (r < math.log(cfg.rs_veto_threshold))
    seg_vetoed = segs.sum(catastrophic.astype(jnp.float32)) > 0
    vetoed = segs.broadcast(seg_vetoed)
    live = segs.sum(mask.astype(jnp.float32)) > 0
    metrics["mis_rs_catastrophic_token_fraction"] = _fraction(segs, catastrophic, mask, mode)
    metrics["mis_rs_catastrophic_seq_fraction"] = (
        jnp.sum((seg_vetoed & live).astype(jnp.float32))
        / jnp.maximum(jnp.sum(live.astype(jnp.float32)), 1.0))

  kept = mask & keep_is & keep_rs & ~vetoed
  w = jnp.where(mask, w, 0.0)
  metrics["mis_is_ratio_mean_after_tis_rs"] = segs.reduce(w, kept, mode)

  # §5: batch normalisation over the kept mask, globally.
  if batch_norm_factor is not None:
    mu = jnp.asarray(batch_norm_factor, jnp.float32)
  elif cfg.tis_batch_normalize:
    # token: Σ w m' / Σ m'. sequence/geometric: mean over segments with a kept token of the
    # segment's common weight, which is exactly the seq-mean reduction of w over m'.
    mu = segs.reduce(w, kept, "token-mean" if cfg.tis_level == "token" else "seq-mean-token-mean")
  else:
    mu = jnp.ones((), jnp.float32)
  factor = jnp.where(mu > _EPS_NORM, mu, 1.0)
  w = w / factor
  metrics["mis_batch_norm_factor"] = factor

  metrics.update(final_weight_metrics(w, kept, mask, segs, mode))
  return jax.lax.stop_gradient(w), kept, metrics


def final_weight_metrics(w, kept, mask, segs: Segments, mode: str) -> dict:
  """Statistics of the weights that multiply the loss, over the kept mask (SPEC §8.2)."""
  keptf = kept.astype(jnp.float32)
  sum_w = segs.total(jnp.where(kept, w, 0.0))
  sum_w2 = segs.total(jnp.where(kept, w * w, 0.0))
  n_kept = segs.total(keptf)
  n_trained = segs.count(mask)
  ess_den = n_kept * sum_w2
  seg_kept = segs.sum(keptf) > 0
  seg_live = segs.sum(mask.astype(jnp.float32)) > 0
  n_live = jnp.sum(seg_live.astype(jnp.float32))
  return {
      "mis_is_ratio_mean_final": segs.reduce(w, kept, mode),
      "mis_is_ratio_min_final": segs.masked_min(w, kept),
      "mis_is_ratio_max_final": segs.masked_max(w, kept),
      "mis_ess_ratio": jnp.where(ess_den > 0, sum_w * sum_w / jnp.where(ess_den > 0, ess_den, 1.0), 0.0),
      "mis_kept_token_fraction": n_kept / jnp.maximum(n_trained, 1.0),
      "mis_kept_seq_fraction": jnp.sum(seg_kept.astype(jnp.float32)) / jnp.maximum(n_live, 1.0),
  }


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
  metrics = mismatch_metrics(o, q, mask, segs, metric_reduction)
  if not cfg.use_tis:
    weights, kept = mask.astype(jnp.float32), mask
  else:
    weights, kept, correction = mis_core(o, q, mask, segs, cfg, metric_reduction, batch_norm_factor)
    metrics.update(correction)
  kept = kept.astype(jnp.asarray(loss_mask).dtype)
  return weights.reshape(shape), kept.reshape(shape), metrics


def vanilla_core(o, q, mask, segs: Segments, mode: str, tis_clip: float, tis_clip_low: float):
  """Built-in vanilla TIS on flat arrays: ``w = clip(exp(r), tis_clip_low, tis_clip)``."""
  r = jnp.where(mask, jax.lax.stop_gradient(o) - jax.lax.stop_gradient(q), 0.0)
  ratio = safe_exp(r)
  w = jnp.clip(ratio, tis_clip_low, tis_clip)
  metrics = {
      "tis": segs.reduce(ratio, mask, mode),
      "tis_clipfrac": segs.reduce((w != ratio).astype(jnp.float32), mask, mode),
      "tis_abs": segs.reduce(jnp.abs(ratio - 1.0), mask, mode),
  }
  return jax.lax.stop_gradient(jnp.where(mask, w, 0.0)), mask, metrics


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
  w, _, metrics = vanilla_core(o, q, mask, segs, metric_reduction, tis_clip, tis_clip_low)
  return w.reshape(shape), metrics
