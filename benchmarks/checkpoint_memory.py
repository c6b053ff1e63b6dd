"""Host memory and loop stalls of checkpoint saves, several saves in one process (as train.py makes them).

  python benchmarks/checkpoint_memory.py [--preset vit_l14] [--saves 5] [--target local|bucket] [--sync]
                                        [--variants release,keep]

A train state as train.py saves it (parameters and AdamW's two moments, fp32, random values made on the device) is
saved `--saves` times with hnclip_jax.checkpoint.Checkpointer (Orbax, async unless --sync) to a local directory or
gs://bench/… on the GCS emulator (fake-gcs-server, tests/requirements.txt), then restored once. Reported per save:
the time the loop is blocked by `save`, the time until committed, the process's resident memory before the save,
its peak during the save (Linux /proc/self/status VmHWM, reset before each save through /proc/self/clear_refs),
and what the save added on top of the state (peak - before) as a multiple of the state's bytes. On a CPU backend
the state itself lives in host memory, so "before" includes it; on a TPU or GPU host only the save's own copies
are host memory — the added multiple is the number to compare across backends.

--variants runs each variant in its own process, one after the other, and prints them side by side: `release` is
the Checkpointer as train.py uses it (the C heap's free pages returned before each save,
hostmem.release_free_memory); `keep` the same with that call made a no-op (the code before it existed).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def rss_bytes() -> tuple[int, int]:
  """(resident now, peak resident since the last reset) of this process, in bytes."""
  now = peak = 0
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        now = int(line.split()[1]) * 1024
      elif line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
  return now, peak


def reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def make_state(preset: str):
  import jax
  import jax.numpy as jnp
  from hnclip_jax.config import model_config
  from hnclip_jax.models import CLIPConfig
  from hnclip_jax.models.clip import abstract_model
  over = {"text_context": 248} if preset == "vit_l14" else {}
  cfg = CLIPConfig(**dict(model_config(preset, **over))).validate()
  _, abstract = abstract_model(cfg)
  leaves, treedef = jax.tree.flatten(abstract)

  @jax.jit
  def tree(key):  # one program for the whole tree (per-leaf programs would compile hundreds of times)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  return {"step": jnp.int32(1), **{name: tree(jax.random.key(i)) for i, name in enumerate(("params", "mu", "nu"))}}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="vit_l14")
  p.add_argument("--saves", type=int, default=5)
  p.add_argument("--target", default="local", choices=["local", "bucket"])
  p.add_argument("--sync", action="store_true", help="synchronous saves (config.async_checkpointing=False)")
  p.add_argument("--variants", default="release,keep")
  p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in this process
  a = p.parse_args()
  if a.variant is None:
    tables = []
    for v in a.variants.split(","):
      args = [sys.executable, __file__, "--preset", a.preset, "--saves", str(a.saves), "--target", a.target,
              "--variant", v, *(["--sync"] if a.sync else [])]
      out = subprocess.run(args, capture_output=True, text=True)
      if out.returncode:
        print(out.stdout, out.stderr[-3000:])
        raise SystemExit(f"variant {v} failed ({out.returncode})")
      tables.append(out.stdout[out.stdout.index("\n" + a.preset + ":"):].strip())
    print("\n\n".join(tables))
    return
  from hnclip_jax import hostmem
  release = hostmem.release_free_memory
  if a.variant == "keep":
    hostmem.release_free_memory = lambda: None
  emu = None
  if a.target == "bucket":
    from gcs import Emulator
    emu = Emulator(tempfile.mkdtemp(prefix="gcs-bench-")).start()
    os.environ.update(emu.env)
    emu.make_bucket("bench")
  import jax
  from hnclip_jax.checkpoint import Checkpointer
  try:
    state = make_state(a.preset)
    jax.block_until_ready(state)
    release()  # both variants start from the state alone (making it leaves XLA's temporaries in the C heap)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    where = (tempfile.mkdtemp(prefix="ckpt-mem-") + "/checkpoints" if a.target == "local"
             else f"gs://bench/{a.preset}/checkpoints")
    ck = Checkpointer(where, max_to_keep=2, async_save=not a.sync)
    rows = []
    for i in range(1, a.saves + 1):
      before, _ = rss_bytes()
      reset_peak()
      t = time.perf_counter()
      ck.save(i, state, {"model": {}}, force=True)
      blocked = time.perf_counter() - t
      ck.wait()
      done = time.perf_counter() - t
      after, peak = rss_bytes()
      rows.append({"save": i, "blocked_s": round(blocked, 2), "committed_s": round(done, 2),
                   "rss_before_GB": round(before / 1e9, 2), "peak_GB": round(peak / 1e9, 2),
                   "rss_after_GB": round(after / 1e9, 2), "added_x_state": round((peak - before) / nbytes, 2),
                   "peak_x_state": round(peak / nbytes, 2)})
      print(json.dumps(rows[-1]), flush=True)
    ck.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    del state
    ck = Checkpointer(where, max_to_keep=2, create=False)
    t = time.perf_counter()
    step, restored, _ = ck.restore_latest_intact(abstract)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t
    ck.close()
  finally:
    if emu is not None:
      emu.stop()
  print(f"\n{a.preset}: train state {nbytes / 1e9:.2f} GB, {a.target}, {'sync' if a.sync else 'async'} saves, "
        f"variant {a.variant}, "
        f"{os.cpu_count()} CPU cores; restore of step {step}: {restore_s:.1f} s")
  print("| save | loop blocked (s) | until committed (s) | RSS before (GB) | peak during save (GB) | added / state |"
        " RSS after (GB) |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['save']} | {r['blocked_s']} | {r['committed_s']} | {r['rss_before_GB']} | {r['peak_GB']} | "
          f"{r['added_x_state']} | {r['rss_after_GB']} |")


if __name__ == "__main__":
  main()
