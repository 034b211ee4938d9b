"""Rollout records: every step's rollouts as one Parquet file, for replay without a server and for
offline analysis of the mismatch (`mis-jax train --save-rollouts / --load-rollouts`,
`mis-jax analyze`).

A run's record directory holds `step_000042.parquet` for each step (the step it trained, from 1),
written atomically (a temporary name, then a rename), so a resumed run that repeats a step
replaces that step's file and never duplicates it. One row per sample:

| column | type | meaning |
|---|---|---|
| `step` | int64 | the training step the sample was used in (from 1) |
| `sample` | int64 | its index within the step (prompt-major) |
| `group` | int64 | its prompt group (the GRPO group) within the step |
| `prompt_ids` | list<int32> | prompt token ids |
| `response_ids` | list<int32> | response token ids (`output_ids`) |
| `rollout_logprobs` | list<float32> | the server's log-prob of each response token (the behaviour log-probs with sampling replay) |
| `reward` | float32 | the task's reward |
| `advantage` | float32 | the sequence's advantage |
| `finish_reason` | string | `stop` or `length` |
| `weight_version` | string | the server's weight version of its last token |
| `weight_versions` | list<struct<version: string, start: int32, end: int32>> | SGLang's spans over the response tokens: the version that generated tokens `[start, end)` (a response that straddled an update, or a trajectory's turns, each under its own weights) |
| `old_logprobs` | list<float32> | the trainer's recomputed log-probs, when the algorithm computed them |
| `sampling_mask` | list<list<int32>> | each response token's sampling support, with sampling replay |
| `routed_experts` | list<int32> | MoE with routed experts (R3, `record_routing`): the server's experts of every position but the last, row-major `[prompt + response - 1, num_hidden_layers, num_experts_per_tok]` |
| `turn` | list<int32> | multi-turn trajectories (`trainers.agents`): per response token, the model turn that sampled it (1, 2, …) or 0 for the environment's tokens (trained on never) |

The last three are per-token extras (`trainers.rollout.extras`): every registered extra has its
column (its `record_type`), written and read when the run uses it.

The file's metadata key `mis_jax` holds JSON: the format version, the run's sampling parameters,
task, loss and trainer configs, and the rollout batch index the step consumed. pyarrow, pandas
or `datasets` read the files as they are.
"""

from __future__ import annotations

import glob
import json
import os
import re

from trainers.models import hf_io
from trainers.rollout import extras as extras_lib

FORMAT_VERSION = 1
METADATA_KEY = b"mis_jax"
REQUIRED = (
  "step",
  "sample",
  "group",
  "prompt_ids",
  "response_ids",
  "rollout_logprobs",
  "reward",
  "advantage",
  "finish_reason",
  "weight_version",
)
_NAME = re.compile(r"^step_(\d{6})\.parquet$")


class RecordError(ValueError):
  """Records that cannot be used: the message names the file and the column."""


def step_path(directory: str, step: int) -> str:
  return os.path.join(directory, f"step_{step:06d}.parquet")


def _schema():
  """Every column's type: the fixed ones, then each registered per-token extra's."""
  import pyarrow as pa

  return {
    "step": pa.int64(),
    "sample": pa.int64(),
    "group": pa.int64(),
    "prompt_ids": pa.list_(pa.int32()),
    "response_ids": pa.list_(pa.int32()),
    "rollout_logprobs": pa.list_(pa.float32()),
    "reward": pa.float32(),
    "advantage": pa.float32(),
    "finish_reason": pa.string(),
    "weight_version": pa.string(),
    "old_logprobs": pa.list_(pa.float32()),
    "loss_mask": pa.list_(pa.bool_()),
    "weight_versions": pa.list_(pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])),
    **{name: kind.record_type() for name, kind in extras_lib.registered().items()},
  }


def optional_columns() -> tuple[str, ...]:
  """The columns a record file may lack: the old log-probs, the loss mask, the version spans and the
  extras'."""
  return ("old_logprobs", "loss_mask", "weight_versions", *extras_lib.registered())


def write_step(directory: str, step: int, columns: dict, metadata: dict) -> str:
  """Writes one step's rows (`columns`: column name → list of per-sample values) atomically."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  types = _schema()
  unknown = set(columns) - set(types)
  if unknown:
    raise ValueError(f"unknown record columns {sorted(unknown)}")
  table = pa.table({k: pa.array(v, type=types[k]) for k, v in columns.items()})
  table = table.replace_schema_metadata({METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION, **metadata})})
  os.makedirs(directory, exist_ok=True)
  dest = step_path(directory, step)
  hf_io.atomic_write(dest, lambda tmp: pq.write_table(table, tmp))
  return dest


def list_steps(directory: str) -> dict[int, str]:
  """`{step: file}` of a record directory; a missing directory or one without records is an error."""
  if not os.path.isdir(directory):
    raise RecordError(f"rollout records {directory!r}: no such directory")
  for path in sorted(glob.glob(os.path.join(directory, "*.parquet"))):
    if _NAME.match(os.path.basename(path)) is None:
      raise RecordError(f"{path}: not a rollout record file name (expected step_NNNNNN.parquet)")
  found = _step_files(directory)
  if not found:
    raise RecordError(f"rollout records {directory!r}: no step_NNNNNN.parquet file")
  return found


def _step_files(directory: str) -> dict[int, str]:
  """`{step: file}` of the record files in `directory` (other files ignored)."""
  found = {}
  for path in sorted(glob.glob(os.path.join(directory, "*.parquet"))):
    m = _NAME.match(os.path.basename(path))
    if m is not None:
      found[int(m.group(1))] = path
  return found


def read_step(path: str):
  """`(columns, metadata)` of one record file, checked: every required column with its type,
  no unknown column, one `step` value matching the file name, token ids >= 0, one log-prob per
  response token (and one old log-prob, and one value of each per-response-token extra, when
  present)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    table = pq.read_table(path)
  except (OSError, pa.ArrowException) as e:
    raise RecordError(f"{path}: not a readable Parquet file: {e}") from None
  types = _schema()
  names = set(table.column_names)
  unknown = sorted(names - set(types))
  if unknown:
    raise RecordError(
      f"{path}: unknown column {unknown[0]!r}; record columns are {', '.join(REQUIRED + optional_columns())}"
    )
  for name in REQUIRED:
    if name not in names:
      raise RecordError(f"{path}: missing column {name!r}")
  for name in names:
    if not table.schema.field(name).type.equals(types[name]):
      try:
        table = table.set_column(table.column_names.index(name), name, table.column(name).cast(types[name]))
      except (pa.ArrowException, ValueError):
        raise RecordError(
          f"{path}: column {name!r} has type {table.schema.field(name).type}, expected {types[name]}"
        ) from None
  cols = table.to_pydict()
  meta = {}
  raw = (table.schema.metadata or {}).get(METADATA_KEY)
  if raw is not None:
    meta = json.loads(raw)
  step = int(_NAME.match(os.path.basename(path)).group(1))
  if any(s != step for s in cols["step"]):
    raise RecordError(f"{path}: column 'step' holds {sorted(set(cols['step']))}, the file name says step {step}")
  for i, (prompt, resp, lps) in enumerate(zip(cols["prompt_ids"], cols["response_ids"], cols["rollout_logprobs"])):
    if not prompt or not resp:
      raise RecordError(f"{path} row {i}: column {'prompt_ids' if not prompt else 'response_ids'!r} is empty")
    if min(prompt) < 0 or min(resp) < 0:
      raise RecordError(
        f"{path} row {i}: column {'prompt_ids' if min(prompt) < 0 else 'response_ids'!r} holds a negative token id"
      )
    if len(lps) != len(resp):
      raise RecordError(
        f"{path} row {i}: column 'rollout_logprobs' has {len(lps)} values for {len(resp)} response tokens"
      )
    per_token = ("old_logprobs", *(n for n, kind in extras_lib.registered().items() if kind.span == "response"))
    for name in per_token:
      if name in cols and cols[name][i] is not None and len(cols[name][i]) != len(resp):
        raise RecordError(
          f"{path} row {i}: column {name!r} has {len(cols[name][i])} entries for {len(resp)} response tokens"
        )
  return cols, meta


def check_fits(path: str, cols: dict, *, vocab_size: int, row_len: int, max_samples: int, max_groups: int) -> None:
  """Records that do not fit the model or the config are errors naming the file and column."""
  if len(cols["step"]) > max_samples:
    raise RecordError(f"{path}: {len(cols['step'])} samples, more than rollout.prompts_per_step x n = {max_samples}")
  for i, (prompt, resp, group) in enumerate(zip(cols["prompt_ids"], cols["response_ids"], cols["group"])):
    top = max(max(prompt), max(resp))
    if top >= vocab_size:
      name = "prompt_ids" if max(prompt) >= vocab_size else "response_ids"
      raise RecordError(
        f"{path} row {i}: column {name!r} holds token id {top}, outside the model's vocabulary ({vocab_size})"
      )
    if len(prompt) + len(resp) - 1 > row_len:
      raise RecordError(
        f"{path} row {i}: columns 'prompt_ids' + 'response_ids' ({len(prompt)} + {len(resp)} "
        f"tokens) do not fit train.row_len {row_len}"
      )
    if not 0 <= group < max_groups:
      raise RecordError(
        f"{path} row {i}: column 'group' is {group}, outside 0..{max_groups - 1} (rollout.prompts_per_step)"
      )


class RecordWriter:
  """A run's records (`rollout.records.save_dir`): process 0 writes step `k`'s file after step `k`;
  every process takes part in gathering the recomputed old log-probs. `start(step)` removes the
  files past the step a run resumes from, so each step is recorded once, by the run that trained
  it. `meta`: what every file's metadata carries besides the step's batch."""

  def __init__(self, directory: str, *, meta: dict, extras=()):
    self.directory, self.meta, self.extras = directory, meta, tuple(extras)  # the run's per-token extras

  def start(self, step: int) -> None:
    from trainers.runtime import distributed

    if distributed.is_primary() and os.path.isdir(self.directory):
      for k, path in _step_files(self.directory).items():
        if k > step:
          os.remove(path)

  def write(self, step: int, sb, rollout, old_logprobs) -> None:
    """Step `step`'s samples (`rollout`), their rewards and advantages (`sb`, the step batch)
    and, when the algorithm computed them, the old log-probs (a device array over `sb`'s rows)."""
    from trainers.runtime import distributed

    samples = rollout.result.samples
    old = None
    if old_logprobs is not None:
      responses = [len(s.response_ids) for s in samples]
      old = [seq[-n:].tolist() for seq, n in zip(sb.per_sequence(distributed.to_host(old_logprobs)), responses)]
    if not distributed.is_primary():
      return
    columns = {
      "step": [step] * len(samples),
      "sample": list(range(len(samples))),
      "group": [s.prompt_index for s in samples],
      "prompt_ids": [list(s.prompt_ids) for s in samples],
      "response_ids": [list(s.response_ids) for s in samples],
      "rollout_logprobs": [list(s.rollout_logprobs) for s in samples],
      "reward": sb.rewards.tolist(),
      "advantage": sb.advantages.tolist(),
      "finish_reason": [s.finish_reason for s in samples],
      "weight_version": [str(s.weight_version) for s in samples],
      "weight_versions": [
        [{"version": str(v), "start": a, "end": b} for v, a, b in s.weight_versions] for s in samples
      ],
    }
    if old is not None:
      columns["old_logprobs"] = old
    for extra in self.extras:
      columns[extra.name] = [extra.to_record(s.extras[extra.name]) for s in samples]
    meta = {**self.meta, "batch_index": rollout.batch}
    if rollout.prompts is None:  # replayed records: no sampling of this run's
      meta["sampling_params"] = None
    write_step(self.directory, step, columns, meta)


class NoRecords:
  """No `rollout.records.save_dir`: nothing is written."""

  def start(self, step: int) -> None:
    pass

  def write(self, step: int, sb, rollout, old_logprobs) -> None:
    pass
