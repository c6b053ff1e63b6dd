"""Start-up time with and without the persistent XLA compilation cache (config.compilation_cache_dir).

  python benchmarks/startup.py [--config configs/demo.py] [--reps 2]

Times a whole `train.py` run of 1 step (process start, data, model, compiling the train/eval programs, one step,
checkpoint, eval): first with the cache disabled, then with an empty cache (cold: fills it), then warm.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config, cache, workdir, data_dir):
  shutil.rmtree(workdir, ignore_errors=True)
  t = time.perf_counter()
  # JAX's own cache variables would win over config.compilation_cache_dir (cli.enable_compilation_cache)
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  subprocess.run([sys.executable, "train.py", "--config", config, "--workdir", workdir, "--config.total_steps=1",
                  f"--config.compilation_cache_dir={cache}", f"--config.data.data_dir={data_dir}"],
                 cwd=ROOT, check=True, capture_output=True, env=env)
  return time.perf_counter() - t


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--reps", type=int, default=2)
  a = p.parse_args()
  tmp = tempfile.mkdtemp()
  data_dir, cache, work = (os.path.join(tmp, x) for x in ("tfds", "xla", "work"))
  run(a.config, "", work, data_dir)  # builds the dataset once, outside the timings
  off = statistics.median(run(a.config, "", work, data_dir) for _ in range(a.reps))
  cold = run(a.config, cache, work, data_dir)
  warm = statistics.median(run(a.config, cache, work, data_dir) for _ in range(a.reps))
  print(f"1-step train.py run, {a.config}, {os.cpu_count()} CPU cores")
  print("| compilation cache | seconds |\n|---|---|")
  print(f"| off | {off:.1f} |\n| on, cold (empty) | {cold:.1f} |\n| on, warm | {warm:.1f} |")
  print(f"warm / off = {warm / off:.2f}")


if __name__ == "__main__":
  main()
