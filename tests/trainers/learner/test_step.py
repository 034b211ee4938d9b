"""The training step at scale: on meshes (8), (2, 4) and (2, 2, 2) of simulated CPU devices the
whole step (parameters, optimiser state and every metric after 1 and 3 updates) equals the
single-device step (on (2, 4) with score centering); declared shardings hold; 1 micro-batch == 4 micro-batches; the
chunked
log-prob path equals full logits; bf16 compute stays close to float32; the mesh config is
validated; the model's HF weights load straight into their shards."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mis_jax
from trainers.rollout import extras as extras_lib
from trainers.runtime import parallel
from trainers.learner import step as step_lib
from trainers.learner.batch import build_step_batch, plan_layout
from trainers.config import TrainSection
from trainers.models import PRESETS, CausalLM, init_checkpoint, load_hf_checkpoint
from trainers.models.hf_io import abstract_model

TINY = dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.3)
MIS = mis_jax.MISConfig(
  use_rs=True,
  tis_mode="mask",
  tis_lower_bound=0.5,
  tis_upper_bound=2.0,
  rs_veto_threshold=1e-4,
  tis_batch_normalize=True,
)
ALGORITHMS = {
  "ppo": mis_jax.LossConfig(),
  "decoupled_ppo": mis_jax.LossConfig(use_tis=True, mis=MIS),
  "reinforce_is": mis_jax.LossConfig(use_tis=True, use_rollout_logprobs=True, denominator="original"),
  # score centering (contract §6.6): the sampler's top-k ids' log-probs gathered in the sharded head's chunks
  "reinforce_is_centred": mis_jax.LossConfig(
    use_tis=True, use_rollout_logprobs=True, denominator="original", score_centering=True
  ),
}
TOP_K = 3
TOP_K_EXTRAS = (extras_lib.SamplerTopLogprobs(TOP_K, TINY.vocab_size), extras_lib.SamplerTopIds(TOP_K, TINY.vocab_size))
MESHES = {"8": (1, 8, 1), "2x4": (2, 4, 1), "2x2x2": (2, 2, 2)}
ROW_LEN = 32
# Adam's first update is lr·g/(|g| + eps): with eps = 1e-8 an entry whose gradient is rounding
# noise (~1e-9, reduction order differs across devices) moves by ±lr either way. eps = 1e-4
# keeps that amplification (lr·δg/eps) below 1e-6; the moments themselves are eps-free.
OPTIM = TrainSection(learning_rate=1e-2, adam_eps=1e-4, max_grad_norm=1.0, steps=10)


def _samples(num=24, seed=0):
  """Rollout-like samples: prompts of 3-6 tokens, responses of 1-14 (a length-1 response
  included), rollout log-probs a perturbation of anything; a sampler's top-k head per response token
  (descending log-probs of distinct ids, a tail of real mass), packed only for score centering."""
  rng, top = np.random.default_rng(seed), np.random.default_rng(seed + 1)  # the heads: their own stream
  out = []
  for i in range(num):
    p, r = int(rng.integers(3, 7)), 1 if i == 0 else int(rng.integers(1, 15))
    head = np.sort(top.dirichlet(np.ones(TOP_K + 1), r)[:, :TOP_K], axis=-1)[:, ::-1]
    out.append(
      types.SimpleNamespace(
        prompt_ids=rng.integers(3, 64, p).tolist(),
        response_ids=rng.integers(3, 64, r).tolist(),
        rollout_logprobs=(-rng.uniform(0.5, 5.0, r)).astype(np.float32),
        extras={
          "top_logprobs": np.log(head).astype(np.float32),
          "top_logprob_ids": np.stack([top.permutation(TINY.vocab_size)[:TOP_K] for _ in range(r)]).astype(np.int32),
        },
      )
    )
  return out


def _step_batch(tokens_per_micro_batch, batch_devices, samples=None, extras=()):
  samples = samples or _samples()
  rng = np.random.default_rng(1)
  rewards = rng.uniform(0, 1, len(samples)).astype(np.float32)
  groups = np.arange(len(samples)) // 4
  adv = np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=int(groups.max()) + 1))
  return build_step_batch(
    samples,
    rewards,
    adv,
    groups,
    num_segments=len(samples),
    row_len=ROW_LEN,
    tokens_per_micro_batch=tokens_per_micro_batch,
    batch_devices=batch_devices,
    extras=extras,
  )


def _functions(mesh, loss_cfg, chunk=8):
  """The trainer's step functions (its default blocked attention and full remat)."""
  return step_lib.build_step_functions(
    TINY, mesh, loss_cfg, OPTIM, temperature=0.9, logprob_chunk=chunk, attention="blocked", remat="full"
  )


def _run(mesh, loss_cfg, sb, steps, fns=None, params=None):
  """`steps` updates on one step batch from the same initial weights; returns host copies of
  (params, opt_state) after each update and the per-update metrics."""
  fns = fns or _functions(mesh, loss_cfg)
  init = nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param) if params is None else params
  params = jax.device_put(init, fns.param_shardings)
  opt_state = fns.init_opt_state(params)
  inputs, batch = _place(mesh, sb)
  states, history = [], []
  for _ in range(steps):
    b = batch
    if loss_cfg.needs_old_logprobs:
      b = b.replace(old_logprobs=fns.logprobs(params, inputs, b.segment_ids).logprobs)
    correction, step_metrics = fns.prepare(b)
    params, opt_state, metrics = fns.train(params, opt_state, inputs, b, correction)
    history.append({k: float(v) for k, v in {**metrics, **step_metrics}.items()})
    states.append(jax.tree.map(np.array, (params, opt_state)))
  return states, history, (params, opt_state, fns)


def _place(mesh, sb):
  """The step batch's model inputs and packed batch on `mesh` (rows split over the batch axes)."""
  put = lambda x: jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x)))
  support = sb.extras.get("sampling_mask")  # the packed supports, with sampling replay
  top_ids = sb.extras.get("top_logprob_ids")  # the sampler's top-k ids, with score centering
  inputs = step_lib.ModelInputs(
    put(sb.input_ids),
    put(sb.positions),
    put(sb.targets),
    support=None if support is None else put(support),
    extra=None if top_ids is None else {"top_logprob_ids": put(top_ids)},
  )
  return inputs, jax.tree.map(put, sb.batch)


def _assert_trees_close(got, want, what):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    # rtol 1e-5; an entry much smaller than its leaf is a sum of larger terms that cancel (Adam's
    # moments of gradients reduced over devices in another order), so its rounding is relative to
    # the leaf's scale: 1e-4 of it (f32's 1.2e-7 over thousands of summed tokens; seen at 2e-5).
    np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-4 * scale + 1e-9, err_msg=f"{what} {jax.tree_util.keystr(path)}"
    )


def _assert_metrics_close(got, want):
  assert got.keys() == want.keys()
  for k in want:
    # The loss is a small difference of thousands of O(1) terms summed in another order on each
    # mesh: f32 rounding reaches 1.3e-5 there (the parameters above are the tight check).
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-4, err_msg=k)


def _mesh(shape):
  return parallel.make_mesh(parallel.ParallelSection(*shape), jax.devices()[: int(np.prod(shape))])


@pytest.fixture(scope="module")
def single_device_runs():
  """Reference runs on one device (3 updates each), shared by the mesh tests: `run(name)` is the
  step batch and the run's states and metrics."""
  mesh = _mesh((1, 1, 1))
  samples = _samples(40)
  runs = {}

  def run(name):  # computed when a mesh case first asks for it (a deselected case costs nothing)
    if name not in runs:
      # The layout the 8-device meshes use (one row per device per micro-batch): the same rows everywhere.
      sb = _step_batch(ROW_LEN, 8, samples, extras=TOP_K_EXTRAS if ALGORITHMS[name].score_centering else ())
      runs[name] = (sb, *_run(mesh, ALGORITHMS[name], sb, 3)[:2])
    return runs[name]

  return run


# Every mesh, every algorithm: decoupled PPO (the whole correction) on the 3-axis mesh (and the
# 1-axis one, a `repeat`: its data axis is one of the 3-axis mesh's and of the (2, 4) mesh's, which
# `make test` runs), the other algorithms on a multi-axis one each (their loss differs, the sharded
# step is the same program); the (2, 4) mesh runs REINFORCE + IS (its correction inside the loss)
# with score centering (the sampler's top-k ids and log-probs sharded beside the tokens, their
# log-probs gathered in the head's shard_map, the centring metrics among those compared).
MESH_CASES = [
  pytest.param("decoupled_ppo", "8", marks=pytest.mark.repeat),
  ("decoupled_ppo", "2x2x2"),
  pytest.param("ppo", "2x2x2", marks=pytest.mark.repeat),
  ("reinforce_is_centred", "2x4"),
]


@pytest.mark.slow
@pytest.mark.parametrize("algo,mesh_name", MESH_CASES)
def test_mesh_step_equals_single_device(algo, mesh_name, single_device_runs):
  sb, want_states, want_history = single_device_runs(algo)
  assert sb.layout.micro_batches == 2  # the step accumulates over micro-batches on every mesh
  if ALGORITHMS[algo].score_centering:
    assert want_history[0]["score_centering_drift"] > 0
  mesh = _mesh(MESHES[mesh_name])
  states, history, (params, opt_state, fns) = _run(mesh, ALGORITHMS[algo], sb, 3)
  for i in (0, 2):  # after one and after three optimiser steps
    _assert_trees_close(states[i][0], want_states[i][0], f"params after {i + 1}")
    _assert_trees_close(states[i][1], want_states[i][1], f"opt_state after {i + 1}")
    _assert_metrics_close(history[i], want_history[i])
  # Every parameter and optimiser leaf carries its declared sharding (donation kept them).
  assert parallel.sharding_mismatches(params, fns.param_shardings) == []
  assert parallel.sharding_mismatches(opt_state, fns.opt_shardings) == []


def test_partition_rules_on_a_3d_mesh():
  mesh = _mesh((2, 2, 2))
  abstract = nnx.state(abstract_model(dataclasses.replace(TINY, tie_word_embeddings=False)), nnx.Param)
  specs = {
    "/".join(str(k) for k in path): s.get_value().spec
    for path, s in nnx.to_flat_state(parallel.param_shardings(abstract, mesh))
  }
  P = jax.sharding.PartitionSpec
  assert specs["layers/self_attn/q_proj/kernel"] == P(None, "fsdp", "tensor")  # column parallel
  assert specs["layers/self_attn/k_proj/kernel"] == P(None, "fsdp", "tensor")
  assert specs["layers/self_attn/o_proj/kernel"] == P(None, "tensor", "fsdp")  # row parallel
  assert specs["layers/mlp/up_proj/kernel"] == P(None, "fsdp", "tensor")
  assert specs["layers/mlp/down_proj/kernel"] == P(None, "tensor", "fsdp")
  assert specs["embed_tokens/embedding"] == P("tensor", "fsdp")  # vocab parallel
  assert specs["lm_head/kernel"] == P("fsdp", "tensor")
  assert specs["layers/input_layernorm/weight"] == P(None, None)  # vectors replicated
  # FSDP alone takes the largest dimension of each matrix.
  specs8 = {
    "/".join(str(k) for k in path): s.get_value().spec
    for path, s in nnx.to_flat_state(parallel.param_shardings(abstract, _mesh((1, 8, 1))))
  }
  assert specs8["layers/mlp/up_proj/kernel"] == P(None, None, "fsdp")  # [L, 64, 128]
  assert specs8["layers/mlp/down_proj/kernel"] == P(None, "fsdp", None)  # [L, 128, 64]


@pytest.mark.slow
@pytest.mark.parametrize(
  "algo", ["decoupled_ppo", pytest.param("reinforce_is", marks=pytest.mark.repeat)]
)  # with and without old log-probs
def test_one_micro_batch_equals_four(algo):
  mesh = _mesh((1, 1, 1))
  one, four = _step_batch(8 * ROW_LEN, 1), _step_batch(2 * ROW_LEN, 1)
  assert (one.layout.micro_batches, four.layout.micro_batches) == (1, 4)
  assert one.layout.num_rows == four.layout.num_rows == 8
  fns = _functions(mesh, ALGORITHMS[algo])  # one compiled step per micro-batch count
  s1, h1, _ = _run(mesh, ALGORITHMS[algo], one, 1, fns)
  s4, h4, _ = _run(mesh, ALGORITHMS[algo], four, 1, fns)
  _assert_trees_close(s4[0], s1[0], "state")
  # Loss terms add, min/max combine, means weighted by their denominators: exact here, except
  # ESS (a ratio of sums, not a mean), which micro-batches can only approximate.
  h1[0].pop("mis_ess_ratio", None), h4[0].pop("mis_ess_ratio", None)
  _assert_metrics_close(h4[0], h1[0])


# The old log-probs from the update's own forward (`train_fused`) against the separate pass: decoupled
# PPO with configs/mis.yaml's correction (token TIS truncated, token RS, veto, batch normalisation)
# and plain token-level TIS (truncate at 2, nothing rejected).
FUSED_LOSSES = {
  "mis_yaml": mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml")),
  "token_tis": mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(tis_level="token")),
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "name", [pytest.param(name, marks=(pytest.mark.repeat,) if name == "token_tis" else ()) for name in FUSED_LOSSES]
)  # token TIS: `make test-all` (the same path again)
def test_fused_update_equals_the_separate_pass(name, step_traces):
  """One update of `train_fused` == the old-log-prob pass + `prepare` + `train` on the same batch
  of one micro-batch: parameters, optimiser state, every metric and the old log-probs; two updates
  trace it once. The two are different XLA programs (the forward in its own jit, and inside the
  differentiated one), so they agree up to float32 reassociation: the old log-probs to 1e-5 (log-probs
  of a peaky model of magnitude ~5, f32 eps ~6e-7 per op over a few hundred ops), the state and
  metrics to the mesh tests' tolerances (rtol 1e-5; see `_assert_trees_close`)."""
  loss_cfg, mesh = FUSED_LOSSES[name], _mesh((1, 1, 1))
  sb = _step_batch(8 * ROW_LEN, 1)
  assert sb.layout.micro_batches == 1
  fns = _functions(mesh, loss_cfg)
  (want_state,), (want_metrics,), _ = _run(mesh, loss_cfg, sb, 1, fns)
  inputs, batch = _place(mesh, sb)
  init = jax.device_put(nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param), fns.param_shardings)
  want_old = np.asarray(fns.logprobs(init, inputs, batch.segment_ids).logprobs)
  assert want_metrics["mis_is_ratio_max_final"] <= 2.0 and want_metrics["mis_kept_token_fraction"] > 0
  key = jax.random.key(0)
  params, opt_state, metrics, old = fns.train_fused(init, fns.init_opt_state(init), inputs, batch, key)
  assert old.shape == batch.segment_ids.shape and old.dtype == jnp.float32
  valid = np.asarray(batch.segment_ids) >= 0
  np.testing.assert_allclose(np.asarray(old)[valid], want_old[valid], rtol=1e-5, atol=1e-5)
  _assert_trees_close(jax.tree.map(np.array, (params, opt_state)), want_state, "state")
  _assert_metrics_close({k: float(v) for k, v in metrics.items()}, want_metrics)
  assert float(metrics["grad_norm"]) > 0  # an update that moved the weights, not two equal no-ops
  fns.train_fused(params, opt_state, inputs, batch, key)  # a second step of the same shape: no new trace
  assert len(step_traces.traces["train_fused"]) == 1 and step_traces.calls["train_fused"] == 2
  with pytest.raises(ValueError, match="one micro-batch, got 4"):
    four_inputs, four_batch = _place(mesh, _step_batch(2 * ROW_LEN, 1))
    fns.train_fused(params, opt_state, four_inputs, four_batch, key)


# make test-all only (~5-10 s here): the mesh tests above check the same body (`update` over
# `loss_fn`) on these meshes; this adds `prepare_step` inside it.
@pytest.mark.slow
@pytest.mark.repeat
def test_fused_update_on_a_mesh_equals_one_device():
  """`train_fused` on the (2, 2, 2) mesh (rows over data × fsdp, the head's tokens over tensor) ==
  on one device: parameters, optimiser state, metrics and old log-probs (the mesh tests' tolerances)."""
  loss_cfg = FUSED_LOSSES["mis_yaml"]
  sb = _step_batch(4 * ROW_LEN, 4)
  assert sb.layout.micro_batches == 1
  out = {}
  for shape in ((1, 1, 1), (2, 2, 2)):
    mesh = _mesh(shape)
    fns = _functions(mesh, loss_cfg)
    params = jax.device_put(nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param), fns.param_shardings)  # donated
    inputs, batch = _place(mesh, sb)
    step = fns.train_fused(params, fns.init_opt_state(params), inputs, batch, jax.random.key(0))
    assert parallel.sharding_mismatches(step.params, fns.param_shardings) == []
    out[shape] = jax.tree.map(np.array, step)
  one, mesh = out[(1, 1, 1)], out[(2, 2, 2)]
  _assert_trees_close((mesh.params, mesh.opt_state), (one.params, one.opt_state), "state")
  _assert_metrics_close({k: float(v) for k, v in mesh.metrics.items()}, {k: float(v) for k, v in one.metrics.items()})
  np.testing.assert_allclose(mesh.old_logprobs, one.old_logprobs, rtol=1e-5, atol=1e-5)


def test_combine_metrics_reduces_each_metric_its_own_way():
  stacked = {
    "loss": jnp.array([0.5, 0.25, 0.0]),
    "mis_is_ratio_max_final": jnp.array([2.0, 3.0, 9.0]),
    "mis_is_ratio_min_final": jnp.array([0.5, 0.2, 0.0]),
    "mis_kl": jnp.array([1.0, 4.0, 7.0]),
    "pg_clipfrac": jnp.array([0.5, 0.0, 3.0]),
    "mis_rs_catastrophic_seq_fraction": jnp.array([1.0, 0.0, 5.0]),
  }
  # The third micro-batch is empty (all padding): it must not count anywhere.
  weights = {"mask": jnp.array([1.0, 3.0, 0.0]), "kept": jnp.array([2.0, 2.0, 0.0]), "seqs": jnp.array([1.0, 1.0, 0.0])}
  out = {k: float(v) for k, v in step_lib.combine_metrics(stacked, weights).items()}
  assert out == pytest.approx(
    {
      "loss": 0.75,
      "mis_is_ratio_max_final": 3.0,
      "mis_is_ratio_min_final": 0.2,
      "mis_kl": (1 * 1 + 4 * 3) / 4,
      "pg_clipfrac": (0.5 * 2) / 4,
      "mis_rs_catastrophic_seq_fraction": 0.5,
    }
  )


def test_layout_is_sized_by_a_token_budget_per_device():
  lengths = [30] * 40  # one sequence per row of 32
  assert plan_layout(lengths, row_len=32, tokens_per_micro_batch=128, batch_devices=8).shape == (2, 32, 32)
  assert plan_layout(lengths[:9], row_len=32, tokens_per_micro_batch=128, batch_devices=8).shape == (1, 16, 32)
  assert plan_layout(lengths, row_len=32, tokens_per_micro_batch=96, batch_devices=1).shape == (16, 3, 32)
  assert plan_layout(lengths[:38], row_len=32, tokens_per_micro_batch=96, batch_devices=1).shape == (16, 3, 32)
  assert plan_layout(lengths[:30], row_len=32, tokens_per_micro_batch=96, batch_devices=1).shape == (12, 3, 32)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_equal_full_logits(tied):
  """The step's log-probs (hidden states + mis_jax.token_logprobs, on a mesh) equal today's
  path (full [T, V] logits, log_softmax) — values, entropy and parameter gradients."""
  cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
  model = CausalLM(cfg, rngs=nnx.Rngs(3))
  graphdef, params = nnx.split(model)
  sb = _step_batch(4 * ROW_LEN, 1)
  inputs = step_lib.ModelInputs(*(jnp.asarray(x[0]) for x in (sb.input_ids, sb.positions, sb.targets)))
  seg = jnp.asarray(sb.batch.segment_ids[0])
  w = jnp.asarray(np.random.default_rng(0).normal(size=seg.shape), jnp.float32)

  def full(p):
    logits = nnx.merge(graphdef, p)(inputs.input_ids, inputs.positions, seg) / 0.9
    logp = jax.nn.log_softmax(logits)
    lp = jnp.take_along_axis(logp, inputs.targets[..., None], axis=-1)[..., 0]
    return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

  mesh = _mesh((2, 2, 2))

  def chunked(p):
    heads = step_lib.model_logprobs(graphdef, p, inputs, seg, temperature=0.9, chunk_size=8, entropy=True, mesh=mesh)
    return heads.logprobs, heads.entropy

  loss = lambda f: lambda p: jnp.sum(jnp.where(seg >= 0, f(p)[0] * w + f(p)[1], 0.0))
  (lp0, ent0), (lp1, ent1) = jax.jit(full)(params), jax.jit(chunked)(params)
  valid = np.asarray(seg) >= 0
  np.testing.assert_allclose(np.asarray(lp1)[valid], np.asarray(lp0)[valid], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent1)[valid], np.asarray(ent0)[valid], rtol=1e-5, atol=1e-5)
  g0, g1 = jax.jit(jax.grad(loss(full)))(params), jax.jit(jax.grad(loss(chunked)))(params)
  _assert_trees_close(g1, g0, "grad")


@pytest.mark.slow
def test_bf16_compute_is_close_to_float32():
  """bf16 compute with float32 master weights: log-probs within 0.2 per token, 0.05 on average
  (bf16 keeps 8 mantissa bits: ~0.4% of logits of magnitude ~10 in this peaky tiny model — the
  same gap as the bf16 rollout engine's), gradients within 5% in norm and aligned (cosine >
  0.99); the gradients stay float32."""
  sb = _step_batch(4 * ROW_LEN, 1)
  inputs = step_lib.ModelInputs(*(jnp.asarray(x[0]) for x in (sb.input_ids, sb.positions, sb.targets)))
  seg = jnp.asarray(sb.batch.segment_ids[0])
  params = nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param)
  valid = np.asarray(seg) >= 0
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    graphdef = nnx.graphdef(abstract_model(TINY, dtype=dtype, attention="blocked", remat="full"))
    f = lambda p: (
      step_lib.model_logprobs(graphdef, p, inputs, seg, temperature=1.0, chunk_size=16, entropy=False).logprobs
    )
    lp = jax.jit(f)(params)
    g = jax.jit(jax.grad(lambda p: jnp.sum(jnp.where(seg >= 0, f(p), 0.0))))(params)
    out[dtype] = (
      np.asarray(lp)[valid],
      np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]),
      {x.dtype for x in jax.tree.leaves(g)},
    )
  (lp32, g32, _), (lp16, g16, dt16) = out[jnp.float32], out[jnp.bfloat16]
  assert dt16 == {np.dtype("float32")}
  print(
    "bf16 - f32 log-probs: max",
    np.max(np.abs(lp16 - lp32)),
    "mean",
    np.mean(np.abs(lp16 - lp32)),
    "grad norm ratio",
    np.linalg.norm(g16) / np.linalg.norm(g32),
    "cosine",
    g16 @ g32 / (np.linalg.norm(g16) * np.linalg.norm(g32)),
  )
  assert np.max(np.abs(lp16 - lp32)) < 0.2 and np.mean(np.abs(lp16 - lp32)) < 0.05
  assert abs(np.linalg.norm(g16) / np.linalg.norm(g32) - 1) < 0.05
  assert g16 @ g32 / (np.linalg.norm(g16) * np.linalg.norm(g32)) > 0.99


@pytest.mark.parametrize(
  "attention,remat,layer_loop",
  [
    ("dense", "full", "scan"),
    ("blocked", "none", "scan"),
    ("blocked", "full", "scan"),
    ("blocked", "dots", "scan"),
    ("blocked", "full", "unrolled"),
  ],
)  # unrolled: each layer checkpointed with prevent_cse
@pytest.mark.slow
def test_attention_backends_remat_and_layer_loop_give_the_same_gradients(attention, remat, layer_loop):
  sb = _step_batch(4 * ROW_LEN, 1)
  inputs = step_lib.ModelInputs(*(jnp.asarray(x[0]) for x in (sb.input_ids, sb.positions, sb.targets)))
  seg = jnp.asarray(sb.batch.segment_ids[0])
  params = nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param)

  def grads(**kwargs):
    graphdef = nnx.graphdef(abstract_model(TINY, **kwargs))
    f = lambda p: (
      step_lib.model_logprobs(graphdef, p, inputs, seg, temperature=1.0, chunk_size=16, entropy=False).logprobs
    )
    return jax.jit(jax.grad(lambda p: jnp.sum(jnp.where(seg >= 0, f(p), 0.0))))(params)

  _assert_trees_close(
    grads(attention=attention, remat=remat, layer_loop=layer_loop), grads(attention="dense", remat="none"), "grad"
  )


def test_invalid_mesh_is_a_config_error():
  with pytest.raises(mis_jax.ConfigError, match=r"data=3 .* does not divide the 8 devices"):
    parallel.mesh_shape(parallel.ParallelSection(data=3), 8)
  with pytest.raises(mis_jax.ConfigError, match="only one of"):
    parallel.mesh_shape(parallel.ParallelSection(data=-1, fsdp=-1), 8)
  with pytest.raises(mis_jax.ConfigError, match=r"data x fsdp x expert x tensor = 4 but there are 8"):
    parallel.mesh_shape(parallel.ParallelSection(data=2, fsdp=2, tensor=1), 8)
  with pytest.raises(mis_jax.ConfigError, match="parallel.tensor must be a positive int"):
    parallel.mesh_shape(parallel.ParallelSection(tensor=0), 8)
  assert parallel.mesh_shape(parallel.ParallelSection(), 8) == (1, 8, 1, 1)
  assert parallel.mesh_shape(parallel.ParallelSection(data=2, tensor=2), 8) == (2, 2, 1, 2)
  with pytest.raises(
    mis_jax.ConfigError, match=r"parallel.tensor=8 does not divide the model's num_attention_heads \(4\)"
  ):
    parallel.check_model(_mesh((1, 1, 8)), TINY)
  with pytest.raises(mis_jax.ConfigError, match=r"num_key_value_heads \(2\)"):
    parallel.check_model(_mesh((1, 2, 4)), TINY)


def test_cli_rejects_a_bad_mesh_before_starting_anything(tmp_path, capsys):
  from trainers import cli

  code = cli.main(
    ["train", "--config", "configs/demo.yaml", "--run-dir", str(tmp_path / "r"), "--set", "parallel.tensor=8"]
  )
  assert code == 2
  assert "parallel.tensor=8 does not divide the model's num_attention_heads (4)" in capsys.readouterr().err
  assert not (tmp_path / "r").exists()  # nothing was started or written


def test_hf_weights_load_straight_into_their_shards(tmp_path):
  init_checkpoint(tmp_path, config=dataclasses.replace(TINY, tie_word_embeddings=False), seed=2)
  mesh = _mesh((2, 2, 2))
  whole = load_hf_checkpoint(tmp_path)
  abstract = nnx.state(abstract_model(whole.config), nnx.Param)
  shardings = parallel.param_shardings(abstract, mesh)
  sharded = load_hf_checkpoint(tmp_path, shardings=shardings)
  state = nnx.state(sharded, nnx.Param)
  assert parallel.sharding_mismatches(state, shardings) == []
  _assert_trees_close(state, nnx.state(whole, nnx.Param), "loaded")
  q = state["layers"]["self_attn"]["q_proj"]["kernel"][...]
  assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 32)}  # [L, 64, 64] split 2 x 2
