"""Thin Orbax wrapper: atomic, async, keeps the newest `max_to_keep`, restores onto given shardings, and never
restores a damaged checkpoint.

Each step directory holds `state` (params, optimizer state, step, counters) and
`meta` (JSON: model config, run config, mesh, code version, and a fingerprint of
the state: per-leaf sum|x| and sum x², compared on restore).
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from hnclip_jax import faults


class CheckpointError(RuntimeError):
  """A checkpoint could not be written; earlier checkpoints are untouched."""


@jax.jit
def _leaf_stats(leaves):
  return [jnp.stack([jnp.sum(jnp.abs(x.astype(jnp.float32))), jnp.sum(jnp.square(x.astype(jnp.float32)))])
          for x in leaves]


def fingerprint(tree) -> dict:
  """{top-level key: [[sum|x|, sum x²] per leaf]} — cheap, computed where the arrays live."""
  return {k: np.asarray(jax.device_get(_leaf_stats(jax.tree.leaves(v)))).tolist() for k, v in tree.items()}


def _same(saved, got, rtol=1e-4) -> bool:
  saved, got = np.asarray(saved, np.float64), np.asarray(got, np.float64)
  return saved.shape == got.shape and bool(np.all(np.abs(saved - got) <= rtol * np.abs(saved) + 1e-6))


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
    return sorted(self._mgr.all_steps())

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Starts an (async) save of `state`; raises CheckpointError naming the step if writing fails."""
    meta = {**meta, "fingerprint": fingerprint(state)}
    try:
      faults.maybe_fail("save_fails", step)
      saved = self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)), force=force)
    except Exception as e:  # noqa: BLE001 — any write failure (disk full, permissions, I/O) ends up here
      raise CheckpointError(f"writing checkpoint {self.directory}/{step} failed: {e}. Earlier checkpoints "
                            f"{self.all_steps()} are intact; free space or fix the directory and rerun to resume"
                            ) from e
    faults.maybe_kill("kill_during_save", step)
    return saved

  def read_meta(self, step: int) -> dict:
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state):
    """abstract_state: tree of jax.ShapeDtypeStruct with `.sharding` set -> restored arrays on those shardings.

    Raises ValueError if the restored values do not match the fingerprint recorded at save time.
    """
    meta = self.read_meta(step)
    state = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
    self._verify(step, meta, state)
    return state

  def restore_latest_intact(self, abstract_state, check_meta=None):
    """Newest checkpoint that restores and verifies -> (step, state, meta), or (None, None, None) if none.

    A damaged checkpoint (half-written, truncated or corrupted files) is skipped with a warning naming it.
    `check_meta(meta, where)` may raise to refuse a checkpoint (e.g. another model config); that is not skipped.
    """
    damaged = []
    found = (None, None, None)
    for step in reversed(self.all_steps()):
      where = f"{self.directory}/{step}"
      try:
        meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001
        self._warn(where, e)
        damaged.append(step)
        continue
      if check_meta is not None:
        check_meta(meta, where)
      try:
        found = (step, self.restore(step, abstract_state), meta)
        break
      except Exception as e:  # noqa: BLE001
        self._warn(where, e)
        damaged.append(step)
    self._set_aside(damaged)
    return found

  def _set_aside(self, steps):
    """Moves damaged step directories to WORKDIR/checkpoints_damaged/ (kept for inspection, out of the way of the
    steps the resumed run will write)."""
    if not steps:
      return
    if jax.process_index() == 0:
      aside = self.directory.rstrip("/") + "_damaged"
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        dst = os.path.join(aside, f"{step}-{int(time.time())}")
        os.replace(os.path.join(self.directory, str(step)), dst)
        print(f"WARNING: moved damaged checkpoint {self.directory}/{step} to {dst}", flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints set aside")
    self._mgr.reload()

  def restore_params(self, step: int, abstract_params):
    """Only the model parameters of a checkpoint (for eval and fine-tuning starts), verified."""
    restored = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": abstract_params},
        restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": abstract_params}),
        partial_restore=True)))
    self._verify(step, self.read_meta(step), restored["state"], keys=("params",))
    return restored["state"]["params"]

  def _verify(self, step, meta, state, keys=None):
    saved = meta.get("fingerprint")
    if saved is None:
      return
    got = fingerprint({k: state[k] for k in (keys or saved)})
    for k, v in got.items():
      if not _same(saved[k], v):
        raise ValueError(f"checkpoint {self.directory}/{step}: the restored '{k}' do not match the fingerprint "
                         "written with them (corrupted files)")

  @staticmethod
  def _warn(where, err):
    msg = f"WARNING: skipping checkpoint {where}: it is incomplete or damaged ({type(err).__name__}: {err})"
    logging.warning(msg)
    if jax.process_index() == 0:
      print(msg[:600], flush=True)

  def wait(self):
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"finishing an asynchronous checkpoint in {self.directory} failed: {e}. Earlier "
                            "checkpoints are intact; rerun to resume") from e

  def close(self):
    self._mgr.close()
