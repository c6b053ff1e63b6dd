"""configs/demo.py:test with the PatchAlign framework of patch_align.py (a config file of the user's own)."""
from hnclip_jax import frameworks
from hnclip_jax.config import base_config, model_config


def get_config():
  c = base_config()
  c.model = model_config("tiny", vocab_size=0, eot_token_id=-1, embed_dim=32, image_size=32, vision_width=32,
                         vision_layers=1, vision_heads=2, vision_mlp_dim=64, text_width=32, text_layers=1,
                         text_heads=2, text_mlp_dim=64)
  c.data.num_train, c.data.num_test, c.data.image_size = 128, 40, 32
  c.batch_size, c.eval_batch_size = 16, 16
  c.total_steps, c.log_every, c.checkpoint_every, c.eval_every = 4, 1, 2, 4
  c.optimizer.lr, c.optimizer.warmup_steps = 1e-3, 2
  frameworks.use(c, "patch_align:PatchAlign")  # sets config.framework and adds config.patch_align
  c.patch_align.weight = 0.7
  return c
