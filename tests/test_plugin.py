"""A fine-tuning framework from outside the package (tests/plugins/patch_align.py, chosen with
--config.framework=patch_align:PatchAlign): no line of hnclip_jax names it, and train.py trains and resumes with it
bit-identically, eval.py evaluates it, and its input, output and term reach the compiled program. Its mesh
equivalence is tests/test_sharding.py's `plugin` section; its TPU compile is in test_compile_for.py."""
import json
import os
import re
import pickle
import sys

import numpy as np
import pytest

from conftest import ROOT, assert_error_exit, check_resume_is_bit_identical, metrics_rows, run_py

PLUGINS = os.path.join(os.path.dirname(__file__), "plugins")
sys.path.insert(0, PLUGINS)
CONFIG = "tests/plugins/patch_align_config.py"
ENV = {"PYTHONPATH": PLUGINS + os.pathsep + ROOT}


def _config():
  import importlib.util
  spec = importlib.util.spec_from_file_location("patch_align_config", os.path.join(ROOT, CONFIG))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def test_an_outside_framework_is_loaded_checked_and_reaches_the_batch():
  from hnclip_jax import config as config_lib, experiment, frameworks, sharding, train_step
  from hnclip_jax.models.clip import CLIPConfig
  from hnclip_jax.objective import Objective
  from hnclip_jax.terms import ContrastiveTerm
  from patch_align import PatchAlignTerm, WordWeight
  c = config_lib.validate(_config())
  assert c.framework == "patch_align:PatchAlign" and frameworks.settings(c).weight == 0.7
  obj = Objective.from_config(c.loss, c)
  assert obj.terms == (ContrastiveTerm(), PatchAlignTerm(weight=0.7)) and obj.term_names == ("hn", "patch_align")
  assert obj.input_keys == ("image", "tokens", "pa_weight")
  # The pipeline's per-example input: picklable (grain workers), a pure function of the caption.
  make = frameworks.hook(c, "inputs")(c, None, None)
  again = pickle.loads(pickle.dumps(make))
  assert isinstance(again, WordWeight) and again(None, "a red circle left of a blue square", None, 0, 5, 3) == {
      "pa_weight": np.float32(1 + 0.1 * 8)}
  # Its input in the compiled program's batch, sharded like the rest.
  mesh = sharding.make_mesh(c.mesh)
  model_cfg = CLIPConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=32, vision_layers=1,
                         vision_heads=2, vision_mlp_dim=64, text_context=77, vocab_size=128, text_width=32,
                         text_layers=1, text_heads=2, text_mlp_dim=64, eot_token_id=3)
  batch = train_step.abstract_batch(experiment.Run.of(c, model_cfg, mesh))
  assert batch["pa_weight"].shape == (16,) and batch["pa_weight"].dtype == np.float32
  assert batch["pa_weight"].sharding == batch["tokens"].sharding
  # Its inputs may not take a core batch entry's name: refused before compiling and in the pipeline.
  import patch_align
  from hnclip_jax.data import pipeline
  clash = staticmethod(lambda config, model_cfg: {"tokens": ((77,), "int32")})
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(patch_align.PatchAlign, "input_specs", clash)
    with pytest.raises(ValueError, match=r"config.framework='patch_align:PatchAlign': its per-example inputs "
                                         r"\['tokens'\] have the names of the core's batch entries "
                                         r"\['image', 'tokens', 'index'\]"):
      experiment.Run.of(c, model_cfg, mesh)
  from hnclip_jax.data.tokenizer import WordTokenizer
  pre = pipeline._Preprocess(WordTokenizer.fit(["a cat"], context_length=8), 8,
                             extra=lambda ex, text, pixels, seed, step, index: {"index": np.int64(7)})
  with pytest.raises(ValueError, match=r"per-example inputs \['index'\] have the names of the core's batch"):
    pre.map({"image": np.zeros((8, 8, 3), np.uint8), "caption": b"a cat"})
  # Its settings block: defaults apply without one (--config.framework=... on the command line), unknown keys and
  # negative weights are refused by name, like the built-in frameworks'.
  bare = config_lib.base_config()
  bare.framework = "patch_align:PatchAlign"
  assert frameworks.settings(config_lib.validate(bare)).to_dict() == {"weight": 0.5, "words_scale": 0.1}
  typo = _config()
  typo.patch_align.wieght = 1.0
  with pytest.raises(ValueError, match=r"config.patch_align.wieght; did you mean config.patch_align.weight"):
    config_lib.validate(typo)
  neg = _config()
  neg.patch_align.words_scale = -1.0
  with pytest.raises(ValueError, match=r"config.patch_align.words_scale=-1.0 must be >= 0"):
    config_lib.validate(neg)
  for name, says in (("no_such_module:X", "cannot import 'no_such_module'"),
                     ("patch_align:Missing", "has no 'Missing'"),
                     ("clip_plus", "or give your own as an import path 'package.module:Name'")):
    bad = config_lib.base_config()
    bad.framework = name
    with pytest.raises(ValueError, match=f"config.framework='{name}'") as e:
      config_lib.validate(bad)
    assert says in str(e.value)


def test_an_outside_framework_trains_resumes_bit_identically_and_evaluates(tmp_path, tfds_dir):
  # The two commands of docs/frameworks.md ("Write your own framework"), exactly as printed but for the workdir
  # (/tmp/pa -> this test's) and the data, found through TFDS' own TFDS_DATA_DIR (the built-in data's build).
  doc = open(os.path.join(ROOT, "docs", "frameworks.md")).read()
  block = doc[doc.index("## Write your own framework"):]
  block = block[block.index("```bash\n") + 8:]
  commands = [line.split() for line in block[:block.index("```")].strip().splitlines()]
  assert [c[:3] for c in commands] == [["PYTHONPATH=tests/plugins", "python", "train.py"],
                                       ["PYTHONPATH=tests/plugins", "python", "eval.py"]], commands
  w = str(tmp_path / "w")
  printed = {"PYTHONPATH": os.path.join(ROOT, "tests", "plugins") + os.pathsep + ROOT, "TFDS_DATA_DIR": str(tfds_dir)}
  run_py([a.replace("/tmp/pa", w) for a in commands[0][2:]], env_extra=printed)
  args = ["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}"]
  rows = [r for r in metrics_rows(w) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for r in rows:  # the term is logged and is in the loss with its weight (config.patch_align.weight = 0.7)
    assert r["loss/patch_align"] > 0
    assert r["loss"] == pytest.approx(r["loss/hn"] + 0.7 * r["loss/patch_align"], rel=1e-5)
  # The per-example input reaches the loss: with words_scale 0 every weight is 1 instead of 1 + 0.1·(word count), so
  # step 1 (the same start and batch) logs a smaller term; a term that ignored its input would log the same value.
  flat = str(tmp_path / "flat")
  run_py([*args, "--workdir", flat, "--config.patch_align.words_scale=0", "--config.total_steps=1"], env_extra=ENV)
  unweighted = [r for r in metrics_rows(flat) if "loss" in r][0]
  assert unweighted["step"] == 1 and unweighted["loss/hn"] == rows[0]["loss/hn"]
  assert rows[0]["loss/patch_align"] > 1.5 * unweighted["loss/patch_align"] > 0  # captions have > 5 words
  # Resumed from step 2 (its step-4 checkpoint deleted): bit-identical metrics and parameters.
  assert commands[0][-2:] == ["--workdir", "/tmp/pa"]
  check_resume_is_bit_identical(commands[0][2:-2], w, str(tmp_path / "again"), last=4, resume_from=2,
                                env_extra=printed)
  run_py([a.replace("/tmp/pa", w) for a in commands[1][2:]], env_extra=printed)
  res = json.load(open(os.path.join(w, "eval_results.json")))
  last = [r for r in metrics_rows(w) if "eval/t2i/R@1" in r][-1]
  assert res["step"] == 4 and all(res[d][k] == pytest.approx(last[f"eval/{d}/{k}"]) for d in ("t2i", "i2t")
                                  for k in ("R@1", "R@5", "R@10"))


def test_the_contract_refuses_a_misspelled_hook_other_arguments_and_a_key_that_does_not_exist(tmp_path, tfds_dir):
  from hnclip_jax import config as config_lib, frameworks, sharding
  from hnclip_jax.frameworks import base
  from hnclip_jax.objective import Objective, embedding_outputs
  from patch_align_mistakes import TextTerm
  # The contract is one class; the documented table lists exactly its hooks and settings, with their arguments.
  doc = open(os.path.join(ROOT, "docs", "frameworks.md")).read()
  table = doc[doc.index("| attribute | what the core does with it |"):]
  table = table[:table.index("\n\n")]
  documented = {}
  for row in table.splitlines()[2:]:
    for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
      documented[name.partition("(")[0]] = name
  assert set(documented) == set(base.HOOKS) | set(base.CONSTANTS), set(documented) ^ (set(base.HOOKS) |
                                                                                      set(base.CONSTANTS))
  for hook, signature in base.HOOKS.items():
    params = ", ".join(p for p in signature.parameters)
    assert documented[hook] == f"{hook}({params})", (documented[hook], signature)
  for key, what in (*base.BATCH_KEYS.items(), *base.OUTPUT_KEYS.items()):
    assert f"| `{key}` | {what} |" in doc
  # A misspelled hook (`objectives`): without the check the run would train plain L_HN and say nothing.
  for name, says in (("patch_align_mistakes:Misspelled", "its 'objectives' is no hook of the framework contract "
                                                         "(did you mean 'objective'?); the hooks are ['check_data'"),
                     ("patch_align_mistakes:WrongArguments", "its hook objective(config) takes other arguments than "
                                                             "the contract's objective(config, obj)")):
    bad = config_lib.base_config()
    bad.framework = name
    with pytest.raises(ValueError, match=f"config.framework='{name}'") as e:
      config_lib.validate(bad)
    assert says in str(e.value)
  # A term reading a model output that does not exist: one line naming the key, the term and the keys there are.
  rng = np.random.default_rng(0)
  v = rng.normal(size=(8, 4)).astype(np.float32)
  v /= np.linalg.norm(v, axis=1, keepdims=True)
  out = {**embedding_outputs(v, v, 10.0), "pa_patches": v, "pa_weight": np.ones(8, np.float32)}
  mesh = sharding.make_mesh(config_lib.base_config().mesh)
  with pytest.raises(base.MissingKey) as e:
    Objective.of(gamma=0.5, terms=(TextTerm(weight=0.5),))(out, mesh)
  assert str(e.value).startswith("patch_align_mistakes.TextTerm.__call__ asked for model outputs['text'], which this "
                                 "run does not have; it has ['img', 'pa_patches', 'pa_weight', 'scale', 'txt'] "
                                 "(did you mean 'txt'?)")
  assert frameworks.hook(config_lib.base_config(), "objective") is None  # "longclip": no framework, no hooks
  with pytest.raises(AttributeError, match="'objectives' is no hook of the framework contract"):
    frameworks.hook(config_lib.base_config(), "objectives")
  # ... and through train.py: one error line, no traceback, nothing trained.
  proc = run_py(["train.py", "--config", CONFIG, f"--config.data.data_dir={tfds_dir}", "--config.framework="
                 "patch_align_mistakes:AsksForText", "--workdir", str(tmp_path / "w")], env_extra=ENV, check=False)
  assert_error_exit(proc, "TextTerm.__call__ asked for model outputs['text']", "did you mean 'txt'?")
