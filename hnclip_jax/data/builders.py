"""TFDS builders (array_record files, no TensorFlow) and a name -> data source lookup."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils

from hnclip_jax.data import synthetic


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


# config.data.name -> (TFDS builder name, function of config.data -> builder kwargs)
DATASETS = {
    "synthetic": (HnclipSynthetic.name, lambda d: {"config": _synthetic_config(d)}),
}


def data_source(data_config, split: str, decode_images: bool = True):
  """Random-access source of `split` (prepared on first use): dicts with image uint8 [H,W,3], caption bytes, image_id."""
  if data_config.name not in DATASETS:
    raise ValueError(f"config.data.name={data_config.name!r} is not a known dataset; known: {sorted(DATASETS)}")
  tfds_name, kwargs = DATASETS[data_config.name]
  builder_kwargs = {**kwargs(data_config), "file_format": "array_record"}
  if jax.process_count() > 1:  # one process prepares, the others wait and then only read
    if jax.process_index() == 0:
      tfds.builder(tfds_name, data_dir=data_config.data_dir or None, **builder_kwargs).download_and_prepare()
    multihost_utils.sync_global_devices(f"prepared {tfds_name}")
  sources = tfds.data_source(
      tfds_name, data_dir=data_config.data_dir or None, builder_kwargs=builder_kwargs,
      decoders=None if decode_images else {"image": tfds.decode.SkipDecoding()})
  if split not in sources:
    raise ValueError(f"split {split!r} does not exist in dataset {data_config.name!r}; available: {sorted(sources)}")
  return sources[split]
