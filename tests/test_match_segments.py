"""tools/match_segments: boxes (from any segmenter) paired with caption sentences by the model's own similarity."""
import json

import numpy as np
import pytest
from PIL import Image

from conftest import assert_error_exit, run_py
from hnclip_jax import pretrained
from hnclip_jax.data.tokenizer import WordTokenizer
from hnclip_jax.models import CLIPConfig, init_params
from hnclip_jax.tools.match_segments import BadBox, check_box, match_entry, split_sentences

CAPTION = "A red block on the left. A blue block on the right! Nothing else?  "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  tok = WordTokenizer.fit([CAPTION, "a green thing"], context_length=16)
  cfg = CLIPConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                   vision_mlp_dim=64, text_context=16, vocab_size=128, text_width=32, text_layers=1, text_heads=2,
                   text_mlp_dim=64, eot_token_id=tok.eot_id)
  out = tmp_path_factory.mktemp("model")
  pretrained.Pretrained(cfg, init_params(cfg, 0)[1], tok, "test").save(str(out))
  return str(out)


def _image():
  arr = np.zeros((30, 40, 3), np.uint8)
  arr[:, :20] = (220, 30, 30)
  arr[:, 20:] = (30, 30, 220)
  arr[10:20, 25:35] = (30, 200, 30)
  return arr


def test_sentences_and_boxes_are_checked():
  assert split_sentences(CAPTION) == ["A red block on the left.", "A blue block on the right!", "Nothing else?"]
  assert check_box([-5, 0, 20, 31.5], 40, 30, "x") == (0.0, 0.0, 20.0, 30.0)  # clipped to the image
  for box, msg in (([5, 5, 5, 10], "empty or reversed"), ([50, 0, 60, 10], "outside the 40x30 image"),
                   ([1, 2, 3], "not \\[x0, y0, x1, y1\\]"), ([0, 0, float("nan"), 4], "not \\[x0"),
                   ("0,0,4,4", "not \\[x0")):
    with pytest.raises(BadBox, match=f"pairs.json\\[3\\] box 1: box .*{msg}"):
      check_box(box, 40, 30, "pairs.json[3] box 1")


def test_each_box_gets_its_most_similar_sentence(model_dir):
  """The scores are the model's cosine between the crop (CLIP-preprocessed pixels under the box) and each
  sentence, computed here independently from NumPy slices of the image; each box takes the argmax."""
  model = pretrained.load(model_dir)
  arr = _image()
  boxes = [[0, 0, 20, 30], [20.4, 0, 40, 30], [25, 10, 35, 20]]
  segs, skipped = match_entry(model, Image.fromarray(arr), boxes, [CAPTION], "e")
  sentences = split_sentences(CAPTION)
  crops = [arr[0:30, 0:20], arr[0:30, 20:40], arr[10:20, 25:35]]  # 20.4 rounds outward to 20
  sims = model.encode_images(crops) @ model.encode_texts(sentences).T
  assert skipped == 0 and [s["box"] for s in segs] == [[float(v) for v in b] for b in boxes]
  for s, row in zip(segs, sims):
    assert s["sentence"] == sentences[int(row.argmax())]
    np.testing.assert_allclose(s["score"], row.max(), rtol=1e-5, atol=1e-6)
  # --min_score drops weak matches; bad boxes are skipped and counted with on_bad_box="skip", else named.
  cut = float(np.sort(sims.max(1))[1])
  assert len(match_entry(model, Image.fromarray(arr), boxes, [CAPTION], "e", min_score=cut)[0]) == 2
  segs, skipped = match_entry(model, Image.fromarray(arr), boxes + [[3, 3, 2, 9]], [CAPTION], "e", on_bad_box="skip")
  assert skipped == 1 and len(segs) == 3
  with pytest.raises(BadBox, match="e box 3: box \\[3, 3, 2, 9\\] is empty"):
    match_entry(model, Image.fromarray(arr), boxes + [[3, 3, 2, 9]], [CAPTION], "e")


def test_cli_writes_segments_in_the_pairs_layout(model_dir, tmp_path):
  Image.fromarray(_image()).save(tmp_path / "a.png")
  entries = [{"filename": "a.png", "caption": CAPTION, "boxes": [[0, 0, 20, 30], [20, 0, 40, 30]]},
             {"filename": "a.png", "captions": ["a green thing"], "split": "test"}]
  (tmp_path / "boxes.json").write_text(json.dumps(entries))
  out = tmp_path / "pairs.json"
  proc = run_py(["-m", "hnclip_jax.tools.match_segments", "--model", model_dir, "--manual_dir", str(tmp_path),
                 "--boxes", str(tmp_path / "boxes.json"), "--out", str(out)])
  assert "2 boxes in 2 entries -> 2 segments" in proc.stdout
  got = json.loads(out.read_text())
  assert "boxes" not in got[0] and [s["box"] for s in got[0]["segments"]] == [[0, 0, 20, 30], [20, 0, 40, 30]]
  assert all(s["sentence"] in split_sentences(CAPTION) and -1 <= s["score"] <= 1 for s in got[0]["segments"])
  assert got[1] == entries[1]  # entries without boxes pass through unchanged
  entries[0]["boxes"].append([0, 0, 0, 0])
  (tmp_path / "boxes.json").write_text(json.dumps(entries))
  proc = run_py(["-m", "hnclip_jax.tools.match_segments", "--model", model_dir, "--manual_dir", str(tmp_path),
                 "--boxes", str(tmp_path / "boxes.json"), "--out", str(tmp_path / "bad.json")], check=False)
  assert_error_exit(proc, "boxes.json[0] box 2: box [0, 0, 0, 0] is empty or reversed")
  assert not (tmp_path / "bad.json").exists()
