"""A real-size model on this host: Qwen3-0.6B's shape trained by `mis-jax train` with its embedded
server, memory and seconds per phase beside what the hardware allows, in one run.

    python -m benchmarks.real_size [--checkpoint DIR] [--runs f32,bf16,http] [--json PATH]   (make bench-real)

The checkpoint is written by `transformers` (`Qwen3ForCausalLM` of Qwen3-0.6B's config, random
weights, bfloat16 safetensors; nothing downloaded) unless `--checkpoint` names one. Each run is 3
steps of `copy_digits` (1 prompt × 8 samples a step, an entropy bonus so a random model has a
gradient, learning rate 1e-5, decoupled PPO with `configs/mis.yaml`), the checkpoint saved at the
end as every run saves it:

- `f32`: float32 compute and master weights (the defaults), the weights pushed through a file;
- `bf16`: `model.dtype: bfloat16` (float32 master weights), through a file;
- `http`: float32 as `f32`, the weights streamed over HTTP with deltas (`rollout.sync.via: http`,
  `delta: true`): the bytes each push sends.

Reported per run: the peak resident memory of the trainer and its server together (their RSS
summed, sampled every 20 ms; and each one's own high-water mark) against the state the run must
hold — float32 parameters, gradients and Adam's two moments (16 bytes a parameter) plus the
engine's bfloat16 copy (2; `http` adds its snapshot of the pushed weights, 2 more); each phase's
seconds (medians of steps 2–3), the sync's phases, and the sync against this machine's floor: the
seconds to write the pushed bytes to a file and read them back (`machine.file_floor`), measured
before and after each run; and each step's `mis_k3_kl` (the docs' choosing guide cites them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from benchmarks import machine

QWEN3_06B = dict(
  vocab_size=151936,
  hidden_size=1024,
  intermediate_size=3072,
  num_hidden_layers=28,
  num_attention_heads=16,
  num_key_value_heads=8,
  head_dim=128,
  max_position_embeddings=40960,
  rope_theta=1e6,
  tie_word_embeddings=True,
)
RUNS = {
  "f32": {},
  "bf16": {"model": {"dtype": "bfloat16"}},
  "http": {"rollout": {"sync": {"via": "http", "delta": True}}},
}


def write_checkpoint(path: str, *, seed: int = 0) -> int:
  """Qwen3-0.6B's shape with random weights, written by `transformers` in bfloat16; its parameter count."""
  import torch
  import transformers

  torch.manual_seed(seed)
  config = transformers.Qwen3Config(**QWEN3_06B, torch_dtype="bfloat16")
  previous = torch.get_default_dtype()
  torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: never a float32 copy of 2.4 GB
  try:
    model = transformers.Qwen3ForCausalLM(config)
  finally:
    torch.set_default_dtype(previous)
  model.save_pretrained(path)
  return sum(p.numel() for p in model.parameters())


def _config(checkpoint: str, run_dir: str, run: str) -> dict:
  cfg = {
    "run_dir": run_dir,
    "seed": 0,
    "model": {"path": checkpoint},
    "task": {"name": "copy_digits", "num_digits": 3},
    "rollout": {"prompts_per_step": 1, "n": 8, "sampling": {"temperature": 1.0}},
    "train": {"steps": 3, "learning_rate": 1e-5, "ppo_epochs": 1, "tokens_per_micro_batch": 1024, "row_len": 64},
    "checkpoint": {"every": 1000},
    "loss": {"algorithm": "decoupled_ppo", "custom_config_path": "configs/mis.yaml", "entropy_coef": 0.01},
  }
  for section, keys in RUNS[run].items():
    for key, value in keys.items():
      target = cfg.setdefault(section, {})
      target[key] = {**target.get(key, {}), **value} if isinstance(value, dict) else value
  return cfg


def train(checkpoint: str, tmp: str, run: str) -> dict:
  """One run of `mis-jax train`, its process tree's memory sampled; metrics and memory."""
  run_dir = os.path.join(tmp, f"run-{run}")
  config = os.path.join(tmp, f"{run}.yaml")
  with open(config, "w") as f:
    yaml.safe_dump(_config(checkpoint, run_dir, run), f)
  log = open(os.path.join(tmp, f"{run}.log"), "w")
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    [sys.executable, "-m", "trainers.cli", "train", "--config", config, "--no-progress"],
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  memory = machine.ProcessTreeMemory(proc.pid).start()
  rc = proc.wait()
  memory.stop()
  log.close()
  if rc != 0:
    raise RuntimeError(f"mis-jax train ({run}) exited with {rc}:\n{open(log.name).read()[-4000:]}")
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return {"wall_s": time.perf_counter() - t0, "rows": rows, "memory": memory.summary()}


def summarize(run: str, out: dict, params: int, floor: dict) -> dict:
  later = [r for r in out["rows"] if r["step"] >= 2]

  def med(key):
    values = [r[key] for r in later if key in r]
    return statistics.median(values) if values else None

  state_gb = params * (16 + 2 + (2 if run == "http" else 0)) / 1e9
  sync = med("sync_s")
  return {
    "run": run,
    "params": params,
    "state_gb": state_gb,
    "peak_gb": out["memory"]["peak_gb"],
    "peak_over_state": out["memory"]["peak_gb"] / state_gb,
    "memory": out["memory"],
    "rollout_s": med("rollout_s"),
    "train_s": med("train_s"),
    "sync_s": sync,
    "sync_phases": {k: med(k) for k in sorted({k for r in later for k in r if k.startswith("sync/")})},
    "floor_s": floor["total_s"],
    "sync_over_floor": sync / floor["total_s"],
    "k3_by_step": [r["mis_k3_kl"] for r in out["rows"]],
    "abs_diff_by_step": [r["train_rollout_logprob_abs_diff"] for r in out["rows"]],
    "sent_bytes_by_step": [r.get("sync/sent_bytes") for r in out["rows"]],
  }


def table(rows: list[dict]) -> str:
  lines = [
    "| run | peak GB (trainer + server) | state GB | peak / state | rollout s | update s | sync s | "
    "sync phases s | floor s | sync / floor | k3 by step |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    ph = r["sync_phases"]
    phases = ", ".join(
      f"{k.removeprefix('sync/').removesuffix('_s')} {v:.2f}"
      for k, v in ph.items()
      if k.endswith("_s") and v is not None and k != "sync/servers_paused_s"
    )
    k3 = " / ".join(f"{v:.2g}" for v in r["k3_by_step"])
    lines.append(
      f"| {r['run']} | {r['peak_gb']:.2f} | {r['state_gb']:.2f} | {r['peak_over_state']:.3f} | "
      f"{r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['sync_s']:.2f} | {phases} | {r['floor_s']:.2f} | "
      f"{r['sync_over_floor']:.1f} | {k3} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", help="an HF checkpoint of Qwen3-0.6B's shape (default: written here)")
  parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS)}")
  parser.add_argument("--json", default="benchmarks/results/real_size.json")
  args = parser.parse_args(argv)
  runs = [r for r in args.runs.split(",") if r]
  unknown = sorted(set(runs) - set(RUNS))
  if unknown:
    parser.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
  result = {
    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    "rows": [],
  }
  with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
    checkpoint = args.checkpoint
    if checkpoint is None:
      checkpoint = os.path.join(tmp, "qwen3-0.6b")
      result["params"] = write_checkpoint(checkpoint)
    files = [os.path.join(checkpoint, f) for f in os.listdir(checkpoint) if f.endswith(".safetensors")]
    nbytes = sum(os.path.getsize(f) for f in files)
    params = result.get("params") or nbytes // 2
    for run in runs:
      before = machine.file_floor(nbytes, directory=tmp)
      out = train(checkpoint, tmp, run)
      after = machine.file_floor(nbytes, directory=tmp)
      floor = {"bytes": nbytes, "total_s": (before["total_s"] + after["total_s"]) / 2, "before": before, "after": after}
      result["rows"].append({**summarize(run, out, params, floor), "floor": floor})
      os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
      print(table(result["rows"]), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
