"""`mis-jax init-model`: a randomly initialised HF checkpoint directory (tests, the demo)."""

from __future__ import annotations

import argparse
import dataclasses

from trainers.models import PRESETS, init_checkpoint


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="mis-jax init-model", description="Write a randomly initialised HF checkpoint dir."
  )
  parser.add_argument("--preset", default="tiny-qwen3", choices=sorted(PRESETS))
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument(
    "--initializer-range",
    type=float,
    default=None,
    help="std of the random weights (default: the preset's, HF's 0.02); "
    "larger values give a peakier, less uniform random policy",
  )
  args = parser.parse_args(argv)
  config = PRESETS[args.preset]
  if args.initializer_range is not None:
    config = dataclasses.replace(config, initializer_range=args.initializer_range)
  cfg = init_checkpoint(args.out, config=config, seed=args.seed, dtype=args.dtype)
  print(f"wrote {cfg.model_type} checkpoint ({args.preset}, {args.dtype}) to {args.out}")
  return 0
