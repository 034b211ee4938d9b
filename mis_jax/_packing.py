"""Packed batches (contract §1): the pytree that losses consume, and the host-side packer.

Sequences are packed first-fit-decreasing into fixed-length rows. Segment ``i`` is the
``i``-th input sequence, padding has segment id ``-1``, and positions restart at 0 in every
segment so a model can build a segment-aware causal mask.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from mis_jax._prepared import Correction

_DATA_FIELDS = (
  "segment_ids",
  "loss_mask",
  "advantages",
  "rollout_logprobs",
  "old_logprobs",
  "ref_logprobs",
  "rollout_staleness",
  "rollout_topk_logprobs",
)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """Per-token inputs of one packed batch (all the same shape, a top-k field with one more axis) and a
  static segment count.

  Only inputs: what :func:`mis_jax.prepare_step` derives from them once per step (IS weights,
  kept mask, the covariance forms' selection, denominators) is a separate
  :class:`mis_jax.Correction`.

  Attributes:
    segment_ids: int32, segment of every token, ``-1`` for padding.
    loss_mask: 1 for trained response tokens (prompt, tool output and padding are 0).
    advantages: float advantage ``A_t`` (the sequence advantage broadcast to its tokens).
    rollout_logprobs: ``q``, log-probs reported by the rollout engine (or None).
    old_logprobs: ``o``, log-probs recomputed by the trainer before the step (or None).
    ref_logprobs: reference-policy log-probs for the KL term (or None).
    rollout_staleness: how many weight versions each token's behaviour policy (the engine's weights
      that sampled it) lags the proximal policy (the weights being trained), ``>= 0``; read by
      ``proximal: loglinear`` (contract §6.3), or None.
    rollout_topk_logprobs: ``[..., k]``, the sampler's log-probs of its ``k`` most likely tokens at
      each position (SGLang's ``output_top_logprobs``), read by ``score_centering`` (contract
      §6.6), or None. The ids they belong to are the log-prob pass's business
      (:func:`mis_jax.token_logprobs`'s ``extra_ids``), not the loss's.
    num_segments: static upper bound on segment ids (a Python int; not a pytree leaf).
  """

  segment_ids: jax.Array
  loss_mask: jax.Array
  advantages: jax.Array
  rollout_logprobs: jax.Array | None = None
  old_logprobs: jax.Array | None = None
  ref_logprobs: jax.Array | None = None
  rollout_staleness: jax.Array | None = None
  rollout_topk_logprobs: jax.Array | None = None
  num_segments: int = dataclasses.field(kw_only=True)

  def __post_init__(self):
    if isinstance(self.num_segments, bool) or not isinstance(self.num_segments, (int, np.integer)):
      # Inside tree transformations leaves may be placeholders; num_segments is always static.
      raise TypeError(f"PackedBatch.num_segments must be a Python int, got {self.num_segments!r}")

  def replace(self, **changes) -> "PackedBatch":
    return dataclasses.replace(self, **changes)

  @property
  def shape(self):
    return np.shape(self.segment_ids)


jax.tree_util.register_dataclass(PackedBatch, data_fields=list(_DATA_FIELDS), meta_fields=["num_segments"])


def split_microbatches(batch: PackedBatch | Correction, k: int) -> list:
  """Splits a batch along its leading (row) axis into ``k`` equal micro-batches.

  Segment ids stay global, so global denominators computed on the full batch (see
  :func:`mis_jax.loss_denominators`) apply to every micro-batch unchanged. A
  :class:`mis_jax.Correction` splits the same way: its per-token arrays by rows, its
  denominators (the step's) whole in every part.
  """
  if isinstance(batch, Correction):
    tokens = [x for x in batch.token_arrays().values() if x is not None]
    if not tokens:
      return [batch] * _check_split(k, None)
    size = np.shape(tokens[0])[0] // _check_split(k, np.shape(tokens[0])[0])
    per_token = batch.replace(denominators=None)
    return [
      jax.tree_util.tree_map(lambda x: x[i * size : (i + 1) * size], per_token).replace(denominators=batch.denominators)
      for i in range(k)
    ]
  rows = np.shape(batch.segment_ids)[0]
  size = rows // _check_split(k, rows)
  return [jax.tree_util.tree_map(lambda x: x[i * size : (i + 1) * size], batch) for i in range(k)]


def _check_split(k: int, rows: int | None) -> int:
  if k <= 0 or (rows is not None and rows % k):
    raise ValueError(f"cannot split {rows} rows into {k} equal micro-batches")
  return k


@dataclasses.dataclass(frozen=True)
class Packing:
  """Where each sequence lives in a ``[num_rows, row_len]`` packed layout.

  Attributes:
    row_len: tokens per row.
    num_rows: number of rows.
    rows, offsets, lengths: per sequence, its row, its start column and its length.
  """

  row_len: int
  num_rows: int
  rows: np.ndarray
  offsets: np.ndarray
  lengths: np.ndarray

  @property
  def num_sequences(self) -> int:
    return len(self.lengths)

  @property
  def segment_ids(self) -> np.ndarray:
    """int32 ``[num_rows, row_len]``: the sequence index of every token, -1 for padding."""
    return self.pack([np.full(n, i, np.int32) for i, n in enumerate(self.lengths)], -1, np.int32)

  @property
  def positions(self) -> np.ndarray:
    """int32 positions restarting at 0 in each segment (0 at padding)."""
    return self.pack([np.arange(n, dtype=np.int32) for n in self.lengths], 0, np.int32)

  def pack(self, sequences: Sequence, pad_value=0, dtype=None) -> np.ndarray:
    """Places per-sequence arrays ``[n_i, ...]`` (trailing dims shared, e.g. a support width)
    into the packed layout ``[num_rows, row_len, ...]``."""
    if len(sequences) != self.num_sequences:
      raise ValueError(f"expected {self.num_sequences} sequences, got {len(sequences)}")
    arrays = [np.asarray(s) for s in sequences]
    if dtype is None:
      dtype = np.result_type(*[a.dtype for a in arrays]) if arrays else np.float32
    trailing = arrays[0].shape[1:] if arrays else ()
    out = np.full((self.num_rows, self.row_len) + trailing, pad_value, dtype=dtype)
    for i, a in enumerate(arrays):
      if a.shape != (self.lengths[i],) + trailing:
        raise ValueError(f"sequence {i} has shape {a.shape}, expected {(int(self.lengths[i]),) + trailing}")
      out[self.rows[i], self.offsets[i] : self.offsets[i] + self.lengths[i]] = a
    return out

  def unpack(self, packed) -> list[np.ndarray]:
    """The inverse of :meth:`pack`: per-sequence 1-D arrays, in input order."""
    packed = np.asarray(packed)
    if packed.shape[:2] != (self.num_rows, self.row_len):
      raise ValueError(f"packed array has shape {packed.shape}, expected ({self.num_rows}, {self.row_len}, ...)")
    return [packed[r, o : o + n] for r, o, n in zip(self.rows, self.offsets, self.lengths)]


def plan_packing(
  lengths: Sequence[int], row_len: int, *, num_rows: int | None = None, row_multiple: int = 1
) -> Packing:
  """First-fit-decreasing packing of sequences of the given lengths into rows of ``row_len``.

  Args:
    lengths: length of every sequence (>= 0).
    row_len: tokens per row.
    num_rows: a fixed number of rows (static shapes); an error if the sequences don't fit.
      Default: as few as first-fit-decreasing needs, rounded up to ``row_multiple``.
    row_multiple: round the row count up to a multiple of this (e.g. the device count).
  """
  lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
  if row_len <= 0:
    raise ValueError(f"row_len must be > 0, got {row_len}")
  if (lengths < 0).any():
    raise ValueError(f"sequence lengths must be >= 0, got {int(lengths.min())}")
  if lengths.size and lengths.max() > row_len:
    i = int(lengths.argmax())
    raise ValueError(
      f"sequence {i} has length {int(lengths[i])} > row_len={row_len}; raise row_len or truncate the sequence"
    )
  order = np.argsort(-lengths, kind="stable")
  free: list[int] = []  # remaining capacity per open row
  rows = np.zeros(len(lengths), np.int64)
  offsets = np.zeros(len(lengths), np.int64)
  for i in order:
    n = int(lengths[i])
    for r, cap in enumerate(free):
      if cap >= n:
        break
    else:
      r = len(free)
      free.append(row_len)
    rows[i], offsets[i] = r, row_len - free[r]
    free[r] -= n
  needed = max(len(free), 1)
  if num_rows is None:
    num_rows = -(-needed // row_multiple) * row_multiple
  elif needed > num_rows:
    raise ValueError(
      f"{len(lengths)} sequences ({int(lengths.sum())} tokens) need {needed} rows "
      f"of {row_len} tokens, but num_rows={num_rows}"
    )
  return Packing(row_len=int(row_len), num_rows=int(num_rows), rows=rows, offsets=offsets, lengths=lengths)
