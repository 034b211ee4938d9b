"""`ModelConfig`: the shared decoder's architecture (`decoder.py`), read from and written to HF
`config.json` by the architecture module registered for its `model_type` (`registry.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (hashable, so a `ModelConfig` stays a valid static/cache key).
  `llama3`: Llama 3.1/3.2's wavelength-dependent scaling (`decoder.rope_inv_freq`)."""

  rope_type: str
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class DecoderFeatures:
  """The switches of the shared decoder an architecture turns on."""

  qkv_bias: bool = False  # biases on q/k/v projections
  o_bias: bool = False  # a bias on o_proj
  mlp_bias: bool = False  # biases on gate/up/down projections
  qk_norm: bool = False  # RMSNorm over the head dimension of q and k before RoPE
  moe: bool = False  # a mixture-of-experts block (router + experts, `trainers.models.moe`) in place of the MLP


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of a registered architecture, in Hugging Face's terms.

  `model_type` selects the architecture module (`registry.family`), which decides the
  `features` (Qwen2: q/k/v biases; Qwen3: q/k norms, `attention_bias` on q/k/v/o; Llama:
  `attention_bias` on q/k/v/o, `mlp_bias`) and owns the HF config mapping.
  """

  model_type: str  # a registered model_type: "qwen2" | "qwen3" | "llama"
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
  attention_bias: bool = False  # Qwen3 / Llama; Qwen2's q/k/v always have a bias.
  initializer_range: float = 0.02
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()
  rope_scaling: RopeScaling | None = None
  mlp_bias: bool = False  # Llama
  # Mixture of experts (Qwen3-MoE): 0 experts is a dense model.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False  # renormalise the top-k gate weights to sum to 1
  router_aux_loss_coef: float = 0.0  # HF's load-balancing coefficient (kept for the round trip)

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def __post_init__(self):
    from trainers.models import registry

    registry.family(self.model_type)  # raises for an unregistered model_type
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
      "head_dim",
      "max_position_embeddings",
    ):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({self.num_key_value_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.num_experts:
      for name in ("num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
          raise ValueError(f"{name} must be a positive int for a mixture-of-experts model, got {getattr(self, name)!r}")
      if self.num_experts_per_tok > self.num_experts:
        raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")

  @property
  def family(self):
    from trainers.models import registry

    return registry.family(self.model_type)

  @property
  def features(self) -> DecoderFeatures:
    return self.family.features(self)

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    """From a HF `config.json` dict, by the architecture registered for its `model_type` (or
    its `architectures` entry)."""
    from trainers.models import registry

    return registry.family_of_hf_dict(d).from_hf_dict(d)

  def to_hf_dict(self, *, dtype: str = "float32") -> dict[str, Any]:
    """A `config.json` dict that transformers and SGLang load as this architecture."""
    return self.family.to_hf_dict(self, dtype)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
    with open(os.path.join(path, "config.json")) as f:
      return cls.from_hf_dict(json.load(f))


def common_from_hf(d: dict[str, Any]) -> dict[str, Any]:
  """The `ModelConfig` fields every decoder architecture spells the same way in `config.json`
  (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
  if d.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act must be 'silu', got {d['hidden_act']!r}")
  rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
  heads = d["num_attention_heads"]
  eos = d.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  return dict(
    model_type=d["model_type"],
    vocab_size=d["vocab_size"],
    hidden_size=d["hidden_size"],
    intermediate_size=d["intermediate_size"],
    num_hidden_layers=d["num_hidden_layers"],
    num_attention_heads=heads,
    num_key_value_heads=d.get("num_key_value_heads") or heads,
    head_dim=d.get("head_dim") or d["hidden_size"] // heads,
    max_position_embeddings=d["max_position_embeddings"],
    rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
    rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
    tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    initializer_range=float(d.get("initializer_range", 0.02)),
    bos_token_id=d.get("bos_token_id"),
    eos_token_id=eos,
  )


def model_type_of(d: dict[str, Any], architectures: dict[str, str]) -> str:
  """`d["model_type"]` when a family serves it, else the one of its `architectures` entry."""
  if d.get("model_type") in architectures:
    return d["model_type"]
  by_arch = {a: t for t, a in architectures.items()}
  return next(by_arch[a] for a in d.get("architectures") or () if a in by_arch)


def rope_type(d: dict[str, Any]) -> str:
  rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
  return rope.get("rope_type", rope.get("type", "default"))


def common_to_hf(cfg: ModelConfig, architecture: str, dtype: str) -> dict[str, Any]:
  """The `config.json` keys every decoder architecture shares."""
  return {
    "architectures": [architecture],
    "model_type": cfg.model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_hidden_layers,
    "num_attention_heads": cfg.num_attention_heads,
    "num_key_value_heads": cfg.num_key_value_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_position_embeddings,
    "rms_norm_eps": cfg.rms_norm_eps,
    # Both spellings: transformers 4.x and SGLang read `rope_theta`, transformers 5.x
    # reads `rope_parameters`.
    "rope_theta": cfg.rope_theta,
    "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "attention_dropout": 0.0,
    "initializer_range": cfg.initializer_range,
    "use_cache": True,
    "torch_dtype": dtype,
    "dtype": dtype,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": (list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0])
    if cfg.eos_token_id
    else None,
  }
