"""Thin Orbax wrapper: atomic, async, keeps the newest `max_to_keep`, restores onto given shardings, and never
restores a damaged checkpoint.

Restoring tells three cases apart (`restore_latest_intact`):
  damaged       fingerprint mismatch, missing or truncated files -> set aside, fall back to the previous step;
  incompatible  the saved state's structure or shapes differ from what this run builds (another optimizer or
                model setting) -> IncompatibleCheckpoint, nothing touched;
  transient     an I/O or permission error -> retried a few times, then CheckpointError; never set aside.

Each step directory holds `state` (params, optimizer state, step, counters) and
`meta` (JSON: model config, run config, mesh, code version, and a fingerprint of
the state: per-leaf sum|x| and sum x², compared on restore).

Frozen parameters (LoRA / DoRA's base weights, config.finetune.freeze) never change, so a run with a `frozen`
predicate stores them once, in FROZEN_DIR beside the step directories, and each step's `state` holds only the
trained parameters; its meta references the frozen store by path and fingerprint, checked on every restore.
"""
from __future__ import annotations

import errno
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from hnclip_jax import faults, hostmem, paths, storage


class CheckpointError(storage.StorageError):
  """A checkpoint could not be written or read; checkpoints on disk are untouched."""


class NonFiniteState(CheckpointError):
  """The state to be saved holds NaN or Inf; it was not written."""


class IncompatibleCheckpoint(ValueError):
  """The checkpoint is intact but holds a differently structured state than the one this run builds."""

  def __init__(self, where: str, differences: list[str], meta: dict):
    self.where, self.differences, self.meta = where, differences, meta
    super().__init__(f"{where}: the saved state differs from this run's: " + "; ".join(differences))


# errno values of storage trouble that may pass (a flaky network file system, permissions being fixed), as
# opposed to a file that is missing or malformed (damage).
TRANSIENT_ERRNOS = {errno.EIO, errno.EACCES, errno.EPERM, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE,
                    errno.EINTR, errno.ENOLCK, errno.ECONNRESET, errno.ECONNABORTED, errno.ENETUNREACH,
                    errno.EHOSTUNREACH, errno.EREMOTEIO}
# The same, as TensorStore (Orbax's array storage) words them in the ValueError it raises.
TRANSIENT_STATUS = ("PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "Input/output error",
                    "Permission denied")


def is_transient(err: BaseException) -> bool:
  """Whether `err` (or what caused it) is a storage error that may pass, rather than damage."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, paths.Unreachable):  # already retried; the server does not answer
      return False
    if isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS:
      return True
    if not isinstance(err, OSError) and any(code in str(err) for code in TRANSIENT_STATUS):
      return True
    err = err.__cause__ or err.__context__
  return False


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _shapes(tree) -> dict:
  """{'opt_state/1/0/mu/w': (shape, dtype)}: paths spelled alike for a live tree and Orbax's saved metadata
  (which stores named tuples as dicts)."""
  return {"/".join(_key_name(k) for k in path): (tuple(x.shape), str(x.dtype))
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}


def structure_differences(saved, target) -> list[str]:
  """What differs between a saved state's metadata tree and the abstract state a run would restore into:
  one line per kind of difference, with its count and the first path."""
  a, b = _shapes(saved), _shapes(target)
  order = lambda k: (not k.startswith("params/"), k)  # noqa: E731 — a parameter is the clearest first example
  only_saved, only_run = sorted(set(a) - set(b), key=order), sorted(set(b) - set(a), key=order)
  other = [k for k in sorted(set(a) & set(b), key=order) if a[k] != b[k]]
  out = []
  if only_saved:
    out.append(f"{len(only_saved)} array(s) in the checkpoint are not in this run's state (first: {only_saved[0]})")
  if only_run:
    out.append(f"{len(only_run)} array(s) of this run's state are not in the checkpoint (first: {only_run[0]})")
  if other:
    k = other[0]
    out.append(f"{len(other)} array(s) have another shape or dtype (first: {k}: checkpoint "
               f"{a[k][1]}{list(a[k][0])}, this run {b[k][1]}{list(b[k][0])})")
  return out


@jax.jit
def _leaf_stats(leaves):
  """Per leaf [max|x|, sum|x|/max, sum (x/max)²] in fp32: scaled so that no finite array can overflow them."""
  out = []
  for x in leaves:
    a = jnp.abs(x.astype(jnp.float32))
    m = jnp.max(a) if a.size else jnp.zeros((), jnp.float32)
    y = a / jnp.where(m > 0, m, 1.0)
    out.append(jnp.stack([m, jnp.sum(y), jnp.sum(jnp.square(y))]))
  return out


def _leaf_fingerprints(state: dict) -> dict:
  """{top-level key: (leaf paths, [n, 3] float64 stats of `_leaf_stats`)}, every key's leaves in one program (one
  compile per state structure, not one per key)."""
  flat = {k: jax.tree_util.tree_flatten_with_path(v)[0] for k, v in state.items()}
  stats = np.asarray(jax.device_get(_leaf_stats([x for leaves in flat.values() for _, x in leaves])),
                     np.float64).reshape(-1, 3)
  out, i = {}, 0
  for k, leaves in flat.items():
    out[k] = ([_path(p) for p, _ in leaves], stats[i:i + len(leaves)])
    i += len(leaves)
  return out


def _fingerprint_of(stats: dict) -> dict:
  return {k: (np.stack([st[:, 0] * st[:, 1], st[:, 0] ** 2 * st[:, 2]], axis=1).tolist() if len(st) else [])
          for k, (_, st) in stats.items()}


def fingerprint(tree) -> dict:
  """{top-level key: [[sum|x|, sum x²] per leaf]} — cheap, computed where the arrays live, in float64 from scaled
  fp32 sums, so that any finite value (even 1e30) has a finite fingerprint."""
  return _fingerprint_of(_leaf_fingerprints(tree))


def _nonfinite_of(stats: dict) -> tuple[list[str], int]:
  bad = [f"{k}/{p}" for k, (paths, st) in stats.items() for p, row in zip(paths, st) if not np.all(np.isfinite(row))]
  return bad, sum(len(paths) for paths, _ in stats.values())


def _same(saved, got, rtol=1e-4) -> bool:
  saved, got = np.asarray(saved, np.float64), np.asarray(got, np.float64)
  return saved.shape == got.shape and bool(np.all(np.abs(saved - got) <= rtol * np.abs(saved) + 1e-6))


FROZEN_DIR = "frozen_params"  # beside the step directories: <checkpoints>_frozen_params (a Workdir names its own)


def _path(k) -> str:
  return "/".join(_key_name(x) for x in k)


def prune(tree, keep) -> dict:
  """The nested dict `tree` with only the leaves whose "/"-path `keep(path)` accepts (empty dicts dropped)."""
  def go(node, prefix):
    if not isinstance(node, dict):
      return node if keep(prefix) else None
    out = {}
    for k, v in node.items():
      sub = go(v, f"{prefix}/{k}" if prefix else str(k))
      if sub is not None and not (isinstance(sub, dict) and not sub):
        out[k] = sub
    return out
  return go(tree, "")


def graft(a: dict, b: dict) -> dict:
  """The union of two nested dicts with disjoint leaves."""
  out = dict(a)
  for k, v in b.items():
    out[k] = graft(out[k], v) if k in out and isinstance(v, dict) else v
  return out


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True, create: bool = True,
               retries: int = 3, retry_wait_s: float = 1.0, frozen=None, overlap_steps: int | None = None,
               frozen_dir: str | None = None, damaged_dir: str | None = None):
    """frozen: parameter path -> True for parameters stored once in the frozen store (`frozen_dir`), not in every
    step. overlap_steps: check(step) waits for a background save once it has run beside this many steps (None:
    never waits; a failure then shows when the write ends, or at the next save). damaged_dir: where damaged steps
    are set aside. A run's Checkpointer gets both from its Workdir; by default they are siblings of `directory`."""
    self.directory = paths.resolve(directory, "checkpoint directory")
    self.frozen_dir = frozen_dir or self.directory.rstrip("/") + "_" + FROZEN_DIR
    self.damaged_dir = damaged_dir or self.directory.rstrip("/") + "_damaged"
    self.frozen = frozen
    self._frozen_fingerprint = None
    self._pending = None  # the step of the latest save started (async), until it is known to have failed
    self.retries, self.retry_wait_s = retries, retry_wait_s
    self.overlap_steps = overlap_steps
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                             enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  # ---- the frozen store ----
  def _split(self, state):
    """state -> (what a step directory holds, the frozen parameters)."""
    if self.frozen is None:
      return state, None
    return ({**state, "params": prune(state["params"], lambda p: not self.frozen(p))},
            prune(state["params"], self.frozen))

  def save_frozen(self, params) -> None:
    """Writes the frozen parameters once (atomically; replaces an earlier store). Called at a run's first start."""
    frozen = prune(params, self.frozen)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(self.frozen_dir, frozen, force=True)
    self._frozen_fingerprint = fingerprint({"params": frozen})["params"]

  def _restore_frozen(self, abstract_frozen, meta, where: str):
    ref = meta.get("frozen_params")
    if ref is None:
      raise IncompatibleCheckpoint(where, ["it stores every parameter, but this run keeps its frozen parameters "
                                           "apart (another config.finetune setting)"], meta)
    # Raised as CheckpointError: a bad store is not a damaged step (no step is set aside, nothing is moved).
    if not paths.isdir(self.frozen_dir):
      raise CheckpointError(f"{where} references the frozen parameters in {self.frozen_dir}, which is missing; "
                            "restore that directory (it is written once, at the run's first start). Nothing was "
                            "moved or deleted")
    try:
      with ocp.StandardCheckpointer() as ckptr:
        frozen = ckptr.restore(self.frozen_dir, abstract_frozen)
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"the frozen parameters in {self.frozen_dir} (referenced by {where}) cannot be read "
                            f"({type(e).__name__}: {e}); restore that directory. Nothing was moved or deleted") from e
    got = fingerprint({"params": frozen})["params"]
    if not _same(ref["fingerprint"], got):
      raise CheckpointError(f"{self.frozen_dir} does not hold the frozen parameters {where} was trained on "
                            "(fingerprint differs): it was replaced or damaged; restore it. Nothing was moved or "
                            "deleted")
    self._frozen_fingerprint = ref["fingerprint"]
    return frozen

  def finished_steps(self) -> list[int]:
    """Steps whose checkpoint directory is complete: Orbax's own finalisation (a rename on a local disk; on a bucket,
    which cannot rename, its commit marker inside the step's directory)."""
    try:
      return self._committed_steps()
    except OSError:
      return []

  def _committed_steps(self) -> list[int]:
    return sorted(int(d) for d in paths.listdir(self.directory)
                  if d.isdigit() and ocp.step.is_checkpoint_finalized(paths.join(self.directory, d)))

  def intact_note(self) -> str:
    try:
      done = self._committed_steps()
    except Exception as e:  # noqa: BLE001 (the storage that failed the run may not answer this either)
      return (f"the checkpoints in {self.directory} could not be listed ({storage.describe(e)}); those already "
              "complete are not touched by a failed run")
    return (f"the complete checkpoints ({', '.join(f'{self.directory}/{s}' for s in done)}) are kept" if done
            else "no checkpoint is complete yet")

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Starts an (async) save of `state`. Raises before writing anything: CheckpointError when an earlier
    background save failed or the disk lacks the space, NonFiniteState when `state` holds NaN or Inf."""
    self.check(sync=True)
    hostmem.release_free_memory()  # the previous save's host copy, before this one makes another
    state, frozen = self._split(state)
    if frozen is not None:
      if self._frozen_fingerprint is None:
        raise CheckpointError(f"{self.directory}: the frozen parameters were neither written (save_frozen) nor "
                              "restored before the first save")
      meta = {**meta, "frozen_params": {"path": self.frozen_dir, "fingerprint": self._frozen_fingerprint}}
    stats = _leaf_fingerprints(state)
    bad, total = _nonfinite_of(stats)
    if bad:
      raise NonFiniteState(f"the state after step {step} holds NaN or Inf in {len(bad)} of {total} arrays (first: "
                           f"{bad[0]}); checkpoint {step} was not written and {self.intact_note()}. The updates "
                           "overflowed or the data is bad: lower optimizer.lr (or raise warmup), check the data, "
                           "then rerun from the last checkpoint")
    meta = {**meta, "fingerprint": _fingerprint_of(stats)}
    try:  # a directory that became read-only would make Orbax's writer threads wait minutes for each other
      storage.check_writable(self.directory, "the checkpoint directory")
    except storage.StorageError as e:
      raise CheckpointError(f"checkpoint {self.directory}/{step} was not written: {e}; "
                            f"{self.intact_note()}") from e
    # What this process writes: its primary copy of each shard (all of it on one process).
    need = sum(int(sh.data.nbytes) for x in jax.tree.leaves(state) for sh in getattr(x, "addressable_shards", [])
               if sh.replica_id == 0)
    free = paths.free_bytes(self.directory)
    if free is not None and free < need:
      raise CheckpointError(f"checkpoint {self.directory}/{step} needs about {need / 2**20:.1f} MiB, but only "
                            f"{free / 2**20:.1f} MiB are free there; nothing was written and "
                            f"{self.intact_note()}. Free space (or lower config.max_to_keep), then rerun the same "
                            "command to resume")
    try:
      faults.maybe_fail("save_fails", step)
      saved = self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)), force=force)
    except Exception as e:  # noqa: BLE001 — any write failure (disk full, permissions, I/O) ends up here
      self._pending = None
      raise CheckpointError(f"writing checkpoint {self.directory}/{step} failed ({storage.describe(e)}); "
                            f"{self.intact_note()}. Free space or fix the directory, then rerun the same command "
                            "to resume") from e
    self._pending = step if saved else None  # Orbax may decline a save (returns False): nothing to watch
    faults.maybe_kill("kill_during_save", step)
    return saved

  def _remove_partial(self, step) -> None:
    """Deletes what a failed save of `step` left (only takes space; nothing in it is usable)."""
    if step is None or jax.process_index() != 0:
      return
    try:
      for d in paths.listdir(self.directory):
        partial = d.startswith(f"{step}.orbax-checkpoint-tmp") or (
            d == str(step) and not ocp.step.is_checkpoint_finalized(paths.join(self.directory, d)))
        if partial:
          paths.rmtree(paths.join(self.directory, d))
    except OSError:
      pass

  def _background_failure(self, step, cause: str) -> CheckpointError:
    return CheckpointError(f"writing checkpoint {self.directory}/{step} failed in the background ({cause}); "
                           f"{self.intact_note()}. Free space or fix the directory, then rerun the same command to "
                           "resume")

  def check(self, step: int | None = None, sync: bool = False) -> None:
    """Raises CheckpointError naming the step if the latest background save failed. Call it after every step with
    that step: once the save has run beside `overlap_steps` steps it waits for the save (every process at the same
    step, so they agree to stop); before that it is cheap, and on one process it looks once the save is over."""
    if self._pending is None:
      return
    if step is not None and self.overlap_steps is not None and step - self._pending >= self.overlap_steps:
      sync = True
    if not sync and (jax.process_count() > 1 or self._mgr.is_saving_in_progress()):
      return
    step = self._pending
    self.wait()  # returns at once when the save is over; raises what Orbax reports
    # Orbax may only log a failed background write: a step that is not on disk once its save is over failed.
    failed = jax.process_index() == 0 and step not in self.finished_steps()
    if jax.process_count() > 1:
      failed = bool(np.max(multihost_utils.process_allgather(np.int32(failed))))
    if failed:
      self._remove_partial(step)
      log = storage.active_debug_log()
      raise self._background_failure(step, log.last_error if log is not None and log.last_error else
                                     "Orbax logged the cause")

  def read_meta(self, step: int) -> dict:
    return self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _read(self, step: int, args):
    """Orbax's restore of `step`, the bucket's server watched while it reads (paths.watched)."""
    return paths.watched(lambda: self._mgr.restore(step, args=args), self.directory,
                         f"reading checkpoint {self.directory}/{step}")

  def restore(self, step: int, abstract_state):
    """abstract_state: tree of jax.ShapeDtypeStruct with `.sharding` set -> restored arrays on those shardings.

    Raises ValueError if the restored values do not match the fingerprint recorded at save time.
    """
    meta = self.read_meta(step)
    faults.maybe_fail_read("restore_io", step)
    slim, abstract_frozen = self._split(abstract_state)
    state = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(slim)))["state"]
    self._verify(step, meta, state)
    if abstract_frozen is not None:
      state = {**state, "params": graft(state["params"],
                                        self._restore_frozen(abstract_frozen, meta, f"{self.directory}/{step}"))}
    return state

  def saved_structure(self, step: int):
    """The saved state's tree of array metadata (shapes and dtypes; no array is read)."""
    from etils import epath
    where = f"{self.directory}/{step}"
    return paths.watched(lambda: ocp.PyTreeCheckpointHandler().metadata(epath.Path(where) / "state"),
                         self.directory, f"reading checkpoint {where}")

  def _retrying(self, fn, where: str):
    """fn(), retried with backoff while it fails with a transient storage error; then CheckpointError."""
    for attempt in range(self.retries):
      try:
        return fn()
      except Exception as e:  # noqa: BLE001
        if not is_transient(e):
          raise
        if attempt + 1 == self.retries:
          raise CheckpointError(
              f"reading checkpoint {where} failed {self.retries} times with a storage error "
              f"({type(e).__name__}: {e}). Nothing was moved or deleted; check the file system and permissions, "
              "then rerun to resume") from e
        wait = self.retry_wait_s * 2 ** attempt
        logging.warning("reading %s: %s; retrying in %.1fs", where, e, wait)
        time.sleep(wait)

  def restore_latest_intact(self, abstract_state, check_meta=None):
    """Newest checkpoint that restores and verifies -> (step, state, meta), or (None, None, None) if none.

    A damaged checkpoint (half-written, truncated or corrupted files) is skipped with a warning naming it and,
    once an intact one is restored (or none is left), moved to checkpoints_damaged/. Raised without touching
    anything: whatever `check_meta(meta, where)` raises (e.g. another model config), IncompatibleCheckpoint when
    the saved state's structure or shapes differ from `abstract_state`, CheckpointError when storage errors
    persist through the retries.
    """
    damaged = []
    found = (None, None, None)
    for step in reversed(self.all_steps()):
      where = f"{self.directory}/{step}"
      try:
        meta = self._retrying(lambda: self.read_meta(step), where)
        saved = self._retrying(lambda: self.saved_structure(step), where)
      except (CheckpointError, paths.Unreachable):  # not damage: nothing is set aside
        raise
      except Exception as e:  # noqa: BLE001 — unreadable metadata: damaged
        self._warn(where, e)
        damaged.append(step)
        continue
      if check_meta is not None:
        check_meta(meta, where)
      differences = structure_differences(saved, self._split(abstract_state)[0])
      if differences:
        raise IncompatibleCheckpoint(where, differences, meta)
      try:
        found = (step, self._retrying(lambda: self.restore(step, abstract_state), where), meta)
        break
      except (CheckpointError, paths.Unreachable):  # not damage: nothing is set aside
        raise
      except Exception as e:  # noqa: BLE001 — unreadable or fingerprint mismatch: damaged
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
      aside = self.damaged_dir
      paths.makedirs(aside)
      for step in steps:
        dst = paths.join(aside, f"{step}-{int(time.time())}")
        paths.move(paths.join(self.directory, str(step)), dst)
        print(f"WARNING: moved damaged checkpoint {self.directory}/{step} to {dst}", flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints set aside")
    self._mgr.reload()

  def restore_params(self, step: int, abstract_params):
    """Only the model parameters of a checkpoint (for eval and fine-tuning starts), verified; the frozen ones from
    the frozen store when the checkpoint references one."""
    meta = self.read_meta(step)
    saved = set(_shapes(self.saved_structure(step)))
    trained, frozen = abstract_params, None
    if meta.get("frozen_params") is not None:
      trained = prune(abstract_params, lambda p: f"params/{p}" in saved)
      frozen = prune(abstract_params, lambda p: f"params/{p}" not in saved)
    restored = self._read(step, ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": trained},
        restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), {"params": trained}),
        partial_restore=True)))
    self._verify(step, meta, restored["state"], keys=("params",))
    params = restored["state"]["params"]
    if frozen is not None:
      params = graft(params, self._restore_frozen(frozen, meta, f"{self.directory}/{step}"))
    return params

  def read_for_eval(self, step: int, read):
    """read(step) with a storage error retried and damage reported as CheckpointError naming the step, what is
    wrong and the other complete steps to evaluate instead (eval.py --step)."""
    where = f"{self.directory}/{step}"
    try:
      return self._retrying(lambda: read(step), where)
    except (CheckpointError, paths.Unreachable):
      raise
    except Exception as e:  # noqa: BLE001 — truncated files, unreadable metadata, fingerprint mismatch
      others = [s for s in self.finished_steps() if s != step]
      raise CheckpointError(f"checkpoint {where} cannot be read: it is damaged ({storage.describe(e)}). Nothing "
                            "was changed; evaluate another step with --step=N" +
                            (f" (complete: {others})" if others else "")) from e

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
    """Waits for the background save; CheckpointError naming its step if it failed."""
    try:
      paths.watched(self._mgr.wait_until_finished, self.directory, "a checkpoint being written")
      self._mgr.check_for_errors()
    except paths.Unreachable as e:  # its partial files cannot be removed either; Orbax skips them on resume
      step, self._pending = self._pending, None
      raise CheckpointError(f"checkpoint {self.directory}/{step} was not written: {e}; the checkpoints already "
                            "complete are kept. Once the bucket answers again, rerun the same command to resume") \
          from e
    except Exception as e:  # noqa: BLE001
      step, self._pending = self._pending, None
      self._remove_partial(step)
      raise self._background_failure(step, storage.describe(e)) from e
    if self._pending is not None:
      hostmem.release_free_memory()
    self._pending = None

  def close(self, quiet: bool = False):
    """Finishes outstanding saves and closes. quiet=True (on the way out of a failed run): a library error here is
    kept in the debug log instead of hiding the error that ended the run."""
    try:
      self.wait()
      self._mgr.close()
    except Exception as e:  # noqa: BLE001
      if not quiet:
        raise
      log = storage.active_debug_log()
      if log is not None:
        log.exception(e)
