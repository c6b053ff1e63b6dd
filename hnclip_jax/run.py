"""One resolved run, the object train.py, eval.py, tools/compile_for and the benchmarks share: `Run` (frozen) and
`Run.of`, which builds one from parts already resolved. How flags become a Run — the workdir, the data, the model's
start — is `hnclip_jax.experiment.resolve`; this module reads no data and no workdir, so building a train step from
a Run (`train_step.build_program`) needs neither tensorflow-datasets nor grain (benchmarks/vit_l_step.py on an
accelerator image that has neither)."""
from __future__ import annotations

import dataclasses

import jax
import ml_collections

from hnclip_jax import frameworks, sharding, train_step
from hnclip_jax.models import CLIPConfig
from hnclip_jax.objective import Objective

PURPOSES = ("train", "eval", "compile")


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """One resolved run. `config` is frozen (validated, its data and epoch-given settings resolved); `model` the
  architecture with this run's compute settings; `framework` the resolved config.framework (None for "longclip");
  `objective` the loss (None for eval); `sources` the data sources a train run reads ({"train", "eval"});
  `init_params` a fine-tuning start's weights (train, first start only); `lock` the workdir's single-writer guard
  (train; release it when the run ends)."""
  purpose: str
  config: ml_collections.ConfigDict
  model: CLIPConfig
  mesh: jax.sharding.Mesh
  rules: tuple
  framework: object
  objective: Objective | None
  tokenizer: object = None
  wd: object = None  # hnclip_jax.workdir.Workdir: the run directory (wd.path) and every path in it
  data_note: str = ""
  sources: dict = dataclasses.field(default_factory=dict)
  init_params: object = dataclasses.field(default=None, repr=False)
  lock: object = dataclasses.field(default=None, repr=False)

  @classmethod
  def of(cls, config, model: CLIPConfig, mesh, *, purpose: str = "compile", rules=None, **rest) -> "Run":
    """A run from parts already resolved (`config` as given, not copied: a test may watch what is read of it):
    the framework and the objective are derived here, the model-, mesh- and framework-dependent checks made."""
    if purpose not in PURPOSES:
      raise ValueError(f"purpose={purpose!r}; one of {PURPOSES}")
    rules = sharding.parse_rules(config.mesh.rules) if rules is None else rules
    fw = frameworks.resolve(frameworks.check_name(config))
    objective = None
    if purpose != "eval":
      objective = Objective.from_config(config.loss, config)
      train_step.check_accumulation(config, mesh)
      sharding.check_model_fits(model, mesh, rules)
      objective.check(model)
    run = cls(purpose, config, model, mesh, rules, fw, objective, **rest)
    if purpose != "eval":
      run.input_specs()  # a framework's input names
    return run

  def hook(self, name: str):
    """The run's framework's hook `name` (base.Framework), None when it has none."""
    return frameworks.hook_of(self.framework, name)

  def input_specs(self) -> dict:
    """The framework's per-example inputs {name: (shape, dtype)} ({} for none); raises on a core batch key's name."""
    return frameworks.input_specs(self.config, self.model)
