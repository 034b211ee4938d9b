"""Config plumbing: the command-line flags of contract §9 and the declarative config keys.

The top-level :mod:`mis_jax` keeps what a user composes (``LossConfig``, ``MISConfig``,
``ConfigError``, the losses); this submodule holds what builds configs from text: the argparse
flags (:func:`add_loss_flags`, :func:`loss_config_from_args`, ``LOSS_FLAG_KEYS``), YAML loading
(:func:`load_yaml`) and the declarative keys a trainer's own config sections are made of
(:func:`config_key`, :func:`config_fields`, :func:`parse_config_value`); :func:`same_value`, whether a
flag's value and a config's agree.
"""

from mis_jax._flags import LOSS_FLAG_KEYS, _same as same_value, add_loss_flags, loss_config_from_args
from mis_jax._keys import fields_of as config_fields, key as config_key, load_yaml, parse_value as parse_config_value

__all__ = ["LOSS_FLAG_KEYS", "add_loss_flags", "config_fields", "config_key", "load_yaml", "loss_config_from_args",
           "parse_config_value", "same_value"]
