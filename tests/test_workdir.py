"""Restore tells damaged, incompatible and transient apart; the workdir remembers its data; data builds are keyed
on their inputs. In-process on a small state (the train.py paths are in test_reliability.py / test_datasets.py)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hnclip_jax import checkpoint, experiment, workdir as workdir_lib
from hnclip_jax.config import base_config
from conftest import listing


def _state(tx):
  params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
  return {"step": jnp.array(5, jnp.int32), "params": params, "opt_state": tx.init(params)}


def _abstract(state):
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)


CLIPPED = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@pytest.fixture
def saved(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False, retry_wait_s=0.01)
  state = _state(CLIPPED)
  for step in (1, 2):
    ck.save(step, dict(state, step=jnp.array(step, jnp.int32)), {"config": {"optimizer": {"grad_clip_norm": 1.0}}},
            force=True)
  ck.wait()
  return ck, state, tmp_path


def test_an_intact_checkpoint_restores(saved):
  ck, state, _ = saved
  step, got, _ = ck.restore_latest_intact(_abstract(state))
  assert step == 2
  np.testing.assert_array_equal(got["params"]["w"], state["params"]["w"])


def test_another_optimizer_is_incompatible_and_nothing_moves(saved):
  ck, state, root = saved
  before = listing(root)
  other = _state(optax.adamw(1e-3))  # no clipping: a differently structured optimizer state
  with pytest.raises(checkpoint.IncompatibleCheckpoint) as e:
    ck.restore_latest_intact(_abstract(other))
  assert e.value.where.endswith("checkpoints/2")
  assert any("in the checkpoint are not in this run's state" in d for d in e.value.differences)
  assert listing(root) == before and not os.path.exists(root / "checkpoints_damaged")


def test_other_shapes_are_incompatible(saved):
  ck, state, _ = saved
  wider = jax.tree.map(lambda x: x, state)
  wider["params"] = {"w": jnp.zeros((3, 5)), "b": jnp.ones(4)}
  wider["opt_state"] = CLIPPED.init(wider["params"])
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"params/w: checkpoint float32\[3, 4\], this run "
                                                               r"float32\[3, 5\]"):
    ck.restore_latest_intact(_abstract(wider))


def test_a_persistent_io_error_is_retried_then_stops_without_setting_aside(saved, monkeypatch):
  ck, state, root = saved
  before = listing(root)
  monkeypatch.setenv("HNCLIP_FAULT", "restore_io@2")
  with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/2 failed 3 times with a storage error.*"
                                                       r"Input/output error.*Nothing was moved"):
    ck.restore_latest_intact(_abstract(state))
  assert listing(root) == before and not os.path.exists(root / "checkpoints_damaged")


def test_a_passing_io_error_is_retried_and_restores(saved, monkeypatch):
  ck, state, _ = saved
  monkeypatch.setenv("HNCLIP_FAULT", "restore_io_once@2")
  step, got, _ = ck.restore_latest_intact(_abstract(state))
  assert step == 2 and int(got["step"]) == 2


def test_storage_errors_are_told_from_damage():
  assert checkpoint.is_transient(OSError(5, "Input/output error"))
  assert checkpoint.is_transient(PermissionError(13, "Permission denied"))
  assert not checkpoint.is_transient(FileNotFoundError(2, "No such file"))  # a missing file is damage
  try:
    try:
      raise OSError(5, "Input/output error")
    except OSError as inner:
      raise ValueError("restore failed") from inner
  except ValueError as outer:
    assert checkpoint.is_transient(outer)  # found through the cause
  assert not checkpoint.is_transient(ValueError("the restored 'params' do not match the fingerprint"))


def test_a_damaged_checkpoint_is_set_aside_after_the_fallback_restores(saved):
  ck, state, root = saved
  data = [os.path.join(d, f) for d, _, fs in os.walk(root / "checkpoints" / "2" / "state") for f in fs]
  biggest = max(data, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 3)
  step, _, _ = ck.restore_latest_intact(_abstract(state))
  assert step == 1
  assert [d.split("-")[0] for d in os.listdir(root / "checkpoints_damaged")] == ["2"]


def test_frozen_parameters_are_stored_once_and_checked(tmp_path):
  """With a `frozen` predicate a step holds the trained arrays only; restoring grafts the frozen store back, and a
  replaced or missing store, or a checkpoint that holds everything, is named."""
  frozen = lambda p: p == "w"  # noqa: E731
  ck = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False, frozen=frozen)
  state = _state(CLIPPED)
  with pytest.raises(checkpoint.CheckpointError, match="neither written"):
    ck.save(1, state, {}, force=True)
  ck.save_frozen(state["params"])
  ck.save(1, state, {}, force=True)
  ck.wait()
  saved = ck.saved_structure(1)["params"]
  assert set(saved) == {"b"}
  step, got, _ = ck.restore_latest_intact(_abstract(state))
  np.testing.assert_array_equal(got["params"]["w"], state["params"]["w"])
  np.testing.assert_array_equal(got["params"]["b"], state["params"]["b"])
  reader = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), create=False)  # as eval.py / pretrained.load
  np.testing.assert_array_equal(reader.restore_params(1, _abstract(state)["params"])["w"], state["params"]["w"])
  other = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False, frozen=frozen)
  other.save_frozen({"w": state["params"]["w"] + 1, "b": state["params"]["b"]})  # the store replaced
  with pytest.raises(checkpoint.CheckpointError, match="does not hold the frozen parameters"):
    ck.restore(1, _abstract(state))
  before = listing(tmp_path)
  with pytest.raises(checkpoint.CheckpointError, match="does not hold the frozen parameters"):
    ck.restore_latest_intact(_abstract(state))  # a bad store is not a damaged step: nothing is set aside
  assert listing(tmp_path) == before
  import shutil
  shutil.rmtree(ck.frozen_dir)
  with pytest.raises(checkpoint.CheckpointError, match="checkpoints_frozen_params, which is missing"):
    ck.restore(1, _abstract(state))
  everything = checkpoint.Checkpointer(str(tmp_path / "all"), async_save=False)
  everything.save(1, state, {}, force=True)
  everything.wait()
  with pytest.raises(checkpoint.IncompatibleCheckpoint):
    checkpoint.Checkpointer(str(tmp_path / "all"), async_save=False, frozen=frozen).restore_latest_intact(
        _abstract(state))


def test_config_changes_name_what_matters():
  old = json.loads(base_config().to_json())
  new = base_config()
  new.optimizer.grad_clip_norm = 0.0
  new.total_steps = 99  # bookkeeping: not named
  new.grad_accum_steps = 2
  assert workdir_lib.config_changes(old, new) == ["grad_accum_steps: 1 -> 2", "optimizer.grad_clip_norm: 1.0 -> 0.0"]
  assert "total_steps: 1000 -> 99" in workdir_lib.config_changes(old, new, bookkeeping=True)


# ---- the workdir remembers its data -------------------------------------------------------------------------

def _config(**data):
  c = base_config()
  for k, v in data.items():
    c.data[k] = v
  return c


def test_a_new_workdir_reads_the_config_data(tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path))
  cfg, note = experiment.resolve_data(_config(name="synthetic"), wd, {}, training=True)
  assert cfg.data.name == "synthetic" and note.startswith("data: synthetic")


def test_resume_and_eval_read_the_recorded_data(tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path))
  wd.save_data(_config(name="pairs", manual_dir="/data/a").data)
  file_says = _config(name="synthetic")  # configs/demo.py without the overrides the run was started with
  for training in (True, False):
    cfg, note = experiment.resolve_data(file_says, wd, {}, training=training)
    assert (cfg.data.name, cfg.data.manual_dir) == ("pairs", "/data/a")
    assert "pairs from /data/a" in note and "name='synthetic' ignored" in note
  assert file_says.data.name == "synthetic"  # the caller's config is not modified


def test_a_resume_refuses_contradicting_data_overrides(tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path))
  wd.save_data(_config(name="pairs", manual_dir="/data/a").data)
  overrides = {"data.manual_dir": "/data/b"}
  with pytest.raises(ValueError, match=r"config.data.manual_dir='/data/b' \(the workdir's: '/data/a'\).*drop those "
                                       r"overrides, or start a new workdir"):
    experiment.resolve_data(_config(name="pairs", manual_dir="/data/b"), wd, overrides, training=True)
  # The build location may move; the same value as recorded is no contradiction.
  cfg, _ = experiment.resolve_data(_config(name="pairs", manual_dir="/data/a", data_dir="/elsewhere"), wd,
                                   {"data.data_dir": "/elsewhere", "data.name": "pairs"}, training=True)
  assert (cfg.data.manual_dir, cfg.data.data_dir) == ("/data/a", "/elsewhere")


def test_eval_may_read_other_data_and_says_so(tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path))
  wd.save_data(_config(name="pairs", manual_dir="/data/a").data)
  cfg, note = experiment.resolve_data(_config(name="pairs", manual_dir="/data/b"), wd, {"data.manual_dir": "/data/b"},
                                      training=False)
  assert cfg.data.manual_dir == "/data/b"
  assert "not the data it was trained on, pairs from /data/a" in note


def test_eval_history_keeps_every_result(tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path))
  first = {"step": 4, "dataset": "pairs", "split": "test", "num_pairs": 8, "t2i": {"R@1": 50.0}, "i2t": {"R@1": 25.0}}
  second = dict(first, dataset="synthetic", num_pairs=40)
  wd.record_eval(first, {"data": {"name": "pairs"}})
  wd.record_eval(second, {"data": {"name": "synthetic"}})
  assert json.load(open(wd.eval_results)) == second  # the latest, in the original schema
  history = wd.eval_records()
  assert [(r["step"], r["dataset"], r["num_pairs"]) for r in history] == [(4, "pairs", 8), (4, "synthetic", 40)]
  assert history[0]["data"] == {"name": "pairs"}


def test_the_run_directory_layout_has_one_owner_and_docs_show_it(tmp_path):
  """workdir.LAYOUT names each entry of a run directory once, Workdir's paths come from it, and docs/workdir.md
  holds its table as layout_markdown() writes it (the runs' files are checked against it: conftest.assert_in_layout)."""
  wd = workdir_lib.Workdir(str(tmp_path / "run"))
  for attr, name, _, _ in workdir_lib.LAYOUT:
    if attr != "eval_table":
      assert getattr(wd, attr) == os.path.join(wd.path, *name.rstrip("/").split("/")), attr
  assert wd.checkpoint(8) == os.path.join(wd.path, "checkpoints", "8")
  assert wd.profile_dir(0) == wd.tensorboard and wd.profile_dir(2) == os.path.join(wd.tensorboard, "process_2")
  assert wd.checkpointer().damaged_dir == wd.checkpoints_damaged
  attrs, names = [a for a, *_ in workdir_lib.LAYOUT], [n for _, n, *_ in workdir_lib.LAYOUT]
  assert len(set(attrs)) == len(attrs) and len(set(names)) == len(names)  # each entry named once
  docs = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "workdir.md")).read()
  assert workdir_lib.layout_markdown() in docs, ("docs/workdir.md's table differs from workdir.LAYOUT: regenerate it "
                                                 "(the command is at the end of docs/workdir.md)")
