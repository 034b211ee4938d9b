"""sglang-router (the `sglang-router` package, Rust; tested with 0.3.2) in a subprocess, and its
worker-management calls: what the tests, `mis-jax launch --role router|worker` and `make
fleet-demo` use (docs/guides/fleet.md).

Routes of sglang-router 0.3 used here: `GET /workers` (`{"workers": [{"url", "is_healthy", ...}]}`),
`POST /workers` (`{"url": ...}`, 202: registration queued), `DELETE /workers/{id}`, `GET /health`;
its Prometheus exporter's `GET /metrics` (`requests_per_worker`).
"""

from __future__ import annotations

import collections
import ctypes
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

ROUTER_VERSION = "0.3.2"
# Health checks often enough that a dead worker leaves the rotation within seconds (the default is 60 s).
HEALTH_ARGS = (
  "--health-check-interval-secs",
  "2",
  "--health-failure-threshold",
  "2",
  "--health-success-threshold",
  "1",
)


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def die_with_parent():  # Linux: the router never outlives the process that started it
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def router_command(
  *,
  host: str,
  port: int,
  worker_urls=(),
  policy: str = "cache_aware",
  prometheus_port: int | None = None,
  extra: tuple[str, ...] = (),
) -> list[str]:
  """The command line of `python -m sglang_router.launch_router` (this interpreter); its metrics
  exporter on `prometheus_port` (None: the router's default, 29000, one router per machine)."""
  cmd = [
    sys.executable,
    "-m",
    "sglang_router.launch_router",
    "--host",
    host,
    "--port",
    str(port),
    "--policy",
    policy,
    "--log-level",
    "warn",
    *HEALTH_ARGS,
    *extra,
  ]
  if prometheus_port is not None:
    cmd += ["--prometheus-port", str(prometheus_port)]
  if worker_urls:
    cmd += ["--worker-urls", *worker_urls]
  return cmd


class RouterProcess:
  """sglang-router on `host:port` (a free port by default) over `worker_urls`, in a subprocess
  that ends with this one; its metrics on another free port (several routers on one machine).
  A context manager, or call `close()`."""

  def __init__(
    self,
    worker_urls=(),
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: str = "cache_aware",
    extra: tuple[str, ...] = (),
    timeout: float = 60.0,
  ):
    try:
      import sglang_router  # noqa: F401
    except ImportError:
      raise RuntimeError(f"sglang-router is not installed: pip install sglang-router=={ROUTER_VERSION}") from None
    port, metrics_port = port or free_port(host), free_port(host)
    self.url = f"http://{host}:{port}"
    self.metrics_url = f"http://{host}:{metrics_port}/metrics"
    self.process = subprocess.Popen(
      router_command(
        host=host, port=port, worker_urls=worker_urls, policy=policy, prometheus_port=metrics_port, extra=extra
      ),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      preexec_fn=die_with_parent,
    )
    self.log: collections.deque[str] = collections.deque(maxlen=200)
    threading.Thread(target=self._drain, daemon=True).start()
    try:
      wait_healthy(self.url, timeout, process=self.process, log=self.log)
      deadline = time.monotonic() + timeout
      while len(workers(self.url)) < len(worker_urls):  # registration is asynchronous
        if time.monotonic() > deadline:
          raise TimeoutError(f"sglang-router lists {workers(self.url)}, not {list(worker_urls)}")
        time.sleep(0.2)
    except BaseException:
      self.close()
      raise

  def _drain(self):
    for line in self.process.stdout:
      self.log.append(line)

  def close(self):
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def wait_healthy(url: str, timeout: float, *, process=None, log=()) -> None:
  """Polls `url/health` until it answers 200 (`TimeoutError` after `timeout` s, `RuntimeError` if
  `process` exits first)."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    if process is not None and process.poll() is not None:
      raise RuntimeError(f"{url} exited with {process.returncode}:\n" + "".join(log))
    if time.monotonic() > deadline:
      raise TimeoutError(f"{url} not healthy after {timeout} s:\n" + "".join(log))
    time.sleep(0.2)


def workers(router_url: str) -> list[dict]:
  """The router's workers (`GET /workers`)."""
  return httpx.get(router_url + "/workers", timeout=10).json().get("workers", [])


def register(router_url: str, worker_url: str, *, timeout: float = 60.0, wait: bool = True) -> None:
  """Adds `worker_url` to the router (`POST /workers`) and waits until it is listed (`wait`: a
  trainer watching the router may remove it again before this sees it; such a caller waits itself)."""
  resp = httpx.post(router_url + "/workers", json={"url": worker_url}, timeout=10)
  if resp.status_code >= 400:
    raise RuntimeError(f"{router_url}/workers refused {worker_url}: HTTP {resp.status_code} {resp.text[:300]}")
  if not wait:
    return
  deadline = time.monotonic() + timeout
  while worker_url.rstrip("/") not in [w.get("url", "").rstrip("/") for w in workers(router_url)]:
    if time.monotonic() > deadline:
      raise TimeoutError(f"{router_url} does not list {worker_url} after {timeout} s")
    time.sleep(0.2)


def deregister(router_url: str, worker_url: str) -> bool:
  """Removes `worker_url` from the router (`DELETE /workers/{id}`); whether it was listed."""
  for w in workers(router_url):
    if w.get("url", "").rstrip("/") == worker_url.rstrip("/"):
      httpx.delete(f"{router_url}/workers/{w['id']}", timeout=10)
      return True
  return False


_WORKER_SUCCESSES = re.compile(r'^smg_worker_cb_outcomes_total\{worker="([^"]+)",outcome="success"\} (\d+)', re.M)


def requests_per_worker(metrics_url: str) -> dict[str, int]:
  """How many requests the router has proxied to each worker with success, from its metrics
  (sglang-router 0.3's `smg_worker_cb_outcomes_total{worker, outcome="success"}`)."""
  text = httpx.get(metrics_url, timeout=10).text
  return {url.rstrip("/"): int(n) for url, n in _WORKER_SUCCESSES.findall(text)}


def pause_worker(worker_url: str) -> None:
  """Pauses a worker before it registers: it holds what the router sends it until the trainer's
  weight push (pause, update, continue) lets it generate with the current weights."""
  httpx.post(worker_url + "/pause_generation", json={"mode": "abort"}, timeout=30).raise_for_status()
