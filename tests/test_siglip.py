"""SigLIP towers (CLIPConfig.family="siglip") against transformers.SiglipModel (PyTorch, CPU): embeddings, logits and
the sigmoid loss of small random models saved in the Hugging Face format; nothing is downloaded."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need torch==2.13.0 (tests/requirements.txt)")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hnclip_jax import losses, pretrained, sharding  # noqa: E402
from hnclip_jax.models import CLIP, CLIPConfig, PRESETS, split_params  # noqa: E402
from hnclip_jax.pretrained import weights  # noqa: E402


def hf_siglip(seed=0, context=12, vocab=300, act="gelu_pytorch_tanh", layers=(2, 2)):
  """A tiny random SiglipModel, every weight moved off its initial value (so a mixed-up weight cannot hide)."""
  torch.manual_seed(seed)
  cfg = transformers.SiglipConfig(
      text_config=dict(vocab_size=vocab, hidden_size=40, intermediate_size=56, num_hidden_layers=layers[1],
                       num_attention_heads=4, max_position_embeddings=context, hidden_act=act, eos_token_id=1,
                       pad_token_id=1, projection_size=48),
      vision_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=layers[0], num_attention_heads=6,
                         image_size=32, patch_size=8, hidden_act=act))
  model = transformers.SiglipModel(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
    model.logit_scale.fill_(np.log(10.0) + 0.3)
    model.logit_bias.fill_(-7.5)
  return model


def inputs(context=12, vocab=300, n=5, seed=0):
  r = np.random.default_rng(seed)
  pixels = r.normal(size=(n, 32, 32, 3)).astype(np.float32)
  ids = r.integers(2, vocab, size=(n, context))
  for i, length in enumerate(r.integers(3, context, size=n)):  # text, then "</s>", then padding with "</s>"
    ids[i, length:] = 1
  return pixels, ids.astype(np.int32)


def hf_outputs(model, pixels, ids):
  with torch.no_grad():
    out = model(pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2), input_ids=torch.from_numpy(ids).long(),
                return_loss=True)
  return {k: getattr(out, k).numpy() for k in ("image_embeds", "text_embeds", "logits_per_image", "loss")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("siglip")
  model = hf_siglip()
  model.save_pretrained(d)
  return str(d), model


def test_siglip_directory_parity(saved):
  """pretrained.load reads a SiglipModel directory; image and text embeddings, the logits t·cos + b and the
  sigmoid loss equal transformers' (<= 1e-5)."""
  directory, model = saved
  pm = pretrained.load(directory)
  cfg = pm.config
  assert (cfg.family, cfg.logit_bias, cfg.act, cfg.embed_dim, cfg.text_context) == ("siglip", True, "gelu_tanh", 48,
                                                                                      12)
  pixels, ids = inputs()
  want = hf_outputs(model, pixels, ids)
  img, txt = pm.encode_pixels(pixels), pm.encode_tokens(ids)
  np.testing.assert_allclose(img, want["image_embeds"], atol=1e-5)
  np.testing.assert_allclose(txt, want["text_embeds"], atol=1e-5)
  scale, bias = np.exp(float(pm.params["logit_scale"])), float(pm.params["logit_bias"])
  np.testing.assert_allclose(scale * img @ txt.T + bias, want["logits_per_image"], atol=1e-4)
  loss = losses.siglip_loss(jnp.asarray(img), jnp.asarray(txt), scale, bias)
  np.testing.assert_allclose(float(loss), float(want["loss"]), rtol=1e-5)


def test_siglip_training_outputs_and_tokens(saved):
  """The training forward pass gives the same embeddings and carries b; the token term's features are the final
  norm's tokens (through the text head for captions) and the real-token mask ends at the first "</s>"."""
  directory, model = saved
  pm = pretrained.load(directory)
  pixels, ids = inputs()
  m = jax.tree.map(jnp.asarray, pm.params)
  from hnclip_jax.models import bind
  out = bind(pm.graphdef, m)(jnp.asarray(pixels), jnp.asarray(ids), token_layer=-1)
  np.testing.assert_allclose(out["img"], pm.encode_pixels(pixels), atol=1e-6)
  np.testing.assert_allclose(float(out["bias"]), -7.5, atol=1e-6)
  assert out["img_tokens"].shape == (5, 16, 48) and out["txt_tokens"].shape == (5, 12, 48)
  first_eos = np.argmax(ids == 1, axis=1)
  np.testing.assert_array_equal(out["txt_mask"], np.arange(12)[None] <= first_eos[:, None])
  with torch.no_grad():
    hv = model.vision_model(pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2)).last_hidden_state.numpy()
    ht = model.text_model(input_ids=torch.from_numpy(ids).long()).last_hidden_state
    ht = model.text_model.head(ht).numpy()
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  np.testing.assert_allclose(out["img_tokens"], unit(hv), atol=1e-5)
  np.testing.assert_allclose(out["txt_tokens"], unit(ht), atol=1e-5)


def test_siglip_gradients_match_transformers(saved):
  """The sigmoid loss's gradients through both towers, t and b equal PyTorch's autograd of SiglipModel."""
  directory, model = saved
  pm = pretrained.load(directory)
  pixels, ids = inputs(n=4, seed=1)
  from hnclip_jax.models import bind

  def loss_fn(params):
    out = bind(pm.graphdef, params)(jnp.asarray(pixels), jnp.asarray(ids))
    return losses.siglip_loss(out["img"], out["txt"], out["scale"], out["bias"])

  grads = jax.grad(loss_fn)(jax.tree.map(jnp.asarray, pm.params))
  model.zero_grad()
  out = model(pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2), input_ids=torch.from_numpy(ids).long(),
              return_loss=True)
  out.loss.backward()
  named = dict(model.named_parameters())
  pairs = {("logit_bias",): "logit_bias", ("logit_scale",): "logit_scale",
           ("vision_head", "probe"): "vision_model.head.probe",
           ("text_head", "kernel"): "text_model.head.weight",
           ("vision", "blocks", 1, "fc2", "kernel"): "vision_model.encoder.layers.1.mlp.fc2.weight",
           ("text", "blocks", 0, "attn", "q", "kernel"): "text_model.encoder.layers.0.self_attn.q_proj.weight",
           ("patch_embed", "bias"): "vision_model.embeddings.patch_embedding.bias"}
  for path, name in pairs.items():
    g = grads
    for k in path:
      g = g[k]
    want = named[name].grad.numpy()
    want = want.T if name.endswith(".weight") and want.ndim == 2 else want.reshape(np.shape(g))
    np.testing.assert_allclose(np.asarray(g), want, rtol=2e-4, atol=1e-6, err_msg=name)


def test_siglip_config_is_refused_with_reasons():
  with pytest.raises(ValueError, match="embed_dim=32 must equal vision_width=48"):
    CLIPConfig(family="siglip", embed_dim=32, vision_width=48, vision_heads=4).validate()
  with pytest.raises(ValueError, match="family='sigmoid'"):
    CLIPConfig(family="sigmoid").validate()
  with pytest.raises(ValueError, match="vision_use_head=false"):
    weights.hf_siglip_config({"vision_config": {"vision_use_head": False}}, "x/config.json")
  with pytest.raises(ValueError, match="projection_size=32 differs"):
    weights.hf_siglip_config({"vision_config": {"hidden_size": 48}, "text_config": {"projection_size": 32}}, "c")


@pytest.mark.parametrize("name", ["siglip_b16_224", "siglip_b16_256", "siglip_l16_256", "siglip_so400m14_384"])
def test_siglip_presets_have_the_published_shapes(name):
  """Parameter counts of the presets against the published model sizes (transformers' SiglipModel of the same
  configuration, built on the meta device: no memory, no download)."""
  cfg = PRESETS[name]
  ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      split_params(__import__("flax").nnx.eval_shape(lambda: CLIP(cfg, rngs=__import__("flax").nnx.Rngs(0))))[1]))
  hf = transformers.SiglipConfig(
      text_config=dict(vocab_size=cfg.vocab_size, hidden_size=cfg.text_width, intermediate_size=cfg.text_mlp_dim,
                       num_hidden_layers=cfg.text_layers, num_attention_heads=cfg.text_heads,
                       max_position_embeddings=cfg.text_context),
      vision_config=dict(hidden_size=cfg.vision_width, intermediate_size=cfg.vision_mlp_dim,
                         num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.vision_heads,
                         image_size=cfg.image_size, patch_size=cfg.patch_size))
  with torch.device("meta"):
    want = sum(p.numel() for p in transformers.SiglipModel(hf).parameters())
  assert ours == want
  sharding.param_specs(split_params(__import__("flax").nnx.eval_shape(
      lambda: CLIP(cfg, rngs=__import__("flax").nnx.Rngs(0))))[1],
      jax.make_mesh((1, 1, 1), sharding.MESH_AXES), sharding.parse_rules(sharding.DEFAULT_RULES))
