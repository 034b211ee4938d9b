"""GRPO / Dr.GRPO / RLOO advantages against a plain loop over groups (contract §6.1)."""

import numpy as np
import pytest

import mis_jax


def loop_oracle(rewards, groups, estimator, member):
  out = np.zeros(len(rewards))
  for g in set(groups):
    idx = [i for i in range(len(rewards)) if groups[i] == g]
    base = [i for i in idx if member[i]]
    r = np.array([rewards[i] for i in base])
    mean = r.mean() if len(r) else 0.0
    for i in idx:
      if estimator == "rloo":
        others = [rewards[j] for j in base if j != i]
        out[i] = rewards[i] - (np.mean(others) if others else 0.0)
      elif estimator == "dr_grpo":
        out[i] = rewards[i] - mean
      else:
        out[i] = (rewards[i] - mean) / (r.std(ddof=1) + 1e-6) if len(r) > 1 else rewards[i] - mean
  return out


@pytest.mark.parametrize("estimator", mis_jax.ESTIMATORS)
@pytest.mark.parametrize("exclude", [False, True])
def test_advantages_match_loop(estimator, exclude):
  rng = np.random.default_rng(0)
  groups = np.array([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])  # group 2 has one member
  rewards = rng.normal(size=len(groups)).astype(np.float32)
  member = np.ones(len(groups), bool)
  if exclude:
    member[[1, 5]] = False  # rejected whole: out of their group's baseline
  got = mis_jax.compute_advantages(rewards, groups, num_groups=4, estimator=estimator,
                                   in_baseline=member if exclude else None)
  np.testing.assert_allclose(np.asarray(got), loop_oracle(rewards, groups, estimator, member), rtol=1e-5, atol=1e-6)


def test_hand_worked_grpo():
  # Group rewards [1, 0, 0, 1]: mean .5, std(ddof=1) = sqrt(1/3).
  got = mis_jax.compute_advantages([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], num_groups=1)
  s = np.sqrt(1 / 3) + 1e-6
  np.testing.assert_allclose(np.asarray(got), [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rtol=1e-6)
  rloo = mis_jax.compute_advantages([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], num_groups=1, estimator="rloo")
  np.testing.assert_allclose(np.asarray(rloo), [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], rtol=1e-6)


def test_broadcast_to_tokens():
  seg = np.array([[0, 0, 1, -1], [2, 2, 2, 1]], np.int32)
  out = mis_jax.sequence_to_tokens(np.array([1.0, 2.0, 3.0], np.float32), seg)
  np.testing.assert_array_equal(np.asarray(out), [[1, 1, 2, 0], [3, 3, 3, 2]])


def test_bad_estimator():
  with pytest.raises(ValueError, match="estimator='ppo' is invalid; allowed values: grpo, dr_grpo, rloo"):
    mis_jax.compute_advantages([1.0], [0], num_groups=1, estimator="ppo")
