"""`make bench-gpu`'s script in its `--dry-run` mode: every part runs at tiny shapes on CPU, so
the script cannot rot before a GPU runs it."""

import json
import math

import pytest

from benchmarks import gpu_step


@pytest.mark.slow
def test_dry_run_measures_every_part(tmp_path):
  path = tmp_path / "gpu.json"
  assert (
    gpu_step.main(
      [
        "--dry-run",
        "--models",
        "qwen3-0.6b",
        "--sampler-model",
        "qwen3-0.6b",
        "--peak-tflops",
        "1",
        "--json",
        str(path),
      ]
    )
    == 0
  )
  out = json.loads(path.read_text())
  assert out["dry_run"] and out["peak_tflops"] == 1
  step = out["steps"]["qwen3-0.6b"]
  for key in ("step_s", "mfu", "model_tflops_per_s", "of_measured_bf16_matmul", "predicted_bytes", "loss"):
    assert math.isfinite(step[key]) and step[key] > 0, key
  sampler = out["sampler"]
  for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "handover_s", "release_s"):
    assert math.isfinite(sampler[key]) and sampler[key] > 0, key


def test_unknown_model_is_named(capsys):
  with pytest.raises(SystemExit):
    gpu_step.main(["--dry-run", "--models", "qwen3-7b"])
  assert "qwen3-7b" in capsys.readouterr().err
