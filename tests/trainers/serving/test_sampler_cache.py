"""The sampler's KV cache layout: left-padded rows aligned in one cache equal the right-padded
full forward, the decode program updates the cache in place (no copy of it), finished rows leave
the batch (continuous batching) without changing anyone's tokens, and a stream of requests
builds a bounded set of programs."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.models import CausalLM
from trainers.serving.embedded.sampler import Sampler, SamplingOptions

from conftest import TINY, sequence_logits

PROMPTS = [[1, 5, 9], [2, 7, 7, 7, 7, 7, 7, 12, 40], [3] + list(range(10, 25))]  # 3, 9 and 16 tokens
FED = [[4, 8], [11, 6], [30, 2]]  # tokens fed after each prompt, one decode step each


@nnx.jit(static_argnames="window")
def _decode(model, ids, cache, slot, start, *, window):
  return model.decode(ids, cache, slot=slot, start=start, window=window)


def _cached_logits(model, prompts, fed, prompt_len):
  """Logits `[row][token]` at every real token of `prompt + fed`, the rows left-padded into one
  cache of `prompt_len + len(fed[0])` slots: a prefill, then one decode step per fed token."""
  rows = len(prompts)
  start = np.array([prompt_len - len(p) for p in prompts], np.int32)
  ids = np.zeros((rows, prompt_len), np.int32)
  for b, p in enumerate(prompts):
    ids[b, start[b] :] = p
  cache = model.init_cache(rows, prompt_len + len(fed[0]))
  logits, cache = _decode(model, ids, cache, jnp.int32(0), start, window=prompt_len)
  per_row = [np.asarray(logits[b, start[b] :]) for b in range(rows)]
  for t in range(len(fed[0])):
    step, cache = _decode(
      model,
      np.array([[f[t]] for f in fed], np.int32),
      cache,
      jnp.int32(prompt_len + t),
      start,
      window=prompt_len + len(fed[0]),
    )
    per_row = [np.concatenate([r, np.asarray(step[b])]) for b, r in enumerate(per_row)]
  return per_row


def test_left_padded_cache_equals_the_right_padded_full_forward(tiny_model):
  """Per row, the logits of the aligned (left-padded) cached forward, prefill and decode steps,
  equal the full forward of the row alone, right-padded (`sequence_logits`)."""
  batched = _cached_logits(tiny_model, PROMPTS, FED, 16)
  for b, (p, f) in enumerate(zip(PROMPTS, FED)):
    np.testing.assert_allclose(batched[b], sequence_logits(tiny_model, p + f), atol=2e-5, rtol=0)


def test_a_window_outside_the_cache_is_refused(tiny_model):
  cache = tiny_model.init_cache(1, 8)
  with pytest.raises(ValueError, match="window 9 outside the cache's 1..8 slots"):
    tiny_model.decode(jnp.ones((1, 1), jnp.int32), cache, slot=jnp.int32(0), start=jnp.zeros((1,), jnp.int32), window=9)


@pytest.fixture(scope="module")
def sampler(tiny_model):
  """A bfloat16 engine (the default's dtype: its cache is stored as bits, see `CausalLM.init_cache`)."""
  return Sampler(CausalLM(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), max_batch_size=8)


# Eight rows, seven of which finish after 2 tokens (the batch the next tests share: one set of programs).
SHORT = SamplingOptions(max_new_tokens=2, seed=5, ignore_eos=True)
LONG = SamplingOptions(max_new_tokens=40, seed=7, ignore_eos=True)
ROWS = [[1, 2 + i] for i in range(8)]


def _spy(sampler, monkeypatch):
  """Records `(batch rows, window)` of each decoding call."""
  calls, decode = [], sampler._decode
  monkeypatch.setattr(
    sampler,
    "_decode",
    lambda params, state, *a, **k: (
      calls.append((state["logits"].shape[0], k["window"])) or decode(params, state, *a, **k)
    ),
  )
  return calls


@pytest.mark.slow
@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_the_decode_program_updates_the_cache_in_place(sampler, layer_loop):
  """In the compiled decoding loop, every instruction that yields a cache-shaped buffer is an
  in-place `dynamic-update-slice` (or a fusion around one), a parameter or a tuple element: no
  copy, conversion or scatter of the cache per step (the state is donated; a bfloat16 cache is
  stored as bits, which XLA:CPU updates in place) — with the layers scanned or unrolled (the
  engine's `layer_loop`)."""
  if layer_loop != "scan":
    sampler = Sampler(CausalLM(TINY, dtype=jnp.bfloat16, layer_loop=layer_loop, rngs=nnx.Rngs(0)), max_batch_size=8)
  rows, prompt_len, num_steps = 8, 16, 64
  ones = np.ones((rows,), np.float32)
  max_new, start = np.full((rows,), num_steps, np.int32), np.zeros((rows,), np.int32)
  state = sampler._prefill(
    sampler.params, np.ones((rows, prompt_len), np.int32), start, ones, max_new, num_steps=num_steps
  )
  args = (
    sampler.params,
    state,
    start,
    np.zeros((rows,), np.uint32),
    ones,
    ones,
    np.full((rows,), -1, np.int32),
    np.zeros((rows,), np.float32),
    max_new,
    np.full((rows, 4), -1, np.int32),
    np.int32(num_steps),
  )
  hlo = sampler._decode.lower(*args, window=32).compile().as_text()
  shape = ",".join(map(str, state["cache"].k.shape))
  ops = re.findall(r"= \w+\[" + shape + r"\]\{[^}]*\} ([\w-]+)\(", hlo)
  assert (
    "input_output_alias" in hlo
    and ops
    and set(ops) <= {"parameter", "get-tuple-element", "dynamic-update-slice", "fusion"}
  )
  fused = re.findall(r"\w+\[" + shape + r"\]\{[^}]*\} (copy|convert|scatter|select)\(", hlo)
  assert fused == []


@pytest.mark.slow
def test_finished_rows_leave_the_batch_and_change_no_tokens(sampler, monkeypatch):
  """Seven rows of eight finish after 2 tokens: at the first window's end (16 steps) the batch
  shrinks to the one running row, whose tokens and log-probs are those of the row alone; the
  same stream again (other seeds) builds no program."""
  calls = _spy(sampler, monkeypatch)
  before = sampler.num_compiled
  outs = sampler.generate(ROWS, [SHORT] * 7 + [LONG])
  assert calls == [(8, 32), (1, 64)]  # the row's 40th token ends the second window's loop
  assert [c.finish_reason for c in outs] == [("length", 2)] * 7 + [("length", 40)]
  alone = sampler.generate(ROWS[7:], LONG)[0]
  assert (alone.output_ids, alone.logprobs) == (outs[7].output_ids, outs[7].logprobs)
  first = sampler.generate(ROWS[:1], SHORT)[0]
  assert (first.output_ids, first.logprobs) == (outs[0].output_ids, outs[0].logprobs)
  built = sampler.num_compiled
  # At most: a prefill and a decoder for 8 rows, the compaction, and per cache of 1 row (80 slots;
  # 32 for the short row alone) a prefill and its windows' decoders (2; 1).
  assert built - before <= 8
  sampler.generate(ROWS, [dataclasses.replace(SHORT, seed=50)] * 7 + [dataclasses.replace(LONG, seed=70)])
  sampler.generate(ROWS[7:], dataclasses.replace(LONG, seed=71))
  assert sampler.num_compiled == built


@pytest.mark.slow
def test_rows_that_all_stop_early_end_the_decoding(sampler, monkeypatch):
  """Greedy rows that all hit a stop token by their 2nd token: one decoding call, not one per window."""
  greedy = SamplingOptions(temperature=0.0, max_new_tokens=40, ignore_eos=True)
  probe = sampler.generate(ROWS, [dataclasses.replace(greedy, max_new_tokens=2)] * 7 + [greedy])
  stopping = [SamplingOptions(temperature=0.0, max_new_tokens=40, stop_token_ids=(c.output_ids[1],)) for c in probe]
  calls = _spy(sampler, monkeypatch)
  outs = sampler.generate(ROWS, stopping)
  assert calls == [(8, 32)]
  assert [c.output_ids for c in outs] == [c.output_ids[: len(o.output_ids)] for c, o in zip(probe, outs)]
  assert all(c.finish_reason == ("stop", c.output_ids[-1]) and len(c.output_ids) <= 2 for c in outs)
