"""The three ways weights reach `mis-jax serve` workers, side by side in one run: through a file,
streamed whole over HTTP, and streamed as deltas.

    python -m benchmarks.sync [--quick] [--shapes demo,qwen3-0.6b] [--workers 1,4] [--json PATH]   (make bench-sync)

For each shape (the demo's tiny Qwen3; Qwen3-0.6B's, random float32 master weights) and each fleet
size (bfloat16 workers on 127.0.0.1, no router: the pushes go to each worker directly either way):

- `file` (`rollout.sync.via: disk`, `DiskSync`): the trainer writes the sharded HF checkpoint,
  then every worker loads it (`/update_weights_from_disk`);
- `http` (`via: http`, `HttpSync`): the weights streamed to every worker at once in 128 MB
  buckets, each staged beside the served weights, then committed;
- `delta` (`via: http`, `delta: true`): after a whole push, pushes of the values that changed
  under a small update (every weight moved by 1e-5, Adam's first step at that learning rate).

Each is pushed `repeats` times; the medians of the push's wall seconds and of its phases, the bytes
it sends (the file's bytes for `file`: written once, read by every worker), and both as fractions
of what this machine allows, measured in the same run: `× floor`, the push over the seconds to
write its bytes to a file and read them back (`machine.file_floor`); `GB/s`, a worker's bytes over
the push's seconds, and that against the memory bandwidth (`roofline`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import psutil

from benchmarks import machine, roofline

TRANSPORTS = ("file", "http", "delta")
UPDATE = 1e-5  # the size of every weight's move between two delta pushes


def _shape(name: str):
  import dataclasses

  from trainers.models import PRESETS, ModelConfig

  if name == "demo":
    return dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.1)
  return ModelConfig(
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
  )


def _state(config, seed: int = 0):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from trainers.models import CausalLM

  abstract = nnx.state(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))), nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(abstract))))
  return jax.tree.map(
    lambda a: config.initializer_range * jax.random.normal(next(keys), a.shape, jnp.float32), abstract
  )


def _moved(state, step: int):
  """Every weight moved by `UPDATE` (a sign drawn per weight and step)."""
  import jax
  import jax.numpy as jnp

  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1000 + step), len(leaves))
  moved = [x + UPDATE * jnp.sign(jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, moved)


def push_rows(shape: str, n: int, tmp: str, state, config, *, repeats: int, bucket_mb: int) -> list[dict]:
  from trainers.rollout.client import http_client
  from trainers.rollout.weight_stream import HttpSync
  from trainers.rollout.weight_sync import DiskSync
  from trainers.serving.embedded.server import EmbeddedServer

  start = os.path.join(tmp, f"{shape}-start")
  rows = []
  with contextlib.ExitStack() as stack:
    workers = [stack.enter_context(EmbeddedServer(start, dtype="bfloat16", timeout=1800)) for _ in range(n)]
    client = http_client([w.url for w in workers], timeout_s=1800, max_retries=0)
    stack.callback(client.close)
    syncs = {
      "file": DiskSync(client, config, weights_root=os.path.join(tmp, f"w-{shape}-{n}"), pause_mode="abort"),
      "http": HttpSync(client, config, pause_mode="abort", bucket_bytes=bucket_mb << 20),
      "delta": HttpSync(client, config, pause_mode="abort", delta=True, bucket_bytes=bucket_mb << 20),
    }
    for transport, sync in syncs.items():
      current, runs = state, []
      if transport == "delta":
        sync.push(current, 0, "bfloat16")  # whole: the base of the deltas
      for k in range(1, repeats + 1):
        if transport == "delta":
          current = _moved(current, k)
        t0 = time.perf_counter()
        metrics, path = sync.push(current, k, "bfloat16")
        runs.append({**metrics, "s": time.perf_counter() - t0})
        if path is not None:
          nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
          runs[-1]["sync/sent_bytes"] = float(nbytes)
      rows.append(
        {
          "shape": shape,
          "workers": n,
          "transport": transport,
          "repeats": repeats,
          "s": statistics.median(r["s"] for r in runs),
          "bytes": statistics.median(r["sync/sent_bytes"] for r in runs),
          "phases": {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.startswith("sync/")},
        }
      )
  return rows


def table(rows: list[dict], floors: dict, bandwidth: float) -> str:
  lines = [
    "| shape | workers | transport | push s | bytes sent | × floor | GB/s a worker | % of memory bandwidth | "
    "phases s |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    floor = floors[r["shape"]]
    per_worker = (r["bytes"] if r["transport"] == "file" else r["bytes"] / r["workers"]) / r["s"]
    phases = ", ".join(
      f"{k.removeprefix('sync/').removesuffix('_s')} {v:.2f}"
      for k, v in r["phases"].items()
      if k.endswith("_s") and k != "sync/servers_paused_s"
    )
    if "sync/changed_fraction" in r["phases"]:
      phases += f"; changed {100 * r['phases']['sync/changed_fraction']:.1f} %"
    lines.append(
      f"| {r['shape']} | {r['workers']} | {r['transport']} | {r['s']:.3f} | {_size(r['bytes'])} | "
      f"{r['s'] / floor['total_s']:.1f} | {per_worker / 1e9:.2f} | {100 * per_worker / bandwidth:.0f} % | "
      f"{phases} |"
    )
  return "\n".join(lines)


def _size(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the demo shape only, one push each")
  parser.add_argument("--shapes", default="demo,qwen3-0.6b")
  parser.add_argument("--workers", default="1,4")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--bucket-mb", type=int, default=128)
  parser.add_argument("--json", default="benchmarks/results/sync.json")
  args = parser.parse_args(argv)
  shapes = ["demo"] if args.quick else args.shapes.split(",")
  repeats = 1 if args.quick else args.repeats
  from trainers.rollout.weight_sync import save_hf_sharded

  limits_bw = roofline.bandwidth_bytes_per_s(256 << 20)
  result = {
    "machine": {
      "cpus": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "bandwidth_gb_s": limits_bw / 1e9,
    },
    "update": UPDATE,
    "rows": [],
    "floors": {},
    "skipped": [],
  }
  with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
    for shape in shapes:
      config = _shape(shape)
      state = _state(config)
      save_hf_sharded(state, config, os.path.join(tmp, f"{shape}-start"), dtype="bfloat16", num_shards=1)
      nbytes = sum(int(x.size) * 2 for x in __import__("jax").tree.leaves(state))
      result["floors"][shape] = machine.file_floor(nbytes, directory=tmp)
      for n in (int(w) for w in args.workers.split(",")):
        need_gb = (n * 2.8 + 5.0) * nbytes / 1.19e9  # each worker staging beside its weights, the trainer
        free_gb = psutil.virtual_memory().available / 1e9
        if free_gb < need_gb:
          result["skipped"].append(f"{shape} × {n} workers: {free_gb:.1f} GB available, ~{need_gb:.0f} GB needed")
          print("skipped:", result["skipped"][-1], flush=True)
          continue
        result["rows"] += push_rows(shape, n, tmp, state, config, repeats=repeats, bucket_mb=args.bucket_mb)
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
          json.dump(result, f, indent=1)
        print(table(result["rows"], result["floors"], limits_bw), flush=True)
      del state
  return 0


if __name__ == "__main__":
  sys.exit(main())
