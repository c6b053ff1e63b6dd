"""Workdirs on a bucket (gs://), against a real GCS emulator (fake-gcs-server on 127.0.0.1, tests/gcs.py): training,
resuming and evaluating there give what a local workdir gives, nothing named after the URL appears on the local
disk, and what cannot work is refused in one line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, _env, assert_error_exit, metrics_rows, run_py
from gcs import Emulator

BASE = ["--config", "configs/demo.py:test", "--config.total_steps=6", "--config.checkpoint_every=2",
        "--config.log_every=1", "--config.eval_every=100", "--config.max_to_keep=10"]


def train(gcs, workdir, tfds_dir, *extra, check=True):
  """gcs: the Emulator, or the environment to run with."""
  return run_py(["train.py", *BASE, "--workdir", str(workdir), f"--config.data.data_dir={tfds_dir}", *extra],
                env_extra=gcs if isinstance(gcs, dict) else gcs.env, check=check)


def evaluate(gcs, workdir, *extra):
  return run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(workdir), *extra],
                env_extra=gcs.env)


def bucket_rows(gcs, name):
  return [json.loads(line) for line in gcs.read("bkt", name).decode().splitlines() if line.strip()]


def no_perf(rows):
  from hnclip_jax.metrics import TIMING_PREFIXES
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def test_train_resume_and_eval_on_a_bucket_match_a_local_disk(gcs, tfds_dir, tmp_path):
  local = tmp_path / "local"
  train(gcs, local, tfds_dir)
  out = train(gcs, "gs://bkt/run", tfds_dir, "--config.profile.steps=5:6")
  assert "done: 6 steps; checkpoints in gs://bkt/run/checkpoints" in out.stdout
  assert not os.path.exists(os.path.join(ROOT, "gs:")) and not os.path.exists("gs:")  # no directory named after it
  names = gcs.objects("bkt", "run/")
  for want in ("run/model.json", "run/data.json", "run/metrics.jsonl", "run/tokenizer/tokenizer_meta.json",
               *(f"run/checkpoints/{s}/commit_success.txt" for s in (2, 4, 6))):
    assert want in names, (want, names)
  assert "run/.lock" not in names  # released at the end of the run
  assert no_perf(bucket_rows(gcs, "run/metrics.jsonl")) == metrics_rows(local)  # bit for bit

  # TensorBoard reads the event file the run uploaded: every logged loss, in order.
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  events = [n for n in names if n.startswith("run/tensorboard/events.out.tfevents")]
  assert len(events) == 1, names
  path = tmp_path / "events"
  path.write_bytes(gcs.read("bkt", events[0]))
  losses = [(e.step, v.tensor.float_val[0]) for e in EventFileLoader(str(path)).Load() for v in e.summary.value
            if v.tag == "loss"]
  assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in metrics_rows(local) if "loss" in r]
  assert len(losses) == 6
  # The profile of steps 5-6 reached the bucket (staged locally, uploaded when the trace stopped).
  trace = [n for n in names if n.startswith("run/tensorboard/plugins/profile/")]
  assert sorted(n.rsplit("/", 1)[1].split(".", 1)[1] for n in trace) == ["trace.json.gz", "xplane.pb"], trace
  assert "profile of steps 5-6 written to gs://bkt/run/tensorboard" in out.stdout

  # A run killed after step 4 (checkpoint 6 never written): a plain rerun resumes from the bucket, bit-identically.
  before = bucket_rows(gcs, "run/metrics.jsonl")
  for name in gcs.objects("bkt", "run/checkpoints/6/"):
    gcs.delete("bkt", name)
  out = train(gcs, "gs://bkt/run", tfds_dir)
  assert "resumed from gs://bkt/run/checkpoints/4 (step 4)" in out.stdout
  assert no_perf(bucket_rows(gcs, "run/metrics.jsonl")) == no_perf(before)

  # eval.py reads the bucket workdir and records its result there; the same recall as the local workdir's.
  evaluate(gcs, local)
  evaluate(gcs, "gs://bkt/run")
  with open(local / "eval_results.json") as f:
    want = json.load(f)
  got = json.loads(gcs.read("bkt", "run/eval_results.json"))
  assert got["step"] == want["step"] == 6
  assert (got["t2i"], got["i2t"]) == (want["t2i"], want["i2t"])
  assert len(bucket_rows(gcs, "run/eval_history.jsonl")) == 1

  # The eval watcher follows the bucket run: every checkpoint evaluated, the best exported there (best.json last).
  out = evaluate(gcs, "gs://bkt/run", "--watch", "--watch_poll_s=1", "--watch_timeout_s=60")
  assert "evaluated steps [2, 4, 6]" in out.stdout, out.stdout[-2000:]
  watched = [r for r in bucket_rows(gcs, "run/eval_history.jsonl") if r.get("job") == "watch"]
  assert [r["step"] for r in watched] == [2, 4, 6]
  assert watched[-1]["t2i"] == got["t2i"]
  best = json.loads(gcs.read("bkt", "run/best/best.json"))
  top = max(r["metric_value"] for r in watched)  # the first step to reach the highest value (a tie keeps the first)
  assert (best["step"], best["value"]) == (next(r["step"] for r in watched if r["metric_value"] == top), top)
  assert all(r["best_step"] == best["step"] for r in watched if r["step"] >= best["step"])
  assert {"run/best/model.json", "run/best/params/commit_success.txt"} <= set(gcs.objects("bkt", "run/best/"))


def test_what_a_bucket_cannot_do_is_refused_in_one_line(gcs, tfds_dir):
  proc = train(gcs, "s4://bkt/run", tfds_dir, check=False)
  assert_error_exit(proc, "--workdir=s4://bkt/run", "s4://", "gs://BUCKET/PATH")
  start = time.monotonic()
  proc = train(gcs, "gs://no-such-bucket/run", tfds_dir, check=False)
  assert_error_exit(proc, "gs://no-such-bucket/run")
  assert time.monotonic() - start < 60
  # Outside an emulator, with no credentials anywhere: the bucket and the ways to authenticate, at once.
  start = time.monotonic()
  proc = run_py(["train.py", *BASE, "--workdir", "gs://bkt/nocreds", f"--config.data.data_dir={tfds_dir}"],
                env_extra={"HOME": str(tfds_dir) + "-no-home", "GOOGLE_APPLICATION_CREDENTIALS": "",
                           "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9"}, check=False)
  line = assert_error_exit(proc, "--workdir=gs://bkt/nocreds", "no usable Google Cloud credentials for gs://bkt",
                           "gcloud auth application-default login", "GOOGLE_APPLICATION_CREDENTIALS")
  assert time.monotonic() - start < 60 and "token" not in proc.stdout.lower() + line.lower()
  # A server that does not answer at all (nothing listens on the port): one line, not gcsfs' minutes of retries.
  from gcs import _free_port
  dead = f"http://127.0.0.1:{_free_port()}"
  start = time.monotonic()
  proc = train({**gcs.env, "STORAGE_EMULATOR_HOST": dead, "TENSORSTORE_GCS_HTTP_URL": dead,
                "CLOUD_STORAGE_EMULATOR_ENDPOINT": dead}, "gs://bkt/dead",
               tfds_dir, check=False)
  assert_error_exit(proc, "gs://bkt", "cannot be reached")
  assert time.monotonic() - start < 60
  for root in ("gs://bkt", "gs://bkt/"):  # a bucket's root is no run directory: refused before anything is written
    proc = train(gcs, root, tfds_dir, check=False)
    assert_error_exit(proc, f"--workdir={root} is the root of its store", "--workdir=gs://bkt/RUN_NAME")
  assert not [n for n in gcs.objects("bkt") if n.startswith(("checkpoints/", "metrics.jsonl", ".lock", "model"))]
  proc = train(gcs, "gs://bkt/data-run", tfds_dir, "--config.data.manual_dir=gs://bkt/raw", check=False)
  line = assert_error_exit(proc, "config.data.manual_dir=gs://bkt/raw", "gcloud storage cp -r gs://bkt/raw")
  doc, section = re.search(r'\((docs/\w+\.md) "([^"]+)"\)', line).groups()  # the pointer names a real section
  with open(os.path.join(ROOT, doc)) as f:
    assert f"## {section}\n" in f.read(), (doc, section)
  assert not gcs.objects("bkt", "data-run/checkpoints/")  # refused before anything was written
  assert not os.path.exists(os.path.join(ROOT, "s4:")) and not os.path.exists(os.path.join(ROOT, "gs:"))


@pytest.mark.long  # a repeat on a bucket of test_eval_jobs' watcher started before training: `-m long`
def test_a_watcher_started_before_training_on_a_bucket_evaluates_every_checkpoint(gcs, tfds_dir, tmp_path):
  """eval.py --watch started before train.py on a bucket workdir: it waits for model.json and for the checkpoint
  directory, which on a bucket exists only once the first checkpoint lands (it ended with 'no checkpoints in
  gs://bkt/early/checkpoints; train first' as soon as model.json appeared), then evaluates every checkpoint and
  exports the best."""
  log = tmp_path / "watch.log"
  with open(log, "w") as f:
    watcher = subprocess.Popen([sys.executable, "eval.py", "--config", "configs/demo.py:test", "--workdir",
                                "gs://bkt/early", "--watch", "--watch_poll_s=0.5", "--watch_timeout_s=240"],
                               cwd=ROOT, env=_env(1, gcs.env), stdout=f, stderr=subprocess.STDOUT, text=True)
  try:
    end = time.monotonic() + 120
    while "waiting for train.py to set up gs://bkt/early" not in log.read_text():
      assert watcher.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
      time.sleep(0.2)
    train(gcs, "gs://bkt/early", tfds_dir, "--config.total_steps=4")
    assert watcher.wait(timeout=300) == 0, log.read_text()[-3000:]
  finally:
    watcher.kill()
  out = log.read_text()
  assert "evaluated steps [2, 4]" in out, out[-2000:]
  assert [r["step"] for r in bucket_rows(gcs, "early/eval_history.jsonl") if r.get("job") == "watch"] == [2, 4]
  assert "early/best/best.json" in gcs.objects("bkt", "early/best/")


def test_the_bucket_lease_refuses_a_second_run_and_frees_a_dead_ones(gcs, tfds_dir):
  held = {"host": "another-host", "pid": 1, "renewed": time.time()}
  gcs.write("bkt", "leased/.lock", json.dumps(held).encode())
  proc = train(gcs, "gs://bkt/leased", tfds_dir, "--config.total_steps=2", check=False)
  assert_error_exit(proc, "another train.py (host another-host, pid 1) holds gs://bkt/leased/.lock")
  assert json.loads(gcs.read("bkt", "leased/.lock")) == held  # left as it was
  # A lease whose process on this host is gone (a SIGKILLed run) is taken over at once.
  import socket
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  gcs.write("bkt", "leased/.lock",
            json.dumps({"host": socket.gethostname(), "pid": dead.pid, "renewed": time.time()}).encode())
  out = train(gcs, "gs://bkt/leased", tfds_dir, "--config.total_steps=2")
  assert "done: 2 steps" in out.stdout
  assert f"taking over gs://bkt/leased/.lock: its holder (host {socket.gethostname()}, pid {dead.pid}) is gone" \
      in out.stdout
  assert "leased/.lock" not in gcs.objects("bkt", "leased/")
  losses = [r["loss"] for r in bucket_rows(gcs, "leased/metrics.jsonl") if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all()


_PROBE_RACE = """
import sys, time
from hnclip_jax import paths, storage
errors, seen, listings = [], 0, 0
deadline = time.monotonic() + 120
# The loops overlap by construction: the prober starts once the lister has, the lister lists until the prober is
# done (the two markers lie outside checkpoints/).
if sys.argv[1] == "probe":
  while not paths.exists("gs://bkt/race/listing") and time.monotonic() < deadline:
    time.sleep(0.01)
  for _ in range(100):
    try:
      storage.check_writable("gs://bkt/race/checkpoints", "the checkpoint directory")
    except Exception as e:
      errors.append(f"{type(e).__name__}: {e}")
  paths.write_text("gs://bkt/race/probed", "")
else:
  paths.write_text("gs://bkt/race/listing", "")
  while (listings < 100 or not paths.exists("gs://bkt/race/probed")) and time.monotonic() < deadline:
    listings += 1
    try:
      names = paths.listdir("gs://bkt/race/checkpoints")
      assert all(n.startswith(".write-probe-") for n in names), names
      seen += bool(names)
    except Exception as e:
      errors.append(f"{type(e).__name__}: {e}")
print(len(errors), seen, listings, errors[:1])
"""


def test_listing_a_prefix_whose_last_object_goes_meanwhile_is_empty_not_an_error(gcs):
  """Two processes of one run start on one bucket workdir: process 0 writes and removes its write probe under
  checkpoints/ while process 1 lists checkpoints/ (experiment.resolve_data on a fresh workdir). On a bucket the prefix
  exists only while the probe does; a listing that found it and then lost it raised gcsfs' FileNotFoundError
  ('b/bkt/o/race%2Fcheckpoints': 63 of 200 listings here) and process 1 ended before joining the job — the
  two-process test's rare failure (process 0 then aborted waiting for it). paths.listdir reads it as empty."""
  procs = [subprocess.Popen([sys.executable, "-c", _PROBE_RACE, role], cwd=ROOT, env=_env(1, gcs.env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in ("probe", "list")]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert [out.split(" ", 1)[0] for out, _ in outs] == ["0", "0"], outs
  seen, listings = (int(x) for x in outs[1][0].split()[1:3])
  assert seen > 0 and listings >= 100, outs  # the lister saw probes come and go: the loops did overlap


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_two_processes_train_into_the_bucket_are_killed_and_resume_bit_identically(gcs, tfds_dir, tmp_path):
  """2 processes × 4 CPU devices write one workdir on the emulator (each its own checkpoint shards; process 1 talks
  to it through a relay that records its requests); both are SIGKILLed once checkpoints 1 and 2 landed, and a plain
  rerun (the lease of the dead process 0 taken over), followed by an eval watcher in a third process, ends with the
  metrics of an uninterrupted single-process run on 8 devices. Process 1 writes only its checkpoint shards and its
  goodput record: the run's metadata, metrics, lease and commit markers are process 0's."""
  import signal
  from conftest import run_processes, start_processes
  from gcs import Relay
  args = ["train.py", "--config", "configs/demo.py:test", "--config.total_steps=3", "--config.log_every=1",
          "--config.eval_every=3", "--config.checkpoint_every=1", f"--config.data.data_dir={tfds_dir}"]
  straight, one = str(tmp_path / "straight"), str(tmp_path / "one")
  run_processes([*args, "--workdir", straight], num_processes=2, devices_per_process=4)
  run_py([*args, "--workdir", one], devices=8)
  relay = Relay().start(gcs.port)
  try:
    for fault in ({"HNCLIP_FAULT": "kill_after_saves@3"}, {}):
      procs = start_processes([*args, "--workdir", "gs://bkt/two"], num_processes=2, devices_per_process=4,
                              env_extra={**gcs.env, **fault}, env_of={1: relay.env(gcs)})
      if not fault:  # the watcher follows the resumed run from a third process
        watcher = subprocess.Popen(
            [sys.executable, "eval.py", "--config", "configs/demo.py:test", "--workdir", "gs://bkt/two",
             f"--config.data.data_dir={tfds_dir}", "--watch", "--watch_poll_s=1", "--watch_timeout_s=120"],
            cwd=ROOT, env=_env(1, gcs.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      outs = [p.communicate(timeout=600) for p in procs]
      if fault:
        if [p.returncode for p in procs] != [-signal.SIGKILL] * 2:  # in full: pytest shortens assertion messages
          for i, (out, err) in enumerate(outs):
            print(f"---- process {i} (exit {procs[i].returncode}) stdout:\n{out[-3000:]}\n---- stderr:\n{err[-8000:]}")
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
        names = gcs.objects("bkt", "two/")
        assert "two/checkpoints/2/commit_success.txt" in names and "two/.lock" in names  # left by the killed run
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    assert "resumed from gs://bkt/two/checkpoints/2 (step 2)" in outs[0][0], outs[0][0][-2000:]
    watched, err = watcher.communicate(timeout=300)
    assert watcher.returncode == 0, err[-2000:]
    evaluated = re.search(r"evaluated steps \[([\d, ]*)\]", watched)
    assert evaluated and [int(x) for x in evaluated.group(1).split(",")] == [1, 2, 3], watched[-2000:]
  finally:
    relay.stop()
  got = no_perf(bucket_rows(gcs, "two/metrics.jsonl"))
  assert got and got == metrics_rows(straight)  # bit for bit: the uninterrupted run of the same two processes
  # One process with the same 8 devices: the same numbers up to the order of the cross-process reductions.
  want = metrics_rows(one)
  assert [sorted(r) for r in got] == [sorted(r) for r in want]
  for a, b in zip(got, want):
    for k in a:
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])
  writes = [r for r in relay.requests if not r.startswith("GET ")]
  shard = re.compile(r"two(%2F|/)checkpoints(%2F|/)\d+(%2F|/)state(%2F|/)(ocdbt\.process_1|array_metadatas(%2F|/)process_1)")
  probe = re.compile(r"two(%2F|/)(checkpoints(%2F|/))?\.write-probe-")  # storage.check_writable: made, then deleted
  own = re.compile(r"two(%2F|/)goodput(%2F|/)[\d.T]+-p1\.json")  # its own goodput record (goodput.py)
  assert writes and all(shard.search(r) or probe.search(r) or own.search(r) for r in writes), \
      [r for r in writes if not (shard.search(r) or probe.search(r) or own.search(r))][:5]
  assert any(own.search(r) for r in writes)
  assert any(shard.search(r) for r in writes)


def test_a_server_that_stops_mid_run_ends_it_in_one_line_and_a_rerun_resumes(tmp_path, tfds_dir):
  """The storage server goes away while train.py runs (it logs every step and saves every 2): the run ends with one
  `error:` line naming the bucket path and the way on, no traceback and no hang (after the client's own retries);
  with the server back, the same command resumes from the last committed checkpoint and ends bit-identically to
  an uninterrupted run."""
  emu = Emulator(str(tmp_path / "gcs")).start()
  try:
    emu.make_bucket("bkt")
    args = [sys.executable, "train.py", *BASE, "--config.total_steps=20", f"--config.data.data_dir={tfds_dir}"]
    local = tmp_path / "local"
    run_py(["train.py", *BASE, "--config.total_steps=20", f"--config.data.data_dir={tfds_dir}",
            "--workdir", str(local)])
    proc = subprocess.Popen([*args, "--workdir", "gs://bkt/fault"], cwd=ROOT, env=_env(1, emu.env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
      if line.startswith("step 5/"):
        break
    emu.stop()
    out, err = proc.communicate(timeout=400)
    assert_error_exit(subprocess.CompletedProcess(args, proc.returncode, out, err), "gs://bkt/fault",
                      "rerun the same command to resume")
    emu.start()
    done = run_py(["train.py", *BASE, "--config.total_steps=20", f"--config.data.data_dir={tfds_dir}",
                   "--workdir", "gs://bkt/fault"], env_extra=emu.env)
    assert "resumed from gs://bkt/fault/checkpoints/" in done.stdout
    assert no_perf(bucket_rows(emu, "fault/metrics.jsonl")) == metrics_rows(local)
  finally:
    emu.stop()


def test_weights_paths_may_be_buckets(gcs, tfds_dir):
  """pretrained export and convert read and write buckets, and config.init_from starts from one: a bucket workdir
  exported to a Hugging Face directory on the bucket, converted back onto the bucket and used as init_from trains
  exactly as init_from=the workdir itself."""
  short = ["--config.total_steps=2", "--config.checkpoint_every=2"]
  train(gcs, "gs://bkt/w", tfds_dir, *short)
  out = run_py(["-m", "hnclip_jax.pretrained.export", "gs://bkt/w", "gs://bkt/hf", "--format=hf"], env_extra=gcs.env)
  assert "wrote gs://bkt/hf (Hugging Face CLIPModel) from gs://bkt/w (step 2)" in out.stdout
  assert {"hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"} <= set(gcs.objects("bkt", "hf/"))
  run_py(["-m", "hnclip_jax.pretrained.convert", "gs://bkt/hf", "gs://bkt/conv"], env_extra=gcs.env)
  train(gcs, "gs://bkt/from-conv", tfds_dir, *short, "--config.init_from=gs://bkt/conv")
  train(gcs, "gs://bkt/from-run", tfds_dir, *short, "--config.init_from=gs://bkt/w")
  a, b = (no_perf(bucket_rows(gcs, f"{w}/metrics.jsonl")) for w in ("from-conv", "from-run"))
  assert len([r for r in a if "loss" in r]) == 2 and a == b
  assert a != no_perf(bucket_rows(gcs, "w/metrics.jsonl"))  # it did start from the trained weights


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_a_server_gone_mid_save_or_mid_restore_ends_the_run_in_seconds_and_loses_nothing(tmp_path, tfds_dir):
  """The server goes away at an exact moment, through a relay in front of the emulator (tests/gcs.py): while Orbax
  writes checkpoint 4's arrays (tensorstore, which on its own retries for ~15 min), and, on the rerun, while it reads
  checkpoint 2's. Each time one `error:` line within seconds; checkpoint 2 stays complete (nothing set aside as
  damaged); with the server back a plain rerun resumes from it and ends bit-identically to an uninterrupted run."""
  from gcs import Relay
  relay = Relay()
  emu = Emulator(str(tmp_path / "gcs"), external_url=relay.url)
  relay.start(emu.port)
  emu.start()
  try:
    emu.make_bucket("bkt")
    args = ["train.py", *BASE, "--config.total_steps=6", f"--config.data.data_dir={tfds_dir}"]
    local = tmp_path / "local"
    run_py([*args, "--workdir", str(local)])
    ran = []

    def run():
      start = time.monotonic()
      proc = run_py([*args, "--workdir", "gs://bkt/cut"], env_extra=relay.env(emu), check=False, timeout=300)
      ran.append(time.monotonic() - start)
      return proc

    relay.stop_on(rb"cut%2Fcheckpoints%2F4%2Fstate%2F[^ ]*%2Fd%2F")  # the first array data of checkpoint 4
    proc = run()
    assert relay.stopped.is_set()
    assert_error_exit(proc, "gs://bkt/cut", "cannot be reached", "rerun the same command")
    names = emu.objects("bkt", "cut/")
    assert "cut/checkpoints/2/commit_success.txt" in names and "cut/checkpoints/4/commit_success.txt" not in names

    relay.start(emu.port)
    relay.stop_on(rb"GET /[^ ]*cut%2Fcheckpoints%2F2%2Fstate%2F(?:[^ ]*%2F)?d%2F")  # the first array read of checkpoint 2
    proc = run()
    assert relay.stopped.is_set()
    assert_error_exit(proc, "gs://bkt/cut", "cannot be reached", "rerun the same command")
    assert emu.objects("bkt", "cut/checkpoints/") == [n for n in names if n.startswith("cut/checkpoints/")]
    assert not emu.objects("bkt", "cut/checkpoints_damaged/")

    relay.start(emu.port)
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from gs://bkt/cut/checkpoints/2 (step 2)" in done.stdout
    assert no_perf(bucket_rows(emu, "cut/metrics.jsonl")) == metrics_rows(local)
    print("seconds per run (gone mid-save, gone mid-restore, resumed):", [round(t, 1) for t in ran])
    assert max(ran[:2]) < 90, ran  # not the libraries' own retries (minutes); the runs include JAX start-up
  finally:
    relay.stop()
    emu.stop()


def test_clustered_batches_store_their_index_in_the_bucket_and_a_resume_reads_it(gcs, tfds_dir):
  """config.data.batching=clustered with a gs:// workdir: the caption index and its record are bucket objects, and
  a rerun on the bucket resumes from them (it would refuse without the index) with the metrics of the first run."""
  args = ["--config.data.batching=clustered", "--config.total_steps=4", "--config.checkpoint_every=2"]
  train(gcs, "gs://bkt/clustered", tfds_dir, *args)
  names = gcs.objects("bkt", "clustered/batching/")
  assert {"clustered/batching/caption_index.npy", "clustered/batching/caption_index.json"} <= set(names), names
  meta = json.loads(gcs.read("bkt", "clustered/batching/caption_index.json"))
  assert meta["examples"] == 128
  first = bucket_rows(gcs, "clustered/metrics.jsonl")
  again = train(gcs, "gs://bkt/clustered", tfds_dir, *args[:1], "--config.total_steps=6",
                "--config.checkpoint_every=2")
  assert "resumed from gs://bkt/clustered/checkpoints/4 (step 4)" in again.stdout, again.stdout[-2000:]
  assert "clustered batches:" in again.stdout
  assert bucket_rows(gcs, "clustered/metrics.jsonl")[:len(first)] == first


def test_a_compilation_cache_in_the_bucket_serves_a_second_host(gcs, tfds_dir, monkeypatch):
  """config.compilation_cache_dir=gs://…: the first process compiles every program into the bucket; a second one
  (another host, a replacement VM: nothing of the first on its disk) reads every program it runs from there — its
  goodput account lists each program's cache verdict, and none is compiled, the train step included."""
  from hnclip_jax import goodput
  from hnclip_jax.workdir import Workdir
  cache = "gs://bkt/xla-shared"
  records = []
  for run in ("first", "second"):
    env = _env(1, gcs.env)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # the test suite's shared local cache would win over the config
    workdir = f"gs://bkt/cache-{run}"
    proc = subprocess.run([sys.executable, "train.py", *BASE, "--config.total_steps=2", "--workdir", workdir,
                           f"--config.data.data_dir={tfds_dir}", f"--config.compilation_cache_dir={cache}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k, v in gcs.env.items():
      monkeypatch.setenv(k, v)
    records.append(goodput.summarize(Workdir(workdir).goodput_records())["programs"])
  first, second = records
  assert any(p["cache"] == "miss" for p in first)
  assert len(gcs.objects("bkt", "xla-shared/")) >= len([p for p in first if p["cache"] == "miss"])
  assert "jit(step)" in [p["name"] for p in second]
  assert [p for p in second if p["cache"] != "hit"] == []


def test_a_holder_whose_lease_was_taken_over_finds_out_instead_of_overwriting_it(gcs, monkeypatch):
  """A train.py whose renewals stalled past the lease's TTL (a frozen VM) while another run took the workdir over:
  its next renewal fails on the generation precondition instead of writing over the new holder's lease, the run
  stops at its next save or log line naming the new holder, and its release removes nothing."""
  for k, v in gcs.env.items():
    monkeypatch.setenv(k, v)
  from hnclip_jax import preemption
  from hnclip_jax.workdir import Workdir
  lock = preemption.WorkdirLock(Workdir("gs://bkt/lease-race"))
  lease = lock._lease
  lease._stop.set()  # its renewal thread stalls: renewals happen only when this test calls them
  lease._thread.join()
  assert lease.renew() and lease.renew()  # its own lease: renewed
  lock.check()
  # the other run, after the TTL: removes the stale lease and creates its own (another client: the JSON API)
  gcs.delete("bkt", "lease-race/.lock")
  gcs.write("bkt", "lease-race/.lock", json.dumps({"host": "other-host", "pid": 4242,
                                                    "renewed": time.time()}).encode())
  assert not lease.renew()
  assert json.loads(gcs.read("bkt", "lease-race/.lock"))["host"] == "other-host"  # not overwritten
  with pytest.raises(ValueError, match=r"lost gs://bkt/lease-race/\.lock to another run \(host other-host, "
                                       r"pid 4242\).*Stopped without writing anything more"):
    lock.check()
  lock.release()
  assert json.loads(gcs.read("bkt", "lease-race/.lock"))["host"] == "other-host"  # not removed either


def test_an_unreachable_bucket_is_never_read_as_empty(tmp_path, monkeypatch):
  """With the server gone, asking whether a path or a checkpoint is there raises paths.Unreachable within seconds
  (it used to answer False / [] after the retries, and a failed run then said "no checkpoint is complete yet"
  about checkpoints that were in the bucket)."""
  emu = Emulator(str(tmp_path / "gcs")).start()
  emu.make_bucket("bkt")
  for k, v in emu.env.items():
    monkeypatch.setenv(k, v)
  from hnclip_jax import paths
  from hnclip_jax.checkpoint import Checkpointer
  emu.write("bkt", "run/checkpoints/5/commit_success.txt", b"done")
  emu.write("bkt", "run/metrics.jsonl", b"{}\n")
  ck = Checkpointer("gs://bkt/run/checkpoints", create=False)
  assert "checkpoints/5" in ck.intact_note() and paths.isdir("gs://bkt/run/checkpoints/5")
  assert not paths.exists("gs://bkt/run/nothing") and paths.listdir("gs://bkt/run/nothing") == []
  emu.stop()
  for ask in (lambda: paths.exists("gs://bkt/run/metrics.jsonl"), lambda: paths.isdir("gs://bkt/run/checkpoints"),
              lambda: paths.listdir("gs://bkt/run/checkpoints")):
    t = time.time()
    with pytest.raises(paths.Unreachable):
      ask()
    assert time.time() - t < 15
  note = ck.intact_note()
  assert "could not be listed" in note and "no checkpoint is complete" not in note


def test_data_built_into_and_read_from_a_bucket_trains_as_from_a_local_disk(gcs, tfds_dir, tmp_path):
  """config.data.data_dir=gs://…: the first run builds the data (locally, then uploaded with its dataset_info.json
  last) and stages it into its host's cache; the run equals one on a local build bit for bit; a second run reuses
  both the build (writing nothing under it) and the staged copy (fetching nothing), and eval.py reads it too."""
  local = tmp_path / "local"
  train(gcs, local, tfds_dir)
  env = {**gcs.env, "HNCLIP_DATA_CACHE": str(tmp_path / "cache")}
  out = train(env, tmp_path / "from-bucket", "gs://bkt/tfds")
  assert "data: building hnclip_synthetic into gs://bkt/tfds/hnclip_synthetic/" in out.stdout
  staged = re.search(r"staged in \S+ \(([\d.]+) MB fetched, ([\d.]+) MB already there\)", out.stdout)
  assert staged and float(staged.group(1)) > 0 and float(staged.group(2)) == 0, out.stdout[-3000:]
  built = gcs.objects("bkt", "tfds/")
  assert [n for n in built if n.endswith("dataset_info.json")] and [n for n in built if ".array_record-" in n]
  assert metrics_rows(tmp_path / "from-bucket") == metrics_rows(local)  # the same examples in the same order
  out = train(env, tmp_path / "again", "gs://bkt/tfds")
  assert "data: reusing the hnclip_synthetic build in gs://bkt/tfds/hnclip_synthetic/" in out.stdout
  again = re.search(r"staged in \S+ \(([\d.]+) MB fetched, ([\d.]+) MB already there\)", out.stdout)
  assert again and float(again.group(1)) == 0 and again.group(2) == staged.group(1), out.stdout[-3000:]
  assert gcs.objects("bkt", "tfds/") == built
  assert metrics_rows(tmp_path / "again") == metrics_rows(local)
  recalls = [[line for line in run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(w),
                                       f"--config.data.data_dir={d}"], env_extra=env).stdout.splitlines()
              if line.startswith(("text->image", "image->text"))] for w, d in ((tmp_path / "from-bucket",
                                                                                "gs://bkt/tfds"), (local, tfds_dir))]
  assert len(recalls[0]) == 2 and recalls[0] == recalls[1], recalls
  # eval.py --benchmarks reads a benchmark's data from the bucket too (the entry's keys over the run's data config).
  cfg = tmp_path / "with_benchmarks.py"
  cfg.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom configs.demo import get_config as demo\n\n\n"
                 "def get_config():\n  c = demo('test')\n  c.eval.benchmarks.synthetic = {'split': 'test'}\n"
                 "  return c\n")
  table = run_py(["eval.py", "--config", str(cfg), "--workdir", str(tmp_path / "from-bucket"), "--benchmarks=all",
                  "--config.data.data_dir=gs://bkt/tfds"], env_extra=env)
  with open(tmp_path / "from-bucket" / "eval_table.json") as f:
    row = json.load(f)["benchmarks"]["synthetic"]
  t2i = next(line for line in recalls[0] if line.startswith("text->image"))
  assert [f"{v:.2f}" for v in row["t2i"].values()] == re.findall(r"R@\d+=\s*([\d.]+)", t2i), (row, t2i)
  assert "synthetic" in table.stdout


def test_data_staging_cut_off_by_the_server_ends_in_one_line_and_a_rerun_trains_as_from_a_local_disk(tmp_path,
                                                                                                  tfds_dir):
  """The data on a bucket, the workdir local: the server goes away while the train split is being staged (a relay
  in front of it stops at the first request for that file): the run ends within seconds with one `error:` line
  naming the data path, no traceback, nothing half-copied left where the cache is read; with the server back the
  same command stages the build and ends as a run on a local build does; a data bucket that does not exist is
  refused before anything compiles."""
  from gcs import Relay
  emu = Emulator(str(tmp_path / "gcs")).start()
  relay = Relay().start(emu.port)
  cache = tmp_path / "cache"
  env = {**relay.env(emu), "HNCLIP_DATA_CACHE": str(cache)}
  try:
    emu.make_bucket("bkt")
    data = "gs://bkt/tfds"
    base = ["train.py", *BASE, "--config.total_steps=12", "--config.checkpoint_every=4"]
    local = tmp_path / "local"
    run_py([*base, f"--config.data.data_dir={tfds_dir}", "--workdir", str(local)])
    args = [*base, f"--config.data.data_dir={data}", "--workdir", str(tmp_path / "w")]
    relay.stop_on(rb"GET [^ ]*train\.array_record")
    t = time.monotonic()
    proc = run_py(args, env_extra=env, check=False)
    assert_error_exit(proc, f"staging the data in {data}", "cannot be reached")
    assert time.monotonic() - t < 90
    staged = [os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs]
    assert not [f for f in staged if "train.array_record" in f and not f.endswith(".staged.json")
                and os.path.exists(f + ".staged.json")], staged  # no train file in place
    assert not [f for f in staged if f.endswith("dataset_info.json")], staged  # TFDS sees no complete build
    relay.start(emu.port)
    out = run_py(args, env_extra=env)
    assert re.search(r"data: gs://bkt/tfds/hnclip_synthetic/\S+ staged in \S+ \([\d.]+ MB fetched", out.stdout)
    assert metrics_rows(tmp_path / "w") == metrics_rows(local)
    blocked = tmp_path / "a-file"  # a cache that cannot be written (a file where its directory would go)
    blocked.write_text("")
    proc = run_py(args, env_extra={**env, "HNCLIP_DATA_CACHE": str(blocked / "cache")}, check=False)
    assert_error_exit(proc, "staging gs://bkt/tfds/hnclip_synthetic/", "HNCLIP_DATA_CACHE", "then rerun")
    start = time.monotonic()
    proc = run_py([*base, "--config.data.data_dir=gs://no-such-bucket/tfds", "--workdir", str(tmp_path / "x")],
                  env_extra=env, check=False)
    assert_error_exit(proc, "gs://no-such-bucket", "does not exist")
    assert time.monotonic() - start < 60
  finally:
    relay.stop()
    emu.stop()


@pytest.mark.long
def test_two_processes_with_clustered_batches_on_bucket_data_train_as_from_a_local_build(gcs, tfds_dir, tmp_path):
  """config.data.batching=clustered with the data on the bucket, 2 processes × 4 devices: the caption index is made
  from the staged data at the first start and the run equals the same two processes on a local build, bit for
  bit; killed after its second checkpoint and rerun, it resumes from the stored index and ends the same."""
  from conftest import run_processes
  args = ["train.py", "--config", "configs/demo.py:test", "--config.total_steps=4", "--config.log_every=1",
          "--config.eval_every=4", "--config.checkpoint_every=1", "--config.data.batching=clustered"]
  straight = tmp_path / "straight"
  run_processes([*args, f"--config.data.data_dir={tfds_dir}", "--workdir", str(straight)], num_processes=2,
                devices_per_process=4)
  env = {**gcs.env, "HNCLIP_DATA_CACHE": str(tmp_path / "cache")}
  bucket = [*args, "--config.data.data_dir=gs://bkt/clustered-tfds", "--workdir", str(tmp_path / "w")]
  from conftest import collect_processes, start_processes
  procs = start_processes(bucket, num_processes=2, devices_per_process=4, env_extra={**env, "HNCLIP_FAULT":
                                                                                     "kill_after_saves@2"})
  for p in procs:
    p.communicate(timeout=600)
  assert -signal.SIGKILL in [p.returncode for p in procs], [p.returncode for p in procs]
  assert (tmp_path / "w" / "batching" / "caption_index.npy").exists()
  outs = collect_processes(start_processes(bucket, num_processes=2, devices_per_process=4, env_extra=env), bucket)
  assert "resumed from" in outs[0][0] and "clustered batches:" in outs[0][0], outs[0][0][-3000:]
  assert metrics_rows(tmp_path / "w") == metrics_rows(straight)


@pytest.mark.long
def test_two_processes_stage_a_bucket_build_once_each_and_train_as_from_a_local_build(gcs, tfds_dir, tmp_path):
  """2 processes × 4 devices (each with its own disk cache, as two hosts) train from data on the bucket: process 0
  builds and uploads it, then each process fetches each array_record file of the build exactly once (counted by a
  relay in front of the emulator per process) and the run equals the same two processes on a local build, bit for
  bit."""
  from conftest import run_processes, start_processes
  from gcs import Relay
  args = ["train.py", "--config", "configs/demo.py:test", "--config.total_steps=3", "--config.log_every=1",
          "--config.eval_every=3", "--config.checkpoint_every=1"]
  straight = tmp_path / "straight"
  run_processes([*args, f"--config.data.data_dir={tfds_dir}", "--workdir", str(straight)], num_processes=2,
                devices_per_process=4)
  relays = [Relay().start(gcs.port) for _ in range(2)]
  try:
    procs = start_processes(
        [*args, "--config.data.data_dir=gs://bkt/shared-tfds", "--workdir", str(tmp_path / "w")], num_processes=2,
        devices_per_process=4, env_extra=gcs.env,
        env_of={i: {**relays[i].env(gcs), "HNCLIP_DATA_CACHE": str(tmp_path / f"host{i}")} for i in range(2)})
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
  finally:
    for r in relays:
      r.stop()
  assert metrics_rows(tmp_path / "w") == metrics_rows(straight)
  files = sorted(n.rsplit("/", 1)[1] for n in gcs.objects("bkt", "shared-tfds/") if ".array_record-" in n)
  assert len(files) == 2, files  # train and test
  for relay in relays:
    reads = [r for r in relay.requests if r.startswith("GET ") and "alt=media" in r and ".array_record-" in r]
    assert sorted(re.search(r"(hnclip_synthetic-\w+\.array_record-\d+-of-\d+)", r).group(1) for r in reads) == \
        files, reads


@pytest.mark.parametrize("batching", ["random", pytest.param("clustered", marks=pytest.mark.long)])
def test_two_processes_reading_the_bucket_in_place_fetch_only_their_share(gcs, tfds_dir, tmp_path, batching):
  """config.data.bucket_reads='direct', 2 processes × 4 devices: over a resumed stretch of N steps each process
  fetches only the training examples of its half of each global batch — one GET per example, counted by a relay in
  front of the emulator per process: from N·B/2 up to the pipeline's read-ahead more, where whole batches would be
  N·B — random and clustered batches alike; the run equals the same processes on a local build bit for bit."""
  from conftest import collect_processes, run_processes, start_processes
  from gcs import Relay
  args = ["train.py", "--config", "configs/demo.py:test", "--config.log_every=1", "--config.eval_every=100",
          "--config.checkpoint_every=4", f"--config.data.batching={batching}"]
  straight = tmp_path / "straight"
  run_processes([*args, "--config.total_steps=16", f"--config.data.data_dir={tfds_dir}", "--workdir", str(straight)],
                num_processes=2, devices_per_process=4)
  work, direct = tmp_path / "w", ["--config.data.data_dir=gs://bkt/direct-tfds", "--config.data.bucket_reads=direct"]
  # The first start builds the data into the bucket, reads whole splits (the tokenizer fit, the clustered index) and
  # is killed after step 5, once checkpoint 4 has landed.
  procs = start_processes([*args, "--config.total_steps=16", *direct, "--workdir", str(work)], num_processes=2,
                          devices_per_process=4, env_extra={**gcs.env, "HNCLIP_FAULT": "kill_after_saves@5"})
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, [o[1][-3000:] for o in outs]
  relays = [Relay().start(gcs.port) for _ in range(2)]
  try:
    outs = collect_processes(start_processes([*args, "--config.total_steps=16", *direct, "--workdir", str(work)],
                                             num_processes=2, devices_per_process=4, env_extra=gcs.env,
                                             env_of={i: relays[i].env(gcs) for i in range(2)}), args)
  finally:
    for r in relays:
      r.stop()
  assert "reading gs://bkt/direct-tfds in place" in outs[0][0] and "resumed from" in outs[0][0], outs[0][0]
  assert metrics_rows(work) == metrics_rows(straight)
  steps, half = 12, 16 // 2
  for relay in relays:
    gets = [r for r in relay.requests if r.startswith("GET ") and re.search(r"train\.array_record", r)]
    assert steps * half <= len(gets) <= (steps + 6) * half < steps * 16, len(gets)


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_a_server_gone_while_reading_the_bucket_in_place_ends_the_run_in_one_line(tmp_path, tfds_dir):
  """config.data.bucket_reads='direct', the workdir local: the server goes away mid-epoch while train.py reads its
  examples from the bucket (a relay in front of it stops): one `error:` line naming the data path within seconds
  of the reader's own retries, no traceback; with the server back, a plain rerun resumes and ends as a run on a
  local build."""
  from gcs import Relay
  emu = Emulator(str(tmp_path / "gcs")).start()
  relay = Relay().start(emu.port)
  try:
    emu.make_bucket("bkt")
    base = ["train.py", *BASE, "--config.total_steps=20", "--config.checkpoint_every=4"]
    local = tmp_path / "local"
    run_py([*base, f"--config.data.data_dir={tfds_dir}", "--workdir", str(local)])
    data = ["--config.data.data_dir=gs://bkt/tfds", "--config.data.bucket_reads=direct"]
    args = [*base, *data, "--workdir", str(tmp_path / "w")]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(1, relay.env(emu)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
      if line.startswith("step 9/"):  # mid-epoch (8 steps an epoch), checkpoint 8 on its way
        break
    relay.stop()
    t = time.monotonic()
    out, err = proc.communicate(timeout=400)
    assert_error_exit(subprocess.CompletedProcess(args, proc.returncode, out, err),
                      "reading the data in gs://bkt/tfds", "cannot be reached")
    assert time.monotonic() - t < 90
    relay.start(emu.port)
    done = run_py(args, env_extra=relay.env(emu))
    assert "resumed from" in done.stdout
    assert metrics_rows(tmp_path / "w") == metrics_rows(local)
  finally:
    relay.stop()
    emu.stop()
