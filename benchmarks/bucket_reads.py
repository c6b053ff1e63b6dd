"""Random-access reads of a TFDS array_record build on a bucket (the GCS emulator) vs a local disk: examples/s, and
what the bucket path transfers for them (a relay in front of the emulator counts requests and response bytes).

  python benchmarks/bucket_reads.py [--reads 512] [--num_train 4096] [--image_size 64] [--hosts 2]

Builds the built-in synthetic data locally (config.data.name=synthetic), uploads it to gs://bench/tfds on
fake-gcs-server (tests/requirements.txt), and reads the same `--reads` random indices of the train split through
`tfds.data_source` (grain's ArrayRecordDataSource) from each place, in one process: the local disk, the bucket
directly, and the bucket staged into a local cache first (data/staging.py, what train.py does); then `--hosts`
processes stage it at once, each into a cache of its own (the hosts of a pod at a job's start). The emulator
runs on this machine: the numbers measure the protocol path (one HTTP request per record, what each asks for),
not a real bucket's latency or bandwidth.
"""
import argparse
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--reads", type=int, default=512)
  p.add_argument("--num_train", type=int, default=4096)
  p.add_argument("--image_size", type=int, default=64)
  p.add_argument("--hosts", type=int, default=2, help="processes that stage the build at once (1: none)")
  a = p.parse_args()
  from gcs import Emulator, Relay
  emu = Emulator(tempfile.mkdtemp(prefix="gcs-bench-")).start()
  emu.make_bucket("bench")
  relay = Relay().start(emu.port)
  os.environ.update(emu.env)
  os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = relay.url  # array_record's reader goes through the relay
  import numpy as np
  import tensorflow_datasets as tfds
  from hnclip_jax import paths
  from hnclip_jax.config import base_config
  from hnclip_jax.data import builders
  try:
    data = base_config().data
    data.num_train, data.image_size = a.num_train, a.image_size
    local = tempfile.mkdtemp(prefix="tfds-local-")
    name, kwargs, _ = builders.DATASETS["synthetic"]
    kw = {**kwargs(data), "file_format": "array_record"}
    tfds.builder(name, data_dir=local, **kw).download_and_prepare()
    paths.upload_tree(local, "gs://bench/tfds")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(local) for f in fs
               if "train.array_record" in f)
    idx = np.random.default_rng(0).integers(0, a.num_train, a.reads)
    rows = []
    for where in (local, "gs://bench/tfds"):
      src = tfds.data_source(name, data_dir=where, builder_kwargs=kw,
                             decoders={"image": tfds.decode.SkipDecoding()})["train"]
      src[0]
      n0, b0 = len(relay.requests), relay.response_bytes
      t = time.perf_counter()
      got = sum(len(src[int(i)]["image"]) for i in idx)
      dt = time.perf_counter() - t
      gets = [r for r in relay.requests[n0:] if re.search(r"train\.array_record", r)]
      rows.append((where, a.reads / dt, got, len(gets), relay.response_bytes - b0))
    # What train.py does with a bucket data_dir: stage the build into this host's cache once, then read locally.
    os.environ["HNCLIP_DATA_CACHE"] = tempfile.mkdtemp(prefix="stage-")
    from hnclip_jax.data import staging
    remote = str(tfds.builder(name, data_dir="gs://bench/tfds", **kw).data_path)
    t = time.perf_counter()
    staged_dir, fetched, _ = staging.stage("gs://bench/tfds", remote)
    stage_s = time.perf_counter() - t
    t = time.perf_counter()
    _, again, reused = staging.stage("gs://bench/tfds", remote)
    restage_s = time.perf_counter() - t
    src = tfds.data_source(name, data_dir=staged_dir, builder_kwargs=kw,
                           decoders={"image": tfds.decode.SkipDecoding()})["train"]
    src[0]
    t = time.perf_counter()
    got = sum(len(src[int(i)]["image"]) for i in idx)
    rows.append(("staged", a.reads / (time.perf_counter() - t), got, 0, 0))
    hosts = _stage_on_hosts(a.hosts, remote) if a.hosts > 1 else []
  finally:
    relay.stop()
    emu.stop()
  print(f"\ntrain split {size / 1e6:.1f} MB, {a.num_train} examples at {a.image_size} px; {a.reads} random reads; "
        f"{os.cpu_count()} CPU cores")
  print("| where | examples/s | image bytes read | GET requests | bytes transferred | transferred / read |")
  print("|---|---:|---:|---:|---:|---:|")
  for where, rate, got, gets, sent in rows:
    label = {"gs://bench/tfds": "bucket, direct (emulator)", "staged": "bucket, staged first"}.get(where, "local disk")
    print(f"| {label} | {rate:.0f} | {got / 1e6:.2f} MB | {gets} | {sent / 1e6:.1f} MB | "
          f"{sent / got if sent else 0:.0f}x |")
  print(f"\nstaging (data/staging.py): {fetched / 1e6:.1f} MB fetched and verified in {stage_s:.2f} s "
        f"({fetched / 1e6 / stage_s:.0f} MB/s); a second time: {again / 1e6:.1f} MB fetched, {reused / 1e6:.1f} MB "
        f"reused, {restage_s:.2f} s")
  if hosts:
    wall = max(h["end"] for h in hosts) - min(h["start"] for h in hosts)
    total = sum(h["fetched"] for h in hosts)
    print(f"{len(hosts)} hosts staging at once (a process each, its own cache): " + ", ".join(
        f"{h['fetched'] / 1e6:.1f} MB in {h['end'] - h['start']:.2f} s" for h in hosts) +
        f"; {total / 1e6:.1f} MB from the bucket in {wall:.2f} s ({total / 1e6 / wall:.0f} MB/s together)")


_STAGER = """
import json, sys, time
from hnclip_jax.data import staging
start = time.time()
_, fetched, reused = staging.stage(sys.argv[1], sys.argv[2])
print(json.dumps({"start": start, "end": time.time(), "fetched": fetched, "reused": reused}))
"""


def _stage_on_hosts(n: int, remote: str) -> list[dict]:
  """`n` processes (as `n` hosts, each with an empty cache of its own) stage the build at the same time."""
  import json
  import subprocess
  procs = [subprocess.Popen([sys.executable, "-c", _STAGER, "gs://bench/tfds", remote], cwd=ROOT,
                            env={**os.environ, "HNCLIP_DATA_CACHE": tempfile.mkdtemp(prefix=f"host{i}-"),
                                 "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True) for i in range(n)]
  return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]


if __name__ == "__main__":
  main()
