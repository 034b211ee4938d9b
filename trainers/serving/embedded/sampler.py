"""Jitted batched autoregressive sampling with a KV cache, SGLang's sampling semantics.

Per row and step, with logits `z` (float32 even when the model computes in bfloat16):

    logp = log_softmax(z / T)                      # the reported log-prob (contract §11)
    keep = top-k ∧ top-p ∧ min-p filter of softmax(z / T)
    token ~ Categorical(softmax(logp restricted to keep))

The reported log-prob is `logp[token]`, *not* renormalised over the kept set, exactly as
SGLang's `output_token_logprobs`. With `sampling_mask` (SGLang's `return_sampling_mask`) a row
also returns, per output token, the kept set ("support", ids by descending probability), the
behaviour log-prob `logp[token] - logsumexp(logp[support])` and the support's renormalised
log-probs (SGLang's `output_token_sampling_mask` / `output_token_sampling_logprobs`). Temperature 0 (below 1e-6) is
greedy and, as in SGLang, is
run as `T = 1, top_k = 1`, so its log-probs are those of `log_softmax(z)`. With
`prompt_logprobs`, the prefill also returns the teacher-forced `log_softmax(z / T)` of every
prompt token after the first (SGLang's `input_token_logprobs`).

A row's randomness depends on its seed only (key `fold_in(key(seed), step)`), as SGLang's
`sampling_seed`: two samples with one seed are identical whatever is batched with them, and
SGLang copies a request's seed to all of its `n` samples.

Shapes are static: the batch is padded to a power of two, prompts and `max_new_tokens` to
powers of two (at least 16), stop-id lists to powers of two (at least 4), so a stream of
requests compiles a handful of programs once.

The KV cache holds the rows aligned: prompts are left-padded to the bucket `P`, so every row's
token of step `t` goes to slot `P + t` and a step writes all rows' keys and values with one
in-place `dynamic_update_slice` per layer (the decoding state is donated: XLA never copies the
cache). Prefill is one forward over the prompts; decoding is a `jax.lax.while_loop` per
attention window: the first power of two of slots (at least 16) that holds the tokens so far,
so a step reads the filled prefix, not the whole cache, and a cache has about log2 windows.
Continuous batching: every `_CHECK_STEPS` steps and at each window's end the host looks at
which rows finished; once at most half the batch runs, the running rows move into the next
smaller power-of-two batch (the finished rows' outputs are kept), and decoding stops when every
row has finished. A row's random draws do not depend on which rows share its batch; its log-probs
do, in the last bits of XLA's kernels (a bfloat16 prompt alone and as row 16 of 32 differed by up
to 0.029, float32 by 7e-6), unless the model computes in batch-invariant arithmetic (exact mode,
contract §13), where they are equal bit for bit. Such a model's programs compile with
`invariant.COMPILER_OPTIONS`, and its log-probs' sums are ordered (`invariant.temperature_log_softmax`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from trainers.models import CausalLM, LayerCache, invariant
from trainers.models.decoder import from_weight_bits, weight_bits


_GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: smaller temperatures are greedy


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """SGLang's sampling parameters that this engine implements (names and defaults as SGLang)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1  # -1: no top-k filter
  min_p: float = 0.0
  max_new_tokens: int = 128
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False  # as SGLang: no token stops the sample (EOS nor stop_token_ids)
  n: int = 1
  seed: int | None = None
  sampling_mask: bool = False  # return each output token's support (needs a finite top_k or greedy)
  routed_experts: bool = False  # return every position's experts per layer (a mixture-of-experts model)
  top_logprobs_num: int = 0  # return each output token's k most likely ids and their log-probs (SGLang's)

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1)):
      raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
    if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
    if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0):
      raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
    if not (isinstance(self.n, int) and self.n >= 1):
      raise ValueError(f"n must be an int >= 1, got {self.n!r}")
    if not all(isinstance(t, int) for t in self.stop_token_ids):
      raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
    if self.seed is not None and not isinstance(self.seed, int):
      raise ValueError(f"seed must be an int, got {self.seed!r}")
    if not (isinstance(self.top_logprobs_num, int) and self.top_logprobs_num >= 0):
      raise ValueError(f"top_logprobs_num must be an int >= 0, got {self.top_logprobs_num!r}")
    if self.sampling_mask and self.top_k == -1 and self.temperature >= _GREEDY_BELOW:
      raise ValueError("sampling_mask needs a finite top_k (or greedy sampling): the support width must be bounded")


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sample. `finish_reason`: `("stop", matched_token_id)` or `("length", max_new_tokens)`."""

  prompt_index: int
  sample_index: int
  prompt_tokens: int
  output_ids: list[int]
  logprobs: list[float]
  finish_reason: tuple[str, int]
  prompt_logprobs: list[float] | None = None  # [t]: log-prob of prompt token t + 1
  # With `sampling_mask`: per output token, the behaviour log-prob (renormalised over the
  # support), the support's ids (descending probability) and their renormalised log-probs.
  sampling_logprobs: list[float] | None = None
  sampling_mask: list[list[int]] | None = None
  sampling_mask_logprobs: list[list[float]] | None = None
  # With `routed_experts`: int32 `[prompt + completion - 1, num_hidden_layers, k]`, row i the
  # experts that routed the token at position i (the last sampled token never ran).
  routed_experts: np.ndarray | None = None
  # With `top_logprobs_num` k: per output token, the k most likely `(logprob, id)` of the full
  # `log_softmax(logits / T)` (SGLang's `output_top_logprobs`), by descending probability.
  top_logprobs: list[list[tuple[float, int]]] | None = None
  # `(version, first output token)` of the weights that generated it: one entry, or one per
  # weight update it ran across (paused in place).
  versions: list[tuple[str, int]] = dataclasses.field(default_factory=lambda: [("", 0)])


def _bucket(n: int, minimum: int) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _log_probs(logits, temperature, invariant_sums: bool):
  """`log_softmax(logits / temperature)`: XLA's, or with `invariant_sums` the batch-invariant one
  (`invariant.temperature_log_softmax`, which exact mode's trainer computes too)."""
  if invariant_sums:
    return invariant.temperature_log_softmax(logits, temperature)
  return jax.nn.log_softmax(logits / temperature)


def _sample(
  logits,
  key,
  temperature,
  top_p,
  top_k,
  min_p,
  *,
  mask_width: int = 0,
  top_width: int = 0,
  filters: bool = True,
  invariant_sums: bool = False,
):
  """`_filter_and_sample`, or with `filters` False (no row of the batch has top-p < 1, top-k, min-p,
  greedy decoding or a sampling mask: the support is the whole vocabulary) the same draw without
  sorting the vocabulary: `categorical(key, log_softmax(logits / T))`, and the `top_width` most
  likely ids by `lax.top_k` (ties in id order, as the stable sort). Tokens, log-probs and top ids
  are those of `_filter_and_sample` (an all-kept support masks nothing). `invariant_sums`: the
  log-probs' sums in batch-invariant order (a model in `batch_invariant` arithmetic)."""
  if filters:
    return _filter_and_sample(
      logits,
      key,
      temperature,
      top_p,
      top_k,
      min_p,
      mask_width=mask_width,
      top_width=top_width,
      invariant_sums=invariant_sums,
    )
  logp = _log_probs(logits, temperature, invariant_sums)
  token = jax.random.categorical(key, logp)
  top = None
  if top_width:
    top_lp, top_ids = jax.lax.top_k(logp, top_width)
    top = {"ids": top_ids.astype(jnp.int32), "logprobs": top_lp}
  return token, logp[token], None, top


def _filter_and_sample(
  logits,
  key,
  temperature,
  top_p,
  top_k,
  min_p,
  *,
  mask_width: int = 0,
  top_width: int = 0,
  invariant_sums: bool = False,
):
  """One row: `logits [V]` float32 → `(token, log_softmax(logits / T)[token], support, top)`, with
  `support` `{ids [W], logprobs [W], size}` when `mask_width` > 0, else None, and `top`
  `{ids [k], logprobs [k]}` (the `top_width` most likely, full vocabulary) when `top_width` > 0.

  The kept set ("support") is a prefix of the vocabulary sorted by descending probability
  (ties in id order), as SGLang's sampler: top-k by rank, top-p on the cumulative mass of the
  full sorted distribution (`<=` as SGLang, so top_p = 1 keeps everything even where the
  cumulative sum rounds to 1 early), min-p against the top probability. The token is drawn
  from `softmax(logp restricted to the support)`. For `return_sampling_mask`, the support's
  first `mask_width` ids (sorted order, `-1` past its size) and their renormalised log-probs
  `logp[v] - logsumexp(logp[support])` (the sampled token's is SGLang's
  `output_token_sampling_logprobs`).
  """
  vocab = logits.shape[-1]
  logp = _log_probs(logits, temperature, invariant_sums)
  order = jnp.argsort(-logp)  # stable: equal probabilities keep id order
  sorted_logp = logp[order]
  sorted_p = jnp.exp(sorted_logp)
  rank = jnp.arange(vocab)
  kept = (
    (jnp.cumsum(sorted_p) - sorted_p <= top_p)
    & (rank < jnp.where(top_k > 0, top_k, vocab))
    & (sorted_p >= min_p * sorted_p[0])
  )
  size = jnp.sum(kept)  # each rule keeps a prefix, so the support is the first `size` ranks
  in_support = jnp.zeros((vocab,), bool).at[order].set(rank < size)
  masked = jnp.where(in_support, logp, -jnp.inf)
  token = jax.random.categorical(key, masked)
  top = {"ids": order[:top_width].astype(jnp.int32), "logprobs": sorted_logp[:top_width]} if top_width else None
  if not mask_width:
    return token, logp[token], None, top
  first = rank[:mask_width] < size
  logsumexp = invariant.logsumexp if invariant_sums else jax.nn.logsumexp
  support = {
    "ids": jnp.where(first, order[:mask_width], -1).astype(jnp.int32),
    "logprobs": jnp.where(first, sorted_logp[:mask_width] - logsumexp(masked), 0.0),
    "size": size.astype(jnp.int32),
  }
  return token, logp[token], support, top


def _aligned_rows(x: jax.Array, start: jax.Array) -> jax.Array:
  """`x [B, P, ...]` in the cache's left-padded layout → each row's entries from its first real
  slot `start[b]` on (entry `t` = prompt token `t`; past the prompt: unspecified)."""
  index = jnp.minimum(start[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :], x.shape[1] - 1)
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _prefill(
  graphdef,
  params,
  prompt_ids,
  start,
  temperature,
  max_new,
  *,
  num_steps: int,
  prompt_logprobs: bool = False,
  mask_width: int = 0,
  routed_experts: bool = False,
  top_width: int = 0,
):
  """Rows `[B]`; `prompt_ids [B, P]` left-padded (row `b`'s prompt in slots `start[b]..P-1`, so
  every row's next token goes to slot `P`). One forward over the prompts into a cache of
  `P + num_steps` slots; returns the decoding state (`_decode` continues it) with empty outputs:
  `output_ids [B, num_steps]`, `logprobs [B, num_steps]` (full vocabulary), `lengths [B]`,
  `stopped [B]`, `prompt_lp [B, P]` (entry `t`: log-prob of prompt token `t + 1`; zeros without
  `prompt_logprobs`), and with `mask_width > 0` `support [B, num_steps, W]` (ids, `-1` padded),
  `support_lp [B, num_steps, W]` (renormalised over the support) and `support_size [B, num_steps]`;
  with `routed_experts`, `prompt_routes [B, P, L, k]` (the prefill's experts, entry `t` prompt
  token `t`'s) and `routes [B, num_steps, L, k]` (those of the token fed at each step)."""
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompt_ids.shape
  cache = model.init_cache(batch, prompt_len + num_steps)
  routing = {"return_routing": True} if routed_experts else {}
  # Without prompt log-probs only the last slot's logits are needed (every row's last prompt token).
  last = None if prompt_logprobs else jnp.full((batch,), prompt_len - 1, jnp.int32)
  all_logits, cache, *prompt_routes = model.decode(
    prompt_ids, cache, slot=jnp.int32(0), start=start, window=prompt_len, logits_at=last, **routing
  )
  if prompt_logprobs and model.invariant:
    lp = invariant.temperature_log_softmax(all_logits.astype(jnp.float32), temperature)
  elif prompt_logprobs:
    lp = jax.nn.log_softmax(all_logits.astype(jnp.float32) / temperature[:, None, None], axis=-1)
    nxt = jnp.concatenate([prompt_ids[:, 1:], jnp.zeros_like(prompt_ids[:, :1])], axis=1)
    prompt_lp = _aligned_rows(jnp.take_along_axis(lp, nxt[..., None], axis=-1)[..., 0], start)
  else:
    prompt_lp = jnp.zeros(prompt_ids.shape, jnp.float32)
  out = {"output_ids": jnp.zeros((batch, num_steps), jnp.int32), "logprobs": jnp.zeros((batch, num_steps), jnp.float32)}
  if mask_width:
    out.update(
      support=jnp.full((batch, num_steps, mask_width), -1, jnp.int32),
      support_lp=jnp.zeros((batch, num_steps, mask_width), jnp.float32),
      support_size=jnp.zeros((batch, num_steps), jnp.int32),
    )
  if top_width:
    out.update(
      top_ids=jnp.zeros((batch, num_steps, top_width), jnp.int32),
      top_lp=jnp.zeros((batch, num_steps, top_width), jnp.float32),
    )
  if routed_experts:
    cfg = model.config
    out["routes"] = jnp.zeros((batch, num_steps, cfg.num_hidden_layers, cfg.num_experts_per_tok), jnp.int32)
    out["prompt_routes"] = _aligned_rows(prompt_routes[0], start)
  return {
    "step": jnp.int32(0),
    "logits": all_logits[:, -1],
    "cache": cache,
    "out": out,
    "lengths": jnp.zeros((batch,), jnp.int32),
    "done": max_new <= 0,
    "stopped": jnp.zeros((batch,), bool),
    "prompt_lp": prompt_lp,
  }


def _decode(
  graphdef,
  params,
  state,
  start,
  row_seeds,
  temperature,
  top_p,
  top_k,
  min_p,
  max_new,
  stop_ids,
  until,
  *,
  window: int,
  mask_width: int = 0,
  routed_experts: bool = False,
  top_width: int = 0,
  filters: bool = True,
):
  """Decodes from `state` (`_prefill`'s, or an earlier `_decode`'s) until every row has finished,
  the output is full, step `until` is reached or the next token would fall outside the cache's
  first `window` slots (static: attention reads only those); `row_seeds [B]` uint32. One
  `jax.lax.while_loop`; every row's token of step `t` goes to slot `P + t` (one in-place write
  per layer). A generation cut into several calls (windows, weights swapped between them) draws
  the same tokens as one call with the same weights."""
  model = nnx.merge(graphdef, params)
  num_steps = state["out"]["output_ids"].shape[1]
  prompt_len = state["prompt_lp"].shape[1]
  last = min(num_steps, window - prompt_len)  # steps this window holds
  routing = {"return_routing": True} if routed_experts else {}
  keys = jax.vmap(jax.random.key)(row_seeds)
  sample = jax.vmap(
    functools.partial(
      _sample, mask_width=mask_width, top_width=top_width, filters=filters, invariant_sums=model.invariant
    )
  )

  def cond(st):
    return (st["step"] < jnp.minimum(until, last)) & ~jnp.all(st["done"])

  def body(st):
    step, out, lengths, done = st["step"], st["out"], st["lengths"], st["done"]
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
    token, lp, support, top = sample(st["logits"].astype(jnp.float32), step_keys, temperature, top_p, top_k, min_p)
    active = ~done
    new = {"output_ids": jnp.where(active, token, 0), "logprobs": jnp.where(active, lp, 0.0)}
    if mask_width:
      new.update(
        support=jnp.where(active[:, None], support["ids"], -1),
        support_lp=jnp.where(active[:, None], support["logprobs"], 0.0),
        support_size=jnp.where(active, support["size"], 0),
      )
    if top_width:
      new.update(
        top_ids=jnp.where(active[:, None], top["ids"], 0), top_lp=jnp.where(active[:, None], top["logprobs"], 0.0)
      )
    out = dict(out, **{k: out[k].at[:, step].set(v) for k, v in new.items()})
    lengths = lengths + active.astype(jnp.int32)
    hit = active & jnp.any(token[:, None] == stop_ids, axis=-1)
    stopped = st["stopped"] | hit
    done = done | hit | (lengths >= max_new)
    next_logits, cache, *routes = model.decode(
      token[:, None].astype(jnp.int32), st["cache"], slot=prompt_len + step, start=start, window=window, **routing
    )
    if routed_experts:
      out = dict(out, routes=out["routes"].at[:, step].set(routes[0][:, 0]))
    return dict(
      st, step=step + 1, logits=next_logits[:, 0], cache=cache, out=out, lengths=lengths, done=done, stopped=stopped
    )

  return jax.lax.while_loop(cond, body, state)


def _abstract(x) -> jax.ShapeDtypeStruct:
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _take_rows(state, index):
  """The decoding state of rows `index [B']` only (continuous batching: finished rows leave)."""
  rows = lambda x: jnp.take(x, index, axis=0)
  cache = LayerCache(*(jnp.take(c, index, axis=1) for c in state["cache"]))  # [L, B, S, KV, D]
  return {
    **jax.tree.map(rows, {k: v for k, v in state.items() if k not in ("step", "cache")}),
    "step": state["step"],
    "cache": cache,
  }


def _window(filled: int, cache_len: int) -> int:
  """Cache slots a decoding call attends over once `filled` slots are in use: a power of two
  (at least 16), at most the cache, so a stream of requests builds a handful of programs."""
  return min(cache_len, _bucket(filled, 16))


# Decoding steps between two chances to swap the weights of a running batch (a pause in place).
SEGMENT_STEPS = 16
# Decoding steps between two looks at which rows finished (they leave the batch when it halves).
_CHECK_STEPS = 64


class Sampler:
  """Batched sampling from a decoder model (`trainers.models.CausalLM`); weights can be swapped without recompiling.

  Args:
    model: the policy (its `dtype` is the inference precision: bfloat16 like a real engine,
      or float32).
    eos_token_ids: ids that end a sample unless `ignore_eos`; default the config's.
    max_batch_size: rows (prompts × n) per compiled call; larger requests run in chunks.
    seed: seeds the generator that draws a seed for requests that bring none.
  """

  def __init__(
    self, model: CausalLM, *, eos_token_ids: Sequence[int] | None = None, max_batch_size: int = 64, seed: int = 0
  ):
    self.config = model.config
    self.graphdef, params = nnx.split(model)
    self.params = weight_bits(params)  # bfloat16 weights as their bits (`decoder.WEIGHT_BITS`: no float32 copy)
    self.eos_token_ids = tuple(self.config.eos_token_id if eos_token_ids is None else eos_token_ids)
    self.max_batch_size = _bucket(max_batch_size, 1)
    self.arithmetic = model.arithmetic
    self._rng = np.random.default_rng(seed)
    self._traces = 0
    self.rows: jax.sharding.NamedSharding | None = None  # `shard`: a batch's rows split over devices
    self._row_split = 1
    # A batch-invariant model's programs compile as its arithmetic requires (`invariant.COMPILER_OPTIONS`).
    options = {"compiler_options": invariant.COMPILER_OPTIONS} if model.invariant else {}
    self._prefill = jax.jit(
      functools.partial(self._counted(_prefill), self.graphdef),
      static_argnames=("num_steps", "prompt_logprobs", "mask_width", "routed_experts", "top_width"),
      **options,
    )
    # The state is donated: XLA updates the carried cache in place, with no copy even on entry.
    self._decode = jax.jit(
      functools.partial(self._counted(_decode), self.graphdef),
      static_argnames=("window", "mask_width", "routed_experts", "top_width", "filters"),
      donate_argnums=(1,),
      **options,
    )
    self._take_rows = jax.jit(self._counted(_take_rows), **options)

  def _counted(self, fn):
    """`fn`, counting its traces (each one a program built: `num_compiled`)."""

    def traced(*args, **kwargs):
      self._traces += 1
      return fn(*args, **kwargs)

    return traced

  def set_params(self, params: nnx.State) -> None:
    """Swaps the weights (same structure, shapes and dtypes: nothing recompiles). bfloat16 weights
    may come as themselves (converted here) or as their bits already (`decoder.weight_bits`)."""
    old = jax.tree.map(lambda x: (x.shape, x.dtype), self.params)
    new = jax.tree.map(lambda x: (x.shape, x.dtype), weight_bits(jax.tree.map(_abstract, params)))
    if old != new:
      raise ValueError("new parameters differ in structure, shape or dtype")
    self.params = weight_bits(params)

  def served_model(self) -> CausalLM:
    """The served model with its weights in their dtype (a bfloat16 copy of the bits: for checks)."""
    return nnx.merge(self.graphdef, jax.tree.map(from_weight_bits, self.params))

  def served_params(self) -> nnx.State:
    """The served weights' structure, shapes, dtypes (bfloat16, not its bits) and shardings, as
    `jax.ShapeDtypeStruct`s: what a new set of weights must match."""
    return jax.tree.map(lambda x: from_weight_bits(_abstract(x)), self.params)

  def shard(self, shardings: nnx.State, rows: jax.sharding.NamedSharding) -> None:
    """Places the weights by `shardings` (a state of shardings, e.g. a trainer's FSDP/TP layout
    on its mesh) and splits each batch's rows over `rows`' devices (`rows`: a sharding of
    `[batch]` arrays; a batch that does not divide runs replicated). XLA then gathers each layer's
    weights while decoding, and the KV cache is split with the rows."""
    self.set_params(jax.device_put(self.params, shardings))
    axes = [a for entry in rows.spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
    self.rows, self._row_split = rows, math.prod(rows.mesh.shape[a] for a in axes)

  def _placed_rows(self, *arrays: np.ndarray) -> tuple:
    """`arrays` (`[batch, ...]`) split over `self.rows` when the batch divides (else as given)."""
    if self.rows is None or arrays[0].shape[0] % self._row_split:
      return arrays
    spec = self.rows.spec
    return tuple(jax.device_put(a, self.rows.update(spec=P(*spec, *([None] * (a.ndim - len(spec)))))) for a in arrays)

  @property
  def num_compiled(self) -> int:
    """Number of programs built so far (a prefill per distinct bucket, a decoder per bucket and
    attention window, a row compaction per pair of batch buckets), counted as traces, so it does
    not depend on which cache serves a compiled program."""
    return self._traces

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    params: SamplingOptions | Sequence[SamplingOptions],
    *,
    prompt_logprobs: bool = False,
    version: str = "",
    between=None,
  ) -> list[Completion]:
    """Samples `params.n` completions per prompt; returns them prompt-major.

    A sample with seed `s` draws from key `fold_in(key(s), step)`, so a seeded request is
    reproducible whatever else is batched with it, and its `n` samples (which share the seed,
    as in SGLang) are identical. Without a seed, every sample draws its own from this
    sampler's generator. With `prompt_logprobs`, each completion carries
    `prompt_logprobs[t]` = the log-prob of prompt token `t + 1` (length `len(prompt) - 1`).

    `between`: called every `SEGMENT_STEPS` decoding steps of a running batch; it returns None,
    or `(params, version)` to decode on with other weights (SGLang's pause in place across a
    weight update: the KV cache of the tokens so far stays). Each completion's `versions` lists
    `(version, first output token)` of the weights that generated it, from `version`.
    """
    if isinstance(params, SamplingOptions):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    vocab, context = self.config.vocab_size, self.config.max_position_embeddings
    rows = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      prompt = [int(t) for t in prompt]
      if not prompt:
        raise ValueError(f"prompt {i} is empty")
      if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
      if len(prompt) + p.max_new_tokens > context:
        raise ValueError(
          f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens "
          f"{p.max_new_tokens} exceed the context length {context}"
        )
      stop = () if p.ignore_eos else tuple(p.stop_token_ids) + self.eos_token_ids
      for j in range(p.n):
        seed = p.seed if p.seed is not None else int(self._rng.integers(0, 2**32))
        rows.append((i, j, prompt, p, seed % 2**32, stop))
    out, current = [], [self.params, version]  # weights and version, as `between` swaps them
    for start in range(0, len(rows), self.max_batch_size):
      out += self._run(rows[start : start + self.max_batch_size], prompt_logprobs, current, between)
    return out

  def _run(self, rows, prompt_logprobs: bool, current: list, between) -> list[Completion]:
    batch = _bucket(len(rows), 1)
    prompt_len = _bucket(max(len(r[2]) for r in rows), 16)
    num_steps = _bucket(max(r[3].max_new_tokens for r in rows), 16)
    num_stop = _bucket(max(len(r[5]) for r in rows), 4)
    ids = np.zeros((batch, prompt_len), np.int32)
    start = np.full((batch,), prompt_len - 1, np.int32)  # padding rows: a one-token prompt
    seeds = np.zeros((batch,), np.uint32)
    temp = np.ones((batch,), np.float32)
    top_p = np.ones((batch,), np.float32)
    min_p = np.zeros((batch,), np.float32)
    top_k = np.full((batch,), -1, np.int32)
    max_new = np.zeros((batch,), np.int32)  # padding rows are done before the first step
    stop = np.full((batch, num_stop), -1, np.int32)
    for b, (i, j, prompt, p, seed, stop_ids) in enumerate(rows):
      start[b] = prompt_len - len(prompt)  # left-padded: every row's next token goes to slot prompt_len
      ids[b, start[b] :] = prompt
      seeds[b] = seed
      greedy = p.temperature < _GREEDY_BELOW
      temp[b] = 1.0 if greedy else p.temperature
      top_k[b] = 1 if greedy else p.top_k
      top_p[b], min_p[b], max_new[b] = p.top_p, p.min_p, p.max_new_tokens
      stop[b, : len(stop_ids)] = stop_ids
    masked = [b for b, r in enumerate(rows) if r[3].sampling_mask]
    # Greedy rows (top_k 1) and finite top-k bound the support; the width is bucketed, and never
    # past the vocabulary (top_k >= vocab is "every token", as in SGLang).
    mask_width = min(_bucket(max(int(top_k[b]) for b in masked), 1), self.config.vocab_size) if masked else 0
    routed = any(r[3].routed_experts for r in rows)
    # Whether any row restricts its support (top-p, top-k, min-p, greedy, a sampling mask): else
    # the draw needs no sort of the vocabulary (`_sample`).
    filters = bool(mask_width or np.any(top_p < 1) or np.any(top_k > 0) or np.any(min_p > 0))
    top_width = (
      min(_bucket(max(r[3].top_logprobs_num for r in rows), 1), self.config.vocab_size)
      if any(r[3].top_logprobs_num for r in rows)
      else 0
    )
    if routed and not self.config.is_moe:
      raise ValueError("routed experts were asked of a dense model")
    per_row = [start, seeds, temp, top_p, min_p, top_k, max_new, stop]
    ids, *placed = self._placed_rows(ids, *per_row)
    state = self._prefill(
      current[0],
      ids,
      placed[0],
      placed[2],
      placed[6],
      num_steps=num_steps,
      prompt_logprobs=prompt_logprobs,
      mask_width=mask_width,
      routed_experts=routed,
      top_width=top_width,
    )
    starts = [[(current[1], 0)] for _ in rows]  # per row: (version, first output token it generated)
    at = np.arange(batch)  # at[b]: the request row decoded in batch row b (continuous batching reorders)
    finished = {}  # request row -> its outputs, once it has left the batch
    step, cache_len = 0, prompt_len + num_steps
    while step < num_steps:
      window = _window(prompt_len + step + 1, cache_len)
      until = min(num_steps, window - prompt_len, step + _CHECK_STEPS - step % _CHECK_STEPS)
      if between is not None:
        until = min(until, step + SEGMENT_STEPS - step % SEGMENT_STEPS)
      start_, seeds_, temp_, top_p_, min_p_, top_k_, max_new_, stop_ = placed
      state = self._decode(
        current[0],
        state,
        start_,
        seeds_,
        temp_,
        top_p_,
        top_k_,
        min_p_,
        max_new_,
        stop_,
        np.int32(until),
        window=window,
        mask_width=mask_width,
        routed_experts=routed,
        top_width=top_width,
        filters=filters,
      )
      step = until
      if step >= num_steps:
        break
      # Calls are dispatched without waiting for them; the host reads the rows' progress only to
      # record a swap, and at a window's end or every `_CHECK_STEPS` to let finished rows go.
      swap = between() if between is not None and step % SEGMENT_STEPS == 0 else None
      if swap is not None:
        lengths, done = jax.device_get((state["lengths"], state["done"]))
        current[:] = swap
        for b, r in enumerate(at):
          if r < len(rows) and not done[b]:
            starts[r].append((current[1], int(lengths[b])))
      if step % _CHECK_STEPS and step != window - prompt_len:
        continue
      done = np.asarray(jax.device_get(state["done"]))
      if done.all():
        break
      keep = np.flatnonzero(~done)
      smaller = _bucket(len(keep), 1)
      if smaller < len(at) and smaller % self._row_split == 0:
        finished.update(self._outputs(state, at, done))
        index = np.concatenate([keep, np.full(smaller - len(keep), np.flatnonzero(done)[0])])
        state = self._take_rows(state, jnp.asarray(index, jnp.int32))
        at = np.where(np.arange(smaller) < len(keep), at[index], batch)  # filler rows: finished copies
        per_row = [x[index] for x in per_row]
        placed = list(self._placed_rows(*per_row))
    finished.update(self._outputs(state, at, np.ones(len(at), bool)))
    out = {r: finished[r] for r in range(len(rows))}
    completions = []
    for b, (i, j, prompt, p, _, _) in enumerate(rows):
      row = out[b]
      n = int(row["lengths"])
      out_ids = row["output_ids"][:n]
      finish = ("stop", int(out_ids[n - 1])) if row["stopped"] else ("length", p.max_new_tokens)
      extra = {}
      if p.sampling_mask:
        sizes = row["support_size"][:n]
        masks = [row["support"][t, :k].tolist() for t, k in enumerate(sizes)]
        support_lps = [row["support_lp"][t, :k].tolist() for t, k in enumerate(sizes)]
        extra = dict(
          sampling_mask=masks,
          sampling_mask_logprobs=support_lps,  # the token's is its behaviour log-prob
          sampling_logprobs=[lps[m.index(tok)] for tok, m, lps in zip(out_ids.tolist(), masks, support_lps)],
        )
      if p.top_logprobs_num:
        k = min(p.top_logprobs_num, self.config.vocab_size)
        extra["top_logprobs"] = [
          list(zip(lps[:k].tolist(), ids[:k].tolist())) for lps, ids in zip(row["top_lp"][:n], row["top_ids"][:n])
        ]
      if p.routed_experts:  # positions 0 .. len(prompt) + n - 2: the prompt's, then the fed tokens'
        seq = np.concatenate([row["prompt_routes"][: len(prompt)], row["routes"][:n]])
        extra["routed_experts"] = seq[: len(prompt) + n - 1]
      versions = [(v, k) for v, k in starts[b] if k < n] or starts[b][:1]  # switches after its last token: none
      completions.append(
        Completion(
          i,
          j,
          len(prompt),
          out_ids.tolist(),
          row["logprobs"][:n].tolist(),
          finish,
          row["prompt_lp"][: len(prompt) - 1].tolist() if prompt_logprobs else None,
          versions=versions,
          **extra,
        )
      )
    return completions

  @staticmethod
  def _outputs(state, at: np.ndarray, rows: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
    """The outputs of batch rows `rows` (a mask) on the host, by request row (`at`)."""
    host = jax.device_get(
      {**state["out"], "lengths": state["lengths"], "stopped": state["stopped"], "prompt_lp": state["prompt_lp"]}
    )
    return {int(r): {k: v[b] for k, v in host.items()} for b, r in enumerate(at) if rows[b]}
