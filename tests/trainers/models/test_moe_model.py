"""Qwen3-MoE: the model against transformers' own (`save_pretrained` checkpoints, norm_topk_prob
true and false, tied and untied): packed log-probs, router top-k at every position and layer,
the load-balancing loss, greedy decoding with routed experts, save → load bit-exact and the
fused expert layout; the MoE block against a NumPy loop (native and replayed routing); routing
replay invariants; dense == grouped == ragged_dot dispatch in values and gradients; the step on
an 8-device mesh with an expert axis == 1 device."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mis_jax
from trainers.models import (
  PRESETS,
  CausalLM,
  ModelConfig,
  hf_state_dict,
  load_hf_checkpoint,
  moe,
  read_hf_tensors,
  save_hf_checkpoint,
)
from trainers.serving.embedded.sampler import Sampler, SamplingOptions
from trainers.runtime import parallel
from trainers.learner import step as step_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HF_CASES = [(True, False), (True, True), (False, False), (False, True)]  # (norm_topk_prob, tied)
SEQS = [[1, 5, 9, 33, 2, 7, 7, 8, 40, 41, 3], [1, 60, 12, 12, 4, 18, 22]]


def _hf_config(norm, tied):
  return transformers.Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=norm,
    tie_word_embeddings=tied,
    initializer_range=0.2,
    max_position_embeddings=128,
  )


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
  """`{(norm, tied): (path, HF model)}` written by transformers' `save_pretrained`."""
  out = {}
  for norm, tied in HF_CASES:
    torch.manual_seed(hash((norm, tied)) % 1000)
    model = transformers.Qwen3MoeForCausalLM(_hf_config(norm, tied)).eval()
    path = str(tmp_path_factory.mktemp(f"qwen3moe-{norm}-{tied}"))
    model.save_pretrained(path)
    out[(norm, tied)] = (path, model)
  return out


def _hf_forward(model, seq):
  """HF's float32 log-probs `[T, V]`, router top-k `[T, L, k]` and load-balancing loss."""
  with torch.no_grad():
    out = model(torch.tensor([seq]), output_router_logits=True)
  k = model.config.num_experts_per_tok
  top = [torch.topk(torch.softmax(r.float(), -1), k, -1).indices.numpy() for r in out.router_logits]
  return (torch.log_softmax(out.logits[0].float(), -1).numpy(), np.stack(top, axis=1), float(out.aux_loss))


@pytest.mark.slow
@pytest.mark.parametrize("norm,tied", HF_CASES)
def test_packed_forward_and_routing_equal_transformers(norm, tied, hf_checkpoints):
  path, hf = hf_checkpoints[(norm, tied)]
  model = load_hf_checkpoint(path, moe_dispatch="grouped")
  assert model.config.model_type == "qwen3_moe" and model.config.norm_topk_prob == norm
  # Both sequences packed in one row (segment-aware attention, per-segment positions).
  ids = np.concatenate(SEQS)[None].astype(np.int32)
  pos = np.concatenate([np.arange(len(s)) for s in SEQS])[None].astype(np.int32)
  seg = np.concatenate([np.full(len(s), i) for i, s in enumerate(SEQS)])[None].astype(np.int32)
  hidden, routing = model.hidden_states(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), return_routing=True)
  logp = np.asarray(jax.nn.log_softmax(model._logits(hidden), axis=-1))[0]
  start = 0
  for s in SEQS:
    want_lp, want_top, _ = _hf_forward(hf, s)
    np.testing.assert_allclose(logp[start : start + len(s)], want_lp, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(routing.native)[0, start : start + len(s)], want_top)
    start += len(s)
  # The load-balancing loss of one unpacked sequence is HF's `aux_loss` (before its coefficient).
  s = SEQS[0]
  _, r1 = model.hidden_states(
    jnp.asarray([s], jnp.int32),
    jnp.arange(len(s), dtype=jnp.int32)[None],
    jnp.zeros((1, len(s)), jnp.int32),
    return_routing=True,
  )
  np.testing.assert_allclose(float(r1.aux_loss), _hf_forward(hf, s)[2], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("norm,tied", HF_CASES)
def test_greedy_decoding_with_routed_experts_equals_transformers(norm, tied, hf_checkpoints):
  """The server's sampler (KV cache, float32): greedy tokens and log-probs equal HF's, and the
  routed experts `[prompt + completion - 1, L, k]` equal HF's router top-k of that sequence."""
  path, hf = hf_checkpoints[(norm, tied)]
  sampler = Sampler(load_hf_checkpoint(path), eos_token_ids=(), max_batch_size=2)
  prompts = [SEQS[0][:5], SEQS[1][:3]]
  outs = sampler.generate(prompts, SamplingOptions(temperature=0.0, max_new_tokens=6, routed_experts=True))
  for prompt, c in zip(prompts, outs):
    seq = prompt + c.output_ids
    want_lp, want_top, _ = _hf_forward(hf, seq)
    assert c.output_ids == [int(np.argmax(want_lp[i])) for i in range(len(prompt) - 1, len(seq) - 1)]
    np.testing.assert_allclose(
      c.logprobs, [want_lp[i, seq[i + 1]] for i in range(len(prompt) - 1, len(seq) - 1)], atol=2e-4
    )
    assert c.routed_experts.shape == (len(seq) - 1, 2, 2) and c.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(c.routed_experts, want_top[: len(seq) - 1])


def test_save_load_is_bit_exact_and_fused_experts_load(hf_checkpoints, tmp_path):
  path, hf = hf_checkpoints[(True, False)]
  model = load_hf_checkpoint(path)
  save_hf_checkpoint(model, tmp_path / "re")
  a, b = read_hf_tensors(path), read_hf_tensors(tmp_path / "re")
  assert sorted(a) == sorted(b) and "model.layers.1.mlp.experts.7.down_proj.weight" in a
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
  reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "re").eval()  # transformers reads ours
  np.testing.assert_array_equal(_hf_forward(reloaded, SEQS[0])[1], _hf_forward(hf, SEQS[0])[1])
  # transformers' in-memory fused layout (experts.gate_up_proj [E, 2F, H], experts.down_proj [E, H, F]).
  from safetensors.torch import save_file

  fused = tmp_path / "fused"
  fused.mkdir()
  shutil.copy(os.path.join(path, "config.json"), fused)
  state = {k: v.contiguous() for k, v in hf.state_dict().items()}
  assert "model.layers.0.mlp.experts.gate_up_proj" in state
  save_file(state, str(fused / "model.safetensors"))
  got = hf_state_dict(load_hf_checkpoint(fused))
  assert sorted(got) == sorted(a)
  for k in a:
    assert np.array_equal(got[k], a[k]), k


def test_config_mapping_and_mixed_layouts_are_refused(hf_checkpoints):
  path, _ = hf_checkpoints[(True, False)]
  d = ModelConfig.from_pretrained(path).to_hf_dict()
  assert d["num_experts"] == d["num_local_experts"] == 8 and d["architectures"] == ["Qwen3MoeForCausalLM"]
  old = {k: v for k, v in d.items() if k not in ("num_local_experts", "rope_parameters")}  # transformers 4.x
  assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(d)
  with pytest.raises(ValueError, match=r"mixed dense/MoE layers .*mlp_only_layers \[1\]"):
    ModelConfig.from_hf_dict({**d, "mlp_only_layers": [1]})
  with pytest.raises(ValueError, match=r"decoder_sparse_step 2: layers \[0\] would be dense"):
    ModelConfig.from_hf_dict({**d, "decoder_sparse_step": 2})
  with pytest.raises(ValueError, match="num_experts"):
    ModelConfig.from_hf_dict({k: v for k, v in d.items() if k not in ("num_experts", "num_local_experts")})


# ---- the block against a NumPy loop; replay; dispatch ---------------------------------------------


def _numpy_moe(x, wr, wg, wu, wd, k, norm, replay=None):
  """Per token: router softmax (float64), its top-k or the replayed experts, gate weights at
  them (renormalised when `norm`), the weighted sum of the experts' SwiGLU FFNs."""
  out = np.zeros_like(x, dtype=np.float64)
  for t in range(x.shape[0]):
    logits = x[t] @ wr
    p = np.exp(logits - logits.max())
    p /= p.sum()
    chosen = np.argsort(-p, kind="stable")[:k] if replay is None or replay[t, 0] < 0 else replay[t]
    w = p[chosen] / (p[chosen].sum() if norm else 1.0)
    for e, we in zip(chosen, w):
      g, u = x[t] @ wg[e], x[t] @ wu[e]
      out[t] += we * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  return out


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_equals_a_numpy_loop_native_and_replayed(norm):
  cfg = dataclasses.replace(PRESETS["tiny-qwen3-moe"], initializer_range=0.3, norm_topk_prob=norm)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, cfg.hidden_size)), jnp.float32)
  replay = rng.permuted(np.tile(np.arange(cfg.num_experts), (10, 1)), axis=1)[:, :2].reshape(2, 5, 2)
  replay[0, 1] = -1  # no record: native routing
  for dispatch in moe.MOE_DISPATCH:
    block = moe.SparseMoeBlock(cfg, dtype=jnp.float32, param_dtype=jnp.float32, dispatch=dispatch, rngs=nnx.Rngs(1))
    ws = [
      np.asarray(w, np.float64)
      for w in (
        block.gate.kernel[...],
        block.experts.gate_proj.kernel[...],
        block.experts.up_proj.kernel[...],
        block.experts.down_proj.kernel[...],
      )
    ]
    flat = np.asarray(x, np.float64).reshape(10, -1)
    y, routing = block(x)
    np.testing.assert_allclose(np.asarray(y).reshape(10, -1), _numpy_moe(flat, *ws, 2, norm), rtol=1e-4, atol=1e-5)
    y, routing_r = block(x, jnp.asarray(replay, jnp.int32))
    np.testing.assert_allclose(
      np.asarray(y).reshape(10, -1),
      _numpy_moe(flat, *ws, 2, norm, replay.reshape(10, 2)),
      rtol=1e-4,
      atol=1e-5,
      err_msg=dispatch,
    )
    np.testing.assert_array_equal(routing_r.native, routing.native)  # the native top-k is reported either way


MOE = dataclasses.replace(PRESETS["tiny-qwen3-moe"], initializer_range=0.3)


def _packed(rng, rows=2, row_len=24):
  ids = rng.integers(3, 64, (rows, row_len)).astype(np.int32)
  seg = np.repeat(np.array([[0] * 10 + [1] * 9 + [-1] * 5, [2] * 20 + [-1] * 4]), 1, axis=0)[:rows].astype(np.int32)
  pos = np.zeros_like(ids)
  for r in range(rows):
    for s in set(seg[r]) - {-1}:
      where = np.flatnonzero(seg[r] == s)
      pos[r, where] = np.arange(len(where))
  return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)


def _objective(model, ids, pos, seg, routing=None):
  hidden = model.hidden_states(ids, pos, seg, routing=routing)
  head, layout = model.head()
  targets = jnp.roll(ids, -1, axis=1)
  lp = mis_jax.token_logprobs(hidden, head, targets, lm_head_layout=layout, chunk_size=8)
  return jnp.sum(jnp.where(seg >= 0, lp, 0.0))


_GRAD = {}


def _value_and_grad(model, ids, pos, seg, routing=None):
  """Jitted per model structure (one compile per dispatch and replay/no-replay)."""
  graphdef, params = nnx.split(model)
  key = (graphdef, routing is None)
  if key not in _GRAD:
    _GRAD[key] = jax.jit(
      jax.value_and_grad(lambda p, ids, pos, seg, r: _objective(nnx.merge(graphdef, p), ids, pos, seg, r))
    )
  return _GRAD[key](params, ids, pos, seg, routing)


@pytest.mark.slow
def test_replaying_the_native_routing_changes_nothing_and_other_experts_train_the_router():
  model = CausalLM(MOE, rngs=nnx.Rngs(0), moe_dispatch="grouped")
  ids, pos, seg = _packed(np.random.default_rng(0))
  _, routing = model.hidden_states(ids, pos, seg, return_routing=True)
  value, grads = _value_and_grad(model, ids, pos, seg)
  value_r, grads_r = _value_and_grad(model, ids, pos, seg, routing.native)
  assert float(value_r) == pytest.approx(float(value), rel=1e-6)  # f32 sums of ~300
  for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  # Other experts (the next two in the ranking): a different output, and the router still learns.
  other = (routing.native + 2) % MOE.num_experts
  value_o, grads_o = _value_and_grad(model, ids, pos, seg, other)
  assert abs(float(value_o) - float(value)) > 1e-3
  gate_grad = np.asarray(grads_o["layers"]["mlp"]["gate"]["kernel"][...])
  assert np.abs(gate_grad).max() > 1e-6
  # A -1 row routes natively: a record everywhere but one position equals the native there.
  partial = routing.native.at[0, 3].set(-1)
  assert float(_objective(model, ids, pos, seg, partial)) == pytest.approx(float(value), rel=1e-6)
  with pytest.raises(
    ValueError,
    match=r"routing has shape \(2, 24, 2\), expected \[batch, length, "
    r"num_hidden_layers, num_experts_per_tok\]",
  ):
    model.hidden_states(ids, pos, seg, routing=routing.native[:, :, 0])
  with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
    CausalLM(PRESETS["tiny-qwen3"], rngs=nnx.Rngs(0)).hidden_states(ids, pos, seg, routing=routing.native)


@pytest.mark.slow
def test_dense_grouped_and_ragged_dispatch_agree_in_values_and_gradients():
  ids, pos, seg = _packed(np.random.default_rng(1))
  ref = CausalLM(MOE, rngs=nnx.Rngs(0), moe_dispatch="dense")
  replay = (model_native := ref.hidden_states(ids, pos, seg, return_routing=True)[1].native) % MOE.num_experts
  replay = (replay + 1) % MOE.num_experts
  for routing in (None, replay):
    value, grads = _value_and_grad(ref, ids, pos, seg, routing)
    for dispatch in ("grouped", "ragged_dot"):
      model = CausalLM(MOE, rngs=nnx.Rngs(0), moe_dispatch=dispatch)
      v, g = _value_and_grad(model, ids, pos, seg, routing)
      assert float(v) == pytest.approx(float(value), rel=1e-5), dispatch
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6 * np.abs(np.asarray(b)).max())
  assert model_native.shape == (2, 24, 2, 2)


def test_grouped_blocks_cover_every_pair_whatever_the_imbalance():
  """All pairs on one expert, or spread: the padded block layout holds them (a static bound)."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(33, 8)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8, 6), (4, 8, 6), (4, 6, 8))]
  weights = jnp.asarray(rng.uniform(size=(33, 2)), jnp.float32)
  for experts in (np.tile([[3, 1]], (33, 1)), rng.integers(0, 4, (33, 2))):
    experts = jnp.asarray(experts, jnp.int32)
    want = moe.dense_dispatch(x, experts, weights, *ws)
    for block in (8, 16, None):
      np.testing.assert_allclose(
        moe.grouped_dispatch(x, experts, weights, *ws, block=block), want, rtol=1e-5, atol=1e-5
      )


# ---- the step on a mesh with an expert axis ---------------------------------------------------------


@pytest.fixture(scope="module")
def moe_step_setup():
  import test_step as ts

  samples = ts._samples(40)
  rng = np.random.default_rng(3)
  for s in samples:  # a recorded routing for every position but the first (native there)
    n = len(s.prompt_ids) + len(s.response_ids) - 1
    experts = np.stack([rng.permutation(MOE.num_experts)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)
    experts[0] = -1
    s.extras = {"routed_experts": experts}
  from trainers.learner.batch import build_step_batch
  from trainers.rollout.extras import RoutedExperts
  from trainers.rollout.samples import RoutingSpec

  rewards = rng.uniform(0, 1, len(samples)).astype(np.float32)
  groups = np.arange(len(samples)) // 4
  adv = np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=int(groups.max()) + 1))
  sb = build_step_batch(
    samples,
    rewards,
    adv,
    groups,
    num_segments=len(samples),
    row_len=ts.ROW_LEN,
    tokens_per_micro_batch=ts.ROW_LEN,
    batch_devices=8,
    extras=(RoutedExperts(RoutingSpec(2, 2, 8)),),
  )
  return ts, sb


def _moe_run(ts, sb, section, steps=2):
  mesh = parallel.make_mesh(section, jax.devices()[: section.data * section.fsdp * section.expert * section.tensor])
  loss_cfg = ts.ALGORITHMS["decoupled_ppo"]
  fns = step_lib.build_step_functions(
    MOE,
    mesh,
    loss_cfg,
    ts.OPTIM,
    temperature=0.9,
    logprob_chunk=8,
    attention="blocked",
    remat="full",
    moe_dispatch="grouped",
  )
  params = jax.device_put(nnx.state(CausalLM(MOE, rngs=nnx.Rngs(0)), nnx.Param), fns.param_shardings)
  opt_state = fns.init_opt_state(params)
  put = lambda x: jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x)))
  inputs = step_lib.ModelInputs(
    put(sb.input_ids), put(sb.positions), put(sb.targets), routing=put(sb.extras["routed_experts"])
  )
  batch = jax.tree.map(put, sb.batch)
  out = []
  for _ in range(steps):
    heads = fns.forward(step_lib.ROUTING)(params, inputs, batch.segment_ids)
    old, native = heads.logprobs, heads.routing
    assert heads.entropy is None and heads.sum_sq is None  # only the heads the pass names
    b = batch.replace(old_logprobs=old)
    correction, step_metrics = fns.prepare(b)
    params, opt_state, metrics = fns.train(params, opt_state, inputs, b, correction)
    out.append(
      (
        jax.tree.map(np.array, (params, opt_state)),
        {k: float(v) for k, v in {**metrics, **step_metrics}.items()},
        np.asarray(native),
      )
    )
  assert parallel.sharding_mismatches(params, fns.param_shardings) == []
  return out, fns


@pytest.mark.slow
def test_expert_axis_mesh_step_equals_one_device(moe_step_setup):
  """Replayed routing (R3), decoupled PPO + MIS, 2 micro-batches: after 2 updates the params,
  optimiser state and metrics on (fsdp 2 × expert 4) and (expert 4 × tensor 2) equal one
  device's; every device's native routing is the same. rtol 1e-4: the router's softmax and the
  gate renormalisation amplify reduction-order rounding a little over the dense model's 1e-5."""
  ts, sb = moe_step_setup
  assert sb.layout.micro_batches == 2 and sb.extras["routed_experts"].shape == sb.input_ids.shape + (2, 2)
  one, _ = _moe_run(ts, sb, parallel.ParallelSection(data=1, fsdp=1, tensor=1, expert=1))
  for section in (
    parallel.ParallelSection(data=1, fsdp=2, tensor=1, expert=4),
    parallel.ParallelSection(data=1, fsdp=1, tensor=2, expert=4),
  ):
    got, fns = _moe_run(ts, sb, section)
    spec = fns.param_shardings["layers"]["mlp"]["experts"]["gate_proj"]["kernel"].get_value().spec
    assert spec[1] == "expert"  # [L, E, H, F]: the experts split over the expert axis
    for (state, metrics, native), (want_state, want_metrics, want_native) in zip(got, one):
      np.testing.assert_array_equal(native, want_native)
      for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        scale = float(np.abs(b).max()) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale + 1e-9)
      assert metrics.keys() == want_metrics.keys()
      for k in metrics:
        np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_expert_axis_config_errors():
  mesh = parallel.make_mesh(parallel.ParallelSection(fsdp=2, expert=4), jax.devices())
  with pytest.raises(mis_jax.ConfigError, match="parallel.expert=4 needs a mixture-of-experts model"):
    parallel.check_model(mesh, PRESETS["tiny-qwen3"])
  parallel.check_model(mesh, MOE)
  wide = parallel.make_mesh(parallel.ParallelSection(fsdp=1, expert=8), jax.devices())
  parallel.check_model(wide, MOE)
  with pytest.raises(mis_jax.ConfigError, match=r"parallel.expert=8 does not divide the model's num_experts \(4\)"):
    parallel.check_model(wide, dataclasses.replace(MOE, num_experts=4))
  # Non-expert parameters are split over fsdp x expert, the experts' expert axis over expert.
  spec = parallel.param_spec(
    ("layers", "self_attn", "q_proj", "kernel"),
    (2, 64, 64),
    parallel.make_mesh(parallel.ParallelSection(fsdp=2, expert=4), jax.devices()),
  )
  assert spec == jax.sharding.PartitionSpec(None, ("fsdp", "expert"), None)


@pytest.mark.slow
def test_the_load_balancing_loss_joins_the_step_when_asked(moe_step_setup):
  """`train.router_aux_loss_coef`: the step's loss gains coef · HF's aux loss (token-weighted
  over micro-batches), logged as `router_aux_loss`; 0 (the default) leaves the step as it was."""
  ts, sb = moe_step_setup
  mesh = parallel.make_mesh(parallel.ParallelSection(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])
  loss_cfg = ts.ALGORITHMS["reinforce_is"]
  params0 = nnx.state(CausalLM(MOE, rngs=nnx.Rngs(0)), nnx.Param)
  out = {}
  for coef in (0.0, 0.5):
    optim = dataclasses.replace(ts.OPTIM, router_aux_loss_coef=coef)
    fns = step_lib.build_step_functions(
      MOE,
      mesh,
      loss_cfg,
      optim,
      temperature=0.9,
      logprob_chunk=8,
      attention="blocked",
      remat="full",
      moe_dispatch="grouped",
    )
    params = jax.device_put(jax.tree.map(jnp.copy, params0), fns.param_shardings)  # the step donates them
    inputs = step_lib.ModelInputs(*(jnp.asarray(x) for x in (sb.input_ids, sb.positions, sb.targets)))
    batch = jax.tree.map(jnp.asarray, sb.batch)
    correction, _ = fns.prepare(batch)
    _, _, metrics = fns.train(params, fns.init_opt_state(params), inputs, batch, correction)
    out[coef] = {k: float(v) for k, v in metrics.items()}
  assert "router_aux_loss" not in out[0.0] and out[0.5]["router_aux_loss"] > 0
  # The aux loss of each micro-batch, weighted by its real tokens, is what the step added.
  model = CausalLM(MOE, rngs=nnx.Rngs(0))
  seg = np.asarray(sb.batch.segment_ids)
  tokens = [(seg[m] >= 0).sum() for m in range(seg.shape[0])]
  aux = [
    float(
      model.hidden_states(
        jnp.asarray(sb.input_ids[m]), jnp.asarray(sb.positions[m]), jnp.asarray(seg[m]), return_routing=True
      )[1].aux_loss
    )
    for m in range(seg.shape[0])
  ]
  want = sum(a * t for a, t in zip(aux, tokens)) / sum(tokens)
  np.testing.assert_allclose(out[0.5]["loss"] - out[0.0]["loss"], 0.5 * want, rtol=1e-4)
  assert out[0.5]["grad_norm"] != out[0.0]["grad_norm"]
