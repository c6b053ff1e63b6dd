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
import difflib
import inspect
import types
from typing import Any, Callable, ClassVar

import jax

# The batch entries the core makes for every example (a framework's `inputs` add more; its names may not clash).
BATCH_KEYS = {
    "image": "[B, H, W, 3] the preprocessed images (float32, CLIP-normalised)",
    "tokens": "[B, L] int32 caption token ids (start token, the caption, end of text, then padding with 0)",
    "index": "[B] int64 each example's record index in the split (host side: the input pipeline and a framework's `inputs` see it; the train step's batch does not carry it)",
}



def check_input_names(names, who: str) -> None:
  """A framework's per-example inputs (declared by its `input_specs`, or made by its `inputs`) may not take the
  name of a core batch entry; `who` starts the message (the framework, or the pipeline's view of it)."""
  clash = sorted(set(names) & set(BATCH_KEYS))
  if clash:
    raise ValueError(f"{who}: its per-example inputs {clash} have the names of the core's batch entries "
                     f"{list(BATCH_KEYS)}; rename them (its `inputs` and `input_specs`)")


# The model outputs the core makes (`CLIP.__call__`); a term's `outputs` add more. Only "scale" and "bias" lack the
# batch dimension.
OUTPUT_KEYS = {
    "img": "[B, D] image embeddings, L2-normalised, float32",
    "txt": "[B, D] caption embeddings, L2-normalised, float32",
    "scale": "s, the learned logit scale (a float32 scalar, already exp(log s))",
    "bias": "b, the learned logit bias (a scalar; models with config.model.logit_bias, i.e. SigLIP)",
    "img_tokens": "[B, P, D] image patch tokens (1+P with token_image_cls), L2-normalised per token; when a term "
                  "asks for token_layer (its model_kwargs) or the token term is on",
    "txt_tokens": "[B, L, D] caption tokens, L2-normalised per token; with img_tokens",
    "txt_mask": "[B, L] bool, True on the real tokens (start through the first end of text, never padding)",
}


class MissingKey(ValueError, KeyError):
  """A term or framework asked for a batch entry or model output that does not exist (one line, no traceback)."""

  def __str__(self):
    return str(self.args[0])


class Keyed(dict):
  """The outputs dict or batch handed to a framework's code: a missing key raises MissingKey naming the key, who
  asked, and the keys that exist (a plain dict's KeyError names only the key)."""

  def __init__(self, entries, what: str, owner: str):
    super().__init__(entries)
    self._what, self._owner = what, owner

  def __missing__(self, key):
    near = difflib.get_close_matches(str(key), [str(k) for k in self], n=1)
    documented = OUTPUT_KEYS if self._what == "model outputs" else BATCH_KEYS
    why = (f" ({key!r} is made only {documented[key].split('; ', 1)[1]})"
           if key in documented and "; " in documented[key] else "")
    raise MissingKey(f"{self._owner} asked for {self._what}[{key!r}], which this run does not have{why}; it has "
                     f"{sorted(self)}" + (f" (did you mean {near[0]!r}?)" if near else "") +
                     ". The keys are documented in docs/frameworks.md (\"The contract\")")


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


# A Keyed passed on to jax (jax.tree.map, lax.map, ...) is a dict to it (sorted keys, as jax flattens a dict).
jax.tree_util.register_pytree_node(Keyed, lambda d: ([d[k] for k in sorted(d)], sorted(d)),
                                   lambda keys, values: dict(zip(keys, values)))


class Framework:
  """The plug-in contract: every attribute a framework may define, with its signature. This class is the one
  definition (docs/frameworks.md's table is checked against it); a framework is a module or an object with any of
  these attributes, all optional, and may subclass this class (it adds nothing but the defaults below). A
  framework with an attribute that looks like one of these but is none (`objectives` for `objective`) is refused
  when it is resolved, as is a hook taking the wrong number of arguments."""

  TITLE: ClassVar[str] = ""  # its name in messages
  CONFIG: ClassVar[dict] = {}  # its settings' defaults: config.<BLOCK>.*
  BLOCK: ClassVar[str | None] = None  # the settings block's name (default: the registry name, or Name.lower())
  NON_NEGATIVE: ClassVar[tuple] = ()  # keys of its block that must be >= 0
  ALWAYS_READ: ClassVar[tuple] = ()  # keys of its block read even when another framework is chosen
  LOSS_SETTINGS: ClassVar[tuple] = ()  # config.loss keys it reads even with the token term off
  SCORES: ClassVar[dict] = {}  # {name: Score}: eval scores for models with its parts (eval.py --score=name)
  PARAMS: ClassVar[tuple] = ()  # the model's top-level modules it adds (see start_params)

  @staticmethod
  def objective(config, obj):
    """`obj` (an Objective) with its loss terms added: obj.replace(terms=obj.terms + (YourTerm(...),))."""
    return obj

  @staticmethod
  def model_fields(config) -> dict:
    """Checks its block; returns the architecture fields (CLIPConfig) it implies, e.g. {"parts":
    "package.module:function", "part_settings": ((key, value), ...)} for modules of its own."""
    del config
    return {}

  @staticmethod
  def inputs(config, model_cfg, tokenizer):
    """A picklable callable (example, caption, image uint8 [H, W, 3], seed, step, index) -> {name: array} the
    input pipeline adds to each training example (None: nothing)."""
    del config, model_cfg, tokenizer

  @staticmethod
  def input_specs(config, model_cfg) -> dict:
    """{name: (shape without the batch dimension, dtype)} of what `inputs` adds."""
    del config, model_cfg
    return {}

  @staticmethod
  def check_data(config, objective):
    """Before anything compiles: raises naming what the data lacks; returns a line to log (or None)."""
    del config, objective

  @staticmethod
  def logit_scale_max(config):
    """A clamp of the learned logit scale (None: the core's)."""
    del config

  @staticmethod
  def resolve_epochs(config, steps_per_epoch: int):
    """`config` with its settings given in epochs (-1 = one) as steps, once the training split's size is known."""
    del steps_per_epoch
    return config

  @staticmethod
  def trained_with_adapters(model_cfg) -> tuple:
    """Regexes of its parameters that train under LoRA / DoRA though they are not adapters."""
    del model_cfg
    return ()

  @staticmethod
  def start_params(params, model_cfg, seed, source):
    """The start's parameters (config.init_from) given its PARAMS: fresh ones added, or the start's own checked."""
    del model_cfg, seed, source
    return params

  @staticmethod
  def upgrade_model_dict(d: dict) -> dict:
    """A saved model description (model.json, a checkpoint's) written by an older version of it -> today's."""
    return d


def _contract():
  hooks, constants = {}, {}
  for name, value in vars(Framework).items():
    if name.startswith("_"):
      continue
    if isinstance(value, staticmethod):
      hooks[name] = inspect.signature(value.__func__)
    else:
      constants[name] = value
  return hooks, constants


HOOKS, CONSTANTS = _contract()


def check_framework(fw, name: str) -> None:
  """Raises one line when `fw` (the framework config.framework=`name` resolved to) has an attribute that looks like
  a hook or setting of the contract but is none, or a hook whose arguments differ from the contract's."""
  own = getattr(fw, "__name__", None) if isinstance(fw, types.ModuleType) else None
  names = (list(vars(fw)) if isinstance(fw, types.ModuleType)
           else [n for k in reversed(type.mro(fw) if isinstance(fw, type) else type(fw).mro()) if k is not object
                 for n in vars(k)] + list(getattr(fw, "__dict__", {})))
  known = {**HOOKS, **CONSTANTS}
  for attr in dict.fromkeys(names):
    if attr.startswith("_") or attr in known:
      continue
    value = getattr(fw, attr)
    if isinstance(value, types.ModuleType) or (own and getattr(value, "__module__", own) != own):
      continue  # an import, not the framework's own
    near = difflib.get_close_matches(attr, list(HOOKS if callable(value) else CONSTANTS), n=1, cutoff=0.8)
    if near:
      raise ValueError(f"config.framework={name!r}: its {attr!r} is no hook of the framework contract (did you mean "
                       f"{near[0]!r}?); the hooks are {sorted(HOOKS)} and the settings {sorted(CONSTANTS)} "
                       "(hnclip_jax/frameworks/base.py:Framework, docs/frameworks.md)")
  for hook, signature in HOOKS.items():
    fn = getattr(fw, hook, None)
    if fn is None or fn is getattr(Framework, hook):
      continue
    if not callable(fn):
      raise ValueError(f"config.framework={name!r}: its {hook!r} is a {type(fn).__name__}, not a function "
                       f"{hook}{signature}")
    try:
      inspect.signature(fn).bind(*signature.parameters)
    except TypeError:
      raise ValueError(f"config.framework={name!r}: its hook {hook}{inspect.signature(fn)} takes other arguments "
                       f"than the contract's {hook}{signature} (hnclip_jax/frameworks/base.py:Framework)") from None
    except ValueError:  # a builtin without a signature: not checked
      pass
