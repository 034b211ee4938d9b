"""Weight-only quantisation of a served model: int8 or fp8 (e4m3fn), per-output-channel scales.

What an inference engine does to serve a model cheaply, and so one controlled source of the
rollout/trainer mismatch (the trainer keeps float32 weights). For every Linear kernel
`W [..., in, out]` (attention q/k/v/o, MLP gate/up/down, an untied `lm_head`; layer-stacked
kernels get one scale per layer and output channel), with `amax = max_in |W|` per output channel:

    int8: s = amax / 127,  W_q = clip(round(W / s), -127, 127)            (symmetric)
    fp8:  s = amax / 448,  W_q = float8_e4m3fn(W / s)                      (448: e4m3fn's max)
    served weight  W' = W_q * s, computed in float32, then cast to the engine's dtype

Embeddings, norms, biases and a mixture of experts' router are left in the engine's dtype, as
in SGLang's weight-only schemes. The served model computes `x @ W'`, which is what a fused dequantising kernel
computes too (up to the order of the scale multiply); memory is not saved here, the numbers
are the point. An all-zero channel gets scale 1 (its weights stay 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

QUANTIZATIONS = ("none", "int8", "fp8")
_INT8_MAX = 127.0
_FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def quantize_kernel(w, method: str) -> np.ndarray:
  """`W [..., in, out]` → the float32 dequantised `W_q * s` (per-output-channel `s`)."""
  if method not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
  w = np.asarray(w, np.float32)
  if method == "none":
    return w
  if w.ndim < 2:
    raise ValueError(f"a kernel [..., in, out] is needed, got shape {w.shape}")
  amax = np.max(np.abs(w), axis=-2, keepdims=True)
  top = _INT8_MAX if method == "int8" else _FP8_MAX
  scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
  if method == "int8":
    q = np.clip(np.rint(w / scale), -_INT8_MAX, _INT8_MAX)
  else:
    q = np.asarray(jnp.asarray(w / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32))
  return (q * scale).astype(np.float32)


def is_quantized_param(path: tuple) -> bool:
  """Linear kernels are quantised (a mixture of experts' expert kernels `[L, E, in, out]` per
  layer, expert and output channel); embeddings, norm weights, biases and the MoE router
  (`mlp.gate`, which SGLang's Qwen3-MoE keeps unquantised under fp8) are not."""
  return str(path[-1]) == "kernel" and not (len(path) >= 2 and str(path[-2]) == "gate")


def quantize_params(state: nnx.State, method: str, *, dtype=jnp.float32) -> nnx.State:
  """The parameter `state` (float32 values, as read from the checkpoint) with every Linear
  kernel replaced by its dequantised `W_q * s` and every leaf cast to `dtype`."""
  if method not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
  out = []
  for path, var in nnx.to_flat_state(state):
    x = var.get_value()
    if is_quantized_param(path) and method != "none":
      x = quantize_kernel(jax.device_get(x), method)
    out.append((path, var.replace(jnp.asarray(x, jnp.float32).astype(dtype))))
  return nnx.from_flat_state(out)
