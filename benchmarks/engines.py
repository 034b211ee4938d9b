"""sglang-jax against `mis-jax serve`, side by side in one run: generation throughput and the
weight sync (write, load, first request after).

    python -m benchmarks.engines [--quick] [--json PATH]        (make bench-engines)

Models (float32, random weights, CPU): the test suite's tiny Qwen3 (head_dim 128, as sglang-jax's
CPU attention needs) and a random model of Qwen3-0.6B's shape (28 layers, hidden 1024, vocab
151,936). One engine runs at a time, each on the same checkpoint, from a fresh process.

- **tokens/s**: `prompts` prompts × `new_tokens` sampled tokens (temperature 1, `ignore_eos`,
  log-probs on, one `/generate` request), best of `repeats` after one warm-up of the same shape;
  completion tokens over wall time.
- **sync**: what the trainer does after a step. `write`: the policy as an HF safetensors
  checkpoint (`save_hf_checkpoint`, float32: the same for both engines); `load`: the
  `/update_weights_from_disk` call; `first request`: a one-token request right after it (any
  recompilation or cache rebuild shows here); best of `repeats`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import httpx

from trainers.models import PRESETS, ModelConfig, init_checkpoint, load_hf_checkpoint, save_hf_checkpoint

MODELS = {
  "tiny-qwen3 (head_dim 128)": dataclasses.replace(
    PRESETS["tiny-qwen3"], head_dim=128, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.1
  ),
  "Qwen3-0.6B shape": ModelConfig(
    model_type="qwen3",
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
  ),
}


def _generate(url: str, prompts: int, new_tokens: int) -> tuple[float, int]:
  body = {
    "input_ids": [[1, 5 + i % 50, 9, 12] for i in range(prompts)],
    "return_logprob": True,
    "sampling_params": {
      "temperature": 1.0,
      "max_new_tokens": new_tokens,
      "ignore_eos": True,
      "skip_special_tokens": False,
      "no_stop_trim": True,
    },
  }
  t0 = time.perf_counter()
  out = httpx.post(url + "/generate", json=body, timeout=3600).json()
  return time.perf_counter() - t0, sum(r["meta_info"]["completion_tokens"] for r in out)


def measure(
  engine: str, path: str, update_dirs: list[str], *, prompts: int, new_tokens: int, repeats: int, mem_fraction: str
) -> dict:
  from trainers.serving.embedded.server import EmbeddedServer
  from trainers.serving.sglang_jax.launcher import SGLangJaxServer

  t0 = time.perf_counter()
  server = (
    SGLangJaxServer(path, dtype="float32", timeout=1800, extra=("--mem-fraction-static", mem_fraction))
    if engine == "sglang-jax"
    else EmbeddedServer(path, dtype="float32", max_batch_size=max(prompts, 8), timeout=1800)
  )
  start_s = time.perf_counter() - t0
  with server:
    _generate(server.url, prompts, new_tokens)  # compiles this shape
    runs = [_generate(server.url, prompts, new_tokens) for _ in range(repeats)]
    seconds, tokens = min(runs)
    loads, firsts = [], []
    for i in range(repeats):
      d = update_dirs[i % len(update_dirs)]
      t = time.perf_counter()
      reply = httpx.post(
        server.url + "/update_weights_from_disk", json={"model_path": d, "weight_version": str(i)}, timeout=3600
      )
      loads.append(time.perf_counter() - t)
      assert reply.status_code == 200 and reply.json()["success"], reply.text
      firsts.append(_generate(server.url, 1, 1)[0])
  return {
    "engine": engine,
    "start_s": start_s,
    "tokens_per_s": tokens / seconds,
    "generate_s": seconds,
    "tokens": tokens,
    "load_s": min(loads),
    "first_request_s": min(firsts),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the tiny model only")
  parser.add_argument("--json", default="benchmarks/results/engines.json")
  args = parser.parse_args(argv)
  # sglang-jax sizes its KV pool from a fraction of the host's memory (CPU default 0.05): the
  # 0.6B model's 2.3 GB of float32 weights need more.
  shapes = {
    "tiny-qwen3 (head_dim 128)": dict(prompts=32, new_tokens=32, repeats=3, mem_fraction="0.05"),
    "Qwen3-0.6B shape": dict(prompts=8, new_tokens=16, repeats=2, mem_fraction="0.3"),
  }
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, config in MODELS.items():
      if args.quick and name != "tiny-qwen3 (head_dim 128)":
        continue
      path, updates = os.path.join(tmp, "start"), [os.path.join(tmp, f"update{i}") for i in range(2)]
      init_checkpoint(path, config=config, seed=0)
      model = load_hf_checkpoint(path)
      writes = []
      for d in updates:  # the trainer's side of a sync: the same for both engines
        t = time.perf_counter()
        save_hf_checkpoint(model, d, dtype="float32")
        writes.append(time.perf_counter() - t)
      del model
      size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
      for engine in ("mis-jax serve", "sglang-jax"):
        row = {
          "model": name,
          "checkpoint_mb": size / 2**20,
          "write_s": min(writes),
          **measure(engine, path, updates, **shapes[name]),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(args.json, rows, shapes)  # after every row: a run cut short keeps what it measured
      for d in [path, *updates]:
        for f in os.listdir(d):
          os.remove(os.path.join(d, f))
  print("\n| model | engine | tokens/s | generate | sync: write | load | first request after | start-up |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['model']} | {r['engine']} | {r['tokens_per_s']:.0f} | {r['tokens']} tok in {r['generate_s']:.2f} s "
      f"| {r['write_s']:.2f} s | {r['load_s']:.2f} s | {r['first_request_s']:.2f} s | {r['start_s']:.0f} s |"
    )
  return 0


def _write(path: str, rows: list[dict], shapes: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows, "shapes": shapes}, f, indent=1)


if __name__ == "__main__":
  raise SystemExit(main())
