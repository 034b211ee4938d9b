"""Batch assembly: rollout samples → a packed, micro-batched step batch and its model inputs.

Each sequence is prompt + response; the model sees `seq[:-1]` and predicts `seq[1:]`, so
response token `j` sits at input position `len(prompt) - 1 + j`. Sequences are packed
first-fit-decreasing into rows of `row_len` tokens (contract §1) and the rows are laid out as
`[micro_batches, rows_per_micro_batch, row_len]`, where a micro-batch holds at most
`tokens_per_micro_batch` tokens per device of the `data × fsdp × expert` batch axes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import mis_jax
from trainers.rollout import extras as extras_lib


def _bucket(n: int) -> int:
  """`n` rounded up to 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5×): few distinct
  shapes to compile, at most a third of the micro-batches empty."""
  if n <= 2:
    return max(n, 1)
  p = 2 ** (math.ceil(math.log2(n)) - 1)
  return 3 * p // 2 if n <= 3 * p // 2 else 2 * p


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a step's rows are split: `micro_batches × rows_per_micro_batch` rows of `row_len`."""

  micro_batches: int
  rows_per_micro_batch: int
  row_len: int

  @property
  def num_rows(self) -> int:
    return self.micro_batches * self.rows_per_micro_batch

  @property
  def shape(self) -> tuple[int, int, int]:
    return self.micro_batches, self.rows_per_micro_batch, self.row_len


def plan_layout(lengths, *, row_len: int, tokens_per_micro_batch: int, batch_devices: int) -> Layout:
  """The smallest layout (in few bucketed shapes) that holds the packed sequences.

  A micro-batch has `rows_per_device × batch_devices` rows, with `rows_per_device ≤
  tokens_per_micro_batch // row_len`; a step that needs fewer rows gets a smaller micro-batch
  (a power of two rows per device), a larger one several micro-batches."""
  max_rows = max(1, tokens_per_micro_batch // row_len)
  needed = mis_jax.plan_packing(lengths, row_len).num_rows
  per_device = -(-needed // batch_devices)
  if per_device <= max_rows:
    rows = min(2 ** math.ceil(math.log2(per_device)), max_rows)
    k = 1
  else:
    rows, k = max_rows, _bucket(-(-per_device // max_rows))
  return Layout(micro_batches=k, rows_per_micro_batch=rows * batch_devices, row_len=row_len)


@dataclasses.dataclass
class StepBatch:
  """One step's packed batch (`[micro_batches, rows, row_len]` arrays) and its model inputs."""

  batch: mis_jax.PackedBatch
  input_ids: np.ndarray
  positions: np.ndarray
  targets: np.ndarray
  rewards: np.ndarray
  advantages: np.ndarray  # per sequence
  response_lengths: np.ndarray
  groups: np.ndarray
  packing: mis_jax.Packing
  layout: Layout
  # The run's per-token extras packed (`extras.pack`), by name: `[micro_batches, rows, row_len, ...]`,
  # e.g. `sampling_mask` [..., K] int32 -1 padded, `routed_experts` [..., layers, k] int32 -1: no record.
  extras: dict = dataclasses.field(default_factory=dict)
  metrics: dict = dataclasses.field(default_factory=dict)  # what building it measured (per-token staleness)

  def per_sequence(self, token_array) -> list[np.ndarray]:
    """A `[micro_batches, rows, row_len]` per-token array → one array per sequence."""
    return self.packing.unpack(np.asarray(token_array).reshape(self.layout.num_rows, self.layout.row_len))

  def tokens(self, per_sequence, fill, dtype) -> np.ndarray:
    """One array per sequence → a packed `[micro_batches, rows, row_len]` array."""
    return self.packing.pack(per_sequence, fill, dtype).reshape(self.layout.shape)


def token_versions(sample) -> np.ndarray:
  """The weight version that generated each response token, from SGLang's `weight_versions`
  spans `(version, start, end)` over the completion tokens (a response that straddled an update
  spans several); the sample's `weight_version` where no span covers a token."""
  versions = np.full(len(sample.response_ids), int(sample.weight_version), np.int64)
  for version, start, end in sample.weight_versions:
    versions[start:end] = int(version)
  return versions


def token_staleness(samples, step: int) -> list[np.ndarray]:
  """Per sample, how many weight versions each response token's sampler lags `step` (the
  version of the weights being trained)."""
  return [step - token_versions(s) for s in samples]


def fresh_tokens(staleness: list[np.ndarray], max_token_staleness: int) -> tuple[list[np.ndarray], dict]:
  """Per sample, its response tokens generated at most `max_token_staleness` weight versions
  before the step (`staleness`: each sample's `token_staleness`): the others leave the loss and
  stay as context.
  Metrics: the share of stale tokens, the mean staleness, and the mean staleness of the tokens
  in each quarter of their response (`_q1` the first)."""
  fresh = [st <= max_token_staleness for st in staleness]
  all_st = np.concatenate(staleness) if staleness else np.zeros(0)
  quarter = (
    np.concatenate([np.minimum(4 * np.arange(len(st)) // max(len(st), 1), 3) for st in staleness])
    if staleness
    else np.zeros(0, int)
  )
  metrics = {
    "rollout/stale_token_fraction": float(np.mean(all_st > max_token_staleness)) if all_st.size else 0.0,
    "rollout/token_staleness_mean": float(all_st.mean()) if all_st.size else 0.0,
  }
  for q in range(4):
    at = all_st[quarter == q]
    metrics[f"rollout/token_staleness_q{q + 1}"] = float(at.mean()) if at.size else 0.0
  return fresh, metrics


def build_step_batch(
  samples,
  rewards,
  advantages,
  groups,
  *,
  num_segments: int,
  row_len: int,
  tokens_per_micro_batch: int,
  batch_devices: int,
  extras=(),
  trained_tokens=None,
  staleness=None,
) -> StepBatch:
  """Packs `samples` (with `prompt_ids`, `response_ids`, `rollout_logprobs`) and their
  per-sequence `advantages` into a :class:`StepBatch`. Each of the run's per-token `extras`
  (`trainers.rollout.extras`) is packed from the samples' `extras` by `extras.pack` into
  `StepBatch.extras` (its `fill` elsewhere: e.g. a sampling support of `-1`s is the whole
  vocabulary, routed experts of `-1` are routed natively). `trained_tokens`: per sample, which response tokens the
  loss trains on (default all; the others stay as context). `staleness`: per sample, each
  response token's `token_staleness`, packed as `rollout_staleness` (0 elsewhere) for
  `loss.proximal: loglinear`."""
  inputs, targets, masks, q, stale = [], [], [], [], []
  for k, s in enumerate(samples):
    seq = np.array(s.prompt_ids + s.response_ids, np.int32)
    inputs.append(seq[:-1])
    targets.append(seq[1:])
    response = np.arange(len(seq) - 1) >= len(s.prompt_ids) - 1
    m = response.copy()
    if trained_tokens is not None:
      m[response] = trained_tokens[k]
    masks.append(m)
    lp = np.zeros(len(seq) - 1, np.float32)
    lp[response] = s.rollout_logprobs
    q.append(lp)
    if staleness is not None:
      st = np.zeros(len(seq) - 1, np.float32)
      st[response] = staleness[k]
      stale.append(st)
  lengths = [len(x) for x in inputs]
  layout = plan_layout(
    lengths, row_len=row_len, tokens_per_micro_batch=tokens_per_micro_batch, batch_devices=batch_devices
  )
  packing = mis_jax.plan_packing(lengths, row_len, num_rows=layout.num_rows)
  shaped = lambda x: np.asarray(x).reshape(layout.shape)
  pack = lambda xs, fill, dtype: shaped(packing.pack(xs, fill, dtype))
  advs = [np.full(n, a, np.float32) for n, a in zip(lengths, advantages)]
  batch = mis_jax.PackedBatch(
    segment_ids=shaped(packing.segment_ids),
    loss_mask=pack(masks, False, bool),
    advantages=pack(advs, 0.0, np.float32),
    rollout_logprobs=pack(q, 0.0, np.float32),
    rollout_staleness=pack(stale, 0.0, np.float32) if staleness is not None else None,
    num_segments=num_segments,
  )
  packed = {e.name: extras_lib.pack(e, samples, packing, layout.shape) for e in extras}
  batch = batch.replace(**{e.batch_field: packed[e.name] for e in extras if e.batch_field})  # e.g. the sampler's top-k
  return StepBatch(
    batch=batch,
    input_ids=pack(inputs, 0, np.int32),
    positions=shaped(packing.positions),
    targets=pack(targets, 0, np.int32),
    rewards=np.asarray(rewards, np.float32),
    advantages=np.asarray(advantages, np.float32),
    response_lengths=np.array([len(s.response_ids) for s in samples]),
    groups=np.asarray(groups, np.int32),
    packing=packing,
    layout=layout,
    extras=packed,
  )


class StepBatcher:
  """A step's rollout → its `StepBatch`: the rewards (the replayed records', the trajectories'
  environments', else `reward(prompt, response_ids, text)`), per-sequence advantages
  (`advantages(rewards, groups, lengths)`), per-token staleness where the run uses it (`staleness`:
  `max_token_staleness` masks tokens older than that; `loglinear` feeds it to the loss), the tokens
  the loss may train on (the extras' `trainable`), the packed batch, then the `stages` in order
  (each `stage(sb, samples, rewards, groups) -> sb`, e.g. an agent run's per-turn returns)."""

  def __init__(
    self,
    *,
    reward,
    advantages,
    extras,
    num_segments: int,
    row_len: int,
    tokens_per_micro_batch: int,
    batch_devices: int,
    max_token_staleness: int | None = None,
    loglinear: bool = False,
    stages=(),
  ):
    self.reward, self.advantages, self.extras, self.stages = reward, advantages, extras, tuple(stages)
    self.layout = dict(
      num_segments=num_segments,
      row_len=row_len,
      tokens_per_micro_batch=tokens_per_micro_batch,
      batch_devices=batch_devices,
    )
    self.max_token_staleness, self.loglinear = max_token_staleness, loglinear

  def __call__(self, prompts, result, step: int) -> StepBatch:
    samples = result.samples
    if result.rewards is not None:  # replayed records carry their rewards
      rewards = np.asarray(result.rewards, np.float32)
    elif samples and all(s.reward is not None for s in samples):  # trajectories: their environment's rewards
      rewards = np.array([s.reward for s in samples], np.float32)
    else:
      rewards = np.array([self.reward(prompts[s.prompt_index], s.response_ids, s.text) for s in samples], np.float32)
    groups = np.array([s.prompt_index for s in samples], np.int32)
    lengths = np.array([len(s.response_ids) for s in samples], np.int32)
    trained, metrics = None, {}
    staleness = (
      token_staleness(samples, step)  # the weights being trained are version `step`
      if self.max_token_staleness is not None or self.loglinear
      else None
    )
    if self.max_token_staleness is not None:
      trained, metrics = fresh_tokens(staleness, self.max_token_staleness)
    trained = extras_lib.trainable(self.extras, samples, trained)  # e.g. a trajectory's model tokens only
    sb = build_step_batch(
      samples,
      rewards,
      self.advantages(rewards, groups, lengths),
      groups,
      **self.layout,
      extras=self.extras,
      trained_tokens=trained,
      staleness=staleness if self.loglinear else None,
    )
    for stage in self.stages:
      sb = stage(sb, samples, rewards, groups)
    sb.metrics.update(metrics)
    return sb
