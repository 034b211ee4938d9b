"""Declarative config keys: a key's default, meaning and constraints in one place, checked once
in Python before anything is traced. Shared by the library's configs and the trainer's sections.

Errors are :class:`ConfigError` naming where the value was written, the key, the value and what
is allowed; an unknown key suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
  """A configuration value is invalid. The message names the source, key and value."""


def load_yaml(path: str, what: str):
  """Parses a YAML file; a missing file or invalid YAML is a ConfigError naming the path."""
  if not os.path.isfile(path):
    raise ConfigError(f"{what} not found: {path}")
  with open(path) as f:
    try:
      return yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f"{path}: invalid YAML: {e}") from None


def _where(source: str | None, key: str) -> str:
  return f"{source}: key '{key}'" if source else f"key '{key}'"


def _closest(key: str, valid) -> str:
  match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ""


def _number(value: Any, where: str, *, allow_none: bool) -> float | None:
  """Accepts ints, floats and numeric strings (YAML 1.1 reads ``1e-4`` as a string)."""
  if value is None:
    if allow_none:
      return None
    raise ConfigError(f"{where} must be a number, got null")
  if isinstance(value, bool):
    raise ConfigError(f"{where} must be a number, got the boolean {value!r}")
  if isinstance(value, str):
    try:
      value = float(value.strip())
    except ValueError:
      raise ConfigError(f"{where} must be a number, got the string {value!r}") from None
  if not isinstance(value, (int, float)):
    raise ConfigError(f"{where} must be a number, got {type(value).__name__} {value!r}")
  value = float(value)
  if not math.isfinite(value):
    raise ConfigError(f"{where} must be finite, got {value!r}")
  return value


def key(default, doc: str, *, ge=None, gt=None, le=None, choices=None, factory=None, parse=None):
  """A config key: its default, one line of meaning, and its constraints (checked on load,
  shown in `mis-jax train --help` and docs/reference/config.md). ``parse(value, where)``, for a key
  whose value is a config of its own (a registered choice: :mod:`mis_jax._registry`), reads and
  checks it instead; ``choices`` then only names the values for the docs."""
  meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices, "parse": parse}
  if factory is not None:
    return dataclasses.field(default_factory=factory, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def fields_of(section_cls) -> dict[str, tuple[dataclasses.Field, Any]]:
  """`{name: (field, type)}` of a section, with the annotations resolved."""
  hints = typing.get_type_hints(section_cls)
  return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def _as_int(value, where: str) -> int:
  """Ints, integral floats and integer strings; never 1.5, a boolean or text."""
  if isinstance(value, bool):
    raise ConfigError(f"{where} must be an integer, got the boolean {value!r}")
  if isinstance(value, str):
    try:
      value = float(value.strip()) if any(c in value for c in ".eE") else int(value.strip())
    except ValueError:
      raise ConfigError(f"{where} must be an integer, got the string {value!r}") from None
  if isinstance(value, float):
    if not (math.isfinite(value) and value.is_integer()):
      raise ConfigError(f"{where} must be an integer, got {value!r}")
    value = int(value)
  if not isinstance(value, int):
    raise ConfigError(f"{where} must be an integer, got {type(value).__name__} {value!r}")
  return value


def parse_value(value, typ, meta: dict, where: str):
  """`value` checked against a key's type and constraints; returns it normalised. Errors are
  `ConfigError("<where> must ...")`, `where` naming the key as its caller writes it."""
  if meta.get("parse") is not None:
    return meta["parse"](value, where)
  args = typing.get_args(typ)
  if type(None) in args:
    if value is None:
      return None
    typ = next(a for a in args if a is not type(None))
  if typing.get_origin(typ) is tuple:  # tuple[T, ...]: a YAML list, each item a T within the key's bounds
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where} must be a list, got {type(value).__name__} {value!r}")
    return tuple(parse_value(v, typing.get_args(typ)[0], meta, f"{where}[{i}]") for i, v in enumerate(value))
  if typ is dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
      raise ConfigError(f"{where} must be a mapping with string keys, got {type(value).__name__} {value!r}")
    return dict(value)
  if typ is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{where} must be true or false, got {type(value).__name__} {value!r}")
  elif typ is int:
    value = _as_int(value, where)
  elif typ is float:
    value = _number(value, where, allow_none=False)
  elif typ is str:
    choices = meta.get("choices") or ()
    if isinstance(value, bool) and {"on", "off"} <= set(choices):
      value = "on" if value else "off"  # YAML 1.1 reads `on` / `off` as booleans
    if not isinstance(value, str) or not value:
      raise ConfigError(f"{where} must be a non-empty string, got {type(value).__name__} {value!r}")
  choices = meta.get("choices")
  if choices is not None and value not in choices:
    raise ConfigError(f"{where} has invalid value {value!r}; allowed values: {', '.join(choices)}")
  for bound, ok, text in (
    ("ge", lambda v, b: v >= b, ">="),
    ("gt", lambda v, b: v > b, ">"),
    ("le", lambda v, b: v <= b, "<="),
  ):
    b = meta.get(bound)
    if b is not None and not ok(value, b):
      raise ConfigError(f"{where} must be {text} {b}, got {value!r}")
  return value


def validate_fields(obj, where) -> None:
  """Parses every declared field of a frozen dataclass in place (`__post_init__` of a config
  whose fields are `key(...)`s): types, ranges and choices from their metadata. `where(name)`
  names a field in errors. Fields without a `doc` in their metadata are left to the class."""
  for name, (field, typ) in fields_of(type(obj)).items():
    if "doc" in field.metadata:
      object.__setattr__(obj, name, parse_value(getattr(obj, name), typ, field.metadata, where(name)))
