"""Trainer at scale II: sharded bf16 weight sync to concurrent servers, the asynchronous loop
(bounded staleness, overlap of generation and training, its faults), and several processes
(`jax.distributed`, gloo, coordinator on 127.0.0.1) equal to one."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

import mis_jax
from fake_sglang import FakeSGLang
from helpers import cpu_process_env, free_port
from test_train import ALGORITHMS, BASE, embedded_server, make_cfg, merged
from trainers.app import trainer as train_lib
from trainers.app.spec import resolve
from trainers.models import PRESETS, CausalLM, hf_state_dict, load_hf_checkpoint, read_hf_tensors
from trainers.rollout.weight_sync import save_hf_sharded
from trainers.rollout.client import http_client

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

DECOUPLED = mis_jax.LossConfig(**ALGORITHMS["decoupled_ppo"])


def _bits(a):
  return np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-untied"])
def test_sharded_bf16_weights_load_bit_exact(tmp_path, preset):
  import torch
  import transformers

  model = CausalLM(PRESETS[preset], rngs=nnx.Rngs(3))
  times = save_hf_sharded(nnx.state(model, nnx.Param), model.config, tmp_path / "w", dtype="bfloat16", num_shards=3)
  assert set(times) == {"gather_s", "write_s"}
  files = sorted(os.listdir(tmp_path / "w"))
  assert files == [
    "config.json",
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
  ]
  index = json.loads((tmp_path / "w" / "model.safetensors.index.json").read_text())
  want = hf_state_dict(model, dtype="bfloat16")
  assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(files[1:4])
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in want.values())
  got = read_hf_tensors(tmp_path / "w")
  assert set(got) == set(want) and all(np.array_equal(_bits(got[k]), _bits(want[k])) for k in want)
  # The project's loader and transformers (PyTorch CPU) read the same bits.
  ours = hf_state_dict(load_hf_checkpoint(tmp_path / "w"), dtype="bfloat16")
  assert all(np.array_equal(_bits(ours[k]), _bits(want[k])) for k in want)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.bfloat16)
  for name, tensor in hf.state_dict().items():
    if name in want:
      assert np.array_equal(tensor.view(torch.int16).numpy().view(np.uint16), _bits(want[name])), name


def test_weight_sync_reaches_four_servers_concurrently():
  fakes = [FakeSGLang(update_delay_s=1.0) for _ in range(4)]
  try:
    client = http_client([f.url for f in fakes])
    start = time.perf_counter()
    times = client.update_weights_from_disk("/weights/step_1", "1")
    elapsed = time.perf_counter() - start
    client.close()
  finally:
    for f in fakes:
      f.close()
  assert 1.0 <= times["server_load_s"] < 1.8 and elapsed < 2.0  # in parallel: about 1 s, not 4 s
  assert all(f.weight_version == "1" for f in fakes)
  starts = [e[1] for f in fakes for e in f.events if e[0] == "update"]
  assert max(starts) - min(starts) < 0.5


def _timed_trainer(tmp_path, name, url, train_delay_s, rollout=None):
  cfg = make_cfg(
    tmp_path,
    name,
    rollout=merged({"transport": {"prompts_per_request": 16}, "sync": {"mismatch_check": False}}, rollout or {}),
    train={"steps": 4},
  )
  trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[url])
  train_on = trainer.train_on

  def slow_train_on(sb):
    time.sleep(train_delay_s)
    return train_on(sb)

  trainer.train_on = slow_train_on
  return trainer


def test_asynchronous_loop_overlaps_generation_and_training(tmp_path):
  """Generation x = 0.8 s and training y = 0.8 s per step: the synchronous loop takes x + y
  per step, the asynchronous one (max_staleness 1) about max(x, y); every trained sample is
  at most 1 version old; max_staleness 0 is the synchronous loop."""
  x = y = 0.8
  with FakeSGLang(generate_delay_s=x) as fake:
    sync = _timed_trainer(tmp_path, "sync", fake.url, y).run(progress=False)
    fake.weight_version = "init"
    asynchronous = _timed_trainer(
      tmp_path, "async", fake.url, y, {"sync": {"max_staleness": 1, "pause_mode": "retract"}}
    ).run(progress=False)
  assert [h["server_weight_version"] for h in sync] == ["0", "1", "2", "3"]
  assert all(h["rollout/staleness_max"] == 0 for h in sync)
  # Batch k+1 is generated while step k trains (with the weights of step k-1 at most).
  assert all(h["rollout/staleness_max"] <= 1 for h in asynchronous)
  assert [h["rollout/staleness_max"] for h in asynchronous[1:]] == [1.0] * 3
  steady = slice(2, 4)  # after the first steps' compilation
  t_sync = np.mean([h["step_s"] for h in sync[steady]])
  t_async = np.mean([h["step_s"] for h in asynchronous[steady]])
  t_other = np.mean([h["step_s"] - h["train_s"] - h["rollout_s"] for h in sync[steady]])  # sync + logging
  # Overlap saves up to min(x, y); a quarter of it proves the two ran at once (the other xdist
  # worker can slow both loops down by a few hundred ms).
  assert t_sync > x + y and t_async < t_sync - 0.25 * min(x, y), (t_sync, t_async)
  assert t_async < max(x, y) + t_other + 0.8, (t_async, t_other)  # slack for a loaded machine
  assert all(h["rollout/wait_s"] < x for h in asynchronous[steady])  # devices barely wait
  for h in asynchronous:
    assert {"sync/gather_s", "sync/write_s", "sync/server_load_s", "sync/servers_paused_s"} <= set(h)


def test_samples_older_than_the_bound_are_dropped_and_counted(tmp_path):
  with FakeSGLang(fault="stale_versions") as fake:  # reports weights 2 versions behind
    history = train_lib.Trainer(
      make_cfg(tmp_path, "k2", rollout={"sync": {"max_staleness": 2, "mismatch_check": False}}, train={"steps": 4}),
      DECOUPLED,
      urls=[fake.url],
    ).run(progress=False)
    # Generated ahead (asynchronously) by a lagging server: the older samples are dropped and
    # counted, the trained ones are exactly at the bound.
    assert [h["rollout/staleness_max"] for h in history] == [0, 1, 2, 2]  # 0, 1: versions 0, 0, ...
    assert all(h["rollout/staleness_mean"] <= 2 for h in history)
    fake.weight_version = "init"
    trainer = train_lib.Trainer(
      make_cfg(tmp_path, "k1", rollout={"sync": {"max_staleness": 1, "mismatch_check": False}}, train={"steps": 6}),
      DECOUPLED,
      urls=[fake.url],
    )
    with pytest.raises(train_lib.TrainingError, match="no sample within max_staleness 1"):
      trainer.run(progress=False)
  rows = [json.loads(line) for line in (tmp_path / "k1" / "metrics.jsonl").read_text().splitlines()]
  assert all(r["rollout/staleness_max"] <= 1 for r in rows)  # nothing older was trained on


def test_asynchronous_faults_stop_cleanly_and_resume(tmp_path):
  cfg = lambda name, steps: make_cfg(
    tmp_path, name, rollout={"sync": {"max_staleness": 1, "mismatch_check": False}}, train={"steps": steps}
  )
  # A server dying mid-generation: the producer's error stops the run at that batch.
  with FakeSGLang(fault="die_after", after=3) as fake:
    trainer = train_lib.Trainer(cfg("dies", 6), DECOUPLED, urls=[fake.url])
    with pytest.raises(train_lib.TrainingError, match=r"rollout batch \d: .*HTTP 503"):
      trainer.run(progress=False)
  assert not trainer_thread_alive()
  with FakeSGLang() as healthy:
    resumed = train_lib.Trainer(cfg("dies", 4), DECOUPLED, urls=[healthy.url])
    history = resumed.run(resume=True, progress=False)
  assert resumed.step == 4 and history and history[-1]["step"] == 4
  # A sync failing while the next rollout is in flight.
  with FakeSGLang(fault="sync_fail", after=3, generate_delay_s=0.3) as fake:  # fails at the step-2 sync
    trainer = train_lib.Trainer(cfg("sync", 6), DECOUPLED, urls=[fake.url])
    with pytest.raises(train_lib.TrainingError, match=r"weight sync at step \d failed: .*shapes mismatch"):
      trainer.run(progress=False)
    last_update = max(i for i, r in enumerate(fake.requests) if r == ("POST", "/update_weights_from_disk"))
    assert ("POST", "/continue_generation") in fake.requests[last_update:]  # never left paused
  assert not trainer_thread_alive()
  assert trainer.checkpoints.latest_step() is not None  # the last checkpoint is whole


def trainer_thread_alive() -> bool:
  import threading

  return any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


# ---- several processes ----------------------------------------------------------------------


def _launch(config, url, run_dir, nproc, *extra):
  port = free_port()
  cmd = [
    sys.executable,
    "-m",
    "trainers.cli",
    "train",
    "--config",
    str(config),
    "--sglang-url",
    url,
    "--run-dir",
    str(run_dir),
    "--no-progress",
    *extra,
  ]
  if nproc == 1:
    return [subprocess.Popen(cmd, env=cpu_process_env(8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
  return [
    subprocess.Popen(
      cmd
      + [
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(nproc),
        "--process-id",
        str(i),
        "--heartbeat-timeout",
        "30",
      ],
      env=cpu_process_env(8 // nproc),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(nproc)
  ]


def _wait(procs, timeout=900):
  logs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  return logs


def _metrics(run_dir):
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def f32_server(tmp_path_factory):
  with embedded_server(tmp_path_factory, "float32") as srv:
    yield srv


@pytest.mark.slow
@pytest.mark.multihost
def test_two_processes_equal_one_process_through_a_kill_and_resume(f32_server, tmp_path):
  """1 process x 8 devices vs 2 processes x 4 devices for 3 steps. The 2-process run is hit by
  kill -9 of process 1 after its step-1 checkpoint: process 0 stops with an error (no hang),
  and `--resume` on 2 processes finishes. Metrics, parameters and the HF weights the server
  loaded equal the 1-process run's; the 2-process weights (one file per process) load in
  transformers."""
  import torch
  import transformers

  raw = json.loads(json.dumps(BASE))
  raw["train"].update(steps=3, adam_eps=1e-4)  # Adam eps: see test_step (rounding noise is not amplified)
  raw["rollout"]["placement"] = {"server_dtype": "float32"}
  raw["parallel"] = {"data": 2, "fsdp": 4}
  config = tmp_path / "cfg.yaml"
  config.write_text(json.dumps(raw))
  _wait(_launch(config, f32_server.url, tmp_path / "one", 1))

  procs = _launch(config, f32_server.url, tmp_path / "two", 2)
  deadline = time.time() + 600
  while not (tmp_path / "two" / "checkpoints" / "1").exists():
    assert all(p.poll() is None for p in procs) and time.time() < deadline, [p.poll() for p in procs]
    time.sleep(0.1)
  procs[1].send_signal(signal.SIGKILL)
  killed_at = time.time()
  out = procs[0].communicate(timeout=300)[0]
  procs[1].communicate()
  assert procs[0].returncode != 0 and time.time() - killed_at < 120, out[-3000:]
  logs = _wait(_launch(config, f32_server.url, tmp_path / "two", 2, "--resume"))
  assert "resumed from checkpoint at step" in logs[0] and "2 process(es)" in logs[0]
  assert "reward:" in logs[0] and "reward:" not in logs[1]  # process 0 reports, process 1 is quiet

  one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
  assert sorted(one) == sorted(two) == [1, 2, 3]
  for step in one:
    assert one[step]["reward_mean"] == two[step]["reward_mean"], step
    for key in ("loss", "pg_loss", "grad_norm", "mis_k3_kl", "entropy_loss"):
      np.testing.assert_allclose(two[step][key], one[step][key], rtol=1e-4, atol=2e-5, err_msg=f"{step} {key}")
  w_one = read_hf_tensors(tmp_path / "one" / "weights" / "step_3")
  w_two = read_hf_tensors(tmp_path / "two" / "weights" / "step_3")
  assert sorted(os.listdir(tmp_path / "two" / "weights" / "step_3")) == [
    "config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
  ]
  assert sorted(w_one) == sorted(w_two)
  for k in w_one:
    np.testing.assert_allclose(w_two[k], w_one[k], rtol=1e-4, atol=1e-5 * np.abs(w_one[k]).max(), err_msg=k)
  served = f32_server_weights(f32_server)
  assert served == str(tmp_path / "two" / "weights" / "step_3")  # what the server loaded last
  hf = transformers.AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
  for name, tensor in hf.state_dict().items():
    if name in w_two:
      assert np.array_equal(tensor.numpy(), w_two[name]), name


def f32_server_weights(server) -> str:
  import httpx

  return httpx.get(server.url + "/model_info").json()["model_path"]


@pytest.mark.parametrize(
  "flags,fragment",
  [
    (["--num-processes", "2"], "missing --coordinator-address (or JAX_COORDINATOR_ADDRESS), --process-id"),
    (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id 2 must be in [0"),
    (["--coordinator-address", "nohost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
  ],
)
def test_bad_process_flags_are_one_line_errors(flags, fragment, capsys):
  from trainers import cli

  assert cli.main(["train", "--config", "configs/demo.yaml", *flags]) == 2
  assert fragment in capsys.readouterr().err


def test_async_config_rules(tmp_path):
  with pytest.raises(mis_jax.ConfigError, match="rollout.sync.max_staleness 1 with rollout.sync.sync_every 2"):
    resolve(make_cfg(tmp_path, rollout={"sync": {"max_staleness": 1, "sync_every": 2}}, checkpoint={"every": 2})).task
  with pytest.warns(UserWarning, match="only decoupled PPO .* corrects for stale rollouts"):
    resolve(make_cfg(tmp_path, rollout={"sync": {"max_staleness": 1}})).task
  from trainers.config import TrainConfig

  cfg = TrainConfig.from_yaml("configs/async.yaml")
  assert (cfg.rollout.sync.max_staleness, cfg.rollout.sync.pause_mode) == (1, "retract")
  assert cfg.loss.algorithm == "decoupled_ppo"


@pytest.mark.slow
@pytest.mark.multihost
def test_moe_routing_replay_two_processes_equal_one(tmp_path):
  """A Qwen3-MoE with R3 on an expert axis (fsdp 2 x expert 4): 1 process x 8 devices vs 2
  processes x 4 devices for 2 steps — the routed experts reach process 1 through the rollout
  broadcast, and metrics (routing mismatch included) and the pushed weights agree."""
  from trainers.models import init_checkpoint
  from trainers.serving.embedded.server import EmbeddedServer

  weights = tmp_path / "moe-init"
  init_checkpoint(weights, preset="tiny-qwen3-moe", seed=1)
  raw = json.loads(json.dumps(BASE))
  raw["model"] = {"path": str(weights)}
  raw["train"].update(steps=2, adam_eps=1e-4)
  raw["rollout"].update(placement={"server_dtype": "float32"}, sampling={"routing_replay": "r3"})
  raw["parallel"] = {"fsdp": 2, "expert": 4}
  config = tmp_path / "cfg.yaml"
  config.write_text(json.dumps(raw))
  with EmbeddedServer(str(weights), dtype="float32", seed=0, extra_args=("--enable-return-routed-experts",)) as srv:
    _wait(_launch(config, srv.url, tmp_path / "one", 1))
    _wait(_launch(config, srv.url, tmp_path / "two", 2))
  one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
  assert sorted(one) == sorted(two) == [1, 2]
  for step in one:
    assert one[step]["reward_mean"] == two[step]["reward_mean"], step
    assert one[step]["routing_mismatch_frac"] == two[step]["routing_mismatch_frac"] == 0.0
    for key in ("loss", "grad_norm", "mis_k3_kl", "entropy_loss"):
      np.testing.assert_allclose(two[step][key], one[step][key], rtol=1e-4, atol=2e-5, err_msg=f"{step} {key}")
  w_one = read_hf_tensors(tmp_path / "one" / "weights" / "step_2")
  w_two = read_hf_tensors(tmp_path / "two" / "weights" / "step_2")
  assert sorted(w_one) == sorted(w_two) and "model.layers.1.mlp.experts.7.up_proj.weight" in w_one
  for k in w_one:
    np.testing.assert_allclose(w_two[k], w_one[k], rtol=1e-4, atol=1e-5 * np.abs(w_one[k]).max(), err_msg=k)
