"""Multi-turn rollouts (`trainers.agents`): trajectories token in, token out; the environment's tokens
out of the loss and of the correction; budgets, aborted turns and failing environments; the tool task.

The driver is checked here against a scripted engine (a function with the client's `generate`
signature whose replies are known in advance); the whole loop against real servers is in
test_agents_train.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
from trainers.tasks.env import Observation, ToolError, Turn, call_tool
from trainers.agents.episodes import Episodes, TurnIndex
from trainers.tasks.base import Prompt
from trainers.tasks.lookup_digits import LookupDigitsTask
from trainers.rollout import extras as extras_lib
from trainers.learner.batch import build_step_batch
from trainers.rollout.samples import RolloutResult, Sample


class ResponseToy(extras_lib.TokenExtra):
  """A response-span extra (as sampling supports are): the token id times 10, per response token."""

  name, span, fill, dtype = "toy_response", "response", -1, np.int32

  def parse(self, reply):
    return np.asarray(reply.ids, np.int32) * 10


class SequenceToy(extras_lib.TokenExtra):
  """A sequence-span extra (as routed experts are): every input position's index, plus 1000 times the
  number of the call that computed it (so each row tells which turn's reply it came from)."""

  name, span, fill, dtype = "toy_sequence", "sequence", -1, np.int32


class ScriptedEngine:
  """`generate(contexts, params, n=1, seed=, extras=)` as the client's: the reply to a context is a
  function of it (`len(context)` decides the ids), version `self.version`, each extra's value as the
  real parser would make it. `abort`: contexts (as tuples) answered with an abort, that many times."""

  def __init__(self, turn_len=3, version="7", abort=None, split_version=None):
    self.calls, self.turn_len, self.version = [], turn_len, version
    self.abort = dict(abort or {})
    self.split_version = split_version  # (version, at): the reply straddles an update at token `at`

  def reply_ids(self, context):
    return tuple(30 + (len(context) + i) % 20 for i in range(self.turn_len - 1)) + (2,)

  def __call__(self, contexts, params, *, n, seed, extras, rows_per_request=None):
    assert n == 1
    self.calls.append([tuple(c) for c in contexts])
    result = RolloutResult(samples=[], num_requested=len(contexts))
    for i, ctx in enumerate(contexts):
      if self.abort.get(tuple(ctx), 0) > 0:
        self.abort[tuple(ctx)] -= 1
        result.num_aborted += 1
        result.lost.append((i, "aborted"))
        continue
      ids = self.reply_ids(ctx)
      spans = ()
      if self.split_version:
        old, at = self.split_version
        spans = ((old, 0, at), (self.version, at, len(ids)))
      values = {}
      for e in extras:
        if e.name == "toy_response":
          values[e.name] = np.asarray(ids, np.int32) * 10
        elif e.name == "toy_sequence":
          values[e.name] = np.arange(len(ctx) + len(ids) - 1, dtype=np.int32) + 1000 * len(self.calls)
        else:
          values[e.name] = np.ones(len(ids), np.int32)
      result.samples.append(
        Sample(
          prompt_index=i,
          prompt_ids=tuple(ctx),
          response_ids=ids,
          rollout_logprobs=tuple(-0.1 * (k + 1) for k in range(len(ids))),
          finish_reason="stop",
          text=f"t{len(ctx)}",
          weight_version=self.version,
          weight_versions=spans,
          extras=values,
        )
      )
    return result


class EchoEnv:
  """Answers every turn with `[50, turn index, 51]` and reward 0.25; done after `turns` turns."""

  def __init__(self, turns=3, fail_at=None):
    self.turns, self.fail_at, self.seen = turns, fail_at, []

  def step(self, turn: Turn) -> Observation:
    self.seen.append(turn)
    if turn.index == self.fail_at:
      raise RuntimeError("the environment broke")
    done = turn.index >= self.turns
    return Observation(ids=(50, turn.index, 51), reward=0.25 + (turn.index == 1), done=done, counts={"tool_calls": 1})


PROMPTS = [Prompt(ids=(1, 5, 13)), Prompt(ids=(1, 6, 7, 13))]
EXTRAS = (TurnIndex(), ResponseToy(), SequenceToy())


def _run(engine, episodes=Episodes(max_turns=4), env=lambda p: EchoEnv(), n=2, extras=EXTRAS):
  return episodes.run(engine, PROMPTS, env, sampling_params={"max_new_tokens": 3}, n=n, seed=0, extras=extras)


def _first_fed(sample) -> np.ndarray:
  """For each input position of a trajectory (all but its last token), the model turn whose request
  fed that token first: the prompt in turn 1; a turn's own tokens in that turn, but for its last one
  (sampled, never fed by it), fed by the next turn as the observation after it is."""
  turn, prompt = list(sample.extras["turn"]), len(sample.prompt_ids)
  out, last_model = [], 0
  for i in range(prompt + len(turn) - 1):
    if i < prompt:
      out.append(1)
      continue
    t = turn[i - prompt]
    last_model = t or last_model
    ends_its_turn = t > 0 and turn[i - prompt + 1] != t
    out.append(t + ends_its_turn if t > 0 else last_model + 1)
  return np.asarray(out)


def test_a_trajectory_is_exactly_the_sampled_and_the_observed_ids():
  engine = ScriptedEngine()
  result = _run(engine)
  assert len(result.samples) == 4 and result.num_requested == 4
  assert [s.prompt_index for s in result.samples] == [0, 0, 1, 1]  # prompt-major groups
  assert [len(c) for c in engine.calls] == [4, 4, 4]  # one batched request per turn, every trajectory in it
  for s in result.samples:
    seq = s.prompt_ids + s.response_ids
    turn = s.extras["turn"]
    # Rebuild the trajectory from the engine's replies and the environment's observations alone.
    want = list(s.prompt_ids)
    for t in (1, 2, 3):
      ctx = tuple(want)
      assert any(ctx == c for c in engine.calls[t - 1]), "each turn's request is the trajectory so far"
      want += engine.reply_ids(ctx)
      if t < 3:
        want += [50, t, 51]
    assert list(seq) == want  # byte for byte: nothing decoded and re-encoded
    # Turn indices: the model's turns 1..3, 0 on the environment's tokens.
    assert turn.tolist() == [1] * 3 + [0] * 3 + [2] * 3 + [0] * 3 + [3] * 3
    lps = np.asarray(s.rollout_logprobs)
    np.testing.assert_array_equal(lps[turn == 0], 0.0)
    np.testing.assert_allclose(lps[turn > 0], np.tile([-0.1, -0.2, -0.3], 3), rtol=1e-6)
    # Each turn's version over its own tokens.
    assert s.weight_versions == (("7", 0, 3), ("7", 6, 9), ("7", 12, 15))
    # A response-span extra at its turn's tokens, its fill at the environment's; a sequence-span
    # extra (R3's routed experts) at each input position from the turn that fed it first: the turn
    # whose reply sampled from that position's forward, not the last turn's.
    toy = s.extras["toy_response"]
    np.testing.assert_array_equal(toy[turn == 0], -1)
    np.testing.assert_array_equal(toy[turn > 0], np.asarray(s.response_ids)[turn > 0] * 10)
    np.testing.assert_array_equal(s.extras["toy_sequence"], np.arange(len(seq) - 1) + 1000 * _first_fed(s))
    assert s.reward == pytest.approx(1.25 + 0.25 + 0.25)
    assert s.text == "".join(f"t{n}" for n in (len(s.prompt_ids), len(s.prompt_ids) + 6, len(s.prompt_ids) + 12))
  m = result.metrics
  assert m["agent/turns_mean"] == 3 and m["agent/tool_calls"] == 12 and m["agent/truncated"] == 0
  assert m["agent/model_tokens"] == 36 and m["agent/env_tokens"] == 24


def test_turns_that_straddle_an_update_keep_their_spans():
  result = _run(ScriptedEngine(version="8", split_version=("7", 1)), n=1)
  s = result.samples[0]
  assert s.weight_versions == (("7", 0, 1), ("8", 1, 3), ("7", 6, 7), ("8", 7, 9), ("7", 12, 13), ("8", 13, 15))
  assert s.oldest_version == "7" and s.weight_version == "8"


def test_budgets_truncate_to_a_prefix_of_what_was_sampled():
  engine = ScriptedEngine(turn_len=3)
  # 8 response tokens: turn 1 (3), observation (3), then 2 of turn 2's 3 tokens.
  result = _run(engine, Episodes(max_turns=4, max_total_tokens=8), n=1)
  for s in result.samples:
    assert len(s.response_ids) == 8
    assert s.extras["turn"].tolist() == [1, 1, 1, 0, 0, 0, 2, 2]
    assert s.response_ids[6:] == engine.reply_ids(s.prompt_ids + s.response_ids[:6])[:2]
  assert result.metrics["agent/truncated"] == 2
  # The context budget (the trainer's row): an observation that leaves no room for a model token ends it.
  result = _run(ScriptedEngine(), Episodes(max_turns=4, max_context=10), n=1)
  # Prompt 0 (3 tokens): turn 1, the observation (9 tokens), 1 token of turn 2; prompt 1 (4 tokens):
  # turn 1 (7 tokens), and its observation would leave no room.
  assert [len(s.prompt_ids + s.response_ids) for s in result.samples] == [10, 7]
  assert [s.extras["turn"].tolist() for s in result.samples] == [[1, 1, 1, 0, 0, 0, 2], [1, 1, 1]]
  assert result.metrics["agent/truncated"] == 2


def test_the_turn_limit_ends_a_trajectory_on_the_model_turn():
  result = _run(ScriptedEngine(), Episodes(max_turns=2), env=lambda p: EchoEnv(turns=10), n=1)
  for s in result.samples:
    assert s.extras["turn"].tolist() == [1, 1, 1, 0, 0, 0, 2, 2, 2]  # no observation after the last turn


def test_an_aborted_turn_is_sent_again_then_dropped():
  ctx = PROMPTS[0].ids
  engine = ScriptedEngine(abort={ctx: 1})
  result = _run(engine, n=1)
  assert len(result.samples) == 2 and result.num_aborted == 0
  assert engine.calls[1] == [ctx]  # the retry: only the aborted trajectory
  engine = ScriptedEngine(abort={ctx: 10})
  result = _run(engine, Episodes(max_turns=3, max_turn_retries=2), n=1)
  assert [s.prompt_index for s in result.samples] == [1] and result.num_aborted == 1
  assert sum(c == [ctx] for c in engine.calls) == 2


def test_a_failing_environment_drops_its_trajectory_and_is_counted():
  envs = iter([EchoEnv(fail_at=2), EchoEnv()])
  result = _run(ScriptedEngine(), env=lambda p: next(envs), n=1)
  assert [s.prompt_index for s in result.samples] == [1]
  assert result.metrics["agent/env_failures"] == 1
  assert any("the environment broke" in r for r in result.rejection_reasons)


def test_tool_calls_that_raise_or_time_out_are_errors_not_crashes():
  import time

  class Slow:
    name = "slow"

    def __call__(self):
      time.sleep(2)
      return "late"

  class Broken:
    name = "broken"

    def __call__(self, x):
      raise ZeroDivisionError("x / 0")

  tools = [Slow(), Broken()]
  with pytest.raises(ToolError, match="'slow' timed out after 0.1 s"):
    call_tool(tools, "slow", {}, timeout_s=0.1)
  with pytest.raises(ToolError, match="'broken' failed: ZeroDivisionError: x / 0"):
    call_tool(tools, "broken", {"x": 1})
  with pytest.raises(ToolError, match="unknown tool 'nope'"):
    call_tool(tools, "nope", {})
  with pytest.raises(ToolError, match="arguments must be an object"):
    call_tool(tools, "broken", [1])


def test_the_lookup_task_needs_its_tool():
  task = LookupDigitsTask(num_digits=3)
  (prompt,) = task.prompts(0, 0, 1)
  d = prompt.answer
  assert not set(task.digit_offset + x for x in d) & set(prompt.ids)  # the digits are not in the prompt
  env = task.environment(prompt)
  obs = env.step(Turn((task.lookup, task.eos), "", "stop", 1))
  assert obs.ids == (task.result, *[task.digit_offset + x for x in d], task.sep) and not obs.done
  assert obs.reward == 0.2 and obs.counts == {"tool_calls": 1}
  assert env.step(Turn((task.lookup, task.eos), "", "stop", 2)).reward == 0.0  # the bonus once
  assert env.step(Turn((5, task.lookup, task.eos), "", "stop", 3)).counts == {"malformed_calls": 1}
  answer = env.step(Turn(tuple(task.digit_offset + x for x in d) + (task.eos,), "", "stop", 4))
  assert answer.done and answer.reward == pytest.approx(1.25)
  off = LookupDigitsTask(num_digits=3, tool=False).environment(prompt)
  obs = off.step(Turn((task.lookup, task.eos), "", "stop", 1))
  assert obs.ids == (task.error, task.sep) and obs.reward == 0 and obs.counts["tool_errors"] == 1


# --- the environment's tokens cannot move the correction ------------------------------------------
LOSS_CONFIGS = {
  "decoupled_mis_seq": mis_jax.LossConfig(
    use_tis=True,
    mis=mis_jax.MISConfig(
      use_tis=True,
      use_rs=True,
      tis_mode="truncate",
      tis_level="sequence",
      rs_level="geometric",
      tis_upper_bound=2.0,
      rs_lower_bound=0.5,
      rs_upper_bound=2.0,
      rs_veto_threshold=1e-4,
      tis_batch_normalize=True,
    ),
  ),
  "reinforce_is": mis_jax.LossConfig(use_tis=True, use_rollout_logprobs=True, denominator="original"),
  "bypass_gspo": mis_jax.LossConfig(use_rollout_logprobs=True, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
  "token_tis": mis_jax.LossConfig(use_tis=True, tis_clip=2.0),
}


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_environment_tokens_cannot_move_the_correction(name):
  cfg = LOSS_CONFIGS[name]
  result = _run(ScriptedEngine(), n=2)
  samples = result.samples
  rng = np.random.default_rng(0)

  def batch(perturb):
    out = []
    for s in samples:
      lps = np.asarray(s.rollout_logprobs, np.float64)
      env = s.extras["turn"] == 0
      if perturb:
        lps = np.where(env, rng.choice([-40.0, -1e4, 0.0], size=lps.shape), lps)
      out.append(dataclasses.replace(s, rollout_logprobs=tuple(lps)))
    trained = extras_lib.trainable(EXTRAS, out)
    sb = build_step_batch(
      out,
      [1.0, 0.5, 0.2, 0.9],
      [0.5, -0.5, 0.8, -0.8],
      [0, 0, 1, 1],
      num_segments=4,
      row_len=32,
      tokens_per_micro_batch=128,
      batch_devices=1,
      extras=(TurnIndex(),),
      trained_tokens=trained,
    )
    return sb

  base, moved = batch(False), batch(True)
  env_tokens = np.asarray(base.extras["turn"]) == 0
  assert not np.asarray(base.batch.loss_mask)[env_tokens & (np.asarray(base.batch.segment_ids) >= 0)].any()
  assert not np.array_equal(base.batch.rollout_logprobs, moved.batch.rollout_logprobs)
  flat = lambda x: None if x is None else jnp.asarray(x).reshape(1, -1)
  # The current and old log-probs: arbitrary at the environment's tokens too (a model's values there).
  lp = jnp.asarray(rng.normal(-1.0, 0.3, base.batch.loss_mask.size).astype(np.float32)).reshape(1, -1)
  old = lp + 0.05 * jnp.asarray(rng.normal(size=lp.shape).astype(np.float32))

  def loss(b, lp, old_at_env):
    o = jnp.where(jnp.asarray(env_tokens.reshape(1, -1)), old_at_env, old)
    pb = mis_jax.PackedBatch(
      segment_ids=flat(b.batch.segment_ids),
      loss_mask=flat(b.batch.loss_mask),
      advantages=flat(b.batch.advantages),
      rollout_logprobs=flat(b.batch.rollout_logprobs),
      old_logprobs=o,
      num_segments=4,
    )
    return mis_jax.policy_loss(lp, pb, cfg)

  (l0, m0), g0 = jax.value_and_grad(loss, argnums=1, has_aux=True)(base, lp, old)
  (l1, m1), g1 = jax.value_and_grad(loss, argnums=1, has_aux=True)(moved, lp, old + 37.0)
  assert np.isfinite(float(l0))
  assert float(l0) == float(l1)
  np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
  assert np.any(np.asarray(g0) != 0)
  for k in m0:
    np.testing.assert_array_equal(np.asarray(m0[k]), np.asarray(m1[k]), err_msg=k)


def test_the_mismatch_by_turn_index_is_k3_over_each_turns_tokens():
  from trainers.agents.episodes import turn_mismatch

  result = _run(ScriptedEngine(), n=2)
  trained = extras_lib.trainable(EXTRAS, result.samples)
  sb = build_step_batch(
    result.samples,
    [1.0] * 4,
    [0.5] * 4,
    [0, 0, 1, 1],
    num_segments=4,
    row_len=32,
    tokens_per_micro_batch=128,
    batch_devices=1,
    extras=(TurnIndex(),),
    trained_tokens=trained,
  )
  rng = np.random.default_rng(1)
  old = np.asarray(sb.batch.rollout_logprobs) + rng.normal(0, 0.2, sb.batch.loss_mask.shape)
  got = turn_mismatch(sb, old, max_turns=4)
  # A loop over the trajectories and their tokens.
  per_turn = {}
  for s, o in zip(result.samples, sb.per_sequence(old)):
    o = o[len(s.prompt_ids) - 1 :]
    for tok, (t, q, oo) in enumerate(zip(s.extras["turn"], s.rollout_logprobs, o)):
      if t > 0:
        r = oo - q
        per_turn.setdefault(int(t), []).append(np.exp(r) - r - 1)
  assert set(got) == {f"agent/k3_turn_{t}" for t in per_turn}
  for t, values in per_turn.items():
    assert got[f"agent/k3_turn_{t}"] == pytest.approx(np.mean(values), rel=1e-6)


def test_agent_settings_of_a_single_turn_task_are_an_error(tmp_path):
  from test_train import make_cfg
  from trainers.app.spec import resolve

  with pytest.raises(mis_jax.ConfigError, match="agent.max_turns is set but task 'copy_digits' is single-turn"):
    resolve(make_cfg(tmp_path, agent={"max_turns": 2})).task
  with pytest.raises(mis_jax.ConfigError, match="task.tool is not a key of task 'copy_digits'"):
    make_cfg(tmp_path, task={"name": "copy_digits", "tool": False})
  task = resolve(make_cfg(tmp_path, task={"name": "lookup_digits", "tool": False}, agent={"max_turns": 2})).task
  assert task.summary == "lookup_digits (3 digits, tool off)"


def test_trajectories_cross_processes_whole():
  """Process 0 rolls out and broadcasts the result as JSON (`RolloutResult.to_json`): every
  trajectory's reward, turn extra, spans and the batch's agent metrics arrive on the others."""
  result = _run(ScriptedEngine(split_version=("6", 1)), n=2)
  back = RolloutResult.from_json(result.to_json())
  assert back.metrics == result.metrics and len(back.samples) == len(result.samples)
  for a, b in zip(result.samples, back.samples):
    assert a == b and a.reward == b.reward and a.weight_versions == b.weight_versions
    for name in a.extras:
      np.testing.assert_array_equal(a.extras[name], b.extras[name])


def test_the_old_environment_module_is_a_deprecated_alias():
  """`trainers.agents.env` (where the agents guide had users import from) is `trainers.tasks.env`, with a
  warning naming the new place, for one release."""
  import importlib
  import sys
  from trainers.tasks import env

  sys.modules.pop("trainers.agents.env", None)
  with pytest.warns(DeprecationWarning, match="trainers.agents.env moved to trainers.tasks.env"):
    old = importlib.import_module("trainers.agents.env")
  assert (old.Observation, old.Turn, old.call_tool, old.ToolError) == (
    env.Observation,
    env.Turn,
    env.call_tool,
    env.ToolError,
  )
