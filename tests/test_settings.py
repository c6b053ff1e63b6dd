"""Every setting is used or refused: for each framework × fine-tuning method, each key of config.loss, config.finetune,
config.optimizer and every framework's block is either read while the run is resolved (the model config, the epoch
settings, the train program with its optimizer and objective, the batch, the framework's inputs, its eval scores)
or, given a value other than its default, refused by config.validate with a message naming it."""
import sys

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh

from hnclip_jax import config as config_lib, experiment, frameworks, optim, sharding, train_step
from hnclip_jax.data.tokenizer import WordTokenizer

SECTIONS = ("loss", "finetune", "optimizer") + tuple(name for name, _ in frameworks.blocks())
METHODS = ("full", "lora", "dora")
# A valid value other than the default, where "default + 1" / "not default" does not give one.
OTHER = {"loss.token_schedule": "ring", "loss.kind": "sigmoid", "loss.sigmoid_schedule": "gather", "loss.negatives": "micro_batch", "finetune.targets": ("fc1$",),
         "finetune.freeze": ("ln_final",), "optimizer.lr_multipliers": ((r"ln_final", 2.0),),
         "finelip.reduction": "mean", "structxlip.floors": (0.5, 0.5, 0.5), "structxlip.remove": ("materials",),
         "loss.token_layer": -2, "structxlip.canny_high": 250.0, "finetune.dropout": 0.1,
         "finelip.score_weight": 0.5, "optimizer.layer_decay": 0.9}
# The functions that check settings rather than use them: their reads do not count (a refusal is what they do).
CHECKERS = {("config.py", "validate"), ("config.py", "flatten"), ("config.py", "check_token_settings"), ("config.py", "check_loss_kind"),
            ("config.py", "check_unused_adapter_settings"), ("__init__.py", "model_fields")}


def _other(key, value):
  if key in OTHER:
    return OTHER[key]
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 2
  if isinstance(value, float):
    return value + 0.25 if value <= 0.5 else value * 0.75
  raise AssertionError(f"test_settings.OTHER needs a value for config.{key} ({value!r})")


class Reads:
  """Records config.<path> keys read through ConfigDict (attribute, item, get, items, dict()) while active (a copy
  is tracked once given to `track`). Reads made directly by a CHECKERS function are left out."""

  def __init__(self, config):
    self.paths, self.read = {}, set()
    self._walk(config, "")

  def _walk(self, cd, prefix):
    self.paths[id(cd)] = prefix
    for k in cd.keys():
      v = dict.__getitem__(cd._fields, k)
      if isinstance(v, ml_collections.ConfigDict):
        self._walk(v, f"{prefix}{k}.")

  def __enter__(self):
    cls = ml_collections.ConfigDict
    self._orig = getitem = cls.__getitem__
    reads = self

    def tracked_getitem(cd, key):
      prefix = reads.paths.get(id(cd))
      caller = sys._getframe(1)
      while caller is not None and (caller.f_code.co_filename.endswith("config_dict.py")  # ConfigDict's methods
                                    or caller.f_code.co_name.startswith("<")):  # a comprehension: its function
        caller = caller.f_back
      checker = caller is not None and (caller.f_code.co_filename.rsplit("/", 1)[-1],
                                        caller.f_code.co_name) in CHECKERS
      if prefix is not None and not checker:
        reads.read.add(prefix + str(key))
      return getitem(cd, key)

    cls.__getitem__ = tracked_getitem
    return self

  def track(self, config):
    """Also track `config` (a copy the resolution made)."""
    self._walk(config, "")
    return config

  def __exit__(self, *exc):
    ml_collections.ConfigDict.__getitem__ = self._orig


def _config(framework, method):
  c = config_lib.base_config()
  c.framework, c.finetune.method = framework, method
  c.batch_size, c.total_steps = 8, 20
  return c


def _resolve(c, reads, tokenizer, mesh):
  """What train.py resolves from the config before the first step, and eval.py's scores."""
  model_cfg = experiment.model_config(c, tokenizer)
  c = reads.track(experiment.resolve_epoch_settings(c, 64))
  run = experiment.Run.of(c, model_cfg, mesh, purpose="train", tokenizer=tokenizer)  # its checks
  train_step.build_program(run)
  train_step.abstract_batch(run)
  optim.logit_scale_max(c)
  make_inputs = frameworks.hook(c, "inputs")
  if make_inputs is not None:
    make_inputs(c, model_cfg, tokenizer)
  # eval.py --score=NAME reads its settings whatever the framework: in the scoring itself (describe() only prints
  # them, so it is not run here: a setting only displayed would count as read)
  r = np.random.default_rng(0)
  unit = lambda *shape: (x := r.normal(size=shape).astype(np.float32)) / np.linalg.norm(x, axis=-1, keepdims=True)
  for _, mod in frameworks.blocks():
    for score in getattr(mod, "SCORES", {}).values():
      score.scores(unit(3, 8), unit(3, 8), unit(3, 5, 8), unit(3, 4, 8), c)


@pytest.mark.parametrize("framework", list(frameworks.REGISTRY))
def test_every_setting_is_read_or_refused(framework):
  tokenizer = WordTokenizer.fit(["a red box left of a blue ball", "two green cubes"], context_length=16)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  silent = []
  for method in METHODS:
    base = _config(framework, method)
    config_lib.validate(base)
    with Reads(base) as reads:
      _resolve(base, reads, tokenizer, mesh)
    keys = {k: v for k, v in config_lib.flatten(config_lib.base_config()).items() if k.split(".")[0] in SECTIONS}
    keys.pop("finetune.method")
    unread = sorted(k for k in keys if k not in reads.read)
    # The tracking sees what the choice leaves out and what it reads (so the loop below has something to check).
    assert ("finetune.rank" in unread) == (method == "full"), (method, sorted(reads.read))
    assert "loss.token_margin" in unread and ("loss.token_layer" in unread) == (framework != "finelip")
    assert {"optimizer.lr", "loss.gamma", "finetune.freeze"} <= reads.read
    for name, _ in frameworks.blocks():
      assert (f"{name}.weight" in unread or f"{name}.segment_weight" in unread or
              f"{name}.structure_weight" in unread) == (name != framework), (name, framework)
    for key in unread:
      c = _config(framework, method)
      section, name = key.split(".")
      c[section][name] = _other(key, keys[key])
      try:
        config_lib.validate(c)
      except ValueError as e:
        assert f"config.{key}=" in str(e), (method, key, str(e))
        continue
      silent.append(f"{method}: config.{key}")
  assert not silent, f"config.framework={framework!r}: accepted but never read: {silent}"


def test_settings_that_only_apply_with_another_setting_are_refused():
  """Read, but of no effect without another setting: refused naming both (config.validate)."""
  c = config_lib.base_config()
  c.loss.negatives = "micro_batch"  # one micro-batch: the same step as "global_batch"
  with pytest.raises(ValueError, match=r"config.loss.negatives='micro_batch' does not apply: with "
                                       r"config.grad_accum_steps=1"):
    config_lib.validate(c)
  c.grad_accum_steps = 2
  config_lib.validate(c)
  c = config_lib.base_config()
  c.async_checkpointing, c.checkpoint_overlap_steps = False, 3
  with pytest.raises(ValueError, match=r"config.checkpoint_overlap_steps=3 does not apply"):
    config_lib.validate(c)
