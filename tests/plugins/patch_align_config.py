"""configs/demo.py:test with the PatchAlign framework of patch_align.py (a config file of the user's own)."""
from configs.demo import get_config as demo_config
from hnclip_jax import frameworks


def get_config():
  c = demo_config("test")
  c.total_steps, c.log_every, c.checkpoint_every, c.eval_every = 4, 1, 2, 4
  c.optimizer.lr = 1e-3
  frameworks.use(c, "patch_align:PatchAlign")  # sets config.framework and adds config.patch_align
  c.patch_align.weight = 0.7
  return c
