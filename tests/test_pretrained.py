"""Pretrained weights, tokenizer and preprocessing against Hugging Face transformers (PyTorch, CPU)."""
import gzip
import json
import os
import string

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch", reason="parity tests need torch==2.13.0 (tests/requirements.txt)")
transformers = pytest.importorskip("transformers")

from hnclip_jax import pretrained  # noqa: E402
from hnclip_jax.data.clip_tokenizer import OPENAI_NUM_MERGES, CLIPTokenizer, byte_alphabet  # noqa: E402
import openai_bpe  # noqa: E402
from conftest import ROOT, assert_error_exit, run_py  # noqa: E402

# OpenAI's real merge list, from the open-clip-torch wheel that tests/setup.sh fetches (never copied into the repo).
OPENAI_BPE = openai_bpe.path()


def setup_module():
  if not os.path.exists(OPENAI_BPE):
    raise FileNotFoundError(openai_bpe.missing_message(OPENAI_BPE))


def hf_model(act="quick_gelu", vision_layers=2, text_layers=2, context=16, seed=0, head_dim=None, vocab=300):
  """A tiny random CLIPModel. head_dim=64 gives OpenAI's head size (OpenAI files do not store head counts);
  vocab=49408 makes it fit CLIP's real tokenizer."""
  torch.manual_seed(seed)
  vw, vh, tw, th = (40, 5, 32, 4) if head_dim is None else (128, 2, 64, 1)
  cfg = transformers.CLIPConfig(
      text_config=dict(vocab_size=vocab, hidden_size=tw, intermediate_size=48, num_hidden_layers=text_layers,
                       num_attention_heads=th, max_position_embeddings=context, hidden_act=act,
                       eos_token_id=vocab - 1, bos_token_id=vocab - 2),
      vision_config=dict(hidden_size=vw, intermediate_size=56, num_hidden_layers=vision_layers,
                         num_attention_heads=vh, image_size=32, patch_size=8, hidden_act=act),
      projection_dim=24)
  model = transformers.CLIPModel(cfg).eval()
  with torch.no_grad():  # move layer norms off 1/0 and biases off 0, so a mixed-up weight cannot hide
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model


def hf_embeddings(model, pixels_nhwc, ids):
  with torch.no_grad():
    fi = model.get_image_features(pixel_values=torch.from_numpy(pixels_nhwc).permute(0, 3, 1, 2))
    ft = model.get_text_features(input_ids=torch.from_numpy(ids).long())
  fi, ft = getattr(fi, "pooler_output", fi), getattr(ft, "pooler_output", ft)
  n = lambda x: (x / x.norm(dim=-1, keepdim=True)).numpy()
  return n(fi), n(ft)


def inputs(context=16, seed=0):
  r = np.random.default_rng(seed)
  pixels = r.normal(size=(3, 32, 32, 3)).astype(np.float32)
  ids = np.zeros((3, context), np.int64)
  for i, length in enumerate([3, 9, context - 2]):  # padded, padded, full
    ids[i, 0], ids[i, 1:length + 1], ids[i, length + 1] = 298, r.integers(1, 297, length), 299
  return pixels, ids


def assert_parity(ours, model, context=16):
  pixels, ids = inputs(context)
  want_img, want_txt = hf_embeddings(model, pixels, ids)
  np.testing.assert_allclose(ours.encode_pixels(pixels), want_img, atol=1e-5)
  np.testing.assert_allclose(ours.encode_tokens(ids), want_txt, atol=1e-5)


@pytest.mark.parametrize("act,vl,tl", [("quick_gelu", 2, 2), ("gelu", 3, 1), ("quick_gelu", 1, 3)])
def test_hugging_face_directory_parity(tmp_path, act, vl, tl):
  model = hf_model(act, vl, tl)
  model.save_pretrained(tmp_path)
  ours = pretrained.load(str(tmp_path))
  assert (ours.config.act, ours.config.vision_layers, ours.config.text_layers) == (act, vl, tl)
  assert_parity(ours, model)


def test_pytorch_model_bin(tmp_path):
  model = hf_model(seed=1)
  model.config.save_pretrained(tmp_path)
  torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
  assert_parity(pretrained.load(str(tmp_path)), model)


def to_openai(sd, long_clip_split=None):
  """Hugging Face CLIPModel state dict -> OpenAI CLIP layout (written independently of the loader)."""
  g = lambda k: sd[k].detach().clone()
  out = {"visual.conv1.weight": g("vision_model.embeddings.patch_embedding.weight"),
         "visual.class_embedding": g("vision_model.embeddings.class_embedding"),
         "visual.positional_embedding": g("vision_model.embeddings.position_embedding.weight"),
         "visual.ln_pre.weight": g("vision_model.pre_layrnorm.weight"),
         "visual.ln_pre.bias": g("vision_model.pre_layrnorm.bias"),
         "visual.ln_post.weight": g("vision_model.post_layernorm.weight"),
         "visual.ln_post.bias": g("vision_model.post_layernorm.bias"),
         "visual.proj": g("visual_projection.weight").T.contiguous(),
         "token_embedding.weight": g("text_model.embeddings.token_embedding.weight"),
         "positional_embedding": g("text_model.embeddings.position_embedding.weight"),
         "ln_final.weight": g("text_model.final_layer_norm.weight"),
         "ln_final.bias": g("text_model.final_layer_norm.bias"),
         "text_projection": g("text_projection.weight").T.contiguous(),
         "logit_scale": g("logit_scale")}
  for tower, dst in (("vision_model", "visual.transformer"), ("text_model", "transformer")):
    i = 0
    while f"{tower}.encoder.layers.{i}.layer_norm1.weight" in sd:
      s, d = f"{tower}.encoder.layers.{i}.", f"{dst}.resblocks.{i}."
      out[d + "attn.in_proj_weight"] = torch.cat([g(s + f"self_attn.{k}_proj.weight") for k in "qkv"])
      out[d + "attn.in_proj_bias"] = torch.cat([g(s + f"self_attn.{k}_proj.bias") for k in "qkv"])
      for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                   ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
        out[d + a + ".weight"], out[d + a + ".bias"] = g(s + b + ".weight"), g(s + b + ".bias")
      i += 1
  if long_clip_split is not None:  # two tables; each holds junk where the other one is used
    pos = out["positional_embedding"]
    junk = torch.randn_like(pos)
    out["positional_embedding"] = torch.cat([pos[:long_clip_split], junk[long_clip_split:]])
    out["positional_embedding_res"] = torch.cat([junk[:long_clip_split], pos[long_clip_split:]])
  return out


def test_openai_state_dict_and_longclip_layouts(tmp_path):
  model = hf_model(seed=2, context=32, head_dim=64)
  # OpenAI checkpoints pool at the largest id (their end token); make it the vocabulary's last id here too.
  sd = model.state_dict()
  torch.save(to_openai(sd), tmp_path / "openai.pt")
  ours = pretrained.load(str(tmp_path / "openai.pt"))
  assert ours.config.text_context == 32 and ours.config.eot_token_id == 299 and ours.config.act == "quick_gelu"
  assert_parity(ours, model, context=32)
  torch.save(to_openai(sd, long_clip_split=20), tmp_path / "longclip.pt")
  assert_parity(pretrained.load(str(tmp_path / "longclip.pt")), model, context=32)


def test_torchscript_archive(tmp_path):
  model = hf_model(seed=3, head_dim=64)
  sd = to_openai(model.state_dict())

  class Node(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
      return x

  root = Node()
  for key, value in sd.items():  # a module tree whose state_dict has exactly these names
    *path, leaf = key.split(".")
    node = root
    for part in path:
      if not hasattr(node, part):
        node.add_module(part, Node())
      node = getattr(node, part)
    node.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
  torch.jit.save(torch.jit.script(root), str(tmp_path / "scripted.pt"))
  assert_parity(pretrained.load(str(tmp_path / "scripted.pt")), model)


def test_stretch_positions_matches_the_formula():
  pos = np.random.default_rng(0).normal(size=(77, 6)).astype(np.float32)
  ref = [pos[i] for i in range(20)]
  for i in range(56):
    a, b = pos[20 + i], pos[21 + i]
    ref += [a, (3 * a + b) / 4, (2 * a + 2 * b) / 4, (a + 3 * b) / 4]
  ref += [pos[76] + k * (pos[76] - pos[75]) / 4 for k in range(4)]
  got = pretrained.stretch_positions(pos)
  assert got.shape == (248, 6)
  np.testing.assert_allclose(got, np.stack(ref), rtol=1e-6, atol=1e-6)


def test_stretched_model_reads_tokens_beyond_77(tmp_path):
  model = hf_model(seed=4, context=77)
  model.save_pretrained(tmp_path)
  long = pretrained.load(str(tmp_path)).with_text_context(248)
  assert long.config.text_context == 248
  ids = np.zeros((2, 248), np.int64)
  ids[:, 0], ids[:, 1:200], ids[:, 200] = 298, 7, 299
  ids[1, 150] = 8  # differs only at position 150 (> 77)
  e = long.encode_tokens(ids)
  assert np.abs(e[0] - e[1]).max() > 1e-4
  with pytest.raises(ValueError, match="can only be stretched to 248"):
    pretrained.load(str(tmp_path)).with_text_context(100)


# ------------------------------------------------------------------------------------------- tokenizer


def write_hf_vocab(directory):
  """vocab.json + merges.txt in Hugging Face format, built from OpenAI's merge list."""
  with gzip.open(OPENAI_BPE, "rt", encoding="utf-8") as f:
    merges = [tuple(line.split()) for line in f.read().split("\n")[1:1 + OPENAI_NUM_MERGES]]
  alphabet = byte_alphabet()
  words = alphabet + [a + "</w>" for a in alphabet] + ["".join(m) for m in merges] + ["<|startoftext|>",
                                                                                        "<|endoftext|>"]
  with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump({w: i for i, w in enumerate(words)}, f)
  with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
    f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")


def corpus():
  r = np.random.default_rng(0)
  base = ["A photo of a cat.", "a photo of a cat", "Hello,   WORLD!!  123 4567.89", "it's they're we've I'm you'll he'd",
          "naïve café — “quotes” ‘single’ and emoji 🐈‍⬛🚀", "日本語のテキストと中文", "Ünïcödé ÀÉÎÕÜ ß ø å", "tab\tand\nnewline  ",
          "", "   ", "e-mail: someone@example.com, url https://x.y/z?q=1&r=2", "3.14159 1/2 50% $100 #tag @user",
          "<|startoftext|> inside text <|endoftext|>", "CamelCaseWords and snake_case_words", "x" * 400,
          " ".join(["A long dense caption describing a red car parked next to a blue bicycle."] * 12)]
  chars = string.ascii_letters + string.digits + string.punctuation + " " * 10 + "éüñç—…€中文🙂"
  for i in range(200):
    base.append("".join(r.choice(list(chars), size=int(r.integers(1, 120)))))
  return base


@pytest.fixture(scope="module")
def hf_vocab_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("vocab")
  write_hf_vocab(str(d))
  return str(d)


def test_tokenizer_matches_transformers(hf_vocab_dir):
  hf = transformers.CLIPTokenizer.from_pretrained(hf_vocab_dir)
  ours_hf = CLIPTokenizer.from_directory(hf_vocab_dir, 77)
  ours_openai = CLIPTokenizer.from_openai_bpe(OPENAI_BPE, 77)
  texts = corpus()
  assert len(texts) >= 200
  for t in texts:
    want = hf(t)["input_ids"][1:-1]
    assert ours_hf.encode_ids([t])[0] == want, t
    assert ours_openai.encode_ids([t])[0] == want, t
  # Packed rows: start, ids, end (kept last when truncated), zero padding.
  rows = ours_openai(["a photo of a cat", "x " * 200])
  assert rows[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407, 0]
  assert rows[1, 0] == 49406 and rows[1, -1] == 49407 and ours_openai.last_truncated == 1


def test_tokenizer_json_source(hf_vocab_dir, tmp_path):
  hf = transformers.CLIPTokenizer.from_pretrained(hf_vocab_dir)
  hf.save_pretrained(str(tmp_path))
  for name in ("vocab.json", "merges.txt"):
    if os.path.exists(tmp_path / name):
      os.remove(tmp_path / name)
  assert os.path.exists(tmp_path / "tokenizer.json")
  ours = CLIPTokenizer.from_directory(str(tmp_path), 77)
  for t in corpus()[:40]:
    assert ours.encode_ids([t])[0] == hf(t)["input_ids"][1:-1]


def test_mismatched_vocabulary_files(hf_vocab_dir, tmp_path):
  with open(os.path.join(hf_vocab_dir, "vocab.json")) as f:
    vocab = json.load(f)
  small = {k: v for k, v in list(vocab.items())[:600]} | {"<|startoftext|>": 600, "<|endoftext|>": 601}
  with open(tmp_path / "vocab.json", "w") as f:
    json.dump(small, f)
  with open(tmp_path / "merges.txt", "w") as f, open(os.path.join(hf_vocab_dir, "merges.txt")) as g:
    f.write(g.read())
  with pytest.raises(ValueError, match="do not belong together"):
    CLIPTokenizer.from_directory(str(tmp_path))


# ------------------------------------------------------------------------------------------- preprocessing


def test_preprocessing_matches_clip_image_processor(tmp_path):
  model = hf_model(seed=5)
  model.save_pretrained(tmp_path)
  ours = pretrained.load(str(tmp_path))
  proc = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
  r = np.random.default_rng(0)
  yy, xx = np.mgrid[0:300, 0:400]
  smooth = np.stack([(xx * 0.6) % 255, (yy * 0.8) % 255, (xx + yy) % 255], -1).astype(np.uint8)
  images = [Image.fromarray(smooth), Image.fromarray(smooth[:, :250].copy()),
            (r.random((61, 47, 3)) * 255).astype(np.uint8), Image.fromarray(smooth[:20, :30].copy()),
            Image.fromarray(smooth[:, :, 0].copy())]  # landscape, portrait, array, upsampled, grayscale
  got = ours.preprocess(images)
  want = proc(images=[im if isinstance(im, Image.Image) else Image.fromarray(im) for im in images],
              return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
  assert got.shape == want.shape == (5, 32, 32, 3)
  diff = np.abs(got - want)
  assert diff.max() <= 1e-2 and diff.mean() <= 2e-3, (diff.max(), diff.mean())


# ------------------------------------------------------------------------------------------- convert + train


def test_convert_then_load_without_torch_and_fine_tune(tmp_path, hf_vocab_dir, tfds_dir):
  model = hf_model(seed=6, context=77, vocab=49408)
  src = tmp_path / "hf"
  model.save_pretrained(src)
  write_hf_vocab(str(src))
  out = tmp_path / "converted"
  run_py(["-m", "hnclip_jax.pretrained.convert", str(src), str(out)])
  # One fresh process (this one has PyTorch loaded) loads both: converted dirs and safetensors need no PyTorch.
  code = ("import sys; import numpy as np; from hnclip_jax import pretrained\n"
          "for source, npy in zip(sys.argv[1::2], sys.argv[2::2]):\n"
          "  np.save(npy, pretrained.load(source).encode_texts(['a red circle', 'two blue squares']))\n"
          "print('TORCH', 'torch' in sys.modules)")
  proc = run_py(["-c", code, str(out), str(tmp_path / "converted.npy"), str(src), str(tmp_path / "hf.npy")])
  assert "TORCH False" in proc.stdout
  np.testing.assert_allclose(np.load(tmp_path / "converted.npy"), np.load(tmp_path / "hf.npy"), atol=1e-6)
  hf_tok = transformers.CLIPTokenizer.from_pretrained(hf_vocab_dir)
  ids = np.zeros((2, 77), np.int64)
  for i, t in enumerate(["a red circle", "two blue squares"]):
    row = hf_tok(t)["input_ids"]
    ids[i, :len(row)] = row
  _, want = hf_embeddings(model, np.zeros((1, 32, 32, 3), np.float32), ids)
  np.testing.assert_allclose(np.load(tmp_path / "hf.npy"), want, atol=1e-5)  # encode_texts = HF on HF's ids
  # Fine-tune from the converted directory with a vanishing learning rate: the weights must be the source's.
  work = tmp_path / "work"
  run_py(["train.py", "--config", "configs/demo.py:test", "--workdir", str(work), f"--config.init_from={out}",
          f"--config.data.data_dir={tfds_dir}", "--config.optimizer.lr=1e-12", "--config.total_steps=2",
          "--config.checkpoint_every=2", "--config.eval_every=2"])
  tuned = pretrained.load(str(work))
  assert tuned.config.vision_width == 40 and tuned.config.text_context == 77
  assert tuned.source.endswith("(step 2)") and pretrained.load(str(work), step=2).source == tuned.source
  with pytest.raises(ValueError, match=r"no checkpoint of step 5; available steps: \[2\]"):
    pretrained.load(str(work), step=5)
  with pytest.raises(ValueError, match="is not a train.py workdir"):
    pretrained.load(str(out), step=2)
  src_params = pretrained.load(str(out)).params
  import jax
  for a, b in zip(jax.tree.leaves(tuned.params), jax.tree.leaves(src_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  # A train.py workdir is itself a valid init_from (pretrain, then fine-tune), and eval.py works on it.
  work2 = tmp_path / "work2"
  run_py(["train.py", "--config", "configs/demo.py:test", "--workdir", str(work2), f"--config.init_from={work}",
          f"--config.data.data_dir={tfds_dir}", "--config.total_steps=2", "--config.checkpoint_every=2",
          "--config.eval_every=2"])
  run_py(["eval.py", "--config", "configs/demo.py:test", "--workdir", str(work2), f"--config.data.data_dir={tfds_dir}",
          f"--config.init_from={work}"])
  with open(work2 / "eval_results.json") as f:
    assert json.load(f)["step"] == 2


def clip_inputs(context, seed):
  pixels, ids = inputs(context=context, seed=seed)
  return pixels, np.where(ids == 298, 49406, np.where(ids == 299, 49407, ids))  # CLIP's start / end tokens


def same_params(a, b):
  import jax
  assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))


@pytest.mark.parametrize("context", [77, 248])
def test_export_to_hugging_face(tmp_path, context):
  """import -> export -> transformers: same embeddings (1e-5, also at Long-CLIP's 248 tokens); -> import again:
  bit-identical parameters; the exported vocabulary tokenizes like ours in transformers' CLIPTokenizer."""
  model = hf_model(seed=8, context=context, vocab=49408)
  src = tmp_path / "hf"
  model.save_pretrained(src)
  write_hf_vocab(str(src))
  out = tmp_path / "exported"
  proc = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(out)])
  assert f"wrote {out}" in proc.stdout and "warning" not in proc.stdout
  back = transformers.CLIPModel.from_pretrained(out)
  assert back.config.text_config.max_position_embeddings == context
  ours = pretrained.load(str(src))
  pixels, ids = clip_inputs(context, seed=3)
  want_img, want_txt = hf_embeddings(back, pixels, ids)
  np.testing.assert_allclose(ours.encode_pixels(pixels), want_img, atol=1e-5)
  np.testing.assert_allclose(ours.encode_tokens(ids), want_txt, atol=1e-5)
  same_params(pretrained.load(str(out)), ours)
  processor = transformers.CLIPProcessor.from_pretrained(out)  # tokenizer + image processor from the export
  for text in ["a photo of a cat", "Two RED circles, left of a blue square."]:
    row = processor.tokenizer(text)["input_ids"]
    assert list(ours.tokenize([text])[0][:len(row)]) == row
  if context != 77:
    return  # the image side does not depend on the text context
  yy, xx = np.mgrid[0:90, 0:120]
  image = Image.fromarray(np.stack([(xx * 2) % 255, (yy * 3) % 255, (xx + yy) % 255], -1).astype(np.uint8))
  want = processor(images=[image], return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
  diff = np.abs(ours.preprocess([image]) - want)
  assert want.shape == (1, 32, 32, 3) and diff.max() <= 1e-2 and diff.mean() <= 2e-3  # as the preprocessing test


@pytest.mark.parametrize("context", [77, 248])
def test_export_openai_and_longclip_layouts(tmp_path, context):
  """--format=openai: the state dict equals the test's own OpenAI layout of the same weights (Long-CLIP's two
  position tables at 248 tokens, each right where Long-CLIP's masks read it); loading it back is bit-identical and
  matches transformers."""
  model = hf_model(seed=9, context=context, head_dim=64, vocab=49408)
  src = tmp_path / "hf"
  model.save_pretrained(src)
  out = tmp_path / "model.pt"
  proc = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(out), "--format=openai"])
  assert ("Long-CLIP state dict" in proc.stdout) == (context == 248), proc.stdout
  got, want = torch.load(out, weights_only=True), to_openai(model.state_dict())
  if context == 248:
    assert got["positional_embedding"].shape == got["positional_embedding_res"].shape == (248, 64)
    pos = want.pop("positional_embedding")
    assert torch.equal(got.pop("positional_embedding")[:20], pos[:20])
    assert torch.equal(got.pop("positional_embedding_res")[20:], pos[20:])
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k
  back = pretrained.load(str(out))
  same_params(back, pretrained.load(str(src)))
  pixels, ids = clip_inputs(context, seed=4)
  want_img, want_txt = hf_embeddings(model, pixels, ids)
  np.testing.assert_allclose(back.encode_pixels(pixels), want_img, atol=1e-5)
  np.testing.assert_allclose(back.encode_tokens(ids), want_txt, atol=1e-5)


def test_export_word_tokenizer_model(tmp_path):
  """A model trained from scratch here (word-level tokenizer): the export's tokenizer.json gives our ids in
  transformers (start/end tokens, truncation, padding) and the exported model our embeddings."""
  from hnclip_jax.data.tokenizer import WordTokenizer
  from hnclip_jax.models import CLIPConfig, init_params
  captions = ["A red car parked next to a blue bicycle.", "Two dogs play on the green grass", "a cat, asleep"]
  tok = WordTokenizer.fit(captions, context_length=12)
  cfg = CLIPConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                   vision_mlp_dim=48, text_context=12, vocab_size=tok.vocab_size, text_width=32, text_layers=2,
                   text_heads=2, text_mlp_dim=48, eot_token_id=tok.eot_id).validate()
  _, params = init_params(cfg, 0)
  src, out = tmp_path / "converted", tmp_path / "exported"
  pretrained.Pretrained(cfg, params, tok, "test").save(str(src))
  proc = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(out)])
  assert "warning" not in proc.stdout
  fast = transformers.AutoTokenizer.from_pretrained(out)
  assert isinstance(fast, transformers.PreTrainedTokenizerFast)
  queries = captions + ["an UNSEEN word, then a red car", "dogs " * 30, ""]
  got = fast(queries, padding="max_length", truncation=True, max_length=12)["input_ids"]
  np.testing.assert_array_equal(np.asarray(got), tok(queries))
  ours = pretrained.load(str(src))
  back = transformers.CLIPModel.from_pretrained(out)
  pixels = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
  want_img, want_txt = hf_embeddings(back, pixels, np.asarray(got))
  np.testing.assert_allclose(ours.encode_tokens(tok(queries)), want_txt, atol=1e-5)
  np.testing.assert_allclose(ours.encode_pixels(pixels), want_img, atol=1e-5)
  again = pretrained.load(str(out))  # our own loader reads the exported tokenizer.json back
  assert again.tokenizer.kind == "word"
  np.testing.assert_array_equal(again.tokenize(queries), tok(queries))
  same_params(again, ours)


def test_export_warnings_and_refusals(tmp_path):
  """A bare weights directory exports with a warning naming the missing tokenizer files; the OpenAI format refuses
  a model its loader would rebuild differently, naming why, and writes nothing."""
  model = hf_model(seed=10, act="gelu")
  src, out = tmp_path / "hf", tmp_path / "exported"
  model.save_pretrained(src)  # weights and config.json only
  proc = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(out)])
  assert "warning:" in proc.stdout and "no tokenizer files" in proc.stdout and "vocab.json" in proc.stdout
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "preprocessor_config.json"]
  assert_parity(pretrained.load(str(out)), model)
  bad = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(tmp_path / "m.pt"), "--format=openai"],
               check=False)
  assert_error_exit(bad, "cannot be written in the OpenAI format")
  assert "'gelu'" in bad.stderr and "heads of width 8" in bad.stderr and "--format=hf" in bad.stderr
  assert not os.path.exists(tmp_path / "m.pt")
  bad = run_py(["-m", "hnclip_jax.pretrained.export", str(src), str(tmp_path / "dir"), "--format=openai"],
               check=False)
  assert_error_exit(bad, "should end in .pt")
  assert not os.path.exists(tmp_path / "dir")


def test_encoders_run_in_fixed_batches(tmp_path):
  """Any number of inputs goes through one compiled program per encoder (padded batches), with the same
  embeddings as one unbatched call."""
  model = hf_model(seed=4, context=77, vocab=49408)
  src = tmp_path / "hf"
  model.save_pretrained(src)
  write_hf_vocab(str(src))
  m = pretrained.load(str(src))
  m.batch_size = 4
  texts = [t for t in corpus() if t.strip()][:10]
  pixels = np.random.default_rng(0).normal(size=(10, 32, 32, 3)).astype(np.float32)
  few, many = m.encode_texts(texts[:3]), m.encode_texts(texts)
  imgs_few, imgs_many = m.encode_pixels(pixels[:2]), m.encode_pixels(pixels)
  assert m._txt._cache_size() == 1 and m._img._cache_size() == 1  # 3, 10 -> one program each
  assert many.shape == (10, m.config.embed_dim) and imgs_many.shape == (10, m.config.embed_dim)
  np.testing.assert_allclose(many, np.asarray(m._txt(m.params, m.tokenize(texts))), atol=1e-6)
  np.testing.assert_allclose(imgs_many, np.asarray(m._img(m.params, pixels)), atol=1e-6)
  np.testing.assert_allclose(few, many[:3], atol=1e-6)
  np.testing.assert_allclose(imgs_few, imgs_many[:2], atol=1e-6)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_sources_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    pretrained.load(str(tmp_path / "nope.pt"))
  bert = tmp_path / "bert"
  bert.mkdir()
  (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
  with pytest.raises(ValueError, match="not a config of a model family here .*CLIPModel, SiglipModel"):
    pretrained.load(str(bert))
  model = hf_model(seed=7, head_dim=64)
  good = tmp_path / "good"
  model.save_pretrained(good)
  data = (good / "model.safetensors").read_bytes()
  (good / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
    pretrained.load(str(good))
  torch.save(to_openai(model.state_dict()), tmp_path / "full.pt")
  blob = (tmp_path / "full.pt").read_bytes()
  (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])
  with pytest.raises(ValueError, match="cut.pt"):
    pretrained.load(str(tmp_path / "cut.pt"))
  torch.save({"conv.weight": torch.zeros(3, 3)}, tmp_path / "resnet.pt")
  with pytest.raises(ValueError, match="not an OpenAI-CLIP state dict"):
    pretrained.load(str(tmp_path / "resnet.pt"))
  write_hf_vocab(str(good))  # CLIP's 49408-token vocabulary next to a 300-embedding model
  model.save_pretrained(good)
  with pytest.raises(ValueError, match="tokenizer files .* do not match the weights"):
    pretrained.load(str(good))


def test_longclip_config_is_the_papers_recipe():
  import importlib.util
  spec = importlib.util.spec_from_file_location("longclip_l", os.path.join(ROOT, "configs", "longclip_l.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("docci")
  from hnclip_jax import config as config_lib
  config_lib.validate(c)
  assert (c.model.patch_size, c.model.vision_layers, c.model.vision_width, c.model.text_context) == (14, 24, 1024, 248)
  assert c.optimizer.lr == 2e-6 and c.batch_size == 128 and c.loss.gamma == 0.5 and c.data.image_size == 224
  # Micro-batch 16 × 8 accumulation = 128; 10 epochs over DOCCI's 9,450 training pairs (PAPER.md) = 738 steps.
  assert (c.batch_size, c.grad_accum_steps, c.total_steps) == (128, 8, 738)
  assert c.finetune.method == "full"
  for variant, method in (("lora", "lora"), ("docci,dora", "dora")):
    v = mod.get_config(variant)
    config_lib.validate(v)
    assert (v.finetune.method, v.finetune.rank, v.optimizer.lr) == (method, 16, 5e-5)
    assert v.data.name == ("docci" if "docci" in variant else "synthetic")
  with pytest.raises(ValueError, match="unknown variant 'lroa'"):
    mod.get_config("docci,lroa")


def test_coco_flickr_recipe_loads_as_train_py_reads_it(tmp_path):
  """configs/coco_flickr.py through ml_collections' loader (as train.py/eval.py read it): the Long-CLIP-L recipe
  on COCO, and a named error when the manual folder is not set."""
  code = ("import sys; from absl import flags; from ml_collections import config_flags; "
          "config_flags.DEFINE_config_file('config'); flags.FLAGS(sys.argv); c = flags.FLAGS.config; "
          "print(c.data.name, c.data.eval_split, c.model.text_context, c.model.vision_layers, c.total_steps)")
  out = run_py(["-c", code, "--config", os.path.join(ROOT, "configs", "coco_flickr.py") + ":coco"]).stdout.split()
  assert out == ["coco", "test", "248", "24", str(113_287 // 128)]
  import importlib.util
  from hnclip_jax import config as config_lib
  from hnclip_jax.data import builders
  spec = importlib.util.spec_from_file_location("coco_flickr", os.path.join(ROOT, "configs", "coco_flickr.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = config_lib.validate(mod.get_config("flickr30k"))
  with pytest.raises(ValueError, match="manual_dir"):  # what train.py's preflight says before building anything
    builders.check_data_config(c.data)
