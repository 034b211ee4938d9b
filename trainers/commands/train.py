"""`mis-jax train`: RL training with rollout correction (the composition root `trainers.app` builds
and runs it)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import jax

import mis_jax
from trainers import config as config_lib
from trainers.app import build, load, trainer
from trainers.rollout import backend
from trainers.runtime import distributed, faults
from trainers.runtime.errors import ServerError, TrainingError


def _config_epilog() -> str:
  lines = ["config keys (YAML sections, or --set SECTION.KEY=VALUE; docs/reference/config.md):"]
  for section, cls in config_lib.SECTIONS.items():
    for path, field, _ in config_lib.config_keys(cls, section):
      default = "null" if field.default is None else field.default
      lines.append(f"  {path} (default: {default}): {field.metadata['doc']}")
  lines.append(
    "  loss.algorithm, loss.policy_loss: {name: FORM, <its keys>} and the other loss keys: docs/reference/config.md"
  )
  lines.append(
    "precedence: YAML file < --set < dedicated flags (--run-dir, --steps, the loss flags). A loss flag "
    "that differs from the config's loss section, or --run-dir/--steps that differ from an explicit "
    "--set of the same key, is an error naming both."
  )
  return "\n".join(lines)


def train_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="mis-jax train",
    description="RL training with rollout correction.",
    epilog=_config_epilog(),
    formatter_class=_HelpFormatter,
  )
  parser.add_argument("--config", default="configs/demo.yaml", help="trainer YAML (see configs/)")
  parser.add_argument(
    "--sglang-url",
    action="append",
    default=[],
    metavar="URL",
    help="SGLang server or router URL, http(s)://HOST:PORT (repeatable); default: start `mis-jax serve` on 127.0.0.1",
  )
  parser.add_argument(
    "--router",
    default=None,
    metavar="URL",
    help="an sglang-router URL (rollout.transport.router): generation through it, the weights "
    "pushed to every worker it lists (docs/guides/fleet.md)",
  )
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
  parser.add_argument("--run-dir", default=None, help="overrides the config's run_dir")
  parser.add_argument("--steps", type=int, default=None, help="overrides the config's train.steps")
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="SECTION.KEY=VALUE",
    help="override a config value, e.g. --set rollout.sync.sync_every=4 --set parallel.fsdp=8",
  )
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument(
    "--save-rollouts",
    default=None,
    metavar="DIR",
    help="write each step's rollouts as Parquet records to DIR (rollout.records.save_dir)",
  )
  parser.add_argument(
    "--load-rollouts",
    default=None,
    metavar="DIR",
    help="train from the records in DIR with no server (rollout.records.load_dir)",
  )
  group = parser.add_argument_group(
    "several processes (jax.distributed; one command per host, one global mesh; default from "
    "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
  )
  group.add_argument(
    "--coordinator-address", default=None, metavar="HOST:PORT", help="process 0's address, the same on every process"
  )
  group.add_argument("--num-processes", default=None, type=int, help="processes in the run")
  group.add_argument("--process-id", default=None, type=int, help="this process, 0..num_processes-1")
  group.add_argument(
    "--heartbeat-timeout",
    default=30,
    type=int,
    metavar="S",
    help="a process silent this long is declared dead and the others stop",
  )
  mis_jax.config.add_loss_flags(parser)
  return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Defaults shown for every option (an unset flag leaves the config's value); the epilog
  (the config keys) kept as written."""

  def _get_help_string(self, action):
    if action.default is None and action.help and "%(default)" not in action.help:
      return action.help + " (default: the config's)"
    return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
  args = train_parser().parse_args(argv)
  try:
    settings = distributed.settings_from(args)
  except ValueError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2
  distributed.initialize(settings, heartbeat_timeout_s=args.heartbeat_timeout)  # before any device is used
  primary = distributed.is_primary()
  try:
    cfg, spec = load.resolve_train_config(args)  # an invalid mesh too is an error before any server starts
    faults.check()  # (the crash tests' hook)
  except mis_jax.ConfigError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2

  say = print if primary else (lambda *a, **k: None)
  mesh = spec.mesh
  say(f"algorithm: {cfg.loss.algorithm} (correction: {cfg.loss.correction}); run dir: {os.path.abspath(cfg.run_dir)}")
  say(
    f"mesh: {dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} device(s) in "
    f"{jax.process_count()} process(es)"
  )
  say(f"task: {spec.task.summary}")
  if cfg.rollout.sync.max_staleness:
    say(
      f"asynchronous rollouts: samples at most {cfg.rollout.sync.max_staleness} weight version(s) old, "
      f"servers paused with {cfg.rollout.sync.pause_mode!r} during a sync"
    )
  try:
    with contextlib.ExitStack() as running:  # the embedded server stops however the run ends
      urls = args.sglang_url
      if not urls and primary and spec.backend == "servers":  # only process 0 talks to (and starts) a server
        server = running.enter_context(
          backend.start_server(cfg, build.initial_weights_dir(cfg), is_moe=spec.model_config.is_moe)
        )
        urls = [server.url]
      run = trainer.Trainer(urls=urls, spec=spec)
      history = run.run(resume=args.resume, progress=not args.no_progress, log=say)
  except mis_jax.ConfigError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2
  except (TrainingError, ServerError) as e:
    print(f"mis-jax train: stopped: {e}", file=sys.stderr)
    return 1
  if primary:
    trainer.print_summary(history, cfg)
  if run.preempted:  # a clean stop on SIGTERM / SIGINT: status 0, and --resume continues
    got = run.preemption.signal
    what = f"checkpoint of step {run.step} saved" if run.step else "nothing trained yet"
    say(
      f"\nmis-jax train: preempted by {signal.Signals(got).name if got else 'another process'} after step "
      f"{run.step}: {what}; --resume continues from it"
    )
  return 0
