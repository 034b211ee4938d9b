"""Advantage estimators against plain loops over groups written from verl's documentation
(contract §6.1), and OTB's per-token baseline against a loop over groups and positions."""

import jax
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


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("exclude", [False, True])
def test_advantages_match_loop(estimator, exclude):
  rng = np.random.default_rng(0)
  groups = np.array([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])  # group 2 has one member
  rewards = rng.normal(size=len(groups)).astype(np.float32)
  member = np.ones(len(groups), bool)
  if exclude:
    member[[1, 5]] = False  # rejected whole: out of their group's baseline
  got = mis_jax.compute_advantages(
    rewards, groups, num_groups=4, estimator=estimator, in_baseline=member if exclude else None
  )
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
  with pytest.raises(ValueError, match="'opo' needs lengths="):
    mis_jax.compute_advantages([1.0], [0], num_groups=1, estimator="opo")
  with pytest.raises(ValueError, match="call mis_jax.optimal_token_baseline"):
    mis_jax.compute_advantages([1.0], [0], num_groups=1, estimator="optimal_token_baseline")
  with pytest.raises(ValueError, match="grpo_passk.*group 2 has fewer"):
    mis_jax.compute_advantages([1.0, 0.0, 2.0], [0, 0, 2], num_groups=3, estimator="grpo_passk")


# --- verl's outcome estimators, each a loop over the batch as verl's docstrings state it ----------


def whiten_tokens(per_seq, lengths):
  """verl's masked_whiten over the response tokens: each sequence's value repeated n_i times."""
  toks = np.concatenate([np.full(n, v) for v, n in zip(per_seq, lengths)])
  mean, var = toks.mean(), toks.var(ddof=1)
  return [(v - mean) / np.sqrt(var + 1e-8) for v in per_seq]


def verl_oracle(estimator, rewards, groups, lengths, weights=None, norm=True):
  by_group = {}
  for i, g in enumerate(groups):
    by_group.setdefault(g, []).append(i)
  out = np.zeros(len(groups))
  if estimator == "reinforce_plus_plus":
    return np.array(whiten_tokens(rewards, lengths))
  if estimator == "gdpo":
    total = np.zeros(len(groups))
    for k in range(rewards.shape[1]):
      r = rewards[:, k]
      for g, idx in by_group.items():
        mean, std = (0.0, 1.0) if len(idx) == 1 else (np.mean(r[idx]), np.std(r[idx], ddof=1))
        for i in idx:
          total[i] += (1.0 if weights is None else weights[k]) * ((r[i] - mean) / (std + 1e-6) if norm else r[i] - mean)
    return np.array(whiten_tokens(total, lengths))
  alpha = len(rewards) / max(np.count_nonzero(rewards), 1)
  for g, idx in by_group.items():
    r = rewards[idx]
    mean = 0.0 if len(idx) == 1 else r.mean()
    for i in idx:
      if estimator == "reinforce_plus_plus_baseline":
        out[i] = rewards[i] - mean
      elif estimator == "opo":
        n = np.array([lengths[j] for j in idx], float)
        out[i] = rewards[i] - (0.0 if len(idx) == 1 else float(np.sum(n * r) / np.sum(n)))
      elif estimator == "gpg":
        out[i] = alpha * (rewards[i] - mean)
    if estimator == "grpo_passk":
      order = sorted(range(len(idx)), key=lambda j: (-r[j], j))
      gap = r[order[0]] - r[order[1]]
      out[idx[order[0]]] = gap / (np.std(r, ddof=1) + 1e-6) if norm else gap
  if estimator == "reinforce_plus_plus_baseline":
    out = np.array(whiten_tokens(out, lengths))
  return out


VERL = ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "gdpo"]


@pytest.mark.parametrize("estimator", VERL)
def test_verl_estimators_match_loop(estimator):
  rng = np.random.default_rng(5)
  groups = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3])
  lengths = rng.integers(1, 9, len(groups))
  rewards = rng.integers(0, 3, len(groups)).astype(np.float32)  # ties, zeros
  if estimator == "gdpo":
    rewards = np.stack([rewards, rng.normal(size=len(groups)).astype(np.float32)], axis=1)
  kw = dict(lengths=lengths) if estimator in mis_jax.estimators.NEEDS_LENGTHS else {}
  got = mis_jax.compute_advantages(rewards, groups, num_groups=4, estimator=estimator, **kw)
  np.testing.assert_allclose(np.asarray(got), verl_oracle(estimator, rewards, groups, lengths), rtol=1e-5, atol=1e-5)
  if estimator in ("gdpo", "grpo_passk"):
    got = mis_jax.compute_advantages(
      rewards,
      groups,
      num_groups=4,
      estimator={"name": estimator, "norm_by_std": False},
      **kw,
      **({"reward_weights": [0.3, 2.0]} if estimator == "gdpo" else {}),
    )
    want = verl_oracle(estimator, rewards, groups, lengths, weights=[0.3, 2.0], norm=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  if estimator != "reinforce_plus_plus":  # groups of one: verl's estimators take no baseline from them
    single = (
      mis_jax.compute_advantages(rewards[:2], [0, 1], num_groups=2, estimator=estimator, lengths=lengths[:2])
      if estimator != "grpo_passk"
      else None
    )
    if single is not None:
      np.testing.assert_allclose(
        np.asarray(single), verl_oracle(estimator, rewards[:2], np.array([0, 1]), lengths[:2]), rtol=1e-5, atol=1e-5
      )


def otb_oracle(rewards, groups, seqs_old, seqs_sumsq, seqs_w=None, zero_tail=True, eps=1e-8):
  """verl's compute_optimal_token_baseline_advantage for outcome rewards, over ragged sequences."""
  W = []
  for i, (o, s2) in enumerate(zip(seqs_old, seqs_sumsq)):
    w = 1 - 2 * np.exp(o) + s2
    if seqs_w is not None:
      w = w * seqs_w[i] ** 2
    W.append(np.cumsum(w))
  adv = [np.full(len(o), float(rewards[i])) for i, o in enumerate(seqs_old)]
  for g in set(groups):
    idx = [i for i in range(len(groups)) if groups[i] == g]
    if len(idx) == 1:
      continue
    horizon = max(len(W[i]) for i in idx)
    for j in range(horizon):
      have = [i for i in idx if j < len(W[i])]
      b = sum(rewards[i] * W[i][j] for i in have) / (sum(W[i][j] for i in have) + eps)
      for i in have:
        adv[i][j] = rewards[i] - b
    lens = sorted(len(W[i]) for i in idx)
    longest = [i for i in idx if len(W[i]) == lens[-1]]
    if zero_tail and len(longest) == 1 and lens[-1] > lens[-2]:
      adv[longest[0]][lens[-2] :] = rewards[longest[0]]
  return adv


@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_matches_loop(with_is):
  rng = np.random.default_rng(2)
  lengths = [3, 5, 2, 7, 4, 4, 6]
  groups = np.array([0, 0, 0, 1, 1, 2, 2])
  groups[-1] = 3  # a group of one
  rewards = rng.normal(size=len(lengths)).astype(np.float32)
  old = [np.log(rng.uniform(0.05, 0.95, n)).astype(np.float32) for n in lengths]
  sumsq = [(np.exp(2 * o) + rng.uniform(0.0, 0.3, len(o))).astype(np.float32) for o in old]  # Σπ² ≥ π_y²
  isw = [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in lengths] if with_is else None
  packing = mis_jax.plan_packing(lengths, 8)
  pack = lambda xs: packing.pack(xs, 0.0, np.float32)
  got = mis_jax.optimal_token_baseline(
    rewards,
    groups,
    packing.segment_ids,
    packing.segment_ids >= 0,
    pack(old),
    pack(sumsq),
    num_groups=4,
    num_segments=len(lengths),
    is_weights=None if isw is None else pack(isw),
  )
  want = otb_oracle(rewards, groups, old, sumsq, isw)
  for a, b in zip(packing.unpack(np.asarray(got)), want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_jit_equals_eager_and_otb_packed_equals_padded():
  """Every estimator gives the same advantages jitted and eager; OTB's per-token advantages do
  not depend on the layout (rows of 8 shared by sequences == one padded row per sequence)."""
  rng = np.random.default_rng(7)
  groups = np.array([0, 0, 0, 1, 1, 2, 2, 2])
  lengths = rng.integers(1, 7, len(groups)).astype(np.int32)
  rewards = rng.integers(0, 3, len(groups)).astype(np.float32)
  for estimator in mis_jax.estimators.SEQUENCE_ESTIMATORS:
    r = np.stack([rewards, rng.normal(size=len(groups)).astype(np.float32)], 1) if estimator == "gdpo" else rewards
    fn = lambda r, g, n: mis_jax.compute_advantages(r, g, num_groups=3, estimator=estimator, lengths=n)
    np.testing.assert_allclose(
      np.asarray(jax.jit(fn)(r, groups, lengths)),
      np.asarray(fn(r, groups, lengths)),
      rtol=1e-6,
      atol=1e-6,
      err_msg=estimator,
    )
  old = [np.log(rng.uniform(0.05, 0.95, n)).astype(np.float32) for n in lengths]
  sumsq = [(np.exp(2 * o) + 0.1).astype(np.float32) for o in old]
  isw = [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in lengths]
  n = len(lengths)
  padded = mis_jax.Packing(
    row_len=int(lengths.max()), num_rows=n, rows=np.arange(n), offsets=np.zeros(n, np.int64), lengths=lengths
  )
  outs = []
  for packing in (mis_jax.plan_packing(lengths, 8), padded):
    pack = lambda xs: packing.pack(xs, 0.0, np.float32)
    fn = jax.jit(mis_jax.optimal_token_baseline, static_argnames=("num_groups", "num_segments"))
    got = fn(
      rewards,
      groups,
      packing.segment_ids,
      packing.segment_ids >= 0,
      pack(old),
      pack(sumsq),
      num_groups=3,
      num_segments=len(lengths),
      is_weights=pack(isw),
    )
    outs.append(np.concatenate(packing.unpack(np.asarray(got))))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(
    outs[0], np.concatenate(otb_oracle(rewards, groups, old, sumsq, isw)), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("zero_tail", [False, True])
def test_otb_a_fully_masked_row_is_no_group_member(zero_tail):
  """contract §6.5: a group of one live response and one fully masked row is a group of one: the
  live response has no baseline (A = R) with either handle_zero_tail (verl with False counts the
  masked row, N = 2, and gives A = 0)."""
  lengths = [4, 3, 5]
  groups = np.array([0, 0, 1])
  rewards = np.array([0.7, -0.4, 1.3], np.float32)
  packing = mis_jax.plan_packing(lengths, 8)
  mask = packing.pack([np.ones(4, bool), np.zeros(3, bool), np.ones(5, bool)], False, bool)
  old = packing.pack([np.full(n, -1.0, np.float32) for n in lengths], 0.0, np.float32)
  got = packing.unpack(
    np.asarray(
      mis_jax.optimal_token_baseline(
        rewards,
        groups,
        packing.segment_ids,
        mask,
        old,
        np.exp(2 * old),
        num_groups=2,
        num_segments=3,
        handle_zero_tail=zero_tail,
      )
    )
  )
  np.testing.assert_allclose(got[0], np.full(4, 0.7, np.float32))
  np.testing.assert_array_equal(got[1], np.zeros(3, np.float32))
