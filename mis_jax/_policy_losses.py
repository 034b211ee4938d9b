"""Policy-loss forms (contract §6.2): verl's registered policy losses, one small function each.

A form maps the current log-probs ``lp`` (with the gradient), the algorithm's anchor ``a``
(contract §6: ``o`` in standard and decoupled PPO, ``q`` in bypass PPO) and the advantages
``A`` to a per-token loss. The correction's weights ``w`` (decoupled PPO; 1 elsewhere) multiply
it, so every form composes with every correction. Sequence-level forms (``gspo``,
``geo_mean``) reduce over the kept mask ``m'`` of each segment, globally over devices.

``clip_cov`` and ``kl_cov`` pick tokens by the covariance of ``A`` and the log-probs over the
whole step (:func:`cov_selection`), once per step from the anchor (the current log-probs at the
step's first update), so micro-batches and devices pick the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _metrics as metrics_lib
from mis_jax._config import LossConfig
from mis_jax._engine import psum
from mis_jax._search import largest_with
from mis_jax._segments import LOG_BOUND, Segments, safe_exp

# DPPO's truncation of its (stop-gradient) ratio when `eps_clip_c` is unset, as verl's default.
DPPO_RATIO_C = 20.0
# GSPO's upper clamp of its log sequence ratio, as verl's.
GSPO_LOG_RATIO_MAX = 10.0


class FormInputs(NamedTuple):
  """What a form reads. Flat ``[T]`` float32 arrays, zero outside the trained mask.

  ``kept``: the kept mask ``m'`` (bool); ``weights``: the correction's weights, or None where
  the algorithm has none; ``selected``: clip_cov/kl_cov's step selection (bool) or None.
  """
  lp: jax.Array
  lp_sg: jax.Array
  anchor: jax.Array
  adv: jax.Array
  kept: jax.Array
  segs: Segments
  weights: jax.Array | None
  selected: jax.Array | None
  cfg: LossConfig


class FormLoss(NamedTuple):
  """A form's per-token loss (weights applied), its clip indicator (``pg_clipfrac``) and extra
  metric rows averaged over the kept mask."""
  pg: jax.Array
  clipfrac: jax.Array
  over_kept: dict


def ppo_token_loss(logprobs, anchor_logprobs, advantages, *, eps_clip: float, eps_clip_high: float,
                   eps_clip_c: float | None = None):
  """Clipped PPO per-token loss and clip indicator (contract §6).

  ``ratio = exp(clip(lp - anchor, ±20))``;
  ``ℓ = max(-ratio·A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high)·A)``; with dual clip
  ``c``, where ``A < 0``: ``ℓ = min(ℓ, -c·A)``.

  Returns:
    ``(loss, clipped)``: per-token loss and a float indicator of the clipped branch winning.
  """
  ratio = safe_exp(logprobs - anchor_logprobs)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
  loss = jnp.maximum(unclipped, clipped)
  clipfrac = (clipped > unclipped).astype(jnp.float32)
  if eps_clip_c is not None:
    loss = jnp.where(advantages < 0, jnp.minimum(loss, -eps_clip_c * advantages), loss)
  return loss, clipfrac


def _weighted(pg, x: FormInputs):
  return pg if x.weights is None else x.weights * pg


def _clip_range(cfg: LossConfig):
  return 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high


def _vanilla(x: FormInputs) -> FormLoss:
  """PPO's clipped surrogate, with the optional dual clip (contract §6)."""
  cfg = x.cfg
  pg, clipfrac = ppo_token_loss(x.lp, x.anchor, x.adv, eps_clip=cfg.eps_clip, eps_clip_high=cfg.clip_high,
                                eps_clip_c=cfg.eps_clip_c)
  return FormLoss(_weighted(pg, x), clipfrac, {})


def _dppo(valid_fn):
  """DPPO (arXiv 2602.04879): ``-A · sg(min(ratio, c)) · lp`` on the tokens inside the trust
  region on probabilities that ``valid_fn(lp, a, A)`` states; 0 outside it."""
  def form(x: FormInputs) -> FormLoss:
    cfg = x.cfg
    c = DPPO_RATIO_C if cfg.eps_clip_c is None else cfg.eps_clip_c
    ratio = safe_exp(x.lp_sg - x.anchor)
    truncated = jnp.minimum(ratio, c)
    valid = valid_fn(x.lp_sg, x.anchor, x.adv, cfg)
    pg = jnp.where(valid, -x.adv * truncated * x.lp, 0.0)
    return FormLoss(_weighted(pg, x), (~valid).astype(jnp.float32),
                    {"pg_clipfrac_lower": (valid & (ratio > c)).astype(jnp.float32)})
  return form


def _tv_region(lp, anchor, adv, cfg):
  """``p - p_a <= eps_high`` where ``A > 0``, ``p - p_a >= -eps`` elsewhere."""
  p, p_anchor = safe_exp(lp), safe_exp(anchor)
  return jnp.where(adv > 0, p - p_anchor <= cfg.clip_high, p - p_anchor >= -cfg.eps_clip)


def _binary_kl_region(lp, anchor, adv, cfg):
  """The binary KL ``p_a log(p_a/p) + (1-p_a) log((1-p_a + 1e-8)/(1-p + 1e-8))`` within
  ``eps_high`` where ``A > 0`` (``eps`` elsewhere), or the move goes the other way."""
  eps = 1e-8
  p, p_anchor = safe_exp(lp), safe_exp(anchor)
  kl = (p_anchor * (anchor - lp) +
        (1.0 - p_anchor) * jnp.log((1.0 - p_anchor + eps) / (1.0 - p + eps)))
  return jnp.where(adv > 0, (kl <= cfg.clip_high) | (p <= p_anchor), (kl <= cfg.eps_clip) | (p >= p_anchor))


def _segment_mean(values, x: FormInputs):
  """Per token, the mean of ``values`` over its segment's kept tokens (global over devices)."""
  sums = x.segs.sum([jnp.where(x.kept, values, 0.0), x.kept.astype(jnp.float32)])
  return x.segs.broadcast(sums[:, 0] / jnp.maximum(sums[:, 1], 1.0)), sums[:, 1]


def _gspo(x: FormInputs) -> FormLoss:
  """GSPO (arXiv 2507.18071): the token ratio ``s_t = exp(sg(mean_s(lp - a)) + lp - sg(lp))``,
  its log clamped to ``[-20, 10]``, in PPO's clipped surrogate."""
  mean_log_ratio, _ = _segment_mean(x.lp_sg - x.anchor, x)
  log_ratio = jnp.clip(mean_log_ratio + x.lp - x.lp_sg, -LOG_BOUND, GSPO_LOG_RATIO_MAX)
  ratio = jnp.exp(log_ratio)
  lo, hi = _clip_range(x.cfg)
  unclipped, clipped = -x.adv * ratio, -x.adv * jnp.clip(ratio, lo, hi)
  pg = jnp.maximum(unclipped, clipped)
  return FormLoss(_weighted(pg, x), (clipped > unclipped).astype(jnp.float32), {})


def _sapo(x: FormInputs) -> FormLoss:
  """SAPO (arXiv 2511.20347): ``-A · (4/τ) σ(τ (ratio - 1))``, ``τ = tau_pos`` where ``A > 0``
  else ``tau_neg``: a smooth gate instead of a hard clip."""
  cfg = x.cfg
  tau = jnp.where(x.adv > 0, cfg.tau_pos, cfg.tau_neg)
  gate = jax.nn.sigmoid(tau * (safe_exp(x.lp - x.anchor) - 1.0)) * (4.0 / tau)
  return FormLoss(_weighted(-gate * x.adv, x), jnp.zeros_like(x.lp), {})


def _gpg(x: FormInputs) -> FormLoss:
  """GPG: plain policy gradient ``-A · lp`` (no ratio, no clip); weighted as REINFORCE + IS's
  ``-w·A·lp`` (the same product order, so the two are equal there to the bit)."""
  pg = -x.adv * x.lp if x.weights is None else -x.weights * x.adv * x.lp
  return FormLoss(pg, jnp.zeros_like(x.lp), {})


def _clip_cov(x: FormInputs) -> FormLoss:
  """Clip-Cov (arXiv 2505.22617): PPO's surrogate, cut to 0 on the step's selected tokens."""
  pg, _ = ppo_token_loss(x.lp, x.anchor, x.adv, eps_clip=x.cfg.eps_clip, eps_clip_high=x.cfg.clip_high)
  pg = jnp.where(x.selected, 0.0, pg)
  selected = x.selected.astype(jnp.float32)
  return FormLoss(_weighted(pg, x), selected, {"cov_selected_fraction": selected})


def _kl_cov(x: FormInputs) -> FormLoss:
  """KL-Cov (arXiv 2505.22617): ``-A · ratio`` (no clip), plus ``ppo_kl_coef · |lp - a|`` on the
  step's selected tokens."""
  diff = x.lp - x.anchor
  pg = -x.adv * safe_exp(diff) + jnp.where(x.selected, x.cfg.ppo_kl_coef * jnp.abs(diff), 0.0)
  return FormLoss(_weighted(pg, x), jnp.zeros_like(x.lp),
                  {"cov_selected_fraction": x.selected.astype(jnp.float32), "ppo_kl_abs": jnp.abs(x.lp_sg - x.anchor)})


def _geo_mean(x: FormInputs) -> FormLoss:
  """GMPO (arXiv 2507.20673): per segment ``-Ā_s · exp(mean_s(sgn(A) · min(sgn(A)·d, sgn(A)·clip(d, -eps,
  eps_high))))`` with ``d = lp - a``, times the segment's geometric-mean weight (as verl); each
  token carries its segment's loss, so ``seq-mean-token-mean`` gives GMPO's mean over sequences."""
  cfg = x.cfg
  d = x.lp - x.anchor
  sign = jnp.sign(x.adv)
  d_clip = jnp.clip(d, -cfg.eps_clip, cfg.clip_high)
  d_min = sign * jnp.minimum(sign * d, sign * d_clip)
  mean_d, _ = _segment_mean(d_min, x)
  mean_adv, _ = _segment_mean(x.adv, x)
  pg = -mean_adv * safe_exp(mean_d)
  if x.weights is not None:
    log_w, _ = _segment_mean(jnp.log(x.weights + 1e-10), x)
    pg = safe_exp(log_w) * pg
  clipped = (d != d_clip)
  return FormLoss(pg, (clipped & (x.adv > 0)).astype(jnp.float32),
                  {"pg_clipfrac_lower": (clipped & (x.adv < 0)).astype(jnp.float32)})


def _dro(x: FormInputs) -> FormLoss:
  """DRO: ``-(A · lp - β/2 · (lp - a)²)``."""
  pg = -(x.adv * x.lp - 0.5 * x.cfg.dro_beta * jnp.square(x.lp - x.anchor))
  return FormLoss(_weighted(pg, x), jnp.zeros_like(x.lp), {})


def _cispo(x: FormInputs) -> FormLoss:
  """CISPO (arXiv 2506.13585): ``-sg(clip(ratio, 1 - eps, 1 + eps_high)) · A · lp``."""
  lo, hi = _clip_range(x.cfg)
  ratio = safe_exp(x.lp_sg - x.anchor)
  clipped = jnp.clip(ratio, lo, hi)
  return FormLoss(_weighted(-clipped * x.adv * x.lp, x), (ratio != clipped).astype(jnp.float32), {})


# The forms' own metrics (contract §6.2, `FormLoss.over_kept`): means over the kept mask.
metrics_lib.declare({"pg_clipfrac_lower": "kept", "cov_selected_fraction": "kept", "ppo_kl_abs": "kept"})

# `LossConfig.policy_loss` → its per-token form (verl's names).
FORMS = {"vanilla": _vanilla, "dppo_tv": _dppo(_tv_region), "dppo_kl": _dppo(_binary_kl_region), "gspo": _gspo,
         "sapo": _sapo, "gpg": _gpg, "clip_cov": _clip_cov, "kl_cov": _kl_cov, "geo_mean": _geo_mean, "dro": _dro,
         "cispo": _cispo}


# --- clip_cov / kl_cov: the step's covariance selection ----------------------------------------

def _ordered_bits(x):
  """float32 → uint32 keys in the same order (``a < b`` iff ``key(a) < key(b)``)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _top_k(keys, eligible, k, axis_name):
  """The eligible tokens with the ``k`` largest uint32 ``keys`` over every device (all of them
  if fewer are eligible; ties at the threshold all go in). Exact: the threshold is built bit by
  bit from the top, each bit one global count."""
  def enough(candidate):
    return psum(jnp.sum((eligible & (keys >= candidate)).astype(jnp.int32)), axis_name) >= k
  threshold = largest_with(enough, bits=32, dtype=jnp.uint32)
  return eligible & (keys >= threshold) & (k > 0)


def _global_positions(n_local: int, axis_name):
  """Each local token's index in the global batch (devices hold consecutive slices)."""
  offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * n_local
  return offset + jnp.arange(n_local, dtype=jnp.int32)


def cov_selection(anchor, adv, kept, segs: Segments, cfg: LossConfig, key):
  """clip_cov / kl_cov's tokens of one step, from ``cov_t = (A_t - Ā)(a_t - ā)`` (means over
  the kept tokens of the step, every device).

  - ``clip_cov``: among kept tokens with ``clip_cov_lb < cov < clip_cov_ub``, ``max(⌊ratio·n⌋, 1)``
    chosen uniformly at random (``n`` kept tokens; ``key`` draws a priority per global token
    position, so the choice does not depend on the devices);
  - ``kl_cov``: the ``max(⌊ratio·n⌋, 1)`` kept tokens of largest ``cov``.

  Returns a flat bool ``[T]``.
  """
  cfg_ratio = cfg.clip_cov_ratio if cfg.policy_loss == "clip_cov" else cfg.kl_cov_ratio
  kept_f = kept.astype(jnp.float32)
  totals = segs.total([kept_f, jnp.where(kept, adv, 0.0), jnp.where(kept, anchor, 0.0)])
  n = totals[0]
  mean_adv, mean_anchor = totals[1] / jnp.maximum(n, 1.0), totals[2] / jnp.maximum(n, 1.0)
  cov = (adv - mean_adv) * (anchor - mean_anchor)
  k = jnp.where(n > 0, jnp.maximum(jnp.floor(cfg_ratio * n), 1.0), 0.0).astype(jnp.int32)
  if cfg.policy_loss == "kl_cov":
    return _top_k(_ordered_bits(cov), kept, k, segs.axis_name)
  eligible = kept & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
  positions = _global_positions(kept.shape[0], segs.axis_name)
  priority = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32))(positions)
  return _top_k(priority, eligible, k, segs.axis_name)
