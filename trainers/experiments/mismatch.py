"""The mismatch experiment: the toy task trained against a deliberately mismatched rollout
engine, under four corrections, same seeds.

The rollout engine lags the trainer (weights pushed every ``sync_every`` steps, so rollouts
come from a stale policy) and runs in bfloat16 while the trainer runs in float32. Runs:
standard PPO (no correction), bypass PPO, decoupled PPO with token TIS, and decoupled PPO
with MIS (token mask + veto). Per step it records reward, ``mis_k3_kl``, ``mis_kl``,
gradient norm and kept-token fraction, writes them to ``OUT/results.json`` and plots them to
``OUT/*.png``.

    python -m trainers.experiments.mismatch --out runs/mismatch --steps 80 --sync-every 4
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import mis_jax

METRICS = {"reward_mean": "reward (mean)", "mis_k3_kl": "mis_k3_kl (rollout vs trainer)",
           "mis_kl": "mis_kl", "grad_norm": "gradient norm", "mis_kept_token_fraction": "kept token fraction"}


def corrections() -> dict[str, mis_jax.LossConfig]:
  return {
      "standard PPO (no correction)": mis_jax.LossConfig(),
      "bypass PPO": mis_jax.LossConfig(use_rollout_logprobs=True),
      "decoupled + token TIS": mis_jax.LossConfig(
          use_tis=True, mis=mis_jax.MISConfig(tis_level="token", tis_mode="truncate", tis_upper_bound=2.0)),
      "decoupled + MIS (mask + veto)": mis_jax.LossConfig(
          use_tis=True, mis=mis_jax.MISConfig(tis_level="token", tis_mode="mask", tis_lower_bound=0.5,
                                              tis_upper_bound=2.0, rs_veto_threshold=1e-4)),
  }


def run_experiment(out: str, *, steps: int = 80, sync_every: int = 4, server_dtype: str = "bfloat16",
                   seed: int = 0, learning_rate: float = 3e-3, progress: bool = False) -> dict:
  """Trains each correction for ``steps`` steps against one embedded server; returns
  ``{name: [per-step metrics]}`` and writes ``out/results.json``."""
  from trainers.config import TrainConfig
  from trainers.server import EmbeddedServer
  from trainers.train import Trainer, initial_weights_dir

  os.makedirs(out, exist_ok=True)
  every = sync_every * max(1, 20 // sync_every)
  base = {"seed": seed, "model": {"preset": "tiny-qwen3", "initializer_range": 0.1},
          "task": {"name": "copy_digits", "num_digits": 3},
          "rollout": {"prompts_per_step": 16, "n": 8, "sync_every": sync_every, "server_dtype": server_dtype},
          "train": {"steps": steps, "learning_rate": learning_rate, "ppo_epochs": 2, "tokens_per_micro_batch": 1024,
                    "row_len": 64},
          "checkpoint": {"every": every, "max_to_keep": 1}}
  results = {}
  init = initial_weights_dir(TrainConfig.from_dict(dict(base, run_dir=os.path.join(out, "init"))))
  with EmbeddedServer(init, dtype=server_dtype, seed=seed) as server:
    for i, (name, loss_cfg) in enumerate(corrections().items()):
      run_dir = os.path.join(out, f"run{i}")
      if os.path.isdir(run_dir):
        import shutil
        shutil.rmtree(run_dir)
      cfg = TrainConfig.from_dict(dict(base, run_dir=run_dir, model=dict(base["model"], path=init)))
      history = Trainer(cfg, loss_cfg, urls=[server.url]).run(progress=progress, log=lambda *_: None)
      results[name] = [{k: h.get(k, 1.0 if k == "mis_kept_token_fraction" else None) for k in ["step", *METRICS]}
                       for h in history]
  meta = {"steps": steps, "sync_every": sync_every, "server_dtype": server_dtype, "seed": seed,
          "learning_rate": learning_rate}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"config": meta, "runs": results}, f, indent=1)
  return {"config": meta, "runs": results}


def plot(results: dict, out: str | None = None, *, smooth: int = 5):
  """One panel per metric, one line per correction; saves ``out/<metric>.png`` and
  ``out/mismatch_experiment.png`` when ``out`` is given. Returns the combined figure."""
  import matplotlib
  if out is not None:
    matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  runs = results["runs"]

  def series(name, key):
    y = np.array([h[key] for h in runs[name]], float)
    k = min(smooth, len(y))
    return np.convolve(y, np.ones(k) / k, mode="valid") if k > 1 else y

  fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4), dpi=80)
  for ax, (key, title) in zip(axes, METRICS.items()):
    for name in runs:
      ax.plot(series(name, key), label=name)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(f"step ({smooth}-step mean)" if smooth > 1 else "step")
    if key in ("mis_k3_kl", "grad_norm"):
      ax.set_yscale("log")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  if out is not None:
    fig.savefig(os.path.join(out, "mismatch_experiment.png"))
    for key, title in METRICS.items():
      f2, ax = plt.subplots(figsize=(5, 3.4), dpi=80)
      for name in runs:
        ax.plot(series(name, key), label=name)
      ax.set_title(title)
      ax.legend(fontsize=7)
      f2.tight_layout()
      f2.savefig(os.path.join(out, f"{key}.png"))
      plt.close(f2)
  return fig


def summary(results: dict, last: int = 10) -> str:
  lines = [f"{'correction':32s} {'reward first10':>14s} {'reward last10':>14s} {'k3_kl':>10s} {'kept':>6s}"]
  for name, hist in results["runs"].items():
    r = [h["reward_mean"] for h in hist]
    k3 = np.mean([h["mis_k3_kl"] for h in hist])
    kept = np.mean([h["mis_kept_token_fraction"] for h in hist])
    lines.append(f"{name:32s} {np.mean(r[:last]):14.3f} {np.mean(r[-last:]):14.3f} {k3:10.2e} {kept:6.3f}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/mismatch")
  parser.add_argument("--steps", type=int, default=80)
  parser.add_argument("--sync-every", type=int, default=4)
  parser.add_argument("--server-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  args = parser.parse_args(argv)
  results = run_experiment(args.out, steps=args.steps, sync_every=args.sync_every, server_dtype=args.server_dtype,
                           seed=args.seed, learning_rate=args.learning_rate, progress=True)
  plot(results, args.out)
  print(summary(results))
  print(f"\nwrote {args.out}/results.json and {args.out}/*.png")


if __name__ == "__main__":
  main()
