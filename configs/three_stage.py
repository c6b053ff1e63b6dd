"""The paper's pipeline at small scale: CLIP -> Long-CLIP -> dense fine-tune (issue 31, docs/replication.md).

  python train.py --config configs/three_stage.py:pretrain --workdir /tmp/hnclip_3s_pretrain
  python train.py --config configs/three_stage.py:longclip --workdir /tmp/hnclip_3s_longclip
  python train.py --config configs/three_stage.py:finetune --workdir /tmp/hnclip_3s_finetune [--config.loss.gamma=0]

The paper's start is itself a fine-tune: OpenAI CLIP (short alt-text, logit scale at its clamp of 100), then
Long-CLIP (fine-tuned on ShareGPT4V's long captions, which are not the benchmarks'), then DOCCI / DCI at 2e-6. That
start is strong (it already retrieves most long captions, so InfoNCE's loss is ~0 on most examples) and crowded (its
text encoder sees the benchmark's near-duplicates as near-identical), and the small learning rate keeps it so.

1. `pretrain`: configs/two_stage.py:pretrain (short alt-text of independent scenes, 32 text positions, InfoNCE).
2. `longclip`: from stage 1, positions stretched 32 -> 68 (Long-CLIP's rule), InfoNCE on a second dense-caption
   set: other scenes and layouts (data seed 1) without near-duplicate groups, captioned in LONGCLIP_CAPTIONS, with
   the logit scale's learning rate raised (LOGIT_SCALE_LR: it climbs towards CLIP's clamp of 100 within ~100 steps,
   as CLIP's does over its far longer pre-training, and Long-CLIP inherits it); LONGCLIP_LR and LONGCLIP_STEPS
   small so that the text encoder stays as crowded as it can.
3. `finetune`: from stage 2 on the target (the dense near-duplicate set of configs/demo.py, groups of 4), at
   FINETUNE_LR for FINETUNE_STEPS (two epochs), small against stage 1's 1e-3 as the paper's 2e-6 is against
   CLIP's 5e-4.
docs/replication.md ("three-stage regime") says how the settings were chosen, which were tried and what the regime
measures: no setting reached both of issue 31's targets; this one makes plain InfoNCE saturate on ~30 % of the
target's examples from the first step (the crowding, mean G 0.14, is the part it misses; the "detailed" grammar
keeps 0.33 but saturates only ~21 %).
"""
import os

PRETRAIN_DIR, LONGCLIP_DIR = "/tmp/hnclip_3s_pretrain", "/tmp/hnclip_3s_longclip"
VARIANTS = ("pretrain", "longclip", "finetune")
LOGIT_SCALE_LR = (("^logit_scale$", 1500.0),)  # x LONGCLIP_LR: 0.15 per step on log s
# The settings tried (docs/replication.md, "three-stage regime"): 400 steps at 5e-4 (scale lr x30), 300 at 5e-4
# (x300), 200 at 1e-4 (x1500), each in the "detailed" grammar, and the last in the target's own ("dense") grammar
# (other scenes): the only one whose start saturates plain InfoNCE on >= 30 % of the target's examples.
LONGCLIP_STEPS, LONGCLIP_LR, LONGCLIP_CAPTIONS = 200, 1e-4, "dense"
FINETUNE_LR, FINETUNE_STEPS = 1e-5, 64


def get_config(variant: str = "finetune"):
  """variant: "pretrain", "longclip" or "finetune", optionally with ",test" (the smallest sizes; the tests)."""
  stage, *mods = variant.split(",")
  if stage not in VARIANTS or mods not in ([], ["test"]):
    raise ValueError(f"configs/three_stage.py has variants {list(VARIANTS)}, each optionally with ',test'; "
                     f"got {variant!r}")
  import runpy  # configs are files, not a package: stage 1 is configs/two_stage.py's pre-training
  two_stage = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_stage.py"))
  if stage == "pretrain":
    return two_stage["get_config"](",".join(["pretrain", *mods]))
  c = two_stage["get_config"](",".join(["finetune", *mods]))  # the target's data and the stretched context
  if stage == "longclip":
    c.init_from = PRETRAIN_DIR
    c.data.captions, c.data.group_size, c.data.seed = LONGCLIP_CAPTIONS, 1, 1
    if not mods:
      c.data.num_train = 16384
      c.total_steps, c.checkpoint_every, c.eval_every = LONGCLIP_STEPS, LONGCLIP_STEPS, LONGCLIP_STEPS
    c.optimizer.lr, c.optimizer.warmup_steps = LONGCLIP_LR, min(50, c.total_steps // 4)
    c.optimizer.lr_multipliers = LOGIT_SCALE_LR
    c.loss.gamma = 0.0  # Long-CLIP is trained with plain InfoNCE
  else:
    c.init_from = LONGCLIP_DIR
    c.optimizer.lr, c.optimizer.warmup_steps = FINETUNE_LR, 0
    if not mods:
      c.total_steps = c.checkpoint_every = c.eval_every = FINETUNE_STEPS
  return c
