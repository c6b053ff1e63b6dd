"""Shared test set-up: persistent compilation cache, repo on the path, helpers for subprocess runs."""
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.expanduser("~/.cache/hnclip_jax/xla-tests")
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _env(devices, env_extra=None):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(env_extra or {})
  return env


def start_processes(args, *, num_processes: int, devices_per_process: int, env_extra=None):
  """Starts `python ARGS` as a multi-process JAX job on 127.0.0.1; returns the Popen objects."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return [subprocess.Popen([sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}",
                            f"--num_processes={num_processes}", f"--process_id={i}"],
                           cwd=ROOT, env=_env(devices_per_process, env_extra), stdout=subprocess.PIPE,
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


def run_processes(args, *, num_processes: int, devices_per_process: int, timeout: int = 600):
  """Runs `python ARGS` as a multi-process JAX job on 127.0.0.1; returns the processes' outputs."""
  procs = start_processes(args, num_processes=num_processes, devices_per_process=devices_per_process)
  return collect_processes(procs, args, timeout=timeout)


def run_py(args, *, devices: int = 1, timeout: int = 600, check: bool = True, env_extra=None):
  """Runs `python ARGS` from the repo root in a fresh process with `devices` fake CPU devices."""
  env = _env(devices, env_extra)
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-6000:]}")
  return proc


def metrics_rows(workdir) -> list:
  """The rows of a train.py workdir's metrics.jsonl."""
  import json
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def check_resume_is_bit_identical(args, workdir, copy_to, last: int, resume_from: int) -> None:
  """Copies a finished train.py `workdir` to `copy_to`, deletes its step-`last` checkpoint and reruns `args` there:
  it must resume from step `resume_from` and end with bit-identical metrics and parameters."""
  import shutil
  import jax
  import numpy as np
  from hnclip_jax import pretrained
  shutil.copytree(workdir, copy_to)
  shutil.rmtree(os.path.join(copy_to, "checkpoints", str(last)))
  proc = run_py([*args, "--workdir", copy_to])
  assert f"(step {resume_from})" in proc.stdout
  assert metrics_rows(copy_to) == metrics_rows(workdir)
  a, b = pretrained.load(workdir).params, pretrained.load(copy_to).params
  assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def listing(root):
  """Every file under `root` (but the lock file and the debug log, which records why a run stopped) with its size:
  'nothing on disk changed' is this staying equal."""
  return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                for d, _, fs in os.walk(root) for f in fs if f not in (".lock", "debug.log"))


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
  """One TFDS data dir shared by every test (synthetic datasets are built once)."""
  return str(tmp_path_factory.mktemp("tfds"))


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
