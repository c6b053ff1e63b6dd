"""Where a test run's time goes: XLA compile and trace+lowering seconds per test (from benchmarks/compile_log's
events) next to each test's duration (from pytest's junit XML), longest tests first.

  python benchmarks/compile_report.py LOG_DIR JUNIT_XML [--top 30] [--functions TEST_SUBSTRING]
"""
import argparse
import collections
import glob
import json
import os
import xml.etree.ElementTree as ET

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")


def test_of(current: str) -> str:
  return current.split(" ")[0].split("@")[0]  # PYTEST_CURRENT_TEST: "path::name@xdist_group (call)"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("log_dir")
  p.add_argument("junit")
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--functions", default="", help="also list the compiled functions of the tests matching this")
  a = p.parse_args()
  events = []
  for fn in glob.glob(os.path.join(a.log_dir, "*.jsonl")):
    with open(fn) as f:
      for line in f:
        try:
          events.append(json.loads(line))
        except ValueError:  # a process killed mid-line
          pass
  compile_s, trace_s, programs = collections.Counter(), collections.Counter(), collections.Counter()
  by_fun, n_fun = collections.Counter(), collections.Counter()
  for e in events:
    t = test_of(e["test"]) or "(outside pytest) " + " ".join(e["argv"])
    if e["event"] == COMPILE:
      compile_s[t] += e["secs"]
      programs[t] += 1
      if a.functions and a.functions in t:
        by_fun[e["fun"]] += e["secs"]
        n_fun[e["fun"]] += 1
    elif e["event"] in TRACE:
      trace_s[t] += e["secs"]
  duration = {}
  for tc in ET.parse(a.junit).getroot().iter("testcase"):
    duration[test_of(tc.get("classname").replace(".", "/") + ".py::" + tc.get("name"))] = float(tc.get("time"))
  print(f"tests {len(duration)}: {sum(duration.values()) / 60:.1f} test-minutes; XLA compile "
        f"{sum(compile_s.values()) / 60:.1f} CPU-minutes ({sum(programs.values())} programs), trace + lowering "
        f"{sum(trace_s.values()) / 60:.1f} (nested traces counted in each)")
  print("| test | seconds | XLA compile (s) | programs | trace + lowering (s) |\n|---|---:|---:|---:|---:|")
  for t, d in sorted(duration.items(), key=lambda kv: -kv[1])[:a.top]:
    print(f"| {t} | {d:.1f} | {compile_s[t]:.1f} | {programs[t]} | {trace_s[t]:.1f} |")
  for f, s in by_fun.most_common(20):
    print(f"  {s:7.1f} s  {n_fun[f]:4d}x  {f}")


if __name__ == "__main__":
  main()
