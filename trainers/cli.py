"""`mis-jax` command line: `train`, `serve`, `launch`, `analyze`, `init-model`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
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
  from trainers.serving.embedded import server
  return server.main(argv)


def _config_epilog() -> str:
  from trainers.training import config as config_lib
  lines = ["config keys (YAML sections, or --set SECTION.KEY=VALUE; docs/reference/config.md):"]
  for section, cls in config_lib.SECTIONS.items():
    for path, field, _ in config_lib.config_keys(cls, section):
      default = "null" if field.default is None else field.default
      lines.append(f"  {path} (default: {default}): {field.metadata['doc']}")
  lines.append("  loss.algorithm, loss.policy_loss: {name: FORM, <its keys>} and the other loss keys: "
               "docs/reference/config.md")
  lines.append("precedence: YAML file < --set < dedicated flags (--run-dir, --steps, the loss flags). A loss flag "
               "that differs from the config's loss section, or --run-dir/--steps that differ from an explicit "
               "--set of the same key, is an error naming both.")
  return "\n".join(lines)


def train_parser() -> argparse.ArgumentParser:
  import mis_jax
  parser = argparse.ArgumentParser(prog="mis-jax train", description="RL training with rollout correction.",
                                   epilog=_config_epilog(), formatter_class=_HelpFormatter)
  parser.add_argument("--config", default="configs/demo.yaml", help="trainer YAML (see configs/)")
  parser.add_argument("--sglang-url", action="append", default=[], metavar="URL",
                      help="SGLang server or router URL, http(s)://HOST:PORT (repeatable); default: start "
                      "`mis-jax serve` on 127.0.0.1")
  parser.add_argument("--router", default=None, metavar="URL",
                      help="an sglang-router URL (rollout.transport.router): generation through it, the weights "
                      "pushed to every worker it lists (docs/guides/fleet.md)")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
  parser.add_argument("--run-dir", default=None, help="overrides the config's run_dir")
  parser.add_argument("--steps", type=int, default=None, help="overrides the config's train.steps")
  parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a config value, e.g. --set rollout.sync.sync_every=4 --set parallel.fsdp=8")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--save-rollouts", default=None, metavar="DIR",
                      help="write each step's rollouts as Parquet records to DIR (rollout.records.save_dir)")
  parser.add_argument("--load-rollouts", default=None, metavar="DIR",
                      help="train from the records in DIR with no server (rollout.records.load_dir)")
  group = parser.add_argument_group(
      "several processes (jax.distributed; one command per host, one global mesh; default from "
      "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
  group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                     help="process 0's address, the same on every process")
  group.add_argument("--num-processes", default=None, type=int, help="processes in the run")
  group.add_argument("--process-id", default=None, type=int, help="this process, 0..num_processes-1")
  group.add_argument("--heartbeat-timeout", default=30, type=int, metavar="S",
                     help="a process silent this long is declared dead and the others stop")
  mis_jax.config.add_loss_flags(parser)
  return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Defaults shown for every option (an unset flag leaves the config's value); the epilog
  (the config keys) kept as written."""

  def _get_help_string(self, action):
    if action.default is None and action.help and "%(default)" not in action.help:
      return action.help + " (default: the config's)"
    return super()._get_help_string(action)


def resolve_train_config(args):
  """`(TrainConfig, task)` from the parsed flags: YAML < --set < dedicated flags, every value typed
  and range-checked (the loss flags over the config's `loss` section, a contradiction an error),
  then the checks across keys and against the machine (paths, URLs, the mesh, the task) — all
  before anything starts. Raises `ConfigError`."""
  import mis_jax
  from mis_jax.config import load_yaml
  from trainers.training import checks
  from trainers.training import config as config_lib

  raw = load_yaml(args.config, "trainer config") or {}
  if not isinstance(raw, dict):
    raise mis_jax.ConfigError(f"{args.config}: the trainer config must be a mapping")
  explicit = {}
  for assignment in args.set:
    config_lib.set_override(raw, assignment)
    explicit[assignment.partition("=")[0]] = assignment
  origins = {path: f"--set {assignment}" for path, assignment in explicit.items()}
  for flag, path, value in (("--run-dir", "run_dir", args.run_dir), ("--steps", "train.steps", args.steps),
                            ("--save-rollouts", "rollout.records.save_dir", args.save_rollouts),
                            ("--load-rollouts", "rollout.records.load_dir", args.load_rollouts),
                            ("--router", "rollout.transport.router", args.router)):
    if value is None:
      continue
    if path in explicit and str(value) != explicit[path].partition("=")[2]:
      raise mis_jax.ConfigError(f"{flag} {value} contradicts --set {explicit[path]}; remove one of them")
    config_lib.assign(raw, path, value)
    origins[path] = f"{flag} {value}"
  raw_loss = raw.pop("loss", None)
  cfg = config_lib.TrainConfig.from_dict(raw, source=args.config, origins=origins)
  # The loss flags over the config's loss section: a flag that contradicts it is an error naming both.
  cfg = cfg.replace(loss=config_lib.loss_config(raw_loss, args, source=args.config, origins=origins))
  for url in args.sglang_url + ([cfg.rollout.transport.router] if cfg.rollout.transport.router else []):
    checks.check_url(url)
  if cfg.rollout.transport.router and args.sglang_url:
    raise mis_jax.ConfigError(f"--sglang-url {args.sglang_url[0]} beside rollout.transport.router "
                              f"{cfg.rollout.transport.router}: the workers are the router's own list; give one of them")
  return cfg, checks.check_config(cfg)


def _start_server(cfg, weights_dir: str):
  """The server a run without `--sglang-url` starts: `mis-jax serve`, or sglang-jax from its venv
  (`rollout.placement.engine`), serving the starting weights as version "0"."""
  import mis_jax
  from trainers.training.rollout import ServerError

  r = cfg.rollout.placement
  if r.engine == "sglang-jax":
    from trainers.serving.sglang_jax import launcher as sglang_jax
    from trainers.training.checks import model_config
    try:
      server = sglang_jax.SGLangJaxServer(weights_dir, dtype=r.server_dtype, weight_version="0",
                                          enable_return_routed_experts=model_config(cfg).is_moe,
                                          extra=("--random-seed", str(cfg.seed)))
    except sglang_jax.EngineUnavailable as e:
      raise mis_jax.ConfigError(f"rollout.placement.engine sglang-jax: {e}") from None
    except (RuntimeError, TimeoutError) as e:
      raise ServerError(f"sglang-jax did not start: {e}") from None
    print(f"sglang-jax {sglang_jax.VERSION} server on {server.url} ({r.server_dtype})")
    return server
  from trainers.serving.embedded.server import EmbeddedServer
  server = EmbeddedServer(weights_dir, dtype=r.server_dtype, seed=cfg.seed, quantize=r.server_quantize,
                          layer_loop=cfg.model.layer_loop,
                          extra_args=("--enable-return-routed-experts", "--weight-version", "0"))
  print(f"embedded SGLang-protocol server on {server.url} ({r.server_dtype})")
  return server


def _train(argv: list[str] | None = None) -> int:
  import os

  import jax

  import mis_jax
  from trainers.training import checks, distributed, train
  from trainers.training.rollout import ServerError

  args = train_parser().parse_args(argv)
  try:
    settings = distributed.settings_from(args)
  except ValueError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2
  distributed.initialize(settings, heartbeat_timeout_s=args.heartbeat_timeout)  # before any device is used
  primary = distributed.is_primary()
  try:
    cfg, task = resolve_train_config(args)
    mesh = checks.check_parallel(cfg)  # an invalid mesh is an error before any server starts
  except mis_jax.ConfigError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2

  say = print if primary else (lambda *a, **k: None)
  say(f"algorithm: {cfg.loss.algorithm} (correction: {cfg.loss.correction}); run dir: {os.path.abspath(cfg.run_dir)}")
  say(f"mesh: {dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} device(s) in "
      f"{jax.process_count()} process(es)")
  say(f"task: {task.summary}")
  if cfg.rollout.sync.max_staleness:
    say(f"asynchronous rollouts: samples at most {cfg.rollout.sync.max_staleness} weight version(s) old, "
        f"servers paused with {cfg.rollout.sync.pause_mode!r} during a sync")
  try:
    with contextlib.ExitStack() as running:  # the embedded server stops however the run ends
      urls = args.sglang_url
      colocated = cfg.rollout.placement.mode == "colocated"
      fleet = bool(cfg.rollout.transport.router)
      if not urls and primary and not cfg.rollout.records.load_dir and not colocated and not fleet:  # only process 0 talks to (and starts) a server
        server = running.enter_context(_start_server(cfg, train.initial_weights_dir(cfg)))
        urls = [server.url]
      trainer = train.Trainer(cfg, urls=urls, task=task)
      history = trainer.run(resume=args.resume, progress=not args.no_progress, log=say)
  except mis_jax.ConfigError as e:
    print(f"mis-jax train: {e}", file=sys.stderr)
    return 2
  except (train.TrainingError, ServerError) as e:
    print(f"mis-jax train: stopped: {e}", file=sys.stderr)
    return 1
  if primary:
    train.print_summary(history, cfg)
  if trainer.preempted:  # a clean stop on SIGTERM / SIGINT: status 0, and --resume continues
    got = trainer.preemption.signal
    what = f"checkpoint of step {trainer.step} saved" if trainer.step else "nothing trained yet"
    say(f"\nmis-jax train: preempted by {signal.Signals(got).name if got else 'another process'} after step "
        f"{trainer.step}: {what}; --resume continues from it")
  return 0


def _launch(argv: list[str]) -> int:
  from trainers import launch
  return launch.main(argv)


def _analyze(argv: list[str]) -> int:
  from trainers.training import analysis
  return analysis.main(argv)


_COMMANDS = {
    "analyze": (_analyze, "report the train-rollout mismatch of saved rollout records"),
    "serve": (_serve, "serve an HF checkpoint over SGLang's native HTTP API"),
    "launch": (_launch, "start one role of a fleet (trainer, worker, router) from the scheduler's environment"),
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
