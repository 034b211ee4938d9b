"""Multi-turn training against a real engine: the embedded server (float32, a real process), records
written and replayed, asynchronous rollouts; sglang-jax in test_sglang_jax.py.

The task here continues every trajectory for three turns whatever the model says (a random tiny
model rarely calls the tool task's tool), so every trajectory is multi-turn from step 1; its
reward (the share of digit tokens in the model's turns) varies across a group, so every step
trains."""

import jax
import numpy as np
import pytest

import mis_jax
from agent_oracle import per_turn_advantages
from test_train import embedded_server, make_cfg
from trainers.tasks.env import Observation, Turn
from trainers.tasks.base import Prompt
from trainers.commands import analyze as analysis
from trainers.rollout import records as rollout_records
from trainers.app import trainer as train_lib
from trainers.rollout.client import SGLangClient

pytestmark = pytest.mark.integration  # starts servers: make test, not make test-fast

DIGITS = range(3, 13)


class ThreeTurns:
  """Prompts `[1, d, d, 13]`; the environment answers turn t with `[13, 40 + t, 13]` (done after 3)."""

  stop_token_ids = (2,)
  max_new_tokens = 4
  max_prompt_len = 4
  summary = "three turns"

  def prompts(self, seed, step, count):
    rng = np.random.default_rng([seed, step])
    return [Prompt(ids=(1, *(int(x) for x in rng.integers(3, 13, 2)), 13)) for _ in range(count)]

  def environment(self, prompt):
    return ThreeTurnsEnv()


class ThreeTurnsEnv:
  def __init__(self):
    self.digits = self.tokens = 0

  def step(self, turn: Turn) -> Observation:
    self.digits += sum(t in DIGITS for t in turn.ids)
    self.tokens += len(turn.ids)
    done = turn.index == 3
    return Observation(
      ids=() if done else (13, 40 + turn.index, 13),
      reward=self.digits / self.tokens if done else 0.0,
      done=done,
      counts={"tool_calls": 1},
    )


class EveryTurnRewarded(ThreeTurns):
  """ThreeTurns whose environment rewards every turn: the share of digit tokens in that turn."""

  def environment(self, prompt):
    return EveryTurnRewardedEnv()


class EveryTurnRewardedEnv(ThreeTurnsEnv):
  def step(self, turn: Turn) -> Observation:
    obs = super().step(turn)
    return Observation(
      ids=obs.ids, reward=sum(t in DIGITS for t in turn.ids) / len(turn.ids), done=obs.done, counts=obs.counts
    )


@pytest.fixture(scope="module")
def server32(tmp_path_factory):
  with embedded_server(tmp_path_factory, "float32") as srv:
    yield srv


class Spy:
  """Every context the client sent and every reply it parsed, by context."""

  def __init__(self, monkeypatch):
    self.replies = {}
    generate = SGLangClient.generate

    def spy(client, prompts, params, **kwargs):
      result = generate(client, prompts, params, **kwargs)
      for s in result.samples:
        self.replies.setdefault(tuple(prompts[s.prompt_index]), []).append(s.response_ids)
      return result

    monkeypatch.setattr(SGLangClient, "generate", spy)


def _trainer(tmp_path, url, name="run", task=None, **sections):
  sections.setdefault("train", {})
  sections["train"] = {"steps": 10, "row_len": 32, "tokens_per_micro_batch": 128, **sections["train"]}
  sections["agent"] = {"max_turns": 4, **sections.get("agent", {})}
  cfg = make_cfg(tmp_path, name, **sections)
  return train_lib.Trainer(
    cfg, mis_jax.LossConfig(use_tis=True, tis_clip=2.0), urls=[url] if url else [], task=task or ThreeTurns()
  )


def _flat(params):
  return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(params)])


def test_trajectories_train_on_exactly_the_sampled_and_observed_ids(server32, tmp_path, monkeypatch):
  spy = Spy(monkeypatch)
  records = str(tmp_path / "records")
  trainer = _trainer(
    tmp_path,
    server32.url,
    train={"steps": 4},  # every property below is per step
    rollout={"records": {"save_dir": records}, "prompts_per_step": 2, "n": 4},
  )
  before = _flat(trainer.params)
  history = trainer.run(progress=False)
  assert [h["step"] for h in history] == list(range(1, 5))
  assert not np.array_equal(before, _flat(trainer.params))
  for h in history:
    # float32 engine and trainer, the weights pushed every step: the same policy on the model's tokens.
    assert h["mis_k3_kl"] < 1e-6, h["step"]
    assert h["grad_norm"] > 0 and h["num_samples"] == 8
    assert h["agent/turns_mean"] == 3 and h["agent/tool_calls"] == 24 and h["agent/env_failures"] == 0
    assert h["agent/env_tokens"] == 8 * 6 and h["agent/model_tokens"] > 0
    assert h["reward_std"] > 0
    assert all(h[f"agent/k3_turn_{t}"] < 1e-6 for t in (1, 2, 3)) and "agent/k3_turn_4" not in h
  for step in range(1, 5):
    cols, _ = rollout_records.read_step(rollout_records.step_path(records, step))
    for prompt, response, turn, lps, spans in zip(
      cols["prompt_ids"], cols["response_ids"], cols["turn"], cols["rollout_logprobs"], cols["weight_versions"]
    ):
      seq, turn = list(prompt) + list(response), np.asarray(turn)
      assert sorted(set(turn.tolist())) == [0, 1, 2, 3]
      # Each model turn is, byte for byte, the engine's reply to the trajectory before it; each
      # observation the environment's ids.
      start = len(prompt)
      for t in (1, 2, 3):
        at = np.flatnonzero(turn == t)
        assert at[0] + len(prompt) == start and np.all(np.diff(at) == 1)
        assert tuple(seq[start : start + len(at)]) in spy.replies[tuple(seq[:start])]
        start += len(at)
        if t < 3:
          assert seq[start : start + 3] == [13, 40 + t, 13] and (turn[start - len(prompt) :][:3] == 0).all()
          start += 3
      assert start == len(seq)
      np.testing.assert_array_equal(np.asarray(lps)[turn == 0], 0.0)
      # Every turn's weight version: the weights pushed after the step before (synchronous rollouts).
      assert {s["version"] for s in spans} == {str(step - 1)}
      assert [(s["start"], s["end"]) for s in spans] == [
        (int(np.flatnonzero(turn == t)[0]), int(np.flatnonzero(turn == t)[-1]) + 1) for t in (1, 2, 3)
      ]
  # `mis-jax analyze` of the records: the model's tokens only, by turn index.
  rows, _ = analysis.load(records)
  report = analysis.analyze(rows)
  model_tokens = sum(int(np.sum(np.asarray(r["turn"]) > 0)) for r in rows)
  assert report["tokens"] == model_tokens == sum(t["tokens"] for t in report["by_turn"])
  assert [t["turn"] for t in report["by_turn"]] == [1, 2, 3] and all(t["mean_k3"] < 1e-6 for t in report["by_turn"])
  assert "## Mismatch by turn" in analysis.markdown(report, [], records)
  # Replayed from its records with no server, the run's first 3 steps train bitwise the same.
  replay = _trainer(
    tmp_path,
    None,
    "replay",
    train={"steps": 3},
    rollout={"records": {"load_dir": records}, "prompts_per_step": 2, "n": 4},
  ).run(progress=False)
  _assert_same_training(history[:3], replay)


def test_asynchronous_multi_turn_rollouts_keep_each_turns_version(server32, tmp_path):
  records = str(tmp_path / "records")
  history = _trainer(
    tmp_path,
    server32.url,
    train={"steps": 4},
    rollout={
      "records": {"save_dir": records},
      "prompts_per_step": 2,
      "n": 4,
      "sync": {"max_staleness": 1, "pause_mode": "in_place"},
    },
  ).run(progress=False)
  assert [h["step"] for h in history] == [1, 2, 3, 4] and all(h["grad_norm"] > 0 for h in history)
  for step in range(1, 5):
    cols, _ = rollout_records.read_step(rollout_records.step_path(records, step))
    for spans, turn in zip(cols["weight_versions"], cols["turn"]):
      versions = [int(s["version"]) for s in spans]
      assert versions == sorted(versions) and step - 1 - versions[0] <= 1  # within the staleness bound
      covered = sum(s["end"] - s["start"] for s in spans)
      assert covered == int(np.sum(np.asarray(turn) > 0))  # every model token under a version, none of the env's


def test_colocated_multi_turn_rollouts(tmp_path):
  """The embedded engine inside the trainer's process: every turn through the same client, the
  weights handed over in memory after each step; float32 on both sides."""
  history = _trainer(
    tmp_path,
    None,
    train={"steps": 3},
    rollout={"prompts_per_step": 2, "n": 4, "placement": {"mode": "colocated", "server_dtype": "float32"}},
  ).run(progress=False)
  assert [h["step"] for h in history] == [1, 2, 3]
  for h in history:
    assert h["agent/turns_mean"] == 3 and h["mis_k3_kl"] < 1e-6 and h["grad_norm"] > 0
    assert h["server_weight_version"] == str(h["step"] - 1)


def test_per_turn_rewards_train_each_turn_on_its_return(server32, tmp_path, monkeypatch):
  """agent.per_turn_rewards in whole runs: every step's packed advantages are the oracle's (a turn's
  return against its group's baseline) on trajectories rewarded at every turn; records keep each
  turn's reward, so a replay trains bitwise the same; with the reward at the last turn only, the
  run is bitwise the default run (the trajectory's reward on every token) on the same rollouts."""
  batches = []
  build = train_lib.Trainer.build_batch

  def spy(trainer, prompts, result):
    sb = build(trainer, prompts, result)
    batches.append((result.samples, sb))
    return sb

  monkeypatch.setattr(train_lib.Trainer, "build_batch", spy)
  per_turn = {"per_turn_rewards": True}
  rollout = {"prompts_per_step": 2, "n": 4}
  records = str(tmp_path / "every-turn")
  trainer = _trainer(
    tmp_path,
    server32.url,
    "every-turn",
    task=EveryTurnRewarded(),
    agent=per_turn,
    train={"steps": 2},
    rollout={**rollout, "records": {"save_dir": records}},
  )
  before = _flat(trainer.params)
  history = trainer.run(progress=False)
  assert not np.array_equal(before, _flat(trainer.params)) and all(h["grad_norm"] > 0 for h in history)
  assert len(batches) == 2
  for samples, sb in batches:
    got = sb.per_sequence(sb.batch.advantages)
    for g, want in zip(got, per_turn_advantages(samples, "grpo")):
      np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    # The turns' returns differ, so the per-turn advantages are not the trajectory's.
    assert any(not np.allclose(g[len(s.prompt_ids) - 1 :], a) for g, s, a in zip(got, samples, sb.advantages))
  replay = _trainer(
    tmp_path,
    None,
    "every-turn-replay",
    task=EveryTurnRewarded(),
    agent=per_turn,
    train={"steps": 1},
    rollout={**rollout, "records": {"load_dir": records}},
  ).run(progress=False)
  _assert_same_training(history[:1], replay)
  # The reward at the last turn only: per-turn returns are the trajectory's reward on every token.
  records = str(tmp_path / "last-turn")
  last = _trainer(
    tmp_path,
    server32.url,
    "last-turn",
    agent=per_turn,
    train={"steps": 1},
    rollout={**rollout, "records": {"save_dir": records}},
  ).run(progress=False)
  default = _trainer(
    tmp_path, None, "last-turn-default", train={"steps": 1}, rollout={**rollout, "records": {"load_dir": records}}
  ).run(progress=False)
  _assert_same_training(last, default)


def _assert_same_training(a_history, b_history):
  """Every metric of every step equal, but times and the rollout's own counters."""
  assert len(a_history) == len(b_history)
  for a, b in zip(a_history, b_history):
    for k in a:
      if k.endswith(("_s", "tokens_per_s")) or k.startswith(("agent/", "rollout/")) or k == "server_weight_version":
        continue
      assert a[k] == b[k], (a["step"], k, a[k], b[k])


def test_the_lookup_task_trains_with_per_turn_rewards(server32, tmp_path):
  """The tool task (its call bonus at the call's turn, the score at the answer's) with per-turn
  rewards: every step trains and the weights move."""
  from trainers.tasks.lookup_digits import LookupDigitsTask

  # A near-uniform model, and credit for any digit: some answers of each step score. The batch's
  # shapes are the other runs' here (2 prompts x 4): their compiled programs serve.
  trainer = _trainer(
    tmp_path,
    server32.url,
    "lookup",
    task=LookupDigitsTask(num_digits=1, digit_credit=0.25),
    agent={"per_turn_rewards": True, "max_turns": 3},
    train={"steps": 2},
    rollout={"prompts_per_step": 2, "n": 4},
    model={"initializer_range": 0.02},
  )
  before = _flat(trainer.params)
  history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2] and all(h["grad_norm"] > 0 for h in history)
  assert not np.array_equal(before, _flat(trainer.params))
