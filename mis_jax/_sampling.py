"""Sampling-mask replay metrics: how much of the truncation shows up as (false) mismatch.

An engine that samples with top-k / top-p / min-p draws from ``π_S(v) = π(v) / M`` on the kept
set ``S`` (``M = Σ_{v∈S} π(v)``, the kept mass), so its behaviour log-prob is ``log π(y) -
log M``. A trainer that scores the token over the whole vocabulary sees the ratio
``π(y) / π_S(y) = M ≤ 1`` even with identical weights; renormalising over the replayed support
(:func:`mis_jax.token_logprobs` with ``support_ids``) removes it. These metrics show both.
"""

from __future__ import annotations

import jax.numpy as jnp

from mis_jax import _correction as correction
from mis_jax import _metrics as metrics_lib
from mis_jax import _validation
from mis_jax._segments import Segments, masked_means, safe_exp

RATIO_BAND = 0.1  # "outside" = |ratio - 1| > 0.1, the band the reference measurements use

# The sampling-replay metrics: means over the loss mask, the kept mass's minimum a minimum.
metrics_lib.declare(
  {
    "sampling_kept_mass_mean": "mask",
    "sampling_ratio_mean_replay": "mask",
    "sampling_ratio_outside_replay": "mask",
    "sampling_ratio_mean_full": "mask",
    "sampling_ratio_outside_full": "mask",
    "sampling_k3_kl_full": "mask",
    "sampling_kept_mass_min": "min",
  }
)


def sampling_metrics(
  logprobs,
  kept_logmass,
  rollout_logprobs,
  loss_mask,
  segment_ids,
  *,
  num_segments: int,
  metric_reduction: str = "token-mean",
  axis_name=None,
) -> dict:
  """Kept mass and token ratios with and without renormalisation over the sampling support.

  With ``lp_S`` the trainer's log-probs over the support, ``log M`` the kept log-mass (both from
  :func:`mis_jax.token_logprobs` with ``support_ids`` and ``return_kept_mass``), ``lp = lp_S +
  log M`` the full-vocabulary log-prob and ``q`` the engine's behaviour log-probs (SGLang's
  ``output_token_sampling_logprobs``), each reduced by ``R_m`` of contract §8 over the loss mask:

  - ``sampling_kept_mass_mean`` = ``R_m(M)``, ``sampling_kept_mass_min`` = ``min_m M``;
  - ``sampling_ratio_mean_replay`` = ``R_m(exp(lp_S - q))``, ``sampling_ratio_outside_replay`` =
    ``R_m(|exp(lp_S - q) - 1| > 0.1)``: the ratio with replay (1 up to real mismatch);
  - ``sampling_ratio_mean_full``, ``sampling_ratio_outside_full``: the same with ``lp`` (the
    ratio a trainer without replay would use against the behaviour log-probs: biased by ``M``);
  - ``sampling_k3_kl_full`` = ``R_m(exp(r) - r - 1)`` with ``r = lp - q`` (``clip`` ±B): what
    ``mis_k3_kl`` would report without replay; with equal weights ``r = log M``, the kept-mass
    bias ``M - log M - 1``.

  Every ``exp`` is ``exp(clip(·, ±B))``. Arrays share one shape; ``segment_ids`` is ``-1`` at
  padding. Returns float32 scalars.
  """
  arrays = _validation.check_token_arrays(
    {
      "segment_ids": segment_ids,
      "logprobs": logprobs,
      "kept_logmass": kept_logmass,
      "rollout_logprobs": rollout_logprobs,
      "loss_mask": loss_mask,
    },
    float_keys=("logprobs", "kept_logmass", "rollout_logprobs"),
  )
  _validation.check_segments(segment_ids, num_segments)
  metric_reduction = _validation.metric_reduction(metric_reduction)
  segs = Segments(segment_ids, num_segments, axis_name)
  mask = _validation.flat_mask(arrays["loss_mask"], segs.valid)
  lp_s, log_m, q = (_validation.flat_float(arrays[k]) for k in ("logprobs", "kept_logmass", "rollout_logprobs"))
  stats = segs.mask_stats(mask)
  replay, full, mass = safe_exp(lp_s - q), safe_exp(lp_s + log_m - q), safe_exp(log_m)
  outside = lambda ratio: (jnp.abs(ratio - 1.0) > RATIO_BAND).astype(jnp.float32)
  values = {
    "sampling_kept_mass_mean": mass,
    "sampling_ratio_mean_replay": replay,
    "sampling_ratio_outside_replay": outside(replay),
    "sampling_ratio_mean_full": full,
    "sampling_ratio_outside_full": outside(full),
    "sampling_k3_kl_full": correction.divergence("k3", lp_s + log_m - q),
  }
  out = masked_means([(mask, stats, values)], segs, metric_reduction)
  out["sampling_kept_mass_min"] = segs.masked_min(mass, mask, stats)
  return out
