"""The first stage of benchmarks/accelerator.sh: can this machine's Python stack run the project's train step?

  python benchmarks/smoke.py

Prints the versions of the stack next to requirements.txt's pins; imports what the train step and checkpoints need
(jax, flax, optax, orbax-checkpoint, ml_collections, ...) and the project's modules for them; runs two train steps of
the tiny model on random inputs (the program train.py runs: `train_step.build_program` of a `run.Run`), saves a
checkpoint with the project's Checkpointer, restores it onto the same shardings and checks that a step from the
restored state equals a step from the saved one, bit for bit. A few seconds once compiled.

An accelerator image brings its own jax / flax / orbax (seen: jax 0.11.2, flax 0.12.10, orbax-checkpoint 0.12.4 on
Python 3.12, newer than the pins). When any of the above fails, the last line names what failed, with the versions,
and the exit code is 1: the script that runs this stops within seconds instead of spending a lent machine's
minutes on compiles that cannot run. The data packages (grain, array_record, tensorflow-datasets, tokenizers, ...)
are only reported: the train-step benchmarks read no data, and the stages that do fail on their own.
"""
import importlib
import importlib.metadata
import os
import platform
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# distribution -> module. CORE: what the train step and checkpoints import; DATA: the input pipeline and tools.
CORE = {"jax": "jax", "jaxlib": "jaxlib", "ml_dtypes": "ml_dtypes", "numpy": "numpy", "flax": "flax",
        "optax": "optax", "orbax-checkpoint": "orbax.checkpoint", "ml_collections": "ml_collections",
        "absl-py": "absl"}
DATA = {"grain": "grain", "array_record": "array_record", "tensorflow-datasets": "tensorflow_datasets",
        "importlib_resources": "importlib_resources", "tokenizers": "tokenizers", "sentencepiece": "sentencepiece",
        "pillow": "PIL", "opencv-python-headless": "cv2", "tensorboard": "tensorboard", "gcsfs": "gcsfs",
        "safetensors": "safetensors", "matplotlib": "matplotlib"}


def pins() -> dict:
  """requirements.txt's `name==version` lines -> {name: version}."""
  out = {}
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    for line in f:
      m = re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s#]+)", line)
      if m:
        out[m.group(1).lower()] = m.group(2)
  return out


def version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return "missing"


def stack() -> str:
  return ", ".join(f"{d} {version(d)}" for d in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")) + \
      f", Python {platform.python_version()}"


def fail(what: str, err: BaseException) -> None:
  detail = " ".join(f"{type(err).__name__}: {err}".split())[:600]
  print(f"error: smoke: {what} with {stack()}: {detail}", flush=True)
  sys.exit(1)


def say(msg: str, t0: float) -> None:
  print(f"[smoke {time.perf_counter() - t0:5.1f} s] {msg}", flush=True)


def main():
  t0 = time.perf_counter()
  want = pins()
  print(f"Python {platform.python_version()} ({sys.executable})")
  print("| package | here | requirements.txt |\n|---|---|---|")
  for dist in (*CORE, *DATA):
    print(f"| {dist} | {version(dist)} | {want.get(dist.lower(), '-')} |")
  for dist, module in CORE.items():
    try:
      importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 — any import failure is the finding
      fail(f"import {module} ({dist} {version(dist)})", e)
  absent = []
  for dist, module in DATA.items():
    try:
      importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
      absent.append(f"{dist} ({type(e).__name__}: {str(e)[:80]})")
  if absent:
    print("note: the stages that read data or use these will fail: " + "; ".join(absent))
  sys.path.insert(0, ROOT)
  try:
    import jax
    import ml_collections
    import numpy as np
    from benchmarks.common import make_step, random_batch
    from hnclip_jax import checkpoint, sharding, train_step
    from hnclip_jax.models import PRESETS
  except Exception as e:  # noqa: BLE001
    fail("import the project's train step and checkpoint modules", e)
  say(f"imports ok; devices: {jax.device_count()} × {jax.devices()[0].device_kind} ({jax.default_backend()})", t0)

  try:
    mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
    cfg = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "vocab_size": 128, "eot_token_id": 3})
    step, tx, sh, _, _ = make_step(cfg, 0.5, mesh)
    batch = random_batch(cfg, 16, mesh)
    state = train_step.initial_state(tx, sh, model_cfg=cfg)
    losses = []
    for _ in range(2):
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
    if not all(np.isfinite(losses)):
      raise FloatingPointError(f"the two steps' losses are {losses}")
  except Exception as e:  # noqa: BLE001
    fail("two train steps of the tiny model", e)
  say(f"two train steps ok (loss {losses[0]:.4f} -> {losses[1]:.4f})", t0)

  try:
    with tempfile.TemporaryDirectory() as tmp:
      ckpt = checkpoint.Checkpointer(os.path.join(tmp, "checkpoints"))
      ckpt.save(2, state, {"smoke": True})
      ckpt.wait()
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
      restored = ckpt.restore(2, target)
      ckpt.close(quiet=True)
    a, ma = step(restored, batch)  # `restored` first: the step donates its state
    b, mb = step(state, batch)
    same = all(bool(np.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    if not same or float(ma["loss"]) != float(mb["loss"]):
      raise AssertionError("a step from the restored checkpoint differs from a step from the state it saved")
  except Exception as e:  # noqa: BLE001
    fail("a checkpoint save and restore", e)
  say("checkpoint saved, restored, and a step from it equals a step from the saved state", t0)
  print(f"smoke: ok in {time.perf_counter() - t0:.1f} s with {stack()}")


if __name__ == "__main__":
  main()
