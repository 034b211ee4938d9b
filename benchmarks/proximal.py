"""Decoupled PPO's device time per RL step with the proximal log-probs recomputed or loglinear
(contract §6.3), side by side in one run, on this machine.

    python -m benchmarks.proximal [--quick] [--json benchmarks/results/proximal.json]

What the trainer runs on the devices per step (`Trainer.train_on`), on the same packed batch:

- `recompute`: the old-log-prob pass (`StepFunctions.logprobs`), `prepare_step` (the correction
  once per step), then `ppo_epochs` calls of the jitted step;
- `loglinear`: `prepare_step` (denominators only) and the `ppo_epochs` steps, whose loss runs
  the correction per micro-batch from the interpolated proximal log-probs.

Two shapes: the demo's (`configs/demo.yaml`: tiny-qwen3, 16 prompts × 8 samples of the 3-digit
copy task, 2 epochs) and a larger one (a 4-layer 256-wide Qwen3, 64 samples × 64 response
tokens). Times are medians over interleaved repetitions (this 2-core VM is noisy), after a
compile; the parameters are restored before each repetition so every one is the same update.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import types

import jax
import numpy as np
from flax import nnx

import mis_jax
from trainers.models import PRESETS, CausalLM
from trainers.runtime import parallel
from trainers.learner import step as step_lib
from trainers.learner.batch import build_step_batch
from trainers.config import TrainSection

MIS = mis_jax.MISConfig.from_yaml("configs/mis.yaml")
LOSSES = {
  "recompute": mis_jax.LossConfig(use_tis=True, mis=MIS),
  "loglinear": mis_jax.LossConfig(use_tis=True, mis=MIS, proximal="loglinear"),
}
LARGER = dataclasses.replace(
  PRESETS["tiny-qwen3"],
  num_hidden_layers=4,
  hidden_size=256,
  intermediate_size=768,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=64,
)


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  model: object
  samples: int
  prompt_len: int
  response_len: int
  row_len: int
  tokens_per_micro_batch: int
  ppo_epochs: int = 2


SHAPES = (
  Shape("demo (tiny-qwen3, 128 x 4 tokens)", PRESETS["tiny-qwen3"], 128, 5, 4, 64, 1024),
  Shape("4-layer 256-wide Qwen3, 64 x 64 tokens", LARGER, 64, 16, 64, 128, 2048),
)


def _step_batch(shape: Shape, seed=0):
  rng = np.random.default_rng(seed)
  vocab = shape.model.vocab_size
  samples = [
    types.SimpleNamespace(
      prompt_ids=rng.integers(3, vocab, shape.prompt_len).tolist(),
      response_ids=rng.integers(3, vocab, shape.response_len).tolist(),
      rollout_logprobs=(-rng.uniform(0.5, 3.0, shape.response_len)).astype(np.float32),
    )
    for _ in range(shape.samples)
  ]
  rewards = rng.uniform(0, 1, shape.samples).astype(np.float32)
  groups = np.arange(shape.samples) // 8
  adv = np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=int(groups.max()) + 1))
  staleness = [rng.integers(0, 2, shape.response_len) for _ in samples]  # an asynchronous loop's 0 or 1
  return build_step_batch(
    samples,
    rewards,
    adv,
    groups,
    num_segments=shape.samples,
    row_len=shape.row_len,
    tokens_per_micro_batch=shape.tokens_per_micro_batch,
    batch_devices=1,
    staleness=staleness,
  )


def _step(fns, loss_cfg, params, opt_state, inputs, batch, epochs):
  """The devices' work of one `Trainer.train_on` (without host transfers and metrics)."""
  if loss_cfg.needs_old_logprobs:
    batch = batch.replace(old_logprobs=fns.logprobs(params, inputs, batch.segment_ids).logprobs)
  correction, _ = fns.prepare(batch)
  for _ in range(epochs):
    params, opt_state, metrics = fns.train(params, opt_state, inputs, batch, correction)
  return jax.block_until_ready((params, opt_state, metrics))


def measure(shape: Shape, reps: int) -> list[dict]:
  mesh = parallel.make_mesh(parallel.ParallelSection(fsdp=1), jax.devices()[:1])
  sb = _step_batch(shape)
  put = lambda x: jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x)))
  inputs = step_lib.ModelInputs(put(sb.input_ids), put(sb.positions), put(sb.targets))
  init = jax.device_get(nnx.state(CausalLM(shape.model, rngs=nnx.Rngs(0)), nnx.Param))  # host: a new copy per put
  runs = {}
  for name, loss_cfg in LOSSES.items():
    fns = step_lib.build_step_functions(
      shape.model, mesh, loss_cfg, TrainSection(ppo_epochs=shape.ppo_epochs), attention="blocked", remat="full"
    )
    batch = jax.tree.map(
      put, sb.batch if loss_cfg.proximal == "loglinear" else sb.batch.replace(rollout_staleness=None)
    )
    runs[name] = (fns, loss_cfg, batch)
  times = {name: [] for name in runs}
  for rep in range(reps + 1):  # the first: compiles
    for name, (fns, loss_cfg, batch) in runs.items():
      params = jax.device_put(init, fns.param_shardings)  # donated by the step: a fresh copy each time
      opt_state = fns.init_opt_state(params)
      jax.block_until_ready((params, opt_state))
      t0 = time.perf_counter()
      _step(fns, loss_cfg, params, opt_state, inputs, batch, shape.ppo_epochs)
      if rep:
        times[name].append(time.perf_counter() - t0)
  tokens = int(np.asarray(sb.batch.segment_ids >= 0).sum())
  return [
    {
      "shape": shape.name,
      "proximal": name,
      "ppo_epochs": shape.ppo_epochs,
      "tokens": tokens,
      "micro_batches": sb.layout.micro_batches,
      "reps": reps,
      "median_ms": 1e3 * float(np.median(t)),
      "p25_ms": 1e3 * float(np.percentile(t, 25)),
      "p75_ms": 1e3 * float(np.percentile(t, 75)),
      "old_logprob_passes": int(LOSSES[name].needs_old_logprobs),
    }
    for name, t in times.items()
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="the demo shape, 3 repetitions")
  parser.add_argument("--reps", type=int, default=30)
  parser.add_argument("--json", default="benchmarks/results/proximal.json")
  args = parser.parse_args(argv)
  shapes, reps = (SHAPES[:1], 3) if args.quick else (SHAPES, args.reps)
  records = []
  print(f"{'shape':42s} {'proximal':>10s} {'passes':>6s} {'median ms':>10s} {'p25-p75 ms':>14s} {'saved':>7s}")
  for shape in shapes:
    rows = measure(shape, reps)
    base = rows[0]["median_ms"]
    for r in rows:
      r["saved_fraction"] = 1.0 - r["median_ms"] / base
      print(
        f"{r['shape']:42s} {r['proximal']:>10s} {r['old_logprob_passes']:6d} {r['median_ms']:10.1f} "
        f"{r['p25_ms']:6.1f}-{r['p75_ms']:<7.1f} {100 * r['saved_fraction']:6.1f}%",
        flush=True,
      )
    records += rows
  if not args.quick:
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "records": records}, f, indent=1)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
