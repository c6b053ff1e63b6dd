"""CLIP model definitions."""
from hnclip_jax.models.clip import (CLIP, CLIPConfig, PRESETS, abstract_model, bind, init_params, split_params)

__all__ = ["CLIP", "CLIPConfig", "PRESETS", "abstract_model", "bind", "init_params", "split_params"]
