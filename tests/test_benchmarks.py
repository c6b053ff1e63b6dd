"""The prepared accelerator benchmark script runs end to end in its CPU quick mode and writes every result."""
import glob
import gzip
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _env

# The benchmarks time steps after compiling them: the suite's persistent XLA cache (JAX_COMPILATION_CACHE_DIR, set by
# conftest and inherited through _env) skips the compiles on reruns.


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_accelerator_script_quick_mode(tmp_path):
  env = _env(1, {"OUT": str(tmp_path)})
  proc = subprocess.run(["bash", "benchmarks/accelerator.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  steps = json.load(open(tmp_path / "step_time.json"))["models"][0]
  assert steps["model"] == "tiny" and steps["step_s_gamma0.5"] > 0
  # The analytic FLOP count agrees with XLA's cost analysis.
  assert abs(steps["analytic_TFLOP"] / steps["xla_TFLOP"] - 1) < 0.05
  # The margin's extra B×B product shows up in XLA's FLOP count (γ = 0 compiles without it), and it is small.
  assert 0 < steps["margin_xla_flops_pct"] < 1
  assert 0 < steps["MFU_pct"] < 100
  smoke = open(tmp_path / "smoke.txt").read().strip().splitlines()
  assert smoke[-1].startswith("smoke: ok") and any("two train steps ok" in x for x in smoke), smoke
  assert any("a step from it equals a step from the saved state" in x for x in smoke), smoke
  vitl = json.load(open(tmp_path / "vit_l_step.json"))["rows"]  # no memory limit on CPU: the largest candidate
  assert [(r["lambda"], r["batch"]) for r in vitl] == [(0.0, 32), (1.0, 32)], vitl
  assert all(r["step_s"] > 0 and r["compile_s"] > 0 and r["matmul_TFLOP"] > 0 for r in vitl), vitl
  assert vitl[1]["matmul_TFLOP"] > vitl[0]["matmul_TFLOP"]  # the token term's work
  retr = json.load(open(tmp_path / "retrieval.json"))
  assert retr[0]["method"] == "hnclip" and retr[0]["n"] == 2000
  loss = json.load(open(tmp_path / "loss_memory.json"))
  assert [r["global_batch"] for r in loss] == [512, 1024]
  fw = json.load(open(tmp_path / "frameworks.json"))["rows"]
  assert [r["framework"] for r in fw] == ["longclip", "structxlip"] and fw[1]["matmul FLOPs vs HN-CLIP"] > 1, fw
  tok = json.load(open(tmp_path / "token_term.json"))[0]
  assert tok["model"] == "tiny" and tok["batch"] == 16 and tok["step_s_hn"] > 0 and tok["step_s_hn+tok"] > 0
  for name in ("memory.json", "devices.txt"):
    assert os.path.getsize(tmp_path / name) > 0
  # Every stage ran and succeeded, and the profiler trace holds the three annotated train steps.
  stages = [line.split("\t") for line in open(tmp_path / "stages.tsv").read().splitlines()[1:]]
  assert [s[0] for s in stages] == ["smoke", "vit_l_step", "step_time", "token_term", "frameworks", "retrieval",
                                    "loss_memory", "memory"]
  assert all(s[1] == "0" for s in stages), stages
  traces = glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.trace.json.gz"))
  assert len(traces) == 1 and glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  events = json.load(gzip.open(traces[0]))["traceEvents"]
  steps = [e for e in events if e.get("name") == "train" and e.get("ph") == "X"]
  assert len(steps) == 3, len(steps)


def test_accelerator_script_reports_stages_its_time_budget_left_out(tmp_path):
  # With the budget spent before the first stage, every stage is recorded as skipped and the script exits 1.
  env = _env(1, {"OUT": str(tmp_path), "ACC_BUDGET_S": "1"})
  proc = subprocess.run(["bash", "benchmarks/accelerator.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout[-2000:]
  stages = [line.split("\t") for line in open(tmp_path / "stages.tsv").read().splitlines()[1:]]
  assert len(stages) == 8 and all(s[1] == "skipped (budget)" for s in stages), stages


def test_accelerator_script_stops_at_a_stack_that_cannot_run_the_project(tmp_path):
  """The first stage imports what the project needs: a package that does not import with this JAX (simulated: a
  flax that raises as flax 0.12.8 did under jax 0.11.2) stops the script at once, its last line naming the package
  and the versions, and no later stage starts."""
  fake = tmp_path / "site" / "flax"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("raise ImportError(\"cannot import name 'simulated' from 'jax._src.core'\")\n")
  env = _env(1, {"OUT": str(tmp_path / "out"), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
  proc = subprocess.run(["bash", "benchmarks/accelerator.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout[-2000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("error: smoke: import flax (flax ") and "jax " in last and "Python 3." in last, last
  assert "ImportError: cannot import name 'simulated'" in last, last
  stages = [line.split("\t") for line in open(tmp_path / "out" / "stages.tsv").read().splitlines()[1:]]
  assert stages[0][:2] == ["smoke", "1"] and len(stages) == 1, stages


def test_the_train_step_stages_run_without_the_data_packages(tmp_path):
  """An accelerator image has its own jax/flax/orbax and none of tensorflow-datasets, grain, array_record
  (simulated: each raises ImportError). The smoke stage still runs the train step and the checkpoint restore and
  only reports them; a framework that reads data (GOAL) is refused naming the missing package."""
  site = tmp_path / "site"
  for name in ("tensorflow_datasets", "grain", "array_record"):
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed (simulated)')\n")
  env = _env(1, {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
  proc = subprocess.run([sys.executable, "benchmarks/smoke.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  assert lines[-1].startswith("smoke: ok"), lines[-3:]
  note = next(x for x in lines if x.startswith("note: "))
  assert all(f"{n} (ImportError: " in note for n in ("grain", "array_record", "tensorflow-datasets")), note
  proc = subprocess.run([sys.executable, "-c", "from hnclip_jax import frameworks; frameworks.resolve('goal')"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert "config.framework='goal' cannot run here" in proc.stderr and "is not installed (simulated)" in proc.stderr


def test_stop_check_benchmark_runs(tmp_path):
  out = tmp_path / "stop.json"
  proc = subprocess.run([sys.executable, "benchmarks/stop_check.py", "--steps", "20", "--reps", "1", "--json", str(out)],
                        cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  ms = json.load(open(out))["ms_per_step"]
  assert sorted(ms) == ["allgather", "none", "sync_point"] and min(ms.values()) > 0


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_layers_benchmark_runs(tmp_path):
  out = tmp_path / "layers.json"
  proc = subprocess.run([sys.executable, "benchmarks/layers.py", "--batch", "2", "--width", "16", "--heads", "2",
                         "--mlp", "32", "--reps", "1", "--no_torch", "--step_batch", "2", "--json", str(out)],
                        cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.load(open(out))
  assert {r["what"] for r in rows} == {"attention", "attention scores, batched matmul (forward only)", "MLP",
                                       "MLP, XLA:CPU YNN fusions", "train step (tiny model), XLA:CPU YNN fusions"}
  assert len(rows) == 16
  assert all(r["fwd_bwd_ms"] > 0 for r in rows)


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_host_allocator_benchmark_runs_each_allocator_in_its_own_process(tmp_path):
  from hnclip_jax import hostmem
  lib = hostmem.find_tcmalloc()
  if lib is None:  # the mechanics still run: preload some other real shared object in the 'tcmalloc' child
    import _lzma
    lib = _lzma.__file__
  out = tmp_path / "alloc.json"
  proc = subprocess.run([sys.executable, "benchmarks/host_allocator.py", "--batch", "2", "--steps", "1", "--rounds",
                         "1", "--tcmalloc", lib, "--json", str(out)], cwd=ROOT, capture_output=True,
                        env=_env(1, {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}),  # 2nd child: no compile
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["allocator"]: r for r in json.load(open(out))}
  assert sorted(rows) == ["system malloc", "tcmalloc"]
  assert rows["system malloc"]["library"] == "system malloc"
  assert rows["tcmalloc"]["library"] == (os.path.realpath(lib) if "tcmalloc" in lib else "system malloc")
  assert rows["system malloc"]["speedup_vs_system"] == 1.0
  assert all(r["step_s"] > 0 and r["page_faults_per_step"] >= 0 for r in rows.values())


def test_compile_log_and_report_attribute_compiles_to_their_tests(tmp_path):
  """benchmarks/compile_log on a process's PYTHONPATH logs each XLA compile with the test named by
  PYTEST_CURRENT_TEST; benchmarks/compile_report.py sums them per test next to the JUnit durations."""
  log = tmp_path / "log"
  code = ("import jax, jax.numpy as jnp\n"
          "f = jax.jit(lambda x: jnp.tanh(x) @ x.T)\n"
          "f(jnp.ones((5, 3))); f(jnp.ones((6, 3)))\n")  # two shapes: two programs of one function
  # As docs/testing.md runs it: compile_log on the PYTHONPATH, behind the tests' own sitecustomize (conftest._env puts
  # tests/site first), which runs the next one on the path.
  env = _env(1, {"HNCLIP_COMPILE_LOG": str(log), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
                 "PYTEST_CURRENT_TEST": "tests/test_x.py::test_a@grp (call)"})
  env["PYTHONPATH"] += os.pathsep + os.path.join(ROOT, "benchmarks", "compile_log")
  assert env["PYTHONPATH"].split(os.pathsep)[1] == os.path.join(ROOT, "tests", "site"), env["PYTHONPATH"]
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = [json.loads(line) for f in log.iterdir() for line in open(f)]
  mine = [e for e in events if e["event"] == "/jax/core/compile/backend_compile_duration" and e["fun"] == "jit(<lambda>)"]
  assert len(mine) == 2 and all(e["test"].startswith("tests/test_x.py::test_a") and e["secs"] > 0 for e in mine)
  junit = tmp_path / "j.xml"
  junit.write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="test_a@grp" time="12.5"/>'
                   '<testcase classname="tests.test_x" name="test_b" time="1.0"/></testsuite></testsuites>')
  report = subprocess.run([sys.executable, "benchmarks/compile_report.py", str(log), str(junit), "--functions",
                           "test_a"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
  row = next(line for line in report.splitlines() if line.startswith("| tests/test_x.py::test_a |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  compiled = sum(e["secs"] for e in events if e["event"] == "/jax/core/compile/backend_compile_duration")
  assert cells[1] == "12.5" and abs(float(cells[2]) - compiled) <= 0.051 and int(cells[3]) == sum(
      e["event"] == "/jax/core/compile/backend_compile_duration" for e in events), report
  assert "| tests/test_x.py::test_b | 1.0 | 0.0 | 0 |" in report, report
  assert any(line.split()[-1] == "jit(<lambda>)" and line.split()[2] == "2x" for line in report.splitlines()), report


@pytest.mark.long
def test_goodput_checkpoint_memory_and_bucket_reads_scripts_run(tmp_path, tfds_dir):
  """benchmarks/goodput.py (a tiny run killed once and resumed), checkpoint_memory.py (tiny state, both variants),
  bucket_reads.py (a small build on the emulator) and decode.py (two small JPEGs): each ends with its table."""
  run = lambda *args: subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(1), capture_output=True,  # noqa: E731
                                     text=True, timeout=900)
  proc = run("benchmarks/goodput.py", "--workdir", str(tmp_path / "gp"), "--config", "configs/demo.py:test",
             "--kill_at", "5", "--", "--config.total_steps=8", "--config.checkpoint_every=4",
             f"--config.data.data_dir={tfds_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # killed after step 5 (its last record: step 4), resumed from checkpoint 4 or, when that save had not committed,
  # from the start (then steps 1-4 are redone)
  assert "goodput (whole run, 2 process starts)" in proc.stdout, proc.stdout
  assert "killed (no end record)" in proc.stdout and "| done" in proc.stdout, proc.stdout
  proc = run("benchmarks/checkpoint_memory.py", "--preset", "tiny", "--saves", "2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("| 2 |") == 2 and "variant keep" in proc.stdout, proc.stdout
  proc = run("benchmarks/bucket_reads.py", "--reads", "16", "--num_train", "64", "--image_size", "32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| bucket, staged first |" in proc.stdout and "staging (data/staging.py)" in proc.stdout, proc.stdout
  proc = run("benchmarks/decode.py", "--images", "2", "--sizes", "96x128", "--px", "64")
  assert proc.returncode == 0 and "| 96×128 |" in proc.stdout, proc.stderr[-3000:]
