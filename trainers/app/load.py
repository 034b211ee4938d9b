"""The composition root's first stage: the `mis-jax train` flags and YAML read into a typed
`TrainConfig` (YAML < --set < dedicated flags), then resolved (`trainers.app.spec.resolve`), before
anything starts."""

from __future__ import annotations

import mis_jax
from mis_jax.config import load_yaml
from trainers import config as config_lib
from trainers.app import checks
from trainers.app.spec import resolve


def resolve_train_config(args):
  """`(TrainConfig, task)` from the parsed flags: YAML < --set < dedicated flags, every value typed
  and range-checked (the loss flags over the config's `loss` section, a contradiction an error),
  then the checks across keys and against the machine (paths, URLs, the mesh, the task) — all
  before anything starts. Raises `ConfigError`."""
  raw = load_yaml(args.config, "trainer config") or {}
  if not isinstance(raw, dict):
    raise mis_jax.ConfigError(f"{args.config}: the trainer config must be a mapping")
  explicit = {}
  for assignment in args.set:
    config_lib.set_override(raw, assignment)
    explicit[assignment.partition("=")[0]] = assignment
  origins = {path: f"--set {assignment}" for path, assignment in explicit.items()}
  for flag, path, value in (
    ("--run-dir", "run_dir", args.run_dir),
    ("--steps", "train.steps", args.steps),
    ("--save-rollouts", "rollout.records.save_dir", args.save_rollouts),
    ("--load-rollouts", "rollout.records.load_dir", args.load_rollouts),
    ("--router", "rollout.transport.router", args.router),
  ):
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
    raise mis_jax.ConfigError(
      f"--sglang-url {args.sglang_url[0]} beside rollout.transport.router "
      f"{cfg.rollout.transport.router}: the workers are the router's own list; give one of them"
    )
  return cfg, resolve(cfg)
