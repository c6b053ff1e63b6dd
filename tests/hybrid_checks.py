"""Run as 2 processes × 4 fake CPU devices (tests/test_multihost.py does): the processes are the slow network's
granules, and hybrid meshes (config.mesh.dcn) put one axis across them. Each check computes the objective's loss
and every parameter gradient on a hybrid mesh (the batch fed the way train.py feeds it: each process its
`sharding.process_rows`) and on one local device of the same process, with the models, batches and terms of
tests/sharded_checks.py. Process 0 prints one JSON line: {name: {"loss_rel", "grad_rel"}}.

  python tests/hybrid_checks.py --coordinator_address=127.0.0.1:PORT --num_processes=2 --process_id=I
"""
import json
import os
import sys

import jax

args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
jax.distributed.initialize(args["coordinator_address"], int(args["num_processes"]), int(args["process_id"]))

import dataclasses  # noqa: E402

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import sharded_checks as sc  # noqa: E402

from hnclip_jax import sharding, train_step  # noqa: E402
from hnclip_jax.frameworks.finelip import FineLIPTerm  # noqa: E402
from hnclip_jax.models import abstract_model, adapters, init_params  # noqa: E402
from hnclip_jax.objective import Objective  # noqa: E402


def hybrid_mesh(ici, dcn):
  return sharding.make_mesh(ml_collections.ConfigDict({**dict(zip(sharding.MESH_AXES, ici)),
                                                       "dcn": dict(zip(sharding.MESH_AXES, dcn))}))


def grads_on(mesh, accum=1, negatives="global_batch", chunk=0, gamma=0.5, token_weight=0.0, model=None, **terms):
  """sharded_checks.grads_on, for a mesh whose devices span processes: inputs built from each process's rows,
  gradients gathered to every process."""
  graphdef, params = model or (sc.GRAPHDEF, sc.PARAMS)
  abstract = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)}
  psh = sharding.state_shardings(abstract, "params", mesh, sc.RULES)["params"]
  objective = Objective.of(gamma=gamma, chunk_size=chunk, token_weight=token_weight, **terms)
  fn = train_step.make_grad_fn(graphdef, mesh, objective, accum, negatives)
  bsh = sharding.batch_sharding(mesh)
  f = jax.jit(fn, in_shardings=(psh, bsh), out_shardings=(sharding.replicated(mesh), psh))
  put = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: np.asarray(x)[i])  # noqa: E731
  rows = sharding.process_rows(mesh, sc.B)
  batch = {k: jax.make_array_from_process_local_data(bsh, v[rows], v.shape) for k, v in sc.batch.items()}
  (loss, _), grads = f(jax.tree.map(put, params, psh), batch)
  if loss.is_fully_addressable:  # the one-device reference
    return float(loss), jax.device_get(grads)
  return float(multihost_utils.process_allgather(loss, tiled=True)), multihost_utils.process_allgather(grads, tiled=True)


def one_device(**kw):
  """The reference: the same objective on this process's first device alone, computed by process 0 only (it alone
  compares and prints; process 1 would compile the same one-device programs for nothing)."""
  if jax.process_index() != 0:
    return None
  mesh = Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  return grads_on(mesh, **kw)


DATA = ((1, 2, 2), (2, 1, 1))  # data parallelism across the processes; fsdp × tensor inside each
FSDP = ((2, 2, 1), (1, 2, 1))  # FSDP across the processes (each process a strided share of the batch)
TENSOR = ((2, 2, 1), (1, 1, 2))  # tensor parallelism across the processes (both read the whole batch)

out = {}


def check(name, layout, ref, **kw):
  loss, grads = grads_on(hybrid_mesh(*layout), **kw)
  if ref is not None:
    out[name] = sc.rel(loss, grads, ref)


ref = one_device()
for name, layout in (("dcn data", DATA), ("dcn fsdp", FSDP), ("dcn tensor", TENSOR)):
  check(name, layout, ref)
check("dcn data, accum x2, chunk 2", DATA, ref, accum=2, chunk=2)
token_ref = one_device(token_weight=1.0)
check("token gather, dcn data", DATA, token_ref, token_weight=1.0)
check("token ring, dcn data", DATA, token_ref, token_weight=1.0, token_schedule="ring")
check("token ring, dcn fsdp", FSDP, token_ref, token_weight=1.0, token_schedule="ring")
siglip = init_params(dataclasses.replace(sc.CFG, family="siglip", logit_bias=True, embed_dim=32, act="gelu_tanh"), 0)
sig = dict(model=siglip, kind="sigmoid")
sig_ref = one_device(sigmoid_schedule="gather", **sig)
check("sigmoid ring, dcn data", DATA, sig_ref, sigmoid_schedule="ring", **sig)
check("sigmoid gather, dcn fsdp", FSDP, sig_ref, sigmoid_schedule="gather", **sig)
from hnclip_jax.frameworks import finelip as finelip_fw  # noqa: E402
fmodel = init_params(dataclasses.replace(sc.CFG, parts=finelip_fw.PARTS,
                                         part_settings=(("hidden_ratio", 0.2), ("tokens", 3))), 0)
fine = dict(terms=(FineLIPTerm(weight=1.0, hn_margin=True),), model=fmodel)
check("finelip, dcn data, accum x2", DATA, one_device(**fine), accum=2, **fine)
dcfg = dataclasses.replace(sc.CFG, adapter="dora", adapter_rank=4, adapter_alpha=8.0)
key = jax.random.key(5)
dparams = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.2 * jax.random.normal(jax.random.fold_in(key, len(adapters.path_of(p))), x.shape)
    if adapters.is_adapter(adapters.path_of(p)) else x, adapters.add_adapters(sc.PARAMS, dcfg, 0))
dora = dict(model=(abstract_model(dcfg)[0], dparams), token_weight=1.0)
check("dora + token term, dcn fsdp", FSDP, one_device(**dora), **dora)
if jax.process_index() == 0:
  print("RESULT " + json.dumps(out), flush=True)
