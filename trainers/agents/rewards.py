"""Per-turn rewards (`agent.per_turn_rewards`): each turn's reward on that turn's own tokens.

Model turn `k` of a trajectory ends with the environment's observation, whose reward is `r_k`
(0 for a turn the budget cut before an observation). The trajectory's reward is `R = Σ_k r_k`,
and by default every model token carries the advantage of `R` (contract §6.1, §11.1). With
per-turn rewards a token of turn `j` carries the advantage of its turn's **return**, the reward
still to come once the turn is sampled (reward-to-go, undiscounted):

    G_j = Σ_{k ≥ j} r_k        A_t = s_i · (G_j − b_i)    (t a token of turn j of trajectory i)

where `b_i` and `s_i` are the baseline and the scale the group's trajectory rewards give the
sequence estimator, `A_i = s_i (R_i − b_i)` (so `G_1 = R`: the first turn's tokens keep the
trajectory's advantage exactly, and a later turn's differ by `s_i` times the rewards earned before
it, which its tokens could not have caused). This is REINFORCE's reward-to-go with the group
baseline: the returns verl's REINFORCE++ / ReMax take from token-level rewards (a reverse cumulative
sum, here γ = 1), with GRPO's baseline; verl's GRPO sums the token-level rewards into one score, and
tunix's agentic GRPO and the default here use `R` for every token.

Defined for the estimators whose advantage is a group baseline and a scale (`ESTIMATOR_SCALE`):
`grpo` (`s = 1/(std_g R + 1e-6)`, `ddof=1`, and `s = 1` for a group of one, as the estimator does
not divide there), `dr_grpo` and `rloo` (`s = 1`). The correction is unchanged: the advantages
are an input of the loss like any other.

`TurnReward` is the per-token extra that carries `r_k` on each token of turn `k` (0 on the
environment's tokens) from the episode driver to the batch, and into the rollout records, so a
replay trains on the same returns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trainers.rollout import extras as extras_lib

__all__ = ["TurnReward", "ESTIMATOR_SCALE", "turn_rewards", "turn_returns", "advantage_scale", "token_advantages"]

# The sequence estimators per-turn rewards are defined for: how each scales `R - b` (contract §6.1).
ESTIMATOR_SCALE = {"grpo": "1 / (std_g R + 1e-6), 1 for a group of one", "dr_grpo": "1", "rloo": "1"}


@extras_lib.register
class TurnReward(extras_lib.TokenExtra):
  """Per response token of a trajectory: the reward of the observation that answered its model
  turn (on every token of the turn), 0 on the environment's tokens. Declared by agent runs with
  `agent.per_turn_rewards`; its record column keeps each turn's reward for a replay."""

  name = "turn_reward"
  span, fill, dtype = "response", 0.0, np.float32
  missing_column = "which agent.per_turn_rewards needs to place each turn's reward on its tokens"

  @classmethod
  def activate(cls, rollout, model_config):
    return None  # declared by the agent section (`Episodes.declared_extras`), not by a rollout setting

  @staticmethod
  def record_type():
    import pyarrow as pa

    return pa.list_(pa.float32())

  def parse(self, reply):
    return np.zeros(len(reply.ids), np.float32)  # the driver writes each turn's reward

  def check_record(self, value, prompt_len, response_len):
    if value is None or len(value) != response_len:
      return (
        f"column 'turn_reward' has {0 if value is None else len(value)} entries for a response of {response_len} tokens"
      )
    if not np.all(np.isfinite(np.asarray(value, np.float64))):
      return "column 'turn_reward' holds a non-finite reward"
    return None


def turn_rewards(turn: np.ndarray, turn_reward: np.ndarray) -> np.ndarray:
  """`[K + 1]`: `r_k` at index `k` for the model turns 1..K of one trajectory (index 0 unused), read
  from its per-token `turn` and `turn_reward` (every token of a turn holds the turn's reward)."""
  turn, turn_reward = np.asarray(turn), np.asarray(turn_reward, np.float64)
  r = np.zeros(int(turn.max(initial=0)) + 1)
  for k in np.unique(turn[turn > 0]):
    values = turn_reward[turn == k]
    if not np.all(values == values[0]):
      raise ValueError(
        f"turn {k} carries several rewards ({sorted(set(values.tolist()))[:3]}): a turn's tokens "
        "share the reward of the observation that answered it"
      )
    r[k] = values[0]
  return r


def turn_returns(turn: np.ndarray, turn_reward: np.ndarray) -> np.ndarray:
  """Per response token of one trajectory: `G_j = Σ_{k ≥ j} r_k` of its model turn `j`; 0 on the
  environment's tokens (`turn == 0`), which no loss reads."""
  r = turn_rewards(turn, turn_reward)
  to_go = np.cumsum(r[::-1])[::-1]  # to_go[j] = Σ_{k ≥ j} r_k
  turn = np.asarray(turn)
  return np.where(turn > 0, to_go[turn], 0.0)


def advantage_scale(rewards: np.ndarray, groups: np.ndarray, *, estimator: str) -> np.ndarray:
  """`[N]`: the scale `s_i` of `R_i − b_i` in `estimator`'s advantage (see `ESTIMATOR_SCALE`), over
  the groups of the batch's trajectories (`groups`: each one's prompt index)."""
  if estimator not in ESTIMATOR_SCALE:
    raise ValueError(
      f"per-turn rewards need a group-baseline estimator ({', '.join(ESTIMATOR_SCALE)}), got {estimator!r}"
    )
  rewards, groups = np.asarray(rewards, np.float64), np.asarray(groups)
  scale = np.ones(len(rewards))
  if estimator == "grpo":
    for g in np.unique(groups):
      members = groups == g
      if members.sum() > 1:
        scale[members] = 1.0 / (rewards[members].std(ddof=1) + 1e-6)
  return scale


def token_advantages(
  samples: Sequence, rewards: np.ndarray, advantages: np.ndarray, groups: np.ndarray, *, estimator: str
) -> list[np.ndarray]:
  """Per trajectory, float32 advantages at its input positions (`len(prompt) + len(response) − 1`,
  as `build_step_batch` lays tokens out): `A_i − s_i (R_i − G_j)` on each token of model turn `j`,
  `A_i` (the sequence estimator's advantage of `R_i`) elsewhere (prompt and environment tokens,
  which the loss does not train). `samples` carry the `turn` and `turn_reward` extras; `rewards`
  must be the sums of their turn rewards (a ValueError names the trajectory otherwise)."""
  scale = advantage_scale(rewards, groups, estimator=estimator)
  out = []
  for i, s in enumerate(samples):
    turn = np.asarray(s.extras["turn"])
    r = turn_rewards(turn, s.extras[TurnReward.name])
    total = r.sum()
    if not np.isclose(total, rewards[i], rtol=1e-5, atol=1e-5):
      raise ValueError(
        f"trajectory {i} (prompt {s.prompt_index}): its turn rewards sum to {total:g}, its reward is "
        f"{float(rewards[i]):g}"
      )
    adv = np.full(len(s.prompt_ids) + len(s.response_ids) - 1, advantages[i], np.float64)
    # R_i - G_j is the reward earned before turn j: summed directly, so turn 1 keeps A_i bit for bit.
    earned_before = np.concatenate([[0.0], np.cumsum(r)])[turn]  # Σ_{k < j} r_k (r[0] = 0)
    model = turn > 0
    adv[len(s.prompt_ids) - 1 :][model] = advantages[i] - scale[i] * earned_before[model]
    out.append(adv.astype(np.float32))
  return out


class PerTurnAdvantages:
  """The step-batch stage of `agent.per_turn_rewards`: each turn's return on its tokens
  (`token_advantages` of the batch's per-sequence advantages), as the batch's per-token advantages."""

  def __init__(self, estimator: str):
    self.estimator = estimator

  def __call__(self, sb, samples, rewards, groups):
    per_token = token_advantages(samples, rewards, sb.advantages, groups, estimator=self.estimator)
    sb.batch = sb.batch.replace(advantages=sb.tokens(per_token, 0.0, np.float32))
    return sb
