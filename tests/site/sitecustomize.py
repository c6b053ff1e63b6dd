"""Loaded by every Python process the tests start (conftest._env puts this directory on PYTHONPATH; the test
processes themselves call `same_cache_key_on_every_process` from conftest): makes JAX's persistent compilation
cache serve every process of a multi-process CPU job, not only process 0.

JAX's cache key hashes the accelerator topology's fingerprint, and on the CPU backend that fingerprint differs
between the processes of one job although their global device lists are identical (checked with jax 0.10.2:
2 processes × 2 devices, `xla_client.get_topology_for_devices(jax.devices()).fingerprint()` differs). Only process 0
writes cache entries, so every other process missed them and compiled every program again, in every run, warm or
cold. On CPU the key here hashes the global devices instead (platform, kind, id, process); TPU and GPU keys, and
users' runs, are untouched. Nothing of JAX is imported here: the key function is replaced when JAX imports it.

Python imports one `sitecustomize` per process, the first on the path, and this directory comes first: after its own
work this one runs the next `sitecustomize.py` on the path (benchmarks/compile_log's when that is on PYTHONPATH, or
the interpreter's own), so nothing a process would have loaded is left out.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def same_cache_key_on_every_process(cache_key) -> None:
  """Replaces jax._src.cache_key._hash_accelerator_config: on CPU, the global devices; otherwise JAX's own."""
  original = cache_key._hash_accelerator_config
  if getattr(original, "hnclip_tests", False):
    return

  def _hash_accelerator_config(hash_obj, accelerators):
    devices = list(accelerators.flat)
    if devices and all(d.platform == "cpu" for d in devices):
      for d in devices:
        cache_key._hash_string(hash_obj, f"{d.platform}/{d.device_kind}/{d.id}/{d.process_index}")
    else:
      original(hash_obj, accelerators)

  _hash_accelerator_config.hnclip_tests = True
  cache_key._hash_accelerator_config = _hash_accelerator_config


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != "jax._src.cache_key":
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
      return None
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      same_cache_key_on_every_process(module)

    spec.loader.exec_module = exec_module
    return spec


def _run_next_sitecustomize() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  for entry in sys.path:
    directory = os.path.abspath(entry or os.getcwd())
    path = os.path.join(directory, "sitecustomize.py")
    if directory != here and os.path.isfile(path):
      spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
      spec.loader.exec_module(importlib.util.module_from_spec(spec))
      return


if __name__ == "sitecustomize":  # imported by Python at start-up (conftest loads it under another name)
  sys.meta_path.insert(0, _Finder())
  _run_next_sitecustomize()
