"""Llama (`LlamaForCausalLM`: Llama 2, 3, 3.1, 3.2) on the shared decoder.

No q/k norms; `attention_bias` puts biases on q/k/v and o_proj, `mlp_bias` on the MLP; RoPE is
default or Llama 3's `llama3` frequency scaling (3.1/3.2: `factor`, `low_freq_factor`,
`high_freq_factor`, `original_max_position_embeddings`); embeddings tied (3.2 1B/3B) or not.
"""

from __future__ import annotations

from typing import Any

from trainers.models import decoder, registry
from trainers.models.config import (
  DecoderFeatures,
  ModelConfig,
  RopeScaling,
  common_from_hf,
  common_to_hf,
  model_type_of,
  rope_type,
)

ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
  model_type = model_type_of(d, ARCHITECTURES)
  kind = rope_type(d)
  scaling = None
  if kind == "llama3":
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
      raise ValueError(f"llama3 RoPE scaling without {', '.join(missing)}: {rope!r}")
    scaling = RopeScaling(
      "llama3",
      float(rope["factor"]),
      float(rope["low_freq_factor"]),
      float(rope["high_freq_factor"]),
      int(rope["original_max_position_embeddings"]),
    )
  elif kind != "default":
    raise ValueError(f"RoPE {kind!r} is not supported for llama (default and llama3 are)")
  if d.get("pretraining_tp", 1) not in (1, None):
    raise ValueError(f"pretraining_tp must be 1, got {d['pretraining_tp']!r}")
  fields = common_from_hf({**d, "model_type": model_type})
  return ModelConfig(
    **fields,
    attention_bias=bool(d.get("attention_bias", False)),
    mlp_bias=bool(d.get("mlp_bias", False)),
    rope_scaling=scaling,
  )


def to_hf_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  d = common_to_hf(cfg, ARCHITECTURES[cfg.model_type], dtype)
  d.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    d["rope_parameters"] = {
      "rope_type": s.rope_type,
      "rope_theta": cfg.rope_theta,
      "factor": s.factor,
      "low_freq_factor": s.low_freq_factor,
      "high_freq_factor": s.high_freq_factor,
      "original_max_position_embeddings": s.original_max_position_embeddings,
    }
    d["rope_scaling"] = dict(d["rope_parameters"])  # transformers 4.x / SGLang spelling
  return d


def features(cfg: ModelConfig) -> DecoderFeatures:
  return DecoderFeatures(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)


FAMILY = registry.register(
  registry.Family(
    name="llama",
    architectures=ARCHITECTURES,
    from_hf_dict=from_hf_dict,
    to_hf_dict=to_hf_dict,
    features=features,
    module=decoder.CausalLM,
    hf_name=decoder.hf_name,
    tensor_rules=decoder.TENSOR_RULES,
    fsdp_rules=decoder.FSDP_RULES,
  )
)
