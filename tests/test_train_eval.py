"""train.py and eval.py end to end (subprocesses, the tiny `configs/demo.py:test` variant)."""
import json
import os
import shutil

import pytest

from conftest import ARTIFACTS, assert_error_exit, metrics_rows, render, run_entry, run_py

# Config and path errors: their own xdist group (no trained workdir needed), part of the inner loop (-m quick).
CONFIG_CHECKS = pytest.mark.xdist_group("test_train_eval.config")

CONFIG = "configs/demo.py:test"


def _metrics(workdir):
  return metrics_rows(workdir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tfds_dir):
  workdir = str(tmp_path_factory.mktemp("run"))
  proc = run_py(["train.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}"])
  return workdir, proc


def test_train_writes_metrics_checkpoints_and_events(trained):
  workdir, proc = trained
  rows = _metrics(workdir)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [2, 4, 6]
  assert all(r["loss"] > 0 and r["lr"] >= 0 for r in train_rows)
  assert [r["step"] for r in rows if "eval/t2i/R@1" in r] == [3, 6]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  assert "steps/s" in proc.stdout and "ETA" in proc.stdout


def test_rerun_resumes_and_matches_uninterrupted_run(trained, tmp_path, tfds_dir):
  workdir, _ = trained
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))  # as if killed after the step-3 checkpoint
  proc = run_py(["train.py", "--config", CONFIG, "--workdir", resumed, f"--config.data.data_dir={tfds_dir}"])
  assert "resumed from" in proc.stdout and "(step 3)" in proc.stdout
  a, b = _metrics(workdir), _metrics(resumed)
  assert [r["step"] for r in b] == [r["step"] for r in a]  # no gaps, no duplicated steps
  for ra, rb in zip(a, b):
    assert ra.keys() == rb.keys()
    for k in ra:
      assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (ra["step"], k)


def test_eval_restores_and_reports_recall(trained, tfds_dir, tmp_path):
  workdir, _ = trained
  report = tmp_path / "report"
  proc = run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, f"--config.data.data_dir={tfds_dir}",
                 "--report", str(report), "--report_samples=6", "--report_failures=10"])
  with open(os.path.join(workdir, "eval_results.json")) as f:
    res = json.load(f)
  assert res["step"] == 6 and res["dataset"] == "synthetic" and res["split"] == "test" and res["num_pairs"] == 40
  for d in ("t2i", "i2t"):
    assert set(res[d]) == {"R@1", "R@5", "R@10"}
    assert 0 <= res[d]["R@1"] <= res[d]["R@5"] <= res[d]["R@10"] <= 100
  # The same checkpoint was evaluated at the end of training: identical numbers.
  last = [r for r in _metrics(workdir) if r["step"] == 6 and "eval/t2i/R@1" in r][0]
  for d in ("t2i", "i2t"):
    for k in ("R@1", "R@5", "R@10"):
      assert res[d][k] == pytest.approx(last[f"eval/{d}/{k}"])
  assert "text->image" in proc.stdout
  check_report_in_browser(report, res)
  bad = run_py(["eval.py", "--config", CONFIG, "--workdir", workdir, "--step", "5",
                f"--config.data.data_dir={tfds_dir}"], check=False)
  assert_error_exit(bad, "--step=5 has no checkpoint", "[3, 6]")


def check_report_in_browser(report, res):
  """The --report page in headless Chromium: every image loads, the recall table holds eval_results.json's
  numbers, each query shows its ground truth and top 5; a screenshot is kept as a test artifact."""
  import html.parser
  dom = render(str(report / "index.html"), screenshot=os.path.join(ARTIFACTS, "retrieval_report.png"))

  class Parse(html.parser.HTMLParser):
    imgs, cells, queries, key = [], {}, [], None

    def handle_starttag(self, tag, attrs):
      a = dict(attrs)
      if tag == "img":
        self.imgs.append(a)
      if tag == "td" and "data-key" in a:
        self.key = a["data-key"]
      if tag == "section":
        self.queries.append(a)

    def handle_data(self, data):
      if self.key:
        self.cells[self.key], self.key = data, None

  p = Parse()
  p.feed(dom)
  queries = json.load(open(report / "queries.json"))
  n_queries = len(queries["sampled"]) + len(queries["failures"])
  assert len(queries["sampled"]) == 6 and n_queries == len(p.queries) > 6  # the demo model still misses some
  assert len(p.imgs) == n_queries * 6  # ground truth + top 5
  assert [i.get("data-loaded") for i in p.imgs] == ["1"] * len(p.imgs), "an image did not load"
  assert p.cells == {f"{d}/{k}": f"{res[d][k]:.2f}" for d in ("t2i", "i2t") for k in ("R@1", "R@5", "R@10")}
  assert {q["data-rank"] for q in p.queries if "miss" in q["class"]} and all(
      int(q["data-rank"]) > 0 for q in p.queries if "miss" in q["class"])
  with open(os.path.join(ARTIFACTS, "retrieval_report.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


TOKEN_RUN = ["--config.loss.token_weight=1", "--config.total_steps=40", "--config.log_every=5",
             "--config.checkpoint_every=20", "--config.eval_every=20"]


def test_full_objective_with_token_term_trains_and_resumes(tmp_path, tfds_dir):
  """λ = 1 (paper Eq. 3) on the built-in data: both terms are logged and fall, and a resume from the step-20
  checkpoint reproduces the uninterrupted run's metrics."""
  workdir = str(tmp_path / "tok")
  args = ["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", *TOKEN_RUN]
  run_py([*args, "--workdir", workdir])
  rows = [r for r in _metrics(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(5, 41, 5))
  first, last = rows[0], rows[-2:]
  assert all(r["loss"] == pytest.approx(r["loss/hn"] + r["loss/tok"], rel=1e-5) for r in rows)
  assert max(r["loss"] for r in last) < 0.9 * first["loss"]
  assert max(r["loss/tok"] for r in last) < first["loss/tok"]
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "40"))
  proc = run_py([*args, "--workdir", resumed])
  assert "(step 20)" in proc.stdout and "token term weight 1.0" in proc.stdout
  a, b = _metrics(workdir), _metrics(resumed)
  assert [r["step"] for r in b] == [r["step"] for r in a]
  for ra, rb in zip(a, b):
    for k in ra:
      assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (ra["step"], k)


@CONFIG_CHECKS
@pytest.mark.parametrize("override,message", [
    ("--config.loss.gama=0", "error: unknown config key --config.loss.gama; did you mean --config.loss.gamma?"),
    ("--config.batch_sise=8", "error: unknown config key --config.batch_sise; did you mean --config.batch_size?"),
    ("--config.optimizr.lr=1", "error: unknown config key --config.optimizr.lr; did you mean --config.optimizer.lr?"),
    ("--config.batch_size=many", "error: flag --config.batch_size=many: invalid literal for int()"),
    ("--workdr=/tmp/x", "error: Unknown command line flag 'workdr'; did you mean --workdir?"),
    ("--config.batch_size=0", "config.batch_size=0 must be positive"),
    ("--config.model.text_layers=-1", "config.model.text_layers=-1 must be positive"),
    ("--config.mesh.data=3", "multiplies to 3 but there are 1 devices"),
    # Settings that would silently do nothing are refused by name.
    ("--config.finetune.rank=8", "config.finetune.rank=8 set, but config.finetune.method='full' trains every weight"),
    ("--config.finetune.targets=('fc1$',)", "config.finetune.targets=('fc1$',) set, but config.finetune.method='full'"),
    ("--config.loss.token_margin=true", "config.loss.token_margin=True set, but config.loss.token_weight=0 turns the "
                                        "token term off"),
    ("--config.loss.token_layer=-2", "config.loss.token_layer=-2 set, but config.loss.token_weight=0"),
    ("--config.finetune.dora_detach_norm=true", "config.finetune.dora_detach_norm=True set, but "
                                                "config.finetune.method='full'"),
    ("--config.loss.token_schedule=rng", "config.loss.token_schedule='rng'; choose one of ['gather', 'ring']"),
    ("--config.loss.token_group=2", "config.loss.token_group=2 set, but config.loss.token_weight=0"),
    ("--config.loss.token_keep=0.5", "config.loss.token_keep=0.5 set, but config.loss.token_weight=0"),
    (("--config.loss.token_weight=1", "--config.loss.token_keep=0"),
     "config.loss.token_keep=0.0; use a fraction in (0, 1] of the tokens the token term scores"),
    ("--config.loss.token_group=-1", "config.loss.token_group=-1; use 0 (the whole global batch) or a group size"),
    (("--config.loss.token_weight=1", "--config.loss.token_group=5"),
     "config.loss.token_group=5 must divide config.batch_size=16"),
    (("--config.loss.token_weight=1", "--config.loss.token_group=2", "--config.loss.token_schedule=ring"),
     "config.loss.token_schedule='ring' set, but config.loss.token_group=2 scores each group on the device"),
])
def test_bad_config_is_named(tmp_path, override, message):
  overrides = [override] if isinstance(override, str) else list(override)
  proc = run_entry("train.py", ["--config", CONFIG, "--workdir", str(tmp_path / "w"), *overrides])
  assert_error_exit(proc, message)
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # and nothing else (no library warning either)


@CONFIG_CHECKS
@pytest.mark.parametrize("script,override,message", [
    ("train.py", "--config.loss.gama=0", "error: unknown config key --config.loss.gama; did you mean"),
    ("eval.py", "--config.batch_size=0", "error: config.batch_size=0 must be positive"),
])
def test_errors_end_a_fresh_process_with_exit_2_and_one_line(tmp_path, script, override, message):
  """The exit-code contract in a real `python SCRIPT` (the other error checks run the same parser and main
  in-process, tests/conftest.run_entry): exit 2, one line on stderr, no traceback, nothing written."""
  (tmp_path / "w").mkdir()
  proc = run_py([script, "--config", CONFIG, "--workdir", str(tmp_path / "w"), override], check=False)
  assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
  assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert os.listdir(tmp_path / "w") == []


@CONFIG_CHECKS
@pytest.mark.parametrize("config,message", [
    ("configs/dmo.py", "error: cannot load the config file: [Errno 2] No such file or directory: 'configs/dmo.py'"),
    ("configs/demo.py:tst", "configs/demo.py has variants 'default' and 'test', got 'tst'"),
])
def test_bad_config_file_is_one_line(tmp_path, config, message):
  proc = run_entry("eval.py", ["--config", config, "--workdir", str(tmp_path)])
  assert_error_exit(proc, message)
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@CONFIG_CHECKS
@pytest.mark.parametrize("override,message", [
    ("--config.init_from={tmp}/nope", "config.init_from='{tmp}/nope': {tmp}/nope does not exist"),
    ("--config.init_from={tmp}/weights.safetensors", "is a file but not an OpenAI-format checkpoint"),
    ("--config.data.name=pairs", "set config.data.manual_dir"),
    ("--config.data.manual_dir={tmp}/nope", "config.data.manual_dir='{tmp}/nope': {tmp}/nope is not a directory"),
])
def test_paths_are_checked_before_any_data_is_built(tmp_path, override, message):
  (tmp_path / "weights.safetensors").write_bytes(b"")
  extra = ["--config.data.name=pairs"] if "manual_dir" in override else []
  data_dir = tmp_path / "tfds"
  proc = run_entry("train.py", ["--config", CONFIG, "--workdir", str(tmp_path / "w"),
                                f"--config.data.data_dir={data_dir}", *extra, override.format(tmp=tmp_path)])
  assert_error_exit(proc, message.format(tmp=tmp_path))
  assert not data_dir.exists()  # nothing was built
  w = tmp_path / "w"  # no model.json, tokenizer, data.json or checkpoints
  assert not w.exists() or sorted(os.listdir(w)) in ([], [".lock"])


@CONFIG_CHECKS
def test_the_top_of_a_store_is_no_workdir():
  """A run directory of its own, never the file system's (or a bucket's: train.py in test_buckets) root. train.py
  is not run at / here: on a break it would train into the machine's root."""
  from hnclip_jax.workdir import resolve_path
  with pytest.raises(ValueError, match=r"--workdir=/ is the root of its store.*--workdir=/RUN_NAME"):
    resolve_path("/")
  assert resolve_path("/tmp/x/") == "/tmp/x"
  proc = run_entry("eval.py", ["--config", CONFIG, "--workdir", "/"])
  assert_error_exit(proc, "--workdir=/ is the root of its store", "--workdir=/RUN_NAME")


def test_eval_of_a_directory_without_checkpoints_changes_nothing(tmp_path):
  (tmp_path / "notes.txt").write_text("x")
  proc = run_entry("eval.py", ["--config", CONFIG, "--workdir", str(tmp_path)])
  assert_error_exit(proc, f"no checkpoints in {tmp_path}/checkpoints")
  assert os.listdir(tmp_path) == ["notes.txt"]


@CONFIG_CHECKS
def test_unknown_key_in_config_file(tmp_path):
  cfg = tmp_path / "cfg.py"
  cfg.write_text("from configs.demo import get_config as g\n"
                 "def get_config():\n  c = g('test'); c.unlock(); c.optimizer.learning_rate = 1.0; return c\n")
  proc = run_entry("train.py", ["--config", str(cfg), "--workdir", str(tmp_path / "w")])
  assert_error_exit(proc, "unknown config key config.optimizer.learning_rate")


@CONFIG_CHECKS
def test_batch_not_divisible_by_devices(tmp_path):
  proc = run_py(["train.py", "--config", CONFIG, "--workdir", str(tmp_path), "--config.batch_size=12"],
                devices=8, check=False)
  assert_error_exit(proc, "config.batch_size=12 is not divisible by the 8 batch shards")


def test_incompatible_checkpoint_is_refused(trained, tfds_dir):
  workdir, _ = trained
  for script in ("train.py", "eval.py"):
    proc = run_py([script, "--config", CONFIG, "--workdir", workdir, "--config.model.text_width=64",
                   f"--config.data.data_dir={tfds_dir}"], check=False)
    assert_error_exit(proc, "written for a different model", "text_width: checkpoint=32, config=64")


@CONFIG_CHECKS
def test_jax_cache_variables_win_over_the_config(monkeypatch):
  """JAX's own JAX_COMPILATION_CACHE_DIR / JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, are kept over
  config.compilation_cache_dir (one cache for every process of a job or a test run); unset, the config's directory
  and a 0.5 s threshold apply."""
  import jax
  from hnclip_jax import cli
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  saved = {k: getattr(jax.config, k) for k in keys}
  try:
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/from-env")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", "/tmp/from-env")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cli.enable_compilation_cache("~/from-config")
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == \
        ("/tmp/from-env", 0.0)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    cli.enable_compilation_cache("~/from-config")
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == \
        (os.path.expanduser("~/from-config"), 0.5)
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)
