"""The stale-KV sequence of issue 46, against any server with SGLang's routes: a prompt prefix P
cached under weights A; a long request holding P while the server is paused and updated to B;
then the P-prefixed prompts again. Every reply after the update must equal the same server's on
B with an empty cache (tokens, prompt and output log-probs), or P's KV from A was reused.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np

PREFIX = [1] + [3 + (7 * i) % 60 for i in range(47)]  # 48 tokens
SUFFIXES = [[5, 9, 12], [7, 7, 3], [30, 4], [11, 20, 21, 22], [60]]


def _body(salt: str | None, **extra) -> dict:
  body = {
    "input_ids": [PREFIX + s for s in SUFFIXES],
    "return_logprob": True,
    "logprob_start_len": len(PREFIX),
    "sampling_params": {
      "temperature": 0,
      "max_new_tokens": 6,
      "ignore_eos": True,
      "skip_special_tokens": False,
      "no_stop_trim": True,
    },
    **extra,
  }
  if salt is not None:
    body["extra_key"] = salt
  return body


def _post(url: str, path: str, body: dict) -> httpx.Response:
  reply = httpx.post(url + path, json=body, timeout=120)
  assert reply.status_code == 200, (path, reply.text)
  return reply


def _long_request(url: str, salt: str | None, out: dict) -> None:
  """A P-prefixed request long enough to be paused while it holds P's KV (400 tokens: ~2 s on
  sglang-jax's CPU decoding, past every pause `stale_kv_sequence` tries)."""
  body = {
    "input_ids": PREFIX + [8],
    "return_logprob": True,
    "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
  }
  if salt is not None:
    body["extra_key"] = salt
  out["reply"] = httpx.post(url + "/generate", json=body, timeout=300).json()


def flush_when_idle(url: str, attempts: int = 50) -> None:
  """`/flush_cache` once the scheduler has retired its last batch (it refuses until then)."""
  for _ in range(attempts):
    if httpx.post(url + "/flush_cache", json={}, timeout=30).status_code == 200:
      return
    time.sleep(0.1)
  raise AssertionError(f"{url} never flushed its cache")


def stale_kv_sequence(url: str, a_path: str, b_path: str, *, mode: str, salt: bool, tag: str) -> dict:
  """Runs the sequence (pause `mode`; with `salt`, requests carry SGLang's `extra_key` naming the
  weights they start under) and returns `{"after", "reference", "long"}`: the replies after the
  update, the same server's replies on B after its cache was flushed, and the long request's
  last streamed result."""
  salt_a, salt_b = (f"{tag}:0:wA", f"{tag}:1:wB") if salt else (None, None)
  # The pause must find the long request running: later attempts wait longer (the first may
  # compile the long request's programs), all well inside the request's ~2 s.
  for attempt in range(4):
    assert _post(url, "/update_weights_from_disk", {"model_path": a_path, "weight_version": f"{tag}-A"}).json()[
      "success"
    ]
    _post(url, "/generate", _body(salt_a))  # P cached under A
    out = {}
    thread = threading.Thread(target=_long_request, args=(url, salt_a, out))
    thread.start()
    try:
      time.sleep(0.3 * (attempt + 1))
      _post(url, "/pause_generation", {"mode": mode})
      try:
        update = _post(url, "/update_weights_from_disk", {"model_path": b_path, "weight_version": f"{tag}-B"})
        assert update.json()["success"], update.text
      finally:
        _post(url, "/continue_generation", {})
      after = _post(url, "/generate", _body(salt_b)).json()
    finally:
      thread.join(300)
    meta = out["reply"]["meta_info"]
    held = (
      len(meta.get("weight_versions") or ()) == 2 if mode == "in_place" else meta["finish_reason"]["type"] == "abort"
    )
    if held:
      break
  else:
    raise AssertionError(f"the long request was never running at the pause ({meta})")
  flush_when_idle(url)  # an empty cache on B
  reference = _post(url, "/generate", _body(salt_b)).json()
  return {"after": after, "reference": reference, "long": out["reply"]}


def differences(a: list, b: list) -> tuple[int, float]:
  """(prompts whose output ids differ, largest |Δ| of prompt and output log-probs) between two
  batch replies."""
  tokens, worst = 0, 0.0
  for x, y in zip(a, b, strict=True):
    tokens += x["output_ids"] != y["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
      lx = np.array([e[0] for e in x["meta_info"][key] if e[0] is not None], np.float64)
      ly = np.array([e[0] for e in y["meta_info"][key] if e[0] is not None], np.float64)
      worst = max(worst, float(np.abs(lx - ly).max(initial=0.0)) if lx.shape == ly.shape else np.inf)
  return tokens, worst
