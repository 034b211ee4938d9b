"""The mixture-of-experts block of Qwen3-MoE (`Qwen3MoeSparseMoeBlock`), with routing replay.

Per token `x` (after the post-attention norm), as Hugging Face computes it:

    logits = x W_gateᵀ                     (the router, in the compute dtype)
    p      = softmax(float32(logits))       (float32 whatever the model dtype)
    S      = top-k of p                     (the token's experts, in top-k order)
    w_e    = p_e (/ Σ_{e' ∈ S} p_e' when norm_topk_prob), cast to the compute dtype
    y      = Σ_{e ∈ S} w_e · W_down,e (silu(W_gate,e x) ⊙ W_up,e x)

**Routing replay** (R3 / R2): given recorded experts `r` (`[..., k]` int32; a row whose first
entry is `-1` has no record and routes natively), `S = r` and the gate weights are recomputed
from the *current* router at those experts (`w_e = p_e`, renormalised per `norm_topk_prob`),
so the output is what the recorded routing gives and the router keeps its gradient.

Three dispatch paths compute `y` (`MOE_DISPATCH`), equal up to float rounding in values and
gradients:

- `dense`: every expert on every token (`[E, N, ffn]` intermediates), weighted by the gates
  (zero off `S`). The reference; right for tiny models and CPU.
- `grouped`: the `N·k` (token, expert) pairs sorted by expert, each expert's group padded to a
  multiple of a block of `b` rows, and the blocks run in a `lax.map` (vectorised a few blocks
  at a time), each block against its one expert's weights; then unsorted and summed over k.
  Memory `O((N·k + E·b)·(hidden + ffn))` whatever the backend, never `[N, E, ffn]`; at most
  `E·b` padding rows of extra work.
- `ragged_dot`: the sorted pairs through `jax.lax.ragged_dot` (one grouped matmul per
  projection). A native grouped GEMM where the backend has one (TPU); XLA:CPU lowers it to a
  masked dense product over all experts (`[N·k, E·hidden]`), so on CPU it is the largest.

On a device mesh (the model's `activation_sharding`), the experts run in a `shard_map`: each
device takes its own tokens (rows over the batch axes) and its layer's expert weights, stored
split over the `expert` axis (and their FFN over `tensor`), are all-gathered over `expert` at
the layer (their gradients reduce-scattered back), so every device computes only its own
tokens' expert FFNs and nothing global (a sort or a dispatch over all devices' tokens) is ever
built. At Qwen3-30B-A3B's shape and 16k tokens per device the bytes gathered per layer (the
experts, 1.2 GB in bf16) are those an all-to-all token dispatch would move (1.0 GB there and
back); a token-dispatch path is not implemented.

Every layer also reports its native top-k (what the router would pick; the routing-mismatch
metrics compare it with a rollout's) and the load-balancing statistics of HF's
`load_balancing_loss_func` (expert counts and mean router probabilities over real tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainers.models import invariant

MOE_DISPATCH = ("dense", "grouped", "ragged_dot")


class LayerRouting(NamedTuple):
  """One layer's routing of `[B, T]` tokens."""

  native: jax.Array  # [B, T, k] int32: the router's own top-k (in top-k order)
  counts: jax.Array  # [E] float32: (token, slot) assignments per expert over real tokens (native top-k)
  probs: jax.Array  # [E] float32: Σ over real tokens of the router probabilities


class ExpertWeights(nnx.Module):
  """One projection of all experts: `kernel [E, in, out]` (HF: `experts.{e}.<name>.weight`, `[out, in]`)."""

  def __init__(self, num_experts: int, fan_in: int, fan_out: int, *, init, param_dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init(rngs.params(), (num_experts, fan_in, fan_out), param_dtype))


class Experts(nnx.Module):
  def __init__(self, cfg, *, param_dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    self.gate_proj = ExpertWeights(e, h, f, init=init, param_dtype=param_dtype, rngs=rngs)
    self.up_proj = ExpertWeights(e, h, f, init=init, param_dtype=param_dtype, rngs=rngs)
    self.down_proj = ExpertWeights(e, f, h, init=init, param_dtype=param_dtype, rngs=rngs)


def route(probs: jax.Array, k: int, norm_topk_prob: bool, replay: jax.Array | None, dtype):
  """`(experts [N, k] int32, gate weights [N, k] in dtype, native [N, k])` from float32 router
  probabilities `[N, E]`, replaying `replay [N, k]` where its first entry is `>= 0`."""
  _, native = jax.lax.top_k(probs, k)
  native = native.astype(jnp.int32)
  experts = native if replay is None else jnp.where(replay[:, :1] >= 0, replay, native)
  w = jnp.take_along_axis(probs, experts, axis=-1)
  if norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return experts, w.astype(dtype), native


def dense_dispatch(x, experts, weights, wg, wu, wd):
  """Every expert on every token; `x [N, H]`, `experts/weights [N, k]`, kernels `[E, in, out]`."""
  num_experts = wg.shape[0]
  gate = jnp.einsum("nh,ehf->enf", x, wg)
  up = jnp.einsum("nh,ehf->enf", x, wu)
  y = jnp.einsum("enf,efh->enh", jax.nn.silu(gate) * up, wd)
  combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=weights.dtype) * weights[..., None], axis=1)  # [N, E]
  return jnp.einsum("enh,ne->nh", y, combine)


def _sorted_pairs(experts, num_experts: int):
  """The `N·k` (token, expert) pairs in expert order: `(order [N·k], their experts, sizes [E])`."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order, flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _combine(y_sorted, order, weights):
  """Per-pair outputs in expert order → `Σ_k w · y` per token."""
  n, k = weights.shape
  unsorted = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True).reshape(n, k, -1)
  return jnp.sum(unsorted * weights[..., None], axis=1)


def block_size(num_pairs: int, num_experts: int, largest: int = 128) -> int:
  """Rows per block of the `grouped` path: the power of two at or above the mean group size
  `N·k / E`, in [8, largest] (padding costs at most `E·b` rows)."""
  mean = max(1, -(-num_pairs // num_experts))
  return int(min(largest, max(8, 1 << (mean - 1).bit_length())))


def grouped_dispatch(x, experts, weights, wg, wu, wd, *, block: int | None = None, blocks_at_once: int = 8):
  """The `N·k` pairs sorted by expert, padded per expert to blocks of `block` rows, each block
  through its expert's FFN in a `lax.map` (`blocks_at_once` vectorised)."""
  n, k = experts.shape
  num_experts, hidden = wg.shape[0], wg.shape[1]
  pairs = n * k
  b = block or block_size(pairs, num_experts)
  order, sorted_e, sizes = _sorted_pairs(experts, num_experts)
  padded = (sizes + b - 1) // b * b
  start = jnp.cumsum(sizes) - sizes
  padded_start = jnp.cumsum(padded) - padded
  dest = padded_start[sorted_e] + jnp.arange(pairs, dtype=jnp.int32) - start[sorted_e]  # sorted pair → padded row
  num_blocks = -(-(pairs + num_experts * (b - 1)) // b)  # a static bound on the padded rows
  rows = jnp.zeros((num_blocks * b, hidden), x.dtype).at[dest].set(x[order // k], unique_indices=True)
  ends = jnp.cumsum(padded)
  block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_blocks) * b, side="right"), num_experts - 1).astype(
    jnp.int32
  )  # blocks past the data: zero rows

  @jax.checkpoint  # the backward pass recomputes a block (never keeps every block's gathered weights)
  def ffn(args):
    xb, e = args
    return (jax.nn.silu(xb @ wg[e]) * (xb @ wu[e])) @ wd[e]

  out = jax.lax.map(
    ffn, (rows.reshape(num_blocks, b, hidden), block_expert), batch_size=min(blocks_at_once, num_blocks)
  )
  return _combine(out.reshape(num_blocks * b, hidden)[dest], order, weights)


def ragged_dot_dispatch(x, experts, weights, wg, wu, wd):
  """The `N·k` (token, expert) pairs sorted by expert through `jax.lax.ragged_dot`."""
  order, _, sizes = _sorted_pairs(experts, wg.shape[0])
  rows = x[order // experts.shape[1]]  # [N·k, H], grouped by expert
  gate = jax.lax.ragged_dot(rows, wg, sizes)
  up = jax.lax.ragged_dot(rows, wu, sizes)
  return _combine(jax.lax.ragged_dot(jax.nn.silu(gate) * up, wd, sizes), order, weights)


class SparseMoeBlock(nnx.Module):
  """Router (`gate`, HF `mlp.gate.weight [E, H]`) and experts; see the module doc."""

  def __init__(
    self,
    cfg,
    *,
    dtype,
    param_dtype,
    dispatch: str = "grouped",
    activation_sharding=None,
    arithmetic: str = "default",
    rngs: nnx.Rngs,
  ):
    if dispatch not in MOE_DISPATCH:
      raise ValueError(f"moe_dispatch={dispatch!r}; allowed: {', '.join(MOE_DISPATCH)}")
    self.gate = nnx.Linear(
      cfg.hidden_size,
      cfg.num_experts,
      use_bias=False,
      kernel_init=nnx.initializers.normal(cfg.initializer_range),
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.experts = Experts(cfg, param_dtype=param_dtype, rngs=rngs)
    self.top_k = cfg.num_experts_per_tok
    self.norm_topk_prob = cfg.norm_topk_prob
    self.dispatch = dispatch
    self.dtype = dtype
    self.activation_sharding = activation_sharding
    self.arithmetic = arithmetic

  def __call__(self, x: jax.Array, replay: jax.Array | None = None, valid: jax.Array | None = None):
    """`x [B, T, H]`, `replay [B, T, k]` or None, `valid [B, T]` bool (real tokens, for the
    load-balancing statistics) → `(y [B, T, H], LayerRouting)`."""
    b, t, h = x.shape
    flat = x.reshape(b * t, h)
    if self.arithmetic == "batch_invariant":
      y, probs, native = self._invariant(flat, None if replay is None else replay.reshape(b * t, -1))
    else:
      probs = jax.nn.softmax(self.gate(flat).astype(jnp.float32), axis=-1)
      experts, weights, native = route(
        probs, self.top_k, self.norm_topk_prob, None if replay is None else replay.reshape(b * t, -1), self.dtype
      )
      kernels = [
        p.kernel[...].astype(self.dtype) for p in (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
      ]
      fn = DISPATCH[self.dispatch]
      if self.activation_sharding is not None:
        fn = _on_mesh(fn, self.activation_sharding)
      y = fn(flat.astype(self.dtype), experts, weights, *kernels)
    real = (jnp.ones((b * t,), bool) if valid is None else valid.reshape(-1))[:, None]
    num_experts = probs.shape[-1]
    counts = jnp.sum(
      jnp.where(real[..., None], jax.nn.one_hot(native, num_experts, dtype=jnp.float32), 0.0), axis=(0, 1)
    )
    prob_sums = jnp.sum(jnp.where(real, probs, 0.0), axis=0)
    return y.reshape(b, t, h), LayerRouting(native.reshape(b, t, -1), counts, prob_sums)

  def _invariant(self, x, replay):
    """The block in batch-invariant arithmetic (`invariant`) on float32 carriers `x [N, H]`: the
    router's product and softmax ordered, the top-k exact, the renormalisation summed in top-k
    order; every expert on every token (dense), each token's `Σ_j w_j y_{e_j}` left to right in
    top-k order. Returns `(y, probs, native)`."""
    dtype = self.dtype
    probs = invariant.softmax(invariant.linear(x, self.gate.kernel[...], None, dtype))
    _, native = jax.lax.top_k(probs, self.top_k)
    native = native.astype(jnp.int32)
    experts = native if replay is None else jnp.where(replay[:, :1] >= 0, replay, native)
    w = jnp.take_along_axis(probs, experts, axis=-1)
    if self.norm_topk_prob:
      w = w / invariant.ordered_sum(w, -1)[:, None]
    w = invariant.round_to(w, dtype)

    def expert(wg, wu, wd):  # [H, F], [H, F], [F, H] -> [N, H]
      gate = invariant.round_to(invariant.silu(invariant.linear(x, wg, None, dtype)), dtype)
      return invariant.linear(invariant.round_to(gate * invariant.linear(x, wu, None, dtype), dtype), wd, None, dtype)

    e = self.experts
    outputs = jax.vmap(expert)(e.gate_proj.kernel[...], e.up_proj.kernel[...], e.down_proj.kernel[...])  # [E, N, H]
    chosen = jnp.take_along_axis(outputs, experts.T[:, :, None], axis=0)  # [k, N, H]
    y = invariant.round_to(invariant.ordered_contract(w.T[:, :, None], chosen), dtype)
    return y, probs, native


DISPATCH = {"dense": dense_dispatch, "grouped": grouped_dispatch, "ragged_dot": ragged_dot_dispatch}


def _on_mesh(dispatch, sharding):
  """`dispatch` per device in a `shard_map`: its own tokens (rows over the batch axes of
  `sharding`), the experts all-gathered over `expert`, their FFN split over `tensor` (the down
  projection's partial sums added with a `psum`)."""
  P = jax.sharding.PartitionSpec
  mesh, rows = sharding.mesh, sharding.spec[0]
  ep = "expert" if "expert" in mesh.axis_names and mesh.shape["expert"] > 1 else None
  tp = "tensor" if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 else None

  def local(x, experts, weights, wg, wu, wd):
    if ep is not None:
      wg, wu, wd = (jax.lax.all_gather(w, ep, axis=0, tiled=True) for w in (wg, wu, wd))
    y = dispatch(x, experts, weights, wg, wu, wd)
    return y if tp is None else jax.lax.psum(y, tp)

  tokens = P(rows, None)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(tokens, tokens, tokens, P(ep, None, tp), P(ep, None, tp), P(ep, tp, None)),
    out_specs=tokens,
    check_vma=False,
  )


def load_balancing_loss(counts: jax.Array, probs: jax.Array, num_tokens: jax.Array) -> jax.Array:
  """HF's `load_balancing_loss_func` from per-layer statistics `[L, E]` over `num_tokens` real
  tokens: `E · Σ_e (Σ_l counts_le / (L·N)) · (Σ_l probs_le / (L·N))`."""
  layers, num_experts = counts.shape
  denom = jnp.maximum(layers * num_tokens.astype(jnp.float32), 1.0)
  return num_experts * jnp.sum((jnp.sum(counts, 0) / denom) * (jnp.sum(probs, 0) / denom))
