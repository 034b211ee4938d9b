"""Trainer configuration: YAML sections, validated once before anything starts.

Sections: ``model``, ``task``, ``rollout``, ``train``, ``parallel``, ``loss``, ``checkpoint`` plus
``run_dir`` and ``seed``. Unknown keys are errors naming the file, the section and the closest valid key.
``loss`` takes the keys of :class:`mis_jax.LossConfig` and ``custom_config_path`` (the MIS
YAML), and is parsed into one: ``TrainConfig.loss`` is a typed `LossConfig`. Every key has a type and constraints (`key(...)`), checked on load: an int is never
1.5 or text, numbers are in range, enums are one of their values.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

import mis_jax
from mis_jax.config import config_fields as fields_of, config_key as key, load_yaml, parse_config_value as parse_value

DTYPES = ("float32", "bfloat16")  # trainers.models.DTYPES' names (a test checks)
PRESET_NAMES = ("tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-hd128", "tiny-qwen3-moe", "tiny-qwen3-untied")
ATTENTION = ("dense", "blocked", "fused")    # trainers.models.attention.ATTENTION_BACKENDS
REMAT = ("none", "full", "dots")             # trainers.models.decoder.REMAT_POLICIES
MOE_DISPATCH = ("dense", "grouped", "ragged_dot")  # trainers.models.moe.MOE_DISPATCH
ROUTING_REPLAY = ("none", "r3", "r2")
TASKS = ("copy_digits", "lookup_digits", "calculator", "dataset", "jsonl")  # `jsonl`: the dataset task's former name
REWARDS = ("math", "exact_match", "format")  # trainers.tasks.rewards.REWARDS


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str | None = key(None, "an HF checkpoint dir (Qwen2, Qwen3, Qwen3-MoE or Llama: config.json + *.safetensors); "
                         "else `preset`")
  preset: str = key("tiny-qwen3", "a tiny model initialised from scratch when `path` is null", choices=PRESET_NAMES)
  initializer_range: float | None = key(None, "std of the preset's random weights (null: the preset's 0.02)", gt=0)
  init_seed: int = key(0, "seed of the preset's random weights", ge=0)
  dtype: str = key("float32", "compute dtype of the trainer's forward/backward", choices=DTYPES)
  param_dtype: str = key("float32", "master weights and optimiser state", choices=DTYPES)
  attention: str = key("blocked", "`dense` ([T, T] reference), `blocked` (flash-style), `fused` (Pallas, else blocked)",
                       choices=ATTENTION)
  remat: str = key("full", "activation checkpointing of the layer scan", choices=REMAT)
  logprob_chunk: int = key(1024, "tokens per chunk of the LM head (`mis_jax.token_logprobs`)", ge=1)
  moe_dispatch: str = key("grouped", "mixture of experts: `grouped` (tokens sorted by expert, blocks per expert), "
                          "`ragged_dot` (jax.lax.ragged_dot: native on TPU, dense on CPU) or `dense` (every expert "
                          "on every token: the small-model reference)", choices=MOE_DISPATCH)


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """The toy task `copy_digits`, or `dataset`: JSONL / Parquet records (`trainers.tasks`)."""
  name: str = key("copy_digits", "`copy_digits` (toy), `lookup_digits` (a toy multi-turn tool task: the digits only "
                  "a lookup call reveals; docs/guides/agents.md), `calculator` (arithmetic with a calculator tool in Qwen3's "
                  "<tool_call> format: an agent task for a Qwen3 tokenizer) or `dataset` (JSONL / Parquet; `jsonl` is its old "
                  "name)", choices=TASKS)
  num_digits: int | None = key(None, "copy_digits, lookup_digits: digits per prompt (null: 3)", ge=1)
  tool: bool | None = key(None, "lookup_digits: whether the lookup tool answers (null: true; false: every call fails, "
                          "the control run that cannot learn)")
  path: str | None = key(None, "dataset: a .jsonl / .parquet file, a directory of them, or a glob")
  prompt_key: str | None = key(None, "dataset: prompt column, dots for nested keys (null: the first of `prompt_ids` / "
                               "`messages` / `prompt`); token ids, chat messages or text")
  answer_key: str | None = key(None, "dataset: ground-truth column (null: the first of `reward_model.ground_truth` / "
                               "`answer` / `solution` / `ground_truth`)")
  reward_fn: str | None = key(None, "dataset: `math`, `exact_match`, `format` (docs/guides/datasets.md) or "
                              "`pkg.mod:fn(record, response_ids, text) -> float`")
  tokenizer: str | None = key(None, "dataset: HF tokenizer directory (null: `model.path`)")
  chat_template: bool | None = key(None, "dataset: render text prompts as one user message with the tokenizer's chat "
                                   "template (null: when it has one)")
  chat_template_kwargs: dict | None = key(None, "dataset: chat-template variables, e.g. `{enable_thinking: false}`")
  stop_token_ids: tuple[int, ...] | None = key(None, "dataset: stop tokens (null: the template's end of turn + EOS)",
                                               ge=0)
  max_new_tokens: int | None = key(None, "dataset: response cap when `rollout.max_new_tokens` is null (null: 128)",
                                   ge=1)

  def problems(self) -> list[str]:
    """Keys that do not fit `name` (checked on load; the files are checked by `make_task`)."""
    given = {f.name for f in dataclasses.fields(self) if f.name != "name" and getattr(self, f.name) is not None}
    toy = {"copy_digits": {"num_digits"}, "lookup_digits": {"num_digits", "tool"}}
    if self.name in toy:
      return [f"task.{k} is not a key of task '{self.name}'" for k in sorted(given - toy[self.name])]
    if self.name == "calculator":
      allowed = {"tokenizer", "chat_template_kwargs", "stop_token_ids", "max_new_tokens"}
      return [f"task.{k} is not a key of task 'calculator'" for k in sorted(given - allowed)]
    out = [f"task.{k} is a key of the toy tasks, not of 'dataset'" for k in sorted(given & {"num_digits", "tool"})]
    out += [f"task.{k} is required for task '{self.name}'" for k in ("path", "reward_fn") if getattr(self, k) is None]
    fn = self.reward_fn
    if fn is not None and fn not in REWARDS and not any(c in fn for c in ".:"):
      out.append(f"task.reward_fn has invalid value {fn!r}; built-in rewards: {', '.join(REWARDS)}, or an import "
                 "path pkg.module:function")
    return out


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts_per_step: int = key(16, "prompts per step", ge=1)
  n: int = key(8, "samples per prompt (a GRPO group)", ge=1)
  temperature: float = key(1.0, "sampling temperature (0: greedy); the trainer divides its logits by it", ge=0)
  top_p: float = key(1.0, "nucleus sampling: keep the smallest prefix of mass >= top_p", gt=0, le=1)
  top_k: int = key(-1, "top-k sampling, -1 = all; with sampling replay, the support width of the step", ge=-1)
  min_p: float = key(0.0, "min-p sampling: drop tokens below min_p x the top probability", ge=0, le=1)
  sampling_replay: str = key("auto", "replay the engine's top-k/top-p/min-p support (SGLang's return_sampling_mask): "
                             "behaviour log-probs and every trainer log-prob over it; auto = on when sampling "
                             "is truncated", choices=("auto", "on", "off"))
  sampling_mask_max_tokens: int = key(4096, "largest support accepted (as SGLang's --sampling-mask-max-tokens); "
                                      "top_k must not exceed it", ge=1)
  max_new_tokens: int | None = key(None, "response length cap (null: the task's)", ge=1)
  routing_replay: str = key("none", "mixture of experts: `r3` replays the server's routed experts (SGLang "
                            "--enable-return-routed-experts) in the old-log-prob pass and every training forward; "
                            "`r2` replays the trainer's own old-pass routing in the training forwards",
                            choices=ROUTING_REPLAY)
  record_routing: bool | None = key(None, "ask the server for routed experts and log the routing-mismatch metrics "
                                    "(null: with r3)")
  placement: str = key("server", "where rollouts are generated: SGLang servers over HTTP (`server`; the embedded "
                                 "one by default), or the embedded engine inside the trainer's process, on its "
                                 "devices, weights handed over in memory (`colocated`)", choices=("server", "colocated"))
  colocated_devices: str = key("first", "colocated: where the embedded engine lives — the mesh's `first` device (a "
                               "model that fits one device; no collectives while decoding), or the whole `mesh`: "
                               "its weights laid out as the trainer's (FSDP/TP), each batch's rows split over the "
                               "data axes", choices=("first", "mesh"))
  engine: str = key("embedded", "the engine that generates: this package's (`embedded`: `mis-jax serve`, or in "
                    "process when colocated) or sglang-jax (`sglang-jax`: its server from its venv, or, colocated, "
                    "its Engine in the trainer's process — run the trainer in its venv, docs/guides/trainer.md)",
                    choices=("embedded", "sglang-jax"))
  server_dtype: str = key("bfloat16", "embedded server precision", choices=DTYPES)
  server_quantize: str = key("none", "embedded server's weight-only quantisation of Linear kernels (per-channel "
                             "scales, on top of `server_dtype`)", choices=("none", "int8", "fp8"))
  sync_every: int = key(1, "push weights every k steps (k > 1: deliberately stale rollouts)", ge=1)
  max_staleness: int = key(0, "asynchronous rollouts: generate while training, samples at most k weight "
                              "versions old (0: the synchronous loop)", ge=0)
  max_token_staleness: int | None = key(None, "mask from the loss the response tokens generated more than k weight "
                                              "versions before the step (from the samples' weight_versions spans: a "
                                              "response that straddled an update is masked in part); they stay as "
                                              "context (null: off)", ge=0)
  pause_mode: str = key("abort", "/pause_generation mode during a weight sync (retract keeps in-flight "
                                 "requests for after the update)", choices=("abort", "retract", "in_place"))
  cache_salt: bool = key(True, "every /generate carries SGLang's extra_key (its prefix-cache namespace) naming the "
                         "weights it starts under, fresh at every weight update: no engine can match a prefix "
                         "computed under other weights (docs/guides/server.md: the prefix cache across updates)")
  weight_dtype: str | None = key(None, "dtype of the HF weights pushed to the servers (null: the dtype the server "
                                       "reports in /server_info, else server_dtype)", choices=DTYPES)
  initial_sync: str = key("auto", "push the starting weights before step 1: `auto` = unless every server already "
                          "serves model.path (its /model_info model_path) and the run is not resumed; `always`; "
                          "`never` (a resume always pushes)", choices=("auto", "always", "never"))
  mismatch_check: bool = key(True, "stop when server and trainer hold the same weights yet their log-probs differ "
                             "far beyond numerics (docs/guides/trainer.md: the mismatch sanity check)")
  max_concurrency: int = key(4, "HTTP requests in flight", ge=1)
  prompts_per_request: int = key(8, "prompts batched into one /generate request", ge=1)
  timeout_s: float = key(120.0, "HTTP timeout per request", gt=0)
  max_retries: int = key(3, "retries of a failed request (connection errors, timeouts, 5xx)", ge=0)
  backoff_s: float = key(0.5, "first retry delay (doubles each retry)", ge=0)
  health_attempts: int = key(30, "/health polls (with backoff) before giving up at start", ge=1)
  server_restart_timeout_s: float = key(600.0, "when no server can serve a step (connection errors or 5xx past the "
                                        "retries): wait this long for one to answer /health again, push it the "
                                        "served weights and redo the step (0: stop at once)", ge=0)
  max_rejected_fraction: float = key(0.25, "more malformed samples than this in a step stops the run", ge=0, le=1)
  save_dir: str | None = key(None, "write each step's rollouts as Parquet records here (`--save-rollouts`; "
                             "docs/guides/records.md)")
  load_dir: str | None = key(None, "train from saved rollout records, the same steps in the same order, with no "
                             "server (`--load-rollouts`)")


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = key(100, "optimisation steps of the run", ge=1)
  learning_rate: float = key(1e-3, "AdamW peak learning rate", gt=0)
  schedule: str = key("constant", "learning-rate schedule after warm-up", choices=("constant", "cosine"))
  warmup_steps: int = key(0, "linear warm-up steps", ge=0)
  weight_decay: float = key(0.0, "AdamW weight decay", ge=0)
  max_grad_norm: float = key(1.0, "global-norm gradient clipping", gt=0)
  adam_eps: float = key(1e-8, "AdamW epsilon", gt=0)
  ppo_epochs: int = key(1, "optimiser updates per step on the same batch", ge=1)
  tokens_per_micro_batch: int = key(4096, "tokens per device (of data x fsdp x expert) in one micro-batch; >= row_len", ge=1)
  row_len: int = key(64, "tokens per packed row (>= the longest prompt + response)", ge=2)
  advantage_estimator: str = key("grpo", "per-group advantages (contract §6.1)", choices=tuple(mis_jax.ESTIMATORS))
  exclude_rejected_from_baseline: bool = key(False, "sequences rejected whole leave their group's baseline (contract §6.1)")
  router_aux_loss_coef: float = key(0.0, "mixture of experts: weight of HF's load-balancing loss (RL recipes: 0)", ge=0)
  max_consecutive_masked_steps: int = key(3, "steps in a row whose correction keeps no token (a warning each) before "
                                          "the run stops, naming the setting and the ratios seen", ge=1)


@dataclasses.dataclass(frozen=True)
class ParallelSection:
  """Mesh axis sizes (`trainers.training.parallel`); one of them may be -1: the devices the others leave."""
  data: int = key(1, "data-parallel replicas (parameters replicated)", ge=-1)
  fsdp: int = key(-1, "fully sharded data parallelism (parameters, optimiser state split); -1: the rest", ge=-1)
  tensor: int = key(1, "Megatron tensor parallelism (heads, MLP columns, vocabulary split)", ge=-1)
  expert: int = key(1, "expert parallelism: a mixture-of-experts model's experts split over it (it also splits the "
                    "batch, as fsdp does)", ge=-1)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = key(10, "Orbax checkpoint every k steps (a multiple of rollout.sync_every)", ge=1)
  max_to_keep: int = key(3, "checkpoints kept", ge=1)


@dataclasses.dataclass(frozen=True)
class AgentSection:
  """Multi-turn rollouts of an agent task (`trainers.agents`; docs/guides/agents.md): its budgets and pool."""
  max_turns: int = key(4, "model turns per trajectory", ge=1)
  max_total_tokens: int | None = key(None, "response tokens of a trajectory, the model's and the environment's "
                                     "(null: what train.row_len leaves after the prompt)", ge=1)
  env_concurrency: int = key(16, "environments stepping at once (a bounded thread pool)", ge=1)
  max_turn_retries: int = key(2, "times a turn the engine aborted (a weight update's pause) is sent again", ge=0)


@dataclasses.dataclass(frozen=True)
class LoggingSection:
  """Where step metrics go besides `run_dir/metrics.jsonl` (`trainers.training.logging`)."""
  tensorboard: bool = key(True, "TensorBoard event files in `run_dir/tensorboard` (tensorboardX, no PyTorch needed)")
  wandb: bool = key(False, "log to Weights & Biases (needs `wandb` installed and logged in)")
  wandb_project: str | None = key(None, "W&B project (null: `mis-jax`)")
  wandb_run_name: str | None = key(None, "W&B run name (null: the run directory's name)")
  progress_every: int = key(10, "when stdout is not a terminal: one progress line every k steps (a terminal gets "
                            "a live bar)", ge=1)


SECTIONS = {"model": ModelSection, "task": TaskSection, "rollout": RolloutSection, "train": TrainSection,
            "parallel": ParallelSection, "checkpoint": CheckpointSection, "logging": LoggingSection,
            "agent": AgentSection}
_TOP = {"run_dir", "seed", "loss", *SECTIONS}


class KeyConfigError(mis_jax.ConfigError):
  """A bad value or unknown key at ``path`` (``section.key``)."""

  def __init__(self, path: str, message: str):
    super().__init__(message)
    self.path = path


def parse_section(section_cls, values, where: str):
  """A section from a mapping: unknown keys (with the closest valid one), types, ranges."""
  if values is None:
    values = {}
  if not isinstance(values, dict):
    raise mis_jax.ConfigError(f"{where} must be a mapping of keys, got {type(values).__name__} {values!r}")
  fields = fields_of(section_cls)
  kwargs = {}
  for k, v in values.items():
    path = f"{where}.{k}"
    if k not in fields:
      raise KeyConfigError(path, f"unknown key '{path}'.{_suggest(k, fields)} Valid keys: {', '.join(fields)}")
    field, typ = fields[k]
    try:
      kwargs[k] = parse_value(v, typ, field.metadata, path)
    except mis_jax.ConfigError as e:
      raise KeyConfigError(path, str(e)) from None
  return section_cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  run_dir: str = "runs/default"
  seed: int = 0
  model: ModelSection = ModelSection()
  task: TaskSection = TaskSection()
  rollout: RolloutSection = RolloutSection()
  train: TrainSection = TrainSection()
  parallel: ParallelSection = ParallelSection()
  loss: mis_jax.LossConfig = mis_jax.LossConfig()
  checkpoint: CheckpointSection = CheckpointSection()
  logging: LoggingSection = LoggingSection()
  agent: AgentSection = AgentSection()
  source: str | None = None

  @classmethod
  def from_dict(cls, d: dict, *, source: str | None = None, origins: dict | None = None) -> "TrainConfig":
    """`origins`: `{"section.key": "--set section.key=value"}` for values that came from the
    command line, so an error names where the value was written."""
    try:
      return cls._from_dict(d, source)
    except KeyConfigError as e:
      where = (origins or {}).get(e.path) or source
      raise mis_jax.ConfigError(f"{where}: {e}" if where else str(e)) from None
    except mis_jax.ConfigError as e:
      raise mis_jax.ConfigError(f"{source}: {e}" if source else str(e)) from None

  @classmethod
  def _from_dict(cls, d, source):
    if not isinstance(d, dict):
      raise mis_jax.ConfigError("the trainer config must be a mapping")
    for k in d:
      if k not in _TOP:
        raise KeyConfigError(k, f"unknown key '{k}'.{_suggest(k, _TOP)} Valid keys: {', '.join(sorted(_TOP))}")
    kwargs: dict[str, Any] = {"source": source}
    for name, section_cls in SECTIONS.items():
      kwargs[name] = parse_section(section_cls, d.get(name), name)
    for name, typ, meta in (("run_dir", str, {}), ("seed", int, {"ge": 0})):
      if name in d:
        try:
          kwargs[name] = parse_value(d[name], typ, meta, name)
        except mis_jax.ConfigError as e:
          raise KeyConfigError(name, str(e)) from None
    if d.get("loss") is not None and not isinstance(d["loss"], dict):
      raise mis_jax.ConfigError(f"loss must be a mapping of keys, got {type(d['loss']).__name__} {d['loss']!r}")
    kwargs["loss"] = mis_jax.config.loss_config_from_args({}, base=dict(d.get("loss") or {}))
    cfg = cls(**kwargs)
    cfg.validate()
    return cfg

  @classmethod
  def from_yaml(cls, path: str) -> "TrainConfig":
    return cls.from_dict(load_yaml(path, "trainer config") or {}, source=path)

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """The config as JSON-able values (the loss section as `LossConfig.to_dict`)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {k: v.to_dict() if k == "loss" else dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            for k, v in out.items()}

  def validate(self) -> None:
    """Checks across keys (single keys are checked on load)."""
    r, t, c = self.rollout, self.train, self.checkpoint
    checks = [
        (t.tokens_per_micro_batch >= t.row_len, f"train.tokens_per_micro_batch ({t.tokens_per_micro_batch}) must be "
                                                f">= train.row_len ({t.row_len}): a micro-batch holds whole rows"),
        (t.warmup_steps < t.steps or t.warmup_steps == 0,
         f"train.warmup_steps ({t.warmup_steps}) must be < train.steps ({t.steps})"),
        # Checkpoints land on sync steps, so a resumed run can restore the server's weights exactly.
        (c.every % r.sync_every == 0, f"checkpoint.every ({c.every}) must be a multiple of rollout.sync_every "
                                      f"({r.sync_every})"),
    ] + [(False, problem) for problem in self.task.problems()]
    where = f"{self.source}: " if self.source else ""
    for ok, message in checks:
      if not ok:
        raise mis_jax.ConfigError(where + message)


def reference_table() -> str:
  """The docs' config reference (docs/reference/config.md): every section key with its default and meaning."""
  rows = ["| key | default | meaning |", "|---|---|---|",
          "| `run_dir` | `runs/default` | metrics, checkpoints, weights (must not be a file) |",
          "| `seed` | `0` | seeds prompts, sampling and init |",
          "| `loss.*` | `LossConfig` defaults | any `LossConfig` key, plus `custom_config_path` (the MIS YAML) |"]
  for section, cls in SECTIONS.items():
    for name, (field, typ) in fields_of(cls).items():
      m = field.metadata
      default = field.default
      shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
      allowed = f" ({' / '.join(m['choices'])})" if m.get("choices") else ""
      rows.append(f"| `{section}.{name}` | `{shown}` | {m['doc']}{allowed} |")
  return "\n".join(rows)


def _suggest(key, valid) -> str:
  match = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.5)
  return f" Did you mean '{match[0]}'?" if match else ""


def set_override(d: dict, assignment: str) -> None:
  """Applies ``section.key=value`` (value parsed as YAML) to a raw config dict."""
  if "=" not in assignment:
    raise mis_jax.ConfigError(f"override {assignment!r} must look like section.key=value")
  path, _, raw = assignment.partition("=")
  try:
    value = yaml.safe_load(raw)
  except yaml.YAMLError as e:
    raise mis_jax.ConfigError(f"--set {assignment}: the value is not valid YAML ({e.problem})") from None
  assign(d, path, value)


def assign(d: dict, path: str, value) -> None:
  """Sets ``d[section][key] = value`` for ``path = "section.key"`` (or a top-level key)."""
  keys = path.split(".")
  if not all(keys):
    raise mis_jax.ConfigError(f"--set {path}=...: the key must look like section.key")
  node = d
  for k in keys[:-1]:
    node = node.setdefault(k, {})
    if not isinstance(node, dict):
      raise mis_jax.ConfigError(f"--set {path}=...: '{k}' is not a section")
  node[keys[-1]] = value
