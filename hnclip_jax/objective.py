"""The training objective: model outputs -> (loss, per-term metrics), on a device mesh.

One `Objective`, built from `config.loss` (and config.framework's terms), is the only place the loss is assembled.
The train step, the global-batch accumulation path, the saturation telemetry and the HN-vs-InfoNCE gradient
comparison all call it on the model's outputs dict (`CLIP.__call__`: "img", "txt", "scale" and, when a term asks,
"img_tokens", "txt_tokens", "txt_mask", ...).

    L = Σ_terms = w_g·L_HN(γ) + λ·L_tok + the framework's terms      (paper Eq. 2 and 3; λ = config.loss.token_weight)

Every part is a `frameworks.Term`: L_HN is HN-CLIP's global term (`terms.ContrastiveTerm`; with
config.loss.kind="sigmoid", SigLIP's pairwise sigmoid loss with the same margin: HN-SigLIP), L_tok the FILIP token
term (`terms.TokenTerm`), and a fine-tuning framework adds its own through `hnclip_jax.frameworks`
(docs/frameworks.md); w_g = 1 except where a framework sets it (its `objective` hook:
`obj.with_term(ContrastiveTerm, weight=...)`). `Objective` only sums them; a plug-in may replace the global term
(the first) as easily as add one.

On a mesh every device all-gathers what its terms need, builds only its own rows of each B×B score matrix against
the whole batch (the math is in `hnclip_jax.losses`), and the per-device sums are reduced with psum; the gather's
transpose is a reduce-scatter, so gradients stay sharded and equal the single-device ones.

How to add a term: write its math in `losses.py` as a function of a block of rows against the whole batch; wrap it
in a `frameworks.Term` (its settings as fields; `outputs` for model outputs it makes from the towers, or
`model_kwargs` for those `CLIP.__call__` makes, `input_keys` for batch entries, `schedule` for step-dependent
weights) and add it in a framework's `objective(config, obj)` (a framework may live outside this package:
docs/frameworks.md, "Write your own framework").
Accumulation, telemetry, the gradient comparison and sharding then work without further changes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hnclip_jax import frameworks, sharding
from hnclip_jax.config import GLOBAL_SETTINGS, TOKEN_SETTINGS
from hnclip_jax.frameworks.base import Context, Keyed
from hnclip_jax.terms import TOKEN_OUTPUTS, ContrastiveTerm, TokenTerm

# Outputs without a batch dimension (everything else in an outputs dict is [B, ...]).
GLOBAL_OUTPUTS = ("scale", "bias")


@dataclasses.dataclass(frozen=True)
class Objective:
  """The sum of its terms: the global term (`terms.ContrastiveTerm`: L_HN, or HN-SigLIP), the token term when λ > 0
  (`terms.TokenTerm`), then the framework's. `gamma` and `chunk_size` are shared by every term (through the
  Context); each term owns the rest of its settings. `Objective.of(...)` builds one from config.loss-style keywords,
  `from_config` from the config."""
  gamma: float = 0.5
  terms: tuple = (ContrastiveTerm(),)
  chunk_size: int = 0  # rows per device computed at a time (0: all rows for L_HN, losses.TOKEN_BLOCK for L_tok)
  batch_axes: tuple = sharding.BATCH_AXES

  @classmethod
  def of(cls, gamma: float = 0.5, kind: str = "softmax", token_weight: float = 0.0, chunk_size: int = 0,
         sigmoid_schedule: str = "ring", global_weight: float = 1.0, terms: tuple = (), margin: str = "geometry",
         margin_value: float = -1.0, margin_topk: int = 0, hn_nce_beta: float = 0.0, shuffle_seed: int = 0,
         margin_directions: str = "both", **token) -> "Objective":
    """The core's terms from config.loss-style settings (the global term with weight `global_weight` and its
    margin control / HN-NCE settings, the token term when token_weight > 0, with the token_* keywords), followed by
    `terms`."""
    if token and not token_weight > 0:
      raise ValueError(f"{sorted(token)} are settings of the token term, which is off (token_weight=0)")
    core = (ContrastiveTerm(kind=kind, sigmoid_schedule=sigmoid_schedule, weight=float(global_weight),
                            margin=str(margin), margin_value=float(margin_value), margin_topk=int(margin_topk),
                            hn_nce_beta=float(hn_nce_beta), shuffle_seed=int(shuffle_seed),
                            margin_directions=str(margin_directions)),)
    if token_weight > 0:
      core += (TokenTerm(weight=float(token_weight), **token),)
    return cls(gamma=float(gamma), terms=core + tuple(terms), chunk_size=int(chunk_size))

  @classmethod
  def from_config(cls, loss_cfg, config=None) -> "Objective":
    """From config.loss; with the whole `config`, also config.framework's terms (hnclip_jax.frameworks). The token
    term's settings are read only when it is on (config.validate refuses them changed otherwise, except those the
    framework reads itself: its LOSS_SETTINGS)."""
    token_weight = float(loss_cfg.token_weight)
    defaults = {f.name: f.default for f in dataclasses.fields(TokenTerm) if f.name in TOKEN_SETTINGS}
    token = {k: type(d)(loss_cfg[k]) for k, d in defaults.items()} if token_weight > 0 else {}
    kind = str(loss_cfg.get("kind", "softmax"))
    extra = {"sigmoid_schedule": str(loss_cfg.sigmoid_schedule)} if kind == "sigmoid" else {}
    control = {k: loss_cfg[k] for k in GLOBAL_SETTINGS if k in loss_cfg}
    if config is not None and control.get("margin") == "shuffled":
      control["shuffle_seed"] = int(config.seed)
    obj = cls.of(gamma=float(loss_cfg.gamma), kind=kind, token_weight=token_weight,
                 chunk_size=int(loss_cfg.chunk_size), **extra, **control, **token)
    if config is not None:
      obj = frameworks.objective_for(config, obj)
    return obj

  def check(self, model_cfg) -> None:
    """Raises naming the config key if this objective cannot run on `model_cfg` (before anything compiles)."""
    layers = min(model_cfg.vision_layers, model_cfg.text_layers)
    for term in self.terms:
      term.check(model_cfg, self)
    layer = self.model_kwargs.get("token_layer")
    if layer is not None and not -layers <= layer < layers:
      raise ValueError(f"config.loss.token_layer={layer} is outside the towers' blocks (the model has "
                       f"{model_cfg.vision_layers} vision and {model_cfg.text_layers} text blocks); use -1 for the "
                       f"last block or an index in [-{layers}, {layers})")

  def replace(self, **changes) -> "Objective":
    return dataclasses.replace(self, **changes)

  def with_term(self, cls, **changes) -> "Objective":
    """This objective with its term of type `cls` changed (e.g. `with_term(ContrastiveTerm, weight=0.5)`)."""
    term = self.term(cls)
    if term is None:
      raise ValueError(f"the objective has no {cls.__name__} term (its terms: "
                       f"{[type(t).__name__ for t in self.terms]})")
    return self.replace(terms=tuple(dataclasses.replace(t, **changes) if t is term else t for t in self.terms))

  @property
  def global_term(self):
    """The first term: the global contrastive term (ContrastiveTerm unless a plug-in replaced it)."""
    return self.terms[0]

  def plain(self) -> "Objective":
    """This objective with its global term plain (γ = 0, and no HN-NCE weighting or margin control): the
    telemetry's InfoNCE / SigLIP on the same batch."""
    plain = getattr(self.global_term, "plain", None)
    terms = self.terms if plain is None else (plain(),) + self.terms[1:]
    return self.replace(gamma=0.0, terms=terms)

  @property
  def plain_name(self) -> str:
    """What the global term is without the margin (γ = 0), for telemetry: "infonce", "siglip", or "plain"."""
    return getattr(self.global_term, "plain_name", "plain")

  @property
  def needs_tokens(self) -> bool:
    """Whether a term reads the token outputs (TOKEN_OUTPUTS); without one, `forward` drops them."""
    return any(getattr(t, "reads_tokens", False) for t in self.terms)

  def term(self, cls):
    """This objective's term of type `cls` (None if it has none)."""
    return next((t for t in self.terms if isinstance(t, cls)), None)

  @property
  def term_names(self) -> tuple:
    return tuple(n for t in self.terms for n in t.names)

  @property
  def input_keys(self) -> tuple:
    """The batch entries `forward` reads."""
    return ("image", "tokens") + tuple(k for t in self.terms for k in t.input_keys)

  def model_inputs(self, inputs=None) -> dict:
    """Keyword arguments of `CLIP.__call__` that produce the outputs this objective reads (inputs: the batch
    entries, for terms whose outputs come from inputs of their own; None: the keys that need none)."""
    kw = {}
    for t in self.terms:
      kw.update(t.model_kwargs(self, inputs))
    return kw

  @property
  def model_kwargs(self) -> dict:
    return self.model_inputs()

  def forward(self, model, inputs: dict, rng=None) -> dict:
    """The model's outputs dict for a batch: inputs {"image" [B, H, W, 3], "tokens" [B, L], and what the terms
    read} (`input_keys`); rng: adapter dropout key."""
    out, hidden = model.forward(inputs["image"], inputs["tokens"], dropout_rng=rng, **self.model_inputs(inputs))
    for t in self.terms:  # outputs a term makes itself (frameworks.Term.outputs)
      out.update(t.outputs(model, Keyed(out, "model outputs", _owner(t, "outputs")),
                           Keyed(inputs, "batch", _owner(t, "outputs")), rng, hidden))
    if not self.needs_tokens:  # a term's outputs were made from them; no term reads them
      out = {k: v for k, v in out.items() if k not in TOKEN_OUTPUTS}
    return out

  def __call__(self, outputs: dict, mesh, step=None):
    """outputs: the model's outputs dict, [B, ...] leaves sharded over the batch axes of `mesh`; step: the train
    step (for terms with a schedule; None = their full weight).

    Returns (loss scalar, aux) with aux = {"terms": {each term's values: "hn" (L_HN), "tok" (L_tok, when on), the
    framework's}, "per_example": [B] each example's loss (the terms' per-example shares, weighted; the global
    term's is ½(i2t + t2i))}. Value and gradients equal the single-device ones.
    """
    axes = tuple(self.batch_axes)
    batch = outputs["img"].shape[0]
    specs = {k: P() if k in GLOBAL_OUTPUTS else P(axes) for k in outputs}

    scheds = tuple(t.schedule(step) for t in self.terms)

    def local(out, scheds):
      n = out["img"].shape[0]
      offset = jax.lax.axis_index(axes) * n
      gather = lambda x: jax.lax.all_gather(x, axes, axis=0, tiled=True)  # noqa: E731  [n, ...] -> [B, ...]
      ctx = Context(axes=axes, batch=batch, offset=offset, gamma=self.gamma, scale=out["scale"],
                    img_all=gather(out["img"]), txt_all=gather(out["txt"]), chunk_size=self.chunk_size,
                    gather=gather)
      loss, per, values = None, None, {}
      for term, sched in zip(self.terms, scheds):
        loss_parts, term_values, per_parts = term(Keyed(out, "model outputs", _owner(term, "__call__")), ctx, sched)
        values.update(term_values)
        for part in loss_parts:
          loss = part if loss is None else loss + part
        for part in per_parts:
          per = part if per is None else per + part
      return loss, {"terms": values, "per_example": per}

    out_specs = (P(), {"terms": {k: P() for k in self.term_names},
                       "per_example": P(axes)})
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs)
    return fn({k: (jnp.asarray(v, jnp.float32) if k in GLOBAL_OUTPUTS else v) for k, v in outputs.items()}, scheds)


def _owner(term, method: str) -> str:
  return f"{type(term).__module__}.{type(term).__qualname__}.{method}"


def embedding_outputs(img_emb, txt_emb, logit_scale) -> dict:
  """An outputs dict from bare embeddings ([B, D] each, L2-normalised) and s: for losses of given embeddings."""
  return {"img": img_emb, "txt": txt_emb, "scale": jnp.asarray(logit_scale, jnp.float32)}
