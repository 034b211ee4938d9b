"""Weights over HTTP (`rollout.sync.via: http`): the step's weights streamed to every engine in
buckets, no filesystem shared with them (contract §11, `protocol.WEIGHTS_STAGE_ROUTE`).

A push gathers the parameters one at a time (`weight_sync.hf_params`: cast to the pushed dtype and
laid out as HF's on the devices, then to the host) and sends them in buckets of about
`rollout.sync.bucket_mb` to every engine at once, one sender thread per engine, each bucket's
tensors sent from the gathered buffers as they lie. Each engine stages what it receives beside
the weights it serves; once every bucket is in, the client's update sequence (pause → flush →
commit → verify → continue; `SGLangClient.update_weights`) swaps them in whole on every engine, so
the fleet's version barrier, pause modes and cache salts are those of the disk path.

The pushed weights stay on process 0's host (the snapshot: `weight_dtype` bytes a parameter),
the base of the next delta and what an engine that joins or comes back is streamed. With
`rollout.sync.delta`, an engine that serves exactly the last push gets only the values that
changed since it (per HF tensor: uint32 flat indices and the values there; a tensor where that is
not smaller goes whole); a new, restarted or lagging engine, or one that refuses the delta (HTTP
409), gets the weights whole. Either way the engine ends on bitwise the weights a whole push gives.

A bucket is sent once: an engine whose stream breaks (killed, timed out) drops what it staged,
keeps serving its old weights whole, is marked down, and gets the served weights whole when it
answers again (`Servers.readmit`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid

import numpy as np

from trainers.models import safetensors_stream as sts
from trainers.models.config import ModelConfig
from trainers.runtime import distributed
from trainers.runtime.errors import NoServerUp, TrainingError
from trainers.rollout.client import Load
from trainers.rollout.samples import ServerError, ServerUnavailable
from trainers.rollout.weight_sync import hf_params
from trainers.serving import protocol

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def delta_entries(name: str, new: np.ndarray, old: np.ndarray | None) -> tuple[list[tuple[str, np.ndarray]], int]:
  """What a delta sends of HF tensor `name` (`new`) against the engine's `old`, and how many of
  its values changed (compared bit for bit): nothing when none did; the changed values' uint32
  flat indices and the values there; or the tensor whole when that is not larger or `old` is not
  comparable (then every value counts as changed)."""
  whole = [(name, new)]
  if old is None or old.shape != new.shape or old.dtype != new.dtype or new.size >= 2**32:
    return whole, new.size
  bits = _UINT[new.dtype.itemsize]
  changed = np.flatnonzero(new.reshape(-1).view(bits) != old.reshape(-1).view(bits))
  if changed.size * (4 + new.dtype.itemsize) >= new.nbytes:
    return whole, changed.size
  if not changed.size:
    return [], 0
  return [
    (name + protocol.DELTA_INDEX_SUFFIX, changed.astype(np.uint32)),
    (name + protocol.DELTA_VALUES_SUFFIX, new.reshape(-1)[changed]),
  ], changed.size


class _Bucket:
  """Tensors sent in one request: the safetensors stream of `entries` (`WEIGHTS_FORMAT`)."""

  def __init__(self, index: int, entries: list[tuple[str, np.ndarray]]):
    self.index, self.entries = index, entries
    self.header = sts.header(entries, {"format": protocol.WEIGHTS_FORMAT})
    self.nbytes = len(self.header) + sum(a.nbytes for _, a in entries)

  def chunks(self):
    yield memoryview(self.header)
    for _, a in self.entries:
      if a.nbytes:
        yield memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class _Buckets:
  """Entries gathered into buckets of about `limit` bytes, each handed to `emit` when full."""

  def __init__(self, limit: int, emit):
    self.limit, self.emit = limit, emit
    self.entries, self.size, self.count = [], 0, 0

  def add(self, entries) -> None:
    for name, a in entries:
      self.entries.append((name, a))
      self.size += a.nbytes
    if self.size >= self.limit:
      self.flush()

  def flush(self) -> None:
    if self.entries:
      bucket = _Bucket(self.count, self.entries)
      self.entries, self.size, self.count = [], 0, self.count + 1
      self.emit(bucket)


class _Sender(threading.Thread):
  """Sends the buckets put on its queue to one engine, in order; after a failure it drains the
  queue without sending (the producer never waits on a dead engine)."""

  def __init__(self, engine, query: dict):
    super().__init__(name=f"weights-to-{engine.url}", daemon=True)
    self.engine, self.query = engine, query
    self.queue: queue.Queue = queue.Queue(maxsize=2)
    self.error: ServerError | None = None
    self.sent_bytes, self.buckets = 0, 0

  def run(self) -> None:
    for bucket in iter(self.queue.get, None):
      if self.error is not None:
        continue
      try:
        self.engine.stage_weights({**self.query, "bucket": bucket.index}, bucket.chunks(), bucket.nbytes)
      except ServerError as e:
        self.error = e
        continue
      self.sent_bytes += bucket.nbytes
      self.buckets += 1


class HttpSync:
  """Servers over HTTP without a shared filesystem: see the module doc. `client`: process 0's
  (None elsewhere); `bucket_bytes`: the size a bucket is closed at; `delta`: send engines that
  serve the last push only what changed."""

  def __init__(
    self, client, model_config: ModelConfig, *, pause_mode: str, delta: bool = False, bucket_bytes: int = 128 << 20
  ):
    self.client, self.model_config, self.pause_mode = client, model_config, pause_mode
    self.delta, self.bucket_bytes = delta, bucket_bytes
    self.lock = threading.RLock()  # the snapshot: one push or one engine's stream at a time
    self.snapshot: dict[str, list[tuple[str, np.ndarray]]] = {}  # parameter -> [(hf_name, block)], the served weights
    self.snapshot_push: str | None = None  # the push that sent them (None: not sent by this sync)
    self.snapshot_version: str | None = None
    self.held: dict[str, str] = {}  # engine url -> the push whose weights it was last given whole or by delta
    self._token = uuid.uuid4().hex[:8]
    self._count = itertools.count()

  @classmethod
  def build(cls, cfg, client, model_config: ModelConfig) -> "HttpSync":
    s = cfg.rollout.sync
    return cls(client, model_config, pause_mode=s.pause_mode, delta=s.delta, bucket_bytes=s.bucket_mb << 20)

  # --- a push ------------------------------------------------------------------------------------
  def push(self, params, step: int, weight_dtype: str) -> tuple[dict, None]:
    if not distributed.is_primary():
      for _ in hf_params(params, self.model_config, weight_dtype):
        pass  # the gathers are collective; process 0 sends
      return {}, None
    with self.client.push_lock, self.lock:
      return self._push(params, str(step), weight_dtype), None

  def _push(self, params, version: str, weight_dtype: str) -> dict:
    t0 = time.perf_counter()
    try:
      self.client.refresh_workers()
    except ServerUnavailable:
      pass  # none listed: the weights are still gathered (every process takes part), then NoServerUp
    targets = self.client.live_urls() or self.client.urls
    push = f"{self._token}-{version}-{next(self._count)}"
    base = self.snapshot_push if self.delta else None
    by_delta = {u: base is not None and self.held.get(u) == base for u in targets}
    senders = {
      u: _Sender(
        self.client.engines[u], {"push": push, "weight_version": version, **({"base": base} if by_delta[u] else {})}
      )
      for u in targets
    }
    for sender in senders.values():
      sender.start()
    streams = {
      kind: _Buckets(
        self.bucket_bytes, lambda b, kind=kind: [s.queue.put(b) for u, s in senders.items() if by_delta[u] == kind]
      )
      for kind in (False, True)
      if kind in by_delta.values()
    }
    gather_s, changed, total = 0.0, 0, 0
    t = time.perf_counter()
    try:
      for key, _, pieces in hf_params(params, self.model_config, weight_dtype):
        old = dict(self.snapshot.get(key, ()))
        for name, block in pieces:
          if False in streams:
            streams[False].add([(name, block)])
          if True in streams:
            entries, n = delta_entries(name, block, old.get(name))
            streams[True].add(entries)
            changed, total = changed + n, total + block.size
        self.snapshot[key] = pieces
        t1 = time.perf_counter()
        gather_s, t = gather_s + t1 - t, t1
      for stream in streams.values():
        stream.flush()
    finally:
      for sender in senders.values():
        sender.queue.put(None)
      for sender in senders.values():
        sender.join()
    self.snapshot_push, self.snapshot_version = push, version
    buckets = {u: streams[by_delta[u]].count for u in targets}
    staged, refused = [], []
    for url, sender in senders.items():
      if sender.error is None:
        staged.append(url)
      elif sender.error.status == 409:
        refused.append(url)  # it does not serve the delta's base after all: whole, from the snapshot
      else:
        self.client.mark_down(url)
    resent = 0
    for url in refused:
      try:
        buckets[url], sent = self._stream_snapshot(self.client.engines[url])
        staged.append(url)
        resent += sent
      except ServerError:
        self.client.mark_down(url)
    metrics = {
      "gather_s": gather_s,
      "stream_s": time.perf_counter() - t0 - gather_s,
      "sent_bytes": float(resent + sum(s.sent_bytes for s in senders.values())),
      "delta_workers": float(sum(by_delta[u] for u in staged if u not in refused)),
      "full_workers": float(sum(not by_delta[u] or u in refused for u in staged)),
    }
    if True in streams and total:
      metrics["changed_fraction"] = changed / total
    if not staged:
      errors = "; ".join(f"{u}: {s.error}" for u, s in senders.items()) or "no server is listed"
      raise NoServerUp(f"weight push of version {version}: no server took it ({errors})", ServerUnavailable(errors))

    def commit(engine):
      return engine.commit_weights(
        {"push": push, "weight_version": version, "num_buckets": buckets[engine.url], "flush_cache": True}
      )

    try:
      metrics.update(
        self.client.update_weights(
          commit, version, urls=staged, pause_mode=self.pause_mode, served=self.served_load(None, version)
        )
      )
    except ServerUnavailable as e:
      raise NoServerUp(f"weight sync at step {version}: {e}", e) from None
    except ServerError as e:
      raise TrainingError(f"weight sync at step {version} failed: {e}") from None
    down = set(self.client.down_urls())
    for url in staged:
      if url not in down:
        self.held[url] = push
    metrics["total_s"] = time.perf_counter() - t0
    return {f"sync/{k}": v for k, v in metrics.items()}

  def _stream_snapshot(self, engine) -> tuple[int, int]:
    """The snapshot, whole, staged on `engine` as push `snapshot_push`; `(buckets, bytes)` sent."""
    ready, sent = [], 0
    buckets = _Buckets(self.bucket_bytes, ready.append)
    query = {"push": self.snapshot_push, "weight_version": self.snapshot_version}
    for entries in [*self.snapshot.values(), None]:
      if entries is None:
        buckets.flush()
      else:
        buckets.add(entries)
      for bucket in ready:
        engine.stage_weights({**query, "bucket": bucket.index}, bucket.chunks(), bucket.nbytes)
        sent += bucket.nbytes
      ready.clear()
    return buckets.count, sent

  # --- the served weights --------------------------------------------------------------------------
  def start(self, params, step: int, weight_dtype: str) -> None:
    """The servers loaded the starting checkpoint themselves: the snapshot is its values as the
    pushes cast them (sent whole to an engine that joins; no delta is relative to it)."""
    for key, _, pieces in hf_params(params, self.model_config, weight_dtype):
      if distributed.is_primary():
        with self.lock:
          self.snapshot[key] = pieces
    self.snapshot_push, self.snapshot_version = f"{self._token}-{step}-start", str(step)

  def served_load(self, path: str | None, version: str) -> Load:
    """The snapshot of `version` streamed whole to the engine, then committed (while it is paused:
    the client's update sequence). A `ServerError` once a newer push replaced that snapshot: the
    engine gets the weights with the next push, or the next readmission."""

    def load(engine):
      with self.lock:
        if version != self.snapshot_version or self.snapshot_push is None:
          raise ServerError(
            f"{engine.url}: the weights of version {version} are no longer held here (version "
            f"{self.snapshot_version} is)"
          )
        n, _ = self._stream_snapshot(engine)
        reply = engine.commit_weights(
          {"push": self.snapshot_push, "weight_version": version, "num_buckets": n, "flush_cache": True}
        )
        if isinstance(reply, dict) and reply.get("success"):
          self.held[engine.url] = self.snapshot_push
        return reply

    return load

  def rollouts_done(self) -> None:
    pass

  def check_reach(self, log=print) -> None:
    """Every server has the streamed weights' routes (`mis-jax serve` and the sglang-jax launcher
    do; SGLang does not): asked with an empty discard, which changes nothing."""
    missing = []
    for url in self.client.live_urls():
      try:
        self.client.engines[url].discard_weights({})
      except ServerUnavailable:
        continue  # down now: the pushes' own logic handles it
      except ServerError as e:
        if e.status in (404, 405):
          missing.append(url)
        else:
          raise TrainingError(f"{url}{protocol.WEIGHTS_DISCARD_ROUTE}: {e}") from None
    if missing:
      raise TrainingError(
        f"{', '.join(missing)} has no {protocol.WEIGHTS_STAGE_ROUTE} route (HTTP 404): rollout.sync.via http streams "
        f"the weights to mis-jax serve or the sglang-jax launcher; SGLang loads them from disk only "
        f"(rollout.sync.via: disk, with a filesystem the servers share)"
      )
