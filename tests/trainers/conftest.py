"""Fixtures shared by the model, sampler and server tests: tiny checkpoints and a jitted
teacher-forced log-prob oracle."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.models import PRESETS, CausalLM, init_checkpoint, teacher_forced_logprobs

# Wider than HF's 0.02 so the tiny models' next-token distributions are far from uniform and
# sampling filters and log-prob comparisons have something to bite on.
TINY = dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
  return CausalLM(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny-qwen3")
  init_checkpoint(path, config=TINY, seed=0)
  return str(path)


_tf = nnx.jit(teacher_forced_logprobs, static_argnames="temperature")
_logits = nnx.jit(lambda model, ids, pos, seg: model(ids, pos, seg))
ORACLE_LEN = 64  # one padded length, so the oracle compiles once per model


def _padded(seq):
  ids = np.zeros((1, ORACLE_LEN), np.int32)
  ids[0, :len(seq)] = seq
  seg = np.full((1, ORACLE_LEN), -1, np.int32)
  seg[0, :len(seq)] = 0
  return jnp.asarray(ids), jnp.arange(ORACLE_LEN, dtype=jnp.int32)[None], jnp.asarray(seg)


def sequence_logprobs(model, prompt, output, *, temperature=1.0) -> np.ndarray:
  """Teacher-forced `log_softmax(logits / T)[y_t]` of each output token `y_t` after
  `prompt + output[:t]` (full forward, no cache)."""
  seq = list(prompt) + list(output)
  ids, pos, seg = _padded(seq)
  targets = jnp.roll(ids, -1, axis=1)
  lp = _tf(model, ids, pos, seg, targets, temperature=temperature)
  return np.asarray(lp[0, len(prompt) - 1:len(seq) - 1])


def sequence_logits(model, seq) -> np.ndarray:
  """Full-forward float32 logits `[len(seq), vocab]`."""
  ids, pos, seg = _padded(seq)
  return np.asarray(_logits(model, ids, pos, seg)[0, :len(seq)])
