"""The safetensors format, streamed: written tensor by tensor from the arrays where they lie, read
tensor by tensor into buffers the reader chooses, from a file or from chunks as they arrive (an
HTTP body). `safetensors.numpy.save_file` makes a bytes copy of every tensor before it writes and
`load_file` returns a second copy of the file; this module never holds more than the tensor in
hand beyond its destination.

The layout (huggingface/safetensors): 8 bytes, the little-endian length `N` of the header; `N`
bytes of JSON, `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str:
str}}`, padded with spaces to a multiple of 8; then the tensors' bytes, row-major little-endian,
each at its offsets from the end of the header, without gaps. Files written here are read by the
`safetensors` library and `transformers`, and files they write are read here.
"""

from __future__ import annotations

import json
import struct
from typing import Callable, Iterable, Iterator, Sequence

import ml_dtypes
import numpy as np

DTYPES = {
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F16": np.dtype(np.float16),
  "F32": np.dtype(np.float32),
  "F64": np.dtype(np.float64),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "I16": np.dtype(np.int16),
  "U16": np.dtype(np.uint16),
  "I32": np.dtype(np.int32),
  "U32": np.dtype(np.uint32),
  "I64": np.dtype(np.int64),
  "U64": np.dtype(np.uint64),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def dtype_name(dtype) -> str:
  """The safetensors name of a NumPy dtype (`BF16` for `ml_dtypes.bfloat16`)."""
  try:
    return _NAMES[np.dtype(dtype)]
  except KeyError:
    raise ValueError(f"dtype {np.dtype(dtype)} has no safetensors name") from None


def header(tensors: Sequence[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> bytes:
  """The 8-byte length and the padded JSON header of `tensors` (in this order), as the
  safetensors library writes them."""
  entries, offset = {}, 0
  if metadata:
    entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name, a in tensors:  # (anything with a shape and a dtype: the data need not exist yet)
    if name in entries:
      raise ValueError(f"tensor {name!r} twice")
    nbytes = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
    entries[name] = {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  text = json.dumps(entries, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text


def chunks(tensors: Sequence[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> Iterator[memoryview]:
  """The file's bytes: the header, then each tensor's buffer as it lies (a C-contiguous copy
  only of a tensor that is not). Nothing else is copied."""
  yield memoryview(header(tensors, metadata))
  for _, a in tensors:
    a = np.ascontiguousarray(a)
    if a.nbytes:
      yield memoryview(a.reshape(-1).view(np.uint8))


def write(path: str, tensors: Sequence[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> int:
  """`tensors` as a safetensors file at `path`; returns the bytes written."""
  total = 0
  with open(path, "wb") as f:
    for piece in chunks(tensors, metadata):
      f.write(piece)
      total += piece.nbytes
  return total


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary (JAX on CPU
  then takes it as a device buffer without a copy)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + align, np.uint8)
  start = -raw.ctypes.data % align
  return raw[start : start + nbytes].view(dtype).reshape(shape)


class Reader:
  """Reads one safetensors stream tensor by tensor.

  Args:
    destination: `(name, dtype, shape) -> array | None`: where the tensor's bytes go — a writable
      C-contiguous array of that dtype and shape (e.g. its place in a larger buffer), or None for
      a fresh one. Called once per tensor, in the order of their data, when its bytes begin.
    done: `(name, array)`: called with the filled array once its last byte is in.

  Feed it chunks (`feed`, then `close`) or let it read a file object (`read_from`). A stream that
  is malformed or ends early raises `ValueError` naming what is wrong.
  """

  def __init__(
    self, destination: Callable[[str, np.dtype, tuple], np.ndarray | None], done: Callable[[str, np.ndarray], None]
  ):
    self.destination, self.done = destination, done
    self.metadata: dict[str, str] = {}
    self.names: list[str] = []
    self._head = bytearray()
    self._header_len: int | None = None
    self._plan: list[tuple[str, np.dtype, tuple, int, int]] = []  # (name, dtype, shape, begin, end) by begin
    self._at = 0  # bytes of data consumed (past the header)
    self._k = 0  # the tensor being filled
    self._buf: np.ndarray | None = None

  # ---- the header ------------------------------------------------------------------------------
  def _parse_header(self, raw: bytes) -> None:
    try:
      entries = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(entries, dict):
      raise ValueError("safetensors header is not a JSON object")
    self.metadata = entries.pop("__metadata__", None) or {}
    plan = []
    for name, e in entries.items():
      try:
        dtype = DTYPES[e["dtype"]]
        shape = tuple(int(n) for n in e["shape"])
        begin, end = (int(x) for x in e["data_offsets"])
      except (KeyError, TypeError, ValueError):
        raise ValueError(f"safetensors header entry {name!r} is malformed: {str(e)[:200]}") from None
      if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or begin < 0:
        raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not hold {e['dtype']}{list(shape)}")
      plan.append((name, dtype, shape, begin, end))
    plan.sort(key=lambda t: t[3])
    at = 0
    for name, _, _, begin, end in plan:
      if begin != at:
        raise ValueError(f"tensor {name!r} starts at byte {begin}, expected {at} (safetensors data has no gaps)")
      at = end
    self._plan, self.names = plan, [p[0] for p in plan]

  @property
  def data_bytes(self) -> int:
    return self._plan[-1][4] if self._plan else 0

  # ---- the data ----------------------------------------------------------------------------------
  def _target(self) -> memoryview:
    """The rest of the current tensor's bytes, its buffer claimed on its first byte."""
    name, dtype, shape, begin, end = self._plan[self._k]
    if self._buf is None:
      buf = self.destination(name, dtype, shape)
      if buf is None:
        buf = np.empty(shape, dtype)
      elif buf.dtype != dtype or tuple(buf.shape) != shape or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError(
          f"tensor {name!r}: destination {buf.dtype}{list(buf.shape)} does not take {dtype}{list(shape)}"
        )
      self._buf = buf
    return memoryview(self._buf.reshape(-1).view(np.uint8))[self._at - begin :]

  def _filled(self, n: int) -> None:
    self._at += n
    name, _, _, _, end = self._plan[self._k]
    if self._at == end:
      buf, self._buf = self._buf, None
      self._k += 1
      self.done(name, buf)

  def _skip_empty(self) -> None:
    while self._k < len(self._plan) and self._plan[self._k][3] == self._plan[self._k][4]:
      name, dtype, shape, _, _ = self._plan[self._k]
      buf = self.destination(name, dtype, shape)
      self._k += 1
      self.done(name, np.empty(shape, dtype) if buf is None else buf)

  def feed(self, chunk) -> None:
    """The next bytes of the stream (any length)."""
    view = memoryview(chunk).cast("B")
    while view.nbytes:
      if self._header_len is None or len(self._head) < 8 + self._header_len:
        need = (8 if self._header_len is None else 8 + self._header_len) - len(self._head)
        self._head += view[:need]
        view = view[need:]
        if self._header_len is None and len(self._head) == 8:
          (self._header_len,) = struct.unpack("<Q", self._head)
          if self._header_len > MAX_HEADER_BYTES:
            raise ValueError(
              f"safetensors header of {self._header_len} bytes (more than {MAX_HEADER_BYTES}): not a safetensors stream"
            )
        if self._header_len is not None and len(self._head) == 8 + self._header_len:
          self._parse_header(bytes(self._head[8:]))
          self._skip_empty()
        continue
      if self._k >= len(self._plan):
        raise ValueError(f"{view.nbytes} bytes past the end of the safetensors data ({self.data_bytes} bytes)")
      target = self._target()
      n = min(target.nbytes, view.nbytes)
      target[:n] = view[:n]
      view = view[n:]
      self._filled(n)
      self._skip_empty()

  def close(self) -> None:
    """The stream ended: raises `ValueError` when it ended early."""
    if self._header_len is None or len(self._head) < 8 + self._header_len:
      raise ValueError(f"the safetensors stream ended in its header ({len(self._head)} bytes)")
    if self._k < len(self._plan):
      raise ValueError(
        f"the safetensors stream ended after {self._at} of {self.data_bytes} data bytes "
        f"(in tensor {self._plan[self._k][0]!r})"
      )

  def read_from(self, f) -> None:
    """Reads the whole stream from the binary file object `f`, each tensor's bytes straight into
    its destination (`readinto`)."""

    def exactly(view: memoryview) -> None:
      while view.nbytes:
        n = f.readinto(view)
        if not n:
          raise ValueError("the safetensors file ended early")
        view = view[n:]

    head = bytearray(8)
    exactly(memoryview(head))
    self.feed(head)
    raw = bytearray(self._header_len)
    exactly(memoryview(raw))
    self.feed(raw)
    while self._k < len(self._plan):
      target = self._target()
      exactly(target)
      self._filled(target.nbytes)
      self._skip_empty()
    self.close()


def tensor_names(path: str) -> list[str]:
  """The tensor names of the file at `path`, from its header alone."""
  reader = Reader(lambda *_: None, lambda *_: None)
  with open(path, "rb") as f:
    head = f.read(8)
    reader.feed(head)
    if reader._header_len is None:
      raise ValueError(f"{path}: not a safetensors file ({len(head)} bytes)")
    reader.feed(f.read(reader._header_len))
  return reader.names


def read_file(path: str, destination=lambda *_: None, done=None) -> dict[str, np.ndarray]:
  """Every tensor of the file at `path` (`destination` and `done` as `Reader`'s; without `done`,
  the tensors are returned by name)."""
  out = {}
  reader = Reader(destination, done or out.__setitem__)
  with open(path, "rb", buffering=0) as f:
    reader.read_from(f)
  return out


def concat(pieces: Iterable) -> bytes:
  """The pieces of `chunks` as one bytes object (tests, small payloads)."""
  return b"".join(bytes(p) for p in pieces)
