"""Trainer configuration: YAML sections, validated once before anything starts.

Sections: ``model``, ``task``, ``rollout``, ``train``, ``parallel``, ``loss``, ``checkpoint``, ``logging`` plus
``run_dir`` and ``seed``. ``rollout`` holds the step's shape (``prompts_per_step``, ``n``) and five sections of its
own: ``sampling``, ``transport``, ``placement``, ``sync``, ``records``. Unknown keys are errors naming the file, the
section and the closest valid key; a key that moved (``rollout.temperature``, ``loss.use_tis``, ``loss.tau_pos``)
is an error naming where it lives now.

``loss`` is parsed into a typed :class:`mis_jax.LossConfig` (``TrainConfig.loss``): the algorithm is one key,
``algorithm`` (the contract §6 row, mapped onto ``use_rollout_logprobs`` × ``use_tis``), the policy-loss form a
tagged section ``policy_loss: {name: FORM, <that form's own keys>}`` (``mis_jax.forms.POLICY_LOSS_KEYS``), and every
other `LossConfig` key, ``custom_config_path`` (the MIS YAML) and ``preset`` sit beside them. Every key has a
type and constraints (`key(...)`), checked on load: an int is never 1.5 or text, numbers are in range, enums
are one of their values. The enums are the implementations' own (each imported from the module that owns it).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

import mis_jax
from mis_jax.config import config_fields as fields_of, config_key as key, load_yaml, parse_config_value as parse_value
from trainers.models.attention import ATTENTION_BACKENDS
from trainers.models.decoder import LAYER_LOOPS, REMAT_POLICIES, UNROLL_MAX_LAYERS
from trainers.models.hf_io import DTYPES as DTYPE_TABLE
from trainers.models.moe import MOE_DISPATCH
from trainers.models.presets import PRESETS
from trainers.tasks.rewards import REWARDS as REWARD_TABLE

DTYPES = tuple(DTYPE_TABLE)
PRESET_NAMES = tuple(sorted(PRESETS))
AUTO = "auto"  # model.remat / model.attention: chosen at start-up by trainers.learner.memory_plan
REMAT = tuple(REMAT_POLICIES) + (AUTO,)
ATTENTION = ATTENTION_BACKENDS + (AUTO,)
LAYER_LOOP = LAYER_LOOPS + (AUTO,)
REWARDS = tuple(REWARD_TABLE)
ROUTING_REPLAY = ("none", "r3", "r2")
OLD_LOGPROBS = (AUTO, "separate", "from_update")  # train.old_logprobs: resolved by trainers.learner.plan
TASKS = ("copy_digits", "lookup_digits", "calculator", "dataset", "jsonl")  # `jsonl`: the dataset task's former name


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str | None = key(
    None, "an HF checkpoint dir (Qwen2, Qwen3, Qwen3-MoE or Llama: config.json + *.safetensors); else `preset`"
  )
  preset: str = key("tiny-qwen3", "a tiny model initialised from scratch when `path` is null", choices=PRESET_NAMES)
  initializer_range: float | None = key(None, "std of the preset's random weights (null: the preset's 0.02)", gt=0)
  init_seed: int = key(0, "seed of the preset's random weights", ge=0)
  dtype: str = key("float32", "compute dtype of the trainer's forward/backward", choices=DTYPES)
  param_dtype: str = key("float32", "master weights and optimiser state", choices=DTYPES)
  attention: str = key(
    AUTO,
    "`dense` ([T, T] reference), `blocked` (flash-style), `fused` (Pallas, else blocked); "
    "`auto`: dense when the compiled step fits the memory budget, else blocked",
    choices=ATTENTION,
  )
  remat: str = key(
    AUTO,
    "activation checkpointing of the layer scan; `auto`: the least (none, dots, full) whose "
    "compiled step fits the memory budget",
    choices=REMAT,
  )
  layer_loop: str = key(
    AUTO,
    "the stacked layers run as one `scan` (one compiled layer body) or `unrolled` (each "
    f"layer its own code: a faster step), in the trainer's step and the embedded engine's "
    f"decoding; `auto`: unrolled up to {UNROLL_MAX_LAYERS} layers, else scan",
    choices=LAYER_LOOP,
  )
  memory_budget_gb: float | None = key(
    None,
    "per-device memory the `auto` choices must fit (null: 0.9 x the "
    "device's bytes_limit; on CPU 0.9 x the host's RAM over its devices)",
    gt=0,
  )
  logprob_chunk: int = key(1024, "tokens per chunk of the LM head (`mis_jax.token_logprobs`)", ge=1)
  moe_dispatch: str = key(
    "grouped",
    "mixture of experts: `grouped` (tokens sorted by expert, blocks per expert), "
    "`ragged_dot` (jax.lax.ragged_dot: native on TPU, dense on CPU) or `dense` (every expert "
    "on every token: the small-model reference)",
    choices=MOE_DISPATCH,
  )


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """The toy task `copy_digits`, or `dataset`: JSONL / Parquet records (`trainers.tasks`)."""

  name: str = key(
    "copy_digits",
    "`copy_digits` (toy), `lookup_digits` (a toy multi-turn tool task: the digits only "
    "a lookup call reveals; docs/guides/agents.md), `calculator` (arithmetic with a calculator tool in Qwen3's "
    "<tool_call> format: an agent task for a Qwen3 tokenizer) or `dataset` (JSONL / Parquet; `jsonl` is its old "
    "name)",
    choices=TASKS,
  )
  num_digits: int | None = key(None, "copy_digits, lookup_digits: digits per prompt (null: 3)", ge=1)
  tool: bool | None = key(
    None,
    "lookup_digits: whether the lookup tool answers (null: true; false: every call fails, "
    "the control run that cannot learn)",
  )
  path: str | None = key(None, "dataset: a .jsonl / .parquet file, a directory of them, or a glob")
  prompt_key: str | None = key(
    None,
    "dataset: prompt column, dots for nested keys (null: the first of `prompt_ids` / "
    "`messages` / `prompt`); token ids, chat messages or text",
  )
  answer_key: str | None = key(
    None,
    "dataset: ground-truth column (null: the first of `reward_model.ground_truth` / "
    "`answer` / `solution` / `ground_truth`)",
  )
  reward_fn: str | None = key(
    None,
    "dataset: `math`, `exact_match`, `format` (docs/guides/datasets.md) or "
    "`pkg.mod:fn(record, response_ids, text) -> float`",
  )
  tokenizer: str | None = key(None, "dataset: HF tokenizer directory (null: `model.path`)")
  chat_template: bool | None = key(
    None, "dataset: render text prompts as one user message with the tokenizer's chat template (null: when it has one)"
  )
  chat_template_kwargs: dict | None = key(None, "dataset: chat-template variables, e.g. `{enable_thinking: false}`")
  stop_token_ids: tuple[int, ...] | None = key(
    None, "dataset: stop tokens (null: the template's end of turn + EOS)", ge=0
  )
  max_new_tokens: int | None = key(
    None, "dataset: response cap when `rollout.sampling.max_new_tokens` is null (null: 128)", ge=1
  )

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
      out.append(
        f"task.reward_fn has invalid value {fn!r}; built-in rewards: {', '.join(REWARDS)}, or an import "
        "path pkg.module:function"
      )
    return out


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  """What each request asks the engine for and gets back per token: the sampling parameters, and the replays
  of the engine's sampling support and routed experts."""

  temperature: float = key(1.0, "sampling temperature (0: greedy); the trainer divides its logits by it", ge=0)
  top_p: float = key(1.0, "nucleus sampling: keep the smallest prefix of mass >= top_p", gt=0, le=1)
  top_k: int = key(-1, "top-k sampling, -1 = all; with sampling replay, the support width of the step", ge=-1)
  min_p: float = key(0.0, "min-p sampling: drop tokens below min_p x the top probability", ge=0, le=1)
  max_new_tokens: int | None = key(None, "response length cap (null: the task's)", ge=1)
  sampling_replay: str = key(
    "auto",
    "replay the engine's top-k/top-p/min-p support (SGLang's return_sampling_mask): "
    "behaviour log-probs and every trainer log-prob over it; auto = on when sampling "
    "is truncated",
    choices=("auto", "on", "off"),
  )
  sampling_mask_max_tokens: int = key(
    4096, "largest support accepted (as SGLang's --sampling-mask-max-tokens); top_k must not exceed it", ge=1
  )
  routing_replay: str = key(
    "none",
    "mixture of experts: `r3` replays the server's routed experts (SGLang "
    "--enable-return-routed-experts) in the old-log-prob pass and every training forward; "
    "`r2` replays the trainer's own old-pass routing in the training forwards",
    choices=ROUTING_REPLAY,
  )
  record_routing: bool | None = key(
    None, "ask the server for routed experts and log the routing-mismatch metrics (null: with r3)"
  )
  top_logprobs_num: int = key(
    0,
    "the sampler's k most likely tokens and log-probs per response token (SGLang's "
    "top_logprobs_num); loss.score_centering needs k >= 1 (contract §6.6)",
    ge=0,
  )


@dataclasses.dataclass(frozen=True)
class TransportSection:
  """The requests to the engines: concurrency, batching, timeouts, retries, and what stops a run."""

  max_concurrency: int = key(4, "HTTP requests in flight", ge=1)
  prompts_per_request: int = key(
    8, "prompts batched into one /generate request (colocated: a step's prompts go in one call)", ge=1
  )
  timeout_s: float = key(120.0, "HTTP timeout per request", gt=0)
  max_retries: int = key(3, "retries of a failed request (connection errors, timeouts, 5xx)", ge=0)
  backoff_s: float = key(0.5, "first retry delay (doubles each retry)", ge=0)
  health_attempts: int = key(30, "/health polls (with backoff) before giving up at start", ge=1)
  server_restart_timeout_s: float = key(
    600.0,
    "when no server can serve a step (connection errors or 5xx past the "
    "retries): wait this long for one to answer /health again, push it the "
    "served weights and redo the step (0: stop at once)",
    ge=0,
  )
  max_rejected_fraction: float = key(0.25, "more malformed samples than this in a step stops the run", ge=0, le=1)
  router: str | None = key(
    None,
    "an sglang-router URL (`--router`): generation goes through it, the workers are its own "
    "list (GET /workers), each gets every weight push directly; workers may join and leave "
    "during the run (docs/guides/fleet.md)",
  )
  router_poll_s: float = key(
    1.0, "with a router: how often its worker list is read for workers that joined (0: only at each push)", ge=0
  )


@dataclasses.dataclass(frozen=True)
class PlacementSection:
  """Which engine generates, where, and in which precision."""

  mode: str = key(
    "server",
    "where rollouts are generated: SGLang servers over HTTP (`server`; the embedded "
    "one by default), or the embedded engine inside the trainer's process, on its "
    "devices, weights handed over in memory (`colocated`)",
    choices=("server", "colocated"),
  )
  colocated_devices: str = key(
    "first",
    "colocated: where the embedded engine lives — the mesh's `first` device (a "
    "model that fits one device; no collectives while decoding), or the whole `mesh`: "
    "its weights laid out as the trainer's (FSDP/TP), each batch's rows split over the "
    "data axes",
    choices=("first", "mesh"),
  )
  engine: str = key(
    "embedded",
    "the engine that generates: this package's (`embedded`: `mis-jax serve`, or in "
    "process when colocated) or sglang-jax (`sglang-jax`: its server from its venv, or, colocated, "
    "its Engine in the trainer's process — run the trainer in its venv, docs/guides/trainer.md)",
    choices=("embedded", "sglang-jax"),
  )
  server_dtype: str = key("bfloat16", "embedded server precision", choices=DTYPES)
  server_quantize: str = key(
    "none",
    "embedded server's weight-only quantisation of Linear kernels (per-channel scales, on top of `server_dtype`)",
    choices=("none", "int8", "fp8"),
  )
  exact: bool = key(
    False,
    "exact mode (contract §13): the embedded engine (colocated or `mis-jax serve "
    "--arithmetic batch_invariant`) and the trainer's old-log-prob pass compute in batch-invariant "
    "arithmetic on the same weights (the pass in `server_dtype` on the engine's copy), so the "
    "sampled tokens' log-probs are equal bit for bit for fresh weights and a sample's do not depend "
    "on its batch; slower rollouts and old-log-prob pass (docs/performance.md)",
  )


@dataclasses.dataclass(frozen=True)
class SyncSection:
  """The weights the engines serve: when they are pushed, how stale a sample may be, the checks on them."""

  sync_every: int = key(1, "push weights every k steps (k > 1: deliberately stale rollouts)", ge=1)
  max_staleness: int = key(
    0,
    "asynchronous rollouts: generate while training, samples at most k weight versions old (0: the synchronous loop)",
    ge=0,
  )
  max_token_staleness: int | None = key(
    None,
    "mask from the loss the response tokens generated more than k weight "
    "versions before the step (from the samples' weight_versions spans: a "
    "response that straddled an update is masked in part); they stay as "
    "context (null: off)",
    ge=0,
  )
  pause_mode: str = key(
    "abort",
    "/pause_generation mode during a weight sync (retract keeps in-flight requests for after the update)",
    choices=("abort", "retract", "in_place"),
  )
  weight_dtype: str | None = key(
    None,
    "dtype of the HF weights pushed to the servers (null: the dtype the server "
    "reports in /server_info, else placement.server_dtype)",
    choices=DTYPES,
  )
  via: str = key(
    "disk",
    "how the weights reach servers over HTTP: `disk` (an HF checkpoint under run_dir, loaded by "
    "/update_weights_from_disk: the servers must see run_dir at the same path) or `http` (streamed to each "
    "server in buckets, no shared filesystem: mis-jax serve and the sglang-jax launcher; "
    "docs/guides/fleet.md)",
    choices=("disk", "http"),
  )
  delta: bool = key(
    False,
    "via http: send a server that holds the last push only the values that changed since "
    "it (bit for bit; a new, restarted or lagging server gets the weights whole)",
  )
  bucket_mb: int = key(128, "via http: megabytes of tensors per request", ge=1)
  initial_sync: str = key(
    "auto",
    "push the starting weights before step 1: `auto` = unless every server already "
    "serves model.path (its /model_info model_path) and the run is not resumed; `always`; "
    "`never` (a resume always pushes)",
    choices=("auto", "always", "never"),
  )
  cache_salt: bool = key(
    True,
    "every /generate carries SGLang's extra_key (its prefix-cache namespace) naming the "
    "weights it starts under, fresh at every weight update: no engine can match a prefix "
    "computed under other weights (docs/guides/server.md: the prefix cache across updates)",
  )
  mismatch_check: bool = key(
    True,
    "stop when server and trainer hold the same weights yet their log-probs differ "
    "far beyond numerics (docs/guides/trainer.md: the mismatch sanity check)",
  )


@dataclasses.dataclass(frozen=True)
class RecordsSection:
  """The trainer's saved rollouts (docs/guides/records.md)."""

  save_dir: str | None = key(
    None, "write each step's rollouts as Parquet records here (`--save-rollouts`; docs/guides/records.md)"
  )
  load_dir: str | None = key(
    None, "train from saved rollout records, the same steps in the same order, with no server (`--load-rollouts`)"
  )


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  """A step's rollouts: how many (the batch's shape, here) and, one section each, how they are sampled,
  requested, placed, kept in sync with the trainer's weights, and recorded."""

  prompts_per_step: int = key(16, "prompts per step", ge=1)
  n: int = key(8, "samples per prompt (a GRPO group)", ge=1)
  sampling: SamplingSection = key(SamplingSection(), "sampling parameters and replays")
  transport: TransportSection = key(TransportSection(), "requests to the engines")
  placement: PlacementSection = key(PlacementSection(), "the engine and where it runs")
  sync: SyncSection = key(SyncSection(), "weight pushes and staleness")
  records: RecordsSection = key(RecordsSection(), "saved rollouts")


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
  old_logprobs: str = key(
    AUTO,
    "where (standard or decoupled) PPO's old log-probs come from: `separate`, a "
    "forward pass before the update; `from_update`, the update's own forward (stop-gradient), exact "
    "only with ppo_epochs 1, the plain pass the only policy pass (no R2/R3 routing pass, no "
    "optimal token baseline) and no advantage stage (exclude_rejected_from_baseline, "
    "token baseline, covariance re-selection) — an error otherwise; a step of several "
    "micro-batches still takes the separate pass; `auto`: from_update exactly when exact",
    choices=OLD_LOGPROBS,
  )
  tokens_per_micro_batch: int = key(
    4096, "tokens per device (of data x fsdp x expert) in one micro-batch; >= row_len", ge=1
  )
  row_len: int = key(64, "tokens per packed row (>= the longest prompt + response)", ge=2)
  advantage_estimator: str = key(
    "grpo", "per-group advantages (contract §6.1)", choices=tuple(mis_jax.estimators.ESTIMATORS)
  )
  exclude_rejected_from_baseline: bool = key(
    False, "sequences rejected whole leave their group's baseline (contract §6.1)"
  )
  router_aux_loss_coef: float = key(0.0, "mixture of experts: weight of HF's load-balancing loss (RL recipes: 0)", ge=0)
  max_consecutive_masked_steps: int = key(
    3,
    "steps in a row whose correction keeps no token (a warning each) before "
    "the run stops, naming the setting and the ratios seen",
    ge=1,
  )


@dataclasses.dataclass(frozen=True)
class ParallelSection:
  """Mesh axis sizes (`trainers.runtime.parallel`); one of them may be -1: the devices the others leave."""

  data: int = key(1, "data-parallel replicas (parameters replicated)", ge=-1)
  fsdp: int = key(-1, "fully sharded data parallelism (parameters, optimiser state split); -1: the rest", ge=-1)
  tensor: int = key(1, "Megatron tensor parallelism (heads, MLP columns, vocabulary split)", ge=-1)
  expert: int = key(
    1,
    "expert parallelism: a mixture-of-experts model's experts split over it (it also splits the batch, as fsdp does)",
    ge=-1,
  )


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = key(10, "Orbax checkpoint every k steps (a multiple of rollout.sync.sync_every)", ge=1)
  max_to_keep: int = key(3, "checkpoints kept", ge=1)


@dataclasses.dataclass(frozen=True)
class AgentSection:
  """Multi-turn rollouts of an agent task (`trainers.agents`; docs/guides/agents.md): its budgets and pool."""

  max_turns: int = key(4, "model turns per trajectory", ge=1)
  max_total_tokens: int | None = key(
    None,
    "response tokens of a trajectory, the model's and the environment's "
    "(null: what train.row_len leaves after the prompt)",
    ge=1,
  )
  env_concurrency: int = key(64, "environments stepping at once (a bounded thread pool)", ge=1)
  max_turn_retries: int = key(2, "times a turn the engine aborted (a weight update's pause) is sent again", ge=0)
  per_turn_rewards: bool = key(
    False,
    "each turn's reward on that turn's tokens: a token's advantage is its turn's "
    "return (the rewards from its turn on) against the group's baseline; off: the "
    "trajectory's reward on every model token (trainers/agents/rewards.py, contract §11.1)",
  )


@dataclasses.dataclass(frozen=True)
class LoggingSection:
  """Where step metrics go besides `run_dir/metrics.jsonl` (`trainers.app.metric_logging`)."""

  tensorboard: bool = key(True, "TensorBoard event files in `run_dir/tensorboard` (tensorboardX, no PyTorch needed)")
  wandb: bool = key(False, "log to Weights & Biases (needs `wandb` installed and logged in)")
  wandb_project: str | None = key(None, "W&B project (null: `mis-jax`)")
  wandb_run_name: str | None = key(None, "W&B run name (null: the run directory's name)")
  progress_every: int = key(
    10, "when stdout is not a terminal: one progress line every k steps (a terminal gets a live bar)", ge=1
  )


SECTIONS = {
  "model": ModelSection,
  "task": TaskSection,
  "rollout": RolloutSection,
  "train": TrainSection,
  "parallel": ParallelSection,
  "checkpoint": CheckpointSection,
  "logging": LoggingSection,
  "agent": AgentSection,
}
_TOP = {"run_dir", "seed", "loss", *SECTIONS}


def _is_section(typ) -> bool:
  return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def config_keys(section_cls, prefix: str):
  """`(path, field, type)` of every key of a section, a nested section's keys under its own path."""
  for name, (field, typ) in fields_of(section_cls).items():
    if _is_section(typ):
      yield from config_keys(typ, f"{prefix}.{name}")
    else:
      yield f"{prefix}.{name}", field, typ


# The flat rollout keys before the rollout section was split: each names where it lives now.
# (Keys added to the nested sections since were never flat.)
NEVER_FLAT = {
  "rollout.transport.router",
  "rollout.transport.router_poll_s",
  "rollout.sampling.top_logprobs_num",
  "rollout.placement.exact",
  "rollout.sync.via",
  "rollout.sync.delta",
  "rollout.sync.bucket_mb",
}
MOVED = {
  f"rollout.{path.rpartition('.')[2]}": path
  for path, _, _ in config_keys(RolloutSection, "rollout")
  if path.count(".") == 2 and path != "rollout.placement.mode" and path not in NEVER_FLAT
}
MOVED["rollout.placement"] = "rollout.placement.mode"  # was a string; the name is the section's now


class KeyConfigError(mis_jax.ConfigError):
  """A bad value or unknown key at ``path`` (``section.key``)."""

  def __init__(self, path: str, message: str):
    super().__init__(message)
    self.path = path


def _moved(path: str, value) -> str:
  new = MOVED[path]
  return (
    f"{path} moved to {new} (write {path.rpartition('.')[0]}: {{{new.split('.')[1]}: "
    f"{{{new.rpartition('.')[2]}: {_yaml(value)}}}}}, or --set {new}=...)"
  )


def _yaml(value) -> str:
  return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def parse_section(section_cls, values, where: str):
  """A section from a mapping: unknown keys (with the closest valid one), moved keys (naming the new one),
  types, ranges; a nested section's mapping recursively."""
  if values is None:
    values = {}
  if not isinstance(values, dict):
    if where in MOVED:
      raise KeyConfigError(where, _moved(where, values))
    raise KeyConfigError(where, f"{where} must be a mapping of keys, got {type(values).__name__} {values!r}")
  fields = fields_of(section_cls)
  kwargs = {}
  for k, v in values.items():
    path = f"{where}.{k}"
    if k not in fields:
      if path in MOVED:
        raise KeyConfigError(path, _moved(path, v))
      # A typo of a key that moved into a nested section suggests its new path.
      moved = {p.rpartition(".")[2]: MOVED[p].removeprefix(f"{where}.") for p in MOVED if p.rpartition(".")[0] == where}
      match = difflib.get_close_matches(str(k), [*fields, *moved], n=1, cutoff=0.5)
      hint = f" Did you mean '{moved.get(match[0], match[0])}'?" if match else ""
      raise KeyConfigError(path, f"unknown key '{path}'.{hint} Valid keys: {', '.join(fields)}")
    field, typ = fields[k]
    if _is_section(typ):
      kwargs[k] = parse_section(typ, v, path)
      continue
    try:
      kwargs[k] = parse_value(v, typ, field.metadata, path)
    except mis_jax.ConfigError as e:
      raise KeyConfigError(path, str(e)) from None
  return section_cls(**kwargs)


# --- the loss section: `algorithm` in the YAML for LossConfig's two flags ---------------------------------------
_FLAGS = ("use_rollout_logprobs", "use_tis")  # set by `loss.algorithm`
# The section's keys beside `algorithm` and `policy_loss`: LossConfig's others, the MIS file, a preset.
LOSS_KEYS = (
  ("algorithm",)
  + tuple(k for k in mis_jax.LossConfig.keys() if k not in _FLAGS)
  + ("custom_config_path", "custom_tis_function_path", "preset")
)
ALGORITHM_DOC = (
  "the algorithm, a row of contract §6: `ppo` (use_rollout_logprobs false, use_tis false), "
  "`bypass_ppo` (true, false), `decoupled_ppo` (false, true), `reinforce_is` (true, true); null: "
  "decoupled_ppo when the MIS config says use_tis: true, else ppo"
)


def _forms_of(k: str) -> list[str]:
  return [form for form, keys in mis_jax.forms.POLICY_LOSS_KEYS.items() if k in keys]


def loss_values(section, where: str = "loss") -> dict:
  """The `loss` section (nested: `algorithm`, `policy_loss: {name: FORM, ...}`) as the `LossConfig` keys
  `mis_jax.config.loss_config_from_args` takes as its base (`policy_loss` as `{name, <its keys>}`). Errors are
  `KeyConfigError`s naming the key; a key of the flat form names where it lives now."""
  if section is None:
    return {}
  if not isinstance(section, dict):
    raise KeyConfigError(where, f"{where} must be a mapping of keys, got {type(section).__name__} {section!r}")
  out: dict[str, Any] = {}
  for k, v in section.items():
    path = f"{where}.{k}"
    if k in _FLAGS:
      given = {f: section[f] for f in _FLAGS if f in section}
      hint = ""
      if all(isinstance(section.get(f, False), bool) for f in _FLAGS):
        name = next(
          n
          for n, flags in mis_jax.config.ALGORITHMS.items()
          if flags == (section.get("use_rollout_logprobs", False), section.get("use_tis", True))
        )
        hint = f": {', '.join(f'{f} {_yaml(x)}' for f, x in given.items())} is algorithm: {name}"
      raise KeyConfigError(path, f"{path} moved to {where}.algorithm ({' | '.join(mis_jax.config.ALGORITHMS)}){hint}")
    if _forms_of(k):
      forms = _forms_of(k)
      raise KeyConfigError(
        path,
        f"{path} moved to {where}.policy_loss.{k}, a key of policy_loss "
        f"{' / '.join(forms)} (write policy_loss: {{name: {forms[0]}, {k}: {_yaml(v)}}})",
      )
    if k == "algorithm":
      if v is not None:
        try:
          name = parse_value(v, str, {"choices": tuple(mis_jax.config.ALGORITHMS)}, path)
        except mis_jax.ConfigError as e:
          raise KeyConfigError(path, str(e)) from None
        out.update(zip(_FLAGS, mis_jax.config.ALGORITHMS[name]))
      continue
    if k == "policy_loss":
      out.update(_policy_loss(v, path))
      continue
    if k not in LOSS_KEYS:
      raise KeyConfigError(path, f"unknown key '{path}'.{_suggest(k, LOSS_KEYS)} Valid keys: {', '.join(LOSS_KEYS)}")
    out[k] = v
  return out


def _policy_loss(value, where: str) -> dict:
  """`policy_loss: {name: FORM, <FORM's own keys>}`, checked, as LossConfig's `policy_loss`."""
  forms = tuple(mis_jax.forms.POLICY_LOSS_KEYS)
  if not isinstance(value, dict):
    raise KeyConfigError(
      where,
      f"{where} is a tagged section: write policy_loss: {{name: {_yaml(value)}}} "
      f"(name: one of {', '.join(forms)}, beside it that form's own keys)",
    )
  if "name" not in value:
    raise KeyConfigError(where, f"{where} needs name: one of {', '.join(forms)}")
  try:
    name = parse_value(value["name"], str, {"choices": forms}, f"{where}.name")
  except mis_jax.ConfigError as e:
    raise KeyConfigError(f"{where}.name", str(e)) from None
  own = mis_jax.forms.POLICY_LOSS_KEYS[name]
  form = {"name": name}
  for k, v in value.items():
    if k == "name":
      continue
    path = f"{where}.{k}"
    if k not in own:
      if _forms_of(k):
        raise KeyConfigError(
          path, f"{path} is a key of policy_loss {' / '.join(_forms_of(k))}, not of {name} ({_own_keys(name)})"
        )
      raise KeyConfigError(path, f"unknown key '{path}'.{_suggest(k, own)} {_own_keys(name)}, beside name")
    form[k] = v
  return {"policy_loss": form}


def _own_keys(form: str) -> str:
  own = mis_jax.forms.POLICY_LOSS_KEYS[form]
  return f"{form}'s keys: {', '.join(own)}" if own else f"{form} has no keys of its own"


def loss_to_dict(loss: mis_jax.LossConfig) -> dict:
  """A `LossConfig` as the trainer's nested `loss` section (`algorithm`, `policy_loss: {name, ...}`); the
  keys of the forms it does not use are left out."""
  out: dict[str, Any] = {}
  for k, v in loss.to_dict().items():
    if k == "use_tis":
      out["algorithm"] = loss.algorithm
    elif k not in _FLAGS:  # policy_loss: {name, its keys} already
      out[k] = v
  return out


def loss_config(section, args=None, *, source: str | None = None, origins: dict | None = None) -> mis_jax.LossConfig:
  """The `LossConfig` of a `loss` section, with the library's loss flags (`args`, `mis_jax.config.add_loss_flags`) over
  it: a flag that contradicts the section is an error naming both. Errors name where the value was written."""
  try:
    base = loss_values(section)
    flags = {} if args is None else dict(vars(args)) if not isinstance(args, dict) else dict(args)
    nested = section or {}
    for flag, path, value, given in _renamed_flags(nested, base):
      if flags.get(flag) is not None and not mis_jax.config.same_value(flags[flag], given):
        raise KeyConfigError(
          path,
          f"--{flag.replace('_', '-')} {_yaml(flags[flag])} contradicts {path}: "
          f"{_yaml(value)} in the config; remove one of them",
        )
    if nested.get("algorithm") is not None and flags.get("use_tis") is None:
      _check_algorithm_against_mis(nested["algorithm"], base, flags)
    return mis_jax.config.loss_config_from_args(flags, base=base)
  except KeyConfigError as e:
    where = (origins or {}).get(e.path) or source
    raise mis_jax.ConfigError(f"{where}: {e}" if where else str(e)) from None
  except mis_jax.ConfigError as e:
    raise mis_jax.ConfigError(f"{source}: {e}" if source else str(e)) from None


def _renamed_flags(nested: dict, base: dict):
  """The library flags whose key the trainer's section spells otherwise: `(flag, path, value as written, the
  flag's value it means)`."""
  if nested.get("algorithm") is not None:
    for flag in _FLAGS:
      yield flag, "loss.algorithm", nested["algorithm"], base[flag]
  if "policy_loss" in base:
    form = base["policy_loss"]
    yield "policy_loss", "loss.policy_loss.name", form["name"], form["name"]
    for k in mis_jax.forms.POLICY_LOSS_KEYS[form["name"]]:
      if k in form and k in mis_jax.config.LOSS_FLAG_KEYS:
        yield k, f"loss.policy_loss.{k}", form[k], form[k]


def _check_algorithm_against_mis(algorithm: str, base: dict, flags: dict) -> None:
  """`loss.algorithm`'s use_tis against the MIS config's (a file's `use_tis: true` turns the correction on):
  a contradiction names both."""
  if flags.get("custom_config_path") and base.get("custom_config_path"):
    return  # the library's check: the flag against the section's file
  path = flags.get("custom_config_path") or base.get("custom_config_path")
  mis = base.get("mis")
  if path:
    mis = mis_jax.MISConfig.from_yaml(path)
  elif isinstance(mis, dict):
    mis = mis_jax.MISConfig.from_dict(mis, source="loss.mis")
  if isinstance(mis, mis_jax.MISConfig) and mis.use_tis != base["use_tis"]:
    raise KeyConfigError(
      "loss.algorithm",
      f"loss.algorithm: {algorithm} (use_tis {_yaml(base['use_tis'])}) "
      f"contradicts use_tis: {_yaml(mis.use_tis)} in {mis.source or 'loss.mis'}; "
      "remove one of them",
    )


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
      cfg = cls._from_dict(d, source)
    except KeyConfigError as e:
      where = (origins or {}).get(e.path) or source
      raise mis_jax.ConfigError(f"{where}: {e}" if where else str(e)) from None
    except mis_jax.ConfigError as e:
      raise mis_jax.ConfigError(f"{source}: {e}" if source else str(e)) from None
    return cfg.replace(loss=loss_config(d.get("loss"), source=source, origins=origins))

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
    cfg = cls(**kwargs)
    cfg.validate()
    return cfg

  @classmethod
  def from_yaml(cls, path: str) -> "TrainConfig":
    return cls.from_dict(load_yaml(path, "trainer config") or {}, source=path)

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """The settings as JSON-able values in the YAML's form (the loss section nested, `loss_to_dict`), which
    `from_dict` reads back to an equal config (the file it came from, `source`, is not a setting)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
    return {
      k: loss_to_dict(v) if k == "loss" else dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
      for k, v in out.items()
    }

  def validate(self) -> None:
    """Checks across keys (single keys are checked on load)."""
    r, t, c = self.rollout, self.train, self.checkpoint
    checks = [
      (
        t.tokens_per_micro_batch >= t.row_len,
        f"train.tokens_per_micro_batch ({t.tokens_per_micro_batch}) must be "
        f">= train.row_len ({t.row_len}): a micro-batch holds whole rows",
      ),
      (
        t.warmup_steps < t.steps or t.warmup_steps == 0,
        f"train.warmup_steps ({t.warmup_steps}) must be < train.steps ({t.steps})",
      ),
      # Checkpoints land on sync steps, so a resumed run can restore the server's weights exactly.
      (
        c.every % r.sync.sync_every == 0,
        f"checkpoint.every ({c.every}) must be a multiple of rollout.sync.sync_every ({r.sync.sync_every})",
      ),
      (
        not r.sync.delta or r.sync.via == "http",
        "rollout.sync.delta streams only what changed: it needs rollout.sync.via http (got disk)",
      ),
      (
        r.sync.via == "disk" or r.placement.mode == "server",
        f"rollout.sync.via {r.sync.via}: colocated rollouts hand the weights over in memory (rollout.placement.mode "
        f"colocated); leave rollout.sync.via at disk",
      ),
    ] + [(False, problem) for problem in self.task.problems()]
    for ok, message in checks:  # (from_dict names the file)
      if not ok:
        raise mis_jax.ConfigError(message)


def reference_table() -> str:
  """The docs' config reference (docs/reference/config.md): every section key with its default and meaning."""
  rows = [
    "| key | default | meaning |",
    "|---|---|---|",
    "| `run_dir` | `runs/default` | metrics, checkpoints, weights (must not be a file) |",
    "| `seed` | `0` | seeds prompts, sampling and init |",
  ]

  def row(path, default, doc, choices=None):
    allowed = f" ({' / '.join(choices)})" if choices else ""
    rows.append(f"| `{path}` | `{_shown(default)}` | {doc.replace('|', chr(92) + '|')}{allowed} |")

  for section, cls in SECTIONS.items():
    for path, field, _ in config_keys(cls, section):
      row(path, field.default, field.metadata["doc"], field.metadata.get("choices"))
  loss_fields = {f.name: f for f in dataclasses.fields(mis_jax.LossConfig)}
  row("loss.algorithm", None, ALGORITHM_DOC, tuple(mis_jax.config.ALGORITHMS))
  for k in mis_jax.LossConfig.keys():
    f = loss_fields[k]
    if k == "policy_loss":
      row(
        "loss.policy_loss.name",
        f.default,
        "the policy-loss form, by verl's name (contract §6.2); beside `name`, "
        "only that form's own keys (the rows below, each naming its forms)",
        f.metadata["choices"],
      )
      listed = set()  # a key of several forms (eps_clip_c) once, under the first
      for form in mis_jax.forms.POLICY_LOSSES.values():
        for fk in dataclasses.fields(form.config):
          if fk.name not in listed:
            listed.add(fk.name)
            row(f"loss.policy_loss.{fk.name}", fk.default, fk.metadata["doc"])
    elif k == "mis":
      row("loss.mis", None, "the MIS keys inline (contract §9), instead of custom_config_path")
    elif k == "correction_fn":
      row(
        "loss.correction_fn",
        None,
        "your correction function, `pkg.mod:fn` with the signature of "
        "`mis_jax.compute_mis_weights` (`--custom-tis-function-path`)",
      )
    elif k not in _FLAGS:
      row(f"loss.{k}", f.default, f.metadata["doc"], f.metadata.get("choices"))
  row("loss.custom_config_path", None, "the MIS YAML file (contract §9; configs/mis.yaml), instead of mis")
  row("loss.preset", None, "a loss preset (configs/presets/*.yaml: flat LossConfig keys) under this section's keys")
  return "\n".join(rows)


def _shown(default) -> str:
  return "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)


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
