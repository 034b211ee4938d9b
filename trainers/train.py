"""The RL loop: SGLang rollouts → rewards → advantages → packing → mis_jax loss → Optax →
weight sync → Orbax checkpoints.

One step: sample ``prompts_per_step × n`` completions from the server(s); score them; GRPO
advantages per prompt group (SPEC §6.1); pack prompt+response into fixed rows (SPEC §1);
recompute old log-probs only when the algorithm needs them (standard and decoupled PPO);
``ppo_epochs`` optimiser updates, each accumulating gradients over ``micro_batches`` with
global denominators (SPEC §7); push the new weights every ``sync_every`` steps (SPEC §11);
checkpoint every ``checkpoint.every`` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mis_jax
from trainers import checkpointing
from trainers.config import TrainConfig
from trainers.models import init_checkpoint, load_hf_checkpoint, save_hf_checkpoint
from trainers.models.config import PRESETS
from trainers.rollout import RolloutResult, ServerError, SGLangClient
from trainers.tasks import make_task


def initial_weights_dir(cfg: TrainConfig) -> str:
  """The HF directory of the starting weights: ``model.path``, or a preset initialised once
  into ``run_dir/weights/init`` (reused on resume)."""
  if cfg.model.path:
    return cfg.model.path
  path = os.path.join(os.path.abspath(cfg.run_dir), "weights", "init")
  if not os.path.isfile(os.path.join(path, "model.safetensors")):
    config = PRESETS[cfg.model.preset]
    if cfg.model.initializer_range is not None:
      config = dataclasses.replace(config, initializer_range=cfg.model.initializer_range)
    init_checkpoint(path, config=config, seed=cfg.model.init_seed)
  return path


class TrainingError(RuntimeError):
  """The run stopped cleanly: the message says why; the last checkpoint is intact."""


@dataclasses.dataclass
class StepBatch:
  """One step's packed batch plus the model inputs for it."""

  batch: mis_jax.PackedBatch
  input_ids: np.ndarray
  positions: np.ndarray
  targets: np.ndarray
  rewards: np.ndarray
  response_lengths: np.ndarray
  groups: np.ndarray
  packing: mis_jax.Packing


class Trainer:
  """Owns the policy, the optimiser, the server client and the run directory."""

  def __init__(self, cfg: TrainConfig, loss_cfg: mis_jax.LossConfig, *, urls: list[str]):
    self.cfg, self.loss_cfg = cfg, loss_cfg
    if cfg.train.exclude_rejected_from_baseline and (loss_cfg.algorithm != "decoupled_ppo" or loss_cfg.mis is None):
      raise mis_jax.ConfigError("train.exclude_rejected_from_baseline needs decoupled PPO with a MIS config "
                                "(use_tis: true, use_rollout_logprobs: false, a mis section): the rejection "
                                "must be known before the step")
    self.run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    r = cfg.rollout
    self.temperature = r.temperature if r.temperature > 0 else 1.0  # greedy: SGLang reports T=1
    if r.top_p < 1 or r.top_k > 0:
      warnings.warn("top_p < 1 or top_k > 0: the server's log-probs are not renormalised for the "
                    "truncated distribution, so the IS ratio is biased (SPEC §11)")

    self.policy = load_hf_checkpoint(initial_weights_dir(cfg))
    self.task = make_task(cfg.task, vocab_size=self.policy.config.vocab_size, model_path=cfg.model.path)
    self.max_new_tokens = r.max_new_tokens or getattr(self.task, "max_new_tokens", None) or 128
    self.graphdef, params = nnx.split(self.policy)
    self.params = params
    self.ref_params = jax.tree_util.tree_map(jnp.copy, params) if loss_cfg.kl_coef > 0 else None
    self._build_functions()
    self.opt_state = self.optimizer.init(params)
    self.step = 0
    self.num_old_logprob_passes = 0  # bypass and REINFORCE-IS never recompute (tested)
    self.client = SGLangClient(urls, timeout_s=r.timeout_s, max_retries=r.max_retries, backoff_s=r.backoff_s,
                               max_concurrency=r.max_concurrency, prompts_per_request=r.prompts_per_request)
    self.checkpoints = checkpointing.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                  max_to_keep=cfg.checkpoint.max_to_keep)
    self.num_segments = r.prompts_per_step * r.n

  # --- model functions (jitted once; shapes are bucketed) --------------------------------
  def _build_functions(self):
    fns = _compiled_functions(self.graphdef, self.loss_cfg, self.temperature, self.cfg.train)
    self.optimizer = fns["optimizer"]
    self._logprobs, self._grad, self._apply = fns["logprobs"], fns["grad"], fns["apply"]

  # --- one step ------------------------------------------------------------------------
  def rollout(self) -> tuple[list, RolloutResult]:
    r = self.cfg.rollout
    prompts = self.task.prompts(self.cfg.seed, self.step, r.prompts_per_step)
    params = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": self.max_new_tokens,
              "stop_token_ids": list(self.task.stop_token_ids), "no_stop_trim": True, "skip_special_tokens": False}
    result = self.client.generate([p.ids for p in prompts], params, n=r.n, seed=self.cfg.seed * 100_003 + self.step)
    bad = result.num_rejected / max(result.num_requested, 1)
    if bad > r.max_rejected_fraction:
      reasons = "; ".join(sorted(set(result.rejection_reasons))[:5])
      raise TrainingError(f"step {self.step}: {result.num_rejected} of {result.num_requested} samples were malformed "
                          f"({bad:.0%} > max_rejected_fraction {r.max_rejected_fraction:.0%}): {reasons}")
    if not result.samples:
      raise TrainingError(f"step {self.step}: no usable samples ({result.num_aborted} aborted, "
                          f"{result.num_rejected} rejected)")
    return prompts, result

  def build_batch(self, prompts, result: RolloutResult) -> StepBatch:
    t = self.cfg.train
    samples = result.samples
    rewards = np.array([self.task.reward(prompts[s.prompt_index], s.response_ids, s.text) for s in samples],
                       np.float32)
    groups = np.array([s.prompt_index for s in samples], np.int32)
    adv = self.advantages(rewards, groups)
    # Sequence = prompt + response; the model sees seq[:-1] and predicts seq[1:]; response token
    # j sits at input position len(prompt) - 1 + j.
    inputs, targets, masks, q, advs = [], [], [], [], []
    for s, a in zip(samples, adv):
      seq = np.array(s.prompt_ids + s.response_ids, np.int32)
      n_prompt = len(s.prompt_ids)
      inputs.append(seq[:-1])
      targets.append(seq[1:])
      m = np.arange(len(seq) - 1) >= n_prompt - 1
      masks.append(m)
      lp = np.zeros(len(seq) - 1, np.float32)
      lp[m] = s.rollout_logprobs
      q.append(lp)
      advs.append(np.full(len(seq) - 1, a, np.float32))
    lengths = [len(x) for x in inputs]
    needed = mis_jax.plan_packing(lengths, t.row_len).num_rows
    rows = max(2 ** math.ceil(math.log2(needed)), t.micro_batches)  # bucketed: few compilations
    rows = -(-rows // t.micro_batches) * t.micro_batches
    packing = mis_jax.plan_packing(lengths, t.row_len, num_rows=rows)
    batch = mis_jax.PackedBatch(
        segment_ids=packing.segment_ids, loss_mask=packing.pack(masks, False, bool),
        advantages=packing.pack(advs, 0.0, np.float32), rollout_logprobs=packing.pack(q, 0.0, np.float32),
        num_segments=self.num_segments)
    return StepBatch(batch=batch, input_ids=packing.pack(inputs, 0, np.int32), positions=packing.positions,
                     targets=packing.pack(targets, 0, np.int32), rewards=rewards,
                     response_lengths=np.array([len(s.response_ids) for s in samples]), groups=groups,
                     packing=packing)

  def advantages(self, rewards, groups, in_baseline=None) -> np.ndarray:
    return np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=self.cfg.rollout.prompts_per_step,
                                                 estimator=self.cfg.train.advantage_estimator,
                                                 in_baseline=in_baseline))

  def exclude_rejected_from_baseline(self, sb: StepBatch, prepared: mis_jax.PackedBatch):
    """SPEC §6.1 option: sequences the correction rejects whole leave their group's baseline.

    ``prepared`` comes from :func:`mis_jax.prepare_step` (its ``kept_mask`` is the step's).
    The rejected sequences' own advantage no longer matters (they carry no kept token); the
    others' baseline stops leaking the rejected rewards (verl PR #6452)."""
    per_seq = sb.packing.unpack(np.asarray(prepared.kept_mask))
    in_baseline = np.array([k.any() for k in per_seq])
    adv = self.advantages(sb.rewards, sb.groups, in_baseline)
    token_adv = sb.packing.pack([np.full(n, a, np.float32) for n, a in zip(sb.packing.lengths, adv)], 0.0, np.float32)
    return prepared.replace(advantages=token_adv), int((~in_baseline).sum())

  def model_logprobs(self, params, sb: StepBatch) -> np.ndarray:
    """Teacher-forced log-probs of the whole batch, one micro-batch at a time."""
    parts = []
    k = self.cfg.train.micro_batches
    for ids, pos, seg, tgt in zip(*(np.split(x, k) for x in (sb.input_ids, sb.positions, sb.batch.segment_ids,
                                                             sb.targets))):
      parts.append(np.asarray(self._logprobs(params, ids, pos, seg, tgt)))
    return np.concatenate(parts)

  def train_on(self, sb: StepBatch) -> dict:
    batch = sb.batch
    if self.loss_cfg.needs_old_logprobs:
      batch = batch.replace(old_logprobs=self.model_logprobs(self.params, sb))
      self.num_old_logprob_passes += 1
    if self.ref_params is not None:
      batch = batch.replace(ref_logprobs=self.model_logprobs(self.ref_params, sb))
    # The correction depends only on o and q, fixed for the whole step: prepare it once.
    prepared, dens, step_metrics = mis_jax.prepare_step(batch, self.loss_cfg)
    excluded = None
    if self.cfg.train.exclude_rejected_from_baseline:
      prepared, excluded = self.exclude_rejected_from_baseline(sb, prepared)
    k = self.cfg.train.micro_batches
    micro = mis_jax.split_microbatches(prepared, k)
    inputs = list(zip(*(np.split(x, k) for x in (sb.input_ids, sb.positions, sb.targets))))
    metrics: dict[str, Any] = {}
    for _ in range(self.cfg.train.ppo_epochs):
      grads, mb_metrics = None, []
      for mb, (ids, pos, tgt) in zip(micro, inputs):
        g, m = self._grad(self.params, ids, pos, tgt, mb, dens)
        grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        mb_metrics.append(m)
      self.params, self.opt_state, grad_norm = self._apply(self.params, self.opt_state, grads)
      if not metrics:  # metrics of the first epoch: before any update of this step
        metrics = _combine(mb_metrics)
        metrics.update({name: float(v) for name, v in step_metrics.items()})
        metrics["grad_norm"] = float(grad_norm)
    if excluded is not None:
      metrics["num_excluded_from_baseline"] = excluded
    if not all(np.isfinite(v) for v in metrics.values()):
      bad = [k for k, v in metrics.items() if not np.isfinite(v)]
      raise TrainingError(f"step {self.step}: non-finite metrics {bad}; stopping before using these weights")
    return metrics

  # --- weights, checkpoints --------------------------------------------------------------
  def sync_weights(self):
    path = os.path.join(self.run_dir, "weights", f"step_{self.step}")
    save_hf_checkpoint(nnx.merge(self.graphdef, self.params), path)
    try:
      self.client.update_weights_from_disk(path, str(self.step))
    except ServerError as e:
      raise TrainingError(f"weight sync at step {self.step} failed: {e}") from None
    # Keep the newest few weight directories (the server may still read the current one).
    root = os.path.join(self.run_dir, "weights")
    old = sorted((d for d in os.listdir(root) if d.startswith("step_")), key=lambda d: int(d[5:]))[:-2]
    for d in old:
      shutil.rmtree(os.path.join(root, d), ignore_errors=True)

  def save_checkpoint(self):
    self.checkpoints.save(self.step, {"params": self.params, "opt_state": self.opt_state},
                          {"step": self.step, "seed": self.cfg.seed, "num_old_logprob_passes": self.num_old_logprob_passes})

  def restore_latest(self) -> bool:
    restored = self.checkpoints.restore_latest({"params": self.params, "opt_state": self.opt_state})
    if restored is None:
      return False
    state, meta = restored
    self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(meta["step"])
    return True

  # --- the loop --------------------------------------------------------------------------
  def run(self, *, resume: bool = False, progress: bool = True, log=print) -> list[dict]:
    from tqdm import tqdm
    if resume and self.restore_latest():
      log(f"resumed from checkpoint at step {self.step} ({self.checkpoints.directory})")
    elif self.checkpoints.latest_step() is not None:
      raise TrainingError(f"{self.run_dir} already holds checkpoints (latest step "
                          f"{self.checkpoints.latest_step()}): pass --resume, or choose another run_dir")
    self.client.wait_until_healthy(attempts=self.cfg.rollout.health_attempts, backoff_s=self.cfg.rollout.backoff_s)
    self.sync_weights()  # the server now holds exactly the trainer's weights (version = step)
    history = []
    metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
    writer = _tensorboard(self.run_dir)
    bar = tqdm(total=self.cfg.train.steps, initial=self.step, disable=not progress, desc="train")
    try:
      while self.step < self.cfg.train.steps:
        t0 = time.perf_counter()
        prompts, result = self.rollout()
        t1 = time.perf_counter()
        sb = self.build_batch(prompts, result)
        metrics = self.train_on(sb)
        t2 = time.perf_counter()
        self.step += 1
        if self.step % self.cfg.rollout.sync_every == 0:
          self.sync_weights()
        t3 = time.perf_counter()
        if self.step % self.cfg.checkpoint.every == 0 or self.step == self.cfg.train.steps:
          self.save_checkpoint()
        trained = int(np.asarray(sb.batch.loss_mask).sum())
        metrics.update({
            "step": self.step, "reward_mean": float(sb.rewards.mean()), "reward_std": float(sb.rewards.std()),
            "response_length": float(sb.response_lengths.mean()), "num_samples": len(result.samples),
            "num_aborted": result.num_aborted, "num_rejected": result.num_rejected,
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
            "tokens_per_s": trained / max(t3 - t0, 1e-9),
            "server_weight_version": result.samples[0].weight_version,
        })
        history.append(metrics)
        with open(metrics_path, "a") as f:
          f.write(json.dumps(metrics) + "\n")
        if writer is not None:
          for k, v in metrics.items():
            if isinstance(v, (int, float)):
              writer.add_scalar(k, v, self.step)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.3f}",
                        kl=f"{metrics.get('mis_k3_kl', float('nan')):.1e}")
    finally:
      bar.close()
      self.checkpoints.close()  # waits for an in-flight async save: the last checkpoint is whole
      self.client.close()
      if writer is not None:
        writer.close()
    return history


@functools.lru_cache(maxsize=8)
def _compiled_functions(graphdef, loss_cfg: mis_jax.LossConfig, temperature: float, train_cfg) -> dict:
  """The jitted model functions and the optimiser, shared by trainers with the same setup (so a
  resumed or repeated run in one process does not compile again)."""
  t = train_cfg
  schedule = (optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1), t.steps)
              if t.schedule == "cosine" else
              optax.join_schedules([optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps),
                                    optax.constant_schedule(t.learning_rate)], [t.warmup_steps]))
  optimizer = optax.chain(optax.clip_by_global_norm(t.max_grad_norm),
                          optax.adamw(schedule, weight_decay=t.weight_decay))

  def logprobs_and_entropy(params, input_ids, positions, segment_ids, targets):
    logits = nnx.merge(graphdef, params)(input_ids, positions, segment_ids) / temperature
    logp = jax.nn.log_softmax(logits)
    lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, entropy

  def grad_fn(params, input_ids, positions, targets, batch, dens):
    def loss(p):
      lp, ent = logprobs_and_entropy(p, input_ids, positions, batch.segment_ids, targets)
      return mis_jax.policy_loss(lp, batch, loss_cfg, entropy=ent, denominators=dens)
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return grads, metrics

  def apply_fn(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)

  return {"optimizer": optimizer, "grad": jax.jit(grad_fn), "apply": jax.jit(apply_fn),
          "logprobs": jax.jit(lambda p, x, pos, seg, y: logprobs_and_entropy(p, x, pos, seg, y)[0])}


def _combine(mb_metrics: list[dict]) -> dict:
  """Micro-batch metrics → step metrics: loss terms add up (global denominators), the rest
  are averaged over micro-batches."""
  additive = {"loss", "pg_loss", "entropy_loss", "kl_loss"}
  out = {}
  for key in mb_metrics[0]:
    values = [float(m[key]) for m in mb_metrics]
    out[key] = sum(values) if key in additive else float(np.mean(values))
  return out


def _tensorboard(run_dir):
  try:
    from torch.utils.tensorboard import SummaryWriter  # optional: only if tensorboard is installed
  except Exception:  # noqa: BLE001 - any import problem just means no TensorBoard
    return None
  try:
    return SummaryWriter(os.path.join(run_dir, "tensorboard"))
  except Exception:  # noqa: BLE001
    return None


SUMMARY_KEYS = ["reward_mean", "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "entropy_loss",
                "mis_kl", "mis_k3_kl", "train_rollout_logprob_abs_diff", "mis_is_ratio_mean_final",
                "mis_kept_token_fraction", "tokens_per_s", "rollout_s", "train_s", "sync_s"]


def main(argv=None) -> int:
  import argparse
  import sys

  from mis_jax._config import load_yaml
  from trainers import config as config_lib
  from trainers.server import EmbeddedServer

  parser = argparse.ArgumentParser(prog="mis-jax train", description="RL training with rollout correction.")
  parser.add_argument("--config", default="configs/demo.yaml", help="trainer YAML (see configs/)")
  parser.add_argument("--sglang-url", action="append", default=[], metavar="URL",
                      help="SGLang server or router URL (repeatable); default: start `mis-jax serve` on 127.0.0.1")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
  parser.add_argument("--run-dir", default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a config value, e.g. --set rollout.sync_every=4")
  parser.add_argument("--no-progress", action="store_true")
  mis_jax.add_loss_flags(parser)
  args = parser.parse_args(argv)

  try:
    raw = load_yaml(args.config, "trainer config") or {}
    for assignment in args.set:
      config_lib.set_override(raw, assignment)
    if args.run_dir:
      raw["run_dir"] = args.run_dir
    if args.steps:
      raw.setdefault("train", {})["steps"] = args.steps
    cfg = TrainConfig.from_dict(raw, source=args.config)
    loss_cfg = mis_jax.loss_config_from_args(args, base=cfg.loss)
  except (mis_jax.ConfigError, ValueError, TypeError) as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2

  print(f"algorithm: {loss_cfg.algorithm} (correction: {loss_cfg.correction}); run dir: {os.path.abspath(cfg.run_dir)}")
  try:
    if args.sglang_url:
      trainer = Trainer(cfg, loss_cfg, urls=args.sglang_url)
      history = trainer.run(resume=args.resume, progress=not args.no_progress)
    else:
      with EmbeddedServer(initial_weights_dir(cfg), dtype=cfg.rollout.server_dtype, seed=cfg.seed) as server:
        print(f"embedded SGLang-protocol server on {server.url} ({cfg.rollout.server_dtype})")
        trainer = Trainer(cfg, loss_cfg, urls=[server.url])
        history = trainer.run(resume=args.resume, progress=not args.no_progress)
  except mis_jax.ConfigError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2
  except (TrainingError, ServerError) as e:
    print(f"mis-jax train: stopped: {e}", file=sys.stderr)
    return 1
  print_summary(history, cfg)
  return 0


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
