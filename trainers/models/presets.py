"""Tiny presets for tests, the demo and `mis-jax init-model`: 2 layers, hidden 64, GQA 4:2, a
64-token vocabulary whose ids 0/1/2 are pad/bos/eos."""

from __future__ import annotations

from trainers.models import llama, qwen, qwen_moe  # noqa: F401 - the architectures the presets use are registered
from trainers.models.config import ModelConfig, RopeScaling


def _tiny(model_type: str, **overrides) -> ModelConfig:
  base = dict(
    model_type=model_type,
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=(2,),
  )
  base.update(overrides)
  return ModelConfig(**base)


PRESETS: dict[str, ModelConfig] = {
  "tiny-qwen2": _tiny("qwen2"),
  "tiny-qwen3": _tiny("qwen3"),
  "tiny-qwen3-untied": _tiny("qwen3", tie_word_embeddings=False),
  # 128-wide heads: sglang-jax's CPU attention pads head_dim to 128 (rollout.placement.engine: sglang-jax).
  "tiny-qwen3-hd128": _tiny("qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=128),
  # Llama 3.1's RoPE scaling, compressed to the tiny context (original 64 of 512 positions).
  "tiny-llama3": _tiny(
    "llama",
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
  ),
  # Qwen3-MoE in miniature: 8 experts, top-2, renormalised (as Qwen3-30B-A3B), expert FFN 32.
  "tiny-qwen3-moe": _tiny(
    "qwen3_moe",
    tie_word_embeddings=False,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
  ),
}
