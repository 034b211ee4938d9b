"""The SGLang client: the trainer's requests to a fleet of engines (contract §11) — generation
round-robin over the live engines in batched `/generate` calls, the probes before step 1, and
the weight-update sequence (pause → flush → update → check `model_info` → continue).

An engine (`trainers.rollout.engines.Engine`) is one SGLang server over HTTP (`http_client`
builds a client over URLs) or an engine in this process (colocated rollouts). Only the
configured engines are ever contacted. An engine that fails past its transport's retries is
marked down: its work goes to a live one, and the servers' side readmits it when it is back.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from trainers.serving import protocol
from trainers.rollout.engines import Engine, HttpEngine, HttpTransport
from trainers.rollout.samples import (
  RolloutResult,
  Sample,
  ServerError,
  ServerUnavailable,
  sample_seeds,
  validate_sample,
)


class SGLangClient:
  """A client of one or more engines (each an `Engine`, named by its `url`).

  Args:
    engines: the engines; requests round-robin over the live ones.
    max_concurrency: requests in flight at once (a bounded thread pool).
    prompts_per_request: prompts batched into one ``/generate`` call.
    cache_salt: every ``/generate`` carries SGLang's ``extra_key`` (its prefix-cache namespace),
      naming the weights the request starts under; each weight update begun moves new requests
      to a fresh one (:meth:`begin_weights`), so no engine can match a prefix computed under
      other weights for them.
  """

  def __init__(
    self,
    engines: Sequence[Engine],
    *,
    max_concurrency: int = 4,
    prompts_per_request: int = 8,
    cache_salt: bool = True,
    log=print,
  ):
    if not engines:
      raise ValueError("at least one engine is needed")
    self.log = log  # what happens to the engines (one goes down, one joins): the servers' side stamps the step
    self.engines = {e.url: e for e in engines}
    self.urls = list(self.engines)
    # The salt: this client's own token, the updates it has begun and the version they load.
    self._salt_prefix = f"mis-jax:{uuid.uuid4().hex[:8]}" if cache_salt else None
    self._updates_begun = -1  # the starting weights are namespace 0
    self.cache_salt: str | None = None
    self.begin_weights("start")
    self.prompts_per_request = prompts_per_request
    self._pool = ThreadPoolExecutor(max_workers=max_concurrency)
    self._next = itertools.count()
    self._down: set[str] = set()  # engines that failed past their retries, until readmitted
    self._lock = threading.Lock()
    self.push_lock = threading.RLock()  # one weight push (or admission of an engine) at a time

  def begin_weights(self, version: str) -> None:
    """Requests sent from now on go to the prefix-cache namespace of weights `version`: called
    before every pause for an update (so a request held by the pause and started under the new
    weights never shares the old namespace). A fresh namespace at every update, even of the same
    version: a restarted or re-pushed server may have held other weights in between."""
    if self._salt_prefix is not None:
      self._updates_begun += 1
      self.cache_salt = f"{self._salt_prefix}:{self._updates_begun}:w{version}"

  # --- which engines are up ------------------------------------------------------------
  def live_urls(self) -> list[str]:
    with self._lock:
      return [u for u in self.urls if u not in self._down]

  def down_urls(self) -> list[str]:
    with self._lock:
      return [u for u in self.urls if u in self._down]

  def mark_down(self, url: str, why: str = "") -> None:
    """`url` failed past its retries (`why`): no request goes to it until it is readmitted. Logged
    once, when it goes down."""
    with self._lock:
      new = url in self.engines and url not in self._down
      self._down.add(url)
      live = len([u for u in self.urls if u not in self._down])
    if new:
      self.log(f"server {url} went down ({why or 'failed past its retries'}); {live} of {len(self.urls)} serve")

  def readmit(self, url: str) -> None:
    with self._lock:
      self._down.discard(url)

  def is_healthy(self, url: str, timeout_s: float = 5.0) -> bool:
    return self.engines[url].is_healthy(timeout_s)

  def serving(self) -> tuple[bool, str]:
    """Whether generation can go on (an engine is live), and if not, why."""
    live = self.live_urls()
    return bool(live), "" if live else f"every server is down ({', '.join(self.urls)})"

  def _pick(self) -> str:
    live = self.live_urls()
    if not live:
      raise ServerUnavailable(f"every server is down ({', '.join(self.urls)})")
    return live[next(self._next) % len(live)]

  def close(self):
    self._pool.shutdown(wait=True)
    for engine in self.engines.values():
      engine.close()

  # --- before step 1 -------------------------------------------------------------------
  def wait_until_healthy(self, *, attempts: int = 30, backoff_s: float = 0.5, max_backoff_s: float = 5.0):
    """Polls ``/health`` on every engine with bounded retries and backoff."""
    for engine in self.engines.values():
      engine.wait_until_healthy(attempts=attempts, backoff_s=backoff_s, max_backoff_s=max_backoff_s)

  def model_info(self, url: str | None = None) -> dict:
    return self.engines[url or self.urls[0]].model_info()

  def server_info(self, url: str | None = None) -> dict:
    return self.engines[url or self.urls[0]].server_info()

  def has_weight_update_route(self, url: str) -> bool:
    return self.engines[url].has_weight_update_route()

  def _probe(self, url: str, body: dict):
    reply = self.engines[url].generate(body)
    return reply[0] if isinstance(reply, list) and reply else reply

  def check_extras(self, extras, sampling_params: dict) -> None:
    """Asks every engine for one token with each of the run's per-token `extras` (its request
    fields, under its `probe_params`); raises the extra's `missing` error (naming the URL, and
    the server flag or the setting that turns it off) if one returns none, or none that fit,
    before any step."""
    for extra in extras:
      for url in self.urls:
        reply = self._probe(
          url, protocol.generate_body([[0]], extra.probe_params(sampling_params), extra_fields=extra.request)
        )
        try:
          error, _ = validate_sample(reply, extras=(extra,), prompt_len=1)
        except extra.missing as e:
          raise extra.missing(f"{url}/generate: {e}") from None
        if error is not None:
          raise extra.missing(f"{url}/generate: malformed reply to a {extra.what} probe: {error}")

  # --- generation ----------------------------------------------------------------------
  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    sampling_params: dict,
    *,
    n: int = 1,
    seed: int | None = None,
    extras=(),
    rows_per_request: int | None = None,
  ) -> RolloutResult:
    """``n`` samples for every prompt; results come back prompt-major (contract §11). With
    ``seed``, sample ``k`` (prompt-major) is sent with ``sampling_seed = sample_seeds(seed)[k]``.
    Each of the run's per-token ``extras`` (``trainers.rollout.extras``: e.g. sampling masks,
    routed experts) adds its request fields, and each sample carries its parsed values
    (:func:`validate_sample`). ``rows_per_request``: batch this many samples (prompts × ``n``) into
    one call instead of ``prompts_per_request`` prompts (a multi-turn turn: its contexts, ``n = 1``,
    as many rows per request as the single-turn requests of the run carry)."""
    per = self.prompts_per_request if rows_per_request is None else max(1, rows_per_request // n)
    chunks = [list(range(i, min(i + per, len(prompts)))) for i in range(0, len(prompts), per)]

    protocol.generate_body([], sampling_params, n=n)  # a bad key fails here, before any request
    request = {k: v for e in extras for k, v in e.request.items()}
    missing = tuple({e.missing for e in extras})

    def call(idx):
      seeds = None if seed is None else sample_seeds(seed, len(idx), n, offset=idx[0] * n)
      body = protocol.generate_body(
        [prompts[i] for i in idx], sampling_params, n=n, seeds=seeds, extra_fields=request, extra_key=self.cache_salt
      )
      return (idx, *self._send(body))

    result = RolloutResult(samples=[], num_requested=len(prompts) * n)
    for idx, url, out in self._pool.map(call, chunks):
      if not isinstance(out, list) or len(out) != len(idx) * n:
        got = len(out) if isinstance(out, list) else type(out).__name__
        result.num_rejected += len(idx) * n
        result.rejection_reasons.append(f"expected {len(idx) * n} results, got {got}")
        result.lost += [(p, "rejected") for p in idx]
        continue
      for j, item in enumerate(out):
        p = idx[j // n]
        try:
          error, parsed = validate_sample(item, extras=extras, prompt_len=len(prompts[p]))
        except missing as e:
          raise type(e)(f"{url}/generate: {e}") from None
        if error is not None:
          result.num_rejected += 1
          result.rejection_reasons.append(error)
          result.lost.append((p, "rejected"))
        elif parsed["aborted"]:
          result.num_aborted += 1
          result.lost.append((p, "aborted"))
        else:
          result.samples.append(
            Sample(
              prompt_index=p,
              prompt_ids=tuple(prompts[p]),
              response_ids=parsed["ids"],
              rollout_logprobs=parsed["logprobs"],
              finish_reason=parsed["finish"],
              text=parsed["text"],
              weight_version=parsed["weight_version"],
              weight_versions=parsed["weight_versions"],
              extras=parsed["extras"],
            )
          )
    return result

  def _send(self, body: dict):
    """`(url, reply)`: one `/generate` call on a live engine; an engine down past its retries:
    the body goes to a live one."""
    while True:
      url = self._pick()
      try:
        return url, self.engines[url].generate(body)
      except ServerUnavailable as e:
        self.mark_down(url, f"/generate: {e}")
        if not self.live_urls():
          raise ServerUnavailable(f"{e} (no other server is up)") from None

  # --- weight sync ---------------------------------------------------------------------
  def weights_served(self, load: "Load", weight_version: str) -> None:
    """The weights every engine serves before step 1 (when no initial push is made), as the load
    that gives an engine them (`disk_load`, or a weight sync's own); a fleet that admits engines
    during the run (`trainers.rollout.fleet.RouterClient`) gives them these."""

  def refresh_workers(self) -> None:
    """Before a push: the engines are this client's own list (a router's fleet reads its list)."""

  def update_weights_from_disk(
    self,
    model_path: str,
    weight_version: str,
    *,
    attempts: int = 3,
    pause_mode: str = "abort",
    urls: Sequence[str] | None = None,
  ) -> dict[str, float]:
    """`update_weights` of the HF checkpoint at `model_path` (`/update_weights_from_disk`)."""
    return self.update_weights(
      disk_load(model_path, weight_version), weight_version, attempts=attempts, pause_mode=pause_mode, urls=urls
    )

  def update_weights(
    self,
    load: "Load",
    weight_version: str,
    *,
    attempts: int = 3,
    pause_mode: str = "abort",
    urls: Sequence[str] | None = None,
    served: "Load | None" = None,
  ) -> dict[str, float]:
    """contract §11 sequence on every engine, all engines concurrently: pause (``pause_mode``:
    ``abort`` ends in-flight requests, ``retract`` keeps them for after the update), flush,
    ``load(engine)`` (the update call: ``/update_weights_from_disk``, or the commit of weights
    streamed to it beforehand), verify, continue.

    ``urls``: those engines only (default: every live one, or every one when none is up). Retries the update a bounded
    number
    of times; raises :class:`ServerError` if an engine keeps answering ``success: false`` or its
    ``weight_version`` does not change, so training never goes on against unknown weights. An
    engine that fails past its retries is marked down (it gets the weights when readmitted);
    :class:`ServerUnavailable` when none took them. ``served``: the load that gives an engine these
    weights later (a fleet's joining workers; default ``load``). Returns ``{"server_load_s":
    slowest update call, "servers_paused_s": slowest pause-to-continue}``.
    """
    targets = list(urls) if urls is not None else (self.live_urls() or self.urls)  # none up: try them all
    self.begin_weights(weight_version)

    def update(url):
      try:
        loaded = self._update_one(self.engines[url], load, weight_version, attempts, pause_mode)
      except ServerUnavailable as e:
        self.mark_down(url, f"loading weight version {weight_version}: {e}")
        return e
      self.readmit(url)  # it holds the weights pushed to every live engine
      return loaded

    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
      outcomes = list(pool.map(update, targets))
    times = [t for t in outcomes if not isinstance(t, ServerUnavailable)]
    if not times:
      raise outcomes[0] if outcomes else ServerUnavailable("no server to update")
    return {"server_load_s": max(t[0] for t in times), "servers_paused_s": max(t[1] for t in times)}

  @staticmethod
  def _update_one(engine: Engine, load: "Load", weight_version, attempts, pause_mode) -> tuple[float, float]:
    t_pause = time.perf_counter()
    engine.pause(pause_mode)
    try:
      try:
        engine.flush_cache()
      except ServerError as e:  # SGLang refuses while retracted requests wait; the update flushes itself
        if e.status != 400:
          raise
      last = None
      t_load = time.perf_counter()
      for _ in range(attempts):
        try:  # SGLang answers a failed update with success: false (HTTP 400): retry it
          reply = load(engine)
        except ServerError as e:
          last = str(e)
          continue
        if isinstance(reply, dict) and reply.get("success"):
          info = engine.model_info()
          if str(info.get("weight_version")) == weight_version or "weight_version" not in info:
            break  # confirmed (a server whose model info has no weight_version: its success reply)
          last = f"weight_version is {info.get('weight_version')!r} after the update, expected {weight_version!r}"
        else:
          last = reply.get("message") if isinstance(reply, dict) else repr(reply)
      else:
        raise ServerError(f"weight sync to {engine.url} failed after {attempts} attempts: {last}")
      load = time.perf_counter() - t_load
    finally:
      engine.resume()
    return load, time.perf_counter() - t_pause


# An engine's update call, given the engine: its reply (`success`, `message`). `disk_load` is
# `/update_weights_from_disk`; a streamed push commits what it staged there.
Load = Callable[[Engine], Any]


def disk_load(model_path: str, weight_version: str) -> Load:
  """The load of the HF checkpoint at `model_path` as weights `weight_version`."""
  return lambda engine: engine.update_weights_from_disk(
    {"model_path": model_path, "weight_version": weight_version, "flush_cache": True}
  )


def http_client(
  urls: Sequence[str],
  *,
  timeout_s: float = 120.0,
  max_retries: int = 3,
  backoff_s: float = 0.5,
  max_concurrency: int = 4,
  prompts_per_request: int = 8,
  cache_salt: bool = True,
) -> SGLangClient:
  """A client of the SGLang servers (or routers) at `urls` (``http://host:port``) over HTTP: one
  shared connection pool, each request `timeout_s`, `max_retries` retries of a transient failure
  (connection error, timeout, 5xx) with backoff from `backoff_s`, doubling."""
  if not urls:
    raise ValueError("at least one SGLang URL is needed")
  transport = HttpTransport(
    timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_concurrency=max_concurrency
  )
  return SGLangClient(
    [HttpEngine(u, transport) for u in urls],
    max_concurrency=max_concurrency,
    prompts_per_request=prompts_per_request,
    cache_salt=cache_salt,
  )
