"""Per-token staleness (`rollout.max_token_staleness`): the response tokens generated more than
k weight versions before the step leave the loss and stay as context, read off SGLang's
`weight_versions` spans. Checked against a loop over the tokens here; on a real engine whose
responses straddle a weight update in tests/trainers/test_sglang_jax.py."""

import numpy as np
import pytest

from trainers.training.batch import build_step_batch, fresh_tokens, token_versions
from trainers.training.rollout import Sample


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
