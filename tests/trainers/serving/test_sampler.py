"""KV-cache sampler: log-probs equal the teacher-forced full forward (SGLang's definition,
`log_softmax(logits / T)`, not renormalised), filters hold, seeds reproduce, stop and length
finish reasons, static shapes (no recompilation inside a bucket), bfloat16 precision knob."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from trainers.models import CausalLM, load_hf_checkpoint
from trainers.serving.embedded.sampler import Sampler, SamplingOptions

from conftest import TINY, sequence_logits, sequence_logprobs

PROMPTS = [[1, 5, 9, 14], [1, 30], [1, 7, 7, 7, 7, 7, 7, 12, 40]]


@pytest.fixture(scope="module")
def sampler(tiny_model):
  return Sampler(tiny_model, max_batch_size=8)


def _check_against_oracle(model, prompts, outs, temperature, atol):
  for c in outs:
    want = sequence_logprobs(model, prompts[c.prompt_index], c.output_ids, temperature=temperature)
    np.testing.assert_allclose(c.logprobs, want, atol=atol, rtol=0)


def test_logprobs_equal_teacher_forced(sampler, tiny_model):
  params = SamplingOptions(
    temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, n=2, ignore_eos=True
  )  # no seed: every sample draws its own
  outs = sampler.generate(PROMPTS, params)
  assert [(c.prompt_index, c.sample_index) for c in outs] == [(i, j) for i in range(3) for j in range(2)]
  for c in outs:
    assert c.prompt_tokens == len(PROMPTS[c.prompt_index])
    assert len(c.output_ids) == len(c.logprobs) == 12 and c.finish_reason == ("length", 12)
  assert outs[0].output_ids != outs[1].output_ids  # n samples draw from distinct keys
  _check_against_oracle(tiny_model, PROMPTS, outs, 0.8, atol=5e-5)


def test_greedy_is_argmax_with_temperature_one_logprobs(sampler, tiny_model):
  outs = [
    sampler.generate(PROMPTS[:1], SamplingOptions(temperature=0.0, max_new_tokens=10, seed=s, ignore_eos=True))[0]
    for s in (1, 2)
  ]
  assert outs[0].output_ids == outs[1].output_ids
  seq = PROMPTS[0] + outs[0].output_ids
  logits = sequence_logits(tiny_model, seq)
  assert outs[0].output_ids == logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
  _check_against_oracle(tiny_model, PROMPTS, outs[:1], 1.0, atol=5e-5)


def test_seed_reproduces_and_other_rows_do_not_matter(sampler):
  """A sample draws from fold_in(key(seed), step) only, as SGLang's sampling_seed: rows added
  after it (and a larger padded batch bucket) leave it unchanged, and the n samples of a
  seeded request (which share its seed) are identical."""
  p = SamplingOptions(temperature=1.0, max_new_tokens=8, seed=123, ignore_eos=True)
  batch = sampler.generate(PROMPTS, p)
  group = sampler.generate(PROMPTS[:1], dataclasses.replace(p, n=3))
  assert [c.output_ids for c in group] == [batch[0].output_ids] * 3
  assert [c.output_ids for c in sampler.generate(PROMPTS, p)] == [c.output_ids for c in batch]
  bigger = sampler.generate(PROMPTS + [[1, 2], [3, 4, 5]], p)
  assert [c.output_ids for c in bigger[:3]] == [c.output_ids for c in batch]
  other = sampler.generate(PROMPTS, dataclasses.replace(p, seed=124))
  assert [c.output_ids for c in batch] != [c.output_ids for c in other]


def test_requests_larger_than_a_batch_run_in_chunks(sampler):
  p = SamplingOptions(temperature=1.0, max_new_tokens=4, n=4, seed=5, ignore_eos=True)
  chunked = sampler.generate(PROMPTS, p)  # 12 rows: a chunk of 8, then one of 4
  assert [(c.prompt_index, c.sample_index) for c in chunked] == [(i, j) for i in range(3) for j in range(4)]
  assert [c.output_ids for c in chunked[:8]] == [c.output_ids for c in sampler.generate(PROMPTS[:2], p)]
  assert [c.output_ids for c in chunked[8:]] == [c.output_ids for c in sampler.generate(PROMPTS[2:], p)]


def test_top_k_and_top_p_restrict_the_support(sampler, tiny_model):
  for params in (
    SamplingOptions(temperature=1.5, top_k=3, max_new_tokens=16, n=4, ignore_eos=True),
    SamplingOptions(temperature=1.5, top_p=0.5, max_new_tokens=16, n=4, ignore_eos=True),
  ):
    for c in sampler.generate(PROMPTS[:1], params):
      logits = sequence_logits(tiny_model, PROMPTS[0] + c.output_ids)[len(PROMPTS[0]) - 1 : -1] / 1.5
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      for p_row, tok in zip(probs, c.output_ids):
        order = np.argsort(-p_row)
        rank = int(np.where(order == tok)[0][0])
        if params.top_k > 0:
          assert rank < params.top_k
        else:
          assert p_row[order[:rank]].sum() <= params.top_p + 1e-6  # mass before it


def test_stop_token_ends_and_is_kept(sampler):
  greedy = SamplingOptions(temperature=0.0, max_new_tokens=16, ignore_eos=True)
  ref = sampler.generate(PROMPTS[:1], greedy)[0].output_ids
  stop = ref[3]
  out = sampler.generate(PROMPTS[:1], dataclasses.replace(greedy, ignore_eos=False, stop_token_ids=(stop,)))[0]
  cut = min(ref.index(t) for t in (stop, 2) if t in ref) + 1  # the config's eos is id 2
  assert out.output_ids == ref[:cut] and out.finish_reason == ("stop", ref[cut - 1])
  # As SGLang: ignore_eos ignores every stop token, stop_token_ids included.
  ignored = sampler.generate(PROMPTS[:1], dataclasses.replace(greedy, stop_token_ids=(stop,)))[0]
  assert ignored.output_ids == ref and ignored.finish_reason == ("length", 16)
  eos = sampler.generate(PROMPTS[:1], SamplingOptions(temperature=0.0, max_new_tokens=16))[0]
  assert (eos.finish_reason[0] == "stop") == (2 in ref)


def test_prompt_logprobs_are_teacher_forced(sampler, tiny_model):
  """`prompt_logprobs[t]` = log_softmax(z / T) of prompt token t + 1 from the prefill."""
  for temperature in (1.0, 0.7):
    outs = sampler.generate(PROMPTS, SamplingOptions(temperature=temperature, max_new_tokens=1), prompt_logprobs=True)
    for c in outs:
      prompt = PROMPTS[c.prompt_index]
      want = sequence_logprobs(tiny_model, prompt[:1], prompt[1:], temperature=temperature)
      np.testing.assert_allclose(c.prompt_logprobs, want, atol=5e-5, rtol=0)


def test_max_new_tokens_zero_and_one(sampler):
  zero, one = (sampler.generate(PROMPTS[:1], SamplingOptions(max_new_tokens=n, seed=0))[0] for n in (0, 1))
  assert zero.output_ids == [] and zero.finish_reason == ("length", 0)
  assert len(one.output_ids) == 1


def test_no_recompilation_within_a_bucket(sampler):
  sampler.generate([[1, 2, 3]], SamplingOptions(max_new_tokens=5, seed=0))
  sampler.generate([[1, 2, 3]], SamplingOptions(max_new_tokens=5, seed=0, top_k=3))  # the filtering decoder
  before = sampler.num_compiled
  for prompt, params in (
    ([1] * 15, SamplingOptions(max_new_tokens=16, temperature=0.3, seed=1)),
    ([4, 5], SamplingOptions(max_new_tokens=2, top_p=0.5, top_k=4, seed=2, stop_token_ids=(3, 4))),
  ):
    sampler.generate([prompt], params)
  assert sampler.num_compiled == before


def test_prefill_and_decode_trace_once_per_bucket(tiny_model, monkeypatch):
  """chex guards the embedded server's programs (the prefill, and the decode loop that runs in
  segments): requests of other lengths, sampling settings, seeds, stop ids, weights and segment
  ends inside one bucket reuse them; a longer prompt is a new bucket and traces each once. A
  batch that filters its support (top-p, top-k, min-p) decodes with its own loop, once per
  bucket too (the others draw without sorting the vocabulary)."""
  import chex
  from trainers.serving.embedded import sampler as sampler_mod

  monkeypatch.setattr(sampler_mod, "_prefill", chex.assert_max_traces(sampler_mod._prefill, n=2))
  monkeypatch.setattr(sampler_mod, "_decode", chex.assert_max_traces(sampler_mod._decode, n=4))
  fresh = Sampler(tiny_model, max_batch_size=4)
  for prompt, params in (
    ([1, 2, 3], SamplingOptions(max_new_tokens=5, seed=0)),
    ([1] * 15, SamplingOptions(max_new_tokens=16, temperature=0.3, seed=1)),
    ([4, 5], SamplingOptions(max_new_tokens=2, top_p=0.5, top_k=4, seed=2, stop_token_ids=(3, 4))),
    ([1] * 20, SamplingOptions(max_new_tokens=9, seed=3)),  # prompt bucket 32: the 2nd trace
    ([1] * 30, SamplingOptions(max_new_tokens=12, min_p=0.1, seed=4)),
  ):
    fresh.generate([prompt], params)
  fresh.set_params(nnx.state(CausalLM(TINY, rngs=nnx.Rngs(9))))
  fresh.generate([[7, 8]], SamplingOptions(max_new_tokens=3, seed=5))
  monkeypatch.setattr(sampler_mod, "SEGMENT_STEPS", 4)
  fresh.generate([[7, 8]], SamplingOptions(max_new_tokens=14, seed=6, ignore_eos=True), between=lambda: None)
  assert fresh.num_compiled == 6  # a prefill and two decoders per bucket, however many segments


@pytest.mark.parametrize("top_width", [0, 5])
def test_an_unfiltered_draw_equals_the_filtering_one(top_width):
  """With no row filtering its support, `_sample` draws without sorting the vocabulary: the same
  tokens, log-probs and top ids (ties in id order) as the sorting path with every id kept."""
  import jax
  from trainers.serving.embedded.sampler import _sample

  rng = np.random.default_rng(0)
  logits = jnp.asarray(np.round(rng.normal(size=(16, 64)), 1), jnp.float32)  # rounded: ties
  keys = jax.vmap(jax.random.key)(jnp.arange(16, dtype=jnp.uint32))
  temp, ones, zeros = jnp.full((16,), 0.7), jnp.ones((16,)), jnp.zeros((16,))
  top_k = jnp.full((16,), -1, jnp.int32)
  draw = lambda filters: jax.vmap(lambda *a: _sample(*a, top_width=top_width, filters=filters))(
    logits, keys, temp, ones, top_k, zeros
  )
  fast, sorted_ = draw(False), draw(True)
  assert len(set(np.asarray(fast[0]).tolist())) > 4  # a real draw, not one token
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(sorted_)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weight_swap_changes_samples_without_recompiling(sampler):
  params = SamplingOptions(temperature=0.0, max_new_tokens=8, ignore_eos=True)
  before = sampler.generate(PROMPTS[:1], params)[0].output_ids
  compiled, original = sampler.num_compiled, sampler.params
  try:
    sampler.set_params(nnx.state(CausalLM(TINY, rngs=nnx.Rngs(9))))
    assert sampler.generate(PROMPTS[:1], params)[0].output_ids != before
    assert sampler.num_compiled == compiled
    with pytest.raises(ValueError, match="structure, shape or dtype"):
      sampler.set_params(nnx.state(CausalLM(dataclasses.replace(TINY, vocab_size=80), rngs=nnx.Rngs(0))))
  finally:
    sampler.set_params(original)


def test_bfloat16_sampler_measurably_differs_from_float32_trainer(tiny_checkpoint):
  f32 = load_hf_checkpoint(tiny_checkpoint)
  bf16 = Sampler(load_hf_checkpoint(tiny_checkpoint, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
  outs = bf16.generate(PROMPTS, SamplingOptions(temperature=1.0, max_new_tokens=16, seed=0, ignore_eos=True))
  diff = np.concatenate(
    [np.asarray(c.logprobs) - sequence_logprobs(f32, PROMPTS[c.prompt_index], c.output_ids) for c in outs]
  )
  assert 1e-4 < np.abs(diff).mean() < 0.05  # real but small: the mismatch MIS corrects


@pytest.mark.slow
def test_the_engine_unrolls_a_shallow_models_layers_and_decodes_the_same(tiny_checkpoint):
  """`GenerationEngine(layer_loop="auto")` unrolls the tiny model's 2 layers (the trainer's rule);
  in float32 the unrolled decoding gives the scanned one's tokens and log-probs bit for bit. In
  bfloat16 XLA rounds in other places (each layer fused on its own), so they differ at bfloat16's
  rounding: a real but small mismatch with float32 teacher forcing, as the scan's (the bound of
  `test_bfloat16_sampler_measurably_differs_from_float32_trainer`)."""
  from trainers.serving.embedded.generation import GenerationEngine

  f32 = load_hf_checkpoint(tiny_checkpoint)
  with pytest.raises(ValueError, match="layer_loop='loop'"):
    GenerationEngine(tiny_checkpoint, layer_loop="loop")
  options = SamplingOptions(temperature=1.0, max_new_tokens=16, seed=0, ignore_eos=True)
  out, diff = {}, {}
  for dtype, loop in (("float32", "auto"), ("float32", "scan"), ("bfloat16", "auto")):
    engine = GenerationEngine(tiny_checkpoint, dtype=dtype, layer_loop=loop, max_batch_size=8)
    engine.close()
    assert engine.layer_loop == (("unrolled", "2 layers <= 8") if loop == "auto" else ("scan", "configured"))
    out[dtype, loop] = engine.sampler.generate(PROMPTS, options)
    diff[dtype, loop] = np.concatenate(
      [np.asarray(c.logprobs) - sequence_logprobs(f32, PROMPTS[c.prompt_index], c.output_ids) for c in out[dtype, loop]]
    )
  for a, b in zip(out["float32", "auto"], out["float32", "scan"]):
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
  assert np.abs(diff["float32", "auto"]).max() < 1e-5
  assert 1e-4 < np.abs(diff["bfloat16", "auto"]).mean() < 0.05  # the bfloat16 mismatch MIS corrects, as scanned


def test_invalid_requests_raise(sampler):
  with pytest.raises(ValueError, match="empty"):
    sampler.generate([[]], SamplingOptions())
  with pytest.raises(ValueError, match="outside"):
    sampler.generate([[64]], SamplingOptions())
  with pytest.raises(ValueError, match="context length"):
    sampler.generate([[1, 2]], SamplingOptions(max_new_tokens=TINY.max_position_embeddings))
  for bad in (
    dict(temperature=-1.0),
    dict(top_p=0.0),
    dict(top_k=0),
    dict(min_p=1.5),
    dict(n=0),
    dict(max_new_tokens=-1),
  ):
    with pytest.raises(ValueError, match=next(iter(bad))):
      SamplingOptions(**bad)


@settings(max_examples=12, deadline=None)
@given(
  temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
  top_p=st.sampled_from([1.0, 0.9, 0.3]),
  top_k=st.sampled_from([-1, 1, 5]),
  min_p=st.sampled_from([0.0, 0.1]),
  seed=st.integers(0, 2**32 - 1),
  prompt=st.lists(st.integers(0, 63), min_size=1, max_size=16),
)
def test_property_logprobs_are_unrenormalised_teacher_forced(
  sampler, tiny_model, temperature, top_p, top_k, min_p, seed, prompt
):
  params = SamplingOptions(
    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_new_tokens=6, seed=seed, ignore_eos=True
  )
  (c,) = sampler.generate([prompt], params)
  assert len(c.output_ids) == 6
  want = sequence_logprobs(tiny_model, prompt, c.output_ids, temperature=temperature or 1.0)
  np.testing.assert_allclose(c.logprobs, want, atol=5e-5, rtol=0)


def numpy_support(logits, temperature, top_p, top_k, min_p):
  """The support SGLang's sampler keeps, from one row of logits, in float64 NumPy: sort by
  descending probability; drop rank >= top_k, tokens whose preceding cumulative mass (over the
  full sorted distribution) exceeds top_p, and p < min_p · p_max."""
  z = np.asarray(logits, np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  ps = p[order]
  before = np.cumsum(ps) - ps
  kept = [
    int(v)
    for r, (v, b, pv) in enumerate(zip(order, before, ps))
    if (top_k < 0 or r < top_k) and b <= top_p and pv >= min_p * ps[0]
  ]
  return kept, p


@pytest.mark.parametrize(
  "top_p,top_k,min_p", [(1.0, 5, 0.0), (0.6, 30, 0.0), (1.0, 30, 0.2), (0.8, 7, 0.05), (0.95, 20, 0.1)]
)
def test_sampling_masks_equal_the_support_from_the_logits(sampler, tiny_model, top_p, top_k, min_p):
  """The returned masks equal the support computed independently from the teacher-forced
  logits; the sampled token is inside; the behaviour log-prob is log(p_y / Σ_S p), the
  support's log-probs log(p_v / Σ_S p); the full-vocabulary log-probs are unchanged."""
  params = SamplingOptions(
    temperature=1.3,
    top_p=top_p,
    top_k=top_k,
    min_p=min_p,
    max_new_tokens=10,
    n=2,
    seed=7,
    ignore_eos=True,
    sampling_mask=True,
  )
  plain = sampler.generate(PROMPTS[:2], dataclasses.replace(params, sampling_mask=False))
  outs = sampler.generate(PROMPTS[:2], params)
  assert [c.output_ids for c in outs] == [c.output_ids for c in plain]  # masks change no sample
  for c in outs:
    prompt = PROMPTS[c.prompt_index]
    logits = sequence_logits(tiny_model, prompt + c.output_ids)[len(prompt) - 1 : -1]
    assert len(c.sampling_mask) == len(c.sampling_logprobs) == len(c.output_ids)
    for row, tok, mask, lp, support_lp in zip(
      logits, c.output_ids, c.sampling_mask, c.sampling_logprobs, c.sampling_mask_logprobs
    ):
      want, p = numpy_support(row, 1.3, top_p, top_k, min_p)
      assert mask == want
      assert tok in mask and len(mask) <= top_k
      mass = p[want].sum()
      np.testing.assert_allclose(lp, np.log(p[tok] / mass), atol=5e-5)
      np.testing.assert_allclose(support_lp, np.log(p[want] / mass), atol=5e-5)
  _check_against_oracle(tiny_model, PROMPTS, outs, 1.3, atol=5e-5)


def test_sampling_masks_when_top_k_reaches_the_vocabulary():
  """top_k >= vocab is "every token" (how a user asks for top-p or min-p alone, since masks need a
  finite top_k): the support width is bucketed to 128 but never past the vocabulary, here 96 (not
  a power of two). top_k 80 is past the largest bucket below 96 (64). Greedy, top-p, min-p and
  their mixes in one batch, each mask equal to the support from the logits."""
  model = CausalLM(dataclasses.replace(TINY, vocab_size=96), rngs=nnx.Rngs(3))
  rows = [
    (1.2, 96, 1.0, 0.0),
    (1.2, 96, 0.9, 0.0),
    (1.2, 96, 1.0, 0.05),
    (1.2, 80, 0.95, 0.02),
    (1.2, 500, 1.0, 0.0),
    (0.0, 96, 1.0, 0.0),
  ]  # temperature, top_k, top_p, min_p
  params = [
    SamplingOptions(
      temperature=t, top_k=k, top_p=p, min_p=m, max_new_tokens=4, seed=i, ignore_eos=True, sampling_mask=True
    )
    for i, (t, k, p, m) in enumerate(rows)
  ]
  outs = Sampler(model, max_batch_size=8).generate([PROMPTS[0]] * len(rows), params)
  for c, (t, k, p, m) in zip(outs, rows):
    logits = sequence_logits(model, PROMPTS[0] + c.output_ids)[len(PROMPTS[0]) - 1 : -1]
    for row, tok, mask, lp in zip(logits, c.output_ids, c.sampling_mask, c.sampling_logprobs):
      if t == 0.0:
        assert mask == [tok] and lp == 0.0
        continue
      want, probs = numpy_support(row, t, p, k, m)
      assert mask == want and tok in mask
      np.testing.assert_allclose(lp, np.log(probs[tok] / probs[want].sum()), atol=5e-5)
  assert len(outs[0].sampling_mask[0]) == 96  # top_k = vocab, nothing else: the whole vocabulary


def test_greedy_mask_is_the_token_with_log_prob_zero(sampler):
  (c,) = sampler.generate(
    PROMPTS[:1], SamplingOptions(temperature=0.0, max_new_tokens=5, ignore_eos=True, sampling_mask=True)
  )
  assert c.sampling_mask == [[t] for t in c.output_ids] and c.sampling_logprobs == [0.0] * 5
  with pytest.raises(ValueError, match="finite top_k"):
    SamplingOptions(top_p=0.9, sampling_mask=True)


def test_decoding_in_segments_and_a_swap_between_them(sampler, monkeypatch):
  """A batch decoded in segments draws what one call draws (ids and log-probs, bitwise); weights
  swapped between segments change only what comes after, and each row records where it switched."""
  from trainers.serving.embedded import sampler as sampler_mod

  monkeypatch.setattr(sampler_mod, "SEGMENT_STEPS", 4)
  params = SamplingOptions(max_new_tokens=14, seed=3, ignore_eos=True, n=2)
  whole = sampler.generate(PROMPTS, params, version="a")
  segmented = sampler.generate(PROMPTS, params, version="a", between=lambda: None)
  assert [(c.output_ids, c.logprobs, c.versions) for c in whole] == [
    (c.output_ids, c.logprobs, c.versions) for c in segmented
  ]
  assert all(c.versions == [("a", 0)] for c in whole)
  other = nnx.state(CausalLM(TINY, rngs=nnx.Rngs(9)))
  calls = []

  def swap():
    calls.append(1)
    return (other, "b") if len(calls) == 2 else None  # after the second segment: 8 tokens

  swapped = sampler.generate(PROMPTS, params, version="a", between=swap)
  for c, w in zip(swapped, whole):
    assert c.versions == [("a", 0), ("b", 8)]
    assert c.output_ids[:8] == w.output_ids[:8] and c.logprobs[:8] == w.logprobs[:8]
    assert c.logprobs[8:] != w.logprobs[8:]
  assert sampler.params is not other  # the sampler's own weights are untouched by a swap


def test_top_logprobs_are_the_teacher_forced_head(sampler, tiny_model):
  """`top_logprobs_num` k (SGLang's `output_top_logprobs`): each output token's k most likely ids and
  their full-vocabulary `log_softmax(logits / T)`, by descending probability, as the full forward's;
  the sampled token's log-prob is among them exactly when its id is."""
  params = SamplingOptions(temperature=0.7, top_k=20, max_new_tokens=6, ignore_eos=True, seed=3, top_logprobs_num=3)
  outs = sampler.generate(PROMPTS[:2], params)
  plain = sampler.generate(PROMPTS[:2], dataclasses.replace(params, top_logprobs_num=0))
  inside = 0
  for c, p in zip(outs, plain):
    assert c.output_ids == p.output_ids and p.top_logprobs is None  # asking for the head changes no draw
    logits = sequence_logits(tiny_model, PROMPTS[c.prompt_index] + c.output_ids)
    for t, (row, tok, lp) in enumerate(zip(c.top_logprobs, c.output_ids, c.logprobs)):
      z = logits[len(PROMPTS[c.prompt_index]) - 1 + t] / 0.7
      log_p = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
      want = np.argsort(-log_p, kind="stable")[:3]
      assert [i for _, i in row] == want.tolist()
      np.testing.assert_allclose([v for v, _ in row], log_p[want], atol=5e-5)
      if tok in want:
        inside += 1
        assert abs(dict((i, v) for v, i in row)[tok] - lp) < 1e-6
  assert inside > 0
  with pytest.raises(ValueError, match="top_logprobs_num"):
    SamplingOptions(top_logprobs_num=-1)
