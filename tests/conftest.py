"""Shared test set-up: persistent compilation cache, repo on the path, helpers for subprocess runs."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.expanduser("~/.cache/hnclip_jax/xla-tests")
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run_py(args, *, devices: int = 1, timeout: int = 600, check: bool = True, env_extra=None):
  """Runs `python ARGS` from the repo root in a fresh process with `devices` fake CPU devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(env_extra or {})
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-6000:]}")
  return proc


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
  """One TFDS data dir shared by every test (synthetic datasets are built once)."""
  return str(tmp_path_factory.mktemp("tfds"))
