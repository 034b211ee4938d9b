"""A crash at any instant changes nothing (docs/guides/trainer.md, "Crash guarantees"). The trainer
(`mis-jax train` in a process group of its own) is SIGKILLed at named points of a step by the crash
hook (`trainers.runtime.faults`, `MIS_JAX_FAULT=POINT:STEP:ACTION`, reached deterministically: no
timing decides where it dies), its whole process group or itself alone, then `--resume`d until it
finishes; every run ends bitwise equal to one uninterrupted run: each step's metrics row (logged
once), its rollout records, the final parameters, optimiser state and checkpoint metadata, and the
weights the servers were last given. The rollouts come from a float32 `mis-jax serve` with a seed
per sample, so a redone step samples the same tokens from the same weights.

Also the two defects of issue 62: a resumed run's served weights deleted by the push's pruning (it
kept the two highest-numbered directories, and a kill leaves two newer than the checkpoint), and
the wait that never ended once a restarted server answered `/health` but could not load them."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import psutil
import pytest

from helpers import cpu_process_env, free_port
from test_train import BASE, merged
from trainers import cli
from trainers.app import checkpointing, trainer as train_lib
from trainers.config import TrainConfig
from trainers.models import init_checkpoint
from trainers.rollout import records as rollout_records
from trainers.runtime import faults
from trainers.serving.embedded.server import EmbeddedServer

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = 6
DEVICES = 8  # the suite's (tests/conftest.py): the subprocesses run the programs the in-process runs do
# What a redone step may change: how long it took, and a server restart it waited for.
TIMING = ("rollout_s", "train_s", "sync_s", "step_s", "tokens_per_s", "rollout/unavailable_s")
RESTART = ("rollout/server_restarts",)


def _serve(path, port):
  """The float32 `mis-jax serve` a trainer would start on `path` (`trainers.rollout.backend.start_server`),
  on `port`."""
  return EmbeddedServer(
    str(path),
    dtype="float32",
    seed=0,
    port=port,
    extra_args=("--enable-return-routed-experts", "--weight-version", "0"),
  )


@dataclasses.dataclass
class World:
  root: object
  config: str
  port: int
  server: EmbeddedServer
  reference: str  # the uninterrupted run's directory

  @property
  def url(self):
    return f"http://127.0.0.1:{self.port}"

  def args(self, run_dir) -> list[str]:
    return [
      "--config",
      self.config,
      "--run-dir",
      str(run_dir),
      "--no-progress",
      "--set",
      f"rollout.records.save_dir={run_dir / 'records'}",
    ]

  def cfg(self, run_dir) -> TrainConfig:
    cfg = TrainConfig.from_yaml(self.config)
    return cfg.replace(
      run_dir=str(run_dir),
      rollout=dataclasses.replace(
        cfg.rollout, records=dataclasses.replace(cfg.rollout.records, save_dir=str(run_dir / "records"))
      ),
    )

  def run_here(self, run_dir, *, resume: bool):
    """The run in this process (the suite's 8 devices), through the shared server."""
    trainer = train_lib.Trainer(self.cfg(run_dir), urls=[self.url])
    return trainer.run(resume=resume, progress=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """A float32 server on a port of its own (a test restarts it there) and the uninterrupted run:
  6 steps, a checkpoint every 2, rollout records, a push after every step."""
  root = tmp_path_factory.mktemp("crash")
  init_checkpoint(root / "start", preset="tiny-qwen3", seed=3)
  raw = merged(
    BASE,
    {
      "model": {"path": str(root / "start")},
      "rollout": {
        "sampling": {"max_new_tokens": 4},
        "placement": {"server_dtype": "float32"},
        "sync": {"initial_sync": "always"},
        "transport": {"prompts_per_request": 4, "server_restart_timeout_s": 120, "backoff_s": 0.05},
      },
      "train": {"steps": STEPS, "ppo_epochs": 1, "row_len": 16},
      "checkpoint": {"every": 2, "max_to_keep": 3},
      "loss": {"algorithm": "decoupled_ppo", "mis": {"use_rs": True, "tis_mode": "mask"}},
    },
  )
  (root / "config.json").write_text(json.dumps(raw))
  port = free_port()
  box = World(root, str(root / "config.json"), port, _serve(root / "start", port), str(root / "reference"))
  try:
    box.run_here(root / "reference", resume=False)
    yield box
  finally:
    box.server.close()


class Launched:
  """`mis-jax train` in a session (and process group) of its own, its output read as it comes."""

  def __init__(self, world, run_dir, *, fault=None, resume=False, own_server=False):
    env = {**cpu_process_env(DEVICES), "PYTHONUNBUFFERED": "1"}
    if fault:
      env[faults.ENV] = fault
    argv = [
      sys.executable,
      "-m",
      "trainers.cli",
      "train",
      *world.args(run_dir),
      *(["--resume"] if resume else []),
      *([] if own_server else ["--sglang-url", world.url]),
    ]
    self.proc = subprocess.Popen(
      argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    self.lines: list[str] = []
    self._seen = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      with self._seen:
        self.lines.append(line)
        self._seen.notify_all()
    with self._seen:
      self.lines.append("")  # EOF
      self._seen.notify_all()

  @property
  def output(self) -> str:
    return "".join(self.lines)

  def wait_for_line(self, pattern: str, timeout=300) -> str:
    """The first output line matching `pattern` (waiting for it)."""
    deadline = time.monotonic() + timeout
    with self._seen:
      while True:
        found = next((line for line in self.lines if line and re.search(pattern, line)), None)
        if found is not None:
          return found
        left = deadline - time.monotonic()
        assert left > 0 and self.lines[-1:] != [""], f"no line matches {pattern!r}:\n{self.output[-3000:]}"
        self._seen.wait(timeout=left)

  def wait(self, timeout=300) -> int:
    return self.proc.wait(timeout=timeout)

  def killed(self, point: str, step: int) -> None:
    """It died of the crash hook's SIGKILL at `point` of `step`, and nothing of its session is left."""
    code = self.wait()
    assert code == -signal.SIGKILL, self.output[-3000:]
    assert f"{faults.ENV}: " in self.output and f"at {point} of step {step}" in self.output, self.output[-3000:]
    _no_process_left(self.proc.pid)

  def stopped(self, timeout=300) -> None:
    """Waits until it stopped itself (the crash hook's `stop`)."""
    deadline = time.monotonic() + timeout
    while True:
      pid, status = os.waitpid(self.proc.pid, os.WUNTRACED | os.WNOHANG)
      if pid and os.WIFSTOPPED(status):
        return
      assert pid == 0 and time.monotonic() < deadline, self.output[-3000:]
      time.sleep(0.05)


def _no_process_left(session: int, timeout=30) -> None:
  """No live process of the killed trainer's session: its server went with it, or stopped itself."""
  deadline = time.monotonic() + timeout
  while True:
    alive = []
    for p in psutil.process_iter(["status"]):
      try:
        if os.getsid(p.pid) == session and p.info["status"] != psutil.STATUS_ZOMBIE:
          alive.append(p.pid)
      except (ProcessLookupError, psutil.Error):
        pass
    if not alive:
      return
    assert time.monotonic() < deadline, f"processes of the killed trainer outlived it: {alive}"
    time.sleep(0.1)


def _rows(run_dir) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _weight_dirs(run_dir) -> list[str]:
  return sorted(d for d in os.listdir(os.path.join(run_dir, "weights")) if d.startswith("step_"))


def _final_state(run_dir, like):
  state, meta = checkpointing.Checkpointer(os.path.join(run_dir, "checkpoints")).restore_latest(like)
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)], meta


def assert_same_as_reference(world, run_dir, *, restarted=False):
  """Bitwise the uninterrupted run: every step logged once with its values (the timings aside, and a
  server restart's count when one restarted), its records, the final checkpoint (parameters,
  optimiser state, metadata) and the weights pushed last (the only weight directory left)."""
  ref, got = _rows(world.reference), _rows(run_dir)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  skip = TIMING + (RESTART if restarted else ())
  for a, b in zip(ref, got):
    keep = lambda row: {k: v for k, v in row.items() if k not in skip and not k.startswith(("sync/", "rollout/wait"))}
    assert keep(b) == keep(a), {k: (keep(a).get(k), v) for k, v in keep(b).items() if keep(a).get(k) != v}
  ref_records = rollout_records.list_steps(os.path.join(world.reference, "records"))
  got_records = rollout_records.list_steps(os.path.join(run_dir, "records"))
  assert sorted(got_records) == sorted(ref_records) == list(range(1, STEPS + 1))
  for step in ref_records:
    (a, meta_a), (b, meta_b) = (rollout_records.read_step(p[step]) for p in (ref_records, got_records))
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), step
    assert meta_a["batch_index"] == meta_b["batch_index"], step
  like = train_lib.Trainer(world.cfg(world.root / "like"), urls=[world.url])
  like = {"params": like.params, "opt_state": like.opt_state}
  (want, want_meta), (have, have_meta) = (_final_state(d, like) for d in (world.reference, run_dir))
  assert have_meta == want_meta and want_meta["step"] == STEPS, (have_meta, want_meta)
  assert want_meta["num_old_logprob_passes"] == STEPS  # the run's, not the resumed process's
  assert len(have) == len(want) and all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(have, want))
  assert _weight_dirs(run_dir) == _weight_dirs(world.reference) == [f"step_{STEPS}"]
  for name in sorted(os.listdir(os.path.join(world.reference, "weights", f"step_{STEPS}"))):
    if name.endswith((".safetensors", ".json")):
      a, b = (open(os.path.join(d, "weights", f"step_{STEPS}", name), "rb").read() for d in (world.reference, run_dir))
      assert a == b, name


@pytest.mark.parametrize("value", ["metrics", "metrics:x", "nowhere:3", "metrics:3:explode", "metrics:3:kill:1"])
def test_a_malformed_hook_stops_before_anything_starts(tmp_path, monkeypatch, capsys, value):
  monkeypatch.setenv(faults.ENV, value)
  assert cli.main(["train", "--config", "configs/demo.yaml", "--run-dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert f"{faults.ENV}={value!r}: expected POINT:STEP[:ACTION] with POINT one of weights, pushed, metrics, " in err
  assert not (tmp_path / "run").exists()


def test_the_process_group_killed_after_a_metrics_row(world, tmp_path):
  """The trainer with the `mis-jax serve` it started, SIGKILLed together (the process group, as a
  node lost) once step 3's row is in `metrics.jsonl` and before its checkpoint: the resumed run drops
  that row and redoes the step, on another server (the shared one) from the pushed weights."""
  run = tmp_path / "run"
  killed = Launched(world, run, fault="metrics:3:kill-group", own_server=True)
  killed.killed("metrics", 3)
  assert [r["step"] for r in _rows(run)] == [1, 2, 3]
  assert checkpointing.Checkpointer(str(run / "checkpoints")).latest_step() in (0, 2, None)
  world.run_here(run, resume=True)
  assert_same_as_reference(world, run)


def test_the_trainer_killed_inside_a_checkpoint_write(world, tmp_path):
  """The trainer alone SIGKILLed inside step 4's checkpoint write (Orbax's files written, the
  temporary directory not yet renamed, in its background thread, while the loop goes on): step 4's
  checkpoint is not whole, the run resumes from step 2's and redoes the steps after it (their rows,
  records and weights written again)."""
  run = tmp_path / "run"
  killed = Launched(world, run, fault="checkpoint:4:kill")
  killed.killed("checkpoint", 4)
  assert checkpointing.Checkpointer(str(run / "checkpoints")).latest_step() == 2
  assert any(name.startswith("4.orbax-checkpoint-tmp") for name in os.listdir(run / "checkpoints"))
  logged = [r["step"] for r in _rows(run)]  # (the loop goes on while Orbax writes: step 5 may be done too)
  assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 4
  # The last logged step's weights served (pushed before its row), the next step's maybe written or pushed.
  assert _weight_dirs(run) and set(_weight_dirs(run)) <= {f"step_{logged[-1]}", f"step_{logged[-1] + 1}"}
  world.run_here(run, resume=True)
  assert_same_as_reference(world, run)


def test_killed_after_a_weights_write_and_in_the_resumed_push_then_the_server_restarts(world, tmp_path):
  """The state that deleted a resumed run's served weights (issue 62), then the restart that hung it:

  1. the process group SIGKILLed once step 6's weights are written (no server loaded them): the
     newest whole checkpoint `r` is step 2's or 4's (Orbax writes step 4's while the loop goes on;
     step 2's is whole by then), and two weight directories are newer (step_5, served; step_6);
  2. `--resume` from step `r`, SIGKILLed during its first push (step_r written, not yet loaded);
  3. `--resume` again, stopped (SIGSTOP) once the server serves step r's weights: `weights/` holds
     step_r alone — the served directory pinned, the killed runs' newer ones gone (the pruning by name
     kept step_5 and step_6 and deleted step_r). The server is then SIGKILLed and the trainer
     continued: step r + 1's rollouts find no server (logged with its URL and the step); a new server
     on the same port (holding its starting weights) is given step r's weights, and the run finishes
     bitwise as the uninterrupted one.
  """
  run = tmp_path / "run"
  Launched(world, run, fault="weights:6:kill-group").killed("weights", 6)
  r = checkpointing.Checkpointer(str(run / "checkpoints")).latest_step()
  assert r in (2, 4) and _weight_dirs(run) == ["step_5", "step_6"]
  assert [x["step"] for x in _rows(run)] == [1, 2, 3, 4, 5]

  resumed = Launched(world, run, fault=f"weights:{r}:kill-group", resume=True)
  resumed.killed("weights", r)
  assert f"resumed from checkpoint at step {r}" in resumed.output
  assert _weight_dirs(run) == sorted([f"step_{r}", "step_5", "step_6"])

  again = Launched(world, run, fault=f"pushed:{r}:stop", resume=True)
  again.stopped()
  assert _weight_dirs(run) == [f"step_{r}"]  # the served weights kept, nothing else
  world.server.process.kill()
  world.server.process.wait()
  again.proc.send_signal(signal.SIGCONT)
  again.wait_for_line(rf"^step {r + 1}: server {re.escape(world.url)} went down \(/generate: ")
  world.server = _serve(world.root / "start", world.port)
  assert again.wait() == 0, again.output[-3000:]
  back = f"step {r + 1}: 1 server(s) back: they serve the weights of step {r} again"
  assert back in again.output, again.output[-3000:]
  assert [x["rollout/server_restarts"] for x in _rows(run)] == [int(k == r + 1) for k in range(1, STEPS + 1)]
  assert_same_as_reference(world, run, restarted=True)


@pytest.mark.repeat
@pytest.mark.parametrize(
  "fault,own_server",
  [
    ("pushed:3:kill", True),  # the trainer alone: the server it started notices and stops itself
    ("metrics:1:kill-group", False),  # before any checkpoint: --resume starts from the beginning
    ("checkpoint:2:kill-group", False),  # inside the first checkpoint's write
    ("weights:5:kill", False),
  ],
)
def test_more_kill_points(world, tmp_path, fault, own_server):
  """The same guarantee at the other points and kinds of kill (make test-all)."""
  point, step, _ = fault.split(":")
  run = tmp_path / "run"
  Launched(world, run, fault=fault, own_server=own_server).killed(point, int(step))
  world.run_here(run, resume=True)
  assert_same_as_reference(world, run)
