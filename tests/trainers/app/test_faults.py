"""Long runs survive their faults (docs/guides/trainer.md, "Faults and preemption"): a server
killed and restarted mid-run is waited for and gets the trainer's weights back; the live servers
carry on while one is down; SIGTERM / SIGINT checkpoint the last finished step and exit 0; a
second signal exits at once and the embedded server goes with the trainer; `--resume` continues
exactly, with every step logged and recorded once; a checkpoint that cannot be written stops the
run with the previous one whole."""

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import mis_jax
from fake_sglang import FakeSGLang
from helpers import cpu_process_env, free_port
from test_train import ALGORITHMS, BASE, make_cfg, merged
from trainers.models import init_checkpoint
from trainers.serving.embedded.server import EmbeddedServer
from trainers.app import checkpointing, trainer as train_lib
from trainers.rollout import records as rollout_records
from trainers.config import TrainConfig

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

DECOUPLED = mis_jax.LossConfig(**ALGORITHMS["decoupled_ppo"])


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """A starting checkpoint and a float32 `mis-jax serve` on it, on a port of its own."""
  path = tmp_path_factory.mktemp("start")
  init_checkpoint(path, preset="tiny-qwen3", seed=3)
  port = free_port()
  srv = EmbeddedServer(str(path), dtype="float32", port=port, extra_args=("--weight-version", "0"))
  yield str(path), srv
  srv.close()


def _cfg(tmp_path, name, path, steps=4, **sections):
  rollout = merged(
    {"sampling": {"max_new_tokens": 4}, "placement": {"server_dtype": "float32"}}, sections.pop("rollout", {})
  )
  train = {"steps": steps, "row_len": 16, "ppo_epochs": 1, **sections.pop("train", {})}
  return make_cfg(tmp_path, name, model={"path": path}, rollout=rollout, train=train, **sections)


def _steps(run_dir):
  return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _when_logged(run_dir, step, action, timeout=600):
  """Runs `action()` in a thread once `metrics.jsonl` holds `step`."""

  def watch():
    deadline = time.time() + timeout
    while time.time() < deadline:
      if (run_dir / "metrics.jsonl").exists() and step in _steps_safe(run_dir):
        return action()
      time.sleep(0.02)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


def _steps_safe(run_dir):
  try:
    return _steps(run_dir)
  except (ValueError, FileNotFoundError):
    return []


def test_a_server_killed_and_restarted_mid_run_is_waited_for(start, tmp_path):
  """The server dies (SIGKILL) after step 2 and comes back 3 s later on the same port with its
  starting weights. The run waits, pushes the served weights into it, redoes the step, and
  finishes: each step once, and every step's log-probs agree with the server's at float32
  level (a restarted server left on its starting weights would differ from step 3 on)."""
  path, srv = start
  port = int(srv.url.rsplit(":", 1)[1])
  box = {}

  def restart():
    srv.process.kill()
    srv.process.wait()
    time.sleep(3)
    box["server"] = EmbeddedServer(path, dtype="float32", port=port, extra_args=("--weight-version", "0"))

  cfg = _cfg(
    tmp_path,
    "restart",
    path,
    steps=5,
    rollout={"transport": {"server_restart_timeout_s": 120, "backoff_s": 0.05}, "sync": {"initial_sync": "always"}},
  )
  trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url])
  watcher = _when_logged(tmp_path / "restart", 2, restart)
  try:
    history = trainer.run(progress=False)
  finally:
    watcher.join(timeout=120)
    srv.process = box["server"].process if "server" in box else srv.process  # the fixture stops it
  assert _steps(tmp_path / "restart") == [1, 2, 3, 4, 5]
  assert sum(h["rollout/server_restarts"] for h in history) == 1
  assert sum(h["rollout/unavailable_s"] for h in history) > 1.0
  assert [h["server_weight_version"] for h in history] == ["0", "1", "2", "3", "4"]
  for h in history:
    assert h["mis_k3_kl"] < 1e-6 and h["train_rollout_logprob_abs_diff"] < 1e-3, h["step"]


def test_the_live_servers_carry_on_while_one_is_down(tmp_path):
  """Two servers; one goes away after step 1 and is back at step 3 on its port: the other serves
  every request meanwhile, and the returning one gets the served weights before it serves."""
  with FakeSGLang() as keeps, FakeSGLang() as leaves:
    port = int(leaves.url.rsplit(":", 1)[1])
    back = {}

    def leave_then_return():
      leaves.close()
      while 3 not in _steps_safe(tmp_path / "two"):
        time.sleep(0.02)
      back["fake"] = FakeSGLang(port=port)

    watcher = _when_logged(tmp_path / "two", 1, leave_then_return)
    trainer = train_lib.Trainer(
      make_cfg(
        tmp_path,
        "two",
        train={"steps": 6, "ppo_epochs": 1},
        rollout={
          "transport": {"prompts_per_request": 1, "server_restart_timeout_s": 60},
          "sync": {"mismatch_check": False},
        },
      ),
      mis_jax.LossConfig(),
      urls=[keeps.url, leaves.url],
    )
    slow = trainer.train_on
    trainer.train_on = lambda sb: (time.sleep(0.2), slow(sb))[1]  # time for the watcher between steps
    history = trainer.run(progress=False)
    watcher.join(timeout=60)
    returned = back["fake"]
    try:
      assert _steps(tmp_path / "two") == [1, 2, 3, 4, 5, 6]
      assert sum(h["rollout/server_restarts"] for h in history) == 1
      assert all(h["num_samples"] == 16 for h in history)  # nothing lost while one was down
      posts = [p for m, p in returned.requests if m == "POST"]
      assert posts[:3] == ["/pause_generation", "/flush_cache", "/update_weights_from_disk"]  # weights first
      assert "/generate" in posts
    finally:
      returned.close()


def _launch(config, run_dir, *extra, url=None):
  cmd = [
    sys.executable,
    "-m",
    "trainers.cli",
    "train",
    "--config",
    str(config),
    "--run-dir",
    str(run_dir),
    "--no-progress",
    *(["--sglang-url", url] if url else []),
    *extra,
  ]
  return subprocess.Popen(cmd, env=cpu_process_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _config(tmp_path, path, steps, every):
  raw = json.loads(json.dumps(BASE))
  raw["model"] = {"path": path}
  raw["rollout"] = merged(raw["rollout"], {"sampling": {"max_new_tokens": 4}, "placement": {"server_dtype": "float32"}})
  raw["train"].update(steps=steps, ppo_epochs=1, row_len=16)
  raw["checkpoint"] = {"every": every, "max_to_keep": 2}
  config = tmp_path / f"cfg-{steps}-{every}.yaml"
  config.write_text(json.dumps(raw))
  return config


def _signal_after(proc, run_dir, step, *signals, timeout=600):
  deadline = time.time() + timeout
  while step not in _steps_safe(run_dir):
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() else "timeout"
    time.sleep(0.02)
  for sig in signals:
    proc.send_signal(sig)
    time.sleep(0.05)
  return proc.communicate(timeout=300)[0]


def test_sigterm_checkpoints_the_last_step_exits_0_and_resume_logs_each_step_once(start, tmp_path):
  """(SIGINT takes the same path: the exact-resume test below stops its run with it.)"""
  path, srv = start
  sig = signal.SIGTERM
  config = _config(tmp_path, path, steps=5, every=4)  # the stop's checkpoint is not a periodic one
  proc = _launch(config, tmp_path / "run", url=srv.url)
  out = _signal_after(proc, tmp_path / "run", 1, sig)
  assert proc.returncode == 0, out[-3000:]
  stopped = _steps(tmp_path / "run")
  assert f"preempted by {sig.name} after step {stopped[-1]}" in out and stopped == list(range(1, len(stopped) + 1))
  assert checkpointing.Checkpointer(str(tmp_path / "run" / "checkpoints")).latest_step() == stopped[-1] < 5
  resumed = _launch(config, tmp_path / "run", "--resume", url=srv.url)
  out = resumed.communicate(timeout=600)[0]
  assert resumed.returncode == 0 and f"resumed from checkpoint at step {stopped[-1]}" in out, out[-3000:]
  assert _steps(tmp_path / "run") == [1, 2, 3, 4, 5]


def test_a_second_signal_exits_at_once_and_the_embedded_server_goes_with_the_trainer(start, tmp_path):
  """No --sglang-url: the trainer starts its own server. Two SIGTERMs: exit 143 at once, the last
  whole checkpoint restorable, and the server gone (it stops when its parent is gone)."""
  path, _ = start
  config = _config(tmp_path, path, steps=50, every=1)
  proc = _launch(config, tmp_path / "run")
  deadline = time.time() + 600
  while not psutil.Process(proc.pid).children() and time.time() < deadline:
    time.sleep(0.1)
  (server,) = psutil.Process(proc.pid).children()
  while not (tmp_path / "run" / "checkpoints" / "2").is_dir():  # a whole checkpoint (Orbax renames it when done)
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.02)
  out = _signal_after(proc, tmp_path / "run", 2, signal.SIGTERM, signal.SIGTERM)
  assert proc.returncode == 128 + signal.SIGTERM and "exiting at once" in out, out[-3000:]
  gone, alive = psutil.wait_procs([server], timeout=30)
  assert not alive, "the embedded server outlived the trainer"
  cfg = TrainConfig.from_yaml(str(config)).replace(run_dir=str(tmp_path / "run"))
  trainer = train_lib.Trainer(cfg, urls=["http://127.0.0.1:9"])
  assert trainer.restore_latest() and trainer.step == trainer.checkpoints.latest_step() >= 2


@pytest.fixture(scope="module")
def records(start, tmp_path_factory):
  """Six steps of rollout records from the float32 server."""
  path, srv = start
  tmp = tmp_path_factory.mktemp("records")
  cfg = _cfg(tmp, "rec", path, steps=6, rollout={"records": {"save_dir": str(tmp / "records")}})
  train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url]).run(progress=False)
  return path, str(tmp / "records")


def _replay(tmp_path, name, records, steps=6, every=5):
  path, load_dir = records
  return _cfg(
    tmp_path,
    name,
    path,
    steps=steps,
    checkpoint={"every": every, "max_to_keep": 3},
    rollout={"records": {"load_dir": load_dir, "save_dir": str(tmp_path / name / "records")}},
  )


def test_resume_after_a_signal_is_exact_and_each_step_is_logged_and_recorded_once(records, tmp_path):
  """Records replay makes the rollouts the same: a run stopped by SIGINT (Ctrl-C) and resumed ends with
  the uninterrupted run's parameters and optimiser state, bit for bit. Rows a killed run logged
  past its checkpoint (and a line cut short) are dropped on resume."""
  whole = train_lib.Trainer(_replay(tmp_path, "whole", records), DECOUPLED, urls=[])
  whole_history = whole.run(progress=False)

  stopped = train_lib.Trainer(_replay(tmp_path, "stopped", records), DECOUPLED, urls=[])
  slow = stopped.train_on
  stopped.train_on = lambda sb: (time.sleep(0.3), slow(sb))[1]
  watcher = _when_logged(tmp_path / "stopped", 2, lambda: os.kill(os.getpid(), signal.SIGINT))
  stopped.run(progress=False)
  watcher.join()
  assert stopped.preempted and 2 <= stopped.step < 6
  k = stopped.step
  with open(tmp_path / "stopped" / "metrics.jsonl", "a") as f:  # as if killed after logging past step k
    f.write(json.dumps({"step": k + 1, "loss": 0.0}) + "\n" + '{"step": ')
  resumed = train_lib.Trainer(_replay(tmp_path, "stopped", records), DECOUPLED, urls=[])
  resumed.run(resume=True, progress=False)

  assert _steps(tmp_path / "stopped") == [1, 2, 3, 4, 5, 6]
  rows = {
    json.loads(line)["step"]: json.loads(line)
    for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
  }
  for h in whole_history:
    assert rows[h["step"]]["loss"] == h["loss"] and rows[h["step"]]["grad_norm"] == h["grad_norm"], h["step"]
  assert sorted(rollout_records.list_steps(str(tmp_path / "stopped" / "records"))) == [1, 2, 3, 4, 5, 6]
  for a, b in zip(*(jax_leaves(t) for t in ((whole.params, whole.opt_state), (resumed.params, resumed.opt_state)))):
    assert np.array_equal(a, b)


def jax_leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_previous_one(records, tmp_path):
  """A full disk for the trainer's process (RLIMIT_FSIZE: writes past 64 KiB fail with EFBIG)
  once step 1's checkpoint is written: the run stops with an error naming step 2 and the
  directory, and step 1's checkpoint is whole."""
  cfg = _replay(tmp_path, "full", records, steps=4, every=1)
  trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[])
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  save = trainer.save_checkpoint

  def save_then_fill_the_disk():
    save()
    if trainer.step == 1:
      trainer.checkpoints.wait()
      resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))

  trainer.save_checkpoint = save_then_fill_the_disk
  try:
    with pytest.raises(
      train_lib.TrainingError,
      match=r"the checkpoint of step 2 could not be written to "
      rf"{tmp_path / 'full' / 'checkpoints'}: .*File too large.*The last whole checkpoint is step 1",
    ):
      trainer.run(progress=False)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, previous)
  again = train_lib.Trainer(cfg, DECOUPLED, urls=[])
  assert again.restore_latest() and again.step == 1


@pytest.mark.slow
@pytest.mark.multihost
def test_two_processes_stop_after_the_same_step_on_a_signal_to_one(start, tmp_path):
  """2 processes x 4 devices; SIGTERM to process 1 only: both finish the same step, one checkpoint
  of it is saved, both exit 0; `--resume` on 2 processes logs each step once."""
  path, srv = start
  config = _config(tmp_path, path, steps=5, every=4)
  port = free_port()

  def launch(*extra):
    return [
      subprocess.Popen(
        [
          sys.executable,
          "-m",
          "trainers.cli",
          "train",
          "--config",
          str(config),
          "--run-dir",
          str(tmp_path / "run"),
          "--no-progress",
          "--sglang-url",
          srv.url,
          "--coordinator-address",
          f"127.0.0.1:{port}",
          "--num-processes",
          "2",
          "--process-id",
          str(i),
          *extra,
        ],
        env=cpu_process_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
      for i in range(2)
    ]

  procs = launch()
  _signal_after(procs[1], tmp_path / "run", 1, signal.SIGTERM)
  out = procs[0].communicate(timeout=300)[0]
  assert [p.returncode for p in procs] == [0, 0], out[-3000:]
  stopped = _steps(tmp_path / "run")
  assert f"preempted by another process after step {stopped[-1]}" in out
  assert checkpointing.Checkpointer(str(tmp_path / "run" / "checkpoints")).latest_step() == stopped[-1] < 5
  port = free_port()
  procs = launch("--resume")
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:]
  assert _steps(tmp_path / "run") == [1, 2, 3, 4, 5]
