"""Qwen3-MoE (`Qwen3MoeForCausalLM`, `model_type: qwen3_moe`: the Qwen3-30B-A3B / 235B-A22B
family) on the shared decoder, its MLP replaced by a mixture-of-experts block in every layer
(`trainers.models.moe`: router `mlp.gate`, experts `mlp.experts.{e}.{gate,up,down}_proj`).

Attention is Qwen3's (q/k RMSNorm, optional `attention_bias`). The HF config names the expert
count `num_experts` (transformers 4.x, SGLang) or `num_local_experts` (transformers 5.x); both
are read and both written. The shared partition rules apply inside an expert (its FFN columns
split over `tensor`); the expert axis of `[L, E, in, out]` is split over the mesh's `expert`
axis (`trainers.runtime.parallel.param_spec`). Layouts that mix dense and MoE layers (`mlp_only_layers`,
`decoder_sparse_step > 1`) are refused: the stacked layer scan needs one layer structure, and
the published checkpoints of this family are MoE in every layer.

Weights load from per-expert tensors (`experts.{e}.gate_proj.weight`, what `save_pretrained`
writes) or transformers' fused `experts.gate_up_proj [E, 2·ffn, H]` / `experts.down_proj
[E, H, ffn]`, and are saved per expert.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from trainers.models import decoder, registry
from trainers.models.config import DecoderFeatures, ModelConfig, common_from_hf, common_to_hf, rope_type

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
  if d.get("use_sliding_window"):
    raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
  if rope_type(d) != "default":
    raise ValueError(
      f"only default RoPE is supported for qwen3_moe, got {d.get('rope_parameters') or d.get('rope_scaling')!r}"
    )
  experts = d.get("num_experts", d.get("num_local_experts"))
  if not isinstance(experts, int) or experts < 1:
    raise ValueError(f"qwen3_moe config needs num_experts (or num_local_experts) >= 1, got {experts!r}")
  for key in ("num_experts_per_tok", "moe_intermediate_size"):
    if key not in d:
      raise ValueError(f"qwen3_moe config has no {key}")
  dense = sorted(set(d.get("mlp_only_layers") or []))
  step = d.get("decoder_sparse_step", 1) or 1
  if step != 1:
    dense = sorted(set(dense) | {i for i in range(d["num_hidden_layers"]) if (i + 1) % step})
  if dense:
    raise ValueError(
      f"mixed dense/MoE layers are not supported (mlp_only_layers {d.get('mlp_only_layers')!r}, "
      f"decoder_sparse_step {step}: layers {dense[:8]} would be dense); every layer must be MoE "
      "(mlp_only_layers: [], decoder_sparse_step: 1)"
    )
  fields = common_from_hf(
    {**d, "model_type": "qwen3_moe", "intermediate_size": d.get("intermediate_size") or d["moe_intermediate_size"]}
  )
  return ModelConfig(
    **fields,
    attention_bias=bool(d.get("attention_bias", False)),
    num_experts=experts,
    num_experts_per_tok=int(d["num_experts_per_tok"]),
    moe_intermediate_size=int(d["moe_intermediate_size"]),
    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
    router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
  )


def to_hf_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  d = common_to_hf(cfg, ARCHITECTURES[cfg.model_type], dtype)
  d.update(
    use_sliding_window=False,
    attention_bias=cfg.attention_bias,
    num_experts=cfg.num_experts,
    num_local_experts=cfg.num_experts,
    num_experts_per_tok=cfg.num_experts_per_tok,
    moe_intermediate_size=cfg.moe_intermediate_size,
    norm_topk_prob=cfg.norm_topk_prob,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=cfg.router_aux_loss_coef,
    output_router_logits=False,
  )
  return d


def features(cfg: ModelConfig) -> DecoderFeatures:
  return DecoderFeatures(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, moe=True)


@dataclasses.dataclass(frozen=True)
class _FusedView:
  """One expert's `[out, in]` block of a fused `[E, rows, in]` tensor, starting at row `row0`."""

  expert: int
  row0: int
  shape: tuple[int, int]

  def index(self, index: tuple) -> tuple:
    rows, cols = (slice(*s.indices(n)) for s, n in zip(index, self.shape))
    return (self.expert, slice(self.row0 + rows.start, self.row0 + rows.stop), cols)


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_views(names, shape_of) -> dict:
  """Per-expert names → views into transformers' fused expert tensors, when the files hold them."""
  views = {}
  for name in names:
    m = _FUSED.match(name)
    if not m:
      continue
    prefix, kind = m.groups()
    num_experts, rows, cols = shape_of(name)
    for e in range(num_experts):
      if kind == "down_proj":
        views[f"{prefix}.{e}.down_proj.weight"] = (name, _FusedView(e, 0, (rows, cols)))
      else:
        half = rows // 2
        views[f"{prefix}.{e}.gate_proj.weight"] = (name, _FusedView(e, 0, (half, cols)))
        views[f"{prefix}.{e}.up_proj.weight"] = (name, _FusedView(e, half, (half, cols)))
  return views


FAMILY = registry.register(
  registry.Family(
    name="qwen3_moe",
    architectures=ARCHITECTURES,
    from_hf_dict=from_hf_dict,
    to_hf_dict=to_hf_dict,
    features=features,
    module=decoder.CausalLM,
    hf_name=decoder.hf_name,
    tensor_rules=decoder.TENSOR_RULES,
    fsdp_rules=decoder.FSDP_RULES,
    hf_views=hf_views,
  )
)
