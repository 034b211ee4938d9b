"""The next weights of a `GenerationEngine`, assembled on the host while the served ones keep
serving, then swapped in whole (all or nothing).

HF tensors arrive one at a time — read from a checkpoint's files, or streamed over HTTP in buckets
(`protocol.WEIGHTS_STAGE_ROUTE`) — and each goes straight to its place in a host buffer, one per
parameter in the served layout, 64-byte aligned, so that on CPU the swap takes it as a device
buffer without a copy (a tensor HF stores transposed is transposed into place tile by tile, ~4×
faster than NumPy's strided copy of the whole, or XLA's of 16-bit values, here). A delta (only
the values that changed since the weights the engine serves, by flat index into the HF tensor)
starts a parameter's buffer from a copy of its served values; a parameter no tensor or delta
touched keeps its served buffer. So a load holds the served weights plus at most one new copy
(and one tensor in flight), never a whole checkpoint beside them.

`raw`: the tensors are kept by name as they came and converted at the end by the engine's own path
(weight-only quantisation computes its scales from the checkpoint's values; a checkpoint whose
tensors are stored fused is read through the architecture's views). Deltas need the served layout.
"""

from __future__ import annotations

import hashlib

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from trainers.models import hf_io, safetensors_stream as sts
from trainers.models.config import ModelConfig
from trainers.models.decoder import WEIGHT_BITS

# The staged buffer's dtype for a served dtype (NumPy has no bfloat16 of its own).
_HOST = {np.dtype(jax.numpy.bfloat16): np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32): np.dtype(np.float32)}


TRANSPOSE_TILE = 128


def transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = TRANSPOSE_TILE) -> None:
  """`dst[...] = src.T` (2-D, cast to `dst`'s dtype) tile by tile: each tile's reads and writes
  stay in cache, where a strided copy of the whole misses on every element of one side."""
  if dst.shape != src.shape[::-1] or src.ndim != 2:
    raise ValueError(f"cannot transpose {list(src.shape)} into {list(dst.shape)}")
  rows, cols = src.shape
  for i in range(0, rows, tile):
    for j in range(0, cols, tile):
      dst[j : j + tile, i : i + tile] = src[i : i + tile, j : j + tile].T


class StageError(ValueError):
  """Staged weights that cannot become the served ones (named tensors missing, a shape or index
  out of place); nothing served has changed."""


class WeightStage:
  """Weights `version` being assembled for an engine serving `served` (its state as the sampler
  holds it: bfloat16 as bits) of `logical` structure (`jax.ShapeDtypeStruct`s in the served dtype).

  `push`: the pusher's name for this set of weights (a delta's base names one); `base`: the push a
  delta is relative to (None: every tensor comes whole).
  """

  def __init__(
    self,
    served: nnx.State,
    logical: nnx.State,
    config: ModelConfig,
    *,
    version: str | None = None,
    push: str | None = None,
    base: str | None = None,
    raw: bool = False,
  ):
    self.version, self.push, self.base, self.raw = version, push, base, raw
    self.logical, self.graphdef = logical, None  # (the engine's graph, for a raw stage's conversion)
    self.slots = hf_io.hf_slots(logical, config)
    self._tied = config.tie_word_embeddings
    self._served = dict(nnx.to_flat_state(served))
    self._logical = dict(nnx.to_flat_state(logical))
    self._buffers: dict[tuple, np.ndarray] = {}
    self._scratch: dict[tuple, np.ndarray] = {}  # (shape, dtype) -> where a tensor to transpose is read
    self.tensors: dict[str, np.ndarray] = {}  # raw: the tensors by name
    self.seen: set[str] = set()
    self.buckets: set[int] = set()
    self.nbytes = 0  # received tensor bytes

  # ---- where each tensor goes ----------------------------------------------------------------------
  def _slot(self, name: str) -> hf_io.HFSlot:
    try:
      return self.slots[name]
    except KeyError:
      raise StageError(f"unexpected tensor {name!r}: the served model has no such weight") from None

  def _buffer(self, path: tuple, *, from_served: bool) -> np.ndarray:
    """The staged buffer of parameter `path` in the served layout and dtype (created on first use:
    a copy of the served values for a delta, else uninitialised until every piece arrives)."""
    if path not in self._buffers:
      ref = self._logical[path].get_value()
      buf = sts.aligned_empty(ref.shape, _HOST[np.dtype(ref.dtype)])
      if from_served:
        served = np.asarray(self._served[path].get_value())  # (a view on CPU)
        buf.reshape(-1).view(served.dtype)[:] = served.reshape(-1)
      self._buffers[path] = buf
    return self._buffers[path]

  def destination(self, name: str, dtype, shape) -> np.ndarray | None:
    """`safetensors_stream.Reader`'s destination: a whole tensor of the served dtype and layout is
    read straight into its place; anything else arrives apart and is placed by `put`."""
    if self.raw or name not in self.slots:
      return None
    slot = self.slots[name]
    if tuple(shape) != slot.shape:
      return None
    if slot.transpose:  # read into one reused buffer, transposed into place by `put` before the next
      key = (tuple(shape), np.dtype(dtype))
      if key not in self._scratch:
        self._scratch[key] = np.empty(shape, dtype)
      return self._scratch[key]
    block = self._buffer(slot.path, from_served=self.base is not None)[slot.lead]
    return block if block.dtype == np.dtype(dtype) else None

  def put(self, name: str, array: np.ndarray) -> None:
    """A whole HF tensor (HF layout, any float dtype: cast to the served one as a load casts)."""
    self.nbytes += array.nbytes
    if name not in self.slots and hf_io.skipped_on_load(name, self._tied):
      return
    if self.raw:
      self.tensors[name] = array
      self.seen.add(name)
      return
    slot = self._slot(name)
    if tuple(array.shape) != slot.shape:
      raise StageError(f"tensor {name!r} has shape {list(array.shape)}, the served model {list(slot.shape)}")
    block = self._buffer(slot.path, from_served=self.base is not None)[slot.lead]
    if slot.transpose:
      transpose_into(block, array)
    elif not np.shares_memory(block, array):  # (else it was read into its place)
      block[...] = array
    self.seen.add(name)

  def put_delta(self, name: str, index: np.ndarray, values: np.ndarray) -> None:
    """The values of HF tensor `name` at flat `index` (into its HF layout) that changed since the
    base weights; every other value stays the served one."""
    self.nbytes += index.nbytes + values.nbytes
    if self.raw or self.base is None:
      raise StageError(f"a delta for {name!r} needs weights it is relative to (a base) and the served layout")
    slot = self._slot(name)
    if index.shape != values.shape or index.ndim != 1:
      raise StageError(f"delta of {name!r}: {index.shape[0] if index.ndim else 0} indices for {values.size} values")
    size = int(np.prod(slot.shape, dtype=np.int64))
    if index.size and (int(index.max()) >= size):
      raise StageError(f"delta of {name!r}: index {int(index.max())} outside its {size} values")
    block = self._buffer(slot.path, from_served=True)[slot.lead]
    if slot.transpose:  # HF [out, in] flat index -> our [in, out] block
      out_, in_ = np.divmod(index.astype(np.int64), slot.shape[1])
      block[in_, out_] = values
    else:
      block.reshape(-1)[index] = values
    self.seen.add(name)

  # ---- the swap ------------------------------------------------------------------------------------
  def missing(self) -> list[str]:
    """HF tensors a full push has not brought (a delta leaves the rest served)."""
    if self.base is not None:
      return []
    return sorted(set(self.slots) - self.seen)

  def state(self) -> nnx.State:
    """The staged weights as the sampler holds them (bfloat16 as bits), on the served weights'
    devices; a parameter nothing touched is its served array. The staging's buffers pass to the
    result (on CPU without a copy); the stage is empty afterwards. Raises `StageError` when a
    full push left tensors out."""
    self._scratch.clear()
    missing = self.missing()
    if missing:
      raise StageError(
        f"{len(missing)} tensors never arrived: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
      )
    out = []
    for path, var in self._served.items():
      served = var.get_value()
      buf = self._buffers.pop(path, None)
      if buf is None:
        out.append((path, var))
        continue
      host = buf.view(np.uint16) if served.dtype == WEIGHT_BITS else buf
      out.append((path, var.replace(jax.device_put(host, served.sharding))))
    return nnx.from_flat_state(out)


def weights_digest(state: nnx.State) -> str:
  """sha256 over a parameter state's leaves in flat order — each leaf's path, shape and bytes, a
  bfloat16 leaf as its bits — so an engine's served weights (`GET protocol.WEIGHTS_DIGEST_ROUTE`)
  and a trainer's parameters cast to the served dtype compare bit for bit without moving them."""
  h = hashlib.sha256()
  for path, var in nnx.to_flat_state(state):
    a = np.asarray(var.get_value())
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
      a = a.view(np.uint16)
    h.update(f"{'.'.join(map(str, path))}:{list(a.shape)}:{a.dtype.itemsize};".encode())
    h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
  return h.hexdigest()


def read_checkpoint(stage: WeightStage, path: str) -> None:
  """Every tensor of the `*.safetensors` files of the HF checkpoint at `path` into `stage`, file
  by file, tensor by tensor (no file is mapped or held whole)."""
  files = hf_io.checkpoint_files(path)
  for f in files:
    sts.read_file(f, stage.destination, stage.put)
