"""SigLIP towers (CLIPConfig.family="siglip") against transformers.SiglipModel (PyTorch, CPU): embeddings, logits and
the sigmoid loss of small random models saved in the Hugging Face format; nothing is downloaded."""
import re

import numpy as np
import pytest

try:  # the parity checks need PyTorch; the rest of this module does not, and runs without it
  import torch
  import transformers
except ImportError:
  torch = transformers = None
needs_torch = pytest.mark.skipif(torch is None, reason="a parity check against transformers (PyTorch): needs "
                                 "torch==2.13.0 and transformers from tests/requirements.txt")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hnclip_jax import losses, pretrained, sharding  # noqa: E402
from hnclip_jax.models import CLIP, CLIPConfig, PRESETS, split_params  # noqa: E402
from hnclip_jax.pretrained import hf_siglip as siglip_mapping, weights  # noqa: E402


def hf_siglip(seed=0, context=12, vocab=300, act="gelu_pytorch_tanh", layers=(2, 2), image=32):
  """A tiny random SiglipModel, every weight moved off its initial value (so a mixed-up weight cannot hide)."""
  torch.manual_seed(seed)
  cfg = transformers.SiglipConfig(
      text_config=dict(vocab_size=vocab, hidden_size=40, intermediate_size=56, num_hidden_layers=layers[1],
                       num_attention_heads=4, max_position_embeddings=context, hidden_act=act, eos_token_id=1,
                       pad_token_id=1, projection_size=48),
      vision_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=layers[0], num_attention_heads=6,
                         image_size=image, patch_size=8, hidden_act=act))
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


@needs_torch
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


@needs_torch
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


@needs_torch
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
    siglip_mapping.config({"vision_config": {"vision_use_head": False}}, "x/config.json")
  with pytest.raises(ValueError, match="projection_size=32 differs"):
    siglip_mapping.config({"vision_config": {"hidden_size": 48}, "text_config": {"projection_size": 32}}, "c")


# Published parameter counts of Google's SigLIP checkpoints as converted by KerasHub, from the "params" field of
# keras_hub/src/models/siglip/siglip_presets.py (each entry's model card:
# https://huggingface.co/collections/google/siglip-659d5e62f0ae1a57ae0e83ba), with the architecture of each
# checkpoint's Hugging Face config.json (google/siglip-base-patch16-224, -base-patch16-256, -large-patch16-256,
# -so400m-patch14-384): (width, layers, heads, MLP) of both towers, vocabulary 32,000, 64 text positions.
# KerasHub's count includes two integer position-id buffers (one per image patch, one per text position) that are
# no trainable weight here: they are subtracted below.
PUBLISHED = {
    "siglip_b16_224": dict(params=203_156_230, width=768, layers=12, heads=12, mlp=3072, image=224, patch=16),
    "siglip_b16_256": dict(params=203_202_370, width=768, layers=12, heads=12, mlp=3072, image=256, patch=16),
    "siglip_l16_256": dict(params=652_151_106, width=1024, layers=24, heads=16, mlp=4096, image=256, patch=16),
    "siglip_so400m14_384": dict(params=877_961_291, width=1152, layers=27, heads=16, mlp=4304, image=384, patch=14),
}


# The B/16 presets in the README command; L/16 and So400m (the same check, 15-20 s each: tracing their construction
# for the abstract parameters) in `-m long`.
LONG_PRESETS = ("siglip_l16_256", "siglip_so400m14_384")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG_PRESETS else n
                                  for n in PUBLISHED])
def test_siglip_presets_have_the_published_shapes(name):
  """Each preset against the checkpoint it stands for: its architecture as the checkpoint's config.json gives it,
  and its parameter count as published (PUBLISHED above; written here, not derived from the preset)."""
  from flax import nnx
  cfg, pub = PRESETS[name].validate(), PUBLISHED[name]
  for tower in ("vision", "text"):
    got = tuple(getattr(cfg, f"{tower}_{k}") for k in ("width", "layers", "heads", "mlp_dim"))
    assert got == (pub["width"], pub["layers"], pub["heads"], pub["mlp"]), (tower, got)
  assert (cfg.image_size, cfg.patch_size, cfg.vocab_size, cfg.text_context) == (pub["image"], pub["patch"], 32000, 64)
  abstract = split_params(nnx.eval_shape(lambda: CLIP(cfg, rngs=nnx.Rngs(0))))[1]
  ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  position_ids = (pub["image"] // pub["patch"]) ** 2 + 64
  assert ours == pub["params"] - position_ids
  specs = sharding.param_specs(abstract, jax.make_mesh((1, 1, 1), sharding.MESH_AXES),
                               sharding.parse_rules(sharding.DEFAULT_RULES))
  # The heads' rules are the family's (SigLIPFamily.logical_axes), not the shared table's.
  assert not [p for p, _ in sharding.LOGICAL_AXES if re.search(p, "text_head/kernel") or re.search(p, "vision_head/probe")]
  assert sharding.FAMILY_AXES["siglip"] and str(specs["text_head"]["kernel"]) == str(P("fsdp", None))
  # ... and so are its top-level modules: its heads are not taken for a framework's parts (which are replicated).
  assert str(specs["vision_head"]["attn"]["q"]["kernel"]) == str(P("fsdp", "tensor"))
  assert sharding.is_framework_part("aggregator/kernel") and not sharding.is_framework_part("vision_head/fc1/kernel")


# ------------------------------------------------------------------------------------------- tokenizer, pixels

def _corpus(n=300, seed=0):
  """Strings that exercise SigLIP's canonicalisation: case, ASCII punctuation, runs of whitespace, digits, accents,
  and lengths past the 16-token context."""
  r = np.random.default_rng(seed)
  words = ["A", "red", "cube", "left", "of", "the", "Blue", "sphere,", "two", "green", "balls!", "(small)", "wooden",
           "table;", "café", "naïve", "3", "42", "x-ray", "it's", "\"quoted\"", "e.g.", "über", "ÉCOLE", "a/b"]
  out = ["", "   ", "!!!", "Hello,   World", "tab\there", "line\nbreak"]
  while len(out) < n:
    k = int(r.integers(1, 40))
    sep = [" ", "  ", "\t", " , "][int(r.integers(4))]
    out.append(sep.join(words[int(i)] for i in r.integers(len(words), size=k)))
  return out


@pytest.fixture(scope="module")
def spiece_dir(tmp_path_factory):
  """A SigLIP-layout SentencePiece model (0 <pad>, 1 </s>, 2 <unk>) trained on the corpus."""
  spm = pytest.importorskip("sentencepiece")
  d = tmp_path_factory.mktemp("spiece")
  from hnclip_jax.data.siglip_tokenizer import canonicalize
  spm.SentencePieceTrainer.train(sentence_iterator=iter([canonicalize(t) for t in _corpus(600, seed=1)] * 3),
                                 model_prefix=str(d / "spiece"), vocab_size=60, model_type="unigram", pad_id=0,
                                 eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0, minloglevel=2)
  return d


@needs_torch
def test_spiece_tokenizer_matches_transformers(spiece_dir):
  """Token ids equal transformers' SiglipTokenizer (padding="max_length", truncation) on 300 strings."""
  from hnclip_jax.data.siglip_tokenizer import SigLIPTokenizer
  texts = _corpus()
  ours = SigLIPTokenizer(str(spiece_dir / "spiece.model"), 16)
  hf = transformers.SiglipTokenizer(vocab_file=str(spiece_dir / "spiece.model"))
  want = np.asarray(hf(texts, padding="max_length", truncation=True, max_length=16)["input_ids"])
  got = ours(texts)
  mismatched = [t for t, a, b in zip(texts, got, want) if not np.array_equal(a, b)]
  assert not mismatched, (len(mismatched), mismatched[:3])
  assert ours.last_truncated > 10 and ours.eot_id == ours.pad_id == 1
  assert (got == 1).any(axis=1).all()  # every caption ends with "</s>", truncated or not


@needs_torch
def test_tokenizer_json_matches_transformers_fast(tmp_path):
  """A tokenizer.json source (SigLIP 2 ships Gemma's): the file's own special tokens, truncated and padded to the
  full length with its pad token, equal to transformers' PreTrainedTokenizerFast on 300 strings."""
  import tokenizers
  from tokenizers import models, normalizers, pre_tokenizers, processors, trainers
  from hnclip_jax.data.siglip_tokenizer import SigLIPTokenizer
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.normalizer = normalizers.NFKC()
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.train_from_iterator(_corpus(600, seed=2), trainers.BpeTrainer(vocab_size=150, special_tokens=[
      "<pad>", "<eos>", "<bos>", "<unk>"]))
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2),
                                                                                              ("<eos>", 1)])
  tok.save(str(tmp_path / "tokenizer.json"))
  texts = _corpus()
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), pad_token="<pad>",
                                            eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
  want = np.asarray(hf(texts, padding="max_length", truncation=True, max_length=16)["input_ids"])
  ours = SigLIPTokenizer(str(tmp_path / "tokenizer.json"), 16)
  np.testing.assert_array_equal(ours(texts), want)
  assert (ours.pad_id, ours.eot_id) == (0, 1) and ours.last_truncated > 10


@needs_torch
def test_pretrained_siglip_with_tokenizer_and_preprocessing(saved, spiece_dir, tmp_path):
  """pretrained.load picks up spiece.model next to SigLIP weights; images are preprocessed as SiglipImageProcessor
  does (whole image to size x size, bicubic, then [-1, 1])."""
  import shutil
  from PIL import Image
  directory, _ = saved
  d = tmp_path / "with_tok"
  shutil.copytree(directory, d)
  shutil.copy(spiece_dir / "spiece.model", d / "spiece.model")
  pm = pretrained.load(str(d))
  assert pm.tokenizer.kind == "siglip" and pm.tokenize(["A red cube."]).shape == (1, 12)
  pm.save(str(tmp_path / "converted"))  # the converted layout (and a workdir) keep the tokenizer file
  again = pretrained.load(str(tmp_path / "converted"))
  texts = _corpus(20)
  np.testing.assert_array_equal(again.tokenize(texts), pm.tokenize(texts))
  assert again.config == pm.config
  from hnclip_jax.pretrained import export  # the export carries spiece.model and SigLIP's tokenizer settings
  assert export.export_hf(pm, str(tmp_path / "hf")) == []
  hf_tok = transformers.SiglipTokenizer.from_pretrained(str(tmp_path / "hf"))
  np.testing.assert_array_equal(np.asarray(hf_tok(texts, padding="max_length", truncation=True,
                                                   max_length=12)["input_ids"]), pm.tokenize(texts))
  proc = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
  yy, xx = np.mgrid[0:300, 0:400]
  smooth = np.stack([(xx * 0.6) % 255, (yy * 0.8) % 255, (xx + yy) % 255], -1).astype(np.uint8)
  images = [Image.fromarray(smooth), Image.fromarray(smooth[:, :250].copy()), Image.fromarray(smooth[:20, :30].copy())]
  got = pm.preprocess(images)
  want = proc(images=images, return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
  assert got.shape == want.shape == (3, 32, 32, 3)
  diff = np.abs(got - want)
  assert diff.max() <= 2e-2 and diff.mean() <= 3e-3, (diff.max(), diff.mean())


@needs_torch
def test_export_siglip_to_hugging_face_and_back(tmp_path):
  """A fine-tuned SigLIP model (stretched to a longer context) exported as a SiglipModel directory: transformers
  loads it and gives our embeddings and logits (<= 1e-5); its tokenizer file goes with it; the OpenAI format is
  refused by name."""
  import jax
  from hnclip_jax.pretrained import export
  model = hf_siglip(seed=3, context=24)
  model.save_pretrained(tmp_path / "src")
  pm = pretrained.load(str(tmp_path / "src")).with_text_context(36)  # Long-CLIP's stretch: keep 20, x4
  pm.params = jax.tree.map(lambda x: x * 1.01, pm.params)  # not the source's weights
  export.export_hf(pm, str(tmp_path / "out"))
  back = transformers.SiglipModel.from_pretrained(tmp_path / "out").eval()
  pixels, ids = inputs(context=pm.config.text_context)
  want = hf_outputs(back, pixels, ids)
  np.testing.assert_allclose(pm.encode_pixels(pixels), want["image_embeds"], atol=1e-5)
  np.testing.assert_allclose(pm.encode_tokens(ids), want["text_embeds"], atol=1e-5)
  again = pretrained.load(str(tmp_path / "out"))
  assert again.config == pm.config
  with pytest.raises(ValueError, match="siglip model cannot be written in the OpenAI CLIP format"):
    export.openai_state_dict(pm.params, pm.config)


@needs_torch
@pytest.mark.parametrize("method", ["lora", "dora"])
def test_adapters_on_siglip_towers(saved, method):
  """LoRA / DoRA on a SigLIP model: adapters on every block's and the attention-pooling head's dense layers (not on
  the text head, the tower's projection); the adapted model starts equal to the base, and after a change to the
  adapters, folding them in gives the adapted model's embeddings."""
  import dataclasses
  from hnclip_jax.models import adapters, bind
  directory, _ = saved
  pm = pretrained.load(directory)
  cfg = dataclasses.replace(pm.config, adapter=method, adapter_rank=4, adapter_alpha=8.0)
  params = adapters.add_adapters(jax.tree.map(np.asarray, pm.params), cfg, seed=0)
  names = [k for k in adapters.flat(params) if adapters.is_adapter(k)]
  assert any(k.startswith("vision_head/attn/q/") for k in names) and any(k.startswith("vision_head/fc1/") for k in
                                                                          names)
  assert not any(k.startswith("text_head") for k in names)
  pixels, ids = inputs()
  graphdef = adapters.abstract_model(cfg)[0]
  emb = lambda g, p: (np.asarray(bind(g, p).encode_image(jnp.asarray(pixels))),  # noqa: E731
                      np.asarray(bind(g, p).encode_text(jnp.asarray(ids))))
  base = emb(pm.graphdef, jax.tree.map(jnp.asarray, pm.params))
  for a, b in zip(emb(graphdef, jax.tree.map(jnp.asarray, params)), base):
    np.testing.assert_allclose(a, b, atol=1e-5)
  moved = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.05 if adapters.path_of(p).endswith("lora_b") else x, params)
  adapted = emb(graphdef, jax.tree.map(jnp.asarray, moved))
  assert np.abs(adapted[0] - base[0]).max() > 1e-3
  merged_cfg, merged = adapters.merge_adapters(moved, cfg)
  for a, b in zip(emb(adapters.abstract_model(merged_cfg)[0], jax.tree.map(jnp.asarray, merged)), adapted):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_logit_bias_trains_and_freezes_with_the_scale():
  """b follows t: trained in full fine-tuning and next to LoRA / DoRA adapters, frozen with
  optimizer.train_logit_scale=False; the SigLIP recipe validates for every size and method."""
  import ml_collections
  from hnclip_jax import config as config_lib, optim
  from configs.siglip import get_config
  on, off = (ml_collections.ConfigDict({"train_logit_scale": v}) for v in (True, False))
  assert not optim.frozen_predicate(on, ())("logit_bias") and optim.frozen_predicate(off, ())("logit_bias")
  c = config_lib.base_config()
  c.finetune.method = "lora"
  frozen = optim.frozen_predicate(on, optim.freeze_patterns(c, CLIPConfig(adapter="lora", logit_bias=True)))
  assert not frozen("logit_bias") and not frozen("vision_head/attn/q/lora/lora_a")
  assert frozen("text_head/kernel") and frozen("vision_head/probe")
  for variant in ("synthetic", "docci,b16", "docci,lora", "urban1k,dora,l16_256"):
    cfg = config_lib.validate(get_config(variant))
    assert cfg.loss.kind == "sigmoid" and cfg.model.family == "siglip" and cfg.model.text_context == 196
  with pytest.raises(ValueError, match="unknown variant 'vitl'"):
    get_config("docci,vitl")


def test_inspect_counts_siglip_tokens(spiece_dir, tmp_path):
  """data.inspect with a SigLIP directory: SigLIP token counts (text + "</s>") and the share truncated at SigLIP's 64
  positions and at the 196 of configs/siglip.py."""
  import io
  import sentencepiece
  from PIL import Image
  from conftest import run_py
  from hnclip_jax.data.siglip_tokenizer import canonicalize
  m = tmp_path / "m"
  texts = ["a red cube", " ".join(["green balls"] * 12), " ".join(["two wooden tables"] * 40)]
  for i, text in enumerate(texts, 1):
    (m / "image").mkdir(parents=True, exist_ok=True)
    (m / "caption").mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(buf, format="JPEG")
    (m / "image" / f"{i}.jpg").write_bytes(buf.getvalue())
    (m / "caption" / f"{i}.txt").write_text(text)
  sp = sentencepiece.SentencePieceProcessor(model_file=str(spiece_dir / "spiece.model"))
  counts = np.array([len(sp.encode(canonicalize(t))) + 1 for t in texts])
  assert counts.min() <= 64 < counts.max()  # the three captions straddle the contexts
  proc = run_py(["-m", "hnclip_jax.data.inspect", "urban1k", "--split", "test", f"--manual_dir={m}",
                 f"--data_dir={tmp_path / 'd'}", f"--vocab={spiece_dir}"])
  assert f"tokens (SigLIP, with start/end): mean {counts.mean():.1f}" in proc.stdout, proc.stdout
  for ctx in (64, 196):
    assert f"truncated at {ctx} tokens: {100 * np.mean(counts > ctx):.1f}%" in proc.stdout


def test_clip_only_frameworks_refuse_siglip_models():
  """FineLIP, GOAL and StructXLIP are built on CLIP's class token, end-token pooling, crops and sentence spans: a
  SigLIP model is refused by name before anything is built."""
  from hnclip_jax import config as config_lib
  from hnclip_jax.frameworks.finelip import FineLIPTerm
  from hnclip_jax.frameworks import goal, structxlip
  siglip = CLIPConfig(family="siglip", logit_bias=True, embed_dim=128)
  with pytest.raises(ValueError, match="framework='finelip' aggregates CLIP's tokens.*'siglip' is not supported"):
    FineLIPTerm(weight=1.0).check(siglip, None)
  c = config_lib.base_config()
  for mod, name in ((goal, "goal"), (structxlip, "structxlip")):
    with pytest.raises(ValueError, match=f"framework='{name}' crops.*'siglip' is not supported"):
      mod.inputs(c, siglip, None)


@needs_torch
def test_image_size_not_a_multiple_of_the_patch(tmp_path):
  """SigLIP So400m/14 runs at 384 px: 27 x 27 patches, the last pixels unused, as transformers' conv does. A 36 px
  model with 8 px patches (4 x 4 patches, 4 px left over) gives transformers' image embeddings."""
  model = hf_siglip(seed=4, image=36)
  model.save_pretrained(tmp_path)
  pm = pretrained.load(str(tmp_path))
  assert pm.config.image_size == 36 and pm.params["vision_positions"].shape[0] == 16
  pixels = np.random.default_rng(3).normal(size=(3, 36, 36, 3)).astype(np.float32)
  with torch.no_grad():
    want = model.get_image_features(pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2))
  want = getattr(want, "pooler_output", want).numpy()
  np.testing.assert_allclose(pm.encode_pixels(pixels), want / np.linalg.norm(want, axis=-1, keepdims=True), atol=1e-5)
