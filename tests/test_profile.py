"""Performance telemetry of train.py: config.profile (a jax.profiler trace of chosen train steps in
WORKDIR/tensorboard, and no profiler at all when off) and the perf/ scalars of every log line (the compiled step's
FLOPs per device against an analytic FLOP model, achieved TFLOP/s, MFU against the chip's peak, input wait)."""
import glob
import gzip
import json
import os

import jax
import pytest

from benchmarks.common import clip_train_flops, token_term_forward_flops
from conftest import assert_error_exit, metrics_rows, run_py
from hnclip_jax import config as config_lib, metrics
from hnclip_jax.models import CLIPConfig

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
  real_start = jax.profiler.start_trace
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
  off = tmp_path / "off"
  run_py([*BASE, data, "--config.total_steps=2", "--workdir", str(off)])
  assert not (off / "tensorboard" / "plugins").exists()
  monkeypatch.setattr(jax.profiler, "start_trace", real_start)
  # A resume past the start of the range traces what it runs, and says so.
  proc = run_py([*BASE, data, "--config.total_steps=3", "--config.profile.steps=1:3", "--workdir", str(off)])
  assert "config.profile.steps=1:3: this run starts after step 2, so only steps 3-3 are traced" in proc.stdout
  assert f"profile of steps 3-3 written to {off}/tensorboard" in proc.stdout
  # A trace that cannot be written (here plugins/ is a file) ends the run with one line, naming the directory.
  broken = tmp_path / "broken"
  (broken / "tensorboard").mkdir(parents=True)
  (broken / "tensorboard" / "plugins").write_text("not a directory")
  err = assert_error_exit(run_py([*BASE, data, "--config.total_steps=2", "--config.profile.steps=2",
                                  "--workdir", str(broken)], check=False),
                          f"writing the profile (config.profile.steps=2:2) to {broken}/tensorboard failed")
  assert "rerun the same command" in err
  # A range past total_steps is refused before anything is written.
  bad = tmp_path / "bad"
  assert_error_exit(run_py([*BASE, data, "--config.total_steps=2", "--config.profile.steps=2:4", "--workdir",
                            str(bad)], check=False), "config.profile.steps='2:4'")
  assert not bad.exists()


def _token_term_flops(cfg, batch):
  """The token term's matmuls per step on one device (benchmarks/tpu_flop_model.py): its B x B x P x L x E token
  similarities 4 times (forward, recompute, two backward), and the per-token projections to E (forward + two
  backward) of P patches and L text positions."""
  patches = (cfg.image_size // cfg.patch_size) ** 2
  return (4 * token_term_forward_flops(batch, patches, cfg.text_context, cfg.embed_dim)
          + 3 * 2 * batch * (patches * cfg.vision_width + cfg.text_context * cfg.text_width) * cfg.embed_dim)


@pytest.mark.parametrize("token_weight", [0, 1])
def test_logged_step_flops_match_the_flop_model(tmp_path, tfds_dir, token_weight):
  """perf/step_tflop_per_device (the compiled step's matmuls, hlo.matmul_flops) against the analytic count of the
  towers (3 x forward), the loss matrices and, with λ = 1, the token term: within 5 % (the analytic count also
  charges the input gradient of the first layers, which no step computes)."""
  w = tmp_path / "w"
  run_py([*BASE, f"--config.data.data_dir={tfds_dir}", "--config.total_steps=2", "--config.log_every=1",
          f"--config.loss.token_weight={token_weight}", "--workdir", str(w)])
  rows = [r for r in metrics_rows(w, timing=True) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2]
  cfg = CLIPConfig.from_dict(json.load(open(w / "model.json")))
  want = clip_train_flops(cfg, 16) + (_token_term_flops(cfg, 16) if token_weight else 0)
  for r in rows:
    assert r["perf/step_tflop_per_device"] * 1e12 == pytest.approx(want, rel=0.05)
    assert r["perf/tflops_per_device"] > 0 and 0 <= r["perf/input_wait_frac"] < 1
    assert "perf/mfu" not in r  # CPU: no known peak, so no MFU
  assert metrics_rows(w) == [{k: v for k, v in r.items() if not k.startswith(("perf/", "goodput/"))}
                             for r in metrics_rows(w, timing=True)]


def test_mfu_uses_the_chips_peak():
  assert metrics.peak_flops("TPU v5 lite") == 197e12 and metrics.peak_flops("TPU v5") == 459e12
  assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and metrics.peak_flops("cpu") is None
  t = metrics.Throughput(10, "TPU v5 lite")
  t.flops = 2e12
  t._t -= 4.0  # 4 s for 20 steps: 10 TFLOP/s per chip
  t.waited(1.0)
  out = t.scalars(30)
  assert out["perf/tflops_per_device"] == pytest.approx(10.0, rel=1e-3)
  assert out["perf/mfu"] == pytest.approx(10e12 / 197e12, rel=1e-3)
  assert out["perf/input_wait_frac"] == pytest.approx(0.25, rel=1e-3)
