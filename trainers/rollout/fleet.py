"""A fleet of SGLang workers behind sglang-router (`rollout.transport.router`, docs/guides/fleet.md).

Generation goes through the router (its policy picks the worker: cache-aware routing keeps a
multi-turn trajectory's prefix where it is cached). The workers are the router's own list
(`GET /workers`), never duplicated in the trainer's config; each gets every weight push directly
(the client's update sequence over one `HttpEngine` per worker), so the version barrier holds
on every worker: the push returns once each live worker serves the new version.

Workers that join and leave while the run goes on:

- a worker registered with the router during the run is found by a watcher thread (every
  `rollout.transport.router_poll_s`) and at every push, and gets the served weights at once.
  A worker started paused (`mis-jax launch --role worker` pauses it before it registers) holds
  every request the router sends it until that push's `continue_generation`, so its first
  samples carry the current version (SGLang holds requests while paused, as `mis-jax serve` does);
- a worker that dies fails its pushes past the transport's retries and is marked down (the
  router stops routing to it after its own health checks); the servers' side readmits it with
  the served weights when it answers `/health` again (`Servers.readmit`); a worker removed from
  the router's list is dropped from the fleet.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from trainers.serving import protocol
from trainers.rollout.engines import HttpEngine, HttpTransport
from trainers.rollout.samples import ServerError, ServerUnavailable, validate_sample
from trainers.rollout.client import SGLangClient

CONTROL_CONNECTIONS = 64  # the control pool bounds how many workers load a push at once (connections open as needed)


def router_workers(router: HttpEngine) -> list[str]:
  """The URLs of the regular workers the router lists (`GET /workers`, sglang-router 0.3)."""
  reply = router.transport.request("GET", router.url, "/workers")
  workers = reply.get("workers") if isinstance(reply, dict) else None
  if not isinstance(workers, list):
    raise ServerError(f"{router.url}/workers: expected {{'workers': [...]}} (sglang-router >= 0.3), got "
                      f"{str(reply)[:200]!r}")
  return [w["url"].rstrip("/") for w in workers
          if isinstance(w, dict) and isinstance(w.get("url"), str) and w.get("worker_type", "regular") == "regular"]


class RouterClient(SGLangClient):
  """A client whose `/generate` calls go through the router at `router_url` and whose engines
  (probes, weight pushes) are the router's workers, followed as they join and leave (see the
  module doc). `poll_s`: how often the watcher thread reads the router's worker list (0: only at
  each push and health check)."""

  def __init__(self, router_url: str, transport: HttpTransport, *, poll_s: float = 1.0, log=print, **kwargs):
    self.router = HttpEngine(router_url, transport)  # generation: `transport`'s connections
    super().__init__([self.router], **kwargs)  # the workers replace it at the first refresh
    self.engines, self.urls = {}, []
    # The worker list, probes and weight pushes over a pool of their own: generation requests the
    # router sent to a paused (joining) worker hold their connections until that worker is
    # admitted, and the admission must not wait for one of them.
    self.transport, self.log = transport.sibling(max_concurrency=CONTROL_CONNECTIONS), log
    self._control = HttpEngine(router_url, self.transport)
    self._served: tuple = None  # (load, version): what every worker must serve, and how one gets it
    self.admitted: list[tuple[str, str | None]] = []  # (url, version it got on joining), in order
    self.dropped: list[str] = []
    self._stop = threading.Event()
    self._rows = ThreadPoolExecutor(max_workers=kwargs.get("max_concurrency", 4) * 2)  # a body's rows
    self._watcher = None
    if poll_s > 0:
      self._watcher = threading.Thread(target=self._watch, args=(poll_s,), name="router-workers", daemon=True)

  # --- the worker list -----------------------------------------------------------------
  def refresh(self) -> list[str]:
    """Reads the router's worker list: new workers join the fleet (with the served weights, if
    any were pushed yet), those no longer listed leave it. Returns the new ones."""
    listed = router_workers(self._control)
    with self.push_lock:
      with self._lock:
        new = [u for u in listed if u not in self.engines]
        gone = [u for u in self.urls if u not in listed]
        for url in gone:
          self.engines.pop(url)
          self.urls.remove(url)
          self._down.discard(url)
        for url in new:
          self.engines[url] = HttpEngine(url, self.transport)
          self.urls.append(url)
      self.dropped += gone
      for url in gone:
        self.log(f"router {self.router.url}: worker {url} left the fleet")
      for url in new:
        self._admit(url)
    return new

  def _admit(self, url: str) -> None:
    version = None
    if self._served is not None:
      load, version = self._served
      try:
        self._update_one(self.engines[url], load, version, 3, "abort")
      except (ServerError, ServerUnavailable) as e:
        self.mark_down(url)  # readmitted with the served weights once it answers /health
        self.log(f"router {self.router.url}: new worker {url} could not load the weights of step {version} "
                 f"({e}); marked down")
        version = None
    else:  # before step 1: it serves what the first push (or its skip) decides
      try:
        self.engines[url].resume()
      except (ServerError, ServerUnavailable):
        self.mark_down(url)
    self.admitted.append((url, version))
    self.log(f"router {self.router.url}: worker {url} joined the fleet"
             + (f" (weights of step {version} loaded)" if version is not None else ""))

  def _watch(self, poll_s: float) -> None:
    while not self._stop.wait(poll_s):
      try:
        self.refresh()
      except (ServerError, ServerUnavailable):
        pass  # the router is away for now: the next poll (or push) tries again

  # --- before step 1 -------------------------------------------------------------------
  def wait_until_healthy(self, *, attempts: int = 30, backoff_s: float = 0.5, max_backoff_s: float = 5.0):
    """The router's `/health`, then at least one worker in its list, then every worker's `/health`."""
    import time
    self.router.wait_until_healthy(attempts=attempts, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    delay = backoff_s
    for _ in range(attempts):
      self.refresh()
      if self.urls:
        break
      time.sleep(delay)
      delay = min(delay * 2, max_backoff_s)
    else:
      raise ServerError(f"router {self.router.url} lists no worker after {attempts} attempts (GET /workers); "
                        f"register one (POST /workers) or start the router with --worker-urls")
    super().wait_until_healthy(attempts=attempts, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    if self._watcher is not None and not self._watcher.is_alive():
      self._watcher.start()

  def check_extras(self, extras, sampling_params: dict) -> None:
    """Each worker returns the run's per-token extras when asked directly (the base check), and
    the router passes their request fields on: sglang-router 0.3 forwards only the `/generate`
    fields it knows (it drops `return_sampling_mask` and `return_routed_experts`), so a run that
    needs one stops here, before step 1, naming the router."""
    super().check_extras(extras, sampling_params)
    for extra in extras:
      reply = self.router.generate(protocol.generate_body([[0]], extra.probe_params(sampling_params),
                                                          extra_fields=extra.request))
      try:
        error, _ = validate_sample(reply[0] if isinstance(reply, list) and reply else reply, extras=(extra,),
                                   prompt_len=1)
      except extra.missing as e:
        raise extra.missing(f"router {self.router.url}/generate drops {', '.join(extra.request)}: the workers "
                            f"return it when asked directly, but sglang-router forwards only the fields it knows; "
                            f"sample from the workers without the router (--sglang-url), or: {e}") from None
      if error is not None:
        raise extra.missing(f"router {self.router.url}/generate: malformed reply to a {extra.what} probe: {error}")

  def weights_served(self, load, weight_version: str) -> None:
    with self.push_lock:
      self._served = (load, weight_version)

  # --- generation and weight sync --------------------------------------------------------
  def _send(self, body: dict):
    """Through the router. sglang-router 0.3 parses `sampling_params` as one mapping (HTTP 422 for
    SGLang's per-row list): a body with per-sample params (seeds) goes as one request per row, in
    parallel, their replies joined in order (each row then routed by its own prefix)."""
    if not self.urls:
      raise ServerUnavailable(f"router {self.router.url} lists no worker")
    params = body.get("sampling_params")
    if not isinstance(params, list):
      return self.router.url, self.router.generate(body)
    rows = [dict(body, input_ids=[ids], sampling_params=p) for ids, p in zip(body["input_ids"], params)]
    replies = list(self._rows.map(self.router.generate, rows))
    out = []
    for reply in replies:
      if not isinstance(reply, list) or len(reply) != 1:
        return self.router.url, reply  # malformed: the caller rejects the chunk
      out += reply
    return self.router.url, out

  def update_weights(self, load, weight_version: str, *, attempts: int = 3, pause_mode: str = "abort", urls=None,
                     served=None) -> dict[str, float]:
    with self.push_lock:
      if urls is None:
        self.refresh_workers()  # a worker that joined since the last poll gets this push
      out = super().update_weights(load, weight_version, attempts=attempts, pause_mode=pause_mode, urls=urls)
      if urls is None or served is not None:
        self._served = (served or load, weight_version)
      return out

  def refresh_workers(self) -> None:
    """Reads the router's worker list before a push (`refresh`; on failure, the known workers get
    it); `ServerUnavailable` when it lists none."""
    with self.push_lock:
      try:
        self.refresh()
      except (ServerError, ServerUnavailable) as e:
        self.log(f"router {self.router.url}: worker list not read ({e}); pushing to the known workers")
      if not self.urls:
        raise ServerUnavailable(f"router {self.router.url} lists no worker")

  def close(self):
    self._stop.set()
    if self._watcher is not None and self._watcher.is_alive():
      self._watcher.join(timeout=10)
    super().close()
    self._rows.shutdown(wait=True)
    self.router.close()
    self._control.close()


def router_client(router_url: str, *, timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                  max_concurrency: int = 4, prompts_per_request: int = 8, cache_salt: bool = True,
                  poll_s: float = 1.0) -> RouterClient:
  """A `RouterClient` over HTTP (the transport as `sglang_client.http_client`'s)."""
  transport = HttpTransport(timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                            max_concurrency=max_concurrency)
  return RouterClient(router_url, transport, poll_s=poll_s, max_concurrency=max_concurrency,
                      prompts_per_request=prompts_per_request, cache_salt=cache_salt)
