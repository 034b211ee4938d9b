"""Our RL step with the engine colocated and behind `mis-jax serve`, against tunix's GRPO with our
loss, side by side in one run, on this machine (`make bench-colocated`).

    python -m benchmarks.colocated [--quick] [--json benchmarks/results/colocated.json]
    python -m benchmarks.colocated --engine sglang-jax   # in sglang-jax's venv: make bench-colocated-sglang-jax

Three shapes of a Qwen3 with a 64-token vocabulary (`--shapes` runs a subset):

- `example`: tunix's example (`examples/tunix_grpo_mis.py`), 2 layers 64 wide (4 heads × 16 over
  2 KV heads), 4 prompts × 4 samples, responses of at most 8 tokens, steady state over steps 9–24;
- `larger`: 4 layers 256 wide (4 heads × 64 over 2), 16 prompts × 4 samples, at most 64 tokens,
  steady state over steps 5–12;
- `qwen3-0.6b-4l`: Qwen3-0.6B's width (1024 hidden, 16 heads × 128 over 8 KV heads, 3072
  intermediate) with 4 layers, 8 prompts × 4 samples, at most 128 tokens; a step takes tens of
  seconds on 2 CPU cores, so steady state over steps 3–4 only, and no `ours, server` row (the
  colocated engine against tunix).

The run first measures this machine's limits (`benchmarks.roofline`: dense-matmul FLOP/s in
float32 and bfloat16, memory bandwidth), and after each contender's steps times its phases apart
on the programs it ran (ours: the trainer's own compiled old-log-prob pass and update on the last
step's batch, the bfloat16 sampler's prefill and decode on the same shape; tunix: its
`RLCluster` methods and our integration's old-log-prob pass, wrapped with timers, per step) and reports each one's
achieved FLOP/s
as a fraction of the matmul FLOP/s of the dtype it computes in (the update and old-log-prob
pass float32, the sampler bfloat16). The model FLOPs, from `benchmarks.roofline`: update
`6 N` per token + attention, old log-probs and prefill `2 N` per token + attention, decode `2 N`
per generated token + attention over its context; the same work for both contenders. A third
table times the phases inside every timed step, the same way for both (each call blocked on:
ours the sampler's call, the old-log-prob pass and the update; tunix its `RLCluster` methods),
with the weight sync and what the step spends outside them all (requests and replies, rewards,
batch building, transfers, metrics): the phases timed apart are each a best of a few repeats,
so a step is not their sum.

The same work in every contender: decoupled PPO with `configs/mis.yaml` (old log-probs: ours
from the update's own forward, `train.old_logprobs: auto` with one micro-batch a step; tunix's
integration in a pass of its own), one update per step, Adam, a bfloat16 sampler of float32 weights re-synced
after every step, no reference model. Contenders:

- `ours, colocated`: `rollout.placement.mode: colocated` (the engine in the trainer's process, weights
  handed over in memory);
- `ours, server`: the embedded `mis-jax serve` process (HTTP, safetensors written and read back);
- `tunix`: tunix 0.1.7's `GRPOLearner` with our loss (`mis_jax.integrations.tunix`) and its
  vanilla sampler on a bfloat16 copy, the example's `BF16Rollout`.

With `--engine sglang-jax` (run in sglang-jax's venv, Python >= 3.12) every contender samples
with sglang-jax 0.1.0rc0 in float32, on 128-wide heads (its CPU attention pads to 128):

- `ours, colocated, sglang-jax`: its `Engine` in the trainer's process, the weights swapped into
  its model runner in memory (`rollout.placement.engine: sglang-jax`);
- `ours, server, sglang-jax`: its HTTP server (our routes added), the weights through safetensors;
- `tunix, sglang-jax`: tunix's `SglangJaxRollout` (its `Engine` in process, tunix's in-memory
  weight sync) with the log-probs kept (`mis_jax.integrations.tunix_sglang_jax`).

A step is timed from one batch request to the next (every contender: rollout, rewards, old
log-probs, update, weight sync, bookkeeping), one device. Every response is `max_new_tokens` long
(ours: `ignore_eos`; tunix: an end-of-sequence id outside the vocabulary), so the contenders
generate and train on the same number of tokens; the mean response length is reported beside
the times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from unittest import mock

import jax
import numpy as np

from benchmarks import roofline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  layers: int
  hidden: int
  intermediate: int
  head_dim: int
  prompts: int
  n: int
  max_new_tokens: int
  steps: int
  first_timed: int  # steps before it are warm-up (compiles)
  row_len: int  # ours: packed rows of prompt + response (two sequences or more per row)
  heads: int = 4
  kv_heads: int = 2
  server: bool = True  # the `ours, server` contender too
  phase_repeats: int = 5  # best of, for the phases timed apart


SHAPES = (
  Shape("example", 2, 64, 128, 16, 4, 4, 8, 24, 9, 32),
  Shape("larger", 4, 256, 768, 64, 16, 4, 64, 12, 5, 72),
  Shape("qwen3-0.6b-4l", 4, 1024, 3072, 128, 8, 4, 128, 4, 3, 136, heads=16, kv_heads=8, server=False, phase_repeats=2),
)
# sglang-jax's CPU attention pads head_dim to 128: its shapes have 128-wide heads, GQA 2:1. The
# example's shape only: at the larger one sglang-jax decodes ~100 tokens/s here (a step of ours
# takes ~40 s), and tunix's sglang-jax run stopped inside sglang-jax's sampler (a ShardingTypeError
# in its top-k/top-p gather for a one-request batch, 2026-12-04).
SGLANG_JAX_SHAPES = (Shape("example", 2, 64, 128, 128, 4, 4, 8, 24, 9, 32, heads=2, kv_heads=1),)
VOCAB = 64
CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"  # ids 3..63 (0 pad, 1 bos, 2 eos)


def _model_config(shape: Shape):
  from trainers.models import PRESETS

  return dataclasses.replace(
    PRESETS["tiny-qwen3"],
    num_hidden_layers=shape.layers,
    hidden_size=shape.hidden,
    intermediate_size=shape.intermediate,
    head_dim=shape.head_dim,
    vocab_size=VOCAB,
    num_attention_heads=shape.heads,
    num_key_value_heads=shape.kv_heads,
    tie_word_embeddings=False,
    initializer_range=0.02,
  )


def _model_dir(shape: Shape, root: str) -> str:
  from trainers.models import init_checkpoint

  path = os.path.join(root, f"init-{shape.name}")
  if not os.path.exists(path):
    init_checkpoint(path, config=_model_config(shape), seed=0)
  return path


class _LastCalls:
  """Stands in for the trainer's `StepFunctions`, keeping the arguments of the last old-log-prob
  pass and update it ran, or of the update with its own old log-probs (`train_fused`: a step of
  one micro-batch under `train.old_logprobs: auto`); nothing is blocked on: the step runs as it would."""

  def __init__(self, fns):
    self.fns, self.forward_args, self.train_args, self.fused_args = fns, None, None, None

  def __getattr__(self, name):
    return getattr(self.fns, name)

  def forward(self, heads):
    run = self.fns.forward(heads)

    def recorded(params, inputs, segment_ids):
      self.forward_args = (heads, inputs, segment_ids)
      return run(params, inputs, segment_ids)

    return recorded

  def train(self, params, opt_state, *rest):
    self.train_args = rest
    return self.fns.train(params, opt_state, *rest)

  def train_fused(self, params, opt_state, *rest):
    self.fused_args = rest
    return self.fns.train_fused(params, opt_state, *rest)


def _sequence_lengths(segment_ids) -> list[int]:
  ids = np.asarray(segment_ids).ravel()
  return [int(n) for n in np.bincount(ids[ids >= 0]) if n]


def trainer_phases(trainer, recorded: _LastCalls, repeats: int) -> tuple[dict, list[int]]:
  """The old-log-prob pass (when the step made one) and the update, each timed apart (best of
  `repeats`) on the last step's batch with the trainer's own compiled programs; and the batch's
  sequence lengths. A fused step's update is `train_fused` (its own forward gives the old log-probs)."""
  fns, phases = recorded.fns, {}
  if recorded.fused_args is not None:
    program, args, segment_ids = fns.train_fused, recorded.fused_args, recorded.fused_args[1].segment_ids
  else:
    heads, inputs, segment_ids = recorded.forward_args
    forward = fns.forward(heads)
    phases["old_logprobs_s"] = roofline.best_time(
      lambda: jax.block_until_ready(forward(trainer.params, inputs, segment_ids)), repeats
    )
    program, args = fns.train, recorded.train_args
  state = [trainer.params, trainer.opt_state]

  def update():
    state[0], state[1], metrics = program(state[0], state[1], *args)[:3]
    jax.block_until_ready(metrics)

  phases["update_s"] = roofline.best_time(update, repeats)
  trainer.params, trainer.opt_state = state
  return phases, _sequence_lengths(segment_ids)


def sampler_phases(shape: Shape, model_dir: str, prompt_len: int) -> dict:
  """The bfloat16 sampler of the colocated engine at this shape, on its own: prefill (a call
  that generates one token per sample) and decode (the rest of a full call, per token)."""
  from trainers.serving.embedded.generation import GenerationEngine

  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, VOCAB, prompt_len).tolist() for _ in range(shape.prompts)]
  engine = GenerationEngine(model_dir, dtype="bfloat16", seed=0)
  try:
    return roofline.generation_times(
      engine.sampler, prompts, n=shape.n, new_tokens=shape.max_new_tokens, repeats=shape.phase_repeats
    )
  finally:
    engine.close()


def roofline_fractions(shape: Shape, phases: dict, seq_lens: list[int], limits) -> dict:
  """Each timed phase: seconds, model FLOPs, achieved FLOP/s over the machine's matmul FLOP/s in
  the phase's dtype. `seq_lens`: the trained sequences (prompt + response)."""
  cfg = _model_config(shape)
  prompt_lens = [max(s - shape.max_new_tokens, 1) for s in seq_lens]
  work = {
    "update": (roofline.train_flops(cfg, seq_lens), "float32"),
    "old_logprobs": (roofline.forward_flops(cfg, seq_lens), "float32"),
    "prefill": (roofline.prefill_flops(cfg, prompt_lens), "bfloat16"),
    "decode": (roofline.decode_flops(cfg, prompt_lens, shape.max_new_tokens - 1), "bfloat16"),
    "generate": (
      roofline.prefill_flops(cfg, prompt_lens) + roofline.decode_flops(cfg, prompt_lens, shape.max_new_tokens),
      "bfloat16",
    ),
  }
  out = {}
  for name, (flops, dtype) in work.items():
    seconds = phases.get(f"{name}_s")
    if seconds:
      out[name] = {
        "s": seconds,
        "flops": flops,
        "dtype": dtype,
        "flops_per_s": flops / seconds,
        "fraction": limits.fraction(flops, seconds, dtype),
      }
  return out


def _step_times(stamps: list[float], shape: Shape) -> list[float]:
  """Seconds per step over the timed steps: stamp `k` is when step `k + 1` asked for its batch."""
  return list(np.diff(stamps[shape.first_timed - 1 :]))


def ours(shape: Shape, placement: str, root: str, engine: str = "embedded", limits=None) -> dict:
  """Our trainer with the engine `colocated` or behind a `server` process: `mis-jax serve` (bfloat16)
  or, `engine` sglang-jax (float32, in its venv), its HTTP server taking the weights from disk."""
  from trainers.serving.sglang_jax import launcher as sglang_jax
  from trainers.serving.embedded.server import EmbeddedServer
  from trainers.app import trainer as train_lib
  from trainers.config import TrainConfig

  import mis_jax

  model = _model_dir(shape, root)
  run_dir = os.path.join(root, f"run-{shape.name}-{placement}-{engine}")
  dtype = "float32" if engine == "sglang-jax" else "bfloat16"
  cfg = TrainConfig.from_dict(
    {
      "run_dir": run_dir,
      "seed": 0,
      "model": {"path": model, "remat": "none"},
      "task": {"name": "copy_digits", "num_digits": 3},
      "rollout": {
        "prompts_per_step": shape.prompts,
        "n": shape.n,
        "sampling": {"temperature": 0.8, "max_new_tokens": shape.max_new_tokens},
        "placement": {"mode": placement, "engine": engine, "server_dtype": dtype},
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
  sampling_params = train_lib.Trainer.sampling_params
  with (
    contextlib.ExitStack() as running,
    mock.patch.object(train_lib.Trainer, "sampling_params", lambda self: {**sampling_params(self), "ignore_eos": True}),
  ):
    urls = []
    if placement == "server" and engine == "sglang-jax":
      urls = [running.enter_context(sglang_jax.SGLangJaxServer(model, dtype=dtype, weight_version="0")).url]
    elif placement == "server":
      urls = [
        running.enter_context(EmbeddedServer(model, dtype=dtype, seed=0, extra_args=("--weight-version", "0"))).url
      ]
    trainer = train_lib.Trainer(cfg, loss, urls=urls)
    stamps, take = [], trainer.source.next
    trainer.source.next = lambda step: stamps.append(time.perf_counter()) or take(step)
    trainer.fns = recorded = _LastCalls(trainer.fns)
    per_step = {}
    if limits is not None:  # the phases inside each step, timed as tunix's are
      forward = recorded.forward
      recorded.forward = lambda heads: _timed(forward(heads), "old_logprobs_s", stamps, per_step)
      _time_methods(recorded, {"train": "update_s", "train_fused": "update_s"}, stamps, per_step)
      if placement == "colocated" and engine == "embedded":
        _time_methods(trainer.servers.weight_sync.engine.inner.sampler, {"generate": "generate_s"}, stamps, per_step)
    history = trainer.run(progress=False, log=lambda *a, **k: None)
    phases = {}
    if limits is not None:  # after the timed steps: the phases apart, for the roofline
      per_step["sync_s"] = {k + 1: h["sync_s"] for k, h in enumerate(history)}
      phases, seq_lens = trainer_phases(trainer, recorded, shape.phase_repeats)
      phases.update(sampler_phases(shape, model, round(float(np.mean(seq_lens))) - shape.max_new_tokens))
  times = _step_times(stamps, shape)
  timed = history[shape.first_timed - 1 : shape.steps]
  name = f"ours, {placement}" + (", sglang-jax" if engine == "sglang-jax" else "")
  return {
    "contender": name,
    "shape": shape.name,
    "step_ms": 1e3 * float(np.median(times)),
    "steps_per_s": 1.0 / float(np.median(times)),
    "sync_ms": 1e3 * float(np.median([h["sync_s"] for h in timed])),
    "rollout_ms": 1e3 * float(np.median([h["rollout_s"] for h in timed])),
    "train_ms": 1e3 * float(np.median([h["train_s"] for h in timed])),
    "mean_response_tokens": float(np.mean([h["response_length"] for h in timed])),
    "step_s_all": [float(x) for x in times],
    "train_s_all": [h["train_s"] for h in timed],
    "micro_batches": [h["micro_batches"] for h in timed],
    **(
      {
        "phases": phases,
        "roofline": roofline_fractions(shape, phases, seq_lens, limits),
        "in_step": in_step_phases(stamps, per_step, shape),
      }
      if phases
      else {}
    ),
  }


TUNIX_PHASES = {"generate": "generate_s", "update_actor": "update_s", "sync_weights": "sync_s"}
# Our integration recomputes the old log-probs in its own method (its `RLCluster`'s is pointed at it).
TUNIX_LEARNER_PHASES = {"old_per_token_logps": "old_logprobs_s"}


def _timed(run, phase: str, stamps: list, per_step: dict):
  """`run`, each call's seconds (its results blocked on) added to `per_step[phase][step]`, the
  step being `len(stamps)` (batches asked so far)."""

  def timed(*args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(run(*args, **kwargs))
    steps = per_step.setdefault(phase, {})
    steps[len(stamps)] = steps.get(len(stamps), 0.0) + time.perf_counter() - t0
    return out

  return timed


def _time_methods(obj, names: dict, stamps: list, per_step: dict) -> None:
  """Wraps `obj`'s methods `names` (method → phase) with `_timed`."""
  for method, phase in names.items():
    setattr(obj, method, _timed(getattr(obj, method), phase, stamps, per_step))


def in_step_phases(stamps: list, per_step: dict, shape: Shape) -> dict:
  """Each phase's median seconds over the timed steps as timed inside them (the same way for
  every contender), and `outside_s`: the median of what a step spends outside those phases
  (requests and replies, rewards, batch building, transfers, metrics, bookkeeping)."""
  steps = range(shape.first_timed, shape.steps + 1)
  durations = dict(zip(steps, _step_times(stamps, shape)))
  out = {phase: float(np.median([by_step.get(k, 0.0) for k in steps])) for phase, by_step in per_step.items()}
  out["outside_s"] = float(
    np.median([durations[k] - sum(by_step.get(k, 0.0) for by_step in per_step.values()) for k in steps])
  )
  return out


def tunix(shape: Shape, root: str, engine: str = "vanilla", limits=None) -> dict:
  """tunix's GRPO with our loss; its sampler the example's bfloat16 copy (`vanilla`) or, `engine`
  sglang-jax (float32, in its venv), its `Engine` in process with the log-probs kept."""
  import optax
  from flax import nnx
  from jax.sharding import AxisType
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.rollout import base_rollout

  from examples.tunix_grpo_mis import BF16Rollout, sglang_jax_rollout
  from mis_jax.integrations import tunix as mis_tunix

  class Tokenizer:
    """64 symbols: 0 pad, 1 bos, 2 eos."""

    def encode(self, text, **kw):
      return [1] + [3 + CHARS.index(c) for c in text]

    def decode(self, ids, **kw):
      return "".join(CHARS[i - 3] for i in ids if 3 <= i < VOCAB)

    def bos_id(self):
      return 1

    def eos_id(self):
      return 1000  # never sampled: every response is max_new_tokens long, as ours (ignore_eos)

    def pad_id(self):
      return 0

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  model_cfg = qwen3.ModelConfig(
    num_layers=shape.layers,
    vocab_size=VOCAB,
    embed_dim=shape.hidden,
    hidden_dim=shape.intermediate,
    num_heads=shape.heads,
    head_dim=shape.head_dim,
    num_kv_heads=shape.kv_heads,
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=False,
  )
  rollout_engine, engine_config = BF16Rollout, {}
  if engine == "sglang-jax":
    # Its end-of-sequence id outside the vocabulary: every response max_new_tokens long, as ours.
    rollout_engine, engine_config = sglang_jax_rollout(
      model_cfg, os.path.join(root, f"tunix-{shape.name}"), CHARS, eos_id=1000
    )
    engine_config["rollout_sglang_jax_context_length"] = 8 + shape.max_new_tokens + 8
    # Our engine's flags (the reward here is constant, so the example's reason to sample freely is moot).
    engine_config["rollout_sglang_jax_enable_deterministic_sampling"] = True
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(0))
  cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=actor,
    tokenizer=Tokenizer(),
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={
        role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
      },
      rollout_engine=rollout_engine,
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adam(1e-3), eval_every_n_steps=10_000, max_steps=shape.steps + 1
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=shape.max_new_tokens,
        max_prompt_length=8,
        temperature=0.8,
        top_p=1.0,
        kv_cache_size=8 + shape.max_new_tokens + 8,
        seed=0,
        **engine_config,
      ),
    ),
  )
  config = mis_tunix.MISGRPOConfig(num_generations=shape.n, beta=0.0, mis=os.path.join(ROOT, "configs/mis.yaml"))
  learner = mis_tunix.MISGRPOLearner(cluster, config, [lambda prompts, completions, **kw: [0.5] * len(completions)])
  rng = np.random.default_rng(0)
  stamps, per_step = [], {}
  if limits is not None:
    _time_methods(cluster, TUNIX_PHASES, stamps, per_step)
    _time_methods(learner, TUNIX_LEARNER_PHASES, stamps, per_step)

  def batches():
    for _ in range(shape.steps + 1):
      stamps.append(time.perf_counter())
      yield {"prompts": np.array([f"{a}+{b}=" for a, b in rng.integers(0, 50, (shape.prompts, 2))])}

  learner.train(batches())
  times = _step_times(stamps, shape)
  lengths = cluster._rl_metrics_logger.get_metric_history("completions", "mean_length", "train")
  record = {
    "contender": "tunix" + (", sglang-jax" if engine == "sglang-jax" else ""),
    "shape": shape.name,
    "step_ms": 1e3 * float(np.median(times)),
    "steps_per_s": 1.0 / float(np.median(times)),
    "mean_response_tokens": float(np.mean(lengths[shape.first_timed - 1 : shape.steps])) if len(lengths) else None,
  }
  if per_step:
    record["in_step"] = in_step_phases(stamps, per_step, shape)
    phases = {k: v for k, v in record["in_step"].items() if k != "outside_s"}  # tunix's phases: the in-step medians
    record["phases"] = phases
    # The same sequences as ours: every prompt as long as its template, every response max_new_tokens.
    seq_lens = [len("00+00=") + 1 + shape.max_new_tokens] * (shape.prompts * shape.n)
    record["roofline"] = {
      k: v
      for k, v in roofline_fractions(shape, phases, seq_lens, limits).items()
      if k in ("update", "old_logprobs", "generate")
    }
  return record


PHASE_COLUMNS = ("update", "old_logprobs", "prefill", "decode", "generate")
IN_STEP_COLUMNS = ("generate_s", "old_logprobs_s", "update_s", "sync_s", "outside_s")


def _label(name: str) -> str:
  s = next(s for s in SHAPES + SGLANG_JAX_SHAPES if s.name == name)
  return f"{s.name}: {s.layers}-layer {s.hidden}-wide, {s.prompts * s.n} samples × {s.max_new_tokens} tokens"


def markdown(records: list[dict], limits) -> str:
  """The tables of docs/performance.md's colocated section, from a run's records (each shape's
  name on its first row)."""
  lines = [
    "| shape | contender | step ms | steps/s | × tunix | rollout / update / weight sync ms |",
    "|---|---|---|---|---|---|",
  ]
  last = None
  for r in records:
    split = f"{r['rollout_ms']:,.1f} / {r['train_ms']:,.1f} / {r['sync_ms']:,.1f}" if "sync_ms" in r else "—"
    ratio = (
      f"**{r['ratio_to_tunix']:.2f}**" if r["contender"].startswith("ours, colocated") else f"{r['ratio_to_tunix']:.2f}"
    )
    shape = _label(r["shape"]) if r["shape"] != last else ""
    last = r["shape"]
    lines.append(f"| {shape} | {r['contender']} | {r['step_ms']:,.1f} | {r['steps_per_s']:.2f} | {ratio} | {split} |")
  if limits is None:
    return "\n".join(lines)
  lines += [
    "",
    f"Roofline: {roofline.describe(limits)}. Each phase timed apart: ms, and achieved FLOP/s as % of the "
    "matmul FLOP/s of its dtype (update and old log-probs float32, the sampler bfloat16; tunix's "
    "generation is its `RLCluster.generate`, ours the sampler's call):",
    "",
    "| shape | contender | update | old log-probs | prefill | decode | whole generation |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in records:
    if "roofline" not in r:
      continue
    cells = [
      (
        f"{1e3 * r['roofline'][k]['s']:,.1f} ms, {100 * r['roofline'][k]['fraction']:.1f} %"
        if k in r["roofline"]
        else "—"
      )
      for k in PHASE_COLUMNS
    ]
    lines.append(f"| {r['shape']} | {r['contender']} | " + " | ".join(cells) + " |")
  lines += [
    "",
    "Inside each timed step (median ms; every contender's phases timed the same way, blocked on "
    "within the step), and what the step spends outside them:",
    "",
    "| shape | contender | step | generation | old log-probs | update | weight sync | outside them |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    if "in_step" not in r:
      continue
    cells = [f"{1e3 * r['in_step'][k]:,.1f}" if k in r["in_step"] else "—" for k in IN_STEP_COLUMNS]
    lines.append(f"| {r['shape']} | {r['contender']} | {r['step_ms']:,.1f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def contenders(shape: Shape, root: str, engine: str, limits) -> list[dict]:
  """The shape's rows, tunix's last (the base of the ratios); the phases (with `limits`) of ours
  colocated and of tunix."""
  rows = [ours(shape, "colocated", root, engine, limits=limits)]
  if shape.server:
    rows.append(ours(shape, "server", root, engine))
  rows.append(tunix(shape, root, "sglang-jax" if engine == "sglang-jax" else "vanilla", limits=limits))
  base = rows[-1]["steps_per_s"]
  for r in rows:
    r["ratio_to_tunix"] = r["steps_per_s"] / base
  return rows


def select_shapes(shapes, names: str | None, quick: bool) -> list[Shape]:
  known = {s.name: s for s in shapes}
  if names:
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
      raise SystemExit(f"--shapes: unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    shapes = [known[n] for n in names.split(",")]
  return [dataclasses.replace(shapes[0], steps=6, first_timed=3)] if quick else list(shapes)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="the first shape, 6 steps; nothing written")
  parser.add_argument("--shapes", default=None, help="comma-separated subset of: " + ", ".join(s.name for s in SHAPES))
  parser.add_argument(
    "--engine",
    default="embedded",
    choices=("embedded", "sglang-jax"),
    help="sglang-jax: every contender samples with sglang-jax (run in its venv)",
  )
  parser.add_argument("--json", default=None, help="default benchmarks/results/colocated[-sglang-jax].json")
  parser.add_argument(
    "--markdown", metavar="JSON", default=None, help="print the docs' tables of a run's JSON (runs nothing)"
  )
  args = parser.parse_args(argv)
  if args.markdown:
    with open(args.markdown) as f:
      run = json.load(f)
    print(markdown(run["records"], roofline.Limits(**run["roofline"]) if run.get("roofline") else None))
    return 0
  sglang = args.engine == "sglang-jax"
  path = args.json or f"benchmarks/results/colocated{'-sglang-jax' if sglang else ''}.json"
  shapes = select_shapes(SGLANG_JAX_SHAPES if sglang else SHAPES, args.shapes, args.quick)
  limits = None if sglang else roofline.measure(quick=args.quick)  # the roofline: our engine's runs
  if limits is not None:
    print(roofline.describe(limits), flush=True)
  root = tempfile.mkdtemp(prefix="bench-colocated-")
  records = []
  print(
    f"{'shape':14s} {'contender':30s} {'step ms':>9s} {'steps/s':>8s} {'x tunix':>8s} {'sync ms':>8s} "
    f"{'response tokens':>16s}"
  )
  try:
    for shape in shapes:
      rows = contenders(shape, root, args.engine, limits)
      for r in rows:
        sync = f"{r['sync_ms']:8.1f}" if "sync_ms" in r else f"{'':8s}"
        length = r.get("mean_response_tokens")
        print(
          f"{shape.name:14s} {r['contender']:30s} {r['step_ms']:9.1f} {r['steps_per_s']:8.2f} "
          f"{r['ratio_to_tunix']:8.2f} {sync} {'' if length is None else f'{length:16.1f}'}",
          flush=True,
        )
      records += rows
      if not args.quick:  # after each shape: a run stopped later keeps the shapes it finished
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
          json.dump(
            {
              "backend": jax.default_backend(),
              "devices": 1,
              "engine": args.engine,
              "roofline": limits.to_dict() if limits is not None else None,
              "records": records,
            },
            f,
            indent=1,
          )
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print("\n" + markdown(records, limits))
  if not args.quick:
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
