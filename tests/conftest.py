"""Shared test set-up: persistent compilation cache, repo on the path, helpers for subprocess runs."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.expanduser("~/.cache/hnclip_jax/xla-tests")
sys.path.insert(0, ROOT)
# Every program goes into the persistent cache, the eager operations' tiny ones too (each costs ~65 ms to compile on
# 2 cores, hundreds per test module), and into one cache for every process of the run: the test processes, the
# train.py / eval.py / tool processes they start and the mesh checks (JAX reads both variables at import, the
# processes the tests start inherit them, and cli.enable_compilation_cache keeps them over
# config.compilation_cache_dir), so a program compiled by one is read back by the others and by a warm rerun
# (docs/testing.md).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE
# XLA's CPU back end set for compiling fast in every test process (this one and those it starts): LLVM at
# optimisation level 0, and the CPU's element-wise code emitted by its classic emitters rather than the newer fusion
# emitters (MLIR, one module per fusion). A cold run is mostly XLA compiling tiny programs that then run a few steps:
# the tiny train step compiles in ~0.55x the time of level 0 alone (~0.25x of XLA's defaults) and runs ~10 % slower
# than level 0 alone. The HLO passes (sharding, collectives, FLOPs) are the defaults; CPU fusion decisions differ
# with the emitters (docs/testing.md, "Compiler settings"). Users' runs keep XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [TEST_XLA_FLAGS, os.environ.get("XLA_FLAGS", "")]))

import jax  # noqa: E402
from jax._src import cache_key as _jax_cache_key  # noqa: E402

SITE = os.path.join(ROOT, "tests", "site")  # the sitecustomize of the processes the tests start (_env)


def _load_site():
  import importlib.util
  spec = importlib.util.spec_from_file_location("hnclip_tests_site", os.path.join(SITE, "sitecustomize.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# This process's JAX is imported already: its cache key function is replaced here (tests/site/sitecustomize.py).
_load_site().same_cache_key_on_every_process(_jax_cache_key)


# ---- scheduling (pyproject.toml: --dist loadgroup --no-loadscope-reorder) -------------------------------------------
# A unit of work is an xdist group, run by one worker. By default a module is one group (its module-scoped fixtures
# are built once); the modules below are split into one group per test (their shared runs are session fixtures,
# built at most once per worker), and tests/test_sharding.py names one group per section of sharded_checks.py.
# Groups are handed out longest first (seconds from tests/durations.json, tests/record_durations.py refreshes it),
# so the long ones overlap instead of ending the run alone.
SPLIT = {"test_reliability", "test_multihost", "test_benchmarks", "test_compile_for", "test_pretrained",
         "test_frameworks", "test_adapters", "test_goal", "test_structxlip", "test_datasets", "test_siglip",
         "test_buckets"}
# The inner loop (`python -m pytest -m quick tests`, docs/testing.md): the loss, objective, sharding-equivalence,
# config and data checks that most changes touch.
QUICK = {"test_losses", "test_objective", "test_controls", "test_model", "test_data", "test_workdir", "test_retrieval",
         "test_settings", "sharded_checks.core", "sharded_checks.token", "test_train_eval.config"}


def group_of(item) -> str:
  marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
  if marks:
    return marks[0]
  module = item.module.__name__
  return module + "." + re.sub(r"[^\w.-]", "_", item.name) if module in SPLIT else module


def pytest_configure(config):
  config.addinivalue_line("markers", "quick: the inner-loop selection (docs/testing.md)")
  config.addinivalue_line("markers", "registry: installs from the package registries (a fresh virtual environment, "
                          "libtpu, the CUDA plugin) and the compiles that need them; left out of the README test "
                          "command by pyproject.toml's `-m 'not registry and not long'`, run by .ci/run "
                          "(docs/testing.md)")
  config.addinivalue_line("markers", "long: a repeat of a scenario the README test command runs (another layout, "
                          "fault, process count or schedule of it) or a benchmark script's smoke run; left out of "
                          "the README test command, run by .ci/run with `-m long` (docs/testing.md)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  import json
  try:
    with open(os.path.join(ROOT, "tests", "durations.json")) as f:
      seconds = json.load(f)
  except OSError:
    seconds = {}
  groups, cost = {}, {}
  for item in items:
    g = groups[id(item)] = group_of(item)
    cost[g] = cost.get(g, 0.0) + seconds.get(item.nodeid, 0.0)
    if not any(item.iter_markers("xdist_group")):
      item.add_marker(pytest.mark.xdist_group(g))
    if g in QUICK or item.module.__name__ in QUICK:
      item.add_marker(pytest.mark.quick)
  first = {}
  for i, item in enumerate(items):
    first.setdefault(groups[id(item)], i)
  items.sort(key=lambda item: (-cost[groups[id(item)]], first[groups[id(item)]]))


def _env(devices, env_extra=None):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([ROOT, SITE, env.get("PYTHONPATH", "")])
  env["PYTHONFAULTHANDLER"] = "1"  # a process that hangs past its timeout is sent SIGABRT: every thread's stack
  env.update(env_extra or {})
  return env


def _run_with_stacks(cmd, env, timeout):
  """subprocess.run(cmd) with output captured; one that outlives `timeout` is sent SIGABRT first (faulthandler,
  PYTHONFAULTHANDLER in _env, prints where every Python thread is) and the test fails with that, not a bare
  TimeoutExpired."""
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGABRT)
    try:
      out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
    raise AssertionError(f"{' '.join(cmd[1:])} still ran after {timeout} s; its output and threads' stacks:\n"
                         f"{out[-3000:]}\n{err[-12000:]}") from None
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_processes(args, *, num_processes: int, devices_per_process: int, env_extra=None, env_of=None):
  """Starts `python ARGS` as a multi-process JAX job on 127.0.0.1; returns the Popen objects. env_of: process index
  -> environment variables for that process only (over env_extra)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # Process 0 compiles each program of the job and hands it to the others through JAX's coordination service
  # (instead of every process compiling it): possible on CPU once every process computes the same cache key
  # (tests/site/sitecustomize.py; without it the others waited forever for a key process 0 never wrote).
  share = {"JAX_SHARE_BINARY_BETWEEN_HOSTS": "true"}
  return [subprocess.Popen([sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}",
                            f"--num_processes={num_processes}", f"--process_id={i}"],
                           cwd=ROOT, env=_env(devices_per_process, {**share, **(env_extra or {}),
                                                                    **(env_of or {}).get(i, {})}),
                           stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(num_processes)]


def collect_processes(procs, args, *, timeout: int = 600):
  """Waits for the processes of `start_processes`; raises with their output if any failed."""
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      p.kill()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    if p.returncode != 0:
      raise AssertionError(f"process {i} of python {' '.join(args)} failed ({p.returncode}):\n{out[-3000:]}\n"
                           f"{err[-6000:]}")
  return outs


def run_processes(args, *, num_processes: int, devices_per_process: int, timeout: int = 600, env_of=None):
  """Runs `python ARGS` as a multi-process JAX job on 127.0.0.1; returns the processes' outputs."""
  procs = start_processes(args, num_processes=num_processes, devices_per_process=devices_per_process, env_of=env_of)
  return collect_processes(procs, args, timeout=timeout)


IN_PROCESS = ("train.py", "eval.py")
# `python -m` tools that run in the test process too (run_entry). Not compile_for: it sets up the TPU / GPU
# compiler's environment before importing JAX, which needs a fresh process.
IN_PROCESS_MODULES = ("hnclip_jax.tools.caption_geometry", "hnclip_jax.tools.match_segments", "hnclip_jax.data.inspect",
                      "hnclip_jax.pretrained.export", "hnclip_jax.pretrained.convert",
                      "hnclip_jax.pretrained.merge_adapters")


def assert_error_exit(proc, *fragments, code: int = 2) -> str:
  """The documented way an entry point refuses: exit `code` (2), no traceback, and exactly one `error: ...` line on
  stderr, its last line, holding every fragment. Returns that line."""
  assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
  lines = proc.stderr.strip().splitlines()
  errors = [line for line in lines if line.startswith("error: ")]
  assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  for f in fragments:
    assert f in errors[0], (f, errors[0])
  return errors[0]


def run_py(args, *, devices: int = 1, timeout: int = 600, check: bool = True, env_extra=None):
  """Runs `python ARGS` from the repo root with `devices` fake CPU devices. A one-device `train.py` / `eval.py` run or
  `python -m TOOL` (IN_PROCESS_MODULES) with no environment changes runs in this process (`run_entry`: the same flag
  parser and main, without a fresh interpreter and JAX import, which cost more than such a run; `timeout` does not
  apply there); anything else in a fresh process (checks of the process itself call subprocess directly).
  """
  if devices == 1 and not env_extra and args and (args[0] in IN_PROCESS or
                                                  (args[0] == "-m" and args[1] in IN_PROCESS_MODULES)):
    proc = run_entry(args[0], args[1:])
  else:
    env = _env(devices, env_extra)
    proc = _run_with_stacks([sys.executable, *args], env, timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-6000:]}")
  return proc


def metrics_rows(workdir, timing: bool = False) -> list:
  """The rows of a train.py workdir's metrics.jsonl; without the wall-clock scalars (metrics.TIMING_PREFIXES:
  throughput, MFU, input wait, goodput: different in every run) unless timing=True, so that runs can be compared
  bit for bit."""
  import json
  from hnclip_jax.metrics import TIMING_PREFIXES
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return rows if timing else [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def check_resume_is_bit_identical(args, workdir, copy_to, last: int, resume_from: int, env_extra=None) -> None:
  """Copies a finished train.py `workdir` to `copy_to`, deletes its step-`last` checkpoint and reruns `args` there:
  it must resume from step `resume_from` and end with bit-identical metrics and parameters."""
  import shutil
  import jax
  import numpy as np
  from hnclip_jax import pretrained
  shutil.copytree(workdir, copy_to)
  shutil.rmtree(os.path.join(copy_to, "checkpoints", str(last)))
  proc = run_py([*args, "--workdir", copy_to], env_extra=env_extra)
  assert f"(step {resume_from})" in proc.stdout
  assert metrics_rows(copy_to) == metrics_rows(workdir)
  a, b = pretrained.load(workdir).params, pretrained.load(copy_to).params
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def assert_in_layout(workdir) -> None:
  """Every file a run left in local `workdir` lies at a path hnclip_jax.workdir.LAYOUT names (a file, or a folder
  it lies under): the run directory has one owner."""
  from hnclip_jax.workdir import LAYOUT
  names = [n for _, entry, _, _ in LAYOUT for n in entry.split(", ")]
  files = [os.path.relpath(os.path.join(d, f), workdir) for d, _, fs in os.walk(workdir) for f in fs]
  stray = [f for f in files if not any(f == n or n.endswith("/") and f.startswith(n) for n in names)]
  assert files and not stray, f"files in {workdir} that hnclip_jax/workdir.py LAYOUT does not name: {stray}"


def listing(root):
  """Every file under `root` (but the lock file and the debug log, which records why a run stopped) with its size:
  'nothing on disk changed' is this staying equal."""
  return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                for d, _, fs in os.walk(root) for f in fs if f not in (".lock", "debug.log"))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """A GCS emulator (tests/gcs.py) with bucket "bkt", for one test module."""
  from gcs import Emulator
  emu = Emulator(str(tmp_path_factory.mktemp("gcs"))).start()
  emu.make_bucket("bkt")
  yield emu
  emu.stop()


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory, worker_id):
  """One TFDS data dir shared by every test of a test process, kept between runs like the XLA cache: under
  ~/.cache/hnclip_jax/tfds-tests/, keyed by the data code (hnclip_jax/data/*.py) and the TFDS version, one per
  xdist worker (a lock keeps two concurrent runs apart; the second one builds in a temporary directory)."""
  import fcntl
  import hashlib
  import tensorflow_datasets as tfds
  code = hashlib.sha256(tfds.__version__.encode())
  data = os.path.join(ROOT, "hnclip_jax", "data")
  for name in sorted(os.listdir(data)):
    if name.endswith(".py"):
      with open(os.path.join(data, name), "rb") as f:
        code.update(name.encode() + f.read())
  path = os.path.expanduser(os.path.join("~/.cache/hnclip_jax/tfds-tests", code.hexdigest()[:16], worker_id))
  try:
    os.makedirs(path, exist_ok=True)
    lock = open(os.path.join(path, ".lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    return str(tmp_path_factory.mktemp("tfds"))
  _TFDS_LOCKS.append(lock)  # held until this test process ends
  return path


_TFDS_LOCKS = []


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
ARTIFACTS = os.environ.get("HNCLIP_TEST_ARTIFACTS", os.path.join(ROOT, "test-artifacts"))


def headless_browser() -> str:
  """A headless Chromium from the system packages (.ci/run installs chromium-headless-shell when missing)."""
  import shutil
  found = os.environ.get("HNCLIP_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
  if not found:
    pytest.fail("no headless Chromium found (tried HNCLIP_CHROMIUM and " + ", ".join(BROWSERS) + "); install it "
                "with `apt-get install chromium-headless-shell` (.ci/run does), or point HNCLIP_CHROMIUM at one")
  return found


def render(page: str, screenshot: str | None = None, width: int = 1400, height: int = 2400) -> str:
  """Opens `page` in headless Chromium; returns the DOM after scripts and image loads ran; optionally saves a
  screenshot."""
  browser = headless_browser()
  common = [browser, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
  url = "file://" + os.path.abspath(page)
  dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout
  if screenshot:
    os.makedirs(os.path.dirname(screenshot), exist_ok=True)
    subprocess.run(common + [f"--screenshot={screenshot}", f"--window-size={width},{height}", url],
                   capture_output=True, text=True, timeout=120, check=True)
  return dom


# ---- entry points in this process -------------------------------------------------------------------------------
# Error paths that end before anything is built are checked in-process through the functions `python train.py` /
# `python eval.py` run (their flag parser and main), which saves a fresh interpreter and JAX import per check; a few
# subprocess checks hold the exit-code contract itself (tests/test_train_eval.py).
_ENTRIES: dict = {}  # script -> (module, its flags)


OWN_FLAG_MODULES = ("train", "eval", "hnclip_jax", "__main__", "configs")


def _own_flags_of_absl(fv) -> set:
  """The flags every run keeps: absl's and the libraries' (grain, Orbax, array_record read theirs at run time);
  the project's own (the entry points', the tools') are set aside. absl names a module run as __main__ by its file
  (sys.argv[0]): a file under the repo is the project's."""
  def own(module):
    return module.split(".")[0] in OWN_FLAG_MODULES or module.startswith(ROOT + os.sep)
  return {n for n in fv if not own(fv.find_module_defining_flag(n) or "__main__")}


@contextlib.contextmanager
def _flags_aside():
  """Every non-absl flag set aside for one run (the entry points and tools all define --config, --workdir or --out);
  afterwards the run's own flags (its --config.* fields, a `-m` module's flags) are removed and the others restored."""
  from absl import app, flags, logging  # noqa: F401  (absl's own flags are defined before anything else)
  fv = flags.FLAGS
  absl_own = _own_flags_of_absl(fv)
  aside = {n: fv[n] for n in list(fv) if n not in absl_own}
  for name in aside:
    delattr(fv, name)
  try:
    yield fv
  finally:
    # Libraries imported during the run (grain) defined theirs: they stay; the run's --config.* fields go.
    kept = absl_own | {n for n in _own_flags_of_absl(fv)
                       if not (fv.find_module_defining_flag(n) or "").startswith("absl.")}
    for name in [n for n in fv if n not in kept]:
      delattr(fv, name)
    for name, flag in aside.items():
      fv[name] = flag


@contextlib.contextmanager
def _entry_flags(script: str):
  """Registers the flags of train.py / eval.py (imported as modules once) with absl for one run (`_flags_aside`)."""
  with _flags_aside() as fv:
    if script not in _ENTRIES:
      import importlib
      name = os.path.splitext(script)[0]
      assert name not in sys.modules, f"{script} was imported outside tests/conftest.run_entry: its flags are taken"
      module = importlib.import_module(name)
      library = _own_flags_of_absl(fv)  # importing it may import libraries that define flags (Orbax): not its own
      _ENTRIES[script] = (module, {n: fv[n] for n in fv if n not in library})
    else:
      for name, flag in _ENTRIES[script][1].items():
        fv[name] = flag
    yield _ENTRIES[script][0]


def run_entry(script: str, args) -> subprocess.CompletedProcess:
  """`python SCRIPT ARGS` (or `python -m MODULE ARGS`: script "-m", args[0] the module) in this process (one device),
  up to its exit: returns its exit code (0 when main returns), stdout and stderr. train.py / eval.py: their flag
  parser and main; a `-m` module: run as __main__ (runpy), its `app.run(main)` included. The error paths and
  one-device runs (`run_py`); JAX's persistent-cache setting, which the run changes, is restored afterwards."""
  import io
  import runpy
  from absl import flags
  from hnclip_jax import storage
  out, err, code = io.StringIO(), io.StringIO(), 0
  module_run = script == "-m"
  argv, saved_argv, saved_cwd = [script, *map(str, args)], sys.argv, os.getcwd()
  if module_run:
    argv = [str(a) for a in args]
  cache = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                               "jax_persistent_cache_min_compile_time_secs")}
  sys.argv = argv  # ml_collections reads the --config.* overrides from sys.argv
  if "hnclip_jax.data.builders" in sys.modules:  # what a fresh process says once, it says again
    sys.modules["hnclip_jax.data.builders"]._reported.clear()
  os.chdir(ROOT)  # relative paths as `python SCRIPT` from the repo root sees them
  flag_context = _flags_aside() if module_run else _entry_flags(script)
  with flag_context as module, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    flags.FLAGS.unparse_flags()
    try:
      if module_run:  # app.run parses sys.argv (argv[0] becomes the module's file) and exits
        with warnings.catch_warnings():  # the module is imported already (the tests use its functions): expected
          warnings.filterwarnings("ignore", "'hnclip_jax.* found in sys.modules", RuntimeWarning)
          runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
      else:
        module.main(module.parse_flags(argv))
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
      sys.argv = saved_argv
      os.chdir(saved_cwd)
      storage.stop_debug_log()
      for k, v in cache.items():
        jax.config.update(k, v)
  return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())
