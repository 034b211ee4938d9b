"""Named points of a step where a test crashes the trainer: the crash tests' hook
(`tests/trainers/app/test_crash.py`, docs/guides/trainer.md's crash guarantees).

Off unless the environment variable `MIS_JAX_FAULT` is `POINT:STEP[:ACTION]`: when the run reaches
`POINT` of step `STEP` (the step counted from 1, as `metrics.jsonl` counts it), the process

- `kill-group` (the default): SIGKILLs its whole process group (the trainer and the embedded server
  it started — a node lost at once);
- `kill`: SIGKILLs itself alone (its children outlive it: a server started by the trainer notices
  and stops itself);
- `stop`: SIGSTOPs itself, so a test can change the world around a frozen trainer (kill and restart
  a server) and SIGCONT it.

The points (`POINTS`) are where a crash leaves a different state on disk; each is reached once per
step. A malformed `MIS_JAX_FAULT` is a `ConfigError` naming it before the trainer builds anything
(`check`).
"""

from __future__ import annotations

import functools
import os
import signal

from mis_jax import ConfigError

ENV = "MIS_JAX_FAULT"
POINTS = {
  "weights": "step k's weights written under weights/step_k; no server has loaded them",
  "pushed": "every live server serves step k's weights; the older weight directories are pruned",
  "metrics": "step k's row written to metrics.jsonl; its checkpoint not begun",
  "checkpoint": "step k's checkpoint written by Orbax but not committed (its temporary directory not renamed)",
}
ACTIONS = ("kill-group", "kill", "stop")


@functools.cache
def _armed(value: str | None) -> tuple[str, int, str] | None:
  if not value:
    return None
  parts = value.split(":")
  point, step, action = (parts + ["kill-group"])[:3] if len(parts) in (2, 3) else (None, None, None)
  if point not in POINTS or not str(step).isdigit() or action not in ACTIONS or len(parts) > 3:
    raise ConfigError(
      f"{ENV}={value!r}: expected POINT:STEP[:ACTION] with POINT one of {', '.join(POINTS)}, STEP a "
      f"step number and ACTION one of {', '.join(ACTIONS)}"
    )
  return point, int(step), action


def check() -> None:
  """Raises `ConfigError` naming `MIS_JAX_FAULT` when it is set and malformed."""
  _armed(os.environ.get(ENV))


def reached(point: str, step: int) -> None:
  """The run is at `point` (one of `POINTS`) of step `step`: crashes here when `MIS_JAX_FAULT` names
  them, else does nothing."""
  armed = _armed(os.environ.get(ENV))
  if armed is None or armed[:2] != (point, step):
    return
  action = armed[2]
  print(f"{ENV}: {action} at {point} of step {step}", flush=True)
  if action == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
  elif action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  else:
    os.killpg(os.getpgrp(), signal.SIGKILL)
