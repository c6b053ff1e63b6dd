"""Pretrained CLIP / Long-CLIP weights: `load(path)` for Hugging Face directories, OpenAI-format `.pt` files,
converted directories (`python -m hnclip_jax.pretrained.convert`) and train.py workdirs."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from hnclip_jax import frameworks, paths, workdir as workdir_format
from hnclip_jax.data import pipeline
from hnclip_jax.models import CLIPConfig, abstract_model, adapters, bind, family
from hnclip_jax.pretrained import weights
from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
from hnclip_jax.data.tokenizer import WordTokenizer
from hnclip_jax.pretrained.weights import stretch_positions

__all__ = ["Pretrained", "load", "stretch_positions", "CLIPTokenizer"]


@dataclasses.dataclass
class Pretrained:
  """A CLIP model with its tokenizer and preprocessing. All encoders return L2-normalised NumPy [N, E]."""
  config: CLIPConfig
  params: dict
  tokenizer: object | None
  source: str

  def __post_init__(self):
    self.graphdef, abstract = abstract_model(self.config)
    weights.check_shapes(self.params, abstract, self.source)
    tok = self.tokenizer
    if tok is not None and (tok.vocab_size > self.config.vocab_size or tok.eot_id != self.config.eot_token_id):
      raise ValueError(f"{self.source}: the tokenizer files ({tok.vocab_size} tokens, end token {tok.eot_id}) do not "
                       f"match the weights ({self.config.vocab_size} embeddings, end token "
                       f"{self.config.eot_token_id}); use the vocabulary the model was trained with")
    self.params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), self.params)
    self._img = jax.jit(lambda p, x: bind(self.graphdef, p).encode_image(x))
    self._txt = jax.jit(lambda p, t: bind(self.graphdef, p).encode_text(t))

  def tokenize(self, texts) -> np.ndarray:
    """list[str] -> int32 [N, text_context]."""
    if self.tokenizer is None:
      raise FileNotFoundError(f"{self.source} came without tokenizer files (vocab.json + merges.txt, tokenizer.json "
                              "or bpe_simple_vocab_16e6.txt.gz); put them next to the weights")
    return self.tokenizer(list(texts))

  def preprocess(self, images) -> np.ndarray:
    """PIL images or uint8 [H, W, 3] arrays -> float32 [N, image_size, image_size, 3] (the family's preprocessing:
    CLIP's or SigLIP's)."""
    return np.stack([pipeline.clip_preprocess(im, self.config.image_size, self.config.family) for im in images])

  batch_size: int = 64  # encoders run in batches of this size (the last one padded): one compile, bounded memory

  def _batched(self, fn, x: np.ndarray) -> np.ndarray:
    n, b = len(x), self.batch_size
    out = []
    for i in range(0, max(n, 1), b):
      chunk = x[i:i + b]
      pad = b - len(chunk)
      if pad:
        chunk = np.concatenate([chunk, np.zeros((pad, *x.shape[1:]), x.dtype)])
      out.append(np.asarray(fn(self.params, chunk))[:b - pad])
    return np.concatenate(out)[:n]

  def encode_pixels(self, pixels) -> np.ndarray:
    return self._batched(self._img, np.asarray(pixels, np.float32))

  def encode_tokens(self, tokens) -> np.ndarray:
    return self._batched(self._txt, np.asarray(tokens, np.int32))

  def encode_images(self, images) -> np.ndarray:
    return self.encode_pixels(self.preprocess(images))

  def encode_texts(self, texts) -> np.ndarray:
    return self.encode_tokens(self.tokenize(texts))

  def with_text_context(self, context: int) -> "Pretrained":
    """The same model with `context` text positions: Long-CLIP stretching when growing 77 -> 248."""
    old = self.config.text_context
    if context == old:
      return self
    expected = 20 + 4 * (old - 20)
    if context != expected:
      raise ValueError(f"text context {old} can only be stretched to {expected} (Long-CLIP: keep 20, ×4); "
                       f"asked for {context}")
    params = dict(self.params, text_positions=stretch_positions(np.asarray(self.params["text_positions"])))
    tok = self.tokenizer.with_context(context) if self.tokenizer is not None else None
    return Pretrained(dataclasses.replace(self.config, text_context=context), params, tok, self.source)

  def with_token_projection(self, kind: str) -> "Pretrained":
    """The same model with config.model.token_projection = `kind`; "separate" starts the token projections as
    copies of the towers' projections (so the token features are unchanged at the start)."""
    if kind == self.config.token_projection:
      return self
    if kind != "separate":
      raise ValueError(f"{self.source} has separate token projections; config.model.token_projection={kind!r} would "
                       "drop them. Use config.model.token_projection='separate'")
    params = dict(self.params, visual_token_projection=np.array(self.params["visual_projection"]),
                  text_token_projection=np.array(self.params["text_projection"]))
    return Pretrained(dataclasses.replace(self.config, token_projection=kind), params, self.tokenizer, self.source)

  def merged(self) -> "Pretrained":
    """The same model with its LoRA / DoRA adapters folded into plain weights (itself when it has none)."""
    if self.config.adapter == "none":
      return self
    cfg, params = adapters.merge_adapters(self.params, self.config)
    return Pretrained(cfg, jax.device_get(params), self.tokenizer, self.source + " (adapters merged)")

  def save(self, out_dir: str) -> None:
    """Writes an Orbax checkpoint of the parameters, model.json and the tokenizer: loadable without PyTorch."""
    import orbax.checkpoint as ocp
    out_dir = paths.resolve(out_dir, "output directory")
    paths.makedirs(out_dir)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(paths.join(out_dir, workdir_format.PARAMS), self.params, force=True)
    workdir_format.write_model(out_dir, self.config)
    if self.tokenizer is not None:
      workdir_format.write_tokenizer(out_dir, self.tokenizer)


def tokenizer_near(directory: str, context: int):
  """CLIP's BPE from the files next to the weights, or the word-level tokenizer.json an export of a model trained
  from scratch here writes."""
  tj = os.path.join(directory, "tokenizer.json")
  if os.path.exists(tj) and not os.path.exists(os.path.join(directory, "vocab.json")):
    with open(tj, encoding="utf-8") as f:
      kind = json.load(f).get("model", {}).get("type")
    if kind == "WordLevel":
      return WordTokenizer(tokenizers.Tokenizer.from_file(tj), context)
  try:
    return CLIPTokenizer.from_directory(directory, context)
  except FileNotFoundError:
    return None


def _load_converted(path: str) -> Pretrained:
  import orbax.checkpoint as ocp
  cfg = workdir_format.read_model(path)
  _, abstract = abstract_model(cfg)
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(paths.join(path, workdir_format.PARAMS), abstract)
  return Pretrained(cfg, params, workdir_format.read_tokenizer(path, required=False), path)


def _load_workdir(path: str, step: int | None = None) -> Pretrained:
  wd = workdir_format.Workdir(path)
  steps = wd.checkpoint_steps()
  if not steps:
    raise FileNotFoundError(f"{path} looks like a train.py workdir but has no checkpoint yet")
  if step is not None and step not in steps:
    raise ValueError(f"{path}: no checkpoint of step {step}; available steps: {steps}")
  ckpt = wd.checkpointer(read_only=True)
  step = steps[-1] if step is None else step
  meta = ckpt.read_meta(step)
  cfg = CLIPConfig.from_dict(frameworks.upgrade_model_dict(meta["model"])).validate()
  _, abstract = abstract_model(cfg)
  params = ckpt.restore_params(step, jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
      abstract))
  ckpt.close()
  return Pretrained(cfg, jax.device_get(params), wd.tokenizer(), f"{path} (step {step})")


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin")


def check_source(path: str, what: str = "path") -> None:
  """Cheap check (nothing is read) that `path` is something `load` reads; raises naming `what` and the fix."""
  full = paths.resolve(path, what)
  if not paths.exists(full):
    raise FileNotFoundError(f"{what}={path!r}: {full} does not exist; expected a Hugging Face CLIP directory, an "
                            "OpenAI-format .pt file, a converted directory or a train.py workdir")
  if paths.isdir(full):
    if workdir_format.is_converted(full) or paths.exists(paths.join(full, "config.json")):
      return
    if workdir_format.is_workdir(full):
      if not workdir_format.Workdir(full).checkpoint_steps():
        raise FileNotFoundError(f"{what}={path!r} is a train.py workdir without any checkpoint yet")
      return
    raise FileNotFoundError(f"{what}={path!r}: no config.json (Hugging Face), model.json + params/ (converted) or "
                            "checkpoints/ (train.py workdir) inside")
  if not full.endswith(WEIGHT_SUFFIXES):
    raise ValueError(f"{what}={path!r} is a file but not an OpenAI-format checkpoint ({', '.join(WEIGHT_SUFFIXES)}); "
                     "for Hugging Face weights pass their directory")




def load(path: str, step: int | str | None = None) -> Pretrained:
  """Loads CLIP weights from any supported source (see the module docstring); the architecture is inferred.
  `step`: which checkpoint of a train.py workdir (default: the newest; "best": the best step an `eval.py --watch`
  job kept in WORKDIR/best); only for workdirs."""
  path = paths.resolve(path, "path")
  if step == "best":
    best = workdir_format.Workdir(path).best
    if not workdir_format.is_converted(best):
      raise FileNotFoundError(f"{path} has no best checkpoint ({best} is missing): `eval.py --watch` keeps the best "
                              "evaluated step there; pass a step number instead, or run it")
    return _load_converted(best)
  check_source(path)
  if step is not None and not (paths.isdir(path) and workdir_format.is_workdir(path)):
    raise ValueError(f"step={step} was given, but {path} is not a train.py workdir (only workdirs have steps)")
  if paths.isdir(path):
    if workdir_format.is_converted(path):
      return _load_converted(path)
    if workdir_format.is_workdir(path):
      return _load_workdir(path, step)
    if not paths.opens_natively(path):  # PyTorch / safetensors files and tokenizers: read from a local copy
      with paths.local_copy(path) as local:
        got = load(local)
      return Pretrained(got.config, got.params, got.tokenizer, path)
    cfg, params = weights.read_hf_directory(path)
    return Pretrained(cfg, params, family.hf(cfg.family).tokenizer(path, cfg.text_context), path)
  if not paths.opens_natively(path):  # an OpenAI .pt file (and a tokenizer beside it): from a local copy
    with paths.local_copy(paths.dirname(path)) as local:
      got = load(os.path.join(local, paths.basename(path)))
    return Pretrained(got.config, got.params, got.tokenizer, path)
  cfg, params = weights.read_openai_file(path)
  return Pretrained(cfg, params, tokenizer_near(os.path.dirname(path), cfg.text_context), path)
