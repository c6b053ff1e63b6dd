"""The goodput account (hnclip_jax/goodput.py): each train.py process's wall time split into parts that add up to
it, compiles carved out of whatever part ran them (per program, with the persistent cache's verdict), the records
in the workdir, and a run killed once and resumed: the redone steps reported and the whole account summing to the
wall time measured from outside."""
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT, _env, run_py
from hnclip_jax import goodput


def test_parts_nest_and_compiles_are_carved_from_the_part_that_ran_them(tmp_path):
  acct = goodput.Account(start_time=time.time()).listen()
  try:
    time.sleep(0.2)  # init
    acct.phase("steps")
    time.sleep(0.1)
    with acct.part("eval"):
      time.sleep(0.15)
      with acct.part("input_wait"):
        time.sleep(0.1)
      x = jnp.arange(1000.0) + 3.0  # noqa: F841  (warm the eager ops)
      f = jax.jit(lambda v: jnp.sin(v) @ jnp.cos(v).T + float(time.time()))  # a new program each run of the test
      f(jnp.ones((64, 64))).block_until_ready()
    time.sleep(0.05)
    acct.phase(None)
    time.sleep(0.1)  # not in any part: `other`
    snap = acct.snapshot()
  finally:
    acct.close()
  p = snap["parts"]
  compiled = [q for q in acct.programs if "<lambda>" in q["name"]]
  assert len(compiled) == 1 and compiled[0]["s"] > 0, acct.programs
  assert p["compile"] >= compiled[0]["s"]
  assert p["init"] == pytest.approx(0.2, abs=0.05)
  assert p["input_wait"] == pytest.approx(0.1, abs=0.03)
  assert p["steps"] == pytest.approx(0.15, abs=0.05)
  # eval: its sleep and the jitted call's run, without the compile that happened inside it
  assert 0.15 <= p["eval"] < 0.15 + 0.1
  assert snap["other_s"] == pytest.approx(0.1, abs=0.03)
  assert sum(p.values()) + snap["other_s"] == pytest.approx(snap["wall_s"], abs=1e-6)
  # after close, compiles are no longer counted
  before = acct.snapshot()["parts"]["compile"]
  jax.jit(lambda v: v * float(time.time()))(jnp.ones(3)).block_until_ready()
  assert acct.snapshot()["parts"]["compile"] == before


def test_a_program_read_from_the_persistent_cache_is_a_hit(tmp_path):
  """A fresh process compiles a program into an empty cache ("miss"), a second fresh one reads it ("hit")."""
  script = ("import jax, jax.numpy as jnp, json\n"
            "from hnclip_jax import goodput\n"
            "a = goodput.Account().listen()\n"
            "jax.jit(lambda v: jnp.tanh(v @ v.T).sum(), )(jnp.ones((32, 32))).block_until_ready()\n"
            "print(json.dumps([p for p in a.programs if 'lambda' in p['name']]))\n")
  env = _env(1, {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  got = [json.loads(subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                                   text=True, check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
  assert [[p["cache"] for p in g] for g in got] == [["miss"], ["hit"]]


def _row(attempt, start_time, start_step, step, loop_s, steps_s, checkpoints, wall=10.0):
  parts = dict.fromkeys(goodput.PARTS, 1.0)
  parts["steps"] = steps_s
  return {"attempt": attempt, "process": 0, "start_time": start_time, "start_step": start_step, "step": step,
          "wall_s": wall, "parts": parts, "other_s": wall - sum(parts.values()), "loop_s": loop_s,
          "steps_s": steps_s, "programs": [{"name": "jit(step)", "s": 1.0, "cache": "miss"}],
          "checkpoints": checkpoints, "ended": None}


def test_summary_counts_the_steps_a_resume_redoes_from_the_earlier_records():
  a = _row("a", 100.0, 0, 13, loop_s=30.0, steps_s=26.0,
           checkpoints={"5": {"loop_s": 12.0, "steps_s": 10.0}, "10": {"loop_s": 24.0, "steps_s": 21.0}})
  b = _row("b", 200.0, 10, 14, loop_s=9.0, steps_s=8.0, checkpoints={})  # killed before any checkpoint of its own
  c = _row("c", 300.0, 10, 20, loop_s=20.0, steps_s=18.0, checkpoints={"20": {"loop_s": 20.0, "steps_s": 18.0}})
  other_process = dict(_row("z", 150.0, 0, 99, 1.0, 1.0, {}), process=1)
  s = goodput.summarize([c, other_process, a, b])
  assert [x["attempt"] for x in s["attempts"]] == ["a", "b", "c"]
  assert [x["redone_steps"] for x in s["attempts"]] == [3, 4, 0]  # 11-13 after checkpoint 10; 11-14: all of b
  assert [x["lost_loop_s"] for x in s["attempts"]] == [6.0, 9.0, 0.0]
  assert s["lost_steps_s"] == 5.0 + 8.0
  assert s["wall_s"] == 30.0 and s["redone_steps"] == 7
  line = goodput.run_line(s)
  assert "3 process starts" in line and "redone 7 steps 13.0" in line
  # productive: the steps' time less what was redone, over the wall time
  assert f"{(26 + 8 + 18 - 13) / 30:.1%} productive" in line
  assert goodput.redone_note([a, b], 10, 0).startswith("goodput: the previous start")
  assert "steps 11-14 are redone from checkpoint 10 (they had cost 9.0 s" in goodput.redone_note([a, b], 10, 0)
  assert goodput.redone_note([a, b], 14, 0) is None


ARGS = ["--config", "configs/demo.py:test", "--config.total_steps=10", "--config.checkpoint_every=4",
        "--config.log_every=1", "--config.eval_every=10"]


def test_a_killed_and_resumed_run_accounts_for_its_wall_time(tmp_path, tfds_dir):
  """train.py run as a script (its account starts when the OS started it), SIGKILLed after step 7 (checkpoint 4
  complete, steps up to 6 recorded: a kill leaves its account as of its last record), then resumed: the records
  hold both starts, the resume names the redone steps,
  and the accounts add up to the wall time of the two processes measured here: each starts when the process did
  and ends at its last record, so what it cannot see is the tail after that (the killed process's last step, the
  interpreter's exit: 0.3-1.2 s here, a constant, not a share of a pod's hours) — within 5 % plus that tail."""
  workdir = tmp_path / "run"
  args = [sys.executable, "train.py", *ARGS, f"--workdir={workdir}", f"--config.data.data_dir={tfds_dir}"]
  walls, starts, outs = [], [], []
  for fault in ("kill_after_saves@7", None):
    env = _env(1, {"HNCLIP_FAULT": fault} if fault else None)
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    walls.append(time.time() - t0)
    starts.append(t0)
    outs.append(proc.stdout)
    assert proc.returncode == (-9 if fault else 0), proc.stderr[-3000:]
  from hnclip_jax.workdir import Workdir
  rows = Workdir(str(workdir)).goodput_records()
  s = goodput.summarize(rows)
  first, second = s["attempts"]
  assert (first["start_step"], first["step"], first["ended"]) == (0, 6, None)
  assert (second["start_step"], second["step"], second["ended"]) == (4, 10, "done")
  assert (first["redone_steps"], second["redone_steps"]) == (2, 0)
  assert 0 < first["lost_steps_s"] <= first["lost_loop_s"] < first["loop_s"]
  assert "steps 5-6 are redone from checkpoint 4" in outs[1]
  for a in (first, second):
    assert all(v >= 0 for v in a["parts"].values()) and a["other_s"] > -0.01, a
    assert sum(a["parts"].values()) + a["other_s"] == pytest.approx(a["wall_s"], abs=1e-6)
    assert a["parts"]["compile"] > 0 and a["parts"]["steps"] > 0 and a["parts"]["init"] > 0
  assert second["parts"]["restore"] > 0 and second["parts"]["eval"] > 0
  for a, t0, wall in zip((first, second), starts, walls):
    assert abs(a["start_time"] - t0) < 0.5  # from the OS's start of the process, not from train.py's main
    assert 0 <= wall - a["wall_s"] <= 0.05 * wall + 1.5, (a["wall_s"], wall)
  assert 0 <= sum(walls) - s["wall_s"] <= 0.05 * sum(walls) + 3.0, (s["wall_s"], walls)
  assert "goodput (whole run, 2 process starts)" in outs[1] and "redone 2 steps" in outs[1]
  # metrics.jsonl: process 0's account at every log step, cumulative within each start
  with open(workdir / "metrics.jsonl") as f:
    rows = [r for r in map(json.loads, f) if "goodput/wall_s" in r]  # the eval's row has none
  resumed = [r for r in rows if r["step"] > 4]
  assert [r["step"] for r in rows] == list(range(1, 11))
  walls = [r["goodput/wall_s"] for r in resumed]
  assert walls == sorted(walls) and walls[-1] <= second["wall_s"]
  assert resumed[-1]["goodput/restore_s"] == pytest.approx(second["parts"]["restore"])
  out = run_py(["-m", "hnclip_jax.tools.goodput", "--workdir", str(workdir)]).stdout
  assert "killed (no end record)" in out and "| 4->10 |" in out and "redone 2 steps" in out
