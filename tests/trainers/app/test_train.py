"""The trainer end to end through a real `mis-jax serve` subprocess, its faults against a
deliberately faulty server, kill -9 + --resume, and its config errors."""

import dataclasses
import json
import os

import numpy as np
import pytest

import mis_jax
from fake_sglang import FakeSGLang
from trainers import cli
from trainers.learner import plan as plan_lib, step as step_lib
from trainers.app import trainer as train_lib
from trainers.learner.plan import StageInput
from trainers.config import TrainConfig
from trainers.models import init_checkpoint
from trainers.rollout.samples import ServerError
from trainers.serving.embedded.server import EmbeddedServer

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

BASE = {
  "seed": 0,
  "model": {"preset": "tiny-qwen3", "initializer_range": 0.1},
  "task": {"name": "copy_digits", "num_digits": 3},
  "rollout": {
    "prompts_per_step": 4,
    "n": 4,
    "transport": {
      "max_retries": 1,
      "backoff_s": 0.01,
      "health_attempts": 2,
      "timeout_s": 60,
      "server_restart_timeout_s": 0,
    },
  },  # fault tests: a dead server stops the run
  "train": {"steps": 3, "tokens_per_micro_batch": 64, "row_len": 32, "ppo_epochs": 2, "learning_rate": 3e-3},
  "checkpoint": {"every": 1, "max_to_keep": 2},
}
MIS = {
  "use_tis": True,
  "use_rs": True,
  "tis_mode": "mask",
  "tis_lower_bound": 0.5,
  "tis_upper_bound": 2.0,
  "rs_veto_threshold": 1e-4,
  "tis_batch_normalize": True,
}
ALGORITHMS = {
  "ppo": dict(),
  "bypass_ppo": dict(use_rollout_logprobs=True),
  "decoupled_ppo": dict(use_tis=True, mis=mis_jax.MISConfig(**MIS)),
  "reinforce_is": dict(use_tis=True, use_rollout_logprobs=True, denominator="original"),
}


def merged(base: dict, *overrides: dict) -> dict:
  """`base` with each override merged in, a nested mapping into its own (`rollout.sync` keys
  update `rollout.sync`); neither is changed."""
  out = json.loads(json.dumps(base))
  for over in overrides:
    for key, value in over.items():
      out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
  return out


def raw_cfg(tmp_path, name="run", **sections) -> dict:
  """`BASE` with `sections` merged in (a dict updates its section, a nested one its own), run_dir
  `tmp_path/name`."""
  raw = merged(BASE, sections)
  raw["run_dir"] = str(tmp_path / name)
  return raw


def make_cfg(tmp_path, name="run", **sections):
  return TrainConfig.from_dict(raw_cfg(tmp_path, name, **sections))


def embedded_server(tmp_path_factory, dtype):
  """`mis-jax serve` of a fresh tiny checkpoint (seed 1), in `dtype`: a context manager."""
  path = tmp_path_factory.mktemp(f"server-init-{dtype}")
  init_checkpoint(path, preset="tiny-qwen3", seed=1)
  return EmbeddedServer(str(path), dtype=dtype, seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  with embedded_server(tmp_path_factory, "bfloat16") as srv:
    yield srv


CENTRING_METRICS = (
  "score_centering_tv",
  "score_centering_tail_mass",
  "score_centering_drift",
  "score_centering_residual_bound",
)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_end_to_end_each_algorithm(algo, server, tmp_path, step_traces):
  """Each algorithm through the embedded server, three steps. REINFORCE + IS runs with score
  centering (contract §6.6; its loss value is the uncentred one): the sampler's top-4 head asked for
  (`top_logprobs_num`), parsed, packed beside the tokens, the ids' log-probs gathered in the training
  forward's chunked pass; its steps log the centring metrics, finite. Standard PPO runs one epoch on
  one micro-batch a step: `train.old_logprobs: auto` takes its old log-probs from the update's own
  forward (`train_fused`: no old-log-prob pass, no separate `prepare`; still counted and returned
  for the records; == the separate path: test_step). Every run moves the weights."""
  import jax

  centred, fused = algo == "reinforce_is", algo == "ppo"
  loss_cfg = mis_jax.LossConfig(**ALGORITHMS[algo], score_centering=centred)
  sections = {"rollout": {"sampling": {"top_logprobs_num": 4}}} if centred else {}
  if fused:
    sections["train"] = {"ppo_epochs": 1, "tokens_per_micro_batch": 1024}
  trainer = train_lib.Trainer(make_cfg(tmp_path, **sections), loss_cfg, urls=[server.url])
  assert {e.name for e in trainer.extras} == ({"top_logprobs", "top_logprob_ids"} if centred else set())
  before = jax.tree.map(np.array, trainer.params)
  if loss_cfg.needs_old_logprobs:
    assert trainer.plan.policy_passes == (step_lib.LOGPROBS,) and trainer.plan.old_logprobs == step_lib.LOGPROBS
  else:  # bypass and REINFORCE-IS skip the recompute entirely
    assert trainer.plan.policy_passes == () and trainer.plan.old_logprobs is None
  assert trainer.plan.fused_old_logprobs == fused
  logs, outcomes = [], []
  train_on = trainer.train_on
  trainer.train_on = lambda sb: outcomes.append(train_on(sb)) or outcomes[-1]
  history = trainer.run(progress=False, log=logs.append)
  assert [h["step"] for h in history] == [1, 2, 3]
  assert trainer.num_old_logprob_passes == (3 if loss_cfg.needs_old_logprobs else 0)  # steps that computed them
  # The step, the loss pass and the old-log-prob pass trace once per shape bucket, never again.
  if fused:
    assert all(h["micro_batches"] == 1 for h in history) and step_traces.calls["train_fused"] == 3
    assert not {"train", "prepare", "logprobs"} & set(step_traces.calls), step_traces.calls
    step_traces.check("train_fused", reused=())
    assert "old log-probs: the update's own forward when a step has one micro-batch" in "\n".join(logs), logs
    for outcome in outcomes:  # the records' column: the update's own log-probs
      old = np.asarray(outcome.old_logprobs)
      assert old.shape[0] == 1 and np.all(np.isfinite(old)) and np.all(old <= 0)
  else:
    step_traces.check("train", "prepare", *(["logprobs"] if loss_cfg.needs_old_logprobs else []))
    assert "train_fused" not in step_traces.calls
  if not loss_cfg.needs_old_logprobs:
    assert not any(name.startswith("logprobs") for name in step_traces.calls), f"{algo} made a forward pass"
    assert all(outcome.old_logprobs is None for outcome in outcomes)
  for h in history:
    assert np.isfinite(h["loss"]) and h["grad_norm"] > 0 and h["num_samples"] == 16  # every step trains
    assert {"mis_kl", "mis_k3_kl", "train_rollout_logprob_abs_diff", "reward_mean", "tokens_per_s"} <= set(h)
  # The samples of step k were generated by the weights pushed after step k-1.
  assert [h["server_weight_version"] for h in history] == ["0", "1", "2"]
  assert str(_model_info(server.url)["weight_version"]) == "3"
  if algo == "decoupled_ppo":
    assert {"mis_batch_norm_factor", "mis_rs_catastrophic_seq_fraction", "ois"} <= set(history[0])
  moved = jax.tree.leaves(
    jax.tree.map(lambda a, b: float(np.abs(np.asarray(b, np.float32) - a).max()), before, trainer.params)
  )
  assert max(moved) > 0
  if centred:
    for h in history:
      assert all(np.isfinite(h[name]) for name in CENTRING_METRICS), h
      assert 0 < h["score_centering_tail_mass"] < 1 and h["score_centering_drift"] > 0
  else:
    assert not set(CENTRING_METRICS) & set(history[0])
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 3 and json.loads(lines[-1])["step"] == 3


def _model_info(url):
  import httpx

  return httpx.get(url + "/model_info").json()


def _trainer(tmp_path, url, **sections):
  """A trainer for the fake server: its random log-probs are another model's, so the mismatch
  sanity check is off."""
  sections["rollout"] = merged({"sync": {"mismatch_check": False}}, sections.get("rollout", {}))
  return train_lib.Trainer(make_cfg(tmp_path, **sections), mis_jax.LossConfig(), urls=[url])


def test_unreachable_server_names_the_url(tmp_path):
  with FakeSGLang() as fake:
    url = fake.url
  trainer = _trainer(tmp_path, url)  # the port is closed now
  with pytest.raises(ServerError, match=f"SGLang server at {url} is unreachable after 2 attempts"):
    trainer.run(progress=False)


def test_5xx_is_retried_then_stops(tmp_path):
  with FakeSGLang(fault="generate_500") as fake:
    with pytest.raises(ServerError, match=r"/generate failed after 2 attempts: HTTP 500: internal error"):
      _trainer(tmp_path, fake.url).run(progress=False)
    assert fake.generate_calls == 2


def test_4xx_is_not_retried_and_shows_the_message(tmp_path):
  with FakeSGLang(fault="generate_400") as fake:
    with pytest.raises(ServerError, match=r"HTTP 400\): Unknown sampling_params key 'bogus'"):
      _trainer(tmp_path, fake.url).run(progress=False)
    assert fake.generate_calls == 1


@pytest.mark.parametrize(
  "fault,reason",
  [
    ("malformed_missing", "missing meta_info.output_token_logprobs"),
    ("malformed_length", "length mismatch: 4 output_ids but 3 output_token_logprobs"),
    ("malformed_null", "invalid log-prob None at response token 0"),
  ],
)
def test_malformed_samples_are_rejected_and_stop_the_run(tmp_path, fault, reason):
  with FakeSGLang(fault=fault) as fake:
    with pytest.raises(train_lib.TrainingError, match=rf"8 of 16 samples were malformed .*{reason}"):
      _trainer(tmp_path, fake.url).run(progress=False)


def test_rejected_and_aborted_samples_are_never_trained_on(tmp_path):
  with FakeSGLang(fault="malformed_null") as fake:
    trainer = _trainer(tmp_path, fake.url, rollout={"transport": {"max_rejected_fraction": 0.6}}, train={"steps": 1})
    history = trainer.run(progress=False)
  assert history[0]["num_rejected"] == 8 and history[0]["num_samples"] == 8
  with FakeSGLang(fault="some_aborted") as fake:
    history = _trainer(tmp_path, fake.url, name="aborted", train={"steps": 1}).run(progress=False)
  assert history[0]["num_aborted"] == 4 and history[0]["num_samples"] == 12


@pytest.mark.parametrize(
  "fault,pattern",
  [("sync_fail", "shapes mismatch"), ("sync_version_stuck", "weight_version is 'init' after the update")],
)
def test_weight_sync_failure_is_retried_then_stops(tmp_path, fault, pattern):
  with FakeSGLang(fault=fault) as fake:
    with pytest.raises(train_lib.TrainingError, match=rf"weight sync at step 0 failed: .*3 attempts: .*{pattern}"):
      _trainer(tmp_path, fake.url).run(progress=False)
    # One empty-body probe of the route before training, then the 3 attempts of the step-0 push.
    assert fake.requests.count(("POST", "/update_weights_from_disk")) == 1 + 3
    assert fake.requests[-1] == ("POST", "/continue_generation")  # never left paused


def test_server_dying_mid_run_keeps_the_last_checkpoint(tmp_path):
  with FakeSGLang(fault="die_after", after=2) as fake:
    trainer = _trainer(tmp_path, fake.url, train={"steps": 5})
    with pytest.raises(ServerError, match="HTTP 503"):
      trainer.run(progress=False)
    assert {p for _, p in fake.requests} <= {
      "/health",
      "/generate",
      "/pause_generation",
      "/flush_cache",
      "/update_weights_from_disk",
      "/model_info",
      "/continue_generation",
      "/server_info",
      "/get_server_info",
      "/mis_jax/read_probe",
    }
  resumed = _trainer(tmp_path, FakeSGLang().url, train={"steps": 3})
  assert resumed.restore_latest() and resumed.step == 2
  with pytest.raises(train_lib.TrainingError, match="already holds checkpoints"):
    _trainer(tmp_path, "http://127.0.0.1:9", train={"steps": 3}).run(progress=False)


def test_rejected_sequences_leave_the_baseline(tmp_path):
  """With a strict Seq-MIS band some sequences are rejected whole; with the option on, the kept
  sequences' advantages are computed from the kept rewards only (checked against a loop)."""
  mis = mis_jax.MISConfig(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.9, tis_upper_bound=1.1)
  with FakeSGLang() as fake:  # random log-probs: large mismatch, many rejections
    trainer = train_lib.Trainer(
      make_cfg(tmp_path, train={"steps": 1, "exclude_rejected_from_baseline": True}),
      mis_jax.LossConfig(use_tis=True, mis=mis),
      urls=[fake.url],
    )
    trainer.servers.client.wait_until_healthy(attempts=2)
    trainer.source.start(0)
    rollout = trainer.source.next(0)
    prompts, result = rollout.prompts, rollout.result
    sb = trainer.build_batch(prompts, result)
    inputs, batch = trainer.learner.device_batch(sb)
    batch = batch.replace(old_logprobs=trainer.fns.logprobs(trainer.params, inputs, batch.segment_ids).logprobs)
    correction = trainer.fns.prepare(batch)[0]
    assert [s.name for s in trainer.learner.stages] == ["exclude_rejected"]
    new_batch, _, stage_metrics = trainer.learner.stages[0].apply(StageInput(sb), batch, correction)
    excluded = stage_metrics["num_excluded_from_baseline"]
    trainer.servers.close()
  kept = [
    k.any()
    for k in sb.per_sequence(
      mis_jax.compute_mis_weights(
        batch.old_logprobs,
        batch.rollout_logprobs,
        batch.loss_mask,
        batch.segment_ids,
        mis,
        num_segments=trainer.spec.num_segments,
      )[1]
    )
  ]
  assert 0 < excluded == len(kept) - sum(kept)
  adv = [a[0] for a in sb.per_sequence(new_batch.advantages)]
  for i, (g, ok) in enumerate(zip(sb.groups, kept)):
    if not ok:
      continue
    members = [sb.rewards[j] for j in range(len(kept)) if sb.groups[j] == g and kept[j]]
    mean = np.mean(members)
    want = (sb.rewards[i] - mean) / (np.std(members, ddof=1) + 1e-6) if len(members) > 1 else sb.rewards[i] - mean
    np.testing.assert_allclose(adv[i], want, rtol=1e-5, atol=1e-6)
  with pytest.raises(mis_jax.ConfigError, match="exclude_rejected_from_baseline needs decoupled PPO"):
    train_lib.Trainer(
      make_cfg(tmp_path, name="x", train={"exclude_rejected_from_baseline": True}),
      mis_jax.LossConfig(use_rollout_logprobs=True),
      urls=["http://127.0.0.1:9"],
    )


def test_policy_loss_and_optimal_token_baseline_end_to_end(server, tmp_path, step_traces, monkeypatch):
  """A verl policy loss with covariance selection (kl_cov), under decoupled PPO with MIS, and the
  optimal token baseline: the run trains, its per-token advantages are verl's (a loop over the
  step's π, Σπ² and squared IS weights), and every pass traces once per shape bucket."""
  from test_advantages import otb_oracle

  loss_cfg = mis_jax.LossConfig(
    use_tis=True, mis=mis_jax.MISConfig(**MIS), policy_loss={"name": "kl_cov", "kl_cov_ratio": 0.1}
  )
  seen = []
  token_baseline = plan_lib.token_baseline

  def spy(step, batch, correction, **kwargs):
    out, correction, metrics = token_baseline(step, batch, correction, **kwargs)
    seen.append((step.sb, batch, correction, step.policy.logprobs, step.policy.sum_sq, out.advantages))
    return out, correction, metrics

  monkeypatch.setattr(plan_lib, "token_baseline", spy)  # the stages are composed when the trainer is built
  trainer = train_lib.Trainer(
    make_cfg(tmp_path, train={"steps": 2, "advantage_estimator": "optimal_token_baseline"}), loss_cfg, urls=[server.url]
  )
  assert trainer.plan.policy_passes == (step_lib.SUM_SQ,) and trainer.plan.old_logprobs == step_lib.SUM_SQ
  assert trainer.plan.advantage_stages == ("token_baseline", "reselect_covariance")
  history = trainer.run(progress=False)
  assert len(seen) == 2
  assert [h["step"] for h in history] == [1, 2] and trainer.num_old_logprob_passes == 2  # π's pass gives o
  step_traces.check("train", "prepare", "logprobs_sum_sq")
  assert all(np.isfinite(h["loss"]) and h["cov_selected_fraction"] > 0 for h in history)
  for sb, batch, correction, pi, sum_sq, adv in seen:
    per_seq = lambda x: [a[m] for a, m in zip(sb.per_sequence(x), sb.per_sequence(batch.loss_mask))]
    np.testing.assert_array_equal(np.concatenate(per_seq(pi)), np.concatenate(per_seq(batch.old_logprobs)))
    want = otb_oracle(sb.rewards, sb.groups, per_seq(pi), per_seq(sum_sq), per_seq(correction.is_weights))
    for got, w in zip(per_seq(adv), want):
      np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


def test_steps_masked_whole_warn_then_stop_naming_the_setting(tmp_path):
  """A band no token of a random-log-prob server fits: every step keeps nothing (loss 0,
  `mis_masked_whole_batch` 1). Step 1 is a warning naming the setting and the ratios seen; the
  second in a row (`train.max_consecutive_masked_steps: 2`) stops the run with the same, before
  its checkpoint."""
  mis = mis_jax.MISConfig(tis_mode="mask", tis_lower_bound=0.999, tis_upper_bound=1.001)
  logs = []
  with FakeSGLang() as fake:
    cfg = make_cfg(
      tmp_path, train={"steps": 5, "max_consecutive_masked_steps": 2}, rollout={"sync": {"mismatch_check": False}}
    )
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(use_tis=True, mis=mis), urls=[fake.url])
    with pytest.raises(
      train_lib.TrainingError, match=r"step 2: the correction kept no token .*2 steps in a row"
    ) as stop:
      trainer.run(progress=False, log=logs.append)
  warnings = [line for line in logs if line.startswith("warning: step 1: the correction kept no token")]
  assert len(warnings) == 1 and "(1 in a row; the run stops at 2)" in warnings[0], logs
  for text in (warnings[0], str(stop.value)):
    assert "tis_mode mask, tis_lower_bound 0.999, tis_upper_bound 1.001" in text, text
    lo, hi = (float(x) for x in text.split("lay in [")[1].split("]")[0].split(", "))
    assert 0 < lo <= hi and not 0.999 <= lo <= hi <= 1.001  # the ratios the band masked
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2] and all(r["mis_masked_whole_batch"] == 1 and r["loss"] == 0 for r in rows)
  assert trainer.checkpoints.latest_step() == 1


def test_config_errors(tmp_path):
  with pytest.raises(
    mis_jax.ConfigError, match=r"unknown key 'rollout.temprature'.*Did you mean 'sampling.temperature'"
  ):
    TrainConfig.from_dict({"rollout": {"temprature": 1.0}})
  with pytest.raises(
    mis_jax.ConfigError, match=r"checkpoint.every \(5\) must be a multiple of rollout.sync.sync_every \(2\)"
  ):
    TrainConfig.from_dict({"rollout": {"sync": {"sync_every": 2}}, "checkpoint": {"every": 5}})
  with pytest.raises(mis_jax.ConfigError, match=r"unknown key 'optim'"):
    TrainConfig.from_dict({"optim": {}})
  assert TrainConfig.from_dict({"train": {"learning_rate": "1e-3"}}).train.learning_rate == 1e-3
  off = tmp_path / "off.yaml"
  off.write_text("use_tis: false\n")
  code = cli.main(["train", "--config", "configs/demo.yaml", "--use-tis", "--custom-config-path", str(off)])
  assert code == 2


@pytest.mark.parametrize("name", sorted(os.listdir("configs/train")))
def test_shipped_trainer_configs_validate(name):
  cfg = TrainConfig.from_yaml(os.path.join("configs/train", name))
  loss = cfg.loss
  assert loss.algorithm in name.replace("-", "_")


PINNED_PLAN = {"attention": "blocked", "remat": "full"}


@pytest.fixture(scope="module")
def f32_server(tmp_path_factory):
  with embedded_server(tmp_path_factory, "float32") as srv:
    yield srv


def test_mesh_runs_match_one_device_and_resume_on_the_mesh(f32_server, tmp_path):
  """The demo loop on meshes (8) and (2, 4) reaches the same rewards and losses as one device,
  step by step; a run stopped after step 2 and resumed on the mesh continues identically, its
  restored parameters and optimiser state on their declared shardings. The server is float32:
  from step 2 it samples from the updated weights, which each mesh reduces in its own order, and
  a bfloat16 server rounds a weight that differs in its last float32 bit either way, so a
  sampled token can flip (it did, once the engine's layers were unrolled: loss 1.4e-4 vs
  -1.0e-4 at step 3); in float32 the samples move with the weights by rounding only."""
  import jax

  server = f32_server
  loss_cfg = mis_jax.LossConfig(**ALGORITHMS["decoupled_ppo"])
  runs = {}
  # (The fsdp-only mesh is checked step by step in test_step; here the two-axis one.)
  for name, parallel_cfg, devices in (("one", {}, jax.devices()[:1]), ("data2-fsdp4", {"data": 2, "fsdp": 4}, None)):
    # The plan pinned (not `auto`, which may pick dense attention on one device and blocked on the
    # mesh, or the reverse), so the runs differ only in their reductions' order.
    trainer = train_lib.Trainer(
      make_cfg(tmp_path, name, parallel=parallel_cfg, model=PINNED_PLAN), loss_cfg, urls=[server.url], devices=devices
    )
    runs[name] = trainer.run(progress=False)
    assert (
      dict(trainer.mesh.shape)
      == {
        "one": {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1},
        "data2-fsdp4": {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1},
      }[name]
    )
  for name in ("data2-fsdp4",):
    for got, want in zip(runs[name], runs["one"]):
      assert got["reward_mean"] == want["reward_mean"], name
      # The loss is a small difference of per-token terms of size ~|A| ~ 0.5: after an update
      # (different reduction orders per mesh, amplified by Adam) it agrees to ~1e-5 absolute.
      for key in ("loss", "pg_loss", "grad_norm", "mis_k3_kl", "entropy_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=2e-5, err_msg=f"{name} {key}")
  # Stop after 2 steps, resume on the (2, 4) mesh for the third.
  cfg = make_cfg(tmp_path, "resumed", parallel={"data": 2, "fsdp": 4}, train={"steps": 2}, model=PINNED_PLAN)
  train_lib.Trainer(cfg, loss_cfg, urls=[server.url]).run(progress=False)
  resumed = train_lib.Trainer(cfg.replace(train=dataclasses.replace(cfg.train, steps=3)), loss_cfg, urls=[server.url])
  assert resumed.restore_latest() and resumed.step == 2
  from trainers.runtime import parallel

  assert parallel.sharding_mismatches(resumed.params, resumed.fns.param_shardings) == []
  assert parallel.sharding_mismatches(resumed.opt_state, resumed.fns.opt_shardings) == []
  history = resumed.run(resume=True, progress=False)
  assert [h["step"] for h in history] == [3]
  for key in ("reward_mean", "loss", "grad_norm", "mis_k3_kl"):
    np.testing.assert_allclose(history[0][key], runs["data2-fsdp4"][2][key], rtol=1e-5, err_msg=key)


def test_auto_bounds_hold_their_targets_at_every_step(tmp_path):
  """The threshold controller in the trainer (contract §3.1), against a server whose log-probs are
  another model's (a large mismatch): decoupled PPO over several micro-batches on 8 devices, the RS band set to
  mask at most 10% of the sequences and the truncation bound to an ESS ratio of 0.8 over what it
  keeps. Every step meets both, its bound is its own, and the ESS the loss sees is the one chosen."""
  mis = mis_jax.MISConfig(
    tis_mode="truncate",
    tis_upper_bound="auto",
    target_ess_ratio=0.8,
    use_rs=True,
    rs_level="geometric",
    rs_upper_bound="auto",
    max_masked_fraction=0.1,
  )
  with FakeSGLang() as fake:
    cfg = make_cfg(
      tmp_path,
      train={"steps": 3, "tokens_per_micro_batch": 16, "row_len": 16},
      rollout={"prompts_per_step": 8, "sync": {"mismatch_check": False}},
    )
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(use_tis=True, mis=mis), urls=[fake.url])
    history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2, 3] and all(h["micro_batches"] > 1 for h in history), [
    h.get("micro_batches") for h in history
  ]
  for h in history:
    assert h["mis_auto_target_met"] == 1.0 and h["mis_auto_ess_ratio"] >= np.float32(0.8), h
    assert h["mis_ess_ratio"] == pytest.approx(h["mis_auto_ess_ratio"], rel=1e-5)
    assert h["mis_auto_rs_masked_fraction"] <= 0.1
    assert 1.0 <= h["mis_auto_rs_upper_bound"] and 0 < h["mis_auto_tis_upper_bound"] and np.isfinite(h["loss"])
  assert len({h["mis_auto_tis_upper_bound"] for h in history}) == 3  # set from each step's own ratios


def test_steps_left_without_a_fresh_token_warn_then_stop(tmp_path):
  """rollout.sync.max_token_staleness 0 against a server that reports weights two versions behind (so
  from step 2 on every token is stale): each such step trains on nothing — a warning — and the
  second in a row stops the run, saying why, before its checkpoint."""
  logs = []
  with FakeSGLang(fault="stale_versions") as fake:
    cfg = make_cfg(
      tmp_path,
      train={"steps": 5, "max_consecutive_masked_steps": 2},
      rollout={"sync": {"mismatch_check": False, "max_token_staleness": 0}},
    )
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[fake.url])
    with pytest.raises(
      train_lib.TrainingError,
      match=r"step 3: no response token was generated within "
      r"rollout.sync.max_token_staleness \(0\).*Raise rollout.sync.max_token_staleness",
    ):
      trainer.run(progress=False, log=logs.append)
  assert any(line.startswith("warning: step 2: no response token") for line in logs), logs
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["rollout/stale_token_fraction"] for r in rows] == [0.0, 1.0, 1.0] and rows[1]["loss"] == 0
  assert trainer.checkpoints.latest_step() == 2
