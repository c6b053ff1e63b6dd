"""Writes tests/durations.json (test id -> seconds) from a pytest JUnit XML report; tests/conftest.py hands the
slowest work out first with it. Refresh after adding slow tests:

  python -m pytest -q tests --junitxml=/tmp/junit.xml && python tests/record_durations.py /tmp/junit.xml

Tests the report does not hold (the `registry` and `long` ones a plain run leaves out) keep their recorded times.
"""
import json
import os
import re
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
  out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
  try:
    with open(out) as f:
      times = json.load(f)
  except OSError:
    times = {}
  for case in ET.parse(path).iter("testcase"):
    module = case.get("classname").replace(".", "/") + ".py"
    name = re.sub(r"@[\w.-]+$", "", case.get("name"))  # the xdist group suffix
    times[f"{module}::{name}"] = round(float(case.get("time")), 1)
  with open(out, "w") as f:
    json.dump(dict(sorted(times.items())), f, indent=0)
    f.write("\n")
  print(f"{out}: {len(times)} tests, {sum(times.values()) / 60:.1f} test-minutes")


if __name__ == "__main__":
  main(sys.argv[1])
