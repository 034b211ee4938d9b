"""Preemption: SIGTERM (what a TPU/GPU preemption, Kubernetes or SLURM sends first) and SIGINT
(Ctrl-C) during a run.

The first signal sets a flag: the loop finishes the step in flight (a step waiting for its
servers is abandoned before any update), checkpoints the last finished step, closes its
records, metrics and servers, and the run ends with status 0. A second signal exits at once
with status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM); the last whole
checkpoint stays (an Orbax save in flight is never committed half-written), and the embedded
server stops itself when its parent is gone.

With several processes, they agree at every step boundary: a signal to any process stops every
process after the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from trainers.runtime import distributed

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Use as a context manager around the loop (handlers are installed in the main thread only;
  elsewhere, as in a test's worker thread, it never fires)."""

  def __init__(self):
    self.signal: int | None = None
    self._previous: dict = {}

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    if self.signal is not None:  # the second: now, without cleaning up
      print(
        f"mis-jax train: second {signal.Signals(signum).name}: exiting at once; the last whole checkpoint stays",
        file=sys.stderr,
        flush=True,
      )
      os._exit(128 + signum)
    self.signal = signum
    print(
      f"mis-jax train: {signal.Signals(signum).name}: finishing the step in flight, then a checkpoint and "
      "exit (send it again to exit at once)",
      file=sys.stderr,
      flush=True,
    )

  def asked(self) -> bool:
    """Whether this process got a signal (no collective: safe anywhere)."""
    return self.signal is not None

  def requested(self) -> bool:
    """Whether any process got a signal: the same answer on every process (a collective: call it
    at the same point of the loop on each)."""
    return distributed.any_process(self.asked())
