"""Image primitives the model families' preprocessing is made of (models/*_family.py `preprocess`): PIL and NumPy
only."""
from __future__ import annotations

import numpy as np
from PIL import Image


# OpenAI CLIP's pixel statistics (RGB, [0, 1] scale).
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def resize_center_crop(image, size: int) -> np.ndarray:
  """PIL image or uint8 [H, W, 3|1] -> uint8 [size, size, 3]: short side to `size` (bicubic), centre crop."""
  img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image).squeeze())
  img = img.convert("RGB")
  w, h = img.size
  if (w, h) != (size, size):
    if w <= h:
      new_w, new_h = size, int(size * h / w)
    else:
      new_w, new_h = int(size * w / h), size
    img = img.resize((new_w, new_h), Image.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    img = img.crop((left, top, left + size, top + size))
  return np.asarray(img, np.uint8)


def normalize(image: np.ndarray) -> np.ndarray:
  """uint8 [H, W, 3] -> float32 [H, W, 3]: scaled to [0, 1], then CLIP mean/std."""
  return (np.asarray(image, np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD


def resize_square(image, size: int) -> np.ndarray:
  """PIL image or uint8 [H, W, 3|1] -> uint8 [size, size, 3]: the whole image resized to size x size (bicubic, no
  crop; SigLIP's processor)."""
  img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image).squeeze())
  img = img.convert("RGB")
  if img.size != (size, size):
    img = img.resize((size, size), Image.BICUBIC)
  return np.asarray(img, np.uint8)
