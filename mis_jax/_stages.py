"""The bound and the masks of the ``mis`` correction (contract §3–4.2) as small named stages,
which :func:`mis_jax._weights.correct` composes into its two passes and the threshold controller.

A stage is one decision about the weights or the kept mask ``m'``, with all it needs in one place:

- ``inputs(mask, advantages)``: per-token arrays it reads beside ``o``, ``q`` and ``m``;
- ``segment_sums(r, m, chunk)``: what it needs from pass 1, the per-segment reductions over the
  original mask ``m`` (``SegSum`` / ``SegMax`` contributions under its own keys);
- ``segments(own, seg)``: its per-segment state from them (a sequence criterion's value, the
  segments it rejects), and, with ``REJECTS_SEGMENTS``, ``rejected(state)``: the segments it
  rejects whole (the pass ORs every stage's and broadcasts the union once);
- ``resolve(step)``: the bound it sets from the step's own ratios (contract §3.1, §4.2), in
  ``BOUND_ORDER``; ``sets_bound`` says whether it has one this config;
- ``apply(tokens, bounds, state, rows)``: pass 2 at the tokens: it narrows ``tokens.kept`` (IS
  also sets ``tokens.w``) and, given ``rows``, adds its per-token metric rows (averaged over
  ``m``) and contributions of its own to the pass;
- ``results(own, state, after)``: its metrics after the passes, from its own pass-2 results;
- ``METRICS``: the metrics it emits with their micro-batch reductions (declared at import).

Numerics live in :mod:`mis_jax._correction` (formulas), :mod:`mis_jax._metrics` (metric rows)
and :mod:`mis_jax._controller` (bounds set from a target); a stage only says which it uses and
when. A new mask is one stage class here and one line in :func:`stages_of` (a new divergence,
level or IS mode is one table entry of :mod:`mis_jax._correction`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _controller as controller
from mis_jax import _correction as correction
from mis_jax import _metrics as metrics_lib
from mis_jax._config import MISConfig, RSCriterion
from mis_jax._engine import LOWEST, Max, SegMax, SegSum, Total
from mis_jax._segments import MaskStats


class Tokens:
  """The tokens the stages decide on: one chunk of pass 2, or the whole batch in the threshold
  controller. ``kept`` starts as ``m`` and each stage narrows it; the IS stage sets ``w``."""

  def __init__(self, r, m, to_tokens: Callable, sum_r, counts, inputs=None):
    self.r, self.m, self.to_tokens, self.sum_r, self.counts = r, m, to_tokens, sum_r, counts
    self.inputs = inputs  # the per-token arrays of the pass by name (o, q, m and the stages' inputs)
    self.kept, self.w = m, None
    self._raw = {}

  def log_probs(self):
    """``(o, q)`` on trained tokens (0 elsewhere)."""
    return jnp.where(self.m, self.inputs["o"], 0.0), jnp.where(self.m, self.inputs["q"], 0.0)

  def probs(self):
    """``(p, p_q) = (exp(o), exp(q))`` of the sampled token on trained tokens (1 elsewhere)."""
    o, q = self.log_probs()
    return jnp.exp(o), jnp.exp(q)

  def log_values(self, level: str):
    """Level log-values ``L_t`` (contract §2)."""
    return correction.level_log_values(level, self.r, self.sum_r, self.counts, self.to_tokens)

  def raw_weights(self, level: str):
    """``w_raw`` at ``level`` (computed once per level: IS and RS at one level share it)."""
    if level not in self._raw:
      self._raw[level] = correction.raw_weights(self.log_values(level))
    return self._raw[level]

  def narrow(self, keep) -> None:
    """``kept ← kept ∧ keep``."""
    self.kept = self.kept & keep


class Rows:
  """What the stages add to pass 2 beside their decisions: per-token metric rows averaged over
  ``m`` (``means``: ``R_m``, contract §8) and contributions of their own (``add``)."""

  def __init__(self, seq_mode: bool):
    self.seq_mode = seq_mode
    self.means: dict = {}
    self.out: dict = {}

  def add(self, stage: "Stage", key: str, contribution) -> None:
    self.out[own_key(stage, key)] = contribution


def own_key(stage: "Stage", key: str) -> str:
  """A stage's key in a pass's results (stage names are unique in a config)."""
  return f"{stage.name}/{key}"


def own_results(stage: "Stage", results: dict) -> dict:
  """The results of a pass under ``stage``'s keys, by its own key."""
  prefix = own_key(stage, "")
  return {k[len(prefix) :]: v for k, v in results.items() if k.startswith(prefix)}


class SegmentView(NamedTuple):
  """Pass 1's shared per-segment results: the counts of ``m`` and ``Σ m r`` (None when no stage
  and no metric needs it)."""

  mask_stats: MaskStats
  sum_r: jax.Array | None


class After(NamedTuple):
  """What a stage's metrics after the passes read: the counts of ``m`` and ``R`` over another
  mask from its per-segment (seq-mean modes) or total sums (``kept_mean(w_sum, n_sum)``)."""

  mask_stats: MaskStats
  kept_mean: Callable


class Step:
  """The threshold controller's view of the step (contract §3.1, §4.2): the whole batch's ``r``
  and pass 1's per-segment results; the bounds as resolved so far, the metrics and whether
  every target is met. ``kept_by(without=stage)`` composes the other stages' masks over the batch."""

  def __init__(self, cfg: MISConfig, seg, segs, r, m, bounds: correction.Bounds, compose: Callable):
    self.cfg, self.seg, self.segs, self.r, self.m = cfg, seg, segs, r, m
    self.bounds, self._compose = bounds, compose
    self.trained = m.astype(jnp.float32)
    self.metrics: dict = {}
    self.met, self.has_target = jnp.bool_(True), False

  def units(self, level: str, kept=None) -> controller.Units:
    """The units a bound at ``level`` acts on: tokens (sharded) or segments (already global), with
    their raw weights, trained multiplicity and kept multiplicity (``kept`` tokens; default ``m``)."""
    kept = (self.m if kept is None else kept).astype(jnp.float32)
    if level == "token":
      return controller.Units(correction.raw_weights(self.r), self.m.astype(jnp.float32), kept, self.segs.axis_name)
    count = self.seg.mask_stats.counts
    x = correction.raw_weights(correction.segment_log_values(level, self.seg.sum_r, count))
    return controller.Units(x, (count > 0).astype(jnp.float32), self.segs.sum(kept), None)

  def token_units(self, x) -> controller.Units:
    """Trained tokens with values ``x``."""
    return controller.Units(x, self.trained, self.trained, self.segs.axis_name)

  def target(self, ok) -> None:
    """A target this step's bound had to meet (``mis_auto_target_met``: all of them)."""
    self.met, self.has_target = self.met & ok, True

  def kept_by(self, without: "Stage") -> jax.Array:
    """``m`` narrowed by every stage but ``without`` at the bounds resolved so far, over the
    whole batch."""
    return self._compose(without, self.bounds)


@dataclasses.dataclass(frozen=True)
class Stage:
  """A bound or mask of the correction (see the module doc); the defaults do nothing."""

  cfg: MISConfig
  name: ClassVar[str] = ""
  METRICS: ClassVar[dict] = {}  # {metric: micro-batch reduction} of what it emits
  REJECTS_SEGMENTS: ClassVar[bool] = False
  BOUND_ORDER: ClassVar[int] = 0  # the controller's order (contract §3.1): M2PO, criteria, RS, then IS

  @property
  def needs_sum_r(self) -> bool:
    """Whether it reads ``Σ m r`` per segment (a sequence or geometric level)."""
    return False

  @property
  def sets_bound(self) -> bool:
    """Whether the threshold controller sets its bound from the step (contract §3.1, §4.2)."""
    return False

  def inputs(self, mask, adv) -> dict:
    return {}

  def segment_sums(self, r, m, ch) -> dict:
    return {}

  def segments(self, own: dict, seg: SegmentView):
    return None

  def rejected(self, state):
    return None

  def resolve(self, step: Step) -> None:
    pass

  def apply(self, tokens: Tokens, bounds: correction.Bounds, state, rows: Rows | None) -> None:
    pass

  def results(self, own: dict, state, after: After) -> dict:
    return {}


def _declares(cls):
  """Declares the stage's metrics' micro-batch reductions (`mis_jax._metrics.declare`)."""
  metrics_lib.declare(cls.METRICS)
  return cls


def _live_share(segments, mask_stats: MaskStats):
  """The share of live segments among ``segments``."""
  return jnp.sum((segments & (mask_stats.counts > 0)).astype(jnp.float32)) / jnp.maximum(mask_stats.num_live, 1.0)


@_declares
@dataclasses.dataclass(frozen=True)
class ImportanceWeights(Stage):
  """§3: the IS weights at ``tis_level``, bounded by ``tis_mode`` (``mask`` rejects tokens), and
  §3.1: ``tis_upper_bound: auto``, set last, by its masked share or by the ESS over what every
  other stage keeps."""

  name = "is"
  BOUND_ORDER = 3
  METRICS = {
    "mis_tis_weight_before_bound": "mask",
    "mis_tis_truncate_fraction": "mask",  # means over m
    "mis_tis_clip_fraction_low": "mask",
    "mis_tis_clip_fraction_high": "mask",
    "mis_tis_mask_fraction_low": "mask",
    "mis_tis_mask_fraction_high": "mask",
    "mis_tis_weight_after_bound": "kept",  # over the tokens IS kept (m' where IS keeps every token)
    "mis_auto_tis_upper_bound": "mask",
    "mis_auto_ess_ratio": "mask",
    "mis_auto_tis_masked_fraction": "mask",
  }

  @property
  def needs_sum_r(self) -> bool:
    return self.cfg.tis_level != "token"

  @property
  def sets_bound(self) -> bool:
    return self.cfg.tis_auto

  def apply(self, tokens, bounds, state, rows):
    cfg = self.cfg
    w_raw = tokens.raw_weights(cfg.tis_level)
    w, keep_is = correction.bounded_weights(w_raw, cfg.tis_mode, bounds)
    w = jnp.where(tokens.m, w, 0.0)
    if keep_is is not None:
      tokens.narrow(keep_is)
    tokens.w = w
    if rows is None:
      return
    if keep_is is not None:  # sums for mis_tis_weight_after_bound
      acc = SegSum if rows.seq_mode else Total
      rows.add(self, "kept_w", acc(jnp.where(tokens.kept, w, 0.0)))
      rows.add(self, "kept_n", acc(tokens.kept))
    rows.means.update(metrics_lib.is_token_values(cfg, bounds, w_raw, w, keep_is))

  def resolve(self, step):
    cfg, b = self.cfg, step.bounds
    if not cfg.tis_auto:
      return
    if cfg.tis_mode == "mask":
      tis_upper, share, ok = controller.masking_bound(
        step.units(cfg.tis_level), cfg.tis_lower_bound, cfg.max_masked_fraction
      )
      step.metrics["mis_auto_tis_masked_fraction"] = share
    else:  # the ESS over what rejection keeps, as pass 2 composes it
      kept = step.kept_by(without=self)
      tis_upper, ess, ok = controller.ess_bound(
        step.units(cfg.tis_level, kept), cfg.tis_mode, cfg.tis_lower_bound, cfg.target_ess_ratio
      )
      step.metrics["mis_auto_ess_ratio"] = ess
    step.target(ok)
    tis_lower = 1.0 / tis_upper if cfg.tis_lower_bound is None else cfg.tis_lower_bound
    step.metrics["mis_auto_tis_upper_bound"] = tis_upper
    b = b._replace(tis_lower=tis_lower, tis_upper=tis_upper)
    if cfg.use_rs and cfg.rs_upper_bound is None:  # the RS band follows the IS band (mask mode)
      b = b._replace(rs_upper=tis_upper, rs_lower=tis_lower if cfg.rs_lower_bound is None else cfg.rs_lower_bound)
    step.bounds = b

  def results(self, own, state, after):
    if "kept_w" not in own:
      return {}
    return {"mis_tis_weight_after_bound": after.kept_mean(own["kept_w"], own["kept_n"])}


@_declares
@dataclasses.dataclass(frozen=True)
class RejectionSampling(Stage):
  """§4 (``use_rs``): keep the tokens whose raw weight at ``rs_level`` is in the RS band; §3.1:
  ``rs_upper_bound: auto``, by its masked share (an unset lower bound is then ``1/U``)."""

  name = "rs"
  BOUND_ORDER = 2
  METRICS = {
    "mis_rs_mask_fraction_low": "mask",
    "mis_rs_mask_fraction_high": "mask",
    "mis_auto_rs_upper_bound": "mask",
    "mis_auto_rs_masked_fraction": "mask",
  }

  @property
  def level(self) -> str:
    return self.cfg.rs_level_resolved

  @property
  def needs_sum_r(self) -> bool:
    return self.level != "token"

  @property
  def sets_bound(self) -> bool:
    return self.cfg.rs_auto

  def apply(self, tokens, bounds, state, rows):
    w_rs_raw = tokens.raw_weights(self.level)
    tokens.narrow(correction.rs_keep(w_rs_raw, bounds))
    if rows is not None:
      rows.means.update(metrics_lib.rs_token_values(bounds, w_rs_raw))

  def resolve(self, step):
    cfg, b = self.cfg, step.bounds
    rs_lower, rs_upper = b.rs_lower, b.rs_upper
    if cfg.rs_auto:
      rs_upper, share, ok = controller.masking_bound(
        step.units(self.level), cfg.rs_lower_bound, cfg.max_masked_fraction
      )
      step.metrics.update(mis_auto_rs_upper_bound=rs_upper, mis_auto_rs_masked_fraction=share)
      step.target(ok)
    if rs_upper is not None and rs_lower is None:  # an unset RS lower bound is 1/(RS upper bound)
      rs_lower = 1.0 / rs_upper
    step.bounds = b._replace(rs_lower=rs_lower, rs_upper=rs_upper)


_ALL_CRITERIA = {}
for _metric in correction.DIVERGENCES:  # every criterion's metrics (contract §4.1)
  for _agg in correction.AGGREGATIONS:
    _ALL_CRITERIA.update(metrics_lib.criterion_names(_metric, _agg))


@_declares
@dataclasses.dataclass(frozen=True)
class Criterion(Stage):
  """§4.1: one divergence criterion of ``rs_criteria`` (the ``index``-th), a band on its value
  per token or per sequence (pass 1 aggregates it); §3.1: its ``upper: auto``, by its masked share
  of its units (tokens, or live sequences)."""

  index: int = 0
  crit: RSCriterion = None
  BOUND_ORDER = 1
  METRICS = _ALL_CRITERIA

  @property
  def name(self) -> str:
    return f"rs_{self.crit.name}"

  @property
  def sets_bound(self) -> bool:
    return self.crit.auto

  @property
  def per_token(self) -> bool:
    return self.crit.agg == "token"

  def segment_sums(self, r, m, ch):
    per_segment = correction.AGGREGATIONS[self.crit.agg]
    if per_segment is None:
      return {}
    d = correction.divergence(self.crit.metric, r)
    if per_segment == "sum":
      return {"agg": SegSum(jnp.where(m, d, 0.0))}
    return {"agg": SegMax(jnp.where(m, d, LOWEST))}

  def segments(self, own, seg):
    if self.per_token:
      return None
    crit = self.crit
    return correction.criterion_value(
      crit.metric, correction.segment_divergence(crit.agg, own["agg"], seg.mask_stats.counts)
    )

  def token_values(self, tokens: Tokens, state):
    """The value its band bounds, at every token."""
    if self.per_token:
      return correction.criterion_value(self.crit.metric, correction.divergence(self.crit.metric, tokens.r))
    return tokens.to_tokens(state)

  def apply(self, tokens, bounds, state, rows):
    crit = self.crit
    value = self.token_values(tokens, state)
    keep = correction.in_band(value, crit.lower, bounds.criteria_upper[self.index])
    tokens.narrow(keep)
    if rows is not None:
      rows.means.update(metrics_lib.criterion_token_values(crit, value, keep))
      rows.add(self, "max", Max(jnp.where(tokens.m, value, LOWEST)))

  def resolve(self, step):
    crit, cfg = self.crit, self.cfg
    if not crit.auto:
      return
    if self.per_token:
      units = step.token_units(correction.criterion_value(crit.metric, correction.divergence(crit.metric, step.r)))
    else:
      live = (step.seg.mask_stats.counts > 0).astype(jnp.float32)
      units = controller.Units(step.seg.states[self.name], live, live, None)
    upper, _, ok = controller.masking_bound(units, crit.lower, cfg.max_masked_fraction, reciprocal=False)
    uppers = list(step.bounds.criteria_upper)
    uppers[self.index] = upper
    step.bounds = step.bounds._replace(criteria_upper=tuple(uppers))
    step.metrics[f"mis_auto_rs_{crit.name}_upper"] = upper
    step.target(ok)

  def results(self, own, state, after):
    return {f"mis_rs_{self.crit.name}_max": jnp.where(after.mask_stats.total > 0, own["max"], 0.0)}


@_declares
@dataclasses.dataclass(frozen=True)
class Veto(Stage):
  """§4 (``rs_veto_threshold``): a segment holding a catastrophic token is rejected whole."""

  name = "veto"
  REJECTS_SEGMENTS = True
  METRICS = {
    "mis_rs_catastrophic_token_fraction": "mask",  # a mean over m
    "mis_rs_catastrophic_seq_fraction": "seqs",
  }  # vetoed among live segments

  def catastrophic(self, r, m):
    return correction.catastrophic_tokens(r, m, self.cfg.rs_veto_threshold)

  def segment_sums(self, r, m, ch):
    return {"catastrophic": SegSum(self.catastrophic(r, m))}

  def segments(self, own, seg):
    return correction.vetoed_segments(own["catastrophic"])

  def rejected(self, state):
    return state

  def apply(self, tokens, bounds, state, rows):
    if rows is not None:
      rows.means["mis_rs_catastrophic_token_fraction"] = self.catastrophic(tokens.r, tokens.m)

  def results(self, own, state, after):
    return {"mis_rs_catastrophic_seq_fraction": _live_share(state, after.mask_stats)}


@_declares
@dataclasses.dataclass(frozen=True)
class OffPolicySequenceMask(Stage):
  """§4.2 (``opsm_delta``, OPSM): a live segment with a negative advantage and a mean
  ``log(π_rollout/π_train)`` above ``δ`` is rejected whole. Needs the advantages."""

  name = "opsm"
  REJECTS_SEGMENTS = True
  METRICS = {"mis_opsm_masked_seq_fraction": "seqs"}  # masked among live segments

  @property
  def needs_sum_r(self) -> bool:
    return True

  def inputs(self, mask, adv):
    if adv is None:
      raise ValueError(
        f"opsm_delta={self.cfg.opsm_delta} (OPSM) masks negative-advantage sequences: pass "
        "advantages= (the losses pass the batch's)"
      )
    return {"adv": jnp.where(mask, jax.lax.stop_gradient(adv), 0.0)}

  def segment_sums(self, r, m, ch):
    return {"sum_adv": SegSum(jnp.where(m, ch["adv"], 0.0))}

  def segments(self, own, seg):
    return correction.opsm_segments(seg.sum_r, seg.mask_stats.counts, own["sum_adv"], self.cfg.opsm_delta)

  def rejected(self, state):
    return state

  def results(self, own, state, after):
    return {"mis_opsm_masked_seq_fraction": _live_share(state, after.mask_stats)}


@_declares
@dataclasses.dataclass(frozen=True)
class SecondMomentMask(Stage):
  """§4.2 (``m2po_threshold``, M2PO): keep ``r² <= T``, the cutoff set first by the controller
  over the step's trained tokens."""

  name = "m2po"
  BOUND_ORDER = 0
  METRICS = {"mis_m2po_max_sq_log_ratio": "mask", "mis_m2po_second_moment": "mask", "mis_m2po_masked_fraction": "mask"}

  @property
  def sets_bound(self) -> bool:
    return True

  def resolve(self, step):
    m2_max, second_moment, share = controller.m2po_cutoff(step.token_units(step.r * step.r), self.cfg.m2po_threshold)
    step.metrics.update(
      mis_m2po_max_sq_log_ratio=m2_max, mis_m2po_second_moment=second_moment, mis_m2po_masked_fraction=share
    )
    step.bounds = step.bounds._replace(m2_max=m2_max)

  def apply(self, tokens, bounds, state, rows):
    tokens.narrow(tokens.r * tokens.r <= bounds.m2_max)  # the largest squared log-ratios go


def _advantages(cfg_key: str, value, mask, adv) -> dict:
  if adv is None:
    raise ValueError(
      f"{cfg_key}={value} conditions its mask on the advantage's sign: pass advantages= (the losses pass the batch's)"
    )
  return {"adv": jnp.where(mask, jax.lax.stop_gradient(adv), 0.0)}


@_declares
@dataclasses.dataclass(frozen=True)
class BinaryTVMask(Stage):
  """§4.3 (``dppo_tv_delta``, DPPO-Binary-TV as prime-rl's default loss): mask a token whose
  probability moved past ``δ`` from the rollout's in the direction its advantage pushes
  (``p - p_q > δ`` where ``A > 0``, ``p_q - p > δ_low`` elsewhere), or either way
  (``dppo_tv_symmetric``). Per token; the sign-conditioned mask needs the advantages."""

  name = "dppo_tv"
  METRICS = {
    "mis_dppo_tv_masked_fraction": "mask",
    "mis_dppo_tv_masked_fraction_high": "mask",
    "mis_dppo_tv_masked_fraction_low": "mask",
    "mis_dppo_tv_prob_abs_diff": "mask",
  }  # means over m

  def inputs(self, mask, adv):
    if self.cfg.dppo_tv_symmetric:
      return {}
    return _advantages("dppo_tv_delta", self.cfg.dppo_tv_delta, mask, adv)

  def apply(self, tokens, bounds, state, rows):
    cfg = self.cfg
    p, p_q = tokens.probs()
    low = cfg.dppo_tv_delta if cfg.dppo_tv_delta_low is None else cfg.dppo_tv_delta_low
    adv = None if cfg.dppo_tv_symmetric else tokens.inputs["adv"]
    masked = correction.dppo_tv_masked(p, p_q, adv, cfg.dppo_tv_delta, low, cfg.dppo_tv_symmetric)
    tokens.narrow(~masked)
    if rows is not None:
      d = p - p_q
      rows.means.update(
        {
          "mis_dppo_tv_masked_fraction": masked,
          "mis_dppo_tv_masked_fraction_high": masked & (d > 0),
          "mis_dppo_tv_masked_fraction_low": masked & (d < 0),
          "mis_dppo_tv_prob_abs_diff": jnp.abs(d),
        }
      )


@_declares
@dataclasses.dataclass(frozen=True)
class KPopMask(Stage):
  """§4.3 (``kpop_phi``, KPop): mask a token whose bidirectional binary KL
  ``max(D_B(p‖p_q), D_B(p_q‖p))`` exceeds ``φ``. Per token."""

  name = "kpop"
  METRICS = {"mis_kpop_masked_fraction": "mask", "mis_kpop_binary_kl": "mask"}  # means over m

  def apply(self, tokens, bounds, state, rows):
    value = correction.kpop_divergence(*tokens.log_probs())
    keep = value <= self.cfg.kpop_phi
    tokens.narrow(keep)
    if rows is not None:
      rows.means.update({"mis_kpop_masked_fraction": ~keep, "mis_kpop_binary_kl": value})


def fixed_bounds(cfg: MISConfig) -> correction.Bounds:
  """A config's fixed bounds (contract §3–4 defaults); None for those it leaves to the controller."""
  uppers = tuple(None if c.auto else c.upper for c in cfg.rs_criteria)
  if cfg.tis_auto:
    return correction.Bounds(None, None, cfg.rs_lower_bound, None if cfg.rs_auto else cfg.rs_upper_bound, None, uppers)
  return correction.Bounds(
    cfg.lower,
    cfg.tis_upper_bound,
    cfg.rs_lower_bound if cfg.rs_auto else cfg.rs_lower,
    None if cfg.rs_auto else cfg.rs_upper,
    None,
    uppers,
  )


def stages_of(cfg: MISConfig | None) -> tuple:
  """The stages a config runs, in the order pass 2 composes the kept mask: IS, RS, each criterion,
  the veto, OPSM, M2PO, DPPO-Binary-TV, KPop (the segments the veto and OPSM reject leave at the first of them)."""
  if cfg is None:
    return ()
  stages = [ImportanceWeights(cfg)]
  if cfg.use_rs:
    stages.append(RejectionSampling(cfg))
  stages += [Criterion(cfg, index=i, crit=crit) for i, crit in enumerate(cfg.rs_criteria)]
  if cfg.rs_veto_threshold is not None:
    stages.append(Veto(cfg))
  if cfg.opsm_delta is not None:
    stages.append(OffPolicySequenceMask(cfg))
  if cfg.m2po_threshold is not None:
    stages.append(SecondMomentMask(cfg))
  if cfg.dppo_tv_delta is not None:
    stages.append(BinaryTVMask(cfg))
  if cfg.kpop_phi is not None:
    stages.append(KPopMask(cfg))
  return tuple(stages)


def compose(stages, tokens: Tokens, bounds: correction.Bounds, states: dict, rejected_at, rows: Rows | None = None):
  """``tokens.kept`` narrowed by every stage in turn (and ``tokens.w`` set by IS): the one
  composition pass 2 and the controller's ESS bound share. ``rejected_at``: the union of the
  segments the stages reject whole, at the tokens (None when none does)."""
  pending = rejected_at is not None
  for stage in stages:
    if pending and stage.REJECTS_SEGMENTS:
      tokens.narrow(~rejected_at)
      pending = False
    stage.apply(tokens, bounds, states.get(stage.name), rows)
  return tokens
