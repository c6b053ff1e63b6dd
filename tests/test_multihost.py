"""train.py/eval.py across layouts and across processes give the numbers of a single device/process."""
import json
import os
import signal
import time

import numpy as np
import pytest

from conftest import collect_processes, metrics_rows, run_processes, run_py, start_processes

COMMON = ["--config", "configs/demo.py:test", "--config.total_steps=3", "--config.log_every=1",
          "--config.eval_every=3", "--config.checkpoint_every=3", "--config.data.num_test=41"]


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [(r["step"], r["loss"]) for r in rows if "loss" in r], [r for r in rows if "eval/t2i/R@1" in r]


def _eval(workdir):
  with open(os.path.join(workdir, "eval_results.json")) as f:
    return json.load(f)


@pytest.fixture(scope="session")  # one per test process: the module's tests are spread (conftest.SPLIT)
def reference(tmp_path_factory, tfds_dir):
  """One process, one device."""
  workdir = str(tmp_path_factory.mktemp("one_device"))
  args = [*COMMON, f"--config.data.data_dir={tfds_dir}", "--workdir", workdir]
  run_py(["train.py", *args])
  run_py(["eval.py", *args])
  return workdir


def _assert_same(workdir, reference):
  (got, got_eval), (want, want_eval) = _losses(workdir), _losses(reference)
  assert [s for s, _ in got] == [1, 2, 3] and [s for s, _ in want] == [1, 2, 3]
  for (_, a), (_, b) in zip(got, want):
    assert a == pytest.approx(b, rel=1e-5)
  assert got_eval[0] == pytest.approx(want_eval[0])


# (8, 1, 1) and (2, 2, 2) in the README command; the other three (the same code, parameters split otherwise) in `long`.
@pytest.mark.parametrize("layout", [(8, 1, 1), pytest.param((2, 4, 1), marks=pytest.mark.long),
                                    pytest.param((1, 8, 1), marks=pytest.mark.long), (2, 2, 2),
                                    pytest.param((4, 1, 2), marks=pytest.mark.long)])
def test_layouts_train_like_one_device(tmp_path, tfds_dir, reference, layout):
  d, f, t = layout
  run_py(["train.py", *COMMON, f"--config.data.data_dir={tfds_dir}", "--workdir", str(tmp_path),
          f"--config.mesh.data={d}", f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}"], devices=8)
  _assert_same(str(tmp_path), reference)


def test_two_processes_train_and_eval_like_one(tmp_path, tfds_dir, reference):
  workdir = str(tmp_path / "two")
  args = [*COMMON, f"--config.data.data_dir={tfds_dir}", "--workdir", workdir]
  outs = run_processes(["train.py", *args], num_processes=2, devices_per_process=4)
  assert "mesh {'data': 8, 'fsdp': 1, 'tensor': 1} on 8 cpu devices, 2 process(es)" in outs[0][0]
  assert "steps/s" in outs[0][0] and "steps/s" not in outs[1][0]  # only process 0 prints progress
  _assert_same(workdir, reference)
  run_processes(["eval.py", *args], num_processes=2, devices_per_process=4)
  got, want = _eval(workdir), _eval(reference)
  assert got["num_pairs"] == 41 and got == want  # 41 pairs over 2 processes: none dropped or doubled


@pytest.mark.parametrize("service", [True, pytest.param(False, marks=pytest.mark.long)],
                         ids=["preemption_service", "allgather_fallback"])
def test_sigterm_on_one_process_stops_all_at_the_same_step(tmp_path, tfds_dir, service):
  """A preemption notice to process 1 only: both processes stop at the same step, the checkpoint of that step is
  written and both exit 0. By default JAX's preemption service picks the step (no per-step collective); with the
  service off, the stop flag is all-gathered every step."""
  workdir = tmp_path / "stop"
  args = ["train.py", "--config", "configs/demo.py:test", "--config.total_steps=100000", "--config.log_every=1",
          "--config.eval_every=100000", "--config.checkpoint_every=100000", f"--config.data.data_dir={tfds_dir}",
          "--workdir", str(workdir)]
  procs = start_processes(args, num_processes=2, devices_per_process=4,
                          env_extra={"JAX_ENABLE_PREEMPTION_SERVICE": str(service).lower()})
  try:
    path = workdir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= 3):
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
  finally:
    outs = collect_processes(procs, args, timeout=120)
  reason = "SIGTERM to one of the processes" if service else "a signal to another process"
  stopped = int(outs[0][0].split(f"{reason}: stopped after step ")[1].split(";")[0])
  assert stopped >= 3
  assert f"process 1: stopped after step {stopped}\n" in outs[1][0]  # both processes stopped after the same step
  checkpoints = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
  assert checkpoints == [stopped]
  with open(path) as f:
    assert json.loads(f.readlines()[-1])["step"] == stopped


HYBRID = ["--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.dcn.data=2"]


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_hybrid_mesh_trains_like_one_device_and_resumes_bit_identically(tmp_path, tfds_dir, reference):
  """Two processes (the slow network's granules) × 4 devices, data parallelism across them (config.mesh.dcn.data=2)
  and fsdp × tensor inside each: the losses and the in-training eval of one device; killed on both processes after
  step 3 (steps 1 and 2 checkpointed), a plain rerun ends with the metrics of the uninterrupted run, bit for bit;
  eval.py restores its checkpoint onto one device and reports the one-device run's Recall."""
  args = [*COMMON, f"--config.data.data_dir={tfds_dir}", "--config.checkpoint_every=1", *HYBRID]
  straight = str(tmp_path / "straight")
  outs = run_processes(["train.py", *args, "--workdir", straight], num_processes=2, devices_per_process=4)
  assert ("mesh {'data': 2, 'fsdp': 2, 'tensor': 2} on 8 cpu devices, 2 process(es); across 2 processes (the slow "
          "network): data ×2") in outs[0][0]
  _assert_same(straight, reference)
  killed = str(tmp_path / "killed")
  procs = start_processes(["train.py", *args, "--workdir", killed], num_processes=2, devices_per_process=4,
                          env_extra={"HNCLIP_FAULT": "kill_after_saves@3"})
  outs = [p.communicate(timeout=600) for p in procs]
  if [p.returncode for p in procs] != [-signal.SIGKILL] * 2:  # in full: pytest shortens assertion messages
    for i, (out, err) in enumerate(outs):
      print(f"---- process {i} (exit {procs[i].returncode}) stdout:\n{out[-3000:]}\n---- stderr:\n{err[-8000:]}")
  assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
  assert sorted(int(d) for d in os.listdir(os.path.join(killed, "checkpoints")) if d.isdigit())[-1] == 2
  outs = run_processes(["train.py", *args, "--workdir", killed], num_processes=2, devices_per_process=4)
  assert "checkpoints/2 (step 2)" in outs[0][0], outs[0][0][-2000:]
  assert metrics_rows(killed) == metrics_rows(straight)
  # The hybrid run's checkpoint restored onto one device (another mesh): the one-device run's Recall.
  run_py(["eval.py", *COMMON, f"--config.data.data_dir={tfds_dir}", "--workdir", killed])
  got, want = _eval(killed), _eval(reference)
  assert got["num_pairs"] == want["num_pairs"] == 41
  assert got["step"] == want["step"] == 3
  assert (got["t2i"], got["i2t"]) == (pytest.approx(want["t2i"]), pytest.approx(want["i2t"]))


@pytest.mark.long  # a repeat or a benchmark script's smoke run: `-m long`, run by .ci/run (docs/testing.md)
def test_hybrid_mesh_gradients_equal_one_device():
  """tests/hybrid_checks.py on 2 processes × 4 devices: L_HN with the data, fsdp or tensor axis across the
  processes; accumulation with row chunks; the token term under both schedules; HN-SigLIP under both schedules;
  FineLIP's terms; DoRA with the token term — loss and every parameter gradient equal one device's (≤ 1e-5)."""
  args = ["tests/hybrid_checks.py"]
  outs = collect_processes(start_processes(args, num_processes=2, devices_per_process=4), args)
  result = json.loads(outs[0][0].split("RESULT ", 1)[1])
  assert len(result) == 11
  for name, r in result.items():
    assert r["loss_rel"] <= 1e-5 and r["grad_rel"] <= 1e-5, (name, r)


def test_every_process_reads_the_compilation_cache(tmp_path):
  """The suite's multi-process jobs share one persistent compilation cache: on a rerun every process reads the
  program process 0 wrote (tests/site/sitecustomize.py makes the CPU cache key the same on every process; JAX's own
  key hashes a CPU topology fingerprint that differs between the processes, so process 1 never hit). In the first
  run process 1 may already read what process 0 wrote a moment before (the two compile independently), so only process
  0, whose cache starts empty, must miss there."""
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
  runs = []
  for _ in range(2):
    outs = collect_processes(start_processes(["tests/cache_key_check.py"], num_processes=2, devices_per_process=2,
                                             env_extra=env), ["tests/cache_key_check.py"])
    runs.append([json.loads(out.split("RESULT ", 1)[1]) for out, _ in outs])
  first, second = runs
  assert first[0]["hits"] == 0 and all(r["hits"] > 0 for r in second), runs
  assert second[0]["hits"] == second[1]["hits"], runs
  assert first[0]["sum"] == first[1]["sum"] == second[1]["sum"] == pytest.approx(64 * float(np.tanh(1.0))), runs
  # Why the hook exists: if JAX's own CPU fingerprints agree some day, tests/site can go.
  assert first[0]["fingerprint"] != first[1]["fingerprint"], "JAX's CPU cache key now agrees across processes"

