"""Orbax checkpoints of the trainer state (params, optimiser state) plus JSON metadata.

Saves are asynchronous; Orbax writes each step to a temporary directory and renames it when
complete, so ``latest_step`` never returns a half-written checkpoint (a run killed mid-save
resumes from the previous one; the crash tests kill it there: `trainers.runtime.faults`'
`checkpoint` point). A save that fails (a read-only or full directory) stops the run with a
`TrainingError` naming the step and the directory; the previous checkpoint stays whole.
"""

from __future__ import annotations

import contextlib
import os

import jax
import orbax.checkpoint as ocp

from trainers.runtime import faults
from trainers.runtime.errors import TrainingError


class _Commit(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """Orbax's atomic rename, with the crash tests' point between a step's files written and their
  commit (the rename of its temporary directory; Orbax's background thread)."""

  async def finalize(self):
    name = self.get_final().name
    if name.isdigit():  # the step's directory (its items, `state` and `meta`, are committed before it)
      faults.reached("checkpoint", int(name))
    await super().finalize()


# Bytes of arrays Orbax serialises at once (its default, 96 GB, is all of them): each in flight
# holds a host copy and its encoded chunks, ~0.9x its size beside the state (a Qwen3-0.6B state of
# 7.2 GB saved with 3.5 GB more resident); a few at a time cost the same seconds on a CPU host.
SAVE_CONCURRENT_GB = 1


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, temporary_path_class=_Commit
    )
    handlers = {
      "state": ocp.StandardCheckpointHandler(save_concurrent_gb=SAVE_CONCURRENT_GB),
      "meta": ocp.JsonCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._pending: int | None = None  # the step of a save that may still be in flight

  def save(self, step: int, state, meta: dict) -> None:
    with self._failures(
      f"the checkpoint of step {self._pending}" if self._pending is not None else f"the checkpoint of step {step}"
    ):
      self._pending = step
      self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
      )

  @contextlib.contextmanager
  def _failures(self, what: str):
    """An Orbax failure (here, or of the previous asynchronous save, which surfaces here) as a
    `TrainingError` that says what is left."""
    try:
      yield
    except (OSError, ValueError, RuntimeError) as e:
      kept = self._manager.latest_step()
      raise TrainingError(
        f"{what} could not be written to {self.directory}: {type(e).__name__}: {e}. "
        + (f"The last whole checkpoint is step {kept}." if kept is not None else "There is no whole checkpoint yet.")
      ) from None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, like):
    """Restores the newest complete checkpoint into the structure of ``like``, or None."""
    step = self._manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    out = self._manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
    )
    return out["state"], out["meta"]

  def wait(self) -> None:
    with self._failures(f"the checkpoint of step {self._pending}"):
      self._manager.wait_until_finished()
    self._pending = None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()
