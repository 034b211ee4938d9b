"""The sharded loss under jax.distributed with 2 processes x 4 CPU devices (gloo collectives,
coordinator on 127.0.0.1) equals the single-process result."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import test_sharding as ts
from helpers import cpu_process_env, free_port
from test_sharding import single_device  # noqa: F401  (fixture)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, single_device):  # noqa: F811  (the fixture)
  out = tmp_path / "result.json"
  port = free_port()
  worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
  procs = [
    subprocess.Popen(
      [sys.executable, worker, str(i), "2", str(port), str(out)],
      env=cpu_process_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  results = json.loads(out.read_text())
  for cfg, got, (loss0, metrics0, grad0) in zip(ts.CONFIGS, results, single_device):
    np.testing.assert_allclose(got["loss"], float(loss0), rtol=1e-5, atol=1e-7, err_msg=cfg.algorithm)
    assert set(got["metrics"]) == set(metrics0)
    for k, v in metrics0.items():
      np.testing.assert_allclose(got["metrics"][k], float(v), rtol=1e-5, atol=1e-6, err_msg=k)
    for g, g0 in zip(got["grad"], jax.tree_util.tree_leaves(grad0)):
      g0 = np.asarray(g0)
      np.testing.assert_allclose(np.asarray(g), g0, rtol=1e-5, atol=1e-6 * np.abs(g0).max())
