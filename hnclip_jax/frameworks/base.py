"""The interface between the core objective and a fine-tuning framework's extra loss terms.

A framework adds terms to L_HN (+ λ·L_tok). Each is a `Term`: a frozen dataclass (its settings are its fields, so
an objective stays hashable and a jitted program is keyed by them) that reads the model's outputs dict on one
device's rows and returns its contribution. `Objective` (hnclip_jax/objective.py) calls every term inside its
`shard_map`, with a `Context` that carries what the core has already built: the row offset, the gathered
embeddings, the learned scale, γ and a gather function. A term's math belongs in `hnclip_jax.losses` (pure
functions of a block of rows against the whole batch), so one device and the mesh run the same code.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Context:
  """What a term sees inside the objective's shard_map (one device's block of n rows of a batch of B)."""
  axes: tuple  # the batch mesh axes (psum / all_gather / all_to_all over these)
  batch: int  # B, the global batch the negatives come from
  offset: Any  # the global index of this device's first row (traced)
  gamma: float  # HN-CLIP's γ (a Python 0 means no margin code at all)
  scale: Any  # the learned logit scale s (fp32 scalar)
  img_all: Any  # [B, D] every image embedding
  txt_all: Any  # [B, D] every caption embedding
  chunk_size: int  # config.loss.chunk_size (0: the term's own default block)
  gather: Callable  # [n, ...] -> [B, ...] over the batch axes

  def psum(self, x):
    return jax.lax.psum(x, self.axes)

  def cols_to_rows(self, x):
    """[B, n] columns (all rows vs this device's) -> this device's [n, B] rows (an all-to-all)."""
    return jax.lax.all_to_all(x, self.axes, 0, 1, tiled=True)


@dataclasses.dataclass(frozen=True)
class Term:
  """One framework's addition to the objective. Subclasses are frozen dataclasses and override:

  - `names`: the per-term metric names it reports (logged as loss/<name>), in order;
  - `input_keys`: the batch entries (beyond image and tokens) the model needs for its outputs;
  - `model_kwargs(objective, inputs)`: keyword arguments of the model's __call__ that produce those outputs
    (inputs: the batch entries, or None when only the keys matter);
  - `outputs(model, out, inputs, rng, hidden)`: extra entries of the outputs dict, made by the term itself from
    the model (a `CLIP`: its towers, e.g. `model.image_tower(pixels, token_layer)`, and pooling methods), the
    outputs so far, the batch entries (its `input_keys` among them) and the towers' last-block outputs `hidden`
    ({"image": [B, 1+P, W], "text": [B, L, W]}); rng: the step's dropout key (None: no dropout; derive your own
    with `models.clip.dropout_key(rng, i)`, i >= 16: the towers and the built-in frameworks use 0 to 6). Entries
    other than "scale" have the batch as their first dimension. Default: none. The core runs it inside the
    function it differentiates, so gradients flow through whatever it computes;
  - `schedule(step)`: replicated values computed outside the mesh function from the train step (e.g. a ramp;
    None: no schedule), handed to __call__ as `sched`;
  - `__call__(out, ctx, sched)` -> (loss contribution, {name: term value}, per-example [n] contribution);
  - `check(model_cfg, objective)`: raise naming the config key when the model cannot produce its outputs.
  """
  names = ()
  input_keys = ()

  def model_kwargs(self, objective, inputs=None) -> dict:
    del objective, inputs
    return {}

  def outputs(self, model, out: dict, inputs: dict, rng=None, hidden=None) -> dict:
    del model, out, inputs, rng, hidden
    return {}

  def schedule(self, step):
    del step
    return None

  def check(self, model_cfg, objective) -> None:
    del model_cfg, objective

  def __call__(self, out: dict, ctx: Context, sched):
    raise NotImplementedError


def one_epoch_as_steps(config, key: str, steps_per_epoch: int):
  """`config` with the setting `key` ("block.name") replaced by `steps_per_epoch` where it is -1 (one epoch of the
  training split); the config itself when it is not (a framework's `resolve_epochs`)."""
  block, name = key.split(".")
  if int(config[block][name]) != -1:
    return config
  config = copy.deepcopy(config)
  with config.unlocked():
    config[block][name] = steps_per_epoch
  return config


@dataclasses.dataclass(frozen=True)
class Score:
  """An eval score besides cosine (`eval.py --score=NAME`), offered by a framework's `SCORES` {NAME: Score} for the
  models its `parts` make. Subclasses override:

  - `check(model_cfg, where)`: raise, naming what is missing, when the model cannot give the score;
  - `describe(config)`: one line for the log (how it ranks);
  - `encode_image(model, pixels, config)`, `encode_text(model, tokens, config)`: per-example features beside the
    global embeddings ([B, ...] each; jitted and batch-sharded by the core like the plain encoders);
  - `scores(img, txt, img_x, txt_x, config)` -> [N_cap, N_img] (higher ranks first) from the global embeddings
    (img [N_img, D], txt [N_cap, D]) and those features (host arrays, every image and caption).
  """

  def check(self, model_cfg, where: str) -> None:
    del model_cfg, where

  def describe(self, config) -> str:
    raise NotImplementedError

  def encode_image(self, model, pixels, config):
    raise NotImplementedError

  def encode_text(self, model, tokens, config):
    raise NotImplementedError

  def scores(self, img, txt, img_x, txt_x, config):
    raise NotImplementedError
