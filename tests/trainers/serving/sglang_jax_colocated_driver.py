"""Runs in sglang-jax's venv, started by tests/trainers/serving/test_sglang_jax.py: the trainer on each
config of a JSON list, with sglang-jax colocated (`rollout.placement.mode: colocated`) or behind its
HTTP server (`server`: started here from the same starting weights), each run's rollouts (as
the trainer took them), metrics and final parameters written for the test to compare.

  python sglang_jax_colocated_driver.py CONFIGS.json OUT_DIR

Also, with `"errors": true` in a config, after its run: in-memory updates the engine must
refuse (a missing tensor, a tensor with no place, a wrong shape), and the reply that follows
each (greedy, so comparable), written to `errors.json`. With `"three_turns": true` the run's task
is `ThreeTurns` (multi-turn trajectories: an environment that answers every model turn, done after
the third).
"""

import contextlib
import json
import os
import sys

import jax
import numpy as np

from trainers.models import ModelConfig
from trainers.serving.sglang_jax import launcher as sglang_jax
from trainers.app import trainer as train_lib
from trainers.config import TrainConfig


class ThreeTurns:
  """Prompts `[1, d, d, 13]`; the environment answers model turn t with `[13, 40 + t, 13]`, done after
  turn 3, rewarding the share of digit tokens (as test_agents_train.py's, which needs pytest: this
  runs in the engine's venv)."""

  stop_token_ids = (2,)
  max_new_tokens = 4
  max_prompt_len = 4
  summary = "three turns"

  def prompts(self, seed, step, count):
    from trainers.tasks.base import Prompt

    rng = np.random.default_rng([seed, step])
    return [Prompt(ids=(1, *(int(x) for x in rng.integers(3, 13, 2)), 13)) for _ in range(count)]

  def environment(self, prompt):
    return _ThreeTurnsEnv()


class _ThreeTurnsEnv:
  def __init__(self):
    self.digits = self.tokens = 0

  def step(self, turn):
    from trainers.tasks.env import Observation

    self.digits += sum(3 <= t < 13 for t in turn.ids)
    self.tokens += len(turn.ids)
    done = turn.index == 3
    return Observation(
      ids=() if done else (13, 40 + turn.index, 13), reward=self.digits / self.tokens if done else 0.0, done=done
    )


GREEDY = {
  "input_ids": [[1, 5, 9, 12], [1, 7, 30]],
  "return_logprob": True,
  "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
}


def _run(raw: dict, out: str) -> None:
  errors, three_turns = raw.pop("errors", False), raw.pop("three_turns", False)
  cfg = TrainConfig.from_dict(raw)
  r = cfg.rollout
  with contextlib.ExitStack() as stack:
    urls = []
    if r.placement.mode == "server":
      server = stack.enter_context(
        sglang_jax.SGLangJaxServer(
          cfg.model.path,
          dtype=r.placement.server_dtype,
          weight_version="0",
          extra=("--random-seed", str(cfg.seed)),
          enable_return_routed_experts=ModelConfig.from_pretrained(cfg.model.path).is_moe,
        )
      )
      urls = [server.url]
    trainer = train_lib.Trainer(cfg, urls=urls, task=ThreeTurns() if three_turns else None)
    rollouts = []
    take = trainer.source.next
    trainer.source.next = lambda step: rollouts.append(take(step)) or rollouts[-1]
    history = trainer.run(progress=False)
    if errors:
      _refusals(trainer, out)
  samples = [
    [
      {
        "response_ids": list(map(int, s.response_ids)),
        "rollout_logprobs": [float(v) for v in s.rollout_logprobs],
        "weight_versions": s.weight_versions,
        "turn": None if "turn" not in s.extras else np.asarray(s.extras["turn"]).tolist(),
        "routed_experts": None if s.routed_experts is None else np.asarray(s.routed_experts).tolist(),
      }
      for s in x.result.samples
    ]
    for x in rollouts
  ]
  with open(os.path.join(out, "run.json"), "w") as f:
    json.dump({"samples": samples, "history": history, "trainer_devices": trainer.mesh.size}, f, default=float)
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
  np.savez(os.path.join(out, "params.npz"), **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


def _refusals(trainer, out: str) -> None:
  """A fresh in-process engine on the starting weights takes three bad in-memory updates (each
  refused, the old weights serving on), then the trainer's final weights."""
  from trainers.serving.sglang_jax.routes import InProcessEngine
  from trainers.models.hf_io import hf_named

  tensors = hf_named(trainer.params, trainer.spec.model_config)
  engine = InProcessEngine(
    sglang_jax.engine_args(trainer.cfg.model.path, dtype="float32", extra=("--device-indexes", "0")), weight_version="0"
  )
  try:
    before = engine.generate_body(dict(GREEDY))
    bad = {
      "missing": {k: v for k, v in tensors.items() if k != "model.norm.weight"},
      "extra": {**tensors, "model.layers.0.mlp.extra.weight": tensors["model.norm.weight"]},
      "shape": {**tensors, "model.norm.weight": tensors["model.norm.weight"][:-1]},
    }
    report = {}
    for name, given in bad.items():
      ok, message = engine.update_weights(given, "bad")
      after = engine.generate_body(dict(GREEDY))
      report[name] = {
        "ok": ok,
        "message": message,
        "version": engine.model_info()["weight_version"],
        "same_reply": [a["output_ids"] for a in after] == [b["output_ids"] for b in before]
        and [a["meta_info"]["output_token_logprobs"] for a in after]
        == [b["meta_info"]["output_token_logprobs"] for b in before],
      }
    ok, message = engine.update_weights(tensors, "final")
    report["good"] = {"ok": ok, "message": message, "version": engine.model_info()["weight_version"]}
  finally:
    engine.close()
  with open(os.path.join(out, "errors.json"), "w") as f:
    json.dump(report, f)


def main() -> None:
  configs, root = sys.argv[1], sys.argv[2]
  with open(configs) as f:
    for name, raw in json.load(f).items():
      out = os.path.join(root, name)
      os.makedirs(out, exist_ok=True)
      _run(raw, out)


if __name__ == "__main__":
  main()
