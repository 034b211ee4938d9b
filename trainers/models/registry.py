"""The model registry: `model_type` (and HF `architectures`) → the architecture module that owns
its HF config mapping, its HF weight names, its module and its partition rules.

An architecture is one module that builds a `Family` and calls `register` (see `qwen.py`,
`llama.py`), plus its import in `trainers/models/__init__.py`. Everything else — loading and
saving HF checkpoints, the server, the trainer's mesh — asks the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

_FAMILIES: dict[str, "Family"] = {}
_BY_ARCHITECTURE: dict[str, "Family"] = {}


@dataclasses.dataclass(frozen=True)
class Family:
  """One architecture family.

  Attributes:
    name: the family's name (e.g. "qwen").
    architectures: `{model_type: HF architectures name}` this family serves.
    from_hf_dict: HF `config.json` dict → `ModelConfig` (raises `ValueError` naming what is unsupported).
    to_hf_dict: `(ModelConfig, dtype)` → `config.json` dict.
    features: `ModelConfig` → `DecoderFeatures` (the shared decoder's switches).
    module: the NNX module class, built as `module(cfg, rngs=..., **model_kwargs)`.
    hf_name: parameter path → `(HF name with "{i}" for the layer, transposed?)`.
    tensor_rules, fsdp_rules: partition rules keyed by the last two components of a parameter
      path (`trainers.runtime.parallel.param_spec`).
    hf_views: optional `(stored names, shape_of) -> {name: (stored name, view)}`: tensors a
      checkpoint may store fused, read as the per-tensor names of `hf_name` (`view.shape`,
      `view.index(index) -> stored index`).
  """

  name: str
  architectures: dict[str, str]
  from_hf_dict: Callable[[dict[str, Any]], Any]
  to_hf_dict: Callable[[Any, str], dict[str, Any]]
  features: Callable[[Any], Any]
  module: type
  hf_name: Callable[[tuple], tuple[str, bool]]
  tensor_rules: dict
  fsdp_rules: dict
  hf_views: Callable | None = None


def register(family: Family) -> Family:
  for model_type, architecture in family.architectures.items():
    if model_type in _FAMILIES:
      raise ValueError(f"model_type {model_type!r} is registered twice ({_FAMILIES[model_type].name}, {family.name})")
    _FAMILIES[model_type] = family
    _BY_ARCHITECTURE[architecture] = family
  return family


def model_types() -> list[str]:
  return sorted(_FAMILIES)


def family(model_type: str) -> Family:
  if model_type not in _FAMILIES:
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {model_types()}")
  return _FAMILIES[model_type]


def family_of_hf_dict(d: dict[str, Any]) -> Family:
  """The family of a HF config dict: by `model_type`, else by its first `architectures` entry."""
  model_type = d.get("model_type")
  if model_type in _FAMILIES:
    return _FAMILIES[model_type]
  for architecture in d.get("architectures") or ():
    if architecture in _BY_ARCHITECTURE:
      return _BY_ARCHITECTURE[architecture]
  raise ValueError(
    f"unsupported model_type {model_type!r} (architectures {d.get('architectures')}); supported: {model_types()}"
  )
