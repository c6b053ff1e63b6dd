"""Thin Orbax wrapper: atomic, async, keeps the newest `max_to_keep`, restores onto given shardings.

Each step directory holds `state` (params, optimizer state, step) and `meta`
(JSON: model config, tokenizer kind, mesh it was written on).
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    return self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=force)

  def read_meta(self, step: int) -> dict:
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state):
    """abstract_state: tree of jax.ShapeDtypeStruct with `.sharding` set -> restored arrays on those shardings."""
    return self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]

  def restore_params(self, step: int, abstract_params):
    """Only the model parameters of a checkpoint (for eval and fine-tuning starts)."""
    restored = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": abstract_params},
        restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": abstract_params}),
        partial_restore=True)))
    return restored["state"]["params"]

  def wait(self):
    self._mgr.wait_until_finished()

  def close(self):
    self._mgr.close()
