"""Exact mode (`rollout.placement.exact`, contract §13): the proof, what it costs, and why it is needed.

    python -m benchmarks.exact [--quick] [--sections probe,proof,cost] [--json benchmarks/results/exact.json]
    make bench-exact

- `probe`: does XLA:CPU compute a row of a product or a row sum the same whatever else is in the
  batch? Per shape and dtype, the fraction of rows of `x @ w` (and of `softmax(x @ w)`) whose bits
  differ between the row computed alone (`M = 1`) and inside `M` rows, for XLA's `jnp.dot` and for
  the batch-invariant arithmetic (`trainers.models.invariant`); and whether XLA's row sum is the
  left-to-right one.
- `proof`: 20 steps of the demo task (`configs/demo.yaml`: decoupled PPO + MIS, a tiny Qwen3, 16
  prompts × 8 samples) with exact mode on, in bfloat16 and float32, colocated and through `mis-jax
  serve` (which the trainer starts): per step `mis_k3_kl`, the largest |old − rollout log-prob| over
  the step's tokens (read back from the run's records), the IS weights' range and the gradient
  norm. The control: the same four runs with exact mode off.
- `cost`: our colocated step, exact mode against the default, side by side in one run at the
  `benchmarks.colocated` shapes (`example`: 2 layers 64 wide, 4 × 4 samples of 8 tokens; `larger`:
  4 layers 256 wide, 16 × 4 samples of 64 tokens): steps/s over the steady-state steps, the median
  rollout (generation) and train (old log-probs and update) times per step, and the exact pass
  alone (best of 3 on the last step's batch). Decoupled PPO with `configs/mis.yaml`, one epoch,
  bfloat16 engine: the default takes its old log-probs from the update's own forward (no separate
  pass), exact mode from the exact pass.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from unittest import mock

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stamp() -> dict:
  """Commit, date and machine of a run."""
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
  ).stdout.strip()
  return {
    "commit": commit,
    "date": datetime.datetime.now().isoformat(timespec="minutes"),
    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    "load_1min": round(os.getloadavg()[0], 2),
  }


# --- probe -------------------------------------------------------------------------------------------------
def probe(quick: bool) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from trainers.models import invariant

  exact = lambda f: jax.jit(f, compiler_options=invariant.COMPILER_OPTIONS)
  rng = np.random.default_rng(0)
  rows = []
  shapes = [(64, 64), (256, 768)] + ([] if quick else [(1024, 3072)])
  for k, n in shapes:
    for dtype in (jnp.float32, jnp.bfloat16):
      w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
      x = jnp.asarray(rng.standard_normal((64, k)), dtype)
      kinds = {
        "jnp.dot": jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
        "softmax(jnp.dot)": jax.jit(lambda x, w: jax.nn.softmax(jnp.dot(x, w, preferred_element_type=jnp.float32))),
        "invariant.matmul": exact(lambda x, w: invariant.matmul(x.astype(jnp.float32), w.astype(jnp.float32))),
        "invariant.softmax": exact(
          lambda x, w: invariant.softmax(invariant.matmul(x.astype(jnp.float32), w.astype(jnp.float32)))
        ),
      }
      for name, fn in kinds.items():
        alone = np.concatenate([np.asarray(fn(x[i : i + 1], w)) for i in range(64)])
        record = {"k": k, "n": n, "dtype": jnp.dtype(dtype).name, "kind": name}
        for m in (2, 17, 64):
          record[f"rows_differing_m{m}"] = float(np.mean(np.any(np.asarray(fn(x[:m], w)) != alone[:m], axis=-1)))
        rows.append(record)
        print(
          f"probe {k}x{n} {record['dtype']:8s} {name:18s} "
          + " ".join(f"M={m}: {record[f'rows_differing_m{m}']:.0%}" for m in (2, 17, 64)),
          flush=True,
        )
  x = rng.standard_normal((8, 1000)).astype(np.float32)
  seq = np.zeros(8, np.float32)
  for j in range(x.shape[1]):
    seq = (seq + x[:, j]).astype(np.float32)
  rows.append(
    {
      "kind": "row sum left to right",
      "jnp.sum": bool(np.array_equal(np.asarray(jax.jit(jnp.sum, static_argnums=1)(x, 1)), seq)),
      "invariant.ordered_sum": bool(np.array_equal(np.asarray(exact(invariant.ordered_sum)(x)), seq)),
    }
  )
  print(f"probe: a 1000-term row sum left to right: {rows[-1]}", flush=True)
  return rows


# --- proof -------------------------------------------------------------------------------------------------
def proof_run(root: str, name: str, *, exact: bool, mode: str, dtype: str, steps: int, prompts: int) -> dict:
  """`configs/demo.yaml` for `steps` steps; per step the mismatch as the metrics and the records give it."""
  from trainers import config as config_lib
  from trainers.app import build, trainer as train_lib
  from trainers.config import TrainConfig
  from trainers.rollout import backend

  import pyarrow.parquet as pq

  run_dir = os.path.join(root, name)
  raw = config_lib.load_yaml(os.path.join(ROOT, "configs/demo.yaml"), "trainer config")
  raw["run_dir"] = run_dir
  raw["train"]["steps"] = steps
  raw["rollout"]["prompts_per_step"] = prompts
  raw["rollout"]["placement"] = {"mode": mode, "server_dtype": dtype, "exact": exact}
  raw["rollout"]["records"] = {"save_dir": os.path.join(run_dir, "records")}
  raw["loss"]["custom_config_path"] = os.path.join(ROOT, raw["loss"]["custom_config_path"])
  raw["checkpoint"] = {"every": 1000, "max_to_keep": 1}
  cfg = TrainConfig.from_dict(raw)
  t0 = time.perf_counter()
  with contextlib.ExitStack() as running:
    urls = []
    if mode == "server":
      urls = [running.enter_context(backend.start_server(cfg, build.initial_weights_dir(cfg), is_moe=False)).url]
    history = train_lib.Trainer(cfg, cfg.loss, urls=urls).run(progress=False, log=lambda *_: None)
  gaps = []
  for path in sorted(glob.glob(os.path.join(run_dir, "records", "*.parquet"))):
    cols = pq.read_table(path).to_pydict()
    gaps.append(
      max(
        float(np.max(np.abs(np.asarray(o, np.float64) - np.asarray(r, np.float64))))
        for o, r in zip(cols["old_logprobs"], cols["rollout_logprobs"])
        if r
      )
    )
  keys = (
    "mis_k3_kl",
    "train_rollout_logprob_abs_diff",
    "mis_is_ratio_min_final",
    "mis_is_ratio_max_final",
    "grad_norm",
    "reward_mean",
    "ppo_kl",
    "pg_clipfrac",
  )
  out = {
    "name": name,
    "exact": exact,
    "mode": mode,
    "dtype": dtype,
    "seconds": round(time.perf_counter() - t0, 1),
    "max_abs_logprob_diff": gaps,
    **{k: [float(h[k]) for h in history] for k in keys},
  }
  zero = all(k == 0.0 for k in out["mis_k3_kl"]) and all(g == 0.0 for g in gaps)
  ones = all(a == b == 1.0 for a, b in zip(out["mis_is_ratio_min_final"], out["mis_is_ratio_max_final"]))
  out["zero_mismatch_every_step"], out["is_weights_exactly_one"] = zero, ones
  out["nonzero_gradient_every_step"] = all(g > 0 for g in out["grad_norm"])
  print(
    f"proof {name:28s} zero mismatch every step: {zero}, IS weights 1: {ones}, max |Δ| over steps "
    f"{max(gaps):.3g}, max mis_k3_kl {max(out['mis_k3_kl']):.3g}, grad norm > 0: "
    f"{out['nonzero_gradient_every_step']} ({out['seconds']} s)",
    flush=True,
  )
  return out


def proof(root: str, quick: bool) -> list[dict]:
  steps, prompts = (3, 4) if quick else (20, 16)
  return [
    proof_run(
      root,
      f"{'exact' if exact else 'control'}-{mode}-{dtype}",
      exact=exact,
      mode=mode,
      dtype=dtype,
      steps=steps,
      prompts=prompts,
    )
    for exact in (True, False)
    for mode in ("colocated", "server")
    for dtype in ("bfloat16", "float32")
  ]


# --- cost --------------------------------------------------------------------------------------------------
def cost_run(shape, root: str, exact: bool) -> dict:
  import jax
  import mis_jax
  from benchmarks import colocated, roofline
  from trainers.app import spec as spec_lib, trainer as train_lib
  from trainers.config import TrainConfig

  model = colocated._model_dir(shape, root)
  cfg = TrainConfig.from_dict(
    {
      "run_dir": os.path.join(root, f"cost-{shape.name}-{exact}"),
      "seed": 0,
      "model": {"path": model, "remat": "none"},
      "task": {"name": "copy_digits", "num_digits": 3},
      "rollout": {
        "prompts_per_step": shape.prompts,
        "n": shape.n,
        "sampling": {"temperature": 0.8, "max_new_tokens": shape.max_new_tokens},
        "placement": {"mode": "colocated", "server_dtype": "bfloat16", "exact": exact},
        "sync": {"mismatch_check": False},
      },
      "train": {
        "steps": shape.steps + 1,
        "learning_rate": 1e-3,
        "ppo_epochs": 1,
        "row_len": shape.row_len,
        "tokens_per_micro_batch": 8192,
      },
      "checkpoint": {"every": 1000, "max_to_keep": 1},
    }
  )
  loss = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml(os.path.join(ROOT, "configs/mis.yaml")))
  sampling_params = spec_lib.RunSpec.sampling_params.fget  # every response max_new_tokens long, in both modes
  with mock.patch.object(
    spec_lib.RunSpec, "sampling_params", property(lambda self: {**sampling_params(self), "ignore_eos": True})
  ):
    trainer = train_lib.Trainer(cfg, loss, urls=[])
    stamps, take = [], trainer.source.next
    trainer.source.next = lambda step: stamps.append(time.perf_counter()) or take(step)
    trainer.learner.fns = recorded = colocated._LastCalls(trainer.learner.fns)
    history = trainer.run(progress=False, log=lambda *_: None)
  timed = history[shape.first_timed - 1 : shape.steps]
  step_s = list(np.diff(stamps[shape.first_timed - 1 :]))
  out = {
    "shape": shape.name,
    "exact": exact,
    "steps_per_s": 1.0 / statistics.median(step_s),
    "step_ms": 1e3 * statistics.median(step_s),
    "rollout_ms": 1e3 * statistics.median(h["rollout_s"] for h in timed),
    "train_ms": 1e3 * statistics.median(h["train_s"] for h in timed),
    "mis_k3_kl": statistics.mean(h["mis_k3_kl"] for h in timed),
    "step_s_all": step_s,
  }
  if recorded.forward_args is not None:  # the exact pass, timed apart on the last step's batch
    heads, inputs, segment_ids = recorded.forward_args
    run = recorded.fns.forward(heads)
    out["old_logprobs_pass_ms"] = 1e3 * roofline.best_time(
      lambda: jax.block_until_ready(run(trainer.params, inputs, segment_ids)), 3
    )
  print(
    f"cost {shape.name:8s} {'exact' if exact else 'default':8s} {out['steps_per_s']:.2f} steps/s, step "
    f"{out['step_ms']:.0f} ms, rollout {out['rollout_ms']:.0f} ms, train {out['train_ms']:.0f} ms"
    + (f" (exact pass {out['old_logprobs_pass_ms']:.0f} ms)" if "old_logprobs_pass_ms" in out else "")
    + f", mis_k3_kl {out['mis_k3_kl']:.2e}",
    flush=True,
  )
  return out


def cost(root: str, quick: bool) -> list[dict]:
  import dataclasses
  from benchmarks import colocated

  shapes = [s for s in colocated.SHAPES if s.name in ("example", "larger")]
  if quick:
    shapes = [dataclasses.replace(shapes[0], steps=4, first_timed=2)]
  return [cost_run(shape, root, exact) for shape in shapes for exact in (False, True)]


def table_cost(rows: list[dict]) -> str:
  lines = [
    "| shape | mode | steps/s | step | rollout | train (old log-probs + update) | exact pass alone | mis_k3_kl |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    alone = f"{r['old_logprobs_pass_ms']:.0f} ms" if "old_logprobs_pass_ms" in r else "— (fused)"
    lines.append(
      f"| {r['shape']} | {'exact' if r['exact'] else 'default'} | {r['steps_per_s']:.2f} | "
      f"{r['step_ms']:.0f} ms | {r['rollout_ms']:.0f} ms | {r['train_ms']:.0f} ms | {alone} | "
      f"{r['mis_k3_kl']:.1e} |"
    )
  return "\n".join(lines)


def table_proof(rows: list[dict]) -> str:
  lines = [
    "| run | steps | max mis_k3_kl | max \\|old − rollout\\| | IS weights exactly 1 | grad norm > 0 every step "
    "| mean \\|ppo_kl\\| | mean pg_clipfrac | final reward |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['name']} | {len(r['mis_k3_kl'])} | {max(r['mis_k3_kl']):.2e} | {max(r['max_abs_logprob_diff']):.2e} "
      f"| {r['is_weights_exactly_one']} | {r['nonzero_gradient_every_step']} | "
      f"{np.mean(np.abs(r['ppo_kl'])):.1e} | {np.mean(r['pg_clipfrac']):.1e} | {r['reward_mean'][-1]:.3f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run: fewer steps and shapes, nothing written")
  parser.add_argument("--sections", default="probe,proof,cost")
  parser.add_argument("--json", default="benchmarks/results/exact.json")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  unknown = set(sections) - {"probe", "proof", "cost"}
  if unknown:
    parser.error(f"--sections: unknown {sorted(unknown)}; choose from probe, proof, cost")
  out = {
    "stamp": stamp(),
    "command": "python -m benchmarks.exact"
    + (f" --sections {args.sections}" if args.sections != "probe,proof,cost" else ""),
  }
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as root:
    if "probe" in sections:
      out["probe"] = probe(args.quick)
    if "proof" in sections:
      out["proof"] = proof(root, args.quick)
      print()
      print(table_proof(out["proof"]))
    if "cost" in sections:
      out["cost"] = cost(root, args.quick)
      print()
      print(table_cost(out["cost"]))
  out["seconds"] = round(time.perf_counter() - start, 1)
  if not args.quick:
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
