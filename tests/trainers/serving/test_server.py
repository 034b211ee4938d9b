"""`mis-jax serve` over real HTTP: one server subprocess per module on a free 127.0.0.1 port
(`--port 0`, read back from its first line), driven like an SGLang 0.5.23 server (contract §11):
response shapes and key order, seeds, output and prompt log-probs against the model's own
teacher-forced log-probs, weight updates, pause/continue/abort, every bad request with SGLang's
status and body shape, and the JSON of requests and responses checked against SGLang's own
contract (`api_types.py` from the sglang wheel, see `sglang_contract`)."""

import dataclasses
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest

from trainers import cli
from trainers.serving import protocol
from trainers.serving.embedded import sampler as sampler_mod
from trainers.models import PRESETS, init_checkpoint, load_hf_checkpoint
from trainers.rollout.samples import sample_seeds
from trainers.serving.embedded.server import EmbeddedServer

from conftest import TINY, sequence_logprobs
from sglang_contract import load_api_types

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

PROMPT = [1, 5, 9, 14, 3]
# bf16 engine vs float32 teacher forcing, per token: over 1,024 sampled tokens of this model the
# difference averages 0.022, its 99th percentile 0.09 and its largest 0.14 (layers scanned or
# unrolled alike); the mean is checked far tighter below.
BF16_ATOL = 0.2
META_KEYS = [
  "id",
  "finish_reason",
  "prompt_tokens",
  "weight_version",
  "num_retractions",
  "reasoning_tokens",
  "completion_tokens",
  "cached_tokens",
  "weight_versions",
  "e2e_latency",
  "response_sent_to_client_ts",
]  # SGLang 0.5.23's order
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]


@pytest.fixture(scope="module")
def api_types():
  return load_api_types()


@pytest.fixture(scope="module")
def embedded(tiny_checkpoint):
  with EmbeddedServer(tiny_checkpoint, dtype="bfloat16", seed=0, max_batch_size=8, timeout=120) as srv:
    assert srv.url.startswith("http://127.0.0.1:")
    yield srv
    assert srv.process.poll() is None  # no request crashed it
  assert srv.process.returncode == 0  # SIGTERM: a clean (graceful) shutdown


@pytest.fixture(scope="module")
def server(embedded):
  with httpx.Client(base_url=embedded.url, timeout=120) as client:
    yield client


@pytest.fixture(scope="module")
def f32_model(tiny_checkpoint):
  return load_hf_checkpoint(tiny_checkpoint)


def _post(client, body, status=200):
  r = client.post("/generate", json=body)
  assert r.status_code == status, r.text
  return r.json()


def _generate(client, input_ids, **sampling):
  return _post(
    client,
    {
      "input_ids": input_ids,
      "return_logprob": True,
      "sampling_params": {"max_new_tokens": 8, "no_stop_trim": True, "skip_special_tokens": False, **sampling},
    },
  )


def test_single_prompt_response_shape(server, api_types):
  out = _generate(server, PROMPT, temperature=0.7, top_p=1.0, top_k=-1, sampling_seed=1, ignore_eos=True)
  assert list(out) == ["text", "output_ids", "meta_info"]
  meta = out["meta_info"]
  assert list(meta) == META_KEYS[:5] + LOGPROB_KEYS + META_KEYS[5:]
  assert out["text"] == "" and len(out["output_ids"]) == 8
  assert meta["finish_reason"] == {"type": "length", "length": 8}
  assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 8, 0)
  assert meta["weight_version"] == "default" and isinstance(meta["id"], str)
  assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
  assert isinstance(meta["e2e_latency"], float) and meta["input_token_logprobs"] == []
  assert abs(meta["response_sent_to_client_ts"] - time.time()) < 60
  lps = meta["output_token_logprobs"]
  assert [t for _, t, _ in lps] == out["output_ids"] and meta["output_token_logprobs_length"] == 8
  assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in lps)
  decoded = api_types.GenerateResponse.from_json_value(out)  # SGLang's own decoder accepts it
  assert decoded.meta_info.completion_tokens == 8 and decoded.output_ids == out["output_ids"]
  assert isinstance(decoded.meta_info.finish_reason, api_types.FinishLength)


def test_return_logprob_false_and_null_defaults(server):
  out = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
  assert list(out["meta_info"]) == META_KEYS
  # `null` means SGLang's default for every sampling value (temperature 1, top_k all, n 1, ...).
  nulls = {
    k: None
    for k in (
      "temperature",
      "top_p",
      "top_k",
      "min_p",
      "n",
      "ignore_eos",
      "frequency_penalty",
      "presence_penalty",
      "repetition_penalty",
      "min_new_tokens",
      "stop",
      "stop_token_ids",
      "logit_bias",
      "no_stop_trim",
    )
  }
  a = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 9, **nulls}})
  b = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 9}})
  assert a["output_ids"] == b["output_ids"] and isinstance(a, dict)
  assert _post(
    server,
    {
      "input_ids": PROMPT,
      "sampling_params": None,
      "return_logprob": None,
      "rid": None,
      "stream": None,
      "logprob_start_len": None,
    },
  )["meta_info"]


def test_unknown_top_level_keys_are_ignored_like_sglang(server):
  """miles always sends return_routed_experts / return_indexer_topk; SGLang ignores unknown keys."""
  body = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 4, "sampling_seed": 2},
    "return_routed_experts": False,
    "return_indexer_topk": False,
    "no_such_key": {"x": 1},
    "seed": 12345,
  }  # not a key of SGLang 0.5.23: ignored, so it does not seed anything
  with_extra, plain = _post(server, body), _post(server, {k: body[k] for k in ("input_ids", "sampling_params")})
  assert with_extra["output_ids"] == plain["output_ids"]


def test_batch_n_and_seeds_as_sglang(server):
  """SGLang copies a request's sampling params (its seed included) to each of its n samples:
  one seed for a group gives n identical samples; distinct samples need one seed each."""
  out = _generate(server, [PROMPT, [1, 2]], n=2, sampling_seed=3, ignore_eos=True)
  assert isinstance(out, list) and len(out) == 4
  assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 5, 2, 2]
  assert out[0]["output_ids"] == out[1]["output_ids"] and out[2]["output_ids"] == out[3]["output_ids"]
  ids = [o["meta_info"]["id"] for o in out]
  assert len(set(ids)) == 4 and all(len(i) == 32 for i in ids)  # fresh ids per parallel sample
  unseeded = _generate(server, [PROMPT], n=2, ignore_eos=True)
  assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]
  # What the trainer's client sends: each sample its own entry and seed.
  body = protocol.generate_body(
    [PROMPT, [1, 2]], {"max_new_tokens": 8, "ignore_eos": True}, n=2, seeds=sample_seeds(7, 2, 2)
  )
  per_sample = _post(server, body)
  assert per_sample[0]["output_ids"] != per_sample[1]["output_ids"]
  assert [o["output_ids"] for o in _post(server, body)] == [o["output_ids"] for o in per_sample]
  assert isinstance(_generate(server, [PROMPT], sampling_seed=3), list)  # a batch of one is a list


def test_rid_normalisation(server):
  out = _post(server, {"input_ids": [PROMPT, [1, 2]], "rid": "grp", "sampling_params": {"max_new_tokens": 2}})
  assert [o["meta_info"]["id"] for o in out] == ["grp_0", "grp_1"]  # a string rid is a prefix
  out = _post(server, {"input_ids": [PROMPT, [1, 2]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
  assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
  assert (
    _post(server, {"input_ids": PROMPT, "rid": "one", "sampling_params": {"max_new_tokens": 2}})["meta_info"]["id"]
    == "one"
  )


def test_seed_determinism(server):
  a, b = (_generate(server, PROMPT, temperature=1.0, sampling_seed=42) for _ in range(2))
  c = _generate(server, PROMPT, temperature=1.0, sampling_seed=43)
  assert a["output_ids"] == b["output_ids"] != c["output_ids"]
  assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_logprobs_are_the_models_teacher_forced_logprobs(server, f32_model):
  for sampling in (
    dict(temperature=0.7, top_p=0.8, sampling_seed=5),
    dict(temperature=0.0),
    dict(temperature=1.3, top_k=5, sampling_seed=6),
  ):
    out = _generate(server, PROMPT, ignore_eos=True, **sampling)
    got = np.array([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = sequence_logprobs(f32_model, PROMPT, out["output_ids"], temperature=sampling["temperature"] or 1.0)
    np.testing.assert_allclose(got, want, atol=BF16_ATOL, rtol=0)
    # bf16 vs f32 differ by ~0.02-0.04 per token on average for these random weights.
    assert np.abs(got - want).mean() < 0.05


def test_prompt_logprobs_with_logprob_start_len(server, f32_model):
  """input_token_logprobs: one entry per prompt token from logprob_start_len, the first null,
  the others the teacher-forced log-prob of that token (miles' prefill scoring)."""
  seq = PROMPT + [7, 22, 40]
  want = sequence_logprobs(f32_model, seq[:1], seq[1:], temperature=1.0)  # tokens 1.. of seq
  for start in (0, 3):
    out = _post(
      server,
      {
        "input_ids": seq,
        "return_logprob": True,
        "logprob_start_len": start,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
      },
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == seq[start:] and entries[0][0] is None
    np.testing.assert_allclose([lp for lp, _, _ in entries[1:]], want[start:], atol=BF16_ATOL, rtol=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
  at_end = _post(
    server,
    {"input_ids": seq, "return_logprob": True, "logprob_start_len": len(seq), "sampling_params": {"max_new_tokens": 1}},
  )
  assert at_end["meta_info"]["input_token_logprobs"] == []
  past = _post(server, {"input_ids": seq, "return_logprob": True, "logprob_start_len": len(seq) + 1}, 400)
  assert "is higher than the number of input tokens" in past["error"]["message"]
  # Without return_logprob, logprob_start_len is ignored (as SGLang).
  assert (
    "input_token_logprobs"
    not in _post(server, {"input_ids": seq, "logprob_start_len": 99, "sampling_params": {"max_new_tokens": 1}})[
      "meta_info"
    ]
  )


def test_stop_token_ids_and_ignore_eos(server):
  ref = _generate(server, PROMPT, temperature=0, ignore_eos=True, max_new_tokens=16)["output_ids"]
  stop = ref[2]
  out = _generate(server, PROMPT, temperature=0, max_new_tokens=16, stop_token_ids=[stop])
  cut = min(ref.index(t) for t in (stop, 2) if t in ref) + 1  # 2: the config's eos
  assert out["output_ids"] == ref[:cut]
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[cut - 1]}
  # ignore_eos: no token stops the sample, stop_token_ids included (SGLang's check_finished).
  ignored = _generate(server, PROMPT, temperature=0, ignore_eos=True, max_new_tokens=16, stop_token_ids=[stop])
  assert ignored["output_ids"] == ref and ignored["meta_info"]["finish_reason"]["type"] == "length"


CONTRACT_ERRORS = {  # 400 {"error": "<message>"}: SGLang's contract check
  "unknown sampling key": {"input_ids": PROMPT, "sampling_params": {"temprature": 1.0}},
  "non-int id": {"input_ids": [1.5]},
  "bool id": {"input_ids": [1, True]},
  "ignore_eos not a bool": {"input_ids": PROMPT, "sampling_params": {"ignore_eos": "yes"}},
  "stop_token_ids not ints": {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": ["2"]}},
  "top_k a float": {"input_ids": PROMPT, "sampling_params": {"top_k": 1.0}},
  "return_logprob a string": {"input_ids": PROMPT, "return_logprob": "true"},
  "rid a number": {"input_ids": PROMPT, "rid": 7},
  "sampling_params a string": {"input_ids": PROMPT, "sampling_params": "greedy"},
  "priority a string": {"input_ids": PROMPT, "priority": "high"},
  "extra_key a number": {"input_ids": PROMPT, "extra_key": 3},
  "cache_salt a list of numbers": {"input_ids": [PROMPT], "cache_salt": [3]},
  "negative max_thinking_tokens": {"input_ids": PROMPT, "max_thinking_tokens": -1},
  "return_prompt_token_ids null": {"input_ids": PROMPT, "return_prompt_token_ids": None},
}
REQUEST_ERRORS = {  # 400 {"error": {"message": "<message>"}}: after decoding
  "missing input_ids": ({"sampling_params": {}}, "Either text, input_ids or input_embeds"),
  "empty input_ids": ({"input_ids": []}, "input_ids cannot be empty"),
  "empty prompt in batch": ({"input_ids": [PROMPT, []]}, "input_ids[1] cannot be empty"),
  "out-of-vocab id": ({"input_ids": [1, 64]}, "out-of-vocabulary token id 64"),
  "negative id": ({"input_ids": [-1]}, "out-of-vocabulary token id -1"),
  "max_new_tokens over context": (
    {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 510}},
    "exceeds the model's maximum context length of 512",
  ),
  "prompt over context": ({"input_ids": [1] * 512}, "longer than the model's context length"),
  "stop strings": ({"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}}, "stop"),
  "repetition_penalty": ({"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
  "top_k 0": ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k must be -1"),
  "negative temperature": ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
  "text without tokenizer": ({"text": "hello"}, "tokenizer"),
  "stream": ({"input_ids": PROMPT, "stream": True}, "stream"),
  "n differs in a batch": (
    {"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 1}, {"n": 2}]},
    "parallel_sample_num should be the same",
  ),
  "rid list too short": ({"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, "rids length mismatch"),
  "duplicate rid": ({"input_ids": [PROMPT, PROMPT], "rid": ["a", "a"]}, "Duplicate request IDs"),
  "extra_key list too short": (
    {"input_ids": [PROMPT, PROMPT], "extra_key": ["v1"]},
    "extra_key has 1 entries for a batch of 2 prompts",
  ),
  "cache_salt list too long": (
    {"input_ids": PROMPT, "cache_salt": ["a", "b"]},
    "cache_salt has 2 entries for a batch of 1 prompts",
  ),
  "list logprob flags with n": (
    {"input_ids": [PROMPT], "return_logprob": [True], "sampling_params": {"n": 2}},
    "Cannot use list return_logprob",
  ),
  "sampling mask without top_k": (
    {"input_ids": PROMPT, "return_sampling_mask": True, "sampling_params": {"top_p": 0.9}},
    "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got top_k=1073741824",
  ),
  "sampling mask top_k over the cap": (
    {"input_ids": PROMPT, "return_sampling_mask": True, "sampling_params": {"top_k": 4097}},
    "got top_k=4097",
  ),
  "sampling_logprobs_mode without mask": (
    {"input_ids": PROMPT, "sampling_logprobs_mode": "support"},
    "sampling_logprobs_mode can only be set when return_sampling_mask",
  ),
  "unknown sampling_logprobs_mode": (
    {
      "input_ids": PROMPT,
      "return_sampling_mask": True,
      "sampling_logprobs_mode": "all",
      "sampling_params": {"top_k": 5},
    },
    "sampling_logprobs_mode must be one of selected, support",
  ),
}


@pytest.mark.parametrize("name", sorted(CONTRACT_ERRORS))
def test_contract_violations_get_sglangs_400(server, api_types, name):
  body = CONTRACT_ERRORS[name]
  with pytest.raises(api_types.JsonContractError):  # SGLang's own decoder rejects it too
    api_types.GenerateRequest.from_json_value(body)
  out = _post(server, body, 400)
  assert set(out) == {"error"} and isinstance(out["error"], str) and out["error"]


@pytest.mark.parametrize("name", sorted(REQUEST_ERRORS))
def test_bad_requests_get_sglangs_400(server, api_types, name):
  body, fragment = REQUEST_ERRORS[name]
  api_types.GenerateRequest.from_json_value(body)  # valid JSON contract: rejected later
  out = _post(server, body, 400)
  assert set(out) == {"error"} and fragment in out["error"]["message"], out


def test_a_prefix_cache_key_is_accepted_and_changes_nothing_here(server):
  """SGLang's extra_key / cache_salt (the trainer's cache salt): no prefix cache here, so the
  same tokens and log-probs with or without one."""
  body = {
    "input_ids": [PROMPT, PROMPT[:3]],
    "return_logprob": True,
    "sampling_params": {"temperature": 0, "max_new_tokens": 5},
  }
  plain = _post(server, body)
  for key in ({"extra_key": "mis-jax:1:w3"}, {"extra_key": ["a", "b"]}, {"cache_salt": "s"}):
    salted = _post(server, {**body, **key})
    assert [x["output_ids"] for x in salted] == [x["output_ids"] for x in plain]
    assert [x["meta_info"]["output_token_logprobs"] for x in salted] == [
      x["meta_info"]["output_token_logprobs"] for x in plain
    ]


def test_malformed_bodies_and_unknown_routes(server):
  for raw in (b"{not json", b"[1, 2]", b""):
    r = server.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400, r.text
  r = server.get("/no_such_route")
  assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
  assert server.get("/generate").status_code == 405
  assert server.get("/health").status_code == 200  # still serving


def test_info_and_housekeeping_routes(server, tiny_checkpoint, api_types):
  info = server.get("/model_info").json()
  assert info["is_generation"] is True and info["model_path"] == os.path.abspath(tiny_checkpoint)
  assert {"served_model_name", "tokenizer_path", "weight_version", "load_format", "model_type", "architectures"} <= set(
    info
  )
  api_types.GetModelInfoResponse.from_json_value(info)
  assert server.get("/get_model_info").json() == info
  sinfo = server.get("/server_info").json()
  decoded = api_types.GetServerInfoResponse.from_json_value(sinfo)
  assert decoded.version == protocol.PROTOCOL_VERSION == "0.5.23" and decoded.max_context_length == 512
  assert (sinfo["dtype"], sinfo["tp_size"], sinfo["dp_size"]) == ("bfloat16", 1, 1)
  assert server.get("/get_server_info").json()["port"] == sinfo["port"]
  assert server.get("/flush_cache").status_code == server.post("/flush_cache").status_code == 200
  assert server.get("/health_generate").status_code == 200


def _in_thread(fn):
  result = {}
  t = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
  t.start()
  return t, result


def test_concurrent_requests_are_served_while_a_batch_runs(server):
  long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 1}}
  t, result = _in_thread(lambda: server.post("/generate", json=long))
  time.sleep(0.3)
  start = time.perf_counter()
  assert server.get("/health").status_code == 200 and server.get("/model_info").status_code == 200
  answered = time.perf_counter() - start
  busy = t.is_alive()
  t.join(120)
  assert result["value"].status_code == 200 and len(result["value"].json()["output_ids"]) == 400
  assert busy and answered < 2.0  # answered during the batch, not after it
  # Concurrent generate requests share batches and each gets its own answer.
  outs = [None] * 4
  threads = [
    threading.Thread(
      target=lambda i=i: outs.__setitem__(
        i, _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "sampling_seed": i}})
      )
    )
    for i in range(4)
  ]
  [th.start() for th in threads]
  [th.join(120) for th in threads]
  solo = [
    _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "sampling_seed": i}}) for i in range(4)
  ]
  assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in solo]


def test_pause_holds_new_requests_out_of_reach_of_aborts(server):
  """As SGLang: a request that arrives while paused is registered (its id is taken) and held
  before the scheduler, so neither pause(abort) nor abort_request touches it; it runs after
  continue_generation."""
  body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 0}}
  assert server.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
  try:
    t, result = _in_thread(lambda: server.post("/generate", json={**body, "rid": "held"}))
    time.sleep(0.5)
    assert t.is_alive()  # held while paused
    dup = server.post("/generate", json={**body, "rid": "held"})
    assert dup.status_code == 400 and dup.json() == {"error": {"message": "Duplicate request ID detected: held"}}
    assert server.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    r = server.post("/abort_request", json={"rid": "held"})
    assert r.status_code == 200 and r.content == b""
    time.sleep(0.3)
    assert t.is_alive()
    assert server.get("/server_info").json()["internal_states"][0]["num_paused_reqs"] == 1
  finally:
    assert server.post("/continue_generation", json={}).status_code == 200
  t.join(60)
  assert result["value"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
  bad = server.post("/pause_generation", json={"mode": "sideways"})
  assert bad.status_code == 400 and bad.json()["object"] == "error"


def test_abort_in_the_waiting_queue_and_pause_abort_waits_for_the_batch(server, api_types):
  """A request queued behind a running batch is aborted in the waiting queue (SGLang's
  two-key form, no tokens); pause(abort) aborts the running batch and answers once it ended."""
  running = {
    "input_ids": PROMPT,
    "rid": "long",
    "sampling_params": {"max_new_tokens": 505, "ignore_eos": True, "sampling_seed": 8},
  }
  queued = {
    "input_ids": [PROMPT, [1, 2]],
    "rid": "grp",
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 4},
  }
  t_long, long_result = _in_thread(lambda: server.post("/generate", json=running))
  assert _wait_running(server)
  t_q, q_result = _in_thread(lambda: server.post("/generate", json=queued))
  deadline = time.monotonic() + 30
  while server.get("/server_info").json()["internal_states"][0]["num_waiting_reqs"] < 2:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  assert server.post("/abort_request", json={"rid": "grp"}).status_code == 200  # prefix: grp_0, grp_1
  t_q.join(30)
  outs = q_result["value"].json()
  assert [o["meta_info"]["id"] for o in outs] == ["grp_0", "grp_1"]
  for out in outs:
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0 and "prompt_tokens" not in meta
    assert list(meta) == [
      "id",
      "finish_reason",
      "weight_version",
      "e2e_latency",
      "weight_versions",
      *LOGPROB_KEYS,
      "completion_tokens",
      "response_sent_to_client_ts",
    ]
    assert isinstance(api_types.GenerateResponse.from_json_value(out).meta_info.finish_reason, api_types.FinishAbort)
  try:
    paused = server.post("/pause_generation", json={"mode": "abort"})
    answered = time.time()
    assert paused.status_code == 200
  finally:
    server.post("/continue_generation", json={})
  t_long.join(120)
  long_meta = long_result["value"].json()["meta_info"]
  assert long_meta["finish_reason"]["type"] == "abort"
  assert long_meta["response_sent_to_client_ts"] <= answered  # the batch ended before pause answered


def _wait_running(server, timeout=60.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if server.get("/server_info").json()["internal_states"][0]["num_running_reqs"]:
      return True
    time.sleep(0.01)
  return False


def test_abort_of_a_running_request_keeps_its_tokens(server):
  body = {
    "input_ids": PROMPT,
    "rid": "running",
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 505, "ignore_eos": True, "sampling_seed": 4},
  }
  for _ in range(3):  # a fast machine may finish the batch before the abort lands: try again
    t, result = _in_thread(lambda: server.post("/generate", json=body))
    assert _wait_running(server)
    assert server.post("/abort_request", json={"rid": "running"}).status_code == 200
    t.join(120)
    out = result["value"].json()
    if out["meta_info"]["finish_reason"]["type"] == "abort":
      break
  assert out["meta_info"]["finish_reason"] == {
    "type": "abort",
    "message": "Aborted",
    "status_code": None,
    "err_type": None,
  }
  assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] > 0  # tokens kept
  assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
  assert "prompt_tokens" in out["meta_info"]


def test_pause_in_place_lets_an_update_land_mid_response(server, tmp_path):
  """SGLang's `in_place` pause: the running request stops at its next decoding segment with its
  KV cache, the weight update lands, and after continue_generation it finishes on the new weights;
  its weight_versions spans say where the switch fell. Its tokens before the switch are the old
  weights' (the same seed without an update), those after are not."""
  info = server.get("/model_info").json()
  version, path = info["weight_version"], info["model_path"]
  body = {
    "input_ids": PROMPT,
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 11},
  }
  reference = _post(server, body)  # the old weights throughout
  new_dir = tmp_path / "in_place"
  init_checkpoint(new_dir, config=TINY, seed=5, dtype="bfloat16")
  try:
    for _ in range(3):  # a fast machine may finish the request before the pause lands: try again
      t, result = _in_thread(lambda: server.post("/generate", json=body))
      assert _wait_running(server)
      assert server.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
      r = server.post("/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "in-place"})
      assert r.status_code == 200 and r.json()["success"], r.text
      assert server.post("/continue_generation", json={}).status_code == 200
      t.join(120)
      out = result["value"].json()
      spans = out["meta_info"]["weight_versions"]
      if len(spans) == 2:
        break
      assert server.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version}).json()[
        "success"
      ]
    (first, second) = spans
    k = first["end"]
    assert first == {"version": version, "start": 0, "end": k} and second == {
      "version": "in-place",
      "start": k,
      "end": 300,
    }
    assert 0 < k < 300 and k % sampler_mod.SEGMENT_STEPS == 0, spans
    assert out["meta_info"]["weight_version"] == "in-place" and len(out["output_ids"]) == 300
    assert out["output_ids"][:k] == reference["output_ids"][:k]
    assert out["meta_info"]["output_token_logprobs"][:k] == reference["meta_info"]["output_token_logprobs"][:k]
    assert out["output_ids"][k:] != reference["output_ids"][k:]
  finally:  # the module's server goes back to its weights
    assert server.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version}).json()[
      "success"
    ]
  again = _post(server, body)
  assert again["output_ids"] == reference["output_ids"] and again["meta_info"]["weight_versions"] == [
    {"version": version, "start": 0, "end": 300}
  ]


def test_update_weights_from_disk(server, tmp_path, f32_model):
  greedy = dict(temperature=0, ignore_eos=True)
  before = _generate(server, PROMPT, **greedy)
  # Failures: bad path, mismatched shapes, wrong architecture. Nothing is lost.
  init_checkpoint(tmp_path / "vocab80", config=dataclasses.replace(TINY, vocab_size=80))
  init_checkpoint(tmp_path / "qwen2", preset="tiny-qwen2")
  for path, fragment in (
    (tmp_path / "missing", "No such file"),
    (tmp_path / "vocab80", "vocab_size"),
    (tmp_path / "qwen2", "model_type"),
  ):
    r = server.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False and fragment in r.json()["message"]
  (tmp_path / "shapes").mkdir()
  init_checkpoint(tmp_path / "shapes", config=TINY)
  (tmp_path / "shapes" / "config.json").write_text(json.dumps({**TINY.to_hf_dict(), "intermediate_size": 96}))
  r = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "shapes")})
  assert r.json()["success"] is False
  # As SGLang's request model: a non-string weight_version or no model_path is a 400 ErrorResponse.
  for body in ({"model_path": str(tmp_path), "weight_version": 7}, {"weight_version": "7"}):
    r = server.post("/update_weights_from_disk", json=body)
    assert r.status_code == 400 and r.json()["object"] == "error", r.text
  assert server.get("/model_info").json()["weight_version"] == "default"
  kept = _generate(server, PROMPT, **greedy)
  assert kept["output_ids"] == before["output_ids"]
  assert kept["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

  # Success, as the trainer does it: pause(abort), flush, update, confirm, continue. SGLang's
  # `manifest` and unknown keys are accepted.
  new_dir = tmp_path / "step7"
  init_checkpoint(new_dir, config=TINY, seed=7, dtype="bfloat16")
  assert server.post("/pause_generation", json={"mode": "abort"}).status_code == 200
  assert server.post("/flush_cache").status_code == 200
  r = server.post(
    "/update_weights_from_disk",
    json={"model_path": str(new_dir), "weight_version": "7", "manifest": {"tensors": []}, "future_key": 1},
  )
  assert r.status_code == 200, r.text
  assert r.json() == {
    "success": True,
    "num_paused_requests": 0,
    "message": "Succeeded to update model weights. Weight version updated to 7.",
  }
  assert server.get("/model_info").json()["weight_version"] == "7"
  assert server.post("/continue_generation", json={}).status_code == 200
  after = _generate(server, PROMPT, **greedy)
  assert after["meta_info"]["weight_version"] == "7" and after["output_ids"] != before["output_ids"]
  new_model = load_hf_checkpoint(new_dir)
  got = np.array([lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]])
  np.testing.assert_allclose(got, sequence_logprobs(new_model, PROMPT, after["output_ids"]), atol=BF16_ATOL, rtol=0)


MILES_SAMPLING = {
  "temperature": 1.0,
  "top_p": 1.0,
  "top_k": -1,
  "max_new_tokens": 6,
  "stop": None,
  "stop_token_ids": None,
  "skip_special_tokens": False,
  "no_stop_trim": True,
  "spaces_between_special_tokens": False,
}


def test_miles_style_payloads(server, api_types):
  """Requests as miles' rollout code sends them: one sample per request with its own seed,
  return_routed_experts / return_indexer_topk always present, then prefill scoring of the
  prompt + response through the server."""
  bodies = [
    {
      "input_ids": PROMPT,
      "sampling_params": {**MILES_SAMPLING, "sampling_seed": 1000 + i},
      "return_logprob": True,
      "return_routed_experts": False,
      "return_indexer_topk": False,
    }
    for i in range(2)
  ]
  for body in bodies:
    api_types.GenerateRequest.from_json_value(body)
  outs = [_post(server, body) for body in bodies]
  assert outs[0]["output_ids"] != outs[1]["output_ids"]
  seq = PROMPT + outs[0]["output_ids"]
  score = _post(
    server,
    {
      "input_ids": seq,
      "sampling_params": {**MILES_SAMPLING, "max_new_tokens": 0},
      "return_logprob": True,
      "logprob_start_len": 0,
      "return_routed_experts": False,
      "return_indexer_topk": False,
    },
  )
  entries = score["meta_info"]["input_token_logprobs"]
  assert len(entries) == len(seq) and entries[0][0] is None
  response_part = [lp for lp, _, _ in entries[len(PROMPT) :]]
  rollout = [lp for lp, _, _ in outs[0]["meta_info"]["output_token_logprobs"]]
  np.testing.assert_allclose(response_part, rollout, atol=BF16_ATOL, rtol=0)  # same weights, same tokens
  served = load_hf_checkpoint(server.get("/model_info").json()["model_path"])  # after any update
  np.testing.assert_allclose(
    response_part, sequence_logprobs(served, PROMPT, outs[0]["output_ids"]), atol=BF16_ATOL, rtol=0
  )


def test_client_requests_follow_sglangs_contract(api_types):
  """Every body the trainer's client builds decodes under SGLang's own contract."""
  for sampling in (
    {
      "temperature": 1.0,
      "top_p": 1.0,
      "top_k": -1,
      "max_new_tokens": 8,
      "stop_token_ids": [2],
      "no_stop_trim": True,
      "skip_special_tokens": False,
    },
    {"temperature": 0.0, "max_new_tokens": 1},
  ):
    for seeds in (None, sample_seeds(3, 2, 2)):
      body = protocol.generate_body([[1, 2], [3]], sampling, n=2, seeds=seeds)
      decoded = api_types.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
      params = decoded.sampling_params if isinstance(decoded.sampling_params, list) else [decoded.sampling_params]
      assert all(p.max_new_tokens == sampling["max_new_tokens"] for p in params)
      if seeds is not None:
        assert [p.sampling_seed for p in params] == seeds and len(set(seeds)) == 4
  with pytest.raises(ValueError, match="temprature"):
    protocol.generate_body([[1]], {"temprature": 1.0})


def test_cli_init_model_and_train_dispatch(tmp_path, capsys):
  assert (
    cli.main(["init-model", "--preset", "tiny-qwen2", "--out", str(tmp_path / "m"), "--initializer-range", "0.5"]) == 0
  )
  config = json.loads((tmp_path / "m" / "config.json").read_text())
  assert (config["model_type"], config["initializer_range"]) == ("qwen2", 0.5)
  assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
  # `train` is dispatched to the trainer; a missing config is a clean exit 2 naming it.
  assert cli.main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
  assert "trainer config not found" in capsys.readouterr().err
  assert set(PRESETS) >= {"tiny-qwen2", "tiny-qwen3"}


def test_embedded_server_reports_a_failed_start(tmp_path):
  with pytest.raises(
    RuntimeError, match=r"exited with 2:\nmis-jax serve: --model-path .*no-checkpoint'?: no such directory"
  ):
    EmbeddedServer(str(tmp_path / "no-checkpoint"), timeout=60)


def test_trainer_client_gets_distinct_reproducible_groups(embedded):
  """The trainer's client against the server: a seeded GRPO group is n distinct samples (one
  seed per sample), the same again for the same seed, prompt-major, with their versions."""
  from trainers.rollout.client import http_client

  client = http_client([embedded.url], prompts_per_request=2)
  try:
    sp = {
      "temperature": 1.0,
      "top_p": 1.0,
      "top_k": -1,
      "max_new_tokens": 6,
      "ignore_eos": True,
      "no_stop_trim": True,
      "skip_special_tokens": False,
    }
    prompts = [PROMPT, [1, 2], [3, 4, 5]]
    a, b = (client.generate(prompts, sp, n=3, seed=11) for _ in range(2))
    assert a.num_rejected == a.num_aborted == 0 and len(a.samples) == 9
    assert [s.prompt_index for s in a.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for p in range(3):
      group = [s.response_ids for s in a.samples if s.prompt_index == p]
      assert len(set(group)) == 3, group  # not n copies of one sample
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
    version = client.model_info()["weight_version"]
    assert all(s.weight_version == version for s in a.samples)
  finally:
    client.close()


def _sampling_mask_chunk_type():
  """SGLang's own host-side container of sampling masks (`sglang/srt/sampling/sampling_mask.py`,
  loaded by file path from the wheel like api_types): its `to_lists` makes the JSON lists."""
  import importlib.util
  import zipfile
  from sglang_contract import CACHE, SGLANG_VERSION, _wheel

  target = CACHE / f"sglang-{SGLANG_VERSION}-sampling_mask.py"
  if not target.exists():
    with zipfile.ZipFile(_wheel()) as whl:
      target.write_bytes(whl.read("sglang/srt/sampling/sampling_mask.py"))
  spec = importlib.util.spec_from_file_location("sglang_0_5_23_sampling_mask", target)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.SamplingMaskChunk


@pytest.mark.parametrize("mode", [None, "selected", "support"])
def test_return_sampling_mask(server, api_types, mode):
  """SGLang 0.5.23's return_sampling_mask: the three meta_info keys after the log-prob keys, one
  support per output token with the sampled token inside, behaviour log-probs renormalised over
  it (selected: the token's; support: the whole support's), full-vocabulary log-probs unchanged;
  SGLang's contract decodes request and reply, and SGLang's SamplingMaskChunk builds the same lists."""
  body = {
    "input_ids": [PROMPT, PROMPT[:2]],
    "return_logprob": True,
    "return_sampling_mask": True,
    "sampling_params": {
      "max_new_tokens": 8,
      "temperature": 1.2,
      "top_k": 20,
      "top_p": 0.8,
      "min_p": 0.05,
      "ignore_eos": True,
      "sampling_seed": 3,
    },
  }
  if mode is not None:
    body["sampling_logprobs_mode"] = mode
  api_types.GenerateRequest.from_json_value(body)
  plain = _post(server, {k: v for k, v in body.items() if k not in ("return_sampling_mask", "sampling_logprobs_mode")})
  outs = _post(server, body)
  chunk_type = _sampling_mask_chunk_type()
  for out, ref in zip(outs, plain):
    api_types.GenerateResponse.from_json_value(out)
    meta = out["meta_info"]
    keys = list(meta)
    assert keys[keys.index("output_token_logprobs_length") + 1 :][:4] == [
      "output_token_sampling_mask",
      "output_token_sampling_logprobs",
      "output_token_sampling_mask_length",
      "reasoning_tokens",
    ]
    assert out["output_ids"] == ref["output_ids"]
    assert meta["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
    masks, values = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(values) == 8
    for tok, mask, value, (full, _, _) in zip(out["output_ids"], masks, values, meta["output_token_logprobs"]):
      assert tok in mask and 1 <= len(mask) <= 20 and len(set(mask)) == len(mask)
      if mode == "support":
        assert len(value) == len(mask) and value == sorted(value, reverse=True)
        np.testing.assert_allclose(np.logaddexp.reduce(value), 0.0, atol=1e-5)
        selected = value[mask.index(tok)]
      else:
        selected = value
      assert full - 1e-6 <= selected <= 1e-6  # renormalising raises the log-prob
    chunk = chunk_type(
      lengths=np.array([len(m) for m in masks], np.int32),
      token_ids=np.array([t for m in masks for t in m], np.int32),
      logprobs=np.array([v for x in values for v in (x if mode == "support" else [x])], np.float32),
    )
    got_masks, got_values = chunk.to_lists(support_logprobs=mode == "support")
    assert got_masks == masks
    np.testing.assert_allclose(
      np.concatenate([np.ravel(v) for v in got_values]), np.concatenate([np.ravel(v) for v in values]), rtol=1e-6
    )


@pytest.mark.parametrize("mode", ["selected", "support"])
def test_sampling_mask_with_top_k_at_or_past_the_vocabulary(server, mode):
  """top_k = vocab (64) or past it means every token, as in SGLang: top-p alone bounds the support."""
  for top_k in (64, 100):
    body = {
      "input_ids": PROMPT,
      "return_logprob": True,
      "return_sampling_mask": True,
      "sampling_logprobs_mode": mode,
      "sampling_params": {
        "max_new_tokens": 3,
        "temperature": 1.0,
        "top_k": top_k,
        "top_p": 0.9,
        "ignore_eos": True,
        "sampling_seed": 1,
      },
    }
    out = _post(server, body)
    meta = out["meta_info"]
    for tok, mask, value in zip(
      out["output_ids"], meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    ):
      assert tok in mask and 1 <= len(mask) <= 64
      if mode == "support":
        np.testing.assert_allclose(np.logaddexp.reduce(value), 0.0, atol=1e-5)


def test_greedy_sampling_mask(server):
  out = _post(
    server,
    {
      "input_ids": PROMPT,
      "return_sampling_mask": True,
      "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    },
  )
  meta = out["meta_info"]
  assert meta["output_token_sampling_mask"] == [[t] for t in out["output_ids"]]
  assert meta["output_token_sampling_logprobs"] == [0.0] * 4
