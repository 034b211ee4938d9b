"""The generation engine behind `mis-jax serve`: model, sampler, a scheduler thread, weights.

Requests (`protocol.NormalizedGenerate`) are queued as jobs; one scheduler thread takes every
queued job that fits in `max_batch_size` rows and runs them as one batch on the device, so
concurrent HTTP requests share a batch (as SGLang's continuous batching does, at request
granularity). A weight update waits for the running batch and never changes weights under it,
except across a pause in place (below).

Pause and abort follow SGLang's tokenizer manager and scheduler:

- While paused, a new request is registered (a duplicate id is refused) and *held* before the
  scheduler; held requests are out of reach of aborts (SGLang's abort goes to the scheduler,
  which has not seen them) and run after `resume()`.
- `abort(...)` and `pause("abort")` end queued samples with the waiting-queue form
  `{"type": "abort", "message": "Abort in waiting queue"}` and no tokens, and samples of the
  running batch with `FINISH_ABORT`'s four keys (`"Aborted"`), keeping the tokens they made
  (the batch cannot stop early here, so that is its full output). A request id matches an
  abort by prefix, as in SGLang's scheduler. `pause("abort")` returns once nothing runs;
  `"retract"` lets the running batch finish and keeps the queue for `resume()`; `"in_place"`
  stops the running batch at its next decoding segment (`sampler.SEGMENT_STEPS` tokens) with its
  KV cache until `resume()`, so a weight update lands mid-response: the rest of each response
  comes from the new weights, and its `weight_versions` spans say where the switch fell.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainers.serving import protocol
from trainers.models import DTYPES, ModelConfig, abstract_model, hf_io, state_from_hf_tensors
from trainers.models import safetensors_stream as sts
from trainers.models.decoder import weight_bits
from trainers.models.quantize import QUANTIZATIONS, quantize_params
from trainers.serving.embedded.sampler import Completion, Sampler, SamplingOptions
from trainers.serving.embedded.staging import StageError, WeightStage, read_checkpoint, weights_digest


@dataclasses.dataclass
class _Job:
  request: protocol.NormalizedGenerate
  start: float
  aborted: list[bool]  # per item
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  running: bool = False
  held: bool = False  # submitted while paused: not yet seen by the scheduler
  result: object = None
  error: BaseException | None = None


class GenerationEngine:
  """Serves one HF checkpoint directory. Thread-safe; `close()` stops the scheduler thread.

  `dtype`: parameters and compute of the served model. `quantize`: `"int8"` / `"fp8"` serve
  weight-only quantised Linear kernels (`trainers.models.quantize`, per-output-channel scales
  computed from the checkpoint's values), re-quantised at every weight update.
  `enable_return_routed_experts` (SGLang's `--enable-return-routed-experts`): a mixture-of-
  experts model returns, for requests with `return_routed_experts`, the experts its router
  chose (in the served dtype) at every position; without it, or for a dense model, such
  requests are answered without them, as SGLang does (its capturer does not exist then).
  `layer_loop` (`auto` | `scan` | `unrolled`, the decoder's `layer_loop`): the decoding
  step's layers as one scan or unrolled; `auto` unrolls up to `UNROLL_MAX_LAYERS`, as the
  trainer does. Unrolled, each layer's weights are read where they lie: in a scan XLA:CPU
  copies (or, bfloat16, converts) every layer's slice of the stacked weights at every step.
  `arithmetic` (the decoder's): `batch_invariant` is exact mode (contract §13): a sample's
  tokens and log-probs do not depend on its batch, and equal a teacher-forced pass of the
  decoder in the same arithmetic on the same weights bit for bit; unquantised weights only.
  """

  def __init__(
    self,
    model_path: str,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_batch_size: int = 64,
    weight_version: str = "default",
    quantize: str = "none",
    sampling_mask_max_tokens: int = protocol.SAMPLING_MASK_MAX_TOKENS,
    enable_return_routed_experts: bool = False,
    layer_loop: str = "auto",
    arithmetic: str = "default",
  ):
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in QUANTIZATIONS:
      raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if sampling_mask_max_tokens < 1:
      raise ValueError(f"sampling_mask_max_tokens must be positive, got {sampling_mask_max_tokens}")
    if arithmetic == "batch_invariant" and quantize != "none":
      raise ValueError(f"arithmetic batch_invariant serves unquantised weights, got quantize {quantize!r}")
    if arithmetic == "batch_invariant" and jax.default_backend() != "cpu":
      raise ValueError(f"arithmetic batch_invariant is built and verified on XLA:CPU, not {jax.default_backend()}")
    self.sampling_mask_max_tokens = sampling_mask_max_tokens
    self.enable_return_routed_experts = enable_return_routed_experts
    self.model_path = os.path.abspath(model_path)
    self.dtype = dtype
    self.quantize = quantize
    self.config = ModelConfig.from_pretrained(model_path)
    model = abstract_model(
      self.config, dtype=DTYPES[dtype], param_dtype=DTYPES[dtype], layer_loop=layer_loop, arithmetic=arithmetic
    )
    self.arithmetic = model.arithmetic
    self.layer_loop = (model.layer_loop, model.layer_loop_reason)
    graphdef, logical = nnx.split(model)  # every variable of the module is a parameter
    first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    logical = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=first), logical)
    stage = self._stage(served=weight_bits(logical), logical=logical, graphdef=graphdef, path=model_path)
    read_checkpoint(stage, model_path)
    self.sampler = Sampler(nnx.merge(graphdef, self._staged(stage, graphdef)), max_batch_size=max_batch_size, seed=seed)
    self.served_push: str | None = None  # the push (`stage_weights`) whose weights are served; None: a file's
    self._staging: WeightStage | None = None
    self.seed = seed
    self.weight_version = weight_version
    self.released = False  # release_weights() freed the served weights (until the next update)
    self.tokenizer = _load_tokenizer(model_path)
    self._weights = threading.Lock()  # held while a batch runs and while weights change
    self._stage_lock = threading.Lock()  # guards `_staging`
    self._cv = threading.Condition()  # guards the queue, pause state and the rid registry
    self._queue: list[_Job] = []
    self._running: list[_Job] = []
    self._rids: dict[str, tuple[_Job, int]] = {}  # queued or running sample → (job, item index)
    self._paused = False
    self._pause_mode = "abort"
    self._closed = False
    self._thread = threading.Thread(target=self._loop, name="mis-jax-scheduler", daemon=True)
    self._thread.start()

  @property
  def paused(self) -> bool:
    return self._paused

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text).ids

  # ---- requests ---------------------------------------------------------------------------
  def submit(self, request: protocol.NormalizedGenerate) -> _Job:
    """Validates and queues a request; raises `protocol.RequestError` as SGLang would."""
    for item in request.items:
      protocol.validate_item(
        item,
        vocab_size=self.config.vocab_size,
        context_length=self.config.max_position_embeddings,
        sampling_mask_max_tokens=self.sampling_mask_max_tokens,
      )
    job = _Job(request, time.perf_counter(), [False] * len(request.items))
    with self._cv:
      job.held = self._paused
      for i, item in enumerate(request.items):
        if item.rid in self._rids:
          for prev in request.items[:i]:
            self._rids.pop(prev.rid, None)
          raise protocol.RequestError(f"Duplicate request ID detected: {item.rid}")
        self._rids[item.rid] = (job, i)
      self._queue.append(job)
      self._cv.notify_all()
    return job

  def submit_body(self, body) -> _Job:
    """A `/generate` JSON body through SGLang's decoding and normalisation (`protocol`), then
    `submit`: what the HTTP route does, and the colocated client without HTTP."""
    req = protocol.decode_generate(body)
    return self.submit(protocol.normalize_generate(req, encode=self.encode if self.tokenizer else None))

  def generate_body(self, body):
    """A `/generate` body's reply, waited for (colocated rollouts: the caller's thread)."""
    return self.wait(self.submit_body(body))

  def wait(self, job: _Job):
    """The response body of a submitted job (an object for a single request, else a list)."""
    job.done.wait()
    if job.error is not None:
      raise job.error
    return job.result

  def generate(self, request: protocol.NormalizedGenerate):
    return self.wait(self.submit(request))

  # ---- scheduler --------------------------------------------------------------------------
  def _loop(self):
    while True:
      with self._cv:
        while not self._closed and (self._paused or not self._queue):
          self._cv.wait()
        if self._closed:
          return
        batch, rows = [], 0
        while self._queue:
          size = sum(not a for a in self._queue[0].aborted)
          if batch and rows + size > self.sampler.max_batch_size:
            break
          job = self._queue.pop(0)
          job.running = True
          batch.append(job)
          rows += size
        self._running = batch
      try:
        self._run(batch)
      finally:
        with self._cv:
          self._running = []
          self._cv.notify_all()

  def _run(self, jobs: list[_Job]):
    work = [(k, i) for k, job in enumerate(jobs) for i, a in enumerate(job.aborted) if not a]
    try:
      with self._weights:
        if self.released:
          raise RuntimeError(
            "the served weights were released (colocated, during a training step) and no update has brought new ones"
          )
        version = self.weight_version
        completions = []
        if work:
          items = [jobs[k].request.items[i] for k, i in work]
          routed = self.enable_return_routed_experts and self.config.is_moe
          completions = self.sampler.generate(
            [it.input_ids for it in items],
            [_engine_params(it, self.config.max_position_embeddings, routed) for it in items],
            prompt_logprobs=any(it.return_logprob and it.logprob_start_len >= 0 for it in items),
            version=version,
            between=self._between_segments,
          )
      done = dict(zip(work, completions))
      for k, job in enumerate(jobs):
        self._finish(job, [done.get((k, i)) for i in range(len(job.aborted))], version)
    except BaseException as e:  # a bug costs these requests (HTTP 500), never the server
      for job in jobs:
        self._release(job)
        job.error = e
        job.done.set()

  def _between_segments(self):
    """Between two decoding segments of the running batch (the scheduler thread, holding the
    weights): paused in place, the batch waits with its KV cache, the weights free for an
    update, until `resume()`; then it decodes on with whatever weights are served, which its
    samples' `weight_versions` spans record (SGLang's `pause_generation` mode `in_place`)."""
    with self._cv:
      if not (self._paused and self._pause_mode == "in_place") or self._closed:
        return None
    version = self.weight_version
    self._weights.release()
    try:
      with self._cv:
        while self._paused and self._pause_mode == "in_place" and not self._closed:
          self._cv.wait()
    finally:
      self._weights.acquire()
    return None if self.weight_version == version else (self.sampler.params, self.weight_version)

  def _release(self, job: _Job):
    with self._cv:
      for item in job.request.items:
        if self._rids.get(item.rid, (None,))[0] is job:
          del self._rids[item.rid]

  def _finish(self, job: _Job, completions: list[Completion | None], version: str):
    self._release(job)
    latency = time.perf_counter() - job.start
    now = time.time()
    out = [
      self._response(item, c, job.aborted[i], c.versions[-1][0] if c else version, latency, now)
      for i, (item, c) in enumerate(zip(job.request.items, completions))
    ]
    job.result = out[0] if job.request.is_single else out
    job.done.set()

  def _response(
    self, item: protocol.Item, c: Completion | None, aborted: bool, version: str, latency: float, now: float
  ) -> dict:
    texts = self._decode_each if item.return_text_in_logprobs and self.tokenizer else None
    if c is None:  # aborted before it ran
      logprobs = ([], []) if item.return_logprob else None
      meta = protocol.meta_info(
        rid=item.rid,
        finish_reason=protocol.finish_abort_waiting(),
        prompt_tokens=None,
        weight_version=version,
        completion_tokens=0,
        e2e_latency=latency,
        sent_ts=now,
        logprobs=logprobs,
        running=False,
      )
      return {"text": "", "output_ids": [], "meta_info": meta}
    kind, value = c.finish_reason
    if aborted:
      finish = protocol.finish_abort()
    elif kind == "stop":
      finish = protocol.finish_stop(value)
    else:
      finish = protocol.finish_length(value)
    logprobs = None
    if item.return_logprob:
      start = item.logprob_start_len
      prompt = item.input_ids
      if start < 0:
        inputs = []
      else:
        ids = prompt[start:]
        values = [None] + [c.prompt_logprobs[start + k - 1] for k in range(1, len(ids))]
        inputs = protocol.logprob_entries(values, ids, texts(ids) if texts else None)[: len(ids)]
      outputs = protocol.logprob_entries(c.logprobs, c.output_ids, texts(c.output_ids) if texts else None)
      logprobs = (inputs, outputs)
    top = None
    if item.return_logprob and item.top_logprobs_num > 0:  # SGLang's: the prompt's are not computed here
      top = (
        [None] * len(logprobs[0]),
        [protocol.logprob_entries([v for v, _ in row], [t for _, t in row]) for row in c.top_logprobs],
      )
    mask = None
    if item.return_sampling_mask:  # top_k <= the cap was checked, so no support overflows it
      mask = (
        c.sampling_mask,
        c.sampling_mask_logprobs if item.sampling_logprobs_mode == "support" else c.sampling_logprobs,
      )
    routed = None
    if c.routed_experts is not None:
      routed = protocol.encode_routed_experts(c.routed_experts[item.routed_experts_start_len :])
    shown = c.output_ids
    if kind == "stop" and not aborted and not item.sampling.no_stop_trim and shown:
      shown = shown[:-1]  # SGLang trims the matched stop token from the text (not output_ids)
    n = len(c.output_ids)
    ends = [k for _, k in c.versions[1:]] + [n]
    spans = [{"version": v, "start": k, "end": end} for (v, k), end in zip(c.versions, ends)]
    meta = protocol.meta_info(
      rid=item.rid,
      finish_reason=finish,
      prompt_tokens=c.prompt_tokens,
      weight_version=version,
      completion_tokens=n,
      e2e_latency=latency,
      sent_ts=now,
      logprobs=logprobs,
      sampling_mask=mask,
      routed_experts=routed,
      spans=spans,
      top_logprobs=top,
    )
    return {
      "text": self._decode(shown, item.sampling.skip_special_tokens),
      "output_ids": c.output_ids,
      "meta_info": meta,
    }

  def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
    if not self.tokenizer:
      return ""
    return self.tokenizer.decode(ids, skip_special_tokens=bool(skip_special_tokens))

  def _decode_each(self, ids: list[int]) -> list[str]:
    return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

  # ---- control ----------------------------------------------------------------------------
  def pause(self, mode: str) -> None:
    """SGLang's `pause_generation`; with `"abort"`, returns once no batch runs."""
    with self._cv:
      self._paused = True
      self._pause_mode = mode
      if mode == "abort":
        self._abort_locked(lambda rid: True)
        while self._running:
          self._cv.wait()
      self._cv.notify_all()

  def resume(self) -> None:
    with self._cv:
      self._paused = False
      for job in self._queue:
        job.held = False
      self._cv.notify_all()

  def abort(self, rid: str = "", abort_all: bool = False) -> None:
    """SGLang's `abort_request`: every sample whose id starts with `rid`, or all."""
    if not abort_all and not rid:
      return  # SGLang ignores an empty rid without abort_all
    with self._cv:
      self._abort_locked(lambda r: abort_all or r.startswith(rid))

  def _abort_locked(self, match) -> None:
    for rid, (job, i) in list(self._rids.items()):
      if match(rid) and not job.held:
        job.aborted[i] = True
    for job in [j for j in self._queue if all(j.aborted)]:
      self._queue.remove(job)  # nothing left to run: answer now (self._cv is reentrant)
      self._finish(job, [None] * len(job.aborted), self.weight_version)

  def internal_state(self) -> dict:
    """Scheduler state: samples running on the device and waiting in the queue."""
    with self._cv:
      running = sum(1 for job, _ in self._rids.values() if job.running)
      held = sum(1 for job, _ in self._rids.values() if job.held)
      return {
        "paused": self._paused,
        "num_running_reqs": running,
        "num_waiting_reqs": len(self._rids) - running - held,
        "num_paused_reqs": held,
      }

  # ---- weights ------------------------------------------------------------------------------
  def _stage(
    self, *, served=None, logical=None, graphdef=None, path: str | None = None, version=None, push=None, base=None
  ) -> WeightStage:
    """An empty stage for the next weights (`staging.WeightStage`), in the served layout unless the
    engine quantises (its scales come from the tensors as given) or the files at `path` store
    tensors under other names (fused experts, read through the architecture's views)."""
    served = self.sampler.params if served is None else served
    logical = self.sampler.served_params() if logical is None else logical
    raw = self.quantize != "none"
    stage = WeightStage(served, logical, self.config, version=version, push=push, base=base, raw=raw)
    stage.graphdef = graphdef or self.sampler.graphdef
    if path is not None and not raw:
      names = {n for f in hf_io.checkpoint_files(path) for n in sts.tensor_names(f)}
      stage.raw = not all(n in stage.slots or hf_io.skipped_on_load(n, self.config.tie_word_embeddings) for n in names)
    return stage

  def _staged(self, stage: WeightStage, graphdef=None) -> nnx.State:
    """The stage's weights as the sampler holds them (`ValueError` when they cannot be)."""
    if not stage.raw:
      return stage.state()
    model = nnx.merge(stage.graphdef, stage.logical)
    return weight_bits(self._served_params(model, stage.tensors))

  def update_weights_from_disk(self, path: str, weight_version: str | None) -> tuple[bool, str]:
    """Loads `path` (HF safetensors) in place of the current weights, all or nothing: read tensor
    by tensor into a stage while the served weights keep serving, then swapped in."""
    try:
      new_config = ModelConfig.from_pretrained(path)
      ignore = ("initializer_range", "bos_token_id", "eos_token_id")
      diff = [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.name not in ignore and getattr(new_config, f.name) != getattr(self.config, f.name)
      ]
      if diff:
        raise ValueError(f"config.json differs from the served model in {', '.join(diff)}")
      stage = self._stage(path=path, version=weight_version)
      read_checkpoint(stage, path)
      state = self._staged(stage)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
      return False, f"Failed to load weights from {path!r}: {e}"
    with self._weights:
      try:
        self.sampler.set_params(state)
      except ValueError as e:
        return False, f"Failed to load weights from {path!r}: {e}"
      message = self._set_version(weight_version, "Succeeded to update model weights.")
      self.model_path = os.path.abspath(path)
      self.released, self.served_push = False, None
    del state, stage  # (the stage refers to the replaced weights)
    _free_replaced()
    return True, message

  def stage_bucket(self, *, push: str, version: str | None, bucket: int, base: str | None = None) -> "BucketSink":
    """A sink for bucket `bucket` of push `push` (`protocol.WEIGHTS_STAGE_ROUTE`): its bytes, fed as
    they arrive, go to the stage of that push (a new push discards what an older one staged). A
    delta (`base`: the push it is relative to) is refused (`StageConflict`) unless the engine
    serves exactly that push's weights in its own layout: the pusher then sends them whole."""
    with self._stage_lock:
      stage = self._staging
      if stage is None or stage.push != push:
        if base is not None and (base != self.served_push or self.quantize != "none"):
          why = (
            f"it serves {'push ' + repr(self.served_push) if self.served_push else 'weights not pushed here'}"
            if self.quantize == "none"
            else "it quantises, from whole tensors"
          )
          raise StageConflict(f"a delta relative to push {base!r} cannot be applied: {why}; send the weights whole")
        stage = self._staging = self._stage(version=version, push=push, base=base)
      elif (stage.version, stage.base) != (version, base):
        raise StageError(
          f"push {push!r} is staging weight_version {stage.version!r} with base {stage.base!r}, "
          f"not {version!r} with {base!r}"
        )
      return BucketSink(self, stage, bucket)

  def commit_weights(self, push: str, weight_version: str | None, num_buckets: int) -> tuple[bool, str]:
    """The weights of push `push`, every one of its `num_buckets` buckets staged, in place of the
    served ones, all or nothing (`protocol.WEIGHTS_COMMIT_ROUTE`); the stage is emptied either way."""
    with self._stage_lock:
      stage = self._staging
      if stage is None or stage.push != push:
        return False, f"no weights staged for push {push!r} (staging: {stage.push if stage else None!r})"
      self._staging = None
      missing = sorted(set(range(num_buckets)) - stage.buckets)
      extra = sorted(stage.buckets - set(range(num_buckets)))
      if missing or extra or stage.version != weight_version:
        return False, (
          f"push {push!r} cannot be committed as weight_version {weight_version!r} of {num_buckets} "
          f"buckets: staged version {stage.version!r}, buckets missing {missing[:8]}, unexpected {extra[:8]}"
        )
      try:
        state = self._staged(stage)
      except ValueError as e:
        return False, f"Failed to update weights from push {push!r}: {e}"
    with self._weights:
      try:
        self.sampler.set_params(state)
      except ValueError as e:
        return False, f"Failed to update weights from push {push!r}: {e}"
      self.released, self.served_push = False, push
      message = self._set_version(
        weight_version,
        f"Succeeded to update model weights ({stage.nbytes} bytes received{', a delta' if stage.base else ''}).",
      )
    del state, stage
    _free_replaced()
    return True, message

  def weights_digest(self) -> dict:
    """`protocol.WEIGHTS_DIGEST_ROUTE`: the served weights' `staging.weights_digest`, their version and push."""
    with self._weights:
      if self.released:
        raise RuntimeError("the served weights were released")
      return {
        "weight_version": self.weight_version,
        "push": self.served_push,
        "digest": weights_digest(self.sampler.params),
      }

  def discard_weights(self, push: str | None = None) -> bool:
    """Drops what push `push` (any, None) staged; whether anything was."""
    with self._stage_lock:
      if self._staging is None or (push is not None and self._staging.push != push):
        return False
      self._staging = None
      return True

  def update_weights(self, params: nnx.State, weight_version: str | None) -> tuple[bool, str]:
    """The in-memory counterpart of `update_weights_from_disk` (colocated rollouts): `params`, a
    parameter state of the served architecture in any float dtype and placement (the trainer's,
    sharded over its mesh), becomes the served weights — cast to the served dtype (read as float32
    and quantised first, as from a checkpoint, when `quantize` says) and moved to the served
    weights' devices. Nothing is serialised; all or nothing."""
    with self._weights:
      try:
        self.sampler.set_params(jax.block_until_ready(self._placed(self._quantized(params))))
      except ValueError as e:
        return False, f"Failed to update model weights in memory: {e}"
      self.released, self.served_push = False, None
      message = self._set_version(weight_version, "Succeeded to update model weights in memory.")
    _free_replaced()
    return True, message

  def _quantized(self, params: nnx.State) -> nnx.State:
    if self.quantize == "none":
      return params
    f32 = nnx.from_flat_state(
      [(path, var.replace(jnp.asarray(var.get_value(), jnp.float32))) for path, var in nnx.to_flat_state(params)]
    )
    return quantize_params(f32, self.quantize, dtype=DTYPES[self.dtype])

  def _placed(self, params: nnx.State) -> nnx.State:
    """`params` matched by path to the served weights, each cast to their dtype and put on their
    devices (a resharding: the trainer's shards gathered where the engine holds its copy)."""
    given = dict(nnx.to_flat_state(params))
    served = nnx.to_flat_state(self.sampler.served_params())
    missing = [path for path, _ in served if path not in given]
    if missing or len(given) != len(served):
      extra = sorted(set(given) - {path for path, _ in served})
      raise ValueError(f"parameters differ from the served model's: missing {missing[:3]}, unexpected {extra[:3]}")

    def put(var, value):
      target = var.get_value()  # (a bfloat16 weight: held as its bits by the sampler, which converts it)
      cast = jnp.asarray(value).astype(target.dtype)
      # Never an alias of the caller's buffers (the trainer donates its parameters to the next
      # step): a cast is a buffer of its own already; only a value taken as it is gets copied.
      return var.replace(jax.device_put(cast, target.sharding, may_alias=False if cast is value else None))

    return nnx.from_flat_state([(path, put(var, given[path].get_value())) for path, var in served])

  def release_weights(self) -> None:
    """Frees the served weights' device memory (colocated: while the trainer trains on the same
    devices); the next `update_weights` brings weights back, and until then a request fails."""
    with self._weights:
      self.sampler.params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.sampler.params
      )  # the engine's only references: freed with them
      self.released = True

  def _set_version(self, weight_version: str | None, message: str) -> str:
    if weight_version is not None:
      self.weight_version = weight_version
      message += f" Weight version updated to {weight_version}."
    return message

  def _served_params(self, model, tensors: dict) -> nnx.State:
    """The served parameter state from HF tensors: cast to `dtype`, or read in float32,
    quantised (`quantize`) and then cast, so the scales come from the checkpoint's values."""
    if self.quantize == "none":
      return state_from_hf_tensors(model, tensors)
    f32 = nnx.state(abstract_model(self.config, dtype=DTYPES[self.dtype], param_dtype=jnp.float32), nnx.Param)
    return quantize_params(state_from_hf_tensors(f32, tensors), self.quantize, dtype=DTYPES[self.dtype])

  def health_generate(self) -> None:
    with self._weights:
      self.sampler.generate([[0]], SamplingOptions(max_new_tokens=1, temperature=0.0))

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    self._thread.join(timeout=30)

  # ---- info -------------------------------------------------------------------------------
  def model_info(self) -> dict:
    """`/model_info`, SGLang 0.5.23's keys."""
    return {
      "model_path": self.model_path,
      "served_model_name": self.model_path,
      "tokenizer_path": self.model_path,
      "is_generation": True,
      "preferred_sampling_params": None,
      "weight_version": self.weight_version,
      "load_format": "auto",
      "reasoning_parser": None,
      "tool_call_parser": None,
      "disaggregation_mode": "null",
      "has_image_understanding": False,
      "has_audio_understanding": False,
      "model_type": self.config.model_type,
      "architectures": self.config.to_hf_dict()["architectures"],
    }

  def server_info(self, host: str, port: int) -> dict:
    """`/server_info`: SGLang's contract fields and the server arguments clients compare."""
    context = self.config.max_position_embeddings
    return {
      "model_path": self.model_path,
      "served_model_name": self.model_path,
      "tokenizer_path": self.model_path,
      "max_context_length": context,
      "context_length": context,
      "max_total_num_tokens": self.sampler.max_batch_size * context,
      "max_running_requests": self.sampler.max_batch_size,
      "host": host,
      "port": port,
      "dtype": self.dtype,
      "quantization": None if self.quantize == "none" else self.quantize,
      "random_seed": self.seed,
      "load_format": "auto",
      "weight_version": self.weight_version,
      "tp_size": 1,
      "dp_size": 1,
      "pp_size": 1,
      "ep_size": 1,
      "nnodes": 1,
      "node_rank": 0,
      "skip_tokenizer_init": self.tokenizer is None,
      "enable_deterministic_inference": True,
      "incremental_streaming_output": False,
      "disaggregation_mode": "null",
      "internal_states": [self.internal_state()],
      "sampling_mask_max_tokens": self.sampling_mask_max_tokens,
      "enable_return_routed_experts": self.enable_return_routed_experts,
      "arithmetic": self.arithmetic,  # `batch_invariant`: exact mode (contract §13); not an SGLang field
      "version": protocol.PROTOCOL_VERSION,
      "frontend": "mis-jax",
    }


def _free_replaced() -> None:
  """Frees the weights a swap replaced now: nnx's `State` and `Variable` objects sit in reference
  cycles, which only the cycle collector frees, so the old copy would otherwise stay until it
  happens to run (Qwen3-0.6B: 1.2 GB held between two loads)."""
  gc.collect()


class StageConflict(ValueError):
  """A delta the engine cannot apply (it does not serve the weights it is relative to): HTTP 409."""


class BucketSink:
  """One bucket's bytes into a stage as they arrive (`feed`, then `close`), its tensors placed by
  `safetensors_stream.Reader`: a tensor `name` whole, or a delta as the pair `name` +
  `protocol.DELTA_INDEX_SUFFIX` (flat indices, uint32) then `name` + `protocol.DELTA_VALUES_SUFFIX`.
  Any error discards the whole stage (its buffers may hold part of the bucket)."""

  def __init__(self, engine: GenerationEngine, stage: WeightStage, bucket: int):
    self.engine, self.stage, self.bucket = engine, stage, bucket
    self.tensors = 0
    self._index: tuple[str, np.ndarray] | None = None
    self._reader = sts.Reader(self._destination, self._done)

  def _destination(self, name, dtype, shape):
    if name.endswith((protocol.DELTA_INDEX_SUFFIX, protocol.DELTA_VALUES_SUFFIX)):
      return None
    return self.stage.destination(name, dtype, shape)

  def _done(self, name: str, array: np.ndarray) -> None:
    self.tensors += 1
    if name.endswith(protocol.DELTA_INDEX_SUFFIX):
      self._index = (name[: -len(protocol.DELTA_INDEX_SUFFIX)], array)
    elif name.endswith(protocol.DELTA_VALUES_SUFFIX):
      target = name[: -len(protocol.DELTA_VALUES_SUFFIX)]
      if self._index is None or self._index[0] != target:
        raise StageError(f"delta values of {target!r} without its indices just before them")
      self.stage.put_delta(target, self._index[1].astype(np.int64, copy=False), array)
      self._index = None
    else:
      self.stage.put(name, array)

  def _guarded(self, fn, *args):
    with self.engine._stage_lock:
      if self.engine._staging is not self.stage:
        raise StageError(f"push {self.stage.push!r} is no longer staged (a newer push or a discard replaced it)")
      try:
        return fn(*args)
      except BaseException:
        self.engine._staging = None
        raise

  def feed(self, chunk) -> None:
    self._guarded(self._reader.feed, chunk)

  def close(self) -> None:
    def finish():
      self._reader.close()
      if self._index is not None:
        raise StageError(f"delta indices of {self._index[0]!r} without their values")
      fmt = self._reader.metadata.get("format")
      if fmt != protocol.WEIGHTS_FORMAT:
        raise StageError(f"bucket metadata format is {fmt!r}, expected {protocol.WEIGHTS_FORMAT!r}")
      self.stage.buckets.add(self.bucket)

    self._guarded(finish)

  def abandon(self) -> None:
    """The bucket will not arrive whole (the client went away): its stage is dropped."""
    self.engine.discard_weights(self.stage.push)


def _engine_params(item: protocol.Item, context: int, routed_experts: bool = False) -> SamplingOptions:
  """A validated protocol item's sampling params → the sampler's."""
  s, prompt_len = item.sampling, len(item.input_ids)
  top_k = -1 if s.top_k is None or s.top_k >= protocol.TOP_K_ALL else s.top_k
  max_new = context - prompt_len if s.max_new_tokens is None else s.max_new_tokens
  return SamplingOptions(
    temperature=float(s.temperature),
    top_p=float(s.top_p),
    top_k=top_k,
    min_p=float(s.min_p),
    max_new_tokens=max_new,
    stop_token_ids=tuple(s.stop_token_ids or ()),
    ignore_eos=bool(s.ignore_eos),
    n=1,
    seed=s.sampling_seed,
    sampling_mask=item.return_sampling_mask,
    routed_experts=routed_experts and item.return_routed_experts,
    top_logprobs_num=item.top_logprobs_num if item.return_logprob else 0,
  )


def _load_tokenizer(path: str):
  """`tokenizer.json` via the `tokenizers` library when both exist; otherwise none (text is "")."""
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    return None
  return Tokenizer.from_file(file)
