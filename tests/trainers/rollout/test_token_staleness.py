"""Per-token staleness (`rollout.sync.max_token_staleness`): the response tokens generated more than
k weight versions before the step leave the loss and stay as context, read off SGLang's
`weight_versions` spans. Checked against a loop over the tokens, and on servers whose responses
straddle a weight update (a pause in place): the embedded server here, sglang-jax in
tests/trainers/serving/test_sglang_jax.py."""

import contextlib
import threading
import time

import httpx
import numpy as np
import pytest

from trainers.models import init_checkpoint
from trainers.serving.embedded.server import EmbeddedServer
import jax
import mis_jax
from fake_sglang import FakeSGLang
from test_train import make_cfg
from trainers.app import trainer as train_lib
from trainers.learner.batch import build_step_batch, fresh_tokens, token_staleness, token_versions
from trainers.rollout.samples import Sample
from trainers.rollout.client import http_client

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast


def _sample(n, spans, version, prompt=(1, 5, 9)):
  return Sample(
    prompt_index=0,
    prompt_ids=prompt,
    response_ids=tuple(range(10, 10 + n)),
    rollout_logprobs=tuple(-0.5 - 0.01 * i for i in range(n)),
    finish_reason="length",
    text="",
    weight_version=version,
    weight_versions=spans,
  )


SAMPLES = [
  _sample(6, (("3", 0, 2), ("4", 2, 5), ("5", 5, 6)), "5"),  # paused in place twice mid-response
  _sample(4, (), "5"),  # no spans: one version
  _sample(5, (("2", 0, 5),), "2"),  # wholly stale
  _sample(3, (("4", 0, 1), ("5", 1, 3)), "5"),
]


def test_token_versions_follow_the_spans():
  assert token_versions(SAMPLES[0]).tolist() == [3, 3, 4, 4, 4, 5]
  assert token_versions(SAMPLES[1]).tolist() == [5] * 4
  assert token_versions(SAMPLES[3]).tolist() == [4, 5, 5]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_stale_tokens_leave_the_loss_and_stay_as_context(k):
  step = 5
  fresh, metrics = fresh_tokens(token_staleness(SAMPLES, step), k)
  # A loop over every token: its staleness, its quarter of the response.
  staleness, quarters = [], {q: [] for q in range(4)}
  for s in SAMPLES:
    versions = token_versions(s)
    for i, v in enumerate(versions):
      staleness.append(step - v)
      quarters[min(4 * i // len(versions), 3)].append(step - v)
  staleness = np.array(staleness)
  assert metrics["rollout/stale_token_fraction"] == pytest.approx(np.mean(staleness > k))
  assert metrics["rollout/token_staleness_mean"] == pytest.approx(staleness.mean())
  for q in range(4):
    assert metrics[f"rollout/token_staleness_q{q + 1}"] == pytest.approx(np.mean(quarters[q]))
  sb = build_step_batch(
    SAMPLES,
    np.ones(4, np.float32),
    np.ones(4, np.float32),
    np.zeros(4, np.int32),
    num_segments=4,
    row_len=16,
    tokens_per_micro_batch=64,
    batch_devices=1,
    trained_tokens=fresh,
  )
  full = build_step_batch(
    SAMPLES,
    np.ones(4, np.float32),
    np.ones(4, np.float32),
    np.zeros(4, np.int32),
    num_segments=4,
    row_len=16,
    tokens_per_micro_batch=64,
    batch_devices=1,
  )
  masks = sb.per_sequence(sb.batch.loss_mask)
  for s, m, want, inputs in zip(SAMPLES, masks, fresh, sb.per_sequence(sb.input_ids)):
    n = len(s.response_ids)
    assert not m[: len(s.prompt_ids) - 1].any()  # the prompt
    np.testing.assert_array_equal(m[-n:], want)  # the response: its fresh tokens only
    np.testing.assert_array_equal(inputs, (s.prompt_ids + s.response_ids)[:-1])  # every token stays as context
  # Nothing else moves: inputs, targets, rollout log-probs and packing are the unmasked batch's.
  for name in ("input_ids", "targets", "positions"):
    np.testing.assert_array_equal(getattr(sb, name), getattr(full, name))
  np.testing.assert_array_equal(sb.batch.rollout_logprobs, full.batch.rollout_logprobs)
  if k == 0:
    assert [m[-len(s.response_ids) :].tolist() for s, m in zip(SAMPLES, masks)][0] == [False] * 5 + [True]


def check_straddling_response(url, start_path, other_path):
  """A 300-token response paused in place across an update from `start_path` (version 6) to
  `other_path` (version 7) on the server at `url`: two spans; at the step that trains version 7
  with `max_token_staleness` 0, the tokens before the switch leave the loss, those after stay."""
  update = lambda path, version: httpx.post(
    url + "/update_weights_from_disk", timeout=120, json={"model_path": path, "weight_version": version}
  ).json()["success"]
  client = http_client([url], max_retries=0)
  try:
    for attempt in range(4):  # the update must land while the response is being generated
      assert update(start_path, "6")
      out = {}
      thread = threading.Thread(
        target=lambda: out.update(
          result=client.generate(
            [[1, 5, 9]], {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}, n=1, seed=attempt
          )
        )
      )
      thread.start()
      time.sleep(0.3 * (attempt + 1))
      assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
      assert update(other_path, "7")
      assert httpx.post(url + "/continue_generation", json={}, timeout=30).status_code == 200
      thread.join(timeout=300)
      sample = out["result"].samples[0]
      if [v for v, _, _ in sample.weight_versions] == ["6", "7"]:
        break
    (_, a, b), (_, c, d) = sample.weight_versions
    assert a == 0 and b == c and 0 < b < d == len(sample.response_ids) == 300, sample.weight_versions
    fresh, metrics = fresh_tokens(token_staleness([sample], 7), 0)  # the step that trains version 7
    assert fresh[0].tolist() == [False] * b + [True] * (300 - b)
    assert metrics["rollout/stale_token_fraction"] == pytest.approx(b / 300)
    assert metrics["rollout/token_staleness_q1"] >= metrics["rollout/token_staleness_q4"] == 0  # early tokens are older
    sb = build_step_batch(
      [sample],
      np.ones(1, np.float32),
      np.ones(1, np.float32),
      np.zeros(1, np.int32),
      num_segments=1,
      row_len=512,
      tokens_per_micro_batch=512,
      batch_devices=1,
      trained_tokens=fresh,
    )
    mask = sb.per_sequence(sb.batch.loss_mask)[0]
    assert mask.sum() == 300 - b and mask[-(300 - b) :].all()
  finally:
    client.close()


def test_the_embedded_server_straddles_an_update_paused_in_place(tmp_path):
  paths = {name: str(tmp_path / name) for name in ("start", "other")}
  for seed, path in enumerate(paths.values()):
    init_checkpoint(path, preset="tiny-qwen3", seed=seed)
  with EmbeddedServer(paths["start"], dtype="bfloat16", seed=0) as server:
    check_straddling_response(server.url, paths["start"], paths["other"])


def test_staleness_is_packed_per_response_token():
  """`loss.proximal: loglinear` reads each response token's staleness from the batch: the step
  minus the version of its span, 0 on the prompt and padding."""
  sb = build_step_batch(
    SAMPLES,
    np.ones(4, np.float32),
    np.ones(4, np.float32),
    np.zeros(4, np.int32),
    num_segments=4,
    row_len=16,
    tokens_per_micro_batch=64,
    batch_devices=1,
    staleness=token_staleness(SAMPLES, 6),
  )
  for s, st in zip(SAMPLES, sb.per_sequence(sb.batch.rollout_staleness)):
    n = len(s.response_ids)
    assert st[-n:].tolist() == [6 - int(v) for v in token_versions(s)] and not st[:-n].any()


LOGLINEAR = mis_jax.LossConfig(use_tis=True, proximal="loglinear", mis=mis_jax.MISConfig(tis_upper_bound=2.0))


def _no_old_logprob_pass(trainer):
  """proximal loglinear must not recompute old log-probs: its plan has no pass."""
  assert trainer.plan.old_logprobs is None and trainer.plan.policy_passes == ()
  return trainer


@pytest.mark.filterwarnings("ignore:loss.proximal loglinear")  # the config expects fresh tokens; this server lags
def test_loglinear_trains_on_stale_tokens_without_the_old_logprob_pass(tmp_path):
  """Against a server two versions behind (staleness 0, 1, 2 at steps 1–3): no old-log-prob
  pass; fresh tokens train as bypass PPO (o = q: weights 1, ois = exp(lp - q)), stale ones get
  an interpolated proximal policy (weights move off 1)."""
  with FakeSGLang(fault="stale_versions") as fake:
    cfg = make_cfg(tmp_path, rollout={"sync": {"mismatch_check": False}}, train={"steps": 3, "ppo_epochs": 1})
    trainer = _no_old_logprob_pass(train_lib.Trainer(cfg, LOGLINEAR, urls=[fake.url]))
    batches = []
    build = trainer.build_batch
    trainer.build_batch = lambda *a, **k: batches.append(build(*a, **k)) or batches[-1]
    history = trainer.run(progress=False)
  assert trainer.num_old_logprob_passes == 0 and [h["step"] for h in history] == [1, 2, 3]
  for step, (sb, h) in enumerate(zip(batches, history)):
    stale = np.asarray(sb.batch.rollout_staleness)[np.asarray(sb.batch.loss_mask)]
    assert stale.size and (stale == step).all(), (step, np.unique(stale))
    assert np.isfinite(h["loss"]) and np.isfinite(h["grad_norm"])
    if step == 0:
      assert h["mis_tis_weight_before_bound"] == 1.0 and h["mis_tis_truncate_fraction"] == 0.0
    else:  # o = q + α(lp - q), α = 1/2 then 2/3: log w = α(lp - q)
      assert h["mis_tis_weight_before_bound"] != 1.0
  # ois = exp(lp - o) = exp((1 - α)(lp - q)): the log-ratio shrinks as α grows.
  assert abs(np.log(history[2]["ois"])) < abs(np.log(history[1]["ois"])) < abs(np.log(history[0]["ois"]))


def test_loglinear_with_fresh_tokens_is_the_bypass_ppo_step(tmp_path):
  """The synchronous loop (every token fresh): decoupled PPO with loglinear proximal log-probs
  makes the same update as bypass PPO (contract §6.3) — parameters and optimiser state after
  two steps of two epochs each."""
  runs = {}
  with FakeSGLang() as fake:
    for name, loss_cfg in (("loglinear", LOGLINEAR), ("bypass", mis_jax.LossConfig(use_rollout_logprobs=True))):
      cfg = make_cfg(tmp_path, name, rollout={"sync": {"mismatch_check": False}}, train={"steps": 2})
      with pytest.warns(UserWarning, match="bypass PPO's") if name == "loglinear" else contextlib.nullcontext():
        trainer = _no_old_logprob_pass(train_lib.Trainer(cfg, loss_cfg, urls=[fake.url]))
      trainer.run(progress=False)
      assert trainer.num_old_logprob_passes == 0
      runs[name] = trainer
  for name in ("params", "opt_state"):
    a, b = (jax.tree.leaves(getattr(runs[k], name)) for k in ("loglinear", "bypass"))
    for x, y in zip(a, b):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7, err_msg=name)


def test_loglinear_refuses_what_needs_the_weights_before_the_step(tmp_path):
  from trainers.app.spec import resolve

  loss = {"algorithm": "decoupled_ppo", "proximal": "loglinear", "mis": {"tis_upper_bound": 2.0}}
  with pytest.raises(mis_jax.ConfigError, match="optimal_token_baseline.*loss.proximal: recompute"):
    resolve(make_cfg(tmp_path, loss=loss, train={"advantage_estimator": "optimal_token_baseline"})).task
  with pytest.raises(mis_jax.ConfigError, match="exclude_rejected_from_baseline needs.*loss.proximal: recompute"):
    resolve(make_cfg(tmp_path, loss=loss, train={"exclude_rejected_from_baseline": True})).task
