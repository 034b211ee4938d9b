"""Per-device memory of the full training step for Qwen3-1.7B and Qwen3-8B shapes, compiled for
8 simulated CPU devices, and for the Qwen3-30B-A3B mixture of experts on 8 and 16, read from
XLA's `memory_analysis()` (nothing is run or allocated).

    python -m benchmarks.memory [--quick] [--json PATH]     (make bench-memory)

Two steps, side by side, per model and tokens per device:

- `before`: the step as it was before `trainers.learner.step` — everything on one device, float32
  compute, dense `[T, T]` attention, no remat, full `[T, V]` logits with `log_softmax`, and an
  Optax update that returns a new copy of parameters and state (no donation). (The layer loop
  was unrolled; here it is the same layers in a `lax.scan` without remat, which keeps the same
  activations for the backward pass.)
- `after`: `trainers.learner.step.StepFunctions.train` — parameters, Adam state and float32 gradient
  accumulators FSDP-sharded over the 8 devices, bf16 compute with float32 master weights,
  blocked (flash-style) attention, full remat of the layer scan, log-probs and entropy chunk by
  chunk with `mis_jax.token_logprobs`, parameters and optimiser state donated.

Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts top-8, expert FFN 768, 32/4 heads) runs
the `after` step with an `expert` mesh axis of 8 (experts split 8 ways, everything else over
`fsdp × expert`), on 8 devices and on 16 (`fsdp` 2 × `expert` 8), once per expert dispatch:
`grouped` (pairs sorted by expert, in per-expert blocks) against the straightforward `dense`
(every expert on every token) and `ragged_dot` (which XLA:CPU lowers to a masked product over
all experts: its CPU figure is not a TPU's, where the op is native).

Decoupled PPO's proximal log-probs (`--proximal`, contract §6.3): per model at 16k tokens per
device, the programs of one step with `loss.proximal: recompute` (the old-log-prob pass, then the
step) and `loglinear` (the step alone, its correction inside the loss).

Score centering (`--centering`, contract §6.6): per model at 16k tokens per device, the step with
`score_centering` on — the sampler's top-20 log-probs and ids per token in the batch, the trainer's
log-probs of those ids gathered in the chunked pass — against the same step without.

`model.remat` / `model.attention` auto (`--auto`): per model at 16k tokens per device, the `after`
step compiled with each candidate of `trainers.learner.memory_plan.LADDER` (no remat + dense
attention first) until one fits 0.9 x 16 GB, and the choice (the trainer makes the same decision
at start-up against its own device).

All are the decoupled-PPO loss of the reference MIS config on one micro-batch of
`tokens_per_device` tokens per device (one row of that length per device). `per_device_bytes`
= arguments + outputs + temporaries − aliased (donated) bytes of the compiled program on one
device. Figures are XLA:CPU's; a GPU or TPU compile differs (other fusion and layouts), so
treat them as the shape of the budget, and check on hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 16)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import mis_jax  # noqa: E402
from trainers.learner import memory_plan, step as step_lib  # noqa: E402
from trainers.runtime import parallel
from trainers.config import TrainSection  # noqa: E402
from trainers.models import ModelConfig  # noqa: E402
from trainers.models.hf_io import abstract_model  # noqa: E402

MODELS = {
  "qwen3-1.7b": ModelConfig(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=True,
  ),
  "qwen3-8b": ModelConfig(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=False,
  ),
}
MOE_MODELS = {
  "qwen3-30b-a3b": ModelConfig(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
  ),
}
# (devices, mesh) of the MoE cases: the expert axis 8, the rest fsdp.
MOE_MESHES = {8: parallel.ParallelSection(fsdp=1, expert=8), 16: parallel.ParallelSection(fsdp=2, expert=8)}
MOE_TOKENS = 16384
TOKENS = (16384, 32768)
TARGETS_GB = {("qwen3-1.7b", 16384): 14.0, ("qwen3-8b", 32768): 60.0, ("qwen3-30b-a3b", 16384, 8): 110.0}
QUICK_MODEL = dataclasses.replace(MODELS["qwen3-1.7b"], num_hidden_layers=2, vocab_size=8192)
LOSS = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml"))
OPTIM = TrainSection()
SEQ_LEN = 1024  # sequences per row: tokens_per_device / SEQ_LEN (sizes the segment count)


def _abstract_batch(rows: int, row_len: int, num_segments: int, sharding, rep, loss=LOSS) -> tuple:
  """Model inputs, the batch and the correction (`mis_jax.Correction`) the step receives under
  `loss`: with `proximal: loglinear` no old log-probs nor precomputed weights, the staleness
  instead, and no kept-token denominators (they follow the current log-probs); with score centering
  the sampler's top-`CENTERING_K` ids (an input) and log-probs (the batch's) per token."""
  sd = lambda dtype: jax.ShapeDtypeStruct((1, rows, row_len), dtype, sharding=sharding)
  inputs = step_lib.ModelInputs(sd(jnp.int32), sd(jnp.int32), sd(jnp.int32))
  if loss.score_centering:
    topk = lambda dtype: jax.ShapeDtypeStruct(
      (1, rows, row_len, CENTERING_K), dtype, sharding=NamedSharding(sharding.mesh, P(*sharding.spec, None))
    )
    inputs = inputs._replace(extra={"top_logprob_ids": topk(jnp.int32)})
    batch, correction = _abstract_batch(
      rows, row_len, num_segments, sharding, rep, dataclasses.replace(loss, score_centering=False)
    )[1:]
    return inputs, batch.replace(rollout_topk_logprobs=topk(jnp.float32)), correction
  if loss.correction_in_loss:
    batch = mis_jax.PackedBatch(
      segment_ids=sd(jnp.int32),
      loss_mask=sd(jnp.bool_),
      advantages=sd(jnp.float32),
      rollout_logprobs=sd(jnp.float32),
      rollout_staleness=sd(jnp.float32),
      num_segments=num_segments,
    )
  else:
    batch = mis_jax.PackedBatch(
      segment_ids=sd(jnp.int32),
      loss_mask=sd(jnp.bool_),
      advantages=sd(jnp.float32),
      rollout_logprobs=sd(jnp.float32),
      old_logprobs=sd(jnp.float32),
      num_segments=num_segments,
    )
  correction = (
    mis_jax.Correction()
    if loss.correction_in_loss
    else mis_jax.Correction(is_weights=sd(jnp.float32), kept_mask=sd(jnp.bool_))
  )
  if loss.correction_in_loss and loss.denominator == "kept":
    return inputs, batch, correction
  dens = mis_jax.Denominators(
    seg_tokens=jax.ShapeDtypeStruct((num_segments,), jnp.float32, sharding=rep),
    num_tokens=jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
    num_seqs=jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
  )
  return inputs, batch, correction.replace(denominators=dens)


def _analysis(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
  }
  out["per_device_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
  return out


def after_step(
  cfg: ModelConfig,
  tokens: int,
  devices,
  section=None,
  *,
  loss=LOSS,
  program="train",
  remat="full",
  attention="blocked",
  **model_kwargs,
) -> dict:
  """The compiled `program` of `trainers.learner.step.StepFunctions`: `train` (the step) or
  `logprobs` (the old-log-prob pass, same inputs); full remat and blocked attention unless said."""
  mesh = parallel.make_mesh(section or parallel.ParallelSection(fsdp=-1), devices)
  fns = step_lib.build_step_functions(
    cfg,
    mesh,
    loss,
    OPTIM,
    logprob_chunk=1024,
    dtype=jnp.bfloat16,
    param_dtype=jnp.float32,
    attention=attention,
    remat=remat,
    **model_kwargs,
  )
  abstract, psh, osh, optimizer = fns.abstract_params, fns.param_shardings, fns.opt_shardings, fns.optimizer
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, psh)
  opt_state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(optimizer.init, abstract), osh
  )
  rows = mesh.size
  inputs, batch, correction = _abstract_batch(
    rows, tokens, rows * max(1, tokens // SEQ_LEN), parallel.batch_sharding(mesh), NamedSharding(mesh, P()), loss
  )
  if program == "logprobs":
    return _analysis(fns.logprobs.lower(params, inputs, batch.segment_ids).compile())
  return _analysis(fns.train.lower(params, opt_state, inputs, batch, correction).compile())


def before_step(cfg: ModelConfig, tokens: int, devices) -> dict:
  """The pre-`trainers.learner.step` program: value_and_grad of full-logits log-probs of an f32,
  dense-attention, no-remat model, then the Optax update, un-donated, on one device."""
  graphdef, abstract = nnx.split(
    abstract_model(cfg, dtype=jnp.float32, param_dtype=jnp.float32, attention="dense", remat="none")
  )
  optimizer = step_lib.make_optimizer(OPTIM)
  dev = jax.sharding.SingleDeviceSharding(devices[0])

  def step(params, opt_state, inputs, batch, correction):
    def loss(p):
      logits = nnx.merge(graphdef, p)(inputs.input_ids[0], inputs.positions[0], batch.segment_ids[0])
      logp = jax.nn.log_softmax(logits)
      lp = jnp.take_along_axis(logp, inputs.targets[0][..., None], axis=-1)[..., 0]
      ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
      mb = jax.tree.map(lambda x: x[0], batch)
      mb_correction = jax.tree.map(lambda x: x[0], correction.replace(denominators=None)).replace(
        denominators=correction.denominators
      )
      return mis_jax.policy_loss(lp, mb, LOSS, entropy=ent, correction=mb_correction)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), abstract)
  opt_state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), jax.eval_shape(optimizer.init, abstract)
  )
  args = _abstract_batch(1, tokens, max(1, tokens // SEQ_LEN), dev, dev)
  return _analysis(jax.jit(step).lower(params, opt_state, *args).compile())


# `model.remat` / `model.attention` auto (`trainers.learner.memory_plan`) for a 16 GB-class device.
AUTO_DEVICE_GB = 16.0
AUTO_TOKENS = 16384


def auto_record(name: str, cfg: ModelConfig, tokens: int, devices) -> dict:
  """What `auto` chooses for the `after` step of `cfg` at `tokens` per device against `SAFETY` x
  `AUTO_DEVICE_GB`: the candidates compiled, cheapest first, until one fits."""
  t0 = time.perf_counter()
  budget = memory_plan.Budget(
    int(memory_plan.SAFETY * AUTO_DEVICE_GB * 1e9), f"{memory_plan.SAFETY:g} x {AUTO_DEVICE_GB:g} GB"
  )
  choice = memory_plan.choose(
    "auto",
    "auto",
    lambda remat, attention: after_step(cfg, tokens, devices, remat=remat, attention=attention)["per_device_bytes"],
    budget,
  )
  return {
    "model": name,
    "tokens_per_device": tokens,
    "step": "auto",
    "devices": len(devices),
    "backend": jax.default_backend(),
    "loss": "decoupled PPO, configs/mis.yaml",
    "budget_bytes": budget.bytes,
    "remat": choice.remat,
    "attention": choice.attention,
    "candidates": [{"remat": r, "attention": a, "per_device_bytes": b} for r, a, b in choice.measured],
    "compile_s": round(time.perf_counter() - t0, 1),
  }


# Colocated rollouts (`rollout.placement.mode: colocated`): the engine's programs on the first device of
# the trainer's mesh, bf16, 16 sequences of a 1024-token prompt and 1024 new tokens (32k of KV).
COLOCATED_ROWS, COLOCATED_PROMPT, COLOCATED_NEW = 16, 1024, 1024


def generation_programs(cfg: ModelConfig, devices, spread: bool = False) -> dict:
  """Compiled memory of the engine's prefill and decode (`trainers.serving.embedded.sampler`), bf16 weights,
  `COLOCATED_ROWS` rows; the KV cache lives inside them (an argument of decode). On `devices[0]`,
  or `spread` (`rollout.placement.colocated_devices: mesh`): the weights laid out as the trainer's over the
  FSDP mesh of `devices`, the rows split over it."""
  import functools
  from trainers.serving.embedded import sampler as sampler_lib

  graphdef, abstract = nnx.split(abstract_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
  if spread:
    mesh = parallel.make_mesh(parallel.ParallelSection(fsdp=-1), devices)
    shardings = parallel.param_shardings(abstract, mesh, cfg.family)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    rows_of = lambda ndim: NamedSharding(mesh, P(parallel.BATCH_AXES, *([None] * (ndim - 1))))
    scalar = NamedSharding(mesh, P())
  else:
    dev = jax.sharding.SingleDeviceSharding(devices[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), abstract)
    rows_of = lambda ndim: dev
    scalar = dev
  rows = COLOCATED_ROWS
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows_of(len(shape)))
  ids, lens = sd((rows, COLOCATED_PROMPT), jnp.int32), sd((rows,), jnp.int32)
  f32, i32 = sd((rows,), jnp.float32), sd((rows,), jnp.int32)
  prefill = jax.jit(functools.partial(sampler_lib._prefill, graphdef), static_argnames=("num_steps",))
  lowered = prefill.lower(params, ids, lens, f32, i32, num_steps=COLOCATED_NEW)
  compiled = lowered.compile()
  state = jax.eval_shape(
    functools.partial(sampler_lib._prefill, graphdef, num_steps=COLOCATED_NEW), params, ids, lens, f32, i32
  )
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, compiled.output_shardings
  )  # where the prefill leaves it
  # The decoding loop's last window, the whole cache: its largest program.
  decode = jax.jit(functools.partial(sampler_lib._decode, graphdef), static_argnames=("window",))
  decoded = decode.lower(
    params,
    state,
    lens,
    sd((rows,), jnp.uint32),
    f32,
    f32,
    i32,
    f32,
    i32,
    sd((rows, 4), jnp.int32),
    jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar),
    window=COLOCATED_PROMPT + COLOCATED_NEW,
  )
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  return {"prefill": _analysis(compiled), "decode": _analysis(decoded.compile()), "weight_bytes": weights}


def colocated_records(name: str, cfg: ModelConfig, tokens: int, devices) -> list[dict]:
  """The busiest device's peak in each phase of a colocated step (the trainer FSDP over `devices`):
  generation = the trainer's resident parameters and Adam state (the step's arguments but the
  batch) + the engine's decode program (its bf16 weights, KV cache, temporaries), with the engine
  on the first device or over the mesh; training = the step's peak, with the engine's weights
  freed (the synchronous loop) or kept (asynchronous; on the first device: all of them there)."""
  step = after_step(cfg, tokens, devices)
  resident = step["argument_bytes"]  # the trainer's parameters and Adam state (and a batch: under 1 MB)
  out = []
  for spread in (False, True):
    gen = generation_programs(cfg, devices, spread=spread)
    weights = gen.pop("weight_bytes")
    kept = weights // len(devices) if spread else weights  # per device (FSDP splits every large weight)
    base = {
      "model": name,
      "tokens_per_device": tokens,
      "devices": len(devices),
      "backend": jax.default_backend(),
      "loss": "decoupled PPO, configs/mis.yaml",
      "placement": "colocated",
      "colocated_devices": "mesh" if spread else "first",
      "engine_weight_bytes": weights,
      "generation_rows": COLOCATED_ROWS,
      "generation_prompt": COLOCATED_PROMPT,
      "generation_new": COLOCATED_NEW,
    }
    gen_peak = resident + max(gen["prefill"]["per_device_bytes"], gen["decode"]["per_device_bytes"])
    out += [
      {**base, "phase": "generation", "per_device_bytes": gen_peak, "engine_programs": gen},
      {**base, "phase": "training, engine weights freed", "per_device_bytes": step["per_device_bytes"]},
      {**base, "phase": "training, engine weights kept", "per_device_bytes": step["per_device_bytes"] + kept},
    ]
  return out


PROXIMAL_TOKENS = 16384
LOGLINEAR = mis_jax.LossConfig(use_tis=True, proximal="loglinear", mis=LOSS.mis)


def proximal_records(name: str, cfg: ModelConfig, tokens: int, devices) -> list[dict]:
  """Decoupled PPO's per-step programs with `loss.proximal` recompute (the old-log-prob pass, then
  the step) and loglinear (the step alone; the correction inside the loss, contract §6.3)."""
  out = []
  for proximal, loss, program in (
    ("recompute", LOSS, "logprobs"),
    ("recompute", LOSS, "train"),
    ("loglinear", LOGLINEAR, "train"),
  ):
    t0 = time.perf_counter()
    rec = {
      "model": name,
      "tokens_per_device": tokens,
      "step": "after",
      "devices": len(devices),
      "backend": jax.default_backend(),
      "loss": f"decoupled PPO, configs/mis.yaml, proximal {proximal}",
      "proximal": proximal,
      "program": "old-logprob pass" if program == "logprobs" else "train step",
      **after_step(cfg, tokens, devices, loss=loss, program=program),
    }
    rec["compile_s"] = round(time.perf_counter() - t0, 1)
    out.append(rec)
    print(
      f"{name:20s} {tokens:10d} {proximal:>10s} {rec['program']:>18s} {rec['temp_bytes'] / 1e9:9.2f} "
      f"{rec['per_device_bytes'] / 1e9:14.2f} {rec['compile_s']:9.1f}",
      flush=True,
    )
  return out


CENTERING_TOKENS, CENTERING_K = 16384, 20
CENTRED = mis_jax.LossConfig(use_tis=True, mis=LOSS.mis, score_centering=True)


def centering_records(name: str, cfg: ModelConfig, tokens: int, devices) -> list[dict]:
  """The step with score centering (contract §6.6; the sampler's top-`CENTERING_K` per token) and
  the same step without, compiled side by side."""
  out = []
  for centred, loss in ((False, LOSS), (True, CENTRED)):
    t0 = time.perf_counter()
    rec = {
      "model": name,
      "tokens_per_device": tokens,
      "step": "after",
      "devices": len(devices),
      "backend": jax.default_backend(),
      "loss": "decoupled PPO, configs/mis.yaml" + (f", score centering (top-{CENTERING_K})" if centred else ""),
      "score_centering": centred,
      "top_logprobs_num": CENTERING_K if centred else 0,
      **after_step(cfg, tokens, devices, loss=loss),
    }
    rec["compile_s"] = round(time.perf_counter() - t0, 1)
    out.append(rec)
    print(
      f"{name:20s} {tokens:10d} {str(centred):>9s} {rec['argument_bytes'] / 1e9:8.2f} "
      f"{rec['temp_bytes'] / 1e9:9.2f} {rec['per_device_bytes'] / 1e9:14.2f} {rec['compile_s']:9.1f}"
      + (f"   ({rec['per_device_bytes'] / out[0]['per_device_bytes'] - 1:+.2%})" if centred else ""),
      flush=True,
    )
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a 2-layer, 8k-vocab model at 2k tokens (seconds)")
  parser.add_argument("--json", default="benchmarks/results/memory.json")
  parser.add_argument("--models", nargs="*", default=sorted(MODELS))
  parser.add_argument("--steps", nargs="*", default=["before", "after"])
  parser.add_argument(
    "--proximal",
    nargs="*",
    default=sorted(MODELS),
    help="models whose step is compiled with the proximal log-probs recomputed and loglinear",
  )
  parser.add_argument(
    "--colocated",
    nargs="*",
    default=["qwen3-1.7b"],
    help="models whose colocated step (engine on the first device, and over the mesh) is measured by phase",
  )
  parser.add_argument(
    "--auto",
    nargs="*",
    default=["qwen3-1.7b"],
    help="models whose `model.remat` / `model.attention` auto choice is recorded (16 GB device)",
  )
  parser.add_argument("--moe", nargs="*", default=sorted(MOE_MODELS), help="mixture-of-experts models to measure")
  parser.add_argument(
    "--centering",
    nargs="*",
    default=["qwen3-1.7b"],
    help="models whose step is compiled with and without score centering (top-20)",
  )
  args = parser.parse_args(argv)
  all_devices = jax.devices()
  if len(all_devices) != 16:
    raise SystemExit(f"needs 16 devices (got {len(all_devices)}); run as `python -m benchmarks.memory`")
  devices = all_devices[:8]
  cases = (
    [("quick-1.7b-2layers", QUICK_MODEL, 2048)]
    if args.quick
    else [(name, MODELS[name], t) for name in args.models for t in TOKENS]
  )
  records = []
  print(
    f"{'model':20s} {'tokens/dev':>10s} {'step':>7s} {'args GB':>8s} {'out GB':>8s} {'temp GB':>9s} "
    f"{'alias GB':>9s} {'per-device GB':>14s} {'compile s':>9s}"
  )
  for name, cfg, tokens in cases:
    for which in args.steps:
      t0 = time.perf_counter()
      rec = {
        "model": name,
        "tokens_per_device": tokens,
        "step": which,
        "devices": len(devices),
        "backend": jax.default_backend(),
        "loss": "decoupled PPO, configs/mis.yaml",
        **(before_step if which == "before" else after_step)(cfg, tokens, devices),
      }
      rec["compile_s"] = round(time.perf_counter() - t0, 1)
      target = TARGETS_GB.get((name, tokens))
      if which == "after" and target:
        rec["target_bytes"] = int(target * 1e9)
      records.append(rec)
      gb = lambda k: rec[k] / 1e9
      print(
        f"{name:20s} {tokens:10d} {which:>7s} {gb('argument_bytes'):8.2f} {gb('output_bytes'):8.2f} "
        f"{gb('temp_bytes'):9.2f} {gb('alias_bytes'):9.2f} {gb('per_device_bytes'):14.2f} "
        f"{rec['compile_s']:9.1f}" + (f"   (target <= {target:g} GB)" if "target_bytes" in rec else ""),
        flush=True,
      )
  if not args.quick:
    print(
      f"\n{'MoE model':20s} {'tokens/dev':>10s} {'devices':>7s} {'mesh':>14s} {'dispatch':>8s} {'args GB':>8s} "
      f"{'out GB':>8s} {'temp GB':>9s} {'alias GB':>9s} {'per-device GB':>14s} {'compile s':>9s}"
    )
  for name in [] if args.quick else args.moe:
    cfg = MOE_MODELS[name]
    for num, section in MOE_MESHES.items():
      for dispatch in ("grouped", "ragged_dot", "dense"):
        t0 = time.perf_counter()
        mesh_desc = f"fsdp{section.fsdp}xexpert{section.expert}"
        rec = {
          "model": name,
          "tokens_per_device": MOE_TOKENS,
          "step": "after",
          "devices": num,
          "mesh": mesh_desc,
          "moe_dispatch": dispatch,
          "backend": jax.default_backend(),
          "loss": "decoupled PPO, configs/mis.yaml",
          **after_step(cfg, MOE_TOKENS, all_devices[:num], section, moe_dispatch=dispatch),
        }
        rec["compile_s"] = round(time.perf_counter() - t0, 1)
        target = TARGETS_GB.get((name, MOE_TOKENS, num))
        if target:
          rec["target_bytes"] = int(target * 1e9)
        records.append(rec)
        gb = lambda k: rec[k] / 1e9
        print(
          f"{name:20s} {MOE_TOKENS:10d} {num:7d} {mesh_desc:>14s} {dispatch:>8s} {gb('argument_bytes'):8.2f} "
          f"{gb('output_bytes'):8.2f} {gb('temp_bytes'):9.2f} {gb('alias_bytes'):9.2f} "
          f"{gb('per_device_bytes'):14.2f} {rec['compile_s']:9.1f}"
          + (f"   (target <= {target:g} GB)" if target else ""),
          flush=True,
        )
  if not args.quick and args.proximal:
    print(
      f"\n{'decoupled PPO':20s} {'tokens/dev':>10s} {'proximal':>10s} {'program':>18s} {'temp GB':>9s} "
      f"{'per-device GB':>14s} {'compile s':>9s}"
    )
  for name in [] if args.quick else args.proximal:
    records += proximal_records(name, MODELS[name], PROXIMAL_TOKENS, devices)
  if not args.quick and args.auto:
    print(
      f"\n{'auto':20s} {'tokens/dev':>10s} {'candidate (remat + attention)':>30s} {'per-device GB':>14s}  "
      f"(budget {memory_plan.SAFETY:g} x {AUTO_DEVICE_GB:g} GB)"
    )
  for name in [] if args.quick else args.auto:
    rec = auto_record(name, MODELS[name], AUTO_TOKENS, devices)
    records.append(rec)
    for c in rec["candidates"]:
      chosen = "  <- chosen" if (c["remat"], c["attention"]) == (rec["remat"], rec["attention"]) else ""
      print(
        f"{name:20s} {AUTO_TOKENS:10d} {c['remat'] + ' + ' + c['attention']:>30s} "
        f"{c['per_device_bytes'] / 1e9:14.2f}{chosen}",
        flush=True,
      )
  if not args.quick and args.colocated:
    print(f"\n{'colocated':20s} {'tokens/dev':>10s} {'phase (engine on)':>40s} {'per-device GB':>14s}")
  for name in [] if args.quick else args.colocated:
    for rec in colocated_records(name, MODELS[name], PROXIMAL_TOKENS, devices):
      records.append(rec)
      phase = f"{rec['phase']} ({rec['colocated_devices']})"
      print(f"{name:20s} {rec['tokens_per_device']:10d} {phase:>40s} {rec['per_device_bytes'] / 1e9:14.2f}", flush=True)
  if not args.quick and args.centering:
    print(
      f"\n{'score centering':20s} {'tokens/dev':>10s} {'centred':>9s} {'args GB':>8s} {'temp GB':>9s} "
      f"{'per-device GB':>14s} {'compile s':>9s}"
    )
  for name in [] if args.quick else args.centering:
    records += centering_records(name, MODELS[name], CENTERING_TOKENS, devices)
  if args.json and not args.quick:
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
