"""`mis-jax serve` over real HTTP: one server subprocess per module on a free 127.0.0.1 port
(`--port 0`, read back from its first line), driven like an SGLang server (SPEC §11): response
shapes, seeds, log-probs against the model's own teacher-forced log-probs, weight updates,
pause/continue/abort, and every bad request."""

import dataclasses
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest

from trainers import cli
from trainers.models import PRESETS, init_checkpoint, load_hf_checkpoint
from trainers.sampler import SamplingParams
from trainers.server import EmbeddedServer, parse_sampling_params

from conftest import TINY, sequence_logprobs

PROMPT = [1, 5, 9, 14, 3]
BF16_ATOL = 0.1  # bf16 engine vs float32 teacher forcing (per token; the mean is far smaller)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
  with EmbeddedServer(tiny_checkpoint, dtype="bfloat16", seed=0, max_batch_size=8, timeout=120) as srv:
    assert srv.url.startswith("http://127.0.0.1:")
    with httpx.Client(base_url=srv.url, timeout=120) as client:
      yield client
    assert srv.process.poll() is None  # no request crashed it
  assert srv.process.returncode is not None


@pytest.fixture(scope="module")
def f32_model(tiny_checkpoint):
  return load_hf_checkpoint(tiny_checkpoint)


def _generate(client, input_ids, **sampling):
  body = {"input_ids": input_ids, "return_logprob": True,
          "sampling_params": {"max_new_tokens": 8, "no_stop_trim": True,
                              "skip_special_tokens": False, **sampling}}
  r = client.post("/generate", json=body)
  assert r.status_code == 200, r.text
  return r.json()


def test_single_prompt_response_shape(server):
  out = _generate(server, PROMPT, temperature=0.7, top_p=1.0, top_k=-1, sampling_seed=1, ignore_eos=True)
  assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
  meta = out["meta_info"]
  assert set(meta) == {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                       "output_token_logprobs", "weight_version", "e2e_latency"}
  assert out["text"] == "" and len(out["output_ids"]) == 8
  assert meta["finish_reason"] == {"type": "length", "length": 8}
  assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 8, 0)
  assert meta["weight_version"] == "default" and isinstance(meta["id"], str)
  assert isinstance(meta["e2e_latency"], float)
  lps = meta["output_token_logprobs"]
  assert [t for _, t, _ in lps] == out["output_ids"]
  assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in lps)


def test_batch_and_n_are_prompt_major_lists(server):
  prompts = [PROMPT, [1, 2]]
  out = _generate(server, prompts, n=2, sampling_seed=3, ignore_eos=True)
  assert isinstance(out, list) and len(out) == 4
  assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 5, 2, 2]
  assert out[0]["output_ids"] != out[1]["output_ids"]
  single_n = _generate(server, PROMPT, n=4, sampling_seed=3, ignore_eos=True)
  assert isinstance(single_n, list) and len(single_n) == 4
  assert single_n[:2] == [{**o, "meta_info": {**o["meta_info"], "id": n["meta_info"]["id"],
                                              "e2e_latency": n["meta_info"]["e2e_latency"]}}
                          for o, n in zip(out[:2], single_n[:2])]  # prompt 0's samples, same seed
  batch_of_one = _generate(server, [PROMPT], sampling_seed=3)
  assert isinstance(batch_of_one, list) and len(batch_of_one) == 1


def test_return_logprob_false_and_defaults(server):
  r = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
  meta = r.json()["meta_info"]
  assert r.status_code == 200 and "output_token_logprobs" not in meta
  assert parse_sampling_params({}) == SamplingParams(max_new_tokens=128)  # SGLang's defaults
  assert parse_sampling_params({"temperature": 0, "top_k": -1, "stop": [], "n": 2}).n == 2


def test_seed_determinism(server):
  a, b = (_generate(server, PROMPT, temperature=1.0, sampling_seed=42) for _ in range(2))
  c = _generate(server, PROMPT, temperature=1.0, sampling_seed=43)
  top = server.post("/generate", json={"input_ids": PROMPT, "seed": 42, "sampling_params": {
      "max_new_tokens": 8, "temperature": 1.0}}).json()
  assert a["output_ids"] == b["output_ids"] == top["output_ids"] != c["output_ids"]
  assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_logprobs_are_the_models_teacher_forced_logprobs(server, f32_model):
  for sampling in (dict(temperature=0.7, top_p=0.8, sampling_seed=5),
                   dict(temperature=0.0), dict(temperature=1.3, top_k=5, sampling_seed=6)):
    out = _generate(server, PROMPT, ignore_eos=True, **sampling)
    got = np.array([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = sequence_logprobs(f32_model, PROMPT, out["output_ids"],
                             temperature=sampling["temperature"] or 1.0)
    np.testing.assert_allclose(got, want, atol=BF16_ATOL, rtol=0)
    # bf16 vs f32 differ by ~0.02-0.04 per token on average for these random weights.
    assert np.abs(got - want).mean() < 0.05


def test_stop_token_ids(server):
  ref = _generate(server, PROMPT, temperature=0, ignore_eos=True, max_new_tokens=16)["output_ids"]
  stop = ref[2]
  out = _generate(server, PROMPT, temperature=0, ignore_eos=True, max_new_tokens=16, stop_token_ids=[stop])
  assert out["output_ids"] == ref[:ref.index(stop) + 1]
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


BAD_REQUESTS = {
    "unknown sampling key": ({"input_ids": PROMPT, "sampling_params": {"temprature": 1.0}}, "temprature"),
    "missing input_ids": ({"sampling_params": {}}, "input_ids"),
    "empty input_ids": ({"input_ids": []}, "input_ids"),
    "empty prompt in batch": ({"input_ids": [PROMPT, []]}, "input_ids[1]"),
    "out-of-vocab id": ({"input_ids": [1, 64]}, "64"),
    "negative id": ({"input_ids": [-1]}, "-1"),
    "non-int id": ({"input_ids": [1.5]}, "input_ids"),
    "max_new_tokens over context": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 510}},
                                    "context length"),
    "stop strings": ({"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}}, "stop"),
    "repetition_penalty": ({"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.2}},
                           "repetition_penalty"),
    "top_k 0": ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
    "negative temperature": ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
    "text without tokenizer": ({"text": "hello"}, "tokenizer"),
    "text and input_ids": ({"text": "hello", "input_ids": PROMPT}, "not both"),
    "stream": ({"input_ids": PROMPT, "stream": True}, "stream"),
    "ignore_eos not a bool": ({"input_ids": PROMPT, "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    "stop_token_ids not ints": ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": ["2"]}},
                                "stop_token_ids"),
    "unknown top-level field": ({"input_ids": PROMPT, "return_logprobs": True}, "return_logprobs"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_generate_requests_get_400(server, name):
  body, fragment = BAD_REQUESTS[name]
  r = server.post("/generate", json=body)
  assert r.status_code == 400, r.text
  assert fragment in r.json()["error"]["message"]


def test_malformed_json_and_unknown_route(server):
  r = server.post("/generate", content=b"{not json", headers={"Content-Type": "application/json"})
  assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
  assert server.get("/no_such_route").status_code == 404
  assert server.get("/health").status_code == 200  # still serving


def test_info_and_housekeeping_routes(server, tiny_checkpoint):
  info = server.get("/model_info").json()
  assert info["is_generation"] is True and info["model_path"] == os.path.abspath(tiny_checkpoint)
  assert {"tokenizer_path", "weight_version"} <= set(info)
  assert server.get("/get_model_info").json() == info
  assert server.get("/server_info").json()["dtype"] == "bfloat16"
  assert server.get("/flush_cache").status_code == server.post("/flush_cache").status_code == 200
  assert server.get("/health_generate").status_code == 200


def _in_thread(fn):
  result = {}
  t = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
  t.start()
  return t, result


def test_pause_waits_and_abort_ends_waiting_requests(server):
  body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 0}}
  assert server.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
  try:
    t, result = _in_thread(lambda: server.post("/generate", json={**body, "rid": "waiting"}))
    time.sleep(0.5)
    assert t.is_alive()  # held while paused
    dup = server.post("/generate", json={**body, "rid": "waiting"})
    assert dup.status_code == 400 and "Duplicate" in dup.json()["error"]["message"]
    assert server.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    t.join(30)
    out = result["value"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    t, result = _in_thread(lambda: server.post("/generate", json={**body, "rid": "by-rid"}))
    time.sleep(0.3)
    assert t.is_alive()  # abort mode also leaves the server paused
    assert server.post("/abort_request", json={"rid": "by-rid"}).status_code == 200
    t.join(30)
    assert result["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    t, result = _in_thread(lambda: server.post("/generate", json=body))
  finally:
    assert server.post("/continue_generation", json={}).status_code == 200
  t.join(60)
  assert result["value"].json()["meta_info"]["finish_reason"]["type"] == "length"
  assert server.post("/pause_generation", json={"mode": "sideways"}).status_code == 400


def test_update_weights_from_disk(server, tmp_path, f32_model):
  greedy = dict(temperature=0, ignore_eos=True)
  before = _generate(server, PROMPT, **greedy)
  # Failures: bad path, mismatched shapes, wrong architecture. Nothing is lost.
  init_checkpoint(tmp_path / "vocab80", config=dataclasses.replace(TINY, vocab_size=80))
  init_checkpoint(tmp_path / "qwen2", preset="tiny-qwen2")
  for path, fragment in ((tmp_path / "missing", "No such file"), (tmp_path / "vocab80", "vocab_size"),
                         (tmp_path / "qwen2", "model_type")):
    r = server.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False and fragment in r.json()["message"]
  (tmp_path / "shapes").mkdir()
  init_checkpoint(tmp_path / "shapes", config=TINY)
  (tmp_path / "shapes" / "config.json").write_text(
      json.dumps({**TINY.to_hf_dict(), "intermediate_size": 96}))
  r = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "shapes")})
  assert r.json()["success"] is False
  r = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "bogus": 1})
  assert r.status_code == 400 and "bogus" in r.json()["message"]
  assert server.get("/model_info").json()["weight_version"] == "default"
  kept = _generate(server, PROMPT, **greedy)
  assert kept["output_ids"] == before["output_ids"]
  assert kept["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

  # Success, as the trainer does it: pause(abort), flush, update, confirm, continue.
  new_dir = tmp_path / "step7"
  init_checkpoint(new_dir, config=TINY, seed=7, dtype="bfloat16")
  assert server.post("/pause_generation", json={"mode": "abort"}).status_code == 200
  assert server.post("/flush_cache").status_code == 200
  r = server.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "7"})
  assert r.status_code == 200, r.text
  assert r.json() == {"success": True, "message": r.json()["message"], "num_paused_requests": 0}
  assert server.get("/model_info").json()["weight_version"] == "7"
  assert server.post("/continue_generation", json={}).status_code == 200
  after = _generate(server, PROMPT, **greedy)
  assert after["meta_info"]["weight_version"] == "7" and after["output_ids"] != before["output_ids"]
  new_model = load_hf_checkpoint(new_dir)
  got = np.array([lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]])
  np.testing.assert_allclose(got, sequence_logprobs(new_model, PROMPT, after["output_ids"]),
                             atol=BF16_ATOL, rtol=0)


def test_cli_init_model_and_train_dispatch(tmp_path, capsys):
  assert cli.main(["init-model", "--preset", "tiny-qwen2", "--out", str(tmp_path / "m"),
                   "--initializer-range", "0.5"]) == 0
  config = json.loads((tmp_path / "m" / "config.json").read_text())
  assert (config["model_type"], config["initializer_range"]) == ("qwen2", 0.5)
  assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
  # `train` is dispatched to the trainer; a missing config is a clean exit 2 naming it.
  assert cli.main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
  assert "trainer config not found" in capsys.readouterr().err
  assert set(PRESETS) >= {"tiny-qwen2", "tiny-qwen3"}


def test_embedded_server_reports_a_failed_start(tmp_path):
  with pytest.raises(RuntimeError, match=r"exited with 2:\nmis-jax serve: --model-path .*no-checkpoint'?: no such directory"):
    EmbeddedServer(str(tmp_path / "no-checkpoint"), timeout=60)
