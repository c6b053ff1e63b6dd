"""The goodput account of a demo run with one preemption: where the wall time went, and what the restart cost.

  python benchmarks/goodput.py [--workdir DIR] [--config configs/demo.py] [--kill_at 250] [--signal KILL|TERM]
                               [-- --config.X=Y ...]

Runs `train.py --config configs/demo.py` (300 steps, checkpoints every 100) into a fresh workdir, preempts it once
after step --kill_at, and reruns the same command to finish it, then prints the account of each process start and
of the whole run (`python -m hnclip_jax.tools.goodput`). KILL (the default) is a machine lost without warning
(HNCLIP_FAULT=kill@STEP: SIGKILL right after that step; the steps after the last checkpoint are redone); TERM is
the notice a TPU VM gets before a preemption (sent from here once metrics.jsonl shows the step; train.py then
checkpoints where it is and stops, so nothing is redone). Also prints the wall time of each process measured
here, to compare with the account (which cannot see the interpreter's exit after the last record).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def last_step(workdir: str) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return max((json.loads(line).get("step", 0) for line in f if line.strip()), default=0)
  except (OSError, ValueError):
    return 0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", default=None)
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--kill_at", type=int, default=250)
  p.add_argument("--signal", default="KILL", choices=["KILL", "TERM"])
  a, extra = p.parse_known_args()
  extra = [x for x in extra if x != "--"]
  workdir = a.workdir or os.path.join(tempfile.mkdtemp(prefix="goodput-"), "run")
  cmd = [sys.executable, "train.py", "--config", a.config, "--workdir", workdir, *extra]
  walls = []
  for attempt in ("preempted", "resumed"):
    env = dict(os.environ)
    if attempt == "preempted" and a.signal == "KILL":
      env["HNCLIP_FAULT"] = f"kill@{a.kill_at}"
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if attempt == "preempted" and a.signal == "TERM":
      while proc.poll() is None and last_step(workdir) < a.kill_at:
        time.sleep(0.2)
      proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate()
    walls.append(time.time() - t0)
    print(f"--- {attempt}: exit {proc.returncode}, {walls[-1]:.1f} s measured here")
    print("\n".join(line for line in out.splitlines() if "goodput" in line or "resumed" in line
                    or line.startswith(("error", "SIGTERM"))))
  print(f"--- the whole run: {sum(walls):.1f} s measured here ({' + '.join(f'{w:.1f}' for w in walls)})")
  subprocess.run([sys.executable, "-m", "hnclip_jax.tools.goodput", "--workdir", workdir], cwd=ROOT, check=True)


if __name__ == "__main__":
  main()
