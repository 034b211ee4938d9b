"""Exact mode at the engine (contract §13): the embedded sampler of a batch-invariant model decodes
over its KV cache the log-probs the trainer's teacher-forced exact pass computes for the same
sequences packed in rows (`trainers.learner.step.exact_logprobs`), bit for bit — bfloat16 and
float32, temperature, top-k with the sampling mask (the renormalised behaviour log-prob), top-p,
greedy, Qwen3 and Qwen3-MoE (its routed experts the pass's native ones, no replay) — and a
sample's tokens and log-probs are the same alone and inside a batch of 32 (rows before and after
it, other prompt lengths, rows that finish early and leave the batch)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.learner.step import exact_logprobs
from trainers.models import PRESETS, invariant, registry
from trainers.serving.embedded.sampler import Sampler, SamplingOptions

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14], [1, 30], [1, 7, 7, 7, 7, 7, 7, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def exact_model(preset: str, dtype):
  cfg = dataclasses.replace(PRESETS[preset], initializer_range=0.3)
  return registry.family(cfg.model_type).module(
    cfg, dtype=dtype, param_dtype=dtype, arithmetic="batch_invariant", layer_loop="auto", rngs=nnx.Rngs(0)
  )


def pack(sequences, row_len: int = 64):
  """Two sequences per row at offsets 0 and `row_len // 2` (the trainer packs several a row):
  inputs, positions, segment ids, next-token targets."""
  rows = -(-len(sequences) // 2)
  ids, pos, tgt = (np.zeros((rows, row_len), np.int32) for _ in range(3))
  seg = np.full((rows, row_len), -1, np.int32)
  where = []
  for i, seq in enumerate(sequences):
    r, at = i // 2, (i % 2) * (row_len // 2)
    assert len(seq) <= row_len // 2
    ids[r, at : at + len(seq)] = seq
    pos[r, at : at + len(seq)] = np.arange(len(seq))
    seg[r, at : at + len(seq)] = i
    tgt[r, at : at + len(seq) - 1] = seq[1:]
    where.append((r, at))
  return ids, pos, seg, tgt, where


def teacher_forced(model, sequences, temperature, supports=None):
  """The trainer's exact pass over `sequences` packed two per row: per sequence, the log-probs of
  tokens 1.. (and the native routing `[len, L, k]` of a MoE model)."""
  graphdef, params = nnx.split(model)
  ids, pos, seg, tgt, where = pack(sequences)
  support = None
  if supports is not None:  # per sequence, per predicted token: its support ids
    width = max(len(s) for per in supports for s in per)
    support = np.full(ids.shape + (width,), -1, np.int32)
    for (r, at), seq, per in zip(where, sequences, supports):
      for t, s in enumerate(per):  # per[t]: the support of output token t, predicted at len(prompt) - 1 + t
        support[r, at + len(seq) - len(per) - 1 + t, : len(s)] = s

  def run(params, ids, pos, seg, tgt, support, temperature):
    m = nnx.merge(graphdef, params)
    if m.config.is_moe:
      hidden, routing = m.hidden_states(ids, pos, seg, return_routing=True)
      routing = routing.native
    else:
      hidden, routing = m.hidden_states(ids, pos, seg), None
    return exact_logprobs(m, hidden, tgt, support, temperature, chunk_size=32), routing

  lp, routing = jax.jit(run, compiler_options=invariant.COMPILER_OPTIONS)(
    params, ids, pos, seg, tgt, support, jnp.float32(temperature)
  )
  lp = np.asarray(lp)
  out = []
  for (r, at), seq in zip(where, sequences):
    out.append((lp[r, at : at + len(seq) - 1], None if routing is None else np.asarray(routing)[r, at : at + len(seq)]))
  return out


@pytest.mark.parametrize(
  "preset, dtype, options",
  [
    ("tiny-qwen3", jnp.bfloat16, dict(temperature=0.7, top_k=8, sampling_mask=True)),
    ("tiny-qwen3", jnp.float32, dict(temperature=1.0, top_p=0.9)),
    ("tiny-qwen3", jnp.bfloat16, dict(temperature=0.0)),
    ("tiny-qwen3-moe", jnp.bfloat16, dict(temperature=1.0, routed_experts=True)),
  ],
)
def test_engine_decoding_equals_the_teacher_forced_exact_pass(preset, dtype, options):
  model = exact_model(preset, dtype)
  sampler = Sampler(model, max_batch_size=8)
  outs = sampler.generate(PROMPTS, SamplingOptions(max_new_tokens=12, seed=7, ignore_eos=True, **options))
  sequences = [PROMPTS[c.prompt_index] + c.output_ids for c in outs]
  masked = options.get("sampling_mask", False)
  temperature = options["temperature"] or 1.0  # greedy reports temperature-1 log-probs
  tf = teacher_forced(model, sequences, temperature)
  for c, seq, (lp, routing) in zip(outs, sequences, tf):
    np.testing.assert_array_equal(lp[len(seq) - len(c.output_ids) - 1 :], np.asarray(c.logprobs, np.float32))
    if options.get("routed_experts"):  # the pass's native routing is the engine's, no replay
      np.testing.assert_array_equal(routing[: len(seq) - 1], c.routed_experts)
  if masked:  # the behaviour log-prob over the replayed support
    tf = teacher_forced(model, sequences, temperature, supports=[c.sampling_mask for c in outs])
    for c, seq, (lp, _) in zip(outs, sequences, tf):
      np.testing.assert_array_equal(lp[len(seq) - len(c.output_ids) - 1 :], np.asarray(c.sampling_logprobs, np.float32))


def test_a_sample_is_the_same_alone_and_in_a_batch_of_32():
  """The same seeded prompt alone, then as row 16 of 32: 16 rows before it and 15 after, prompts
  of 1 to 23 tokens (another prompt bucket: other left padding), most finishing after 3 tokens, so
  at the first window's end (16 steps) the batch compacts to the rows still running."""
  sampler = Sampler(exact_model("tiny-qwen3", jnp.bfloat16), max_batch_size=32)
  prompt, mine = (
    [1, 9, 17, 33, 2, 60],
    SamplingOptions(temperature=0.8, top_k=20, max_new_tokens=24, seed=11, ignore_eos=True),
  )
  alone = sampler.generate([prompt], mine)[0]
  rng = np.random.default_rng(0)
  others = [rng.integers(3, 64, size=int(n)).tolist() for n in rng.integers(1, 24, size=31)]
  params = [
    SamplingOptions(temperature=1.0, max_new_tokens=3 if i % 4 else 20, seed=i, ignore_eos=True) for i in range(31)
  ]
  batch = sampler.generate(others[:16] + [prompt] + others[16:], params[:16] + [mine] + params[16:])
  assert batch[16].output_ids == alone.output_ids
  np.testing.assert_array_equal(np.asarray(batch[16].logprobs, np.float32), np.asarray(alone.logprobs, np.float32))
