"""`mis-jax` command line: `train`, `serve`, `launch`, `analyze`, `init-model` (`trainers.commands`)."""

from __future__ import annotations

import argparse
import sys

from trainers.commands import COMMANDS, command


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="mis-jax", description=__doc__)
  parser.add_argument(
    "command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {help_}" for k, (_, help_) in COMMANDS.items())
  )
  parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see COMMAND -h)")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  return command(args.command).main(args.args)


if __name__ == "__main__":
  sys.exit(main())
