"""Several trainer processes as one JAX program (`jax.distributed`): one global mesh over every
process's devices.

Process 0 owns the HTTP client (rollouts, weight sync) and the run directory's logs; what it
learns is broadcast so every process builds the same packed batch and feeds its own rows. A
failure on process 0 is broadcast too, so all processes stop together with its message; a
process that dies is detected by the coordination service's heartbeat (bounded by
`heartbeat_timeout_s`), and the others exit with an error instead of hanging.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

ENV = {
  "coordinator_address": "JAX_COORDINATOR_ADDRESS",
  "num_processes": "JAX_NUM_PROCESSES",
  "process_id": "JAX_PROCESS_ID",
}


def settings_from(args) -> dict | None:
  """`jax.distributed.initialize` arguments from the flags, else the usual environment
  variables (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); None for one
  process. Raises `ValueError` naming the flag when they are incomplete or invalid."""
  values = {}
  for name, env in ENV.items():
    value = getattr(args, name, None)
    values[name] = value if value is not None else os.environ.get(env)
  if all(v is None for v in values.values()):
    return None
  missing = [f"--{k.replace('_', '-')} (or {ENV[k]})" for k, v in values.items() if v is None]
  if missing:
    raise ValueError(
      f"several processes need all of --coordinator-address, --num-processes, --process-id; "
      f"missing {', '.join(missing)}"
    )
  try:
    num, pid = int(values["num_processes"]), int(values["process_id"])
  except ValueError:
    raise ValueError(
      f"--num-processes {values['num_processes']!r} and --process-id {values['process_id']!r} must be integers"
    ) from None
  if num < 1 or not 0 <= pid < num:
    raise ValueError(f"--process-id {pid} must be in [0, --num-processes {num})")
  host, _, port = str(values["coordinator_address"]).rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"--coordinator-address {values['coordinator_address']!r} must be HOST:PORT")
  return {"coordinator_address": values["coordinator_address"], "num_processes": num, "process_id": pid}


def initialize(settings: dict | None, *, heartbeat_timeout_s: int = 30, init_timeout_s: int = 300) -> None:
  """Joins the process group (before anything touches a device); a no-op for one process."""
  if settings is None or settings["num_processes"] == 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices: gloo over TCP
  jax.distributed.initialize(
    **settings, initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s
  )


def is_primary() -> bool:
  return jax.process_index() == 0


def broadcast_json(value: Any) -> Any:
  """Process 0's `value` (JSON-serialisable) on every process."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils

  data = json.dumps(value).encode() if is_primary() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
  buf = np.frombuffer(data, np.uint8) if is_primary() else np.zeros(size, np.uint8)
  out = multihost_utils.broadcast_one_to_all(buf)
  return json.loads(np.asarray(out, np.uint8).tobytes().decode())


class PrimaryError(RuntimeError):
  """What failed on process 0 (every process raises it with the same message); `kind`: the
  class name of the original exception."""

  def __init__(self, message: str, kind: str = ""):
    super().__init__(message)
    self.kind = kind


def on_primary(fn: Callable[[], Any], *, errors=(Exception,)) -> Any:
  """Runs `fn` on process 0 only and returns its (JSON) result on every process; if it raises
  one of `errors`, every process raises `PrimaryError` with its message."""
  if jax.process_count() == 1:
    return fn()  # one process: its exceptions as they are
  outcome = None
  if is_primary():
    try:
      outcome = {"ok": fn()}
    except errors as e:
      outcome = {"error": str(e), "kind": type(e).__name__}
  outcome = broadcast_json(outcome)
  if "error" in outcome:
    raise PrimaryError(outcome["error"], outcome["kind"])
  return outcome["ok"]


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process (every process gets the same answer)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def to_host(x) -> np.ndarray:
  """The whole value of a (possibly multi-process, sharded) array on every process."""
  if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
