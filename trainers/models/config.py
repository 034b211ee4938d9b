"""Architecture config of the Qwen2 / Qwen3 decoder, read from and written to HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Qwen2 or Qwen3 decoder-only transformer, in Hugging Face's terms.

  The two families differ in two places only: Qwen2 has biases on the q/k/v projections
  (`attention_bias` is implied True) and no q/k norms; Qwen3 applies an RMSNorm over the head
  dimension to queries and keys before RoPE (`qk_norm`) and takes `attention_bias` (also on
  `o_proj`) from the config, default False.
  """

  model_type: str  # "qwen2" | "qwen3"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  max_position_embeddings: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen3 only; Qwen2's q/k/v always have a bias.
  initializer_range: float = 0.02
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()

  def __post_init__(self):
    if self.model_type not in _ARCHITECTURES:
      raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {self.model_type!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                       f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def qkv_bias(self) -> bool:
    return self.model_type == "qwen2" or self.attention_bias

  @property
  def o_bias(self) -> bool:
    return self.model_type == "qwen3" and self.attention_bias

  @property
  def qk_norm(self) -> bool:
    return self.model_type == "qwen3"

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    """Reads a HF `config.json` dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
    model_type = d.get("model_type")
    if model_type not in _ARCHITECTURES:
      raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
    if d.get("use_sliding_window"):
      raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act must be 'silu', got {d['hidden_act']!r}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
      raise ValueError(f"only default RoPE is supported, got {rope!r}")
    rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    heads = d["num_attention_heads"]
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return cls(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        max_position_embeddings=d["max_position_embeddings"],
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)) and model_type == "qwen3",
        initializer_range=float(d.get("initializer_range", 0.02)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
    )

  def to_hf_dict(self, *, dtype: str = "float32") -> dict[str, Any]:
    """A `config.json` dict that transformers and SGLang load as this architecture."""
    d = {
        "architectures": [_ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        # Both spellings: transformers 4.x and SGLang read `rope_theta`, transformers 5.x
        # reads `rope_parameters`.
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": self.initializer_range,
        "use_cache": True,
        "use_sliding_window": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_id) if len(self.eos_token_id) != 1
                         else self.eos_token_id[0]) if self.eos_token_id else None,
    }
    if self.model_type == "qwen3":
      d["attention_bias"] = self.attention_bias
    return d

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
    with open(os.path.join(path, "config.json")) as f:
      return cls.from_hf_dict(json.load(f))


def _tiny(model_type: str, **overrides) -> ModelConfig:
  base = dict(
      model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
      bos_token_id=1, eos_token_id=(2,))
  base.update(overrides)
  return ModelConfig(**base)


# Tiny presets for tests and the demo: 2 layers, hidden 64, GQA 4:2, a 64-token vocabulary
# whose ids 0/1/2 are pad/bos/eos.
PRESETS: dict[str, ModelConfig] = {
    "tiny-qwen2": _tiny("qwen2"),
    "tiny-qwen3": _tiny("qwen3"),
    "tiny-qwen3-untied": _tiny("qwen3", tie_word_embeddings=False),
}
