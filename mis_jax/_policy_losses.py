"""Policy-loss forms (contract §6.2): verl's registered policy losses, each one small function with a
frozen config of its own keys, registered by name (:func:`register_policy_loss`).

A form maps the current log-probs ``lp`` (with the gradient), the algorithm's anchor ``a``
(contract §6: ``o`` in standard and decoupled PPO, ``q`` in bypass PPO) and the advantages
``A`` to a per-token loss. The correction's weights ``w`` (decoupled PPO; 1 elsewhere) multiply
it, so every form composes with every correction. Sequence-level forms (``gspo``,
``geo_mean``) reduce over the kept mask ``m'`` of each segment, globally over devices.

``clip_cov`` and ``kl_cov`` pick tokens by the covariance of ``A`` and the log-probs over the
whole step (their ``select`` functions), once per step from the anchor (the current log-probs at the
step's first update), so micro-batches and devices pick the same tokens.

A new form is one function ``fn(x: FormInputs, cfg) -> FormLoss``, its config (a frozen dataclass
subclassing :class:`mis_jax.forms.PolicyLossConfig`, omitted when it has no keys) and
``@register_policy_loss(name, config)``: ``LossConfig(policy_loss={"name": name, <its keys>})`` and the
trainer's ``loss.policy_loss: {name: ..., ...}`` then take it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _metrics as metrics_lib
from mis_jax._config import POLICY_LOSSES, LossConfig, PolicyLossConfig
from mis_jax._engine import psum
from mis_jax._keys import ConfigError, key
from mis_jax._search import largest_with
from mis_jax._segments import LOG_BOUND, Segments, safe_exp

# DPPO's truncation of its (stop-gradient) ratio when `eps_clip_c` is unset, as verl's default.
DPPO_RATIO_C = 20.0
# GSPO's upper clamp of its log sequence ratio, as verl's.
GSPO_LOG_RATIO_MAX = 10.0


class FormInputs(NamedTuple):
  """What a form reads. Flat ``[T]`` float32 arrays, zero outside the trained mask.

  ``kept``: the kept mask ``m'`` (bool); ``segs``: the batch's :class:`mis_jax.engine.Segments`
  (per-segment sums, global over devices); ``weights``: the correction's weights, or None where the
  algorithm has none (multiply them in with :meth:`weighted`); ``selected``: the step's selection of
  a form with a ``select`` function (bool) or None; ``loss_cfg``: the :class:`mis_jax.LossConfig`, for
  the keys every form shares (``eps_clip``, ``clip_high``).
  """

  lp: jax.Array
  lp_sg: jax.Array
  anchor: jax.Array
  adv: jax.Array
  kept: jax.Array
  segs: Segments
  weights: jax.Array | None
  selected: jax.Array | None
  loss_cfg: LossConfig

  def weighted(self, pg):
    """The per-token loss times the correction's weights, where the algorithm has them."""
    return pg if self.weights is None else self.weights * pg

  def clip_range(self):
    """``(1 - eps_clip, 1 + eps_clip_high)``."""
    return 1.0 - self.loss_cfg.eps_clip, 1.0 + self.loss_cfg.clip_high


class FormLoss(NamedTuple):
  """A form's per-token loss (weights applied), its clip indicator (``pg_clipfrac``) and its own
  metric rows, averaged over the kept mask (their names registered with the form)."""

  pg: jax.Array
  clipfrac: jax.Array
  over_kept: dict


class PolicyLossForm(NamedTuple):
  """A registered form (``mis_jax.forms.POLICY_LOSSES[name]``).

  Attributes:
    name: the form's name, the value of ``policy_loss``.
    config: its :class:`PolicyLossConfig` subclass (its own keys).
    fn: ``fn(x: FormInputs, cfg) -> FormLoss``, ``cfg`` the form's config.
    ratio_free: the form forms no ratio to an anchor, so REINFORCE + IS (which has none) takes it:
      there the per-token loss is REINFORCE's ``-w·A·lp`` (contract §6).
    select: ``select(anchor, adv, kept, segs, cfg, key) -> bool [T]``, the tokens the form selects once
      per step in :func:`mis_jax.prepare_step` (``FormInputs.selected``), or None.
    select_needs_key: ``select`` draws at random from ``key``.
    metrics: the names of the form's own metric rows (``FormLoss.over_kept``).
  """

  name: str
  config: type | None
  fn: Callable
  ratio_free: bool = False
  select: Callable | None = None
  select_needs_key: bool = False
  metrics: tuple = ()


def register_policy_loss(
  name: str,
  config: type | None = None,
  *,
  ratio_free: bool = False,
  select: Callable | None = None,
  select_needs_key: bool = False,
  metrics=(),
):
  """Registers the decorated function as the policy-loss form ``name``, with ``config`` its keys.

  ``fn(x: FormInputs, cfg) -> FormLoss`` gets the batch's inputs and the form's config (an instance of
  ``config``: a frozen dataclass subclassing :class:`PolicyLossConfig`, its fields ``key(...)``s;
  None: the form has no keys of its own). ``metrics`` names the rows of ``FormLoss.over_kept``
  (means over the kept mask, so they combine over micro-batches weighted by it). A name registered
  already is an error.
  """
  metrics = tuple(metrics)

  def register(fn):
    POLICY_LOSSES.add(PolicyLossForm(name, config, fn, ratio_free, select, select_needs_key, metrics))
    metrics_lib.declare({m: "kept" for m in metrics})
    return fn

  return register


def _forget_metrics(form: PolicyLossForm) -> None:
  """An unregistered form's own metrics are no longer the library's (unless another form emits them)."""
  still = {m for other in POLICY_LOSSES.values() for m in other.metrics}
  metrics_lib.undeclare(m for m in form.metrics if m not in still)


POLICY_LOSSES.on_unregister(_forget_metrics)


def ppo_token_loss(
  logprobs, anchor_logprobs, advantages, *, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None
):
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


# --- the forms -------------------------------------------------------------------------------

# `eps_clip_c` is a key of vanilla (its dual clip) and of both DPPO forms (their ratio truncation).
_EPS_CLIP_C_DOC = "dual-clip constant of vanilla; DPPO's ratio truncation (null: off; DPPO: 20)"


@dataclasses.dataclass(frozen=True)
class VanillaConfig(PolicyLossConfig):
  """``vanilla``'s keys: PPO's optional dual clip."""

  eps_clip_c: float | None = key(None, _EPS_CLIP_C_DOC, gt=1)


@register_policy_loss("vanilla", VanillaConfig, ratio_free=True)
def vanilla(x: FormInputs, cfg: VanillaConfig) -> FormLoss:
  """PPO's clipped surrogate, with the optional dual clip (contract §6)."""
  loss_cfg = x.loss_cfg
  pg, clipfrac = ppo_token_loss(
    x.lp, x.anchor, x.adv, eps_clip=loss_cfg.eps_clip, eps_clip_high=loss_cfg.clip_high, eps_clip_c=cfg.eps_clip_c
  )
  return FormLoss(x.weighted(pg), clipfrac, {})


@dataclasses.dataclass(frozen=True)
class DppoTvConfig(PolicyLossConfig):
  """``dppo_tv``'s keys: the truncation of its ratio."""

  eps_clip_c: float | None = key(None, _EPS_CLIP_C_DOC, gt=1)


@dataclasses.dataclass(frozen=True)
class DppoKlConfig(DppoTvConfig):
  """``dppo_kl``'s keys: ``dppo_tv``'s."""


def _dppo(x: FormInputs, cfg: DppoTvConfig, valid_fn) -> FormLoss:
  """DPPO (arXiv 2602.04879): ``-A · sg(min(ratio, c)) · lp`` on the tokens inside the trust
  region on probabilities that ``valid_fn(lp, a, A, loss_cfg)`` states; 0 outside it."""
  c = DPPO_RATIO_C if cfg.eps_clip_c is None else cfg.eps_clip_c
  ratio = safe_exp(x.lp_sg - x.anchor)
  truncated = jnp.minimum(ratio, c)
  valid = valid_fn(x.lp_sg, x.anchor, x.adv, x.loss_cfg)
  pg = jnp.where(valid, -x.adv * truncated * x.lp, 0.0)
  return FormLoss(
    x.weighted(pg), (~valid).astype(jnp.float32), {"pg_clipfrac_lower": (valid & (ratio > c)).astype(jnp.float32)}
  )


def _tv_region(lp, anchor, adv, cfg: LossConfig):
  """``p - p_a <= eps_high`` where ``A > 0``, ``p - p_a >= -eps`` elsewhere."""
  p, p_anchor = safe_exp(lp), safe_exp(anchor)
  return jnp.where(adv > 0, p - p_anchor <= cfg.clip_high, p - p_anchor >= -cfg.eps_clip)


def _binary_kl_region(lp, anchor, adv, cfg: LossConfig):
  """The binary KL ``p_a log(p_a/p) + (1-p_a) log((1-p_a + 1e-8)/(1-p + 1e-8))`` within
  ``eps_high`` where ``A > 0`` (``eps`` elsewhere), or the move goes the other way."""
  eps = 1e-8
  p, p_anchor = safe_exp(lp), safe_exp(anchor)
  kl = p_anchor * (anchor - lp) + (1.0 - p_anchor) * jnp.log((1.0 - p_anchor + eps) / (1.0 - p + eps))
  return jnp.where(adv > 0, (kl <= cfg.clip_high) | (p <= p_anchor), (kl <= cfg.eps_clip) | (p >= p_anchor))


@register_policy_loss("dppo_tv", DppoTvConfig, metrics=("pg_clipfrac_lower",))
def dppo_tv(x: FormInputs, cfg: DppoTvConfig) -> FormLoss:
  """DPPO-Binary-TV: the trust region ``p - p_a <= eps_high`` (``A > 0``), ``>= -eps`` elsewhere."""
  return _dppo(x, cfg, _tv_region)


@register_policy_loss("dppo_kl", DppoKlConfig, metrics=("pg_clipfrac_lower",))
def dppo_kl(x: FormInputs, cfg: DppoKlConfig) -> FormLoss:
  """DPPO-Binary-KL: the trust region on the binary KL of the sampled token's probability."""
  return _dppo(x, cfg, _binary_kl_region)


def _segment_mean(values, x: FormInputs):
  """Per token, the mean of ``values`` over its segment's kept tokens (global over devices)."""
  sums = x.segs.sum([jnp.where(x.kept, values, 0.0), x.kept.astype(jnp.float32)])
  return x.segs.broadcast(sums[:, 0] / jnp.maximum(sums[:, 1], 1.0)), sums[:, 1]


@dataclasses.dataclass(frozen=True)
class GspoConfig(PolicyLossConfig):
  """``gspo`` has no keys of its own (its clip range is ``eps_clip`` / ``eps_clip_high``)."""


@register_policy_loss("gspo", GspoConfig)
def gspo(x: FormInputs, cfg: GspoConfig) -> FormLoss:
  """GSPO (arXiv 2507.18071): the token ratio ``s_t = exp(sg(mean_s(lp - a)) + lp - sg(lp))``,
  its log clamped to ``[-20, 10]``, in PPO's clipped surrogate."""
  mean_log_ratio, _ = _segment_mean(x.lp_sg - x.anchor, x)
  log_ratio = jnp.clip(mean_log_ratio + x.lp - x.lp_sg, -LOG_BOUND, GSPO_LOG_RATIO_MAX)
  ratio = jnp.exp(log_ratio)
  lo, hi = x.clip_range()
  unclipped, clipped = -x.adv * ratio, -x.adv * jnp.clip(ratio, lo, hi)
  pg = jnp.maximum(unclipped, clipped)
  return FormLoss(x.weighted(pg), (clipped > unclipped).astype(jnp.float32), {})


@dataclasses.dataclass(frozen=True)
class SapoConfig(PolicyLossConfig):
  """``sapo``'s keys: its gate's temperatures."""

  tau_pos: float = key(1.0, "sapo: gate temperature where A > 0", gt=0)
  tau_neg: float = key(1.05, "sapo: gate temperature where A <= 0", gt=0)


@register_policy_loss("sapo", SapoConfig)
def sapo(x: FormInputs, cfg: SapoConfig) -> FormLoss:
  """SAPO (arXiv 2511.20347): ``-A · (4/τ) σ(τ (ratio - 1))``, ``τ = tau_pos`` where ``A > 0``
  else ``tau_neg``: a smooth gate instead of a hard clip."""
  tau = jnp.where(x.adv > 0, cfg.tau_pos, cfg.tau_neg)
  gate = jax.nn.sigmoid(tau * (safe_exp(x.lp - x.anchor) - 1.0)) * (4.0 / tau)
  return FormLoss(x.weighted(-gate * x.adv), jnp.zeros_like(x.lp), {})


@dataclasses.dataclass(frozen=True)
class GpgConfig(PolicyLossConfig):
  """``gpg`` has no keys of its own."""


@register_policy_loss("gpg", GpgConfig, ratio_free=True)
def gpg(x: FormInputs, cfg: GpgConfig) -> FormLoss:
  """GPG: plain policy gradient ``-A · lp`` (no ratio, no clip); weighted as REINFORCE + IS's
  ``-w·A·lp`` (the same product order, so the two are equal there to the bit)."""
  pg = -x.adv * x.lp if x.weights is None else -x.weights * x.adv * x.lp
  return FormLoss(pg, jnp.zeros_like(x.lp), {})


# --- clip_cov / kl_cov: the step's covariance selection --------------------------------------


@dataclasses.dataclass(frozen=True)
class ClipCovConfig(PolicyLossConfig):
  """``clip_cov``'s keys: how many tokens it cuts, among which covariances."""

  clip_cov_ratio: float = key(0.0002, "clip_cov: share of the step's tokens whose loss is cut", gt=0, le=1)
  clip_cov_lb: float = key(1.0, "clip_cov: lower bound of a candidate's covariance")
  clip_cov_ub: float = key(5.0, "clip_cov: upper bound of a candidate's covariance")

  def __post_init__(self):
    super().__post_init__()
    if not self.clip_cov_lb < self.clip_cov_ub:
      raise ConfigError(
        f"key 'policy_loss.clip_cov_lb' ({self.clip_cov_lb}) must be below 'clip_cov_ub' ({self.clip_cov_ub})"
      )


@dataclasses.dataclass(frozen=True)
class KlCovConfig(PolicyLossConfig):
  """``kl_cov``'s keys: how many tokens get its penalty, and its weight."""

  kl_cov_ratio: float = key(0.0002, "kl_cov: share of the step's tokens given the KL penalty", gt=0, le=1)
  ppo_kl_coef: float = key(0.1, "kl_cov: coefficient of |lp - anchor| on the selected tokens", ge=0)


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


def _covariance(anchor, adv, kept, segs: Segments, ratio: float):
  """``cov_t = (A_t - Ā)(a_t - ā)`` (means over the kept tokens of the step, every device) and the
  count ``k = max(⌊ratio·n⌋, 1)`` of ``n`` kept tokens (0 when none is kept)."""
  kept_f = kept.astype(jnp.float32)
  totals = segs.total([kept_f, jnp.where(kept, adv, 0.0), jnp.where(kept, anchor, 0.0)])
  n = totals[0]
  mean_adv, mean_anchor = totals[1] / jnp.maximum(n, 1.0), totals[2] / jnp.maximum(n, 1.0)
  cov = (adv - mean_adv) * (anchor - mean_anchor)
  k = jnp.where(n > 0, jnp.maximum(jnp.floor(ratio * n), 1.0), 0.0).astype(jnp.int32)
  return cov, k


def clip_cov_selection(anchor, adv, kept, segs: Segments, cfg: ClipCovConfig, key):
  """clip_cov's tokens of one step: among kept tokens with ``clip_cov_lb < cov < clip_cov_ub``,
  ``k`` chosen uniformly at random (``key`` draws a priority per global token position, so the
  choice does not depend on the devices). Returns a flat bool ``[T]``."""
  cov, k = _covariance(anchor, adv, kept, segs, cfg.clip_cov_ratio)
  eligible = kept & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
  positions = _global_positions(kept.shape[0], segs.axis_name)
  priority = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32))(positions)
  return _top_k(priority, eligible, k, segs.axis_name)


def kl_cov_selection(anchor, adv, kept, segs: Segments, cfg: KlCovConfig, key):
  """kl_cov's tokens of one step: the ``k`` kept tokens of largest ``cov``. Returns a flat bool ``[T]``."""
  cov, k = _covariance(anchor, adv, kept, segs, cfg.kl_cov_ratio)
  return _top_k(_ordered_bits(cov), kept, k, segs.axis_name)


@register_policy_loss(
  "clip_cov", ClipCovConfig, select=clip_cov_selection, select_needs_key=True, metrics=("cov_selected_fraction",)
)
def clip_cov(x: FormInputs, cfg: ClipCovConfig) -> FormLoss:
  """Clip-Cov (arXiv 2505.22617): PPO's surrogate, cut to 0 on the step's selected tokens."""
  pg, _ = ppo_token_loss(x.lp, x.anchor, x.adv, eps_clip=x.loss_cfg.eps_clip, eps_clip_high=x.loss_cfg.clip_high)
  pg = jnp.where(x.selected, 0.0, pg)
  selected = x.selected.astype(jnp.float32)
  return FormLoss(x.weighted(pg), selected, {"cov_selected_fraction": selected})


@register_policy_loss("kl_cov", KlCovConfig, select=kl_cov_selection, metrics=("cov_selected_fraction", "ppo_kl_abs"))
def kl_cov(x: FormInputs, cfg: KlCovConfig) -> FormLoss:
  """KL-Cov (arXiv 2505.22617): ``-A · ratio`` (no clip), plus ``ppo_kl_coef · |lp - a|`` on the
  step's selected tokens."""
  diff = x.lp - x.anchor
  pg = -x.adv * safe_exp(diff) + jnp.where(x.selected, cfg.ppo_kl_coef * jnp.abs(diff), 0.0)
  return FormLoss(
    x.weighted(pg),
    jnp.zeros_like(x.lp),
    {"cov_selected_fraction": x.selected.astype(jnp.float32), "ppo_kl_abs": jnp.abs(x.lp_sg - x.anchor)},
  )


@dataclasses.dataclass(frozen=True)
class GeoMeanConfig(PolicyLossConfig):
  """``geo_mean`` has no keys of its own (its clip range is ``eps_clip`` / ``eps_clip_high``)."""


@register_policy_loss("geo_mean", GeoMeanConfig, metrics=("pg_clipfrac_lower",))
def geo_mean(x: FormInputs, cfg: GeoMeanConfig) -> FormLoss:
  """GMPO (arXiv 2507.20673): per segment ``-Ā_s · exp(mean_s(sgn(A) · min(sgn(A)·d, sgn(A)·clip(d, -eps,
  eps_high))))`` with ``d = lp - a``, times the segment's geometric-mean weight (as verl); each
  token carries its segment's loss, so ``seq-mean-token-mean`` gives GMPO's mean over sequences."""
  loss_cfg = x.loss_cfg
  d = x.lp - x.anchor
  sign = jnp.sign(x.adv)
  d_clip = jnp.clip(d, -loss_cfg.eps_clip, loss_cfg.clip_high)
  d_min = sign * jnp.minimum(sign * d, sign * d_clip)
  mean_d, _ = _segment_mean(d_min, x)
  mean_adv, _ = _segment_mean(x.adv, x)
  pg = -mean_adv * safe_exp(mean_d)
  if x.weights is not None:
    log_w, _ = _segment_mean(jnp.log(x.weights + 1e-10), x)
    pg = safe_exp(log_w) * pg
  clipped = d != d_clip
  return FormLoss(
    pg, (clipped & (x.adv > 0)).astype(jnp.float32), {"pg_clipfrac_lower": (clipped & (x.adv < 0)).astype(jnp.float32)}
  )


@dataclasses.dataclass(frozen=True)
class DroConfig(PolicyLossConfig):
  """``dro``'s keys: the weight of its quadratic penalty (required: verl has no default either)."""

  dro_beta: float | None = key(None, "dro: quadratic log-ratio penalty (required by dro)", gt=0)

  def __post_init__(self):
    super().__post_init__()
    if self.dro_beta is None:
      raise ConfigError(
        "policy_loss 'dro' needs key 'dro_beta' (> 0), the weight of its quadratic log-ratio "
        "penalty; verl has no default either"
      )


@register_policy_loss("dro", DroConfig)
def dro(x: FormInputs, cfg: DroConfig) -> FormLoss:
  """DRO: ``-(A · lp - β/2 · (lp - a)²)``."""
  pg = -(x.adv * x.lp - 0.5 * cfg.dro_beta * jnp.square(x.lp - x.anchor))
  return FormLoss(x.weighted(pg), jnp.zeros_like(x.lp), {})


@dataclasses.dataclass(frozen=True)
class CispoConfig(PolicyLossConfig):
  """``cispo`` has no keys of its own (its clip range is ``eps_clip`` / ``eps_clip_high``)."""


@register_policy_loss("cispo", CispoConfig)
def cispo(x: FormInputs, cfg: CispoConfig) -> FormLoss:
  """CISPO (arXiv 2506.13585): ``-sg(clip(ratio, 1 - eps, 1 + eps_high)) · A · lp``."""
  lo, hi = x.clip_range()
  ratio = safe_exp(x.lp_sg - x.anchor)
  clipped = jnp.clip(ratio, lo, hi)
  return FormLoss(x.weighted(-clipped * x.adv * x.lp), (ratio != clipped).astype(jnp.float32), {})
