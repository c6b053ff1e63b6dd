"""Fixed short runs of every objective path, to show a refactor changes no number (issue 54).

  python benchmarks/behaviour.py record OUT [--only NAME,...]   # train.py (4 steps) + eval.py per variant
  python benchmarks/behaviour.py compare OLD NEW                 # metrics.jsonl and eval_results.json, bit for bit

Each variant is configs/demo.py:test on the built-in data (HNCLIP_TFDS_DIR or a fresh build in OUT/tfds) with one
objective path switched on: the longclip default, FineLIP, GOAL, StructXLIP, LoRA, DoRA, the token term with both
schedules, HN-SigLIP. `compare` prints every value that differs (perf/ timings and wall-clock fields excepted) with
its relative difference, and exits 1 if any does.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--config", "configs/demo.py:test", "--config.total_steps=4", "--config.log_every=1",
          "--config.checkpoint_every=4", "--config.eval_every=4"]
VARIANTS = {
    "longclip": [],
    "finelip": ["--config.framework=finelip", "--config.finelip.tokens=4"],
    "goal": ["--config.framework=goal"],
    "structxlip": ["--config.framework=structxlip", "--config.structxlip.steps_per_epoch=2"],
    "lora": ["--config.finetune.method=lora"],
    "dora": ["--config.finetune.method=dora"],
    "token_gather": ["--config.loss.token_weight=1.0", "--config.loss.token_schedule=gather"],
    "token_ring": ["--config.loss.token_weight=1.0", "--config.loss.token_schedule=ring"],
    "hn_siglip": ["--config.loss.kind=sigmoid", "--config.model.logit_bias=True"],
}
SKIP = ("time", "wall", "perf/", "goodput/", "steps_per_s", "eta")  # metrics.TIMING_PREFIXES and the log lines' clocks


def record(out, only):
  os.makedirs(out, exist_ok=True)
  data = os.environ.get("HNCLIP_TFDS_DIR") or os.path.join(out, "tfds")
  for name, extra in VARIANTS.items():
    if only and name not in only:
      continue
    w = os.path.join(out, name)
    for script in ("train.py", "eval.py"):
      args = [sys.executable, script, *COMMON, f"--config.data.data_dir={data}", "--workdir", w]
      args += extra
      proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
      if proc.returncode:
        sys.exit(f"{name}: {script} failed:\n{proc.stderr[-3000:]}")
    print(f"{name}: recorded in {w}", flush=True)


def _rows(path):
  with open(path) as f:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP)} for line in f if line.strip()]


def compare(old, new):
  bad = 0
  for name in VARIANTS:
    a, b = os.path.join(old, name), os.path.join(new, name)
    if not all(os.path.exists(os.path.join(d, "eval_results.json")) for d in (a, b)):
      print(f"{name}: not recorded in both")
      continue
    ra, rb = _rows(os.path.join(a, "metrics.jsonl")), _rows(os.path.join(b, "metrics.jsonl"))
    ea = json.load(open(os.path.join(a, "eval_results.json")))
    eb = json.load(open(os.path.join(b, "eval_results.json")))
    diffs = []
    if len(ra) != len(rb):
      diffs.append(f"{len(ra)} vs {len(rb)} metric rows")
    for x, y in zip(ra, rb):
      for k in sorted(set(x) | set(y)):
        if x.get(k) != y.get(k):
          rel = (abs(x[k] - y[k]) / max(abs(x[k]), 1e-30) if isinstance(x.get(k), float)
                 and isinstance(y.get(k), float) else None)
          diffs.append(f"step {x.get('step')} {k}: {x.get(k)!r} vs {y.get(k)!r}" + (f" (rel {rel:.2e})" if rel else ""))
    for d in ("t2i", "i2t"):
      if ea.get(d) != eb.get(d):
        diffs.append(f"eval {d}: {ea.get(d)} vs {eb.get(d)}")
    bad += bool(diffs)
    print(f"{name}: " + ("bit-identical" if not diffs else f"{len(diffs)} differences\n  " + "\n  ".join(diffs[:20])))
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  if len(sys.argv) >= 3 and sys.argv[1] == "record":
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    record(sys.argv[2], only)
  elif len(sys.argv) == 4 and sys.argv[1] == "compare":
    compare(sys.argv[2], sys.argv[3])
  else:
    sys.exit(__doc__)
