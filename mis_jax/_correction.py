"""What the ``mis`` correction computes: the formulas of contract §2–5 as small pure functions.

Each works elementwise on tokens (``[C]`` or ``[T]`` arrays) or on segments (``[S]``); none
knows about chunks, scatters or devices (that is :mod:`mis_jax._engine`).
Notation (docs/contract.md): ``m`` trained mask, ``r = o - q`` the token log-ratio, ``B = 20``, ``n_s = Σ_{t∈s} m_t``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mis_jax._segments import LOG_BOUND, safe_exp

BATCH_NORM_EPS = 1e-8


def log_ratio(train_logprobs, rollout_logprobs, mask):
  """``r_t = o_t - q_t`` on trained tokens, 0 elsewhere (selected, so NaN never leaks)."""
  return jnp.where(mask, train_logprobs - rollout_logprobs, 0.0)


# --- contract §2: levels ---------------------------------------------------------------------

# The per-segment levels: ``L_s`` from the segment's ``Σ_{u∈s} m_u r_u`` and ``n_s``.
SEGMENT_LEVELS = {
  "sequence": lambda sum_r, count: sum_r,  # L_s = Σ m r
  "geometric": lambda sum_r, count: sum_r / jnp.maximum(count, 1.0),  # L_s = Σ m r / max(n_s, 1)
}
LEVELS = ("token",) + tuple(SEGMENT_LEVELS)  # token: L_t = r_t


def segment_log_values(level: str, sum_r, count):
  """Per-segment level log-value (contract §2), for the levels of ``SEGMENT_LEVELS``."""
  if level not in SEGMENT_LEVELS:
    raise ValueError(f"level {level!r} has no per-segment log-value")
  return SEGMENT_LEVELS[level](sum_r, count)


def level_log_values(level: str, r, sum_r, count, to_tokens):
  """Level log-values ``L_t`` at every token (contract §2).

  ``token``: ``L_t = r_t``; ``sequence``: ``L_t = Σ_{u∈s} m_u r_u``; ``geometric``:
  ``L_t = Σ_{u∈s} m_u r_u / max(Σ_{u∈s} m_u, 1)``, the same value for every token of the
  segment. ``sum_r`` and ``count`` are per segment; ``to_tokens`` broadcasts ``[S]`` values
  to the tokens of ``r``.
  """
  if level == "token":
    return r
  return to_tokens(segment_log_values(level, sum_r, count))


def raw_weights(log_values):
  """``w_raw = exp(clip(L, -B, B))`` (contract §2; the clip comes after aggregation)."""
  return safe_exp(log_values)


# --- contract §3: importance-sampling weights ------------------------------------------------

# IS weights per ``tis_mode`` (contract §3): ``(w_raw, Lo, U) -> (w, keep_is)``, ``keep_is`` None
# unless the mode rejects tokens.
TIS_MODES = {
  "truncate": lambda w_raw, lower, upper: (jnp.minimum(w_raw, upper), None),  # w = min(w_raw, U)
  "clip": lambda w_raw, lower, upper: (jnp.clip(w_raw, lower, upper), None),  # w = clip(w_raw, Lo, U)
  "mask": lambda w_raw, lower, upper: (w_raw, in_band(w_raw, lower, upper)),  # keep Lo <= w_raw <= U
  "none": lambda w_raw, lower, upper: (jnp.ones_like(w_raw), None),  # pure rejection: w = 1
}


class Bounds(NamedTuple):
  """The resolved bounds of one step: floats, or traced scalars where the threshold controller
  set them (contract §3.1); ``m2_max`` is M2PO's cutoff on ``r²`` (contract §4.2), None when off."""

  tis_lower: Any
  tis_upper: Any
  rs_lower: Any
  rs_upper: Any
  m2_max: Any = None
  criteria_upper: tuple = ()  # per criterion of rs_criteria: its upper bound (an auto one resolved)


def bounded_weights(w_raw, tis_mode: str, bounds: Bounds):
  """IS weights per ``tis_mode`` (contract §3, ``TIS_MODES``) and the tokens IS keeps.

  Returns:
    ``(w, keep_is)``: ``keep_is`` is None unless ``tis_mode`` is ``mask``.
  """
  return TIS_MODES[tis_mode](w_raw, bounds.tis_lower, bounds.tis_upper)


def in_band(value, lower: float | None, upper: float | None):
  """``lower <= value <= upper`` (a closed band; a bound of None is absent)."""
  keep = jnp.ones(jnp.shape(value), bool)
  if lower is not None:
    keep = keep & (value >= lower)
  if upper is not None:
    keep = keep & (value <= upper)
  return keep


# --- contract §4: rejection sampling and veto ------------------------------------------------


def rs_keep(w_rs_raw, bounds: Bounds):
  """RS keep decision (contract §4): ``lo_rs <= w_rs_raw <= hi_rs`` on the raw weight at ``rs_level``."""
  return in_band(w_rs_raw, bounds.rs_lower, bounds.rs_upper)


def catastrophic_tokens(r, mask, veto_threshold: float):
  """Veto (contract §4): a token is catastrophic iff ``m_t = 1`` and ``r_t < log C`` (raw ``r``)."""
  return mask & (r < math.log(veto_threshold))


def vetoed_segments(catastrophic_counts):
  """Veto (contract §4): a segment with any catastrophic token is rejected whole."""
  return catastrophic_counts > 0


# --- contract §4.2: off-policy masks of recent papers ---------------------------------------


def opsm_segments(sum_r, count, sum_adv, delta: float):
  """OPSM (contract §4.2, DeepSeek-V3.2's off-policy sequence masking): a live segment is masked
  iff its advantage is negative (``Σ m A < 0``) and its mean ``log(π_rollout/π_train)``,
  ``-Σ m r / n_s``, exceeds ``δ``."""
  divergence = -sum_r / jnp.maximum(count, 1.0)
  return (count > 0) & (sum_adv < 0) & (divergence > delta)


# --- contract §4.3: trust regions on probabilities ------------------------------------------

# KPop's clamp of both probabilities before the binary KL (prime-rl PR #3283, as in the issue's
# definition), so that neither complement term is log(0).
KPOP_PROB_EPS = 1e-6


def dppo_tv_masked(p, p_q, adv, delta_high: float, delta_low: float, symmetric: bool):
  """DPPO-Binary-TV (contract §4.3; prime-rl's ``default_loss_fn``): with ``d = p - p_q`` on the
  sampled token's probabilities, the token is masked iff ``d > δ_high`` where ``A > 0`` and
  ``d < -δ_low`` elsewhere (``A = 0`` takes the low side, as prime-rl's ``torch.where``);
  symmetric (prime-rl's ``ipo_loss_fn``): iff ``|d| > δ``, whatever ``A``."""
  d = p - p_q
  if symmetric:
    return jnp.abs(d) > delta_high
  return jnp.where(adv > 0, d > delta_high, d < -delta_low)


def binary_kl(log_p, log_q, eps: float = KPOP_PROB_EPS):
  """``D_B(p‖p_q) = p log(p/p_q) + (1-p) log((1-p)/(1-p_q))``, the KL of Bernoulli(p) from
  Bernoulli(p_q) (this token against the rest of the vocabulary), from the log-probs, both
  probabilities clamped to ``[eps, 1-eps]``. The complements are ``-expm1(log p)``, so a
  confident token (``p`` near 1) keeps its precision in float32."""
  lo, hi = math.log(eps), math.log1p(-eps)

  def parts(log_x):
    comp = jnp.clip(-jnp.expm1(jnp.minimum(log_x, 0.0)), eps, 1.0 - eps)  # 1 - clip(p)
    return jnp.clip(log_x, lo, hi), comp, jnp.log(comp)

  lp, cp, lcp = parts(log_p)
  lq, _, lcq = parts(log_q)
  return jnp.exp(lp) * (lp - lq) + cp * (lcp - lcq)


def kpop_divergence(log_p, log_q):
  """KPop's statistic (contract §4.3): ``max(D_B(p‖p_q), D_B(p_q‖p))``; a token is kept iff it is ``<= φ``."""
  return jnp.maximum(binary_kl(log_p, log_q), binary_kl(log_q, log_p))


# --- contract §4.1: divergence criteria ------------------------------------------------------


def k3(r):
  """``exp(r) - 1 - r`` of an already clipped ``r``, as ``max(expm1(r) - r, 0)``: accurate for small ``r``
  and never negative (``exp(r) - 1 - r`` in float32 goes below 0 for ``|r|`` under ~1e-4)."""
  return jnp.maximum(jnp.expm1(r) - r, 0.0)


def _k3(r):
  return k3(jnp.clip(r, -LOG_BOUND, LOG_BOUND))


# Per-token divergences (contract §4.1) of the raw, unclipped ``r`` (only k3 exponentiates, so
# only k3 clips).
DIVERGENCES = {
  "k1": lambda r: -r,
  "k2": lambda r: 0.5 * r * r,
  "k3": _k3,  # exp(clip(r, ±B)) - 1 - clip(r, ±B)
}
# How a criterion aggregates its divergence: per token, or per sequence over trained tokens
# (pass 1's per-segment reduction of it: a sum or a max).
AGGREGATIONS = {"token": None, "seq_sum": "sum", "seq_mean": "sum", "seq_max": "max"}


def divergence(metric: str, r):
  """Per-token divergence (contract §4.1): ``DIVERGENCES[metric](r)``."""
  return DIVERGENCES[metric](r)


def segment_divergence(agg: str, seg_total, count):
  """The per-sequence aggregate ``agg`` of a criterion's divergence over trained tokens: ``seq_sum``
  and ``seq_max`` as given (``seg_total`` is the segment's sum or max), ``seq_mean`` =
  ``seq_sum / max(n_s, 1)``."""
  return seg_total / jnp.maximum(count, 1.0) if agg == "seq_mean" else seg_total


def criterion_value(metric: str, aggregated):
  """The value a criterion's band bounds (contract §4.1): the aggregated divergence for k2/k3,
  and for k1 the aggregated log-ratio ``-agg(k1)`` (bounds are on ``log(π_train/π_rollout)``)."""
  return -aggregated if metric == "k1" else aggregated


# --- contract §6: KL penalty to a reference policy -----------------------------------------


def _low_var_kl(d):
  dc = jnp.clip(d, -LOG_BOUND, LOG_BOUND)
  return jnp.clip(jnp.exp(-dc) + dc - 1.0, -10.0, 10.0)


# Per-token KL estimators of ``d = lp - ref`` (contract §6); `LossConfig.kl_type` takes these names.
KL_ESTIMATORS = {
  "k1": lambda d: d,
  "k2": lambda d: 0.5 * d * d,
  "k3": lambda d: safe_exp(-d) + d - 1.0,
  "low_var_kl": _low_var_kl,  # k3 with the log-ratio clipped to ±B and the value to ±10
}


# --- contract §5: batch normalisation --------------------------------------------------------


def batch_norm_mean_token(sum_kept_weights, num_kept):
  """Token level (contract §5): ``μ = Σ_t w_t m'_t / Σ_t m'_t``."""
  return sum_kept_weights / jnp.maximum(num_kept, 1.0)


def batch_norm_mean_sequence(seg_kept_weights, seg_kept_counts):
  """Sequence/geometric levels (contract §5): ``μ`` = mean over segments with a kept token of the
  segment's common weight ``Σ_{t∈s} w_t m'_t / Σ_{t∈s} m'_t``."""
  has = seg_kept_counts > 0
  common = seg_kept_weights / jnp.maximum(seg_kept_counts, 1.0)
  return jnp.sum(jnp.where(has, common, 0.0)) / jnp.maximum(jnp.sum(has.astype(jnp.float32)), 1.0)


def batch_norm_factor(mu):
  """The factor weights are divided by (contract §5): ``μ`` if ``μ > 1e-8``, else 1."""
  mu = jnp.asarray(mu, jnp.float32)
  return jnp.where(mu > BATCH_NORM_EPS, mu, 1.0)


def stop_gradient_weights(w, mask):
  """``w ← sg(w) · m`` (contract §3): weights never carry gradient and are 0 off the mask."""
  return jnp.where(mask, jax.lax.stop_gradient(w), 0.0)
