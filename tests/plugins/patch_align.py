"""A fine-tuning framework written outside hnclip_jax, as a user would (tests/test_plugin.py; docs/frameworks.md,
"Write your own framework"): `--config.framework=patch_align:PatchAlign` with this folder on PYTHONPATH.

PatchAlign adds one term to L_HN: InfoNCE (with L_HN's margin γ·Ḡ) between each image's mean patch embedding and
the captions of the whole batch, each example weighted by 1 + words_scale · (its caption's word count), a
per-example input the input pipeline makes. It exercises the three things a framework can add: settings
(config.patch_align), an input made per example, and a model output made from the towers (then its loss term)."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from hnclip_jax import frameworks, losses
from hnclip_jax.models.clip import dropout_key


class PatchAlign:
  """The framework: an object with the attributes hnclip_jax.frameworks reads (a module works the same way)."""
  TITLE = "PatchAlign"
  BLOCK = "patch_align"  # its settings: config.patch_align.*
  CONFIG = {"weight": 0.5, "words_scale": 0.1}
  NON_NEGATIVE = ("weight", "words_scale")

  @staticmethod
  def objective(config, obj):
    s = frameworks.settings(config)
    return obj.replace(terms=obj.terms + (PatchAlignTerm(weight=float(s.weight)),))

  @staticmethod
  def inputs(config, model_cfg, tokenizer):
    del model_cfg, tokenizer
    return WordWeight(float(frameworks.settings(config).words_scale))

  @staticmethod
  def input_specs(config, model_cfg):
    del config, model_cfg
    return {"pa_weight": ((), "float32")}


class WordWeight:
  """The per-example input: a pure function of the example (resumes stay bit-identical) and picklable (the input
  pipeline may run it in worker processes)."""

  def __init__(self, scale: float):
    self.scale = scale

  def __call__(self, example, caption, image, seed, step, index):
    del example, image, seed, step, index
    return {"pa_weight": np.float32(1.0 + self.scale * len(caption.split()))}


@dataclasses.dataclass(frozen=True)
class PatchAlignTerm(frameworks.Term):
  weight: float = 0.5
  names = ("patch_align",)
  input_keys = ("pa_weight",)

  def outputs(self, model, out, inputs, rng=None, hidden=None):
    # The image tower's projected tokens of the last block (CLS first), averaged over the patches; a second pass
    # of the tower, with its own dropout key (the towers and the built-in frameworks use 0 to 6).
    _, tokens = model.image_tower(inputs["image"], token_layer=-1, rng=dropout_key(rng, 16))
    mean = jnp.mean(tokens[:, 1:].astype(jnp.float32), axis=1)
    return {"pa_patches": mean / jnp.linalg.norm(mean, axis=-1, keepdims=True), "pa_weight": inputs["pa_weight"]}

  def __call__(self, out, ctx, sched):
    del sched
    i2t, t2i = losses.contrastive_rows(out["pa_patches"], out["txt"], ctx.gather(out["pa_patches"]), ctx.txt_all,
                                       ctx.scale, ctx.gamma, ctx.offset)
    per = 0.5 * out["pa_weight"] * (i2t + t2i)
    value = ctx.psum(jnp.sum(per)) / ctx.batch
    return [self.weight * value], {"patch_align": value}, [self.weight * per]
