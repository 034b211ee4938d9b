"""Config plumbing: what each key accepts, the named presets, the command-line flags of contract §9
and the declarative config keys.

The top-level :mod:`mis_jax` keeps what a user composes (``LossConfig``, ``MISConfig``,
``ConfigError``, the losses); this submodule holds the names each config key accepts (the contract §6
algorithms, the levels, IS modes, divergences, aggregations, KL estimators, loss aggregations and
denominators: their formula tables are the library's), the named presets (``PRESETS``), and what
builds configs from text: the argparse flags (:func:`add_loss_flags`, :func:`loss_config_from_args`,
``LOSS_FLAG_KEYS``), YAML loading (:func:`load_yaml`) and the declarative keys a config's sections are
made of (:func:`config_key`, :func:`config_fields`, :func:`parse_config_value`); :func:`same_value`,
whether a flag's value and a config's agree. The policy-loss forms and advantage estimators are
registries of their own (:mod:`mis_jax.forms`, :mod:`mis_jax.estimators`).
"""

from mis_jax._flags import LOSS_FLAG_KEYS, _same as same_value, add_loss_flags, loss_config_from_args
from mis_jax._keys import fields_of as config_fields, key as config_key, load_yaml, parse_value as parse_config_value
from mis_jax._presets import PRESET_NAMES, PRESETS, Preset
from mis_jax._vocabulary import (
  AGGREGATIONS,
  ALGORITHMS,
  DENOMINATORS,
  DIVERGENCES,
  KL_TYPES,
  LEVELS,
  LOSS_AGG_MODES,
  TIS_MODES,
  Algorithm,
)

__all__ = [
  "AGGREGATIONS",
  "ALGORITHMS",
  "Algorithm",
  "DENOMINATORS",
  "DIVERGENCES",
  "KL_TYPES",
  "LEVELS",
  "LOSS_AGG_MODES",
  "LOSS_FLAG_KEYS",
  "PRESETS",
  "PRESET_NAMES",
  "Preset",
  "TIS_MODES",
  "add_loss_flags",
  "config_fields",
  "config_key",
  "load_yaml",
  "loss_config_from_args",
  "parse_config_value",
  "same_value",
]
