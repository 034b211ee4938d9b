"""The servers' side when servers go away (issue 62's two defects, at their cause; the whole trainer
killed and resumed through them is test_crash.py):

- what the servers serve is pinned: a push deletes every other weight directory only once the
  servers took the new one (those a killed run left past the step it resumes from included), and a
  push no server took deletes nothing; the same push retried loads what it wrote;
- every wait has one deadline per step, computed once and checked before each poll: a server that
  answers `/health` but cannot load the served weights ends the wait with an error naming what it
  waited for (it looped forever: the wait returned at `/health`, the readmission failed, and the
  step started again with the deadline past), and a second wait in the same step does not get a
  new budget."""

import os
import time

import pytest

import mis_jax
from fake_sglang import FakeSGLang
from test_train import make_cfg
from trainers.app import trainer as train_lib
from trainers.rollout import weight_sync
from trainers.runtime.errors import NoServerUp, TrainingError

pytestmark = pytest.mark.integration  # starts (in-thread) servers


def _trainer(tmp_path, url, timeout_s=60.0):
  cfg = make_cfg(
    tmp_path,
    rollout={
      "sync": {"mismatch_check": False},
      "transport": {"server_restart_timeout_s": timeout_s, "backoff_s": 0.05},
    },
  )
  return train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[url])


def _steps(root) -> list[str]:
  return sorted(d for d in os.listdir(root) if d.startswith("step_"))  # (`init`: the preset's starting weights)


def _update_paths(fake) -> list[str]:
  return [
    body["model_path"] for route, body in fake.bodies if route == "/update_weights_from_disk" and "model_path" in body
  ]


def test_a_push_keeps_what_the_servers_serve_and_removes_every_other_weight_directory(tmp_path, monkeypatch):
  writes = []
  save = weight_sync.save_hf_sharded
  monkeypatch.setattr(weight_sync, "save_hf_sharded", lambda *a, **k: writes.append(str(a[2])) or save(*a, **k))
  with FakeSGLang() as fake:
    trainer = _trainer(tmp_path, fake.url)
    servers, sync = trainer.servers, trainer.servers.weight_sync
    root = sync.weights_root
    for step in (2, 5, 6):  # an older directory, and two a killed run left newer than its checkpoint (step 4)
      os.makedirs(os.path.join(root, f"step_{step}"))
    servers.push(trainer.params, 4)
    assert _steps(root) == ["step_4"] and sync.served == os.path.join(root, "step_4")
    assert _update_paths(fake) == [os.path.join(root, "step_4")] and servers.served_path == sync.served
  port = int(fake.url.rsplit(":", 1)[1])
  with pytest.raises(NoServerUp):  # no server took step 5's weights: nothing is deleted
    servers.push(trainer.params, 5)
  assert _steps(root) == ["step_4", "step_5"] and sync.served == os.path.join(root, "step_4")
  assert servers.served_version == 4  # what a server that comes back is given
  with FakeSGLang(port=port) as back:  # the push retried once a server is back: loaded, not written again
    servers.push(trainer.params, 5)
    assert _update_paths(back) == [os.path.join(root, "step_5")]
  assert writes == [os.path.join(root, "step_4"), os.path.join(root, "step_5")]
  assert _steps(root) == ["step_5"] and servers.served_version == 5
  trainer.servers.close()


def test_a_server_back_without_the_served_weights_ends_the_wait_at_its_one_deadline(tmp_path):
  """The served directory is gone (as the pruning by name left it): the server answers `/health`
  at once, but every readmission fails. The wait ends after `server_restart_timeout_s`, naming the
  weights and the server's answer; the same step's next wait (the step retried) ends at once: the
  deadline is the step's. The next step has a budget of its own, and a server that can load the
  weights ends it at once, readmitted."""
  with FakeSGLang(fault="missing_weights") as fake:
    trainer = _trainer(tmp_path, fake.url, timeout_s=1.5)
    servers = trainer.servers
    lines = []
    servers.log = lines.append
    gone = str(tmp_path / "gone" / "step_4")
    servers.served_version, servers.served_path = 4, gone
    servers.readmit(5)
    servers.client.mark_down(fake.url, "SIGKILLed")
    assert lines == [f"step 5: server {fake.url} went down (SIGKILLed); 0 of 1 serve"]
    error = NoServerUp("rollout batch 4: every server is down")
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as stop:
      servers.wait_for_restart(error)
    took = time.monotonic() - t0
    assert 1.5 <= took < 4.0, took
    assert (
      f"step 5: rollout batch 4: every server is down; waited rollout.transport.server_restart_timeout_s "
      f"(1.5 s) for a server to serve the weights of step 4 ({gone}), in vain: {fake.url}: answers /health, "
      f"but did not take the weights of step 4 ("
    ) in str(stop.value)
    assert f"{gone} does not exist" in str(stop.value)
    tries = len(_update_paths(fake))
    assert tries >= 2  # it kept trying while the deadline lasted
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="in vain"):  # the step retried: no new budget
      servers.wait_for_restart(error)
    assert time.monotonic() - t0 < 0.5 and len(_update_paths(fake)) == tries
    assert servers.step_done()["rollout/server_restarts"] == 0
    os.makedirs(gone)  # the next step, and the weights are there: readmitted at the first poll
    servers.readmit(6)
    assert servers.client.live_urls() == [fake.url]
    assert lines[-1] == "step 6: 1 server(s) back: they serve the weights of step 4 again"
    assert servers.step_done()["rollout/server_restarts"] == 1
    servers.close()


def test_a_push_no_server_takes_ends_at_the_deadline_naming_it(tmp_path):
  """Every server gone for good during a push: the wait for one to answer `/health` ends after the
  timeout, naming the push and the servers (and the push is not retried past it)."""
  with FakeSGLang() as fake:
    trainer = _trainer(tmp_path, fake.url, timeout_s=1.0)
  t0 = time.monotonic()
  with pytest.raises(TrainingError) as stop:
    trainer.servers.sync(trainer.params, 3)
  assert 1.0 <= time.monotonic() - t0 < 4.0
  assert "the weight push after step 3: weight sync at step 3: " in str(
    stop.value
  ) and f"(1 s) for a server to load the weights of step 3, in vain: no answer to /health from {fake.url}" in str(
    stop.value
  ), str(stop.value)
  trainer.servers.close()
