"""`mis-jax` command line: `train`, `serve`, `init-model`."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def _init_model(argv: list[str]) -> int:
  from trainers.models import PRESETS, init_checkpoint

  parser = argparse.ArgumentParser(prog="mis-jax init-model",
                                   description="Write a randomly initialised HF checkpoint dir.")
  parser.add_argument("--preset", default="tiny-qwen3", choices=sorted(PRESETS))
  parser.add_argument("--out", required=True, help="output directory")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--initializer-range", type=float, default=None,
                      help="std of the random weights (default: the preset's, HF's 0.02); "
                      "larger values give a peakier, less uniform random policy")
  args = parser.parse_args(argv)
  config = PRESETS[args.preset]
  if args.initializer_range is not None:
    config = dataclasses.replace(config, initializer_range=args.initializer_range)
  cfg = init_checkpoint(args.out, config=config, seed=args.seed, dtype=args.dtype)
  print(f"wrote {cfg.model_type} checkpoint ({args.preset}, {args.dtype}) to {args.out}")
  return 0


def _serve(argv: list[str]) -> int:
  from trainers import server
  return server.main(argv)


def _train(argv: list[str]) -> int:
  from trainers import train
  return train.main(argv)


_COMMANDS = {
    "serve": (_serve, "serve an HF checkpoint over SGLang's native HTTP API"),
    "init-model": (_init_model, "write a tiny random HF checkpoint (tests, demo)"),
    "train": (_train, "RL training with rollout correction on SGLang rollouts"),
}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="mis-jax", description=__doc__)
  parser.add_argument("command", choices=sorted(_COMMANDS),
                      help="; ".join(f"{k}: {v[1]}" for k, v in _COMMANDS.items()))
  parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see COMMAND -h)")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  return _COMMANDS[args.command][0](args.args)


if __name__ == "__main__":
  sys.exit(main())
