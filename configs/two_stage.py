"""The paper's regime at small scale: pre-train on short captions, then fine-tune on dense near-duplicates.

  python train.py --config configs/two_stage.py:pretrain --workdir /tmp/hnclip_pretrain
  python -m hnclip_jax.tools.caption_geometry --config configs/two_stage.py:finetune \\
      --checkpoint /tmp/hnclip_pretrain        # before fine-tuning: how crowded the dense captions look
  python train.py --config configs/two_stage.py:finetune --workdir /tmp/hnclip_finetune \\
      [--config.init_from=/tmp/hnclip_pretrain] [--config.loss.gamma=0]

CLIP was pre-trained on short web alt-text and is fine-tuned on dense captions whose near-duplicates share
everything a short caption would say, so its text encoder sees them as crowded (mean off-diagonal text similarity
0.84-0.88 for Long-CLIP-L on the paper's benchmarks). Stage 1 here trains the demo's tiny CLIP (configs/demo.py)
with plain InfoNCE on 16,384 independent synthetic scenes captioned like alt-text (one or two salient objects,
several phrasings: `data.captions="short"`, `synthetic.short_caption`), 32 text positions. Stage 2 starts from it,
stretches the text positions to 68 the way Long-CLIP stretches 77 to 248 (keep 20, x4), and fine-tunes on the
dense near-duplicate set of configs/demo.py. docs/replication.md has the measurements.
"""
from hnclip_jax.config import base_config, model_config

PRETRAIN_DIR = "/tmp/hnclip_pretrain"
VARIANTS = ("pretrain", "finetune")


def get_config(variant: str = "finetune"):
  """variant: "pretrain" or "finetune", optionally with ",test" (the smallest sizes; used by the tests)."""
  stage, *mods = variant.split(",")
  if stage not in VARIANTS or mods not in ([], ["test"]):
    raise ValueError(f"configs/two_stage.py has variants {list(VARIANTS)}, each optionally with ',test'; "
                     f"got {variant!r}")
  variant = stage
  c = base_config()
  c.model = model_config("tiny", vocab_size=0, eot_token_id=-1)
  c.batch_size = 128
  c.log_every = 25
  if variant == "pretrain":
    c.model.text_context = 32
    c.data.captions, c.data.group_size, c.data.num_train, c.data.num_test = "short", 1, 16384, 512
    c.total_steps = 600
    c.checkpoint_every = c.eval_every = 200
    c.optimizer.lr, c.optimizer.warmup_steps = 1e-3, 50
    c.loss.gamma = 0.0  # plain CLIP pre-training
  else:
    c.init_from = PRETRAIN_DIR
    c.model.text_context = 68  # 20 + 4 x (32 - 20): Long-CLIP's stretch of the pre-trained positions
    c.total_steps = 100
    c.checkpoint_every = c.eval_every = 50
    c.optimizer.lr, c.optimizer.warmup_steps = 2e-4, 0
    c.loss.gamma = 0.5
  if mods:  # seconds-scale: configs/demo.py:test's model and sizes
    c.model.update(dict(embed_dim=32, image_size=32, vision_width=32, vision_layers=1, vision_heads=2,
                        vision_mlp_dim=64, text_width=32, text_layers=1, text_heads=2, text_mlp_dim=64))
    c.data.num_train, c.data.num_test, c.data.image_size = 128, 40, 32
    c.batch_size = c.eval_batch_size = 16
    c.total_steps, c.log_every, c.checkpoint_every, c.eval_every = 4, 1, 4, 4
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, 1)
  return c
