"""Fine-tuning frameworks as plug-ins (issue 29, in progress). Today each framework module owns its loss terms
(a `Term`, see base.py) and how config.<framework> turns into them (`objective(config, obj)`); its model parts,
inputs and config block are still in the core modules. `objective_for` is all the core asks of this package."""
from __future__ import annotations

import importlib

from hnclip_jax.frameworks.base import Context, Term

# config.framework -> the module whose objective(config, obj) adds the framework's terms ("longclip": L_HN alone).
REGISTRY = {"longclip": None, "finelip": "hnclip_jax.frameworks.finelip", "goal": "hnclip_jax.frameworks.goal",
            "structxlip": "hnclip_jax.frameworks.structxlip"}


def objective_for(config, obj):
  """The objective `obj` (built from config.loss) with config.framework's terms added."""
  name = config.get("framework", "longclip")
  if name not in REGISTRY:
    raise ValueError(f"config.framework={name!r}; choose one of {list(REGISTRY)}")
  module = REGISTRY[name]
  return obj if module is None else importlib.import_module(module).objective(config, obj)


__all__ = ["Context", "REGISTRY", "Term", "objective_for"]
