"""Full fine-tuning vs LoRA vs DoRA (config.finetune.method): parameters trained, optimizer-state bytes and what
a step checkpoint holds, at ViT-L/14 (Long-CLIP-L, 248 tokens; shapes only, from jax.eval_shape of the real train
program) and at the tiny size (plus a real Orbax checkpoint's bytes on disk), and the tiny model's train-step time,
measured side by side (alternating order).

  python benchmarks/adapters.py [--reps 7] [--json out.json]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # tcmalloc when installed, like the other step-time benchmarks (hnclip_jax/hostmem.py)
  from hnclip_jax import hostmem
  hostmem.use_tcmalloc(default="auto")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import alternating_times, dump, random_batch, table  # noqa: E402


def program_for(model: dict, method: str, batch: int):
  """The program train.py would build for architecture `model` (config.model fields) trained by `method`
  (experiment.resolve, one device) -> (program, model config, mesh)."""
  from hnclip_jax import config as config_lib, experiment, train_step
  config = config_lib.base_config()
  config.model.update(model)
  config.finetune.method = method
  if method != "full":
    config.finetune.rank, config.finetune.alpha = 16, 16.0
  config.batch_size, config.total_steps = batch, 1000
  config.optimizer.warmup_steps = 1
  run = experiment.resolve(config, None, "compile", devices=jax.devices()[:1])
  return train_step.build_program(run), run.model, run.mesh


def nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def sizes(cfg, method, batch):
  from hnclip_jax import checkpoint, optim
  program, model_cfg, mesh = program_for(cfg, method, batch)
  st = program.abstract_state
  trained = sum(int(np.prod(x.shape)) for x in optim.trained_params(st["opt_state"]))
  step_arrays = st if program.frozen is None else {
      **st, "params": checkpoint.prune(st["params"], lambda p: not program.frozen(p))}
  frozen = 0 if program.frozen is None else nbytes(checkpoint.prune(st["params"], program.frozen))
  return program, model_cfg, mesh, {
      "method": method, "params (M)": nbytes(st["params"]) / 4e6, "trained (M)": trained / 1e6,
      "optimizer state (MB)": nbytes(st["opt_state"]) / 1e6, "step checkpoint arrays (MB)": nbytes(step_arrays) / 1e6,
      "frozen store, once (MB)": frozen / 1e6}


def du(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  from hnclip_jax.config import model_config
  from hnclip_jax.models import init_params
  from hnclip_jax.models.adapters import add_adapters
  import tempfile
  from hnclip_jax import checkpoint, train_step
  tiny = {**dict(model_config("tiny")), "vocab_size": 1024, "eot_token_id": 1023}
  vit_l = dict(model_config("vit_l14", text_context=248))
  results = {"vit_l14": [sizes(vit_l, m, 128)[3] for m in ("full", "lora", "dora")]}
  rows, steps = [], {}
  tiny_cfg = program_for(tiny, "full", args.batch)[1]
  base = jax.device_get(init_params(tiny_cfg, 0)[1])  # host copies: each run's state is donated to its step
  for m in ("full", "lora", "dora"):
    program, model_cfg, mesh, row = sizes(tiny, m, args.batch)
    params = jax.tree.map(np.array, base) if m == "full" else add_adapters(base, model_cfg, 0)
    state = jax.device_put(train_step.init_state(params, program.tx), program.shardings)
    batch = random_batch(model_cfg, args.batch, mesh)
    holder = {"state": state}

    def run(program=program, holder=holder, batch=batch):
      holder["state"], metrics = program.step(holder["state"], batch)
      jax.block_until_ready(metrics["loss"])

    run()  # compile
    steps[m] = run
    with tempfile.TemporaryDirectory() as tmp:  # real Orbax checkpoints of this state: bytes on disk
      ck = checkpoint.Checkpointer(os.path.join(tmp, "checkpoints"), async_save=False, frozen=program.frozen)
      if program.frozen is not None:
        ck.save_frozen(holder["state"]["params"])
      ck.save(1, holder["state"], {"model": {}}, force=True)
      ck.close()
      row["step checkpoint on disk (MB)"] = du(os.path.join(tmp, "checkpoints", "1")) / 1e6
    rows.append(row)
  times = alternating_times(steps, reps=args.reps, inner=3, warmup=1)
  for row in rows:
    t = float(np.median(times[row["method"]]))
    row["step (ms)"] = 1e3 * t
    row["vs full"] = t / float(np.median(times["full"]))
  results["tiny"] = rows
  cols = ["method", "params (M)", "trained (M)", "optimizer state (MB)", "step checkpoint arrays (MB)",
          "frozen store, once (MB)"]
  print(f"ViT-L/14 (248 tokens), rank 16 on q/k/v/out/fc1/fc2 of both towers (shapes only):\n"
        f"{table(results['vit_l14'], cols)}\n")
  print(f"tiny ({tiny['vision_layers']}+{tiny['text_layers']} blocks, width {tiny['vision_width']}), batch {args.batch}, "
        f"{jax.devices()[0].platform}, median of {args.reps} alternating repetitions:\n"
        f"{table(rows, cols + ['step checkpoint on disk (MB)', 'step (ms)', 'vs full'])}")
  dump(args.json, results)


if __name__ == "__main__":
  main()
