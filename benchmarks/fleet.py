"""Weight sync to a fleet behind sglang-router: 1, 2 and 4 `mis-jax serve` workers, side by side
in one run.

    python -m benchmarks.fleet [--quick] [--json PATH]        (make bench-fleet)

What is timed is the trainer's own push (`weight_sync.DiskSync` through a `RouterClient`): the
trainer writes the step's sharded HF checkpoint once (bfloat16, the demo's `weight_dtype`), then
every worker the router lists runs pause → flush → `/update_weights_from_disk` → verify →
continue, all workers concurrently; the push returns when the slowest is done.

- **demo shape** (configs/demo.yaml: tiny Qwen3, 16 prompts × 8 samples): `mis-jax train` of the
  demo config through the router for `steps` steps; from its metrics (steps 2.., after the
  compiles) the median `sync_s` (the push), `sync/write_s` + `sync/gather_s` (the trainer's
  write), `sync/server_load_s` (the slowest worker's load) and `step_s`, so the share of the step
  the sync takes.
- **Qwen3-0.6B shape** (28 layers, hidden 1024, vocab 151,936; random weights, nothing
  downloaded): `repeats` pushes of a random model of that shape (float32 master weights, bfloat16
  on the wire), the median of each phase. A training step of this model is not run on this
  machine's CPUs, so no share is given for it.

On a machine with few cores the workers' loads compete for them (each load reads and converts
the whole checkpoint); the ratio to one worker then measures the cores as much as the fleet.
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

WORKERS = (1, 2, 4)


def _fleet(path: str, n: int):
  """`n` bfloat16 `mis-jax serve` workers of `path` behind a router (round robin); a context manager."""
  import contextlib

  from trainers.serving import router as router_lib
  from trainers.serving.embedded.server import EmbeddedServer

  @contextlib.contextmanager
  def fleet():
    with contextlib.ExitStack() as stack:
      workers = [stack.enter_context(EmbeddedServer(path, dtype="bfloat16", seed=0, timeout=1800)) for _ in range(n)]
      router = stack.enter_context(router_lib.RouterProcess([w.url for w in workers], policy="round_robin"))
      yield router, workers

  return fleet()


def demo_shape(tmp: str, n: int, steps: int) -> dict:
  """The demo config trained through a router over `n` workers: medians of its metrics from step 2."""
  from trainers.models import init_checkpoint

  init = os.path.join(tmp, "demo-init")
  if not os.path.exists(init):
    init_checkpoint(init, preset="tiny-qwen3", seed=0)  # the demo's starting weights (make fleet-demo's)
  run_dir = os.path.join(tmp, f"demo-{n}")
  with _fleet(init, n) as (router, _):
    out = subprocess.run(
      [
        sys.executable,
        "-m",
        "trainers.cli",
        "train",
        "--config",
        "configs/demo.yaml",
        "--router",
        router.url,
        "--run-dir",
        run_dir,
        "--steps",
        str(steps),
        "--no-progress",
        "--set",
        "checkpoint.every=1000",
      ],
      capture_output=True,
      text=True,
    )
  if out.returncode != 0:
    raise RuntimeError(f"mis-jax train exited with {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  rows = [r for r in rows if r["step"] >= 2]

  def med(key):
    return statistics.median(r[key] for r in rows)

  write = statistics.median(r["sync/gather_s"] + r["sync/write_s"] for r in rows)
  return {
    "shape": "demo",
    "workers": n,
    "steps": len(rows),
    "sync_s": med("sync_s"),
    "write_s": write,
    "load_s": med("sync/server_load_s"),
    "paused_s": med("sync/servers_paused_s"),
    "step_s": med("step_s"),
    "share": med("sync_s") / med("step_s"),
  }


def qwen3_06b_shape(tmp: str, n: int, repeats: int, state, config) -> dict:
  """`repeats` pushes of `state` (Qwen3-0.6B's shape) to `n` workers: medians of each phase."""
  from trainers.rollout.fleet import router_client
  from trainers.rollout.weight_sync import DiskSync

  init = os.path.join(tmp, "q06-init")
  if not os.path.exists(init):
    from trainers.rollout.weight_sync import save_hf_sharded

    save_hf_sharded(state, config, init, dtype="bfloat16", num_shards=1)
  with _fleet(init, n) as (router, _):
    client = router_client(router.url, poll_s=0, timeout_s=1800, max_retries=0)
    try:
      client.wait_until_healthy()
      sync = DiskSync(client, config, weights_root=os.path.join(tmp, f"q06-{n}"), pause_mode="abort")
      runs = []
      for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        times, _ = sync.push(state, step, "bfloat16")
        runs.append({**times, "sync_s": time.perf_counter() - t0})
    finally:
      client.close()

  def med(key):
    return statistics.median(r[key] for r in runs)

  return {
    "shape": "Qwen3-0.6B",
    "workers": n,
    "repeats": repeats,
    "sync_s": med("sync_s"),
    "write_s": statistics.median(r["sync/gather_s"] + r["sync/write_s"] for r in runs),
    "load_s": med("sync/server_load_s"),
    "paused_s": med("sync/servers_paused_s"),
    "step_s": None,
    "share": None,
  }


def table(rows: list[dict]) -> str:
  one = {r["shape"]: r["sync_s"] for r in rows if r["workers"] == 1}
  lines = [
    "| shape | workers | sync (s) | × 1 worker | trainer write (s) | slowest load (s) | workers paused (s) "
    "| step (s) | sync share of step |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    step = f"{r['step_s']:.2f}" if r["step_s"] is not None else "—"
    share = f"{100 * r['share']:.0f} %" if r["share"] is not None else "—"
    lines.append(
      f"| {r['shape']} | {r['workers']} | {r['sync_s']:.2f} | {r['sync_s'] / one[r['shape']]:.2f} | "
      f"{r['write_s']:.2f} | {r['load_s']:.2f} | {r['paused_s']:.2f} | {step} | {share} |"
    )
  return "\n".join(lines)


def _write(path: str, rows: list[dict]) -> None:
  """The results so far (after every row: a later row that runs out of memory loses nothing)."""
  result = {
    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    "workers": list(WORKERS),
    "rows": rows,
  }
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the demo shape only")
  parser.add_argument("--steps", type=int, default=5, help="demo shape: steps of each run (the first is left out)")
  parser.add_argument("--repeats", type=int, default=3, help="Qwen3-0.6B shape: pushes per worker count")
  parser.add_argument("--json", default="benchmarks/results/fleet.json")
  args = parser.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
    for n in WORKERS:
      rows.append(demo_shape(tmp, n, args.steps))
      _write(args.json, rows)
      print(table(rows), flush=True)
    if not args.quick:
      from flax import nnx

      from trainers.models import CausalLM
      from benchmarks.engines import MODELS

      config = MODELS["Qwen3-0.6B shape"]
      state = nnx.state(CausalLM(config, rngs=nnx.Rngs(0)), nnx.Param)
      for n in WORKERS:
        rows.append(qwen3_06b_shape(tmp, n, args.repeats, state, config))
        _write(args.json, rows)
        print(table(rows), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
