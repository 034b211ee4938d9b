"""A fleet of SGLang workers behind sglang-router (`rollout.transport.router`, docs/guides/fleet.md).

Generation goes through the router (its policy picks the worker: cache-aware routing keeps a
multi-turn trajectory's prefix where it is cached). The workers are the router's own list
(`GET /workers`), never duplicated in the trainer's config; each gets every weight push directly
(the client's update sequence over one `HttpEngine` per worker), so the version barrier holds
on every worker: the push returns once each live worker serves the new version.

Workers that join and leave while the run goes on:

- a worker registered with the router during the run is found by a watcher thread (every
  `rollout.transport.router_poll_s`), before every batch's generation and at every push, and gets the
  served weights at once. A worker started paused (`mis-jax launch --role worker` pauses it before it
  registers) holds every request the router sends it until that push's `continue_generation`, so
  its first samples carry the current version (SGLang holds requests while paused, as `mis-jax
  serve` does). Before that, a worker is probed for the trainer's weight directory as the fleet is before step 1
  (`admission_check`: `DiskSync.sees_weights`); one that cannot read it is removed from the router
  (it would serve other weights), and the trainer says why (a request the router sent it before that
  stays held by the paused worker until the transport's timeout, then goes to another);
- a worker that dies is marked down, and the trainer logs it with its URL and the step: when the
  router's health check reports it unhealthy (its worker list, read by the watcher) or when a push
  fails past the transport's retries. The servers' side readmits it with the served weights when it
  answers `/health` again (`Servers.readmit`); a worker removed from the router's list is dropped
  from the fleet.

When the router itself is away, generation fails and the run waits for it (`serving`: the router
answers `/health` and lists a live worker) up to `rollout.transport.server_restart_timeout_s`, then
stops with an error naming it; the pushes go to the known workers directly meanwhile.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from trainers.serving import protocol
from trainers.rollout.engines import HttpEngine, HttpTransport
from trainers.rollout.samples import ServerError, ServerUnavailable, validate_sample
from trainers.rollout.client import SGLangClient

CONTROL_CONNECTIONS = 64  # the control pool bounds how many workers load a push at once (connections open as needed)


def router_workers(router: HttpEngine) -> dict[str, dict]:
  """The regular workers the router lists (`GET /workers`, sglang-router 0.3), by URL: each its
  entry (`id`, `is_healthy`: the router's own health check, ...)."""
  reply = router.transport.request("GET", router.url, "/workers")
  workers = reply.get("workers") if isinstance(reply, dict) else None
  if not isinstance(workers, list):
    raise ServerError(
      f"{router.url}/workers: expected {{'workers': [...]}} (sglang-router >= 0.3), got {str(reply)[:200]!r}"
    )
  return {
    w["url"].rstrip("/"): w
    for w in workers
    if isinstance(w, dict) and isinstance(w.get("url"), str) and w.get("worker_type", "regular") == "regular"
  }


class RouterClient(SGLangClient):
  """A client whose `/generate` calls go through the router at `router_url` and whose engines
  (probes, weight pushes) are the router's workers, followed as they join and leave (see the
  module doc). `poll_s`: how often the watcher thread reads the router's worker list (0: only at
  each push and health check)."""

  def __init__(self, router_url: str, transport: HttpTransport, *, poll_s: float = 1.0, log=print, **kwargs):
    self.router = HttpEngine(router_url, transport)  # generation: `transport`'s connections
    super().__init__([self.router], log=log, **kwargs)  # the workers replace it at the first refresh
    self.engines, self.urls = {}, []
    # The worker list, probes and weight pushes over a pool of their own: generation requests the
    # router sent to a paused (joining) worker hold their connections until that worker is
    # admitted, and the admission must not wait for one of them.
    self.transport = transport.sibling(max_concurrency=CONTROL_CONNECTIONS)
    self._control = HttpEngine(router_url, self.transport)
    # `url -> why it cannot read the trainer's weight directory` (None: it can, or cannot tell),
    # asked of every worker before it joins (`DiskSync.sees_weights`; None: no such check).
    self.admission_check = None
    self.refused: list[str] = []  # workers removed from the router because they failed it
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
        new = [u for u in listed if u not in self.engines and u not in self.refused]
        gone = [u for u in self.urls if u not in listed]
        for url in gone:
          self.engines.pop(url)
          self.urls.remove(url)
          self._down.discard(url)
        for url in new:
          self.engines[url] = HttpEngine(url, self.transport)
          self.urls.append(url)
        failing = [
          u
          for u, w in listed.items()
          if w.get("is_healthy") is False and u in self.engines and u not in self._down and u not in new
        ]
      self.dropped += gone
      for url in gone:
        self.log(f"router {self.router.url}: worker {url} left the fleet")
      for url in failing:  # (its own /health asked too: the router's check lags a worker that came back)
        if not self.engines[url].is_healthy(timeout_s=2.0):
          self.mark_down(url, f"router {self.router.url}'s health check reports it unhealthy")
      for url in new:
        self._admit(url, listed[url])
    return new

  def _admit(self, url: str, entry: dict) -> None:
    if self._served is not None and self.admission_check is not None:  # (before step 1: `check_reach` probes all)
      why = self.admission_check(url)
      if why is not None:
        self._refuse(url, entry, why)
        return
    version = None
    if self._served is not None:
      load, version = self._served
      try:
        self._update_one(self.engines[url], load, version, 3, "abort")
      except (ServerError, ServerUnavailable) as e:  # readmitted with the served weights once it answers /health
        self.mark_down(
          url, f"new worker of router {self.router.url}: it could not load the weights of step {version}: {e}"
        )
        version = None
    else:  # before step 1: it serves what the first push (or its skip) decides
      try:
        self.engines[url].resume()
      except (ServerError, ServerUnavailable) as e:
        self.mark_down(url, f"new worker of router {self.router.url}: /continue_generation failed: {e}")
    self.admitted.append((url, version))
    self.log(
      f"router {self.router.url}: worker {url} joined the fleet"
      + (f" (weights of step {version} loaded)" if version is not None else "")
    )

  def _refuse(self, url: str, entry: dict, why: str) -> None:
    """`url` cannot serve the trainer's weights (`why`): out of the fleet and off the router's list,
    so no request goes to it."""
    with self._lock:
      self.engines.pop(url, None)
      self.urls.remove(url)
    self.refused.append(url)
    try:
      self.transport.request("DELETE", self.router.url, f"/workers/{entry.get('id')}")
      removed = "removed from the router"
    except (ServerError, ServerUnavailable) as e:
      removed = f"not removed from the router ({e}): deregister it"
    self.log(f"router {self.router.url}: worker {url} refused, {removed}: {why}")

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
      raise ServerError(
        f"router {self.router.url} lists no worker after {attempts} attempts (GET /workers); "
        f"register one (POST /workers) or start the router with --worker-urls"
      )
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
      reply = self.router.generate(
        protocol.generate_body([[0]], extra.probe_params(sampling_params), extra_fields=extra.request)
      )
      try:
        error, _ = validate_sample(
          reply[0] if isinstance(reply, list) and reply else reply, extras=(extra,), prompt_len=1
        )
      except extra.missing as e:
        raise extra.missing(
          f"router {self.router.url}/generate drops {', '.join(extra.request)}: the workers "
          f"return it when asked directly, but sglang-router forwards only the fields it knows; "
          f"sample from the workers without the router (--sglang-url), or: {e}"
        ) from None
      if error is not None:
        raise extra.missing(f"router {self.router.url}/generate: malformed reply to a {extra.what} probe: {error}")

  def serving(self) -> tuple[bool, str]:
    """The router answers `/health` and lists a worker that is not down."""
    if not self.router.is_healthy():
      return False, f"router {self.router.url} does not answer /health"
    try:
      self.refresh()
    except (ServerError, ServerUnavailable) as e:
      return False, f"router {self.router.url}'s worker list cannot be read: {e}"
    if not self.live_urls():
      return False, f"router {self.router.url} lists no live worker ({', '.join(self.urls) or 'none'})"
    return True, ""

  def weights_served(self, load, weight_version: str) -> None:
    with self.push_lock:
      self._served = (load, weight_version)

  # --- generation and weight sync --------------------------------------------------------
  def generate(self, prompts, sampling_params: dict, **kwargs):
    """`SGLangClient.generate` through the router, once the worker list is read: a worker
    registered since the last poll is admitted (or refused) before any request of the batch can
    reach it."""
    try:
      self.refresh()
    except (ServerError, ServerUnavailable):
      pass  # the router is away: the requests fail, and the run waits for it
    return super().generate(prompts, sampling_params, **kwargs)

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

  def update_weights(
    self, load, weight_version: str, *, attempts: int = 3, pause_mode: str = "abort", urls=None, served=None
  ) -> dict[str, float]:
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


def router_client(
  router_url: str,
  *,
  timeout_s: float = 120.0,
  max_retries: int = 3,
  backoff_s: float = 0.5,
  max_concurrency: int = 4,
  prompts_per_request: int = 8,
  cache_salt: bool = True,
  poll_s: float = 1.0,
) -> RouterClient:
  """A `RouterClient` over HTTP (the transport as `sglang_client.http_client`'s)."""
  transport = HttpTransport(
    timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_concurrency=max_concurrency
  )
  return RouterClient(
    router_url,
    transport,
    poll_s=poll_s,
    max_concurrency=max_concurrency,
    prompts_per_request=prompts_per_request,
    cache_salt=cache_salt,
  )
