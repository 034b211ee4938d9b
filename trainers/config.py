"""Trainer configuration: YAML sections, validated once before anything starts.

Sections: ``model``, ``task``, ``rollout``, ``train``, ``parallel``, ``loss``, ``checkpoint`` plus
``run_dir`` and ``seed``. Unknown keys are errors naming the file, the section and the closest valid key.
``loss`` takes the keys of :class:`mis_jax.LossConfig` and ``custom_config_path`` (the MIS
YAML); command-line flags (SPEC §9) override it.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

import mis_jax
from mis_jax._config import load_yaml
from trainers.parallel import ParallelSection

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str | None = None            # an HF checkpoint directory; else a preset is initialised
  preset: str = "tiny-qwen3"
  initializer_range: float | None = None
  init_seed: int = 0
  dtype: str = "float32"             # compute dtype of the trainer's forward/backward
  param_dtype: str = "float32"       # master weights (and optimiser state: same dtype)
  attention: str = "blocked"         # dense | blocked | fused (trainers.models.attention)
  remat: str = "full"                # none | full | dots (trainers.models.qwen.REMAT_POLICIES)
  logprob_chunk: int = 1024          # tokens per chunk of the LM head (mis_jax.token_logprobs)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts_per_step: int = 16
  n: int = 8                          # samples per prompt (a GRPO group)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  max_new_tokens: int | None = None   # default: the task's
  server_dtype: str = "bfloat16"      # embedded server only
  sync_every: int = 1                 # push weights every k steps (k > 1: stale rollouts)
  max_concurrency: int = 4
  prompts_per_request: int = 8
  timeout_s: float = 120.0
  max_retries: int = 3
  backoff_s: float = 0.5
  health_attempts: int = 30           # /health polls (with backoff) before giving up at start
  max_rejected_fraction: float = 0.25  # more rejected samples in a step stops the run


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 100
  learning_rate: float = 1e-3
  schedule: str = "constant"          # constant | cosine
  warmup_steps: int = 0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  adam_eps: float = 1e-8
  ppo_epochs: int = 1
  tokens_per_micro_batch: int = 4096  # per device of the data x fsdp axes
  row_len: int = 64
  advantage_estimator: str = "grpo"
  exclude_rejected_from_baseline: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = 10
  max_to_keep: int = 3


_SECTIONS = {"model": ModelSection, "rollout": RolloutSection, "train": TrainSection,
             "parallel": ParallelSection, "checkpoint": CheckpointSection}
_TOP = {"run_dir", "seed", "task", "loss", *_SECTIONS}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  run_dir: str = "runs/default"
  seed: int = 0
  model: ModelSection = ModelSection()
  task: dict = dataclasses.field(default_factory=lambda: {"name": "copy_digits"})
  rollout: RolloutSection = RolloutSection()
  train: TrainSection = TrainSection()
  parallel: ParallelSection = ParallelSection()
  loss: dict = dataclasses.field(default_factory=dict)
  checkpoint: CheckpointSection = CheckpointSection()
  source: str | None = None

  @classmethod
  def from_dict(cls, d: dict, *, source: str | None = None) -> "TrainConfig":
    where = f"{source}: " if source else ""
    if not isinstance(d, dict):
      raise mis_jax.ConfigError(f"{where}the trainer config must be a mapping")
    for key in d:
      if key not in _TOP:
        raise mis_jax.ConfigError(f"{where}unknown key '{key}'.{_suggest(key, _TOP)} Valid keys: {', '.join(sorted(_TOP))}")
    kwargs: dict[str, Any] = {"source": source}
    for name, section_cls in _SECTIONS.items():
      values = d.get(name) or {}
      fields = {f.name: f for f in dataclasses.fields(section_cls)}
      for key, value in values.items():
        if key not in fields:
          raise mis_jax.ConfigError(f"{where}unknown key '{name}.{key}'.{_suggest(key, fields)} "
                                    f"Valid keys: {', '.join(fields)}")
      kwargs[name] = section_cls(**{k: _coerce(v, fields[k], f"{where}{name}.{k}") for k, v in values.items()})
    for key in ("run_dir", "seed"):
      if key in d:
        kwargs[key] = d[key]
    kwargs["task"] = dict(d.get("task") or {"name": "copy_digits"})
    kwargs["loss"] = dict(d.get("loss") or {})
    cfg = cls(**kwargs)
    cfg.validate()
    return cfg

  @classmethod
  def from_yaml(cls, path: str) -> "TrainConfig":
    return cls.from_dict(load_yaml(path, "trainer config") or {}, source=path)

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  def validate(self) -> None:
    where = f"{self.source}: " if self.source else ""
    r, t, c, m = self.rollout, self.train, self.checkpoint, self.model
    from trainers.models.attention import ATTENTION_BACKENDS
    from trainers.models.qwen import REMAT_POLICIES
    checks = [
        (m.dtype in DTYPES and m.param_dtype in DTYPES, f"model.dtype and model.param_dtype must be one of {DTYPES}"),
        (m.attention in ATTENTION_BACKENDS, f"model.attention must be one of {ATTENTION_BACKENDS}, got {m.attention!r}"),
        (m.remat in REMAT_POLICIES, f"model.remat must be one of {tuple(REMAT_POLICIES)}, got {m.remat!r}"),
        (m.logprob_chunk > 0, "model.logprob_chunk must be > 0"),
        (r.prompts_per_step > 0, "rollout.prompts_per_step must be > 0"),
        (r.n > 0, "rollout.n must be > 0"),
        (r.temperature >= 0, "rollout.temperature must be >= 0"),
        (0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (r.sync_every >= 1, "rollout.sync_every must be >= 1"),
        (r.server_dtype in ("bfloat16", "float32"), "rollout.server_dtype must be bfloat16 or float32"),
        (0 <= r.max_rejected_fraction <= 1, "rollout.max_rejected_fraction must be in [0, 1]"),
        (t.steps > 0 and t.ppo_epochs > 0, "train.steps and train.ppo_epochs must be > 0"),
        (t.adam_eps > 0, "train.adam_eps must be > 0"),
        (t.schedule in ("constant", "cosine"), "train.schedule must be constant or cosine"),
        (t.advantage_estimator in mis_jax.ESTIMATORS, f"train.advantage_estimator must be one of {mis_jax.ESTIMATORS}"),
        (t.row_len > 0, "train.row_len must be > 0"),
        (t.tokens_per_micro_batch >= t.row_len, f"train.tokens_per_micro_batch ({t.tokens_per_micro_batch}) must be "
                                                f">= train.row_len ({t.row_len}): a micro-batch holds whole rows"),
        (c.every > 0 and c.max_to_keep > 0, "checkpoint.every and max_to_keep must be > 0"),
        # Checkpoints land on sync steps, so a resumed run can restore the server's weights exactly.
        (c.every % r.sync_every == 0, f"checkpoint.every ({c.every}) must be a multiple of rollout.sync_every "
                                      f"({r.sync_every})"),
    ]
    for ok, message in checks:
      if not ok:
        raise mis_jax.ConfigError(where + message)


def _suggest(key, valid) -> str:
  match = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ""


def _coerce(value, field: dataclasses.Field, where: str):
  """YAML 1.1 reads 1e-3 as a string; accept numeric strings for float fields."""
  typ = str(field.type)
  if isinstance(value, str) and "float" in typ:
    try:
      return float(value)
    except ValueError:
      raise mis_jax.ConfigError(f"{where} must be a number, got {value!r}") from None
  if "int" in typ and "float" not in typ and isinstance(value, float) and value.is_integer():
    return int(value)
  if ("int" in typ or "float" in typ) and isinstance(value, bool):
    raise mis_jax.ConfigError(f"{where} must be a number, got {value!r}")
  return value


def set_override(d: dict, assignment: str) -> None:
  """Applies ``section.key=value`` (value parsed as YAML) to a raw config dict."""
  if "=" not in assignment:
    raise mis_jax.ConfigError(f"override {assignment!r} must look like section.key=value")
  path, _, raw = assignment.partition("=")
  value = yaml.safe_load(raw)
  keys = path.split(".")
  node = d
  for k in keys[:-1]:
    node = node.setdefault(k, {})
  node[keys[-1]] = value
