"""CLIP towers against a NumPy re-implementation of the OpenAI-CLIP forward pass, plus structural checks."""
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import openai_bpe
from hnclip_jax.models import CLIPConfig, PRESETS, abstract_model, bind, init_params
from hnclip_jax.models.clip_family import CLIPFamily
from hnclip_jax.models.family import Family

CFG = CLIPConfig(embed_dim=24, image_size=16, patch_size=4, vision_width=32, vision_layers=2, vision_heads=4,
                 vision_mlp_dim=48, text_context=12, vocab_size=50, text_width=32, text_layers=2, text_heads=2,
                 text_mlp_dim=40, eot_token_id=3)


def np_ln(x, p, eps=1e-5):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_block(x, p, heads, causal, act):
  def lin(h, q):
    return h @ q["kernel"] + q["bias"]
  h = np_ln(x, p["ln1"])
  b, l, w = h.shape
  q, k, v = (lin(h, p["attn"][n]).reshape(b, l, heads, w // heads).transpose(0, 2, 1, 3) for n in "qkv")
  s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(w // heads)
  if causal:
    s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
  a = np.exp(s - s.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  o = (a @ v).transpose(0, 2, 1, 3).reshape(b, l, w)
  x = x + lin(o, p["attn"]["out"])
  h = lin(np_ln(x, p["ln2"]), p["fc1"])
  h = h / (1 + np.exp(-1.702 * h)) if act == "quick_gelu" else 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
  return x + lin(h, p["fc2"])


def np_encode_image(p, cfg, pixels):
  b, n = pixels.shape[0], cfg.image_size // cfg.patch_size
  ps = cfg.patch_size
  patches = pixels.reshape(b, n, ps, n, ps, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, n * n, ps * ps * 3)
  x = patches @ p["patch_embed"]["kernel"].reshape(ps * ps * 3, -1)
  x = np.concatenate([np.broadcast_to(p["class_embedding"], (b, 1, x.shape[-1])), x], 1) + p["vision_positions"]
  x = np_ln(x, p["ln_pre"])
  for i in range(cfg.vision_layers):
    x = np_block(x, p["vision"]["blocks"][i], cfg.vision_heads, False, cfg.act)
  f = np_ln(x[:, 0], p["ln_post"]) @ p["visual_projection"]
  return f / np.linalg.norm(f, axis=-1, keepdims=True)


def np_encode_text(p, cfg, tokens):
  x = p["token_embedding"]["embedding"][tokens] + p["text_positions"][:tokens.shape[1]]
  for i in range(cfg.text_layers):
    x = np_block(x, p["text"]["blocks"][i], cfg.text_heads, True, cfg.act)
  x = np_ln(x, p["ln_final"])
  eot = np.argmax(tokens == cfg.eot_token_id, axis=1)
  f = x[np.arange(len(tokens)), eot] @ p["text_projection"]
  return f / np.linalg.norm(f, axis=-1, keepdims=True)


def _tokens(rng, n, cfg):
  toks = np.zeros((n, cfg.text_context), np.int32)
  for i in range(n):
    length = rng.integers(2, cfg.text_context - 1)
    toks[i, 0] = 2
    toks[i, 1:length] = rng.integers(4, cfg.vocab_size, length - 1)
    toks[i, length] = cfg.eot_token_id
  return toks


@pytest.fixture(scope="module", params=["quick_gelu", "gelu"])
def model(request):
  cfg = CLIPConfig(**{**CFG.__dict__, "act": request.param})
  graphdef, params = init_params(cfg, 0)
  return cfg, graphdef, params


def test_matches_numpy_reference(model):
  cfg, graphdef, params = model
  rng = np.random.default_rng(0)
  pixels = rng.normal(size=(3, cfg.image_size, cfg.image_size, 3)).astype(np.float32)
  tokens = _tokens(rng, 4, cfg)
  m = bind(graphdef, params)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  np.testing.assert_allclose(m.encode_image(pixels), np_encode_image(p, cfg, pixels.astype(np.float64)), atol=2e-5)
  np.testing.assert_allclose(m.encode_text(tokens), np_encode_text(p, cfg, tokens), atol=2e-5)


def test_text_is_causal_and_pooled_at_eot(model):
  cfg, graphdef, params = model
  m = bind(graphdef, params)
  tokens = _tokens(np.random.default_rng(1), 2, cfg)
  eot = int(np.argmax(tokens[0] == cfg.eot_token_id))
  after = tokens.copy()
  after[0, eot + 1:] = 7  # tokens after the end-of-text token cannot matter
  before = tokens.copy()
  before[0, 1] = 5 if tokens[0, 1] != 5 else 6
  base = np.asarray(m.encode_text(tokens))
  np.testing.assert_allclose(m.encode_text(after), base, atol=1e-6)
  assert np.abs(np.asarray(m.encode_text(before))[0] - base[0]).max() > 1e-4


def test_embeddings_are_unit_norm_and_scale_is_clip_init(model):
  cfg, graphdef, params = model
  m = bind(graphdef, params)
  e = np.asarray(m.encode_image(np.ones((2, cfg.image_size, cfg.image_size, 3), np.float32)))
  np.testing.assert_allclose(np.linalg.norm(e, axis=-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(m.scale(), 1 / 0.07, rtol=1e-5)
  big = dict(params, logit_scale=jnp.float32(10.0))
  # Not clamped in the forward pass (that would zero its gradient at the bound); train_step clamps the parameter.
  np.testing.assert_allclose(float(bind(graphdef, big).scale()), np.exp(10.0), rtol=1e-6)


@pytest.mark.parametrize("preset,millions", [("vit_b16", 149.62), ("vit_l14", 427.62)])
def test_preset_sizes_match_openai_clip(preset, millions):
  """OpenAI CLIP ViT-B/16 has 149.62M and ViT-L/14 427.62M parameters (as open_clip reports)."""
  _, params = abstract_model(PRESETS[preset])
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert abs(n / 1e6 - millions) < 0.005, n


def test_long_context_preset_builds():
  cfg = CLIPConfig(**{**PRESETS["vit_l14"].__dict__, "text_context": 248})
  _, params = abstract_model(cfg)
  assert params["text_positions"].shape == (248, 768)


@pytest.mark.parametrize("changes", [{}, {"adapter": "lora", "adapter_rank": 4}, {"adapter": "dora", "adapter_rank": 4},
                                     {"token_projection": "separate"}, {"family": "siglip", "logit_bias": True, "embed_dim": 32},
                                     {"parts": "hnclip_jax.frameworks.finelip:model_parts",
                                      "part_settings": (("hidden_ratio", 0.5), ("tokens", 4))}])
def test_abstract_model_is_what_flax_builds(changes):
  """abstract_model builds with shape-only rngs (nnx.Rngs made it quadratic in the model's size): the same graphdef
  and parameter shapes and dtypes as the build with flax's own nnx.Rngs, for every family, adapter and part."""
  from flax import nnx
  from hnclip_jax.models.clip import CLIP, split_params
  cfg = dataclasses.replace(CFG, **changes).validate()
  g1, p1 = abstract_model(cfg)
  g2, p2 = split_params(nnx.eval_shape(lambda: CLIP(cfg, rngs=nnx.Rngs(0))))
  assert g1 == g2
  assert jax.tree.map(lambda x: (x.shape, x.dtype), p1) == jax.tree.map(lambda x: (x.shape, x.dtype), p2)
  assert jax.tree.structure(p1) == jax.tree.structure(init_params(cfg, 0)[1])


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="vision_width=30 is not divisible by config.model.vision_heads=4"):
    CLIPConfig(**{**CFG.__dict__, "vision_width": 30}).validate()
  with pytest.raises(ValueError, match=r"config.model.text_layers=0 must be positive"):
    CLIPConfig(**{**CFG.__dict__, "text_layers": 0}).validate()
  with pytest.raises(ValueError, match="act='relu'"):
    CLIPConfig(**{**CFG.__dict__, "act": "relu"}).validate()


def test_model_and_tokenizer_agree_before_anything_compiles(tmp_path):
  """Every preset × tokenizer kind (a word tokenizer fitted on captions, OpenAI's CLIP BPE, a converted directory's
  tokenizer read back): the preset's CLIP ids are accepted only with a tokenizer that ends captions with them;
  0 / -1 take the tokenizer's. Without that check the default `configs/longclip_l.py` (no weights, the built-in
  word tokenizer, end token 3) pooled every caption at position 0: identical text embeddings from step 1."""
  from configs import longclip_l
  from hnclip_jax import config as config_lib, experiment
  from hnclip_jax.data.tokenizer import WordTokenizer
  from hnclip_jax.data.clip_tokenizer import CLIPTokenizer
  from hnclip_jax.workdir import read_tokenizer, write_tokenizer
  word = WordTokenizer.fit(["a small red circle left of a blue square", "a green triangle"], context_length=77)
  if not os.path.exists(openai_bpe.path()):
    raise FileNotFoundError(openai_bpe.missing_message(openai_bpe.path()))
  bpe = CLIPTokenizer.from_openai_bpe(openai_bpe.path(), 77)
  write_tokenizer(str(tmp_path), bpe)
  converted = read_tokenizer(str(tmp_path))
  assert (word.eot_id, bpe.eot_id, converted.eot_id) == (3, 49407, 49407)

  def config(preset, **model):
    c = config_lib.base_config()
    c.model = config_lib.model_config(preset, **model)
    return c
  for preset in ("tiny", "vit_b16", "vit_l14"):
    for tok in (word, bpe, converted):
      if tok.eot_id == PRESETS[preset].eot_token_id:
        cfg = experiment.model_config(config(preset), tok)
        assert (cfg.vocab_size, cfg.eot_token_id) == (49408, 49407)
      else:
        with pytest.raises(ValueError, match=rf"config.model.eot_token_id=49407 is not the end token of the "
                                             rf"{tok.kind} tokenizer \(3; .*set --config.model.eot_token_id=-1 "
                                             r"--config.model.vocab_size=0"):
          experiment.model_config(config(preset), tok)
      cfg = experiment.model_config(config(preset, vocab_size=0, eot_token_id=-1), tok)
      assert cfg.eot_token_id == tok.eot_id and tok.vocab_size <= cfg.vocab_size < tok.vocab_size + 128
  # The paper's config without init_from (the README's `train.py --config configs/longclip_l.py`): the tokenizer's
  # ids, at ViT-L/14's real shapes.
  cfg = experiment.model_config(longclip_l.get_config(), word)
  assert (cfg.eot_token_id, cfg.vocab_size, cfg.text_context) == (3, 128, 248)
  _, abstract = abstract_model(cfg)
  assert abstract["token_embedding"]["embedding"].shape == (128, 768)


class BidirectionalCLIP(CLIPFamily):
  """A family defined outside the package: OpenAI CLIP's towers with bidirectional text attention, and a size of
  its own (it inherits CLIP's preprocessing and sharding rules, not its presets or Hugging Face mapping)."""
  name = "clip_bidirectional"
  causal_text = False
  presets = {"tiny_bidirectional": dataclasses.replace(CLIPFamily.presets["tiny"], family="clip_bidirectional")}


class NoPixels(CLIPFamily):
  """A family that says nothing about images: refused."""
  preprocess = Family.preprocess


def test_model_families_are_chosen_by_name(monkeypatch):
  """CLIPConfig.family names the module that builds the family's parts (hnclip_jax/models/family.py): an unknown
  name is refused naming the registered ones, and a family registered from outside builds and runs with nothing
  else changed — CLIP's parameters (same names, same initial values), the same image embedding, and text embeddings
  that differ only through its own choice (attention that also looks at later tokens)."""
  from hnclip_jax.models import family
  with pytest.raises(ValueError, match=r"config.model.family='eva'; choose one of \['clip', 'siglip'\]"):
    dataclasses.replace(PRESETS["tiny"], family="eva").validate()
  monkeypatch.setitem(family.REGISTRY, "clip_bidirectional", "test_model:BidirectionalCLIP")
  monkeypatch.setattr(family, "_LOADED", {})
  base = dataclasses.replace(PRESETS["tiny"], vocab_size=64, eot_token_id=63)
  mine = dataclasses.replace(base, family="clip_bidirectional").validate()
  (g0, p0), (g1, p1) = init_params(base, 0), init_params(mine, 0)
  assert jax.tree.all(jax.tree.map(np.array_equal, p0, p1))
  rng = np.random.default_rng(0)
  pixels = rng.normal(size=(2, base.image_size, base.image_size, 3)).astype(np.float32)
  tokens = np.zeros((2, base.text_context), np.int32)
  tokens[:, :5] = [[1, 7, 9, 63, 0], [1, 8, 63, 0, 0]]
  tokens[:, 6:] = 5  # after the end token: a causal tower never sees it, a bidirectional one does
  a, b = bind(g0, p0), bind(g1, p1)
  np.testing.assert_array_equal(a.encode_image(pixels), b.encode_image(pixels))
  assert not np.allclose(a.encode_text(tokens), b.encode_text(tokens), atol=1e-4)
  changed = tokens.copy()
  changed[:, 6:] = 9
  np.testing.assert_array_equal(a.encode_text(tokens), a.encode_text(changed))
  assert not np.allclose(b.encode_text(tokens), b.encode_text(changed), atol=1e-4)
  # Everything else of a family comes from it too: its presets join PRESETS, the input pipeline preprocesses with
  # the family's own function, and the Hugging Face / OpenAI formats it does not declare are refused by name.
  from hnclip_jax.data import pipeline
  from hnclip_jax.pretrained import export
  assert PRESETS["tiny_bidirectional"].family == "clip_bidirectional" and "tiny" in PRESETS
  image = rng.integers(0, 255, size=(40, 50, 3)).astype(np.uint8)
  for got, want in zip(pipeline.pixels_of(image, 32, "clip_bidirectional"), pipeline.pixels_of(image, 32, "clip")):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="model family 'clip_bidirectional' has no Hugging Face mapping"):
    family.hf("clip_bidirectional")
  with pytest.raises(ValueError, match="a clip_bidirectional model cannot be written in the OpenAI CLIP format"):
    export.openai_state_dict(p1, mine)
  monkeypatch.setitem(family.REGISTRY, "no_pixels", "test_model:NoPixels")
  with pytest.raises(ValueError, match=r"model family 'no_pixels' \(test_model:NoPixels\) lacks preprocess"):
    family.get("no_pixels")
