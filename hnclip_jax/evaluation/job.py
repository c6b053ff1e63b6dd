"""eval.py's work: checkpoints of a train.py workdir evaluated on one or several benchmarks, and an eval job that
follows a training run (`eval.py --watch`).

`Evaluator` is set up once per job: the model and tokenizer (the workdir's), the encoders (jitted once; every
benchmark reuses them, as the batch and image shapes are the same), and each benchmark's data (built once, at its
first use). `evaluate(step)` reads that checkpoint's parameters and returns one result row per benchmark.

`watch` evaluates each new complete checkpoint once, in step order, while training runs beside it: it reads only
(never the training job's lock, nothing written under checkpoints/), skips checkpoints that training deletes
(max_to_keep) before or while they are read, resumes where its history (eval_history.jsonl, rows with
"job": "watch") says it stopped, keeps the best step's parameters in WORKDIR/best/ (a converted directory that
`pretrained.load(WORKDIR, step="best")` reads) and ends when the final step (the run's config.total_steps) is
evaluated or no new checkpoint came for a while.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax

from hnclip_jax import frameworks, paths, sharding, storage
from hnclip_jax.data import builders, pipeline
from hnclip_jax.evaluation import benchmarks as bench_lib, embedding
from hnclip_jax.evaluation.retrieval import recall_from_scores
from hnclip_jax.experiment import describe_data
from hnclip_jax.metrics import MetricsWriter, log
from hnclip_jax.models import abstract_model
from hnclip_jax.workdir import Workdir, check_model_compatible, write_model, write_tokenizer



@dataclasses.dataclass(frozen=True)
class Request:
  """What an eval.py command asks for (its flags)."""
  workdir: str
  step: int | None = None
  watch: bool = False
  benchmarks: str | None = None
  split: str | None = None
  report: str | None = None
  score: str = "cosine"
  poll_s: float = 10.0
  timeout_s: float = 3600.0
  newest_only: bool = False
  report_samples: int = 20
  report_failures: int = 50
  report_twin_threshold: float = 0.9


def check_request(r: Request) -> int | None:
  """Every check on an eval request that needs no model: the workdir (waited for with --watch), flags that do not
  go together, a workdir the result can be written to, the step. Returns the step to evaluate (None: --watch)."""
  if paths.isfile(r.workdir):
    raise ValueError(f"--workdir={r.workdir} is a file; pass the directory train.py wrote to")
  if r.watch and r.step is None:  # an eval job may start before the training job has set up its workdir
    wait_for_run(r.workdir, r.poll_s, r.timeout_s)
  if not paths.isdir(r.workdir):
    raise FileNotFoundError(f"--workdir={r.workdir} does not exist; pass the directory train.py wrote to")
  if r.watch and r.step is not None:
    raise ValueError(f"--step={r.step} and --watch: --watch evaluates every new checkpoint as training writes "
                     "it; pass one of them")
  if r.watch and r.report:
    raise ValueError("--report with --watch: the report is for one checkpoint; run eval.py --step=N --report=DIR "
                     "on the step you want to look at")
  if r.benchmarks and r.split:
    raise ValueError(f"--split={r.split} with --benchmarks: each benchmark's split is "
                     "config.eval.benchmarks.NAME.split (default 'test'); set it there")
  # eval.py records its result in the workdir: find out now, not after the embedding pass
  storage.check_writable(r.workdir, "the workdir, where eval.py records its result (eval_results.json),")
  wd = Workdir(r.workdir)
  steps = wd.checkpoint_steps()
  if not steps and not r.watch:
    raise FileNotFoundError(f"no checkpoints in {wd.checkpoints}; train first with train.py --workdir {r.workdir}")
  if r.watch:
    return None
  step = steps[-1] if r.step is None else r.step
  if step not in steps:
    raise ValueError(f"--step={step} has no checkpoint in {wd.checkpoints}; available steps: {steps}")
  return step


def start(run, r: Request, order: list[str]) -> "Evaluator":
  """The resolved eval run's benchmarks (--benchmarks, else the run's own data and split), checked, and its
  Evaluator (model, tokenizer and encoders, compiled once), with what it evaluates logged."""
  config = run.config
  if r.benchmarks:
    benchmarks = bench_lib.resolve(config, r.benchmarks, order=order)
  else:
    benchmarks = [bench_lib.own_data(config, r.split or config.data.eval_split)]
  for b in benchmarks:
    builders.check_data_config(b.data)
  if r.watch and jax.process_count() > 1:
    raise ValueError(f"--watch runs as one process ({jax.process_count()} joined): give it its own devices or a CPU "
                     "host (docs/evaluation.md)")
  ev = Evaluator(run, benchmarks, r.score)
  if r.benchmarks:
    log("benchmarks: " + "; ".join(f"{b.name}: {describe_data(b.data)}, split '{b.split}'" for b in benchmarks))
  else:
    log(f"{run.data_note}; split '{benchmarks[0].split}'")
  if ev.scorer is not None:
    log(f"score: {ev.scorer.describe(config)}")
  return ev


def follow(ev: "Evaluator", r: Request) -> dict:
  """--watch: every checkpoint the training run writes, evaluated once (`watch`), with its summary logged."""
  config, wd = ev.config, ev.wd
  if r.benchmarks:  # the metric must exist before the first (long) evaluation
    bench_lib.metric(bench_lib.table([_placeholder(b) for b in ev.benchmarks]), config.eval.best_metric)
  log(f"watching {wd.checkpoints} (every {r.poll_s:g} s; ends after the final step, or {r.timeout_s:g} s without a "
      f"new checkpoint); best by {config.eval.best_metric} -> {wd.best}")
  summary = watch(ev, poll_s=r.poll_s, timeout_s=r.timeout_s, newest_only=r.newest_only,
                  metric=config.eval.best_metric)
  best = summary["best"]
  log(f"evaluated steps {summary['evaluated']}" + (f", skipped {summary['skipped']}" if summary["skipped"] else "")
      + (f", missed {summary['missed']} (deleted before this job saw them)" if summary["missed"] else "")
      + (f"; best: step {best['step']} ({config.eval.best_metric} {best['value']:.2f}) in {wd.best}"
         if best else "") + f"; history: {wd.eval_history}, TensorBoard: {wd.eval_tensorboard}")
  return summary


def evaluate_step(ev: "Evaluator", step: int, r: Request) -> list[dict]:
  """One checkpoint on every benchmark: the rows logged and recorded (eval_history.jsonl, eval_results.json; Table
  1 with --benchmarks), and the HTML report with --report. Returns the rows."""
  wd, benchmarks = ev.wd, ev.benchmarks
  _meta, params = ev.read(step)
  rows, embedded = [], []
  for b in benchmarks:
    row, emb = ev.evaluate(params, step, b)
    rows.append(row)
    embedded.append(emb)
  log_rows(rows, named=bool(r.benchmarks))
  if r.benchmarks:
    tab = bench_lib.table(rows)
    for i, (row, b) in enumerate(zip(rows, benchmarks)):  # eval_results.json: the table (a failed write: one line)
      wd.record_eval(row, {"data": dict(b.data)}, latest=tab if i == len(rows) - 1 else False)
    md = write_table(wd, tab)
    if jax.process_index() == 0:
      print(md, flush=True)
  else:
    wd.record_eval(rows[0], {"data": dict(benchmarks[0].data)})
  if r.report and jax.process_index() == 0:
    _write_reports(ev, step, r, rows, embedded)
  what = (f"{len(rows)} benchmarks; wrote {wd.eval_table('md')}, {wd.eval_table('json')} and {wd.eval_results}"
          if r.benchmarks else
          f"{embedding.describe_counts(rows[0])} of {describe_data(benchmarks[0].data)}, split "
          f"'{benchmarks[0].split}'; wrote {wd.eval_results}")
  log(f"step {step}, {what} (history: {wd.eval_history})")
  return rows


def _write_reports(ev, step, r: Request, rows, embedded) -> None:
  from hnclip_jax.evaluation.report import write_report
  for row, b, (img, txt, caption_image) in zip(rows, ev.benchmarks, embedded):
    _, encoded, captions = ev.data(b)
    out = paths.resolve(r.report, "--report")
    target = paths.join(out, b.name) if r.benchmarks else out
    with paths.staged_dir(target) as local:  # a bucket: written locally, then uploaded
      page = write_report(
          local, img=img, txt=txt, caption_image=caption_image,
          captions=[c for caps in captions for c in caps], image_bytes=lambda i, e=encoded: e[i]["image"],
          recall={"t2i": row["t2i"], "i2t": row["i2t"]}, seed=ev.config.seed, num_samples=r.report_samples,
          max_failures=r.report_failures, twin_threshold=r.report_twin_threshold,
          meta={"workdir": r.workdir, "step": int(step), "data": describe_data(b.data), "split": b.split,
                "images": row["num_images"], "captions": row["num_captions"]})
    log(f"report: {paths.join(target, paths.basename(page))}")


def _placeholder(b) -> dict:
  """A result row of zeros (to check config.eval.best_metric against the table's names before evaluating)."""
  zeros = {f"R@{k}": 0.0 for k in (1, 5, 10)}
  return {"step": 0, "benchmark": b.name, "dataset": b.data.name, "split": b.split, "num_images": 0,
          "num_captions": 0, "t2i": zeros, "i2t": zeros}


class Gone(Exception):
  """A checkpoint that disappeared (training's max_to_keep deleted it, or it was set aside) before it was read."""


class Evaluator:

  def __init__(self, run, benchmarks: list, score: str):
    """`run`: the resolved eval run (experiment.resolve(..., "eval")): its config, workdir, model, tokenizer, mesh."""
    self.config, self.wd, self.benchmarks, self.score, self.mesh = run.config, run.wd, benchmarks, score, run.mesh
    self.model_cfg, self.tokenizer = run.model, run.tokenizer
    graphdef, abstract_params = abstract_model(self.model_cfg)
    param_sh = sharding.state_shardings({"params": abstract_params}, "params", run.mesh, run.rules)["params"]
    self.target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params,
                               param_sh)
    self.encoders = embedding.make_embed_fn(graphdef, run.mesh, param_sh)
    self.scorer = frameworks.score(score, self.model_cfg, run.wd.path)  # None: cosine
    self.score_encoders = None if self.scorer is None else embedding.make_score_embed_fn(
        graphdef, run.mesh, param_sh, self.scorer, run.config)
    self.wd = run.wd
    self.ckpt = run.wd.checkpointer(read_only=True)
    self._data = {}

  def data(self, b):
    """(decoded source, undecoded source, caption lists) of a benchmark, built at its first use."""
    if b.name not in self._data:
      source = builders.data_source(b.data, b.split)
      encoded = builders.data_source(b.data, b.split, decode_images=False)  # every process (it may sync hosts)
      self._data[b.name] = (source, encoded, pipeline.caption_lists(encoded))
    return self._data[b.name]

  def read(self, step: int):
    """-> (meta, params) of a checkpoint; CheckpointError naming it when damaged."""
    meta = self.ckpt.read_for_eval(step, self.ckpt.read_meta)
    check_model_compatible(meta.get("model"), self.model_cfg, f"{self.ckpt.directory}/{step}")
    return meta, self.ckpt.read_for_eval(step, lambda s: self.ckpt.restore_params(s, self.target))

  def read_racing(self, step: int, settle_s: float = 1.0):
    """read(step) while training may delete the step beside us: Gone when it disappears before or while it is
    read (a deletion in progress leaves a partial directory for a moment: looked at again after settle_s)."""
    path = self.wd.checkpoint(step)
    if not paths.isdir(path):
      raise Gone(step)
    try:
      return self.read(step)
    except Exception:  # noqa: BLE001
      time.sleep(settle_s)
      if not paths.isdir(path):
        raise Gone(step) from None
      raise

  def evaluate(self, params, step: int, b) -> tuple[dict, tuple]:
    """One benchmark -> (result row, (img, txt, caption_image) for a report)."""
    source, _, captions = self.data(b)
    c = self.config
    img, txt, caption_image = embedding.embed_split(params, self.encoders, source, self.tokenizer, self.model_cfg,
                                                     self.mesh, c.eval_batch_size, captions)
    res = embedding.retrieval_result(img, txt, caption_image)
    if self.scorer is not None:
      img_x, txt_x, _ = embedding.embed_split(params, self.score_encoders, source, self.tokenizer, self.model_cfg,
                                               self.mesh, c.eval_batch_size, captions)
      res.update(recall_from_scores(self.scorer.scores(img, txt, img_x, txt_x, c), caption_image))
    row = {"step": int(step), "benchmark": b.name, "dataset": b.data.name, "split": b.split,
           "num_pairs": res["num_pairs"], "num_images": res["num_images"], "num_captions": res["num_captions"],
           "t2i": res["t2i"], "i2t": res["i2t"], "score": self.score}
    return row, (img, txt, caption_image)

  def close(self):
    self.ckpt.close()


def data_identity(data) -> dict:
  """What makes two evaluations comparable: the data config without where its build is stored."""
  return {k: v for k, v in dict(data).items() if k != "data_dir"}


def log_rows(rows: list[dict], named: bool = True) -> None:
  for r in rows:
    for d, name in bench_lib.DIRECTIONS:
      log((f"{r['benchmark']:>12s} " if named else "") + f"{name:12s} " +
          "  ".join(f"{k}={v:6.2f}" for k, v in r[d].items()))


def write_table(wd: Workdir, tab: dict) -> str:
  """WORKDIR/eval_table.md and .json (the latest table; atomic). Returns the Markdown."""
  md = bench_lib.markdown(tab)
  if jax.process_index() == 0:
    for ext, text in (("md", md), ("json", json.dumps(tab, indent=2))):
      path = wd.eval_table(ext)
      try:
        storage.write_text_atomic(path, text)
      except OSError as e:
        raise storage.StorageError(f"writing {path} failed ({storage.describe(e)}); free space or fix the workdir "
                                   "and rerun eval.py") from e
  return md


def read_best(wd: Workdir) -> dict | None:
  if not paths.exists(wd.best_json):
    return None
  return json.loads(paths.read_text(wd.best_json))


def export_best(wd: Workdir, params, model_cfg, tokenizer, info: dict) -> None:
  """Writes the parameters to WORKDIR/best (a converted directory + best.json), replacing the previous best only
  once the new one is complete (paths.replace_dir: a reader sees the old best or the new one; on a bucket a
  best/ without best.json is incomplete)."""
  import orbax.checkpoint as ocp

  def write(directory: str) -> None:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(paths.join(directory, "params"), params, force=True)
    write_model(directory, model_cfg)
    write_tokenizer(directory, tokenizer)
    storage.write_text_atomic(paths.join(directory, paths.basename(wd.best_json)), json.dumps(info, indent=2))

  try:
    paths.replace_dir(wd.best, write)
  except OSError as e:
    raise storage.StorageError(f"writing the best checkpoint (step {info['step']}) to {wd.best} failed "
                               f"({storage.describe(e)}); free space or fix the workdir and restart the eval job "
                               "(it resumes where it stopped)") from e


def finished_steps(wd: Workdir) -> list[int]:
  """The workdir's checkpoint steps that Orbax has finalised (renamed to the step, or committed on object stores)."""
  from orbax.checkpoint import step as ocp_step
  out = []
  for s in wd.checkpoint_steps():
    try:
      if ocp_step.is_checkpoint_finalized(wd.checkpoint(s)):
        out.append(s)
    except Exception:  # noqa: BLE001 — deleted while we looked
      pass
  return out


def watched_steps(rows: list[dict], benchmarks: list, score: str) -> set[int]:
  """Steps the watcher already evaluated on every one of `benchmarks` with this score (its history rows)."""
  want = {b.name: data_identity(b.data) | {"split": b.split} for b in benchmarks}
  seen = {}
  for r in rows:
    name = r.get("benchmark")
    if (r.get("job") == "watch" and name in want and r.get("score") == score
        and data_identity(r.get("data", {})) | {"split": r.get("split")} == want[name]):
      seen.setdefault(int(r["step"]), set()).add(name)
  return {s for s, names in seen.items() if names == set(want)}


def wait_for_run(workdir: str, poll_s: float, timeout_s: float, clock=time.monotonic, sleep=time.sleep) -> None:
  """Waits until train.py has set up `workdir`: its model.json (written before the first step) and its checkpoint
  directory (on a bucket a prefix exists only once an object is under it: the first checkpoint). Raises after
  timeout_s."""
  wd, start, said = Workdir(workdir), clock(), False
  while True:
    missing = [p for p, there in ((wd.model_json, paths.exists), (wd.checkpoints, paths.isdir)) if not there(p)]
    if not missing:
      return
    if clock() - start > timeout_s:
      raise FileNotFoundError(f"no training run appeared in --workdir={workdir} within {timeout_s:g} s "
                              f"(--watch_timeout_s): {missing[0]} is missing. Start train.py with that --workdir, "
                              "or check the path")
    if not said:
      log(f"waiting for train.py to set up {workdir} (its model.json and first checkpoint)")
      said = True
    sleep(poll_s)


def watch(ev: Evaluator, *, poll_s: float, timeout_s: float, newest_only: bool, metric: str,
          clock=time.monotonic, sleep=time.sleep) -> dict:
  """Follows the workdir's checkpoints until the final step is evaluated or none came for timeout_s; returns
  {"evaluated": [steps], "skipped": [steps], "missed": [steps], "best": {...}}: every checkpoint training wrote is
  in one of the three lists — "missed" are those it wrote (its goodput records, Workdir.saved_steps) but deleted
  (max_to_keep) before this job saw them complete, older than the newest it did see. One process
  (eval.py refuses --watch on several: their views of a directory that changes under them would differ)."""
  wd = ev.wd
  rows = wd.eval_records()
  done = watched_steps(rows, ev.benchmarks, ev.score)
  names = [b.name for b in ev.benchmarks]
  best = read_best(wd)
  if best is not None and (best.get("metric"), best.get("benchmarks"), best.get("score")) != (metric, names, ev.score):
    log(f"{wd.best} holds the best by {best.get('metric')} on {best.get('benchmarks')} ({best.get('score')} "
        f"score); this job keeps it by {metric} on {names} ({ev.score}): replaced at the first step evaluated")
    best = None
  elif best is None and done:
    prior = [r for r in rows if r.get("job") == "watch" and r["step"] in done and r.get("benchmark") == names[0]
             and r.get("metric") == metric]
    if prior:
      top = max(prior, key=lambda r: (r["metric_value"], -r["step"]))
      best = {"step": top["step"], "metric": metric, "value": top["metric_value"], "benchmarks": names,
              "score": ev.score, "exported": False}
      log(f"{wd.best} is missing; by the history the best so far is step {best['step']} ({metric} "
          f"{best['value']:.2f}), which is not exported again: the next better step will be")
  if done:
    log(f"already evaluated by an earlier watcher (eval_history.jsonl): steps {sorted(done)}")
  writer = MetricsWriter(None, wd.eval_tensorboard)
  evaluated, skipped, missed = [], [], []
  last_new = clock()
  seen = set(done)
  try:
    while True:
      steps = finished_steps(wd)
      if set(steps) - seen:
        last_new = clock()
        seen |= set(steps)
      gone = [s for s in wd.saved_steps() if steps and s < steps[-1] and s not in seen]
      if gone:
        log(f"steps {gone}: written by training but deleted (max_to_keep) before this job saw them; missed")
        missed += gone
        seen |= set(gone)
        done |= set(gone)
      todo = [s for s in steps if s not in done]
      if newest_only and len(todo) > 1:
        log(f"behind training: skipping steps {todo[:-1]} (--watch_newest_only), evaluating {todo[-1]}")
        skipped += todo[:-1]
        done |= set(todo[:-1])
        todo = todo[-1:]
      if not todo:
        if steps and steps[-1] in done and _is_final(ev, steps[-1]):
          log(f"the final step {steps[-1]} is evaluated; stopping")
          break
        if clock() - last_new > timeout_s:
          log(f"no new checkpoint in {wd.checkpoints} for {timeout_s:g} s (--watch_timeout_s); stopping")
          break
        sleep(poll_s)
        continue
      step = todo[0]
      try:
        meta, params = ev.read_racing(step)
      except Gone:
        log(f"step {step}: its checkpoint was deleted by training (max_to_keep) before it was read; skipped")
        skipped.append(step)
        done.add(step)
        continue
      except Exception as e:  # noqa: BLE001 — a damaged checkpoint does not end the job
        log(f"WARNING: step {step} skipped: {storage.describe(e)}")
        skipped.append(step)
        done.add(step)
        continue
      rows = [ev.evaluate(params, step, b)[0] for b in ev.benchmarks]
      tab = bench_lib.table(rows)
      value = bench_lib.metric(tab, metric)
      scalars = {f"benchmarks/{r['benchmark']}/{d}/{k}": v for r in rows for d, _ in bench_lib.DIRECTIONS
                 for k, v in r[d].items()}
      scalars.update({f"benchmarks/average/{d}/{k}": v for d in ("t2i", "i2t", "both")
                      for k, v in tab["average"][d].items()})
      writer.write(step, scalars)
      is_best = best is None or value > best["value"]
      if is_best:
        best = {"step": step, "metric": metric, "value": value, "benchmarks": names, "score": ev.score,
                "exported": True, "source": wd.checkpoint(step), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        export_best(wd, params, ev.model_cfg, ev.tokenizer, best)
      for r in rows:
        wd.record_eval(r, {"data": dict(next(b.data for b in ev.benchmarks if b.name == r["benchmark"])),
                           "job": "watch", "metric": metric, "metric_value": value, "best_step": best["step"]},
                       latest=False)
      write_table(wd, tab)
      log_rows(rows)
      log(f"step {step}: {metric} = {value:.2f}" + (" (best so far: exported to " + wd.best + ")"
                                                     if is_best else f" (best: step {best['step']}, {best['value']:.2f})"))
      done.add(step)
      evaluated.append(step)
      if _is_final(ev, step, meta) and not [s for s in finished_steps(wd) if s > step]:
        log(f"the final step {step} is evaluated; stopping")  # (a resume may have raised total_steps since)
        break
  finally:
    writer.close(quiet=True)
  return {"evaluated": evaluated, "skipped": skipped, "missed": sorted(missed), "best": best}


def _is_final(ev: Evaluator, step: int, meta: dict | None = None) -> bool:
  """Whether `step` is the last step of the run that wrote it (its recorded config.total_steps); False when its
  metadata cannot be read any more (deleted meanwhile)."""
  if meta is None:
    try:
      meta = ev.ckpt.read_meta(step)
    except Exception:  # noqa: BLE001
      return False
  total = meta.get("config", {}).get("total_steps")
  return total is not None and int(total) == step
