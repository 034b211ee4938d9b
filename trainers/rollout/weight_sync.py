"""Weight sync: how the trainer's weights of a step reach the engines, one strategy per kind.

- `DiskSync` (servers over HTTP): every process writes its share of the sharded HF checkpoint
  (`save_hf_sharded`, the layout SGLang's `/update_weights_from_disk` and `transformers` load),
  then process 0 runs the client's update sequence on every live server;
- `MemorySync` (colocated): the parameters handed to the engine in this process while it is
  paused, no file written.

Rollouts replayed from records push nothing: they have no servers' side at all.
"""

from __future__ import annotations

import collections
import os
import pathlib
import secrets
import shutil
import tempfile
import time
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from trainers.models import DTYPES, hf_io, safetensors_stream as sts
from trainers.serving import protocol
from trainers.models.config import ModelConfig
from trainers.runtime import distributed, faults
from trainers.runtime.errors import NoServerUp, TrainingError, on_primary
from trainers.rollout.client import Load, disk_load
from trainers.rollout.samples import ServerError, ServerUnavailable


# One jitted cast per (dtype, HF transposition), shared by every push (a new jit per call would
# recompile each sync).
_HF_CASTS: dict = {}


def _hf_cast(dtype: str, transpose: bool):
  if (dtype, transpose) not in _HF_CASTS:
    dt = hf_io.DTYPES[dtype]
    _HF_CASTS[dtype, transpose] = jax.jit(lambda x: (jnp.swapaxes(x, -1, -2) if transpose else x).astype(dt))
  return _HF_CASTS[dtype, transpose]


def _sorted_leaves(state) -> list[tuple[str, tuple, object]]:
  return sorted(((".".join(map(str, p)), p, v.get_value()) for p, v in hf_io.param_leaves(state)), key=lambda t: t[0])


def hf_params(state: nnx.State, config: ModelConfig, dtype: str):
  """Collective: every parameter of `state`, in name order, cast to `dtype` and laid out as HF's on
  its devices (one jitted pass: Linear kernels transposed, the stacked axes kept), then gathered
  whole to the host: yields `(name, host array, [(hf_name, block)])`, each block a view of the host
  array. On one CPU process the host array is the cast's own buffer (no copy). One parameter is
  in flight at a time: the caller keeps what it needs of it."""
  for key, p, x in _sorted_leaves(state):
    full = distributed.to_host(_hf_cast(dtype, hf_io.hf_transposed(p, config))(x))
    yield key, full, hf_io.hf_pieces(p, full, config)


class _Spec(NamedTuple):  # what a header needs of a tensor that is not gathered yet
  shape: tuple
  dtype: np.dtype


def hf_layout(state: nnx.State, config: ModelConfig, dtype: str) -> dict[str, list[tuple[str, _Spec]]]:
  """`{parameter name: [(hf_name, spec)]}` in the order `hf_params` yields them, from shapes alone."""
  slots, host = hf_io.hf_slots(state, config), np.dtype(hf_io.DTYPES[dtype])
  by_path = collections.defaultdict(list)
  for name, slot in slots.items():
    by_path[slot.path].append((name, _Spec(slot.shape, host)))
  return {key: by_path[p] for key, p, _ in _sorted_leaves(state)}


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


def save_hf_sharded(
  state: nnx.State,
  config: ModelConfig,
  path: str | os.PathLike,
  *,
  dtype: str = "bfloat16",
  num_shards: int | None = None,
) -> dict[str, float]:
  """Writes `path` as a sharded HF checkpoint: `model-0000k-of-0000N.safetensors` (N =
  `num_shards`, default the number of processes; fewer if there are fewer parameters) +
  `model.safetensors.index.json` + `config.json`, the layout SGLang and `transformers` load.

  Collective: every process calls it with the same (sharded, possibly multi-process) `state`.
  Each parameter, cast to `dtype` and laid out as HF's on its devices (`hf_params`), is gathered
  in turn and written at once by the process that owns its file (file `k` belongs to process
  `k % process_count`, files balanced by `shard_plan`), straight from the gathered buffer: a
  file's header is known from the shapes before any tensor is, so no more than one parameter is
  held on the host. Process 0 writes the index and the config; every file is renamed into place
  whole. Returns the seconds spent gathering (with the cast) and writing (this process).
  """
  if dtype not in hf_io.DTYPES:
    raise ValueError(f"dtype must be one of {sorted(hf_io.DTYPES)}, got {dtype!r}")
  layout = hf_layout(state, config, dtype)
  itemsize = np.dtype(hf_io.DTYPES[dtype]).itemsize
  num_shards = max(1, min(num_shards or jax.process_count(), len(layout)))
  plan = shard_plan({k: sum(int(np.prod(sp.shape)) for _, sp in ts) * itemsize for k, ts in layout.items()}, num_shards)
  files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
  me, procs = jax.process_index(), jax.process_count()
  os.makedirs(path, exist_ok=True)
  mine = {k: [t for key in layout if plan[key] == k for t in layout[key]] for k in range(num_shards) if k % procs == me}
  handles, gather_s, write_s = {}, 0.0, 0.0
  try:
    for k, tensors in mine.items():
      fd, tmp = tempfile.mkstemp(dir=path, prefix=".tmp-")
      handles[k] = (os.fdopen(fd, "wb"), tmp)
      handles[k][0].write(sts.header(tensors, {"format": "pt"}))
    t = time.perf_counter()
    for key, _, pieces in hf_params(state, config, dtype):
      t1 = time.perf_counter()
      gather_s += t1 - t
      if plan[key] in handles:
        f = handles[plan[key]][0]
        for _, block in pieces:
          f.write(memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8)))
      t = time.perf_counter()
      write_s += t - t1
    for k, (f, tmp) in handles.items():
      f.close()
      os.chmod(tmp, 0o644)  # a server running as another user must read it
      os.replace(tmp, os.path.join(path, files[k]))
    handles = {}
  finally:
    for f, tmp in handles.values():
      f.close()
      os.unlink(tmp)
  if me == 0:
    weight_map = {name: files[plan[key]] for key, ts in layout.items() for name, _ in ts}
    total = sum(int(np.prod(sp.shape)) for ts in layout.values() for _, sp in ts) * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    hf_io.write_json(os.path.join(path, "model.safetensors.index.json"), index)
    hf_io.write_json(os.path.join(path, "config.json"), config.to_hf_dict(dtype=dtype))
  distributed.barrier(f"save_hf_sharded {os.path.abspath(path)}")
  return {"gather_s": gather_s, "write_s": write_s}


class WeightSync(Protocol):
  """How the weights of a step reach the engines."""

  def push(self, params, step: int, weight_dtype: str) -> tuple[dict, str | None]:
    """The weights of `step`, cast to `weight_dtype`, into every engine; returns the phase times
    (`sync/...`) and the HF directory they were loaded from (None: handed over in memory)."""

  def rollouts_done(self) -> None:
    """A step's rollouts are generated (nothing generates until the next push)."""

  def check_reach(self, log=print) -> None:
    """Before step 1 (process 0): raises `TrainingError` when an engine could not load what the
    pushes will give it."""

  def start(self, params, step: int, weight_dtype: str) -> None:
    """The engines serve the starting weights `params` of `step` without a push (collective)."""

  def served_load(self, path: str | None, version: str) -> Load:
    """How an engine that joins or comes back gets the served weights of `version` (`path`: the
    HF directory they were loaded from, None when none was written)."""


class DiskSync:
  """Servers over HTTP: the sharded HF checkpoint under `weights_root/step_{step}` (every
  process), then process 0's `client` updates every live server concurrently (`NoServerUp`
  when none is up).

  What the servers serve is pinned: `served` is the directory the last push loaded (what a server
  that comes back is given, `Servers.readmit`). Only once the servers took a new directory is every
  other `step_*` directory deleted — whatever its number: those a killed run left past the step it
  resumes from go too. A push no server took deletes nothing (the served directory and the new one
  stay), and the same push retried after a wait loads what it wrote without writing it again."""

  def __init__(self, client, model_config: ModelConfig, *, weights_root: str, pause_mode: str):
    self.client, self.model_config = client, model_config  # client: process 0's (None elsewhere)
    self.weights_root, self.pause_mode = weights_root, pause_mode
    self.served: str | None = None  # pinned: what the servers hold (None: nothing pushed by this process yet)
    self._written: str | None = None  # the directory this process wrote last

  @classmethod
  def build(cls, cfg, client, model_config: ModelConfig) -> "DiskSync":
    return cls(
      client,
      model_config,
      weights_root=os.path.join(os.path.abspath(cfg.run_dir), "weights"),
      pause_mode=cfg.rollout.sync.pause_mode,
    )

  def push(self, params, step: int, weight_dtype: str) -> tuple[dict, str]:
    path = os.path.join(self.weights_root, f"step_{step}")
    times = {}
    if path != self._written:
      times = save_hf_sharded(params, self.model_config, path, dtype=weight_dtype)
      self._written = path
      faults.reached("weights", step)

    def update():
      try:
        return self.client.update_weights_from_disk(path, str(step), pause_mode=self.pause_mode)
      except ServerUnavailable as e:
        raise NoServerUp(f"weight sync at step {step}: {e}", e) from None
      except ServerError as e:
        raise TrainingError(f"weight sync at step {step} failed: {e}") from None

    times.update(on_primary(update))
    self.served = path
    if distributed.is_primary():
      self._prune()
    faults.reached("pushed", step)
    return {f"sync/{k}": v for k, v in times.items()}, path

  def _prune(self) -> None:
    """Deletes every weight directory but the served one (process 0, once the servers took it)."""
    for name in os.listdir(self.weights_root):
      path = os.path.join(self.weights_root, name)
      if name.startswith("step_") and path != self.served:
        shutil.rmtree(path, ignore_errors=True)

  def rollouts_done(self) -> None:
    pass

  def start(self, params, step: int, weight_dtype: str) -> None:
    pass  # the servers loaded the starting directory themselves

  def served_load(self, path: str | None, version: str) -> Load:
    return disk_load(path, version)

  def check_reach(self, log=print) -> None:
    """Every server sees `weights_root` (a shared filesystem): a probe file with a nonce is
    written there and each server is asked to read it back (`protocol.READ_PROBE_ROUTE`, a route
    of `mis-jax serve`). A server that cannot read it, or reads other content (its path names
    another directory), stops the run here, before step 1, naming the server and the path. SGLang
    and sglang-jax have no such route (HTTP 404): for them this says so, and their first
    `/update_weights_from_disk` is the check."""
    blind, unchecked = self._probe(self.client.live_urls())
    if unchecked:
      log(
        f"{', '.join(unchecked)}: no {protocol.READ_PROBE_ROUTE} route (SGLang, sglang-jax): whether it sees "
        f"{self.weights_root} shows at its first weight load"
      )
    if blind:
      raise TrainingError(f"{'; '.join(f'{url} ({why})' for url, why in blind.items())} {self._blind_advice()}")

  def sees_weights(self, url: str) -> str | None:
    """The check of `check_reach` for one server joining the fleet during the run (process 0): why
    it cannot read the weight directory, or None (it can, or it has no probe route: then its first
    weight load is the check)."""
    blind, _ = self._probe([url])
    return f"{blind[url]}: it {self._blind_advice()}" if blind else None

  def _blind_advice(self) -> str:
    return (
      f"cannot read the trainer's weight directory {self.weights_root}: the weights reach every server "
      f"through /update_weights_from_disk, so each must see that directory at the same path. Put run_dir on "
      f"a filesystem the servers mount at the same path (docs/guides/fleet.md)"
    )

  def _probe(self, urls) -> tuple[dict[str, str], list[str]]:
    """`({url: what it read instead}, [urls without the probe route])`: a probe file with a nonce
    written under `weights_root`, read back by each server, removed (with `weights_root`, when the
    probe made it)."""
    created = not os.path.isdir(self.weights_root)  # removed again after: the check leaves no trace
    os.makedirs(self.weights_root, exist_ok=True)
    nonce = secrets.token_hex(8)
    path = os.path.join(self.weights_root, f"{protocol.PROBE_PREFIX}{nonce}")
    hf_io.atomic_write(path, lambda f: pathlib.Path(f).write_text(nonce))
    try:
      blind, unchecked = {}, []
      for url in urls:
        seen = _read_probe(self.client.engines[url], path)
        if seen is None:
          unchecked.append(url)
        elif seen != nonce:
          blind[url] = seen
    finally:
      os.remove(path)
      if created:
        try:
          os.rmdir(self.weights_root)
        except OSError:
          pass  # something else wrote there meanwhile
    return blind, unchecked


def _read_probe(engine, path: str) -> str | None:
  """What `engine` reads at `path`: the content, a reason it could not, or None (no such route, or
  the engine is down)."""
  try:
    reply = engine.transport.request("POST", engine.url, protocol.READ_PROBE_ROUTE, {"path": path})
  except ServerUnavailable:
    return None  # down now: the pushes' own logic handles it
  except ServerError as e:
    if e.status in (404, 405):
      return None
    raise TrainingError(f"{engine.url}{protocol.READ_PROBE_ROUTE}: {e}") from None
  if not isinstance(reply, dict) or not reply.get("readable"):
    why = reply.get("error") if isinstance(reply, dict) else repr(reply)
    return f"not readable there: {why}"
  return reply.get("content")


class MemorySync:
  """Colocated: the trainer's weights of `step` into the in-process `engine`
  (`colocated.LocalEngine`), in memory: cast on the trainer's devices to `weight_dtype` (what the
  disk path writes), then taken by the engine (served dtype, quantisation, its devices) while it
  is paused with `rollout.sync.pause_mode`. `client`: the one generating from it (its cache salt moves
  to the new weights first).

  `release_between_steps`: the engine frees its weights once a step's rollouts are generated —
  only where it can, every step pushes new ones and nothing generates during the step."""

  def __init__(self, client, engine, rollout):
    self.client, self.engine, self.pause_mode = client, engine, rollout.sync.pause_mode
    self.release_between_steps = (
      engine.releases_weights and rollout.sync.sync_every == 1 and rollout.sync.max_staleness == 0
    )

  def push(self, params, step: int, weight_dtype: str) -> tuple[dict, None]:
    t0 = time.perf_counter()
    dtype = DTYPES[weight_dtype]
    state = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    t1 = time.perf_counter()
    self.client.begin_weights(str(step))
    self.engine.pause(self.pause_mode)
    t2 = time.perf_counter()
    try:
      ok, message = self.engine.update_weights(state, str(step))
    finally:
      self.engine.resume()
    if not ok:
      raise ServerError(f"weight handover at step {step} failed: {message}")
    t3 = time.perf_counter()
    return {"sync/handover_s": t3 - t2, "sync/servers_paused_s": t3 - t1, "sync/total_s": t3 - t0}, None

  def rollouts_done(self) -> None:
    if self.release_between_steps:
      self.engine.release_weights()

  def start(self, params, step: int, weight_dtype: str) -> None:
    pass

  def served_load(self, path: str | None, version: str) -> Load:
    def load(engine):  # never needed: the one engine is in this process and never goes away
      raise ServerError(f"{engine.url}: the colocated engine gets its weights in memory only")

    return load

  def check_reach(self, log=print) -> None:
    pass  # the engine is in this process
