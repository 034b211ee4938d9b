"""Per-token staleness (`rollout.max_token_staleness`): the response tokens generated more than
k weight versions before the step leave the loss and stay as context, read off SGLang's
`weight_versions` spans. Checked against a loop over the tokens, and on servers whose responses
straddle a weight update (a pause in place): the embedded server here, sglang-jax in
tests/trainers/test_sglang_jax.py."""

import threading
import time

import httpx
import numpy as np
import pytest

from trainers.models import init_checkpoint
from trainers.serving.server import EmbeddedServer
from trainers.training.batch import build_step_batch, fresh_tokens, token_versions
from trainers.training.rollout import Sample, SGLangClient


def _sample(n, spans, version, prompt=(1, 5, 9)):
  return Sample(prompt_index=0, prompt_ids=prompt, response_ids=tuple(range(10, 10 + n)),
                rollout_logprobs=tuple(-0.5 - 0.01 * i for i in range(n)), finish_reason="length", text="",
                weight_version=version, weight_versions=spans)


SAMPLES = [
    _sample(6, (("3", 0, 2), ("4", 2, 5), ("5", 5, 6)), "5"),  # paused in place twice mid-response
    _sample(4, (), "5"),                                          # no spans: one version
    _sample(5, (("2", 0, 5),), "2"),                              # wholly stale
    _sample(3, (("4", 0, 1), ("5", 1, 3)), "5"),
]


def test_token_versions_follow_the_spans():
  assert token_versions(SAMPLES[0]).tolist() == [3, 3, 4, 4, 4, 5]
  assert token_versions(SAMPLES[1]).tolist() == [5] * 4
  assert token_versions(SAMPLES[3]).tolist() == [4, 5, 5]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_stale_tokens_leave_the_loss_and_stay_as_context(k):
  step = 5
  fresh, metrics = fresh_tokens(SAMPLES, step, k)
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
  sb = build_step_batch(SAMPLES, np.ones(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32),
                        num_segments=4, row_len=16, tokens_per_micro_batch=64, batch_devices=1, trained_tokens=fresh)
  full = build_step_batch(SAMPLES, np.ones(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32),
                          num_segments=4, row_len=16, tokens_per_micro_batch=64, batch_devices=1)
  masks = sb.per_sequence(sb.batch.loss_mask)
  for s, m, want, inputs in zip(SAMPLES, masks, fresh, sb.per_sequence(sb.input_ids)):
    n = len(s.response_ids)
    assert not m[:len(s.prompt_ids) - 1].any()  # the prompt
    np.testing.assert_array_equal(m[-n:], want)  # the response: its fresh tokens only
    np.testing.assert_array_equal(inputs, (s.prompt_ids + s.response_ids)[:-1])  # every token stays as context
  # Nothing else moves: inputs, targets, rollout log-probs and packing are the unmasked batch's.
  for name in ("input_ids", "targets", "positions"):
    np.testing.assert_array_equal(getattr(sb, name), getattr(full, name))
  np.testing.assert_array_equal(sb.batch.rollout_logprobs, full.batch.rollout_logprobs)
  if k == 0:
    assert [m[-len(s.response_ids):].tolist() for s, m in zip(SAMPLES, masks)][0] == [False] * 5 + [True]


def check_straddling_response(url, start_path, other_path):
  """A 300-token response paused in place across an update from `start_path` (version 6) to
  `other_path` (version 7) on the server at `url`: two spans; at the step that trains version 7
  with `max_token_staleness` 0, the tokens before the switch leave the loss, those after stay."""
  update = lambda path, version: httpx.post(url + "/update_weights_from_disk", timeout=120,
                                            json={"model_path": path, "weight_version": version}).json()["success"]
  client = SGLangClient([url], max_retries=0)
  try:
    for attempt in range(4):  # the update must land while the response is being generated
      assert update(start_path, "6")
      out = {}
      thread = threading.Thread(target=lambda: out.update(result=client.generate(
          [[1, 5, 9]], {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}, n=1, seed=attempt)))
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
    fresh, metrics = fresh_tokens([sample], 7, 0)  # the step that trains version 7
    assert fresh[0].tolist() == [False] * b + [True] * (300 - b)
    assert metrics["rollout/stale_token_fraction"] == pytest.approx(b / 300)
    assert metrics["rollout/token_staleness_q1"] >= metrics["rollout/token_staleness_q4"] == 0  # early tokens are older
    sb = build_step_batch([sample], np.ones(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32),
                          num_segments=1, row_len=512, tokens_per_micro_batch=512, batch_devices=1,
                          trained_tokens=fresh)
    mask = sb.per_sequence(sb.batch.loss_mask)[0]
    assert mask.sum() == 300 - b and mask[-(300 - b):].all()
  finally:
    client.close()


def test_the_embedded_server_straddles_an_update_paused_in_place(tmp_path):
  paths = {name: str(tmp_path / name) for name in ("start", "other")}
  for seed, path in enumerate(paths.values()):
    init_checkpoint(path, preset="tiny-qwen3", seed=seed)
  with EmbeddedServer(paths["start"], dtype="bfloat16", seed=0) as server:
    check_straddling_response(server.url, paths["start"], paths["other"])
