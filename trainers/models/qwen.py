"""Qwen2 / Qwen3 decoder-only transformer in Flax NNX, numerically matching Hugging Face.

One forward serves training and inference:

- packed training forward, `model(input_ids, positions, segment_ids)`: a token attends to the
  earlier tokens of its own segment only (segment-aware causal mask), so one row holds several
  sequences with no cross-attention and per-segment RoPE positions;
- cached decoding, `model.decode(input_ids, positions, cache)`: one sequence per row, new keys
  and values are written into a fixed-size KV cache at slot = position, and a query at
  position `p` attends to slots `<= p`.

Layer (pre-norm): `h = x + Attn(RMSNorm(x))`, `y = h + W_down(silu(W_gate RMSNorm(h)) * W_up RMSNorm(h))`,
with `RMSNorm(x) = w * x / sqrt(mean(x²) + eps)` computed in float32, RoPE
`x·cos(pθ) + rotate_half(x)·sin(pθ)`, `θ_i = theta^(-2i/head_dim)`, grouped-query attention
`softmax(q kᵀ / sqrt(head_dim) + mask) v` with the softmax in float32, and for Qwen3 an RMSNorm
over the head dimension of q and k before RoPE.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainers.models.config import ModelConfig

_MASKED = float(jnp.finfo(jnp.float32).min)


class LayerCache(NamedTuple):
  """Keys and values of one layer, `[batch, cache_len, num_key_value_heads, head_dim]`."""
  k: jax.Array
  v: jax.Array


def _expand(x: jax.Array, ndim: int) -> jax.Array:
  """Lifts a trailing-axis vector to rank `ndim` (explicit, so rank promotion can stay 'raise')."""
  return x.reshape((1,) * (ndim - x.ndim) + x.shape)


class RMSNorm(nnx.Module):
  """`w * x / sqrt(mean(x², -1) + eps)`, normalised in float32 then cast back, as in HF."""

  def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return _expand(self.weight[...].astype(self.dtype), x.ndim) * x32.astype(self.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding of `x: [B, T, H, D]` at integer `positions: [B, T]` (HF's half-split layout)."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    dense = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, kernel_init=init, dtype=dtype,
                                          param_dtype=param_dtype, rngs=rngs)
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    self.q_proj = dense(cfg.hidden_size, h * d, cfg.qkv_bias)
    self.k_proj = dense(cfg.hidden_size, kv * d, cfg.qkv_bias)
    self.v_proj = dense(cfg.hidden_size, kv * d, cfg.qkv_bias)
    self.o_proj = dense(h * d, cfg.hidden_size, cfg.o_bias)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.cfg = cfg
    self.dtype = dtype

  def __call__(self, x, positions, mask, cache: LayerCache | None):
    """`mask: [B, Tq, Tk]` (True = may attend). With a cache, `Tk` is the cache length and the
    new keys/values are written at slots `positions[:, 0] + arange(Tq)` first."""
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    if cache is not None:
      write = jax.vmap(lambda c, new, start: jax.lax.dynamic_update_slice(c, new, (start, 0, 0)))
      cache = LayerCache(write(cache.k, k.astype(cache.k.dtype), positions[:, 0]),
                         write(cache.v, v.astype(cache.v.dtype), positions[:, 0]))
      k, v = cache.k.astype(self.dtype), cache.v.astype(self.dtype)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    q = q.reshape(b, t, cfg.num_key_value_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * cfg.head_dim ** -0.5
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, -1)
    return self.o_proj(out), cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    dense = lambda i, o: nnx.Linear(i, o, use_bias=False, kernel_init=init, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = dense(cfg.hidden_size, cfg.intermediate_size)
    self.up_proj = dense(cfg.hidden_size, cfg.intermediate_size)
    self.down_proj = dense(cfg.intermediate_size, cfg.hidden_size)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, positions, mask, cache):
    h, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen(nnx.Module):
  """Qwen2/Qwen3 causal LM. Parameters are stored in `param_dtype`, computed in `dtype`;
  logits are always returned in float32.

  Attribute names mirror HF's module tree (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
  ...), so the checkpoint mapping in `hf_io` is mechanical.
  """

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.config = cfg
    self.dtype = dtype
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype,
                                  embedding_init=nnx.initializers.normal(cfg.initializer_range),
                                  rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                kernel_init=nnx.initializers.normal(cfg.initializer_range),
                                dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.norm(x)
    logits = self.embed_tokens.attend(x) if self.config.tie_word_embeddings else self.lm_head(x)
    return logits.astype(jnp.float32)

  def __call__(self, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Packed forward. All inputs `[B, T]` int32; returns logits `[B, T, vocab]` float32.

    Token `j` is visible to token `i` iff `segment_ids[i] == segment_ids[j]` and `j <= i`
    (segments are contiguous within a row). Padding (`segment_ids == -1`) attends only to
    padding, its logits are meaningless, and it never influences real tokens.
    """
    _check_ids(input_ids, positions, segment_ids)
    idx = jnp.arange(input_ids.shape[1])
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (idx[None, :, None] >= idx[None, None, :])
    x = self.embed_tokens(input_ids)
    for layer in self.layers:
      x, _ = layer(x, positions, mask, None)
    return self._logits(x)

  def init_cache(self, batch: int, length: int, dtype=None) -> tuple[LayerCache, ...]:
    cfg = self.config
    shape = (batch, length, cfg.num_key_value_heads, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype or self.dtype)
    return tuple(LayerCache(zeros(), zeros()) for _ in range(cfg.num_hidden_layers))

  def decode(self, input_ids: jax.Array, positions: jax.Array, cache: tuple[LayerCache, ...]):
    """Cached forward of `input_ids: [B, T]` at contiguous `positions: [B, T]` (one sequence
    per row). Returns `(logits [B, T, vocab] float32, updated cache)`; a query at position `p`
    attends to cache slots `0..p`, which must hold this row's tokens at positions `0..p`."""
    _check_ids(input_ids, positions)
    slots = jnp.arange(cache[0].k.shape[1])
    mask = slots[None, None, :] <= positions[:, :, None]
    x = self.embed_tokens(input_ids)
    new_cache = []
    for layer, layer_cache in zip(self.layers, cache):
      x, layer_cache = layer(x, positions, mask, layer_cache)
      new_cache.append(layer_cache)
    return self._logits(x), tuple(new_cache)


def _check_ids(*arrays: jax.Array) -> None:
  shape = arrays[0].shape
  for a in arrays:
    if a.ndim != 2 or a.shape != shape:
      raise ValueError(f"expected [batch, length] int arrays of one shape, got {[x.shape for x in arrays]}")
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"expected integer ids/positions, got {a.dtype}")


def teacher_forced_logprobs(model: Qwen, input_ids: jax.Array, positions: jax.Array,
                            segment_ids: jax.Array, targets: jax.Array, *,
                            temperature: float = 1.0) -> jax.Array:
  """Per-token `log_softmax(logits_t / temperature)[targets_t]`, float32, shape `[B, T]`.

  `targets[b, t]` is the token that follows `input_ids[b, t]` in its segment (the caller shifts;
  entries at segment ends or padding are arbitrary valid ids and should be masked downstream).
  This is the quantity SGLang returns as `output_token_logprobs` (SPEC §11): the temperature-
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
