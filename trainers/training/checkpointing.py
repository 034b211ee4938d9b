"""Orbax checkpoints of the trainer state (params, optimiser state) plus JSON metadata.

Saves are asynchronous; Orbax writes each step to a temporary directory and renames it when
complete, so ``latest_step`` never returns a half-written checkpoint (a run killed mid-save
resumes from the previous one).
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, like):
    """Restores the newest complete checkpoint into the structure of ``like``, or None."""
    step = self._manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                              meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
