"""config.profile: a jax.profiler trace of chosen train steps in WORKDIR/tensorboard, and no profiler at all when off."""
import glob
import gzip
import json
import os

import jax
import pytest

from conftest import assert_error_exit, run_py
from hnclip_jax import config as config_lib

BASE = ["train.py", "--config", "configs/demo.py:test", "--config.eval_every=100", "--config.checkpoint_every=100"]


def test_profile_settings_are_checked():
  c = config_lib.base_config()
  assert config_lib.profile_steps(c) is None
  c.profile.steps = "7"
  assert config_lib.profile_steps(c) == (7, 7)
  c.profile.steps = "2:5"
  assert config_lib.profile_steps(c) == (2, 5)
  for bad, says in (("5:2", "first <= last"), ("0:2", "must lie in 1..config.total_steps=1000"),
                    ("2001", "must lie in"), ("two", "give a step 'N' or a range 'N:M'")):
    c.profile.steps = bad
    with pytest.raises(ValueError, match=f"config.profile.steps='{bad}'") as e:
      config_lib.validate(c)
    assert says in str(e.value)
  c.profile.steps, c.profile.processes = "", "some"
  with pytest.raises(ValueError, match="config.profile.processes='some'; choose 'first'"):
    config_lib.validate(c)


def test_a_profile_of_the_chosen_steps_is_written_and_off_starts_no_profiler(tmp_path, tfds_dir, monkeypatch):
  data = f"--config.data.data_dir={tfds_dir}"
  w = tmp_path / "traced"
  proc = run_py([*BASE, data, "--config.total_steps=3", "--config.profile.steps=2:3", "--workdir", str(w)])
  assert f"profile of steps 2-3 written to {w}/tensorboard" in proc.stdout
  runs = glob.glob(str(w / "tensorboard" / "plugins" / "profile" / "*"))
  assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.xplane.pb"))
  (trace,) = glob.glob(os.path.join(runs[0], "*.trace.json.gz"))
  events = json.load(gzip.open(trace))["traceEvents"]
  steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and e.get("ph") == "X")
  assert steps == [2, 3]  # the chosen steps, each once, and not step 1
  # Off (the default): the profiler is never started (a call would fail the run here) and nothing is written.
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
  off = tmp_path / "off"
  run_py([*BASE, data, "--config.total_steps=2", "--workdir", str(off)])
  assert not (off / "tensorboard" / "plugins").exists()
  # A range past total_steps is refused before anything is written.
  bad = tmp_path / "bad"
  assert_error_exit(run_py([*BASE, data, "--config.total_steps=2", "--config.profile.steps=2:4", "--workdir",
                            str(bad)], check=False), "config.profile.steps='2:4'")
  assert not bad.exists()
