"""One training step of a Qwen3-1.7B-shaped model at 16k tokens on one accelerator: peak memory
against XLA's compiled prediction, step time and MFU.

    python -m benchmarks.gpu_step [--quick] [--tokens N] [--steps N] [--peak-tflops F]

Random weights (nothing is downloaded), the decoupled-PPO loss of `configs/mis.yaml`, bf16
compute with float32 master weights, blocked attention (or `--attention fused`), full remat,
one micro-batch of `--tokens` tokens in rows of 4096 with sequences of 1024. MFU counts model
FLOPs only (6 · params · tokens for the matmuls plus causal attention within each sequence,
no remat recompute) against `--peak-tflops` (default: H100/H200 dense bf16, 989).
`--quick` runs a 2-layer, 8k-vocab model at 2k tokens: a check that the script works (CPU too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mis_jax
from benchmarks.memory import LOSS, MODELS, OPTIM
from trainers.training import parallel, step as step_lib
from trainers.models import CausalLM


def model_flops(cfg, tokens: int, seq_len: int) -> float:
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(
      nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)))
  # q·k and p·v, causal (half), fwd + bwd (3x), per layer and head.
  attention = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * seq_len / 2
  return 6.0 * params * tokens + attention


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--attention", default="blocked")
  parser.add_argument("--peak-tflops", type=float, default=989.0)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  cfg, tokens, row_len, seq_len = MODELS["qwen3-1.7b"], args.tokens, 4096, 1024
  if args.quick:
    cfg, tokens, row_len, seq_len = dataclasses.replace(cfg, num_hidden_layers=2, vocab_size=8192), 2048, 1024, 256
  device = jax.devices()[0]
  mesh = parallel.make_mesh(parallel.ParallelSection(fsdp=1), [device])
  fns = step_lib.build_step_functions(cfg, mesh, LOSS, OPTIM, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                      attention=args.attention, remat="full")
  params = nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)  # float32 master weights
  psh = fns.param_shardings
  params = jax.device_put(params, psh)
  opt_state = fns.init_opt_state(params)

  rows = tokens // row_len
  rng = np.random.default_rng(0)
  shape = (1, rows, row_len)
  seg = (np.arange(rows * row_len) // seq_len).reshape(shape).astype(np.int32)
  positions = (np.arange(rows * row_len) % seq_len).reshape(shape).astype(np.int32)
  ids = rng.integers(0, cfg.vocab_size, shape).astype(np.int32)
  inputs = step_lib.ModelInputs(*(jax.device_put(x) for x in (ids, positions, np.roll(ids, -1, axis=-1))))
  mask = positions >= 64  # a 64-token prompt per sequence
  q = -rng.uniform(0.1, 3.0, shape).astype(np.float32)
  batch = mis_jax.PackedBatch(segment_ids=seg, loss_mask=mask, advantages=rng.normal(size=shape).astype(np.float32),
                              rollout_logprobs=q, old_logprobs=q + rng.normal(0, 0.05, shape).astype(np.float32),
                              num_segments=int(seg.max()) + 1)
  batch = jax.tree.map(jax.device_put, batch)
  correction, _ = fns.prepare(batch)

  compiled = fns.train.lower(params, opt_state, inputs, batch, correction).compile()
  m = compiled.memory_analysis()
  predicted = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  times = []
  for _ in range(args.steps + 1):
    t0 = time.perf_counter()
    params, opt_state, metrics = fns.train(params, opt_state, inputs, batch, correction)
    jax.block_until_ready(metrics["loss"])
    times.append(time.perf_counter() - t0)
  step_s = min(times[1:])  # the first call includes compilation
  stats = device.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  flops = model_flops(cfg, tokens, seq_len)
  out = {"device": str(device.device_kind), "platform": device.platform, "model": "qwen3-1.7b" + ("-quick" if args.quick else ""),
         "tokens": tokens, "attention": args.attention, "predicted_bytes": int(predicted),
         "peak_bytes_in_use": peak, "step_s": step_s, "tokens_per_s": tokens / step_s,
         "model_tflops_per_s": flops / step_s / 1e12, "mfu": flops / step_s / (args.peak_tflops * 1e12),
         "loss": float(metrics["loss"])}
  print(json.dumps(out, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
