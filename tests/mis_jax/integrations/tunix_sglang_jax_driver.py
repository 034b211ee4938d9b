"""tunix 0.1.7 with sglang-jax 0.1.0rc0 trains exactly what the engine sampled, with the model the
engine runs. Run in sglang-jax's venv (Python >= 3.12, tunix installed there) by
tests/mis_jax/integrations/test_tunix.py, as one process:

1. ``completion_logprobs`` aligns by position only (synthetic replies, no engine), and a
   ``config.json`` with another ``rope_theta`` than tunix's Qwen3 computes with is refused;
2. the example (``examples/tunix_grpo_mis.py --sglang-jax``, 2 GRPO steps, float32 on both
   sides): every trained token's engine log-prob equals the one tunix recomputes from the same
   weights to 1e-5, and the completions with a sampled pad before other tokens were left out of
   the loss and counted in ``completions/untrainable``;
3. the example's model with its pad, bos and eos ids made likely, so it samples them
   mid-completion (tunix's rollout stage, 2 batches): the completion tokens are the engine's
   sampled ids, every log-prob sits at its own token's position, the pad-broken completions are
   masked and counted, and every trained token (after a sampled bos too) is within 1e-5 of
   tunix's own log-prob.

usage: python tunix_sglang_jax_driver.py WORKDIR OUT_JSON. Raises on any failure.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from mis_jax.integrations import tunix as mis_tunix
from mis_jax.integrations.tunix_sglang_jax import completion_logprobs

ROOT = pathlib.Path(__file__).resolve().parents[3]
TOL = 1e-5


def load_example():
  spec = importlib.util.spec_from_file_location("tunix_grpo_mis", ROOT / "examples" / "tunix_grpo_mis.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def reply(ids, entries, completion_tokens=None):
  meta = {"id": "r", "output_token_logprobs": [[lp, tok, ""] for lp, tok in entries]}
  if completion_tokens is not None:
    meta["completion_tokens"] = completion_tokens
  return {"output_ids": ids, "meta_info": meta}


def check_completion_logprobs():
  sampled = [(-0.5, 7), (-1.0, 0), (-1.5, 18), (-2.0, 1), (-2.5, 2)]
  np.testing.assert_array_equal(
    completion_logprobs(reply([7, 0, 18, 1, 2], sampled, 5)), np.float32([-0.5, -1.0, -1.5, -2.0, -2.5])
  )
  # sglang-jax resends a long completion's entries from the start: the last completion_tokens count.
  np.testing.assert_array_equal(
    completion_logprobs(reply([7, 0, 18, 1, 2], sampled[:2] + sampled, 5)), np.float32([-0.5, -1.0, -1.5, -2.0, -2.5])
  )
  # Special ids skipped from output_ids (tunix's skip_special_tokens): never aligned by id.
  for bad, match in [
    (reply([7, 18], sampled, 5), "2 output ids, 5 completion tokens"),
    (reply([7, 18, 1, 2, 0], sampled, 5), "output id 18 at position 1"),
    (reply([7, 0, 18, 1, 2], sampled[:4], 5), "4 log-prob entries"),
  ]:
    try:
      completion_logprobs(bad)
    except ValueError as e:
      assert match in str(e), (match, str(e))
    else:
      raise AssertionError(f"no error for {bad}")


def check_engine_rope_theta(ex, workdir):
  """A config.json whose rope_theta is not what tunix's Qwen3 computes with is refused before the
  engine starts."""
  import dataclasses

  from mis_jax import ConfigError

  model_cfg = ex.model_config(sglang_jax=True)
  rollout_cls, engine_config = ex.sglang_jax_rollout(
    dataclasses.replace(model_cfg, rope_theta=10_000), str(pathlib.Path(workdir) / "theta10000")
  )
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(0))
  config = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=8, **engine_config)
  try:
    rollout_cls(rollout_actor=actor, tokenizer=ex.CharTokenizer(), mesh=mesh, rollout_config=config)
  except ConfigError as e:
    assert "reads rope_theta=10000" in str(e) and "computes with 1000000" in str(e), str(e)
  else:
    raise AssertionError("sglang-jax was started on rope_theta 10000 for tunix's Qwen3")


def actor_weights(cluster) -> list:
  """The actor's parameters, copied to the host."""
  return [np.array(x) for x in jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param))]


def moved(before: list, after: list) -> bool:
  return any(not np.array_equal(a, b) for a, b in zip(before, after))


def record(learner, cluster):
  """Keeps the train examples and each rollout output (tokens, log-probs) with the engine's raw replies."""
  examples, outputs, weights = [], [], []
  produce = learner._generate_and_compute_advantage

  def recording(*args, **kwargs):
    weights.append(actor_weights(cluster))  # the actor before this step's update
    examples.append(produce(*args, **kwargs))
    return examples[-1]

  learner._generate_and_compute_advantage = recording
  engine_cls = type(cluster.rollout._sampler.engine)
  engine_generate = engine_cls.async_generate

  async def keeping(self, *args, **kwargs):
    out = await engine_generate(self, *args, **kwargs)
    outputs.append({"replies": out if isinstance(out, list) else [out]})
    return out

  engine_cls.async_generate = keeping
  generate = cluster.rollout.generate

  def keeping_output(*args, **kwargs):
    out = generate(*args, **kwargs)
    outputs[-1]["output"] = out
    return out

  cluster.rollout.generate = keeping_output

  def restore():
    engine_cls.async_generate = engine_generate
    weights.append(actor_weights(cluster))  # after the last step's update

  return examples, outputs, restore, weights


def trained_gap(example):
  mask = np.asarray(example.completion_mask).astype(bool)
  q, o = np.asarray(example.rollout_per_token_logps), np.asarray(example.old_per_token_logps)
  return np.abs(o - q)[mask]


def run_example(ex, workdir):
  """Phase 2: the example's own main, recording what its learner trains."""
  recorded = {}
  learner_cls = ex.mis_tunix.MISGRPOLearner

  class Recording(learner_cls):
    def __init__(self, cluster, *args, **kwargs):
      super().__init__(cluster, *args, **kwargs)
      recorded["examples"], recorded["outputs"], recorded["restore"], recorded["weights"] = record(self, cluster)

  ex.mis_tunix.MISGRPOLearner = Recording
  try:
    history_path = pathlib.Path(workdir) / "history.json"
    ex.main(
      [
        "--sglang-jax",
        "--steps",
        "2",
        "--json",
        str(history_path),
        "--workdir",
        str(pathlib.Path(workdir) / "ex"),
        "--mis",
        str(ROOT / "configs" / "mis.yaml"),
      ]
    )
  finally:
    ex.mis_tunix.MISGRPOLearner = learner_cls
    recorded.get("restore", lambda: None)()
  history = json.loads(history_path.read_text())
  # What tunix trained: every completion but those with a sampled pad before other tokens, counted.
  untrainable = [mis_tunix.untrainable_completions(e.completion_ids, 0) for e in recorded["examples"]]
  assert history["untrainable"] == [int(u.sum()) for u in untrainable], history
  for e, u in zip(recorded["examples"], untrainable):
    mask = np.asarray(e.completion_mask).astype(bool)
    np.testing.assert_array_equal(mask, (np.asarray(e.completion_ids) != 0) & ~u[:, None])
  gaps = np.concatenate([trained_gap(e) for e in recorded["examples"]])
  assert len(recorded["examples"]) == 2 and gaps.size > 20, gaps.size
  assert gaps.max() <= TOL, gaps.max()
  assert all(d <= TOL for d in history["train_rollout_logprob_abs_diff"]), history
  weights = recorded["weights"]  # before step 1, before step 2, after step 2: every update moved them
  assert len(weights) == 3 and all(moved(a, b) for a, b in zip(weights, weights[1:]))
  return {
    "example_history": history,
    "example_trained_tokens": int(gaps.size),
    "example_gap_mean": float(gaps.mean()),
    "example_gap_max": float(gaps.max()),
  }


def run_special_tokens(ex, workdir, steps=2):
  """Phase 3: pad (0), bos (1) and eos (2) made likely (their output-embedding columns 1.3, 1.8
  and 0.5 times the likeliest token's), sampled at T = 1 in two batches of 16 completions (the
  example's shapes, already compiled)."""
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  model_cfg = ex.model_config(sglang_jax=True)
  tokenizer = ex.CharTokenizer()
  pad, bos, eos = tokenizer.pad_id(), tokenizer.bos_id(), tokenizer.eos_id()
  batches = [
    {"prompts": np.array([f"{a}+{b}=" for a, b in pairs])}
    for pairs in np.random.default_rng(1).integers(0, 50, (steps, 4, 2))
  ]
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([tokenizer.encode(batches[0]["prompts"][0])])
    logits, _ = actor(
      tokens, jnp.arange(tokens.shape[1])[None], None, jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
    )
    column = actor.lm_head.w[...][:, int(jnp.argmax(jax.nn.softmax(logits[0], -1).mean(0)))]
    actor.lm_head.w[...] = (
      actor.lm_head.w[...].at[:, pad].set(1.3 * column).at[:, bos].set(1.8 * column).at[:, eos].set(0.5 * column)
    )
  engine, engine_config = ex.sglang_jax_rollout(model_cfg, str(pathlib.Path(workdir) / "special"))
  cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=actor,
    tokenizer=tokenizer,
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={
        role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
      },
      rollout_engine=engine,
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.sgd(0.0), eval_every_n_steps=10_000, max_steps=1
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=8, max_prompt_length=8, temperature=1.0, top_p=1.0, kv_cache_size=32, **engine_config
      ),
    ),
  )
  learner = mis_tunix.MISGRPOLearner(
    cluster,
    mis_tunix.MISGRPOConfig(num_generations=4, beta=0.0, mis=str(ROOT / "configs" / "mis.yaml")),
    [ex.odd_digits],
  )
  # The rollout stage alone (the example's run trains): what tunix hands its training step.
  learner._rollout_micro_batch_size = learner._compute_logps_micro_batch_size = 4  # set by train()
  examples, outputs, restore, _ = record(learner, cluster)
  try:
    for batch in batches:  # train() repeats each prompt num_generations times
      learner._generate_and_compute_advantage({"prompts": list(np.repeat(batch["prompts"], 4))})
  finally:
    restore()
  assert len(examples) == len(outputs) == steps
  counts = dict(untrainable=0, bos_mid_trained=0, eos_ended=0, trained_tokens=0, after_bos_tokens=0)
  gap_max = 0.0
  for example, recorded in zip(examples, outputs):
    output, replies = recorded["output"], recorded["replies"]
    ids = np.asarray(example.completion_ids)
    for b, (r, toks, lps) in enumerate(zip(replies, output.tokens, output.logprobs)):
      entries = r["meta_info"]["output_token_logprobs"][-len(toks) :]
      # The trainer's tokens are the engine's sampled ids, each log-prob its own token's.
      np.testing.assert_array_equal(toks, [e[1] for e in entries], err_msg=f"completion {b}")
      np.testing.assert_array_equal(lps, np.float32([e[0] for e in entries]), err_msg=f"completion {b}")
      np.testing.assert_array_equal(ids[b, : len(toks)], toks)
    untrainable = mis_tunix.untrainable_completions(ids, pad)
    mask = np.asarray(example.completion_mask).astype(bool)
    assert not mask[untrainable].any()
    np.testing.assert_array_equal(mask[~untrainable], (ids != pad)[~untrainable])
    gap = np.abs(np.asarray(example.old_per_token_logps) - np.asarray(example.rollout_per_token_logps))
    # Every trained token within TOL, those after a sampled bos included (dropping it would
    # shift them onto other tokens' contexts: 0.3-1.1 nats off).
    gap_max = max(gap_max, float(gap[mask].max()))
    for b, toks in enumerate(output.tokens):
      if not untrainable[b] and bos in toks[:-1]:
        counts["bos_mid_trained"] += 1
        counts["after_bos_tokens"] += len(toks) - 1 - list(toks).index(bos)
    counts["untrainable"] += int(untrainable.sum())
    counts["eos_ended"] += sum(int(t[-1] == eos) for t in output.tokens)
    counts["trained_tokens"] += int(mask.sum())
  (buffered,) = cluster._buffered_train_metrics
  logged, reduce = buffered.metrics[mis_tunix.UNTRAINABLE_METRIC]
  assert reduce is np.sum and int(np.sum(logged)) == counts["untrainable"] and len(logged) == steps, (logged, counts)
  # The model did sample them: pad ids mid-completion, bos ids in trained completions, eos ends.
  assert counts["untrainable"] and counts["bos_mid_trained"] and counts["eos_ended"], counts
  assert gap_max <= TOL, gap_max
  return {
    "special_completions": 16 * steps,
    "special_gap_max": gap_max,
    **{f"special_{k}": v for k, v in counts.items()},
  }


def main(workdir, out):
  check_completion_logprobs()
  ex = load_example()
  check_engine_rope_theta(ex, workdir)
  result = run_example(ex, workdir)
  result.update(run_special_tokens(ex, workdir))
  pathlib.Path(out).write_text(json.dumps(result))
  print(json.dumps(result))


if __name__ == "__main__":
  main(*sys.argv[1:])
