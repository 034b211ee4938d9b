"""`make bench-gpu`: what one accelerator does with the trainer's programs, in a few minutes.

    python -m benchmarks.gpu_step [--dry-run] [--models qwen3-0.6b,qwen3-1.7b] [--tokens N]
                                  [--peak-tflops F] [--json PATH]

Measures, on the first device (random weights, nothing is downloaded):

1. the machine's limits (`benchmarks.roofline`: dense-matmul FLOP/s in float32 and bfloat16,
   memory bandwidth);
2. for each of `--models` (default Qwen3-0.6B and Qwen3-1.7B): one training step at `--tokens`
   (16k) tokens in rows of 4096, sequences of 1024 (a 64-token prompt each), the decoupled-PPO
   loss of `configs/mis.yaml`, bf16 compute on float32 master weights, `--attention` and
   `--remat` as given: step time, MFU, peak memory against XLA's compiled prediction;
3. the embedded sampler (`trainers.serving.embedded`, bfloat16) of `--sampler-model`: prefill
   and decode tokens/s at `--batch` rows (64, its default `max_batch_size`) of `--prompt-len`
   tokens decoding `--new-tokens` each;
4. the colocated handover of the same model (as `rollout.placement.mode: colocated` does it,
   `trainers.rollout.weight_sync.MemorySync`): the trainer's float32 weights cast to bfloat16 on
   the device and handed to the engine in memory (`GenerationEngine.update_weights`), and back
   (`release_weights`: the engine frees its copy so the next step has the memory).

MFU counts model FLOPs only (`benchmarks.roofline.train_flops`: `6 N` per token plus causal
attention, no remat recompute) against `--peak-tflops`: by default the device kind's spec-sheet
dense bf16 figure (`roofline.PEAK_BF16_TFLOPS`; H100/H200: 989), else 989. The fraction of the
matmul FLOP/s measured in step 1 is printed beside it.

`--dry-run` runs every part at tiny shapes on whatever device there is (CPU in CI): the code
paths are the real run's, the figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mis_jax
from benchmarks import roofline
from benchmarks.memory import LOSS, MODELS, OPTIM
from trainers.models import CausalLM, ModelConfig, init_checkpoint
from trainers.runtime import parallel
from trainers.learner import step as step_lib

GPU_MODELS = {
  "qwen3-0.6b": ModelConfig(
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
  "qwen3-1.7b": MODELS["qwen3-1.7b"],
}


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The shapes of a run: the step's tokens, rows and sequences; the sampler's batch."""

  tokens: int = 16384
  row_len: int = 4096
  seq_len: int = 1024
  prompt_len: int = 64  # of each trained sequence (its loss mask starts after)
  batch: int = 64
  sampler_prompt_len: int = 512
  new_tokens: int = 512
  repeats: int = 3


DRY_RUN = Sizes(
  tokens=256, row_len=128, seq_len=64, prompt_len=8, batch=4, sampler_prompt_len=8, new_tokens=8, repeats=1
)


def tiny(cfg: ModelConfig) -> ModelConfig:
  """`cfg` cut to a size that compiles and runs in a second on a CPU (`--dry-run`)."""
  return dataclasses.replace(
    cfg,
    num_hidden_layers=1,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
  )


def step_batch(cfg: ModelConfig, sizes: Sizes, rng) -> tuple:
  """One micro-batch of random token ids in packed rows, with its PPO batch."""
  rows = sizes.tokens // sizes.row_len
  shape = (1, rows, sizes.row_len)
  seg = (np.arange(rows * sizes.row_len) // sizes.seq_len).reshape(shape).astype(np.int32)
  positions = (np.arange(rows * sizes.row_len) % sizes.seq_len).reshape(shape).astype(np.int32)
  ids = rng.integers(0, cfg.vocab_size, shape).astype(np.int32)
  inputs = step_lib.ModelInputs(*(jax.device_put(x) for x in (ids, positions, np.roll(ids, -1, axis=-1))))
  q = -rng.uniform(0.1, 3.0, shape).astype(np.float32)
  batch = mis_jax.PackedBatch(
    segment_ids=seg,
    loss_mask=positions >= sizes.prompt_len,
    advantages=rng.normal(size=shape).astype(np.float32),
    rollout_logprobs=q,
    old_logprobs=q + rng.normal(0, 0.05, shape).astype(np.float32),
    num_segments=int(seg.max()) + 1,
  )
  return inputs, jax.tree.map(jax.device_put, batch)


def train_step(cfg: ModelConfig, sizes: Sizes, *, attention: str, remat: str, peak_flops: float, limits) -> dict:
  """Step time, MFU and memory of one training step of `cfg` on the first device."""
  device = jax.devices()[0]
  mesh = parallel.make_mesh(parallel.ParallelSection(fsdp=1), [device])
  fns = step_lib.build_step_functions(
    cfg, mesh, LOSS, OPTIM, dtype=jnp.bfloat16, param_dtype=jnp.float32, attention=attention, remat=remat
  )
  params = jax.device_put(nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param), fns.param_shardings)
  opt_state = fns.init_opt_state(params)
  inputs, batch = step_batch(cfg, sizes, np.random.default_rng(0))
  correction, _ = fns.prepare(batch)
  compiled = fns.train.lower(params, opt_state, inputs, batch, correction).compile()
  m = compiled.memory_analysis()
  predicted = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  state = {"params": params, "opt_state": opt_state}

  def step():
    state["params"], state["opt_state"], metrics = fns.train(
      state["params"], state["opt_state"], inputs, batch, correction
    )
    state["loss"] = float(metrics["loss"])  # blocks

  step_s = roofline.best_time(step, sizes.repeats)
  flops = roofline.model_flops(cfg, sizes.tokens, sizes.seq_len)
  peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
  return {
    "tokens": sizes.tokens,
    "attention": attention,
    "remat": remat,
    "predicted_bytes": int(predicted),
    "peak_bytes_in_use": peak,
    "step_s": step_s,
    "tokens_per_s": sizes.tokens / step_s,
    "model_tflops_per_s": flops / step_s / 1e12,
    "mfu": flops / step_s / peak_flops,
    "of_measured_bf16_matmul": limits.fraction(flops, step_s, "bfloat16"),
    "loss": state["loss"],
  }


def sampler_and_handover(cfg: ModelConfig, sizes: Sizes, root: str) -> dict:
  """The embedded engine (bfloat16) of `cfg`: its prefill and decode tokens/s, and the colocated
  handover of float32 trainer weights into it and back."""
  from trainers.serving.embedded.generation import GenerationEngine

  path = os.path.join(root, "model")
  init_checkpoint(path, config=cfg, seed=0, dtype="bfloat16")
  engine = GenerationEngine(path, dtype="bfloat16", seed=0, max_batch_size=sizes.batch)
  try:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, sizes.sampler_prompt_len).tolist() for _ in range(sizes.batch)]
    times = roofline.generation_times(engine.sampler, prompts, n=1, new_tokens=sizes.new_tokens, repeats=sizes.repeats)
    trainer_params = nnx.state(CausalLM(cfg, rngs=nnx.Rngs(1)), nnx.Param)  # float32, on the device
    cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))

    def hand_over():  # MemorySync.push: cast on the trainer's devices, then the engine takes them
      ok, message = engine.update_weights(cast(trainer_params), "1")
      if not ok:
        raise RuntimeError(message)

    hand_over()  # compiles the cast
    handover, release = [], []
    for _ in range(sizes.repeats):
      t0 = time.perf_counter()
      engine.release_weights()
      t1 = time.perf_counter()
      hand_over()
      release.append(t1 - t0)
      handover.append(time.perf_counter() - t1)
  finally:
    engine.close()
  rows_tokens = sizes.batch * sizes.new_tokens
  return {
    "model_params": roofline.matmul_params(cfg),
    "batch": sizes.batch,
    "prompt_len": sizes.sampler_prompt_len,
    "new_tokens": sizes.new_tokens,
    **times,
    "prefill_tokens_per_s": sizes.batch * sizes.sampler_prompt_len / times["prefill_s"],
    "decode_tokens_per_s": rows_tokens / times["decode_s"],
    "generate_tokens_per_s": rows_tokens / times["generate_s"],
    "handover_s": min(handover),
    "release_s": min(release),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dry-run", action="store_true", help="every part at tiny shapes (CPU): a check that it runs")
  parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b", help="comma-separated: " + ", ".join(GPU_MODELS))
  parser.add_argument("--sampler-model", default="qwen3-1.7b", choices=tuple(GPU_MODELS))
  parser.add_argument("--tokens", type=int, default=Sizes.tokens)
  parser.add_argument("--batch", type=int, default=Sizes.batch)
  parser.add_argument("--new-tokens", type=int, default=Sizes.new_tokens)
  parser.add_argument("--attention", default="blocked")
  parser.add_argument("--remat", default="full")
  parser.add_argument(
    "--peak-tflops",
    type=float,
    default=None,
    help="the MFU's denominator; default the device kind's dense bf16 figure, else 989",
  )
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  names = args.models.split(",")
  unknown = [n for n in names if n not in GPU_MODELS]
  if unknown:
    parser.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(GPU_MODELS)}")
  sizes = DRY_RUN if args.dry_run else Sizes(tokens=args.tokens, batch=args.batch, new_tokens=args.new_tokens)
  if sizes.tokens % sizes.row_len or sizes.row_len % sizes.seq_len:
    parser.error(f"--tokens {sizes.tokens} must be a multiple of the row length {sizes.row_len}")
  configs = {n: tiny(GPU_MODELS[n]) if args.dry_run else GPU_MODELS[n] for n in set(names) | {args.sampler_model}}
  device = jax.devices()[0]
  peak_tflops = args.peak_tflops or roofline.nominal_peak_tflops(device.device_kind) or roofline.DEFAULT_PEAK_TFLOPS
  t0 = time.perf_counter()
  limits = roofline.measure(quick=args.dry_run)
  print(roofline.describe(limits), flush=True)
  out = {
    "device": str(device.device_kind),
    "platform": device.platform,
    "dry_run": args.dry_run,
    "peak_tflops": peak_tflops,
    "roofline": limits.to_dict(),
    "sizes": dataclasses.asdict(sizes),
    "steps": {},
  }
  for name in names:
    out["steps"][name] = train_step(
      configs[name], sizes, attention=args.attention, remat=args.remat, peak_flops=peak_tflops * 1e12, limits=limits
    )
    r = out["steps"][name]
    print(
      f"step {name}: {r['step_s'] * 1e3:,.1f} ms for {r['tokens']} tokens, MFU {100 * r['mfu']:.1f} % of "
      f"{peak_tflops:g} TFLOP/s ({100 * r['of_measured_bf16_matmul']:.1f} % of the measured bf16 matmul), "
      f"peak memory {r['peak_bytes_in_use']} bytes (XLA predicted {r['predicted_bytes']})",
      flush=True,
    )
  with tempfile.TemporaryDirectory(prefix="bench-gpu-") as root:
    out["sampler"] = s = sampler_and_handover(configs[args.sampler_model], sizes, root)
  print(
    f"sampler {args.sampler_model}: {s['batch']} rows × {s['prompt_len']} prompt tokens: prefill "
    f"{s['prefill_tokens_per_s']:,.0f} tokens/s; decode {s['new_tokens']} tokens each: "
    f"{s['decode_tokens_per_s']:,.0f} tokens/s; handover in {1e3 * s['handover_s']:,.1f} ms, "
    f"release {1e3 * s['release_s']:,.1f} ms",
    flush=True,
  )
  out["wall_s"] = time.perf_counter() - t0
  print(json.dumps(out, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
