"""Fine-tuning frameworks as plug-ins (issue 29, in progress). Each framework module owns its config block
(`CONFIG`, `NON_NEGATIVE` keys, `model_fields(config)`: checks and the architecture fields it implies, `OFF`: those
fields when another framework is chosen, `TITLE`), its loss terms (a `Term`, see base.py) and how config.<name>
turns into them (`objective(config, obj)`); its model parts and inputs are still in the core modules. `blocks`,
`model_fields` and `objective_for` are what the core asks of this package."""
from __future__ import annotations

import importlib

from hnclip_jax.frameworks.base import Context, Term

# config.framework -> the module whose objective(config, obj) adds the framework's terms ("longclip": L_HN alone).
REGISTRY = {"longclip": None, "finelip": "hnclip_jax.frameworks.finelip", "goal": "hnclip_jax.frameworks.goal",
            "structxlip": "hnclip_jax.frameworks.structxlip"}


def blocks() -> list:
  """[(name, module)] of the registered frameworks that have a config block (config.<name>), in registry order."""
  return [(name, importlib.import_module(m)) for name, m in REGISTRY.items() if m is not None]


def check_name(config) -> str:
  name = config.get("framework", "longclip")
  if name not in REGISTRY:
    raise ValueError(f"config.framework={name!r}; choose one of {list(REGISTRY)}")
  return name


def model_fields(config) -> dict:
  """Checks config.framework and every framework's block: a block changed from its defaults while another
  framework is chosen is refused (it would silently do nothing). Returns the architecture fields the choice
  implies (FineLIP's aggregators; `OFF` of the others)."""
  chosen = check_name(config)
  fields = {}
  for name, mod in blocks():
    if name == chosen:
      continue
    changed = [f"config.{name}.{k}={v!r}" for k, v in config.get(name, {}).items()
               if k not in mod.ALWAYS_READ and v != mod.CONFIG.get(k)]
    if changed:
      raise ValueError(f"{', '.join(changed)} set, but config.framework={chosen!r}: {mod.TITLE}'s settings apply only "
                       f"with config.framework={name!r}. Set that, or drop them")
    fields.update(mod.OFF)
  own = hook(config, "model_fields")
  if own is not None:
    fields.update(own(config))
  return fields


def hook(config, name: str):
  """The chosen framework module's function `name` (None when it has none, or for "longclip")."""
  module = REGISTRY[check_name(config)]
  return None if module is None else getattr(importlib.import_module(module), name, None)


def objective_for(config, obj):
  """The objective `obj` (built from config.loss) with config.framework's terms added."""
  add = hook(config, "objective")
  return obj if add is None else add(config, obj)


__all__ = ["Context", "REGISTRY", "Term", "blocks", "check_name", "hook", "model_fields", "objective_for"]
