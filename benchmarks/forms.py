"""The loss pass of every policy-loss form (contract §6.2) next to `vanilla`, at `make bench`'s
named shapes, in one run: decoupled PPO with the reference MIS config (`configs/mis.yaml`),
`policy_loss` forward+backward on the step's prepared batch (best of N), its compiled peak
(temp) memory, and `prepare_step` (where `clip_cov` / `kl_cov` select their tokens).

    python -m benchmarks.forms [--quick] [--json benchmarks/results/forms.json]

`make bench` runs it after the loss path (`benchmarks.run`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform

import jax
import numpy as np

import mis_jax
from benchmarks.run import LOSS_CFG, make_data, save_json, temp_bytes, timeit, to_batch

FORM_KEYS = {"dro": {"dro_beta": 0.1}}  # the forms' required keys; the rest take verl's defaults
KEY = jax.random.key(0)


def form_config(form: str) -> mis_jax.LossConfig:
  return dataclasses.replace(LOSS_CFG, policy_loss={"name": form, **FORM_KEYS.get(form, {})})


def bench_forms(rng, num_seqs, max_len, row_len) -> dict:
  seqs, packing = make_data(rng, num_seqs, max_len, row_len)
  batch, lp = to_batch(seqs, packing)
  tokens = int(sum(len(s["m"]) for s in seqs))
  out = {"num_seqs": num_seqs, "max_len": max_len, "tokens": tokens, "packed_shape": list(batch.shape), "forms": {}}
  for form in mis_jax.forms.POLICY_LOSSES:
    cfg = form_config(form)
    prepare = jax.jit(lambda b, key, cfg=cfg: mis_jax.prepare_step(b, cfg, key=key))
    correction, _ = prepare(batch, KEY)
    loss_grad = jax.jit(
      jax.value_and_grad(lambda lp, b, c, cfg=cfg: mis_jax.policy_loss(lp, b, cfg, correction=c), has_aux=True)
    )
    row = {
      "loss_fwd_bwd_s": timeit(loss_grad, lp, batch, correction),
      "prepare_s": timeit(prepare, batch, KEY),
      "loss_temp_MB": temp_bytes(loss_grad, lp, batch, correction) / 1e6,
    }
    row["tokens_per_s"] = tokens / row["loss_fwd_bwd_s"]
    out["forms"][form] = row
  base = out["forms"]["vanilla"]
  for row in out["forms"].values():
    row["loss_over_vanilla"] = row["loss_fwd_bwd_s"] / base["loss_fwd_bwd_s"]
    row["prepare_over_vanilla"] = row["prepare_s"] / base["prepare_s"]
  return out


def run(quick: bool = False) -> list[dict]:
  """The two named shapes of `benchmarks.run` (512 × ≤1024 and 4096 × ≤256 tokens; 8× fewer
  sequences with `quick`)."""
  rng = np.random.default_rng(0)
  scale = 8 if quick else 1
  return [bench_forms(rng, 512 // scale, 1024, 4096), bench_forms(rng, 4096 // scale, 256, 4096)]


def print_table(shapes: list[dict]) -> None:
  print(
    "\nPolicy-loss forms (decoupled PPO + reference MIS config; loss forward+backward and prepare_step, best of N):"
  )
  for shape in shapes:
    print(f"\n{shape['num_seqs']} sequences ≤ {shape['max_len']} tokens ({shape['tokens']} tokens):")
    print("form | loss ms | × vanilla | tok/s | temp MB | prepare ms | × vanilla")
    for form, r in shape["forms"].items():
      print(
        f"{form} | {1e3 * r['loss_fwd_bwd_s']:.2f} | {r['loss_over_vanilla']:.2f} | {r['tokens_per_s']:.3g} | "
        f"{r['loss_temp_MB']:.1f} | {1e3 * r['prepare_s']:.2f} | {r['prepare_over_vanilla']:.2f}"
      )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="8x fewer sequences")
  parser.add_argument("--json", default="benchmarks/results/forms.json")
  args = parser.parse_args(argv)
  out = {
    "machine": {
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
    },
    "shapes": run(quick=args.quick),
  }
  print_table(out["shapes"])
  return save_json(out, args.json)


if __name__ == "__main__":
  main()
