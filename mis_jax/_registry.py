"""Registries of named choices, each with a frozen config of its own keys: a tagged union.

A choice (a policy-loss form, an advantage estimator) is a name, a :class:`ChoiceConfig` subclass
(a frozen dataclass whose fields are ``key(...)``: default, meaning, constraints) and a function. A
config names it as a mapping ``{name: NAME, <its own keys>}``, by the bare name (its defaults), or
as an instance of its config class; :meth:`Registry.config_of` reads any of the three. A new choice
is one function, its config and a registration (the ``register_*`` decorators of
:mod:`mis_jax.forms` and :mod:`mis_jax.estimators`); every table of names is a view of the
registry, so nothing else is edited.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Mapping

from mis_jax._keys import ConfigError, _closest, validate_fields


@dataclasses.dataclass(frozen=True)
class ChoiceConfig:
  """The keys of one registered choice. Subclass it as a frozen dataclass of ``key(...)`` fields; the
  registration binds its :attr:`name` (one class per choice: subclass another choice's to share keys).
  Hashable, so a config holding it stays a static jit argument."""

  name: ClassVar[str] = ""
  KEY: ClassVar[str] = ""  # the config key that names the choice (`policy_loss`, `estimator`), for errors

  def __post_init__(self):
    validate_fields(self, lambda k: f"key '{self.KEY}.{k}'")  # types, choices, ranges of the keys

  @classmethod
  def keys(cls) -> tuple[str, ...]:
    """The choice's own keys, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))

  def to_dict(self) -> dict[str, Any]:
    """``{"name": NAME, <its keys>}``: what :meth:`Registry.config_of` reads back to an equal config."""
    return {"name": self.name, **{k: getattr(self, k) for k in self.keys()}}


def _config_class(name: str, base: type, module: str) -> type:
  """The config of a choice without keys of its own: an empty subclass of ``base`` named after it, in the
  module of the choice's function."""
  cls_name = "".join(part.capitalize() for part in name.split("_")) + "Config"
  namespace = {"__doc__": f"``{name}`` has no keys of its own.", "__module__": module}
  return dataclasses.dataclass(frozen=True)(type(cls_name, (base,), namespace))


class Registry(Mapping):
  """The registered choices of one kind, by name (in registration order): ``registry[name]`` is the
  registration (with its ``name``, ``config`` class and ``fn``).

  Args:
    key: the config key that names a choice (``policy_loss``), in error messages.
    kind: what a choice is, in words (``policy-loss form``).
    base: the :class:`ChoiceConfig` subclass every choice's config derives from.
    reserved: the names no choice's key may take (the keys beside it in its parent config), read
      when a choice registers.
  """

  def __init__(self, key: str, kind: str, base: type, reserved: Callable[[], Iterable[str]] = tuple):
    self.key, self.kind, self.base, self._reserved = key, kind, base, reserved
    self._entries: dict[str, Any] = {}
    self._on_unregister: list[Callable] = []

  def __getitem__(self, name):
    return self._entries[name]

  def __iter__(self):
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def __repr__(self) -> str:
    return f"<{self.kind} registry: {', '.join(self._entries)}>"

  def add(self, entry):
    """Registers ``entry`` (its ``name``, ``config`` class or None, ``fn``) and binds its config's
    name; returns the entry as registered (a keyless choice gets an empty config class)."""
    name = entry.name
    if not isinstance(name, str) or not name.isidentifier():
      raise ValueError(f"a {self.kind}'s name must be an identifier (it is a config value), got {name!r}")
    if name in self._entries:
      raise ValueError(
        f"{self.kind} '{name}' is registered already (by {_qualname(self._entries[name].fn)}); "
        "register yours under another name"
      )
    module = getattr(entry.fn, "__module__", None) or __name__
    config = _config_class(name, self.base, module) if entry.config is None else entry.config
    if not (
      isinstance(config, type)
      and issubclass(config, self.base)
      and dataclasses.is_dataclass(config)
      and config.__dataclass_params__.frozen
    ):
      raise TypeError(
        f"{self.kind} '{name}': its config must be a frozen dataclass subclassing {self.base.__name__}, got {config!r}"
      )
    if config.__dict__.get("name"):
      raise ValueError(
        f"{self.kind} '{name}': {config.__name__} is the config of '{config.name}' already; give "
        "each choice its own class (a subclass shares the keys)"
      )
    clash = sorted(set(config.keys()) & {"name", *self._reserved()})
    if clash:
      raise ValueError(
        f"{self.kind} '{name}': key(s) {', '.join(clash)} are taken by the config that names it "
        f"(`{self.key}` sits beside them); name its own keys otherwise"
      )
    config.name = name
    entry = entry._replace(config=config)
    self._entries[name] = entry
    return entry

  def unregister(self, name: str):
    """Removes the registration called ``name`` and returns it (a test's or a notebook's own choice, to be
    registered again); its config class can then be registered anew."""
    entry = self._entries.pop(name)
    del entry.config.name
    for hook in self._on_unregister:
      hook(entry)
    return entry

  def on_unregister(self, hook: Callable) -> None:
    """Calls ``hook(entry)`` when a choice is unregistered (what its registration declared elsewhere goes
    with it)."""
    self._on_unregister.append(hook)

  def lookup(self, name, path: str):
    """The registration called ``name``; otherwise a :class:`ConfigError` naming the key ``path`` and
    listing the registered names."""
    if isinstance(name, str) and name in self._entries:
      return self._entries[name]
    hint = _closest(name, self._entries) if isinstance(name, str) else ""
    raise ConfigError(
      f"key '{path}' has invalid value {name!r}; allowed values: {', '.join(self._entries)}.{hint}".rstrip(".")
    )

  def config_of(self, value, path: str | None = None):
    """A choice's config from a registered config instance, a name (its defaults) or a mapping
    ``{name: NAME, <its keys>}``; errors name the key ``path`` (default: the registry's key)."""
    path = self.key if path is None else path
    if isinstance(value, self.base):
      entry = self.lookup(value.name, f"{path}.name")
      if type(value) is not entry.config:
        raise ConfigError(
          f"key '{path}': a {type(value).__name__} is not the config of '{value.name}' ({entry.config.__name__})"
        )
      return value
    if isinstance(value, str):
      return self.lookup(value, path).config()
    if not isinstance(value, Mapping):
      raise ConfigError(
        f"key '{path}' must be a {self.kind}'s name, a mapping {{name: NAME, <its keys>}} or its "
        f"config, got {type(value).__name__} {value!r}"
      )
    if "name" not in value:
      raise ConfigError(f"key '{path}' needs name: one of {', '.join(self._entries)}")
    entry = self.lookup(value["name"], f"{path}.name")
    own = entry.config.keys()
    for k in value:
      if k != "name" and k not in own:
        raise ConfigError(self.misplaced(k, entry.name, f"{path}.{k}"))
    return entry.config(**{k: v for k, v in value.items() if k != "name"})

  def owners(self, key: str) -> list[str]:
    """The choices that have a key called ``key``."""
    return [name for name, entry in self._entries.items() if key in entry.config.keys()]

  def misplaced(self, key: str, name: str, path: str) -> str:
    """The error for ``key`` (at ``path``) written beside ``name``, which has no such key: the choices
    that have it, or the closest key of ``name``'s."""
    own = self._entries[name].config.keys()
    listed = f"{name}'s keys: {', '.join(own)}" if own else f"{name} has no keys of its own"
    owners = self.owners(key)
    if owners:
      return f"key '{path}' is a key of {self.key} {' / '.join(owners)}, not of {name} ({listed})"
    return f"unknown key '{path}'.{_closest(str(key), own)} {listed}, beside name"

  def where(self, predicate: Callable) -> "Subset":
    """A live view of the registrations for which ``predicate(entry)`` holds."""
    return Subset(self, predicate)

  def own_keys(self) -> "OwnKeys":
    """A live view ``{name: its own keys}``."""
    return OwnKeys(self)


class Subset(Mapping):
  """The registrations of a registry that satisfy a predicate, as they are now (a later registration
  shows)."""

  def __init__(self, registry: Registry, predicate: Callable):
    self._registry, self._predicate = registry, predicate

  def __getitem__(self, name):
    entry = self._registry[name]
    if not self._predicate(entry):
      raise KeyError(name)
    return entry

  def __iter__(self):
    return (name for name, entry in self._registry.items() if self._predicate(entry))

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __repr__(self) -> str:
    return f"<{', '.join(self)}>"


class OwnKeys(Mapping):
  """``{name: the keys of its config}`` over a registry, as it is now."""

  def __init__(self, registry: Registry):
    self._registry = registry

  def __getitem__(self, name) -> tuple[str, ...]:
    return self._registry[name].config.keys()

  def __iter__(self):
    return iter(self._registry)

  def __len__(self) -> int:
    return len(self._registry)

  def __repr__(self) -> str:
    return repr(dict(self))


def _qualname(fn) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
