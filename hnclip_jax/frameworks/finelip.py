"""FineLIP (Asokan et al. 2025): a hinge over late-interaction scores of aggregated tokens, added to L_HN.

This module holds everything FineLIP adds: its config block (`config.finelip`) and checks, the two token aggregators
the model gains (`TokenAggregation`, built through `CLIPConfig.parts`), the aggregated-token outputs and the hinge
term, the ramp, the aggregators' weights on config.init_from and under LoRA / DoRA, and eval.py's
`--score=finelip`. docs/frameworks.md describes the method."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hnclip_jax import losses
from hnclip_jax.frameworks.base import Score, Term, one_epoch_as_steps
from hnclip_jax.models.clip import l2_normalize
from hnclip_jax.terms import ContrastiveTerm


TITLE = "FineLIP"
# config.finelip; defaults = the authors' released settings. tokens: K aggregated tokens per tower
# (39 = int(196 patches × 0.4 × 0.5)); hidden_ratio: the aggregation MLP's width / embed_dim; weight, margin:
# the hinge's weight and margin; reduction: "sum" over every violating pair (the authors) or "mean" (÷ batch);
# ramp_steps: the hinge's weight ramps linearly from 0 over these steps (-1: one epoch of the training split, the
# authors' ramp; 0: none); hn_margin: also add γ·Ḡ to the hinge's negatives; global_weight: weight of L_HN (the
# released FineLIP code has none: 0; the paper's swap adds it: 1); score_weight: eval.py --score=finelip ranks by
# (1 − w)·cosine + w·late interaction (the authors: 0.2). The aggregators' learning rate is set with
# config.optimizer.lr_multipliers (configs/longclip_l.py:finelip: backbone 1e-6, aggregators 2e-4).
CONFIG = {"tokens": 39, "hidden_ratio": 0.2, "weight": 1.0, "margin": 0.2, "reduction": "sum", "ramp_steps": -1,
          "hn_margin": False, "global_weight": 1.0, "score_weight": 0.2}
NON_NEGATIVE = ("weight", "margin", "global_weight", "score_weight")
# Read whatever config.framework is (eval.py --score=finelip on any model with aggregators).
ALWAYS_READ = ("score_weight",)
# config.loss keys the aggregators read even with the token term off (the tokens they aggregate).
LOSS_SETTINGS = ("token_layer", "token_image_cls")
# CLIPConfig.parts of a FineLIP model: this module's `model_parts`.
PARTS = f"{__name__}:model_parts"


def model_fields(config) -> dict:
  """Checks config.finelip; the model's architecture fields it implies (the aggregators)."""
  f = config.finelip
  if int(f.tokens) < 1:
    raise ValueError(f"config.finelip.tokens={f.tokens} must be >= 1 (the aggregated tokens per tower)")
  if not 0 < float(f.hidden_ratio):
    raise ValueError(f"config.finelip.hidden_ratio={f.hidden_ratio} must be positive")
  if f.reduction not in ("sum", "mean"):
    raise ValueError(f"config.finelip.reduction={f.reduction!r}; choose 'sum' (FineLIP) or 'mean'")
  if int(f.ramp_steps) < -1:
    raise ValueError(f"config.finelip.ramp_steps={f.ramp_steps}; use -1 (one epoch), 0 (no ramp) or a step count")
  if not 0 <= float(f.score_weight) <= 1:
    raise ValueError(f"config.finelip.score_weight={f.score_weight} must be in [0, 1]")
  return {"parts": PARTS, "part_settings": (("hidden_ratio", float(f.hidden_ratio)), ("tokens", int(f.tokens)))}


# ---- The model's parts: one token aggregator per tower ----------------------------------------------------------

# The model's top-level modules this framework adds (`TokenAggregation`, one per tower).
PARAMS = ("image_aggregator", "text_aggregator")


class TokenAggregation(nnx.Module):
  """FineLIP's token aggregation: N tokens [B, N, E] -> K tokens [B, K, E], each a softmax-weighted mean of the input
  tokens. The weights come from LayerNorm -> Linear(E, h) -> GELU -> Linear(h, K) per token, times a learned scalar
  temperature (init 1), normalised over the (valid) tokens. Runs in fp32 (a small module; its softmax over tokens
  should not round)."""

  def __init__(self, dim: int, tokens: int, hidden: int, eps: float, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(dim, epsilon=eps, rngs=rngs)
    self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, tokens, rngs=rngs)
    self.scale = nnx.Param(jnp.ones((), jnp.float32))

  def __call__(self, x, mask=None):  # x [B, N, E], mask [B, N] bool (True: a token to aggregate) -> [B, K, E]
    x = x.astype(jnp.float32)
    logits = self.fc2(jax.nn.gelu(self.fc1(self.norm(x)), approximate=False)) * self.scale[...]  # [B, N, K]
    if mask is not None:
      logits = jnp.where(mask[:, :, None], logits, -1e30)
    weights = jax.nn.softmax(logits, axis=1)
    return jnp.einsum("bnk,bne->bke", weights, x, precision=jax.lax.Precision.HIGHEST)


def _hidden(cfg, settings) -> int:
  return int(float(settings["hidden_ratio"]) * cfg.embed_dim)


def check_parts(cfg, settings: dict) -> None:
  """The aggregators' settings against the architecture (CLIPConfig.validate)."""
  if int(settings["tokens"]) < 1:
    raise ValueError(f"config.finelip.tokens={settings['tokens']} must be >= 1")
  if _hidden(cfg, settings) < 1:
    raise ValueError(f"config.finelip.hidden_ratio={settings['hidden_ratio']} gives an MLP of width "
                     f"int({settings['hidden_ratio']} * embed_dim {cfg.embed_dim}) = 0; use a larger ratio")


def model_parts(cfg, settings: dict, rngs: nnx.Rngs) -> dict:
  """CLIPConfig.parts: the two aggregation modules (model attributes `PARAMS`)."""
  return {name: TokenAggregation(cfg.embed_dim, int(settings["tokens"]), _hidden(cfg, settings), cfg.ln_eps,
                                 rngs=rngs) for name in PARAMS}


model_parts.check = check_parts


def has_aggregators(cfg) -> bool:
  return cfg.parts == PARTS


def init_aggregators(cfg, seed: int) -> dict:
  """Fresh aggregation-module parameters (pure dicts, keyed as in the model's params) for weights that lack them."""
  mods = model_parts(cfg, dict(cfg.part_settings), nnx.Rngs(seed + 104729))
  return {k: nnx.to_pure_dict(nnx.state(m, nnx.Param)) for k, m in mods.items()}


def aggregate_image(model, img_tok):
  """[CLS, K aggregated patches] [B, 1+K, E] from projected, unnormalised image tokens img_tok [B, 1+P, E] (CLS
  first), L2-normalised per token, fp32."""
  agg = jnp.concatenate([img_tok[:, :1].astype(jnp.float32), model.image_aggregator(img_tok[:, 1:])], axis=1)
  return l2_normalize(agg)


def aggregate_text(model, txt_tok, tokens):
  """[K aggregated from the start token through the last word, the end-of-text token] [B, K+1, E] from projected,
  unnormalised text tokens txt_tok [B, L, E], L2-normalised per token, fp32."""
  eot = model.eot_positions(tokens)
  words = jnp.arange(tokens.shape[1])[None, :] < eot[:, None]  # start token .. last word (never empty)
  eot_tok = jnp.take_along_axis(txt_tok, eot[:, None, None], axis=1).astype(jnp.float32)
  return l2_normalize(jnp.concatenate([model.text_aggregator(txt_tok, words), eot_tok], axis=1))


def start_params(params: dict, cfg, seed: int, source: str) -> dict:
  """Pretrained weights with the aggregators `cfg` has: fresh ones where the weights lack them (pre-trained CLIP),
  a FineLIP start's own where their shapes match."""
  if not has_aggregators(cfg):
    return {k: v for k, v in params.items() if k not in PARAMS}
  params = dict(params)
  for name, tree in init_aggregators(cfg, seed).items():
    if name not in params:
      params[name] = tree
      continue
    have, want = jax.tree.map(np.shape, params[name]), jax.tree.map(np.shape, tree)
    if have != want:
      got = dict(cfg.part_settings)
      raise ValueError(f"config.init_from={source} has FineLIP aggregators of other shapes ({name}: {have} vs "
                       f"{want} for config.finelip.tokens={got['tokens']}, hidden_ratio={got['hidden_ratio']}); "
                       "use its settings, or set them to match")
  return params


def trained_with_adapters(model_cfg) -> tuple:
  """Parameters (path regexes) that train under LoRA / DoRA although they are not adapters: the aggregators, new
  and randomly initialised."""
  return (r"(?:image|text)_aggregator/",) if has_aggregators(model_cfg) else ()


def upgrade_model_dict(d: dict) -> dict:
  """A model.json / checkpoint description written before CLIPConfig.parts (FineLIP's aggregators were the fields
  aggregate_tokens / aggregate_hidden_ratio) -> today's fields."""
  if "aggregate_tokens" not in d and "aggregate_hidden_ratio" not in d:
    return d
  d = dict(d)
  tokens, ratio = int(d.pop("aggregate_tokens", 0)), float(d.pop("aggregate_hidden_ratio", 0.2))
  if tokens:
    d.update(parts=PARTS, part_settings=(("hidden_ratio", ratio), ("tokens", tokens)))
  return d


def resolve_epochs(config, steps_per_epoch: int):
  """config.finelip.ramp_steps = -1 (one epoch) as steps."""
  return one_epoch_as_steps(config, "finelip.ramp_steps", steps_per_epoch)


# FineLIP (Asokan et al. 2025): late interaction on aggregated tokens, and a hinge over all in-batch negatives.
LEAKY_SLOPE = 0.1


def late_interaction(img_r, txt_c, slope: float = LEAKY_SLOPE):
  """FineLIP's score of r images against c captions: img_r [r, Ti, E], txt_c [c, Tt, E], L2-normalised per token.

  For each pair the token similarities pass through LeakyReLU(slope); the text side is, per caption token, the max
  over image tokens averaged over caption tokens, the image side the max over caption tokens averaged over image
  tokens; the score is their sum (in [-2·slope, 2]). Returns [r, c] fp32 (the same score twice, for
  `pairwise_rows`)."""
  s = jax.nn.leaky_relu(losses.sims(img_r, txt_c, "ape,bqe->abpq"), slope)  # [r, c, Ti, Tt]
  score = jnp.mean(jnp.max(s, axis=2), axis=2) + jnp.mean(jnp.max(s, axis=3), axis=2)
  return score, score


def hinge_rows(img_agg_rows, txt_agg_all, row_offset, margin: float = 0.2, block: int = losses.TOKEN_BLOCK,
               hn_margin=None, cols_to_rows=lambda x: x):
  """Per-example FineLIP hinge for a block of rows: img_agg_rows [n, Ti, E] (rows `row_offset ..`), txt_agg_all
  [B, Tt, E]. With S the late-interaction scores (`late_interaction`):
    i2t[a] = Σ_{b≠a} max(0, margin + S[a, b] − S[a, a])     (image a against every other caption)
    t2i[a] = Σ_{b≠a} max(0, margin + S[b, a] − S[a, a])     (caption a against every other image)
  hn_margin: None, or (gamma, txt_emb_rows [n, D], txt_emb_all [B, D]): add HN-CLIP's γ·Ḡ to the negatives' scores.
  Returns (i2t [n], t2i [n]) fp32."""
  n, batch = img_agg_rows.shape[0], txt_agg_all.shape[0]
  # S and S^T rows
  rows, cols_t = losses.pairwise_rows(late_interaction, img_agg_rows, (txt_agg_all,), block, cols_to_rows)
  is_pos = losses.positives(n, batch, row_offset)
  extra = 0.0 if hn_margin is None else losses.margin_rows(hn_margin[1], hn_margin[2], hn_margin[0], is_pos)
  diag = jnp.sum(jnp.where(is_pos, rows, 0.0), axis=1, keepdims=True)  # S[a, a]
  cost = lambda s: jnp.sum(jnp.where(is_pos, 0.0, jax.nn.relu(margin + s + extra - diag)), axis=1)
  return cost(rows), cost(cols_t)


@dataclasses.dataclass(frozen=True)
class FineLIPTerm(Term):
  """w_f·ramp(step)·L_FineLIP: the hinge over every in-batch negative of the late-interaction scores of the
  aggregated tokens ("img_agg" [B, 1+K, E], "txt_agg" [B, K+1, E])."""
  weight: float = 1.0  # w_f
  margin: float = 0.2  # the hinge's margin
  reduction: str = "sum"  # "sum" over every violating pair (FineLIP) | "mean": divided by the batch size
  ramp_steps: int = 0  # w_f ramps linearly from 0 to 1 over these steps (0: no ramp)
  hn_margin: bool = False  # also add γ·Ḡ to the hinge's negatives
  token_layer: int = -1  # config.loss.token_layer: the block whose tokens the aggregators read
  token_image_cls: bool = False  # config.loss.token_image_cls
  names = ("fine",)

  def model_kwargs(self, objective, inputs=None) -> dict:
    del objective, inputs
    return {"token_layer": self.token_layer, "image_cls_token": self.token_image_cls}

  def outputs(self, model, out, inputs, rng=None, hidden=None) -> dict:
    return {"img_agg": aggregate_image(model, hidden["image_tokens"]),
            "txt_agg": aggregate_text(model, hidden["text_tokens"], inputs["tokens"])}

  def check(self, model_cfg, objective) -> None:
    if model_cfg.family != "clip":
      raise ValueError(f"config.framework='finelip' aggregates CLIP's tokens (the class token first, the text up to its "
                       f"end-of-text token); model.family={model_cfg.family!r} is not supported by it (use a CLIP "
                       "model, or the longclip framework)")
    if not has_aggregators(model_cfg):
      raise ValueError("config.framework='finelip' needs the model's token aggregators, but this model has none "
                       "(config.finelip.tokens=0?)")
    if self.reduction not in ("sum", "mean"):
      raise ValueError(f"config.finelip.reduction={self.reduction!r}; choose 'sum' (FineLIP) or 'mean'")

  def schedule(self, step):
    """The ramp at `step` (None: 1, the full weight)."""
    if step is None or not self.ramp_steps:
      return jnp.float32(1.0)
    return jnp.minimum(jnp.asarray(step, jnp.float32) / self.ramp_steps, 1.0)

  def __call__(self, out, ctx, ramp):
    margin = (ctx.gamma, out["txt"], ctx.txt_all) if self.hn_margin and losses.has_margin(ctx.gamma) else None
    fi2t, ft2i = hinge_rows(out["img_agg"], ctx.gather(out["txt_agg"]), ctx.offset, self.margin,
                                   block=ctx.chunk_size or losses.TOKEN_BLOCK, hn_margin=margin,
                                   cols_to_rows=ctx.cols_to_rows)
    norm = ctx.batch if self.reduction == "mean" else 1
    fine = ctx.psum(jnp.sum(fi2t) + jnp.sum(ft2i)) / norm
    weight = self.weight * ramp
    return [weight * fine], {"fine": fine}, [weight * (fi2t + ft2i) / norm]


def objective(config, obj):
  """config.finelip -> the objective's changes: FineLIP's hinge, and w_g (FineLIP's released code has no global
  term; the paper's swap adds L_HN with weight config.finelip.global_weight)."""
  f = config.finelip
  term = FineLIPTerm(weight=float(f.weight), margin=float(f.margin), reduction=str(f.reduction),
                     ramp_steps=max(int(f.ramp_steps), 0), hn_margin=bool(f.hn_margin),
                     token_layer=int(config.loss.token_layer), token_image_cls=bool(config.loss.token_image_cls))
  obj = obj.with_term(ContrastiveTerm, weight=float(f.global_weight))
  return obj.replace(terms=obj.terms + (term,))


# ---- eval.py --score=finelip ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FineLIPScore(Score):
  """FineLIP's inference score: (1 − w)·cosine of the global embeddings + w·late interaction of the aggregated
  tokens, w = config.finelip.score_weight, the tokens of block config.loss.token_layer as in training."""

  def check(self, model_cfg, where: str) -> None:
    if not has_aggregators(model_cfg):
      raise ValueError(f"--score=finelip needs FineLIP's token aggregators, but {where} was trained without them "
                       "(config.framework='finelip' adds them); use --score=cosine")

  def describe(self, config) -> str:
    w = float(config.finelip.score_weight)
    return f"{1 - w:g}·cosine + {w:g}·late interaction of the aggregated tokens (config.finelip.score_weight)"

  def encode_image(self, model, pixels, config):  # [B, H, W, 3] -> [B, 1+K, E]
    return aggregate_image(model, model.image_tower(pixels, int(config.loss.token_layer))[1])

  def encode_text(self, model, tokens, config):  # [B, L] -> [B, K+1, E]
    return aggregate_text(model, model.text_tower(tokens, int(config.loss.token_layer))[1], tokens)

  def scores(self, img, txt, img_x, txt_x, config):
    return finelip_scores(img, txt, img_x, txt_x, float(config.finelip.score_weight))


SCORES = {"finelip": FineLIPScore()}


@functools.partial(jax.jit, static_argnames=("weight",))
def _finelip_chunk(txt_c, txt_agg_c, img, img_agg, weight):
  return ((1.0 - weight) * losses.sims(txt_c, img, "cd,nd->cn") +
          weight * late_interaction(img_agg, txt_agg_c)[0].T)


def finelip_scores(img, txt, img_agg, txt_agg, weight: float = 0.2, chunk: int = 16) -> np.ndarray:
  """FineLIP's inference score [N_cap, N_img]: (1 − weight)·cosine of the global embeddings (img [N_img, D], txt
  [N_cap, D]) + weight·late interaction of the aggregated tokens (img_agg [N_img, Ti, E], txt_agg [N_cap, Tt, E];
  `late_interaction`); `chunk` captions at a time against every image ([chunk, N_img, Ti, Tt] alive)."""
  img, img_agg = jnp.asarray(img, jnp.float32), jnp.asarray(img_agg, jnp.float32)
  out = []
  for start in range(0, len(txt_agg), chunk):
    c, ca = (np.asarray(x[start:start + chunk], np.float32) for x in (txt, txt_agg))
    m = len(c)
    if m < chunk:
      c = np.concatenate([c, np.zeros((chunk - m, *c.shape[1:]), np.float32)])
      ca = np.concatenate([ca, np.zeros((chunk - m, *ca.shape[1:]), np.float32)])
    out.append(np.asarray(_finelip_chunk(jnp.asarray(c), jnp.asarray(ca), img, img_agg, float(weight)))[:m])
  return np.concatenate(out)
