"""Fine-tuning frameworks as plug-ins. A framework is a module (the built-in ones: finelip.py, goal.py,
structxlip.py) or any object with the same attributes (`config.framework="package.module:Name"` imports `Name` from
a module outside this package). What it may define, with every hook's signature, is one class:
`hnclip_jax.frameworks.base.Framework` (the contract; all optional). A framework is checked against it when it is
resolved: an attribute that looks like a hook but is none (a misspelling) or a hook with other arguments is refused
in one line. Its loss terms are `Term`s (base.py); the batch entries and model outputs they read are
`base.BATCH_KEYS` and `base.OUTPUT_KEYS` (plus what frameworks add), and a term asking for one that does not exist
is refused naming the ones that do.

docs/frameworks.md ("Write your own framework") walks through one. `blocks`, `model_fields`, `objective_for`, `hook`,
`settings`, `loss_settings`, `score` and `upgrade_model_dict` are what the core asks of this package; nothing outside
it names a framework.
"""
from __future__ import annotations

import importlib

import ml_collections

from hnclip_jax.frameworks.base import (HOOKS, Context, Framework, Score, Term, check_framework,
                                       check_input_names)

# config.framework -> the module of a built-in framework ("longclip": L_HN alone, no module).
REGISTRY = {"longclip": None, "finelip": "hnclip_jax.frameworks.finelip", "goal": "hnclip_jax.frameworks.goal",
            "structxlip": "hnclip_jax.frameworks.structxlip"}


_MISSING = {}  # built-in framework -> why its module does not import here (a package it needs is not installed)


def _builtin(name: str):
  """The module of built-in framework `name`, or None (recorded in _MISSING) when a package it needs is missing."""
  if name not in _MISSING:
    try:
      return importlib.import_module(REGISTRY[name])
    except ImportError as e:
      _MISSING[name] = f"{type(e).__name__}: {e}"
  return None


def blocks() -> list:
  """[(name, module)] of the registered frameworks that have a config block (config.<name>), in registry order.
  A built-in framework whose module needs a package this environment lacks (GOAL and StructXLIP read data: an
  accelerator image without tensorflow-datasets, grain or OpenCV) is left out; asking for it names the package."""
  return [(name, mod) for name, m in REGISTRY.items() if m is not None and (mod := _builtin(name)) is not None]


_RESOLVED = {}  # config.framework -> the framework: imported and checked against the contract once per process
RESOLUTIONS = [0]  # how many times a framework was looked up and checked (tests: once per process and name)


def resolve(name: str):
  """config.framework -> the framework (a module or object; None for "longclip"), checked against the contract
  (base.Framework). A name with a colon, "package.module:Name", imports Name from package.module (found on sys.path
  / PYTHONPATH). Resolved once per process and name; later calls return the same object."""
  if name not in _RESOLVED:
    fw = _find(name)
    if fw is not None:
      check_framework(fw, name)
    RESOLUTIONS[0] += 1
    _RESOLVED[name] = fw
  return _RESOLVED[name]


def _find(name: str):
  if name in REGISTRY:
    if REGISTRY[name] is None:
      return None
    if _builtin(name) is None:
      raise ValueError(f"config.framework={name!r} cannot run here: its module needs a package that is not "
                       f"installed ({_MISSING[name]}); pip install -r requirements.txt")
    return _builtin(name)
  if ":" not in name:
    raise ValueError(f"config.framework={name!r}; choose one of {list(REGISTRY)}, or give your own as an import path "
                     "'package.module:Name' (docs/frameworks.md, \"Write your own framework\")")
  module, _, attr = name.partition(":")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"config.framework={name!r}: cannot import {module!r} ({e}). Put its folder on PYTHONPATH "
                     "(or install it) and run again") from None
  obj = getattr(mod, attr, None)
  if obj is None:
    raise ValueError(f"config.framework={name!r}: {module} ({mod.__file__}) has no {attr!r}")
  return obj


def check_name(config) -> str:
  name = config.get("framework", "longclip")
  resolve(name)
  return name


def block_name(config) -> str | None:
  """The config block (config.<BLOCK>) of the chosen framework; None when it has no settings."""
  name = check_name(config)
  fw = resolve(name)
  if fw is None or not getattr(fw, "CONFIG", None):
    return None
  return name if name in REGISTRY else getattr(fw, "BLOCK", None) or name.rpartition(":")[2].lower()


def external_block(config):
  """(block name, framework) of a chosen framework from outside the registry that has settings, else None. Its
  block may be absent from the config (its defaults apply) or given by the config file (`use`)."""
  name = check_name(config)
  if name in REGISTRY:
    return None
  block = block_name(config)
  return None if block is None else (block, resolve(name))


def use(config, name: str):
  """In a config file: choose the framework `name` ("package.module:Name" or a registered one) and add its
  settings block with their defaults (config.<BLOCK>), so `--config.<BLOCK>.<key>=...` can change them."""
  config.framework = name
  block = block_name(config)
  if block is not None and block not in config:
    config[block] = ml_collections.ConfigDict(dict(resolve(name).CONFIG))
  return config


def settings(config):
  """The chosen framework's settings: its defaults (CONFIG) updated with config.<BLOCK> (None if it has none)."""
  block = block_name(config)
  if block is None:
    return None
  fw = resolve(check_name(config))
  merged = ml_collections.ConfigDict(dict(fw.CONFIG))
  merged.update(dict(config.get(block, {})))
  return merged


def model_fields(config) -> dict:
  """Checks config.framework and every framework's block: a block changed from its defaults while another
  framework is chosen is refused (it would silently do nothing). Returns the architecture fields the choice
  implies (no model parts unless the chosen framework adds them)."""
  chosen = check_name(config)
  fields = {"parts": "", "part_settings": ()}
  for name, mod in blocks():
    if name == chosen:
      continue
    changed = [f"config.{name}.{k}={v!r}" for k, v in config.get(name, {}).items()
               if k not in getattr(mod, "ALWAYS_READ", ()) and v != mod.CONFIG.get(k)]
    if changed:
      raise ValueError(f"{', '.join(changed)} set, but config.framework={chosen!r}: {mod.TITLE}'s settings apply only "
                       f"with config.framework={name!r}. Set that, or drop them")
  own = hook(config, "model_fields")
  if own is not None:
    fields.update(own(config))
  return fields


def hook(config, name: str):
  """The chosen framework's function `name`, one of the contract's hooks (None when it has none, or for
  "longclip"; a subclass of base.Framework that does not override it has none)."""
  return hook_of(resolve(check_name(config)), name)


def hook_of(fw, name: str):
  """`hook` of a resolved framework `fw` (a resolved run's `framework`)."""
  if name not in HOOKS:
    raise AttributeError(f"{name!r} is no hook of the framework contract (base.Framework): {sorted(HOOKS)}")
  fn = None if fw is None else getattr(fw, name, None)
  return None if fn is getattr(Framework, name) else fn


def input_specs(config, model_cfg) -> dict:
  """The chosen framework's per-example inputs {name: (shape without the batch dimension, dtype)} ({} for none);
  raises when one takes the name of a core batch entry (image, tokens, index)."""
  specs = hook(config, "input_specs")
  specs = {} if specs is None else dict(specs(config, model_cfg))
  check_input_names(specs, f"config.framework={check_name(config)!r}")
  return specs


def loss_settings(config) -> tuple:
  """config.loss keys the chosen framework reads even with the token term off (its `LOSS_SETTINGS`)."""
  fw = resolve(check_name(config))
  return tuple(getattr(fw, "LOSS_SETTINGS", ())) if fw is not None else ()


def upgrade_model_dict(d: dict) -> dict:
  """A saved model description (model.json, a checkpoint's meta) -> today's CLIPConfig fields: each registered
  framework's `upgrade_model_dict` maps the fields its older versions wrote."""
  for _, mod in blocks():
    up = getattr(mod, "upgrade_model_dict", None)
    if up is not None:
      d = up(d)
  return d


def _parts_framework(model_cfg):
  """The framework whose `model_parts` made the model's parts (None when it has none)."""
  if not model_cfg.parts:
    return None
  return importlib.import_module(model_cfg.parts.partition(":")[0])


def score(name: str, model_cfg, where: str):
  """eval.py --score=name -> the `Score` (None for "cosine"), from the framework whose parts the model has; raises
  naming the choices, or what the model lacks."""
  if name == "cosine":
    return None
  own = getattr(_parts_framework(model_cfg), "SCORES", {}) if model_cfg.parts else {}
  if name in own:
    own[name].check(model_cfg, where)
    return own[name]
  for _, mod in blocks():  # a built-in framework's score on a model without its parts: its own message
    if name in getattr(mod, "SCORES", {}):
      mod.SCORES[name].check(model_cfg, where)
  raise ValueError(f"--score={name!r}: choose 'cosine'" + "".join(f" or {n!r}" for n in own) +
                   f" (the scores {where}'s model offers)")


def objective_for(config, obj):
  """The objective `obj` (built from config.loss) with config.framework's terms added."""
  add = hook(config, "objective")
  return obj if add is None else add(config, obj)


__all__ = ["Context", "Framework", "REGISTRY", "Score", "Term", "block_name", "blocks", "check_name", "external_block", "hook", "hook_of",
           "input_specs", "loss_settings", "model_fields", "objective_for", "resolve", "score", "settings",
           "upgrade_model_dict", "use"]
