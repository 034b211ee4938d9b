"""Dataset records from JSONL and Parquet files, and column look-up by (dotted) key.

``path`` is a ``.jsonl`` or ``.parquet`` file, a directory (every ``.jsonl`` / ``.parquet``
file directly in it, in name order) or a glob (``data/train-*.parquet``). JSONL is read line
by line with the standard ``json`` module (any JSON values, one object a line; blank lines
skipped); Parquet with ``pyarrow`` (nested columns — lists of chat messages, structs such as
verl's ``reward_model`` — come back as Python lists and dicts). Every record carries where it
came from, for error messages: ``file:LINE`` (1-based) for JSONL, ``file row N`` (0-based, as
pyarrow and pandas count) for Parquet.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Iterator

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
MISSING = object()


@dataclasses.dataclass(frozen=True)
class Record:
  values: dict
  where: str  # "file:LINE" or "file row N"


def dataset_files(path: str) -> list[str]:
  """The data files ``path`` names; a `FileNotFoundError` / `ValueError` naming it otherwise."""
  if any(c in path for c in "*?["):
    files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
    if not files:
      raise FileNotFoundError(f"task.path {path!r}: no file matches this pattern")
  elif os.path.isdir(path):
    files = sorted(
      os.path.join(path, f)
      for f in os.listdir(path)
      if os.path.splitext(f)[1] in FORMATS and os.path.isfile(os.path.join(path, f))
    )
    if not files:
      raise FileNotFoundError(f"task.path {path!r}: the directory holds no .jsonl or .parquet file")
  elif os.path.isfile(path):
    files = [path]
  else:
    raise FileNotFoundError(f"task.path: dataset not found: {path}")
  for f in files:
    if os.path.splitext(f)[1] not in FORMATS:
      raise ValueError(f"task.path: {f}: unknown dataset format; expected a .jsonl or .parquet file")
  return files


def read_records(path: str) -> Iterator[Record]:
  """Every record of every file of ``path`` (:func:`dataset_files`), in order."""
  for file in dataset_files(path):
    yield from read_file(file)


def read_file(file: str) -> Iterator[Record]:
  """The records of one ``.jsonl`` or ``.parquet`` file."""
  return (_jsonl if file.endswith(".jsonl") else _parquet)(file)


def _jsonl(file: str) -> Iterator[Record]:
  with open(file, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{lineno}: invalid JSON: {e}") from None
      if not isinstance(value, dict):
        raise ValueError(f"{file}:{lineno}: a record must be a JSON object, got {type(value).__name__}")
      yield Record(value, f"{file}:{lineno}")


def _parquet(file: str) -> Iterator[Record]:
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    reader = pq.ParquetFile(file)
    batches = reader.iter_batches(batch_size=1024)
    row = 0
    for batch in batches:
      for value in batch.to_pylist():
        yield Record(value, f"{file} row {row}")
        row += 1
  except (pa.ArrowException, OSError) as e:
    raise ValueError(f"{file}: not a readable Parquet file: {e}") from None


def lookup(values: dict, key: str) -> Any:
  """``values[key]``, or for a dotted key the nested value (``reward_model.ground_truth`` →
  ``values["reward_model"]["ground_truth"]``); a column whose name holds the dot wins.
  `MISSING` when absent."""
  if key in values:
    return values[key]
  node: Any = values
  for part in key.split("."):
    if not isinstance(node, dict) or part not in node:
      return MISSING
    node = node[part]
  return node


def columns(values: dict, prefix: str = "") -> list[str]:
  """The record's keys, nested ones dotted (for "missing column" messages)."""
  out = []
  for k, v in values.items():
    out.append(prefix + k)
    if isinstance(v, dict):
      out.extend(columns(v, prefix + k + "."))
  return out
