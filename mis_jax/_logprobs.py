"""Memory-efficient per-token log-probs and entropy of an LM head, chunked over tokens.

The trainer needs ``log π(y_t | ·)`` of the sampled tokens (and the entropy bonus), not the
``[T, V]`` logits. With ``T = 8k`` tokens and ``V = 152k`` (Qwen) the float32 logits alone are
5 GB, and autodiff keeps them (and the softmax) alive for the backward pass. Here the logits
exist one chunk of ``chunk_size`` tokens at a time, in the forward pass and, through a
``jax.custom_vjp`` that recomputes them, in the backward pass too: memory beyond the inputs,
outputs and gradients is ``O(chunk_size · V + D · V)`` whatever ``T`` is.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mis_jax import _validation

LM_HEAD_LAYOUTS = ("dv", "vd")


def _logits(h, w, layout: str, temperature: float):
  """float32 ``(h @ W) / τ`` of one chunk ``h [C, D]``; products accumulate in float32."""
  contract = (((1,), (0,)), ((), ())) if layout == "dv" else (((1,), (1,)), ((), ()))
  z = jax.lax.dot_general(h, w, contract, preferred_element_type=jnp.float32)
  return z if temperature == 1.0 else z / temperature


def _chunked(x, num_chunks: int, chunk: int):
  """``[T, ...] -> [num_chunks, chunk, ...]``, zero-padding the tail (a no-op if none)."""
  pad = num_chunks * chunk - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return jnp.reshape(x, (num_chunks, chunk) + x.shape[1:])


def _unchunked(x, num_tokens: int):
  return jnp.reshape(x, (-1,) + x.shape[2:])[:num_tokens]


def _num_chunks(num_tokens: int, chunk_size: int):
  chunk = max(1, min(chunk_size, num_tokens))
  return -(-num_tokens // chunk), chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _token_logprobs(hidden, lm_head, targets, temperature, chunk_size, layout, with_entropy):
  """Flat core: ``hidden [T, D]``, ``lm_head`` (same dtype), ``targets [T]`` int32 in range."""
  out, _ = _token_logprobs_fwd(hidden, lm_head, targets, temperature, chunk_size, layout,
                               with_entropy)
  return out


def _token_logprobs_fwd(hidden, lm_head, targets, temperature, chunk_size, layout, with_entropy):
  num_tokens = hidden.shape[0]
  num_chunks, chunk = _num_chunks(num_tokens, chunk_size)

  def body(_, xs):
    h, y = xs
    z = _logits(h, lm_head, layout, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0] - lse
    if not with_entropy:
      return None, (lp, lse, lse)  # third slot unused; keeps one scan signature
    log_p = z - lse[:, None]
    # -Σ p log p, with log p = z - lse exact: no cancellation of lse against Σ p z.
    ent = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return None, (lp, lse, ent)

  _, (lp, lse, ent) = jax.lax.scan(
      body, None, (_chunked(hidden, num_chunks, chunk), _chunked(targets, num_chunks, chunk)))
  lp = _unchunked(lp, num_tokens)
  if not with_entropy:
    return lp, (hidden, lm_head, targets, lse, None)
  # Residuals are O(T): the inputs themselves plus per-token lse and entropy (chunked, padded).
  return (lp, _unchunked(ent, num_tokens)), (hidden, lm_head, targets, lse, ent)


def _token_logprobs_bwd(temperature, chunk_size, layout, with_entropy, res, g):
  hidden, lm_head, targets, lse, ent = res
  num_tokens, vocab = hidden.shape[0], lm_head.shape[1 if layout == "dv" else 0]
  num_chunks, chunk = _num_chunks(num_tokens, chunk_size)
  g_lp, g_ent = g if with_entropy else (g, None)
  # Padded rows get zero cotangents, hence dz = 0 exactly (every factor below is finite):
  # they add nothing to dW, and their dh rows are sliced off.
  g_lp = _chunked(g_lp.astype(jnp.float32), num_chunks, chunk)
  if with_entropy:
    g_ent = _chunked(g_ent.astype(jnp.float32), num_chunks, chunk)
  else:
    g_ent = ent = jnp.zeros_like(g_lp)  # dummies, unused by the body
  vocab_ids = jnp.arange(vocab, dtype=jnp.int32)[None, :]

  def body(dw, xs):
    h, y, lse_c, ent_c, g_lp_c, g_ent_c = xs
    z = _logits(h, lm_head, layout, temperature)
    log_p = z - lse_c[:, None]
    p = jnp.exp(log_p)
    # d lp / dz = onehot(y) - p;   d H / dz = -p (log p + H).
    dz = g_lp_c[:, None] * ((vocab_ids == y[:, None]).astype(jnp.float32) - p)
    if with_entropy:
      dz = dz - g_ent_c[:, None] * p * (log_p + ent_c[:, None])
    if temperature != 1.0:
      dz = dz / temperature
    # Both matmuls take dz in the inputs' dtype and accumulate in float32 (bf16 for bf16
    # inputs, as fused cross-entropy kernels do); dW accumulates across chunks in float32.
    dz = dz.astype(h.dtype)
    if layout == "dv":
      dh = jax.lax.dot_general(dz, lm_head, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(h, dz, (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    else:
      dh = jax.lax.dot_general(dz, lm_head, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(dz, h, (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    return dw, dh.astype(h.dtype)

  xs = (_chunked(hidden, num_chunks, chunk), _chunked(targets, num_chunks, chunk), lse, ent,
        g_lp, g_ent)
  dw, dh = jax.lax.scan(body, jnp.zeros(lm_head.shape, jnp.float32), xs)
  # Integer targets get no cotangent.
  return _unchunked(dh, num_tokens), dw.astype(lm_head.dtype), None


_token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


def _check_args(hidden, lm_head, targets, temperature, chunk_size, return_entropy, layout):
  hidden = _validation.as_array("hidden", hidden)
  lm_head = _validation.as_array("lm_head", lm_head)
  targets = _validation.as_array("targets", targets)
  if layout not in LM_HEAD_LAYOUTS:
    raise ValueError(f"lm_head_layout={layout!r} is invalid; allowed values: "
                     f"{', '.join(LM_HEAD_LAYOUTS)}")
  if not jnp.issubdtype(hidden.dtype, jnp.floating):
    raise TypeError(f"'hidden' must be a floating-point array, got dtype {hidden.dtype}")
  if not jnp.issubdtype(lm_head.dtype, jnp.floating):
    raise TypeError(f"'lm_head' must be a floating-point array, got dtype {lm_head.dtype}")
  if hidden.ndim < 1:
    raise ValueError("'hidden' must have shape [..., D], got a scalar")
  if lm_head.ndim != 2:
    raise ValueError(f"'lm_head' must have rank 2 ([D, V] for lm_head_layout='dv', [V, D] for "
                     f"'vd'), got shape {tuple(lm_head.shape)}")
  d_axis = 0 if layout == "dv" else 1
  if lm_head.shape[d_axis] != hidden.shape[-1]:
    raise ValueError(
        f"'hidden' has shape {tuple(hidden.shape)} (D={hidden.shape[-1]}) but 'lm_head' has "
        f"shape {tuple(lm_head.shape)} with D={lm_head.shape[d_axis]} for "
        f"lm_head_layout={layout!r}; pass lm_head_layout='vd' for a [V, D] (HF/tied) matrix")
  vocab = lm_head.shape[1 - d_axis]
  if vocab == 0:
    raise ValueError("'lm_head' has an empty vocabulary axis (V=0)")
  if targets.dtype == jnp.bool_ or not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"'targets' must be an integer array, got dtype {targets.dtype}")
  if tuple(targets.shape) != tuple(hidden.shape[:-1]):
    raise ValueError(f"'targets' has shape {tuple(targets.shape)} but 'hidden' has shape "
                     f"{tuple(hidden.shape)}; targets must have hidden's leading shape "
                     f"{tuple(hidden.shape[:-1])}")
  if _validation._is_concrete(targets) and targets.size:
    ids = np.asarray(targets)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
      raise ValueError(f"'targets' holds ids in [{lo}, {hi}], outside [0, V={vocab}); mask such "
                       "tokens and pass any valid id (under jit they are clipped)")
  if isinstance(temperature, jax.core.Tracer):
    raise TypeError("temperature must be a static Python float, got a traced value")
  is_number = isinstance(temperature, (int, float, np.number)) or (
      isinstance(temperature, (np.ndarray, jax.Array)) and np.ndim(temperature) == 0)
  if isinstance(temperature, bool) or not is_number:
    raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
  temperature = float(temperature)
  if not (math.isfinite(temperature) and temperature > 0):
    raise ValueError(f"temperature must be finite and > 0, got {temperature}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
    raise TypeError(f"chunk_size must be a Python int (static), got "
                    f"{type(chunk_size).__name__} {chunk_size!r}")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
  if not isinstance(return_entropy, (bool, np.bool_)):
    raise TypeError(f"return_entropy must be a bool, got {type(return_entropy).__name__}")
  return hidden, lm_head, targets, temperature, int(chunk_size), bool(return_entropy), vocab


def _compute_dtype(a, b):
  """The float dtype both operands are cast to: the wider one (bf16 with f16: float32), as
  JAX's standard promotion does, spelled out so it also holds under strict promotion."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  if a == b:
    return a
  bits_a, bits_b = jnp.finfo(a).bits, jnp.finfo(b).bits
  if bits_a == bits_b:
    return jnp.dtype(jnp.float32)
  return a if bits_a > bits_b else b


def token_logprobs(hidden, lm_head, targets, *, temperature: float = 1.0, chunk_size: int = 1024,
                   return_entropy: bool = False, lm_head_layout: str = "dv"):
  """Per-token log-probs (and entropy) of ``targets`` without materialising ``[T, V]`` logits.

  With ``z_t = (h_t · W) / τ`` the float32 logits of token ``t``,

    ``lse_t = log Σ_v exp z_tv``,   ``logprob_t = z_{t, y_t} - lse_t``,
    ``entropy_t = -Σ_v p_tv log p_tv``  with  ``log p_tv = z_tv - lse_t``.

  Tokens are processed ``chunk_size`` at a time by a ``lax.scan``, so only a ``[chunk_size, V]``
  block of logits exists at once. The backward pass (a ``jax.custom_vjp``) keeps only the inputs
  and per-token ``lse_t`` and ``entropy_t`` and rescans the chunks, recomputing the logits:

    ``∂L/∂z_tv = g^lp_t (1[v = y_t] - p_tv) - g^H_t p_tv (log p_tv + entropy_t)``,
    ``∂L/∂h_t = (∂L/∂z_t / τ) · Wᵀ``,   ``∂L/∂W = Σ_t h_tᵀ (∂L/∂z_t / τ)``,

  for any cotangents ``g^lp`` of the log-probs and ``g^H`` of the entropy together. ``∂L/∂W``
  accumulates in float32 across chunks. Temporary memory is about ``2 · chunk_size · V``
  float32 values (the logits block and its gradient; one block in the forward pass), plus a
  ``D · V`` float32 accumulator when ``lm_head`` is not float32, whatever the number of tokens
  (compiled, T=8192, D=1024, V=151936, chunk 1024: 1.25 GB against 19.9 GB for full logits).
  The price is one extra ``[T, D] × [D, V]`` matmul: 4 instead of 3 for forward + backward.

  Everything is computed in float32: bf16 ``hidden`` and ``lm_head`` enter the matmuls as bf16
  with float32 accumulation (no upcast copy of ``W``); in the backward pass ``∂L/∂z`` is rounded
  to the inputs' dtype before its two matmuls, as fused cross-entropy kernels do (exact for
  float32 inputs). Gradients are returned in the inputs' dtypes. If ``hidden`` and ``lm_head``
  have different dtypes both are cast to their promoted dtype first.

  Args:
    hidden: ``[..., D]`` final hidden states (after the final norm), any float dtype; the leading
      shape (e.g. ``[B, L]`` or packed ``[T]``) is flattened to ``T`` tokens.
    lm_head: the output projection, ``[D, V]`` (``lm_head_layout="dv"``: an ``nnx.Linear``
      kernel) or ``[V, D]`` (``"vd"``: HF's ``lm_head.weight``, tied input embeddings).
    targets: ``[...]`` int token ids, ``hidden``'s leading shape: ``y_t``, usually the input ids
      shifted left by one. Ids must lie in ``[0, V)``: concrete out-of-range ids raise, traced
      ones (under jit) are clipped to the range, so mask those positions in the loss.
    temperature: ``τ > 0``, the sampling temperature the rollout used (static).
    chunk_size: tokens per chunk (static); trades memory ``∝ chunk_size · V`` for matmul
      efficiency. ``T`` need not be a multiple: the tail is zero-padded internally and the
      padded rows are sliced off and receive no gradient.
    return_entropy: also return the per-token entropy of ``softmax(z_t)``.
    lm_head_layout: ``"dv"`` or ``"vd"``, the layout of ``lm_head`` (no transposed copy made).

  Returns:
    float32 log-probs of ``hidden``'s leading shape, or ``(logprobs, entropy)`` when
    ``return_entropy``. Differentiable in ``hidden`` and ``lm_head`` (not in ``targets``).
  """
  hidden, lm_head, targets, temperature, chunk_size, return_entropy, vocab = _check_args(
      hidden, lm_head, targets, temperature, chunk_size, return_entropy, lm_head_layout)
  lead = tuple(hidden.shape[:-1])
  dtype = _compute_dtype(hidden.dtype, lm_head.dtype)
  flat_hidden = jnp.reshape(hidden, (-1, hidden.shape[-1])).astype(dtype)
  flat_targets = jnp.clip(jnp.reshape(targets, (-1,)).astype(jnp.int32), 0, vocab - 1)
  out = _token_logprobs(flat_hidden, jnp.asarray(lm_head).astype(dtype), flat_targets, temperature,
                        chunk_size, lm_head_layout, return_entropy)
  if return_entropy:
    return jnp.reshape(out[0], lead), jnp.reshape(out[1], lead)
  return jnp.reshape(out, lead)
