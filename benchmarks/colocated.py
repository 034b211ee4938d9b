"""Our RL step with the engine colocated and behind `mis-jax serve`, against tunix's GRPO with our
loss, side by side in one run, on this machine (`make bench-colocated`).

    python -m benchmarks.colocated [--quick] [--json benchmarks/results/colocated.json]
    python -m benchmarks.colocated --engine sglang-jax   # in sglang-jax's venv: make bench-colocated-sglang-jax

Two shapes, each a 2-layer 64-wide (tunix's example, `examples/tunix_grpo_mis.py`) or a 4-layer
256-wide Qwen3 with a 64-token vocabulary, GQA 4:2:

- `example`: 4 prompts × 4 samples, responses of at most 8 tokens, steady state over steps 9–24;
- `larger`: 16 prompts × 4 samples, at most 64 tokens, steady state over steps 5–12.

The same work in every contender: decoupled PPO with `configs/mis.yaml` (tunix computes the
old log-probs too), one update per step, Adam, a bfloat16 sampler of float32 weights re-synced
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


SHAPES = (Shape("example", 2, 64, 128, 16, 4, 4, 8, 24, 9, 32),
          Shape("larger", 4, 256, 768, 64, 16, 4, 64, 12, 5, 72))
# sglang-jax's CPU attention pads head_dim to 128: its shapes have 128-wide heads, GQA 2:1. The
# example's shape only: at the larger one sglang-jax decodes ~100 tokens/s here (a step of ours
# takes ~40 s), and tunix's sglang-jax run stopped inside sglang-jax's sampler (a ShardingTypeError
# in its top-k/top-p gather for a one-request batch, 2026-12-04).
SGLANG_JAX_SHAPES = (Shape("example", 2, 64, 128, 128, 4, 4, 8, 24, 9, 32, heads=2, kv_heads=1),)
VOCAB = 64
CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"  # ids 3..63 (0 pad, 1 bos, 2 eos)


def _model_dir(shape: Shape, root: str) -> str:
  from trainers.models import PRESETS, init_checkpoint
  path = os.path.join(root, f"init-{shape.name}")
  config = dataclasses.replace(PRESETS["tiny-qwen3"], num_hidden_layers=shape.layers, hidden_size=shape.hidden,
                               intermediate_size=shape.intermediate, head_dim=shape.head_dim, vocab_size=VOCAB,
                               num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                               tie_word_embeddings=False, initializer_range=0.02)
  init_checkpoint(path, config=config, seed=0)
  return path


def _step_times(stamps: list[float], shape: Shape) -> list[float]:
  """Seconds per step over the timed steps: stamp `k` is when step `k + 1` asked for its batch."""
  return list(np.diff(stamps[shape.first_timed - 1:]))


def ours(shape: Shape, placement: str, root: str, engine: str = "embedded") -> dict:
  """Our trainer with the engine `colocated` or behind a `server` process: `mis-jax serve` (bfloat16)
  or, `engine` sglang-jax (float32, in its venv), its HTTP server taking the weights from disk."""
  from trainers.serving.sglang_jax import launcher as sglang_jax
  from trainers.serving.embedded.server import EmbeddedServer
  from trainers.training import train as train_lib
  from trainers.training.config import TrainConfig

  import mis_jax
  model = _model_dir(shape, root)
  run_dir = os.path.join(root, f"run-{shape.name}-{placement}-{engine}")
  dtype = "float32" if engine == "sglang-jax" else "bfloat16"
  cfg = TrainConfig.from_dict({
      "run_dir": run_dir, "seed": 0, "model": {"path": model, "remat": "none"},
      "task": {"name": "copy_digits", "num_digits": 3},
      "rollout": {"prompts_per_step": shape.prompts, "n": shape.n,
                  "sampling": {"temperature": 0.8, "max_new_tokens": shape.max_new_tokens},
                  "placement": {"mode": placement, "engine": engine, "server_dtype": dtype},
                  "sync": {"mismatch_check": False}},
      "train": {"steps": shape.steps + 1, "learning_rate": 1e-3, "ppo_epochs": 1, "row_len": shape.row_len,
                "tokens_per_micro_batch": 8192},
      "checkpoint": {"every": 1000, "max_to_keep": 1}})
  loss = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml(os.path.join(ROOT, "configs/mis.yaml")))
  sampling_params = train_lib.Trainer.sampling_params
  with contextlib.ExitStack() as running, mock.patch.object(
      train_lib.Trainer, "sampling_params", lambda self: {**sampling_params(self), "ignore_eos": True}):
    urls = []
    if placement == "server" and engine == "sglang-jax":
      urls = [running.enter_context(sglang_jax.SGLangJaxServer(model, dtype=dtype, weight_version="0")).url]
    elif placement == "server":
      urls = [running.enter_context(EmbeddedServer(model, dtype=dtype, seed=0, extra_args=("--weight-version", "0"))).url]
    trainer = train_lib.Trainer(cfg, loss, urls=urls)
    stamps, take = [], trainer.source.next
    trainer.source.next = lambda step: stamps.append(time.perf_counter()) or take(step)
    history = trainer.run(progress=False, log=lambda *a, **k: None)
  times = _step_times(stamps, shape)
  timed = history[shape.first_timed - 1:shape.steps]
  name = f"ours, {placement}" + (", sglang-jax" if engine == "sglang-jax" else "")
  return {"contender": name, "shape": shape.name, "step_ms": 1e3 * float(np.median(times)),
          "steps_per_s": 1.0 / float(np.median(times)), "sync_ms": 1e3 * float(np.median([h["sync_s"] for h in timed])),
          "rollout_ms": 1e3 * float(np.median([h["rollout_s"] for h in timed])),
          "train_ms": 1e3 * float(np.median([h["train_s"] for h in timed])),
          "mean_response_tokens": float(np.mean([h["response_length"] for h in timed])),
          "step_s_all": [float(x) for x in times], "train_s_all": [h["train_s"] for h in timed],
          "micro_batches": [h["micro_batches"] for h in timed]}


def tunix(shape: Shape, root: str, engine: str = "vanilla") -> dict:
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
  model_cfg = qwen3.ModelConfig(num_layers=shape.layers, vocab_size=VOCAB, embed_dim=shape.hidden,
                                hidden_dim=shape.intermediate, num_heads=shape.heads, head_dim=shape.head_dim,
                                num_kv_heads=shape.kv_heads,
                                rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=False)
  rollout_engine, engine_config = BF16Rollout, {}
  if engine == "sglang-jax":
    # Its end-of-sequence id outside the vocabulary: every response max_new_tokens long, as ours.
    rollout_engine, engine_config = sglang_jax_rollout(model_cfg, os.path.join(root, f"tunix-{shape.name}"), CHARS,
                                                       eos_id=1000)
    engine_config["rollout_sglang_jax_context_length"] = 8 + shape.max_new_tokens + 8
    # Our engine's flags (the reward here is constant, so the example's reason to sample freely is moot).
    engine_config["rollout_sglang_jax_enable_deterministic_sampling"] = True
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(0))
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=actor, tokenizer=Tokenizer(),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                                rl_cluster_lib.Role.ROLLOUT)},
          rollout_engine=rollout_engine,
          training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adam(1e-3), eval_every_n_steps=10_000,
                                                          max_steps=shape.steps + 1),
          rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=shape.max_new_tokens, max_prompt_length=8,
                                                    temperature=0.8, top_p=1.0,
                                                    kv_cache_size=8 + shape.max_new_tokens + 8, seed=0,
                                                    **engine_config)))
  config = mis_tunix.MISGRPOConfig(num_generations=shape.n, beta=0.0, mis=os.path.join(ROOT, "configs/mis.yaml"))
  learner = mis_tunix.MISGRPOLearner(cluster, config, [lambda prompts, completions, **kw: [0.5] * len(completions)])
  rng = np.random.default_rng(0)
  stamps = []

  def batches():
    for _ in range(shape.steps + 1):
      stamps.append(time.perf_counter())
      yield {"prompts": np.array([f"{a}+{b}=" for a, b in rng.integers(0, 50, (shape.prompts, 2))])}
  learner.train(batches())
  times = _step_times(stamps, shape)
  lengths = cluster._rl_metrics_logger.get_metric_history("completions", "mean_length", "train")
  return {"contender": "tunix" + (", sglang-jax" if engine == "sglang-jax" else ""), "shape": shape.name, "step_ms": 1e3 * float(np.median(times)),
          "steps_per_s": 1.0 / float(np.median(times)),
          "mean_response_tokens": float(np.mean(lengths[shape.first_timed - 1:shape.steps])) if len(lengths) else None}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="the example shape, 6 steps")
  parser.add_argument("--engine", default="embedded", choices=("embedded", "sglang-jax"),
                      help="sglang-jax: every contender samples with sglang-jax (run in its venv)")
  parser.add_argument("--json", default=None, help="default benchmarks/results/colocated[-sglang-jax].json")
  args = parser.parse_args(argv)
  sglang = args.engine == "sglang-jax"
  path = args.json or f"benchmarks/results/colocated{'-sglang-jax' if sglang else ''}.json"
  shapes = SGLANG_JAX_SHAPES if sglang else SHAPES
  shapes = [dataclasses.replace(shapes[0], steps=6, first_timed=3)] if args.quick else shapes
  root = tempfile.mkdtemp(prefix="bench-colocated-")
  records = []
  print(f"{'shape':8s} {'contender':30s} {'step ms':>8s} {'steps/s':>8s} {'x tunix':>8s} {'sync ms':>8s} "
        f"{'response tokens':>16s}")
  try:
    for shape in shapes:
      rows = [ours(shape, "colocated", root, args.engine), ours(shape, "server", root, args.engine),
              tunix(shape, root, "sglang-jax" if sglang else "vanilla")]
      base = rows[-1]["steps_per_s"]
      for r in rows:
        r["ratio_to_tunix"] = r["steps_per_s"] / base
        sync = f"{r['sync_ms']:8.1f}" if "sync_ms" in r else f"{'':8s}"
        length = r.get("mean_response_tokens")
        print(f"{shape.name:8s} {r['contender']:30s} {r['step_ms']:8.1f} {r['steps_per_s']:8.2f} "
              f"{r['ratio_to_tunix']:8.2f} {sync} {'' if length is None else f'{length:16.1f}'}", flush=True)
      records += rows
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if not args.quick:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump({"backend": jax.default_backend(), "devices": 1, "engine": args.engine, "records": records}, f,
                indent=1)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
