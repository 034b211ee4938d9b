"""tunix GRPO with mis_jax's rollout correction, on a tiny Qwen3 on the CPU (`make example-tunix`).

The sampler is tunix's own vanilla engine, run on a bfloat16 copy of the weights (synced from
the float32 trainer after every step, as a real inference server would be): its log-probs
differ from the trainer's, as SGLang's do. The two lines that differ from a stock tunix GRPO
script are marked `# mis_jax`. Every step prints the mismatch and correction metrics and how
many completions tunix could not train as sampled (a sampled pad id before other tokens).

    python examples/tunix_grpo_mis.py --steps 8 --mis configs/mis.yaml

With `--sglang-jax` the sampler is sglang-jax 0.1.0rc0 instead (SGLang's JAX port, in this
process, float32), its weights swapped in memory by tunix after every step, every sampled id
and its own log-probs kept (`mis_jax.integrations.tunix_sglang_jax.SglangJaxRollout`): they
agree with the trainer's to about 5e-7 per token. It needs the sglang-jax venv (Python >= 3.12)
with tunix installed: `make example-tunix-sglang-jax`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout, vanilla_rollout

from mis_jax.integrations import tunix as mis_tunix

SHOWN = ("mis_k3_kl", "train_rollout_logprob_abs_diff", "mis_is_ratio_mean_final", "mis_kept_token_fraction", "pg_loss")


class CharTokenizer:
  """A character tokenizer with tunix's tokenizer methods: 0 pad, 1 bos, 2 eos."""

  chars = "0123456789+=abcdefghijklmnopqrstu"

  def encode(self, text, **kw):
    return [1] + [3 + self.chars.index(c) for c in text]

  def decode(self, ids, **kw):
    return "".join(self.chars[i - 3] for i in ids if i >= 3)

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


class BF16Rollout(vanilla_rollout.VanillaRollout):
  """tunix's vanilla sampler on a bfloat16 copy of the actor: tunix syncs the trainer's weights
  into it after every step and casts them to bfloat16 (VanillaRollout.update_params)."""

  def __init__(self, rollout_actor, tokenizer, mesh, rollout_config):
    model = nnx.clone(rollout_actor)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    cfg = model.config
    super().__init__(
      model,
      tokenizer,
      base_rollout.CacheConfig(
        cache_size=rollout_config.kv_cache_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
      ),
    )


def sglang_jax_rollout(model_cfg, workdir: str, chars: str = CharTokenizer.chars, eos_id: int = 2):
  """tunix's sglang-jax rollout keeping the engine's log-probs, on a config.json (and a character
  tokenizer, which sglang-jax detokenizes with) matching the tunix model; its weights come from
  the actor (tunix's load_checkpoint), so the engine starts from random ("dummy") ones."""
  import json
  import os

  from tokenizers import Tokenizer, decoders, models
  from transformers import PreTrainedTokenizerFast

  from mis_jax.integrations.tunix_sglang_jax import SglangJaxRollout

  os.makedirs(workdir, exist_ok=True)
  hf = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": model_cfg.vocab_size,
    "hidden_size": model_cfg.embed_dim,
    "intermediate_size": model_cfg.hidden_dim,
    "num_hidden_layers": model_cfg.num_layers,
    "num_attention_heads": model_cfg.num_heads,
    "num_key_value_heads": model_cfg.num_kv_heads,
    "head_dim": model_cfg.head_dim,
    "rope_theta": model_cfg.rope_theta,
    "rms_norm_eps": model_cfg.norm_eps,
    "max_position_embeddings": 64,
    "tie_word_embeddings": model_cfg.use_tied_embedding,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": eos_id,
    "pad_token_id": 0,
    "attention_bias": False,
    "hidden_act": "silu",
  }
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(hf, f)
  vocab = {"<pad>": 0, "<s>": 1, "</s>": eos_id, **{c: 3 + i for i, c in enumerate(chars)}}
  core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  core.decoder = decoders.Fuse()
  PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
  ).save_pretrained(workdir)
  cpu = dict(
    device="cpu",
    attention_backend="native",
    grammar_backend="none",
    disable_precompile=True,
    skip_server_warmup=True,
    disable_overlap_schedule=True,
    max_total_tokens=4096,
    random_seed=0,
  )
  return SglangJaxRollout, dict(
    rollout_sglang_jax_model_version=workdir,
    rollout_sglang_jax_context_length=64,
    rollout_sglang_jax_mem_fraction_static=0.05,
    rollout_sglang_jax_load_format="dummy",
    # Not deterministic sampling: tunix gives every request the same seed, so each GRPO group
    # would be one completion repeated (zero advantages); random_seed keeps runs reproducible.
    rollout_sglang_jax_enable_deterministic_sampling=False,
    rollout_sglang_jax_page_size=1,
    rollout_sglang_jax_max_running_requests=64,
    rollout_sglang_jax_kwargs=cpu,
  )


def model_config(*, sglang_jax: bool = False) -> qwen3.ModelConfig:
  """The tiny Qwen3. rope_theta 1e6: tunix's Qwen3 computes with it whatever its config says
  (mis_jax.integrations.tunix.check_rope_theta); head_dim 128 with sglang-jax, whose CPU
  attention pads to it."""
  heads = (
    dict(num_heads=2, head_dim=128, num_kv_heads=1) if sglang_jax else dict(num_heads=4, head_dim=16, num_kv_heads=2)
  )
  return qwen3.ModelConfig(
    num_layers=2,
    vocab_size=36,
    embed_dim=64,
    hidden_dim=128,
    **heads,
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=False,
  )


def odd_digits(prompts, completions, **kw):
  """The reward: the fraction of odd digits in the completion."""
  return [sum(c in "13579" for c in text) / max(len(text), 1) for text in completions]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--mis", default="configs/mis.yaml", help="a mis.yaml (the reference page's keys)")
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--fp32-sampler", action="store_true", help="sample with the float32 weights (no mismatch)")
  parser.add_argument("--sglang-jax", action="store_true", help="sample with sglang-jax (float32, in process)")
  parser.add_argument("--json", default=None, help="write the per-step metrics (and rewards) here")
  parser.add_argument("--workdir", default="runs/tunix-sglang-jax", help="sglang-jax's config.json and tokenizer")
  args = parser.parse_args(argv)

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  model_cfg = model_config(sglang_jax=args.sglang_jax)
  engine, engine_config = "vanilla" if args.fp32_sampler else BF16Rollout, {}
  if args.sglang_jax:
    engine, engine_config = sglang_jax_rollout(model_cfg, args.workdir)
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(0))
  cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=actor,
    tokenizer=CharTokenizer(),
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={
        role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
      },
      rollout_engine=engine,
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adam(1e-3), eval_every_n_steps=10_000, max_steps=args.steps
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=8,
        max_prompt_length=8,
        temperature=args.temperature,
        top_p=1.0,
        kv_cache_size=32,
        seed=0,
        **engine_config,
      ),
    ),
  )

  config = mis_tunix.MISGRPOConfig(num_generations=4, beta=0.0, mis=args.mis)  # mis_jax: was GRPOConfig
  learner = mis_tunix.MISGRPOLearner(cluster, config, [odd_digits])  # mis_jax: was GRPOLearner

  rng = np.random.default_rng(0)
  data = [{"prompts": np.array([f"{a}+{b}=" for a, b in rng.integers(0, 50, (4, 2))])} for _ in range(args.steps)]
  print(
    f"tunix GRPO + mis_jax: {config.loss_config.algorithm}, MIS config {args.mis}, "
    f"{'sglang-jax (float32)' if args.sglang_jax else 'float32' if args.fp32_sampler else 'bfloat16'} sampler, "
    f"T={args.temperature}"
  )
  start = time.time()
  learner.train(data)
  logger = cluster.actor_trainer.metrics_logger
  history = {name: logger.get_metric_history("actor", name, "train") for name in SHOWN}
  rewards = cluster._rl_metrics_logger.get_metric_history("rewards", "score/mean", "train")
  untrainable = cluster._rl_metrics_logger.get_metric_history(*mis_tunix.UNTRAINABLE_METRIC.split("/"), "train")
  print("step  reward  untrainable  " + "  ".join(f"{n:>30}" for n in SHOWN))
  for step in range(len(history[SHOWN[0]])):
    print(
      f"{step + 1:4d}  {rewards[step]:6.3f}  {int(untrainable[step]):11d}  "
      + "  ".join(f"{history[n][step]:30.4g}" for n in SHOWN)
    )
  print(
    f"{args.steps} steps in {time.time() - start:.1f} s; every mis_jax metric is in tunix's metrics "
    f"logger under prefix 'actor': {', '.join(learner.metric_names)}"
  )
  if args.json:
    import json

    with open(args.json, "w") as f:
      json.dump(
        {
          "sampler": "sglang-jax" if args.sglang_jax else "vanilla",
          "rewards": [float(r) for r in rewards],
          "untrainable": [int(u) for u in untrainable],
          **{n: [float(v) for v in history[n]] for n in SHOWN},
        },
        f,
      )
  return history


if __name__ == "__main__":
  main()
