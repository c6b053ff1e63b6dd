"""Logs every JAX compile phase (trace, lowering, XLA compile) of every Python process that has this directory on
its PYTHONPATH, with the pytest test that caused it: where a cold test run's time goes (docs/testing.md).

  HNCLIP_COMPILE_LOG=/tmp/clog PYTHONPATH=benchmarks/compile_log python -m pytest -q tests --junitxml=/tmp/j.xml
  python benchmarks/compile_report.py /tmp/clog /tmp/j.xml

One JSON line per event in $HNCLIP_COMPILE_LOG/<pid>.jsonl, through JAX's own monitoring listeners, registered when
jax._src.monitoring is first imported (nothing of JAX is imported earlier, so a process that sets JAX's environment
before importing it is unaffected). Without HNCLIP_COMPILE_LOG it does nothing.
"""
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("HNCLIP_COMPILE_LOG")


def _listener(event, duration, **kw):
  try:
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
      f.write(json.dumps({"event": event, "secs": duration, "fun": kw.get("fun_name"), "time": time.time(),
                          "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "argv": sys.argv[:3]}) + "\n")
  except OSError:
    pass


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != "jax._src.monitoring":
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
      return None
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      module.register_event_duration_secs_listener(_listener)

    spec.loader.exec_module = exec_module
    return spec


if _DIR:
  os.makedirs(_DIR, exist_ok=True)
  sys.meta_path.insert(0, _Finder())
