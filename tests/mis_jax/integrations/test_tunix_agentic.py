"""mis_jax inside tunix's agentic GRPO (`AgenticGRPOLearner`), against the real google-tunix 0.1.7.

A tiny tunix Qwen3 on one CPU device, tunix's vanilla sampler, a character tokenizer and chat
parser, and a two-turn environment from tunix's own agentic API (`BaseTaskEnv`): the model
answers, the environment replies (`<u>ok 7<a>`, loss mask 0), the model answers again. SGD, so a
parameter change is the gradient times the learning rate.

* decoupled PPO + token TIS with the engine's log-probs perturbed: each step's weights equal
  the previous ones minus LR × the gradient of `mis_jax.policy_loss` over the model tokens only,
  packed; the logged loss equals an independent NumPy computation of the formula;
* the environment's tokens' log-probs (rollout, old and reference), perturbed by any amount,
  leave the loss, the gradient and every metric unchanged;
* the weights move at every step;
* decoupled PPO + sequence MIS with rejection, on-policy: the sampler's log-probs equal the
  trainer's on every model token of every turn (this chat parser renders append-only), every
  sequence kept, the step equal to mis_jax's on the packed model tokens;
* an engine turn without log-probs stops the run, naming the engine, before its group or a later
  one reaches an update, whichever group finishes first (both orders forced); an update made from
  an earlier whole micro-batch stands;
* the constructor is tunix's; config errors name the key.
"""

from __future__ import annotations

import inspect
import threading

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
from tunix.rl.agentic import agentic_grpo_learner
from tunix.rl.agentic.environments import base_environment
from tunix.rl.agentic.parser.chat_template_parser import parser as chat_parser_lib
from tunix.rl.rollout import base_rollout

import mis_jax
from mis_jax.integrations import tunix as mis_tunix
from tunix_helpers import logged, perturb_rollout_logprobs
from mis_jax.integrations import tunix_agentic as mis_agentic

pytestmark = pytest.mark.integration  # the real tunix package, several training runs

LR = 0.05
TEMPERATURE = 0.9
MAX_RESPONSE = 32
EPS = 0.2
TIS_CLIP = 1.2
MIS = mis_jax.MISConfig(tis_level="sequence", use_rs=True, tis_upper_bound=2.0)
OBSERVATION = "ok 7"


class CharTokenizer:
  """One id per character; 0 pad, 1 bos, 2 eos; `add_special_tokens` honoured (tunix's chat
  utilities encode each message without them)."""

  chars = "0123456789+=abcdefghijklmnopqrstuvwxyz<>|:?! "

  def encode(self, text, add_special_tokens=True, **kw):
    return ([1] if add_special_tokens else []) + [3 + self.chars.index(c if c in self.chars else "?") for c in text]

  def decode(self, ids, **kw):
    return "".join(
      self.chars[i - 3] if i - 3 < len(self.chars) else "?" for i in np.asarray(ids).reshape(-1).tolist() if i >= 3
    )

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


VOCAB = 3 + len(CharTokenizer.chars)
# Stop ids: the special ids (so no pad/bos/eos is ever sampled mid-turn) and a few letters (so a
# random model's turns end after ~7 tokens). tunix's sampler leaves the stop id out of the turn.
STOPS = [0, 1, 2] + list(range(15, 18))


class AppendOnlyParser(chat_parser_lib.BaseChatTemplateParser):
  """`<s>system<u>user<a>assistant...`: no end-of-turn marker, so the conversation tunix
  re-renders for the next turn is the trained tokens, append-only."""

  def _init_tokens(self):
    return chat_parser_lib.TokenConfig(system_token="<s>", user_token="<u>", assistant_token="<a>")

  def _init_generation_prompt(self):
    return "<a>"


class TwoTurnEnv(base_environment.BaseTaskEnv):
  """tunix's task-environment API: the first action gets an observation, the second ends it."""

  def __init__(self, single_example, **kwargs):
    super().__init__(task=single_example, max_steps=2, **kwargs)

  def _initial_observation(self):
    return {"prompts": str(np.asarray(self.task["prompts"]).reshape(-1)[0])}

  def _step_impl(self, action):
    done = self.step_count >= 2
    return base_environment.EnvStepResult(observation=None if done else OBSERVATION, reward=0.0, done=done, info={})


def reward(prompts, completions, **kw):
  """Distinct, deterministic scores for distinct first answers."""
  return [float(sum((i + 1) * ord(c) for i, c in enumerate(text)) % 13) for text in completions]


MODEL = qwen3.ModelConfig(
  num_layers=2,
  vocab_size=VOCAB,
  embed_dim=32,
  hidden_dim=64,
  num_heads=2,
  head_dim=16,
  num_kv_heads=1,
  rope_theta=1_000_000,
  norm_eps=1e-6,
  use_tied_embedding=False,
)
DATA = [{"prompts": ["1+2=", "3+4="]}, {"prompts": ["5+6=", "7+8="]}]


@pytest.fixture(autouse=True, scope="module")
def tunix_numpy_rules():
  """tunix relies on JAX's standard promotion rules; the suite's are strict (conftest)."""
  old = jax.config.jax_numpy_dtype_promotion, jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  jax.config.update("jax_numpy_rank_promotion", "allow")
  yield
  jax.config.update("jax_numpy_dtype_promotion", old[0])
  jax.config.update("jax_numpy_rank_promotion", old[1])


def make_cluster(steps, mini_batch_size=None):
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    actor = qwen3.Qwen3(MODEL, rngs=nnx.Rngs(0))
  rollout = base_rollout.RolloutConfig(
    max_tokens_to_generate=MAX_RESPONSE,
    max_prompt_length=48,
    temperature=TEMPERATURE,
    top_p=1.0,
    kv_cache_size=96,
    eos_tokens=STOPS,
  )
  config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={
      role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    },
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(LR), eval_every_n_steps=1000, max_steps=steps, mini_batch_size=mini_batch_size
    ),
    rollout_config=rollout,
  )
  return rl_cluster_lib.RLCluster(actor=actor, reference=actor, tokenizer=CharTokenizer(), cluster_config=config)


def make_learner(cluster, **settings):
  config = mis_agentic.MISAgenticGRPOConfig(
    num_generations=2, beta=0.0, max_response_length=MAX_RESPONSE, system_prompt="be brief", epsilon=EPS, **settings
  )
  return mis_agentic.MISAgenticGRPOLearner(
    cluster, config, reward, chat_parser=AppendOnlyParser(cluster.tokenizer), env_class=TwoTurnEnv
  )


def params(model):
  # Copies (np.array): np.asarray of a CPU jax.Array is a view of its buffer, which a later
  # computation may free and reuse (a 'before' snapshot that changed by itself).
  return jax.tree.map(np.array, nnx.state(model, nnx.Param).to_pure_dict())


def record_updates(cluster):
  """Each update: (the weights before, the examples trained, the weights after)."""
  updates = []
  update = cluster.update_actor

  def recording(batches, *args, **kwargs):
    before = nnx.clone(cluster.actor_trainer.model)
    out = update(batches, *args, **kwargs)
    updates.append((before, list(batches), params(cluster.actor_trainer.model)))
    return out

  cluster.update_actor = recording
  return updates


def current_logps(model, example):
  return common.compute_per_token_logps(
    *nnx.split(model),
    prompt_tokens=example.prompt_ids,
    completion_tokens=example.completion_ids,
    pad_id=0,
    eos_id=2,
    stop_gradient=False,
    temperature=TEMPERATURE,
  ).astype(jnp.float32)


def packed_direct_loss(model, example, loss_cfg):
  """mis_jax called directly: the model tokens of every conversation packed into one flat row."""
  lp = current_logps(model, example)
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
  return mis_jax.policy_loss(take(lp), batch, loss_cfg, entropy=jnp.zeros(len(rows), jnp.float32))


def numpy_token_tis_loss(lp, example):
  """Decoupled PPO with vanilla token TIS, seq-mean-token-mean, in NumPy over the model tokens:
  (1/N) Σ_s (1/n_s) Σ_{t∈s} w_t · max(-A_s r_t, -A_s clip(r_t, 1-ε, 1+ε)),
  r_t = exp(lp_t - o_t), w_t = min(exp(o_t - q_t), TIS_CLIP), N = conversations with a model token."""
  lp, o, q = (np.asarray(x, np.float64) for x in (lp, example.old_per_token_logps, example.rollout_per_token_logps))
  mask = np.asarray(example.completion_mask).astype(bool)
  adv = np.asarray(example.advantages, np.float64)[:, None]
  ratio = np.exp(lp - o)
  pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - EPS, 1 + EPS))
  w = np.minimum(np.exp(o - q), TIS_CLIP)
  n = mask.sum(-1)
  per_seq = np.where(mask, w * pg, 0.0).sum(-1) / np.maximum(n, 1)
  return per_seq[n > 0].sum() / (n > 0).sum()


def check_multi_turn(example):
  """Model tokens, then the environment's (mask 0), then model tokens again, in some row."""
  mask = np.asarray(example.completion_mask).astype(bool)
  ids = np.asarray(example.completion_ids)
  env = CharTokenizer().encode("<u>" + OBSERVATION + "<a>", add_special_tokens=False)
  found = 0
  for row_ids, row in zip(ids, mask):
    starts = [i for i in range(len(row_ids) - len(env) + 1) if list(row_ids[i : i + len(env)]) == env]
    for i in starts:
      assert not row[i : i + len(env)].any()  # the environment's tokens are out of the loss
      found += bool(row[:i].any() and row[i + len(env) :].any())
  return found


@pytest.fixture(scope="module")
def token_tis_run():
  """2 steps of decoupled PPO + vanilla token TIS, the engine's log-probs perturbed."""
  cluster = make_cluster(steps=2)
  learner = make_learner(cluster, use_tis=True, tis_clip=TIS_CLIP)
  assert learner.algo_config.loss_config.algorithm == "decoupled_ppo"
  perturb_rollout_logprobs(cluster, scale=0.5)
  updates = record_updates(cluster)
  learner.train(DATA)
  return cluster, learner, updates


def test_each_step_equals_mis_jax_over_the_model_tokens(token_tis_run):
  cluster, learner, updates = token_tis_run
  assert len(updates) == 2
  cfg = learner.algo_config.loss_config
  for step, (before, batches, after) in enumerate(updates):
    (example,) = batches
    assert isinstance(example, mis_agentic.MISAgenticTrainExample)
    assert check_multi_turn(example) > 0
    (loss, metrics), grads = nnx.value_and_grad(lambda m: packed_direct_loss(m, example, cfg), has_aux=True)(before)
    assert metrics["mis_k3_kl"] > 1e-3  # the injected mismatch is there...
    assert float(metrics["tis_clipfrac"]) > 0  # ...and the clip acts
    expected = jax.tree.map(
      lambda p, g: np.asarray(p) - LR * np.asarray(g), nnx.state(before, nnx.Param).to_pure_dict(), grads.to_pure_dict()
    )
    jax.tree.map(lambda e, a: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6), expected, after)
    np.testing.assert_allclose(logged(cluster, "loss")[step], float(loss), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
      float(loss), numpy_token_tis_loss(current_logps(before, example), example), rtol=1e-5, atol=1e-7
    )
    for name, value in metrics.items():
      if name not in ("loss", "entropy_loss"):  # the direct call passed no entropy
        np.testing.assert_allclose(logged(cluster, name)[step], float(value), rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_weights_move_at_every_step(token_tis_run):
  _, _, updates = token_tis_run
  for before, batches, after in updates:
    assert float(np.std(np.asarray(batches[0].advantages))) > 0
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params(before), after)
    assert max(jax.tree.leaves(moved)) / LR > 1e-3


def test_environment_logprobs_cannot_move_the_loss(token_tis_run):
  cluster, learner, updates = token_tis_run
  before, (example,), _ = updates[0]
  config = learner.algo_config
  env = ~np.asarray(example.completion_mask).astype(bool)
  assert env.any()
  rng = np.random.default_rng(1)

  def junk(x):
    x = np.asarray(x, np.float32)
    return jnp.asarray(np.where(env, rng.normal(0.0, 50.0, x.shape).astype(np.float32), x))

  perturbed = example.replace(
    rollout_per_token_logps=junk(example.rollout_per_token_logps),
    old_per_token_logps=junk(example.old_per_token_logps),
    ref_per_token_logps=junk(np.zeros(env.shape, np.float32)),
  )
  loss_fn = lambda ex: lambda m: mis_tunix.mis_policy_loss_fn(m, ex, config, pad_id=0, eos_id=2)
  (loss, aux), grads = nnx.value_and_grad(loss_fn(example), has_aux=True)(before)
  (loss_p, aux_p), grads_p = nnx.value_and_grad(loss_fn(perturbed), has_aux=True)(before)
  assert float(loss) == float(loss_p)
  jax.tree.map(np.testing.assert_array_equal, grads.to_pure_dict(), grads_p.to_pure_dict())
  assert set(aux) == set(aux_p)
  for name in aux:
    np.testing.assert_array_equal(np.asarray(aux_p[name]), np.asarray(aux[name]), err_msg=name)


def test_on_policy_sequence_mis_keeps_every_turn_and_equals_mis_jax():
  cluster = make_cluster(steps=1)
  learner = make_learner(cluster, use_tis=True, mis=MIS)
  updates = record_updates(cluster)
  learner.train(DATA[:1])
  ((before, (example,), after),) = updates
  assert check_multi_turn(example) > 0
  mask = np.asarray(example.completion_mask).astype(bool)
  q, o = np.asarray(example.rollout_per_token_logps), np.asarray(example.old_per_token_logps)
  # The sampler's log-probs, turn after turn, are the trainer's at the sampling temperature.
  assert np.max(np.abs(q - o)[mask]) < 1e-4
  assert logged(cluster, "mis_kept_seq_fraction")[0] == 1.0
  cfg = learner.algo_config.loss_config
  (loss, _), grads = nnx.value_and_grad(lambda m: packed_direct_loss(m, example, cfg), has_aux=True)(before)
  expected = jax.tree.map(
    lambda p, g: np.asarray(p) - LR * np.asarray(g), nnx.state(before, nnx.Param).to_pure_dict(), grads.to_pure_dict()
  )
  jax.tree.map(lambda e, a: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6), expected, after)
  np.testing.assert_allclose(logged(cluster, "loss")[0], float(loss), rtol=1e-5, atol=1e-7)


def force_order(cluster, learner, *, bad, first):
  """Group `bad`'s turns return no log-probs; every turn of the group other than `first` waits
  until `first`'s group has been wholly processed by the learner (trained examples queued, or
  refused). Groups by their prompt: "1+2=" is group 0, "3+4=" group 1 (DATA[0]). Events, no sleeps;
  the wait has a deadline, so a scheduling bug fails instead of hanging."""
  first_done = threading.Event()
  generate = cluster.rollout.generate
  group_of = lambda prompts: 0 if "1+2=" in str(prompts) else 1

  def ordered(prompts, *args, **kwargs):
    group = group_of(prompts)
    if group != first and not first_done.wait(timeout=120):
      raise TimeoutError(f"group {first} was never processed")
    out = generate(prompts, *args, **kwargs)
    if group == bad:
      out.logprobs = None
    return out

  process = learner._batch_to_train_example

  def processing(batch_results, *args, **kwargs):
    try:
      return process(batch_results, *args, **kwargs)
    finally:
      first_done.set()  # only `first`'s group can get here first: the other's turns wait

  cluster.rollout.generate = ordered
  learner._batch_to_train_example = processing


@pytest.mark.parametrize("first", [0, 1], ids=["good-group-queued-first", "bad-group-first"])
def test_a_turn_without_logprobs_stops_before_any_update(first):
  """One micro-batch holds the step's two groups. Whichever finishes first, the group with a turn
  lacking log-probs is refused before it is queued, and the good group already queued is not
  trained alone as a short micro-batch (tunix would): no update at all, the error names the engine."""
  cluster = make_cluster(steps=1)
  learner = make_learner(cluster, use_tis=True)
  assert cluster.cluster_config.rollout_config.return_logprobs  # the learner asked for them
  before = params(cluster.actor_trainer.model)
  updates = record_updates(cluster)
  force_order(cluster, learner, bad=1, first=first)
  with pytest.raises(mis_tunix.MissingRolloutLogprobs, match="'vanilla' rollout engine returned no log-probs"):
    learner.train(DATA[:1])
  assert updates == []
  jax.tree.map(np.testing.assert_array_equal, before, params(cluster.actor_trainer.model))


def test_updates_from_earlier_whole_micro_batches_stand():
  """A micro-batch of one group (mini_batch_size 1): the good group finishes, is trained (one SGD
  update, on its own rows only), then the other group's turn without log-probs stops the run."""
  cluster = make_cluster(steps=1, mini_batch_size=1)
  learner = make_learner(cluster, use_tis=True)
  before = params(cluster.actor_trainer.model)
  updates = record_updates(cluster)
  force_order(cluster, learner, bad=1, first=0)
  with pytest.raises(mis_tunix.MissingRolloutLogprobs, match="'vanilla' rollout engine returned no log-probs"):
    learner.train(DATA[:1])
  assert len(updates) == 1
  (example,) = updates[0][1]
  assert example.completion_ids.shape[0] == 2  # one group of num_generations=2
  jax.tree.map(np.testing.assert_array_equal, before, params(updates[0][0]))
  after = params(cluster.actor_trainer.model)
  jax.tree.map(np.testing.assert_array_equal, updates[0][2], after)  # nothing after the one update
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_the_constructor_is_tunix_agentic_one():
  ours = inspect.signature(mis_agentic.MISAgenticGRPOLearner.__init__).parameters
  theirs = inspect.signature(agentic_grpo_learner.GRPOLearner.__init__).parameters
  assert list(ours) == list(theirs)
  assert all(ours[k].default == theirs[k].default for k in theirs)
  assert issubclass(mis_agentic.MISAgenticGRPOLearner, agentic_grpo_learner.GRPOLearner)
  assert issubclass(mis_agentic.MISAgenticGRPOConfig, agentic_grpo_learner.GRPOConfig)
  with pytest.raises(TypeError, match="MISAgenticGRPOConfig"):
    mis_agentic.MISAgenticGRPOLearner(None, agentic_grpo_learner.GRPOConfig(), reward)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(sampler_is="token"), "sampler_is='token'"),
    (dict(use_rollout_logps=False), "use_rollout_logps=False"),
    (dict(policy_loss_fn="grpo"), "policy_loss_fn must be 'mis_jax'"),
    (dict(loss_agg_mode="sequence-mean-token-scale"), "loss_agg_mode='sequence-mean-token-scale'"),
    (dict(mis={"tis_levle": "token"}), "tis_levle"),
  ],
)
def test_config_errors_name_the_key(kwargs, match):
  with pytest.raises(mis_jax.ConfigError, match=match):
    mis_agentic.MISAgenticGRPOConfig(num_generations=2, **kwargs)


def test_config_maps_tunix_settings():
  config = mis_agentic.MISAgenticGRPOConfig(
    num_generations=2, epsilon=0.1, epsilon_high=0.3, beta=0.01, kl_loss_mode="low_var_kl", mis=MIS, use_tis=True
  )
  cfg = config.loss_config
  assert (cfg.algorithm, cfg.eps_clip, cfg.clip_high, cfg.kl_coef, cfg.kl_type, cfg.loss_agg_mode) == (
    "decoupled_ppo",
    0.1,
    0.3,
    0.01,
    "k3",
    "seq-mean-token-mean",
  )
  assert cfg.mis.tis_level == "sequence"
