"""The metrics of contract §8.1 (mismatch monitoring) and §8.2 (the ``mis`` correction).

Each metric is ``R_mask(x)`` of a per-token or per-segment value ``x`` (contract §8). The
functions here say what ``x`` is; the passes of :mod:`mis_jax._weights` reduce it (a
per-token value over the original mask ``m`` as one weighted total, a per-segment value with
:func:`mis_jax._segments.per_segment_mean`). Every ``exp`` is ``exp(clip(·, -B, B))``.
"""

from __future__ import annotations

import jax.numpy as jnp

from mis_jax._config import MISConfig, RSCriterion, resolve_correction_fn
from mis_jax._correction import k3
from mis_jax._segments import LOG_BOUND, per_segment_mean, safe_exp

MISMATCH_NAMES = (
  "mis_training_log_ppl",
  "mis_training_ppl",
  "mis_rollout_log_ppl",
  "mis_rollout_ppl",
  "mis_kl",
  "mis_k3_kl",
  "mis_log_ppl_diff",
  "mis_log_ppl_abs_diff",
  "mis_ppl_ratio",
  "mis_chi2_token",
  "mis_chi2_seq",
  "train_rollout_logprob_abs_diff",
)


# --- contract §8.1: mismatch monitoring --------------------------------------------------------


def mismatch_token_values(r) -> dict:
  """Per-token rows of contract §8.1, each averaged over ``m`` by ``R_m``.

  ``mis_k3_kl``: ``exp(r) - r - 1``, computed as ``max(expm1(r) - r, 0)`` (never
  negative: ``exp(r) - r - 1`` in float32 goes below 0 for ``|r|`` under ~1e-4); ``mis_chi2_token``: ``exp(r)² - 1`` (so
  its mean is
  ``mean_m(exp(r)²) - 1``); ``train_rollout_logprob_abs_diff``: ``|o - q|``; ``r`` is clipped
  to ±B where it is exponentiated (contract §12.10), raw in ``|o - q|``.
  """
  rc = jnp.clip(r, -LOG_BOUND, LOG_BOUND)
  return {"mis_k3_kl": k3(rc), "mis_chi2_token": jnp.exp(2.0 * rc) - 1.0, "train_rollout_logprob_abs_diff": jnp.abs(r)}


def mismatch_segment_values(sum_o, sum_q, sum_r, count) -> dict:
  """Per-segment rows of contract §8.1 from the segment's sums over ``m``.

  With ``mean_m(x) = Σ_{t∈s} m_t x_t / max(n_s, 1)``: ``mis_training_log_ppl = -mean_m(o)``,
  ``mis_training_ppl = exp(clip(-mean_m(o), ±B))``, ``mis_rollout_log_ppl = -mean_m(q)``,
  ``mis_rollout_ppl = exp(clip(-mean_m(q), ±B))`` (a sequence whose mean log-prob is below
  -B reports ``e^B``, never inf), ``mis_kl = mean_m(q - o)`` (the token row ``q - o``, whose
  masked mean per segment is this), ``mis_log_ppl_diff = mean_m(q) - mean_m(o)``,
  ``mis_log_ppl_abs_diff = |mean_m(q) - mean_m(o)|``,
  ``mis_ppl_ratio = exp(clip(mean_m(q) - mean_m(o), ±B))``,
  ``mis_chi2_seq = exp(2·clip(Σ m r, ±B)) - 1``.
  """
  n = jnp.maximum(count, 1.0)
  mean_o, mean_q, mean_r = sum_o / n, sum_q / n, sum_r / n
  diff = mean_q - mean_o
  return {
    "mis_training_log_ppl": -mean_o,
    "mis_training_ppl": safe_exp(-mean_o),
    "mis_rollout_log_ppl": -mean_q,
    "mis_rollout_ppl": safe_exp(-mean_q),
    "mis_kl": -mean_r,
    "mis_log_ppl_diff": diff,
    "mis_log_ppl_abs_diff": jnp.abs(diff),
    "mis_ppl_ratio": safe_exp(diff),
    "mis_chi2_seq": jnp.exp(2.0 * jnp.clip(sum_r, -LOG_BOUND, LOG_BOUND)) - 1.0,
  }


def mismatch_metrics(seg_values: dict, token_means: dict, count, mode: str) -> dict:
  """The contract §8.1 table, in its order, from :func:`mismatch_segment_values` (reduced here)
  and the reduced :func:`mismatch_token_values` (``token_means``)."""
  return {
    name: per_segment_mean(seg_values[name], count, mode) if name in seg_values else token_means[name]
    for name in MISMATCH_NAMES
  }


# --- contract §8.2: correction metrics -----------------------------------------------------------


def is_token_values(cfg: MISConfig, bounds, w_raw, w, keep_is) -> dict:
  """Per-token rows of the IS weights (contract §8.2) averaged over the original mask ``m``
  (fractions use strict ``<``/``>``).

  ``mis_tis_weight_before_bound``: ``w_raw``; ``mis_tis_weight_after_bound``: the bounded
  ``w`` (here only when IS keeps every token, i.e. not in ``mask`` mode); per ``tis_mode``
  ``mis_tis_truncate_fraction = [w_raw > U]``, ``mis_tis_{clip,mask}_fraction_low/_high =
  [w_raw < Lo]/[w_raw > U]``.
  """
  upper, lower = bounds.tis_upper, bounds.tis_lower
  out = {"mis_tis_weight_before_bound": w_raw}
  if keep_is is None:
    out["mis_tis_weight_after_bound"] = w
  if cfg.tis_mode == "truncate":
    out["mis_tis_truncate_fraction"] = w_raw > upper
  elif cfg.tis_mode in ("clip", "mask"):
    out[f"mis_tis_{cfg.tis_mode}_fraction_low"] = w_raw < lower
    out[f"mis_tis_{cfg.tis_mode}_fraction_high"] = w_raw > upper
  return out


def rs_token_values(bounds, w_rs_raw) -> dict:
  """Per-token rows of rejection sampling (contract §8.2) averaged over ``m``:
  ``mis_rs_mask_fraction_low/_high = [w_rs_raw < lo_rs]/[w_rs_raw > hi_rs]``."""
  return {
    "mis_rs_mask_fraction_low": w_rs_raw < bounds.rs_lower,
    "mis_rs_mask_fraction_high": w_rs_raw > bounds.rs_upper,
  }


def criterion_token_values(crit: RSCriterion, value, keep) -> dict:
  """Per-token rows of a divergence criterion averaged over ``m``: the share it rejects
  (``_masked_fraction``) and its mean value (``_mean``); its global ``_max`` is a maximum."""
  prefix = f"mis_rs_{crit.name}"
  return {f"{prefix}_masked_fraction": ~keep, f"{prefix}_mean": value}


def final_weight_metrics(
  *, mean_after_tis_rs, factor, w_min, w_max, sum_w, sum_w2, num_kept, num_trained, seg_kept_counts, num_live
) -> dict:
  """contract §8.2 rows of the weights that multiply the loss, over the kept mask ``m'``.

  ``mis_is_ratio_mean_after_tis_rs = R_{m'}(w)`` before normalisation; ``mis_batch_norm_factor
  = μ``; ``mis_is_ratio_{mean,min,max}_final``: ``R_{m'}``, global min and max of ``w / μ``
  (0 when nothing is kept); ``mis_ess_ratio = (Σ w m')² / (Σ m' · Σ w² m')`` (scale-free);
  ``mis_kept_token_fraction`` / ``mis_kept_seq_fraction``: kept share of trained tokens / of
  live segments; ``mis_masked_whole_batch``: 1 when the correction keeps no token at all (the
  loss is then 0 with zero, finite gradients), else 0.
  """
  any_kept = num_kept > 0
  ess_den = num_kept * sum_w2
  return {
    "mis_is_ratio_mean_after_tis_rs": mean_after_tis_rs,
    "mis_batch_norm_factor": factor,
    "mis_is_ratio_mean_final": mean_after_tis_rs / factor,
    "mis_is_ratio_min_final": jnp.where(any_kept, w_min, 0.0) / factor,
    "mis_is_ratio_max_final": jnp.where(any_kept, w_max, 0.0) / factor,
    "mis_ess_ratio": jnp.where(ess_den > 0, sum_w * sum_w / jnp.where(ess_den > 0, ess_den, 1.0), 0.0),
    "mis_kept_token_fraction": num_kept / jnp.maximum(num_trained, 1.0),
    "mis_kept_seq_fraction": jnp.sum((seg_kept_counts > 0).astype(jnp.float32)) / jnp.maximum(num_live, 1.0),
    "mis_masked_whole_batch": (~any_kept).astype(jnp.float32),
  }


# --- how each metric combines over the micro-batches of one step -----------------------------

# Metrics reduced over the same mask in every micro-batch combine as a mean weighted by each
# micro-batch's share of that mask: "mask" (trained tokens in token-mean, live sequences in the
# seq-mean modes), "kept" (the kept mask m'), "seqs" (live sequences). Loss terms are sums
# ("sum": their denominators are the step's). Extremes are "min" / "max" over the micro-batches
# that have trained tokens. ESS, a ratio of sums, is approximated by its kept-weighted mean.
REDUCTIONS = ("sum", "min", "max", "mask", "kept", "seqs")

# Every metric the library emits, with its reduction: each module declares its own metrics where
# it defines them (`declare`), so a metric without one is an error at import, and
# `microbatch_reduction` of an undeclared name is an error, never a silent default.
MICROBATCH_REDUCTIONS: dict[str, str] = {}


def declare(reductions: dict) -> dict:
  """Declares the micro-batch reductions of a module's metrics (``{name: reduction}``, a
  reduction of ``REDUCTIONS``); a name declared twice with two reductions is an error."""
  for name, how in reductions.items():
    if how not in REDUCTIONS:
      raise ValueError(f"metric {name!r}: unknown micro-batch reduction {how!r}; one of {REDUCTIONS}")
    if MICROBATCH_REDUCTIONS.setdefault(name, how) != how:
      raise ValueError(
        f"metric {name!r} declared with two micro-batch reductions: {MICROBATCH_REDUCTIONS[name]!r} and {how!r}"
      )
  return reductions


def undeclare(names) -> None:
  """Forgets the micro-batch reductions of ``names`` (the metrics of a policy-loss form that was
  unregistered)."""
  for name in names:
    MICROBATCH_REDUCTIONS.pop(name, None)


def criterion_names(metric: str, agg: str) -> dict:
  """The metrics of a divergence criterion (``criterion_token_values``, its global max and, for
  a divergence (k2, k3: a k1 band is on the log-ratio, never auto), its auto upper bound), with
  their reductions."""
  prefix = f"mis_rs_{metric}_{agg}"
  names = {f"{prefix}_masked_fraction": "mask", f"{prefix}_mean": "mask", f"{prefix}_max": "max"}
  if metric != "k1":
    names[f"mis_auto_rs_{metric}_{agg}_upper"] = "mask"
  return names


declare({name: "mask" for name in MISMATCH_NAMES})  # contract §8.1: means over m
declare(
  {  # contract §8.2, `final_weight_metrics`
    "mis_is_ratio_mean_after_tis_rs": "kept",
    "mis_batch_norm_factor": "mask",
    "mis_is_ratio_mean_final": "kept",
    "mis_is_ratio_min_final": "min",
    "mis_is_ratio_max_final": "max",
    "mis_ess_ratio": "kept",
    "mis_kept_token_fraction": "mask",
    "mis_kept_seq_fraction": "seqs",
    "mis_masked_whole_batch": "min",  # the step keeps nothing iff no micro-batch keeps anything
  }
)
declare({"mis_auto_target_met": "min"})  # contract §3.1: met over the step iff met in every micro-batch
# The metrics of the correction's bound and masks are declared by their stages (`mis_jax._stages`).


def criterion_microbatch_reductions(crit: RSCriterion) -> dict:
  """The reductions of a divergence criterion's metrics (``criterion_token_values`` and its max)."""
  return criterion_names(crit.metric, crit.agg)


def microbatch_reduction(name: str, loss_cfg=None) -> str:
  """How metric ``name`` combines over micro-batches: one of ``REDUCTIONS``, as declared where
  the metric is defined (``MICROBATCH_REDUCTIONS``). A correction function of your own
  (``loss_cfg.correction_fn``) declares its metrics' as its attribute ``microbatch_reductions``
  (``{name: reduction}``). An undeclared name is a ``KeyError``."""
  if name in MICROBATCH_REDUCTIONS:
    return MICROBATCH_REDUCTIONS[name]
  own = {}
  if loss_cfg is not None and loss_cfg.correction_fn is not None:
    own = getattr(resolve_correction_fn(loss_cfg.correction_fn), "microbatch_reductions", {})
  if name in own:
    if own[name] not in REDUCTIONS:
      raise ValueError(f"metric {name!r}: unknown micro-batch reduction {own[name]!r}; one of {REDUCTIONS}")
    return own[name]
  raise KeyError(
    f"metric {name!r} declares no micro-batch reduction (one of {REDUCTIONS}): the library declares "
    "its metrics' in mis_jax.engine.MICROBATCH_REDUCTIONS; a correction function of your own declares its "
    "metrics' as its attribute microbatch_reductions"
  )
