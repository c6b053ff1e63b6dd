"""Resolving a run: `resolve(config, workdir, purpose)` turns the flags into a frozen `Run` (hnclip_jax/run.py) —
config, model config, tokenizer, framework, objective, mesh, data — which train.py, eval.py, tools/compile_for,
benchmarks/replicate.py and the benchmarks take from there (`Run.of` builds one from parts a test or benchmark
makes itself; `experiment.Run` is the same class). The pieces it
is made of are here too: the data (and what the workdir recorded of it), the model config and its start (pretrained
weights, adapters, a framework's modules), the tokenizer, epoch settings, and checkpoint-compatibility errors.
Process set-up is in `hnclip_jax.cli`, eval embedding in `hnclip_jax.evaluation.embedding`."""
from __future__ import annotations

import copy
import dataclasses
import os
import types

import ml_collections

import jax

from hnclip_jax import cli, config as config_lib, frameworks, preemption, pretrained, sharding, storage, train_step
from hnclip_jax.checkpoint import IncompatibleCheckpoint
from hnclip_jax.data import builders, pipeline
from hnclip_jax.data.tokenizer import WordTokenizer
from hnclip_jax.config import FRAMEWORK_FIELDS, RUNTIME_FIELDS, adapter_fields, framework_fields
from hnclip_jax.models import CLIPConfig, adapters
from hnclip_jax.run import PURPOSES, Run  # noqa: F401 (experiment.Run: the resolved run)
from hnclip_jax.workdir import DATA_LOCATION_KEYS, Workdir, check_model_compatible, config_changes

CLIP_BPE_VOCAB = 49408  # the CLIP BPE tokenizer's vocabulary: what a compile without data or weights assumes


def resolve(config, workdir: str | None, purpose: str, *, overrides: dict | None = None, devices=None) -> Run:
  """Flags -> the frozen Run that train.py ("train"), eval.py ("eval") or tools/compile_for ("compile") executes.

  train: the workdir checked and held (its lock), the data it trains on (data.json, recorded at the first start),
  epoch-given settings as steps, the model and tokenizer (model.json, or the start's weights, or fitted), the
  objective and the framework. eval: the workdir's model and tokenizer and the data to evaluate (command-line data
  overrides applied). compile: no workdir; the model from config.init_from or config.model (a vocabulary size 0 /
  end token -1 read as the CLIP BPE tokenizer's), the epoch settings from the training split when it is built.
  `overrides`: the command line's {'data.name': value, ...}; `devices`: the mesh's devices (default: all)."""
  if purpose not in PURPOSES:
    raise ValueError(f"purpose={purpose!r}; one of {PURPOSES}")
  config = config_lib.validate(config)
  if purpose == "compile":
    mesh = sharding.make_mesh(config.mesh, devices)
    config = config_lib.freeze(_compile_epoch_settings(config))
    return Run.of(config, compile_model(config), mesh, purpose=purpose)
  if purpose == "train":
    preemption.check_workdir(workdir)
  wd = Workdir(workdir)
  storage.start_debug_log(wd.debug_log)  # library tracebacks go there; the console keeps one line per problem
  config, data_note = resolve_data(config, wd, overrides or {}, training=purpose == "train")
  if purpose == "eval":
    config = config_lib.freeze(config)
    cli.enable_compilation_cache(config.compilation_cache_dir)
    cli.maybe_initialize_distributed()
    mesh = sharding.make_mesh(config.mesh, devices)
    model, tokenizer, _ = resolve_model(config, wd, training=False)
    return Run.of(config, model, mesh, purpose=purpose, tokenizer=tokenizer, wd=wd,
                  data_note=data_note)
  preflight(config)
  storage.check_writable(wd.checkpoints, "the checkpoint directory")  # fail now, not at the first save
  cli.enable_compilation_cache(config.compilation_cache_dir)
  cli.maybe_initialize_distributed()
  lock = preemption.WorkdirLock(wd)
  try:
    mesh = sharding.make_mesh(config.mesh, devices)
    sharding.check_batch_size(config.eval_batch_size, mesh, "config.eval_batch_size")
    train_step.check_accumulation(config, mesh)
    fresh_note = f"data: {describe_data(config.data)}"
    with config.unlocked():  # the build a dataset made from downloaded files reads, named once (data.json keeps it)
      config.data = builders.pin_build(config.data)
    if data_note == fresh_note:  # a first start's line names the build too
      data_note = f"data: {describe_data(config.data)}"
    sources = {"train": builders.data_source(config.data, config.data.train_split),
               "eval": builders.data_source(config.data, config.data.eval_split)}
    if wd.data() is None:
      wd.save_data(config.data)
    config = config_lib.freeze(resolve_epoch_settings(config, len(sources["train"])))
    model, tokenizer, init_params = resolve_model(config, wd, training=True)
    return Run.of(config, model, mesh, purpose=purpose, tokenizer=tokenizer, wd=wd,
                  data_note=data_note, sources=sources, init_params=init_params, lock=lock)
  except BaseException:
    lock.release()
    raise


def _compile_epoch_settings(config):
  """A compile's epoch-given settings: from the training split's size when it is built here; otherwise refused
  when they change the program (a setting of -1 epochs means nothing without the data)."""
  num = builders.num_examples(config.data, config.data.train_split)
  if num is not None:
    return resolve_epoch_settings(config, num)
  one, two = (resolve_epoch_settings(config, n * config.batch_size) for n in (1, 2))
  differ = sorted(k for k, v in config_lib.flatten(one).items() if config_lib.flatten(two).get(k) != v)
  if differ:
    raise ValueError(f"{', '.join(f'config.{k}' for k in differ)} is given in epochs of the training split, which is "
                     f"not built here ({describe_data(config.data)}): give it in steps, or build the data first "
                     "(python -m hnclip_jax.data.inspect)")
  return one


def compile_model(config) -> CLIPConfig:
  """The architecture a compile without a workdir builds, by the functions train.py uses (pretrained_start,
  model_config): config.init_from's (read from the weights) or config.model. Without weights there is no data here
  to fit a tokenizer on: a vocabulary size 0 / end token -1 means the CLIP BPE tokenizer's 49,408 / the last id;
  sizes the config gives are taken as they are."""
  if config.init_from:
    return pretrained_start(config)[0]
  vocab = config.model.vocab_size or CLIP_BPE_VOCAB
  eot = config.model.eot_token_id if config.model.eot_token_id >= 0 else vocab - 1
  return model_config(config, types.SimpleNamespace(vocab_size=vocab, eot_id=eot, kind="assumed"))


def runtime(cfg: CLIPConfig, config) -> CLIPConfig:
  """`cfg` with this run's compute settings (config.dtype, config.remat, config.attention) and how its adapters
  train (config.finetune.dropout, .dora_detach_norm)."""
  dropout = float(config.finetune.dropout) if cfg.adapter != "none" else 0.0
  detach = cfg.adapter == "dora" and bool(config.finetune.get("dora_detach_norm", False))
  cfg = dataclasses.replace(cfg, adapter_dropout=dropout, adapter_detach_norm=detach,
                            **{k: config[k] for k in RUNTIME_FIELDS}).validate()
  if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(f"config.attention='cudnn' needs an NVIDIA GPU; this run's backend is "
                     f"{jax.default_backend()}. Use config.attention='auto'")
  return cfg


def preflight(config) -> None:
  """The checks on paths that need no data and no compilation: config.init_from's existence and format, the
  dataset name and its manual folder. Called before anything is built."""
  if config.init_from:
    pretrained.check_source(config.init_from, "config.init_from")
  builders.check_data_config(config.data)


def describe_data(data) -> str:
  """'pairs from /data/x' / 'synthetic (tr4096_te512_g4_px64_s0)': which dataset a run reads, for the log."""
  if data["name"] == "synthetic":
    return (f"synthetic ({data['num_train']} train / {data['num_test']} test, group {data['group_size']}, "
            f"{data['image_size']} px, seed {data['seed']}"
            + (f", {data['captions']} captions" if data.get("captions", "dense") != "dense" else "") + ")")
  where = f"{data['name']} from {data['manual_dir']}" if data.get("manual_dir") else data["name"]
  return where + (f" (build {data['build']})" if data.get("build") else "")


BUILD_INPUT_KEYS = ("name", "manual_dir", "on_bad_example")  # what names a build of downloaded files


def resolve_data(config, wd: Workdir, overrides: dict, *, training: bool):
  """The data a run on `wd` reads -> (config with that data, log line).

  A workdir records its data config at the first start (data.json). Later runs read that data: a config file
  that says otherwise is ignored (and the log says so). Explicit --config.data.* overrides that contradict it
  are an error for a resume (a run trains on one dataset) and are applied for eval (evaluating on another split or
  dataset is normal). `overrides`: the command line's {'data.name': value, ...} (config_flags.get_override_values).
  """
  stored = wd.data()
  if stored is None:
    if training and wd.checkpoint_steps():
      return config, (f"{wd.path} has no {os.path.basename(wd.data_json)} (an older workdir): reading the data the "
                      f"config gives, {describe_data(config.data)}, and recording it")
    return config, f"data: {describe_data(config.data)}"
  explicit = {k[len("data."):]: v for k, v in overrides.items() if k.startswith("data.")}
  data = {**dict(config.data), **{k: v for k, v in stored.items() if k in config.data}}
  notes = []
  if training:
    clash = [f"config.data.{k}={v!r} (the workdir's: {stored.get(k)!r})" for k, v in explicit.items()
             if k not in DATA_LOCATION_KEYS and stored.get(k) != v]
    if clash:
      raise ValueError(f"{wd.path} trains on {describe_data(stored)} ({wd.data_json}); the command line asks for "
                       + ", ".join(clash) + ". A resume continues on the data it started with: drop those "
                       "overrides, or start a new workdir (--config.init_from=" + wd.path + " takes its parameters)")
  ignored = [f"{k}={config.data[k]!r}" for k in config.data if k not in explicit and k not in DATA_LOCATION_KEYS
             and k in stored and stored[k] != config.data[k] and not (k == "build" and not config.data[k])]
  if ignored:
    notes.append("the config file's " + ", ".join(ignored) + " ignored")
  data.update({k: v for k, v in explicit.items() if not training or k in DATA_LOCATION_KEYS})
  if not training and "build" not in explicit and any(k in explicit for k in BUILD_INPUT_KEYS):
    data["build"] = ""  # another dataset or folder to evaluate on: its own build, not the recorded one
  if not training and any(data.get(k) != stored.get(k) for k in stored if k not in DATA_LOCATION_KEYS):
    notes.append(f"not the data it was trained on, {describe_data(stored)}")
  config = copy.deepcopy(config)
  with config.unlocked():
    config.data = ml_collections.ConfigDict(data)
  origin = f"recorded in {wd.data_json}" + (" with command-line overrides" if explicit else "")
  return config, f"data: {describe_data(config.data)} ({origin}" + "".join(f"; {n}" for n in notes) + ")"


def resolve_model(config, wd: Workdir, *, training: bool):
  """The run's architecture and tokenizer -> (CLIPConfig, tokenizer, initial params or None).

  A workdir remembers both (model.json, tokenizer/) from its first start, so
  resuming and eval.py never need the original weights again. On a first start:
  with config.init_from, the architecture and tokenizer come from those weights
  (text positions are stretched if config.model.text_context asks for more, as
  Long-CLIP does; config.dtype, config.remat and config.attention apply); without it, from config.model and
  a tokenizer fitted on the training captions.
  """
  cfg = wd.model()
  if cfg is not None:
    tok = wd.tokenizer()
    if training:  # the adapters are the workdir's (eval and pretrained.load need not repeat config.finetune)
      check_adapters(cfg, config, wd.model_json)
    if not config.init_from:
      kept = list(ADAPTER_KEYS) + ([] if training else list(FRAMEWORK_FIELDS))  # eval need not repeat the framework
      expected = dataclasses.replace(model_config(config, tok), **{k: getattr(cfg, k) for k in kept})
      check_model_compatible(dataclasses.asdict(cfg), expected, wd.model_json)
    return runtime(cfg, config), tok, None
  if not training:
    raise FileNotFoundError(f"{wd.model_json} is missing: {wd.path} is not a train.py workdir (train first)")
  params = None
  if config.init_from:
    cfg, pre = pretrained_start(config)
    if pre.tokenizer is None:
      raise FileNotFoundError(f"config.init_from={config.init_from} has no tokenizer files next to the weights "
                              "(vocab.json + merges.txt, tokenizer.json or bpe_simple_vocab_16e6.txt.gz)")
    tok = pre.tokenizer
    params = start_params(pre.params, cfg, config, config.init_from)
    if cfg.adapter != "none":
      params = adapters.add_adapters(params, cfg, config.seed)
  else:
    tok = get_tokenizer(config, wd, fit_if_missing=True)
    cfg = model_config(config, tok)
  wd.save_model(cfg, tok)
  return cfg, tok, params


def pretrained_start(config):
  """config.init_from's weights as this run starts from them -> (the run's CLIPConfig, the Pretrained): adapters of
  an adapter workdir folded in, text positions stretched if config.model.text_context asks for more (as Long-CLIP
  does), the token projection config.model asks for, then this run's adapters, framework modules and compute
  settings. train.py (resolve_model) and tools/compile_for build a fine-tuning start's architecture here."""
  pre = pretrained.load(config.init_from).merged()  # an adapter workdir starts from its folded weights
  if config.model.text_context > pre.config.text_context:
    pre = pre.with_text_context(config.model.text_context)
  pre = pre.with_token_projection(config.model.token_projection)
  cfg = dataclasses.replace(runtime(pre.config, config), **adapter_fields(config), **framework_fields(config))
  return cfg.validate(), pre


def get_tokenizer(config, wd: Workdir, *, fit_if_missing: bool):
  """The workdir's tokenizer; when absent and `fit_if_missing`, fits one on the training captions."""
  tok = wd.tokenizer(required=False)
  if tok is None:
    if not fit_if_missing:
      raise FileNotFoundError(f"no tokenizer in {wd.tokenizer_dir}: run train.py with this --workdir first")
    captions = pipeline.read_captions(builders.data_source(config.data, config.data.train_split, decode_images=False))
    tok = WordTokenizer.fit(captions, context_length=config.model.text_context)
  if tok.context_length != config.model.text_context:
    raise ValueError(f"{wd.tokenizer_dir} was saved with context_length={tok.context_length} but "
                     f"config.model.text_context={config.model.text_context}; use the same text context")
  return tok


def resume_error(err: IncompatibleCheckpoint, config, wd: Workdir) -> ValueError:
  """The one-line error for a checkpoint whose state this config cannot restore into."""
  changes = config_changes(err.meta.get("config"), config)
  said = ("The settings that differ from the run that wrote it: " + ", ".join(changes) if changes else
          "No config setting differs from the run that wrote it (the code's state layout changed)")
  return ValueError(f"{err.where} cannot be resumed with this config: {'; '.join(err.differences)}. "
                    f"{said}. Either rerun with the checkpoint's settings, or take only its parameters into a new "
                    f"run: --config.init_from={wd.path} --workdir NEW_DIR. Nothing on disk was changed.")


VOCAB_MULTIPLE = 128


def model_config(config, tokenizer) -> CLIPConfig:
  """config.model with the tokenizer's vocabulary filled in where it says 0 / -1."""
  d = dict(config.model)
  if d["vocab_size"] == 0:  # rounded up so the embedding splits over any tensor-parallel size
    d["vocab_size"] = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  if d["eot_token_id"] == -1:
    d["eot_token_id"] = tokenizer.eot_id
  if d["vocab_size"] < tokenizer.vocab_size:
    raise ValueError(f"config.model.vocab_size={d['vocab_size']} is smaller than the tokenizer's "
                     f"vocabulary ({tokenizer.vocab_size}); set it to 0 to take the tokenizer's size")
  if d["eot_token_id"] != tokenizer.eot_id:  # every caption would be pooled at position 0: identical embeddings
    raise ValueError(f"config.model.eot_token_id={d['eot_token_id']} is not the end token of the {tokenizer.kind} "
                     f"tokenizer ({tokenizer.eot_id}; {tokenizer.vocab_size} tokens), so the text tower would pool "
                     "every caption at the same position. Without config.init_from the model takes the tokenizer's "
                     "ids: set --config.model.eot_token_id=-1 --config.model.vocab_size=0 (or start from weights "
                     "with --config.init_from)")
  return runtime(CLIPConfig.from_dict({**d, **adapter_fields(config), **framework_fields(config)}), config)


def resolve_epoch_settings(config, num_train: int):
  """A framework's settings given in epochs of the training split (-1 = one epoch) as steps (its `resolve_epochs`)."""
  resolve = frameworks.hook(config, "resolve_epochs")
  return config if resolve is None else resolve(config, max(num_train // config.batch_size, 1))


def start_params(params: dict, cfg: CLIPConfig, config, source: str) -> dict:
  """Pretrained weights as this run's start: the top-level modules another framework owns (its `PARAMS`, e.g. a
  token-aggregating framework's modules in a start for another framework) are left out, the towers kept; the chosen framework then
  adds or checks its own (its `start_params(params, cfg, seed, source)`)."""
  own = set(getattr(frameworks.resolve(frameworks.check_name(config)), "PARAMS", ()) or ())
  others = {p for _, mod in frameworks.blocks() for p in getattr(mod, "PARAMS", ())} - own
  params = {k: v for k, v in params.items() if k not in others}
  add = frameworks.hook(config, "start_params")
  return params if add is None else add(params, cfg, config.seed, source)


ADAPTER_KEYS = {"adapter": "method", "adapter_rank": "rank", "adapter_alpha": "alpha", "adapter_targets": "targets"}


def check_adapters(cfg: CLIPConfig, config, where: str) -> None:
  """The workdir's adapters (model.json) must be what config.finetune asks for; raises naming the differences."""
  want = {k: v for k, v in {**{k: getattr(CLIPConfig, k) for k in ADAPTER_KEYS}, **adapter_fields(config)}.items()
          if k in ADAPTER_KEYS}
  have = {k: getattr(cfg, k) for k in ADAPTER_KEYS}
  if have["adapter"] == want["adapter"] == "none":
    return
  diffs = [f"config.finetune.{ADAPTER_KEYS[k]}: workdir={have[k]!r}, config={want[k]!r}" for k in ADAPTER_KEYS
           if have[k] != want[k]]
  if diffs:
    raise ValueError(f"{where} was trained with other adapters: {'; '.join(diffs)}. Use its settings, or start a "
                     "fresh --workdir (--config.init_from=THAT_WORKDIR merges its adapters into the new start)")


def truncation_report(config, tokenizer) -> str:
  """How many training captions exceed the text context (they are truncated, keeping the end token)."""
  if builders.reads_in_place(config.data):  # every caption would mean every record of the split, on every host
    return (f"training captions longer than the {tokenizer.context_length}-token context: not counted at start-up "
            "(config.data.bucket_reads='direct' would fetch the whole split; python -m hnclip_jax.data.inspect "
            "counts them)")
  captions = pipeline.read_captions(builders.data_source(config.data, config.data.train_split, decode_images=False))
  long = sum(len(ids) + 2 > tokenizer.context_length for ids in tokenizer.encode_ids(captions))
  return (f"{long} of {len(captions)} training captions ({100 * long / max(len(captions), 1):.1f}%) are longer "
          f"than the {tokenizer.context_length}-token context and are truncated")




def log_run(run: Run) -> None:
  """The resolved run's lines: the mesh, the host allocator (CPU), the data, the captions the tokenizer truncates."""
  import jax
  from hnclip_jax import hostmem
  from hnclip_jax.metrics import log
  config, mesh = run.config, run.mesh
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es){sharding.describe_dcn(mesh, config.mesh)}")
  if jax.devices()[0].platform == "cpu":
    log(hostmem.cpu_allocator_note())
  log(f"{run.data_note}; training on split '{config.data.train_split}', evaluating on '{config.data.eval_split}'")
  log(truncation_report(config, run.tokenizer))


def check_framework_data(run: Run, program) -> None:
  """What the framework needs of the data (its `check_data` hook), before anything compiles; its note logged."""
  from hnclip_jax.metrics import log
  check_data = run.hook("check_data")
  if check_data is not None and (note := check_data(run.config, program.objective)):
    log(note)


def restore_or_start(run: Run, program, account):
  """-> (the run's Checkpointer, its state): the newest intact checkpoint restored, else a fine-tuning start from
  config.init_from (fresh optimizer, step 0), else the model initialised from config.seed — created on the
  program's shardings; the frozen parameters stored once at a first start. A checkpoint of another model or
  optimizer: ValueError saying what differs (resume_error)."""
  from hnclip_jax.metrics import log
  config, wd, model_cfg = run.config, run.wd, run.model
  ckpt = wd.checkpointer(max_to_keep=config.max_to_keep, async_save=config.async_checkpointing,
                         overlap_steps=config.checkpoint_overlap_steps, frozen=program.frozen)
  try:
    with account.part("restore"):
      latest, state, saved_meta = ckpt.restore_latest_intact(
          program.target(),
          check_meta=lambda meta, where: check_model_compatible(meta.get("model"), model_cfg, where))
  except IncompatibleCheckpoint as e:
    raise resume_error(e, config, wd) from None
  if state is not None:
    changed = config_changes(saved_meta.get("config"), config)
    log(f"resumed from {ckpt.directory}/{latest} (step {latest})" +
        (f"; settings changed since that checkpoint: {', '.join(changed)}" if changed else ""))
  elif run.init_params is not None:  # fine-tuning start: given weights, fresh optimizer, step 0
    state = train_step.initial_state(program.tx, program.shardings, params=run.init_params)
    log(f"initialised from {config.init_from}")
  else:
    state = train_step.initial_state(program.tx, program.shardings, model_cfg=model_cfg, seed=config.seed)
  if latest is None and program.frozen is not None:
    ckpt.save_frozen(state["params"])  # once: checkpoints then hold only what trains, and reference these
    log(f"frozen parameters stored once in {ckpt.frozen_dir}")
  return ckpt, state
