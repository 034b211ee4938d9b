"""Weight-only quantised rollouts: the kernels against a NumPy oracle, the quantised engine's
log-probs against a teacher-forced forward of the same quantised weights (the mismatch is the
quantisation, not a bug), re-quantisation on weight updates, the mismatch ordering on a fixed
batch, and bad input rejected before anything starts."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from trainers.serving.embedded import server
from trainers.serving.embedded.generation import GenerationEngine
from trainers.models import init_checkpoint, load_hf_checkpoint
from trainers.models.quantize import quantize_kernel
from trainers.serving.embedded.sampler import SamplingOptions

from conftest import TINY, sequence_logprobs

PROMPTS = [[1, 5, 9, 14], [1, 30, 31], [1, 7, 7, 7, 7, 12, 40]]


def _oracle(w, method):
  """Per-output-channel symmetric quantisation, one channel at a time."""
  w = np.asarray(w, np.float64)
  out = np.empty_like(w)
  flat_w, flat_o = w.reshape(-1, *w.shape[-2:]), out.reshape(-1, *w.shape[-2:])
  for b in range(flat_w.shape[0]):
    for j in range(w.shape[-1]):
      col = flat_w[b, :, j].astype(np.float32)
      amax = np.abs(col).max()
      s = np.float32(amax / (127.0 if method == "int8" else 448.0)) if amax > 0 else np.float32(1)
      if method == "int8":
        q = np.clip(np.round(col / s), -127, 127)
      else:
        q = (col / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
      flat_o[b, :, j] = q * s
  return out.astype(np.float32)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_kernel_matches_oracle(method):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(2, 24, 6)).astype(np.float32) * rng.uniform(0.01, 3, size=(1, 1, 6)).astype(np.float32)
  w[1, :, 2] = 0.0  # an all-zero channel stays zero
  got = quantize_kernel(w, method)
  assert got.dtype == np.float32 and got.shape == w.shape
  np.testing.assert_allclose(got, _oracle(w, method), rtol=1e-6, atol=0)
  assert np.all(got[1, :, 2] == 0)
  # The channel maximum is representable exactly (127·s, 448·s); the rest is rounded.
  np.testing.assert_allclose(np.abs(got).max(axis=-2), np.abs(w).max(axis=-2), rtol=1e-6)
  rel = np.abs(got - w).max() / np.abs(w).max()
  assert 0 < rel < (0.5 / 127 + 1e-6 if method == "int8" else 1 / 16 + 1e-6)


def test_bad_method_and_shape():
  with pytest.raises(ValueError, match="int8, fp8"):
    quantize_kernel(np.ones((2, 2)), "int4")
  with pytest.raises(ValueError, match="kernel"):
    quantize_kernel(np.ones(3), "int8")


def _quantized_model(path, method):
  """The oracle's served model: float32 checkpoint weights, every Linear kernel quantised."""
  model = load_hf_checkpoint(path)
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if p[-1] == "kernel":
      var.set_value(jnp.asarray(_oracle(np.asarray(var.get_value()), method)))
  return model


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny-qwen3-b")
  init_checkpoint(path, config=TINY, seed=1)
  return str(path)


def test_quantized_engine_logprobs_are_teacher_forced_quantized_weights(tiny_checkpoint, second_checkpoint):
  engine = GenerationEngine(tiny_checkpoint, dtype="float32", quantize="fp8", max_batch_size=8)
  try:
    params = SamplingOptions(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=3)
    for path in (tiny_checkpoint, second_checkpoint):
      if path == second_checkpoint:  # a weight update is quantised again
        ok, message = engine.update_weights_from_disk(path, "1")
        assert ok, message
      outs = engine.sampler.generate(PROMPTS, params)
      quantized, plain = _quantized_model(path, "fp8"), load_hf_checkpoint(path)
      gaps = []
      for c in outs:
        prompt = PROMPTS[c.prompt_index]
        np.testing.assert_allclose(c.logprobs, sequence_logprobs(quantized, prompt, c.output_ids), atol=5e-5, rtol=0)
        gaps.append(np.abs(np.array(c.logprobs) - sequence_logprobs(plain, prompt, c.output_ids)).max())
      assert max(gaps) > 1e-3  # ... and the unquantised weights give other log-probs
  finally:
    engine.close()


def _k3(o, q):
  r = np.asarray(o, np.float64) - np.asarray(q, np.float64)
  return float(np.mean(np.exp(r) - r - 1)), float(np.mean(np.abs(r)))


def test_mismatch_grows_with_coarser_weights_on_a_fixed_batch(tiny_checkpoint):
  """Same token sequences, scored teacher-forced by each engine's served model and by the
  float32 trainer: mis_k3_kl and |o - q| order fp32 < bf16 < int8 < fp8. (The engine's
  sampler reports exactly these teacher-forced log-probs: the test above.)"""
  rng = np.random.default_rng(0)
  seqs = [[1] + rng.integers(3, TINY.vocab_size, size=int(n)).tolist() for n in (12, 20, 30, 40)]
  trainer = load_hf_checkpoint(tiny_checkpoint)
  o = np.concatenate([sequence_logprobs(trainer, s[:1], s[1:]) for s in seqs])
  k3 = {}
  for name, dtype, quantize in (
    ("fp32", "float32", "none"),
    ("bf16", "bfloat16", "none"),
    ("int8", "bfloat16", "int8"),
    ("fp8", "bfloat16", "fp8"),
  ):
    engine = GenerationEngine(tiny_checkpoint, dtype=dtype, quantize=quantize)
    engine.close()
    served = engine.sampler.served_model()
    k3[name] = _k3(o, np.concatenate([sequence_logprobs(served, s[:1], s[1:]) for s in seqs]))
  assert k3["fp32"][0] < 1e-9
  assert k3["fp32"][0] < k3["bf16"][0] < k3["int8"][0] < k3["fp8"][0]
  assert k3["fp32"][1] < k3["bf16"][1] < k3["int8"][1] < k3["fp8"][1]


def test_bad_quantize_is_refused_before_anything_starts(tiny_checkpoint):
  with pytest.raises(SystemExit) as e:
    server.main(["--model-path", tiny_checkpoint, "--quantize", "int4"])
  assert e.value.code == 2
  with pytest.raises(ValueError, match="quantize must be one of none, int8, fp8, got 'int4'"):
    server.EmbeddedServer(tiny_checkpoint, quantize="int4")  # raises before a process starts
  with pytest.raises(ValueError, match="quantize must be one of"):
    GenerationEngine(tiny_checkpoint, quantize="int4")


def test_trainer_config_key():
  from trainers.config import TrainConfig
  import mis_jax

  assert (
    TrainConfig.from_dict({"rollout": {"placement": {"server_quantize": "fp8"}}}).rollout.placement.server_quantize
    == "fp8"
  )
  with pytest.raises(mis_jax.ConfigError, match="rollout.placement.server_quantize has invalid value 'int4'"):
    TrainConfig.from_dict({"rollout": {"placement": {"server_quantize": "int4"}}})
