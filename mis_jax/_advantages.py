"""Advantages from per-sequence rewards (contract §6.1), and OTB's per-token baseline.

Rewards are per sequence; each prompt is sampled ``n`` times (a group). Group statistics use
``jax.ops.segment_sum`` over group ids, so groups of different sizes need no padding. Besides
our ``grpo``, ``dr_grpo`` and ``rloo``, verl's outcome estimators are here by their verl names.

Each estimator is a registered function with a frozen config of its own keys
(:func:`register_advantage_estimator`; :data:`ESTIMATORS`): ``fn(x: EstimatorInputs, cfg) -> [N]``.
A new estimator is its function, its config (omitted without keys) and the registration:
``compute_advantages(..., estimator={"name": NAME, <its keys>})`` then takes it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mis_jax._keys import ConfigError, key
from mis_jax._registry import ChoiceConfig, Registry

_STD_EPS = 1e-6
_WHITEN_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(ChoiceConfig):
  """The keys of one advantage estimator (contract §6.1): subclass it as a frozen dataclass of
  ``key(...)`` fields and register it with its function (:func:`register_advantage_estimator`)."""

  KEY = "estimator"


class Estimator(NamedTuple):
  """A registered advantage estimator (``mis_jax.estimators.ESTIMATORS[name]``).

  Attributes:
    name: the estimator's name, the value of ``estimator``.
    config: its :class:`AdvantageConfig` subclass (its own keys).
    fn: ``fn(x: EstimatorInputs, cfg) -> [N]`` float32 per-sequence advantages; for a per-token
      estimator, the function that computes them (with its own arguments).
    per_token: the advantages are per token (:func:`optimal_token_baseline`), not from
      :func:`compute_advantages`.
    needs_lengths: reads each response's token count (``lengths=``).
    reward_components: takes ``[N, K]`` rewards (``[N]`` is one component).
  """

  name: str
  config: type | None
  fn: Callable
  per_token: bool = False
  needs_lengths: bool = False
  reward_components: bool = False


# The registered estimators, by name; per-sequence ones (compute_advantages) are SEQUENCE_ESTIMATORS.
ESTIMATORS = Registry("estimator", "advantage estimator", AdvantageConfig)
SEQUENCE_ESTIMATORS = ESTIMATORS.where(lambda e: not e.per_token)
# Estimators that read each response's token count (a length-weighted baseline or token whitening).
NEEDS_LENGTHS = ESTIMATORS.where(lambda e: e.needs_lengths)


def register_advantage_estimator(
  name: str,
  config: type | None = None,
  *,
  per_token: bool = False,
  needs_lengths: bool = False,
  reward_components: bool = False,
):
  """Registers the decorated function as the advantage estimator ``name``, with ``config`` its keys.

  ``fn(x: EstimatorInputs, cfg) -> [N]`` gets the rewards with their group statistics and the
  estimator's config (an instance of ``config``, a frozen dataclass subclassing
  :class:`AdvantageConfig`; None: no keys of its own). A name registered already is an error.
  """

  def register(fn):
    ESTIMATORS.add(Estimator(name, config, fn, per_token, needs_lengths, reward_components))
    return fn

  return register


class GroupStats:
  """Per-group statistics over the baseline members, broadcast back to the sequences."""

  def __init__(self, group_ids, num_groups, member):
    self.ids, self.num_groups, self.member = group_ids, num_groups, member

  def sum(self, x):
    return jax.ops.segment_sum(jnp.where(self.member, x, 0.0), self.ids, num_segments=self.num_groups)[self.ids]

  def max(self, x, where):
    return jax.ops.segment_max(jnp.where(where, x, -jnp.inf), self.ids, num_segments=self.num_groups)[self.ids]

  def count(self):
    return self.sum(jnp.ones(self.ids.shape, jnp.float32))

  def mean(self, x):
    return self.sum(x) / jnp.maximum(self.count(), 1.0)

  def std(self, x):
    """``ddof=1`` over the members (0 for a group of one)."""
    return jnp.sqrt(self.sum((x - self.mean(x)) ** 2) / jnp.maximum(self.count() - 1.0, 1.0))


class EstimatorInputs(NamedTuple):
  """What an estimator reads: ``rewards`` (float32 ``[N]``, or ``[N, K]`` for one with reward
  components), their :class:`GroupStats` (``member``: the sequences in their group's baseline),
  ``lengths`` (``[N]`` token counts, or None) and ``reward_weights`` (``[K]`` or None)."""

  rewards: jax.Array
  stats: GroupStats
  lengths: jax.Array | None
  reward_weights: jax.Array | None


def _whiten_over_tokens(values, lengths):
  """verl's ``masked_whiten`` of a per-sequence value broadcast to its ``n_i`` tokens:
  ``(x - μ) / sqrt(var + 1e-8)`` with the token-weighted mean ``μ = Σ n x / Σ n`` and the
  unbiased token variance ``Σ n (x - μ)² / (Σ n - 1)``."""
  n = lengths.astype(jnp.float32)
  total = jnp.sum(n)
  mean = jnp.sum(n * values) / jnp.maximum(total, 1.0)
  var = jnp.sum(n * (values - mean) ** 2) / jnp.maximum(total - 1.0, 1.0)
  return (values - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)


def _verl_mean(x: EstimatorInputs):
  """The group mean, 0 for a group of one (verl's estimators take no baseline from it)."""
  mean, n = x.stats.mean(x.rewards), x.stats.count()
  return jnp.where(n > 1, mean, 0.0)


@register_advantage_estimator("grpo")
def grpo(x: EstimatorInputs, cfg: AdvantageConfig):
  """``(R - mean_g R) / (std_g R + 1e-6)``; no division for a group of one."""
  rewards, stats = x.rewards, x.stats
  mean, n = stats.mean(rewards), stats.count()
  return jnp.where(n > 1, (rewards - mean) / (stats.std(rewards) + _STD_EPS), rewards - mean)


@register_advantage_estimator("dr_grpo")
def dr_grpo(x: EstimatorInputs, cfg: AdvantageConfig):
  """``R - mean_g R``."""
  return x.rewards - x.stats.mean(x.rewards)


@register_advantage_estimator("rloo")
def rloo(x: EstimatorInputs, cfg: AdvantageConfig):
  """``R_i - mean_{j≠i} R_j`` over the other baseline members; a group of one has no baseline."""
  rewards, stats = x.rewards, x.stats
  others = stats.count() - stats.member.astype(jnp.float32)
  total = stats.sum(rewards)
  baseline = jnp.where(others > 0, (total - jnp.where(stats.member, rewards, 0.0)) / jnp.maximum(others, 1.0), 0.0)
  return rewards - baseline


@register_advantage_estimator("reinforce_plus_plus", needs_lengths=True)
def reinforce_plus_plus(x: EstimatorInputs, cfg: AdvantageConfig):
  """``R`` whitened over the batch's tokens (outcome rewards, γ = 1)."""
  return _whiten_over_tokens(x.rewards, x.lengths)


@register_advantage_estimator("reinforce_plus_plus_baseline", needs_lengths=True)
def reinforce_plus_plus_baseline(x: EstimatorInputs, cfg: AdvantageConfig):
  """``R - mean_g R`` (0 baseline for a group of one), whitened over the tokens."""
  return _whiten_over_tokens(x.rewards - _verl_mean(x), x.lengths)


@register_advantage_estimator("opo", needs_lengths=True)
def opo(x: EstimatorInputs, cfg: AdvantageConfig):
  """``R - Σ_g |y| R / Σ_g |y|``, the length-weighted group mean (0 for a group of one)."""
  rewards, stats = x.rewards, x.stats
  n = stats.count()
  n_tok = x.lengths.astype(jnp.float32)
  baseline = stats.sum(n_tok * rewards) / jnp.maximum(stats.sum(n_tok), 1.0)
  return rewards - jnp.where(n > 1, baseline, 0.0)


@dataclasses.dataclass(frozen=True)
class GrpoPasskConfig(AdvantageConfig):
  """``grpo_passk``'s keys."""

  norm_by_std: bool = key(True, "divide the gap by the group's std (verl's norm_adv_by_std_in_grpo)")


@register_advantage_estimator("grpo_passk", GrpoPasskConfig)
def grpo_passk(x: EstimatorInputs, cfg: GrpoPasskConfig):
  """Only each group's best member (the first of equal best) gets ``R_max - R_2nd`` (divided by
  ``std_g + 1e-6`` with ``norm_by_std``); groups need two members."""
  rewards, stats = x.rewards, x.stats
  if not isinstance(stats.count(), jax.core.Tracer):
    small = np.asarray(stats.count()) < 2
    if small.any():
      raise ValueError(
        f"estimator='grpo_passk' needs two baseline members per group; group "
        f"{int(np.asarray(stats.ids)[small][0])} has fewer"
      )
  idx = jnp.arange(rewards.shape[0], dtype=jnp.int32)
  best_r = stats.max(rewards, stats.member)
  is_best = stats.member & (rewards == best_r)
  first = jax.ops.segment_min(jnp.where(is_best, idx, rewards.shape[0]), stats.ids, num_segments=stats.num_groups)[
    stats.ids
  ]
  best = idx == first
  second = stats.max(rewards, stats.member & ~best)
  gap = best_r - second
  if cfg.norm_by_std:
    gap = gap / (stats.std(rewards) + _STD_EPS)
  return jnp.where(best & (stats.count() >= 2), gap, 0.0)


@register_advantage_estimator("gpg")
def gpg(x: EstimatorInputs, cfg: AdvantageConfig):
  """``α (R - mean_g R)``, ``α = N / #{R ≠ 0}`` over the batch (0 baseline for a group of one)."""
  rewards = x.rewards
  verl_mean = _verl_mean(x)
  alpha = rewards.shape[0] / jnp.maximum(jnp.sum((rewards != 0).astype(jnp.float32)), 1.0)
  return alpha * (rewards - verl_mean)


@dataclasses.dataclass(frozen=True)
class GdpoConfig(AdvantageConfig):
  """``gdpo``'s keys."""

  norm_by_std: bool = key(
    True, "divide each component's centred reward by its group's std (verl's norm_adv_by_std_in_grpo)"
  )


@register_advantage_estimator("gdpo", GdpoConfig, needs_lengths=True, reward_components=True)
def gdpo(x: EstimatorInputs, cfg: GdpoConfig):
  """``Σ_k w_k · grpo'(R_k)`` whitened over the tokens, ``grpo'`` verl's GRPO (a group of one:
  ``R / (1 + 1e-6)``; without ``norm_by_std`` ``R - mean_g R``), ``w`` = ``reward_weights``."""
  rewards, stats = x.rewards if x.rewards.ndim == 2 else x.rewards[:, None], x.stats
  k = rewards.shape[1]
  weights = jnp.ones((k,), jnp.float32) if x.reward_weights is None else jnp.asarray(x.reward_weights, jnp.float32)
  if weights.shape != (k,):
    raise ValueError(f"reward_weights has shape {weights.shape}; gdpo's rewards have {k} components")
  n = stats.count()
  total = jnp.zeros(rewards.shape[:1], jnp.float32)
  for j in range(k):
    r = rewards[:, j]
    mean = jnp.where(n > 1, stats.mean(r), 0.0)
    std = jnp.where(n > 1, stats.std(r), 1.0)
    total = total + weights[j] * ((r - mean) / (std + _STD_EPS) if cfg.norm_by_std else r - mean)
  return _whiten_over_tokens(total, x.lengths)


def estimator_config(estimator, *, norm_by_std: bool | None = None) -> AdvantageConfig:
  """The estimator's config from its config, its name or ``{name, <its keys>}``; ``norm_by_std``, the
  keyword :func:`compute_advantages` took before estimators had configs, folded in with a
  DeprecationWarning (an estimator without the key takes only its default, True)."""
  if isinstance(estimator, str) and estimator not in ESTIMATORS:
    raise ConfigError(f"estimator={estimator!r} is invalid; allowed values: {', '.join(ESTIMATORS)}")
  cfg = ESTIMATORS.config_of(estimator)
  if norm_by_std is None:
    return cfg
  owners = " / ".join(ESTIMATORS.owners("norm_by_std"))
  if "norm_by_std" in cfg.keys():
    warnings.warn(
      f"compute_advantages(norm_by_std=) moved into the estimator's config: pass "
      f"estimator={{'name': '{cfg.name}', 'norm_by_std': {norm_by_std}}}",
      DeprecationWarning,
      stacklevel=3,
    )
    return dataclasses.replace(cfg, norm_by_std=norm_by_std)
  if norm_by_std is not True:
    raise ConfigError(f"norm_by_std={norm_by_std!r} is a key of estimator {owners}, not of {cfg.name}")
  warnings.warn(
    f"compute_advantages(norm_by_std=) moved into the estimator's config (a key of {owners}); "
    f"{cfg.name} has no such key: drop it",
    DeprecationWarning,
    stacklevel=3,
  )
  return cfg


def compute_advantages(
  rewards,
  group_ids,
  *,
  num_groups: int,
  estimator="grpo",
  in_baseline=None,
  lengths=None,
  reward_weights=None,
  norm_by_std: bool | None = None,
):
  """Per-sequence advantages (contract §6.1).

  With ``g`` a sequence's group, ``mean_g`` / ``std_g`` (``ddof=1``) over the group's baseline
  members and ``n_g`` their number:

  - ``grpo``: ``(R - mean_g R) / (std_g R + 1e-6)``; no division for a group of one.
  - ``dr_grpo``: ``R - mean_g R``.
  - ``rloo``: ``R_i - mean_{j≠i} R_j``; a group of one has no baseline (``A = R``).
  - ``reinforce_plus_plus``: ``R`` whitened over the batch's tokens (verl's ``masked_whiten``:
    each sequence weighs its token count; outcome rewards, γ = 1).
  - ``reinforce_plus_plus_baseline``: ``R - mean_g R`` (0 baseline for a group of one), then
    whitened over the tokens.
  - ``opo``: ``R - Σ_g |y| R / Σ_g |y|``, the length-weighted group mean (0 for a group of one).
  - ``grpo_passk``: only each group's best sequence learns, with ``(R_max - R_2nd) / (std_g + 1e-6)``
    (no division without its key ``norm_by_std``); groups need two members.
  - ``gpg``: ``α (R - mean_g R)``, ``α = N / #{R ≠ 0}`` over the batch (0 baseline for a group of one).
  - ``gdpo``: rewards ``[N, K]``; ``Σ_k w_k · grpo'(R_k)`` whitened over the tokens, where
    ``grpo'`` is verl's GRPO (a group of one: ``R / (1 + 1e-6)``; without its key ``norm_by_std``
    ``R - mean_g R``), ``w`` = ``reward_weights`` (default ones).

  Args:
    rewards: ``[N]`` float rewards (``[N, K]`` for ``gdpo``).
    group_ids: ``[N]`` int group (prompt) of every sequence, in ``[0, num_groups)``.
    num_groups: static number of groups.
    estimator: a per-sequence estimator of ``mis_jax.estimators.SEQUENCE_ESTIMATORS`` (static): its
      name (its defaults), ``{"name": NAME, <its keys>}`` or its config
      (``optimal_token_baseline`` is per token: :func:`optimal_token_baseline`).
    in_baseline: optional ``[N]`` bool; sequences with False (e.g. rejected whole by the
      correction) are left out of their group's statistics, as in verl PR #6452. They still
      receive an advantage relative to the remaining members.
    lengths: ``[N]`` response token counts, for the estimators that read them
      (``mis_jax.estimators.NEEDS_LENGTHS``).
    reward_weights: ``gdpo``'s ``[K]`` weights.
    norm_by_std: deprecated: the key of ``grpo_passk`` and ``gdpo``, given in ``estimator``.

  Returns:
    ``[N]`` float32 advantages.
  """
  cfg = estimator_config(estimator, norm_by_std=norm_by_std)
  entry = ESTIMATORS[cfg.name]
  if entry.per_token:
    fn = entry.fn
    where = f"mis_jax.{fn.__name__}" if fn.__module__ == __name__ else f"{fn.__module__}.{fn.__qualname__}"
    raise ValueError(
      f"estimator={cfg.name!r} gives per-token advantages: call {where} (it needs the old log-probs and Σπ² per token)"
    )
  rewards = jnp.asarray(rewards, jnp.float32)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  want_ndim = 2 if entry.reward_components else 1
  if rewards.ndim not in (want_ndim, 1) or group_ids.ndim != 1 or rewards.shape[0] != group_ids.shape[0]:
    raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be [N] (gdpo: [N, K]) and [N]")
  if entry.needs_lengths:
    if lengths is None:
      raise ValueError(f"estimator={cfg.name!r} needs lengths= (each response's token count)")
    lengths = jnp.asarray(lengths)
    if lengths.shape != group_ids.shape:
      raise ValueError(f"lengths {lengths.shape} must have group_ids' shape {group_ids.shape}")
  member = jnp.ones(group_ids.shape, bool) if in_baseline is None else jnp.asarray(in_baseline, bool)
  stats = GroupStats(group_ids, num_groups, member)
  return entry.fn(EstimatorInputs(rewards, stats, lengths, reward_weights), cfg)


@dataclasses.dataclass(frozen=True)
class OptimalTokenBaselineConfig(AdvantageConfig):
  """``optimal_token_baseline``'s keys (the keywords of :func:`optimal_token_baseline`)."""

  handle_zero_tail: bool = key(
    True, "past the second-longest response of a group, its unique longest one gets no baseline (verl's default)"
  )
  epsilon: float = key(1e-8, "added to the baseline's denominator", gt=0)


@register_advantage_estimator("optimal_token_baseline", OptimalTokenBaselineConfig, per_token=True)
def optimal_token_baseline(
  rewards,
  group_ids,
  segment_ids,
  loss_mask,
  old_logprobs,
  sum_pi_squared,
  *,
  num_groups: int,
  num_segments: int,
  is_weights=None,
  handle_zero_tail: bool = True,
  epsilon: float = 1e-8,
):
  """Optimal Token Baseline (verl's ``optimal_token_baseline``): a baseline per group and
  response position, weighted by the path-variance proxy.

  For response token ``j`` (the ``j``-th trained token of its sequence) with ``π_j = exp(o_j)``:
  ``w_j = 1 - 2π_j + Σ_v π²`` (times ``ρ̄_j²``, the squared IS weight, under truncated IS),
  ``W_j = Σ_{i≤j} w_i`` and, over the group's sequences that have a ``j``-th token,
  ``B_j = Σ G_j W_j / (Σ W_j + ε)``; ``A_j = G_j - B_j`` with ``G_j = R`` (outcome rewards).
  A group of one has no baseline. With ``handle_zero_tail``, past the second-longest response of
  a group, its (unique) longest one gets no baseline.

  Args:
    rewards: ``[S]`` per-sequence (segment) rewards; ``group_ids``: ``[S]`` their groups.
    segment_ids: per-token packed segment ids (-1 padding). A sequence's tokens must lie in
      order in the flattened array (as packed rows hold them), on one device.
    loss_mask: the trained tokens, of ``segment_ids``' shape.
    old_logprobs: the per-token log-probs ``o`` of the sampled tokens, same shape.
    sum_pi_squared: ``Σ_v π_v²`` per token, same shape (from :func:`mis_jax.token_logprobs`
      with ``return_sum_pi_squared``).
    num_groups: static count of groups.
    num_segments: static count of segments.
    is_weights: optional per-token IS weights ``ρ̄`` (they enter squared).

  Returns:
    float32 per-token advantages of the inputs' shape (0 off the loss mask).
  """
  shape = jnp.shape(segment_ids)
  ids = jnp.reshape(jnp.asarray(segment_ids), (-1,)).astype(jnp.int32)
  mask = jnp.reshape(jnp.asarray(loss_mask), (-1,)).astype(bool) & (ids >= 0)
  flat = lambda x: jnp.where(mask, jnp.reshape(jnp.asarray(x), (-1,)).astype(jnp.float32), 0.0)
  rewards = jnp.asarray(rewards, jnp.float32)
  groups = jnp.asarray(group_ids, jnp.int32)
  seg = jnp.where(ids >= 0, ids, num_segments)  # padding to an extra, dropped segment
  pi = jnp.exp(jnp.minimum(flat(old_logprobs), 0.0))
  w = 1.0 - 2.0 * pi + flat(sum_pi_squared)
  if is_weights is not None:
    w = w * flat(is_weights) ** 2
  w = jnp.where(mask, w, 0.0)

  def in_segment_cumsum(x):
    """Inclusive cumulative sum within each segment (segments contiguous in flat order)."""
    c = jnp.cumsum(x)
    first = jax.ops.segment_min(jnp.arange(x.shape[0], dtype=jnp.int32), seg, num_segments=num_segments + 1)
    return c - (c - x)[first[seg]]

  W = in_segment_cumsum(w)
  pos = in_segment_cumsum(mask.astype(jnp.int32)) - 1  # j: index among the trained tokens
  length = jax.ops.segment_sum(mask.astype(jnp.int32), seg, num_segments=num_segments + 1)[:num_segments]
  tok_group = groups[jnp.minimum(seg, num_segments - 1)]
  G = rewards[jnp.minimum(seg, num_segments - 1)]
  max_pos = ids.shape[0]
  cell = jnp.where(mask, tok_group * max_pos + pos, num_groups * max_pos)
  num = jax.ops.segment_sum(jnp.where(mask, G * W, 0.0), cell, num_segments=num_groups * max_pos + 1)
  den = jax.ops.segment_sum(W, cell, num_segments=num_groups * max_pos + 1)
  baseline = num[cell] / (den[cell] + epsilon)
  # Groups of one (counting sequences with a trained token) get no baseline.
  live = (length > 0).astype(jnp.int32)
  group_size = jax.ops.segment_sum(live, groups, num_segments=num_groups)
  baseline = jnp.where(group_size[tok_group] > 1, baseline, 0.0)
  if handle_zero_tail:
    longest = jax.ops.segment_max(jnp.where(length > 0, length, -1), groups, num_segments=num_groups)
    n_longest = jax.ops.segment_sum(
      ((live > 0) & (length == longest[groups])).astype(jnp.int32), groups, num_segments=num_groups
    )
    second = jax.ops.segment_max(
      jnp.where((length > 0) & (length < longest[groups]), length, 0), groups, num_segments=num_groups
    )
    tok_len = length[jnp.minimum(seg, num_segments - 1)]
    tail = (
      (n_longest[tok_group] == 1)
      & (tok_len == longest[tok_group])
      & (tok_len > second[tok_group])
      & (pos >= second[tok_group])
    )
    baseline = jnp.where(tail, 0.0, baseline)
  return jnp.reshape(jnp.where(mask, G - baseline, 0.0), shape)


def sequence_to_tokens(seq_values, segment_ids):
  """Broadcasts per-sequence values ``[N]`` to tokens by segment id (0 at padding)."""
  seq_values = jnp.asarray(seq_values)
  segment_ids = jnp.asarray(segment_ids)
  out = seq_values[jnp.where(segment_ids >= 0, segment_ids, 0)]
  return jnp.where(segment_ids >= 0, out, jnp.zeros((), out.dtype))
