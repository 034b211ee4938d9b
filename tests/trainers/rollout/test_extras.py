"""Per-token extras declared once (`trainers.rollout.extras`): a toy extra registered in this file
alone — its request field, reply parser, record column, packer and model input — flows from the
engine's reply to the model input and back out of the records, through the code the trainer runs.

Files an extra touches: today's sampling support before this registry touched 10 (the request
body in `serving/protocol.py` and `training/sglang_client.py` (generate and its probe), the reply
in `rollout.py` (`validate_sample`, `Sample`), the records in `rollout_records.py` (writer, schema,
reader checks) and `sources.py` (`RecordedRollouts`), the packing in `batch.py`
(`StepBatch.support`), the model input in `step.py` and `train.py` (`device_batch`), the probe in
`servers.py`, the record checks in `checks.py`); routed experts as many. With the registry, an
extra is one class: the toy below touches this file only (`test_the_toy_extra_is_one_file`).
"""

import inspect
import pathlib

import numpy as np
import pytest

from fake_sglang import FakeSGLang
from trainers.models import PRESETS
from trainers.serving import protocol
from trainers.rollout import extras as extras_lib, records as rollout_records, settings
from trainers.app import trainer as train_lib
from trainers.learner.batch import build_step_batch
from trainers.rollout.samples import Sample, ServerError, validate_sample
from trainers.rollout.sources import RecordedRollouts
from trainers.learner.step import ModelInputs

from test_train import make_cfg

ROOT = pathlib.Path(__file__).resolve().parents[3]


class NoToyScore(ServerError):
  """The server returned no toy scores."""


class ToyScore(extras_lib.TokenExtra):
  """A per-token float the engine returns as `meta_info.toy_score` when asked `return_toy_score`,
  recorded as `toy_score` and fed to the model as `ModelInputs.extra["toy_score"]`."""

  name = "toy_score"
  request = {"return_toy_score": True}
  missing = NoToyScore
  what = "toy-score"
  fill, dtype, model_input = 0.0, np.float32, "toy_score"

  @classmethod
  def activate(cls, rollout, model_config):
    return cls()

  @staticmethod
  def record_type():
    import pyarrow as pa

    return pa.list_(pa.float32())

  def parse(self, reply):
    scores = reply.meta.get("toy_score")
    if scores is None:
      raise NoToyScore("the reply has no meta_info.toy_score")
    if len(scores) != len(reply.ids):
      return f"length mismatch: {len(reply.ids)} output_ids but {len(scores)} toy_score"
    return np.asarray(scores, np.float32)


def toy_scores(ids):
  """What the toy server returns for a response: a float per token, exact in float32."""
  return [t / 4 + k for k, t in enumerate(ids)]


@pytest.fixture
def toy():
  extras_lib.register(ToyScore)
  try:
    yield ToyScore()
  finally:
    extras_lib.unregister(ToyScore.name)


class ToyServer(FakeSGLang):
  """The fake SGLang server, its replies carrying `meta_info.toy_score`."""

  def _sample(self, rng, n_tokens, i):
    item = super()._sample(rng, n_tokens, i)
    item["meta_info"]["toy_score"] = toy_scores(item["output_ids"])
    return item


def test_the_toy_extra_is_one_file():
  """The toy is declared here and nowhere else: no trainer module names it."""
  assert inspect.getsourcefile(ToyScore) == __file__
  named = [p for p in (ROOT / "trainers").rglob("*.py") if "toy_score" in p.read_text()]
  assert named == []
  # The extras the trainer ships are one declaration each: the engine's in the extras module (the
  # sampler's top-k head as two columns, its log-probs and its ids), the trajectories' turn index in
  # the episode driver that makes it, their per-turn rewards in the module that turns them into
  # advantages.
  from trainers.agents import episodes, rewards

  kinds = {name: inspect.getsourcefile(k) for name, k in extras_lib.registered().items() if name != "toy_score"}
  assert kinds == {
    "sampling_mask": extras_lib.__file__,
    "routed_experts": extras_lib.__file__,
    "top_logprobs": extras_lib.__file__,
    "top_logprob_ids": extras_lib.__file__,
    "turn": episodes.__file__,
    "turn_reward": rewards.__file__,
  }


def test_reply_to_model_input_and_back_out_of_the_records(toy, tmp_path):
  """validate_sample → Sample → records written and read → build_step_batch → ModelInputs."""
  active = extras_lib.active(
    settings.derive(make_cfg(tmp_path).rollout, PRESETS["tiny-qwen3"]), PRESETS["tiny-qwen3"]
  )  # as the Trainer decides
  assert [e.name for e in active] == ["toy_score"]
  prompts = [(1, 2, 3), (4, 5)]
  responses = [(7, 8, 9, 10), (11, 12)]
  samples = []
  for k, (prompt, ids) in enumerate(zip(prompts, responses)):
    item = {
      "text": "",
      "output_ids": list(ids),
      "meta_info": {
        "finish_reason": {"type": "length", "length": len(ids)},
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
        "toy_score": toy_scores(ids),
      },
    }
    error, parsed = validate_sample(item, extras=active, prompt_len=len(prompt))
    assert error is None
    samples.append(
      Sample(
        prompt_index=k,
        prompt_ids=prompt,
        response_ids=parsed["ids"],
        rollout_logprobs=parsed["logprobs"],
        finish_reason=parsed["finish"],
        text="",
        weight_version=parsed["weight_version"],
        extras=parsed["extras"],
      )
    )
  assert samples[0].extras["toy_score"].tolist() == toy_scores(responses[0])
  # A reply without it: the extra's own error; a malformed one: the sample is rejected.
  with pytest.raises(NoToyScore):
    validate_sample(
      {**item, "meta_info": {k: v for k, v in item["meta_info"].items() if k != "toy_score"}}, extras=(toy,)
    )
  bad = {**item, "meta_info": {**item["meta_info"], "toy_score": [1.0]}}
  assert validate_sample(bad, extras=(toy,))[0] == "length mismatch: 2 output_ids but 1 toy_score"
  # Its request field joins every /generate body.
  assert protocol.generate_body([[1]], {"max_new_tokens": 2}, extra_fields=toy.request)["return_toy_score"] is True

  sb = build_step_batch(
    samples,
    np.ones(2, np.float32),
    np.ones(2, np.float32),
    np.arange(2),
    num_segments=2,
    row_len=16,
    tokens_per_micro_batch=16,
    batch_devices=1,
    extras=(toy,),
  )
  packed = sb.extras["toy_score"]
  assert packed.shape == sb.input_ids.shape and packed.dtype == np.float32
  mask = np.asarray(sb.batch.loss_mask)
  assert np.array_equal(packed[mask], np.concatenate([toy_scores(r) for r in responses]).astype(np.float32))
  assert np.all(packed[~mask] == 0.0)
  inputs = ModelInputs(sb.input_ids, sb.positions, sb.targets, **extras_lib.model_inputs((toy,), sb.extras))
  assert inputs.extra["toy_score"] is packed and inputs.support is None and inputs.routing is None

  # Records: written as a column of its own, read back unchanged.
  writer = rollout_records.RecordWriter(str(tmp_path), meta={}, extras=(toy,))
  rollout = type("Rollout", (), {"result": type("R", (), {"samples": samples})(), "batch": 0, "prompts": [1]})()
  writer.write(1, sb, rollout, None)
  cols, _ = rollout_records.read_step(rollout_records.step_path(str(tmp_path), 1))
  assert cols["toy_score"] == [toy_scores(r) for r in responses]
  replayed = RecordedRollouts(str(tmp_path), (toy,)).next(0).result.samples
  for a, b in zip(replayed, samples):
    assert np.array_equal(a.extras["toy_score"], b.extras["toy_score"])


@pytest.mark.integration
def test_the_trainer_carries_a_toy_extra(toy, tmp_path):
  """The Trainer, which never names it, asks the server for it, records it, and feeds it to the
  model: a run against a server that returns it, then a replay of its records."""
  records = tmp_path / "records"
  with ToyServer() as fake:
    cfg = make_cfg(
      tmp_path, rollout={"sync": {"mismatch_check": False}, "records": {"save_dir": str(records)}}, train={"steps": 2}
    )
    trainer = train_lib.Trainer(cfg, urls=[fake.url])  # (the fake's log-probs are random)
    assert [e.name for e in trainer.extras] == ["toy_score"]
    history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2]
  generates = [b for route, b in fake.bodies if route == "/generate"]
  assert generates and all(b.get("return_toy_score") is True for b in generates)  # probe and rollouts
  cols, _ = rollout_records.read_step(rollout_records.step_path(str(records), 1))
  assert cols["toy_score"] == [toy_scores(ids) for ids in cols["response_ids"]]

  replay = train_lib.Trainer(
    make_cfg(tmp_path, "replay", rollout={"records": {"load_dir": str(records)}}, train={"steps": 1}), urls=[]
  )
  rollout = replay.source.next(0)
  sb = replay.build_batch(rollout.prompts, rollout.result)
  inputs, _ = replay.learner.device_batch(sb)
  got = np.asarray(inputs.extra["toy_score"])
  for seq, ids in zip(sb.per_sequence(got), cols["response_ids"]):  # each response's scores, at its tokens
    assert seq[-len(ids) :].tolist() == toy_scores(ids) and not seq[: -len(ids)].any()
  assert np.array_equal(got, sb.extras["toy_score"])
  assert replay.run(progress=False)[0]["step"] == 1  # and the step trains with it among the inputs
