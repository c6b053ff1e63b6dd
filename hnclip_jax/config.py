"""The base experiment config and its validation. Config files in configs/ start from `base_config()`."""
from __future__ import annotations

import dataclasses
import difflib

import ml_collections

from hnclip_jax import frameworks, sharding
from hnclip_jax.models import PRESETS


# How to compute, not what to compute: set at the top level (config.dtype, config.remat, config.attention), not
# stored with a checkpoint's model, and free to change between runs of the same workdir.
RUNTIME_FIELDS = ("dtype", "remat", "attention")
# CLIPConfig fields set from config.finetune (not config.model); the dropout rate is a run setting, not architecture.
ADAPTER_FIELDS = ("adapter", "adapter_rank", "adapter_alpha", "adapter_targets", "adapter_dropout",
                  "adapter_detach_norm")
# CLIPConfig fields set from config.framework and its block (a framework's own modules: hnclip_jax/frameworks).
FRAMEWORK_FIELDS = ("parts", "part_settings")
# Not in model.json, not compared on resume: how adapters train, not what they are.
MODEL_RUNTIME_FIELDS = RUNTIME_FIELDS + ("adapter_dropout", "adapter_detach_norm")


def model_config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """A named architecture as a ConfigDict (fields of `CLIPConfig`); `vocab_size=0`/`eot_token_id=-1` mean: from the tokenizer."""
  if preset not in PRESETS:
    raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
  skip = RUNTIME_FIELDS + ADAPTER_FIELDS + FRAMEWORK_FIELDS
  d = {k: v for k, v in dataclasses.asdict(PRESETS[preset]).items() if k not in skip}
  unknown = set(overrides) - set(d)
  if unknown:
    raise ValueError(f"unknown model field(s) {sorted(unknown)}; known: {sorted(d)}")
  d.update(overrides)
  return ml_collections.ConfigDict(d)


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.batch_size = 128  # global, over all devices and processes
  c.total_steps = 1000
  c.log_every = 50
  c.checkpoint_every = 500
  c.eval_every = 500
  c.max_to_keep = 3
  c.eval_batch_size = 256
  c.workers = 0  # grain worker processes (0: threads in the main process)
  # the persistent XLA cache ("" disables it); JAX's own JAX_COMPILATION_CACHE_DIR, when set, wins
  c.compilation_cache_dir = "~/.cache/hnclip_jax/xla"
  c.dtype = "float32"  # compute dtype of the towers ("bfloat16": bf16 matmuls; params, loss, softmax stay fp32)
  c.remat = "none"  # rematerialise transformer blocks: "none" | "full" | "dots"
  c.attention = "auto"  # "auto" | "einsum" | "xla" | "cudnn" (GPU, bf16): see models.clip.ATTENTION_IMPLS
  # Start from these weights (fresh optimizer, step 0): a Hugging Face CLIP directory, an OpenAI/Long-CLIP .pt,
  # a converted directory (python -m hnclip_jax.pretrained.convert) or a train.py workdir. "" = from scratch.
  c.init_from = ""
  # A non-finite loss or gradient: "error" stops the run (the update is not applied; checkpoints stay finite),
  # "skip" skips that update and counts it (metric nonfinite_steps).
  c.on_nonfinite = "error"
  c.async_checkpointing = True
  # Steps a background checkpoint write may run beside training before the step waits for it: a failed write of
  # step N stops the run at step N + this at the latest, naming step N. Larger hides longer writes (big models on
  # slow storage) and reports a failure later; ignored when async_checkpointing is False (saves are then synchronous).
  c.checkpoint_overlap_steps = 1
  # Saturation telemetry on every log step (one extra forward pass there); every `every` steps also the
  # parameter gradients of HN-CLIP vs plain InfoNCE on the same batch (two backward passes). 0 turns them off.
  c.diagnostics = ml_collections.ConfigDict({"log": True, "every": 0})
  # A jax.profiler trace of train steps: steps "N" or "N:M" (first and last step, inclusive; "" = off), written to
  # WORKDIR/tensorboard (TensorBoard's profile plugin; the .trace.json.gz opens in Perfetto); processes "first"
  # (process 0 only) or "all" (process i > 0 into WORKDIR/tensorboard/process_i). See profile_steps.
  c.profile = ml_collections.ConfigDict({"steps": "", "processes": "first"})

  c.grad_accum_steps = 1  # micro-batches per step, accumulated inside the jitted step
  # negatives: which batch Ḡ and the negatives span when grad_accum_steps > 1 ("micro_batch" | "global_batch").
  # chunk_size: rows of the loss computed at a time per device (0: all at once for L_HN; the token term always
  #   works in blocks of chunk_size, or losses.TOKEN_BLOCK when 0).
  # token_weight: λ of the FILIP token term (paper Eq. 3; 0 = off). The token-term choices the paper leaves open
  #   (docs/objective.md says why each default): token_layer (which block's tokens; -1 = last, through the tower's
  #   final LayerNorm and projection), token_image_cls (CLS token among the patches), token_logit_scale (0 = the
  #   model's learned s; > 0 = a fixed multiplier), token_margin (add γ·Ḡ to the token logits too). Which projection
  #   the tokens go through is an architecture setting: config.model.token_projection ("shared" | "separate").
  # token_schedule: how the token term meets every caption on a mesh: "gather" all-gathers the caption tokens on
  #   every device (memory per device grows with the global batch), "ring" passes tiles of them around the batch
  #   axes (ppermute) and scores each against the device's images as it arrives: O(local batch) tokens per device,
  #   the same loss and gradients (docs/objective.md, docs/sharding.md).
  # token_group: which negatives the token term sees (a cost choice at large batch, docs/objective.md): 0 = the whole
  #   global batch (paper Eq. 3); G > 0 = only the other examples of its group of G consecutive examples of the
  #   global batch, B/G times less token work and no caption tokens sent between devices. G must divide the
  #   per-device batch; the result is the same on any mesh.
  # token_keep: the fraction of tokens the token term scores (a cost choice, docs/objective.md): 1.0 = all of them
  #   (paper Eq. 3); f < 1 = each image's ceil(f·P) patches and each caption's ceil(f·n) of its n real tokens most
  #   similar to the example's own global embedding, chosen before anything is sent: about f² of the term's work
  #   and f of its memory and collectives, on any mesh and schedule.
  # kind: the global term: "softmax" (HN-CLIP, paper Eq. 2) or "sigmoid" (HN-SigLIP: SigLIP's pairwise sigmoid loss
  #   with learned t and b, the margin γ·Ḡ added to every negative's logit before t and b; docs/objective.md). The
  #   model needs a logit bias (SigLIP checkpoints and presets have one; or config.model.logit_bias=True).
  # sigmoid_schedule: how the sigmoid loss meets every caption on a mesh: "ring" (big_vision's chunked schedule:
  #   caption chunks passed around the batch axes with ppermute) or "gather" (all-gather the captions).
  # margin: "geometry" (γ·Ḡ, HN-CLIP) or a geometry-free control of the same margin (issue 55; docs/objective.md
  #   "Controls"): "constant" (γ·c on every negative: c = margin_value, or with margin_value = -1 the batch's mean
  #   off-diagonal Ḡ), "shuffled" (each row's Ḡ values permuted among its negatives), "topk" (only each row's
  #   margin_topk nearest captions by Ḡ get their margin).
  # hn_nce_beta: > 0 turns the softmax loss into HN-NCE (Radenovic et al. 2023, Eq. 3): negatives re-weighted by
  #   e^{β·logit}; run it with gamma = 0 to compare it with the margin.
  # margin_directions: which of the softmax's cross-entropies get the margin: "both" (the paper), "i2t" (image→text
  #   rows only) or "t2i" (text→image columns only).
  c.loss = ml_collections.ConfigDict({"kind": "softmax", "sigmoid_schedule": "ring",
                                      "gamma": 0.5, "negatives": "global_batch", "chunk_size": 0,
                                      "token_weight": 0.0, "token_layer": -1, "token_image_cls": False,
                                      "token_logit_scale": 0.0, "token_margin": False, "token_schedule": "gather",
                                      "token_group": 0, "token_keep": 1.0, "margin": "geometry",
                                      "margin_value": -1.0, "margin_topk": 0, "hn_nce_beta": 0.0,
                                      "margin_directions": "both"})
  # train_logit_scale: learn CLIP's logit scale (its parameter is clamped to [0, ln 100] after every update; not for
  #   loss.kind="sigmoid") and, for the sigmoid loss, its logit bias b.
  c.optimizer = ml_collections.ConfigDict({
      "lr": 5e-4, "weight_decay": 0.1, "warmup_steps": 50,
      "b1": 0.9, "b2": 0.98, "eps": 1e-6, "grad_clip_norm": 1.0, "train_logit_scale": True,
      # lr_multipliers: ((regex, factor), ...); the first regex found in a parameter's path ("vision/blocks/3/fc1/
      # kernel", "text_projection", ...) scales its learning rate (and decoupled weight decay), e.g.
      # (("^vision/", 0.1),) for a slower image tower. layer_decay: d in (0, 1], 0 = off; block i of a tower with L
      # blocks gets d ** (L - i), its embeddings d ** (L + 1), the heads 1 (multiplied with lr_multipliers).
      "lr_multipliers": (), "layer_decay": 0.0})
  # finetune.freeze: regexes; parameters whose path matches one get no update and no optimizer state (e.g.
  # ("^(vision|patch_embed|class_embedding|vision_positions|ln_pre|ln_post|visual_projection)",) locks the image
  # tower, LiT-style).
  # finetune.method: "full" (every parameter), "lora" or "dora" (adapters of rank `rank`, update scale alpha / rank,
  # on the dense layers whose module path matches one of `targets`, e.g. "attn/(q|v)$" or "^text/.*fc1$"; everything
  # else frozen). dropout: on the adapter branch's input in training (a key per step from config.seed; none in eval).
  # dora_detach_norm: DoRA's column norm ||W0 + BA||_c as a constant in the backward pass (the DoRA paper §4.3 and
  # PEFT's implementation; False: gradients flow through it).
  c.finetune = ml_collections.ConfigDict({"method": "full", "rank": 16, "alpha": 16.0, "dropout": 0.0,
                                          "targets": (r"attn/(q|k|v|out)$", r"fc1$", r"fc2$"), "freeze": (),
                                          "dora_detach_norm": False})
  # framework: which fine-tuning framework's objective (docs/frameworks.md): a name in hnclip_jax.frameworks.REGISTRY
  # or "package.module:Name" (your own). "longclip": the global term L_HN (+ the token term if
  # config.loss.token_weight > 0) on the whole model, as Long-CLIP fine-tunes; the others add their terms (and
  # model parts, inputs) to it.
  c.framework = "longclip"
  # Each registered framework's settings: config.<name>, defaults and their meaning in the framework's module
  # (hnclip_jax/frameworks/<name>.py, CONFIG).
  for name, mod in frameworks.blocks():
    c[name] = ml_collections.ConfigDict(dict(mod.CONFIG))
  c.model = model_config("tiny", vocab_size=0, eot_token_id=-1)
  c.data = ml_collections.ConfigDict({
      # name: synthetic | docci | dci | long_dci | urban1k | coco | flickr30k | pairs.
      # manual_dir: where the downloaded files are.
      # on_bad_example: "error" stops the build at a bad example, "skip" leaves it out and reports it.
      # build: a dataset made from downloaded files is read from its build in data_dir, named after the files
      # (default_<fingerprint>; the log prints it). Empty: the build of the files in manual_dir; a name: that build,
      # read without the files (a pod's other hosts, an eval or replacement VM). A run records it in data.json.
      "name": "synthetic", "data_dir": "", "train_split": "train", "eval_split": "test",
      "manual_dir": "", "on_bad_example": "error", "build": "",
      # bucket_reads (data_dir on a bucket): "stage" copies the build once into each host's cache
      # (HNCLIP_DATA_CACHE) and reads it there; "direct" reads each example from the bucket, each process only its
      # own (one request per example: slower, more bytes; for data larger than a host's disk). docs/buckets.md.
      "bucket_reads": "stage",
      # Synthetic data only (captions: "dense" near-duplicate descriptions, "short" alt-text for pre-training, or
      # "detailed", dense captions in another grammar: the three-stage regime's intermediate domain):
      "num_train": 4096, "num_test": 512, "group_size": 4, "image_size": 64, "seed": 0, "captions": "dense",
      # batching: "random" (a seeded shuffle per epoch) or "clustered" (each batch an example and its nearest
      # neighbours by the start model's caption embeddings: crowded batches; hnclip_jax/data/clustering.py).
      "batching": "random"})
  # eval.py's benchmarks (`eval.py --benchmarks=all` or `=NAME,...`; docs/evaluation.md): NAME -> settings of
  # config.data for that benchmark (e.g. {"manual_dir": "docci"}; "name" defaults to NAME) plus "split" (default
  # "test"), in the order the config lists them. The rest of each benchmark's data config is the run's. data_root: the folder relative manual_dirs are
  # in. best_metric: what `eval.py --watch` keeps the best checkpoint by: "average/R@1" (R@1 averaged over the
  # benchmarks and both directions, the paper's summary), "average/t2i/R@5", "NAME/i2t/R@10", ...
  c.eval = ml_collections.ConfigDict({"benchmarks": ml_collections.ConfigDict(sort_keys=False), "data_root": "",
                                      "best_metric": "average/R@1"})
  # Device mesh: axis sizes; one may be -1 (= all remaining devices). The batch is split over data × fsdp.
  # rules: logical parameter axis -> mesh axis (see hnclip_jax/sharding.py).
  # dcn: the part of each axis that crosses the slow network (data-center network between TPU slices; the network
  # between GPU / CPU hosts, one process each). All 1 (default): every device is on one fast network and data /
  # fsdp / tensor span all of them. Otherwise data / fsdp / tensor are the sizes inside one slice (host) and each
  # mesh axis is ici × dcn, e.g. dcn.data=2 on two v5e-256 slices: data parallelism between the slices, whatever
  # layout inside each (docs/sharding.md "Beyond one slice or host"). One dcn size may be -1 (= all the slices).
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1,
                                      "dcn": ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}),
                                      "rules": "embed=fsdp,heads=tensor,mlp=tensor,vocab=tensor"})
  return c


POSITIVE = ("batch_size", "grad_accum_steps", "total_steps", "log_every", "checkpoint_every", "eval_every", "max_to_keep",
            "checkpoint_overlap_steps",
            "eval_batch_size", "data.num_train", "data.num_test", "data.group_size", "data.image_size",
            "optimizer.lr")
NON_NEGATIVE = ("workers", "loss.chunk_size", "diagnostics.every", "optimizer.weight_decay", "optimizer.warmup_steps",
                "loss.gamma", "loss.token_weight", "loss.token_logit_scale", "loss.hn_nce_beta")  # + each framework's NON_NEGATIVE


def flatten(cfg, prefix="") -> dict:
  """{'a.b': value} for a ConfigDict or a nested dict."""
  out = {}
  for k, v in cfg.items():
    key = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


FINETUNE_METHODS = {"full": "none", "lora": "lora", "dora": "dora"}


def framework_fields(config) -> dict:
  """config.framework and the frameworks' blocks checked -> the model's architecture fields the choice implies
  (its own modules; hnclip_jax.frameworks.model_fields)."""
  return frameworks.model_fields(config)


BENCHMARKS_PREFIX = "eval.benchmarks."
BENCHMARK_KEYS = ("split",)  # besides config.data's keys


def check_benchmarks(config) -> None:
  """Each config.eval.benchmarks entry: a block of config.data keys (+ split); raises naming the bad key."""
  data_keys = set(base_config().data)
  for name, entry in config.get("eval", {}).get("benchmarks", {}).items():
    where = f"config.eval.benchmarks.{name}"
    if not isinstance(entry, (ml_collections.ConfigDict, dict)):
      raise ValueError(f"{where}={entry!r}: each benchmark is a block of data settings, e.g. "
                       f"{{'name': 'docci', 'manual_dir': '/data/docci'}}")
    for key in entry:
      if key not in data_keys and key not in BENCHMARK_KEYS:
        close = difflib.get_close_matches(key, sorted(data_keys) + list(BENCHMARK_KEYS), n=1)
        raise ValueError(f"unknown key {where}.{key}" + (f"; did you mean {where}.{close[0]}?" if close else "") +
                         " (a benchmark takes config.data's keys and 'split')")


ADAPTER_SETTINGS = ("rank", "alpha", "dropout", "targets", "dora_detach_norm")  # only LoRA / DoRA read these
# config.loss keys only the token term reads (token_weight > 0), and a framework that names them (LOSS_SETTINGS).
TOKEN_SETTINGS = ("token_layer", "token_image_cls", "token_logit_scale", "token_margin", "token_schedule",
                  "token_group", "token_keep")
TOKEN_SCHEDULES = ("gather", "ring")
# config.loss keys of the global term's margin controls and HN-NCE (terms.ContrastiveTerm reads them)
GLOBAL_SETTINGS = ("margin", "margin_value", "margin_topk", "hn_nce_beta", "margin_directions")
MARGINS = ("geometry", "constant", "shuffled", "topk")
DIRECTIONS = ("both", "i2t", "t2i")


def check_margin_settings(loss, gamma: float | None = None) -> None:
  """The global term's margin control and HN-NCE settings — config.loss, or a ContrastiveTerm with its objective's
  `gamma` (the same names; Objective.check): a value outside the choices, or a setting that would do nothing, is
  refused by name."""
  defaults = base_config().loss
  gamma = float(loss.gamma if gamma is None else gamma)
  if loss.margin not in MARGINS:
    raise ValueError(f"config.loss.margin={loss.margin!r}; choose one of {list(MARGINS)}")
  if loss.margin != defaults.margin and gamma == 0:
    raise ValueError(f"config.loss.margin={loss.margin!r} set, but config.loss.gamma=0 adds no margin to shape. "
                     "Set gamma > 0, or drop it")
  if loss.margin_value != defaults.margin_value and loss.margin != "constant":
    raise ValueError(f"config.loss.margin_value={loss.margin_value} set, but config.loss.margin={loss.margin!r}: it "
                     "is the constant margin's value. Set margin='constant', or drop it")
  if not (float(loss.margin_value) >= 0 or float(loss.margin_value) == -1):
    raise ValueError(f"config.loss.margin_value={loss.margin_value}: give c >= 0, or -1 for the batch's mean "
                     "off-diagonal caption similarity")
  if loss.margin == "topk" and not int(loss.margin_topk) >= 1:
    raise ValueError("config.loss.margin='topk' needs config.loss.margin_topk >= 1 (how many nearest captions per "
                     "row keep their margin)")
  if loss.margin_topk != defaults.margin_topk and loss.margin != "topk":
    raise ValueError(f"config.loss.margin_topk={loss.margin_topk} set, but config.loss.margin={loss.margin!r}. Set "
                     "margin='topk', or drop it")
  if loss.margin_directions not in DIRECTIONS:
    raise ValueError(f"config.loss.margin_directions={loss.margin_directions!r}; choose one of {list(DIRECTIONS)}")
  if loss.margin_directions != defaults.margin_directions and (loss.kind != "softmax" or gamma == 0):
    raise ValueError(f"config.loss.margin_directions={loss.margin_directions!r} set, but it chooses which of the "
                     "softmax loss's two cross-entropies get the margin: it needs loss.kind='softmax' and gamma > 0. "
                     "Drop it, or set those")
  if float(loss.hn_nce_beta) and loss.kind != "softmax":
    raise ValueError(f"config.loss.hn_nce_beta={loss.hn_nce_beta} re-weights the softmax's negatives; "
                     f"config.loss.kind={loss.kind!r} scores each pair on its own. Use kind='softmax', or drop it")
  if loss.kind == "sigmoid" and loss.sigmoid_schedule == "ring" and loss.margin in ("shuffled", "topk"):
    raise ValueError(f"config.loss.margin={loss.margin!r} needs each row's whole Ḡ, which the sigmoid loss's ring "
                     "schedule never holds: set config.loss.sigmoid_schedule='gather'")


NEGATIVES = ("micro_batch", "global_batch")  # config.loss.negatives: whose captions a micro-batch's rows score


def check_negatives(negatives: str) -> None:
  if negatives not in NEGATIVES:
    raise ValueError(f"config.loss.negatives={negatives!r}; choose one of {NEGATIVES}")


def check_chunk_size(chunk: int, rows: int) -> None:
  """config.loss.chunk_size against the `rows` each device's loss scores at a time (0 or >= rows: all at once)."""
  if chunk and chunk < rows and rows % chunk:
    raise ValueError(f"config.loss.chunk_size={chunk} must divide the per-device micro-batch {rows} (batch_size / "
                     "grad_accum_steps / batch shards)")


def _normalised(v):
  return tuple(v) if isinstance(v, (list, tuple)) else v


LOSS_KINDS = ("softmax", "sigmoid")


def check_loss_kind(config) -> None:
  loss, defaults = config.loss, base_config().loss
  if loss.kind not in LOSS_KINDS:
    raise ValueError(f"config.loss.kind={loss.kind!r}; choose one of {list(LOSS_KINDS)}")
  if loss.sigmoid_schedule not in TOKEN_SCHEDULES:
    raise ValueError(f"config.loss.sigmoid_schedule={loss.sigmoid_schedule!r}; choose one of {list(TOKEN_SCHEDULES)}")
  if loss.kind != "sigmoid" and loss.sigmoid_schedule != defaults.sigmoid_schedule:
    raise ValueError(f"config.loss.sigmoid_schedule={loss.sigmoid_schedule!r} set, but config.loss.kind="
                     f"{loss.kind!r}: it applies to the sigmoid loss only. Set kind='sigmoid', or drop it")
  if (loss.kind == "sigmoid" and loss.sigmoid_schedule == "ring" and int(loss.chunk_size)
      and not float(loss.token_weight) > 0):
    raise ValueError(f"config.loss.chunk_size={loss.chunk_size} set, but the sigmoid loss's ring schedule scores one "
                     "visiting chunk of captions at a time already (and the token term is off), so it would do "
                     "nothing. Drop it, or use config.loss.sigmoid_schedule='gather' to score rows in chunks")


def check_token_settings(config) -> None:
  """The token term's settings with the term off (config.loss.token_weight = 0) would do nothing: refused by name,
  except those the chosen framework reads itself (its LOSS_SETTINGS, e.g. the layer its token modules read)."""
  loss, defaults = config.loss, base_config().loss
  if loss.token_schedule not in TOKEN_SCHEDULES:
    raise ValueError(f"config.loss.token_schedule={loss.token_schedule!r}; choose one of {list(TOKEN_SCHEDULES)}")
  group = loss.token_group
  if not isinstance(group, int) or group < 0:
    raise ValueError(f"config.loss.token_group={group!r}; use 0 (the whole global batch) or a group size > 0")
  keep = loss.token_keep
  if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
    raise ValueError(f"config.loss.token_keep={keep!r}; use a fraction in (0, 1] of the tokens the token term "
                     "scores (1.0: all of them)")
  on = float(loss.token_weight) > 0
  if on and group and int(config.batch_size) % group:
    raise ValueError(f"config.loss.token_group={group} must divide config.batch_size={config.batch_size} (and the "
                     "per-device batch): choose a divisor, or 0 for the whole global batch")
  if on and group and loss.token_schedule != defaults.token_schedule:
    raise ValueError(f"config.loss.token_schedule={loss.token_schedule!r} set, but config.loss.token_group={group} "
                     "scores each group on the device that holds it, with no caption tokens sent: the schedule "
                     "would do nothing. Drop token_schedule, or set token_group=0")
  if on:
    return
  read = frameworks.loss_settings(config)
  unused = [f"config.loss.{k}={loss[k]!r}" for k in TOKEN_SETTINGS if loss[k] != defaults[k] and k not in read]
  if unused:
    raise ValueError(f"{', '.join(unused)} set, but config.loss.token_weight=0 turns the token term off, so "
                     "they would do nothing. Set config.loss.token_weight > 0 (the paper: 1.0), or drop them")


def adapter_fields(config) -> dict:
  """config.finetune -> the model's adapter fields (CLIPConfig.adapter*); raises naming the bad key."""
  ft = config.finetune
  if ft.method not in FINETUNE_METHODS:
    raise ValueError(f"config.finetune.method={ft.method!r}; choose one of {sorted(FINETUNE_METHODS)}")
  if ft.method == "full":
    check_unused_adapter_settings(config)
    return {"adapter": "none"}
  if not 0 <= float(ft.dropout) < 1:
    raise ValueError(f"config.finetune.dropout={ft.dropout!r} must be in [0, 1)")
  targets = [ft.targets] if isinstance(ft.targets, str) else list(ft.targets)
  if not targets:
    raise ValueError("config.finetune.targets is empty: name the layers to adapt, e.g. ('attn/(q|v)$',)")
  if int(ft.rank) <= 0 or float(ft.alpha) <= 0:
    raise ValueError(f"config.finetune.rank={ft.rank} and alpha={ft.alpha} must be positive")
  detach = bool(ft.get("dora_detach_norm", False))
  if detach and ft.method != "dora":
    raise ValueError(f"config.finetune.dora_detach_norm=True set, but config.finetune.method={ft.method!r}: it "
                     "applies to DoRA's column norm only. Set method 'dora', or drop it")
  return {"adapter": FINETUNE_METHODS[ft.method], "adapter_rank": int(ft.rank), "adapter_alpha": float(ft.alpha),
          "adapter_targets": "|".join(f"(?:{t})" for t in targets), "adapter_dropout": float(ft.dropout),
          "adapter_detach_norm": detach}


def check_unused_adapter_settings(config) -> None:
  """With config.finetune.method='full' the adapters' settings would silently do nothing: refused by name."""
  ft, defaults = config.finetune, base_config().finetune
  unused = [f"config.finetune.{k}={ft[k]!r}" for k in ADAPTER_SETTINGS
            if _normalised(ft[k]) != _normalised(defaults[k])]
  if unused:
    raise ValueError(f"{', '.join(unused)} set, but config.finetune.method='full' trains every weight and adds no "
                     "adapters: these apply only with method 'lora' or 'dora'. Set the method, or drop them")


def freeze(config) -> ml_collections.FrozenConfigDict:
  """The resolved run (validated, its data and epoch-given settings resolved): from here on the code reads it and
  nothing changes it (train.py, eval.py)."""
  return ml_collections.FrozenConfigDict(config)


def profile_steps(config) -> tuple[int, int] | None:
  """(first, last) train step to trace from config.profile.steps ("N" or "N:M"), None when off; ValueError naming
  the value otherwise."""
  spec, where = str(config.profile.steps).strip(), f"config.profile.steps={config.profile.steps!r}"
  if config.profile.processes not in ("first", "all"):
    raise ValueError(f"config.profile.processes={config.profile.processes!r}; choose 'first' (process 0) or 'all'")
  if not spec:
    return None
  try:
    first, last = (int(x) for x in (spec.split(":") if ":" in spec else (spec, spec)))
  except ValueError:
    raise ValueError(f"{where}: give a step 'N' or a range 'N:M' (first and last step traced), or '' for no "
                     "trace") from None
  if not 1 <= first <= last <= int(config.total_steps):
    raise ValueError(f"{where}: steps must lie in 1..config.total_steps={config.total_steps}, first <= last")
  return first, last


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises ValueError naming the offending key/value and the fix; returns the config unchanged."""
  known, given = flatten(base_config()), flatten(config)
  external = frameworks.external_block(config)  # a framework from outside the package: its block's keys are known
  if external is not None:
    known.update({f"{external[0]}.{k}": v for k, v in external[1].CONFIG.items()})
  for key in sorted(set(given) - set(known)):
    if key.startswith(BENCHMARKS_PREFIX):
      continue  # named by the config (checked in check_benchmarks)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean config.{close[0]}?" if close else ""
    raise ValueError(f"unknown config key config.{key}{hint} (see hnclip_jax/config.py for all keys)")
  for key in POSITIVE:
    if key in given and not given[key] > 0:
      raise ValueError(f"config.{key}={given[key]!r} must be positive")
  with_blocks = frameworks.blocks() + ([external] if external is not None else [])
  for key in NON_NEGATIVE + tuple(f"{name}.{k}" for name, mod in with_blocks for k in getattr(mod, "NON_NEGATIVE", ())):
    if key in given and given[key] < 0:
      raise ValueError(f"config.{key}={given[key]!r} must be >= 0")
  for key, value in given.items():
    if key.startswith("model.") and isinstance(value, (int, float)) and not isinstance(value, bool):
      auto = (key == "model.vocab_size" and value == 0) or (key == "model.eot_token_id" and value == -1)
      if value <= 0 and not auto:
        raise ValueError(f"config.{key}={value!r} must be positive")
  # Compute settings are checked here too, so a typo fails before any data is built (the GPU check for
  # attention="cudnn" needs the backend and comes later, in experiment.runtime).
  dataclasses.replace(PRESETS["tiny"], token_projection=config.model.token_projection,
                      **{k: config[k] for k in RUNTIME_FIELDS}).validate()
  adapter_fields(config)  # config.finetune.* checked here too
  framework_fields(config)  # config.framework and the frameworks' blocks too
  check_loss_kind(config)
  check_token_settings(config)
  check_margin_settings(config.loss)
  if config.on_nonfinite not in ("error", "skip"):
    raise ValueError(f"config.on_nonfinite={config.on_nonfinite!r}; choose 'error' or 'skip'")
  check_negatives(config.loss.negatives)
  if int(config.grad_accum_steps) == 1 and config.loss.negatives != base_config().loss.negatives:
    raise ValueError(f"config.loss.negatives={config.loss.negatives!r} does not apply: with config.grad_accum_steps=1 "
                     "the micro-batch is the global batch. Set config.grad_accum_steps > 1, or drop it")
  if not config.async_checkpointing and config.checkpoint_overlap_steps != base_config().checkpoint_overlap_steps:
    raise ValueError(f"config.checkpoint_overlap_steps={config.checkpoint_overlap_steps} does not apply: "
                     "config.async_checkpointing=False writes each checkpoint before training goes on. Drop one")
  check_benchmarks(config)
  profile_steps(config)
  sharding.check_mesh_sizes(config.mesh)
  return config
