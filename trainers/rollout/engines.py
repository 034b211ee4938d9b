"""One rollout engine from the trainer's side (`Engine`): SGLang's native routes as typed calls —
generate, pause, continue, flush, load weights, model and server info, health. Two transports
answer them: `HttpEngine` (one SGLang server over HTTP, transient faults retried) and the
in-process engines of colocated rollouts (`trainers.rollout.colocated`). The client
(`trainers.rollout.client.SGLangClient`) is a fleet over engines of either kind.

Errors: `ServerError` when an engine rejects a request (`status`: its HTTP status, 4xx) or
cannot be used, `ServerUnavailable` when it failed past its retries (down or restarting).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Protocol

import httpx

from trainers.serving import protocol
from trainers.rollout.samples import ServerError, ServerUnavailable


class Engine(Protocol):
  """One engine answering SGLang's native API. `url` names it (in messages and the fleet's down
  set)."""

  url: str

  def generate(self, body: dict) -> Any:
    """`POST /generate`: the reply (a list of results for a batched body)."""

  def pause(self, mode: str) -> None:
    """`POST /pause_generation` (`abort`, `retract` or `in_place`)."""

  def resume(self) -> None:
    """`POST /continue_generation`."""

  def flush_cache(self) -> None:
    """`POST /flush_cache`."""

  def update_weights_from_disk(self, body: dict) -> Any:
    """`POST /update_weights_from_disk`: the reply (`success`, `message`)."""

  def model_info(self) -> dict:
    """`GET /model_info` (`model_path`, `weight_version`, ...)."""

  def server_info(self) -> dict:
    """`GET /server_info` (`dtype`, `quantization`, ...)."""

  def is_healthy(self, timeout_s: float = 5.0) -> bool:
    """One `/health` poll."""

  def wait_until_healthy(self, *, attempts: int, backoff_s: float, max_backoff_s: float) -> None:
    """Polls `/health` with bounded retries; `ServerError` when it never answers."""

  def has_weight_update_route(self) -> bool:
    """Whether it can load weights from disk."""

  def stage_weights(self, query: dict, chunks: Iterable, nbytes: int) -> Any:
    """`POST protocol.WEIGHTS_STAGE_ROUTE`: one bucket of streamed weights (`nbytes` bytes in
    `chunks`); `ServerError` with status 409 when the engine refuses a delta."""

  def commit_weights(self, body: dict) -> Any:
    """`POST protocol.WEIGHTS_COMMIT_ROUTE`: the reply (`success`, `message`)."""

  def discard_weights(self, body: dict) -> None:
    """`POST protocol.WEIGHTS_DISCARD_ROUTE`."""

  def close(self) -> None: ...


class HttpTransport:
  """The HTTP side every `HttpEngine` of a client shares: one connection pool (`max_concurrency`
  connections) and the retry policy (`max_retries` retries of a connection error, timeout or
  5xx, backoff from `backoff_s`, doubling; a 4xx is not retried and the server's message shown)."""

  def __init__(self, *, timeout_s: float, max_retries: int, backoff_s: float, max_concurrency: int):
    self.http = httpx.Client(
      timeout=timeout_s, limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    )
    self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s

  def sibling(self, max_concurrency: int) -> "HttpTransport":
    """A transport with this one's timeout and retry policy over its own connection pool (a
    control plane that requests held by a paused server cannot starve of connections)."""
    return HttpTransport(
      timeout_s=self.timeout_s, max_retries=self.max_retries, backoff_s=self.backoff_s, max_concurrency=max_concurrency
    )

  def request(self, method: str, url: str, path: str, body=None):
    delay, last = self.backoff_s, None
    for attempt in range(self.max_retries + 1):
      try:
        resp = self.http.request(method, url + path, json=body)
      except httpx.TransportError as e:  # connection refused/reset, timeouts
        last = f"{type(e).__name__}: {e}"
      else:
        if resp.status_code < 400:
          try:
            return resp.json() if resp.content else None
          except ValueError:
            return resp.text
        if resp.status_code < 500:
          raise ServerError(
            f"{url}{path} rejected the request (HTTP {resp.status_code}): {_message(resp)}", status=resp.status_code
          )
        last = f"HTTP {resp.status_code}: {_message(resp)}"
      if attempt < self.max_retries:
        time.sleep(delay)
        delay *= 2
    raise ServerUnavailable(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")

  def send(self, url: str, path: str, params: dict, chunks: Iterable, nbytes: int):
    """`POST url + path` of `nbytes` raw bytes from `chunks` (buffers sent as they lie), once: a
    body cannot be sent again from where a broken connection left it, so a connection error or a
    timeout (every read and write within `timeout_s`) is `ServerUnavailable` at once, a 4xx
    `ServerError` with the server's message."""
    try:
      resp = self.http.post(
        url + path,
        params=params,
        content=chunks,
        headers={"content-type": "application/octet-stream", "content-length": str(nbytes)},
      )
    except httpx.TransportError as e:
      raise ServerUnavailable(f"{url}{path}: {type(e).__name__}: {e}") from None
    if resp.status_code >= 500:
      raise ServerUnavailable(f"{url}{path}: HTTP {resp.status_code}: {_message(resp)}")
    if resp.status_code >= 400:
      raise ServerError(
        f"{url}{path} rejected the request (HTTP {resp.status_code}): {_message(resp)}", status=resp.status_code
      )
    return resp.json() if resp.content else None

  def close(self) -> None:
    self.http.close()  # (idempotent: every engine of the client closes it)


class HttpEngine:
  """One SGLang server (or router) at `url` over HTTP, through a shared `HttpTransport`."""

  def __init__(self, url: str, transport: HttpTransport):
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"SGLang URL {url!r} must start with http:// or https://")
    self.url, self.transport = url, transport

  def _post(self, path: str, body=None):
    return self.transport.request("POST", self.url, path, body)

  def generate(self, body: dict):
    return self._post("/generate", body)

  def pause(self, mode: str) -> None:
    self._post("/pause_generation", {"mode": mode})

  def resume(self) -> None:
    self._post("/continue_generation", {})

  def flush_cache(self) -> None:
    self._post("/flush_cache", {})

  def update_weights_from_disk(self, body: dict):
    return self._post("/update_weights_from_disk", body)

  def model_info(self) -> dict:
    """`GET /model_info`, or `/get_model_info` where the first is missing (HTTP 404: older SGLang
    releases and sglang-jax have only the second, without `weight_version`)."""
    return self._get_either("/model_info", "/get_model_info")

  def server_info(self) -> dict:
    """`GET /server_info` (or `/get_server_info`): the server's arguments (`dtype`, ...)."""
    return self._get_either("/server_info", "/get_server_info")

  def _get_either(self, path: str, fallback: str) -> dict:
    try:
      out = self.transport.request("GET", self.url, path)
    except ServerError as e:
      if e.status not in (404, 405):
        raise
      out = self.transport.request("GET", self.url, fallback)
    return out if isinstance(out, dict) else {}

  def is_healthy(self, timeout_s: float = 5.0) -> bool:
    """One `/health` poll: 200 within `timeout_s`."""
    try:
      return self.transport.http.get(self.url + "/health", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
      return False

  def wait_until_healthy(self, *, attempts: int = 30, backoff_s: float = 0.5, max_backoff_s: float = 5.0) -> None:
    delay, last = backoff_s, None
    for _ in range(attempts):
      try:
        if self.transport.http.get(self.url + "/health").status_code == 200:
          return
        last = "not healthy yet"
      except httpx.TransportError as e:
        last = f"{type(e).__name__}: {e}"
      time.sleep(delay)
      delay = min(delay * 2, max_backoff_s)
    raise ServerError(f"SGLang server at {self.url} is unreachable after {attempts} attempts ({last})")

  def has_weight_update_route(self) -> bool:
    """Whether it has `POST /update_weights_from_disk`, asked with an empty body (a request that
    route rejects as malformed, HTTP 4xx other than 404/405, without loading anything)."""
    try:
      self._post("/update_weights_from_disk", {})
    except ServerError as e:
      if e.status in (404, 405):
        return False
      if e.status is None:
        raise
    return True

  def stage_weights(self, query: dict, chunks: Iterable, nbytes: int):
    return self.transport.send(self.url, protocol.WEIGHTS_STAGE_ROUTE, query, chunks, nbytes)

  def commit_weights(self, body: dict):
    return self._post(protocol.WEIGHTS_COMMIT_ROUTE, body)

  def discard_weights(self, body: dict) -> None:
    self._post(protocol.WEIGHTS_DISCARD_ROUTE, body)

  def close(self) -> None:
    self.transport.close()


def _message(resp: httpx.Response) -> str:
  try:
    body = resp.json()
  except ValueError:
    return resp.text[:500]
  return protocol.error_message(body)
