"""Group-relative advantages from per-sequence rewards (contract §6.1).

Rewards are per sequence; each prompt is sampled ``n`` times (a group). Group statistics use
``jax.ops.segment_sum`` over group ids, so groups of different sizes need no padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
_STD_EPS = 1e-6


def compute_advantages(rewards, group_ids, *, num_groups: int, estimator: str = "grpo",
                       in_baseline=None):
  """Per-sequence advantages.

  - ``grpo``: ``A = (R - mean_g R) / (std_g(R, ddof=1) + 1e-6)``; the division is skipped
    for a group of one member.
  - ``dr_grpo``: ``A = R - mean_g R``.
  - ``rloo``: ``A_i = R_i - mean_{j≠i} R_j``; a group of one has no baseline (``A = R``).

  Args:
    rewards: ``[N]`` float rewards.
    group_ids: ``[N]`` int group (prompt) of every sequence, in ``[0, num_groups)``.
    num_groups: static number of groups.
    estimator: ``grpo`` (default), ``dr_grpo`` or ``rloo``.
    in_baseline: optional ``[N]`` bool; sequences with False (e.g. rejected whole by the
      correction) are left out of their group's statistics, as in verl PR #6452. They still
      receive an advantage relative to the remaining members.

  Returns:
    ``[N]`` float32 advantages.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is invalid; allowed values: {', '.join(ESTIMATORS)}")
  rewards = jnp.asarray(rewards, jnp.float32)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  if rewards.ndim != 1 or group_ids.shape != rewards.shape:
    raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be 1-D of one shape")
  member = jnp.ones_like(rewards, dtype=bool) if in_baseline is None else jnp.asarray(in_baseline, bool)
  gsum = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=num_groups)[group_ids]
  r_in = jnp.where(member, rewards, 0.0)
  n = gsum(member.astype(jnp.float32))
  total = gsum(r_in)
  mean = total / jnp.maximum(n, 1.0)
  if estimator == "rloo":
    # Leave-one-out mean over the other baseline members.
    others = n - member.astype(jnp.float32)
    baseline = jnp.where(others > 0, (total - r_in) / jnp.maximum(others, 1.0), 0.0)
    return rewards - baseline
  centered = rewards - mean
  if estimator == "dr_grpo":
    return centered
  sq = gsum(jnp.where(member, (rewards - mean) ** 2, 0.0))
  std = jnp.sqrt(sq / jnp.maximum(n - 1.0, 1.0))
  return jnp.where(n > 1, centered / (std + _STD_EPS), centered)


def sequence_to_tokens(seq_values, segment_ids):
  """Broadcasts per-sequence values ``[N]`` to tokens by segment id (0 at padding)."""
  seq_values = jnp.asarray(seq_values)
  segment_ids = jnp.asarray(segment_ids)
  out = seq_values[jnp.where(segment_ids >= 0, segment_ids, 0)]
  return jnp.where(segment_ids >= 0, out, jnp.zeros((), out.dtype))
