"""Benchmark 2: one full HN-CLIP train step in hnclip-jax vs the PyTorch stack users would otherwise use
(transformers.CLIPModel + torch.optim.AdamW, the same loss written in torch), same sizes, same batch, same
process, interleaved in alternating order; the speed-up is the median of the per-repetition ratios (min and
max reported too), after warm-up. CPU by default.

  python benchmarks/vs_pytorch.py [--sizes tiny,small] [--batch 64] [--reps 5] [--inner 3] [--json out.json]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # tcmalloc when installed (train.py: HNCLIP_TCMALLOC=1): hnclip_jax/hostmem.py
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")  # measured under tcmalloc when installed, as docs/benchmarks.md says

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.common import alternating_times, dump, make_step, table  # noqa: E402
from hnclip_jax import hostmem, sharding, train_step  # noqa: E402
from hnclip_jax.models import CLIPConfig, init_params  # noqa: E402

SIZES = {  # (width, layers, heads, mlp, image, patch, embed) for both towers
    "tiny": (128, 2, 4, 512, 64, 8, 64),
    "small": (256, 4, 4, 1024, 96, 16, 128),
    "vit_b16": (768, 12, 12, 3072, 224, 16, 512),
}


def torch_hn_loss(img, txt, scale, gamma):
  img = torch.nn.functional.normalize(img, dim=-1)
  txt = torch.nn.functional.normalize(txt, dim=-1)
  s = img @ txt.T
  g = (txt @ txt.T).detach()
  g = g * (1 - torch.eye(len(g)))
  logits = scale * (s + gamma * g)
  y = torch.arange(len(g))
  return 0.5 * (torch.nn.functional.cross_entropy(logits, y) + torch.nn.functional.cross_entropy(logits.T, y))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="tiny,small")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=77)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--inner", type=int, default=3, help="timed steps per repetition and library (median)")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--json", default="")
  a = p.parse_args()
  torch.set_num_threads(a.threads)
  rows = []
  for name in a.sizes.split(","):
    w, layers, heads, mlp, image, patch, embed = SIZES[name]
    vocab, b, ctx = 49408, a.batch, a.context
    hf = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=w, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=ctx, eos_token_id=vocab - 1),
        vision_config=dict(hidden_size=w, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                           image_size=image, patch_size=patch), projection_dim=embed))
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1)
    r = np.random.default_rng(0)
    pixels = r.normal(size=(b, image, image, 3)).astype(np.float32)
    ids = np.concatenate([np.full((b, 1), vocab - 2), r.integers(1, vocab - 2, (b, ctx - 2)), np.full((b, 1), vocab - 1)],
                         1)
    tp, ti = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(ids).long()

    def torch_step():
      opt.zero_grad(set_to_none=True)
      fi = hf.get_image_features(pixel_values=tp)
      ft = hf.get_text_features(input_ids=ti)
      fi, ft = getattr(fi, "pooler_output", fi), getattr(ft, "pooler_output", ft)
      loss = torch_hn_loss(fi, ft, hf.logit_scale.exp().clamp(max=100), 0.5)
      loss.backward()
      opt.step()

    cfg = CLIPConfig(embed_dim=embed, image_size=image, patch_size=patch, vision_width=w, vision_layers=layers,
                     vision_heads=heads, vision_mlp_dim=mlp, text_context=ctx, vocab_size=vocab, text_width=w,
                     text_layers=layers, text_heads=heads, text_mlp_dim=mlp, eot_token_id=vocab - 1)
    mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
    # torch.optim.AdamW's defaults, no clipping: the same update on both sides.
    step, tx, sh, _, _ = make_step(cfg, 0.5, mesh, dict(warmup_steps=0, b2=0.999, eps=1e-8, grad_clip_norm=0.0))
    _, params = init_params(cfg, 0)
    state = jax.jit(lambda: train_step.init_state(params, tx), out_shardings=sh)()
    batch = sharding.to_global({"image": pixels, "tokens": ids.astype(np.int32)}, mesh)
    holder = [state]

    def jax_step():
      holder[0], m = step(holder[0], batch)
      jax.block_until_ready(m["loss"])

    jax_step(), torch_step()  # warm-up (compiles)
    # Alternating order; the speed-up is the median of the per-repetition ratios. One untimed step after each
    # switch: the other library's worker threads may still be spinning on the cores (OpenMP's busy-wait after a
    # parallel region), which would be charged to whichever runs next.
    t = alternating_times({"jax": jax_step, "torch": torch_step}, a.reps, inner=a.inner, warmup=1)
    tj, tt = t["jax"], t["torch"]
    ratios = np.array(tt) / np.array(tj)
    rows.append({"size": name, "batch": b, "params_M": sum(x.numel() for x in hf.parameters()) / 1e6,
                 "jax_step_s": float(np.median(tj)), "torch_step_s": float(np.median(tt)),
                 "jax_speedup": float(np.median(ratios)), "speedup_min": float(ratios.min()),
                 "speedup_max": float(ratios.max())})
  print(f"HN-CLIP train step, JAX vs PyTorch (transformers {transformers.__version__}, torch {torch.__version__}), "
        f"CPU, {a.threads} threads, {hostmem.host_allocator()}")
  print(table(rows, list(rows[0])))
  dump(a.json, rows)


if __name__ == "__main__":
  main()
