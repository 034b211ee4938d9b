"""The step's plan (`trainers.learner.plan.plan_step`): where the old log-probs come from. `auto`
fuses them into the update's own forward exactly when that is exact (one epoch, the plain pass the
only policy pass, no advantage stage), `separate` never does, and `from_update` where it is not exact is a
config error naming the key and the reason — from the CLI before anything is written or compiled."""

import pytest

import mis_jax
from trainers import cli
from trainers.learner import plan as plan_lib, step as step_lib
from trainers.config import TrainConfig

MIS = mis_jax.MISConfig(use_rs=True, tis_mode="mask", rs_veto_threshold=1e-4)
LOSSES = {
  "ppo": mis_jax.LossConfig(),
  "decoupled": mis_jax.LossConfig(use_tis=True, mis=MIS),
  "decoupled_kl": mis_jax.LossConfig(use_tis=True, mis=MIS, kl_coef=0.1),  # the reference pass stays apart
  "kl_cov": mis_jax.LossConfig(use_tis=True, mis=MIS, policy_loss={"name": "kl_cov", "kl_cov_ratio": 0.1}),
  "bypass": mis_jax.LossConfig(use_rollout_logprobs=True),
  "reinforce_is": mis_jax.LossConfig(use_tis=True, use_rollout_logprobs=True, denominator="original"),
  "loglinear": mis_jax.LossConfig(use_tis=True, mis=MIS, proximal="loglinear"),
}
OTB = {"advantage_estimator": "optimal_token_baseline"}
EXCLUDE = {"exclude_rejected_from_baseline": True}

# (loss, train keys, routing (replay, records)) -> (fused, the old-log-prob pass, words of the reason)
CASES = [
  ("ppo", {}, ("none", False), (True, step_lib.LOGPROBS, "one epoch")),
  ("decoupled", {}, ("none", False), (True, step_lib.LOGPROBS, "one epoch")),
  ("decoupled_kl", {}, ("none", False), (True, step_lib.LOGPROBS, "one epoch")),
  ("kl_cov", {}, ("none", False), (True, step_lib.LOGPROBS, "one epoch")),  # its selection is in prepare_step
  ("decoupled", {"ppo_epochs": 2}, ("none", False), (False, step_lib.LOGPROBS, "train.ppo_epochs 2")),
  ("decoupled", {"old_logprobs": "separate"}, ("none", False), (False, step_lib.LOGPROBS, "separate")),
  ("decoupled", OTB, ("none", False), (False, step_lib.SUM_SQ, "token_baseline")),
  ("decoupled", EXCLUDE, ("none", False), (False, step_lib.LOGPROBS, "exclude_rejected")),
  ("decoupled", {}, ("r3", True), (False, step_lib.ROUTING, "routing")),
  ("decoupled", {}, ("r2", False), (False, step_lib.ROUTING, "routing")),
  ("decoupled", {}, ("none", True), (False, step_lib.ROUTING, "routing")),  # routing-mismatch metrics
  ("bypass", {}, ("none", False), (False, None, "uses none")),
  ("reinforce_is", {}, ("none", False), (False, None, "uses none")),
  ("loglinear", {}, ("none", False), (False, None, "uses none")),
]


def _cfg(loss: str, exact: bool = False, **train) -> TrainConfig:
  return TrainConfig.from_dict(
    {"train": {"ppo_epochs": 1, **train}, "rollout": {"placement": {"exact": exact}}}
  ).replace(loss=LOSSES[loss])


@pytest.mark.parametrize("loss,train,routing,want", CASES)
def test_auto_fuses_the_old_logprobs_exactly_when_exact(loss, train, routing, want):
  plan = plan_lib.plan_step(_cfg(loss, **train), *routing)
  fused, old, words = want
  assert (plan.fused_old_logprobs, plan.old_logprobs) == (fused, old)
  assert words in plan.old_logprobs_reason and words in plan.describe()
  assert plan.fuses(1) == fused and not plan.fuses(2)  # a step of several micro-batches: the separate pass
  if fused:
    assert plan.describe().startswith("old log-probs: the update's own forward when a step has one micro-batch")
    assert plan_lib.plan_step(_cfg(loss, old_logprobs="from_update", **train), *routing).fused_old_logprobs
  elif old is not None:
    assert plan.describe().startswith(f"old log-probs: a separate {old.name} pass")


@pytest.mark.parametrize(
  "loss,train,routing,reason",
  [
    ("decoupled", {"ppo_epochs": 2}, ("none", False), r"train.ppo_epochs 2: the epochs after the first update"),
    ("decoupled", OTB, ("none", False), r"the logprobs_sum_sq pass yields more .*advantage stages \(token_baseline\)"),
    ("decoupled", EXCLUDE, ("none", False), r"advantage stages \(exclude_rejected\)"),
    ("decoupled", {}, ("r3", True), r"the logprobs_routing pass yields more"),
    ("bypass", {}, ("none", False), r"needs an algorithm with old log-probs"),
  ],
)
def test_from_update_where_it_is_not_exact_is_a_config_error(loss, train, routing, reason):
  with pytest.raises(mis_jax.ConfigError, match=r"train.old_logprobs: from_update .*" + reason):
    plan_lib.plan_step(_cfg(loss, old_logprobs="from_update", **train), *routing)


# Exact mode (rollout.placement.exact): (loss, train keys, routing) -> the policy passes, the old-log-prob pass
EXACT_CASES = [
  ("ppo", {}, ("none", False), (step_lib.EXACT,), step_lib.EXACT),
  ("decoupled", {"ppo_epochs": 2}, ("none", False), (step_lib.EXACT,), step_lib.EXACT),
  ("decoupled", {}, ("r3", True), (step_lib.EXACT_ROUTING,), step_lib.EXACT_ROUTING),
  ("decoupled", {}, ("none", True), (step_lib.EXACT_ROUTING,), step_lib.EXACT_ROUTING),
  ("decoupled", OTB, ("none", False), (step_lib.EXACT, step_lib.SUM_SQ), step_lib.EXACT),
  ("bypass", {}, ("none", False), (), None),  # no old-log-prob pass: the loss reads the rollout's
  ("bypass", {}, ("none", True), (step_lib.ROUTING,), None),
]


@pytest.mark.parametrize("loss,train,routing,passes,old", EXACT_CASES)
def test_exact_mode_takes_the_old_logprobs_from_the_exact_pass_never_the_update(loss, train, routing, passes, old):
  plan = plan_lib.plan_step(_cfg(loss, exact=True, **train), *routing)
  assert (plan.policy_passes, plan.old_logprobs) == (passes, old)
  assert not plan.fused_old_logprobs and not plan.fuses(1)
  assert plan.routing_pass == next((p for p in passes if p.routing), None)
  if old is not None:
    assert plan.describe() == (
      f"old log-probs: a separate {old.name} pass (rollout.placement.exact: the engine's "
      "arithmetic on its copy of the weights)"
    )
    with pytest.raises(mis_jax.ConfigError, match="train.old_logprobs: from_update with rollout.placement.exact"):
      plan_lib.plan_step(_cfg(loss, exact=True, old_logprobs="from_update", **train), *routing)


def test_cli_rejects_from_update_with_two_epochs_before_anything_starts(tmp_path, capsys):
  code = cli.main(
    [
      "train",
      "--config",
      "configs/demo.yaml",
      "--run-dir",
      str(tmp_path / "r"),
      "--set",
      "train.old_logprobs=from_update",
      "--set",
      "train.ppo_epochs=2",
    ]
  )
  assert code == 2
  err = capsys.readouterr().err
  assert "train.old_logprobs: from_update is exact only with one epoch" in err and "train.ppo_epochs 2" in err, err
  assert not (tmp_path / "r").exists()  # nothing was started or written
