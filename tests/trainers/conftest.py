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
  ids[0, : len(seq)] = seq
  seg = np.full((1, ORACLE_LEN), -1, np.int32)
  seg[0, : len(seq)] = 0
  return jnp.asarray(ids), jnp.arange(ORACLE_LEN, dtype=jnp.int32)[None], jnp.asarray(seg)


def sequence_logprobs(model, prompt, output, *, temperature=1.0) -> np.ndarray:
  """Teacher-forced `log_softmax(logits / T)[y_t]` of each output token `y_t` after
  `prompt + output[:t]` (full forward, no cache)."""
  seq = list(prompt) + list(output)
  ids, pos, seg = _padded(seq)
  targets = jnp.roll(ids, -1, axis=1)
  lp = _tf(model, ids, pos, seg, targets, temperature=temperature)
  return np.asarray(lp[0, len(prompt) - 1 : len(seq) - 1])


def sequence_logits(model, seq) -> np.ndarray:
  """Full-forward float32 logits `[len(seq), vocab]`."""
  ids, pos, seg = _padded(seq)
  return np.asarray(_logits(model, ids, pos, seg)[0, : len(seq)])


class StepTraces:
  """Counts the traces of the trainer's jitted step functions (`trainers.learner.step._jit`), per
  shape bucket (the arrays' shapes and dtypes; Python values by type only): a function must trace
  once per bucket and never again, so a Python value that changes between calls as a static
  argument (a recompile every call) fails. This is the trace counter where chex cannot reach: the
  trainer's buckets vary with each step's samples, and `chex.assert_max_traces` bounds a function's total
  (keyed by its source, so not per bucket)."""

  def __init__(self):
    self.traces: dict[str, list] = {}  # function name -> the signatures it traced, in order
    self.calls: dict[str, int] = {}

  def jit(self, fn, **kwargs):
    import jax

    name = fn.__name__

    def traced(*args):
      # A shape bucket is the arrays' shapes and dtypes: a Python value (a static argument) that
      # changes between calls of one bucket recompiles every time, so it does not make a new one.
      key = str(
        jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else type(x).__name__, args)
      )
      seen = self.traces.setdefault(name, [])
      assert key not in seen, (
        f"{name} traced again for shapes it had compiled (a Python value that changes "
        f"is static: it recompiles every call): {key[:300]}"
      )
      seen.append(key)
      return fn(*args)

    compiled = jax.jit(traced, **kwargs)

    def call(*args):
      self.calls[name] = self.calls.get(name, 0) + 1
      return compiled(*args)

    return call

  def check(self, *names, reused=("train",)):
    """Each of `names` traced each signature once; those in `reused` also ran more often than
    they traced (a compiled program was reused, so the guard was exercised)."""
    for name in names:
      sigs = self.traces.get(name, [])
      assert sigs, f"{name} never traced"
      assert len(sigs) == len(set(sigs)), f"{name} traced a signature twice"
      if name in reused:
        assert self.calls[name] > len(sigs), f"{name}: {self.calls[name]} calls, {len(sigs)} traces"


@pytest.fixture
def step_traces(monkeypatch):
  from trainers.learner import step
  from trainers.app import build

  traces = StepTraces()
  monkeypatch.setattr(step, "_jit", traces.jit)
  # Step functions another test built for the same setup would be reused without tracing: build anew.
  build.step_functions.cache_clear()
  yield traces
  build.step_functions.cache_clear()  # (none built through the counter outlives the test)
