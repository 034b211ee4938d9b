"""The decoder-only transformer every registered architecture shares (Qwen2, Qwen3, Qwen3-MoE, Llama),
in Flax NNX, numerically matching Hugging Face. An architecture module (`qwen.py`, `llama.py`)
maps its HF config onto `ModelConfig` and registers itself (`registry.py`); the blocks here
(RMSNorm, RoPE with its scalings, grouped-query attention, the SwiGLU MLP) are reused by all.

One forward serves training and inference:

- packed training forward, `model(input_ids, positions, segment_ids)`: a token attends to the
  earlier tokens of its own segment only (segment-aware causal mask), so one row holds several
  sequences with no cross-attention and per-segment RoPE positions;
- cached decoding, `model.decode(input_ids, cache, slot=, start=)`: one sequence per row, the rows
  aligned in one cache layout (prompts left-padded: row `b`'s tokens fill slots `start[b]..`), so a
  step writes every row's new keys and values with one in-place `dynamic_update_slice` at one
  slot, and a query in slot `s` attends to slots `start[b]..s` of the first `window` slots only.

The decoder layers are stacked (every layer parameter has a leading `num_hidden_layers` axis)
and run by one `lax.scan`, so a 28-layer model compiles one layer body; the scan body can be
rematerialised (`remat`: activations recomputed in the backward pass, per `REMAT_POLICIES`).
The training forward's attention backend is `attention` (`trainers.models.attention`): `dense`
(the reference, a `[T, T]` mask), `blocked` (flash-style, memory O(T)) or `fused` (a platform
kernel where one exists, else `blocked`). `hidden_states` stops before the LM head so a trainer
can compute log-probs chunk by chunk (`mis_jax.token_logprobs`) without `[T, V]` logits.

Layer (pre-norm): `h = x + Attn(RMSNorm(x))`, `y = h + W_down(silu(W_gate RMSNorm(h)) * W_up RMSNorm(h))`,
with `RMSNorm(x) = w * x / sqrt(mean(x²) + eps)` computed in float32, RoPE
`x·cos(pθ) + rotate_half(x)·sin(pθ)`, `θ_i = theta^(-2i/head_dim)`, grouped-query attention
`softmax(q kᵀ / sqrt(head_dim) + mask) v` with the softmax in float32. Per architecture
(`ModelConfig.features`): biases on q/k/v (Qwen2, optional on Qwen3 and Llama), on o_proj
(Qwen3 and Llama with `attention_bias`) and on the MLP (Llama's `mlp_bias`); an RMSNorm over the
head dimension of q and k before RoPE (Qwen3); Llama 3's RoPE frequency scaling (`llama3`).

The parameter tree mirrors HF's module tree, so one name map (`hf_name`) and one set of
partition rules (`TENSOR_RULES`, `FSDP_RULES`) serve every architecture built on it.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from trainers.models import invariant
from trainers.models.attention import ATTENTION_BACKENDS, dense_attention, packed_attention, segment_mask
from trainers.models.config import ModelConfig
from trainers.models.moe import MOE_DISPATCH, SparseMoeBlock, load_balancing_loss

# How the stacked layers run: one `lax.scan` over them (one compiled layer body: the compile time
# and program size of a deep model do not grow with its depth) or a loop unrolled at trace time
# (each layer its own code: XLA lays out and fuses each layer's backward on its own, with no
# stacked residual buffers sliced per iteration; the update 19 % faster at 4 layers on XLA:CPU,
# docs/performance.md). `auto` (`resolve_layer_loop`): unrolled up to `UNROLL_MAX_LAYERS` layers.
LAYER_LOOPS = ("scan", "unrolled")
UNROLL_MAX_LAYERS = 8


def resolve_layer_loop(setting: str, num_layers: int) -> tuple[str, str]:
  """`(loop, why)` for a configured `setting` (`auto` or one of `LAYER_LOOPS`)."""
  if setting in LAYER_LOOPS:
    return setting, "configured"
  if setting != "auto":
    raise ValueError(f"layer_loop={setting!r}; allowed: auto, {', '.join(LAYER_LOOPS)}")
  if num_layers <= UNROLL_MAX_LAYERS:
    return "unrolled", f"{num_layers} layers <= {UNROLL_MAX_LAYERS}"
  return "scan", f"{num_layers} layers > {UNROLL_MAX_LAYERS}: one compiled layer body"


def _unrolled(body, carry, xs):
  """`lax.scan(body, carry, xs)` as a loop unrolled at trace time (static slices of `xs`)."""
  ys = []
  for i in range(jax.tree.leaves(xs)[0].shape[0]):
    carry, y = body(carry, jax.tree.map(lambda a: a[i], xs))
    ys.append(y)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


# Activation checkpointing of the layer scan body: what the backward pass may keep.
REMAT_POLICIES = {
  "none": None,  # keep everything
  "full": jax.checkpoint_policies.nothing_saveable,  # keep only layer inputs
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projections' outputs
}


class Routing(NamedTuple):
  """A mixture-of-experts forward's routing: `native [B, T, num_layers, k]` int32 (each layer's
  router top-k, whatever was replayed) and HF's load-balancing `aux_loss` (float32 scalar)."""

  native: jax.Array
  aux_loss: jax.Array


class LayerCache(NamedTuple):
  """Keys and values of every layer, `[num_layers, batch, cache_len, num_key_value_heads, head_dim]`."""

  k: jax.Array
  v: jax.Array


class CacheSlots(NamedTuple):
  """One decoding layer's view of the stacked cache (`k, v` `[L, B, S, KV, D]`): its new keys
  and values go to slots `slot ..` of layer `layer` (one slot for all rows: an aligned layout),
  and it attends over the first `window` slots (static)."""

  k: jax.Array
  v: jax.Array
  layer: jax.Array
  slot: jax.Array
  window: int

  def write(self, k: jax.Array, v: jax.Array) -> "CacheSlots":
    """`k, v [B, T, KV, D]` into slots `slot .. slot + T - 1`: one in-place update per array."""
    at = (self.layer, 0, self.slot, 0, 0)
    put = lambda c, new: jax.lax.dynamic_update_slice(c, _stored(new, c.dtype)[None], at)
    return self._replace(k=put(self.k, k), v=put(self.v, v))

  def read(self, dtype) -> tuple[jax.Array, jax.Array]:
    """This layer's first `window` slots, `[B, window, KV, D]` each, in `dtype`."""
    _, b, _, kv, d = self.k.shape
    take = lambda c: _loaded(jax.lax.dynamic_slice(c, (self.layer, 0, 0, 0, 0), (1, b, self.window, kv, d))[0], dtype)
    return take(self.k), take(self.v)


# A 16-bit float cache is stored as its bits (uint16): XLA:CPU updates a bfloat16 buffer by
# converting all of it to float32 and back (the whole cache, every layer and step), an integer
# one in place. Elsewhere the bitcast is free.
def _storage_dtype(dtype):
  return jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype)


def _stored(x: jax.Array, storage) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, storage) if storage == jnp.uint16 else x.astype(storage)


def _loaded(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x.astype(dtype)


# An engine holds its bfloat16 weights as their bits (`WEIGHT_BITS`, `weight_bits`), as it holds its
# cache and for the same reason: XLA:CPU slices (or gathers from) a bfloat16 array by converting
# all of it to float32, and the conversion of weights that do not change during a call is hoisted
# out of the decoding loops into a float32 copy of the whole model (3.6 GB of temporaries beside
# Qwen3-0.6B's 1.2 GB of weights). `decode` reads such weights a piece at a time, converting each
# piece as it is used: a layer's weights in its turn, the embedding's rows of the tokens, the output
# projection in `DECODE_VOCAB_CHUNK`-row chunks. The training forward never sees bits.
WEIGHT_BITS = jnp.uint16
DECODE_VOCAB_CHUNK = 8192


def weight_bits(state):
  """`state` (arrays or `jax.ShapeDtypeStruct`s) with its bfloat16 leaves as their bits (`WEIGHT_BITS`)."""

  def bits(a):
    if a.dtype != jnp.bfloat16:
      return a
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape, WEIGHT_BITS, sharding=a.sharding)
    return jax.lax.bitcast_convert_type(a, WEIGHT_BITS)

  return jax.tree.map(bits, state)


def from_weight_bits(x):
  """A weight held as its bits (`WEIGHT_BITS`) as the bfloat16 it is; anything else as it is."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding) if x.dtype == WEIGHT_BITS else x
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == WEIGHT_BITS else x


def _expand(x: jax.Array, ndim: int) -> jax.Array:
  """Lifts a trailing-axis vector to rank `ndim` (explicit, so rank promotion can stay 'raise')."""
  return x.reshape((1,) * (ndim - x.ndim) + x.shape)


class RMSNorm(nnx.Module):
  """`w * x / sqrt(mean(x², -1) + eps)`, normalised in float32 then cast back, as in HF."""

  def __init__(self, dim: int, *, eps: float, dtype, param_dtype, arithmetic: str = "default"):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype
    self.arithmetic = arithmetic

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.arithmetic == "batch_invariant":
      return invariant.rms_norm(x, from_weight_bits(self.weight[...]), self.eps, self.dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return _expand(from_weight_bits(self.weight[...]).astype(self.dtype), x.ndim) * x32.astype(self.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """float32 `θ_i = theta^(-2i/head_dim)`, scaled as `cfg.rope_scaling` says (computed in float32
  NumPy as transformers computes it in float32 torch).

  `llama3` (Llama 3.1/3.2): wavelengths `2π/θ` longer than `original / low_freq_factor` are
  divided by `factor`, shorter than `original / high_freq_factor` kept, and those between
  interpolated with `s = (original / wavelength - low) / (high - low)`: `(1 - s) θ / factor + s θ`.
  """
  d = cfg.head_dim
  inv_freq = (
    1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)))
  ).astype(np.float32)
  scaling = cfg.rope_scaling
  if scaling is None:
    return inv_freq
  if scaling.rope_type != "llama3":
    raise ValueError(f"unsupported RoPE scaling {scaling.rope_type!r}")
  old = scaling.original_max_position_embeddings
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = (2 * math.pi / inv_freq).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(scaling.factor), inv_freq).astype(np.float32)
  smooth = ((old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).astype(
    np.float32
  )
  smoothed = ((1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled).astype(np.float32)
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | None, theta: float) -> jax.Array:
  """Rotary embedding of `x: [B, T, H, D]` at integer `positions: [B, T]` (HF's half-split
  layout) with the frequencies `inv_freq [D/2]` (`rope_inv_freq`; None: the default
  `theta^(-2i/D)`, computed in the graph as it always was)."""
  d = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  inv_freq = jnp.asarray(inv_freq, jnp.float32)
  freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, arithmetic: str = "default", rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    dense = lambda i, o, bias: nnx.Linear(
      i, o, use_bias=bias, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    features = cfg.features
    self.q_proj = dense(cfg.hidden_size, h * d, features.qkv_bias)
    self.k_proj = dense(cfg.hidden_size, kv * d, features.qkv_bias)
    self.v_proj = dense(cfg.hidden_size, kv * d, features.qkv_bias)
    self.o_proj = dense(h * d, cfg.hidden_size, features.o_bias)
    self.qk_norm = features.qk_norm
    if self.qk_norm:
      self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic)
      self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic)
    self.cfg = cfg
    self.dtype = dtype
    self.arithmetic = arithmetic

  def __call__(self, x, positions, attend: Callable, cache: CacheSlots | None):
    """`attend(q [B, T, H, D], k, v [B, S, KV, D]) -> [B, T, H, D]`. With a cache, the new
    keys/values are first written into it (`CacheSlots.write`) and `k, v` are its window."""
    if self.arithmetic == "batch_invariant":
      return self._invariant(x, positions, attend, cache)
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg) if cfg.rope_scaling is not None else None
    q, k = rope(q, positions, inv_freq, cfg.rope_theta), rope(k, positions, inv_freq, cfg.rope_theta)
    if cache is not None:
      cache = cache.write(k.astype(self.dtype), v.astype(self.dtype))
      k, v = cache.read(self.dtype)
    out = attend(q, k, v).reshape(b, t, -1)
    return self.o_proj(out), cache

  def _invariant(self, x, positions, attend, cache: CacheSlots | None):
    """`__call__` in batch-invariant arithmetic (`invariant`): float32 carriers of `dtype` values;
    the cache stores and returns them exactly."""
    cfg, dtype = self.cfg, self.dtype
    b, t, _ = x.shape
    q = _linear(self.q_proj, x, dtype).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = _linear(self.k_proj, x, dtype).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = _linear(self.v_proj, x, dtype).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg)
    q, k = invariant.rope(q, positions, inv_freq, dtype), invariant.rope(k, positions, inv_freq, dtype)
    if cache is not None:
      cache = cache.write(k.astype(dtype), v.astype(dtype))  # exact: the carriers hold `dtype` values
      k, v = (c.astype(jnp.float32) for c in cache.read(dtype))
    out = attend(q, k, v).reshape(b, t, -1)
    return _linear(self.o_proj, out, dtype), cache


def _linear(layer: nnx.Linear, x: jax.Array, dtype) -> jax.Array:
  """An `nnx.Linear` in batch-invariant arithmetic."""
  return invariant.linear(x, layer.kernel[...], None if layer.bias is None else layer.bias[...], dtype)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, arithmetic: str = "default", rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    bias = cfg.features.mlp_bias
    dense = lambda i, o: nnx.Linear(
      i, o, use_bias=bias, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.gate_proj = dense(cfg.hidden_size, cfg.intermediate_size)
    self.up_proj = dense(cfg.hidden_size, cfg.intermediate_size)
    self.down_proj = dense(cfg.intermediate_size, cfg.hidden_size)
    self.dtype = dtype
    self.arithmetic = arithmetic

  def __call__(self, x, *, fused: bool = False):
    """`fused`: the gate and up projections as one product with their kernels side by side (the
    same sums per output; one larger GEMM, and in the backward pass one gradient product and one
    transposed copy instead of two of each: the update at the 4-layer bench shape took 572–601 ms
    against 630–700 ms, three runs each on XLA:CPU). The teacher-forced forward without remat
    fuses (`CausalLM._layers`); decoding and rematerialised layers do not. Batch-invariant
    arithmetic never fuses them (the same sums either way)."""
    if self.arithmetic == "batch_invariant":
      dtype = self.dtype
      h = invariant.round_to(
        invariant.round_to(invariant.silu(_linear(self.gate_proj, x, dtype)), dtype) * _linear(self.up_proj, x, dtype),
        dtype,
      )
      return _linear(self.down_proj, h, dtype)
    if not fused:
      return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
    gate, up = self.gate_proj, self.up_proj

    def product(x, w_gate, w_up):
      kernel = jnp.concatenate([w_gate, w_up], axis=-1).astype(gate.dtype)
      return checkpoint_name(jnp.dot(x.astype(gate.dtype), kernel), "fused_gate_up")

    # The backward pass concatenates the kernels again rather than keep the forward's copy (every
    # layer's, stacked: 0.7 GB at Qwen3-0.6B in float32, more than a short batch's activations).
    h = jax.checkpoint(product, policy=jax.checkpoint_policies.save_only_these_names("fused_gate_up"))(
      x, gate.kernel[...], up.kernel[...]
    )
    if gate.bias is not None:
      h = h + _expand(jnp.concatenate([gate.bias[...], up.bias[...]]).astype(gate.dtype), h.ndim)
    g, u = jnp.split(h, 2, axis=-1)
    return self.down_proj(jax.nn.silu(g) * u)


class DecoderLayer(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    dtype,
    param_dtype,
    moe_dispatch: str = "grouped",
    activation_sharding=None,
    arithmetic: str = "default",
    rngs: nnx.Rngs,
  ):
    norm = lambda: RMSNorm(
      cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic
    )
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.is_moe = cfg.features.moe
    if self.is_moe:
      self.mlp = SparseMoeBlock(
        cfg,
        dtype=dtype,
        param_dtype=param_dtype,
        dispatch=moe_dispatch,
        activation_sharding=activation_sharding,
        arithmetic=arithmetic,
        rngs=rngs,
      )
    else:
      self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic, rngs=rngs)
    self.dtype = dtype
    self.arithmetic = arithmetic

  def __call__(self, x, positions, attend, cache, replay=None, valid=None, fuse_mlp=False):
    """Returns `(x, cache, routing)`; `routing` is a `moe.LayerRouting` for a MoE layer, else None.
    `fuse_mlp`: the MLP's gate and up projections as one product (`MLP`)."""
    h, cache = self.self_attn(self.input_layernorm(x), positions, attend, cache)
    if self.arithmetic == "batch_invariant":  # the residual adds rounded to the compute dtype
      add = lambda a, b: invariant.round_to(a + b, self.dtype)
    else:
      add = lambda a, b: a + b
    x = add(x, h)
    if self.is_moe:
      y, routing = self.mlp(self.post_attention_layernorm(x), replay, valid)
      return add(x, y), cache, routing
    return add(x, self.mlp(self.post_attention_layernorm(x), fused=fuse_mlp)), cache, None


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, **layer_kwargs) -> "DecoderLayer":
  """`cfg.num_hidden_layers` decoder layers as one module with a leading layer axis (scanned or unrolled)."""

  @nnx.split_rngs(splits=cfg.num_hidden_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def stacked(rngs):
    return DecoderLayer(cfg, rngs=rngs, **layer_kwargs)

  return stacked(rngs)


class CausalLM(nnx.Module):
  """The decoder-only causal LM of every registered architecture. Parameters are stored in `param_dtype`, computed in
  `dtype`;
  logits are always returned in float32.

  Attribute names mirror HF's module tree (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
  ...), with the layers stacked: `layers.self_attn.q_proj.kernel` is `[num_layers, in, out]`,
  so the checkpoint mapping in `hf_io` is mechanical.

  Args:
    attention: the training forward's attention backend (`ATTENTION_BACKENDS`); decoding with a
      KV cache always uses the dense kernel.
    remat: activation checkpointing policy of the layer scan (`REMAT_POLICIES`).
    layer_loop: `scan` (one `lax.scan` over the stacked layers), `unrolled` (`LAYER_LOOPS`) or
      `auto` (`resolve_layer_loop`: by depth), for the training forward and decoding alike;
      `self.layer_loop` is the loop chosen, `self.layer_loop_reason` why.
    activation_sharding: optional `NamedSharding` of the `[B, T, hidden]` residual stream,
      applied at every layer boundary (batch over the data axes, replicated over `tensor`).
    moe_dispatch: a mixture-of-experts model's expert computation (`trainers.models.moe`):
      `grouped` (sorted by expert, `ragged_dot`) or `dense` (every expert on every token).
    arithmetic: `default` (XLA's kernels) or `batch_invariant` (`trainers.models.invariant`: every
      float sum left to right, a 16-bit `dtype` emulated in float32 carriers, so a token's values do
      not depend on its batch, row, padding, or on decoding it over a cache against scoring its
      sequence at once; `attention`, `moe_dispatch` and the MLP fusion are then unused: attention
      is dense, the experts dense; a forward only (its programs compile with
      `invariant.COMPILER_OPTIONS`).
  """

  def __init__(
    self,
    cfg: ModelConfig,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    attention: str = "dense",
    remat: str = "none",
    activation_sharding=None,
    moe_dispatch: str = "grouped",
    layer_loop: str = "scan",
    arithmetic: str = "default",
    rngs: nnx.Rngs,
  ):
    for name, value, allowed in (
      ("attention", attention, ATTENTION_BACKENDS),
      ("remat", remat, REMAT_POLICIES),
      ("moe_dispatch", moe_dispatch, MOE_DISPATCH),
    ):
      if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {', '.join(allowed)}")
    self.arithmetic = invariant.check_arithmetic(arithmetic)
    self.config = cfg
    self.layer_loop, self.layer_loop_reason = resolve_layer_loop(layer_loop, cfg.num_hidden_layers)
    self.dtype = dtype
    self.attention = attention
    self.remat = remat
    self.activation_sharding = activation_sharding
    self.embed_tokens = nnx.Embed(
      cfg.vocab_size,
      cfg.hidden_size,
      dtype=dtype,
      param_dtype=param_dtype,
      embedding_init=nnx.initializers.normal(cfg.initializer_range),
      rngs=rngs,
    )
    self.layers = _stacked_layers(
      cfg,
      rngs,
      dtype=dtype,
      param_dtype=param_dtype,
      moe_dispatch=moe_dispatch,
      activation_sharding=activation_sharding,
      arithmetic=arithmetic,
    )
    self.norm = RMSNorm(
      cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, arithmetic=arithmetic
    )
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Linear(
        cfg.hidden_size,
        cfg.vocab_size,
        use_bias=False,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
      )

  @property
  def invariant(self) -> bool:
    """Whether the model computes in batch-invariant arithmetic (`arithmetic`)."""
    return self.arithmetic == "batch_invariant"

  def _embed(self, input_ids: jax.Array) -> jax.Array:
    if self.invariant:  # a float32 carrier of the compute dtype's values
      return invariant.carried(jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0), self.dtype)
    return self.embed_tokens(input_ids)

  def _constrain(self, x):
    if self.activation_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.activation_sharding)

  def _layers(self, x, positions, attend, cache: CacheSlots | None, *, remat: str, replay=None, valid=None):
    """Runs the stacked layers with one `lax.scan`, or unrolled (`self.layer_loop`; the replayed
    routing `[num_layers, B, T, k]`, if any, is scanned with them; a decoding cache is carried).
    Returns `(x, cache, routing)`, `routing` a `moe.LayerRouting` with a leading layer axis (None
    for a dense model)."""
    graphdef, state = nnx.split(self.layers)
    unrolled = self.layer_loop == "unrolled"
    scan = _unrolled if unrolled else jax.lax.scan

    # The gate and up projections fused in the teacher-forced forward without remat only: decoding
    # would copy the concatenated kernels every step, and under remat the step is sized for memory
    # (with `dots` the fused product's residuals took 11.5 % more at Qwen3-1.7B@16k).
    fuse_mlp = cache is None and remat == "none"

    def body(x, xs, layer_cache=None):
      layer_state, layer_replay = xs
      x, layer_cache, routing = nnx.merge(graphdef, layer_state)(
        x, positions, attend, layer_cache, layer_replay, valid, fuse_mlp
      )
      return self._constrain(x), (layer_cache, routing)

    if cache is not None:  # decoding: the stacked cache is carried; each layer writes its new slots in place

      def cached(carry, xs):
        x, k, v = carry
        layer, layer_state, layer_replay = xs
        layer_state = jax.tree.map(from_weight_bits, layer_state)  # this layer's only (`WEIGHT_BITS`)
        x, (slots, routing) = body(x, (layer_state, layer_replay), cache._replace(k=k, v=v, layer=layer))
        return (x, slots.k, slots.v), routing

      layers = jnp.arange(cache.k.shape[0], dtype=jnp.int32)
      (x, k, v), routing = scan(cached, (self._constrain(x), cache.k, cache.v), (layers, state, replay))
      return x, LayerCache(k, v), routing
    if remat != "none":  # unrolled, CSE would merge the recomputation with the forward it repeats
      body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=unrolled)
    x, (_, routing) = scan(body, self._constrain(x), (state, replay))
    return x, None, routing

  def _routing(self, routing, valid) -> Routing:
    num_tokens = jnp.sum(valid.astype(jnp.float32))
    return Routing(jnp.moveaxis(routing.native, 0, 2), load_balancing_loss(routing.counts, routing.probs, num_tokens))

  def _replay(self, routing: jax.Array | None, shape) -> jax.Array | None:
    """Replayed experts `[B, T, num_layers, k]` → the scan's `[num_layers, B, T, k]`."""
    if routing is None:
      return None
    cfg = self.config
    if not cfg.is_moe:
      raise ValueError("routing replay needs a mixture-of-experts model; this one is dense")
    want = tuple(shape) + (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    if tuple(routing.shape) != want:
      raise ValueError(
        f"routing has shape {tuple(routing.shape)}, expected [batch, length, num_hidden_layers, "
        f"num_experts_per_tok] = {list(want)}"
      )
    if not jnp.issubdtype(routing.dtype, jnp.integer):
      raise ValueError(f"routing must hold integer expert ids, got {routing.dtype}")
    return jnp.moveaxis(routing.astype(jnp.int32), 2, 0)

  def head(self) -> tuple[jax.Array, str]:
    """The output projection and its `mis_jax.token_logprobs` layout: the tied input embedding
    `[V, D]` ("vd") or the `lm_head` kernel `[D, V]` ("dv"), in its parameter dtype."""
    if self.config.tie_word_embeddings:
      return self.embed_tokens.embedding[...], "vd"
    return self.lm_head.kernel[...], "dv"

  def hidden_states(
    self,
    input_ids: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    routing: jax.Array | None = None,
    return_routing: bool = False,
  ):
    """Packed forward up to the final norm: `[B, T, hidden]` in the compute dtype.

    Token `j` is visible to token `i` iff `segment_ids[i] == segment_ids[j]` and `j <= i`
    (segments are contiguous within a row). Padding (`segment_ids == -1`) attends only to
    padding, its outputs are meaningless, and it never influences real tokens.

    Mixture of experts: `routing [B, T, num_hidden_layers, k]` replays recorded experts
    (rows whose first entry is -1 route natively; `trainers.models.moe`); with
    `return_routing` the result is `(hidden, Routing)`.
    """
    _check_ids(input_ids, positions, segment_ids)
    valid = segment_ids >= 0
    x, _, layer_routing = self._layers(
      self._embed(input_ids),
      positions,
      self._packed_attend(segment_ids),
      None,
      remat=self.remat,
      replay=self._replay(routing, input_ids.shape),
      valid=valid,
    )
    hidden = self.norm(x)
    if not return_routing:
      return hidden
    if layer_routing is None:
      raise ValueError("return_routing needs a mixture-of-experts model; this one is dense")
    return hidden, self._routing(layer_routing, valid)

  def _packed_attend(self, segment_ids):
    """The training forward's attention. On a mesh (`activation_sharding` set) the blocked and
    fused kernels run per device in a `shard_map` — rows over the batch axes, heads over
    `tensor` when the mesh has one — so each device loops over its own rows' blocks and a
    Pallas kernel sees local arrays; dense attention is left to XLA's partitioner."""
    if self.invariant:  # dense, its sums ordered; XLA partitions it on a mesh (element-wise: no value changes)
      mask = segment_mask(segment_ids)
      return lambda q, k, v: invariant.attention(q, k, v, mask, self.dtype)
    backend = self.attention
    local = lambda q, k, v, seg: packed_attention(q, k, v, seg, backend=backend)
    sharding = self.activation_sharding
    if sharding is None or backend == "dense":
      return lambda q, k, v: local(q, k, v, segment_ids)
    P = jax.sharding.PartitionSpec
    mesh, rows = sharding.mesh, sharding.spec[0]
    heads = "tensor" if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 else None
    spec = P(rows, None, heads, None)
    attend = jax.shard_map(
      local, mesh=mesh, in_specs=(spec, spec, spec, P(rows, None)), out_specs=spec, check_vma=False
    )
    return lambda q, k, v: attend(q, k, v, segment_ids)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """The LM head on final hidden states (`hidden_states`): float32 `[..., vocab]` logits."""
    return self._logits(hidden)

  def _logits(self, x: jax.Array) -> jax.Array:
    if self.invariant:
      head, layout = self.head()
      head = from_weight_bits(head)
      return invariant.round_to(
        invariant.matmul(x, invariant.carried(head.T if layout == "vd" else head, self.dtype)), self.dtype
      )
    logits = self.embed_tokens.attend(x) if self.config.tie_word_embeddings else self.lm_head(x)
    return logits.astype(jnp.float32)

  def _embed_rows(self, input_ids: jax.Array) -> jax.Array:
    """`embed_tokens(input_ids)` of decoding: an embedding held as bits (`WEIGHT_BITS`) gathered as bits."""
    table = self.embed_tokens.embedding[...]
    if self.invariant:  # a float32 carrier of the compute dtype's values, as `_embed`
      return invariant.carried(from_weight_bits(jnp.take(table, input_ids, axis=0)), self.dtype)
    if table.dtype != WEIGHT_BITS:
      return self.embed_tokens(input_ids)
    return from_weight_bits(jnp.take(table, input_ids, axis=0)).astype(self.dtype)

  def _chunked_logits(self, x: jax.Array) -> jax.Array:
    """`_logits(x)` of decoding: an output projection held as bits (`WEIGHT_BITS`) is read in
    `DECODE_VOCAB_CHUNK`-row chunks, each converted as it is used."""
    w, layout = self.head()
    if w.dtype != WEIGHT_BITS or self.invariant:  # (batch-invariant: the head whole, in its ordered product)
      return self._logits(x)
    w = w if layout == "vd" else w.T  # [V, D]
    vocab, chunk = w.shape[0], DECODE_VOCAB_CHUNK

    def block(rows):  # in the compute dtype, then float32, as `_logits`
      return jnp.einsum("btd,vd->btv", x, from_weight_bits(rows).astype(self.dtype)).astype(jnp.float32)

    full, parts = vocab // chunk, []
    if full:
      _, ys = jax.lax.scan(
        lambda _, i: (None, block(jax.lax.dynamic_slice_in_dim(w, i * chunk, chunk))), None, jnp.arange(full)
      )  # [full, B, T, chunk]
      parts.append(jnp.moveaxis(ys, 0, 2).reshape(x.shape[:2] + (full * chunk,)))
    if vocab % chunk:
      parts.append(block(w[full * chunk :]))
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

  def __call__(self, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Packed forward. All inputs `[B, T]` int32; returns logits `[B, T, vocab]` float32."""
    return self._logits(self.hidden_states(input_ids, positions, segment_ids))

  def init_cache(self, batch: int, length: int) -> LayerCache:
    """An empty cache for `decode`, in the compute dtype (a 16-bit float one stored as its bits, uint16)."""
    cfg = self.config
    shape = (cfg.num_hidden_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim)
    storage = _storage_dtype(self.dtype)
    return LayerCache(jnp.zeros(shape, storage), jnp.zeros(shape, storage))

  def decode(
    self,
    input_ids: jax.Array,
    cache: LayerCache,
    *,
    slot: jax.Array,
    start: jax.Array,
    window: int | None = None,
    return_routing: bool = False,
    logits_at: jax.Array | None = None,
  ):
    """Cached forward of `input_ids: [B, T]`, the rows aligned in the cache: the tokens go to
    slots `slot .. slot + T - 1` (a scalar: one in-place write per layer for all rows), row `b`'s
    sequence starts at slot `start[b]` (its position 0; earlier slots are its left padding), so
    the token in slot `s` has position `s - start[b]` (RoPE) and its query attends to slots
    `start[b] .. s`. Only the first `window` slots (static, default the whole cache; it must
    cover `slot + T`) are read, so a step costs the filled prefix, not the cache.

    Returns `(logits [B, T, vocab] float32, updated cache)`. `logits_at: [B]` int: the logits
    of that index of each row only (`[B, 1, vocab]`: a prefill needs its last prompt token's,
    not `T × vocab` per row). With `return_routing` (mixture of experts) also each token's
    experts per layer, `[B, T, num_hidden_layers, k]` int32 (the engine's own routing).
    Left padding's queries see nothing (their outputs are finite and meaningless)."""
    _check_ids(input_ids, input_ids)
    b, t = input_ids.shape
    window = cache.k.shape[2] if window is None else window
    if not 0 < window <= cache.k.shape[2]:
      raise ValueError(f"window {window} outside the cache's 1..{cache.k.shape[2]} slots")
    at = slot + jnp.arange(t, dtype=jnp.int32)  # [T] slots written
    positions = jnp.maximum(at[None, :] - start[:, None], 0).astype(jnp.int32)
    keys = jnp.arange(window, dtype=jnp.int32)
    mask = (keys[None, None, :] >= start[:, None, None]) & (keys[None, None, :] <= at[None, :, None])
    if self.invariant:
      attend = lambda q, k, v: invariant.attention(q, k, v, mask, self.dtype)
    else:
      attend = lambda q, k, v: dense_attention(q, k, v, mask)
    slots = CacheSlots(cache.k, cache.v, jnp.int32(0), jnp.asarray(slot, jnp.int32), window)
    x, cache, routing = self._layers(self._embed_rows(input_ids), positions, attend, slots, remat="none")
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    out = self._chunked_logits(self.norm(x)), cache
    if not return_routing:
      return out
    if routing is None:
      raise ValueError("return_routing needs a mixture-of-experts model; this one is dense")
    return out + (jnp.moveaxis(routing.native, 0, 2),)


def _check_ids(*arrays: jax.Array) -> None:
  shape = arrays[0].shape
  for a in arrays:
    if a.ndim != 2 or a.shape != shape:
      raise ValueError(f"expected [batch, length] int arrays of one shape, got {[x.shape for x in arrays]}")
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"expected integer ids/positions, got {a.dtype}")


def teacher_forced_logprobs(
  model: CausalLM,
  input_ids: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
) -> jax.Array:
  """Per-token `log_softmax(logits_t / temperature)[targets_t]`, float32, shape `[B, T]`.

  `targets[b, t]` is the token that follows `input_ids[b, t]` in its segment (the caller shifts;
  entries at segment ends or padding are arbitrary valid ids and should be masked downstream).
  This is the quantity SGLang returns as `output_token_logprobs` (contract §11): the temperature-
  scaled distribution, not renormalised for top-p/top-k. For a greedy rollout (temperature 0)
  SGLang reports temperature-1 log-probs, so pass `temperature=1.0`.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if targets.shape != input_ids.shape:
    raise ValueError(f"targets shape {targets.shape} != input_ids shape {input_ids.shape}")
  logits = model(input_ids, positions, segment_ids) / temperature
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


# --- the parameter tree's HF names and partition rules (shared by every architecture) --------------


def hf_name(path: tuple) -> tuple[str, bool]:
  """HF name of a parameter path (`{i}` in place of the layer index for stacked layer parameters)
  and whether its array is transposed in HF (flax Linear kernels are `[in, out]`, torch `[out, in]`)."""
  *module, leaf = (str(p) for p in path)
  if module[0] == "layers":
    module.insert(1, "{i}")
  if "experts" in module:  # a mixture-of-experts layer's `[L, E, in, out]` expert kernels
    module.insert(module.index("experts") + 1, "{e}")
  name = ".".join(module + ["weight" if leaf in ("kernel", "embedding") else leaf])
  return (name if module[0] == "lm_head" else "model." + name), leaf == "kernel"


# Which axis of a parameter (per layer, after the stacked layer axis) tensor parallelism splits,
# by the last two components of its name: column-parallel projections split their output
# features (heads, MLP columns; their biases too), row-parallel ones their input features, the
# embedding and LM head the vocabulary. Everything else (norms, o/down biases) is replicated
# over `tensor`.
TENSOR_RULES = {
  ("q_proj", "kernel"): -1,
  ("k_proj", "kernel"): -1,
  ("v_proj", "kernel"): -1,
  ("q_proj", "bias"): -1,
  ("k_proj", "bias"): -1,
  ("v_proj", "bias"): -1,
  ("gate_proj", "kernel"): -1,
  ("up_proj", "kernel"): -1,
  ("gate_proj", "bias"): -1,
  ("up_proj", "bias"): -1,
  ("o_proj", "kernel"): -2,
  ("down_proj", "kernel"): -2,
  ("embed_tokens", "embedding"): 0,
  ("lm_head", "kernel"): -1,
}
# The embedding table is split over `fsdp` along its hidden dimension, not the (larger)
# vocabulary: a lookup of batch-sharded ids in a vocab-sharded table makes XLA replicate the
# whole table, a hidden-sharded one is gathered locally.
FSDP_RULES = {("embed_tokens", "embedding"): -1}
