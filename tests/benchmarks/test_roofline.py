"""The model FLOPs of `benchmarks.roofline` against counts made another way, and the measured
limits' shape."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from benchmarks import roofline
from trainers.models import PRESETS, CausalLM

TINY = dataclasses.replace(
  PRESETS["tiny-qwen3"],
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  hidden_size=48,
  intermediate_size=80,
  vocab_size=96,
)


def kernel_count(cfg) -> int:
  """`N` from the model's own parameters: every Linear kernel, and the embedding when it is tied
  (then it is the vocabulary projection too)."""
  state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  total = 0
  for path, var in nnx.to_flat_state(state):
    if path[-1] == "kernel" or (path[0] == "embed_tokens" and cfg.tie_word_embeddings):
      total += int(np.prod(var.get_value().shape))
  return total


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_are_the_models_kernels(tied):
  cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
  assert roofline.matmul_params(cfg) == kernel_count(cfg)


def test_flops_against_a_loop_over_tokens():
  """Per query token at position t (causal): 2 N for the matmuls and 4 L H d (t + 1) for q k and p v."""
  cfg, lens = TINY, [5, 1, 12]
  n, per_key = roofline.matmul_params(cfg), 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
  attention = sum(per_key * (t + 1) for s in lens for t in range(s))
  # The causal count s^2 / 2 the module uses omits the diagonal's half: within s / 2 pairs per sequence.
  expected = 2 * n * sum(lens) + attention - per_key * sum(lens) / 2
  assert roofline.forward_flops(cfg, lens) == pytest.approx(expected)
  assert roofline.train_flops(cfg, lens) == pytest.approx(3 * expected)
  assert roofline.model_flops(cfg, 24, 8) == pytest.approx(roofline.train_flops(cfg, [8, 8, 8]))
  decode = sum(2 * n + per_key * (p + t) for p in (3, 7) for t in range(4))
  assert roofline.decode_flops(cfg, [3, 7], 4) == pytest.approx(decode)


def test_moe_is_refused_by_name():
  with pytest.raises(ValueError, match="tiny-qwen3-moe|qwen3_moe"):
    roofline.matmul_params(PRESETS["tiny-qwen3-moe"])


def test_nominal_peaks_by_device_kind():
  assert roofline.nominal_peak_tflops("NVIDIA H200") == 989.0
  assert roofline.nominal_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert roofline.nominal_peak_tflops("TPU v5 lite") == 197.0
  assert roofline.nominal_peak_tflops("cpu") is None


def test_measured_limits_are_positive_and_fractions_divide():
  limits = roofline.measure(quick=True)
  assert set(limits.matmul_flops) == {"float32", "bfloat16"}
  assert all(f > 0 for f in limits.matmul_flops.values()) and limits.bandwidth > 0
  assert limits.fraction(2e9, 0.5, "float32") == pytest.approx(4e9 / limits.matmul_flops["float32"])
