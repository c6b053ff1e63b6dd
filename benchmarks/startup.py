"""Start-up time with and without the persistent XLA compilation cache (config.compilation_cache_dir), and the
time to build a large model abstractly.

  python benchmarks/startup.py [--config configs/demo.py] [--reps 2]
  python benchmarks/startup.py --abstract vit_l14,siglip_so400m14_384 [--reps 3]

Times a whole `train.py` run of 1 step (process start, data, model, compiling the train/eval programs, one step,
checkpoint, eval): first with the cache disabled, then with an empty cache (cold: fills it), then warm.
`--abstract`: `models.abstract_model` (every train.py / eval.py start builds the model this way) against the same
build with flax's own nnx.Rngs, side by side, alternating, in one process; both must give the same graphdef and
parameter shapes.
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


def abstract_times(presets: list, reps: int) -> None:
  import jax
  from flax import nnx
  from hnclip_jax.models import PRESETS, abstract_model
  from hnclip_jax.models.clip import CLIP, split_params

  def with_nnx_rngs(cfg):
    return split_params(nnx.eval_shape(lambda: CLIP(cfg, rngs=nnx.Rngs(0))))
  print(f"abstract model build, {os.cpu_count()} CPU cores, median of {reps}, alternating")
  print("| preset | parameters | abstract_model (s) | with nnx.Rngs (s) | ratio |\n|---|---:|---:|---:|---:|")
  for name in presets:
    cfg = PRESETS[name]
    times, outs = {"ours": [], "nnx": []}, {}
    for rep in range(reps):
      for which in (("ours", "nnx") if rep % 2 == 0 else ("nnx", "ours")):
        t = time.perf_counter()
        outs[which] = abstract_model(cfg) if which == "ours" else with_nnx_rngs(cfg)
        times[which].append(time.perf_counter() - t)
    (g1, p1), (g2, p2) = outs["ours"], outs["nnx"]
    same = g1 == g2 and jax.tree.map(lambda x: (x.shape, x.dtype), p1) == jax.tree.map(lambda x: (x.shape, x.dtype), p2)
    if not same:
      raise SystemExit(f"{name}: abstract_model and the nnx.Rngs build differ")
    n = sum(int(x.size) for x in jax.tree.leaves(p1))
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["nnx"])
    print(f"| {name} | {n / 1e6:.0f}M | {ours:.2f} | {theirs:.2f} | {theirs / ours:.1f}x |", flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--reps", type=int, default=2)
  p.add_argument("--abstract", default="", help="presets to build abstractly, comma-separated (no train.py run)")
  a = p.parse_args()
  if a.abstract:
    sys.path.insert(0, ROOT)
    abstract_times(a.abstract.split(","), a.reps)
    return
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
