"""Checkpoint save and restore on a local disk vs a bucket (a GCS emulator on 127.0.0.1), side by side in one run.

  python benchmarks/bucket_checkpoints.py [--presets tiny,vit_l14] [--reps 2]

For each model preset, a train state as train.py checkpoints it (parameters and AdamW's two moments, fp32) is
saved with hnclip_jax.checkpoint.Checkpointer (Orbax, async) to a local directory and to gs://bench/… on
fake-gcs-server (tests/requirements.txt), then restored. Reported per preset and target: the time the training
loop is blocked by `save` (async saving: the call returns once the arrays are copied to host memory and the write
started), the save's total time (until committed) and the restore time. The emulator runs on this machine (its
filesystem backend), so the bucket numbers measure the GCS protocol path (HTTP, OCDBT objects, commit markers),
not a real bucket's network.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--presets", default="tiny,vit_l14")
  p.add_argument("--reps", type=int, default=2)
  p.add_argument("--state", default="train", choices=["train", "params"],
                 help="train: parameters + AdamW's two moments (what train.py saves); params: parameters only")
  p.add_argument("--targets", default="local,bucket")
  a = p.parse_args()
  from gcs import Emulator
  emu = Emulator(tempfile.mkdtemp(prefix="gcs-bench-")).start()
  os.environ.update(emu.env)  # before anything imports gcsfs
  emu.make_bucket("bench")
  import jax
  import numpy as np
  from hnclip_jax.checkpoint import Checkpointer
  from hnclip_jax.config import model_config
  from hnclip_jax.models import CLIPConfig, init_params

  rows = []
  try:
    for preset in a.presets.split(","):
      over = {"text_context": 248} if preset == "vit_l14" else {}
      cfg = CLIPConfig(**dict(model_config(preset, **over))).validate()
      params = jax.device_get(init_params(cfg, 0)[1])
      state = {"step": np.int32(1), "params": params, **({"mu": params, "nu": params} if a.state == "train" else {})}
      nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
                              state)
      state = jax.device_put(state)
      for target in a.targets.split(","):
        times = {"blocked_s": [], "save_s": [], "restore_s": []}
        for rep in range(a.reps):
          where = (tempfile.mkdtemp(prefix="ckpt-bench-") + "/checkpoints" if target == "local"
                   else f"gs://bench/{preset}/{rep}/checkpoints")
          ck = Checkpointer(where, max_to_keep=2)
          t = time.perf_counter()
          ck.save(1, state, {"model": {}})
          times["blocked_s"].append(time.perf_counter() - t)
          ck.wait()
          times["save_s"].append(time.perf_counter() - t)
          ck.close()
          ck = Checkpointer(where, max_to_keep=2, create=False)
          t = time.perf_counter()
          step, restored, _ = ck.restore_latest_intact(abstract)
          jax.block_until_ready(restored)
          times["restore_s"].append(time.perf_counter() - t)
          assert step == 1
          ck.close()
        row = {"preset": preset, "target": target, "state": a.state, "state_MB": round(nbytes / 1e6, 1),
               **{k: round(statistics.median(v), 3) for k, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
  finally:
    emu.stop()
  print(f"\n{os.cpu_count()} CPU cores; median of {a.reps}")
  print("| preset | state MB | target | loop blocked per save (s) | save until committed (s) | restore (s) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['preset']} | {r['state_MB']} | {r['target']} | {r['blocked_s']} | {r['save_s']} | {r['restore_s']} |")


if __name__ == "__main__":
  main()
