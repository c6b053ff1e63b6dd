"""Run as a script with 8 fake CPU devices (tests/test_sharding.py does): `python tests/sharded_checks.py SECTION...`
prints one JSON line of the named sections' measurements (all of them without arguments). Sections are independent
(each its own random data), so the test suite spreads them over its workers."""
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hnclip_jax import losses, optim, sharding, train_step
from hnclip_jax.models import CLIPConfig, init_params
from hnclip_jax.frameworks.finelip import FineLIPTerm
from hnclip_jax.frameworks.goal import GOALTerm
from hnclip_jax.frameworks.structxlip import StructXLIPTerm
from hnclip_jax.objective import GLOBAL_OUTPUTS, Objective, embedding_outputs

LAYOUTS = [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (4, 1, 2)]
CFG = CLIPConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=32, vision_layers=1, vision_heads=4,
                 vision_mlp_dim=64, text_context=8, vocab_size=64, text_width=32, text_layers=1, text_heads=4,
                 text_mlp_dim=64, eot_token_id=3)
RULES = sharding.parse_rules(sharding.DEFAULT_RULES)
out = {}


def mesh_of(shape):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), sharding.MESH_AXES)


def max_rel(a, b):
  """Largest gradient difference relative to the largest reference gradient entry (key biases have exactly-zero
  true gradients, so a per-leaf ratio would divide round-off by round-off)."""
  a, b = [np.asarray(x) for x in jax.tree.leaves(a)], [np.asarray(x) for x in jax.tree.leaves(b)]
  assert len(a) == len(b)
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / max(float(np.abs(y).max()) for y in b)


graphdef, params = init_params(CFG, 0)
GRAPHDEF, PARAMS = graphdef, params
rng = np.random.default_rng(0)
B = 16
# Captions of unequal length (start 2, words, end 3, then padding 0), so the token term's masks matter.
lengths = rng.integers(3, 9, B)
tokens = np.where(np.arange(8)[None] < lengths[:, None] - 1, rng.integers(4, 64, (B, 8)), 0)
tokens[:, 0], tokens[np.arange(B), lengths - 1] = 2, 3
batch = {"image": rng.normal(size=(B, 16, 16, 3)).astype(np.float32), "tokens": tokens.astype(np.int32)}


def grads_on(shape, accum=1, negatives="global_batch", chunk=0, gamma=0.5, token_weight=0.0, model=None, data=None,
             **terms):
  graphdef, params = model or (GRAPHDEF, PARAMS)
  data = batch if data is None else data
  mesh = mesh_of(shape)
  abstract = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)}
  psh = sharding.state_shardings(abstract, "params", mesh, RULES)["params"]
  objective = Objective.of(gamma=gamma, chunk_size=chunk, token_weight=token_weight, **terms)
  fn = train_step.make_grad_fn(graphdef, mesh, objective, accum, negatives)
  bsh = sharding.batch_sharding(mesh)
  f = jax.jit(fn, in_shardings=(psh, bsh), out_shardings=(sharding.replicated(mesh), psh))
  (loss, _), grads = f(jax.device_put(params, psh), jax.device_put(data, bsh))
  return float(loss), jax.device_get(grads), psh


def rel(loss, grads, ref):
  return {"loss_rel": abs(loss - ref[0]) / ref[0], "grad_rel": max_rel(grads, ref[1])}


def outputs_of(model=None, data=None, **settings):
  """The model's outputs for the objective of `settings` (Objective.of keywords), on one device: what
  `loss_grads_on` differentiates."""
  graphdef, params = model or (GRAPHDEF, PARAMS)
  data = batch if data is None else data
  objective = Objective.of(**settings)
  forward = train_step.make_forward(graphdef, objective)
  return jax.device_get(jax.jit(forward)(params, {k: data[k] for k in objective.input_keys}))


def loss_grads_on(shape, outputs, accum=1, negatives="global_batch", chunk=0, gamma=0.5, token_weight=0.0,
                  **settings):
  """`grads_on` for the objective alone: the loss on the mesh of `shape` and its gradient with respect to the
  model's outputs (embeddings, token features, s, b), the per-example outputs split over the batch axes as the step
  has them. The objective-variant sections check their settings this way (one small program per layout); the
  towers' sharded backward pass is checked by `core`, `token`, `adapters` and one tower run in each of them."""
  mesh = mesh_of(shape)
  objective = Objective.of(gamma=gamma, chunk_size=chunk, token_weight=token_weight, **settings)
  loss_of = train_step.make_loss_of_outputs(mesh, objective, accum, negatives)
  floats, masks = train_step.partition_outputs(outputs)
  on = lambda tree: {k: sharding.replicated(mesh) if k in GLOBAL_OUTPUTS else sharding.batch_sharding(mesh)  # noqa: E731
                     for k in tree}
  f = jax.jit(jax.value_and_grad(lambda fl, ma: loss_of(fl, ma)[0]), in_shardings=(on(floats), on(masks)),
              out_shardings=(sharding.replicated(mesh), on(floats)))
  loss, grads = f(jax.device_put(floats, on(floats)), jax.device_put(masks, on(masks)))
  return float(loss), jax.device_get(grads)


def core():
  """L_HN on every layout, parameter and optimizer-state specs, accumulation (global and micro-batch negatives),
  row chunks."""
  ref_loss, ref_grads, _ = ref = grads_on((1, 1, 1))
  out["layouts"] = {}
  for shape in LAYOUTS:
    loss, grads, psh = grads_on(shape)
    out["layouts"][str(shape)] = rel(loss, grads, ref)
    if shape == (2, 2, 2):
      blk = psh["text"]["blocks"][0]
      out["specs"] = {"q_kernel": str(blk["attn"]["q"]["kernel"].spec),
                      "out_kernel": str(blk["attn"]["out"]["kernel"].spec),
                      "fc1_kernel": str(blk["fc1"]["kernel"].spec), "fc2_kernel": str(blk["fc2"]["kernel"].spec),
                      "ln1_scale": str(blk["ln1"]["scale"].spec),
                      "token_embedding": str(psh["token_embedding"]["embedding"].spec),
                      "logit_scale": str(psh["logit_scale"].spec)}

  # Optimizer state follows the parameters.
  mesh = mesh_of((2, 2, 2))
  tx = optim.make_optimizer(ml_collections.ConfigDict(dict(lr=1e-3, weight_decay=0.1, warmup_steps=1, b1=0.9,
                                                                b2=0.98, eps=1e-6, grad_clip_norm=1.0)), 10)
  abstract_state = jax.eval_shape(lambda p: train_step.init_state(p, tx), PARAMS)
  ssh = sharding.state_shardings(abstract_state, "params", mesh, RULES)
  mu = ssh["opt_state"][1][0].mu
  out["opt_mu_q_kernel"] = str(mu["vision"]["blocks"][0]["attn"]["q"]["kernel"].spec)
  out["opt_count"] = str(ssh["opt_state"][1][0].count.spec)

  # Gradient accumulation.
  out["accum"] = {}
  for shape, a in [((8, 1, 1), 2), ((2, 2, 2), 2), ((2, 2, 2), 4)]:
    loss, grads, _ = grads_on(shape, accum=a, negatives="global_batch")
    out["accum"][f"global_batch x{a} {shape}"] = rel(loss, grads, ref)
  loss_mb, _, _ = grads_on((4, 1, 1), accum=2, negatives="micro_batch")
  # Reference for micro-batch negatives: micro-batch k holds rows k, k+2, ...; the loss is the mean over them.
  from hnclip_jax.models import bind
  m = bind(GRAPHDEF, PARAMS)
  img, txt = np.asarray(m.encode_image(batch["image"])), np.asarray(m.encode_text(batch["tokens"]))
  ref_mb = np.mean([float(losses.hn_clip_loss(img[k::2], txt[k::2], m.scale(), 0.5)) for k in range(2)])
  out["micro_batch_loss_rel"] = abs(loss_mb - ref_mb) / ref_mb
  out["micro_batch_differs_from_global"] = abs(loss_mb - ref_loss) / ref_loss

  # Row-chunked loss.
  loss_c, grads_c, _ = grads_on((4, 1, 1), chunk=2)
  out["chunked"] = rel(loss_c, grads_c, ref)


def token():
  """The full objective with the token term (λ = 1): every layout, accumulation and chunking equal one device."""
  ref_loss = grads_on((1, 1, 1))[0]
  ref = grads_on((1, 1, 1), token_weight=1.0)
  out["token_term_differs"] = abs(ref[0] - ref_loss) / ref_loss
  out["token_layouts"] = {}
  # Through the towers: the batch over one axis (8, 1, 1), over two with the parameters split by the third (2, 2, 2),
  # and global-batch accumulation.
  for name, kw in (("(8, 1, 1)", dict(shape=(8, 1, 1))), ("(2, 2, 2)", dict(shape=(2, 2, 2))),
                   ("accum x2 (2, 2, 2)", dict(shape=(2, 2, 2), accum=2))):
    loss, grads, _ = grads_on(token_weight=1.0, **kw)
    out["token_layouts"][name] = rel(loss, grads, ref)
  # On the model's outputs (the towers' backward on these layouts is `core`'s): the other three layouts and 1-row
  # chunks.
  outs = outputs_of(token_weight=1.0)
  ref_o = loss_grads_on((1, 1, 1), outs, token_weight=1.0)
  for name, kw in (("outputs (2, 4, 1)", dict(shape=(2, 4, 1))), ("outputs (1, 8, 1)", dict(shape=(1, 8, 1))),
                   ("outputs (4, 1, 2)", dict(shape=(4, 1, 2))),
                   ("outputs chunk 1 (4, 1, 1)", dict(shape=(4, 1, 1), chunk=1))):
    loss, grads = loss_grads_on(kw.pop("shape"), outs, token_weight=1.0, **kw)
    out["token_layouts"][name] = rel(loss, grads, ref_o)
  # token_group=2 (each example's token negatives: its group of 2 consecutive rows; no caption tokens sent), a
  # setting of the objective: on the model's outputs (loss_grads_on), the layouts that split the groups over devices
  # differently, 1-row chunks and micro-batch negatives equal one device.
  group = dict(token_weight=1.0, token_group=2, token_margin=True)
  ref_g = loss_grads_on((1, 1, 1), outs, **group)
  out["token_group_differs"] = abs(ref_g[0] - ref[0]) / ref[0]
  out["token_group_layouts"] = {}
  for name, kw in (("(8, 1, 1)", dict(shape=(8, 1, 1))), ("(2, 2, 2)", dict(shape=(2, 2, 2))),
                   ("chunk 1 (4, 1, 1)", dict(shape=(4, 1, 1), chunk=1)),
                   ("micro-batch negatives, accum x2 (4, 1, 1)", dict(shape=(4, 1, 1), accum=2,
                                                                     negatives="micro_batch"))):
    loss, grads = loss_grads_on(kw.pop("shape"), outs, **kw, **group)
    want = ref_g if "micro" not in name else loss_grads_on((1, 1, 1), outs, accum=2, negatives="micro_batch", **group)
    out["token_group_layouts"][name] = rel(loss, grads, want)
  # token_keep=0.5 (each example's tokens chosen by the model's forward on its own device, per micro-batch, before
  # anything is sent): through the towers, both schedules and global-batch accumulation equal one device.
  ref_k = grads_on((1, 1, 1), token_weight=1.0, token_keep=0.5)
  out["token_keep_differs"] = abs(ref_k[0] - ref[0]) / ref[0]
  out["token_keep_layouts"] = {}
  for name, kw in (("(2, 2, 2)", dict(shape=(2, 2, 2))),
                   ("ring (8, 1, 1)", dict(shape=(8, 1, 1), token_schedule="ring")),
                   ("accum x2 (2, 2, 2)", dict(shape=(2, 2, 2), accum=2))):
    loss, grads, _ = grads_on(token_weight=1.0, token_keep=0.5, **kw)
    out["token_keep_layouts"][name] = rel(loss, grads, ref_k)


# DoRA has every adapter leaf (lora_a, lora_b, magnitude) and the column norms: (8, 1, 1), (2, 2, 2) and accumulation
# in `adapters`, the other three layouts in `adapters_layouts` (`-m long`); LoRA (the same lora_a / lora_b rules) on
# the layout that splits over all three axes.
ADAPTER_RUNS = {"lora": [((2, 2, 2), {})], "dora": [((8, 1, 1), {}), ((2, 2, 2), {}), ((2, 2, 2), {"accum": 2})]}
ADAPTER_OTHER_LAYOUTS = {"dora": [((2, 4, 1), {}), ((1, 8, 1), {}), ((4, 1, 2), {})]}


def adapters_(runs_of=ADAPTER_RUNS):
  """LoRA / DoRA adapters (random, so every adapter leaf has a gradient) with the token term, on the runs of
  `runs_of` (method -> [(layout, grads_on keywords)]), equal one device, and the adapter leaves are split like the
  kernels they adapt."""
  import dataclasses
  from hnclip_jax.models import abstract_model, adapters
  out["adapters"] = {}
  for method, runs in runs_of.items():
    acfg = dataclasses.replace(CFG, adapter=method, adapter_rank=4, adapter_alpha=8.0)
    aparams = adapters.add_adapters(PARAMS, acfg, 0)
    key = jax.random.key(5)
    aparams = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.2 * jax.random.normal(jax.random.fold_in(key, len(adapters.path_of(p))), x.shape)
        if adapters.is_adapter(adapters.path_of(p)) else x, aparams)
    amodel = (abstract_model(acfg)[0], aparams)
    ref = grads_on((1, 1, 1), token_weight=1.0, model=amodel)
    for shape, kw in runs:
      loss, grads, psh = grads_on(shape, token_weight=1.0, model=amodel, **kw)
      out["adapters"][f"{method} {shape}{' accum x2' if kw else ''}"] = rel(loss, grads, ref)
      if shape == (2, 2, 2) and not kw:
        q = psh["text"]["blocks"][0]["attn"]["q"]
        fc2 = psh["text"]["blocks"][0]["fc2"]
        out["adapters"][f"{method} specs"] = {"q_lora_a": str(q["lora"]["lora_a"].spec),
                                               "q_lora_b": str(q["lora"]["lora_b"].spec),
                                               "fc2_lora_a": str(fc2["lora"]["lora_a"].spec)}


# A framework's terms on the layouts that run different code for them: the batch over one axis with the others of
# size 1 (8, 1, 1) and over two axes with the parameters split by the third (2, 2, 2); global-batch accumulation and
# 1-row chunks. (2, 4, 1), (1, 8, 1) and (4, 1, 2) differ from these in how the towers' parameters are split, which
# the frameworks' terms do not touch: `core` runs the towers on all five; `token` and `ring` run the objective on
# all five (the other three on the model's outputs); DoRA's other three are `adapters_layouts` (`-m long`).
VARIANTS = [((8, 1, 1), {}), ((2, 2, 2), {}), ((2, 2, 2), {"accum": 2}), ((4, 1, 1), {"chunk": 1})]


def every_variant(name, terms):
  """A framework's terms (and their inputs, terms["data"]) on every layout, with accumulation and 1-row chunks,
  against one device: out[name_layouts]; out[name_differs]: how much the terms change the loss (L_HN alone)."""
  ref = grads_on((1, 1, 1), **terms)
  out[f"{name}_layouts"] = {}
  for shape, kw in VARIANTS:
    loss, grads, _ = grads_on(shape, **kw, **terms)
    out[f"{name}_layouts"][f"{shape} {kw}"] = rel(loss, grads, ref)
  out[f"{name}_differs"] = abs(ref[0] - grads_on((1, 1, 1), data=terms["data"])[0]) / ref[0]


def finelip():
  """FineLIP: L_HN + the late-interaction hinge on aggregated tokens (with γ·Ḡ on its negatives too): every layout,
  accumulation over the global batch and chunking equal one device."""
  import dataclasses
  from hnclip_jax.frameworks import finelip as finelip_fw
  fmodel = init_params(dataclasses.replace(CFG, parts=finelip_fw.PARTS,
                                           part_settings=(("hidden_ratio", 0.2), ("tokens", 3))), 0)
  fine = dict(terms=(FineLIPTerm(weight=1.0, hn_margin=True),), model=fmodel)
  ref = grads_on((1, 1, 1), **fine)
  out["finelip_layouts"] = {}
  for shape, kw in VARIANTS:
    loss, grads, psh = grads_on(shape, **kw, **fine)
    out["finelip_layouts"][f"{shape} {kw}"] = {
        **rel(loss, grads, ref), "aggregator_grad": float(np.abs(grads["image_aggregator"]["fc1"]["kernel"]).max())}
    if shape == (2, 2, 2) and not kw:
      out["finelip_layouts"]["aggregator spec"] = str(psh["text_aggregator"]["fc1"]["kernel"].spec)
  out["finelip_differs"] = abs(ref[0] - grads_on((1, 1, 1), model=fmodel)[0]) / ref[0]


def goal():
  """GOAL: L_HN + segment InfoNCE (with γ·Ḡ of the sentences) + the patch and span alignments, on a batch where
  some examples have no segment, some boxes cover no patch and some sentences are not in their caption."""
  r = np.random.default_rng(1)
  goal_batch = dict(batch)
  goal_batch["seg_image"] = r.normal(size=(B, 16, 16, 3)).astype(np.float32)
  goal_batch["seg_tokens"] = np.roll(tokens, 3, axis=0).astype(np.int32)
  patches = (r.random((B, 4)) < 0.5).astype(np.float32)
  patches[1] = 0.0  # a box the crop cut away
  goal_batch["seg_patches"] = patches
  span = ((np.arange(8)[None] >= 1) & (np.arange(8)[None] < lengths[:, None] - 1) & (r.random((B, 8)) < 0.7))
  span[2] = False  # a sentence not found in its caption
  goal_batch["seg_span"] = span.astype(np.float32)
  goal_batch["seg_valid"] = np.arange(B) % 5 != 4  # rows 4, 9, 14: no segment
  every_variant("goal", dict(terms=(GOALTerm(segment_weight=0.5, patch_weight=1.0, text_weight=1.0,
                                             segment_margin=True),), data=goal_batch))


def structxlip():
  """StructXLIP: L_HN + structure InfoNCE (γ·Ḡ of the structure captions) + RGB-edge consistency + the local
  chunk-vs-crop term, with rows lacking crops or chunks."""
  r = np.random.default_rng(2)
  K, C = 2, 3
  sx_batch = dict(batch)
  sx_batch["sx_edge"] = r.normal(size=(B, 16, 16, 3)).astype(np.float32)
  sx_batch["sx_crop_edges"] = r.normal(size=(B, K, 16, 16, 3)).astype(np.float32)
  crop_valid = r.random((B, K)) < 0.7
  crop_valid[5] = False
  sx_batch["sx_crop_valid"] = crop_valid
  sx_batch["sx_tokens"] = np.roll(tokens, 5, axis=0).astype(np.int32)
  chunks = np.zeros((B, C, 8), np.float32)
  for i in range(B):
    for c in range(C):
      if (i + c) % 4:
        chunks[i, c, 1 + c:3 + c] = 1
  sx_batch["sx_chunks"] = chunks
  every_variant("structxlip", dict(terms=(StructXLIPTerm(structure_weight=0.5, consistency_weight=0.3,
                                                         local_weight=0.4, structure_margin=True),), data=sx_batch))


def plugin():
  """A framework from outside the package (tests/plugins/patch_align.py: its own input, model output and term) on
  the layouts, accumulation and chunks of VARIANTS, against one device."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "plugins"))
  from patch_align import PatchAlignTerm
  r = np.random.default_rng(3)
  data = dict(batch, pa_weight=r.uniform(0.5, 3.0, B).astype(np.float32))
  terms = dict(terms=(PatchAlignTerm(weight=0.7),), data=data)
  ref = grads_on((1, 1, 1), **terms)
  out["plugin_layouts"] = {}
  for shape, kw in VARIANTS:
    loss, grads, _ = grads_on(shape, **kw, **terms)
    out["plugin_layouts"][f"{shape} {kw}"] = rel(loss, grads, ref)
  out["plugin_differs"] = abs(ref[0] - grads_on((1, 1, 1))[0]) / ref[0]


def _buffer_sizes(hlo: str) -> list[int]:
  return [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"[fs]\d+\[([\d,]*)\]", hlo)]


def memory():
  """Compiled programs on 8 devices: no device holds B×B logits, nor the token terms' pairwise tensors."""
  mesh = mesh_of((8, 1, 1))
  sh = NamedSharding(mesh, P(sharding.BATCH_AXES))
  out["memory"] = {}
  for chunk in (0, 32):
    for gb in (1024, 2048, 4096):
      x = jax.ShapeDtypeStruct((gb, 64), jnp.float32, sharding=sh)
      f = lambda a, b: Objective.of(gamma=0.5, chunk_size=chunk)(embedding_outputs(a, b, 30.0), mesh)[0]
      compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, x).compile()
      shapes = set(re.findall(r"f32\[(\d+),(\d+)\]", compiled.as_text()))
      out["memory"][f"{chunk}/{gb}"] = {
          "temp": compiled.memory_analysis().temp_size_in_bytes,
          "has_full": (str(gb), str(gb)) in shapes,
          "has_rows": (str(gb // 8), str(gb)) in shapes or (str(chunk), str(gb)) in shapes}

  # The token term's memory: no [B, B, P, L] (nor [n_local, B, P, L]) buffer anywhere in the compiled program.
  TB, TP, TL, TE = 256, 16, 12, 8
  tok = {"img": jax.ShapeDtypeStruct((TB, TE), jnp.float32, sharding=sh),
         "txt": jax.ShapeDtypeStruct((TB, TE), jnp.float32, sharding=sh),
         "img_tokens": jax.ShapeDtypeStruct((TB, TP, TE), jnp.float32, sharding=sh),
         "txt_tokens": jax.ShapeDtypeStruct((TB, TL, TE), jnp.float32, sharding=sh)}
  mask = jax.ShapeDtypeStruct((TB, TL), jnp.bool_, sharding=sh)
  f = lambda o, m: Objective.of(gamma=0.5, token_weight=1.0)({**o, "txt_mask": m, "scale": jnp.float32(30.0)}, mesh)[0]
  sizes = _buffer_sizes(jax.jit(jax.value_and_grad(f)).lower(tok, mask).compile().as_text())
  out["token_memory"] = {"largest_buffer": max(sizes), "BxBxPxL": TB * TB * TP * TL,
                         "nxBxPxL": TB // 8 * TB * TP * TL, "block": losses.TOKEN_BLOCK ** 2 * TP * TL}
  # FineLIP's hinge: no [B, B, Ti, Tt] (nor [n_local, B, Ti, Tt]) buffer either.
  FT = 10
  agg = {"img": tok["img"], "txt": tok["txt"], "img_agg": jax.ShapeDtypeStruct((TB, FT, TE), jnp.float32, sharding=sh),
         "txt_agg": jax.ShapeDtypeStruct((TB, FT, TE), jnp.float32, sharding=sh)}
  f = lambda o: Objective.of(gamma=0.5, terms=(FineLIPTerm(weight=1.0),))({**o, "scale": jnp.float32(30.0)}, mesh)[0]
  sizes = _buffer_sizes(jax.jit(jax.value_and_grad(f)).lower(agg).compile().as_text())
  out["finelip_memory"] = {"largest_buffer": max(sizes), "BxBxTxT": TB * TB * FT * FT,
                           "nxBxTxT": TB // 8 * TB * FT * FT, "block": losses.TOKEN_BLOCK ** 2 * FT * FT}
  # StructXLIP's local term: each device scores its rows' chunks against all crops ([n, C, B·K]); no [B, C, B, K].
  XC, XK = 16, 3
  sxo = {k: tok[k] for k in ("img", "txt")}
  sxo.update({"sx_edge_img": tok["img"], "sx_txt": tok["txt"],
              "sx_crop_img": jax.ShapeDtypeStruct((TB, XK, TE), jnp.float32, sharding=sh),
              "sx_chunks": jax.ShapeDtypeStruct((TB, XC, TE), jnp.float32, sharding=sh)})
  sxm = {"sx_crop_valid": jax.ShapeDtypeStruct((TB, XK), jnp.bool_, sharding=sh),
         "sx_chunk_valid": jax.ShapeDtypeStruct((TB, XC), jnp.bool_, sharding=sh)}
  f = lambda o, m: Objective.of(gamma=0.5, terms=(StructXLIPTerm(local_weight=1.0),))({**o, **m, "scale": jnp.float32(30.0)}, mesh)[0]
  sizes = _buffer_sizes(jax.jit(jax.value_and_grad(f)).lower(sxo, sxm).compile().as_text())
  out["structxlip_memory"] = {"largest_buffer": max(sizes), "rows": TB // 8 * XC * TB * XK,
                              "full": TB * XC * TB * XK}


def ring():
  """The token term's ring schedule (config.loss.token_schedule="ring"): every layout, accumulation and chunking equal
  one device (and so the gather schedule); per device, no caption-token buffer grows with the global batch."""
  outs = outputs_of(token_weight=1.0)
  ref = loss_grads_on((1, 1, 1), outs, token_weight=1.0)
  out["ring_layouts"] = {}
  for shape in LAYOUTS:
    loss, grads = loss_grads_on(shape, outs, token_weight=1.0, token_schedule="ring")
    out["ring_layouts"][str(shape)] = rel(loss, grads, ref)
  for name, kw in (("chunk 1 (4, 1, 1)", dict(shape=(4, 1, 1), chunk=1)),
                   ("micro-batch negatives, accum x2 (4, 2, 1)", dict(shape=(4, 2, 1), accum=2,
                                                                     negatives="micro_batch"))):
    loss, grads = loss_grads_on(kw.pop("shape"), outs, token_weight=1.0, token_schedule="ring", **kw)
    want = ref if "micro" not in name else loss_grads_on((1, 1, 1), outs, token_weight=1.0, accum=2,
                                                         negatives="micro_batch")
    out["ring_layouts"][name] = rel(loss, grads, want)
  # Through the towers, with global-batch accumulation (the schedule inside the whole sharded step).
  loss, grads, _ = grads_on((2, 2, 2), accum=2, token_weight=1.0, token_schedule="ring")
  out["ring_layouts"]["towers, accum x2 (2, 2, 2)"] = rel(loss, grads, grads_on((1, 1, 1), token_weight=1.0))
  # Compiled value and gradient of the objective at 32 rows per device on 4 and on 8 devices (global batch 128 and
  # 256): the largest buffer holding caption tokens ([..., L, E]) under each schedule.
  TP, TL, TE, rows = 5, 7, 24, 32
  out["ring_memory"] = {}
  for devices in (4, 8):
    mesh = mesh_of((devices, 1, 1))
    sh = NamedSharding(mesh, P(sharding.BATCH_AXES))
    tb = rows * devices
    o = {"img": jax.ShapeDtypeStruct((tb, TE), jnp.float32, sharding=sh),
         "txt": jax.ShapeDtypeStruct((tb, TE), jnp.float32, sharding=sh),
         "img_tokens": jax.ShapeDtypeStruct((tb, TP, TE), jnp.float32, sharding=sh),
         "txt_tokens": jax.ShapeDtypeStruct((tb, TL, TE), jnp.float32, sharding=sh)}
    mask = jax.ShapeDtypeStruct((tb, TL), jnp.bool_, sharding=sh)
    for schedule in ("gather", "ring"):
      obj = Objective.of(gamma=0.5, token_weight=1.0, token_schedule=schedule)
      f = lambda o, m, obj=obj, mesh=mesh: obj({**o, "txt_mask": m, "scale": jnp.float32(30.0)}, mesh)[0]
      hlo = jax.jit(jax.value_and_grad(f)).lower(o, mask).compile().as_text()
      tokens = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"[fs]\d+\[([\d,]*)\]", hlo)
                if dims.endswith(f",{TL},{TE}")]
      out["ring_memory"][f"{schedule}/{devices}"] = {"largest_token_buffer": max(tokens), "global_batch": tb,
                                                     "rows": rows, "L": TL, "E": TE,
                                                     "collective_permutes": hlo.count("collective-permute")}


def sigmoid():
  """HN-SigLIP (config.loss.kind="sigmoid") on a SigLIP-family model: both schedules on every layout, accumulation
  (global and micro-batch negatives) and row chunks equal one device; no device holds B×B logits or, under the
  ring, the [B, D] captions."""
  import dataclasses
  model = init_params(dataclasses.replace(CFG, family="siglip", logit_bias=True, embed_dim=32, act="gelu_tanh"), 0)
  kw = dict(model=model, kind="sigmoid")
  # Through the towers (t, b and both towers' gradients): one device, and the ring with global-batch accumulation.
  ref = grads_on((1, 1, 1), sigmoid_schedule="gather", **kw)
  out["sigmoid_bias_grad"] = float(np.abs(ref[1]["logit_bias"]))
  out["sigmoid_layouts"] = {}
  loss, grads, _ = grads_on((2, 2, 2), accum=2, sigmoid_schedule="ring", **kw)
  out["sigmoid_layouts"]["towers, ring accum x2 (2, 2, 2)"] = rel(loss, grads, ref)
  # The schedules on the model's outputs (loss_grads_on): every layout, 1-row chunks, micro-batch negatives.
  outs = outputs_of(model=model, kind="sigmoid")
  ref = loss_grads_on((1, 1, 1), outs, kind="sigmoid", sigmoid_schedule="gather")
  plain = loss_grads_on((1, 1, 1), outs, kind="sigmoid", sigmoid_schedule="gather", gamma=0.0)
  out["sigmoid_margin_differs"] = abs(ref[0] - plain[0]) / plain[0]
  runs = [(f"{schedule} {shape}", dict(shape=shape, sigmoid_schedule=schedule))
          for schedule, shapes in (("ring", LAYOUTS), ("gather", [(8, 1, 1), (2, 2, 2)])) for shape in shapes]
  runs += [("gather chunk 1 (4, 1, 1)", dict(shape=(4, 1, 1), chunk=1, sigmoid_schedule="gather")),
           ("ring micro-batch negatives, accum x2 (4, 2, 1)", dict(shape=(4, 2, 1), accum=2, negatives="micro_batch",
                                                                  sigmoid_schedule="ring"))]
  for name, extra in runs:
    loss, grads = loss_grads_on(extra.pop("shape"), outs, kind="sigmoid", **extra)
    want = ref if "micro" not in name else loss_grads_on((1, 1, 1), outs, kind="sigmoid", accum=2,
                                                         negatives="micro_batch", sigmoid_schedule="gather")
    out["sigmoid_layouts"][name] = rel(loss, grads, want)
  # Compiled value and gradient at 128 rows per device on 8 devices: the largest [x, B] logits buffer and the largest
  # buffer of caption embeddings ([x, D]) under each schedule.
  mesh = mesh_of((8, 1, 1))
  sh = NamedSharding(mesh, P(sharding.BATCH_AXES))
  gb, d = 1024, 48
  x = jax.ShapeDtypeStruct((gb, d), jnp.float32, sharding=sh)
  out["sigmoid_memory"] = {}
  for schedule in ("gather", "ring"):
    obj = Objective.of(gamma=0.5, kind="sigmoid", sigmoid_schedule=schedule)
    f = lambda a, b, obj=obj: obj({**embedding_outputs(a, b, 10.0), "bias": jnp.float32(-10.0)}, mesh)[0]
    hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, x).compile().as_text()
    shapes = [tuple(int(v) for v in dims.split(",")) for dims in re.findall(r"f32\[(\d+,\d+)\]", hlo)]
    out["sigmoid_memory"][schedule] = {"B": gb, "D": d, "has_BxB": (gb, gb) in shapes,
                                       "largest_emb_rows": max(r for r, c in shapes if c == d),
                                       "collective_permutes": hlo.count("collective-permute")}


# The global term's controls (issue 55): each a setting of the term; HN-NCE with γ = 0 as its paper runs it.
CONTROLS = {"constant_batch_mean": dict(margin="constant"), "constant_0.4": dict(margin="constant", margin_value=0.4),
            "shuffled": dict(margin="shuffled", shuffle_seed=3), "topk_3": dict(margin="topk", margin_topk=3),
            "hn_nce_0.5": dict(gamma=0.0, hn_nce_beta=0.5), "t2i_only": dict(margin_directions="t2i")}
CONTROL_VARIANTS = [((2, 2, 2), {}), ((4, 1, 1), {"chunk": 1})]


def controls():
  """The margin controls (constant, shuffled, top-k) and HN-NCE, settings of the objective checked on the model's
  outputs (loss_grads_on): (2, 2, 2) and 4 devices with 1-row chunks equal one device, and each changes the loss.
  The sigmoid loss with the constant margin (ring and gather) and the shuffled / top-k margins (gather). Top-k
  through the towers with global-batch accumulation."""
  out["controls"], out["controls_differ"] = {}, {}
  outs = outputs_of()
  plain = loss_grads_on((1, 1, 1), outs)
  for name, kw in CONTROLS.items():
    ref = loss_grads_on((1, 1, 1), outs, **kw)
    out["controls_differ"][name] = abs(ref[0] - plain[0]) / plain[0]
    for shape, v in CONTROL_VARIANTS:
      loss, grads = loss_grads_on(shape, outs, **v, **kw)
      out["controls"][f"{name} {shape} {v}"] = rel(loss, grads, ref)
  import dataclasses
  model = init_params(dataclasses.replace(CFG, family="siglip", logit_bias=True, embed_dim=32, act="gelu_tanh"), 0)
  souts = outputs_of(model=model, kind="sigmoid")
  for name, kw, schedules in (("sigmoid constant", dict(margin="constant"), ("ring", "gather")),
                              ("sigmoid shuffled", dict(margin="shuffled"), ("gather",)),
                              ("sigmoid topk_3", dict(margin="topk", margin_topk=3), ("gather",))):
    ref = loss_grads_on((1, 1, 1), souts, kind="sigmoid", sigmoid_schedule="gather", **kw)
    for schedule in schedules:
      loss, grads = loss_grads_on((2, 2, 2), souts, kind="sigmoid", sigmoid_schedule=schedule, **kw)
      out["controls"][f"{name} {schedule} (2, 2, 2)"] = rel(loss, grads, ref)
  topk = CONTROLS["topk_3"]
  loss, grads, _ = grads_on((2, 2, 2), accum=2, **topk)
  out["controls"]["topk_3 towers, accum x2 (2, 2, 2)"] = rel(loss, grads, grads_on((1, 1, 1), **topk))


SECTIONS = {"core": core, "controls": controls, "token": token, "ring": ring, "adapters": adapters_,
            "adapters_layouts": lambda: adapters_(ADAPTER_OTHER_LAYOUTS), "finelip": finelip, "goal": goal,
            "structxlip": structxlip, "memory": memory, "plugin": plugin, "sigmoid": sigmoid}

if __name__ == "__main__":
  for name in sys.argv[1:] or SECTIONS:
    SECTIONS[name]()
  print("RESULT " + json.dumps(out))
