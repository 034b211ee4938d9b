"""Weights streamed over HTTP (`rollout.sync.via: http`, `trainers.rollout.weight_stream`).

Exactness is checked by the engine's digest of what it serves (`GET protocol.WEIGHTS_DIGEST_ROUTE`,
sha256 over every served tensor's bits) against the same digest of the trainer's parameters cast
to bfloat16 — what a whole push, or a load of the checkpoint the disk path writes, gives it. The
first tests run the engine in this process (its staging, deltas, bad buckets); the others start
real `mis-jax serve` workers and break them: killed mid-stream, timed out, lagging behind.
"""

import os
import signal

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.models import CausalLM, PRESETS, hf_io, init_checkpoint, safetensors_stream as sts
from trainers.rollout.client import SGLangClient, http_client
from trainers.rollout.colocated import EmbeddedLocal
from trainers.rollout.samples import ServerError
from trainers.rollout.weight_stream import HttpSync, delta_entries
from trainers.rollout.weight_sync import save_hf_sharded
from trainers.runtime.errors import NoServerUp
from trainers.serving import protocol
from trainers.serving.embedded.generation import GenerationEngine, StageConflict
from trainers.serving.embedded.server import EmbeddedServer
from trainers.serving.embedded.staging import StageError, weights_digest

CONFIG = PRESETS["tiny-qwen3"]
BUCKET = 16 << 10  # the tiny model's 160 KB in about ten buckets


def _params(seed: int) -> nnx.State:
  return nnx.state(CausalLM(CONFIG, rngs=nnx.Rngs(seed)), nnx.Param)


def _nudged(params: nnx.State, step: int) -> nnx.State:
  """A small update: every 7th value scaled by 1 + 2e-3 (most bfloat16 values keep their bits)."""

  def nudge(x):
    picked = (jnp.arange(x.size).reshape(x.shape) % 7 == step % 7).astype(x.dtype)
    return x * (1 + 2e-3 * picked)

  return jax.tree.map(nudge, params)


def _expected(params: nnx.State) -> str:
  """The digest of a whole bfloat16 push of `params`."""
  return weights_digest(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


@pytest.fixture(scope="module")
def start_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("stream") / "start")
  init_checkpoint(path, preset="tiny-qwen3", seed=0)
  return path


# --- the pieces --------------------------------------------------------------------------------------
def test_delta_entries_against_a_loop_over_values():
  rng = np.random.default_rng(0)
  old = rng.standard_normal((40, 30)).astype(jnp.bfloat16)
  new = old.copy()
  flat = new.reshape(-1)
  picks = rng.choice(flat.size, 25, replace=False)
  flat[picks] = (flat[picks].astype(np.float32) * 1.5).astype(jnp.bfloat16)
  flat[3] = -0.0 if old.reshape(-1)[3] == 0 else old.reshape(-1)[3]  # unchanged bits stay out
  want = [k for k in range(flat.size) if flat.view(np.uint16)[k] != old.reshape(-1).view(np.uint16)[k]]
  entries, n = delta_entries("w", new, old)
  assert n == len(want) == 25
  (iname, index), (vname, values) = entries
  assert (iname, vname) == ("w" + protocol.DELTA_INDEX_SUFFIX, "w" + protocol.DELTA_VALUES_SUFFIX)
  assert index.dtype == np.uint32 and index.tolist() == want
  assert values.view(np.uint16).tolist() == [flat.view(np.uint16)[k] for k in want]
  assert delta_entries("w", old.copy(), old) == ([], 0)
  # Zero and minus zero differ in bits: a delta carries the sign; a NaN with the same bits does not move.
  z = np.zeros(8, jnp.bfloat16)
  entries, n = delta_entries("z", -z, z)
  assert n == 8 and entries == [("z", entries[0][1])]  # all changed: sent whole
  nan = np.full(8, np.nan, jnp.bfloat16)
  assert delta_entries("n", nan.copy(), nan) == ([], 0)
  everything = (old.astype(np.float32) + 1).astype(jnp.bfloat16)
  assert delta_entries("w", everything, old)[0] == [("w", everything)]  # not smaller: whole
  assert delta_entries("w", new, None)[0] == [("w", new)] and delta_entries("w", new, old.T)[0] == [("w", new)]


class InProcess(EmbeddedLocal):
  """An engine in this process answering the streamed weights' routes as `mis-jax serve` does."""

  def __init__(self, inner, name: str):
    super().__init__(inner)
    self.url = f"inproc://{name}"

  def stage_weights(self, query, chunks, nbytes):
    try:
      sink = self.inner.stage_bucket(
        push=query["push"], version=query.get("weight_version"), bucket=int(query["bucket"]), base=query.get("base")
      )
    except StageConflict as e:
      raise ServerError(str(e), status=409) from None
    for chunk in chunks:
      sink.feed(chunk)
    sink.close()
    return {"success": True}

  def commit_weights(self, body):
    ok, message = self.inner.commit_weights(body["push"], body["weight_version"], body["num_buckets"])
    return {"success": ok, "message": message}

  def discard_weights(self, body):
    return {"discarded": self.inner.discard_weights(body.get("push"))}


def test_whole_and_delta_pushes_serve_exactly_the_trainers_weights(start_dir, tmp_path):
  """Over three steps of small updates: a whole push, then deltas, each engine's served weights
  are bitwise the trainer's cast to bfloat16 — and those of a fresh engine loading the checkpoint
  the disk path writes. A delta sends a fraction of the bytes."""
  engines = [InProcess(GenerationEngine(start_dir, dtype="bfloat16"), n) for n in "ab"]
  client = SGLangClient(engines, cache_salt=False)
  sync = HttpSync(client, CONFIG, pause_mode="abort", delta=True, bucket_bytes=BUCKET)
  params, sent = _params(1), []
  for step in range(1, 4):
    params = _nudged(params, step)
    metrics, path = sync.push(params, step, "bfloat16")
    assert path is None
    sent.append(metrics["sync/sent_bytes"])
    assert metrics["sync/delta_workers" if step > 1 else "sync/full_workers"] == 2, metrics
    for e in engines:
      assert e.inner.weights_digest() == {
        "weight_version": str(step),
        "push": sync.snapshot_push,
        "digest": _expected(params),
      }
  save_hf_sharded(params, CONFIG, tmp_path / "disk", dtype="bfloat16")
  loaded = GenerationEngine(str(tmp_path / "disk"), dtype="bfloat16")
  assert loaded.weights_digest()["digest"] == _expected(params)
  assert 0 < metrics["sync/changed_fraction"] < 0.3 and sent[1] < sent[0] / 3 and sent[2] < sent[0] / 3, (metrics, sent)
  for e in engines + [loaded]:
    e.inner.close() if hasattr(e, "inner") else e.close()


def test_bad_buckets_leave_the_served_weights_as_they_were(start_dir):
  engine = GenerationEngine(start_dir, dtype="bfloat16")
  before = engine.weights_digest()
  good = InProcess(engine, "a")
  tensors = [
    (name, np.zeros(slot.shape, jnp.bfloat16))
    for name, slot in hf_io.hf_slots(engine.sampler.served_params(), engine.config).items()
  ]
  meta = {"format": protocol.WEIGHTS_FORMAT}
  # A push that leaves a tensor out cannot be committed; nothing served changed.
  good.stage_weights({"push": "p1", "weight_version": "1", "bucket": 0}, sts.chunks(tensors[1:], meta), 0)
  ok, message = engine.commit_weights("p1", "1", 1)
  assert not ok and "1 tensors never arrived: " + tensors[0][0] in message
  # A tensor the model does not have, a wrong shape, a missing format, a truncated bucket.
  for bad, match in (
    ([("model.nope.weight", np.zeros(3, jnp.bfloat16))], "unexpected tensor 'model.nope.weight'"),
    ([(tensors[0][0], np.zeros(5, jnp.bfloat16))], "has shape \\[5\\]"),
    ("no format", "metadata format is None"),
    ("truncated", "ended after"),
  ):
    sink = engine.stage_bucket(push="p2", version="2", bucket=0)
    with pytest.raises(StageError if isinstance(bad, list) or bad == "no format" else ValueError, match=match):
      if bad == "no format":
        for c in sts.chunks(tensors):
          sink.feed(c)
      elif bad == "truncated":
        sink.feed(sts.concat(sts.chunks(tensors, meta))[:-10])
      else:
        for c in sts.chunks(bad, meta):
          sink.feed(c)
      sink.close()
    assert engine.commit_weights("p2", "2", 1)[0] is False  # the stage was dropped with the bad bucket
  # A delta against weights it does not serve: refused before anything is staged.
  with pytest.raises(StageConflict, match="serves weights not pushed here"):
    engine.stage_bucket(push="p3", version="3", bucket=0, base="p1")
  # A commit that names too few buckets, or another version.
  good.stage_weights({"push": "p4", "weight_version": "4", "bucket": 0}, sts.chunks(tensors, meta), 0)
  good.stage_weights({"push": "p4", "weight_version": "4", "bucket": 1}, sts.chunks([], meta), 0)
  assert not engine.commit_weights("p4", "4", 1)[0]
  assert engine.weights_digest() == before
  engine.close()


# --- real workers ------------------------------------------------------------------------------------
def _digest(url: str) -> dict:
  return httpx.get(url + protocol.WEIGHTS_DIGEST_ROUTE, timeout=30).json()


@pytest.fixture(scope="module")
def pool(start_dir):
  servers = [EmbeddedServer(start_dir, dtype="bfloat16") for _ in range(2)]
  yield servers
  for server in servers:
    server.close()


@pytest.fixture
def workers(pool, start_dir):
  """The module's two workers, a killed one restarted (on its port) first."""
  for i, server in enumerate(pool):
    if server.process.poll() is not None:
      pool[i] = _restart(server, start_dir)
  return pool


def _restart(server: EmbeddedServer, start_dir) -> EmbeddedServer:
  port = int(server.url.rsplit(":", 1)[1])
  server.process.wait(timeout=30)
  return EmbeddedServer(start_dir, dtype="bfloat16", port=port)


@pytest.mark.integration
def test_a_run_with_deltas_serves_exactly_the_trainers_weights_at_every_step(workers, start_dir, tmp_path):
  """`mis-jax train` over HTTP with deltas, two workers, five steps: after every push (the initial
  one whole, then deltas) each worker serves bitwise the trainer's weights cast to bfloat16 — what
  a whole push gives — and the weights moved at every step; a delta is a fraction of a whole push."""
  import mis_jax
  from test_train import make_cfg
  from trainers.app import trainer as train_lib

  cfg = make_cfg(
    tmp_path,
    "http",
    model={"path": start_dir},
    rollout={"sync": {"via": "http", "delta": True, "initial_sync": "always"}},
    train={"steps": 5, "ppo_epochs": 1, "learning_rate": 1e-6},
  )  # most bfloat16 values stay
  trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[w.url for w in workers])
  push, seen = trainer.servers.weight_sync.push, []

  def checked(params, step, dtype):
    out = push(params, step, dtype)
    seen.append((step, _expected(params), [_digest(w.url) for w in workers], out[0]))
    return out

  trainer.servers.weight_sync.push = checked
  history = trainer.run(progress=False)
  assert [h["step"] for h in history] == list(range(1, 6)) and [s[0] for s in seen] == list(range(6))
  for step, want, got, metrics in seen:
    assert all(g == {"weight_version": str(step), "push": got[0]["push"], "digest": want} for g in got), step
    assert metrics["sync/delta_workers" if step else "sync/full_workers"] == 2, metrics
  assert len({want for _, want, _, _ in seen}) == 6  # every step moved the weights
  whole = seen[0][3]["sync/sent_bytes"]
  assert all(0 < m["sync/sent_bytes"] < whole / 2 and 0 < m["sync/changed_fraction"] < 0.5 for *_, m in seen[1:]), [
    (m["sync/sent_bytes"], m.get("sync/changed_fraction")) for *_, m in seen
  ]
  assert all(h["sync/sent_bytes"] == m["sync/sent_bytes"] for h, (*_, m) in zip(history, seen[1:]))


def _during_bucket(engine, k: int, act) -> list:
  """Runs `act()` halfway through the chunks of the next bucket `k` sent to `engine` (once);
  returns a list that holds True once it ran."""
  stage, ran = engine.stage_weights, []

  def wrapped(query, chunks, nbytes):
    if query["bucket"] != k or ran:
      return stage(query, chunks, nbytes)

    def halfway():
      pieces = list(chunks)
      for i, piece in enumerate(pieces):
        if i == len(pieces) // 2:
          act()
          ran.append(True)
        yield piece

    return stage(query, halfway(), nbytes)

  engine.stage_weights = wrapped
  return ran


@pytest.mark.integration
def test_a_worker_killed_mid_stream(workers, start_dir):
  """Worker a is SIGKILLed halfway through bucket 1 of push 2 (a delta of two buckets): b serves
  push 2 exactly, a is marked down; restarted, it is readmitted with the served weights whole."""
  a, b = workers
  client = http_client([a.url, b.url], max_retries=0, timeout_s=30)
  sync = HttpSync(client, CONFIG, pause_mode="abort", delta=True, bucket_bytes=BUCKET)
  params = _params(1)
  sync.push(params, 1, "bfloat16")
  params = _nudged(params, 2)
  killed = _during_bucket(client.engines[a.url], 1, lambda: os.kill(a.process.pid, signal.SIGKILL))
  metrics, _ = sync.push(params, 2, "bfloat16")
  assert killed and client.down_urls() == [a.url] and metrics["sync/delta_workers"] == 1, metrics
  assert _digest(b.url) == {"weight_version": "2", "push": sync.snapshot_push, "digest": _expected(params)}
  workers[0] = a = _restart(a, start_dir)
  assert _digest(a.url)["weight_version"] == "default"  # its own starting weights, whole
  client.update_weights(sync.served_load(None, "2"), "2", urls=[a.url])  # Servers.readmit's call
  assert client.down_urls() == [] and _digest(a.url)["digest"] == _expected(params)
  client.close()


@pytest.mark.integration
def test_a_stream_that_times_out(workers):
  """Worker a stops (SIGSTOP) halfway through bucket 1 of push 2; its request times out: b serves
  push 2 exactly, a is marked down. Let go, a serves push 1 still, whole — what it staged of push
  2 is never served — and the next push reaches it whole."""
  a, b = workers
  client = http_client([a.url, b.url], max_retries=0, timeout_s=1.5)
  sync = HttpSync(client, CONFIG, pause_mode="abort", delta=True, bucket_bytes=BUCKET)
  p1 = _params(1)
  sync.push(p1, 1, "bfloat16")
  p2 = _nudged(p1, 2)
  stopped = _during_bucket(client.engines[a.url], 1, lambda: os.kill(a.process.pid, signal.SIGSTOP))
  try:
    metrics, _ = sync.push(p2, 2, "bfloat16")
  finally:
    os.kill(a.process.pid, signal.SIGCONT)
  assert stopped and client.down_urls() == [a.url] and metrics["sync/delta_workers"] == 1, metrics
  assert _digest(b.url)["digest"] == _expected(p2)
  assert _digest(a.url) == {"weight_version": "1", "push": sync.held[a.url], "digest": _expected(p1)}
  p3 = _nudged(p2, 3)
  client.readmit(a.url)  # it answers again (Servers.readmit would give it push 2 first)
  metrics, _ = sync.push(p3, 3, "bfloat16")
  assert metrics["sync/full_workers"] == 1 and metrics["sync/delta_workers"] == 1, metrics  # a lags: whole
  assert _digest(a.url)["digest"] == _digest(b.url)["digest"] == _expected(p3)
  client.close()


@pytest.mark.integration
def test_a_restarted_worker_refuses_a_delta_and_gets_the_weights_whole(workers, start_dir):
  """Worker a restarts between two pushes without the trainer seeing it go: the delta it is sent is
  refused (409: it serves its starting weights), and the push sends it the weights whole."""
  a, b = workers
  client = http_client([a.url, b.url], max_retries=1, timeout_s=30)
  sync = HttpSync(client, CONFIG, pause_mode="abort", delta=True, bucket_bytes=BUCKET)
  params = _params(1)
  sync.push(params, 1, "bfloat16")
  os.kill(a.process.pid, signal.SIGKILL)
  workers[0] = a = _restart(a, start_dir)
  params = _nudged(params, 2)
  metrics, _ = sync.push(params, 2, "bfloat16")
  assert metrics["sync/full_workers"] == 1 and metrics["sync/delta_workers"] == 1 and client.down_urls() == []
  assert _digest(a.url)["digest"] == _digest(b.url)["digest"] == _expected(params)
  client.close()


def test_no_server_took_the_push():
  import socket

  ports = []
  for _ in range(2):  # nothing listens there
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      ports.append(sock.getsockname()[1])
  client = http_client([f"http://127.0.0.1:{p}" for p in ports], max_retries=0, timeout_s=5)
  sync = HttpSync(client, CONFIG, pause_mode="abort", bucket_bytes=BUCKET)
  with pytest.raises(NoServerUp, match="no server took it"):
    sync.push(_params(1), 1, "bfloat16")
  assert sync.snapshot_version == "1"  # gathered all the same: what a readmitted server would get
  with pytest.raises(ServerError, match="no longer held"):
    sync.served_load(None, "0")(client.engines[client.urls[0]])
  client.close()


def test_transpose_into_against_numpy():
  from trainers.serving.embedded.staging import transpose_into

  rng = np.random.default_rng(0)
  for shape, tile in (((300, 257), 64), ((5, 3), 128), ((128, 128), 128), ((1, 1000), 7)):
    src = rng.standard_normal(shape).astype(jnp.bfloat16)
    dst = np.empty(shape[::-1], jnp.float32)
    transpose_into(dst, src, tile=tile)
    np.testing.assert_array_equal(dst, src.T.astype(np.float32))
  with pytest.raises(ValueError, match="cannot transpose"):
    transpose_into(np.empty((3, 4)), np.empty((3, 4)))
