"""Checks the FLOPs of compiled TPU rows (benchmarks/tpu_layouts.sh) against a count from the model's shapes.

  python benchmarks/tpu_flop_model.py --rows tpu_layouts.jsonl --hlo_dir tpu_hlo

F = one example's forward matmuls through both towers (2 x multiply-adds of the q/k/v/out and MLP projections per
token and layer, plus attention's two n x n x d products, plus the patch embedding). Per example, without the
token term, a step runs: 3 F without accumulation (the forward and the two backward matmuls of each), 4 F with it
(GradCache's extra no-gradient pass for the embeddings), plus R with config.remat=full (the backward recomputes
each block's forward except its last matmul, whose output it does not need). The token term adds
4 x 2 x rows x B x P x L x E (its similarities: forward, its own recompute, two backward matmuls; rows = captions per
chip, P = patch tokens, L = text positions, E = embedding width). Programs that do not fit also carry XLA's own
rematerialisation (compile_for.compiler_remat), which this model leaves out; it is subtracted before comparing.
"""
import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from configs.longclip_l import get_config  # noqa: E402
from hnclip_jax.losses import kept_tokens  # noqa: E402
from hnclip_jax import experiment  # noqa: E402
from hnclip_jax.tools import compile_for  # noqa: E402


def tower(tokens, width, layers, mlp, last_matmul=True):
  per_token = 2 * (4 * width * width + (2 if last_matmul else 1) * width * mlp) + 4 * tokens * width
  return tokens * layers * per_token


def costs(m):
  patches = (m.image_size // m.patch_size) ** 2
  fwd = (tower(patches + 1, m.vision_width, m.vision_layers, m.vision_mlp_dim)
         + 2 * patches * 3 * m.patch_size ** 2 * m.vision_width
         + tower(m.text_context, m.text_width, m.text_layers, m.text_mlp_dim))
  recompute = (tower(patches + 1, m.vision_width, m.vision_layers, m.vision_mlp_dim, last_matmul=False)
               + tower(m.text_context, m.text_width, m.text_layers, m.text_mlp_dim, last_matmul=False))
  return fwd, recompute, patches + 1


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", required=True, help="JSONL rows written by compile_for --sweep --out")
  p.add_argument("--hlo_dir", default="", help="the --hlo_dir of those rows: XLA's own remat for rows that predate its count")
  args = p.parse_args()
  config = get_config()  # the config tpu_layouts.sh compiles
  m = experiment.compile_model(config)
  fwd, recompute, patch_tokens = costs(m)
  print(f"F = {fwd / 1e9:.1f} GFLOP per example forward, R = {recompute / 1e9:.1f} GFLOP (remat=full's recompute)")
  print("| topology | mesh | batch | accum | remat | λ | TFLOP per chip | XLA remat | model | measured − XLA remat / model |")
  print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
  for line in open(args.rows):
    r = json.loads(line)
    if "TFLOP" not in r:
      continue
    chips = 1
    for d in r["layout"].split("x"):
      chips *= int(d)
    batch, accum = int(r["batch_size"]), int(r.get("grad_accum_steps", 1))
    rows = batch // chips
    model = rows * ((4 if accum > 1 else 3) * fwd + (recompute if r.get("remat", "none") == "full" else 0))
    if float(r.get("loss.token_weight", config.loss.token_weight)) > 0:
      # value + gradient ≈ 4× the forward 2·n·B·P·L·E; token_group G: G negatives instead of B; token_keep f: the
      # kept ⌈f·P⌉ patches and ⌈f·L⌉ caption slots (docs/objective.md)
      negatives = int(r.get("loss.token_group", config.loss.token_group)) or batch
      keep = float(r.get("loss.token_keep", config.loss.token_keep))
      model += 8 * rows * negatives * kept_tokens(keep, patch_tokens) * kept_tokens(keep, m.text_context) * m.embed_dim
    xla_remat = r.get("xla_remat_TFLOP", 0.0) * 1e12  # rows written since compile_for counts it
    if args.hlo_dir and r.get("hlo") and "xla_remat_TFLOP" not in r:
      with gzip.open(os.path.join(args.hlo_dir, r["hlo"]), "rt") as f:
        xla_remat = compile_for.compiler_remat(f.read())["matmul_flops"]
    measured = r["TFLOP"] * 1e12
    print(f"| {r.get('topology', '')} | {r['layout']} | {batch} | {accum} | {r.get('remat', 'none')} | {r.get('loss.token_weight', config.loss.token_weight)} | "
          f"{measured / 1e12:,.1f} | {xla_remat / 1e12:,.1f} | {model / 1e12:,.1f} | "
          f"{(measured - xla_remat) / model:.3f} |")


if __name__ == "__main__":
  main()
