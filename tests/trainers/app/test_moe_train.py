"""Routed experts end to end: `mis-jax serve --enable-return-routed-experts` (a real process)
answers SGLang's `return_routed_experts` / `routed_experts_start_len` in its wire format; the
trainer replays them (R3), replays its own (R2) or only measures the routing mismatch, with
micro-batches, asynchronous rollouts and rollout records; its errors come before training."""

import base64
import json

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
from test_train import make_cfg, merged
from trainers import cli
from trainers.models import PRESETS, init_checkpoint, load_hf_checkpoint
from trainers.serving import protocol
from trainers.serving.embedded.server import EmbeddedServer
from trainers.app import trainer as train_lib
from trainers.app.spec import resolve
from trainers.rollout import settings
from trainers.rollout.extras import RoutedExperts
from trainers.rollout.samples import NoRoutedExperts, RoutingSpec, ServerError, validate_sample

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

MOE = PRESETS["tiny-qwen3-moe"]
DECOUPLED = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
  path = tmp_path_factory.mktemp("moe-weights")
  init_checkpoint(path, preset="tiny-qwen3-moe", seed=1)
  with EmbeddedServer(str(path), dtype="float32", seed=0, extra_args=("--enable-return-routed-experts",)) as srv:
    yield str(path), srv


def _generate(url, body):
  return httpx.post(url + "/generate", json=body, timeout=60)


def test_routed_experts_in_sglangs_wire_format(moe_server):
  path, srv = moe_server
  prompts = [[1, 5, 9, 13], [1, 7, 3, 3, 8, 2, 4]]
  body = {
    "input_ids": prompts,
    "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
    "return_logprob": True,
    "return_routed_experts": True,
  }
  replies = _generate(srv.url, body).json()
  model = load_hf_checkpoint(path)
  for prompt, reply in zip(prompts, replies):
    meta = reply["meta_info"]
    seq = prompt + reply["output_ids"]
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
    experts = raw.reshape(len(seq) - 1, MOE.num_hidden_layers, MOE.num_experts_per_tok)
    assert list(meta)[-1] == "routed_experts" and "routed_experts_dtype" not in meta
    # Row i: the experts of position i, as a teacher-forced forward of the whole sequence routes them.
    _, routing = model.hidden_states(
      jnp.asarray([seq], jnp.int32),
      jnp.arange(len(seq), dtype=jnp.int32)[None],
      jnp.zeros((1, len(seq)), jnp.int32),
      return_routing=True,
    )
    np.testing.assert_array_equal(experts, np.asarray(routing.native)[0, : len(seq) - 1])
    np.testing.assert_array_equal(protocol.decode_routed_experts(meta["routed_experts"], 2, 2), experts)
  # routed_experts_start_len s: rows s .. seqlen - 2.
  one = _generate(srv.url, {**body, "input_ids": prompts[1], "routed_experts_start_len": 3}).json()
  rows = protocol.decode_routed_experts(one["meta_info"]["routed_experts"], 2, 2)
  assert rows.shape[0] == len(prompts[1]) + 5 - 1 - 3
  np.testing.assert_array_equal(
    rows, protocol.decode_routed_experts(replies[1]["meta_info"]["routed_experts"], 2, 2)[3:]
  )
  # The scheduler's checks, SGLang's messages (HTTP 400).
  for start, needle in (
    (-1, "routed_experts_start_len=-1 is lower than 0"),
    (8, "routed_experts_start_len=8 is higher than the number of input tokens"),
  ):
    r = _generate(srv.url, {**body, "input_ids": prompts[1], "routed_experts_start_len": start})
    assert r.status_code == 400 and needle in r.text
  # Not asked: no key.
  assert "routed_experts" not in _generate(srv.url, {**body, "return_routed_experts": False}).json()[0]["meta_info"]


def test_without_the_flag_or_with_a_dense_model_replies_carry_no_routed_experts(moe_server, tmp_path):
  """As SGLang 0.5.23: the capturer exists only with --enable-return-routed-experts on a MoE
  model; otherwise the request is answered without `routed_experts` (no error)."""
  path, _ = moe_server
  dense = tmp_path / "dense"
  init_checkpoint(dense, preset="tiny-qwen3", seed=0)
  body = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
  for model_path, extra in ((path, ()), (str(dense), ("--enable-return-routed-experts",))):
    with EmbeddedServer(model_path, dtype="float32", extra_args=extra) as srv:
      reply = _generate(srv.url, body)
      assert reply.status_code == 200 and "routed_experts" not in reply.json()["meta_info"]
      if not extra:  # and the trainer says what to do
        cfg = make_cfg(
          tmp_path, "noflag", model={"path": path}, rollout={"sampling": {"routing_replay": "r3"}}, train={"steps": 1}
        )
        trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url])
        with pytest.raises(ServerError, match="start the SGLang server with --enable-return-routed-experts"):
          trainer.run(progress=False)
        assert trainer.step == 0 and not (tmp_path / "noflag" / "weights").exists()  # found before any step


def _cfg(tmp_path, model_path, name, rollout=None):
  return make_cfg(
    tmp_path,
    name,
    model={"path": model_path, "moe_dispatch": "grouped"},
    rollout=merged({"sampling": {"max_new_tokens": 6}, "placement": {"server_dtype": "float32"}}, rollout or {}),
    train={"steps": 2, "ppo_epochs": 2, "row_len": 16, "tokens_per_micro_batch": 16},
  )


def test_r3_with_a_float32_engine_leaves_no_routing_mismatch(moe_server, tmp_path, step_traces):
  model_path, srv = moe_server
  cfg = _cfg(
    tmp_path,
    model_path,
    "r3",
    {"sampling": {"routing_replay": "r3"}, "records": {"save_dir": str(tmp_path / "records")}},
  )
  trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url])
  result = trainer.servers.generate(trainer.prompts(0), 0)
  s = result.samples[0]
  assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2)
  again = type(result).from_json(json.loads(json.dumps(result.to_json())))  # the multi-process broadcast
  assert all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(again.samples, result.samples))
  history = train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url]).run(progress=False)
  assert [h["step"] for h in history] == [1, 2] and history[0]["micro_batches"] > 1
  step_traces.check("train", "prepare", "logprobs_routing")  # once per shape bucket (MoE, R3)
  for h in history:
    assert h["routing_mismatch_frac"] == 0 and h["routing_mismatch_token_frac"] == 0
    assert h["routing_mismatch_layer/0"] == 0 and h["routing_positions"] > 0
  assert history[0]["mis_k3_kl"] < 1e-9 and history[0]["train_rollout_logprob_abs_diff"] < 2e-5
  # The records carry the routed experts; a replay from them trains the same step 1.
  replay = _cfg(
    tmp_path,
    model_path,
    "replayed",
    {"sampling": {"routing_replay": "r3"}, "records": {"load_dir": str(tmp_path / "records")}},
  )
  replayed = train_lib.Trainer(replay, DECOUPLED, urls=[]).run(progress=False)
  for key in ("loss", "grad_norm", "mis_k3_kl", "routing_mismatch_frac"):
    np.testing.assert_allclose(replayed[0][key], history[0][key], rtol=1e-5, atol=1e-8, err_msg=key)


def test_r2_and_measuring_only_with_asynchronous_rollouts(moe_server, tmp_path):
  model_path, srv = moe_server
  r2 = train_lib.Trainer(
    _cfg(tmp_path, model_path, "r2", {"sampling": {"routing_replay": "r2", "record_routing": True}}),
    DECOUPLED,
    urls=[srv.url],
  ).run(progress=False)
  measured = train_lib.Trainer(
    _cfg(tmp_path, model_path, "measure", {"sampling": {"record_routing": True}, "sync": {"max_staleness": 1}}),
    DECOUPLED,
    urls=[srv.url],
  ).run(progress=False)
  for h in r2 + measured:
    assert np.isfinite(h["loss"]) and "routing_mismatch_frac" in h
  assert r2[0]["routing_mismatch_frac"] == 0 and r2[0]["mis_k3_kl"] < 1e-9  # float32 engine: the same routing
  plain = train_lib.Trainer(_cfg(tmp_path, model_path, "plain"), DECOUPLED, urls=[srv.url]).run(progress=False)
  assert "routing_mismatch_frac" not in plain[0]  # nothing asked of the server, nothing measured


@pytest.mark.parametrize(
  "sets,needle",
  [
    (
      ["rollout.sampling.routing_replay=r3"],
      "rollout.sampling.routing_replay r3 needs a mixture-of-experts model; qwen3 is dense",
    ),
    (["rollout.sampling.record_routing=true"], "rollout.sampling.record_routing needs a mixture-of-experts model"),
    (
      ["model.preset=tiny-qwen3-moe", "rollout.sampling.routing_replay=r3", "rollout.sampling.record_routing=false"],
      "rollout.sampling.record_routing cannot be false with it",
    ),
    (["parallel.expert=2"], "parallel.expert=2 needs a mixture-of-experts model"),
    (
      ["model.preset=tiny-qwen3-moe", "parallel.expert=16", "parallel.fsdp=1"],
      "parallel: data=1 x fsdp=1 x expert=16 x tensor=1 (= 16) does not divide the 8 devices",
    ),
    (["train.router_aux_loss_coef=0.01"], "train.router_aux_loss_coef is for mixture-of-experts models"),
  ],
)
def test_routing_config_errors_come_before_anything_starts(sets, needle, tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["train", "--config", "configs/demo.yaml", "--run-dir", str(run_dir)]
  for s in sets:
    argv += ["--set", s]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err, err
  assert not run_dir.exists()


def test_routed_experts_that_do_not_fit_the_model_stop_the_run():
  spec = RoutingSpec(num_layers=2, top_k=2, num_experts=8)
  good = {
    "text": "",
    "output_ids": [4, 5],
    "meta_info": {
      "finish_reason": {"type": "length", "length": 2},
      "output_token_logprobs": [[-1.0, 4, None], [-1.0, 5, None]],
      "routed_experts": protocol.encode_routed_experts(np.zeros((4, 2, 2), np.int32)),
    },
  }
  error, parsed = validate_sample(good, extras=(RoutedExperts(spec),), prompt_len=3)
  assert error is None and parsed["extras"]["routed_experts"].shape == (4, 2, 2)
  for experts, needle in (
    (np.zeros((3, 3, 3), np.int32), "do not fit the model"),
    (np.zeros((5, 2, 2), np.int32), "5 rows for a sequence of 5 tokens"),
    (np.full((4, 2, 2), 9, np.int32), "ids outside [0, 8)"),
  ):
    bad = json.loads(json.dumps(good))
    bad["meta_info"]["routed_experts"] = protocol.encode_routed_experts(experts)
    with pytest.raises(NoRoutedExperts, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
      validate_sample(bad, extras=(RoutedExperts(spec),), prompt_len=3)
  # Another dtype when the server says so.
  other = json.loads(json.dumps(good))
  other["meta_info"]["routed_experts"] = base64.b64encode(np.arange(16, dtype="<i2") % 8).decode()
  other["meta_info"]["routed_experts_dtype"] = "int16"
  assert (
    validate_sample(other, extras=(RoutedExperts(spec),), prompt_len=3)[1]["extras"]["routed_experts"]
    .reshape(-1)
    .tolist()
    == (np.arange(16) % 8).tolist()
  )
  assert issubclass(NoRoutedExperts, ServerError)


def test_shipped_moe_config():
  from trainers.config import TrainConfig

  cfg = TrainConfig.from_yaml("configs/moe_r3.yaml")
  resolve(cfg).task
  assert PRESETS[cfg.model.preset].is_moe and cfg.rollout.sampling.routing_replay == "r3"
  assert settings.routing_setup(cfg.rollout, PRESETS[cfg.model.preset])[1] == RoutingSpec(2, 2, 8)


@pytest.mark.parametrize("algo", ["bypass_ppo", pytest.param("reinforce_is", marks=pytest.mark.repeat)])
def test_r3_with_the_other_algorithms(algo, moe_server, tmp_path):
  """R3 needs no old-log-prob pass of the algorithm (bypass, REINFORCE + IS): the routing pass
  still measures the mismatch, and the replayed routing reaches every training forward."""
  from test_train import ALGORITHMS

  model_path, srv = moe_server
  cfg = _cfg(tmp_path, model_path, algo, {"sampling": {"routing_replay": "r3"}})
  (h1, h2) = train_lib.Trainer(cfg, mis_jax.LossConfig(**ALGORITHMS[algo]), urls=[srv.url]).run(progress=False)
  assert h1["routing_mismatch_frac"] == 0 and h1["mis_k3_kl"] < 1e-9 and np.isfinite(h2["loss"])
