"""Score centering (contract §6.6): the sampled token's score ``∇log p(y_t)`` in the policy
gradient is replaced by the centred score ``∇log p(y_t) - E_{v~q}[∇log p(v)]``, ``q`` the
sampler's distribution at the token's prefix, estimated from the sampler's top-k head ``K``
with the mass outside it spread over the other tokens in proportion to ``p``:

  ``E_q[∇log p] ≈ Σ_{v∈K} q_v ∇log p_v + q_tail ∇log p_tail``,
  ``q_tail = 1 - Σ_K q_v``,   ``p_tail = 1 - Σ_K p_v``.

:func:`expected_logprob` is the per-token ``C_t = Σ_K sg(q_v) log p_v + sg(q_tail) log p_tail``
(its gradient is that estimate); :func:`centred_logprobs` makes ``lp - C + sg(C)``, equal to
``lp`` in value and carrying the centred score, which every policy-loss form reads in place of
``lp`` — so the forms, their clips, trust regions and weights are unchanged, and each token's
score is centred with the coefficient the form gives it (chain rule).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax import _metrics as metrics_lib
from mis_jax._segments import LOG_BOUND

# The trainer's tail mass is floored here (its head's mass capped at 1 - P_TAIL_MIN); past it the
# tail term carries no gradient instead of q_tail / p_tail.
P_TAIL_MIN = 1e-6


class ExpectedScore(NamedTuple):
  """Per trained token (flat ``[T]``, 0 off the mask).

  Attributes:
    expected: ``C_t``, differentiable through the trainer's top-k log-probs.
    drift_l1: ``‖q̂_t - p_t‖₁ = Σ_K |q_v - p_v| + |q_tail - p_tail|``, the L1 size of the
      expected score ``E_q̂[∇_z log p] = q̂ - p`` on the logits ``z`` (stop-gradient).
    tail_mass: ``q_tail``, the sampler's mass outside its top-k.
  """

  expected: jax.Array
  drift_l1: jax.Array
  tail_mass: jax.Array


def expected_logprob(topk_logprobs, rollout_topk_logprobs, mask) -> ExpectedScore:
  """``C_t = Σ_{v∈K} sg(q_v) log p_v + sg(q_tail) log p_tail`` per token (contract §6.6).

  Args:
    topk_logprobs: ``[T, k]`` float32, the trainer's ``log p_v`` of the sampler's top-k ids
      (carries the gradient).
    rollout_topk_logprobs: ``[T, k]`` float32, the sampler's ``log q_v`` of the same ids. A
      non-finite entry is zero mass; entries are clipped to ``[-B, 0]`` before ``exp``.
    mask: ``[T]`` bool, the trained tokens (elsewhere everything is 0, whatever the inputs hold).

  ``q_tail = max(1 - Σ_K q_v, 0)``; ``log p_tail = log1p(-min(Σ_K exp(clip(log p_v, -B, 0)), 1 - 1e-6))``,
  so ``p_tail >= 1e-6`` and the tail's gradient ``-q_tail p_v / p_tail`` stays finite (zero once
  the trainer's top-k holds all but 1e-6 of its mass). Log-probs are at most 0, so the head's mass
  is a plain sum of exponentials (no log-sum-exp's max): one exponential per entry serves the
  estimate, its gradient (``∂ p_head / ∂ log p_v = p_v``) and the metrics.
  """
  sg = jax.lax.stop_gradient
  rows = mask[:, None]
  finite = rows & jnp.isfinite(rollout_topk_logprobs)
  q_k = sg(jnp.where(finite, jnp.exp(jnp.clip(jnp.where(finite, rollout_topk_logprobs, 0.0), -LOG_BOUND, 0.0)), 0.0))
  q_tail = jnp.maximum(1.0 - jnp.sum(q_k, axis=-1), 0.0)
  lp_k = jnp.where(rows, topk_logprobs, 0.0)
  p_k = jnp.exp(jnp.clip(lp_k, -LOG_BOUND, 0.0))
  p_head = jnp.sum(p_k, axis=-1)
  log_p_tail = jnp.log1p(-jnp.minimum(p_head, 1.0 - P_TAIL_MIN))
  expected = jnp.sum(q_k * lp_k, axis=-1) + q_tail * log_p_tail
  p_tail = jnp.maximum(1.0 - sg(p_head), 0.0)
  drift = jnp.sum(jnp.where(rows, jnp.abs(q_k - sg(p_k)), 0.0), axis=-1) + jnp.abs(q_tail - p_tail)
  return ExpectedScore(jnp.where(mask, expected, 0.0), jnp.where(mask, drift, 0.0), jnp.where(mask, q_tail, 0.0))


def centred_logprobs(logprobs, expected):
  """``lp - C + sg(C)``: ``lp``'s value, the centred score ``∇lp - ∇C`` as its gradient."""
  return logprobs - expected + jax.lax.stop_gradient(expected)


def centre(logprobs, topk_logprobs, rollout_topk_logprobs, mask, coefficient):
  """The centred log-probs a form reads and the centring metric rows (contract §6.6).

  Args:
    logprobs: flat ``[T]`` float32 ``lp`` (carries the gradient).
    topk_logprobs: ``[..., k]``, the trainer's log-probs of the sampler's top-k ids (gradient).
    rollout_topk_logprobs: ``[..., k]``, the sampler's (stop-gradient).
    mask: flat ``[T]`` bool, the trained tokens.
    coefficient: flat ``[T]``, ``|A_t| w_t`` for the drift metrics (:func:`metric_rows`).

  Returns:
    ``(lp - C + sg(C), (rows over m, rows over m'))``.
  """
  k = jnp.shape(topk_logprobs)[-1]
  flat = lambda x: jnp.reshape(x, (-1, k)).astype(jnp.float32)
  score = expected_logprob(flat(topk_logprobs), jax.lax.stop_gradient(flat(rollout_topk_logprobs)), mask)
  return centred_logprobs(logprobs, score.expected), metric_rows(score, coefficient)


def metric_rows(score: ExpectedScore, coefficient) -> tuple[dict, dict]:
  """The centring metrics (contract §6.6) as per-token rows: ``(over m, over m')``.

  ``coefficient`` is ``|A_t| · w_t``, the size of the sampled score's coefficient in REINFORCE's
  gradient (``w_t`` the correction's weight where it multiplies the loss, else 1).
  """
  over_mask = {"score_centering_tv": 0.5 * score.drift_l1, "score_centering_tail_mass": score.tail_mass}
  over_kept = {
    "score_centering_drift": coefficient * score.drift_l1,
    "score_centering_residual_bound": coefficient * 2.0 * score.tail_mass,
  }
  return over_mask, over_kept


metrics_lib.declare(
  {
    "score_centering_tv": "mask",
    "score_centering_tail_mass": "mask",
    "score_centering_drift": "kept",
    "score_centering_residual_bound": "kept",
  }
)
