"""The trainer against a real SGLang implementation: sglang-jax (the JAX port of SGLang, same
`/generate` API), started on 127.0.0.1 from a Python >= 3.12 venv with pinned
`sglang-jax[cpu]` (created once, cached in `~/.cache/mis_jax`, or `$MIS_JAX_CACHE`).

sglang-jax has no weight-update route, no `/model_info` (only `/get_model_info`) and no
`weight_version`: the trainer runs against it with the server started on `model.path`, the
first push skipped (`initial_sync: auto`) and no sync within the run (`sync_every > steps`).
Flags that make it correct and light on CPU: `--disable-overlap-schedule` (its overlap scheduler
garbles some instances' multi-sequence batches), `--enable-deterministic-sampling` (else
`sampling_seed` is ignored), `--skip-tokenizer-init` (the tiny checkpoint has no tokenizer),
`--attention-backend native`, small memory pools. head_dim 128: its CPU attention pads to it.
"""

import contextlib
import dataclasses
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

import mis_jax
from helpers import free_port
from test_train import make_cfg
from trainers.models import PRESETS, init_checkpoint
from trainers.serving.server import EmbeddedServer
from trainers.training import train as train_lib
from trainers.training.rollout import SGLangClient

PIN = "sglang-jax[cpu]==0.1.0rc0"
CACHE = os.environ.get("MIS_JAX_CACHE", os.path.expanduser("~/.cache/mis_jax"))
VENV = os.path.join(CACHE, "sglang-jax-0.1.0rc0")
FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "native", "--grammar-backend", "none",
         "--disable-precompile", "--skip-server-warmup", "--disable-overlap-schedule", "--random-seed", "0",
         "--skip-tokenizer-init", "--enable-deterministic-sampling", "--max-total-tokens", "4096",
         "--max-running-requests", "64", "--mem-fraction-static", "0.05"]
MODEL = dataclasses.replace(PRESETS["tiny-qwen3"], head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                            initializer_range=0.1)


def _python312() -> str | None:
  for name in ("python3.12", "python3.13"):
    if shutil.which(name):
      return shutil.which(name)
  found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23]*/bin/python3")))
  return found[0] if found else None


def _venv_python() -> str:
  """The cached venv's interpreter with sglang-jax importable, created (once, under a file
  lock) if missing; a skip naming what is missing where it cannot be."""
  python = os.path.join(VENV, "bin", "python")
  ok = lambda: os.path.exists(python) and subprocess.run([python, "-c", "import sgl_jax"],
                                                         capture_output=True).returncode == 0
  os.makedirs(CACHE, exist_ok=True)
  with open(os.path.join(CACHE, ".sglang-jax.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if ok():
      return python
    base = _python312()
    if base is None:
      pytest.skip("sglang-jax needs Python >= 3.12: no python3.12 / python3.13 on PATH or under ~/.pyenv/versions")
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [[base, "-m", "venv", VENV], [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [python, "-m", "pip", "install", "-q", PIN]]
    for cmd in steps:
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
      if done.returncode != 0:
        shutil.rmtree(VENV, ignore_errors=True)
        pytest.skip(f"could not install {PIN} with {base}: {' '.join(cmd[2:])} failed: {done.stderr[-800:]}")
    if not ok():
      pytest.skip(f"{PIN} installed in {VENV} but `import sgl_jax` fails")
    return python


@contextlib.contextmanager
def sglang_jax_server(model_path: str, *extra: str, flags=FLAGS):
  python = _venv_python()
  port = free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(CACHE, "jax-cache-sglang-jax"))
  log = open(os.path.join(os.path.dirname(model_path), f"sglang-jax-{port}.log"), "w")
  proc = subprocess.Popen([python, "-m", "sgl_jax.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
                           "--port", str(port), *flags, *extra], env=env, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.time() + 240
    while True:
      if proc.poll() is not None:
        log.flush()
        raise RuntimeError(f"sglang-jax exited with {proc.returncode}: {open(log.name).read()[-3000:]}")
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      if time.time() > deadline:
        raise RuntimeError(f"sglang-jax not healthy after 240 s: {open(log.name).read()[-3000:]}")
      time.sleep(0.5)
    yield url
  finally:
    os.killpg(proc.pid, 15)
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
    log.close()


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("sglang-jax") / "model")
  init_checkpoint(path, config=MODEL, seed=0)
  with sglang_jax_server(path) as url:
    yield path, url


def test_the_trainer_trains_against_sglang_jax(real_server, tmp_path):
  path, url = real_server
  cfg = make_cfg(tmp_path, "sgl", model={"path": path},
                 rollout={"server_dtype": "float32", "max_new_tokens": 4, "sync_every": 3},
                 train={"steps": 2, "row_len": 16, "ppo_epochs": 1}, checkpoint={"every": 3})
  loss = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))
  trainer = train_lib.Trainer(cfg, loss, urls=[url])
  with pytest.warns(UserWarning, match="carry no usable weight_version"):
    history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2] and all(h["num_samples"] == 16 for h in history)
  assert [h["server_weight_version"] for h in history] == ["0", "0"]  # never pushed: the starting weights
  assert trainer.weight_dtype == "float32"  # from its /get_server_info
  # Step 1, same weights on both sides in float32: the mismatch is rounding.
  assert history[0]["mis_k3_kl"] < 1e-8 and history[0]["train_rollout_logprob_abs_diff"] < 1e-4
  print({k: history[0][k] for k in ("mis_k3_kl", "train_rollout_logprob_abs_diff")})
  # Step 2 trains on rollouts of the starting weights (one update stale): decoupled PPO corrects.
  assert history[1]["train_rollout_logprob_abs_diff"] > history[0]["train_rollout_logprob_abs_diff"]


def test_greedy_tokens_and_logprobs_equal_the_embedded_server(real_server):
  path, url = real_server
  body = {"input_ids": [[1, 5, 9, 12], [1, 7, 7, 3, 30], [1, 60]], "return_logprob": True,
          "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "skip_special_tokens": False,
                              "no_stop_trim": True}}
  theirs = httpx.post(url + "/generate", json=body, timeout=120).json()
  with EmbeddedServer(path, dtype="float32") as ours_srv:
    ours = httpx.post(ours_srv.url + "/generate", json=body, timeout=120).json()
  for a, b in zip(theirs, ours):
    assert a["output_ids"] == b["output_ids"]
    np.testing.assert_allclose([e[0] for e in a["meta_info"]["output_token_logprobs"]],
                               [e[0] for e in b["meta_info"]["output_token_logprobs"]], atol=2e-5)


def test_the_clients_other_calls(real_server):
  path, url = real_server
  client = SGLangClient([url], max_retries=0)
  try:
    client.wait_until_healthy(attempts=3)
    assert os.path.realpath(client.model_info()["model_path"]) == os.path.realpath(path)  # via /get_model_info
    assert client.server_info()["dtype"] == "float32"  # via /get_server_info
    assert client.has_weight_update_route(url) is False
    for route, body in (("/pause_generation", {"mode": "abort"}), ("/flush_cache", {}), ("/continue_generation", {})):
      client._request("POST", url, route, body)  # noqa: SLF001 - the calls the weight sync makes, one by one
    result = client.generate([[1, 5, 9]], {"temperature": 1.0, "max_new_tokens": 3}, n=2, seed=7)
    assert len(result.samples) == 2 and result.num_rejected == 0
    # Not asked of sglang-jax here: /update_weights_from_disk (it has none: above) and
    # /health_generate (its no-logprob request in a log-prob batch kills its scheduler).
  finally:
    client.close()


def _write_tokenizer(path: str, vocab_size: int) -> None:
  """A word-level tokenizer over the tiny vocabulary (ids 0/1/2 pad/bos/eos): sglang-jax returns
  routed experts only through its detokenizer (with `--skip-tokenizer-init` the reply cannot
  be encoded: HTTP 500)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
  core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                          unk_token="<pad>").save_pretrained(path)


def test_routing_replay_r3_against_sglang_jax(tmp_path):
  """A tiny Qwen3-MoE served by sglang-jax with --enable-return-routed-experts: its routed
  experts (SGLang's wire format, computed by another implementation) are replayed by the
  trainer; with float32 on both sides step 1 has no routing mismatch and k3 0."""
  config = dataclasses.replace(PRESETS["tiny-qwen3-moe"], head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                               initializer_range=0.1)
  path = str(tmp_path / "moe")
  init_checkpoint(path, config=config, seed=0)
  _write_tokenizer(path, config.vocab_size)
  flags = [f for f in FLAGS if f != "--skip-tokenizer-init"]
  with sglang_jax_server(path, "--enable-return-routed-experts", flags=flags) as url:
    cfg = make_cfg(tmp_path, "r3", model={"path": path},
                   rollout={"server_dtype": "float32", "max_new_tokens": 4, "sync_every": 3, "routing_replay": "r3"},
                   train={"steps": 1, "row_len": 16, "ppo_epochs": 1}, checkpoint={"every": 3})
    loss = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))
    with pytest.warns(UserWarning, match="carry no usable weight_version"):
      (h,) = train_lib.Trainer(cfg, loss, urls=[url]).run(progress=False)
  assert h["routing_positions"] > 0 and h["routing_mismatch_frac"] == 0
  assert h["mis_k3_kl"] < 1e-8 and h["train_rollout_logprob_abs_diff"] < 1e-4
