"""The trainer's cache salt (`rollout.sync.cache_salt`): every `/generate` carries SGLang's `extra_key`
naming the weights it starts under, a fresh one from the moment each update begins (before the
pause), so no engine with a prefix cache can answer it from KV of other weights. Against the
fault server (it records every body); the engines' side is in test_server.py (the embedded
server checks the key) and test_sglang_jax.py (sglang-jax's cache, with and without it)."""

import pytest

import mis_jax
from fake_sglang import FakeSGLang
from test_train import make_cfg
from trainers.app import trainer as train_lib
from trainers.rollout.client import http_client

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast


def _generate_keys(fake, start: int = 0) -> list:
  return [body.get("extra_key", "<none>") for route, body in fake.bodies[start:] if route == "/generate"]


def test_every_request_carries_the_namespace_of_the_weights_it_starts_under():
  with FakeSGLang() as fake:
    client = http_client([fake.url], max_retries=0, prompts_per_request=1)
    try:
      client.generate([[1, 5], [1, 6]], {"max_new_tokens": 2}, n=2, seed=0)
      first = _generate_keys(fake)
      assert len(first) == 2 and len(set(first)) == 1 and first[0] == client.cache_salt
      salts_at_pause = []
      (engine,) = client.engines.values()
      pause = engine.pause

      def spy(mode):  # the salt in force when the pause is sent
        salts_at_pause.append(client.cache_salt)
        return pause(mode)

      engine.pause = spy
      client.update_weights_from_disk("/nowhere", "3")
      assert salts_at_pause == [client.cache_salt] and client.cache_salt != first[0]
      assert client.cache_salt.endswith(":w3")
      n = len(fake.bodies)
      client.generate([[1, 5]], {"max_new_tokens": 2}, n=1)
      assert _generate_keys(fake, n) == [client.cache_salt]
      again = client.cache_salt
      client.update_weights_from_disk("/nowhere", "3")  # the same version pushed again: a fresh namespace
      assert client.cache_salt != again and client.cache_salt.endswith(":w3")
    finally:
      client.close()
  with FakeSGLang() as fake:  # another client (a restarted trainer): another namespace
    other = http_client([fake.url], max_retries=0)
    try:
      other.generate([[1, 5]], {"max_new_tokens": 2}, n=1)
      assert _generate_keys(fake) == [other.cache_salt] and other.cache_salt.split(":")[1] != first[0].split(":")[1]
    finally:
      other.close()


def test_the_trainer_salts_its_rollouts_unless_told_not_to(tmp_path):
  loss = mis_jax.LossConfig(use_tis=True)
  for salt in (True, False):
    with FakeSGLang() as fake:
      cfg = make_cfg(
        tmp_path,
        f"salt-{salt}",
        rollout={
          "sampling": {"max_new_tokens": 3},
          "sync": {"cache_salt": salt, "sync_every": 1, "mismatch_check": False, "initial_sync": "always"},
        },
        train={"steps": 2, "ppo_epochs": 1, "row_len": 16},
        checkpoint={"every": 2},
      )
      train_lib.Trainer(cfg, loss, urls=[fake.url]).run(progress=False)
      keys = _generate_keys(fake)
      if salt:  # step 1 after the initial push (version 0), step 2 after the push of step 1
        versions = [k.rsplit(":w", 1)[1] for k in keys]
        assert versions[0] == "0" and versions[-1] == "1" and len(set(keys)) == 2, keys
      else:
        assert set(keys) == {"<none>"}
