"""The mismatch experiment's statistics against hand-computed values, its bad-input errors, and
its `--quick` mode end to end (real embedded servers and trainers, a few steps)."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from trainers.experiments import mismatch


def test_t_interval_matches_hand_computed_quantiles():
  x = [0.1, 0.4, 0.35, 0.2, 0.45]
  mean, lo, hi = mismatch.t_interval(x)
  s = math.sqrt(sum((v - 0.3) ** 2 for v in x) / 4)
  half = 2.7764451052 * s / math.sqrt(5)  # t_{0.975, 4}
  assert mean == pytest.approx(0.3) and lo == pytest.approx(0.3 - half) and hi == pytest.approx(0.3 + half)
  mean, lo, hi = mismatch.t_interval([1.0, 2.0])
  assert hi - mean == pytest.approx(12.7062047362 * math.sqrt(0.5) / math.sqrt(2))  # t_{0.975, 1}
  with pytest.raises(ValueError, match="at least 2"):
    mismatch.t_interval([1.0])


def _synthetic():
  rng = np.random.default_rng(0)
  runs = []
  for arm, shift in (("standard PPO", 0.0), ("decoupled + MIS", 0.1)):
    for seed in range(4):
      rewards = (np.linspace(0, 1, 6) + shift + rng.normal(0, 0.05, 6)).tolist()
      runs.append(
        {
          "arm": arm,
          "setting": "fp8",
          "seed": seed,
          "reward_mean": rewards,
          "mis_k3_kl": [0.01] * 6,
          "train_rollout_logprob_abs_diff": [0.1] * 6,
        }
      )
  return {"design": {"final_window": 2, "settings": ["fp8"], "arms": ["standard PPO", "decoupled + MIS"]}, "runs": runs}


def test_summary_is_means_and_paired_differences_over_seeds():
  results = _synthetic()
  rows = {r["arm"]: r for r in mismatch.summarize(results)}
  runs = results["runs"]
  final = {a: [np.mean(r["reward_mean"][-2:]) for r in runs if r["arm"] == a] for a in rows}
  area = {a: [np.mean(r["reward_mean"]) for r in runs if r["arm"] == a] for a in rows}
  assert rows["standard PPO"]["final_reward"][0] == pytest.approx(np.mean(final["standard PPO"]))
  assert rows["decoupled + MIS"]["auc"][0] == pytest.approx(np.mean(area["decoupled + MIS"]))
  diff = np.array(final["decoupled + MIS"]) - np.array(final["standard PPO"])
  got = rows["decoupled + MIS"]["final_reward_minus_baseline"]
  half = 3.1824463053 * diff.std(ddof=1) / 2  # t_{0.975, 3}, sqrt(4)
  assert got == pytest.approx((diff.mean(), diff.mean() - half, diff.mean() + half))
  assert "final_reward_minus_baseline" not in rows["standard PPO"]
  assert rows["standard PPO"]["mis_k3_kl"] == pytest.approx(0.01)
  table = mismatch.summary_table(dict(results, summary=list(rows.values())))
  assert "| fp8 | decoupled + MIS |" in table and "*" in table  # a 0.1 shift with noise 0.05: significant


def test_centering_table_pairs_each_centred_arm_with_itself_uncentred():
  """Δ is to the same arm without centring (not to standard PPO), over the common seeds; the
  centring metrics are means [95% CI] over seeds at step 1, of each run's mean over steps and over
  its last `final_window` steps."""
  rng = np.random.default_rng(1)
  arms = ["standard PPO", "decoupled + MIS", "decoupled + MIS" + mismatch.CENTERED]
  runs = []
  for arm, shift in zip(arms, (0.3, 0.0, 0.05)):
    for seed in range(3):
      centred = arm.endswith(mismatch.CENTERED)
      runs.append(
        {
          "arm": arm,
          "setting": "fp8",
          "seed": seed,
          "reward_mean": (np.linspace(0, 1, 6) + shift + rng.normal(0, 0.05, 6)).tolist(),
          "mis_k3_kl": [0.01] * 6,
          "train_rollout_logprob_abs_diff": [0.1] * 6,
          **{k: (rng.uniform(0, 1, 6).tolist() if centred else [None] * 6) for k in mismatch.CENTERING_METRICS},
        }
      )
  results = {"design": {"final_window": 2, "settings": ["fp8"], "arms": arms}, "runs": runs}
  table = mismatch.centering_table(results)
  by = {(r["arm"], r["seed"]): r for r in runs}
  diff = [
    np.mean(by[(arms[2], s)]["reward_mean"][-2:]) - np.mean(by[(arms[1], s)]["reward_mean"][-2:]) for s in range(3)
  ]
  m, lo, hi = mismatch.t_interval(diff)
  row = next(line for line in table.splitlines() if line.startswith("| fp8 | decoupled + MIS + centering |"))
  assert [c.strip() for c in row.strip("|").split("|")][2].startswith(f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
  assert len(table.splitlines()) == 3  # header, rule, one centred arm in one setting
  metrics = mismatch.centering_metrics_table(results)
  drift = [by[(arms[2], s)]["score_centering_drift"] for s in range(3)]
  row = next(line for line in metrics.splitlines() if "`score_centering_drift`" in line)
  want = [
    mismatch.t_interval(v)
    for v in ([d[0] for d in drift], [np.mean(d) for d in drift], [np.mean(d[-2:]) for d in drift])
  ]
  assert [c.strip() for c in row.strip("|").split("|")][3:] == [f"{a:.2e} [{b:.2e}, {c:.2e}]" for a, b, c in want]


def test_exact_table_pairs_each_exact_setting_with_its_default():
  """Δ is exact minus default of the same arm and staleness, over the seeds both ran; the mismatch
  columns are each setting's mean."""
  rng = np.random.default_rng(2)
  runs = []
  for setting, shift, k3 in (
    ("bf16", 0.0, 4e-5),
    ("bf16, exact", 0.02, 0.0),
    ("bf16, sync 4", -0.1, 0.2),
    ("bf16, exact, sync 4", -0.1, 0.2),
  ):
    for seed in range(4):
      runs.append(
        {
          "arm": "standard PPO",
          "setting": setting,
          "seed": seed,
          "reward_mean": (np.linspace(0, 1, 6) + shift + rng.normal(0, 0.02, 6)).tolist(),
          "mis_k3_kl": [k3] * 6,
          "train_rollout_logprob_abs_diff": [10 * k3] * 6,
        }
      )
  results = {
    "design": {"final_window": 2, "settings": list(mismatch.EXACT.settings), "arms": ["standard PPO"]},
    "runs": runs,
  }
  results["summary"] = mismatch.summarize(results)
  table = mismatch.exact_table(results)
  by = {(r["setting"], r["seed"]): r for r in runs}
  diff = [
    np.mean(by[("bf16, exact", s)]["reward_mean"][-2:]) - np.mean(by[("bf16", s)]["reward_mean"][-2:]) for s in range(4)
  ]
  m, lo, hi = mismatch.t_interval(diff)
  row = next(line for line in table.splitlines() if "| bf16, exact vs bf16 |" in line)
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[2].startswith(f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]") and cells[5] == "0.00e+00 / 4.00e-05"
  assert len(table.splitlines()) == 4  # header, rule, fresh and stale


def test_drawdown_is_fall_from_the_best_running_mean():
  assert mismatch.drawdown({"reward_mean": [0.0, 0.2, 0.4, 0.6]}, 2) == 0.0  # still improving
  # running means of 2: 0.5, 0.9, 0.5, 0.2 -> best 0.9, final 0.2
  assert mismatch.drawdown({"reward_mean": [0.2, 0.8, 1.0, 0.0, 0.4]}, 2) == pytest.approx(0.7)


def test_bad_design_names_the_field():
  with pytest.raises(ValueError, match="unknown arm"):
    mismatch.Design(arms=("PPO",))
  with pytest.raises(ValueError, match="unknown setting"):
    mismatch.Design(settings=("fp4",))
  with pytest.raises(ValueError, match="at least 2 seeds"):
    mismatch.Design(seeds=(0,))
  with pytest.raises(SystemExit):
    mismatch.main(["--bogus"])


COMMITTED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "notebooks", "figures", "mismatch")


@pytest.mark.parametrize(
  "sub, design",
  [
    ("", mismatch.FULL),
    ("stress", mismatch.STRESS),
    ("moe", mismatch.MOE),
    ("forms", mismatch.FORMS),
    ("controller", mismatch.CONTROLLER),
    ("proximal", mismatch.PROXIMAL),
    ("centering", mismatch.CENTERING),
    ("exact", mismatch.EXACT),
  ],
)
def test_committed_results_are_the_full_design(sub, design):
  """notebooks/figures/mismatch (the grid) and its stress/ (the collapse search) hold complete
  runs of the current designs, and their summaries are what `summarize` computes from the runs."""
  with open(os.path.join(COMMITTED, sub, "results.json")) as f:
    results = json.load(f)
  assert results["design"] == json.loads(json.dumps(dataclasses.asdict(design)))
  want = {(a, s, seed) for a in design.arms for s in design.settings for seed in design.seeds}
  want |= {(design.arms[0], s, seed) for s in design.probe_settings for seed in design.seeds}
  assert {(r["arm"], r["setting"], r["seed"]) for r in results["runs"]} == want
  assert all(len(r["reward_mean"]) == design.steps for r in results["runs"])
  assert json.loads(json.dumps(mismatch.summarize(results))) == results["summary"]
  for name in ("curves_reward_mean.png", "curves_mis_k3_kl.png", "curves_grad_norm.png", "intervals.png"):
    assert os.path.isfile(os.path.join(COMMITTED, sub, name))
  if design is mismatch.CONTROLLER:  # the controller held its targets at every step of every seed
    for r in results["runs"]:
      if r["arm"] == "decoupled + auto TIS":
        assert min(r["mis_auto_target_met"]) == 1 and min(r["mis_auto_ess_ratio"]) >= np.float32(mismatch.AUTO_ESS)
      if r["arm"] == "decoupled + auto MIS":
        assert min(r["mis_auto_target_met"]) == 1 and max(r["mis_auto_tis_masked_fraction"]) <= mismatch.AUTO_MASKED
      if "auto" in r["arm"]:  # and the bound moved with the steps' ratios
        assert max(r["mis_auto_tis_upper_bound"]) > 1.05 * min(r["mis_auto_tis_upper_bound"])
  if design is mismatch.PROXIMAL:  # synchronous, every token is fresh: loglinear is bypass PPO whatever the bound
    run = {(r["arm"], r["setting"], r["seed"]): r for r in results["runs"]}
    for seed in design.seeds:
      a, b = (run[(arm + mismatch.LOGLINEAR, "fp8", seed)] for arm in ("decoupled + token TIS", "decoupled + MIS"))
      assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] == b["grad_norm"]
      stale = (
        run[(arm + mismatch.LOGLINEAR, "fp8, sync 4", seed)] for arm in ("decoupled + token TIS", "decoupled + MIS")
      )
      assert next(stale)["grad_norm"] != next(stale)["grad_norm"]  # stale tokens: the corrections differ
  if design is mismatch.CENTERING:  # the centred runs asked for the top-k and logged the centring at every step
    for r in results["runs"]:
      centred = r["arm"].endswith(mismatch.CENTERED)
      assert r["top_logprobs_num"] == (mismatch.TOP_K if centred else 0)
      for name in mismatch.CENTERING_METRICS:
        assert all((v is not None and np.isfinite(v)) if centred else v is None for v in r[name]), (r["arm"], name)
    assert os.path.isfile(os.path.join(COMMITTED, sub, "curves_score_centering_drift.png"))
  if design is mismatch.EXACT:  # fresh exact runs: zero mismatch at every step; stale ones: only the first step
    for r in results["runs"]:
      exact, stale = mismatch.SETTINGS[r["setting"]].exact, mismatch.SETTINGS[r["setting"]].sync_every > 1
      if exact and not stale:
        assert max(r["mis_k3_kl"]) == 0.0 and max(r["train_rollout_logprob_abs_diff"]) == 0.0, r["seed"]
      elif exact:  # the steps right after a push are fresh and exact; the stale ones are not
        every = mismatch.SETTINGS[r["setting"]].sync_every
        assert all(k3 == 0.0 for k3 in r["mis_k3_kl"][::every]) and max(r["mis_k3_kl"]) > 0, r["seed"]
      else:
        assert min(r["train_rollout_logprob_abs_diff"]) > 0, (r["setting"], r["seed"])
  if design.preset.endswith("moe"):  # the router disagreement was measured in every arm, with or without R3
    assert all(None not in r["routing_mismatch_frac"] for r in results["runs"])
    assert "| fp8 | decoupled + MIS + R3 |" in mismatch.routing_table(results)


@pytest.mark.slow
@pytest.mark.repeat  # the trainer end to end on the embedded server: tests/trainers/app/test_train.py
def test_quick_mode_end_to_end(tmp_path, capsys):
  out = str(tmp_path / "quick")
  mismatch.main(["--quick", "--out", out])
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
  design = mismatch.QUICK
  assert {(r["arm"], r["setting"], r["seed"]) for r in results["runs"]} == {
    (a, s, seed) for a in design.arms for s in design.settings for seed in design.seeds
  }
  for r in results["runs"]:
    assert len(r["reward_mean"]) == len(r["step"]) == design.steps
    assert all(0 <= v <= 1.25 for v in r["reward_mean"])
    assert all(v > 0 for v in r["mis_k3_kl"])  # fp8 weights, stale: a real mismatch
    # The centred arm asked for the sampler's top-k and logged the drift before and its bound after
    # centring, finite; the others asked for nothing and logged none.
    centred = r["arm"].endswith(mismatch.CENTERED)
    assert r["top_logprobs_num"] == (mismatch.TOP_K if centred else 0)
    for name in mismatch.CENTERING_METRICS:
      assert all((v is not None and np.isfinite(v)) if centred else v is None for v in r[name]), (r["arm"], name)
    if centred:
      assert all(0 < v < 1 for v in r["score_centering_tail_mass"]) and max(r["score_centering_drift"]) > 0
  assert [row["arm"] for row in results["summary"]] == list(design.arms)
  for name in (
    "curves_reward_mean.png",
    "curves_mis_k3_kl.png",
    "curves_grad_norm.png",
    "intervals.png",
    "curves_score_centering_drift.png",
  ):
    assert os.path.getsize(os.path.join(out, name)) > 1000
  printed = capsys.readouterr().out
  assert "| fp8, sync 4 | decoupled + MIS |" in printed
  centring = printed[printed.index("| Δ final vs uncentred |") :]  # the centring tables
  assert "| fp8, sync 4 | decoupled + MIS + centering |" in centring
  assert "| fp8, sync 4 | decoupled + MIS + centering | `score_centering_drift` |" in centring
  mismatch.main(["--quick", "--out", out, "--resume"])  # nothing left to run: no server starts
  with open(os.path.join(out, "results.json")) as f:
    assert json.load(f)["runs"] == results["runs"]
