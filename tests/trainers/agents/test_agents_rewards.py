"""Per-turn rewards (`trainers.agents.rewards`, `agent.per_turn_rewards`): each token's advantage
against a NumPy oracle written from the definition (a loop per trajectory), the driver placing
each observation's reward on its turn's tokens, and the settings it refuses. Whole runs against a
real engine are in test_agents_train.py."""

import numpy as np
import pytest

import mis_jax
from agent_oracle import per_turn_advantages as _oracle
from trainers.agents.episodes import Episodes, TurnIndex
from trainers.agents.rewards import TurnReward, token_advantages, turn_returns
from trainers.tasks.base import Prompt
from trainers.rollout.samples import RolloutResult, Sample

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _trajectory(prompt_index, prompt_len, turns):
  """A sample from `turns`: per model turn `(its token count, the env tokens after it, its reward)`."""
  turn, reward = [], []
  for k, (model, env, r) in enumerate(turns, start=1):
    turn += [k] * model + [0] * env
    reward += [r] * model + [0.0] * env
  n = len(turn)
  return Sample(
    prompt_index=prompt_index,
    prompt_ids=tuple(range(1, prompt_len + 1)),
    response_ids=tuple([7] * n),
    rollout_logprobs=tuple([-0.5] * n),
    finish_reason="stop",
    text="",
    weight_version="0",
    extras={"turn": np.array(turn, np.int32), "turn_reward": np.array(reward, np.float32)},
    reward=float(sum(r for _, _, r in turns)),
  )


# Three groups: four trajectories of one to three turns (a zero reward, a negative one), two of
# equal return, and a group of one.
BATCH = [
  _trajectory(0, 3, [(2, 3, 0.2), (3, 2, 0.0), (1, 0, 1.25)]),
  _trajectory(0, 3, [(4, 0, 1.0)]),
  _trajectory(0, 3, [(1, 2, 0.2), (2, 0, -0.5)]),
  _trajectory(0, 3, [(2, 1, 0.0), (2, 1, 0.7), (3, 0, 0.1)]),
  _trajectory(1, 2, [(2, 2, 0.5), (1, 0, 0.5)]),
  _trajectory(1, 2, [(3, 0, 1.0)]),
  _trajectory(2, 4, [(1, 2, 0.3), (2, 0, 0.4)]),
]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_tokens_advantage_is_its_turns_return_against_the_groups_baseline(estimator):
  rewards = np.array([s.reward for s in BATCH], np.float32)
  groups = np.array([s.prompt_index for s in BATCH], np.int32)
  sequence = np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=3, estimator=estimator))
  got = token_advantages(BATCH, rewards, sequence, groups, estimator=estimator)
  for i, (g, want) in enumerate(zip(got, _oracle(BATCH, estimator))):
    assert g.dtype == np.float32 and g.shape == want.shape
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5, err_msg=f"trajectory {i}")
    # The first turn's tokens keep the trajectory's advantage bit for bit; so does every token of a
    # trajectory whose reward all comes at its first turn.
    first = len(BATCH[i].prompt_ids) - 1 + np.flatnonzero(BATCH[i].extras["turn"] == 1)
    np.testing.assert_array_equal(g[first], sequence[i])
  # A later turn's tokens differ by the scale times the rewards earned before it: not a no-op.
  assert not np.allclose(got[0], sequence[0])


def test_turn_returns_are_the_rewards_still_to_come():
  s = BATCH[0]
  np.testing.assert_allclose(
    turn_returns(s.extras["turn"], s.extras["turn_reward"]),
    [1.45] * 2 + [0] * 3 + [1.25] * 3 + [0] * 2 + [1.25],
    rtol=1e-6,
  )


def test_turn_rewards_that_do_not_add_up_are_an_error():
  rewards = np.array([s.reward for s in BATCH], np.float32)
  rewards[2] += 1.0
  groups = np.array([s.prompt_index for s in BATCH], np.int32)
  with pytest.raises(ValueError, match=r"trajectory 2 \(prompt 0\): its turn rewards sum to -0.3, its reward is 0.7"):
    token_advantages(BATCH, rewards, np.zeros(len(BATCH), np.float32), groups, estimator="grpo")
  with pytest.raises(ValueError, match="per-turn rewards need a group-baseline estimator"):
    token_advantages(BATCH, rewards, np.zeros(len(BATCH), np.float32), groups, estimator="opo")


class _Engine:
  """The client's `generate`: every context answered with `[30, 31, 2]`."""

  def __call__(self, contexts, params, *, n, seed, extras, rows_per_request=None):
    result = RolloutResult(samples=[], num_requested=len(contexts))
    for i, ctx in enumerate(contexts):
      ids = (30, 31, 2)
      values = {e.name: e.parse(type("Reply", (), {"ids": ids})()) for e in extras}
      result.samples.append(
        Sample(
          prompt_index=i,
          prompt_ids=tuple(ctx),
          response_ids=ids,
          rollout_logprobs=(-0.1, -0.2, -0.3),
          finish_reason="stop",
          text="x",
          weight_version="0",
          extras=values,
        )
      )
    return result


class _RewardEachTurn:
  """Reward 0.5·turn index after each turn; done after three turns (the last one's budget-free)."""

  def step(self, turn):
    from trainers.tasks.env import Observation

    return Observation(ids=(50, 51), reward=0.5 * turn.index, done=turn.index == 3)


def test_the_driver_puts_each_observations_reward_on_its_turns_tokens():
  extras = Episodes.declared_extras(per_turn_rewards=True)
  assert [e.name for e in extras] == [TurnIndex.name, TurnReward.name]
  assert Episodes.declared_extras() == Episodes.extras  # off: the default run's extras, unchanged
  result = Episodes(max_turns=4).run(
    _Engine(),
    [Prompt(ids=(1, 5, 13))],
    lambda p: _RewardEachTurn(),
    sampling_params={"max_new_tokens": 3},
    n=2,
    seed=0,
    extras=extras,
  )
  for s in result.samples:
    assert s.extras["turn"].tolist() == [1] * 3 + [0] * 2 + [2] * 3 + [0] * 2 + [3] * 3
    assert s.extras["turn_reward"].dtype == np.float32
    assert s.extras["turn_reward"].tolist() == [0.5] * 3 + [0] * 2 + [1.0] * 3 + [0] * 2 + [1.5] * 3
    assert s.reward == pytest.approx(3.0)
  back = RolloutResult.from_json(result.to_json())  # as process 0 broadcasts it
  for a, b in zip(result.samples, back.samples):
    np.testing.assert_array_equal(a.extras["turn_reward"], b.extras["turn_reward"])
  # A turn the budget cuts before its observation earned nothing.
  cut = Episodes(max_turns=4, max_total_tokens=12).run(
    _Engine(), [Prompt(ids=(1, 5, 13))], lambda p: _RewardEachTurn(), sampling_params={}, n=1, seed=0, extras=extras
  )
  (s,) = cut.samples
  assert s.extras["turn"].tolist() == [1] * 3 + [0] * 2 + [2] * 3 + [0] * 2 + [3] * 2
  assert s.extras["turn_reward"].tolist() == [0.5] * 3 + [0] * 2 + [1.0] * 3 + [0] * 2 + [0.0] * 2
  assert s.reward == pytest.approx(1.5)


def test_per_turn_rewards_refuse_what_they_are_not_defined_for(tmp_path):
  from test_train import make_cfg
  from trainers.app.spec import resolve

  agent = {"per_turn_rewards": True}
  task = {"name": "lookup_digits"}
  assert resolve(make_cfg(tmp_path, task=task, agent=agent)).task.summary.startswith("lookup_digits")
  with pytest.raises(
    mis_jax.ConfigError,
    match="agent.per_turn_rewards needs a group-baseline advantage "
    "estimator .grpo, dr_grpo, rloo.: train.advantage_estimator 'opo'",
  ):
    resolve(make_cfg(tmp_path, task=task, agent=agent, train={"advantage_estimator": "opo"})).task
  with pytest.raises(mis_jax.ConfigError, match="exclude_rejected_from_baseline"):
    resolve(make_cfg(tmp_path, task=task, agent=agent, train={"exclude_rejected_from_baseline": True})).task
  with pytest.raises(mis_jax.ConfigError, match="agent.per_turn_rewards is set but task 'copy_digits' is single-turn"):
    resolve(make_cfg(tmp_path, agent=agent)).task
