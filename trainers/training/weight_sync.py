"""Weight sync, the writing side: the trainer's sharded parameters as an HF checkpoint that
SGLang (`/update_weights_from_disk`) and `transformers` load, written by every process at once."""

from __future__ import annotations

import collections
import os
import time

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from trainers.models import hf_io
from trainers.models.config import ModelConfig
from trainers.training import distributed


# One jitted cast per dtype, shared by every save (a new jit per call would recompile each sync).
_CASTS = {name: jax.jit(lambda x, d=dt: x.astype(d)) for name, dt in hf_io.DTYPES.items()}


def shard_plan(sizes: dict[str, int], num_shards: int) -> dict[str, int]:
  """`{parameter: shard}`: parameters (in name order) to `num_shards` files, largest first
  onto the lightest shard, so every file (one per process) has about the same bytes."""
  loads = [0] * num_shards
  plan = {}
  for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
    k = min(range(num_shards), key=lambda i: (loads[i], i))
    plan[name] = k
    loads[k] += sizes[name]
  return plan


def save_hf_sharded(state: nnx.State, config: ModelConfig, path: str | os.PathLike, *,
                    dtype: str = "bfloat16", num_shards: int | None = None) -> dict[str, float]:
  """Writes `path` as a sharded HF checkpoint: `model-0000k-of-0000N.safetensors` (N =
  `num_shards`, default the number of processes; fewer if there are fewer parameters) +
  `model.safetensors.index.json` + `config.json`, the layout SGLang and `transformers` load.

  Collective: every process calls it with the same (sharded, possibly multi-process) `state`.
  Each parameter, cast to `dtype` on its devices, is gathered in turn and kept only by the
  process that owns its file (file `k` belongs to process `k % process_count`, files balanced
  by `shard_plan`), which converts it to HF names and layout and writes that file; processes
  write their files in parallel. Process 0 writes the index and the config; every file is
  renamed into place whole. Returns the seconds spent gathering and writing (this process).
  """
  if dtype not in hf_io.DTYPES:
    raise ValueError(f"dtype must be one of {sorted(hf_io.DTYPES)}, got {dtype!r}")
  t0 = time.perf_counter()
  leaves = sorted(((".".join(map(str, p)), p, v.get_value()) for p, v in hf_io.param_leaves(state)),
                  key=lambda t: t[0])
  itemsize = np.dtype(hf_io.DTYPES[dtype]).itemsize
  num_shards = max(1, min(num_shards or jax.process_count(), len(leaves)))
  plan = shard_plan({k: int(np.prod(x.shape)) * itemsize for k, _, x in leaves}, num_shards)
  files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
  me, procs = jax.process_index(), jax.process_count()
  cast = _CASTS[dtype]
  mine, weight_map, total = collections.defaultdict(dict), {}, 0
  for key, p, x in leaves:
    if x.dtype != hf_io.DTYPES[dtype]:
      x = cast(x)  # on the devices: half the bytes to gather for bf16
    full = distributed.to_host(x)
    for name, a in hf_io.hf_arrays(p, full, config).items():
      weight_map[name] = files[plan[key]]
      total += a.size * itemsize
      if plan[key] % procs == me:
        mine[plan[key]][name] = np.ascontiguousarray(a)
  t1 = time.perf_counter()
  os.makedirs(path, exist_ok=True)
  for k, tensors in mine.items():
    hf_io.atomic_write(os.path.join(path, files[k]), lambda f, t=tensors: save_file(t, f, metadata={"format": "pt"}))
  if me == 0:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    hf_io.write_json(os.path.join(path, "model.safetensors.index.json"), index)
    hf_io.write_json(os.path.join(path, "config.json"), config.to_hf_dict(dtype=dtype))
  distributed.barrier(f"save_hf_sharded {os.path.abspath(path)}")
  return {"gather_s": t1 - t0, "write_s": time.perf_counter() - t1}
