"""The prepared accelerator benchmark script runs end to end in its CPU quick mode and writes every result."""
import json
import os
import subprocess

from conftest import ROOT, _env


def test_accelerator_script_quick_mode(tmp_path):
  env = _env(1, {"OUT": str(tmp_path)})
  proc = subprocess.run(["bash", "benchmarks/accelerator.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  steps = json.load(open(tmp_path / "step_time.json"))["models"][0]
  assert steps["model"] == "tiny" and steps["step_s_gamma0.5"] > 0
  # The analytic FLOP count agrees with XLA's cost analysis.
  assert abs(steps["analytic_TFLOP"] / steps["xla_TFLOP"] - 1) < 0.05
  retr = json.load(open(tmp_path / "retrieval.json"))
  assert retr[0]["method"] == "hnclip" and retr[0]["n"] == 2000
  loss = json.load(open(tmp_path / "loss_memory.json"))
  assert [r["global_batch"] for r in loss] == [512, 1024]
  for name in ("memory.json", "devices.txt"):
    assert os.path.getsize(tmp_path / name) > 0
