"""Qwen2/Qwen3 NNX model: parity with Hugging Face transformers (PyTorch, float32) on
per-token log-probs, packed and unpacked; HF checkpoint save/load round trips."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.models import (
  PRESETS,
  ModelConfig,
  CausalLM,
  hf_state_dict,
  init_checkpoint,
  load_hf_checkpoint,
  read_hf_tensors,
  save_hf_checkpoint,
  state_from_hf_tensors,
  teacher_forced_logprobs,
)
from trainers.models.decoder import DecoderLayer, resolve_layer_loop

from conftest import TINY, sequence_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ_LENS = (7, 12, 4)
VOCAB = 96
_tf = nnx.jit(teacher_forced_logprobs, static_argnames="temperature")

HF_CASES = {
  "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True), 1e4),
  "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False), 1e6),
  "qwen3-tied-bias": ("qwen3", dict(tie_word_embeddings=True, attention_bias=True), 5e5),
}


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
  """A tiny random HF model saved by transformers, its sequences and HF's own log-probs."""
  model_type, extra, theta = HF_CASES[request.param]
  config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
  lm_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
  config = config_cls(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": theta},
    **extra,
  )
  torch.manual_seed(0)
  hf = lm_cls(config).eval()
  with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so they matter
    for name, p in hf.named_parameters():
      p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  rng = np.random.default_rng(1)
  seqs = [rng.integers(0, VOCAB, n).tolist() for n in SEQ_LENS]
  hf_lps = []
  for s in seqs:
    with torch.no_grad():
      logits = hf(torch.tensor([s])).logits[0].double()
    hf_lps.append(torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy())
  return dict(
    path=str(path), seqs=seqs, hf_lps=hf_lps, theta=theta, model_type=model_type, tied=extra["tie_word_embeddings"]
  )


def test_config_read_from_transformers(hf_case):
  cfg = ModelConfig.from_pretrained(hf_case["path"])
  assert (cfg.model_type, cfg.rope_theta, cfg.tie_word_embeddings) == (
    hf_case["model_type"],
    hf_case["theta"],
    hf_case["tied"],
  )
  assert cfg.head_dim == 16 and cfg.num_key_value_heads == 2


def test_logprobs_match_transformers_unpacked(hf_case):
  model = load_hf_checkpoint(hf_case["path"])
  width = max(SEQ_LENS)
  ids = np.zeros((len(SEQ_LENS), width), np.int32)
  seg = np.full_like(ids, -1)
  for i, s in enumerate(hf_case["seqs"]):
    ids[i, : len(s)], seg[i, : len(s)] = s, 0
  pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
  lp = np.asarray(
    _tf(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), jnp.roll(jnp.asarray(ids), -1, axis=1))
  )
  for i, (s, ref) in enumerate(zip(hf_case["seqs"], hf_case["hf_lps"])):
    assert np.std(ref) > 0.3  # a peaked distribution, not a near-uniform one
    np.testing.assert_allclose(lp[i, : len(s) - 1], ref, atol=1e-5, rtol=0)


def test_logprobs_match_transformers_packed(hf_case):
  """All sequences in one row (then padding), positions restarting per segment."""
  model = load_hf_checkpoint(hf_case["path"])
  row = 32
  ids, pos, seg, tgt = (np.zeros(row, np.int32) for _ in range(4))
  seg[:] = -1
  start = 0
  for i, s in enumerate(hf_case["seqs"]):
    n = len(s)
    ids[start : start + n], pos[start : start + n], seg[start : start + n] = s, np.arange(n), i
    tgt[start : start + n - 1] = s[1:]
    start += n
  lp = np.asarray(_tf(model, *(jnp.asarray(a)[None] for a in (ids, pos, seg, tgt))))[0]
  start = 0
  for s, ref in zip(hf_case["seqs"], hf_case["hf_lps"]):
    np.testing.assert_allclose(lp[start : start + len(s) - 1], ref, atol=1e-5, rtol=0)
    start += len(s)


def test_transformers_loads_our_checkpoint(tmp_path):
  """The other direction: a checkpoint we write is a valid HF checkpoint with our numbers."""
  cfg = dataclasses.replace(PRESETS["tiny-qwen3-untied"], initializer_range=0.3)
  init_checkpoint(tmp_path, config=cfg, seed=3)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  seq = list(range(3, 20))
  with torch.no_grad():
    ref = hf(torch.tensor([seq])).logits[0].numpy()
  ours = sequence_logits(load_hf_checkpoint(tmp_path), seq)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_save_load_round_trip_float32_is_bit_exact(tmp_path, tiny_model):
  save_hf_checkpoint(tiny_model, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  loaded = load_hf_checkpoint(tmp_path)
  assert loaded.config == tiny_model.config
  want, got = hf_state_dict(tiny_model), hf_state_dict(loaded)
  assert want.keys() == got.keys() == read_hf_tensors(tmp_path).keys()
  for name in want:
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))


def test_save_load_round_trip_bfloat16_is_bit_exact(tmp_path, tiny_model):
  save_hf_checkpoint(tiny_model, tmp_path / "a", dtype="bfloat16")
  loaded = load_hf_checkpoint(tmp_path / "a", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  want = hf_state_dict(tiny_model, dtype="bfloat16")
  got = hf_state_dict(loaded)
  for name in want:
    assert got[name].dtype == jnp.bfloat16
    np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))
  save_hf_checkpoint(loaded, tmp_path / "b", dtype="bfloat16")
  for f in ("model.safetensors", "config.json"):
    assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
  assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_hf_names(tiny_model):
  names = set(hf_state_dict(tiny_model))
  assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied
  assert {
    "model.layers.1.self_attn.q_norm.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
  } <= names
  q = hf_state_dict(tiny_model)["model.layers.0.self_attn.q_proj.weight"]
  assert q.shape == (TINY.num_attention_heads * TINY.head_dim, TINY.hidden_size)  # torch [out, in]


def test_mismatched_checkpoint_is_rejected_naming_tensors(tmp_path, tiny_model):
  save_hf_checkpoint(CausalLM(dataclasses.replace(TINY, vocab_size=80), rngs=nnx.Rngs(1)), tmp_path / "v")
  with pytest.raises(ValueError, match=r"shape mismatch: model\.embed_tokens\.weight"):
    state_from_hf_tensors(tiny_model, read_hf_tensors(tmp_path / "v"))
  save_hf_checkpoint(CausalLM(PRESETS["tiny-qwen2"], rngs=nnx.Rngs(1)), tmp_path / "q2")
  with pytest.raises(ValueError, match=r"missing: .*q_norm.*unexpected: .*q_proj\.bias"):
    state_from_hf_tensors(tiny_model, read_hf_tensors(tmp_path / "q2"))
  with pytest.raises(FileNotFoundError):
    read_hf_tensors(tmp_path)


def test_temperature_scaling_matches_numpy(tiny_model):
  seq = [1, 5, 9, 33, 7, 21, 2, 60]
  logits = sequence_logits(tiny_model, seq).astype(np.float64)
  ids = jnp.asarray([seq], jnp.int32)
  pos, seg = jnp.arange(len(seq), dtype=jnp.int32)[None], jnp.zeros_like(ids)
  for t in (0.5, 1.7):
    z = logits / t
    want = z[np.arange(len(seq)), np.roll(seq, -1)] - np.log(np.exp(z).sum(-1))
    got = _tf(tiny_model, ids, pos, seg, jnp.roll(ids, -1, axis=1), temperature=t)
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-5, rtol=0)
  with pytest.raises(ValueError, match="temperature"):
    teacher_forced_logprobs(tiny_model, ids, pos, seg, ids, temperature=0.0)


def test_padding_and_neighbours_do_not_leak(tiny_model):
  """A sequence's logits are the same alone, next to another segment, and before padding."""
  a, b = [1, 4, 8, 15, 16], [1, 23, 42]
  forward = nnx.jit(lambda m, *args: m(*(jnp.asarray([x], jnp.int32) for x in args)))
  alone = np.asarray(forward(tiny_model, a + [0] * 5, list(range(10)), [0] * 5 + [-1] * 5))
  packed = np.asarray(
    forward(tiny_model, b + a + [0, 0], [0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 0, 0, 1, 1, 1, 1, 1, -1, -1])
  )
  np.testing.assert_allclose(packed[0, 3:8], alone[0, :5], atol=1e-5, rtol=0)


def test_unrolled_layers_equal_the_layer_scan(tiny_model):
  """`layer_loop="unrolled"` runs the same layers as the scan: the packed forward and a cached
  prefill + decode step give the same logits (float32, up to XLA's reassociation)."""
  graphdef, params = nnx.split(tiny_model)
  unrolled = nnx.merge(nnx.graphdef(CausalLM(TINY, layer_loop="unrolled", rngs=nnx.Rngs(0))), params)
  assert unrolled.layer_loop == "unrolled" and tiny_model.layer_loop == "scan"
  ids = jnp.asarray([[1, 5, 9, 33, 7, 21, 2, 60]], jnp.int32)
  pos, seg = jnp.arange(8, dtype=jnp.int32)[None], jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1]], jnp.int32)
  forward = nnx.jit(lambda m: m(ids, pos, seg))
  np.testing.assert_allclose(np.asarray(forward(unrolled)), np.asarray(forward(tiny_model)), atol=1e-5, rtol=0)

  @nnx.jit
  def decoded(m):
    cache = m.init_cache(1, 16)
    first, cache = m.decode(ids, cache, slot=jnp.int32(0), start=jnp.zeros((1,), jnp.int32), window=8)
    step, cache = m.decode(ids[:, :1], cache, slot=jnp.int32(8), start=jnp.zeros((1,), jnp.int32), window=16)
    return first, step, cache.k

  for a, b in zip(decoded(unrolled), decoded(tiny_model)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="layer_loop='loop'; allowed: auto, scan, unrolled"):
    CausalLM(TINY, layer_loop="loop", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_the_fused_gate_up_product_equals_two_products(mlp_bias):
  """The teacher-forced forward's MLP multiplies by `[W_gate | W_up]` once: the same outputs and
  gradients as the two products (float32, up to the GEMM's summation order), biases included."""
  cfg = dataclasses.replace(PRESETS["tiny-llama3"], mlp_bias=mlp_bias)  # Llama: the MLP's biases optional
  assert cfg.features.mlp_bias == mlp_bias
  graphdef, params = nnx.split(DecoderLayer(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
  if mlp_bias:  # nonzero biases, so their concatenation is checked too
    params = jax.tree_util.tree_map_with_path(
      lambda path, a: a + 0.1 if "bias" in jax.tree_util.keystr(path) else a, params
    )
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size))
  run = lambda p, fused: jnp.sum(jnp.sin(nnx.merge(graphdef, p).mlp(x, fused=fused)))
  (value, grads), (want_value, want_grads) = (jax.value_and_grad(run)(params, f) for f in (True, False))
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
  "setting, layers, want",
  [
    ("auto", 4, ("unrolled", "4 layers <= 8")),
    ("auto", 8, ("unrolled", "8 layers <= 8")),
    ("auto", 28, ("scan", "28 layers > 8: one compiled layer body")),
    ("scan", 2, ("scan", "configured")),
    ("unrolled", 28, ("unrolled", "configured")),
  ],
)
def test_the_layer_loop_is_resolved_by_depth(setting, layers, want):
  assert resolve_layer_loop(setting, layers) == want


def test_bfloat16_model_is_close_but_not_equal(tiny_checkpoint):
  f32 = load_hf_checkpoint(tiny_checkpoint)
  bf16 = load_hf_checkpoint(tiny_checkpoint, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  seq = list(range(1, 30))
  a, b = sequence_logits(f32, seq), sequence_logits(bf16, seq)
  assert b.dtype == np.float32
  diff = np.abs(jax.nn.log_softmax(a) - jax.nn.log_softmax(b))
  assert 0 < float(diff.mean()) < 0.05


def test_config_validation_and_round_trip():
  for cfg in PRESETS.values():
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
  d = PRESETS["tiny-qwen3"].to_hf_dict()
  with pytest.raises(ValueError, match="sliding"):
    ModelConfig.from_hf_dict({**d, "use_sliding_window": True})
  with pytest.raises(ValueError, match="model_type"):
    ModelConfig.from_hf_dict({**d, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
  with pytest.raises(ValueError, match="multiple"):
    dataclasses.replace(PRESETS["tiny-qwen3"], num_key_value_heads=3)
  with pytest.raises(ValueError, match="RoPE"):
    ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
