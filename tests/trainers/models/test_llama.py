"""Llama through the model registry: checkpoints written by transformers' `save_pretrained`
(Llama 3 without RoPE scaling, untied; Llama 3.1-style `llama3` RoPE scaling, tied, with
attention and MLP biases) give HF's log-probs packed and unpacked, greedy generation by the
serving engine gives HF's tokens and log-probs, configs and weights round-trip, and
`mis-jax train` trains 2 steps on one."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers import cli
from trainers.models import PRESETS, ModelConfig, RopeScaling, load_hf_checkpoint, teacher_forced_logprobs
from trainers.models import decoder
from trainers.serving.embedded.sampler import Sampler, SamplingOptions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
SEQ_LENS = (9, 14, 5)
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 32,
}
CASES = {
  "llama3-untied": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
  "llama3.1-scaled-tied-biases": dict(
    tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
  ),
}
_tf = nnx.jit(teacher_forced_logprobs, static_argnames="temperature")


def save_hf_llama(path, case: str):
  """A tiny random `LlamaForCausalLM` of `CASES[case]`, saved by transformers to `path`."""
  config = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    **CASES[case],
  )
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so they matter
    for name, p in hf.named_parameters():
      p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
  hf.save_pretrained(path)
  return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def llama(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  return dict(name=request.param, path=str(path), hf=save_hf_llama(path, request.param))


def _hf_logprobs(hf, seq):
  with torch.no_grad():
    logits = hf(torch.tensor([seq])).logits[0].double()
  return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()


def test_config_read_from_transformers(llama):
  cfg = ModelConfig.from_pretrained(llama["path"])
  assert cfg.model_type == "llama" and cfg.family.name == "llama" and cfg.rms_norm_eps == 1e-5
  if "scaled" in llama["name"]:
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32) and cfg.tie_word_embeddings
    assert cfg.features.qkv_bias and cfg.features.o_bias and cfg.features.mlp_bias and not cfg.features.qk_norm
  else:
    assert cfg.rope_scaling is None and not cfg.tie_word_embeddings and not cfg.features.qkv_bias
  # The scaled inverse frequencies are transformers' own.
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf_cfg = llama["hf"].config
  kind = hf_cfg.rope_parameters["rope_type"]
  if kind != "default":
    want, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    np.testing.assert_allclose(decoder.rope_inv_freq(cfg), want.numpy(), rtol=3e-7)  # float32 pow: 1 ulp
  assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_logprobs_match_transformers_packed_and_unpacked(llama):
  model = load_hf_checkpoint(llama["path"])
  rng = np.random.default_rng(1)
  seqs = [rng.integers(3, VOCAB, n).tolist() for n in SEQ_LENS]
  refs = [_hf_logprobs(llama["hf"], s) for s in seqs]
  width = max(SEQ_LENS)
  ids = np.zeros((len(seqs), width), np.int32)
  seg = np.full_like(ids, -1)
  for i, s in enumerate(seqs):
    ids[i, : len(s)], seg[i, : len(s)] = s, 0
  pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
  lp = np.asarray(_tf(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), jnp.roll(jnp.asarray(ids), -1, 1)))
  for i, (s, ref) in enumerate(zip(seqs, refs)):
    assert np.std(ref) > 0.3
    np.testing.assert_allclose(lp[i, : len(s) - 1], ref, atol=1e-5, rtol=0)
  # All in one row, positions restarting per segment.
  row = 32
  ids, pos, seg, tgt = (np.zeros(row, np.int32) for _ in range(4))
  seg[:] = -1
  start = 0
  for i, s in enumerate(seqs):
    n = len(s)
    ids[start : start + n], pos[start : start + n], seg[start : start + n] = s, np.arange(n), i
    tgt[start : start + n - 1] = s[1:]
    start += n
  lp = np.asarray(_tf(model, *(jnp.asarray(a)[None] for a in (ids, pos, seg, tgt))))[0]
  start = 0
  for s, ref in zip(seqs, refs):
    np.testing.assert_allclose(lp[start : start + len(s) - 1], ref, atol=1e-5, rtol=0)
    start += len(s)


def test_greedy_generation_matches_transformers(llama):
  """The serving engine's sampler (KV cache, float32) greedy-decodes HF's tokens with HF's log-probs."""
  sampler = Sampler(load_hf_checkpoint(llama["path"]), max_batch_size=2)
  prompt = [1, 17, 40, 5, 63]
  (c,) = sampler.generate([prompt], SamplingOptions(temperature=0.0, max_new_tokens=10, ignore_eos=True))
  seq, hf_lps = list(prompt), []
  with torch.no_grad():  # HF's own greedy decoding, step by step (no stop token, as ignore_eos)
    for _ in range(10):
      logp = torch.log_softmax(llama["hf"](torch.tensor([seq])).logits[0, -1].double(), -1)
      seq.append(int(logp.argmax()))
      hf_lps.append(float(logp[seq[-1]]))
  assert c.output_ids == seq[len(prompt) :]
  np.testing.assert_allclose(c.logprobs, hf_lps, atol=2e-5)


def test_our_llama_checkpoint_loads_in_transformers(tmp_path):
  from trainers.models import init_checkpoint

  init_checkpoint(tmp_path, config=PRESETS["tiny-llama3"], seed=4)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["architectures"] == ["LlamaForCausalLM"] and saved["rope_parameters"]["rope_type"] == "llama3"
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  seq = list(range(3, 40))
  with torch.no_grad():
    ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
  from conftest import sequence_logits

  ours = np.asarray(sequence_logits(load_hf_checkpoint(tmp_path), seq), np.float64)
  ours = ours - np.log(np.exp(ours - ours.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ours.max(-1, keepdims=True)
  np.testing.assert_allclose(ours, ref, atol=1e-4)


@pytest.mark.integration
def test_mis_jax_train_two_steps_on_a_transformers_llama(tmp_path, capsys):
  """The scaled, tied, biased case: served by the embedded server (float32), trained 2 steps."""
  save_hf_llama(tmp_path / "llama", "llama3.1-scaled-tied-biases")
  llama = {"path": str(tmp_path / "llama")}
  run_dir = tmp_path / "run"
  code = cli.main(
    [
      "train",
      "--config",
      "configs/demo.yaml",
      "--run-dir",
      str(run_dir),
      "--steps",
      "2",
      "--no-progress",
      "--set",
      f"model.path={llama['path']}",
      "--set",
      "rollout.prompts_per_step=4",
      "--set",
      "rollout.n=4",
      "--set",
      "rollout.placement.server_dtype=float32",
      "--set",
      "train.row_len=16",
    ]
  )
  out = capsys.readouterr()
  assert code == 0, out.err[-2000:]
  lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2] and all(np.isfinite(x["loss"]) for x in lines)
  assert lines[0]["mis_k3_kl"] < 1e-6  # float32 server on the same weights: no mismatch
  pushed = json.loads((run_dir / "weights" / "step_2" / "config.json").read_text())
  assert pushed["architectures"] == ["LlamaForCausalLM"] and pushed["rope_parameters"]["rope_type"] == "llama3"
