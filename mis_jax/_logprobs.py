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
  """``[T, ...] -> [num_chunks, chunk, ...]``, zero-padding the tail (a no-op if none); None stays None."""
  if x is None:
    return None
  pad = num_chunks * chunk - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return jnp.reshape(x, (num_chunks, chunk) + x.shape[1:])


def _unchunked(x, num_tokens: int):
  if x is None:
    return None
  return jnp.reshape(x, (-1,) + x.shape[2:])[:num_tokens]


def _num_chunks(num_tokens: int, chunk_size: int):
  chunk = max(1, min(chunk_size, num_tokens))
  return -(-num_tokens // chunk), chunk


def _support_member(ids, vocab: int):
  """``[C, K]`` support ids (``-1`` = padding) → ``[C, V]`` bool membership. A row with no
  valid id stands for "no truncation known" and is the whole vocabulary."""
  valid = ids >= 0
  rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
  cols = jnp.where(valid, ids, vocab)  # out of range: dropped
  member = jnp.zeros((ids.shape[0], vocab), bool).at[rows, cols].set(True, mode="drop")
  return member | ~jnp.any(valid, axis=-1, keepdims=True)


def _support_lse(z, member):
  """``log Σ_{v∈S} exp z_v`` per row (``S`` never empty)."""
  return jax.nn.logsumexp(jnp.where(member, z, -jnp.inf), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _token_logprobs(
  hidden,
  lm_head,
  targets,
  support,
  extra,
  temperature,
  chunk_size,
  layout,
  with_entropy,
  with_support,
  with_mass,
  with_sum_sq,
):
  """Flat core: ``hidden [T, D]``, ``lm_head`` (same dtype), ``targets [T]`` int32 in range,
  ``support [T, K]`` int32 (``-1`` padded) or None, ``extra [T, k]`` int32 in range or None.
  Returns ``(logprobs, entropy, kept_logmass, sum_pi_squared, extra_logprobs)``, the last four
  None when not asked for."""
  out, _ = _token_logprobs_fwd(
    hidden,
    lm_head,
    targets,
    support,
    extra,
    temperature,
    chunk_size,
    layout,
    with_entropy,
    with_support,
    with_mass,
    with_sum_sq,
  )
  return out


def _token_logprobs_fwd(
  hidden,
  lm_head,
  targets,
  support,
  extra,
  temperature,
  chunk_size,
  layout,
  with_entropy,
  with_support,
  with_mass,
  with_sum_sq=False,
):
  num_tokens, vocab = hidden.shape[0], lm_head.shape[1 if layout == "dv" else 0]
  num_chunks, chunk = _num_chunks(num_tokens, chunk_size)

  def body(_, xs):
    h, y, ids, extra_ids = xs
    z = _logits(h, lm_head, layout, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    member = _support_member(ids, vocab) if with_support else None
    lse_s = _support_lse(z, member) if with_support else None  # None: the support is everything
    norm = lse if lse_s is None else lse_s
    lp = jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0] - norm
    ent = None
    if with_entropy:
      log_q = z - norm[:, None]
      # -Σ q log q over the support, with log q = z - lse_S exact (no cancellation).
      terms = jnp.exp(log_q) * log_q
      ent = -jnp.sum(terms if member is None else jnp.where(member, terms, 0.0), axis=-1)
    sum_sq = None
    if with_sum_sq:  # Σ q² = exp(lse(2 log q)) over the support
      log_q2 = 2.0 * (z - norm[:, None])
      sum_sq = jnp.exp(jax.nn.logsumexp(log_q2 if member is None else jnp.where(member, log_q2, -jnp.inf), axis=-1))
    # The extra ids' log-probs are over the whole vocabulary (lse), the scale engines report top-k in.
    extra_lp = None if extra_ids is None else jnp.take_along_axis(z, extra_ids, axis=-1) - lse[:, None]
    return None, (lp, lse, lse_s, ent, sum_sq, extra_lp)

  _, (lp, lse, lse_s, ent, sum_sq, extra_lp) = jax.lax.scan(
    body,
    None,
    (
      _chunked(hidden, num_chunks, chunk),
      _chunked(targets, num_chunks, chunk),
      _chunked(support, num_chunks, chunk),
      _chunked(extra, num_chunks, chunk),
    ),
  )
  mass = (lse_s - lse if with_support else jnp.zeros_like(lse)) if with_mass else None
  out = tuple(_unchunked(x, num_tokens) for x in (lp, ent, mass, sum_sq, extra_lp))
  # Residuals are O(T): the inputs themselves plus per-token lse (and lse_S, entropy when used).
  return out, (hidden, lm_head, targets, support, extra, lse, lse_s, ent)


def _token_logprobs_bwd(temperature, chunk_size, layout, with_entropy, with_support, with_mass, with_sum_sq, res, g):
  hidden, lm_head, targets, support, extra, lse, lse_s, ent = res
  num_tokens, vocab = hidden.shape[0], lm_head.shape[1 if layout == "dv" else 0]
  num_chunks, chunk = _num_chunks(num_tokens, chunk_size)
  # Padded rows get zero cotangents, hence dz = 0 exactly (every factor below is finite):
  # they add nothing to dW, and their dh rows are sliced off.
  # Σπ² is a statistic (OTB's baseline), not differentiated: its cotangent is dropped.
  g_lp, g_ent, g_mass = (None if x is None else _chunked(x.astype(jnp.float32), num_chunks, chunk) for x in g[:3])
  g_extra = None if extra is None else _chunked(g[4].astype(jnp.float32), num_chunks, chunk)
  vocab_ids = jnp.arange(vocab, dtype=jnp.int32)[None, :]

  def body(dw, xs):
    h, y, ids, extra_ids, lse_c, lse_s_c, ent_c, g_lp_c, g_ent_c, g_mass_c, g_extra_c = xs
    z = _logits(h, lm_head, layout, temperature)
    # q: the distribution renormalised over the support (p itself without one).
    log_q = z - (lse_c if lse_s_c is None else lse_s_c)[:, None]
    q = jnp.exp(log_q)
    if with_support:
      member = _support_member(ids, vocab)
      q = jnp.where(member, q, 0.0)
      log_q = jnp.where(member, log_q, 0.0)
    # d lp / dz = onehot(y) - q;   d H / dz = -q (log q + H);   d log M / dz = q - p.
    dz = g_lp_c[:, None] * ((vocab_ids == y[:, None]).astype(jnp.float32) - q)
    if with_entropy:
      dz = dz - g_ent_c[:, None] * q * (log_q + ent_c[:, None])
    if with_mass and with_support:  # without a support the kept log-mass is the constant 0
      dz = dz + g_mass_c[:, None] * (q - jnp.exp(z - lse_c[:, None]))
    if extra_ids is not None:  # d log p_v / dz = onehot(v) - p, summed over the extra ids
      rows = jnp.broadcast_to(jnp.arange(z.shape[0])[:, None], extra_ids.shape)
      dz = (
        dz
        + jnp.zeros_like(z).at[rows, extra_ids].add(g_extra_c)
        - jnp.sum(g_extra_c, axis=-1, keepdims=True) * jnp.exp(z - lse_c[:, None])
      )
    if temperature != 1.0:
      dz = dz / temperature
    # Both matmuls take dz in the inputs' dtype and accumulate in float32 (bf16 for bf16
    # inputs, as fused cross-entropy kernels do); dW accumulates across chunks in float32.
    dz = dz.astype(h.dtype)
    if layout == "dv":
      dh = jax.lax.dot_general(dz, lm_head, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(h, dz, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    else:
      dh = jax.lax.dot_general(dz, lm_head, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(dz, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dw, dh.astype(h.dtype)

  xs = (
    _chunked(hidden, num_chunks, chunk),
    _chunked(targets, num_chunks, chunk),
    _chunked(support, num_chunks, chunk),
    _chunked(extra, num_chunks, chunk),
    lse,
    lse_s,
    ent,
    g_lp,
    g_ent,
    g_mass,
    g_extra,
  )
  dw, dh = jax.lax.scan(body, jnp.zeros(lm_head.shape, jnp.float32), xs)
  # Integer targets, support and extra ids get no cotangent.
  return _unchunked(dh, num_tokens), dw.astype(lm_head.dtype), None, None, None


_token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


def _check_args(hidden, lm_head, targets, temperature, chunk_size, return_entropy, layout):
  hidden = _validation.as_array("hidden", hidden)
  lm_head = _validation.as_array("lm_head", lm_head)
  targets = _validation.as_array("targets", targets)
  if layout not in LM_HEAD_LAYOUTS:
    raise ValueError(f"lm_head_layout={layout!r} is invalid; allowed values: {', '.join(LM_HEAD_LAYOUTS)}")
  if not jnp.issubdtype(hidden.dtype, jnp.floating):
    raise TypeError(f"'hidden' must be a floating-point array, got dtype {hidden.dtype}")
  if not jnp.issubdtype(lm_head.dtype, jnp.floating):
    raise TypeError(f"'lm_head' must be a floating-point array, got dtype {lm_head.dtype}")
  if hidden.ndim < 1:
    raise ValueError("'hidden' must have shape [..., D], got a scalar")
  if lm_head.ndim != 2:
    raise ValueError(
      f"'lm_head' must have rank 2 ([D, V] for lm_head_layout='dv', [V, D] for 'vd'), got shape {tuple(lm_head.shape)}"
    )
  d_axis = 0 if layout == "dv" else 1
  if lm_head.shape[d_axis] != hidden.shape[-1]:
    raise ValueError(
      f"'hidden' has shape {tuple(hidden.shape)} (D={hidden.shape[-1]}) but 'lm_head' has "
      f"shape {tuple(lm_head.shape)} with D={lm_head.shape[d_axis]} for "
      f"lm_head_layout={layout!r}; pass lm_head_layout='vd' for a [V, D] (HF/tied) matrix"
    )
  vocab = lm_head.shape[1 - d_axis]
  if vocab == 0:
    raise ValueError("'lm_head' has an empty vocabulary axis (V=0)")
  _check_integer("targets", targets)
  if tuple(targets.shape) != tuple(hidden.shape[:-1]):
    raise ValueError(
      f"'targets' has shape {tuple(targets.shape)} but 'hidden' has shape "
      f"{tuple(hidden.shape)}; targets must have hidden's leading shape "
      f"{tuple(hidden.shape[:-1])}"
    )
  _check_id_range("targets", targets, vocab, "mask such tokens and pass any valid id (under jit they are clipped)")
  if isinstance(temperature, jax.core.Tracer):
    raise TypeError("temperature must be a static Python float, got a traced value")
  is_number = isinstance(temperature, (int, float, np.number)) or (
    isinstance(temperature, (np.ndarray, jax.Array)) and np.ndim(temperature) == 0
  )
  if isinstance(temperature, bool) or not is_number:
    raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
  temperature = float(temperature)
  if not (math.isfinite(temperature) and temperature > 0):
    raise ValueError(f"temperature must be finite and > 0, got {temperature}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
    raise TypeError(f"chunk_size must be a Python int (static), got {type(chunk_size).__name__} {chunk_size!r}")
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


def _check_support(support_ids, support_mask, targets, vocab: int):
  """``support_ids [..., K]`` (and ``support_mask``) → int32 ids, ``-1`` where not in the support."""
  support_ids = _validation.as_array("support_ids", support_ids)
  if support_ids.dtype == jnp.bool_ or not jnp.issubdtype(support_ids.dtype, jnp.integer):
    raise TypeError(f"'support_ids' must be an integer array, got dtype {support_ids.dtype}")
  lead = tuple(targets.shape)
  if support_ids.ndim != len(lead) + 1 or tuple(support_ids.shape[:-1]) != lead:
    raise ValueError(
      f"'support_ids' has shape {tuple(support_ids.shape)} but must be [..., K] with "
      f"targets' shape {lead} in front (K: the padded support width)"
    )
  if support_ids.shape[-1] == 0:
    raise ValueError("'support_ids' has width K=0; pass at least one column")
  if support_mask is not None:
    support_mask = _validation.as_array("support_mask", support_mask)
    if support_mask.dtype != jnp.bool_:
      raise TypeError(f"'support_mask' must be a bool array, got dtype {support_mask.dtype}")
    if tuple(support_mask.shape) != tuple(support_ids.shape):
      raise ValueError(
        f"'support_mask' has shape {tuple(support_mask.shape)} but 'support_ids' has shape {tuple(support_ids.shape)}"
      )
  concrete = (
    _validation._is_concrete(support_ids)
    and _validation._is_concrete(targets)
    and (support_mask is None or _validation._is_concrete(support_mask))
  )
  xp = np if concrete else jnp  # concrete inputs are checked (and, under an outer jit, kept) in NumPy
  valid = xp.asarray(support_ids) >= 0
  if support_mask is not None:
    valid = valid & xp.asarray(support_mask)
  ids = xp.where(valid, xp.asarray(support_ids), -1).astype(np.int32)
  if concrete and support_ids.size:
    ids_np, y = ids, np.asarray(targets)
    if ids_np.max() >= vocab:
      raise ValueError(f"'support_ids' holds id {int(ids_np.max())}, outside [0, V={vocab})")
    has = (ids_np >= 0).any(-1)
    outside = has & ~(ids_np == y[..., None]).any(-1)
    if outside.any():
      at = tuple(int(i) for i in np.argwhere(outside)[0])
      raise ValueError(
        f"target {int(y[at])} at index {at} is not in its support "
        f"{sorted(int(v) for v in ids_np[at] if v >= 0)}: a sampled token always is; "
        "check that supports and targets are aligned"
      )
  return ids


def _check_integer(name: str, ids) -> None:
  if ids.dtype == jnp.bool_ or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"'{name}' must be an integer array, got dtype {ids.dtype}")


def _check_id_range(name: str, ids, vocab: int, hint: str) -> None:
  """Concrete ids outside ``[0, V)`` raise, naming `name` (traced ones are clipped by the caller)."""
  if _validation._is_concrete(ids) and ids.size:
    values = np.asarray(ids)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= vocab:
      raise ValueError(f"'{name}' holds ids in [{lo}, {hi}], outside [0, V={vocab}); {hint}")


def _check_extra(extra_ids, targets, vocab: int):
  """``extra_ids [..., k]`` → int32 ids in ``[0, V)`` (concrete ids out of range raise; traced ones clip)."""
  extra_ids = _validation.as_array("extra_ids", extra_ids)
  _check_integer("extra_ids", extra_ids)
  lead = tuple(targets.shape)
  if extra_ids.ndim != len(lead) + 1 or tuple(extra_ids.shape[:-1]) != lead or extra_ids.shape[-1] == 0:
    raise ValueError(
      f"'extra_ids' has shape {tuple(extra_ids.shape)} but must be [..., k] with k >= 1 and "
      f"targets' shape {lead} in front"
    )
  _check_id_range("extra_ids", extra_ids, vocab, "pass any valid id at positions the loss masks")
  return jnp.clip(jnp.asarray(extra_ids).astype(jnp.int32), 0, vocab - 1)


def token_logprobs(
  hidden,
  lm_head,
  targets,
  *,
  temperature: float = 1.0,
  chunk_size: int = 1024,
  return_entropy: bool = False,
  lm_head_layout: str = "dv",
  support_ids=None,
  support_mask=None,
  return_kept_mass: bool = False,
  return_sum_pi_squared: bool = False,
  extra_ids=None,
):
  """Per-token log-probs (and entropy) of ``targets`` without materialising ``[T, V]`` logits.

  With ``z_t = (h_t · W) / τ`` the float32 logits of token ``t``,

    ``lse_t = log Σ_v exp z_tv``,   ``logprob_t = z_{t, y_t} - lse_t``,
    ``entropy_t = -Σ_v p_tv log p_tv``  with  ``log p_tv = z_tv - lse_t``.

  **Sampling-mask replay.** With ``support_ids`` (the tokens that survived the engine's top-k /
  top-p / min-p filter at each position, ``S_t``), everything is over the truncated distribution
  the engine really sampled from, ``π_S(v) = π(v) / Σ_{u∈S} π(u)`` on ``S``:

    ``lse^S_t = log Σ_{v∈S_t} exp z_tv``,   ``logprob_t = z_{t, y_t} - lse^S_t``
    (``= log π(y) - log Σ_{v∈S} π(v)``),   ``entropy_t = -Σ_{v∈S_t} π_S log π_S``,

  and ``return_kept_mass`` adds ``kept_logmass_t = lse^S_t - lse_t = log Σ_{v∈S_t} π(v) ≤ 0``,
  the log of the probability mass the filter kept. A position whose support row is empty
  (every entry padding: prompt tokens, padding, untruncated sampling) is over the whole
  vocabulary (kept log-mass 0).

  Tokens are processed ``chunk_size`` at a time by a ``lax.scan``, so only a ``[chunk_size, V]``
  block of logits exists at once (with a support, also a ``[chunk_size, V]`` membership mask
  built by a scatter of the chunk's ``[chunk_size, K]`` ids). The backward pass (a
  ``jax.custom_vjp``) keeps only the inputs and per-token ``lse_t``, ``lse^S_t`` and
  ``entropy_t`` and rescans the chunks, recomputing the logits; with ``q`` the distribution
  the outputs are over (``π_S`` on ``S``, 0 elsewhere; ``p`` without a support):

    ``∂L/∂z_tv = g^lp_t (1[v = y_t] - q_tv) - g^H_t q_tv (log q_tv + entropy_t)
                 + g^M_t (q_tv - p_tv)``,
    ``∂L/∂h_t = (∂L/∂z_t / τ) · Wᵀ``,   ``∂L/∂W = Σ_t h_tᵀ (∂L/∂z_t / τ)``,

  for any cotangents ``g^lp``, ``g^H``, ``g^M`` of the outputs together. ``∂L/∂W``
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
    return_entropy: also return the per-token entropy (of ``π_S`` with a support).
    lm_head_layout: ``"dv"`` or ``"vd"``, the layout of ``lm_head`` (no transposed copy made).
    support_ids: optional ``[..., K]`` int ids of each position's sampling support, padded to a
      static width ``K`` with ``-1`` (or with any id and ``support_mask`` False), e.g. SGLang's
      ``output_token_sampling_mask``. Order and duplicates do not matter. Concrete inputs are
      checked: ids below ``V``, and each target inside its (non-empty) support; under jit a
      target outside its support gets ``z_y - lse^S`` (not a log-prob), so keep them aligned.
    support_mask: optional ``[..., K]`` bool, False for padding entries of ``support_ids``.
    return_kept_mass: also return ``kept_logmass`` (needs nothing else; 0 without a support).
    return_sum_pi_squared: also return ``Σ_v q_tv²`` (the distribution's collision probability,
      over the support with one), from the same chunks; OTB's path-variance proxy
      (:func:`mis_jax.optimal_token_baseline`). It is not differentiated (a zero gradient).
    extra_ids: optional ``[..., k]`` int ids: also return ``extra_logprobs [..., k]``, the
      log-probs ``z_{t,v} - lse_t`` of these ids over the whole vocabulary (no support; the scale
      SGLang reports its top-k log-probs in), gathered from the same chunks and differentiable:
      their backward adds ``Σ_j g_tj (1[v = v_tj] - p_tv)`` to ``∂L/∂z_t`` (score centering's
      top-k, contract §6.6). Ids must lie in ``[0, V)`` (traced ones are clipped).

  Returns:
    float32 log-probs of ``hidden``'s leading shape; with ``return_entropy``,
    ``return_kept_mass``, ``return_sum_pi_squared`` and/or ``extra_ids`` a tuple
    ``(logprobs, [entropy], [kept_logmass], [sum_pi_squared], [extra_logprobs])`` in that order.
    Differentiable in ``hidden`` and ``lm_head`` (not in ``targets`` or the ids).
  """
  hidden, lm_head, targets, temperature, chunk_size, return_entropy, vocab = _check_args(
    hidden, lm_head, targets, temperature, chunk_size, return_entropy, lm_head_layout
  )
  if not isinstance(return_kept_mass, (bool, np.bool_)):
    raise TypeError(f"return_kept_mass must be a bool, got {type(return_kept_mass).__name__}")
  if support_mask is not None and support_ids is None:
    raise ValueError("'support_mask' was given without 'support_ids'")
  lead = tuple(hidden.shape[:-1])
  with_support = support_ids is not None
  flat_support = None
  if with_support:
    ids = _check_support(support_ids, support_mask, targets, vocab)
    flat_support = jnp.reshape(ids, (math.prod(lead), ids.shape[-1]))
  dtype = _compute_dtype(hidden.dtype, lm_head.dtype)
  flat_hidden = jnp.reshape(hidden, (-1, hidden.shape[-1])).astype(dtype)
  flat_targets = jnp.clip(jnp.reshape(targets, (-1,)).astype(jnp.int32), 0, vocab - 1)
  if not isinstance(return_sum_pi_squared, (bool, np.bool_)):
    raise TypeError(f"return_sum_pi_squared must be a bool, got {type(return_sum_pi_squared).__name__}")
  flat_extra = None
  if extra_ids is not None:
    extra = _check_extra(extra_ids, targets, vocab)
    flat_extra = jnp.reshape(extra, (math.prod(lead), extra.shape[-1]))
  lp, ent, mass, sum_sq, extra_lp = _token_logprobs(
    flat_hidden,
    jnp.asarray(lm_head).astype(dtype),
    flat_targets,
    flat_support,
    flat_extra,
    temperature,
    chunk_size,
    lm_head_layout,
    return_entropy,
    with_support,
    bool(return_kept_mass),
    bool(return_sum_pi_squared),
  )
  outs = [jnp.reshape(x, lead + x.shape[1:]) for x in (lp, ent, mass, sum_sq, extra_lp) if x is not None]
  return outs[0] if len(outs) == 1 else tuple(outs)
