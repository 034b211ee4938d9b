"""Frozen, validated configuration: the MIS YAML file (contract §9) and the loss knobs.

Everything here runs in Python, once, before anything is traced. Errors name the file
(when there is one), the key and the allowed values, and suggest the closest valid key.

The names each key accepts come from below (:mod:`mis_jax._vocabulary`); the policy-loss forms are
a registry (:data:`POLICY_LOSSES`) that the forms fill as they are defined (:mod:`mis_jax._policy_losses`,
or your own module): ``LossConfig.policy_loss`` holds one form's config, its own keys.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import warnings
from typing import Any, Callable, Mapping

from mis_jax import _presets
from mis_jax._keys import ConfigError, _closest, _where, key, load_yaml, validate_fields  # noqa: F401
from mis_jax._registry import ChoiceConfig, Registry
from mis_jax._vocabulary import (
  AGGREGATIONS,
  ALGORITHMS,  # noqa: F401  (re-exported)
  AUTO,
  AUTO_KEYS,
  DENOMINATORS,
  DIVERGENCES,  # noqa: F401
  KL_TYPES,
  LEVELS,
  LOSS_AGG_MODES,
  PROXIMAL,
  SQ_KL_TOKENS,
  TIS_MODES,
  algorithm_of,
  metric_reduction,
)


@dataclasses.dataclass(frozen=True)
class RSCriterion:
  """A divergence-based rejection criterion (extension, after verl's rollout-correction RS).

  Per trained token, with the raw, unclipped ``r = log π_train - log π_rollout``: ``k1 = -r``,
  ``k2 = r²/2``, ``k3 = exp(clip(r, ±20)) - 1 - clip(r, ±20)`` (only k3 exponentiates, so only
  k3 clips; contract §4.1). ``agg`` reduces it per token (``token``) or
  per sequence over trained tokens (``seq_sum``, ``seq_mean``, ``seq_max``; the sequence is
  kept or rejected whole). A token is kept iff ``lower <= value <= upper`` where ``value`` is
  the aggregated divergence for k2/k3 and, for k1, the aggregated **log-ratio**
  ``-agg(k1)`` — bounds are stated on ``log(π_train/π_rollout)``, so ``lower`` always means
  "the trainer finds the sample too unlikely" (``seq_max`` of k1 with ``lower = log C`` is the
  veto). Either bound may be None; at least one is required.
  """

  metric: str = key(None, "the divergence (contract §4.1)", choices=DIVERGENCES)
  agg: str = key("token", "per token, or per sequence over trained tokens", choices=AGGREGATIONS)
  lower: float | None = key(None, "the band's lower bound (null: none)")
  upper: float | None = key(None, "the band's upper bound (null: none), or auto (k2/k3: set each step, contract §3.1)")

  @property
  def name(self) -> str:
    return f"{self.metric}_{self.agg}"

  @property
  def auto(self) -> bool:
    """Whether the threshold controller sets ``upper`` each step (contract §3.1)."""
    return self.upper == AUTO

  @classmethod
  def from_value(cls, value, where: str) -> "RSCriterion":
    if isinstance(value, RSCriterion):
      return value
    if not isinstance(value, Mapping):
      raise ConfigError(f"{where} must be a mapping with keys metric, agg, lower, upper; got {value!r}")
    valid = ("metric", "agg", "lower", "upper")
    for k in value:
      if k not in valid:
        raise ConfigError(f"{where}: unknown key '{k}'.{_closest(str(k), valid)} Valid keys: {', '.join(valid)}")
    if "metric" not in value:
      raise ConfigError(f"{where} needs 'metric' (one of {', '.join(DIVERGENCES)})")
    values = dict(value)
    auto = isinstance(values.get("upper"), str) and values["upper"].strip().lower() == AUTO
    if auto:  # set each step by the threshold controller (contract §3.1); checked as a number meanwhile
      values["upper"] = 0.0
    crit = cls(**values)
    validate_fields(crit, lambda name: _where(where, name))  # types and choices of the keys
    if auto:
      if crit.metric == "k1":
        raise ConfigError(
          f"{where}: upper: auto needs a divergence (k2 or k3); a k1 band is on the log-ratio: "
          "use rs_upper_bound: auto for it"
        )
      object.__setattr__(crit, "upper", AUTO)
      return crit
    metric, lower, upper = crit.metric, crit.lower, crit.upper
    if lower is None and upper is None:
      raise ConfigError(f"{where} needs a 'lower' or an 'upper' bound")
    if lower is not None and upper is not None and lower > upper:
      raise ConfigError(f"{where}: lower ({lower}) > upper ({upper})")
    if metric != "k1" and upper is not None and upper < 0:
      raise ConfigError(f"{where}: {metric} is >= 0, so upper must be >= 0, got {upper}")
    return crit


@dataclasses.dataclass(frozen=True)
class MISConfig:
  """Masked/truncated importance sampling and rejection sampling settings (contract §2–5).

  The keys are those of the reference page's ``mis.yaml``. Bounds left ``None`` take the
  defaults of contract §3–4 (``tis_lower_bound = 1/tis_upper_bound``, RS bounds = TIS bounds);
  the resolved values are available as ``lower``, ``rs_lower`` and ``rs_upper``.
  """

  use_tis: bool = key(True, "apply this file's IS weights and rejection")
  use_rs: bool = key(False, "rejection sampling on the raw weights at rs_level (contract §4)")
  tis_level: str = key("token", "level of the IS weights (contract §2)", choices=LEVELS)
  rs_level: str | None = key(None, "level of rejection sampling (null: tis_level)", choices=LEVELS)
  tis_mode: str = key("truncate", "how the weights are bounded (contract §3)", choices=TIS_MODES)
  tis_lower_bound: float | None = key(None, "Lo (null: 1 / tis_upper_bound)")
  tis_upper_bound: float = key(2.0, "U, or auto: set each step from a target (contract §3.1)", gt=0)
  rs_lower_bound: float | None = key(
    None, "RS lower bound (null: the IS lower bound; 1 / rs_upper_bound when that is auto)"
  )
  rs_upper_bound: float | None = key(None, "RS upper bound (null: tis_upper_bound), or auto (contract §3.1)")
  rs_veto_threshold: float | None = key(None, "veto threshold C in (0, 1) (null: no veto)")
  tis_batch_normalize: bool = key(False, "divide the weights by their mean over the kept mask (contract §5)")
  # Off-policy masks of recent papers (contract §4.2).
  opsm_delta: float | None = key(
    None, "OPSM (DeepSeek-V3.2): mask negative-advantage sequences whose mean log(pi_rollout/pi_train) > this"
  )
  m2po_threshold: float | None = key(
    None, "M2PO (AReaL): mask the largest squared log-ratios until their mean over the step is <= this", gt=0
  )
  # Probability-space trust regions (contract §4.3), on p = exp(o) and p_q = exp(q) of the sampled token.
  dppo_tv_delta: float | None = key(
    None, "DPPO-Binary-TV (prime-rl's default): mask where A > 0 and p - p_q > this (null: off)", ge=0
  )
  dppo_tv_delta_low: float | None = key(
    None, "DPPO-Binary-TV: mask where A <= 0 and p_q - p > this (null: dppo_tv_delta)", ge=0
  )
  dppo_tv_symmetric: bool = key(
    False, "DPPO-Binary-TV without the advantage: mask where |p - p_q| > dppo_tv_delta (prime-rl's ipo loss)"
  )
  kpop_phi: float | None = key(
    None, "KPop: mask where the binary KL D_B(p||p_q) or D_B(p_q||p) > this (null: off)", gt=0
  )
  # The threshold controller's targets (contract §3.1), for the bounds given as `auto`.
  target_ess_ratio: float | None = key(
    None, "auto truncate/clip bound: the loosest whose ESS ratio is >= this, in (0, 1)", gt=0
  )
  max_masked_fraction: float | None = key(
    None, "auto masking band: the tightest masking at most this share, in [0, 1)", ge=0
  )
  # Extension: divergence-based rejection criteria, combined with AND (see RSCriterion).
  rs_criteria: tuple = ()
  # Where the values came from (a YAML path), for error messages only.
  source: str | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    src = self.source
    set_ = lambda k, v: object.__setattr__(self, k, v)
    auto = [k for k in AUTO_KEYS if isinstance(getattr(self, k), str) and getattr(self, k).strip().lower() == AUTO]
    for k in auto:  # checked as numbers below with a stand-in, then put back
      set_(k, 2.0)
    validate_fields(self, lambda name: _where(src, name))  # types, choices, ranges of the keys
    for k in auto:
      set_(k, AUTO)
    criteria = self.rs_criteria if self.rs_criteria is not None else ()
    if isinstance(criteria, Mapping) or not isinstance(criteria, (list, tuple)):
      raise ConfigError(f"{_where(src, 'rs_criteria')} must be a list of criteria, got {criteria!r}")
    set_(
      "rs_criteria",
      tuple(RSCriterion.from_value(c, f"{_where(src, f'rs_criteria[{i}]')}") for i, c in enumerate(criteria)),
    )
    names = [c.name for c in self.rs_criteria]
    if len(set(names)) != len(names):
      raise ConfigError(f"{_where(src, 'rs_criteria')} lists a metric/agg pair twice: {names}")
    self._check_auto(src)
    # Relations between keys (an auto bound's relations are kept by the controller).
    if not self.tis_auto and not 0 <= self.lower < self.tis_upper_bound:
      raise ConfigError(
        f"{_where(src, 'tis_lower_bound')} must satisfy 0 <= tis_lower_bound < tis_upper_bound "
        f"({self.tis_upper_bound}), got {self.lower}"
      )
    if not (self.tis_auto or self.rs_auto) and self.rs_upper <= 0:
      raise ConfigError(f"{_where(src, 'rs_upper_bound')} must be > 0, got {self.rs_upper}")
    if not (self.tis_auto or self.rs_auto) and not 0 <= self.rs_lower <= self.rs_upper:
      raise ConfigError(
        f"{_where(src, 'rs_lower_bound')} must satisfy 0 <= rs_lower_bound <= rs_upper_bound "
        f"({self.rs_upper}), got {self.rs_lower}"
      )
    if self.rs_veto_threshold is not None and not 0 < self.rs_veto_threshold < 1:
      raise ConfigError(
        f"{_where(src, 'rs_veto_threshold')} must be in (0, 1) (typical 1e-4 … 1e-6), got {self.rs_veto_threshold}"
      )
    self._check_trust_regions(src)

  def _check_trust_regions(self, src) -> None:
    """DPPO-Binary-TV's keys (contract §4.3) mean something only beside ``dppo_tv_delta``."""
    if self.dppo_tv_delta is None:
      for k in ("dppo_tv_delta_low", "dppo_tv_symmetric"):
        if getattr(self, k) not in (None, False):
          raise ConfigError(f"{_where(src, k)} is set but dppo_tv_delta is not: DPPO-Binary-TV is off")
    if self.dppo_tv_symmetric and self.dppo_tv_delta_low is not None:
      raise ConfigError(
        f"{_where(src, 'dppo_tv_delta_low')} is the bound where A <= 0 of the sign-conditioned mask; "
        "dppo_tv_symmetric masks |p - p_q| > dppo_tv_delta whatever the advantage"
      )

  def _check_auto(self, src) -> None:
    """The controller's keys (contract §3.1): each auto bound has the target its mode can meet,
    and no target is given without an auto bound to meet it."""
    where = lambda k: _where(src, k)
    if self.tis_auto and self.tis_mode in ("truncate", "clip") and self.target_ess_ratio is None:
      raise ConfigError(
        f"{where('tis_upper_bound')} is auto in tis_mode '{self.tis_mode}': give target_ess_ratio "
        "(the loosest bound whose ESS ratio reaches it is chosen each step)"
      )
    if self.tis_auto and self.tis_mode == "mask":
      if self.target_ess_ratio is not None:
        raise ConfigError(
          f"{where('target_ess_ratio')} cannot set a mask-mode bound: the ESS of the kept weights "
          "is not monotone in a masking bound (dropping a weight can lower it). Use "
          "max_masked_fraction, or tis_mode truncate/clip for an ESS target"
        )
      if self.max_masked_fraction is None:
        raise ConfigError(
          f"{where('tis_upper_bound')} is auto in tis_mode 'mask': give max_masked_fraction "
          "(the tightest band masking at most that share is chosen each step)"
        )
    if self.tis_auto and self.tis_mode == "none":
      raise ConfigError(f"{where('tis_upper_bound')} is auto but tis_mode 'none' uses no bound")
    if self.rs_auto and not self.use_rs:
      raise ConfigError(f"{where('rs_upper_bound')} is auto but use_rs is false")
    if self.rs_auto and self.max_masked_fraction is None:
      raise ConfigError(f"{where('rs_upper_bound')} is auto: give max_masked_fraction")
    if self.criteria_auto and self.max_masked_fraction is None:
      raise ConfigError(f"{where('rs_criteria')}: a criterion's upper is auto: give max_masked_fraction")
    if self.tis_auto and self.tis_mode != "mask" and self.use_rs and self.rs_upper_bound is None:
      raise ConfigError(
        f"{where('rs_upper_bound')} must be given (a number or auto) when tis_upper_bound is auto "
        f"in tis_mode '{self.tis_mode}': the RS band would move with the bound the ESS target sets"
      )
    ess_used = self.tis_auto and self.tis_mode in ("truncate", "clip")
    mask_used = (self.tis_auto and self.tis_mode == "mask") or self.rs_auto or self.criteria_auto
    if self.target_ess_ratio is not None and not ess_used:
      raise ConfigError(
        f"{where('target_ess_ratio')} is set but no bound uses it: set tis_upper_bound: auto "
        "with tis_mode truncate or clip"
      )
    if self.max_masked_fraction is not None and not mask_used:
      raise ConfigError(
        f"{where('max_masked_fraction')} is set but no bound uses it: set rs_upper_bound: auto, "
        "a criterion's upper: auto, or tis_upper_bound: auto with tis_mode mask"
      )
    if self.target_ess_ratio is not None and not self.target_ess_ratio < 1:
      raise ConfigError(f"{where('target_ess_ratio')} must be in (0, 1), got {self.target_ess_ratio}")
    if self.max_masked_fraction is not None and not self.max_masked_fraction < 1:
      raise ConfigError(f"{where('max_masked_fraction')} must be in [0, 1), got {self.max_masked_fraction}")
    if self.tis_auto and self.tis_lower_bound is not None and self.tis_lower_bound < 0:
      raise ConfigError(f"{where('tis_lower_bound')} must be >= 0, got {self.tis_lower_bound}")
    if self.rs_auto and self.rs_lower_bound is not None and self.rs_lower_bound < 0:
      raise ConfigError(f"{where('rs_lower_bound')} must be >= 0, got {self.rs_lower_bound}")

  @property
  def tis_auto(self) -> bool:
    """Whether the controller sets ``U`` each step (contract §3.1)."""
    return self.tis_upper_bound == AUTO

  @property
  def criteria_auto(self) -> bool:
    """Whether the controller sets some divergence criterion's upper bound (contract §3.1)."""
    return any(c.auto for c in self.rs_criteria)

  @property
  def rs_auto(self) -> bool:
    """Whether the controller sets the RS upper bound each step (contract §3.1)."""
    return self.rs_upper_bound == AUTO

  # Resolved bounds (contract §3–4 defaults); an auto bound resolves inside the jitted pass.
  @property
  def lower(self) -> float:
    return 1.0 / self.tis_upper_bound if self.tis_lower_bound is None else self.tis_lower_bound

  @property
  def rs_level_resolved(self) -> str:
    return self.tis_level if self.rs_level is None else self.rs_level

  @property
  def rs_lower(self) -> float:
    return self.lower if self.rs_lower_bound is None else self.rs_lower_bound

  @property
  def rs_upper(self) -> float:
    return self.tis_upper_bound if self.rs_upper_bound is None else self.rs_upper_bound

  @classmethod
  def keys(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "source")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], *, source: str | None = None) -> "MISConfig":
    if values is None:
      values = {}
    if not isinstance(values, Mapping):
      where = f"{source}: " if source else ""
      raise ConfigError(f"{where}the MIS config must be a mapping of keys, got {type(values).__name__}")
    valid = cls.keys()
    for name in values:
      if name not in valid:
        raise ConfigError(
          f"{_where(source, str(name))} is not a MIS config key.{_closest(str(name), valid)} "
          f"Valid keys: {', '.join(valid)}"
        )
    return cls(**dict(values), source=source)

  @classmethod
  def from_preset(cls, name: str, **overrides) -> "MISConfig":
    """The MIS keys of the named preset (``mis_jax.config.PRESETS``: ``icepop``, ``trl:sequence_mask``,
    ...; docs/reference/presets.md), with MIS keys in ``overrides`` over them."""
    values = preset_values(name, {"mis": overrides})["mis"]
    return cls.from_dict(values, source=f"preset '{name}'")

  @classmethod
  def from_yaml(cls, path: str | os.PathLike) -> "MISConfig":
    path = os.fspath(path)
    return cls.from_dict(load_yaml(path, "MIS config file"), source=path)

  def to_dict(self) -> dict[str, Any]:
    out = {k: getattr(self, k) for k in self.keys()}
    out["rs_criteria"] = [dataclasses.asdict(c) for c in self.rs_criteria]
    return out


def resolve_correction_fn(spec: Callable | str | None) -> Callable | None:
  """A user correction function, given as an object or an import path.

  Accepts ``package.module.function`` or ``package.module:function``. The function must have
  the signature of :func:`mis_jax.compute_mis_weights`.
  """
  if spec is None or callable(spec):
    return spec
  if not isinstance(spec, str) or not spec.strip():
    raise ConfigError(f"correction_fn must be a callable or an import path string, got {spec!r}")
  if ":" in spec:
    module_name, _, attr = spec.partition(":")
  else:
    module_name, _, attr = spec.rpartition(".")
  if not module_name or not attr:
    raise ConfigError(
      f"correction function path {spec!r} must look like 'package.module.function' or 'package.module:function'"
    )
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"correction function path {spec!r}: cannot import module '{module_name}': {e}") from None
  fn = getattr(module, attr, None)
  if fn is None:
    raise ConfigError(f"correction function path {spec!r}: module '{module_name}' has no attribute '{attr}'")
  if not callable(fn):
    raise ConfigError(f"correction function path {spec!r}: '{attr}' is not callable")
  return fn


# --- policy-loss forms: a registry of tagged configs (contract §6.2) -----------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(ChoiceConfig):
  """The keys of one policy-loss form (contract §6.2), the value of ``LossConfig.policy_loss``.

  Each form's config subclasses this as a frozen dataclass of ``key(...)`` fields and registers with
  its function (:func:`mis_jax.forms.register_policy_loss`); ``name`` is the form's. The keys every
  form shares (``eps_clip``, ``eps_clip_high``, the aggregation) stay in :class:`LossConfig`.
  """

  KEY = "policy_loss"


# The registered forms, by name (`mis_jax.forms.POLICY_LOSSES`): filled by `register_policy_loss`. A
# form's own keys may not take the name of a LossConfig key.
POLICY_LOSSES = Registry("policy_loss", "policy-loss form", PolicyLossConfig, reserved=lambda: LossConfig.keys())


def policy_loss_of(value, where: str | None = None) -> PolicyLossConfig:
  """A form's config from its config, its name (its defaults) or ``{name: FORM, <its keys>}`` (errors name
  the key ``policy_loss``; ``where``, as a key's parser gets it, is not needed)."""
  return POLICY_LOSSES.config_of(value)


def form_mapping(value) -> dict:
  """``{name: FORM, <keys>}`` of a ``policy_loss`` value as written: a name gives ``{name}``, a mapping
  itself, a form's config all its keys."""
  if isinstance(value, PolicyLossConfig):
    return value.to_dict()
  if isinstance(value, Mapping):
    return dict(value)
  return {"name": value}


def is_form_key(name: str) -> bool:
  """Whether ``name`` is some registered form's own key (a LossConfig key before forms had configs)."""
  return bool(POLICY_LOSSES.owners(name))


def with_form_keys(policy_loss, flat: Mapping[str, Any]) -> PolicyLossConfig:
  """``policy_loss`` with form keys written beside it, flat, as LossConfig keys were before forms had
  configs (``LossConfig(policy_loss="sapo", tau_pos=2.0)``): a key of the form sets it; a key of another
  form that is unset (None) or at that form's default is dropped, as it meant nothing then either;
  any other is a :class:`ConfigError` naming the form that has it."""
  values = form_mapping(policy_loss)
  own = POLICY_LOSSES.lookup(values.get("name"), "policy_loss.name").config.keys()
  for k, v in flat.items():
    if k in own:
      values[k] = v
    elif v is not None and any(v != _default(POLICY_LOSSES[o].config, k) for o in POLICY_LOSSES.owners(k)):
      owners = POLICY_LOSSES.owners(k)
      raise ConfigError(
        f"key '{k}' is a key of policy_loss {' / '.join(owners)}, not of {values['name']}: it moved "
        f"into its form's config, policy_loss={{'name': '{owners[0]}', '{k}': {v!r}}}"
      )
  return policy_loss_of(values)


def _default(config: type, k: str):
  field = next(f for f in dataclasses.fields(config) if f.name == k)
  return field.default


def _moved_keys_warning(keys, form: str) -> None:
  listed = ", ".join(f"'{k}': ..." for k in keys)
  warnings.warn(
    f"LossConfig's {', '.join(keys)} moved into the form's config: write "
    f"policy_loss={{'name': '{form}', {listed}}} (mis_jax.forms.POLICY_LOSSES['{form}'].config)",
    DeprecationWarning,
    stacklevel=3,
  )


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy-loss settings (contract §6–7). Hashable, so it can be a static jit argument.

  ``use_tis`` left ``None`` takes its value from the MIS config (a file that sets
  ``use_tis: true`` turns correction on without the flag); an explicit value that contradicts
  the file is an error.

  ``policy_loss`` is the form's config (a :class:`PolicyLossConfig`: its name and its own keys, such
  as ``sapo``'s ``tau_pos``); its name, or ``{"name": FORM, <its keys>}``, is read as that config. The
  keys here are those every form shares. The form keys that were LossConfig keys (``tau_pos``,
  ``tau_neg``, ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``,
  ``dro_beta``, ``eps_clip_c``) are still accepted beside ``policy_loss`` for one release, with a
  ``DeprecationWarning``, when they are the form's (:func:`with_form_keys`).
  """

  use_tis: bool | None = key(None, "rollout correction on (null: the MIS config's use_tis)")
  use_rollout_logprobs: bool = key(False, "the rollout log-probs are the PPO anchor (bypass, REINFORCE + IS)")
  proximal: str = key(
    "recompute",
    "decoupled PPO's proximal log-probs: recomputed by a forward pass, or "
    "interpolated from the rollout's and the current by weight versions (contract §6.3)",
    choices=PROXIMAL,
  )
  get_mismatch_metrics: bool = key(False, "mismatch metrics without changing the loss")
  eps_clip: float = key(0.2, "PPO clip range, in (0, 1)", gt=0)
  eps_clip_high: float | None = key(None, "upper clip range (null: eps_clip)", gt=0)
  loss_agg_mode: str = key("seq-mean-token-mean", "loss aggregation (contract §7)", choices=LOSS_AGG_MODES)
  loss_scale_factor: float | None = key(
    None, "seq-mean-token-sum-norm's constant divisor (Dr. GRPO's: the longest response allowed)", gt=0
  )
  policy_loss: PolicyLossConfig | str = key(
    "vanilla",
    "the per-token policy loss, by verl's name (contract §6.2), with its own keys",
    choices=POLICY_LOSSES,
    parse=policy_loss_of,
  )
  denominator: str = key("kept", "tokens the loss is divided by (contract §7)", choices=DENOMINATORS)
  tis_clip: float = key(2.0, "vanilla TIS upper clip", gt=0)
  tis_clip_low: float = key(0.0, "vanilla TIS lower clip, below tis_clip", ge=0)
  mis: MISConfig | None = None
  correction_fn: Callable | str | None = None
  entropy_coef: float = key(0.0, "entropy bonus coefficient", ge=0)
  kl_coef: float = key(0.0, "KL penalty coefficient", ge=0)
  kl_type: str = key("k3", "KL estimator (contract §6)", choices=KL_TYPES)
  sq_kl_coef: float = key(
    0.0,
    "tau of the squared log-ratio KL tau * (lp - q)^2 to the rollout policy (Kimi-K2.5, prime-rl; contract §6.4)",
    ge=0,
  )
  sq_kl_tokens: str = key(
    "trainable", "the squared log-ratio KL's tokens: all trainable (m) or kept (m')", choices=SQ_KL_TOKENS
  )
  score_centering: bool = key(
    False,
    "score centering: the policy gradient's sampled-token score minus the sampler-"
    "expected score, from the sampler's top-k log-probs and a proportional tail "
    "(contract §6.6)",
  )

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    validate_fields(self, lambda name: _where(None, name))  # types, choices, ranges of the keys; the form's
    if self.mis is not None and not isinstance(self.mis, MISConfig):
      if isinstance(self.mis, Mapping):
        set_("mis", MISConfig.from_dict(self.mis))
      else:
        raise ConfigError(f"key 'mis' must be a MISConfig, a mapping or None, got {type(self.mis).__name__}")
    file_tis = self.mis.use_tis if self.mis is not None else None
    if self.use_tis is None:
      set_("use_tis", bool(file_tis))
    else:
      if file_tis is not None and file_tis != self.use_tis:
        where = self.mis.source or "the MIS config"
        raise ConfigError(
          f"use_tis={self.use_tis} (flag/argument) contradicts use_tis: {str(file_tis).lower()} "
          f"in {where}; make them agree"
        )
    # Relations between keys.
    if self.eps_clip >= 1:
      raise ConfigError(f"key 'eps_clip' must be in (0, 1), got {self.eps_clip}")
    if not 0 <= self.tis_clip_low < self.tis_clip:
      raise ConfigError(
        f"key 'tis_clip_low' must satisfy 0 <= tis_clip_low < tis_clip ({self.tis_clip}), got {self.tis_clip_low}"
      )
    if self.correction_fn is not None and not self.use_tis:
      raise ConfigError("key 'correction_fn' is set but use_tis is false: the correction would never run")
    self._check_policy_loss()
    self._check_proximal()
    # Resolve import paths now so a bad path fails before tracing.
    resolve_correction_fn(self.correction_fn)

  def _check_policy_loss(self):
    """Combinations of the policy loss with the algorithm and the other keys that mean nothing."""
    name = self.policy_loss.name
    if not self.form.ratio_free and self.use_rollout_logprobs and self.use_tis:
      raise ConfigError(
        f"policy_loss '{name}' forms a ratio to an anchor policy, but REINFORCE + IS (use_rollout_logprobs "
        "and use_tis both true) has none: its ratio is the IS weight. Use bypass PPO (use_tis: false) to "
        f"anchor '{name}' on the rollout log-probs, or decoupled PPO (use_rollout_logprobs: false) to anchor "
        "it on the old log-probs with the correction's weights"
      )
    if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
      raise ConfigError(
        "loss_agg_mode 'seq-mean-token-sum-norm' needs key 'loss_scale_factor' (Dr. GRPO's "
        "constant, such as the longest response allowed): a packed batch has no padded "
        "response length to default to, as verl's does"
      )
    if self.loss_scale_factor is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
      raise ConfigError(
        f"key 'loss_scale_factor' is used only by loss_agg_mode 'seq-mean-token-sum-norm', not '{self.loss_agg_mode}'"
      )

  def _check_proximal(self):
    if self.proximal == "recompute":
      return
    if self.algorithm != "decoupled_ppo":
      raise ConfigError(
        f"proximal 'loglinear' approximates decoupled PPO's proximal (old) log-probs; algorithm "
        f"'{self.algorithm}' (use_tis {self.use_tis}, use_rollout_logprobs "
        f"{self.use_rollout_logprobs}) has none. Set use_tis: true and use_rollout_logprobs: false, "
        "or proximal: recompute"
      )
    if self.uses_cov_selection:
      raise ConfigError(
        f"policy_loss '{self.policy_loss.name}' selects its tokens once per step from the anchor "
        "log-probs, which proximal 'loglinear' only knows inside the loss (they follow the "
        "current log-probs); use proximal: recompute"
      )

  def __getattr__(self, name: str):
    # The form keys that were LossConfig keys read through to the form's config, for one release.
    form = self.__dict__.get("policy_loss") if not name.startswith("_") else None
    if not isinstance(form, PolicyLossConfig) or not is_form_key(name):
      raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
    if name not in form.keys():
      raise AttributeError(
        f"'{name}' is a key of policy_loss {' / '.join(POLICY_LOSSES.owners(name))}, not of "
        f"this config's form '{form.name}' (its keys live in LossConfig.policy_loss)"
      )
    warnings.warn(
      f"LossConfig.{name} moved into the form's config: read LossConfig.policy_loss.{name}",
      DeprecationWarning,
      stacklevel=2,
    )
    return getattr(form, name)

  @property
  def form(self):
    """The registration of the policy-loss form (its config class, function and properties)."""
    return POLICY_LOSSES[self.policy_loss.name]

  @property
  def metric_mode(self) -> str:
    """How metrics are reduced under this loss mode (:func:`metric_reduction`)."""
    return metric_reduction(self.loss_agg_mode)

  @property
  def uses_cov_selection(self) -> bool:
    """Whether the form selects its tokens once per step (clip_cov, kl_cov: by covariance), in
    :func:`mis_jax.prepare_step`."""
    return self.form.select is not None

  def to_dict(self) -> dict[str, Any]:
    """The keys as JSON-able values (the form as ``{name, <its keys>}``, the MIS config as its keys,
    a correction function as its import path or repr)."""
    out = {k: getattr(self, k) for k in self.keys()}
    out["policy_loss"] = self.policy_loss.to_dict()
    out["mis"] = None if self.mis is None else self.mis.to_dict()
    if self.correction_fn is not None and not isinstance(self.correction_fn, str):
      out["correction_fn"] = repr(self.correction_fn)
    return out

  @property
  def clip_high(self) -> float:
    return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

  @property
  def algorithm(self) -> str:
    """The contract §6 table row selected by the two flags (``ALGORITHMS``)."""
    return algorithm_of(self.use_rollout_logprobs, self.use_tis)

  @property
  def needs_old_logprobs(self) -> bool:
    """Whether the trainer must recompute old log-probs (contract §6 table, last column; not
    with ``proximal: loglinear``, contract §6.3)."""
    return not self.use_rollout_logprobs and self.proximal == "recompute"

  @property
  def correction_in_loss(self) -> bool:
    """Whether the correction's weights follow the current log-probs, so that the correction
    runs inside :func:`mis_jax.policy_loss` (per micro-batch), not once per step in
    :func:`mis_jax.prepare_step`: REINFORCE + IS, and decoupled PPO with ``proximal: loglinear``."""
    return self.algorithm == "reinforce_is" or self.proximal == "loglinear"

  @property
  def correction(self) -> str | None:
    """Which correction runs: None, 'vanilla', 'mis' or 'custom'."""
    if not self.use_tis:
      return None
    if self.correction_fn is not None:
      return "custom"
    return "mis" if self.mis is not None else "vanilla"

  @classmethod
  def keys(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], *, source: str | None = None) -> "LossConfig":
    """From a mapping of LossConfig keys; ``policy_loss`` may be a form's name or a mapping
    ``{name, <its keys>}``, ``mis`` a mapping of MIS keys and ``custom_config_path`` a MIS YAML file
    (the two are exclusive)."""
    where = f"{source}: " if source else ""
    if not isinstance(values, Mapping):
      raise ConfigError(f"{where}a loss config must be a mapping, got {type(values).__name__}")
    values = dict(values)
    valid = cls.keys() + ("custom_config_path",)
    for name in values:
      if name not in valid and not is_form_key(str(name)):
        raise ConfigError(
          f"{where}unknown loss key '{name}'.{_closest(str(name), valid)} Valid keys: {', '.join(valid)}"
        )
    path = values.pop("custom_config_path", None)
    if path is not None and values.get("mis") is not None:
      raise ConfigError(f"{where}give either 'mis' or 'custom_config_path', not both")
    if path is not None:
      values["mis"] = MISConfig.from_yaml(path)
    elif isinstance(values.get("mis"), Mapping):
      values["mis"] = MISConfig.from_dict(values["mis"], source=f"{source}: mis" if source else "mis")
    return cls(**values)

  @classmethod
  def from_preset(cls, name: str, **overrides) -> "LossConfig":
    """The named preset (``mis_jax.config.PRESETS``; docs/reference/presets.md) as a LossConfig, with
    ``overrides`` over it: LossConfig keys replace the preset's, MIS keys go into its ``mis``."""
    return cls.from_dict(preset_values(name, overrides), source=f"preset '{name}'")

  @classmethod
  def from_yaml(cls, path: str | os.PathLike) -> "LossConfig":
    """A preset file (``configs/presets/*.yaml``): LossConfig keys plus an optional ``mis:``."""
    path = os.fspath(path)
    return cls.from_dict(load_yaml(path, "loss config file") or {}, source=path)


def _accepting_form_keys(init):
  """``LossConfig.__init__`` taking the form keys that were LossConfig keys (``tau_pos=`` beside
  ``policy_loss="sapo"``) for one release: folded into the form's config with a DeprecationWarning."""

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIELDS and is_form_key(k)}
    if flat:
      form = kwargs.get("policy_loss", "vanilla")
      kwargs["policy_loss"] = with_form_keys(form, flat)
      _moved_keys_warning(list(flat), kwargs["policy_loss"].name)
    init(self, *args, **kwargs)

  return __init__


_FIELDS = frozenset(LossConfig.keys())
LossConfig.__init__ = _accepting_form_keys(LossConfig.__init__)


def preset_values(name: str, overrides: Mapping[str, Any] | None = None) -> dict:
  """The named preset's LossConfig keys (``mis_jax.config.PRESETS``) with ``overrides`` over them: a
  LossConfig key replaces the preset's, a MIS key (but ``use_tis``, a LossConfig key) goes into its
  ``mis``; ``mis=`` a mapping is merged into the preset's MIS keys."""
  values = _presets.get(name).loss_values()
  loss_keys, mis_keys = set(LossConfig.keys()), set(MISConfig.keys())
  for k, v in (overrides or {}).items():
    if k == "mis" and isinstance(v, Mapping):
      values["mis"].update(v)
    elif k in loss_keys or is_form_key(k):
      values[k] = v
    elif k in mis_keys:
      values["mis"][k] = v
    else:
      valid = sorted(loss_keys | mis_keys)
      raise ConfigError(
        f"preset '{name}': unknown key '{k}'.{_closest(str(k), valid)} Valid keys: the LossConfig and MIS keys"
      )
  return values
