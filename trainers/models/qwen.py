"""Qwen2 and Qwen3 (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`) on the shared decoder.

The two differ from each other in two places: Qwen2 has biases on the q/k/v projections and
no q/k norms; Qwen3 applies an RMSNorm over the head dimension to queries and keys before RoPE
and takes `attention_bias` (q/k/v and o_proj) from the config, default False. Both use default
RoPE and no sliding window here.
"""

from __future__ import annotations

from typing import Any

from trainers.models import decoder, registry
from trainers.models.config import DecoderFeatures, ModelConfig, common_from_hf, common_to_hf, model_type_of, rope_type

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
  model_type = model_type_of(d, ARCHITECTURES)
  if d.get("use_sliding_window"):
    raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
  if rope_type(d) != "default":
    raise ValueError(
      f"only default RoPE is supported for {model_type}, got {d.get('rope_parameters') or d.get('rope_scaling')!r}"
    )
  fields = common_from_hf({**d, "model_type": model_type})
  return ModelConfig(**fields, attention_bias=bool(d.get("attention_bias", False)) and model_type == "qwen3")


def to_hf_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  d = common_to_hf(cfg, ARCHITECTURES[cfg.model_type], dtype)
  d["use_sliding_window"] = False
  if cfg.model_type == "qwen3":
    d["attention_bias"] = cfg.attention_bias
  return d


def features(cfg: ModelConfig) -> DecoderFeatures:
  qwen3 = cfg.model_type == "qwen3"
  return DecoderFeatures(qkv_bias=not qwen3 or cfg.attention_bias, o_bias=qwen3 and cfg.attention_bias, qk_norm=qwen3)


FAMILY = registry.register(
  registry.Family(
    name="qwen",
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
