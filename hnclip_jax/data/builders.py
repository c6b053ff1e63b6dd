"""TFDS builders (array_record files, no TensorFlow) and a name -> data source lookup."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import jax
import numpy as np
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils

from hnclip_jax import paths
from hnclip_jax.data import clustering, manual, staging, synthetic


@dataclasses.dataclass
class SyntheticConfig(tfds.core.BuilderConfig):
  num_train: int = 4096
  num_test: int = 512
  group_size: int = 4
  image_size: int = 64
  seed: int = 0
  captions: str = "dense"


class HnclipSynthetic(tfds.core.GeneratorBasedBuilder):
  """Procedural dense-caption scenes with near-duplicate groups (see `synthetic.py`)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "exact segments: every object's box and the caption sentence that describes it"}
  BUILDER_CONFIGS = [SyntheticConfig(name="default")]

  def _info(self):
    s = self.builder_config.image_size
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(s, s, 3), encoding_format="png"),
            "caption": tfds.features.Text(),
            "image_id": np.int64,
            "group_id": np.int64,
            "segments": manual.SEGMENTS_FEATURE,
        }))

  def _split_generators(self, dl_manager):
    c = self.builder_config
    # Test scenes come from an independent stream so no group straddles the splits.
    return {"train": self._generate_examples(c.num_train, c.seed),
            "test": self._generate_examples(c.num_test, c.seed + 1_000_003)}

  def _generate_examples(self, n, seed):
    c = self.builder_config
    for image_id, png, cap, group, segments in synthetic.generate(n, c.group_size, c.image_size, seed, c.captions):
      yield image_id, {"image": png, "caption": cap, "image_id": image_id, "group_id": group,
                       "segments": manual.segments_feature_value(segments)}


def _synthetic_config(d) -> SyntheticConfig:
  captions = d.get("captions", "dense")
  if captions not in synthetic.CAPTION_STYLES:
    raise ValueError(f"config.data.captions={captions!r}; choose one of {list(synthetic.CAPTION_STYLES)}")
  name = f"tr{d.num_train}_te{d.num_test}_g{d.group_size}_px{d.image_size}_s{d.seed}"
  name += "" if captions == "dense" else f"_{captions}"  # dense keeps the names of existing builds
  return SyntheticConfig(name=name, num_train=d.num_train, num_test=d.num_test, group_size=d.group_size,
                         image_size=d.image_size, seed=d.seed, captions=captions)


def _base(d) -> str:
  return "skip_bad" if d.on_bad_example == "skip" else "default"


def _folder(d) -> str | None:
  """The manual folder's absolute path when it is on this machine, else None."""
  if not d.get("manual_dir"):
    return None
  path = os.path.abspath(os.path.expanduser(d.manual_dir))
  return path if os.path.isdir(path) else None


def _folder_build(d) -> str | None:
  """The build name the files in the manual folder give (`default_<fingerprint>`), None without the folder."""
  folder = _folder(d)
  return None if folder is None else f"{_base(d)}_{manual.input_fingerprint(folder)}"


def _manual_config(d) -> manual.ManualConfig:
  """Keyed on the inputs: a changed or different manual folder is another config, so another build; a build named
  by config.data.build is read by that name, without the folder (pin_build)."""
  name = d.get("build") or _folder_build(d)
  folder = _folder(d)
  return manual.ManualConfig(name=name, on_bad_example=d.on_bad_example,
                             description=f"built from {folder} (input fingerprint {name.rsplit('_', 1)[1]})"
                             if folder else f"build {name}")


def _manual(builder):
  return (builder.name, lambda d: {"config": _manual_config(d)}, True)


# config.data.name -> (TFDS builder name, config.data -> builder kwargs, needs config.data.manual_dir)
DATASETS = {
    "synthetic": (HnclipSynthetic.name, lambda d: {"config": _synthetic_config(d)}, False),
    "docci": _manual(manual.HnclipDocci),
    "dci": _manual(manual.HnclipDci),
    "long_dci": _manual(manual.HnclipLongDci),
    "urban1k": _manual(manual.HnclipUrban1k),
    "pairs": _manual(manual.HnclipPairs),
    "coco": _manual(manual.HnclipCoco),
    "flickr30k": _manual(manual.HnclipFlickr30k),
}


BUCKET_READS = ("stage", "direct")


def reads_in_place(data_config) -> bool:
  """Whether every example is fetched from the bucket when read (config.data.bucket_reads='direct' on a bucket
  data_dir): then a read may wait on the bucket, and what reads a whole split is worth avoiding."""
  return (bool(data_config.get("data_dir")) and not paths.opens_natively(data_config.data_dir)
          and data_config.get("bucket_reads", "stage") == "direct")


def check_data_config(data_config) -> None:
  """Raises naming the config key when the dataset is unknown or its manual folder is not set or missing."""
  if data_config.name not in DATASETS:
    raise ValueError(f"config.data.name={data_config.name!r} is not a known dataset; known: {sorted(DATASETS)}")
  if data_config.get("data_dir"):
    paths.resolve(data_config.data_dir, "config.data.data_dir")  # a store that opens it (a bucket: credentials)
  if data_config.get("manual_dir") and not paths.opens_natively(data_config.manual_dir):
    raise ValueError(f"config.data.manual_dir={data_config.manual_dir}: a builder reads the files you downloaded "
                     "from a local directory. Copy them to a local disk (gcloud storage cp -r "
                     f"{data_config.manual_dir} /data/raw) and pass that; the build itself may go to a bucket, "
                     "config.data.data_dir=gs://… (docs/buckets.md \"Data in a bucket\")")
  if data_config.get("bucket_reads", "stage") not in BUCKET_READS:
    raise ValueError(f"config.data.bucket_reads={data_config.bucket_reads!r}; choose one of {list(BUCKET_READS)}")
  if data_config.get("batching", "random") not in clustering.BATCHINGS:
    raise ValueError(f"config.data.batching={data_config.batching!r}; choose one of {list(clustering.BATCHINGS)}")
  if data_config.on_bad_example not in ("error", "skip"):
    raise ValueError(f"config.data.on_bad_example={data_config.on_bad_example!r}; choose 'error' or 'skip'")
  captions = data_config.get("captions", "dense")
  if captions not in synthetic.CAPTION_STYLES:
    raise ValueError(f"config.data.captions={captions!r}; choose one of {list(synthetic.CAPTION_STYLES)}")
  if captions != "dense" and data_config.name != "synthetic":
    raise ValueError(f"config.data.captions={captions!r} applies to the built-in synthetic data only; "
                     f"config.data.name={data_config.name!r} has its own captions: drop the setting")
  tfds_name, _, manual_needed = DATASETS[data_config.name]
  build = data_config.get("build", "")
  if build and not manual_needed:
    raise ValueError(f"config.data.build={build!r} names a build of a dataset made from downloaded files; "
                     f"config.data.name={data_config.name!r} is not one: drop the setting")
  if build and not build.startswith(_base(data_config) + "_"):
    raise ValueError(f"config.data.build={build!r} was not made with config.data.on_bad_example="
                     f"{data_config.on_bad_example!r} (its builds are named {_base(data_config)}_…): set "
                     "on_bad_example as the build was made, or name another build")
  if manual_needed and not build:
    how = tfds.builder_cls(tfds_name).MANUAL_DOWNLOAD_INSTRUCTIONS
    if not data_config.manual_dir:
      raise ValueError(f"config.data.name={data_config.name!r} is built from files you download by hand: set "
                       f"config.data.manual_dir (what it must hold: above), or config.data.build=NAME to read a "
                       f"build already in config.data.data_dir\n{how}")
    if _folder(data_config) is None:
      path = os.path.abspath(os.path.expanduser(data_config.manual_dir))
      raise FileNotFoundError(f"config.data.manual_dir={data_config.manual_dir!r}: {path} is not a directory. "
                              f"Download the data by hand and point manual_dir at it (what it must hold: above), or "
                              f"set config.data.build=NAME to read a build already in config.data.data_dir\n{how}")


def pin_build(data_config):
  """config.data with `build` named, for a dataset made from downloaded files: the build these inputs read
  (`default_<fingerprint of the manual folder>`; `skip_bad_…` with on_bad_example="skip"). data.json records it at
  a run's first start, so a resume reads that very build — from data_dir, with or without the folder — and a
  changed folder never slips in a different one. Process 0 names it and the other processes take its name: their
  copies of the files (if any) may differ in times, and a pod's other hosts need none when data_dir holds the
  build. Other datasets are returned as they are."""
  if not DATASETS[data_config.name][2] or data_config.get("build"):
    return data_config
  name = error = ""
  if jax.process_index() == 0:
    try:
      check_data_config(data_config)
      name = _folder_build(data_config)
    except (OSError, ValueError) as e:
      error = str(e)
  if jax.process_count() > 1:
    text = (name or "\0" + error).encode()[:4096].ljust(4096, b" ")
    got = multihost_utils.broadcast_one_to_all(np.frombuffer(text, np.uint8))
    got = bytes(np.asarray(got, np.uint8)).decode(errors="replace").rstrip(" ")
    name, error = ("", got[1:] or "?") if got.startswith("\0") else (got, "")
    if error and jax.process_index() != 0:
      raise ValueError(f"process 0 could not name the build of config.data (its error: {error})")
  if error:
    check_data_config(data_config)  # raises it again, with its own type
    raise ValueError(error)
  import ml_collections
  out = ml_collections.ConfigDict(dict(data_config))
  out.build = name
  return out


def _builds_beside(data_path: str, base: str) -> tuple[str, list[str]]:
  """The dataset's folder above a build's data path (DATASET/CONFIG/VERSION) and its builds named BASE_…."""
  parent = paths.dirname(paths.dirname(data_path))
  return parent, sorted(d for d in (paths.listdir(parent) if paths.isdir(parent) else []) if d.startswith(base + "_"))


def _check_buildable(builder, data_config) -> None:
  """Before a manual dataset's build is made: the files in the manual folder must be the ones its name says
  (a build named by config.data.build, or recorded in data.json, is never made from other files)."""
  if not DATASETS[data_config.name][2]:
    return
  build, folder = data_config.build, _folder(data_config)
  now = None if folder is None else f"{_base(data_config)}_{manual.input_fingerprint(folder)}"
  if now == build:
    return
  parent, there = _builds_beside(str(builder.data_path), _base(data_config))
  raise FileNotFoundError(
      f"config.data.build={build}: there is no such build in {parent} (builds there: {', '.join(there) or 'none'}), "
      "and it cannot be made: " + ("config.data.manual_dir (the files to make it from) is not set"
                                   if not data_config.get("manual_dir") else
                                   f"config.data.manual_dir={data_config.manual_dir!r} is not on this machine"
                                   if folder is None else
                                   f"the files in {folder} have changed since it was made (they give {now} now)")
      + ". Point config.data.data_dir at the place that holds the build, restore the files it was made from, or "
      "start a new workdir on the files as they are")


_reported: set = set()


def _report_build(builder, data_config) -> None:
  """Says once per process whether the build for these inputs exists (reused) or is made now, and why."""
  where = str(builder.data_path)
  if where in _reported:
    return
  _reported.add(where)
  name = builder.builder_config.name
  manual_needed = DATASETS[data_config.name][2]
  if builder.is_prepared():
    why = "same settings"
    if manual_needed:
      now = _folder_build(data_config)
      why = (f"config.data.build={name}; its files are not on this machine" if now is None else
             f"manual folder {data_config.manual_dir} unchanged" if now == name else
             f"config.data.build={name}; the files in {data_config.manual_dir} have changed since, and are not read")
    print(f"data: reusing the {builder.name} build in {where} ({why})", flush=True)
    return
  reason = "no build for these inputs yet"
  if manual_needed:
    parent, others = _builds_beside(where, name.rsplit("_", 1)[0])
    others = [d for d in others if d != name]
    if others:
      reason = (f"the manual folder {data_config.manual_dir} differs from what the earlier build(s) "
                f"{', '.join(others)} in {parent} were made from (files, sizes, times or index contents)")
    reason += f"; config.data.build={name} reads it without the files"
  print(f"data: building {builder.name} into {where}: {reason}", flush=True)


def num_examples(data_config, split: str) -> int | None:
  """How many examples `split` of the build for these inputs holds; None when it is not built (builds nothing)."""
  try:
    check_data_config(data_config)
  except (ValueError, FileNotFoundError):
    return None
  tfds_name, kwargs, _ = DATASETS[data_config.name]
  if data_config.data_dir:
    paths.prepare(data_config.data_dir)  # TFDS opens a bucket through gcsfs: with this package's retry rules
  builder = tfds.builder(tfds_name, data_dir=data_config.data_dir or None, **kwargs(data_config),
                         file_format="array_record")
  if not builder.is_prepared() or split not in builder.info.splits:
    return None
  return int(builder.info.splits[split].num_examples)


def _build_into_bucket(tfds_name: str, data_dir: str, builder_kwargs: dict, prepare: dict) -> None:
  """Builds in a local temporary directory and uploads the build to bucket `data_dir`: TFDS writes array_record
  through array_record's C++ writer, which opens local files only (tried: "open() failed ... gs://…"). Its
  dataset_info.json goes last — TFDS takes a build as complete once that file is there, so a reader (another host,
  a rerun after a failed upload) never takes a half-uploaded build for a whole one."""
  with tempfile.TemporaryDirectory(prefix="hnclip_jax-build-") as local:
    tfds.builder(tfds_name, data_dir=local, **builder_kwargs).download_and_prepare(**prepare)
    paths.upload_tree(local, data_dir, last=("dataset_info.json",))


def data_source(data_config, split: str, decode_images: bool = True):
  """Random-access source of `split` (prepared on first use): dicts with image uint8 [H,W,3], caption bytes, image_id.
  config.data.data_dir may be a bucket (gs://…): the build is made locally and uploaded there once (process 0),
  and every process stages it into its own local cache (data/staging.py) and reads it there."""
  check_data_config(data_config)
  data_config = pin_build(data_config)
  tfds_name, kwargs, manual_needed = DATASETS[data_config.name]
  builder_kwargs = {**kwargs(data_config), "file_format": "array_record"}
  prepare = {}
  if manual_needed:
    prepare = {"download_config": tfds.download.DownloadConfig(manual_dir=os.path.expanduser(data_config.manual_dir))}
  # A store TFDS's array_record files cannot be written or read in place (a bucket): the build is made locally and
  # uploaded, and each process reads a staged copy.
  in_bucket = bool(data_config.data_dir) and not paths.opens_natively(data_config.data_dir)
  if in_bucket:
    paths.prepare(data_config.data_dir)  # before TFDS opens the bucket (gcsfs) and array_record's reader does
    root = paths.root(data_config.data_dir)
    if not paths.exists(root):  # refused here, before anything is built or compiled
      raise FileNotFoundError(f"config.data.data_dir={data_config.data_dir}: "
                              f"{paths.describe_error(root, FileNotFoundError(root))}")
  if jax.process_index() == 0:
    builder = tfds.builder(tfds_name, data_dir=data_config.data_dir or None, **builder_kwargs)
    if not builder.is_prepared():
      _check_buildable(builder, data_config)  # before the line that says it builds
    _report_build(builder, data_config)
    if in_bucket and not builder.is_prepared():
      _build_into_bucket(tfds_name, data_config.data_dir, builder_kwargs, prepare)
  if jax.process_count() > 1:  # one process prepares, the others wait and then only read
    if jax.process_index() == 0:
      tfds.builder(tfds_name, data_dir=data_config.data_dir or None, **builder_kwargs).download_and_prepare(**prepare)
    multihost_utils.sync_global_devices(f"prepared {tfds_name}")
  read_from = data_config.data_dir or None
  if reads_in_place(data_config):  # each example fetched when read: every process only its own
    if (data_config.data_dir, "direct") not in _reported:
      _reported.add((data_config.data_dir, "direct"))
      print(f"data: reading {data_config.data_dir} in place (config.data.bucket_reads='direct'): each process fetches "
            "only the examples it reads, one request each (docs/buckets.md \"Data in a bucket\")", flush=True)
  elif in_bucket:  # every process copies the build to its own disk once (data/staging.py), and reads it there
    remote = str(tfds.builder(tfds_name, data_dir=data_config.data_dir, **builder_kwargs).data_path)
    try:
      read_from, fetched, reused = staging.stage(data_config.data_dir, remote)
    except paths.Unreachable as e:
      raise paths.Unreachable(f"staging the data in {data_config.data_dir}: {e}") from None
    if (remote, read_from) not in _reported:
      _reported.add((remote, read_from))
      print(f"data: {remote} staged in {read_from} ({fetched / 1e6:.1f} MB fetched, {reused / 1e6:.1f} MB "
            "already there)", flush=True)
  try:
    sources = tfds.data_source(
        tfds_name, data_dir=read_from, builder_kwargs=builder_kwargs,
        download_and_prepare_kwargs=prepare,
        decoders=None if decode_images else {"image": tfds.decode.SkipDecoding()})
  except AssertionError as e:  # TFDS reports a missing/empty manual directory this way
    if "Manual directory" in str(e):
      raise FileNotFoundError(f"config.data.manual_dir: {e}") from None
    raise
  if split not in sources:
    raise ValueError(f"split {split!r} does not exist in dataset {data_config.name!r}; available: {sorted(sources)}")
  return sources[split]
