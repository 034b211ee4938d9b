"""The trainer sampling from a fleet behind the real sglang-router (`rollout.transport.router`):
two `mis-jax serve` workers (float32) and the router on 127.0.0.1, started and stopped here. The
version barrier on every worker, both workers used, a worker killed (the trainer logs it with its
URL and the step) and another registered while the run goes on; a worker joining mid-run that
cannot read the weight directory refused; the router itself gone: the run waits for it up to its
timeout, stops naming it, and resumes once it is back, nothing lost."""

import json
import os
import re
import time

import httpx
import pytest

import mis_jax
from trainers.models import init_checkpoint
from trainers.serving import router as router_lib
from trainers.serving.embedded.server import EmbeddedServer
from trainers.rollout import fleet as fleet_lib
from trainers.app import trainer as train_lib

from helpers import free_port
from test_shared_weights import server_in_own_view
from test_train import make_cfg, merged
from trainers.app import checkpointing
from trainers.runtime.errors import TrainingError

pytestmark = pytest.mark.integration

try:
  import sglang_router  # noqa: F401
except ImportError:  # CI installs it (the test extra): there a missing router fails, never skips
  if os.environ.get("CI") == "true":
    raise
  pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2)", allow_module_level=True)

FLOAT32 = {
  "model": {"dtype": "float32", "param_dtype": "float32"},
  "rollout": {
    "placement": {"server_dtype": "float32"},
    "sync": {"weight_dtype": "float32"},
    "transport": {
      "max_retries": 1,
      "backoff_s": 0.05,
      "health_attempts": 20,
      "server_restart_timeout_s": 60,
      "router_poll_s": 0.5,
    },
  },
}


def _worker(path):
  """A float32 `mis-jax serve` that logs every request (its /generate calls are counted)."""
  return EmbeddedServer(path, dtype="float32", seed=0, extra_args=("--verbose",))


def _generate_calls(server) -> int:
  return sum("POST /generate" in line for line in server.log)


def _version(url) -> str:
  return str(httpx.get(url + "/model_info", timeout=10).json()["weight_version"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("fleet-init")
  init_checkpoint(path, preset="tiny-qwen3", seed=1)
  return str(path)


@pytest.fixture(scope="module")
def fleet(checkpoint):
  """Two workers behind a round-robin router (both are used whatever the prompts)."""
  with _worker(checkpoint) as a, _worker(checkpoint) as b:
    with router_lib.RouterProcess([a.url, b.url], policy="round_robin") as router:
      workers = [a, b]
      yield router, workers
      workers[1].close()  # (a replacement's)


def _trainer(tmp_path, router, name, steps, sync=None):
  sections = merged(
    FLOAT32, {"rollout": {"transport": {"router": router.url}, "sync": sync or {}}, "train": {"steps": steps}}
  )
  cfg = make_cfg(tmp_path, name, **sections)
  trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[])
  versions = {}  # step -> the weight versions of every sample it trained on
  generate = trainer.servers.generate

  def recording(prompts, batch):
    result = generate(prompts, batch)
    versions[batch + 1] = {s.weight_version for s in result.samples}
    return result

  trainer.servers.generate = recording
  return trainer, versions


def test_ten_float32_steps_through_the_router(fleet, tmp_path):
  router, workers = fleet
  before = [_generate_calls(w) for w in workers]
  trainer, versions = _trainer(tmp_path, router, "run", 10)
  assert sorted(trainer.servers.client.urls) == [] and trainer.servers.client.router.url == router.url
  pushed = []
  push = trainer.servers.push

  def checked_push(params, step):  # after every push, every worker serves the trainer's version
    out = push(params, step)
    pushed.append((step, [_version(w.url) for w in workers]))
    return out

  trainer.servers.push = checked_push
  history = trainer.run(progress=False)
  assert sorted(trainer.servers.client.urls) == sorted(w.url for w in workers)  # read from the router
  assert [h["step"] for h in history] == list(range(1, 11))
  for h in history:
    assert h["mis_k3_kl"] < 1e-6, (h["step"], h["mis_k3_kl"])
    assert h["grad_norm"] > 0, h["step"]
  assert versions == {k: {str(k - 1)} for k in range(1, 11)}  # every sample of step k: version k-1
  assert pushed == [(k, [str(k)] * 2) for k in range(11)]  # the initial push, then after every step
  used = [_generate_calls(w) - b for w, b in zip(workers, before)]
  assert all(n >= 10 for n in used), used  # both workers served every step's requests (round robin)


@pytest.mark.parametrize("via", ["disk", "http"])
def test_a_worker_dies_and_another_joins(fleet, checkpoint, tmp_path, via):
  """Worker b is killed after step 2, worker c registers after step 3 and is given the weights of
  step 3 as it joins — from the served directory, or streamed whole from the trainer's snapshot
  (`via: http`, deltas to the worker that holds the last push): no step fails, every sample of
  step k is version k - 1, the survivors end on version 5."""
  router, (a, b) = fleet
  if b.process.poll() is not None:  # killed by the run before: a fresh worker in its place
    b = fleet[1][1] = _worker(checkpoint)
    router_lib.register(router.url, b.url)
  sync = {"via": "http", "delta": True} if via == "http" else {}
  trainer, versions = _trainer(tmp_path, router, f"churn-{via}", 5, sync)
  logs = []
  with b, _worker(checkpoint) as c:  # c: started now (it takes seconds), registered at step 4
    sync = trainer.servers.sync
    joined = {}

    def churn(params, step, **kw):
      out = sync(params, step, **kw)
      if step == 2:
        b.process.kill()  # SIGKILL: no goodbye to the router
      if step == 3:  # before step 4's rollouts: paused, then registered (as `mis-jax launch --role worker`)
        router_lib.pause_worker(c.url)
        joined["calls"] = _generate_calls(c)
        router_lib.register(router.url, c.url)
      return out

    trainer.servers.sync = churn
    history = trainer.run(progress=False, log=logs.append)
    assert [h["step"] for h in history] == list(range(1, 6))  # no step failed
    # The death in the trainer's log, with the URL and the step: the router's health check (read by
    # the watcher) or the next push found it.
    died = [line for line in logs if f"server {b.url} went down (" in line]
    assert len(died) == 1 and re.match(r"(step [345]|the weight push after step [34]): ", died[0]), logs
    assert versions == {k: {str(k - 1)} for k in range(1, 6)}
    client = trainer.servers.client
    assert (c.url, "3") in client.admitted  # it got the weights of step 3 as it joined (before serving)
    assert _generate_calls(c) > joined["calls"]  # and served from step 4 on: its samples are all version >= 3
    assert _version(c.url) == _version(a.url) == "5"
    assert b.url in client.down_urls() or b.url in client.dropped
    if via == "http":
      assert history[-1]["sync/delta_workers"] >= 1 and history[-1]["sync/sent_bytes"] > 0
    for gone in (b.url, c.url):  # the module's router is shared: later tests see live workers only
      router_lib.deregister(router.url, gone)


def test_a_worker_joining_mid_run_that_cannot_read_the_weights_is_refused(fleet, checkpoint, tmp_path):
  """A worker that sees another filesystem at the run directory (its own mount namespace, as a node
  without the shared filesystem), paused and registered with the router after step 1 (as `mis-jax
  launch --role worker` registers one): probed before it gets anything, as the fleet is before step
  1, it is refused and removed from the router, the trainer saying why; the run goes on with the
  other worker, every sample from the trainer's weights."""
  runs = tmp_path / "runs"
  runs.mkdir()
  proc, blind = server_in_own_view(checkpoint, runs)
  try:
    a = fleet[1][0]  # (a router of its own over the fleet's first worker)
    with router_lib.RouterProcess([a.url], policy="round_robin") as router:
      trainer, versions = _trainer(runs, router, "blind", 3)
      sync, logs = trainer.servers.sync, []

      def join(params, step, **kw):
        out = sync(params, step, **kw)
        if step == 1:
          router_lib.pause_worker(blind)
          # Listed, or already refused: the trainer's watcher may probe and remove it before a
          # wait for the listing sees it (a race this test once lost under load).
          router_lib.register(router.url, blind, wait=False)
          deadline = time.monotonic() + 60
          while blind not in trainer.servers.client.refused and blind not in [
            w["url"] for w in router_lib.workers(router.url)
          ]:
            assert time.monotonic() < deadline, f"{router.url} neither lists nor refused {blind}"
            time.sleep(0.05)
        return out

      trainer.servers.sync = join
      history = trainer.run(progress=False, log=logs.append)
      assert [h["step"] for h in history] == [1, 2, 3] and versions == {k: {str(k - 1)} for k in (1, 2, 3)}
      assert trainer.servers.client.refused == [blind] and [w["url"] for w in router_lib.workers(router.url)] == [a.url]
      (refused,) = [line for line in logs if f"worker {blind} refused" in line]
      weights = os.path.join(trainer.run_dir, "weights")
      assert re.match(r"(step 2|the weight push after step 1): ", refused), refused  # (the watcher, or step 2's batch)
      assert "removed from the router: not readable there: FileNotFoundError" in refused, refused
      assert f"cannot read the trainer's weight directory {weights}" in refused, refused
  finally:
    proc.terminate()
    log = proc.communicate(timeout=30)[0]
  assert "POST /mis_jax/read_probe" in log and "POST /update_weights_from_disk" not in log
  assert "POST /generate" not in log


def test_the_router_gone_stops_the_run_at_its_timeout_and_loses_nothing(fleet, tmp_path):
  """The router SIGKILLed after step 2 (its push done): step 3's rollouts fail, the run waits for the
  router up to `server_restart_timeout_s` and stops with an error naming it; steps 1 and 2 are logged
  and checkpointed, nothing after. A router back on the same port: `--resume` finishes, each step
  logged once."""
  a = fleet[1][0]  # (a router of its own over the fleet's first worker)
  port = free_port()
  router = router_lib.RouterProcess([a.url], policy="round_robin", port=port)
  try:
    sections = merged(
      FLOAT32, {"rollout": {"transport": {"router": router.url, "server_restart_timeout_s": 3}}, "train": {"steps": 4}}
    )
    cfg = make_cfg(tmp_path, "gone", **sections)
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[])
    sync = trainer.servers.sync

    def kill_router(params, step, **kw):
      out = sync(params, step, **kw)
      if step == 2:
        router.process.kill()
        router.process.wait()
      return out

    trainer.servers.sync = kill_router
    with pytest.raises(TrainingError) as stop:
      trainer.run(progress=False)
    message = str(stop.value)
    assert message.startswith("step 3: rollout batch 2: ") and "server_restart_timeout_s (3 s)" in message
    assert f"in vain: router {router.url} does not answer /health" in message, message
    rows = [json.loads(line)["step"] for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    assert rows == [1, 2] and checkpointing.Checkpointer(os.path.join(cfg.run_dir, "checkpoints")).latest_step() == 2
  finally:
    router.close()
  with router_lib.RouterProcess([a.url], policy="round_robin", port=port):
    history = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[]).run(resume=True, progress=False)
  assert [h["step"] for h in history] == [3, 4] and all(h["mis_k3_kl"] < 1e-6 for h in history)
  rows = [json.loads(line)["step"] for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
  assert rows == [1, 2, 3, 4]


def test_the_worker_list_and_pushes_have_their_own_connections():
  """Generation requests the router sent to a paused, joining worker hold every generation
  connection until the worker is admitted; the admission (worker list, push, resume) must not
  wait for one of them (it did, for the transport's whole timeout)."""
  client = fleet_lib.router_client("http://127.0.0.1:9", max_concurrency=2, poll_s=0)
  try:
    assert client.transport is not client.router.transport
    assert client.transport.http is not client.router.transport.http
    assert client._control.transport is client.transport
  finally:
    client.close()


def test_fields_the_router_drops_stop_the_run_before_step_1(fleet, tmp_path):
  """sglang-router 0.3.2 forwards only the `/generate` fields it knows: it drops
  `return_sampling_mask` (and `return_routed_experts`). Sampling-mask replay through it stops
  before step 1, naming the router, although each worker returns masks when asked directly."""
  from trainers.rollout.samples import NoSamplingMask

  router, _ = fleet
  sections = merged(
    FLOAT32,
    {
      "rollout": {
        "transport": {"router": router.url},
        "sampling": {"temperature": 1.0, "top_k": 5, "sampling_replay": "on"},
      },
      "train": {"steps": 1},
    },
  )
  cfg = make_cfg(tmp_path, "masks", **sections)
  with pytest.raises(NoSamplingMask, match=f"router {router.url}/generate drops return_sampling_mask"):
    train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[]).run(progress=False)
  assert not os.path.exists(os.path.join(cfg.run_dir, "metrics.jsonl"))


class _Recorder:
  """A worker that answers `/health` and records every `/generate` body the router forwards (what
  reaches a worker, whatever engine it is)."""

  def __init__(self):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = self.bodies = []

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        self._reply({})

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/generate":
          bodies.append(body)
        self._reply([{"meta_info": {}}])

    self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_what_the_router_forwards_to_a_worker():
  """sglang-router 0.3.2 re-encodes `/generate` with the fields it knows: the trainer's (one seeded
  row, as the router client splits them) reach the worker unchanged; the two per-token extras'
  request fields are dropped (docs/guides/fleet.md; the trainer stops before step 1 for them)."""
  from trainers.serving import protocol

  worker = _Recorder()
  try:
    with router_lib.RouterProcess([worker.url]) as router:
      body = protocol.generate_body(
        [[1, 5, 9]],
        {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True, "stop_token_ids": [2]},
        seeds=[11],
        extra_key="salt",
        extra_fields={"top_logprobs_num": 4, "return_sampling_mask": True, "return_routed_experts": True},
      )
      body["sampling_params"] = body["sampling_params"][0]  # one seeded row, as the router client sends it
      httpx.post(router.url + "/generate", json=body, timeout=30).raise_for_status()
    (got,) = worker.bodies
    assert got["sampling_params"] == body["sampling_params"] and got["sampling_params"]["sampling_seed"] == 11
    for key in ("input_ids", "return_logprob", "extra_key", "top_logprobs_num"):
      assert got[key] == body[key], key
    assert "return_sampling_mask" not in got and "return_routed_experts" not in got
  finally:
    worker.server.shutdown()
