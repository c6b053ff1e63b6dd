"""The on-disk formats of a train.py workdir and of a converted weights directory: their one reader and writer, and
the one place a path inside a run directory is spelled (`LAYOUT`, `Workdir`; docs/workdir.md is `layout_markdown()`).

    CONVERTED/                     python -m hnclip_jax.pretrained.convert, Pretrained.save
      model.json, params/ (Orbax), tokenizer/

Every check that a config fits a workdir (model, data, the state's structure) lives here.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax

from hnclip_jax import checkpoint, frameworks, paths, storage
from hnclip_jax.config import MODEL_RUNTIME_FIELDS, flatten
from hnclip_jax.data.saved_tokenizer import load_tokenizer
from hnclip_jax.models import CLIPConfig
from hnclip_jax.models.clip import normalise_fields

MODEL_JSON = "model.json"
TOKENIZER = "tokenizer"
PARAMS = "params"

# Every file and folder of a run directory: (Workdir attribute, path in the workdir, written by, what it holds). Only
# Workdir joins these names to a workdir; everything else is handed the path (docs/workdir.md is this table).
LAYOUT = (
    ("model_json", MODEL_JSON, "train.py", "the resolved architecture (CLIPConfig without the runtime fields)"),
    ("tokenizer_dir", TOKENIZER + "/", "train.py", "the tokenizer the run uses (fitted on the training captions, "
     "or the weights')"),
    ("data_json", "data.json", "train.py", "the data config the run trains on (written at the first start)"),
    ("checkpoints", "checkpoints/", "train.py", "`<step>/`: Orbax's `state` and `meta` of each kept step "
     "(checkpoint.py)"),
    ("checkpoints_frozen", "checkpoints_frozen_params/", "train.py (config.finetune: LoRA, DoRA, frozen towers)",
     "the parameters that never change, stored once (each step's `state` holds only the trained ones)"),
    ("checkpoints_damaged", "checkpoints_damaged/", "train.py (a resume)", "`<step>-<time>/`: checkpoints found "
     "damaged, set aside for inspection"),
    ("metrics", "metrics.jsonl", "train.py", "one JSON line of training metrics per logged step"),
    ("tensorboard", "tensorboard/", "train.py", "TensorBoard event files; profiles (config.profile) under "
     "`plugins/profile/`, process i > 0 in `process_i/`"),
    ("eval_tensorboard", "tensorboard/eval/", "eval.py --watch", "the eval job's scalars (a run `eval` in "
     "TensorBoard)"),
    ("goodput", "goodput/", "train.py", "`<start>-p<i>.json`: the wall-time account of process i of the train.py "
     "started at `<start>` (UTC), rewritten whole at each record (goodput.py)"),
    ("caption_index", "batching/caption_index.npy", "train.py (config.data.batching='clustered')", "the caption "
     "embeddings the clustered batches are drawn from"),
    ("caption_index_meta", "batching/caption_index.json", "train.py (config.data.batching='clustered')", "its "
     "size, fingerprint and the weights it was built from"),
    ("lock", ".lock", "train.py", "one run per workdir (paths.lease): local, the running train.py's pid under an "
     "flock; on a bucket a lease object (host, pid, last renewal) created and renewed under generation "
     "preconditions"),
    ("debug_log", "debug.log", "train.py, eval.py (a local workdir)", "library warnings and tracebacks (on a "
     "bucket: a temp file on the host, named in each error line)"),
    ("eval_results", "eval_results.json", "eval.py", "the latest result"),
    ("eval_history", "eval_history.jsonl", "eval.py", "every result, one a line (one per benchmark; an eval "
     "job's rows say \"job\": \"watch\")"),
    ("eval_table", "eval_table.md, eval_table.json", "eval.py --benchmarks / --watch", "the latest Table 1"),
    ("best", "best/", "eval.py --watch", "the best step the job found, as a converted directory (model.json, "
     "params/, tokenizer/) + best.json"),
)
BEST_JSON = "best.json"  # in best/: which step, by which metric

# Config keys that never change what a run computes or stores: not worth naming when a resume differs.
BOOKKEEPING = ("total_steps", "log_every", "checkpoint_every", "eval_every", "max_to_keep", "eval_batch_size",
               "workers", "compilation_cache_dir", "async_checkpointing", "checkpoint_overlap_steps", "init_from",
               "data.data_dir")
BOOKKEEPING_PREFIXES = ("diagnostics.", "eval.")
# A data config's identity: every data key except where its build is stored.
DATA_LOCATION_KEYS = ("data_dir", "bucket_reads")  # where and how the data is read, not which data


def _write_json(path: str, obj) -> None:
  """Atomic: a reader sees the old file or the new one, never half of one (a failed write leaves no temp file)."""
  storage.write_text_atomic(path, json.dumps(obj, indent=2))


def read_model(directory: str) -> CLIPConfig | None:
  path = paths.join(directory, MODEL_JSON)
  if not paths.exists(path):
    return None
  return CLIPConfig.from_dict(frameworks.upgrade_model_dict(json.loads(paths.read_text(path)))).validate()


def write_model(directory: str, cfg: CLIPConfig) -> None:
  _write_json(paths.join(directory, MODEL_JSON),
              {k: v for k, v in dataclasses.asdict(cfg).items() if k not in MODEL_RUNTIME_FIELDS})


def read_tokenizer(directory: str, required: bool = True):
  path = paths.join(directory, TOKENIZER)
  if not paths.isdir(path):
    if required:
      raise FileNotFoundError(f"no tokenizer in {path}")
    return None
  with paths.local_copy(path) as local:  # the tokenizer libraries read local files; all is in memory after
    return load_tokenizer(local)


def write_tokenizer(directory: str, tokenizer) -> None:
  with paths.staged_dir(paths.join(directory, TOKENIZER)) as local:
    tokenizer.save(local)


def is_converted(directory: str) -> bool:
  return paths.exists(paths.join(directory, MODEL_JSON)) and paths.isdir(paths.join(directory, PARAMS))


def is_workdir(directory: str) -> bool:
  return paths.isdir(Workdir(directory).checkpoints)


def check_model_compatible(saved: dict | None, model_cfg: CLIPConfig, where: str) -> None:
  """Raises if a saved model description (model.json or a checkpoint's meta) differs from `model_cfg`."""
  if saved is None:
    raise ValueError(f"{where} has no model config in its metadata; it was not written by hnclip_jax")
  mine = dataclasses.asdict(model_cfg)
  # A field the checkpoint predates has its default (e.g. token_projection, added after the first workdirs).
  saved = {**{f.name: f.default for f in dataclasses.fields(CLIPConfig)},
           **normalise_fields(frameworks.upgrade_model_dict(saved))}
  diffs = [f"model.{k}: checkpoint={saved.get(k)!r}, config={v!r}" for k, v in mine.items()
           if k not in MODEL_RUNTIME_FIELDS and saved.get(k) != v]
  if diffs:
    raise ValueError(f"{where} was written for a different model: " + "; ".join(diffs) +
                     ". Use the config it was trained with, or a fresh --workdir "
                     "(--config.init_from=THAT_WORKDIR takes its parameters into a new run).")


def config_changes(saved: dict | None, config, *, bookkeeping: bool = False) -> list[str]:
  """['key: saved -> now', ...] between a checkpoint's recorded run config and `config` (bookkeeping keys such as
  total_steps left out unless asked for)."""
  if not saved:
    return []
  old = flatten(saved)
  new = flatten(json.loads(config.to_json()) if hasattr(config, "to_json") else config)
  out = []
  for k in sorted(set(old) | set(new)):
    if not bookkeeping and (k in BOOKKEEPING or k.startswith(BOOKKEEPING_PREFIXES)):
      continue
    if k in old and k in new and old[k] != new[k]:
      out.append(f"{k}: {old[k]!r} -> {new[k]!r}")
    elif k in old and k not in new:
      out.append(f"{k}: {old[k]!r} -> (not in this config)")
    elif k not in old and k in new:
      out.append(f"{k}: (not recorded) -> {new[k]!r}")
  return out


def resolve_path(path: str) -> str:
  """--workdir resolved (paths.resolve) as a run directory: not the top of its store. A run writes checkpoints/,
  metrics.jsonl, tensorboard/, best/ and a lease there; at a bucket's root they would lie among every other run's
  objects and a second run could not be told apart. ValueError naming the flag."""
  resolved = paths.resolve(path, "--workdir")
  if paths.is_root(resolved):
    raise ValueError(f"--workdir={path} is the root of its store: a run writes checkpoints/, metrics.jsonl, "
                     f"tensorboard/ and more there, among whatever else it holds. Give the run a folder of its own, "
                     f"e.g. --workdir={paths.join(resolved, 'RUN_NAME')}")
  return resolved


def layout_markdown() -> str:
  """The run directory's layout as the Markdown table in docs/workdir.md."""
  rows = ["| path in the workdir | written by | what it holds |", "|---|---|---|"]
  rows += [f"| `{name}` | {who} | {what} |" for _, name, who, what in LAYOUT]
  return "\n".join(rows) + "\n"


class Workdir:
  """A train.py workdir: every path in it (an attribute per LAYOUT entry), and its readers and writers. Reading
  never creates anything on disk."""

  def __init__(self, path: str):
    self.path = paths.resolve(path, "--workdir")
    for attr, name, _, _ in LAYOUT:
      if attr != "eval_table":
        setattr(self, attr, paths.join(self.path, *name.rstrip("/").split("/")))
    self.best_json = paths.join(self.best, BEST_JSON)

  def checkpoint(self, step: int) -> str:
    """Where checkpoint `step` is (or would be) written."""
    return paths.join(self.checkpoints, str(step))

  def eval_table(self, ext: str) -> str:
    """The latest Table 1 as `ext` ("md" or "json")."""
    return paths.join(self.path, f"eval_table.{ext}")

  def profile_dir(self, process: int) -> str:
    """Where process `process` writes its profiler traces (TensorBoard's profile plugin finds them there)."""
    return paths.join(self.tensorboard, *([f"process_{process}"] if process else []))

  # ---- model and tokenizer ----
  def model(self) -> CLIPConfig | None:
    return read_model(self.path)

  def tokenizer(self, required: bool = True):
    return read_tokenizer(self.path, required)

  def save_model(self, cfg: CLIPConfig, tokenizer) -> None:
    if jax.process_index() == 0:
      paths.makedirs(self.path)
      write_tokenizer(self.path, tokenizer)
      write_model(self.path, cfg)

  # ---- data ----
  def data(self) -> dict | None:
    """The data config recorded at the run's first start, or None (a workdir from before data.json existed)."""
    if not paths.exists(self.data_json):
      return None
    try:
      return json.loads(paths.read_text(self.data_json))["data"]
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{self.data_json} is damaged ({type(e).__name__}: {e}); it records the data this workdir "
                       "trains on: restore it from a backup, or rewrite it as {\"data\": {...}} with the data "
                       "config the run started with") from e

  def save_data(self, data_config: dict) -> None:
    if jax.process_index() == 0:
      try:
        _write_json(self.data_json, {"data": dict(data_config)})
      except OSError as e:
        raise storage.StorageError(f"writing {self.data_json} failed ({storage.describe(e)}); nothing was trained "
                                   "yet. Free space or fix the workdir and rerun the same command") from e

  # ---- checkpoints ----
  def checkpoint_steps(self) -> list[int]:
    """Steps with a finished checkpoint directory (no Orbax manager, nothing created)."""
    return sorted(int(d) for d in paths.listdir(self.checkpoints)
                  if d.isdigit() and paths.isdir(paths.join(self.checkpoints, d)))

  def checkpointer(self, *, max_to_keep: int = 3, async_save: bool = True, overlap_steps: int | None = None,
                   read_only: bool = False, frozen=None):
    if read_only and not paths.isdir(self.checkpoints):
      raise FileNotFoundError(f"no checkpoints in {self.checkpoints}; train first with "
                              f"train.py --workdir {self.path}")
    return checkpoint.Checkpointer(self.checkpoints, max_to_keep=max_to_keep, async_save=async_save,
                                   overlap_steps=overlap_steps, create=not read_only, frozen=frozen,
                                   frozen_dir=self.checkpoints_frozen, damaged_dir=self.checkpoints_damaged)

  # ---- goodput (goodput.py) ----
  def goodput_record(self, attempt: str) -> str:
    return paths.join(self.goodput, f"{attempt}.json")

  def goodput_records(self) -> list[dict]:
    """Every process start's account in this workdir (goodput.py), unordered; a damaged one left out."""
    folder = self.goodput
    if not paths.isdir(folder):
      return []
    out = []
    for name in paths.listdir(folder):
      if name.endswith(".json"):
        try:
          out.append(json.loads(paths.read_text(paths.join(folder, name))))
        except ValueError:
          print(f"warning: {paths.join(folder, name)} is damaged; its process start is left out of the goodput "
                "account", flush=True)
    return out

  def saved_steps(self) -> list[int]:
    """Every step train.py started a checkpoint save of, by its processes' goodput records (kept or deleted
    since by max_to_keep); [] for a workdir from before those records."""
    return sorted({int(k) for r in self.goodput_records() if r.get("process") == 0 for k in r.get("checkpoints", {})})

  # ---- eval results ----
  def record_eval(self, result: dict, details: dict | None = None, latest: dict | None | bool = True) -> None:
    """Appends `result` and `details` (e.g. the full data config) to eval_history.jsonl (never rewritten) and
    makes `latest` (default: `result`; False: none) eval_results.json (the latest)."""
    if jax.process_index() != 0:
      return
    row = {**result, **(details or {}), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    latest = result if latest is True else latest
    writes = [(self.eval_history, lambda: storage.append_jsonl(self.eval_history, row))]
    if latest:
      writes.append((self.eval_results, lambda: _write_json(self.eval_results, latest)))
    for path, write in writes:
      try:
        write()
      except OSError as e:
        raise storage.StorageError(f"recording the result of step {result.get('step')} in {path} failed "
                                   f"({storage.describe(e)}); the recall printed above was not saved. Free space "
                                   "or fix the workdir and rerun eval.py") from e

  def eval_records(self) -> list[dict]:
    """Every recorded eval result; lines a cut-off write left are set aside with a warning."""
    rows, torn = storage.read_jsonl(self.eval_history)
    if torn:
      print(storage.torn_warning(self.eval_history, torn), flush=True)
    return rows
