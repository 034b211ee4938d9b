"""The resolved run: every value a run derives from its config, computed once (`resolve`), before
anything is built or started. The parts below the root receive them; none derives them again.

`resolve(cfg)` reads the model's config.json, builds the task, derives what the `rollout` section
implies (`trainers.rollout.settings.derive`: sampling-mask replay, routed experts), the step's plan
(`trainers.learner.plan.plan_step`), the mesh, the run's per-token extras, the layer loop, the
sampling temperature and response budget, the rollout backend's mode — and runs every check across
them (`trainers.app.checks`, which only raise). `RunSpec.describe` is the start-up lines.
"""

from __future__ import annotations

import dataclasses
import json

import jax

import mis_jax
from trainers.agents.episodes import Episodes
from trainers.app import checks
from trainers.config import TrainConfig
from trainers.learner.plan import StepPlan, plan_step
from trainers.models import PRESETS, ModelConfig, checkpoint_dir_problem
from trainers.models.decoder import resolve_layer_loop
from trainers.rollout import extras as extras_lib, settings
from trainers.rollout.settings import RolloutSettings
from trainers.runtime import parallel
from trainers.tasks import make_task
from trainers.tasks.env import is_agent_task

__all__ = ["RunSpec", "resolve", "model_config", "BACKENDS"]

# Where a run's rollouts come from (`RunSpec.backend`): replayed records, an engine in this process,
# sglang-router's fleet, SGLang servers over HTTP.
BACKENDS = ("records", "colocated", "router", "servers")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run resolved from its config (`cfg`): the `task`, the model's `model_config`, the `mesh`,
  the `rollout` settings, the step's `plan`, the per-token `extras` (an agent run's among them),
  the `layer_loop` and why, the `temperature` the trainer's log-probs use (SGLang reports T = 1
  for greedy sampling), a sample's `max_new_tokens`, whether the task is multi-turn (`agent`), the
  rollout `backend` (`BACKENDS`) and the step's segments (`num_segments`)."""

  cfg: TrainConfig
  task: object
  model_config: ModelConfig
  mesh: jax.sharding.Mesh
  rollout: RolloutSettings
  plan: StepPlan
  extras: tuple
  layer_loop: tuple[str, str]
  temperature: float
  max_new_tokens: int
  agent: bool
  backend: str
  num_segments: int

  @property
  def sampling_params(self) -> dict:
    """SGLang's sampling params of every request of the run."""
    s = self.cfg.rollout.sampling
    return {
      "temperature": s.temperature,
      "top_p": s.top_p,
      "top_k": s.top_k,
      "min_p": s.min_p,
      "max_new_tokens": self.max_new_tokens,
      "stop_token_ids": list(self.task.stop_token_ids),
      "no_stop_trim": True,
      "skip_special_tokens": False,
    }

  def describe(self) -> list[str]:
    """The start-up lines of what the run does besides the model line: the old log-probs' source,
    R2, each active extra's own line."""
    lines = [self.plan.describe()]
    if self.rollout.routing_replay == "r2" and not self.plan.compare_routing:
      lines.append("routing replay R2: the old-log-prob pass's routing is replayed in every training forward")
    lines += [said for said in (extra.describe() for extra in self.extras) if said]
    return lines


def resolve(cfg: TrainConfig, *, devices=None, task=None) -> RunSpec:
  """`cfg` resolved (see the module doc); `task` replaces the config's (a test's own task), `devices`
  the mesh's. Raises `ConfigError` naming the key and the value."""
  model_cfg = model_config(cfg)
  rollout = settings.derive(cfg.rollout, model_cfg)
  plan = plan_step(cfg, rollout.routing_replay, rollout.routing_spec is not None)
  if task is None:
    try:
      task = make_task(cfg.task, vocab_size=model_cfg.vocab_size, model_path=cfg.model.path)
    except (ValueError, TypeError, FileNotFoundError) as e:  # they name the key, file, row and column
      raise mis_jax.ConfigError(f"task ({cfg.task.name}): {e}") from None
  max_new_tokens = settings.max_new_tokens(cfg.rollout, task)
  agent = is_agent_task(task)
  checks.check_config(cfg, task, model_cfg, rollout, max_new_tokens=max_new_tokens, agent=agent)
  mesh = parallel.make_mesh(cfg.parallel, devices)
  checks.check_mesh(cfg, mesh, model_cfg)
  extras = extras_lib.active(rollout, model_cfg) + (
    Episodes.declared_extras(cfg.agent.per_turn_rewards) if agent else ()
  )
  r = cfg.rollout
  backend = (
    "records"
    if r.records.load_dir
    else "colocated"
    if r.placement.mode == "colocated"
    else "router"
    if r.transport.router
    else "servers"
  )
  return RunSpec(
    cfg=cfg,
    task=task,
    model_config=model_cfg,
    mesh=mesh,
    rollout=rollout,
    plan=plan,
    extras=extras,
    layer_loop=resolve_layer_loop(cfg.model.layer_loop, model_cfg.num_hidden_layers),
    temperature=r.sampling.temperature if r.sampling.temperature > 0 else 1.0,
    max_new_tokens=max_new_tokens,
    agent=agent,
    backend=backend,
    num_segments=r.prompts_per_step * r.n,
  )


def model_config(cfg: TrainConfig) -> ModelConfig:
  """The architecture of ``model.path`` (checked: a directory with config.json and
  safetensors), or of ``model.preset``."""
  path = cfg.model.path
  if not path:
    return PRESETS[cfg.model.preset]
  problem = checkpoint_dir_problem(path)
  if problem:
    raise mis_jax.ConfigError(f"model.path {path!r}: {problem}")
  try:
    return ModelConfig.from_pretrained(path)
  except (ValueError, KeyError, json.JSONDecodeError) as e:
    raise mis_jax.ConfigError(
      f"model.path {path!r}: config.json is not a supported config (architectures: Qwen2, Qwen3, Qwen3-MoE, Llama): {e}"
    ) from None
