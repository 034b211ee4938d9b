"""What the trainer asks the servers before step 1 and checks at every fresh step: the initial
weight push only when needed (`rollout.sync.initial_sync`), the pushed dtype, servers that lack
routes or fields (`/model_info`, the weight-update route, `weight_version`), and the mismatch
sanity check — against a real `mis-jax serve` process, directly or behind a proxy that
removes routes or garbles replies (`fake_sglang.FakeSGLang(upstream=...)`)."""

import pytest

import mis_jax
from fake_sglang import FakeSGLang
from test_train import make_cfg
from trainers.models import init_checkpoint
from trainers.serving.embedded.server import EmbeddedServer
from trainers.rollout import servers as servers_lib
from trainers.app import trainer as train_lib

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

DECOUPLED = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """A starting checkpoint and a float32 server started on it (version "0", as `mis-jax train`
  starts its embedded one)."""
  path = tmp_path_factory.mktemp("start")
  init_checkpoint(path, preset="tiny-qwen3", seed=3)
  with EmbeddedServer(str(path), dtype="float32", seed=0, extra_args=("--weight-version", "0")) as srv:
    yield str(path), srv


def _cfg(tmp_path, path, name, steps=2, sync=None):
  sync = sync or {}
  return make_cfg(
    tmp_path,
    name,
    model={"path": path},
    rollout={"sampling": {"max_new_tokens": 4}, "placement": {"server_dtype": "float32"}, "sync": sync},
    train={"steps": steps, "row_len": 16, "ppo_epochs": 1},
    checkpoint={"every": sync.get("sync_every", 1)},
  )


def _reset(srv, path):
  """The shared server back on the starting checkpoint, version "0" (as a fresh start)."""
  from trainers.rollout.client import http_client

  client = http_client([srv.url])
  client.update_weights_from_disk(path, "0")
  client.close()


def _pushes(proxy):
  return [p for m, p in proxy.requests if p == "/update_weights_from_disk"]


def test_auto_skips_the_first_push_only_when_the_server_serves_the_starting_weights(start, tmp_path):
  path, srv = start
  _reset(srv, path)
  with FakeSGLang(upstream=srv.url) as proxy:  # records what the trainer asks
    trainer = train_lib.Trainer(
      _cfg(tmp_path, path, "auto", steps=1, sync={"sync_every": 5}), DECOUPLED, urls=[proxy.url]
    )
    (h,) = trainer.run(progress=False)
    assert _pushes(proxy) == ["/update_weights_from_disk"]  # the route probe only (an empty, rejected body)
    assert h["server_weight_version"] == "0" and h["mis_k3_kl"] < 1e-9  # the server's own load of model.path
    assert trainer.servers.weight_dtype == "float32"  # what the server reports in /server_info
    proxy.requests.clear()
    train_lib.Trainer(
      _cfg(tmp_path, path, "always", steps=1, sync={"sync_every": 5, "initial_sync": "always"}),
      DECOUPLED,
      urls=[proxy.url],
    ).run(progress=False)
    assert len(_pushes(proxy)) == 2  # probe + the push
  # A server started elsewhere (the preset's directory differs from its model_path): pushed.
  with FakeSGLang(upstream=srv.url) as proxy:
    other = make_cfg(
      tmp_path,
      "other",
      rollout={"sampling": {"max_new_tokens": 4}, "placement": {"server_dtype": "float32"}, "sync": {"sync_every": 5}},
      train={"steps": 1, "row_len": 16, "ppo_epochs": 1},
      checkpoint={"every": 5},
    )
    train_lib.Trainer(other, DECOUPLED, urls=[proxy.url]).run(progress=False)
    assert len(_pushes(proxy)) == 2


def test_a_resume_always_pushes(start, tmp_path):
  path, srv = start
  _reset(srv, path)
  cfg = _cfg(tmp_path, path, "resume", steps=1, sync={"sync_every": 5, "initial_sync": "never"})
  train_lib.Trainer(cfg, DECOUPLED, urls=[srv.url]).run(progress=False)
  with FakeSGLang(upstream=srv.url) as proxy:
    resumed = train_lib.Trainer(
      _cfg(tmp_path, path, "resume", steps=2, sync={"sync_every": 5, "initial_sync": "never"}),
      DECOUPLED,
      urls=[proxy.url],
    )
    history = resumed.run(resume=True, progress=False)
    assert [h["step"] for h in history] == [2] and len(_pushes(proxy)) == 2  # probe + the restored weights
    assert history[0]["server_weight_version"] == "1" and history[0]["mis_k3_kl"] < 1e-9


def test_servers_without_model_info_or_weight_version(start, tmp_path):
  """sglang-jax's shape: `/get_model_info` only, no `weight_version` anywhere."""
  path, srv = start
  _reset(srv, path)
  with FakeSGLang(upstream=srv.url, fault="no_model_info") as proxy:
    cfg = _cfg(tmp_path, path, "nomi", steps=2)
    history = train_lib.Trainer(cfg, DECOUPLED, urls=[proxy.url]).run(progress=False)
    assert ("GET", "/get_model_info") in proxy.requests and ("GET", "/get_server_info") in proxy.requests
    assert [h["server_weight_version"] for h in history] == ["0", "1"]
  with FakeSGLang(upstream=srv.url, fault="no_weight_version") as proxy:
    with pytest.warns(UserWarning, match="carry no usable weight_version .* trainer's own bookkeeping"):
      history = train_lib.Trainer(_cfg(tmp_path, path, "nowv", steps=2), DECOUPLED, urls=[proxy.url]).run(
        progress=False
      )
    assert [h["server_weight_version"] for h in history] == ["0", "1"]
    assert all(h["mis_k3_kl"] < 1e-9 for h in history)


def test_a_server_without_a_weight_update_route(start, tmp_path):
  path, srv = start
  _reset(srv, path)
  with FakeSGLang(upstream=srv.url, fault="no_update_route") as proxy:
    trainer = train_lib.Trainer(_cfg(tmp_path, path, "noroute", steps=2), DECOUPLED, urls=[proxy.url])
    with pytest.raises(
      train_lib.TrainingError,
      match=r"has no /update_weights_from_disk route \(HTTP 404\), so it "
      r"cannot load the weights after step 1\. Settings that need no "
      r"weight push: .*rollout.sync.sync_every > train.steps",
    ):
      trainer.run(progress=False)
    assert trainer.step == 0
    with pytest.raises(train_lib.TrainingError, match="cannot load the starting weights before step 1"):
      train_lib.Trainer(
        _cfg(tmp_path, path, "noroute2", sync={"initial_sync": "always"}), DECOUPLED, urls=[proxy.url]
      ).run(progress=False)
    # What needs no push trains: started on model.path, no sync within the run.
    proxy.requests.clear()
    history = train_lib.Trainer(
      _cfg(tmp_path, path, "nosync", steps=2, sync={"sync_every": 3}), DECOUPLED, urls=[proxy.url]
    ).run(progress=False)
    assert [h["server_weight_version"] for h in history] == ["0", "0"]
    assert _pushes(proxy) == ["/update_weights_from_disk"]  # the route probe only


def test_the_sanity_check_stops_a_server_that_shifts_log_probs_by_one_token(start, tmp_path):
  path, srv = start
  _reset(srv, path)
  with FakeSGLang(upstream=srv.url, fault="shift_logprobs") as proxy:
    cfg = _cfg(tmp_path, path, "shift", steps=2)
    trainer = train_lib.Trainer(cfg, DECOUPLED, urls=[proxy.url])
    with pytest.raises(
      train_lib.TrainingError,
      match=r"step 1: the server and the trainer hold the same weights, yet "
      r"their log-probs differ far beyond numerics: mean \|Δ log p\| "
      r".* \(limit 0\.001\), .*for server float32, trainer float32. "
      r"Likely causes: the server runs another model or tokenizer",
    ):
      trainer.run(progress=False)
    run = tmp_path / "shift"
    assert not (run / "checkpoints" / "1").exists() and not (run / "weights" / "step_1").exists()
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    history = train_lib.Trainer(
      _cfg(tmp_path, path, "shift-off", steps=1, sync={"mismatch_check": False}), DECOUPLED, urls=[proxy.url]
    ).run(progress=False)
    assert history[0]["train_rollout_logprob_abs_diff"] > 0.05  # what the check saw


def test_mismatch_limits_by_dtype_pair(start, tmp_path):
  path, srv = start
  trainer = train_lib.Trainer(_cfg(tmp_path, path, "limits"), DECOUPLED, urls=[srv.url])
  servers = trainer.servers
  servers.server_dtype, servers.server_quantized, servers.weight_dtype = "float32", False, "float32"
  assert servers.mismatch_limits()[:2] == servers_lib.MISMATCH_LIMITS["float32"]
  servers.server_dtype = "bfloat16"
  assert servers.mismatch_limits() == (*servers_lib.MISMATCH_LIMITS["low"], "server bfloat16, trainer float32")
  # Measured mismatches sit well inside, garbled ones far outside (docs/guides/trainer.md: the sanity check).
  low_abs, low_k3 = servers_lib.MISMATCH_LIMITS["low"]
  assert 6e-2 * 4 <= low_abs < 1.78 and 4.3e-3 * 20 < low_k3 < 1.23
