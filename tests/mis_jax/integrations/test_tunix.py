"""mis_jax inside tunix's GRPO, against the real google-tunix package (the `tunix` extra).

A tiny tunix Qwen3 on one CPU device, tunix's vanilla sampler, one training step per learner
(SGD, so a parameter change is the gradient times the learning rate):

* on-policy: MISGRPOLearner (decoupled PPO + sequence MIS with rejection) moves the weights as
  stock tunix GRPO does, KL to a reference included;
* injected mismatch (rollout log-probs perturbed at the engine): the learner's weights, loss
  and logged metrics equal mis_jax called directly on the same tokens, packed, for decoupled
  PPO + MIS and for token TIS;
* temperature 0.7: the recomputed old log-probs equal the sampler's to float32 rounding, where
  tunix's own old log-probs (temperature 1) do not;
* an engine that returns no log-probs stops training before any update, naming the engine.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType

from tunix.models.qwen3 import model as qwen3
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

import mis_jax
from mis_jax.integrations import tunix as mis_tunix
from tunix_helpers import logged, perturb_rollout_logprobs

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

LR = 0.05
TEMPERATURE = 0.7
PROMPTS = np.array(["1+2=", "3+4="])
MODEL = qwen3.ModelConfig(
  num_layers=2,
  vocab_size=34,
  embed_dim=32,
  hidden_dim=64,
  num_heads=2,
  head_dim=16,
  num_kv_heads=1,
  rope_theta=1_000_000,
  norm_eps=1e-6,
  use_tied_embedding=False,
)
MIS = mis_jax.MISConfig(tis_level="sequence", use_rs=True, tis_upper_bound=2.0)


@pytest.fixture(autouse=True, scope="module")
def tunix_numpy_rules():
  """tunix relies on JAX's standard promotion rules; the suite's are strict (conftest)."""
  old = jax.config.jax_numpy_dtype_promotion, jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  jax.config.update("jax_numpy_rank_promotion", "allow")
  yield
  jax.config.update("jax_numpy_dtype_promotion", old[0])
  jax.config.update("jax_numpy_rank_promotion", old[1])


def _load_example():
  """examples/tunix_grpo_mis.py as a module (`make example-tunix` runs it; its tokenizer serves here)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("tunix_grpo_mis", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "tunix_grpo_mis.py"
example = _load_example()
CharTokenizer = example.CharTokenizer


def reward(prompts, completions, **kw):
  return [float(sum(c in "13579" for c in text)) for text in completions]


def make_cluster(*, with_reference=False, model=MODEL):
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(model, rngs=nnx.Rngs(0))
    reference = qwen3.Qwen3(model, rngs=nnx.Rngs(1)) if with_reference else actor
  rollout = base_rollout.RolloutConfig(
    max_tokens_to_generate=6, max_prompt_length=8, temperature=TEMPERATURE, top_p=1.0, kv_cache_size=32
  )
  config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={
      rl_cluster_lib.Role.ACTOR: mesh,
      rl_cluster_lib.Role.REFERENCE: mesh,
      rl_cluster_lib.Role.ROLLOUT: mesh,
    },
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(LR), eval_every_n_steps=1000, max_steps=1
    ),
    rollout_config=rollout,
  )
  return rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=CharTokenizer(), cluster_config=config)


def params(cluster):
  # Copies (np.array): np.asarray of a CPU jax.Array is a view of its buffer, which a later
  # computation may free and reuse (a 'before' snapshot that changed by itself).
  return jax.tree.map(np.array, nnx.state(cluster.actor_trainer.model, nnx.Param).to_pure_dict())


def record_examples(learner):
  """Keeps what the learner's rollout stage hands the training step."""
  examples = []
  produce = learner._generate_and_compute_advantage

  def recording(*args, **kwargs):
    example = produce(*args, **kwargs)
    examples.append(example)
    return example

  learner._generate_and_compute_advantage = recording
  return examples


def train_one_step(learner):
  learner.train([{"prompts": PROMPTS}])


def packed_direct_loss(model, example, loss_cfg):
  """mis_jax called directly: the completions packed end to end into one flat row of tokens."""
  lp = common.compute_per_token_logps(
    *nnx.split(model),
    prompt_tokens=example.prompt_ids,
    completion_tokens=example.completion_ids,
    pad_id=0,
    eos_id=2,
    stop_gradient=False,
    temperature=TEMPERATURE,
  )
  mask = np.asarray(example.completion_mask).astype(bool)
  rows, cols = np.nonzero(mask)
  take = lambda x: jnp.asarray(x)[rows, cols]
  batch = mis_jax.PackedBatch(
    segment_ids=jnp.asarray(rows, jnp.int32),
    loss_mask=jnp.ones(len(rows), bool),
    advantages=jnp.asarray(np.asarray(example.advantages)[rows], jnp.float32),
    rollout_logprobs=take(example.rollout_per_token_logps),
    old_logprobs=take(example.old_per_token_logps),
    num_segments=mask.shape[0],
  )
  entropy = jnp.zeros(len(rows), jnp.float32)
  return mis_jax.policy_loss(take(lp), batch, loss_cfg, entropy=entropy)


def test_on_policy_equals_stock_grpo():
  """Also: tunix's own learner given the loss by name (`policy_loss_fn="mis_jax"`) takes the
  same step as with its own "grpo" loss (standard PPO either way)."""
  stock_cluster, ours_cluster = make_cluster(with_reference=True), make_cluster(with_reference=True)
  by_name_cluster = make_cluster(with_reference=True)
  before = params(stock_cluster)
  stock = grpo_learner.GRPOLearner(
    stock_cluster, grpo_learner.GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), [reward]
  )
  ours = mis_tunix.MISGRPOLearner(
    ours_cluster,
    mis_tunix.MISGRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl", use_tis=True, mis=MIS),
    [reward],
  )
  by_name = grpo_learner.GRPOLearner(
    by_name_cluster,
    grpo_learner.GRPOConfig(
      num_generations=2, beta=0.04, kl_loss_mode="low_var_kl", policy_loss_fn=mis_tunix.LOSS_NAME
    ),
    [reward],
  )
  stock_examples, our_examples = record_examples(stock), record_examples(ours)
  train_one_step(stock)
  train_one_step(ours)
  train_one_step(by_name)
  np.testing.assert_array_equal(stock_examples[0].completion_ids, our_examples[0].completion_ids)
  assert float(np.std(np.asarray(our_examples[0].advantages))) > 0  # a real gradient
  # No mismatch: the sampler's log-probs are the trainer's to float32 rounding.
  q, o = np.asarray(our_examples[0].rollout_per_token_logps), np.asarray(our_examples[0].old_per_token_logps)
  mask = np.asarray(our_examples[0].completion_mask).astype(bool)
  assert np.max(np.abs(q - o)[mask]) < 1e-4
  assert logged(ours_cluster, "mis_kept_seq_fraction")[0] == 1.0
  # The same step: the gradients (parameter change / LR) agree leaf by leaf.
  grads = lambda c: jax.tree.map(lambda a, b: (a - b) / LR, before, params(c))
  stock_grads, our_grads = grads(stock_cluster), grads(ours_cluster)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-6), stock_grads, our_grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-6), stock_grads, grads(by_name_cluster))
  assert max(float(np.max(np.abs(g))) for g in jax.tree.leaves(our_grads)) > 1e-3
  np.testing.assert_allclose(
    logged(ours_cluster, "loss"),
    stock_cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train"),
    rtol=1e-5,
    atol=1e-7,
  )
  np.testing.assert_allclose(logged(ours_cluster, "kl"), logged(stock_cluster, "kl"), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  "settings",
  [
    pytest.param(dict(use_tis=True, mis=MIS), id="decoupled_ppo-mis"),
    pytest.param(dict(use_tis=True, tis_clip=1.5), id="token_tis"),
    pytest.param(
      dict(use_tis=True, mis=mis_jax.MISConfig(tis_mode="truncate", tis_upper_bound="auto", target_ess_ratio=0.95)),
      id="decoupled_ppo-auto",
    ),
  ],
)
def test_injected_mismatch_equals_mis_jax_directly(settings):
  cluster = make_cluster()
  before = nnx.clone(cluster.actor_trainer.model)
  config = mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0, **settings)
  learner = mis_tunix.MISGRPOLearner(cluster, config, [reward])
  assert config.loss_config.algorithm == "decoupled_ppo"
  perturb_rollout_logprobs(cluster, scale=0.3)
  examples = record_examples(learner)
  train_one_step(learner)
  example = examples[0]
  (loss, metrics), grads = nnx.value_and_grad(
    lambda m: packed_direct_loss(m, example, config.loss_config), has_aux=True
  )(before)
  # The mismatch is real and the correction acts.
  assert metrics["mis_k3_kl"] > 1e-3
  if config.loss_config.mis is not None:
    assert abs(float(metrics["mis_is_ratio_mean_final"]) - 1.0) > 1e-3
  else:  # vanilla token TIS: the clip at 1.5 changed some weights
    assert float(metrics["tis_clipfrac"]) > 0
  if "mis_auto_tis_upper_bound" in metrics:  # the threshold controller, on tunix's batch
    assert float(metrics["mis_auto_target_met"]) == 1.0 and float(metrics["mis_auto_ess_ratio"]) >= np.float32(0.95)
  expected = jax.tree.map(
    lambda p, g: np.asarray(p) - LR * np.asarray(g), nnx.state(before, nnx.Param).to_pure_dict(), grads.to_pure_dict()
  )
  jax.tree.map(lambda e, a: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6), expected, params(cluster))
  np.testing.assert_allclose(logged(cluster, "loss")[0], float(loss), rtol=1e-5, atol=1e-7)
  for name, value in metrics.items():
    if name in ("loss", "entropy_loss"):  # the direct call passed no entropy
      continue
    np.testing.assert_allclose(logged(cluster, name)[0], float(value), rtol=1e-5, atol=1e-6, err_msg=name)
  assert set(learner.metric_names) >= set(metrics) - {"loss"}


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_temperature_old_logprobs_match_the_sampler(num_iterations):
  """With num_iterations 2 tunix itself asks the cluster for old log-probs (the learner's
  temperature-aware replacement answers); with 1 the learner computes them."""
  cluster = make_cluster()
  learner = mis_tunix.MISGRPOLearner(
    cluster, mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0, num_iterations=num_iterations), [reward]
  )
  learner._rollout_micro_batch_size = learner._compute_logps_micro_batch_size = len(PROMPTS)  # set by train()
  example = learner._generate_and_compute_advantage({"prompts": list(np.repeat(PROMPTS, 2))})
  mask = np.asarray(example.completion_mask).astype(bool)
  q, o = np.asarray(example.rollout_per_token_logps), np.asarray(example.old_per_token_logps)
  assert mask.sum() > 4
  assert np.max(np.abs(o - q)[mask]) < 1e-4  # float32 rounding (decode with a KV cache vs one forward)
  # tunix's own old log-probs ignore the temperature: off by far more than rounding.
  stock = np.asarray(cluster.rollout.get_per_token_logps(example.prompt_ids, example.completion_ids))
  assert np.max(np.abs(stock - q)[mask]) > 0.05


def test_an_engine_without_logprobs_stops_before_any_update():
  cluster = make_cluster()
  before = params(cluster)
  learner = mis_tunix.MISGRPOLearner(
    cluster, mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0, use_tis=True), [reward]
  )
  assert cluster.cluster_config.rollout_config.return_logprobs  # the learner asked for them
  generate = cluster.rollout.generate

  def without_logprobs(*args, **kwargs):
    out = generate(*args, **kwargs)
    out.logprobs = None
    return out

  cluster.rollout.generate = without_logprobs
  with pytest.raises(mis_tunix.MissingRolloutLogprobs, match="'vanilla' rollout engine returned no log-probs"):
    train_one_step(learner)
  jax.tree.map(np.testing.assert_array_equal, before, params(cluster))


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen2"])
def test_which_tunix_models_ignore_rope_theta(family):
  """ROPE_THETA_IGNORED is tunix's behaviour: its Qwen3 and Llama3 give the same logits at theta
  1e4 and 1e6 (both 1e6), its Qwen2 does not."""
  import importlib

  module = importlib.import_module(f"tunix.models.{family}.model")
  cls = {"qwen3": "Qwen3", "llama3": "Llama3", "qwen2": "Qwen2"}[family]
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  tokens, logits = jnp.arange(1, 9)[None], []
  for theta in (10_000, 1_000_000):
    config = module.ModelConfig(
      **{
        f.name: getattr(MODEL, f.name)
        for f in dataclasses.fields(MODEL)
        if f.name
        in ("num_layers", "vocab_size", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads", "norm_eps")
      },
      rope_theta=theta,
    )
    with jax.set_mesh(mesh):
      model = getattr(module, cls)(config, rngs=nnx.Rngs(0))
      logits.append(np.asarray(model(tokens, jnp.arange(8)[None], None, jnp.tril(jnp.ones((8, 8), bool))[None])[0]))
    assert mis_tunix.rope_theta_computed(config) == (1e6 if module.__name__ in mis_tunix.ROPE_THETA_IGNORED else theta)
  ignored = module.__name__ in mis_tunix.ROPE_THETA_IGNORED
  assert ignored == (family != "qwen2")
  assert (np.max(np.abs(logits[0] - logits[1])) == 0) == ignored


def test_the_learner_refuses_a_rope_theta_tunix_ignores():
  """The example's former theta: tunix's Qwen3 computes with 1e6, an engine reading 10000 samples
  from another model (0.17 nats mean |Δ log p| on the example's tiny Qwen3)."""
  cluster = make_cluster(model=dataclasses.replace(MODEL, rope_theta=10_000))
  with pytest.raises(mis_jax.ConfigError, match="rope_theta=10000, but tunix's model applies RoPE with theta 1000000"):
    mis_tunix.MISGRPOLearner(cluster, mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0), [reward])
  mis_tunix.check_rope_theta(MODEL)  # 1e6: what it computes
  mis_tunix.check_rope_theta(None)


def test_untrainable_completions():
  ids = np.array(
    [
      [7, 0, 18, 0, 0],  # a sampled pad, then a token: untrainable
      [7, 18, 0, 0, 0],  # padding (or a pad == eos stop) at the end only
      [7, 1, 18, 2, 0],  # bos and eos sampled: trainable as they are
      [0, 0, 0, 0, 0],
    ]
  )
  np.testing.assert_array_equal(mis_tunix.untrainable_completions(ids, 0), [True, False, False, False])


def test_a_sampled_pad_mid_completion_is_out_of_the_loss_and_counted():
  """tunix masks `tokens != pad` and rebuilds positions from it: a completion with a pad id the
  engine sampled before other tokens cannot be trained as sampled, so it leaves the loss."""
  cluster = make_cluster()
  learner = mis_tunix.MISGRPOLearner(
    cluster, mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0, use_tis=True, mis=MIS), [reward]
  )
  generate = cluster.rollout.generate
  broken = []

  def sampling_a_pad(*args, **kwargs):
    out = generate(*args, **kwargs)
    b = next(b for b, t in enumerate(out.tokens) if len(t) >= 3)
    out.tokens[b] = np.asarray(out.tokens[b]).copy()
    out.tokens[b][1] = 0
    broken.append(b)
    return out

  cluster.rollout.generate = sampling_a_pad
  examples = record_examples(learner)
  train_one_step(learner)
  (example,), (b,) = examples, broken
  ids, mask = np.asarray(example.completion_ids), np.asarray(example.completion_mask).astype(bool)
  assert not mask[b].any()
  rest = ~mis_tunix.untrainable_completions(ids, 0)  # the sampler's own pads too, if any
  assert not rest[b] and rest.sum() > 0
  np.testing.assert_array_equal(mask[rest], (ids != 0)[rest])
  assert not mask[~rest].any()
  logged_count = cluster._rl_metrics_logger.get_metric_history("completions", "untrainable", "train")
  assert list(logged_count) == [int((~rest).sum())]
  np.testing.assert_allclose(logged(cluster, "mis_kept_seq_fraction"), [1.0])  # live rows only


def test_the_stock_learner_cannot_feed_the_correction():
  """The loss is registered by name; with tunix's own learner it has no rollout log-probs."""
  cluster = make_cluster()
  config = mis_tunix.MISGRPOConfig(num_generations=2, beta=0.0, use_tis=True)
  learner = grpo_learner.GRPOLearner(cluster, config, [reward])
  with pytest.raises(mis_tunix.MissingRolloutLogprobs, match="MISGRPOLearner"):
    train_one_step(learner)


def test_sglang_jax_hint_and_misalignment_errors():
  out = base_rollout.RolloutOutput(
    text=["a"], logits=None, tokens=[np.array([3, 4])], left_padded_prompt_tokens=np.zeros((1, 2), int), logprobs=None
  )
  with pytest.raises(mis_tunix.MissingRolloutLogprobs, match="sglang_jax rollout never returns them"):
    mis_tunix.rollout_logprobs(out, np.zeros((1, 4), int), engine="sglang_jax")
  out.logprobs = [np.array([-1.0])]
  with pytest.raises(ValueError, match="completion 0: .* 1 log-probs for 2 tokens"):
    mis_tunix.rollout_logprobs(out, np.zeros((1, 4), int))
  out.logprobs = [np.array([-1.0, np.nan])]
  with pytest.raises(ValueError, match="log-prob at token 1 is nan"):
    mis_tunix.rollout_logprobs(out, np.zeros((1, 4), int))
  out.logprobs = [np.array([-1.0, -2.0])]
  np.testing.assert_array_equal(mis_tunix.rollout_logprobs(out, np.zeros((1, 4), int)), [[-1.0, -2.0, 0.0, 0.0]])


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(loss_agg_mode="sequence-mean-token-scale"), "loss_agg_mode='sequence-mean-token-scale'"),
    (dict(loss_algo="gspo-token"), "loss_algo='gspo-token'"),
    (dict(kl_loss_mode="kl", kl_clamp_value=10.0), "kl_clamp_value=10.0"),
    (dict(epsilon=1.5), "epsilon must be in"),
    (dict(epsilon_c=0.5), "epsilon_c"),
    (dict(policy_loss_fn="grpo"), "policy_loss_fn must be 'mis_jax'"),
    (dict(mis={"tis_levle": "token"}), "tis_levle"),
    (dict(use_tis=False, mis={"use_tis": True}), "contradicts"),
  ],
)
def test_config_errors_name_the_key(kwargs, match):
  with pytest.raises(mis_jax.ConfigError, match=match):
    mis_tunix.MISGRPOConfig(num_generations=2, **kwargs)


def test_config_maps_tunix_settings_and_reads_a_mis_yaml(tmp_path):
  path = tmp_path / "mis.yaml"
  path.write_text("use_tis: true\ntis_level: sequence\nuse_rs: true\ntis_upper_bound: 3.0\n")
  config = mis_tunix.MISGRPOConfig(
    num_generations=2,
    epsilon=0.1,
    epsilon_high=0.3,
    beta=0.01,
    kl_loss_mode="mse_kl",
    loss_agg_mode="token-mean",
    mis=str(path),
    use_rollout_logprobs=True,
  )
  cfg = config.loss_config
  assert (cfg.algorithm, cfg.eps_clip, cfg.clip_high, cfg.kl_coef, cfg.kl_type, cfg.loss_agg_mode) == (
    "reinforce_is",
    0.1,
    0.3,
    0.01,
    "k2",
    "token-mean",
  )
  assert cfg.mis.tis_upper_bound == 3.0 and cfg.mis.source == str(path)
  with pytest.raises(mis_jax.ConfigError, match="max_seq_token_per_tpu"):
    cluster = make_cluster()
    object.__setattr__(cluster.cluster_config.training_config, "max_seq_token_per_tpu", 64)
    mis_tunix.MISGRPOLearner(cluster, config, [reward])


def test_the_example_runs_and_shows_the_bf16_sampler_mismatch(capsys):
  """`make example-tunix` runs examples/tunix_grpo_mis.py; here its first step, in-process."""
  history = example.main(["--steps", "1", "--mis", str(EXAMPLE.parents[1] / "configs" / "mis.yaml")])
  assert len(history["mis_k3_kl"]) == 1
  assert history["train_rollout_logprob_abs_diff"][0] > 1e-4  # bfloat16 engine vs float32 trainer
  assert "mis_kept_token_fraction" in capsys.readouterr().out


def test_tunix_grpo_with_sglang_jax_trains_what_the_engine_sampled(tmp_path):
  """tunix 0.1.7 and sglang-jax 0.1.0rc0 share sglang-jax's venv (Python >= 3.12); there
  tests/mis_jax/integrations/tunix_sglang_jax_driver.py runs, in one process: completion_logprobs'
  positional alignment; the example's GRPO with sglang-jax in process (`make
  example-tunix-sglang-jax`, 2 steps), every trained token's engine log-prob within 1e-5 of
  tunix's from the same float32 weights; and the example's model made to sample pad, bos and eos
  ids, whose completions keep every sampled id, the pad-broken ones out of the loss and counted."""
  import json
  import os
  import subprocess

  from trainers.serving.sglang_jax import launcher as sglang_jax

  try:
    python = sglang_jax.venv_python(extra=(sglang_jax.TUNIX,))
  except sglang_jax.EngineUnavailable as e:
    if os.environ.get("CI") == "true":
      pytest.fail(f"sglang-jax + tunix must run in CI: {e}")
    pytest.skip(str(e))
  out = tmp_path / "result.json"
  env = {**sglang_jax.engine_env(), "PYTHONPATH": str(EXAMPLE.parents[1])}
  done = subprocess.run(
    [python, str(pathlib.Path(__file__).with_name("tunix_sglang_jax_driver.py")), str(tmp_path), str(out)],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    cwd=EXAMPLE.parents[1],
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  history = result["example_history"]
  assert history["sampler"] == "sglang-jax" and len(history["mis_k3_kl"]) == 2
  assert all(d <= 1e-5 for d in history["train_rollout_logprob_abs_diff"]), history
  assert result["example_gap_max"] <= 1e-5 and result["example_trained_tokens"] > 100, result
  assert len(history["untrainable"]) == 2
  assert result["special_untrainable"] > 0 and result["special_bos_mid_trained"] > 0, result
  assert result["special_gap_max"] <= 1e-5, result
