"""A NumPy oracle of per-turn rewards' advantages (`agent.per_turn_rewards`), written from the
definition in docs/guides/agents.md, one trajectory at a time; shared by the agent tests."""

import numpy as np


def per_turn_advantages(samples, estimator):
  """Per trajectory, the advantage of every input position, from the definition alone: the
  return of turn j is the sum of the rewards of turns >= j; the group's trajectory rewards give
  the baseline and the scale; the prompt's and the environment's positions keep the trajectory's
  advantage."""
  rewards = [sum(float(r) for r in _rewards_by_turn(s).values()) for s in samples]
  out = []
  for i, s in enumerate(samples):
    group = [rewards[j] for j, o in enumerate(samples) if o.prompt_index == s.prompt_index]
    others = [rewards[j] for j, o in enumerate(samples) if o.prompt_index == s.prompt_index and j != i]
    if estimator == "rloo":
      baseline, scale = (sum(others) / len(others) if others else 0.0), 1.0
    else:
      baseline = sum(group) / len(group)
      scale = 1.0
      if estimator == "grpo" and len(group) > 1:
        mean = baseline
        scale = 1.0 / ((sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5 + 1e-6)
    by_turn = _rewards_by_turn(s)
    seq = [scale * (rewards[i] - baseline)] * (len(s.prompt_ids) - 1)
    for t in s.extras["turn"]:
      if t == 0:
        seq.append(scale * (rewards[i] - baseline))
      else:
        ret = sum(r for k, r in by_turn.items() if k >= t)
        seq.append(scale * (ret - baseline))
    out.append(np.array(seq))
  return out


def _rewards_by_turn(s):
  return {int(t): float(r) for t, r in zip(s.extras["turn"], s.extras["turn_reward"]) if t > 0}
