"""sglang-jax's own HTTP server with the SGLang 0.5.23 routes and fields it lacks, in process.

Runs inside the sglang-jax venv (Python >= 3.12), started by `mis-jax serve --engine sglang-jax`
(`trainers.serving.sglang_jax.launcher`) as `python -P this_file.py [--weight-version V] <sglang-jax flags>`.
It imports nothing but the standard library and what sglang-jax itself installs (a test checks).

sglang-jax 0.1.0rc0 serves `/generate` with log-probs and routed experts but cannot take new
weights over HTTP. In its single-process mode the scheduler runs in this process, so this
module adds, over sglang-jax's own model loader and model runner (its scheduler, kernels,
sampler and generation are untouched):

- `POST /update_weights_from_disk`: SGLang's request (`model_path`, `weight_version`,
  `abort_all_requests`, `flush_cache`, ...) and reply (`success`, `message`,
  `num_paused_requests`; HTTP 400 on failure). The checkpoint is loaded by sglang-jax's loader
  into a new model on the runner's mesh, checked leaf by leaf against the served one (missing
  tensors, shapes, dtypes), then its leaves replace `model_runner.model_state_leaves` in the
  scheduler thread between two batches, and the prefix cache is flushed (its KV came from the
  old weights). A bad directory leaves the old weights serving.
  As in SGLang, an update while generation is not paused waits for the requests in flight and
  holds new ones back; while paused it proceeds at once.
- `meta_info.weight_version` on every `/generate` result, and `weight_versions` spans
  (`{"version", "start", "end"}` over the completion tokens) for a request that an update
  (with `pause_generation` `retract` or `in_place`) split between two versions.
- `GET /model_info` (SGLang's keys, `weight_version` among them) and `GET /get_weight_version`.
- mis-jax's streamed weights (`rollout.sync.via: http`, contract §11; the routes and format of
  `trainers.serving.protocol.WEIGHTS_*`, repeated here since this file cannot import the package):
  each bucket (a safetensors stream) is kept by name as it came; the commit loads them as an
  in-memory update (`WeightUpdates.update` with tensors) — between two batches, all or nothing. A
  delta is refused (HTTP 409: nothing here keeps the pushed tensors a delta would apply to), so
  the trainer sends this engine the weights whole.
- `extra_key` (SGLang's prefix-cache namespace, the trainer's cache salt) honoured in a batch
  request as in a single one (sglang-jax 0.1.0rc0 drops it when it splits a batch), a list's
  length checked.
- **No request reads KV computed under other weights.** Every request's prefix-cache key carries
  the launcher's weight epoch, which each update advances: a request paused in place keeps the
  KV it holds (its `weight_versions` spans record the switch), but nothing admitted after the
  update can match a prefix computed before it, salt or not (`--prefix-cache-versions shared`
  restores sglang-jax's own behaviour, for comparisons only).
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import os
import queue
import sys
import threading
import time

logger = logging.getLogger("mis_jax.sglang_jax.routes")

# config.json keys whose change would make a checkpoint another model than the one served.
_SAME_MODEL_KEYS = (
  "model_type",
  "hidden_size",
  "num_hidden_layers",
  "num_attention_heads",
  "num_key_value_heads",
  "head_dim",
  "intermediate_size",
  "vocab_size",
  "tie_word_embeddings",
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
)


RETRACT_REFUSED = (
  "pause_generation mode 'retract' is refused here: sglang-jax 0.1.0rc0 drops the requests of a prefill batch "
  "that has run but is not yet merged into its running batch (Scheduler.pause_generation resets last_batch), so "
  "those requests never finish. Use mode 'in_place' (requests keep running across a weight update, their "
  "weight_versions spans record the switch) or 'abort' (rollout.sync.pause_mode in the trainer)"
)


# Appended to every request's prefix-cache key (SGLang's `extra_key`): the weights' epoch.
_EPOCH = "\x1fmis-jax-weights:{}\x1f"

# trainers.serving.protocol's streamed-weights routes and format (a test checks they agree).
WEIGHTS_STAGE_ROUTE = "/mis_jax/weights/stage"
WEIGHTS_COMMIT_ROUTE = "/mis_jax/weights/commit"
WEIGHTS_DISCARD_ROUTE = "/mis_jax/weights/discard"
WEIGHTS_FORMAT = "mis_jax.weights.v1"
DELTA_SUFFIXES = (":delta_index", ":delta_values")


def _read_bucket(raw: bytes) -> tuple[dict, dict]:
  """`(metadata, {name: array})` of a safetensors stream, each array a view of `raw`."""
  import ml_dtypes
  import numpy as np

  dtypes = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "U32": np.uint32,
    "I32": np.int32,
    "I64": np.int64,
  }
  if len(raw) < 8:
    raise ValueError(f"{len(raw)} bytes: not a safetensors stream")
  n = int.from_bytes(raw[:8], "little")
  if n > len(raw) - 8:
    raise ValueError(f"a header of {n} bytes in a body of {len(raw)}")
  try:
    header = json.loads(raw[8 : 8 + n])
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"safetensors header is not JSON: {e}") from None
  meta = header.pop("__metadata__", None) or {}
  data, tensors, end = memoryview(raw)[8 + n :], {}, 0
  for name, e in header.items():
    try:
      dtype = dtypes[e["dtype"]]
      begin, stop = e["data_offsets"]
      tensors[name] = np.frombuffer(data[begin:stop], dtype).reshape(e["shape"])
    except (KeyError, TypeError, ValueError) as err:
      raise ValueError(f"tensor {name!r}: {type(err).__name__}: {err}") from None
    end = max(end, stop)
  if end != len(data):
    raise ValueError(f"{len(data)} data bytes, the header accounts for {end}")
  return meta, tensors


def _check_extra_key(obj) -> None:
  """SGLang's `extra_key` on a `/generate` body: a string, or one string per prompt (ValueError:
  HTTP 400 naming the field)."""
  key = obj.extra_key
  if key is None or isinstance(key, str):
    return
  if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
    raise ValueError(f"extra_key: a string or a list of strings, got {type(key).__name__}")
  ids, text = obj.input_ids, obj.text
  batch = (
    len(ids)
    if isinstance(ids, list) and ids and isinstance(ids[0], list)
    else len(text)
    if isinstance(text, list)
    else 1
  )
  if len(key) != batch:
    raise ValueError(f"extra_key has {len(key)} entries for a batch of {batch} prompts")


def _carry_extra_key() -> None:
  """sglang-jax 0.1.0rc0's `GenerateReqInput.__getitem__` (how a batch becomes requests) drops
  `extra_key`: each request gets its own (a list indexed by prompt, a string shared)."""
  from sgl_jax.srt.managers.io_struct import GenerateReqInput

  split = GenerateReqInput.__getitem__
  if getattr(split, "carries_extra_key", False):
    return

  def getitem(self, i):
    item, key = split(self, i), self.extra_key
    item.extra_key = key[i % len(key)] if isinstance(key, list) else key  # n > 1: prompts repeat n times
    return item

  getitem.carries_extra_key = True
  GenerateReqInput.__getitem__ = getitem


def _trim_logprobs(item: dict, meta: dict) -> None:
  """sglang-jax 0.1.0rc0 sends a non-streaming request's output every 50 tokens, but for a
  request with `return_logprob` alone it never advances the log-prob offset of those sends
  (`scheduler_output_processor_mixin`, `return_output_logprob_only`), so a completion of
  n > 50 tokens comes back with its log-probs repeated (50 + 100 + ... + n entries), the last
  send being the whole list. Where the last n entries are exactly the output tokens, they are
  that list: keep them (SGLang's contract: one entry per output token). Anything else is left
  as it came (the trainer's client rejects it)."""
  ids, lps = item.get("output_ids"), meta.get("output_token_logprobs")
  if not isinstance(ids, list) or not isinstance(lps, list) or len(lps) <= len(ids) or not ids:
    return
  tail = lps[-len(ids) :]
  if all(isinstance(e, (list, tuple)) and len(e) > 1 and e[1] == t for e, t in zip(tail, ids)):
    meta["output_token_logprobs"] = tail


def _assign(loader, mappings: dict, tensors: dict) -> None:
  """sglang-jax's `WeightLoader.load_weights_from_safetensors(mappings)` over in-memory `tensors`
  (`{HF name: array}`) instead of files: each regular weight through the loader's own per-weight
  transform (`_process_and_assign_weight`: transpose, reshape, KV-head padding, sharding, dtype),
  each `__MOE_EXPERTS__` group stacked `[E, ...]` (each expert transposed when the map says, as
  its loader does). Every weight the map names must be given, and every tensor given must have
  a place (ValueError naming them)."""
  import jax.numpy as jnp
  from flax import nnx
  from sgl_jax.srt.utils.weight_utils import WeightMapping

  params = nnx.state(loader.model)
  used, missing = set(), []
  for key, spec in mappings.items():
    mapping = spec if isinstance(spec, WeightMapping) else WeightMapping(target_path=spec)
    if "*" in key or mapping.concat_axis is not None:
      raise ValueError(f"weight map entry {key!r} (a pattern, or a tensor split over files) is not supported in memory")
    if key.startswith("__MOE_EXPERTS__"):
      names = list(mapping.target_path[1:])
      absent = [n for n in names if n not in tensors]
      if absent:
        missing += absent
        continue
      w = jnp.stack([jnp.swapaxes(tensors[n], -1, -2) if mapping.transpose else jnp.asarray(tensors[n]) for n in names])
      if mapping.physical_to_logical_map is not None:
        w = w[jnp.asarray(mapping.physical_to_logical_map)]
      if mapping.reshape is not None:
        w = jnp.reshape(w, mapping.reshape)
      if mapping.repeat is not None:
        w = jnp.repeat(w, mapping.repeat[1], axis=mapping.repeat[0])
      param = loader._get_param(params, mapping.target_path[0])  # noqa: SLF001 - its loader's own lookup
      param.value = loader._shard_weight(
        w,
        mapping.sharding,
        _expert_mesh(loader)  # noqa: SLF001
        if "expert" in mapping.sharding
        else None,
      ).astype(param.value.dtype)
      used.update(names)
    elif key in tensors:
      loader._process_and_assign_weight(params, key, jnp.asarray(tensors[key]), mapping)  # noqa: SLF001
      used.add(key)
    elif not (key == "d2t" or loader._is_excluded_layer_weight(key)):  # noqa: SLF001 - as its loader skips them
      missing.append(key)
  if missing:
    raise ValueError(f"{len(missing)} weights of the served model not given: {', '.join(sorted(missing)[:5])}")
  extra = sorted(set(tensors) - used)
  if extra:
    raise ValueError(f"{len(extra)} tensors have no place in the served model: {', '.join(extra[:5])}")


def _placeholder(leaf) -> bool:
  """A served state leaf that holds no weights (sglang-jax keeps some as shapes or empty arrays)."""
  import jax

  return isinstance(leaf, jax.ShapeDtypeStruct) or leaf.shape == (0,)


def _expert_mesh(loader):
  """The (expert, tensor) mesh sglang-jax's loader places stacked experts on: the served mesh's
  devices, `ep_size` experts groups."""
  import jax

  mesh = loader.mesh
  ep = getattr(loader.model_config.hf_config, "ep_size", 1)
  tp = mesh.shape.get("data", 1) * mesh.shape.get("tensor", 1) // ep
  return jax.sharding.Mesh(
    mesh.devices.flatten().reshape(ep, tp), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )


class _Gate:
  """SGLang's model-update lock: generate requests are readers, an update is the writer (it waits
  for the readers in flight and holds new ones back). Lives on the server's event loop."""

  def __init__(self):
    self._cond = asyncio.Condition()
    self._readers = 0
    self._writer = False

  @contextlib.asynccontextmanager
  async def reader(self):
    async with self._cond:
      await self._cond.wait_for(lambda: not self._writer)
      self._readers += 1
    try:
      yield
    finally:
      async with self._cond:
        self._readers -= 1
        self._cond.notify_all()

  @contextlib.asynccontextmanager
  async def writer(self):
    async with self._cond:
      await self._cond.wait_for(lambda: not self._writer)
      self._writer = True
      await self._cond.wait_for(lambda: self._readers == 0)
    try:
      yield
    finally:
      async with self._cond:
        self._writer = False
        self._cond.notify_all()


class WeightUpdates:
  """The added routes and their state: the served weight version, the span bookkeeping, and the
  hook that runs weight swaps in the scheduler thread between two batches."""

  def __init__(self, weight_version: str, *, isolate_versions: bool = True):
    self.weight_version = weight_version
    # Each update starts a new prefix-cache namespace (`_EPOCH` in every request's key).
    self.isolate_versions, self.epoch = isolate_versions, 0
    self.tokenizer_manager = None
    self.scheduler = None
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # swaps for the scheduler thread
    # rid -> [(version before a swap, completion tokens generated before it)], for the spans.
    self._splits: dict[str, list[tuple[str, int]]] = {}
    self._gate = None
    self._transfer = None  # (served leaves it fills, compiled program), for in-memory updates
    self._loading = threading.Lock()  # one load at a time: the in-memory trace patches its loader class
    self._staging: dict | None = None  # a streamed push's buckets, until its commit

  # ---- wiring -------------------------------------------------------------------------------
  def attach(self, tokenizer_manager, scheduler) -> None:
    """Hooks into the engine once it is built: the generate path (versions, the update gate)
    and the scheduler loop's request step (swaps run there, between two batches)."""
    self.tokenizer_manager, self.scheduler = tokenizer_manager, scheduler
    # Its watchdog (a batch stuck past --watchdog-timeout) sends SIGQUIT to the scheduler's parent
    # process: in single-process mode that is whoever launched the engine (a trainer, a test).
    # The engine's own process handles SIGQUIT by stopping itself: aim there.
    scheduler.parent_process = type(scheduler.parent_process)(os.getpid())
    self._wrap_generate(tokenizer_manager)
    self._wrap_scheduler(scheduler)

  def _wrap_generate(self, tokenizer_manager) -> None:
    """The generate path: the cache salt checked, each request under the update gate, each reply
    stamped with its weight version."""
    generate = tokenizer_manager.generate_request
    _carry_extra_key()

    async def generate_request(obj, request=None):
      _check_extra_key(obj)
      if self._gate is None:
        self._gate = _Gate()
      async with self._gate.reader():
        async for out in generate(obj, request):
          for item in out if isinstance(out, list) else [out]:
            self._stamp(item)
          yield out

    tokenizer_manager.generate_request = generate_request

  def _wrap_scheduler(self, scheduler) -> None:
    """The scheduler loop's request step: new requests in the namespace of their weights, then the
    queued jobs (swaps) between two batches."""
    process = scheduler.process_input_requests

    from sgl_jax.srt.managers.io_struct import TokenizedGenerateReqInput

    def process_input_requests(recv_reqs):
      if self.isolate_versions:  # every new request in the namespace of the weights it starts under
        for recv in recv_reqs:
          if isinstance(recv, TokenizedGenerateReqInput):
            recv.extra_key = (recv.extra_key or "") + _EPOCH.format(self.epoch)
      out = process(recv_reqs)  # first: what was received is queued, a pause message applied
      later = []
      while True:
        try:
          job = self._jobs.get_nowait()
        except queue.Empty:
          break
        if not job():
          later.append(job)
      for job in later:
        self._jobs.put(job)
      return out

    scheduler.process_input_requests = process_input_requests  # read by the loop every iteration

  @property
  def model_runner(self):
    worker = self.scheduler.tp_worker
    return getattr(worker, "worker", worker).model_runner

  def _stamp(self, item) -> None:
    """`weight_version` (the version of the last token) and, for a request split by an update,
    `weight_versions` spans, in one result's `meta_info`."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
      return
    finished = meta.get("finish_reason") is not None
    splits = (self._splits.pop if finished else self._splits.get)(meta.get("id"), None) or []
    n = meta.get("completion_tokens")
    n = len(item.get("output_ids") or ()) if n is None else n
    _trim_logprobs(item, meta)
    spans, start = [], 0
    for version, boundary in [*splits, (self.weight_version, n)]:
      end = min(boundary, n)
      if spans and spans[-1]["version"] == version:
        spans[-1]["end"] = max(spans[-1]["end"], end)
      elif end > start or (not spans and end == n):
        spans.append({"version": version, "start": start, "end": end})
      start = max(start, end)
    meta["weight_version"] = spans[-1]["version"]
    if len(spans) > 1:
      meta["weight_versions"] = spans

  # ---- the update -----------------------------------------------------------------------------
  def _check_config(self, path: str) -> None:
    """The checkpoint at `path` is the served architecture (a ValueError naming the key otherwise)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
      raise ValueError(f"{path!r} has no config.json")
    with open(config_file) as f:
      new = json.load(f)
    served = self.model_runner.model_config.hf_config.to_dict()
    # sglang-jax reads num_experts; transformers 5 writes num_local_experts.
    for d in (new, served):
      if "num_local_experts" in d and "num_experts" not in d:
        d["num_experts"] = d["num_local_experts"]
    diff = [f"{k} {new.get(k)!r} (served: {served.get(k)!r})" for k in _SAME_MODEL_KEYS if new.get(k) != served.get(k)]
    if new.get("architectures") != served.get("architectures"):
      diff.insert(0, f"architectures {new.get('architectures')!r} (served: {served.get('architectures')!r})")
    if diff:
      raise ValueError(f"config.json differs from the served model in {'; '.join(diff)}")

  def _load(self, path: str) -> list:
    """The state leaves of the checkpoint at `path`, loaded by sglang-jax's own loader, checked
    against the served ones (see `_checked`) and put in the served layout (no recompilation)."""
    import jax

    self._check_config(path)
    runner = self.model_runner
    model_config = copy.copy(runner.model_config)  # the loader writes model_path into it
    model_config.model_path = path
    with self._loading:
      leaves = self._checked(runner.model_loader.load_model(model_config=model_config), repr(path))
    out = [
      old if new is None else new if new.sharding == old.sharding else jax.device_put(new, old.sharding)
      for new, old in zip(leaves, runner.model_state_leaves)
    ]
    return jax.block_until_ready(out)

  def _load_tensors(self, tensors: dict) -> list:
    """The state leaves of `tensors` (`{HF name: array}`, any float dtype, any devices of this
    process), placed by sglang-jax's own weight map and per-weight transforms (transposes, KV-head
    padding, its mesh's sharding; MoE experts stacked as its loader stacks them) into a model of
    the served architecture — no file read — and checked against the served leaves (`_checked`).

    All of it is one compiled program (traced once per set of names, shapes and dtypes), whose
    outputs are new buffers in the served layout: never the given arrays (a trainer donates its
    buffers to its next step)."""
    import jax

    runner = self.model_runner
    if getattr(runner.model_config, "quantization_config", None) is not None:
      raise ValueError(
        "the served model is quantised: weights are taken in memory only for an unquantised model "
        "(use /update_weights_from_disk)"
      )
    served = runner.model_state_leaves
    if self._transfer is None:
      placed = [i for i, old in enumerate(served) if not _placeholder(old)]
      self._transfer = (placed, jax.jit(self._transferred(placed), out_shardings=[served[i].sharding for i in placed]))
    placed, transfer = self._transfer
    mesh = runner.model_loader.mesh
    devices = set(mesh.devices.flat)
    if any(not isinstance(t, jax.Array) or t.sharding.device_set != devices for t in tensors.values()):
      # Host arrays, or arrays on other devices (a trainer's mesh): replicated onto the engine's first.
      tensors = jax.device_put(tensors, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    out = list(served)
    with self._loading:
      new = transfer(tensors)
    for i, leaf in zip(placed, new):
      out[i] = leaf
    return jax.block_until_ready(out)

  def _transferred(self, placed: list[int]):
    """`tensors -> [leaf i for i in placed]` (see `_load_tensors`), to be traced."""
    from flax import nnx
    import jax.numpy as jnp
    from sgl_jax.srt.utils import weight_utils

    runner = self.model_runner
    graphdef, state = nnx.split(self._abstract_model())

    def transfer(tensors: dict) -> list:
      model = nnx.merge(graphdef, state, copy=True)  # Variables of this trace
      loader_class = weight_utils.WeightLoader
      read_files = loader_class.load_weights_from_safetensors
      # The model's own `load_weights` builds its weight map and hands it to this method: the
      # one place its loader reads files, here the tensors given.
      loader_class.load_weights_from_safetensors = lambda loader, mappings, *_, **__: _assign(loader, mappings, tensors)
      try:
        model.load_weights(runner.model_config)
      finally:
        loader_class.load_weights_from_safetensors = read_files
      leaves = self._checked(model, "the given tensors")
      return [jnp.copy(leaves[i]) for i in placed]

    return transfer

  def _abstract_model(self):
    """The served architecture with no weights, as sglang-jax's loader builds it (`_get_model`)."""
    import jax
    from flax import nnx
    from sgl_jax.srt.model_loader.arch import get_model_architecture

    runner = self.model_runner
    model_class, _ = get_model_architecture(runner.model_config)
    kwargs = {"dtype": runner.model_config.dtype, "mesh": runner.model_loader.mesh}
    with jax.set_mesh(runner.model_loader.mesh):
      return nnx.eval_shape(lambda: model_class(runner.model_config.hf_config, **kwargs))

  def _checked(self, model, source: str) -> list:
    """`model`'s state leaves in the served model's tree order (None where the served model has a
    placeholder too), checked against the served leaves: the tree, every tensor present, shapes
    and dtypes (a ValueError naming the first that differs)."""
    import jax
    from flax import nnx

    runner = self.model_runner
    state = nnx.split(model)[1]
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if treedef != runner._model_state_def:  # noqa: SLF001 - the runner's own record of its tree
      raise ValueError("the loaded model's parameter tree differs from the served model's")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    out = []
    for name, new, old in zip(paths, leaves, runner.model_state_leaves):
      if isinstance(new, jax.ShapeDtypeStruct):
        if _placeholder(old):  # a placeholder in the served model too
          out.append(None)
          continue
        raise ValueError(f"missing tensor for {name} (shape {tuple(new.shape)}) in {source}")
      if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"{name}: loaded {new.dtype}{list(new.shape)}, served {old.dtype}{list(old.shape)}")
      out.append(new)
    return out

  def _swap(self, leaves: list, version: str | None, flush: bool) -> str:
    """In the scheduler thread, between two batches: the new leaves in place, the version
    recorded for the requests in flight (their spans), the prefix cache flushed."""
    scheduler, runner = self.scheduler, self.model_runner
    live = {}
    for batch in (scheduler.running_batch, scheduler.cur_batch):
      for info in getattr(batch, "reqs_info", None) or ():
        for req in info.reqs or ():
          live[req.rid] = len(req.output_ids)
    for req in scheduler.waiting_queue:
      live[req.rid] = len(req.output_ids)
    for rid in list(self.tokenizer_manager.rid_to_state):  # a finished result not yet sent: all old
      self._splits.setdefault(rid, []).append((self.weight_version, live.get(rid, 1 << 62)))
    runner.model_state_leaves = leaves
    if version is not None:
      self.weight_version = version
    if self.isolate_versions:
      self._next_epoch()
    if not flush:
      return ""
    running = sum(len(info.reqs or ()) for info in getattr(scheduler.running_batch, "reqs_info", None) or ())
    if running:  # paused in place: they keep their KV (out of every later request's reach); the rest goes
      cache = scheduler.tree_cache
      if cache is not None and not getattr(cache, "disable", False):
        from sgl_jax.srt.mem_cache.base_prefix_cache import EvictParams

        cache.evict(EvictParams(num_tokens=1 << 62, dp_rank=0))
      return f" {running} requests paused in place keep their cache; the rest of the prefix cache was evicted."
    # Requests retracted by pause_generation hold no KV (they are prefilled again): set them
    # aside so that sglang-jax's own flush clears the tree, the pools and the batch state.
    waiting, scheduler.waiting_queue = scheduler.waiting_queue, []
    try:
      ok, message, _ = scheduler.flush_cache()
    finally:
      scheduler.waiting_queue = waiting + scheduler.waiting_queue
    return "" if ok else f" The cache was not flushed: {message}"

  def _next_epoch(self) -> None:
    """A new prefix-cache namespace for the new weights (in the scheduler thread, at a swap). The
    requests queued but not yet started move to it (they will be prefilled with the new weights);
    those that hold KV (running, paused in place, mid chunked prefill) stay in the old one, so
    what they computed and what they cache when they finish is matched by none of the new."""
    old, self.epoch = _EPOCH.format(self.epoch), self.epoch + 1
    new = _EPOCH.format(self.epoch)
    scheduler = self.scheduler
    holding = {id(r) for r in getattr(scheduler, "chunked_reqs", None) or () if r is not None}
    for queue_name in ("waiting_queue", "grammar_queue", "pending_dp_reqs"):
      for req in getattr(scheduler, queue_name, None) or ():
        key = getattr(req, "extra_key", None)
        if id(req) not in holding and isinstance(key, str) and old in key:
          req.extra_key = key.replace(old, new)

  async def update(self, body: dict, tensors: dict | None = None) -> tuple[bool, str, int]:
    """SGLang's `/update_weights_from_disk` (`body`); with `tensors` (`{HF name: array}`), the same
    update from memory (colocated rollouts: `InProcessEngine.update_weights`), `model_path` unused."""
    path = body.get("model_path")
    version = body.get("weight_version")
    tm = self.tokenizer_manager
    if body.get("abort_all_requests"):
      tm.abort_request(abort_all=True)
    loop = asyncio.get_running_loop()
    if self._gate is None:
      self._gate = _Gate()
    source = f"{path!r}" if tensors is None else "memory"
    async with contextlib.AsyncExitStack() as stack:
      if not tm.is_pause:  # SGLang: an update waits for the requests in flight unless paused
        await stack.enter_async_context(self._gate.writer())
      t0 = time.perf_counter()
      try:
        if tensors is None:
          leaves = await loop.run_in_executor(None, self._load, path)
        else:
          leaves = await loop.run_in_executor(None, self._load_tensors, tensors)
      except Exception as e:  # noqa: BLE001 - any failure leaves the old weights serving
        logger.warning("weight update from %s failed: %s", source, e)
        return False, f"Failed to load weights from {source}: {type(e).__name__}: {e}", 0
      done: concurrent.futures.Future = concurrent.futures.Future()

      def job() -> bool:
        """False: not yet (a retract / in_place pause not yet applied by the scheduler)."""
        if tm.is_pause and tm.rid_to_state and not self.scheduler._engine_paused:  # noqa: SLF001
          return False
        try:
          done.set_result(self._swap(leaves, version, bool(body.get("flush_cache", True))))
        except BaseException as e:  # noqa: BLE001 - reported to the request
          done.set_exception(e)
        return True

      self._jobs.put(job)
      note = await asyncio.wrap_future(done)
    if tensors is None:
      tm.model_path = os.path.abspath(path)  # /model_info and /get_model_info, as SGLang
    message = "Succeeded to update model weights."
    if version is not None:
      message += f" Weight version updated to {version}."
    logger.info("weights from %s in %.2f s, version %s", source, time.perf_counter() - t0, self.weight_version)
    return True, message + note, 0

  # ---- weights streamed over HTTP -----------------------------------------------------------------
  def stage(self, query: dict, raw: bytes) -> tuple[int, dict]:
    """`WEIGHTS_STAGE_ROUTE`: one bucket kept for the commit of its push (a new push drops an older
    one's). `(HTTP status, reply)`."""
    push, bucket = query.get("push"), query.get("bucket", "")
    if not push or not bucket.isdigit():
      return 400, _error_body(f"query needs push (a name) and bucket (an index), got {push!r}, {bucket!r}")
    if query.get("base") is not None:
      return 409, _error_body(
        f"a delta relative to push {query['base']!r} cannot be applied: the sglang-jax launcher "
        f"keeps no copy of the pushed tensors; send the weights whole"
      )
    staging = self._staging
    if staging is None or staging["push"] != push:
      staging = self._staging = {"push": push, "version": query.get("weight_version"), "tensors": {}, "buckets": set()}
    try:
      meta, tensors = _read_bucket(raw)
      if meta.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"metadata format {meta.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
      if any(name.endswith(DELTA_SUFFIXES) for name in tensors):
        raise ValueError("delta entries in a push without a base")
    except ValueError as e:
      self._staging = None
      return 400, _error_body(f"bucket {bucket} of push {push!r}: {e}")
    staging["tensors"].update(tensors)
    staging["buckets"].add(int(bucket))
    return 200, {"success": True, "push": push, "bucket": int(bucket), "tensors": len(tensors)}

  async def commit(self, body: dict) -> tuple[bool, str]:
    """`WEIGHTS_COMMIT_ROUTE`: the staged push in place of the served weights (`update` from memory)."""
    staging, self._staging = self._staging, None
    push, version, count = body.get("push"), body.get("weight_version"), body.get("num_buckets")
    if staging is None or staging["push"] != push:
      return False, f"no weights staged for push {push!r}"
    if staging["buckets"] != set(range(count if isinstance(count, int) else -1)) or staging["version"] != version:
      return False, (
        f"push {push!r} cannot be committed as weight_version {version!r} of {count} buckets: staged "
        f"{staging['version']!r}, buckets {sorted(staging['buckets'])[:8]}"
      )
    ok, message, _ = await self.update(
      {
        "weight_version": version,
        "flush_cache": body.get("flush_cache", True),
        "abort_all_requests": body.get("abort_all_requests", False),
      },
      tensors=staging["tensors"],
    )
    return ok, message

  def model_info(self) -> dict:
    """SGLang's `/model_info` reply (`weight_version` among its keys)."""
    tm = self.tokenizer_manager
    args = tm.server_args
    hf = self.model_runner.model_config.hf_config
    return {
      "model_path": tm.model_path,
      "tokenizer_path": args.tokenizer_path,
      "served_model_name": getattr(args, "served_model_name", None) or tm.model_path,
      "is_generation": tm.is_generation,
      "preferred_sampling_params": args.preferred_sampling_params,
      "weight_version": self.weight_version,
      "load_format": args.load_format,
      "has_image_understanding": False,
      "has_audio_understanding": False,
      "model_type": getattr(hf, "model_type", None),
      "architectures": getattr(hf, "architectures", None),
    }

  async def pause(self, mode: str) -> None:
    """`/pause_generation` as sglang-jax's own, minus the mode that loses requests (ValueError)."""
    if mode == "retract":
      raise ValueError(RETRACT_REFUSED)
    from sgl_jax.srt.managers.io_struct import PauseGenerationReqInput

    await self.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=mode))

  # ---- routes -------------------------------------------------------------------------------------
  def add_routes(self, app) -> None:
    self._add_sglang_routes(app)
    self._add_weight_stream_routes(app)

  def _add_sglang_routes(self, app) -> None:
    """The SGLang routes sglang-jax lacks or answers otherwise."""
    from fastapi import Request
    from fastapi.responses import ORJSONResponse

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
      body = await _json_object(request)
      if isinstance(body, str):
        return _bad_request(body)
      if not isinstance(body.get("model_path"), str):
        return _bad_request("model_path: Field required (a string)")
      if body.get("weight_version") is not None and not isinstance(body["weight_version"], str):
        return _bad_request("weight_version: Input should be a valid string")
      success, message, paused = await self.update(body)
      return ORJSONResponse(
        {"success": success, "message": message, "num_paused_requests": paused}, status_code=200 if success else 400
      )

    async def pause_generation(request: Request):
      body = await _json_object(request)
      try:
        await self.pause(body.get("mode", "abort") if isinstance(body, dict) else "abort")
      except ValueError as e:
        return _bad_request(str(e))
      return ORJSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    # Ahead of sglang-jax's own /pause_generation: the same call, minus the mode that loses requests.
    app.router.add_api_route("/pause_generation", pause_generation, methods=["POST"])
    app.router.routes.insert(0, app.router.routes.pop())

    @app.get("/model_info")
    async def model_info():
      return self.model_info()

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def get_weight_version():
      return {"weight_version": self.weight_version}

  def _add_weight_stream_routes(self, app) -> None:
    """mis-jax's streamed-weights routes (contract §11): stage, commit, discard."""
    from fastapi import Request
    from fastapi.responses import ORJSONResponse

    @app.post(WEIGHTS_STAGE_ROUTE)
    async def stage_weights(request: Request):
      status, reply = self.stage(dict(request.query_params), await request.body())
      return ORJSONResponse(reply, status_code=status)

    @app.post(WEIGHTS_COMMIT_ROUTE)
    async def commit_weights(request: Request):
      body = await _json_object(request)
      if isinstance(body, str):
        return _bad_request(body)
      if not isinstance(body.get("push"), str):
        return _bad_request("push: Field required (a string)")
      success, message = await self.commit(body)
      return ORJSONResponse(
        {"success": success, "message": message, "num_paused_requests": 0}, status_code=200 if success else 400
      )

    @app.post(WEIGHTS_DISCARD_ROUTE)
    async def discard_weights(request: Request):
      body = await _json_object(request)
      push = body.get("push") if isinstance(body, dict) else None
      dropped = self._staging is not None and push in (None, self._staging["push"])
      if dropped:
        self._staging = None
      return ORJSONResponse({"discarded": dropped})


async def _json_object(request) -> dict | str:
  """A request's JSON body, {} for JSON that is not an object, or why it is not JSON (a string)."""
  try:
    body = await request.json()
  except ValueError as e:
    return f"the body is not JSON: {e}"
  return body if isinstance(body, dict) else {}


def _error_body(message: str) -> dict:
  return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _bad_request(message: str):
  """SGLang's 400 error body."""
  from fastapi.responses import ORJSONResponse

  return ORJSONResponse(_error_body(message), status_code=400)


class InProcessEngine:
  """sglang-jax's `Engine` in this process (its single-process mode: scheduler and detokenizer
  threads, its event loop on a thread of its own), with the routes above as calls: colocated
  rollouts in the caller's process. `argv`: sglang-jax's server flags. Thread-safe: each call
  runs on the engine's event loop, as the HTTP server's handlers do.

  `generate_body(body)` is `/generate` (a body with the fields sglang-jax knows; others are ignored,
  as its HTTP server ignores them), its reply as the HTTP server's (`weight_version` stamped);
  `update_weights(tensors, version)` swaps in `{HF name: array}` without files."""

  def __init__(
    self,
    argv: list[str],
    weight_version: str = "default",
    timeout_s: float | None = None,
    isolate_versions: bool = True,
  ):
    from sgl_jax.srt.entrypoints.engine import Engine
    from sgl_jax.srt.server_args import ServerArgs

    server_args = ServerArgs.from_cli(argv)
    server_args.enable_single_process = True
    server_args.enable_engine_loop_run_forever_daemon = True  # callable from any thread
    self.engine = Engine(server_args=server_args)
    self.timeout_s = timeout_s  # of one generate call (TimeoutError), as an HTTP client's
    self.updates = WeightUpdates(weight_version, isolate_versions=isolate_versions)
    self.updates.attach(self.engine.tokenizer_manager, self.engine.scheduler_info["scheduler"])

  def _run(self, coro, timeout_s: float | None = None):
    future = asyncio.run_coroutine_threadsafe(coro, self.engine.loop)
    try:
      return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
      future.cancel()
      raise TimeoutError(f"no reply from sglang-jax's Engine within {timeout_s} s") from None

  def generate_body(self, body: dict):
    import dataclasses

    from sgl_jax.srt.managers.io_struct import GenerateReqInput

    known = {f.name for f in dataclasses.fields(GenerateReqInput)}
    obj = GenerateReqInput(**{k: v for k, v in body.items() if k in known})
    if obj.stream:
      raise ValueError("stream: a colocated request returns its whole result")

    async def first():
      return await self.updates.tokenizer_manager.generate_request(obj, None).__anext__()

    return self._run(first(), self.timeout_s)

  def pause(self, mode: str) -> None:
    self._run(self.updates.pause(mode))

  def resume(self) -> None:
    from sgl_jax.srt.managers.io_struct import ContinueGenerationReqInput

    self._run(self.updates.tokenizer_manager.continue_generation(ContinueGenerationReqInput()))

  def update_weights(self, tensors: dict, weight_version: str | None) -> tuple[bool, str]:
    ok, message, _ = self._run(self.updates.update({"weight_version": weight_version}, tensors=tensors))
    return ok, message

  def model_info(self) -> dict:
    return self.updates.model_info()

  def server_info(self, host: str, port: int) -> dict:
    """`/get_server_info`: its server arguments (`dtype` among them), `host`/`port` the caller's."""
    import dataclasses

    return {
      **dataclasses.asdict(self.engine.server_args),
      "host": host,
      "port": port,
      "weight_version": self.updates.weight_version,
    }

  def close(self) -> None:
    self.engine.shutdown()


def _stop_with_parent(kill_process_tree) -> None:
  """The engine never outlives what started it: once its parent is gone (this process was
  re-parented), it stops itself, whatever killed the parent (a SIGKILL leaves no time to clean up)."""
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    kill_process_tree(os.getpid(), include_parent=True)

  threading.Thread(target=watch, daemon=True, name="mis-jax-parent-watch").start()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--weight-version", default="default")  # SGLang's flag; sglang-jax has none
  # `shared`: sglang-jax's own prefix cache, where a request admitted after an update can match
  # KV computed under the old weights (the stale-KV bug; for comparisons only).
  parser.add_argument("--prefix-cache-versions", choices=("isolated", "shared"), default="isolated")
  ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

  from sgl_jax.srt.entrypoints import http_server
  from sgl_jax.srt.server_args import ServerArgs
  from sgl_jax.srt.utils import kill_process_tree

  _stop_with_parent(kill_process_tree)
  server_args = ServerArgs.from_cli(rest)
  server_args.enable_single_process = True  # the scheduler in this process: its runner is reachable
  updates = WeightUpdates(ours.weight_version, isolate_versions=ours.prefix_cache_versions == "isolated")
  launch = http_server._launch_subprocesses_or_threads  # noqa: SLF001

  def launch_and_attach(server_args, port_args=None):
    tokenizer_manager, template_manager, info = launch(server_args, port_args)
    updates.attach(tokenizer_manager, info["scheduler"])
    return tokenizer_manager, template_manager, info

  http_server._launch_subprocesses_or_threads = launch_and_attach  # noqa: SLF001
  updates.add_routes(http_server.app)
  try:
    http_server.launch(server_args)
  finally:
    kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
  main()
