"""The names each config key accepts: the bottom of the configs (they import this, never the reverse).

The correction's choices are the keys of its formula tables in :mod:`mis_jax._correction` (a new
level, IS mode, divergence, aggregation or KL estimator is one entry there, and its name is accepted
here); the algorithms of the contract §6 table are :data:`ALGORITHMS`; the loss's aggregations,
denominators, proximal policies and squared-KL token sets are named here.
"""

from __future__ import annotations

from typing import NamedTuple

from mis_jax import _correction

LEVELS = _correction.LEVELS
DIVERGENCES = tuple(_correction.DIVERGENCES)
AGGREGATIONS = tuple(_correction.AGGREGATIONS)
TIS_MODES = tuple(_correction.TIS_MODES)
KL_TYPES = tuple(_correction.KL_ESTIMATORS)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm")
DENOMINATORS = ("kept", "original")
PROXIMAL = ("recompute", "loglinear")
SQ_KL_TOKENS = ("trainable", "kept")  # the tokens the squared log-ratio KL is summed over (contract §6.4)

# A bound the threshold controller sets each step (contract §3.1), and the keys that take it.
AUTO = "auto"
AUTO_KEYS = ("tis_upper_bound", "rs_upper_bound")


class Algorithm(NamedTuple):
  """A row of the contract §6 table: its two flags (a plain ``(use_rollout_logprobs, use_tis)``
  pair compares equal to it) and what they mean for the policy-loss form."""

  use_rollout_logprobs: bool
  use_tis: bool

  @property
  def anchor(self) -> str:
    """The log-probs the form's ratio is taken against (contract §6.2): the rollout's (``q``) or the
    old ones (``o``). REINFORCE + IS has no anchor of its own: ``q`` stands in for ``ppo_kl``."""
    return "rollout" if self.use_rollout_logprobs else "old"

  @property
  def weighted(self) -> bool:
    """Whether the correction's weights multiply the form's per-token loss."""
    return self.use_tis


# The contract §6 table: `LossConfig.algorithm` is the row its two flags select.
ALGORITHMS = {
  "ppo": Algorithm(False, False),
  "bypass_ppo": Algorithm(True, False),
  "decoupled_ppo": Algorithm(False, True),
  "reinforce_is": Algorithm(True, True),
}


def algorithm_of(use_rollout_logprobs: bool, use_tis: bool) -> str:
  """The name of the §6 row the two flags select."""
  return next(name for name, row in ALGORITHMS.items() if row == (use_rollout_logprobs, use_tis))


def metric_reduction(loss_agg_mode: str) -> str:
  """How metrics are reduced under a loss mode (contract §8): per token for the token modes,
  per sequence for the seq-mean modes."""
  return "token-mean" if loss_agg_mode in ("token-mean", "token-sum") else "seq-mean-token-mean"
