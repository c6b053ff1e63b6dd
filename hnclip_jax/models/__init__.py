"""CLIP model definitions (clip.py) and LoRA / DoRA adapters as parameters (adapters.py)."""
from hnclip_jax.models.adapters import init_params
from hnclip_jax.models.clip import CLIP, CLIPConfig, abstract_model, bind, split_params
from hnclip_jax.models.family import PRESETS

__all__ = ["CLIP", "CLIPConfig", "PRESETS", "abstract_model", "bind", "init_params", "split_params"]
