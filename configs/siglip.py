"""HN-SigLIP: the paper's recipe with SigLIP's sigmoid loss, fine-tuning a SigLIP / SigLIP 2 checkpoint on dense
captions.

  python train.py --config configs/siglip.py:DATASET --config.init_from=/path/to/siglip-so400m-patch14-384 --workdir DIR
  python train.py --config configs/siglip.py:DATASET,b16 ...    # another size: b16 (224 px), b16_256, l16_256
  python train.py --config configs/siglip.py:DATASET,lora ...   # or dora: adapters, the backbone frozen

init_from: a transformers SiglipModel directory (config.json, model.safetensors and spiece.model or tokenizer.json;
SigLIP and fixed-resolution SigLIP 2 checkpoints). The architecture and vocabulary come from the weights; the size
variant only matters without init_from (compile_for, or training from scratch).

The global term is SigLIP's pairwise sigmoid loss with the margin on every negative's logit (config.loss.kind =
"sigmoid", docs/objective.md), chunked around the mesh as big_vision does (loss.sigmoid_schedule="ring"). SigLIP's
64-token text context is stretched to 196 as Long-CLIP stretches CLIP's 77 to 248 (the first 20 positions kept,
the rest interpolated 4x; `python -m hnclip_jax.data.inspect` shows how many captions are still truncated). The rest
is the paper's recipe (configs/longclip_l.py): AdamW lr 2e-6 with cosine decay, weight decay 0.05, no warmup, an
effective batch of 128 (8 micro-batches of 16, Ḡ over all 128), γ = 0.5 (the paper's; in the small-scale
replication γ = 0.5 lowered SigLIP's R@1 by ~13 points against γ = 0, docs/replication.md "HN-SigLIP": compare
with --config.loss.gamma=0 on your data), 10 epochs. The FILIP token term is off
(λ = 0): the paper defines it for CLIP's softmax; set config.loss.token_weight to add it.
"""
from hnclip_jax.config import base_config, model_config

TRAIN_PAIRS = {"docci": 9450, "dci": 5445, "long_dci": 5445, "urban1k": 14579, "synthetic": 4096}
SIZES = {"so400m": ("siglip_so400m14_384", 384), "b16": ("siglip_b16_224", 224), "b16_256": ("siglip_b16_256", 256),
         "l16_256": ("siglip_l16_256", 256)}
METHODS = ("full", "lora", "dora")
CONTEXT = 20 + 4 * (64 - 20)  # 196: SigLIP's 64 positions stretched as Long-CLIP stretches CLIP's 77


def get_config(variant: str = "synthetic"):
  """variant: a dataset, a size, a fine-tuning method, comma-separated ("docci", "docci,b16", "docci,lora")."""
  parts = [p for p in variant.split(",") if p]
  unknown = [p for p in parts if p not in TRAIN_PAIRS and p not in SIZES and p not in METHODS]
  if unknown:
    raise ValueError(f"configs/siglip.py: unknown variant {unknown[0]!r}; datasets: {sorted(TRAIN_PAIRS)}, sizes: "
                     f"{sorted(SIZES)}, methods: {list(METHODS)} (e.g. ':docci,b16')")
  dataset = next((p for p in parts if p in TRAIN_PAIRS), "synthetic")
  preset, image_size = SIZES[next((p for p in parts if p in SIZES), "so400m")]
  method = next((p for p in parts if p in METHODS), "full")
  c = base_config()
  c.model = model_config(preset, text_context=CONTEXT)
  c.data.name = dataset
  c.data.image_size = image_size
  c.seed = 42
  c.batch_size = 128
  c.grad_accum_steps = 8
  c.loss.kind = "sigmoid"
  c.loss.gamma = 0.5
  c.optimizer.lr = 2e-6
  c.optimizer.weight_decay = 0.05
  c.optimizer.warmup_steps = 0
  c.total_steps = 10 * TRAIN_PAIRS[dataset] // c.batch_size
  c.log_every = 10
  c.checkpoint_every = c.eval_every = max(1, c.total_steps // 10)
  c.eval_batch_size = 256
  if method != "full":  # as configs/longclip_l.py's PEFT variants: rank 16, the backbone, t and b frozen, lr 5e-5
    c.finetune.method, c.finetune.rank, c.finetune.alpha = method, 16, 16.0
    c.optimizer.lr = 5e-5
    c.optimizer.train_logit_scale = False
    if method == "dora":
      c.finetune.dora_detach_norm = True
  return c
