"""What :func:`mis_jax.prepare_step` computes once per optimisation step (contract §6.2, §7): the
:class:`Correction` value every micro-batch's :func:`mis_jax.policy_loss` reads beside its batch,
and the step's global :class:`Denominators`.

A :class:`mis_jax.PackedBatch` holds a step's inputs only; what is derived from them once per
step lives here, so a loss reads its inputs from one value and the step's decisions from another.
"""

from __future__ import annotations

import dataclasses

import jax

from mis_jax._segments import MaskStats


@dataclasses.dataclass(frozen=True)
class Denominators:
  """Global loss denominators of one optimisation step (contract §7).

  Attributes:
    seg_tokens: ``[num_segments]`` float32, ``Σ_{t∈s} D_t`` for every segment.
    num_tokens: ``Σ_t D_t`` over the whole step.
    num_seqs: ``N``, the number of segments with ``Σ_{t∈s} D_t > 0``.
  """

  seg_tokens: jax.Array
  num_tokens: jax.Array
  num_seqs: jax.Array

  @classmethod
  def from_stats(cls, stats: MaskStats) -> "Denominators":
    """The denominators of the mask ``D`` whose :class:`MaskStats` are ``stats``."""
    return cls(seg_tokens=stats.counts, num_tokens=stats.total, num_seqs=stats.num_live)


jax.tree_util.register_dataclass(Denominators, data_fields=["seg_tokens", "num_tokens", "num_seqs"], meta_fields=[])

TOKEN_FIELDS = ("is_weights", "kept_mask", "cov_selected")


@dataclasses.dataclass(frozen=True)
class Correction:
  """The once-per-step correction of a batch (a pytree): :func:`mis_jax.prepare_step` returns it,
  :func:`mis_jax.policy_loss` takes it as ``correction=``. Per-token arrays have the batch's
  shape (and split with it: :func:`mis_jax.split_microbatches`); every field is None where the
  configuration computes none once per step.

  Attributes:
    is_weights: float32 IS weights of decoupled PPO's correction (contract §3–5: they depend only
      on ``o`` and ``q``), 0 off the loss mask; None for the other algorithms, and where the
      weights follow the current log-probs (REINFORCE + IS, ``proximal: loglinear``).
    kept_mask: bool kept mask ``m'`` matching ``is_weights`` (contract §4); None with it.
    cov_selected: bool, clip_cov / kl_cov's tokens of the step (contract §6.2), else None.
    denominators: the step's global :class:`Denominators` (contract §7), or None where they
      depend on the current log-probs (REINFORCE + IS with ``denominator: kept``).
  """

  is_weights: jax.Array | None = None
  kept_mask: jax.Array | None = None
  cov_selected: jax.Array | None = None
  denominators: Denominators | None = None

  def replace(self, **changes) -> "Correction":
    return dataclasses.replace(self, **changes)

  def token_arrays(self) -> dict:
    """The per-token fields (None ones included), by name."""
    return {name: getattr(self, name) for name in TOKEN_FIELDS}


jax.tree_util.register_dataclass(Correction, data_fields=[*TOKEN_FIELDS, "denominators"], meta_fields=[])
