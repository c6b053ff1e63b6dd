"""The paper's recipe: HN-CLIP fine-tuning of Long-CLIP-L.

  python train.py --config configs/longclip_l.py:DATASET --config.init_from=/path/to/longclip-L.pt --workdir DIR
  python train.py --config configs/longclip_l.py:DATASET,lora ...     # or ,dora: the paper's PEFT variants
  python train.py --config configs/longclip_l.py:DATASET,finelip ...  # a plug-in framework (docs/frameworks.md)
  python train.py --config configs/longclip_l.py:DATASET,goal ...     # (needs segments in the data)
  python train.py --config configs/longclip_l.py:DATASET,structxlip ...  # (segments; edge maps made on the fly)

LoRA / DoRA variants (paper): rank 16 adapters on every attention projection and MLP layer of both towers, the
backbone frozen, lr 5e-5 (alpha = rank, i.e. scale 1: the paper does not give alpha).

Long-CLIP-L (ViT-L/14, 224 px, 248 text tokens; a 77-token CLIP is stretched as Long-CLIP does), AdamW lr 2e-6
with cosine decay, effective batch 128 = 8 micro-batches of 16 accumulated inside the step, 10 epochs, γ = 0.5, and
the full objective L_HN + λ·L_tok with the FILIP token term at λ = 1 (paper Eq. 3; its open choices are the
defaults of config.loss, explained in docs/objective.md).
Choices the paper leaves open, taken from the published baseline code for the same setting: weight decay 0.05,
no warmup. Ḡ spans the whole effective batch of 128 (config.loss.negatives="global_batch"; set "micro_batch" for
16). Seed 42 (the paper also reports 43).
"""
from hnclip_jax.config import base_config, model_config
from hnclip_jax.frameworks import REGISTRY

# Training-split sizes (pairs), for 10 epochs of steps.
TRAIN_PAIRS = {"docci": 9450, "dci": 5445, "long_dci": 5445, "urban1k": 14579, "synthetic": 4096}


BENCHMARKS = ("docci", "dci", "long_dci", "urban1k")  # the paper's four (Table 1)
METHODS = ("full", "lora", "dora")
FRAMEWORKS = tuple(REGISTRY)  # the built-in frameworks; a recipe for each below (one from outside: --config.framework)


def get_config(variant: str = "synthetic"):
  """variant: a dataset, a fine-tuning method, or both, comma-separated ("docci", "lora", "docci,dora")."""
  parts = [p for p in variant.split(",") if p]
  dataset = next((p for p in parts if p in TRAIN_PAIRS), "synthetic")
  method = next((p for p in parts if p in METHODS), "full")
  framework = next((p for p in parts if p in FRAMEWORKS), "longclip")
  unknown = [p for p in parts if p not in TRAIN_PAIRS and p not in METHODS and p not in FRAMEWORKS]
  if unknown:
    raise ValueError(f"configs/longclip_l.py: unknown variant {unknown[0]!r}; datasets: {sorted(TRAIN_PAIRS)}, "
                     f"methods: {list(METHODS)}, frameworks: {list(FRAMEWORKS)} (e.g. ':docci,lora', "
                     "':docci,finelip')")
  c = base_config()
  # With config.init_from (the paper's setting) the vocabulary comes from the weights (CLIP's BPE); without it (the
  # built-in data, from scratch) from the tokenizer fitted on the captions: vocab_size 0 / eot_token_id -1.
  c.model = model_config("vit_l14", text_context=248, vocab_size=0, eot_token_id=-1)
  c.data.name = dataset
  c.data.image_size = 224
  c.seed = 42
  c.batch_size = 128
  c.grad_accum_steps = 8
  c.loss.gamma = 0.5
  c.loss.negatives = "global_batch"
  c.loss.token_weight = 1.0
  c.optimizer.lr = 2e-6
  c.optimizer.weight_decay = 0.05
  c.optimizer.warmup_steps = 0
  c.total_steps = 10 * TRAIN_PAIRS[dataset] // c.batch_size
  c.log_every = 10
  c.checkpoint_every = max(1, c.total_steps // 10)
  c.eval_every = max(1, c.total_steps // 10)
  c.eval_batch_size = 256
  # The paper's Table 1 in one eval job: python eval.py --config configs/longclip_l.py:DATASET --workdir DIR
  # --benchmarks=all --config.eval.data_root=ROOT, with ROOT/docci, ROOT/dci, ROOT/long_dci, ROOT/urban1k laid out
  # as each builder's instructions say (hnclip_jax/data/manual.py; Long-DCI's dci_long.csv names the DCI photos
  # relative to its folder). Test splits; best checkpoint by R@1 averaged over the four and both directions.
  for name in BENCHMARKS:
    c.eval.benchmarks[name] = {"manual_dir": name, "split": "test"}
  c.eval.best_metric = "average/R@1"
  if method != "full":  # the paper's parameter-efficient runs: rank 16, backbone frozen, lr 5e-5
    c.finetune.method, c.finetune.rank, c.finetune.alpha = method, 16, 16.0
    c.optimizer.lr = 5e-5
    # PEFT's LoRA / DoRA train the adapters only: CLIP's logit scale stays at the start's (docs/frameworks.md).
    c.optimizer.train_logit_scale = False
    if method == "dora":  # DoRA as its authors (§4.3) and PEFT run it: the column norm detached in the backward
      c.finetune.dora_detach_norm = True
  if framework == "finelip":
    # FineLIP's released recipe (ffa-ti-ma/FineLIP train/arguments.py): backbone lr 1e-6, the aggregation modules
    # 2e-4 (x200), weight decay 0.01, 200 warmup steps, 6 epochs; its hinge instead of the token term, with L_HN as
    # the global term (config.finelip.global_weight = 1; docs/frameworks.md).
    if method != "full":
      raise ValueError("configs/longclip_l.py: finelip fine-tunes the whole model; it has no lora/dora variant")
    c.framework = "finelip"
    c.loss.token_weight = 0.0
    c.optimizer.lr = 1e-6
    c.optimizer.lr_multipliers = ((r"^(image|text)_aggregator/", 200.0),)
    c.optimizer.weight_decay = 0.01
    c.optimizer.warmup_steps = 200
    c.total_steps = 6 * TRAIN_PAIRS[dataset] // c.batch_size
    c.checkpoint_every = c.eval_every = max(1, c.total_steps // 6)
  if framework in ("goal", "structxlip"):
    # Both released recipes (PerceptualAI-Lab/GOAL goal_loss_finetuning.py; intelligolabs/StructXLIP
    # scripts/finetune.sh, DOCCI): batch 16, AdamW lr 5e-6 with cosine decay to 0 and no warmup, weight decay 0.05,
    # 10 epochs; the framework's terms instead of the token term, with L_HN as the global term. Both need segments
    # in the data (docs/frameworks.md).
    if method != "full":
      raise ValueError(f"configs/longclip_l.py: {framework} fine-tunes the whole model; it has no lora/dora variant")
    c.framework = framework
    c.loss.token_weight = 0.0
    c.batch_size, c.grad_accum_steps = 16, 1
    c.optimizer.lr = 5e-6
    c.total_steps = 10 * TRAIN_PAIRS[dataset] // c.batch_size
    c.checkpoint_every = c.eval_every = max(1, c.total_steps // 10)
  if framework == "structxlip":
    # The run script's weights: structure / consistency / local 0.25 / 0.001 / 0.001, the 2 best segments' edge
    # crops, colour words removed, the logit scale clamped at 3.5 (the config.structxlip defaults are its train.py's
    # argument defaults instead: 0.5 / 0.05 / 0.1, 3 crops).
    c.structxlip.structure_weight, c.structxlip.consistency_weight, c.structxlip.local_weight = 0.25, 0.001, 0.001
    c.structxlip.top_k = 2
  return c
