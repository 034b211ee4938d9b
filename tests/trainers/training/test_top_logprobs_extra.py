"""The sampler's top-k head as per-token extras (score centering, contract §6.6): asked for with
`rollout.sampling.top_logprobs_num`, parsed from SGLang's `output_top_logprobs` (each malformed form
rejected with a reason), recorded and read back, packed into `PackedBatch.rollout_topk_logprobs` and
`ModelInputs.extra`, and the config's cross-key errors."""

import numpy as np
import pytest

import mis_jax
from trainers.models import PRESETS
from trainers.training import checks, extras as extras_lib
from trainers.training.batch import build_step_batch
from trainers.training.rollout import Sample, ServerError, validate_sample

from test_train import make_cfg

K = 3


def _reply(ids, top=None, **meta):
  top = [[[-0.2 - j, (t + j) % 50, None] for j in range(K)] for t in ids] if top is None else top
  return {"text": "", "output_ids": list(ids), "meta_info": {
      "finish_reason": {"type": "length", "length": len(ids)}, "weight_version": "0",
      "output_token_logprobs": [[-0.5, t, None] for t in ids], "output_top_logprobs": top, **meta}}


@pytest.fixture
def active(tmp_path):
  cfg = make_cfg(tmp_path, rollout={"sampling": {"top_logprobs_num": K}})
  extras = extras_lib.active(cfg.rollout, PRESETS["tiny-qwen3"])
  assert [e.name for e in extras] == ["top_logprobs", "top_logprob_ids"]
  assert all(e.request == {"top_logprobs_num": K} for e in extras)
  return extras


def test_parsed_recorded_and_packed(active):
  ids = [(7, 8, 9), (11, 12)]
  samples = []
  for k, response in enumerate(ids):
    error, parsed = validate_sample(_reply(response), extras=active, prompt_len=2)
    assert error is None
    np.testing.assert_array_equal(parsed["extras"]["top_logprob_ids"], [[(t + j) % 50 for j in range(K)] for t in response])
    np.testing.assert_allclose(parsed["extras"]["top_logprobs"], [[-0.2 - j for j in range(K)]] * len(response), rtol=1e-6)
    for e in active:  # the record column round-trips
      value = parsed["extras"][e.name]
      back = e.from_record(e.to_record(value), 2, len(response))
      assert e.check_record(e.to_record(value), 2, len(response)) is None and back.dtype == e.dtype
      np.testing.assert_array_equal(back, value)
    samples.append(Sample(k, (1, 2), response, tuple(parsed["logprobs"]), "length", "", "0", extras=parsed["extras"]))
  sb = build_step_batch(samples, np.array([1.0, 0.0], np.float32), np.array([1.0, -1.0], np.float32), np.arange(2),
                        num_segments=2, row_len=8, tokens_per_micro_batch=8, batch_devices=1, extras=active)
  topk = sb.batch.rollout_topk_logprobs
  assert topk.shape == sb.layout.shape + (K,)
  # response token j of a sample sits at input position len(prompt) - 1 + j, as its log-prob
  rows = sb.packing.unpack(topk.reshape(sb.layout.num_rows, sb.layout.row_len, K))
  got = [r[m] for r, m in zip(rows, sb.per_sequence(sb.batch.loss_mask))]
  np.testing.assert_allclose(got[0], [[-0.2 - j for j in range(K)]] * 3, rtol=1e-6)
  inputs = extras_lib.model_inputs(active, sb.extras)
  assert set(inputs) == {"extra"} and inputs["extra"]["top_logprob_ids"].shape == sb.layout.shape + (K,)


@pytest.mark.parametrize("top,reason", [
    ([[[-0.1, 1, None]] * K] * 2, "length mismatch: 3 output_ids but 2 output_top_logprobs"),
    ([[[-0.1, 1, None]] * (K - 1)] * 3, "output_top_logprobs[0] has 2 entries, expected 3"),
    ([[[-0.1, 10**9, None]] * K] * 3, "output_top_logprobs[0][0] is not [logprob, token_id in [0, "),
    ([[[None, 1, None]] * K] * 3, "invalid top log-prob None at output_top_logprobs[0][0]"),
    ([[[0.5, 1, None]] * K] * 3, "invalid top log-prob 0.5"),
])
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
    checks.check_config(make_cfg(tmp_path, **base))
  with pytest.raises(mis_jax.ConfigError, match="score_centering with sampling replay"):
    checks.check_config(make_cfg(tmp_path, **base, rollout={"sampling": {"top_logprobs_num": 2, "top_k": 5,
                                                                          "temperature": 1.0}}))
  with pytest.raises(mis_jax.ConfigError, match="top_logprobs_num 100 exceeds the model's vocabulary"):
    checks.check_config(make_cfg(tmp_path, **base, rollout={"sampling": {"top_logprobs_num": 100}}))


@pytest.mark.slow
def test_the_centred_step_on_a_mesh_equals_one_device():
  """The trainer's step with score centering (REINFORCE + IS, the top-k ids' log-probs gathered in the
  chunked pass under the head's shard_map) on a 2×4 mesh equals one device: parameters, optimiser
  state and every metric after one update, the centring metrics among them."""
  import dataclasses
  import types

  import jax
  from flax import nnx

  from trainers.training import parallel, step as step_lib
  from trainers.training.config import TrainSection
  from trainers.models import CausalLM

  tiny = dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.3)
  loss_cfg = mis_jax.LossConfig(use_tis=True, use_rollout_logprobs=True, denominator="original", score_centering=True)
  extras = (extras_lib.SamplerTopLogprobs(K, tiny.vocab_size), extras_lib.SamplerTopIds(K, tiny.vocab_size))
  rng = np.random.default_rng(0)
  samples = []
  for i in range(16):
    p, r = int(rng.integers(3, 7)), int(rng.integers(1, 12))
    head = np.sort(rng.dirichlet(np.ones(K + 1), r)[:, :K], axis=-1)[:, ::-1]
    samples.append(types.SimpleNamespace(
        prompt_ids=rng.integers(3, 64, p).tolist(), response_ids=rng.integers(3, 64, r).tolist(),
        rollout_logprobs=(-rng.uniform(0.5, 3.0, r)).astype(np.float32),
        extras={"top_logprobs": np.log(head).astype(np.float32),
                "top_logprob_ids": np.stack([rng.permutation(tiny.vocab_size)[:K] for _ in range(r)]).astype(np.int32)}))
  rewards = rng.uniform(0, 1, 16).astype(np.float32)
  groups = np.arange(16) // 4
  adv = np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=4))
  sb = build_step_batch(samples, rewards, adv, groups, num_segments=16, row_len=32, tokens_per_micro_batch=32,
                        batch_devices=8, extras=extras)
  optim = TrainSection(learning_rate=1e-2, adam_eps=1e-4, max_grad_norm=1.0, steps=10)

  def run(shape):
    mesh = parallel.make_mesh(parallel.ParallelSection(*shape), jax.devices()[:int(np.prod(shape))])
    fns = step_lib.build_step_functions(tiny, mesh, loss_cfg, optim, temperature=0.9, logprob_chunk=8,
                                        attention="blocked", remat="full")
    params = jax.device_put(nnx.state(CausalLM(tiny, rngs=nnx.Rngs(0)), nnx.Param), fns.param_shardings)
    put = lambda x: jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x)))
    inputs = step_lib.ModelInputs(put(sb.input_ids), put(sb.positions), put(sb.targets),
                                  **extras_lib.model_inputs(extras, sb.extras, put))
    batch = jax.tree.map(put, sb.batch)
    correction, _ = fns.prepare(batch)
    params, opt_state, metrics = fns.train(params, fns.init_opt_state(params), inputs, batch, correction)
    return jax.tree.map(np.asarray, (params, opt_state)), {k: float(v) for k, v in metrics.items()}

  (one, m1), (eight, m8) = run((1, 1, 1)), run((2, 4, 1))
  assert m1.keys() == m8.keys() and m1["score_centering_drift"] > 0
  for k in m1:
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-4, err_msg=k)
  for a, b in zip(jax.tree.leaves(eight), jax.tree.leaves(one)):
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4 * scale + 1e-9)
