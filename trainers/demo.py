"""`make demo` (until the trainer lands): the rollout-correction library on synthetic data.

Builds a packed batch of variable-length sequences whose rollout log-probs differ from the
trainer's by a controllable mismatch (plus a few catastrophic tokens), runs every algorithm of
SPEC §6 with the reference ``configs/mis.yaml``, takes a few jitted Optax steps on a toy
per-token policy, and prints the metrics table.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mis_jax

ALGORITHMS = {"standard PPO": (False, False), "bypass PPO": (True, False),
              "decoupled PPO + MIS": (False, True), "REINFORCE + rollout IS": (True, True)}
SHOWN = ["loss", "pg_clipfrac", "ppo_kl", "mis_kl", "mis_k3_kl", "train_rollout_logprob_abs_diff",
         "mis_tis_truncate_fraction", "mis_rs_catastrophic_seq_fraction", "mis_batch_norm_factor",
         "mis_is_ratio_mean_final", "mis_kept_token_fraction", "mis_ess_ratio"]


def synthetic_batch(rng, *, num_seqs=256, row_len=512, mismatch=0.15, catastrophic=1e-3):
  lengths = rng.integers(8, 256, num_seqs)
  packing = mis_jax.plan_packing(lengths, row_len, row_multiple=8)
  seqs = {k: [] for k in ("m", "q", "o", "adv")}
  rewards = rng.normal(size=num_seqs).astype(np.float32)
  adv = np.asarray(mis_jax.compute_advantages(rewards, np.arange(num_seqs) // 8, num_groups=num_seqs // 8))
  for i, n in enumerate(lengths):
    prompt = rng.integers(1, n // 2 + 1)
    m = np.arange(n) >= prompt
    q = -np.abs(rng.normal(0.5, 0.7, n)).astype(np.float32)
    r = rng.normal(0, mismatch, n).astype(np.float32)
    r[rng.random(n) < catastrophic] = -12.0
    seqs["m"].append(m)
    seqs["q"].append(q)
    seqs["o"].append(q + r)
    seqs["adv"].append(np.full(n, adv[i], np.float32))
  batch = mis_jax.PackedBatch(
      segment_ids=packing.segment_ids, loss_mask=packing.pack(seqs["m"], False, bool),
      advantages=packing.pack(seqs["adv"], 0.0, np.float32), rollout_logprobs=packing.pack(seqs["q"], 0.0, np.float32),
      old_logprobs=packing.pack(seqs["o"], 0.0, np.float32), num_segments=num_seqs)
  return batch, packing


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--mismatch", type=float, default=0.15, help="std of the per-token log-ratio o - q")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--config", default="configs/mis.yaml")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  batch, packing = synthetic_batch(rng, mismatch=args.mismatch)
  mis = mis_jax.MISConfig.from_yaml(args.config)
  ntok = int(np.asarray(batch.loss_mask).sum())
  print(f"packed {packing.num_sequences} sequences into {packing.num_rows} rows of {packing.row_len} "
        f"({ntok} trained tokens, {100 * (np.asarray(batch.segment_ids) >= 0).mean():.1f}% occupancy); "
        f"mismatch std {args.mismatch}; MIS config {args.config}")

  results = {}
  for name, (roll, tis) in ALGORITHMS.items():
    cfg = mis_jax.LossConfig(use_rollout_logprobs=roll, use_tis=tis, mis=mis if tis else None)
    # A toy policy: one free logit offset per token position, so lp = o + delta.
    delta = jnp.zeros(batch.shape, jnp.float32)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = opt.init(delta)

    @jax.jit
    def step(delta, state, batch, cfg=cfg):
      lp = batch.old_logprobs + delta
      (loss, metrics), grad = jax.value_and_grad(lambda lp: mis_jax.policy_loss(lp, batch, cfg), has_aux=True)(lp)
      updates, state = opt.update(grad, state, delta)
      return optax.apply_updates(delta, updates), state, metrics

    t0 = time.perf_counter()
    for _ in range(args.steps):
      delta, state, metrics = step(delta, state, batch)
    jax.block_until_ready(delta)
    dt = time.perf_counter() - t0
    results[name] = {k: float(v) for k, v in metrics.items()}
    results[name]["tokens/s"] = args.steps * ntok / dt

  names = list(results)
  width = max(len(k) for k in SHOWN) + 2
  print("\n" + "metric".ljust(width) + "".join(n.rjust(24) for n in names))
  for key in SHOWN + ["tokens/s"]:
    row = [results[n].get(key) for n in names]
    print(key.ljust(width) + "".join(("-" if v is None else f"{v:.4g}").rjust(24) for v in row))
  print(f"\n(last of {args.steps} jitted optax steps per algorithm; '-' = not emitted by that algorithm)")


if __name__ == "__main__":
  main()
