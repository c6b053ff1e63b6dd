"""Set-up shared by train.py and eval.py: XLA cache, tokenizer, model config, checkpoint checks, eval."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from hnclip_jax import sharding
from hnclip_jax.data import builders, pipeline
from hnclip_jax.data.tokenizer import WordTokenizer, load_tokenizer
from hnclip_jax.evaluation import recall_at_k
from hnclip_jax.config import RUNTIME_FIELDS
from hnclip_jax.models import CLIPConfig


def enable_compilation_cache(cache_dir: str) -> None:
  """Persistent XLA cache: repeated runs skip recompiling the same programs."""
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def maybe_initialize_distributed() -> None:
  """Joins a multi-process job: from --coordinator_address/--num_processes/--process_id, the JAX_COORDINATOR_ADDRESS/
  JAX_NUM_PROCESSES/JAX_PROCESS_ID environment variables, or --distributed (cluster auto-detection on TPU pods/SLURM).
  """
  from absl import flags
  f = flags.FLAGS
  addr = f.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if addr:
    num = f.num_processes if f.num_processes is not None else int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    pid = f.process_id if f.process_id is not None else int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if num <= 0 or pid < 0:
      raise ValueError(f"coordinator address {addr} given, but not the process count and id: pass --num_processes "
                       "and --process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    jax.distributed.initialize(coordinator_address=addr, num_processes=num, process_id=pid)
  elif f.distributed:
    jax.distributed.initialize()


def tokenizer_dir(workdir: str) -> str:
  return os.path.join(workdir, "tokenizer")


MODEL_JSON = "model.json"


def runtime(cfg: CLIPConfig, config) -> CLIPConfig:
  """`cfg` with this run's compute settings (config.dtype, config.remat, config.attention)."""
  cfg = dataclasses.replace(cfg, **{k: config[k] for k in RUNTIME_FIELDS}).validate()
  if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(f"config.attention='cudnn' needs an NVIDIA GPU; this run's backend is "
                     f"{jax.default_backend()}. Use config.attention='auto'")
  return cfg


def resolve_model(config, workdir: str, *, training: bool):
  """The run's architecture and tokenizer -> (CLIPConfig, tokenizer, initial params or None).

  A workdir remembers both (model.json, tokenizer/) from its first start, so
  resuming and eval.py never need the original weights again. On a first start:
  with config.init_from, the architecture and tokenizer come from those weights
  (text positions are stretched if config.model.text_context asks for more, as
  Long-CLIP does; config.dtype, config.remat and config.attention apply); without it, from config.model and
  a tokenizer fitted on the training captions.
  """
  model_json = os.path.join(workdir, MODEL_JSON)
  if os.path.exists(model_json):
    with open(model_json) as f:
      cfg = CLIPConfig.from_dict(json.load(f))
    tok = load_tokenizer(tokenizer_dir(workdir))
    if not config.init_from:
      check_compatible({"model": dataclasses.asdict(cfg)}, model_config(config, tok), model_json)
    return runtime(cfg, config), tok, None
  if not training:
    raise FileNotFoundError(f"{model_json} is missing: {workdir} is not a train.py workdir (train first)")
  params = None
  if config.init_from:
    from hnclip_jax import pretrained
    pre = pretrained.load(config.init_from)
    if config.model.text_context > pre.config.text_context:
      pre = pre.with_text_context(config.model.text_context)
    pre = pre.with_token_projection(config.model.token_projection)
    if pre.tokenizer is None:
      raise FileNotFoundError(f"config.init_from={config.init_from} has no tokenizer files next to the weights "
                              "(vocab.json + merges.txt, tokenizer.json or bpe_simple_vocab_16e6.txt.gz)")
    cfg, tok, params = runtime(pre.config, config), pre.tokenizer, pre.params
  else:
    tok = get_tokenizer(config, workdir, fit_if_missing=True)
    cfg = model_config(config, tok)
  if jax.process_index() == 0:
    tok.save(tokenizer_dir(workdir))
    with open(model_json, "w") as f:
      json.dump({k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_FIELDS}, f, indent=2)
  return cfg, tok, params


def get_tokenizer(config, workdir: str, *, fit_if_missing: bool):
  """The workdir's tokenizer; when absent and `fit_if_missing`, fits one on the training captions and saves it."""
  path = tokenizer_dir(workdir)
  if os.path.exists(os.path.join(path, "tokenizer_meta.json")):
    tok = load_tokenizer(path)
  elif fit_if_missing:
    captions = pipeline.read_captions(builders.data_source(config.data, config.data.train_split, decode_images=False))
    tok = WordTokenizer.fit(captions, context_length=config.model.text_context)
    if jax.process_index() == 0:
      tok.save(path)
  else:
    raise FileNotFoundError(f"no tokenizer in {path}: run train.py with this --workdir first")
  if tok.context_length != config.model.text_context:
    raise ValueError(f"{path} was saved with context_length={tok.context_length} but "
                     f"config.model.text_context={config.model.text_context}; use the same text context")
  return tok


VOCAB_MULTIPLE = 128


def model_config(config, tokenizer) -> CLIPConfig:
  """config.model with the tokenizer's vocabulary filled in where it says 0 / -1."""
  d = dict(config.model)
  if d["vocab_size"] == 0:  # rounded up so the embedding splits over any tensor-parallel size
    d["vocab_size"] = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  if d["eot_token_id"] == -1:
    d["eot_token_id"] = tokenizer.eot_id
  if d["vocab_size"] < tokenizer.vocab_size:
    raise ValueError(f"config.model.vocab_size={d['vocab_size']} is smaller than the tokenizer's "
                     f"vocabulary ({tokenizer.vocab_size}); set it to 0 to take the tokenizer's size")
  return runtime(CLIPConfig.from_dict(d), config)


def check_compatible(meta: dict, model_cfg: CLIPConfig, where: str) -> None:
  """Raises if a checkpoint's model config differs from the one this run builds."""
  saved = meta.get("model")
  if saved is None:
    raise ValueError(f"{where} has no model config in its metadata; it was not written by hnclip_jax")
  mine = dataclasses.asdict(model_cfg)
  # A field the checkpoint predates has its default (e.g. token_projection, added after the first workdirs).
  saved = {**{f.name: f.default for f in dataclasses.fields(CLIPConfig)}, **saved}
  diffs = [f"model.{k}: checkpoint={saved.get(k)!r}, config={v!r}" for k, v in mine.items()
           if k not in RUNTIME_FIELDS and saved.get(k) != v]
  if diffs:
    raise ValueError(f"checkpoint {where} was written for a different model: " + "; ".join(diffs) +
                     ". Use the config it was trained with, or a fresh --workdir.")


def truncation_report(config, tokenizer) -> str:
  """How many training captions exceed the text context (they are truncated, keeping the end token)."""
  captions = pipeline.read_captions(builders.data_source(config.data, config.data.train_split, decode_images=False))
  long = sum(len(ids) + 2 > tokenizer.context_length for ids in tokenizer.encode_ids(captions))
  return (f"{long} of {len(captions)} training captions ({100 * long / max(len(captions), 1):.1f}%) are longer "
          f"than the {tokenizer.context_length}-token context and are truncated")


def embed_split(params, embed_fn, source, tokenizer, model_cfg: CLIPConfig, mesh, batch_size: int):
  """Embeds every pair of `source` -> (img [N, E], txt [N, E]) NumPy on every process, pairs aligned by row."""
  sharding.check_batch_size(batch_size, mesh, "config.eval_batch_size")
  local = batch_size // jax.process_count()
  imgs, txts, masks = [], [], []
  for batch in pipeline.eval_batches(source, tokenizer, image_size=model_cfg.image_size, batch_size=local,
                                     process_index=jax.process_index(), process_count=jax.process_count()):
    g = sharding.to_global({"image": batch["image"], "tokens": batch["tokens"]}, mesh)
    i, t = embed_fn(params, g["image"], g["tokens"])
    imgs.append(multihost_utils.process_allgather(i, tiled=True))
    txts.append(multihost_utils.process_allgather(t, tiled=True))
    masks.append(multihost_utils.process_allgather(batch["mask"], tiled=True))
  mask = np.concatenate(masks)
  return np.concatenate(imgs)[mask], np.concatenate(txts)[mask]


def evaluate(params, embed_fn, source, tokenizer, model_cfg, mesh, batch_size: int) -> dict:
  img, txt = embed_split(params, embed_fn, source, tokenizer, model_cfg, mesh, batch_size)
  out = recall_at_k(img, txt)
  out["num_pairs"] = int(img.shape[0])
  return out
