"""The composition root's second stage: the parts of a run built from its `RunSpec` — the starting
weights, the learner (its model options decided once, `model.remat` / `model.attention` `auto`
included), the step batcher, and an agent run's own parts. `trainers.app.trainer.Trainer` composes
them with the rollout backend and the side jobs into the loop."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

import mis_jax
from trainers.agents.episodes import Episodes, TurnMismatch
from trainers.agents.rewards import PerTurnAdvantages
from trainers.app.spec import RunSpec
from trainers.config import ModelSection, TrainConfig
from trainers.learner import memory_plan, plan as plan_lib
from trainers.learner.batch import StepBatcher
from trainers.learner.learner import Learner
from trainers.learner.step import StepFunctions, build_step_functions
from trainers.models import DTYPES, PRESETS, ModelConfig, init_checkpoint, load_hf_params
from trainers.models.attention import resolve_attention_backend
from trainers.runtime import distributed, parallel

__all__ = ["initial_weights_dir", "build_learner", "build_batcher", "AgentParts", "agent_parts", "model_line"]


def initial_weights_dir(cfg: TrainConfig) -> str:
  """The HF directory of the starting weights: ``model.path``, or a preset initialised once
  into ``run_dir/weights/init`` (reused on resume)."""
  if cfg.model.path:
    return cfg.model.path
  path = os.path.join(os.path.abspath(cfg.run_dir), "weights", "init")
  if distributed.is_primary() and not os.path.isfile(os.path.join(path, "model.safetensors")):
    config = PRESETS[cfg.model.preset]
    if cfg.model.initializer_range is not None:
      config = dataclasses.replace(config, initializer_range=cfg.model.initializer_range)
    init_checkpoint(path, config=config, seed=cfg.model.init_seed)
  distributed.barrier(f"initial weights {path}")  # one writer; every process reads them
  return path


def build_learner(spec: RunSpec, start_dir: str) -> tuple[Learner, memory_plan.ModelChoice]:
  """The learner of `spec` on the weights of `start_dir` (each device reads its own shards of the
  HF tensors: no full copy anywhere), and the model options it was built with."""
  cfg, model_cfg = spec.cfg, spec.model_config
  model = dataclasses.replace(cfg.model, layer_loop=spec.layer_loop[0])
  choice = model_choice(model_cfg, model, spec.mesh, memory_plan.probe_shape(cfg.train, spec.extras))
  model = dataclasses.replace(model, remat=choice.remat, attention=choice.attention)
  fns = step_functions(model_cfg, model, cfg.loss, spec.temperature, cfg.train, spec.mesh, exact_pass(cfg))
  params = load_hf_params(start_dir, fns.abstract_params, fns.param_shardings, config=model_cfg)
  r = cfg.rollout
  learner = Learner(
    fns,
    spec.plan,
    params=params,
    mesh=spec.mesh,
    seed=cfg.seed,
    ppo_epochs=cfg.train.ppo_epochs,
    estimator=cfg.train.advantage_estimator,
    num_groups=r.prompts_per_step,
    num_segments=spec.num_segments,
    extras=spec.extras,
    ref_params=jax.tree_util.tree_map(jnp.copy, params) if cfg.loss.kl_coef > 0 else None,
  )
  return learner, choice


def build_batcher(spec: RunSpec, stages=()) -> StepBatcher:
  """The step batcher of `spec` (the task's rewards, `train.advantage_estimator`, the row layout on
  the mesh, per-token staleness where the run uses it), with the batch `stages` after it."""
  cfg = spec.cfg
  t, r = cfg.train, cfg.rollout
  advantages = functools.partial(
    plan_lib.sequence_advantages, estimator=t.advantage_estimator, num_groups=r.prompts_per_step
  )
  reward = getattr(spec.task, "reward", None)  # (none for an agent task: its environments reward)
  return StepBatcher(
    reward=reward,
    advantages=advantages,
    extras=spec.extras,
    num_segments=spec.num_segments,
    row_len=t.row_len,
    tokens_per_micro_batch=t.tokens_per_micro_batch,
    batch_devices=parallel.batch_devices(spec.mesh),
    max_token_staleness=r.sync.max_token_staleness,
    loglinear=cfg.loss.proximal == "loglinear",
    stages=stages,
  )


@dataclasses.dataclass(frozen=True)
class AgentParts:
  """What a multi-turn run adds to the loop: the episode driver and its environments (the rollout
  backend generates trajectories with them), the side jobs after each step (the mismatch by turn),
  and the batch stages (per-turn returns)."""

  episodes: tuple | None = None
  hooks: tuple = ()
  batch_stages: tuple = ()


def agent_parts(spec: RunSpec) -> AgentParts:
  """An agent task's parts (its budgets: `agent.*`, a trajectory within a row); none for a
  single-turn task."""
  if not spec.agent:
    return AgentParts()
  cfg, task = spec.cfg, spec.task
  a, row = cfg.agent, cfg.train.row_len
  room = row + 1 - task.max_prompt_len  # a sequence of row_len + 1 tokens fills a row
  driver = Episodes(
    max_turns=a.max_turns,
    max_total_tokens=min(a.max_total_tokens or room, room),
    max_context=row + 1,
    env_concurrency=a.env_concurrency,
    max_turn_retries=a.max_turn_retries,
    rows_per_request=cfg.rollout.transport.prompts_per_request * cfg.rollout.n,
  )
  stages = (PerTurnAdvantages(cfg.train.advantage_estimator),) if a.per_turn_rewards else ()
  return AgentParts(episodes=(driver, task.environment), hooks=(TurnMismatch(a.max_turns),), batch_stages=stages)


@functools.lru_cache(maxsize=8)
def model_choice(
  model_cfg: ModelConfig, model: ModelSection, mesh, shape: memory_plan.ProbeShape
) -> memory_plan.ModelChoice:
  """`memory_plan.choose` over the candidates' compiled steps, each with the probe's loss and
  optimiser (`memory_plan.PROBE_LOSS`): once per model, shape and mesh in a process, and one
  program for the persistent compilation cache whatever the run's loss."""

  def predict(remat: str, attention: str) -> int:
    fns = build_step_functions(
      model_cfg,
      mesh,
      memory_plan.PROBE_LOSS,
      memory_plan.PROBE_TRAIN,
      **model_options(dataclasses.replace(model, remat=remat, attention=attention), model_cfg),
    )
    return memory_plan.step_bytes(fns, mesh, shape, within=budget.bytes)

  auto = memory_plan.AUTO in (model.remat, model.attention)
  budget = memory_plan.memory_budget(list(mesh.devices.flat), model.memory_budget_gb) if auto else None
  return memory_plan.choose(model.remat, model.attention, predict, budget)


def exact_pass(cfg: TrainConfig) -> tuple[str, str] | None:
  """Exact mode's `(served dtype, pushed dtype)` (`rollout.placement.exact`), the casts that make the
  engine's copy of the weights; None without exact mode."""
  r = cfg.rollout
  if not r.placement.exact:
    return None
  return r.placement.server_dtype, r.sync.weight_dtype or r.placement.server_dtype


@functools.lru_cache(maxsize=8)
def step_functions(
  model_cfg: ModelConfig,
  model: ModelSection,
  loss_cfg: mis_jax.LossConfig,
  temperature: float,
  train_cfg,
  mesh,
  exact: tuple[str, str] | None = None,
) -> StepFunctions:
  """The jitted step functions, shared by trainers with the same setup (so a resumed or
  repeated run in one process does not compile again)."""
  return build_step_functions(
    model_cfg, mesh, loss_cfg, train_cfg, temperature=temperature, exact=exact, **model_options(model, model_cfg)
  )


def model_options(model: ModelSection, model_cfg: ModelConfig) -> dict:
  """`build_step_functions`' options of the model section (remat, attention and the layer loop
  resolved)."""
  return dict(
    logprob_chunk=model.logprob_chunk,
    dtype=DTYPES[model.dtype],
    param_dtype=DTYPES[model.param_dtype],
    attention=model.attention,
    remat=model.remat,
    layer_loop=model.layer_loop,
    **({"moe_dispatch": model.moe_dispatch} if model_cfg.is_moe else {}),
  )


def model_line(model: ModelSection, choice: memory_plan.ModelChoice, layer_loop: tuple[str, str]) -> str:
  """The start-up line of the model's options: dtypes, remat and attention, the layer loop, and
  why those."""
  attention, fallback = resolve_attention_backend(choice.attention)
  loop, why = layer_loop
  return (
    f"model: {model.dtype} compute, {model.param_dtype} weights, remat {choice.remat}, attention {attention}"
    f"{f' ({fallback})' if fallback else ''} ({choice.reason()}), layers {loop} ({why})"
  )
