"""How a run stops: the exceptions the trainer's parts raise, and process 0's work made every
process's (its result, or its failure with its kind kept)."""

from __future__ import annotations

from typing import Any, Callable

from trainers.runtime import distributed


class ServerError(RuntimeError):
  """The server could not be used (unreachable, failing, or rejecting requests). `status`: the
  HTTP status of a rejected request (4xx), else None."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status


class ServerUnavailable(ServerError):
  """A server failed past its retries (connection errors, timeouts, HTTP 5xx): down or restarting."""


class TrainingError(RuntimeError):
  """The run stopped cleanly: the message says why; the last checkpoint is intact."""


class NoServerUp(TrainingError):
  """No server could serve the step (connection errors or 5xx past the retries): the run waits
  for them (`rollout.transport.server_restart_timeout_s`) and redoes the step. `error` is what stops the
  run when it does not wait (a timeout of 0: the failure as it was)."""

  def __init__(self, message: str, error: BaseException | None = None):
    super().__init__(message)
    self.error = error if error is not None else TrainingError(message)


class Preempted(TrainingError):
  """A stop was asked (SIGTERM / SIGINT) while the step waited: it is abandoned, never half-applied."""


_KINDS = {cls.__name__: cls for cls in (NoServerUp, ServerUnavailable, Preempted)}


def on_primary(fn: Callable[[], Any]) -> Any:
  """`fn()` on process 0; its result on every process. With one process its exceptions pass as
  they are; with several, a `TrainingError` or `ServerError` on process 0 is raised on every
  process with its message, as the same kind where the loop acts on the kind (unavailable
  servers, a preemption) and as a `TrainingError` otherwise."""
  try:
    return distributed.on_primary(fn, errors=(TrainingError, ServerError))
  except distributed.PrimaryError as e:
    raise _KINDS.get(e.kind, TrainingError)(str(e)) from None
