"""The `mis-jax` commands: one module each with `main(argv) -> int`, registered by name below (a
new command is one module and one line here). `trainers.cli` dispatches to them; a command imports
the composition root (`trainers.app`) and the layers below, never another command."""

from __future__ import annotations

import importlib

COMMANDS = {  # name -> (module, one line of help)
  "analyze": ("trainers.commands.analyze", "report the train-rollout mismatch of saved rollout records"),
  "init-model": ("trainers.commands.init_model", "write a tiny random HF checkpoint (tests, demo)"),
  "launch": (
    "trainers.commands.launch",
    "start one role of a fleet (trainer, worker, router) from the scheduler's environment",
  ),
  "serve": ("trainers.commands.serve", "serve an HF checkpoint over SGLang's native HTTP API"),
  "train": ("trainers.commands.train", "RL training with rollout correction on SGLang rollouts"),
}


def command(name: str):
  """The module of command `name`, imported on first use (`mis-jax serve` never loads the trainer)."""
  return importlib.import_module(COMMANDS[name][0])
