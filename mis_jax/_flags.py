"""Command-line flags of contract §9 and their resolution into a :class:`LossConfig`.

Flags left unset stay ``None`` so an explicit flag can be told from a default. A MIS config
file that sets ``use_tis: true`` turns correction on without ``--use-tis``; ``--use-tis``
with a file that says ``use_tis: false`` is an error naming both, and so is any flag whose
value differs from the same key in the base values (a trainer config's ``loss`` section):
contract §9, never a silent override.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from mis_jax import _presets
from mis_jax._config import (
  POLICY_LOSSES,
  ConfigError,
  LossConfig,
  MISConfig,
  PolicyLossConfig,
  form_mapping,
  is_form_key,
  load_yaml,
  preset_values,
)
from mis_jax._vocabulary import DENOMINATORS, KL_TYPES, LOSS_AGG_MODES

# flag dest -> loss key, for the value-carrying loss knobs (`policy_loss` names the form; `eps_clip_c` is a key
# of the vanilla and DPPO forms, set in `policy_loss`).
_KNOBS = {
  "eps_clip": float,
  "eps_clip_high": float,
  "eps_clip_c": float,
  "tis_clip": float,
  "tis_clip_low": float,
  "loss_agg_mode": str,
  "denominator": str,
  "entropy_coef": float,
  "kl_coef": float,
  "kl_type": str,
  "policy_loss": str,
  "loss_scale_factor": float,
}
LOSS_FLAG_KEYS = tuple(_KNOBS)  # the loss keys that have a value-carrying flag
_CHOICES = {
  "loss_agg_mode": LOSS_AGG_MODES,
  "denominator": DENOMINATORS,
  "kl_type": KL_TYPES,
  "policy_loss": POLICY_LOSSES,
}  # the registry: a form registered later is a choice too


def add_loss_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds the rollout-correction flags of contract §9 to ``parser``."""
  g = parser.add_argument_group("rollout correction (contract §9)")
  g.add_argument(
    "--use-tis", action="store_true", default=None, help="apply importance sampling / rejection sampling to the loss"
  )
  g.add_argument(
    "--use-rollout-logprobs",
    action="store_true",
    default=None,
    help="use the rollout engine's log-probs as the PPO anchor; skip the recompute",
  )
  g.add_argument(
    "--get-mismatch-metrics",
    action="store_true",
    default=None,
    help="compute mismatch metrics without changing the loss",
  )
  g.add_argument(
    "--custom-config-path", default=None, metavar="YAML", help="MIS config file (keys of the reference mis.yaml)"
  )
  g.add_argument(
    "--custom-tis-function-path",
    default=None,
    metavar="MODULE.FUNCTION",
    help="correction function with the signature of mis_jax.compute_mis_weights",
  )
  g.add_argument(
    "--preset",
    default=None,
    metavar="YAML",
    help="a loss preset (configs/presets/*.yaml); explicit flags and keys override it",
  )
  for key, typ in _KNOBS.items():
    where = f"policy_loss.{key}" if key == "eps_clip_c" else key
    g.add_argument(
      "--" + key.replace("_", "-"), type=typ, default=None, choices=_CHOICES.get(key), help=f"LossConfig.{where}"
    )
  return parser


def loss_config_from_args(
  args: argparse.Namespace | Mapping[str, Any], base: Mapping[str, Any] | None = None
) -> LossConfig:
  """Builds a :class:`LossConfig` from parsed flags over optional base values (e.g. a YAML).

  Explicit flags override ``base``; the MIS file is loaded and validated here, before tracing.
  """
  values = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
  base = dict(base or {})
  out = _under_preset(values, base)
  _check_flags_agree(values, base)
  _apply_flags(values, out)
  _apply_mis(values, out)
  return LossConfig(**out)


def _under_preset(values: dict, base: dict) -> dict:
  """``base`` over the preset it names (or the ``--preset`` flag names), checked for unknown keys."""
  out: dict[str, Any] = dict(base)
  preset = values.get("preset") or out.pop("preset", None)
  out.pop("preset", None)
  if preset:
    # A preset file (configs/presets/*.yaml) under the base values: explicit keys win.
    if _is_preset_name(preset):  # a named preset (mis_jax.config.PRESETS: icepop, trl:sequence_mask, ...)
      preset_keys = preset_values(preset)
    else:
      preset_keys = load_yaml(preset, "loss preset") or {}
    LossConfig.from_dict(preset_keys, source=preset)  # validates the file, naming it
    out = {**preset_keys, **out}
  unknown = (
    {k for k in out if not is_form_key(k)} - set(LossConfig.keys()) - {"custom_config_path", "custom_tis_function_path"}
  )
  if unknown:
    raise ConfigError(f"unknown loss keys: {', '.join(sorted(unknown))}; valid keys: {', '.join(LossConfig.keys())}")
  return out


def _check_flags_agree(values: dict, base: dict) -> None:
  """A flag whose value differs from the same key in ``base`` is an error naming both (contract §9)."""
  for key in list(_KNOBS) + [
    "use_rollout_logprobs",
    "get_mismatch_metrics",
    "use_tis",
    "custom_config_path",
    "custom_tis_function_path",
  ]:
    flag, given = values.get(key), _given(base, key)
    if flag is not None and given is not None and not _same(flag, given):
      path = f"loss.policy_loss.{key}" if _is_form_flag(key) else f"loss.{key}"
      raise ConfigError(
        f"--{key.replace('_', '-')} {_show(flag)} contradicts {path}: {_show(given)} in the config; remove one of them"
      )


def _apply_flags(values: dict, out: dict) -> None:
  """The value-carrying flags into ``out``: ``--policy-loss`` names the form, a form's key (``--eps-clip-c``)
  goes into ``policy_loss``."""
  for key in list(_KNOBS) + ["use_rollout_logprobs", "get_mismatch_metrics"]:
    if values.get(key) is not None and key != "policy_loss" and not _is_form_flag(key):
      out[key] = values[key]
  form_flags = {k: values[k] for k in _KNOBS if _is_form_flag(k) and values.get(k) is not None}
  if values.get("policy_loss") is not None or form_flags:
    form = form_mapping(out.get("policy_loss", "vanilla"))
    if values.get("policy_loss") is not None:
      form["name"] = values["policy_loss"]
    out["policy_loss"] = {**form, **form_flags}


def _apply_mis(values: dict, out: dict) -> None:
  """The MIS config (a file, a mapping) and the correction function into ``out``, and ``use_tis``: a file
  with ``use_tis: true`` turns correction on without the flag; a flag or key that contradicts it is an
  error naming both."""
  config_path = values.get("custom_config_path") or out.pop("custom_config_path", None)
  out.pop("custom_config_path", None)
  fn_path = values.get("custom_tis_function_path") or out.pop("custom_tis_function_path", None)
  out.pop("custom_tis_function_path", None)
  mis = out.get("mis")
  if config_path:
    mis = MISConfig.from_yaml(config_path)
  elif isinstance(mis, Mapping):
    mis = MISConfig.from_dict(mis)
  out["mis"] = mis
  if fn_path:
    out["correction_fn"] = fn_path

  flag_tis = values.get("use_tis")
  if flag_tis is None and out.get("use_tis") is not None and mis is not None and mis.use_tis != out["use_tis"]:
    raise ConfigError(
      f"loss.use_tis: {_show(out['use_tis'])} contradicts use_tis: {_show(mis.use_tis)} in "
      f"{mis.source or 'the MIS config'}; remove one of them"
    )
  if flag_tis is not None:
    if mis is not None and mis.use_tis != flag_tis:
      raise ConfigError(
        f"--use-tis contradicts use_tis: {str(mis.use_tis).lower()} in "
        f"{mis.source or 'the MIS config'}; remove the flag or change the file"
      )
    out["use_tis"] = flag_tis
  elif mis is not None:
    # The file decides (a file with use_tis: true turns correction on without the flag).
    out["use_tis"] = None


def _is_form_flag(key: str) -> bool:
  """A flag that sets a key of the form (``--eps-clip-c``), not of LossConfig."""
  return key not in LossConfig.keys() and is_form_key(key)


def _given(base: Mapping[str, Any], key: str):
  """The value ``base`` gives ``key``: for ``policy_loss`` the form's name, for a form's key its value in
  ``policy_loss`` (or beside it, flat, the old spelling)."""
  form = base.get("policy_loss")
  if key == "policy_loss":
    return form.name if isinstance(form, PolicyLossConfig) else form.get("name") if isinstance(form, Mapping) else form
  if _is_form_flag(key) and key not in base and form is not None:
    return form_mapping(form).get(key) if not isinstance(form, str) else None
  return base.get(key)


def _is_preset_name(preset) -> bool:
  """A ``preset`` value names a preset of ``mis_jax.config.PRESETS`` (else it is a YAML path): a string
  that is no existing file and looks like no path; a name not in the table is an error listing them."""
  if not isinstance(preset, str) or os.path.exists(preset) or preset.endswith((".yaml", ".yml")) or "/" in preset:
    return False
  _presets.get(preset)  # an unknown name: ConfigError listing the valid ones
  return True


def _same(a, b) -> bool:
  """Flag and config values agree (numbers compared as numbers: YAML may give ``"1e-4"``)."""
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  try:
    return float(a) == float(b)
  except (TypeError, ValueError):
    return a == b


def _show(value) -> str:
  return str(value).lower() if isinstance(value, bool) else str(value)
