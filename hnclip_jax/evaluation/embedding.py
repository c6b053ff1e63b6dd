"""Embedding for evaluation: the jitted encoders (plain, and a framework score's features) and the loop that embeds
every image and caption of a data set on a mesh (several processes included), then Recall@K."""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from hnclip_jax import sharding
from hnclip_jax.data import pipeline
from hnclip_jax.evaluation.retrieval import recall_at_k
from hnclip_jax.models import CLIPConfig, bind


class Encoders(NamedTuple):
  images: object  # jitted (params, images [B,H,W,3]) -> [B, E]
  texts: object  # jitted (params, tokens [B,L]) -> [B, E]


def make_embed_fn(graphdef, mesh, param_shardings) -> Encoders:
  """Jitted eval encoders, L2-normalised fp32 embeddings, batch-sharded: images and texts separately (an image
  with several captions is encoded once)."""
  batch_sh = sharding.batch_sharding(mesh)
  kw = dict(in_shardings=(param_shardings, batch_sh), out_shardings=batch_sh, compiler_options=sharding.compiler_options(mesh))
  return Encoders(images=jax.jit(lambda p, x: bind(graphdef, p).encode_image(x), **kw),
                  texts=jax.jit(lambda p, t: bind(graphdef, p).encode_text(t), **kw))


def make_score_embed_fn(graphdef, mesh, param_shardings, score, config) -> Encoders:
  """Jitted eval encoders of a framework score's per-example features (`frameworks.Score.encode_image` /
  `encode_text`), for eval.py --score=NAME."""
  batch_sh = sharding.batch_sharding(mesh)
  kw = dict(in_shardings=(param_shardings, batch_sh), out_shardings=batch_sh, compiler_options=sharding.compiler_options(mesh))
  return Encoders(images=jax.jit(lambda p, x: score.encode_image(bind(graphdef, p), x, config), **kw),
                  texts=jax.jit(lambda p, t: score.encode_text(bind(graphdef, p), t, config), **kw))


def _embed_rows(params, fn, batches, mesh, name: str, n: int) -> np.ndarray:
  """Runs `fn` over this process's rows of padded global batches; returns [n, ...] on every process, in row
  order. The rows' indices travel as a global array beside the inputs, so any layout of processes over the batch
  (`sharding.process_rows`) puts each embedding back in its place."""
  embs, rows = [], []
  for batch in batches:
    g = sharding.to_global({name: batch[name], "index": np.where(batch["mask"], batch["index"], -1)}, mesh)
    embs.append(multihost_utils.process_allgather(fn(params, g[name]), tiled=True))
    rows.append(multihost_utils.process_allgather(g["index"], tiled=True))
  emb, row = np.concatenate(embs), np.concatenate(rows)
  out = np.zeros((n, *emb.shape[1:]), emb.dtype)
  out[row[row >= 0]] = emb[row >= 0]
  return out


def embed_split(params, encoders, source, tokenizer, model_cfg: CLIPConfig, mesh, batch_size: int, captions=None):
  """Embeds every image of `source` and every caption -> (img [N_img, E], txt [N_cap, E], caption_image [N_cap])
  NumPy on every process. `captions`: each example's caption list (`pipeline.caption_lists`), read from `source`
  when not given (pass it from a source that skips image decoding to avoid decoding twice)."""
  sharding.check_batch_size(batch_size, mesh, "config.eval_batch_size")
  positions = sharding.process_rows(mesh, batch_size)
  captions = pipeline.caption_lists(source) if captions is None else captions
  if len(captions) != len(source):
    raise ValueError(f"embed_split: {len(captions)} caption lists for {len(source)} examples")
  flat = [c for caps in captions for c in caps]
  caption_image = np.repeat(np.arange(len(captions)), [len(c) for c in captions])
  img = _embed_rows(params, encoders.images, pipeline.eval_image_batches(
      source, image_size=model_cfg.image_size, batch_size=batch_size, positions=positions,
      family=model_cfg.family), mesh, "image", len(source))
  txt = _embed_rows(params, encoders.texts, pipeline.eval_text_batches(
      flat, tokenizer, batch_size=batch_size, positions=positions), mesh, "tokens", len(flat))
  return img, txt, caption_image


def embed_captions(params, encoders, captions: list, tokenizer, mesh, batch_size: int) -> np.ndarray:
  """Each example's captions -> [N, E]: the L2-normalised mean of its captions' embeddings (one caption: its own),
  NumPy on every process (the caption index of config.data.batching="clustered")."""
  sharding.check_batch_size(batch_size, mesh, "config.eval_batch_size")
  flat = [c for caps in captions for c in caps]
  owner = np.repeat(np.arange(len(captions)), [len(c) for c in captions])
  txt = _embed_rows(params, encoders.texts, pipeline.eval_text_batches(
      flat, tokenizer, batch_size=batch_size, positions=sharding.process_rows(mesh, batch_size)), mesh, "tokens",
      len(flat)).astype(np.float64)
  mean = np.zeros((len(captions), txt.shape[1]))
  np.add.at(mean, owner, txt)
  return (mean / np.linalg.norm(mean, axis=1, keepdims=True)).astype(np.float32)


def describe_counts(res) -> str:
  if res["num_images"] == res["num_captions"]:
    return f"{res['num_images']} pairs"
  return f"{res['num_images']} images, {res['num_captions']} captions"


def evaluate(params, encoders, source, tokenizer, model_cfg, mesh, batch_size: int, captions=None) -> dict:
  """Recall@1/5/10 both ways (COCO protocol when images have several captions) and what was counted."""
  return retrieval_result(*embed_split(params, encoders, source, tokenizer, model_cfg, mesh, batch_size, captions))


def retrieval_result(img, txt, caption_image) -> dict:
  out = recall_at_k(img, txt, caption_image=caption_image)
  out["num_images"], out["num_captions"] = int(img.shape[0]), int(txt.shape[0])
  out["num_pairs"] = out["num_captions"]  # one per image on the paper's benchmarks
  return out
