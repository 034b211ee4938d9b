"""The RL loop: SGLang rollouts → rewards → advantages → packed batch → jitted step on the
mesh → weight sync → Orbax checkpoints.

One step: sample ``prompts_per_step × n`` completions from the server(s); score them; GRPO
advantages per prompt group (contract §6.1); pack prompt+response into micro-batched rows
(`trainers.training.batch`); recompute old log-probs only when the algorithm needs them (standard and
decoupled PPO); ``ppo_epochs`` calls of the jitted step (`trainers.training.step`: gradients accumulated
over the micro-batches with global denominators, contract §7, and the Optax update in one
program); push the new weights every ``sync_every`` steps (contract §11); checkpoint every
``checkpoint.every`` steps. Parameters, optimiser state and the batch live on the mesh of the
``parallel`` section (`trainers.training.parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import threading
import time
import urllib.parse
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import mis_jax
from trainers.models import DTYPES, PRESETS, ModelConfig, checkpoint_dir_problem, init_checkpoint, load_hf_params
from trainers.tasks import make_task
from trainers.training import checkpointing, distributed, parallel, rollout_records
from trainers.training.batch import StepBatch, build_step_batch
from trainers.training.config import ModelSection, TrainConfig
from trainers.training.metric_logging import MetricLogger
from trainers.training.rollout import RolloutResult, RoutingSpec, Sample, ServerError, SGLangClient
from trainers.training.step import ModelInputs, StepFunctions, build_step_functions
from trainers.training.weight_sync import save_hf_sharded


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


def sampling_replay_width(r) -> int:
  """The support width of sampling-mask replay for the `rollout` section (0: off), checked.

  Sampling is truncated when it is not greedy and top-k, top-p or min-p cuts the vocabulary.
  `auto` replays exactly then, `on` always (it needs truncated, non-greedy sampling), `off`
  never (with a warning when sampling is truncated: the IS ratio is then biased by the kept
  mass). SGLang returns masks only for a finite `top_k` no larger than its
  `--sampling-mask-max-tokens`: `top_k` is the static support width of every step."""
  truncated = r.temperature > 0 and (r.top_p < 1 or r.top_k > 0 or r.min_p > 0)
  mode = r.sampling_replay
  if mode == "off" or (mode == "auto" and not truncated):
    if truncated:
      warnings.warn("rollout.sampling_replay is off with truncated sampling (top_p < 1, top_k > 0 or min_p > 0): "
                    "the server's log-probs are over the whole vocabulary while it samples from the truncated "
                    "distribution, so the IS ratio is biased by the kept mass (contract §11)")
    return 0
  if r.temperature == 0:
    raise mis_jax.ConfigError("rollout.sampling_replay on with greedy sampling (rollout.temperature 0): every "
                              "renormalised log-prob is 0 and nothing is learned; use temperature > 0 or "
                              "sampling_replay: off")
  if r.top_k < 1:
    what = "untruncated sampling" if not truncated else f"rollout.top_p {r.top_p}, min_p {r.min_p}"
    raise mis_jax.ConfigError(
        f"rollout.sampling_replay {mode} ({what}) needs a finite rollout.top_k: SGLang returns sampling masks "
        f"only for 1 < top_k <= --sampling-mask-max-tokens, and top_k bounds the replayed support; set e.g. "
        f"rollout.top_k: 50, or rollout.sampling_replay: off")
  if r.top_k > r.sampling_mask_max_tokens:
    raise mis_jax.ConfigError(f"rollout.top_k {r.top_k} exceeds rollout.sampling_mask_max_tokens "
                              f"{r.sampling_mask_max_tokens}: the replayed support would not fit; lower top_k or "
                              "raise sampling_mask_max_tokens (and the server's --sampling-mask-max-tokens)")
  return r.top_k


def routing_setup(r, model_cfg: ModelConfig) -> tuple[str, RoutingSpec | None]:
  """`(routing_replay, spec)` of the `rollout` section for this model, checked: `spec` (what the
  server's routed experts must look like) when they are asked for — with `r3`, or with
  `record_routing` for the routing-mismatch metrics — else None."""
  record = r.routing_replay == "r3" if r.record_routing is None else r.record_routing
  if r.routing_replay == "r3" and not record:
    raise mis_jax.ConfigError("rollout.routing_replay r3 replays the server's routed experts: "
                              "rollout.record_routing cannot be false with it")
  if (r.routing_replay != "none" or record) and not model_cfg.is_moe:
    what = f"rollout.routing_replay {r.routing_replay}" if r.routing_replay != "none" else "rollout.record_routing"
    raise mis_jax.ConfigError(f"{what} needs a mixture-of-experts model; {model_cfg.model_type} is dense (set "
                              "rollout.routing_replay: none, rollout.record_routing: null)")
  spec = (RoutingSpec(model_cfg.num_hidden_layers, model_cfg.num_experts_per_tok, model_cfg.num_experts)
          if record else None)
  return r.routing_replay, spec


def routing_metrics(native: np.ndarray, recorded: np.ndarray) -> dict[str, float]:
  """Routing mismatch between the trainer's native top-k and the rollout's, over the positions
  with a record (`recorded[..., 0, 0] >= 0`); both `[..., num_layers, k]`. Experts are compared
  as sets: `routing_mismatch_frac` over (token, layer) choices, `routing_mismatch_token_frac`
  over tokens (any layer differs), and `routing_mismatch_layer/{l}` per layer."""
  has = recorded[..., 0, 0] >= 0
  a, b = np.sort(native[has], axis=-1), np.sort(recorded[has], axis=-1)  # [n, L, k]
  differ = np.any(a != b, axis=-1)  # [n, L]
  out = {"routing_mismatch_frac": float(differ.mean()) if differ.size else 0.0,
         "routing_mismatch_token_frac": float(differ.any(axis=-1).mean()) if differ.size else 0.0,
         "routing_positions": float(has.sum())}
  for layer in range(native.shape[-2]):
    out[f"routing_mismatch_layer/{layer}"] = float(differ[:, layer].mean()) if differ.size else 0.0
  return out


# The mismatch sanity check's limits (mean |Δ log p| over response tokens, mis_k3_kl) when server
# and trainer hold the same weights. Measured on the tiny models (docs/guides/trainer.md): float32 on both sides
# 3e-7 / 0; bf16 engine 7e-3–1.2e-2 / 4e-5–7e-4; fp8 weights 5e-2–6e-2 / 2e-3–4e-3; a batch
# garbled by sglang-jax's overlap scheduler 1.78 / 1.23; log-probs shifted by one token ~2 / ~1.
MISMATCH_LIMITS = {"float32": (1e-3, 1e-4), "low": (0.25, 0.1)}


class TrainingError(RuntimeError):
  """The run stopped cleanly: the message says why; the last checkpoint is intact."""


class Trainer:
  """Owns the policy, the optimiser, the server client and the run directory."""

  def __init__(self, cfg: TrainConfig, loss_cfg: mis_jax.LossConfig, *, urls: list[str], devices=None,
               task=None):
    """``task``: the task :func:`check_config` returned for these configs (else checked here)."""
    self.cfg, self.loss_cfg = cfg, loss_cfg
    self.task = task if task is not None else check_config(cfg, loss_cfg)
    self.mesh = check_parallel(cfg, devices)
    self.run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    r = cfg.rollout
    self.temperature = r.temperature if r.temperature > 0 else 1.0  # greedy: SGLang reports T=1
    self.support_width = sampling_replay_width(r)  # 0: no sampling-mask replay

    weights = self.start_dir = initial_weights_dir(cfg)  # collective: every process, here
    model_cfg = self.model_config = ModelConfig.from_pretrained(weights)
    self.routing_replay, self.routing_spec = routing_setup(r, model_cfg)
    self.max_new_tokens = r.max_new_tokens or getattr(self.task, "max_new_tokens", None) or 128
    self.fns = _step_functions(model_cfg, cfg.model, loss_cfg, self.temperature, cfg.train, self.mesh)
    self.graphdef = self.fns.graphdef
    # Each device reads its own shards of the HF tensors: no full copy anywhere.
    self.params = load_hf_params(weights, self.fns.abstract_params, self.fns.param_shardings, config=model_cfg)
    self.ref_params = jax.tree_util.tree_map(jnp.copy, self.params) if loss_cfg.kl_coef > 0 else None
    self._logprobs = self.fns.logprobs
    self.opt_state = self.fns.init_opt_state(self.params)
    self.step = 0
    self.num_old_logprob_passes = 0  # bypass and REINFORCE-IS never recompute (tested)
    self.primary = distributed.is_primary()  # owns the HTTP client and the logs
    self.replay = r.load_dir  # train from saved rollout records: no server at all
    self.asynchronous = r.max_staleness > 0 and not self.replay  # a replay is always synchronous
    self.client = (SGLangClient(urls, timeout_s=r.timeout_s, max_retries=r.max_retries, backoff_s=r.backoff_s,
                                max_concurrency=r.max_concurrency, prompts_per_request=r.prompts_per_request)
                   if self.primary and not self.replay else None)
    self._old_logprobs = None  # the step's recomputed old log-probs (device), for the records
    self.checkpoints = checkpointing.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                  max_to_keep=cfg.checkpoint.max_to_keep)
    self.num_segments = r.prompts_per_step * r.n
    self.weight_dtype = r.weight_dtype or r.server_dtype  # refined from the servers' /server_info at start
    self.server_dtype, self.server_quantized = r.server_dtype, r.server_quantize != "none"
    self.served_version = 0  # the step whose weights the servers hold (the trainer's bookkeeping)
    self._warned_versions = False
    self.batch_index = 0  # rollout batches consumed (= step, unless a stale batch was skipped)
    self.sync_times: dict[str, float] = {}

  def _primary(self, fn):
    """`fn()` on process 0, its result (or its failure, as TrainingError) on every process."""
    try:
      return distributed.on_primary(fn, errors=(TrainingError, ServerError))
    except distributed.PrimaryError as e:
      raise TrainingError(str(e)) from None

  # --- one step ------------------------------------------------------------------------
  def sampling_params(self) -> dict:
    r = self.cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.task.stop_token_ids), "no_stop_trim": True, "skip_special_tokens": False}

  def prompts(self, batch: int) -> list:
    """The prompts of rollout batch `batch` (a function of (seed, batch) only)."""
    return self.task.prompts(self.cfg.seed, batch, self.cfg.rollout.prompts_per_step)

  def generate(self, batch: int) -> RolloutResult:
    """Rollout batch `batch` from the servers (process 0): its prompts and per-sample seeds
    depend on (seed, batch) only."""
    version = self.served_version
    result = self.client.generate([p.ids for p in self.prompts(batch)], self.sampling_params(), n=self.cfg.rollout.n,
                                  seed=self.cfg.seed * 100_003 + batch, support_width=self.support_width,
                                  routing=self.routing_spec)
    return self._own_versions(result, version)

  def check_rollout(self, result: RolloutResult) -> RolloutResult:
    r = self.cfg.rollout
    bad = result.num_rejected / max(result.num_requested, 1)
    if bad > r.max_rejected_fraction:
      reasons = "; ".join(sorted(set(result.rejection_reasons))[:5])
      raise TrainingError(f"step {self.step}: {result.num_rejected} of {result.num_requested} samples were malformed "
                          f"({bad:.0%} > max_rejected_fraction {r.max_rejected_fraction:.0%}): {reasons}")
    if not result.samples:
      raise TrainingError(f"step {self.step}: no usable samples ({result.num_aborted} aborted, "
                          f"{result.num_rejected} rejected)")
    return result

  def rollout(self) -> tuple[list, RolloutResult]:
    """The synchronous rollout of this step, the same on every process."""
    if self.replay:
      return self.replayed_rollout()

    def produce():
      return self.check_rollout(self.generate(self.batch_index)).to_json()
    result = RolloutResult.from_json(self._primary(produce))
    prompts = self.prompts(self.batch_index)
    self.batch_index += 1
    return prompts, result

  def replayed_rollout(self) -> tuple[None, RolloutResult]:
    """Step `step + 1`'s rollouts from the saved records (every process reads them)."""
    cols, _ = rollout_records.read_step(rollout_records.step_path(self.replay, self.step + 1))
    masks = cols.get("sampling_mask") or [None] * len(cols["step"])
    spec = self.routing_spec
    routed = (cols.get("routed_experts") if spec else None) or [None] * len(cols["step"])
    samples = [Sample(prompt_index=int(g), prompt_ids=tuple(p), response_ids=tuple(r), rollout_logprobs=tuple(q),
                      finish_reason=f, text="", weight_version=v,
                      sampling_mask=None if m is None else tuple(tuple(x) for x in m),
                      routed_experts=None if e is None else np.asarray(e, np.int32).reshape(-1, spec.num_layers,
                                                                                           spec.top_k))
               for g, p, r, q, f, v, m, e in zip(cols["group"], cols["prompt_ids"], cols["response_ids"],
                                                   cols["rollout_logprobs"], cols["finish_reason"],
                                                   cols["weight_version"], masks, routed)]
    self.batch_index += 1
    return None, RolloutResult(samples=samples, num_requested=len(samples), rewards=cols["reward"])

  def build_batch(self, prompts, result: RolloutResult) -> StepBatch:
    samples = result.samples
    if result.rewards is not None:  # replayed records carry their rewards
      rewards = np.asarray(result.rewards, np.float32)
    else:
      rewards = np.array([self.task.reward(prompts[s.prompt_index], s.response_ids, s.text) for s in samples],
                         np.float32)
    groups = np.array([s.prompt_index for s in samples], np.int32)
    t = self.cfg.train
    return build_step_batch(samples, rewards, self.advantages(rewards, groups), groups,
                            num_segments=self.num_segments, row_len=t.row_len,
                            tokens_per_micro_batch=t.tokens_per_micro_batch,
                            batch_devices=parallel.batch_devices(self.mesh), support_width=self.support_width,
                            routing=self.routing_spec)

  def advantages(self, rewards, groups, in_baseline=None) -> np.ndarray:
    return np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=self.cfg.rollout.prompts_per_step,
                                                 estimator=self.cfg.train.advantage_estimator,
                                                 in_baseline=in_baseline))

  def exclude_rejected_from_baseline(self, sb: StepBatch, prepared: mis_jax.PackedBatch):
    """contract §6.1 option: sequences the correction rejects whole leave their group's baseline.

    ``prepared`` comes from :func:`mis_jax.prepare_step` (its ``kept_mask`` is the step's).
    The rejected sequences' own advantage no longer matters (they carry no kept token); the
    others' baseline stops leaking the rejected rewards (verl PR #6452)."""
    in_baseline = np.array([k.any() for k in sb.per_sequence(distributed.to_host(prepared.kept_mask))])
    adv = self.advantages(sb.rewards, sb.groups, in_baseline)
    token_adv = sb.tokens([np.full(n, a, np.float32) for n, a in zip(sb.packing.lengths, adv)], 0.0, np.float32)
    return prepared.replace(advantages=self._on_mesh(token_adv)), int((~in_baseline).sum())

  def _on_mesh(self, x):
    """A host array (the same on every process) on the mesh: each process places only the
    rows of its own devices."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, parallel.batch_sharding(self.mesh, x.ndim), lambda idx: x[idx])

  def device_batch(self, sb: StepBatch) -> tuple[ModelInputs, mis_jax.PackedBatch]:
    """The step batch placed on the mesh (rows over `data × fsdp × expert`)."""
    inputs = ModelInputs(*(self._on_mesh(x) for x in (sb.input_ids, sb.positions, sb.targets)),
                         support=None if sb.support is None else self._on_mesh(sb.support),
                         routing=None if sb.routing is None or self.routing_replay != "r3" else self._on_mesh(sb.routing))
    return inputs, jax.tree.map(self._on_mesh, sb.batch)

  def train_on(self, sb: StepBatch) -> dict:
    inputs, batch = self.device_batch(sb)
    routing = {}
    if self.routing_replay == "r2" or sb.routing is not None:
      # One pass gives the old log-probs (with r3: under the rollout's routing) and the trainer's
      # native routing: the metrics compare it with the rollout's, r2 replays it from here on.
      old, native = self.fns.logprobs_routing(self.params, inputs, batch.segment_ids)
      if sb.routing is not None:
        routing = routing_metrics(distributed.to_host(native), sb.routing)
      if self.loss_cfg.needs_old_logprobs:
        batch = batch.replace(old_logprobs=old)
        self.num_old_logprob_passes += 1
      if self.routing_replay == "r2":
        inputs = inputs._replace(routing=native)
    elif self.loss_cfg.needs_old_logprobs:
      batch = batch.replace(old_logprobs=self._logprobs(self.params, inputs, batch.segment_ids))
      self.num_old_logprob_passes += 1
    self._old_logprobs = batch.old_logprobs
    if self.ref_params is not None:  # the reference model routes natively
      batch = batch.replace(ref_logprobs=self._logprobs(self.ref_params, inputs._replace(routing=None),
                                                        batch.segment_ids))
    # The correction depends only on o and q, fixed for the whole step: prepare it once.
    prepared, dens, step_metrics = self.fns.prepare(batch)
    excluded = None
    if self.cfg.train.exclude_rejected_from_baseline:
      prepared, excluded = self.exclude_rejected_from_baseline(sb, prepared)
    metrics: dict = {}
    for _ in range(self.cfg.train.ppo_epochs):
      self.params, self.opt_state, epoch_metrics = self.fns.train(self.params, self.opt_state, inputs, prepared,
                                                                  dens)
      if not metrics:  # metrics of the first epoch: before any update of this step
        metrics = {name: float(v) for name, v in {**epoch_metrics, **step_metrics}.items()}
    metrics["micro_batches"] = sb.layout.micro_batches
    metrics["sampling_replay"] = float(sb.support is not None)  # log-probs, entropy and KL over the support
    metrics.update(routing)
    if excluded is not None:
      metrics["num_excluded_from_baseline"] = excluded
    if not all(np.isfinite(v) for v in metrics.values()):
      bad = [k for k, v in metrics.items() if not np.isfinite(v)]
      raise TrainingError(f"step {self.step}: non-finite metrics {bad}; stopping before using these weights")
    return metrics

  # --- the servers before step 1 -----------------------------------------------------------
  def server_facts(self) -> dict:
    """What the servers say before training (process 0): whether every one serves the
    trainer's starting weights (`/model_info`'s `model_path` is `model.path`, or the preset's
    initial directory), the dtype the first reports (`/server_info`), and the URLs without a
    weight-update route."""
    start = os.path.realpath(self.start_dir)  # (process 0 only: no collective in here)
    serves_start, dtypes, quantized = True, set(), False
    for url in self.client.urls:
      info = self.client.model_info(url)
      path = info.get("model_path")
      serves_start &= isinstance(path, str) and os.path.realpath(path) == start
      try:
        sinfo = self.client.server_info(url)
      except ServerError:
        sinfo = {}
      dtypes.add(sinfo.get("dtype"))
      quantized |= sinfo.get("quantization") not in (None, "none", "")
    missing = [url for url in self.client.urls if not self.client.has_weight_update_route(url)]
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return {"serves_start": serves_start, "dtype": dtype if dtype in DTYPES else None, "quantized": quantized,
            "missing_update_route": missing}

  def prepare_servers(self, *, resumed: bool, log=print) -> bool:
    """Decides the first weight push (`rollout.initial_sync`) and the pushed dtype, and checks
    that every server can load weights when the run will push any. Returns whether to push now.

    `auto` skips the push when the run is not resumed and every server reports `model.path`
    (or the preset's initial directory) as its `model_path`: it loaded the very checkpoint the
    trainer starts from, so a push would write the same values (cast to the same dtype). A
    resume always pushes (the servers must get the restored weights)."""
    r = self.cfg.rollout
    facts = self._primary(self.server_facts)
    self.server_dtype = facts["dtype"] or r.server_dtype
    self.server_quantized = facts["quantized"] or r.server_quantize != "none"
    self.weight_dtype = r.weight_dtype or self.server_dtype
    push = resumed or r.initial_sync == "always" or (r.initial_sync == "auto" and not facts["serves_start"])
    first_sync = self.step + r.sync_every - self.step % r.sync_every  # the loop's first push
    will_sync = push or first_sync <= self.cfg.train.steps
    if facts["missing_update_route"] and will_sync:
      when = "the resumed weights before step 1" if resumed else (
          "the starting weights before step 1" if push else f"the weights after step {first_sync}")
      raise TrainingError(
          f"{', '.join(facts['missing_update_route'])} has no /update_weights_from_disk route (HTTP 404), so it "
          f"cannot load {when}. Settings that need no weight push: start the server on model.path with "
          f"rollout.initial_sync: auto (or never) and rollout.sync_every > train.steps (every step then trains on "
          f"rollouts of the starting weights: decoupled PPO corrects the growing staleness), or train from records "
          f"(rollout.load_dir)")
    if self.primary:
      if not push:
        log(f"initial weight push skipped (rollout.initial_sync {r.initial_sync}): "
            + ("every server already serves the starting weights" if facts["serves_start"] else "as configured"))
      if facts["missing_update_route"]:
        log(f"{', '.join(facts['missing_update_route'])} cannot load new weights; none will be pushed in "
            f"{self.cfg.train.steps} steps (rollout.sync_every {r.sync_every})")
    return push

  def mismatch_limits(self) -> tuple[float, float, str]:
    """`(max mean |Δ log p|, max mis_k3_kl, what)` for the sanity check, by dtype pair: float32
    on both sides (no quantisation) vs anything lower (`MISMATCH_LIMITS`)."""
    exact = (self.server_dtype == "float32" and not self.server_quantized and self.weight_dtype == "float32"
             and self.cfg.model.dtype == "float32")
    key = "float32" if exact else "low"
    pair = (f"server {self.server_dtype}{' quantised' if self.server_quantized else ''}, trainer "
            f"{self.cfg.model.dtype}")
    return (*MISMATCH_LIMITS[key], pair)

  def check_mismatch(self, metrics: dict, result: RolloutResult) -> None:
    """When the servers held the trainer's weights for this step's samples (all fresh), a
    mismatch far beyond numerics stops the run before anything is saved or pushed."""
    if not self.cfg.rollout.mismatch_check or self.replay:
      return
    if self.served_version != self.step or any(s.oldest_version != str(self.step) for s in result.samples):
      return
    max_abs, max_k3, pair = self.mismatch_limits()
    diff, k3 = metrics.get("train_rollout_logprob_abs_diff"), metrics.get("mis_k3_kl")
    if diff is None or k3 is None or (diff <= max_abs and k3 <= max_k3):
      return
    raise TrainingError(
        f"step {self.step + 1}: the server and the trainer hold the same weights, yet their log-probs differ far "
        f"beyond numerics: mean |Δ log p| {diff:.3g} (limit {max_abs:g}), mis_k3_kl {k3:.3g} (limit {max_k3:g}) for "
        f"{pair}. Likely causes: the server runs another model or tokenizer than model.path, or an engine bug that "
        f"garbles batches (e.g. sglang-jax's overlap scheduler: start it with --disable-overlap-schedule). Nothing "
        f"of this step was saved or pushed; set rollout.mismatch_check: false to train anyway")

  def _own_versions(self, result: RolloutResult, version: int) -> RolloutResult:
    """Samples whose server reports no usable weight version (none, or not a step number such as
    SGLang's "default") get the trainer's own bookkeeping: `version`, the last it pushed."""
    bad = [s for s in result.samples if not str(s.weight_version).isdigit()]
    if not bad:
      return result
    if not self._warned_versions:
      self._warned_versions = True
      warnings.warn(f"the server's replies carry no usable weight_version ({bad[0].weight_version!r}): using the "
                    f"trainer's own bookkeeping (the version it last pushed)")
    own = str(version)
    samples = [dataclasses.replace(s, weight_version=own, weight_versions=tuple((own, a, b) for _, a, b in
                                                                                 s.weight_versions))
               if not str(s.weight_version).isdigit() else s for s in result.samples]
    return dataclasses.replace(result, samples=samples)

  # --- weights, checkpoints --------------------------------------------------------------
  def sync_weights(self):
    """Every process writes its share of the sharded HF checkpoint (`save_hf_sharded`), then
    process 0 updates all servers concurrently. Phase times land in `self.sync_times`. A replay
    from records has no server: nothing to sync."""
    if self.replay:
      self.sync_times = {}
      return
    path = os.path.join(self.run_dir, "weights", f"step_{self.step}")
    times = save_hf_sharded(self.params, self.model_config, path, dtype=self.weight_dtype)

    def update():
      try:
        return self.client.update_weights_from_disk(path, str(self.step), pause_mode=self.cfg.rollout.pause_mode)
      except ServerError as e:
        raise TrainingError(f"weight sync at step {self.step} failed: {e}") from None
    times.update(self._primary(update))
    self.served_version = self.step
    self.sync_times = {f"sync/{k}": v for k, v in times.items()}
    if self.primary:  # keep the newest few weight directories (the servers may still read the current one)
      root = os.path.join(self.run_dir, "weights")
      old = sorted((d for d in os.listdir(root) if d.startswith("step_")), key=lambda d: int(d[5:]))[:-2]
      for d in old:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)

  def save_records(self, sb: StepBatch, result: RolloutResult, prompts) -> None:
    """This step's rollouts as `rollout.save_dir/step_NNNNNN.parquet` (rollout_records), written
    by process 0 (every process gathers the old log-probs with it)."""
    old = None
    if self._old_logprobs is not None:
      responses = [len(s.response_ids) for s in result.samples]
      old = [seq[-n:].tolist() for seq, n in zip(sb.per_sequence(distributed.to_host(self._old_logprobs)), responses)]
    if not self.primary:
      return
    samples = result.samples
    columns = {
        "step": [self.step] * len(samples), "sample": list(range(len(samples))),
        "group": [s.prompt_index for s in samples], "prompt_ids": [list(s.prompt_ids) for s in samples],
        "response_ids": [list(s.response_ids) for s in samples],
        "rollout_logprobs": [list(s.rollout_logprobs) for s in samples], "reward": sb.rewards.tolist(),
        "advantage": sb.advantages.tolist(),
        "finish_reason": [s.finish_reason for s in samples],
        "weight_version": [str(s.weight_version) for s in samples],
    }
    if old is not None:
      columns["old_logprobs"] = old
    if self.support_width:
      columns["sampling_mask"] = [[list(m) for m in s.sampling_mask] for s in samples]
    if self.routing_spec is not None:
      columns["routed_experts"] = [s.routed_experts.reshape(-1).tolist() for s in samples]
    meta = {"sampling_params": self.sampling_params() if prompts is not None else None,
            "batch_index": self.batch_index - 1, "temperature": self.temperature,
            "config": dataclasses.asdict(self.cfg), "loss": self.loss_cfg.to_dict()}
    rollout_records.write_step(self.cfg.rollout.save_dir, self.step, columns, meta)

  def save_checkpoint(self):
    self.checkpoints.save(self.step, {"params": self.params, "opt_state": self.opt_state},
                          {"step": self.step, "seed": self.cfg.seed, "num_old_logprob_passes": self.num_old_logprob_passes,
                           "batch_index": self.batch_index})

  def restore_latest(self) -> bool:
    restored = self.checkpoints.restore_latest({"params": self.params, "opt_state": self.opt_state})
    if restored is None:
      return False
    state, meta = restored
    self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(meta["step"])
    self.batch_index = int(meta.get("batch_index", self.step))
    return True

  # --- asynchronous rollouts ------------------------------------------------------------
  def stale_filtered(self, result: RolloutResult) -> tuple[RolloutResult, dict]:
    """Drops samples generated more than `max_staleness` versions before this step; returns
    the kept result and the staleness metrics."""
    k = self.cfg.rollout.max_staleness
    staleness = [self.step - int(s.oldest_version) for s in result.samples]
    kept = [s for s, st in zip(result.samples, staleness) if st <= k]
    shown = [st for st in staleness if st <= k] or [0]
    metrics = {"rollout/staleness_mean": float(np.mean(shown)), "rollout/staleness_max": float(max(shown)),
               "rollout/dropped_stale": len(result.samples) - len(kept)}
    return dataclasses.replace(result, samples=kept), metrics

  def async_rollout(self, producer: "RolloutProducer") -> tuple[list, RolloutResult, dict]:
    """The next batch from the producer (process 0), stale samples dropped, on every process."""
    def produce():
      dropped, batch = 0, self.batch_index
      for _ in range(8):  # a batch left with nothing fresh is skipped, a bounded number of times
        batch, result, waited = producer.take(batch)
        result, metrics = self.stale_filtered(result)
        dropped += metrics["rollout/dropped_stale"]
        if result.samples:
          metrics.update({"rollout/dropped_stale": dropped, "rollout/wait_s": waited, "batch": batch})
          return {"result": self.check_rollout(result).to_json(), "metrics": metrics}
        batch += 1
      raise TrainingError(f"step {self.step}: 8 rollout batches in a row had no sample within "
                          f"max_staleness {self.cfg.rollout.max_staleness}")
    out = self._primary(produce)
    metrics = out["metrics"]
    batch = metrics.pop("batch")
    self.batch_index = batch + 1
    return self.prompts(batch), RolloutResult.from_json(out["result"]), metrics

  # --- the loop --------------------------------------------------------------------------
  def run(self, *, resume: bool = False, progress: bool = True, log=print) -> list[dict]:
    if resume and self.restore_latest():
      if self.primary:
        log(f"resumed from checkpoint at step {self.step} ({self.checkpoints.directory})")
    elif self.checkpoints.latest_step() is not None:
      raise TrainingError(f"{self.run_dir} already holds checkpoints (latest step "
                          f"{self.checkpoints.latest_step()}): pass --resume, or choose another run_dir")
    r = self.cfg.rollout
    if self.primary and self.replay:
      log(f"replaying rollout records from {self.replay} (no server)")
    if self.primary and self.routing_spec is not None:
      what = {"r3": "replayed (R3) in the old-log-prob pass and every training forward", "r2": "compared with the "
              "trainer's; the trainer's old-pass routing is replayed (R2)", "none": "compared with the trainer's"}
      log(f"routed experts from the server: {what[self.routing_replay]}")
    elif self.primary and self.routing_replay == "r2":
      log("routing replay R2: the old-log-prob pass's routing is replayed in every training forward")
    if self.primary and self.support_width:
      log(f"sampling replay on (top_k {r.top_k}, top_p {r.top_p}, min_p {r.min_p}): behaviour log-probs from the "
          "server's sampling masks; log-probs, entropy and KL over each token's support")
    if not self.replay:
      self._primary(lambda: self.client.wait_until_healthy(attempts=r.health_attempts, backoff_s=r.backoff_s))
      if self.routing_spec is not None:  # a server without routed experts is found before any step
        self._primary(lambda: self.client.check_routed_experts(self.routing_spec))
      if self.support_width:  # so is one without sampling masks
        self._primary(lambda: self.client.check_sampling_masks(self.sampling_params(), self.support_width))
      push = self.prepare_servers(resumed=self.step > 0, log=log)
    else:
      push = False
    if push:
      self.sync_weights()  # the servers now hold exactly the trainer's weights (version = step)
    self.served_version = self.step
    producer = RolloutProducer(self, self.batch_index) if (self.asynchronous and self.primary) else None
    history = []
    logger = (MetricLogger(self.run_dir, self.cfg.logging, total_steps=self.cfg.train.steps, initial_step=self.step,
                           progress=progress) if self.primary else None)
    try:
      while self.step < self.cfg.train.steps:
        t0 = time.perf_counter()
        if self.asynchronous:
          prompts, result, rollout_metrics = self.async_rollout(producer)
        else:
          prompts, result = self.rollout()
          rollout_metrics = {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/dropped_stale": 0}
        t1 = time.perf_counter()
        sb = self.build_batch(prompts, result)
        metrics = self.train_on(sb)
        self.check_mismatch(metrics, result)
        t2 = time.perf_counter()
        self.step += 1
        if r.save_dir:
          self.save_records(sb, result, prompts)
        sync_times = {}
        if self.step % r.sync_every == 0:
          self.sync_weights()
          sync_times = self.sync_times
        t3 = time.perf_counter()
        if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.train.steps:
          self.save_checkpoint()
        trained = int(np.asarray(sb.batch.loss_mask).sum())
        metrics.update({
            "step": self.step, "reward_mean": float(sb.rewards.mean()), "reward_std": float(sb.rewards.std()),
            "response_length": float(sb.response_lengths.mean()), "num_samples": len(result.samples),
            "num_aborted": result.num_aborted, "num_rejected": result.num_rejected,
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
            "tokens_per_s": trained / max(t3 - t0, 1e-9),
            "server_weight_version": result.samples[0].weight_version, **rollout_metrics, **sync_times,
        })
        history.append(metrics)
        if logger is not None:
          logger.log(self.step, metrics)
    finally:
      if logger is not None:
        logger.close()
      if producer is not None:
        producer.close()
      self.checkpoints.close()  # waits for an in-flight async save: the last checkpoint is whole
      if self.client is not None:
        self.client.close()
    return history


class RolloutProducer:
  """Process 0's rollout thread for the asynchronous loop (`rollout.max_staleness = k > 0`).

  It generates batch `j` as soon as the trainer has taken batch `j - k` (so at most `k + 1`
  batches are ahead of training, a bounded buffer) with whatever weights the servers hold;
  each sample carries the server's `weight_version`, and the trainer drops those more than
  `k` versions old. A weight sync pauses the servers (`rollout.pause_mode`); requests in
  flight resume or come back aborted (dropped and counted). A failure is handed to the
  trainer at the batch it hit.
  """

  def __init__(self, trainer: Trainer, first_batch: int):
    self.trainer, self.k = trainer, trainer.cfg.rollout.max_staleness
    self._cv = threading.Condition()
    self._ready: dict[int, tuple[RolloutResult | None, BaseException | None]] = {}
    self._taken = first_batch  # batches the trainer has taken
    self._stop = False
    self._thread = threading.Thread(target=self._loop, args=(first_batch,), name="rollout-producer", daemon=True)
    self._thread.start()

  def _loop(self, batch: int):
    while True:
      with self._cv:
        while not self._stop and batch >= self._taken + self.k:
          self._cv.wait()
        if self._stop:
          return
      try:
        result, error = self.trainer.generate(batch), None
      except BaseException as e:  # noqa: BLE001 - handed to the trainer
        result, error = None, e
      with self._cv:
        self._ready[batch] = (result, error)
        self._cv.notify_all()
      if error is not None:
        return
      batch += 1

  def take(self, batch: int) -> tuple[int, RolloutResult, float]:
    """Batch `batch` (waiting for it); returns `(batch, result, seconds waited)`."""
    start = time.perf_counter()
    with self._cv:
      while batch not in self._ready:
        if not self._thread.is_alive() and batch not in self._ready:
          raise TrainingError(f"the rollout producer stopped before batch {batch}")
        self._cv.wait(timeout=1.0)
      result, error = self._ready.pop(batch)
      self._taken = batch + 1
      self._cv.notify_all()
    if error is not None:
      if isinstance(error, (TrainingError, ServerError)):
        raise TrainingError(f"rollout batch {batch}: {error}")
      raise error
    return batch, result, time.perf_counter() - start

  def close(self) -> None:
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    self._thread.join(timeout=self.trainer.cfg.rollout.timeout_s + 5)


def check_config(cfg: TrainConfig, loss_cfg: mis_jax.LossConfig):
  """Checks that need both configs, the files they name, and the task, before anything is
  built or started: a `ConfigError` naming the key and the value. Sequences that would not fit
  a row are an error. Returns the task (built to check it)."""
  if cfg.train.exclude_rejected_from_baseline and (loss_cfg.algorithm != "decoupled_ppo" or loss_cfg.mis is None):
    raise mis_jax.ConfigError("train.exclude_rejected_from_baseline needs decoupled PPO with a MIS config "
                              "(use_tis: true, use_rollout_logprobs: false, a mis section): the rejection "
                              "must be known before the step")
  r = cfg.rollout
  sampling_replay_width(r)
  model_cfg = _model_config(cfg)  # config.json read once
  routing_setup(r, model_cfg)
  if cfg.train.router_aux_loss_coef > 0 and not model_cfg.is_moe:
    raise mis_jax.ConfigError("train.router_aux_loss_coef is for mixture-of-experts models; this one is dense")
  if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
    raise mis_jax.ConfigError("logging.wandb is true but wandb is not installed: pip install wandb, or set "
                              "logging.wandb: false")
  if r.max_staleness > 0 and r.sync_every != 1:
    raise mis_jax.ConfigError(f"rollout.max_staleness {r.max_staleness} with rollout.sync_every {r.sync_every}: "
                              "the asynchronous loop pushes weights every step and bounds the lag by "
                              "max_staleness; set sync_every to 1")
  if r.max_staleness > 0 and loss_cfg.algorithm != "decoupled_ppo":
    warnings.warn(f"rollout.max_staleness {r.max_staleness} with {loss_cfg.algorithm}: only decoupled PPO "
                  "(old log-probs recomputed, behaviour = the server's) corrects for stale rollouts; "
                  "see docs/guides/multihost.md, asynchronous rollouts")
  if os.path.isfile(cfg.run_dir):
    raise mis_jax.ConfigError(f"run_dir {cfg.run_dir!r} is a file; it must be a directory (or not exist yet)")
  try:
    task = make_task(cfg.task, vocab_size=model_cfg.vocab_size, model_path=cfg.model.path)
  except (ValueError, TypeError, FileNotFoundError) as e:  # they name the key, file, row and column
    raise mis_jax.ConfigError(f"task ({cfg.task.name}): {e}") from None
  if r.load_dir:
    check_records(cfg, model_cfg)
  max_new = cfg.rollout.max_new_tokens or getattr(task, "max_new_tokens", None) or 128
  longest = getattr(task, "max_prompt_len", None)
  if longest is not None and longest + max_new - 1 > cfg.train.row_len:
    raise mis_jax.ConfigError(
        f"train.row_len ({cfg.train.row_len}) is shorter than the longest prompt ({longest} tokens) + "
        f"max_new_tokens ({max_new}) - 1: such a sequence could not be packed; raise train.row_len to "
        f">= {longest + max_new - 1} or lower rollout.max_new_tokens")
  return task


def check_records(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
  """Every record file a replay will read exists and fits the model and the config (a
  `ConfigError` naming the file and the column otherwise), before anything is trained."""
  r = cfg.rollout
  if r.save_dir and os.path.abspath(r.save_dir) == os.path.abspath(r.load_dir):
    raise mis_jax.ConfigError(f"rollout.save_dir and rollout.load_dir are the same directory {r.load_dir!r}")
  try:
    steps = rollout_records.list_steps(r.load_dir)
    missing = [k for k in range(1, cfg.train.steps + 1) if k not in steps]
    if missing:
      raise rollout_records.RecordError(
          f"rollout records {r.load_dir!r} have no {os.path.basename(rollout_records.step_path(r.load_dir, missing[0]))} "
          f"(they cover steps {min(steps)}..{max(steps)}); lower train.steps to {missing[0] - 1} or less")
    _, spec = routing_setup(r, model_cfg)
    for k in range(1, cfg.train.steps + 1):
      cols, _ = rollout_records.read_step(steps[k])
      rollout_records.check_fits(steps[k], cols, vocab_size=model_cfg.vocab_size, row_len=cfg.train.row_len,
                                 max_samples=r.prompts_per_step * r.n, max_groups=r.prompts_per_step)
      if sampling_replay_width(r) and cols.get("sampling_mask") is None:
        raise rollout_records.RecordError(f"{steps[k]}: missing column 'sampling_mask', which sampling replay "
                                          "needs (set rollout.sampling_replay: off to replay without it)")
      if spec is not None:
        experts = cols.get("routed_experts")
        if experts is None:
          raise rollout_records.RecordError(f"{steps[k]}: missing column 'routed_experts', which routing replay r3 "
                                            "and record_routing need (set rollout.routing_replay: none, "
                                            "record_routing: null)")
        per = spec.num_layers * spec.top_k
        for i, (e, p_ids, r_ids) in enumerate(zip(experts, cols["prompt_ids"], cols["response_ids"])):
          want = (len(p_ids) + len(r_ids) - 1) * per
          if e is None or len(e) != want or (want and not 0 <= min(e) <= max(e) < spec.num_experts):
            raise rollout_records.RecordError(
                f"{steps[k]} row {i}: column 'routed_experts' has {0 if e is None else len(e)} ids, expected "
                f"{want} in [0, {spec.num_experts}) (tokens - 1 rows x num_hidden_layers {spec.num_layers} x "
                f"num_experts_per_tok {spec.top_k})")
  except rollout_records.RecordError as e:
    raise mis_jax.ConfigError(str(e)) from None


def check_url(url: str) -> None:
  """An SGLang base URL: http(s)://HOST[:PORT][/path]."""
  parsed = urllib.parse.urlparse(url)
  try:
    port = parsed.port
  except ValueError:
    port = -1
  if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
    raise mis_jax.ConfigError(f"--sglang-url {url!r} is not a valid server URL; expected http(s)://HOST:PORT")


def _model_config(cfg: TrainConfig) -> ModelConfig:
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
    raise mis_jax.ConfigError(f"model.path {path!r}: config.json is not a supported config (architectures: Qwen2, "
                              f"Qwen3, Qwen3-MoE, Llama): {e}") from None


def check_parallel(cfg: TrainConfig, devices=None) -> jax.sharding.Mesh:
  """The mesh of ``cfg.parallel`` checked against the devices and the model (a `ConfigError`
  otherwise), before any server starts or anything compiles."""
  mesh = parallel.make_mesh(cfg.parallel, devices)
  parallel.check_model(mesh, _model_config(cfg))
  r = cfg.rollout
  if r.prompts_per_step * r.n < parallel.batch_devices(mesh):
    warnings.warn(f"rollout.prompts_per_step x n = {r.prompts_per_step * r.n} sequences for "
                  f"{parallel.batch_devices(mesh)} batch devices (data x fsdp): some devices get only padding")
  return mesh


@functools.lru_cache(maxsize=8)
def _step_functions(model_cfg: ModelConfig, model: ModelSection, loss_cfg: mis_jax.LossConfig,
                    temperature: float, train_cfg, mesh) -> StepFunctions:
  """The jitted step functions, shared by trainers with the same setup (so a resumed or
  repeated run in one process does not compile again)."""
  return build_step_functions(model_cfg, mesh, loss_cfg, train_cfg, temperature=temperature,
                              logprob_chunk=model.logprob_chunk, dtype=DTYPES[model.dtype],
                              param_dtype=DTYPES[model.param_dtype], attention=model.attention,
                              remat=model.remat, **({"moe_dispatch": model.moe_dispatch} if model_cfg.is_moe else {}))


SUMMARY_KEYS = ["reward_mean", "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "entropy_loss",
                "mis_kl", "mis_k3_kl", "train_rollout_logprob_abs_diff", "mis_is_ratio_mean_final",
                "mis_kept_token_fraction", "tokens_per_s", "rollout_s", "train_s", "sync_s"]


def print_summary(history: list[dict], cfg: TrainConfig) -> None:
  if not history:
    print("nothing to do: the run had already reached train.steps")
    return
  rewards = [h["reward_mean"] for h in history]
  k = min(10, len(rewards))
  print(f"\nreward: first {k} steps mean {np.mean(rewards[:k]):.3f} -> last {k} steps mean {np.mean(rewards[-k:]):.3f}")
  last = history[-1]
  print(f"\nmetrics at step {last['step']}:")
  for key in SUMMARY_KEYS:
    if key in last:
      print(f"  {key:34s} {last[key]:.4g}")
  print(f"\nrun directory: {os.path.abspath(cfg.run_dir)} (metrics.jsonl, checkpoints/, weights/)")
