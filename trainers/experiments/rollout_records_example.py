"""Writes `data/rollout_records_example/`: the rollout records of a short demo run (6 steps of
`configs/demo.yaml`: a bf16 embedded server, decoupled PPO with the reference MIS config) and the
`mis-jax analyze` report of them (docs/guides/records.md).

    python -m trainers.experiments.rollout_records_example [--out data/rollout_records_example]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from trainers.commands import command


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="data/rollout_records_example")
  args = parser.parse_args(argv)
  shutil.rmtree(args.out, ignore_errors=True)
  with tempfile.TemporaryDirectory() as run_dir:
    code = command("train").main(
      [
        "--config",
        "configs/demo.yaml",
        "--steps",
        "6",
        "--no-progress",
        "--run-dir",
        os.path.join(run_dir, "run"),
        "--save-rollouts",
        args.out,
      ]
    )
    if code:
      return code
  return command("analyze").main([args.out, "--out", os.path.join(args.out, "report")])


if __name__ == "__main__":
  raise SystemExit(main())
