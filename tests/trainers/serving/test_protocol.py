"""The client's side of the protocol: it parses every response shape SGLang 0.5.23 sends (each
finish reason, aborts with and without partial tokens, weight-version spans) and every error
body, and the seeds it sends are one per sample."""

import pytest

from trainers.serving import protocol
from trainers.rollout.samples import sample_seeds, validate_sample


def _sample(finish, ids=(5, 6), **meta):
  return {
    "text": "",
    "output_ids": list(ids),
    "meta_info": {
      "id": "x",
      "finish_reason": finish,
      "prompt_tokens": 3,
      "weight_version": "4",
      "output_token_logprobs": [[-0.5, t, None] for t in ids],
      **meta,
    },
  }


def test_every_finish_reason_form():
  assert validate_sample(_sample({"type": "stop", "matched": 6}))[1]["finish"] == "stop"
  assert validate_sample(_sample({"type": "stop", "matched": "</s>"}))[1]["finish"] == "stop"
  assert validate_sample(_sample({"type": "stop", "matched": [6, 7]}))[1]["finish"] == "stop"
  assert validate_sample(_sample({"type": "length", "length": 2}))[1]["finish"] == "length"
  for abort in (
    {"type": "abort", "message": "Abort in waiting queue"},
    {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
    {"type": "abort", "message": "timeout", "status_code": 503, "err_type": "ServiceUnavailable"},
  ):
    for ids in ((), (5, 6, 7)):  # aborts with and without partial tokens are dropped, not trained on
      error, parsed = validate_sample(_sample(abort, ids))
      assert error is None and parsed["aborted"] is True
  error, _ = validate_sample(_sample({"type": "cancelled"}))
  assert "unknown finish_reason" in error


def test_weight_version_spans():
  spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
  _, parsed = validate_sample(_sample({"type": "length", "length": 2}, weight_versions=spans))
  assert parsed["weight_version"] == "4" and parsed["weight_versions"] == (("3", 0, 1), ("4", 1, 2))
  _, parsed = validate_sample(_sample({"type": "length", "length": 2}))
  assert parsed["weight_version"] == "4" and parsed["weight_versions"] == ()


@pytest.mark.parametrize(
  "item,fragment",
  [
    ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}}, "output_token_logprobs"),
    ({"output_ids": ["a"], "meta_info": {}}, "malformed sample"),
    ({"meta_info": {"finish_reason": {"type": "length"}}}, "missing output_ids"),
    ({"output_ids": [1]}, "missing meta_info"),
    ({"output_ids": [1], "meta_info": {"finish_reason": "length"}}, "malformed sample"),
    (
      _sample({"type": "length", "length": 2}, output_token_logprobs=[[None, 5, None], [-1.0, 6, None]]),
      "invalid log-prob None",
    ),
    (_sample({"type": "length", "length": 2}, output_token_logprobs=[[-1.0, 5, None]]), "length mismatch"),
    (
      _sample({"type": "length", "length": 2}, output_token_logprobs=[[-1.0, 5, None], [-1.0, 9, None]]),
      "is for token 9",
    ),
    (_sample({"type": "length", "length": 0}, ids=()), "empty response"),
    ([1, 2], "not an object"),
  ],
)
def test_malformed_samples_are_rejected_with_a_reason(item, fragment):
  error, parsed = validate_sample(item)
  assert parsed is None and fragment in error


def test_error_message_reads_every_sglang_error_body():
  assert protocol.error_message({"error": "unknown field `x`"}) == "unknown field `x`"
  assert protocol.error_message({"error": {"message": "too long"}}) == "too long"
  assert (
    protocol.error_message(
      {"error": {"message": "bad", "type": "invalid_request_error", "code": 400, "retryable": False}}
    )
    == "bad"
  )
  assert protocol.error_message(protocol.json_error_body("Field required")) == "Field required"
  assert (
    protocol.error_message({"success": False, "message": "shapes mismatch", "num_paused_requests": 0})
    == "shapes mismatch"
  )
  assert protocol.error_message({"detail": "Not Found"}) == "Not Found"
  assert protocol.error_message({"detail": [{"loc": ["body"], "msg": "Field required"}]}) == "Field required"
  assert protocol.error_message({"error": ["a", "b"]}) == "a; b"
  assert protocol.error_message("plain text") == "plain text"


def test_sample_seeds_are_distinct_and_deterministic():
  seeds = sample_seeds(3, num_prompts=4, n=8)
  assert len(set(seeds)) == 32 and seeds == sample_seeds(3, 4, 8)
  assert not set(seeds) & set(sample_seeds(4, 4, 8))  # another step: other seeds
  assert all(0 <= s < 2**31 for s in seeds)
  # A chunk of prompts 4.. gets the seeds that follow (the same whatever the chunking).
  assert sample_seeds(3, 2, 8, offset=4 * 8) == sample_seeds(3, 6, 8)[32:]


def test_top_logprobs_num_is_normalised_and_returned_in_sglang_form():
  """`top_logprobs_num` per prompt (a scalar shared, a list one each), a negative one refused with
  SGLang's kind of message; `meta_info` carries `input_top_logprobs` / `output_top_logprobs` after the
  token log-probs, and the client's `MetaInfo` reads them."""
  req = protocol.GenerateRequest(input_ids=[[1, 2], [3]], return_logprob=True, top_logprobs_num=[2, 0])
  items = protocol.normalize_generate(req).items
  assert [i.top_logprobs_num for i in items] == [2, 0]
  bad = protocol.normalize_generate(protocol.GenerateRequest(input_ids=[1], top_logprobs_num=-1)).items[0]
  with pytest.raises(protocol.RequestError, match="top_logprobs_num must be >= 0"):
    protocol.validate_item(bad, vocab_size=10, context_length=512)
  top = [[[-0.1, 4, None], [-2.5, 1, None]]]
  meta = protocol.meta_info(
    rid="r",
    finish_reason=protocol.finish_length(1),
    prompt_tokens=1,
    weight_version="0",
    completion_tokens=1,
    e2e_latency=0.0,
    sent_ts=0.0,
    logprobs=([], [[-0.1, 4, None]]),
    top_logprobs=([], top),
  )
  keys = list(meta)
  assert keys.index("output_top_logprobs") == keys.index("output_token_logprobs_length") + 2
  parsed = protocol.parse_generate_result({"output_ids": [4], "meta_info": meta})
  assert parsed.meta_info.output_top_logprobs == top
