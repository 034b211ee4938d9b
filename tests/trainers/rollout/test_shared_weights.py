"""The weights reach the servers through a directory (`/update_weights_from_disk`): a server that
does not see the trainer's weight directory stops the run before step 1 (`DiskSync.check_reach`),
not at the first push. The server here runs in its own mount namespace (`unshare`) with an empty
tmpfs over the trainer's run directory: the same path, another view, as a node without the shared
filesystem has."""

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

import mis_jax
from helpers import cpu_process_env, free_port
from test_train import make_cfg
from trainers.models import init_checkpoint
from trainers.serving import protocol
from trainers.app import trainer as train_lib

pytestmark = pytest.mark.integration


def test_probe_route_reads_only_probe_files(tmp_path):
  probe = tmp_path / f"{protocol.PROBE_PREFIX}abc"
  probe.write_text("abc")
  assert protocol.read_probe(str(probe)) == (200, {"readable": True, "content": "abc"})
  status, body = protocol.read_probe(str(tmp_path / f"{protocol.PROBE_PREFIX}gone"))
  assert status == 200 and body["readable"] is False and "FileNotFoundError" in body["error"]
  (tmp_path / "secret").write_text("x")
  for path in (str(tmp_path / "secret"), None, 3):
    status, body = protocol.read_probe(path)
    assert status == 400 and "must name a .mis-jax-probe-* file" in body["error"]


def server_in_own_view(model, hidden):
  """`mis-jax serve` of `model` that sees an empty tmpfs at `hidden` (its own mount namespace)."""
  port = free_port()
  serve = [
    sys.executable,
    "-m",
    "trainers.cli",
    "serve",
    "--model-path",
    str(model),
    "--dtype",
    "float32",
    "--port",
    str(port),
    "--exit-with-parent",
    "--verbose",
  ]
  script = f"mount -t tmpfs none {hidden} && exec {' '.join(serve)}"
  proc = subprocess.Popen(
    ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
    env=cpu_process_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while True:
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      pass
    if proc.poll() is not None:
      out = proc.stdout.read()
      if os.environ.get("CI") != "true" and re.search(r"unshare: |Operation not permitted", out):
        pytest.skip(f"no unprivileged mount namespace here: {out[-300:]}")
      raise AssertionError(f"the server exited with {proc.returncode}:\n{out[-3000:]}")
    assert time.monotonic() < deadline, "the server did not start"
    time.sleep(0.2)


def test_a_server_without_the_weight_directory_stops_the_run_before_step_1(tmp_path):
  model, runs = tmp_path / "model", tmp_path / "runs"
  init_checkpoint(model, preset="tiny-qwen3", seed=1)
  runs.mkdir()
  proc, url = server_in_own_view(model, runs)
  try:
    cfg = make_cfg(
      runs,
      "run",
      model={"path": str(model)},
      rollout={"placement": {"server_dtype": "float32"}, "sync": {"initial_sync": "always"}},
    )
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[url])
    weights = os.path.join(os.path.abspath(cfg.run_dir), "weights")
    with pytest.raises(train_lib.TrainingError) as e:
      trainer.run(progress=False)
    message = str(e.value)
    assert f"{url} (not readable there: FileNotFoundError" in message
    assert f"cannot read the trainer's weight directory {weights}" in message and "same path" in message
    assert trainer.step == 0 and not os.path.exists(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert not os.path.exists(weights)  # the probe and the directory it made are gone; nothing was pushed
  finally:
    proc.terminate()
    log = proc.communicate(timeout=30)[0]
  assert f"POST {protocol.READ_PROBE_ROUTE}" in log and "POST /update_weights_from_disk" not in log
  assert "POST /generate" not in log
