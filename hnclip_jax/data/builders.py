"""TFDS builders (array_record files, no TensorFlow) and a name -> data source lookup."""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils

from hnclip_jax.data import manual, synthetic


@dataclasses.dataclass
class SyntheticConfig(tfds.core.BuilderConfig):
  num_train: int = 4096
  num_test: int = 512
  group_size: int = 4
  image_size: int = 64
  seed: int = 0


class HnclipSynthetic(tfds.core.GeneratorBasedBuilder):
  """Procedural dense-caption scenes with near-duplicate groups (see `synthetic.py`)."""

  VERSION = tfds.core.Version("1.0.0")
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
        }))

  def _split_generators(self, dl_manager):
    c = self.builder_config
    # Test scenes come from an independent stream so no group straddles the splits.
    return {"train": self._generate_examples(c.num_train, c.seed),
            "test": self._generate_examples(c.num_test, c.seed + 1_000_003)}

  def _generate_examples(self, n, seed):
    c = self.builder_config
    for image_id, png, cap, group in synthetic.generate(n, c.group_size, c.image_size, seed):
      yield image_id, {"image": png, "caption": cap, "image_id": image_id, "group_id": group}


def _synthetic_config(d) -> SyntheticConfig:
  name = f"tr{d.num_train}_te{d.num_test}_g{d.group_size}_px{d.image_size}_s{d.seed}"
  return SyntheticConfig(name=name, num_train=d.num_train, num_test=d.num_test, group_size=d.group_size,
                         image_size=d.image_size, seed=d.seed)


def _manual(builder):
  return (builder.name, lambda d: {"config": "skip_bad" if d.on_bad_example == "skip" else "default"}, True)


# config.data.name -> (TFDS builder name, config.data -> builder kwargs, needs config.data.manual_dir)
DATASETS = {
    "synthetic": (HnclipSynthetic.name, lambda d: {"config": _synthetic_config(d)}, False),
    "docci": _manual(manual.HnclipDocci),
    "dci": _manual(manual.HnclipDci),
    "long_dci": _manual(manual.HnclipLongDci),
    "urban1k": _manual(manual.HnclipUrban1k),
    "pairs": _manual(manual.HnclipPairs),
}


def data_source(data_config, split: str, decode_images: bool = True):
  """Random-access source of `split` (prepared on first use): dicts with image uint8 [H,W,3], caption bytes, image_id."""
  if data_config.name not in DATASETS:
    raise ValueError(f"config.data.name={data_config.name!r} is not a known dataset; known: {sorted(DATASETS)}")
  tfds_name, kwargs, manual_needed = DATASETS[data_config.name]
  if data_config.on_bad_example not in ("error", "skip"):
    raise ValueError(f"config.data.on_bad_example={data_config.on_bad_example!r}; choose 'error' or 'skip'")
  builder_kwargs = {**kwargs(data_config), "file_format": "array_record"}
  prepare = {}
  if manual_needed:
    if not data_config.manual_dir:
      raise ValueError(f"config.data.name={data_config.name!r} is built from files you download by hand: set "
                       f"config.data.manual_dir.\n{tfds.builder_cls(tfds_name).MANUAL_DOWNLOAD_INSTRUCTIONS}")
    prepare = {"download_config": tfds.download.DownloadConfig(manual_dir=os.path.expanduser(data_config.manual_dir))}
  if jax.process_count() > 1:  # one process prepares, the others wait and then only read
    if jax.process_index() == 0:
      tfds.builder(tfds_name, data_dir=data_config.data_dir or None, **builder_kwargs).download_and_prepare(**prepare)
    multihost_utils.sync_global_devices(f"prepared {tfds_name}")
  try:
    sources = tfds.data_source(
        tfds_name, data_dir=data_config.data_dir or None, builder_kwargs=builder_kwargs,
        download_and_prepare_kwargs=prepare,
        decoders=None if decode_images else {"image": tfds.decode.SkipDecoding()})
  except AssertionError as e:  # TFDS reports a missing/empty manual directory this way
    if "Manual directory" in str(e):
      raise FileNotFoundError(f"config.data.manual_dir: {e}") from None
    raise
  if split not in sources:
    raise ValueError(f"split {split!r} does not exist in dataset {data_config.name!r}; available: {sorted(sources)}")
  return sources[split]
