"""TFDS builders (array_record files, no TensorFlow) and a name -> data source lookup."""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

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


def synthetic_builder(data_dir: str, num_train: int, num_test: int, group_size: int, image_size: int, seed: int):
  name = f"tr{num_train}_te{num_test}_g{group_size}_px{image_size}_s{seed}"
  cfg = SyntheticConfig(name=name, num_train=num_train, num_test=num_test, group_size=group_size,
                        image_size=image_size, seed=seed)
  return HnclipSynthetic(config=cfg, data_dir=data_dir or None, file_format="array_record")


def get_builder(data_config):
  """Returns the TFDS builder that `config.data` names (prepared on first use)."""
  if data_config.name == "synthetic":
    return synthetic_builder(data_config.data_dir, data_config.num_train, data_config.num_test,
                             data_config.group_size, data_config.image_size, data_config.seed)
  raise ValueError(f"config.data.name={data_config.name!r} is not a known dataset; known: ['synthetic']")


def data_source(data_config, split: str, decode_images: bool = True):
  """Random-access source of `split`: items are dicts with image (uint8 [H,W,3]), caption (bytes), image_id."""
  builder = get_builder(data_config)
  builder.download_and_prepare()
  if split not in builder.info.splits:
    raise ValueError(f"split {split!r} does not exist in dataset {data_config.name!r}; "
                     f"available: {sorted(builder.info.splits)}")
  decoders = None if decode_images else {"image": tfds.decode.SkipDecoding()}
  return builder.as_data_source(split=split, decoders=decoders)
