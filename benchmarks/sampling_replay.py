"""How much truncated sampling looks like mismatch, and what sampling-mask replay leaves of it.

    python -m benchmarks.sampling_replay [--quick] [--json PATH]     (make bench-replay)

The embedded server (`mis-jax serve`) samples a tiny Qwen3 with top-p / top-k / min-p and
returns its sampling masks (SGLang's `return_sampling_mask`); the trainer runs one step with
replay on and reports, over the step's response tokens (`mis_jax.sampling_metrics`):

- replay off: the ratio `π(y) / π_S^engine(y)` of the trainer's full-vocabulary log-prob to
  the engine's behaviour log-prob (what a trainer without replay compares against the
  distribution the engine really sampled from): mean and fraction outside [0.9, 1.1], and k3;
- replay on: the same with the trainer renormalised over the replayed support, `π_S / π_S^engine`.

Engines: float32 (weights identical to the trainer's, so the only difference is the truncation)
and bfloat16 (a real numeric mismatch as well). The untruncated control uses `top_k` = the
vocabulary size (SGLang returns masks only for a finite top_k), so its support is everything.
Each setting is one step of `prompts_per_step × n` samples of the copy-digits task from the
same initial weights and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

SETTINGS = {  # name: (top_k, top_p, min_p); the tiny model's vocabulary is 64 tokens
  "untruncated (control)": (64, 1.0, 0.0),
  "top_p 0.8": (64, 0.8, 0.0),
  "top_k 20": (20, 1.0, 0.0),
  "min_p 0.1": (64, 1.0, 0.1),
}
KEYS = (
  "sampling_kept_mass_mean",
  "sampling_ratio_mean_full",
  "sampling_ratio_outside_full",
  "sampling_k3_kl_full",
  "sampling_ratio_mean_replay",
  "sampling_ratio_outside_replay",
  "mis_k3_kl",
)


def measure(dtype: str, setting: str, model_path: str, url: str, run_dir: str, *, prompts: int, n: int) -> dict:
  import mis_jax
  from trainers.app import trainer as train_lib
  from trainers.config import TrainConfig

  top_k, top_p, min_p = SETTINGS[setting]
  cfg = TrainConfig.from_dict(
    {
      "seed": 0,
      "run_dir": run_dir,
      "model": {"path": model_path},
      "task": {"name": "copy_digits", "num_digits": 3},
      "rollout": {
        "prompts_per_step": prompts,
        "n": n,
        "sampling": {
          "temperature": 1.0,
          "top_k": top_k,
          "top_p": top_p,
          "min_p": min_p,
          "sampling_replay": "on",
          "max_new_tokens": 8,
        },
        "placement": {"server_dtype": dtype},
      },
      "train": {"steps": 1, "row_len": 16, "tokens_per_micro_batch": 4096},
    }
  )
  (h,) = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[url]).run(progress=False, log=lambda *_: None)
  return {k: h[k] for k in KEYS} | {"tokens": int(h["num_samples"] * h["response_length"])}


def table(results: list[dict]) -> str:
  rows = [
    "| engine | sampling | kept mass | ratio mean, off | outside [0.9, 1.1], off | k3, off | "
    "ratio mean, on | outside, on | k3 (`mis_k3_kl`), on |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    rows.append(
      f"| {r['engine']} | {r['setting']} | {r['sampling_kept_mass_mean']:.3f} | "
      f"{r['sampling_ratio_mean_full']:.3f} | {r['sampling_ratio_outside_full']:.1%} | "
      f"{r['sampling_k3_kl_full']:.2e} | {r['sampling_ratio_mean_replay']:.4f} | "
      f"{r['sampling_ratio_outside_replay']:.1%} | {r['mis_k3_kl']:.1e} |"
    )
  return "\n".join(rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
  parser.add_argument("--json", default="benchmarks/results/sampling_replay.json")
  args = parser.parse_args(argv)
  import dataclasses
  from trainers.models import PRESETS, init_checkpoint
  from trainers.serving.embedded.server import EmbeddedServer

  prompts, n = (4, 4) if args.quick else (32, 8)
  results = []
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    model_path = os.path.join(tmp, "model")
    # The trainer's and the engine's starting weights; initializer_range 0.3 makes the tiny
    # model's next-token distributions peaked enough that the filters cut a realistic share.
    init_checkpoint(model_path, config=dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.3), seed=0)
    for dtype in ("float32", "bfloat16"):
      with EmbeddedServer(model_path, dtype=dtype, seed=0) as srv:
        for i, setting in enumerate(SETTINGS):
          r = measure(dtype, setting, model_path, srv.url, os.path.join(tmp, f"run-{dtype}-{i}"), prompts=prompts, n=n)
          results.append({"engine": dtype, "setting": setting, **r})
          print(f"{dtype:9s} {setting:22s} " + " ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True)
  out = {
    "prompts_per_step": prompts,
    "n": n,
    "max_new_tokens": 8,
    "seconds": round(time.perf_counter() - start, 1),
    "results": results,
  }
  if not args.quick:
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  print()
  print(table(results))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
