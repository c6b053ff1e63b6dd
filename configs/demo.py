"""CPU demo: a tiny CLIP trained with HN-CLIP on the built-in synthetic near-duplicate scenes.

  python train.py --config configs/demo.py --workdir /tmp/hnclip_demo      # ~5 min on 2 CPU cores
  python train.py --config configs/demo.py:test --workdir /tmp/t           # seconds; used by the tests
"""
from hnclip_jax.config import base_config, model_config


def get_config(variant: str = "default"):
  c = base_config()
  c.batch_size = 128
  c.total_steps = 300
  c.log_every = 25
  c.checkpoint_every = 100
  c.eval_every = 100
  c.optimizer.lr = 1e-3
  c.optimizer.warmup_steps = 30
  c.loss.gamma = 0.5
  if variant == "test":  # the smallest thing that exercises every code path
    c.model = model_config("tiny", vocab_size=0, eot_token_id=-1, embed_dim=32, image_size=32, vision_width=32,
                           vision_layers=1, vision_heads=2, vision_mlp_dim=64, text_width=32, text_layers=1,
                           text_heads=2, text_mlp_dim=64)
    c.data.num_train, c.data.num_test, c.data.image_size = 128, 40, 32
    c.batch_size, c.eval_batch_size = 16, 16
    c.total_steps, c.log_every, c.checkpoint_every, c.eval_every = 6, 2, 3, 3
    c.optimizer.warmup_steps = 2
  elif variant != "default":
    raise ValueError(f"configs/demo.py has variants 'default' and 'test', got {variant!r}")
  return c
