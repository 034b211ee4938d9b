"""The sampler's top-k head as per-token extras (score centering, contract §6.6): asked for with
`rollout.sampling.top_logprobs_num`, parsed from SGLang's `output_top_logprobs` (each malformed form
rejected with a reason), recorded and read back, packed into `PackedBatch.rollout_topk_logprobs` and
`ModelInputs.extra`, and the config's cross-key errors. (The centred step on a 2×4 mesh equals one
device in test_step's mesh cases; the trainer end to end in test_train.)"""

import numpy as np
import pytest

import mis_jax
from trainers.models import PRESETS
from trainers.app.spec import resolve
from trainers.rollout import extras as extras_lib, settings
from trainers.learner.batch import build_step_batch
from trainers.rollout.samples import Sample, ServerError, validate_sample

from test_train import make_cfg

K = 3


def _reply(ids, top=None, **meta):
  top = [[[-0.2 - j, (t + j) % 50, None] for j in range(K)] for t in ids] if top is None else top
  return {
    "text": "",
    "output_ids": list(ids),
    "meta_info": {
      "finish_reason": {"type": "length", "length": len(ids)},
      "weight_version": "0",
      "output_token_logprobs": [[-0.5, t, None] for t in ids],
      "output_top_logprobs": top,
      **meta,
    },
  }


@pytest.fixture
def active(tmp_path):
  cfg = make_cfg(tmp_path, rollout={"sampling": {"top_logprobs_num": K}})
  extras = extras_lib.active(settings.derive(cfg.rollout, PRESETS["tiny-qwen3"]), PRESETS["tiny-qwen3"])
  assert [e.name for e in extras] == ["top_logprobs", "top_logprob_ids"]
  assert all(e.request == {"top_logprobs_num": K} for e in extras)
  return extras


def test_parsed_recorded_and_packed(active):
  ids = [(7, 8, 9), (11, 12)]
  samples = []
  for k, response in enumerate(ids):
    error, parsed = validate_sample(_reply(response), extras=active, prompt_len=2)
    assert error is None
    np.testing.assert_array_equal(
      parsed["extras"]["top_logprob_ids"], [[(t + j) % 50 for j in range(K)] for t in response]
    )
    np.testing.assert_allclose(
      parsed["extras"]["top_logprobs"], [[-0.2 - j for j in range(K)]] * len(response), rtol=1e-6
    )
    for e in active:  # the record column round-trips
      value = parsed["extras"][e.name]
      back = e.from_record(e.to_record(value), 2, len(response))
      assert e.check_record(e.to_record(value), 2, len(response)) is None and back.dtype == e.dtype
      np.testing.assert_array_equal(back, value)
    samples.append(Sample(k, (1, 2), response, tuple(parsed["logprobs"]), "length", "", "0", extras=parsed["extras"]))
  sb = build_step_batch(
    samples,
    np.array([1.0, 0.0], np.float32),
    np.array([1.0, -1.0], np.float32),
    np.arange(2),
    num_segments=2,
    row_len=8,
    tokens_per_micro_batch=8,
    batch_devices=1,
    extras=active,
  )
  topk = sb.batch.rollout_topk_logprobs
  assert topk.shape == sb.layout.shape + (K,)
  # response token j of a sample sits at input position len(prompt) - 1 + j, as its log-prob
  rows = sb.packing.unpack(topk.reshape(sb.layout.num_rows, sb.layout.row_len, K))
  got = [r[m] for r, m in zip(rows, sb.per_sequence(sb.batch.loss_mask))]
  np.testing.assert_allclose(got[0], [[-0.2 - j for j in range(K)]] * 3, rtol=1e-6)
  inputs = extras_lib.model_inputs(active, sb.extras)
  assert set(inputs) == {"extra"} and inputs["extra"]["top_logprob_ids"].shape == sb.layout.shape + (K,)


@pytest.mark.parametrize(
  "top,reason",
  [
    ([[[-0.1, 1, None]] * K] * 2, "length mismatch: 3 output_ids but 2 output_top_logprobs"),
    ([[[-0.1, 1, None]] * (K - 1)] * 3, "output_top_logprobs[0] has 2 entries, expected 3"),
    ([[[-0.1, 10**9, None]] * K] * 3, "output_top_logprobs[0][0] is not [logprob, token_id in [0, "),
    ([[[None, 1, None]] * K] * 3, "invalid top log-prob None at output_top_logprobs[0][0]"),
    ([[[0.5, 1, None]] * K] * 3, "invalid top log-prob 0.5"),
  ],
)
def test_malformed_heads_are_rejected_with_a_reason(active, top, reason):
  error, _ = validate_sample(_reply((7, 8, 9), top=top), extras=active, prompt_len=2)
  assert error is not None and reason in error


def test_a_server_without_the_head_is_named(active):
  item = _reply((7, 8))
  del item["meta_info"]["output_top_logprobs"]
  with pytest.raises(ServerError, match="no meta_info.output_top_logprobs .*rollout.sampling.top_logprobs_num: 0"):
    validate_sample(item, extras=active, prompt_len=2)


def test_config_errors(tmp_path):
  base = dict(loss={"algorithm": "reinforce_is", "score_centering": True})
  with pytest.raises(mis_jax.ConfigError, match="rollout.sampling.top_logprobs_num to k >= 1"):
    resolve(make_cfg(tmp_path, **base)).task
  with pytest.raises(mis_jax.ConfigError, match="score_centering with sampling replay"):
    resolve(
      make_cfg(tmp_path, **base, rollout={"sampling": {"top_logprobs_num": 2, "top_k": 5, "temperature": 1.0}})
    ).task
  with pytest.raises(mis_jax.ConfigError, match="top_logprobs_num 100 exceeds the model's vocabulary"):
    resolve(make_cfg(tmp_path, **base, rollout={"sampling": {"top_logprobs_num": 100}})).task
