"""Every sharding decision in one place: the mesh from config, logical axes of parameters, and batch layout.

Parameters carry *logical* axis names (`LOGICAL_AXES`, matched on their path);
`config.mesh.rules` maps logical names to mesh axes. The defaults give FSDP
over `fsdp` (weights split along the model width) and Megatron-style tensor
parallelism over `tensor` (attention heads, MLP hidden units, vocabulary).
The batch is split over data × fsdp.
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the global batch is split over these
DEFAULT_RULES = "embed=fsdp,heads=tensor,mlp=tensor,vocab=tensor"

# The towers' top-level modules every family has (models/clip.py CLIP); a family adds its own (Family.modules,
# FAMILY_MODULES); any other top-level module is a framework's part (CLIPConfig.parts).
SHARED_MODULES = ("patch_embed", "vision", "ln_post", "token_embedding", "text", "ln_final")

# (regex on the "/"-joined parameter path, logical axis per dimension); first match wins.
# "norm" and None are never sharded (small vectors are not worth a collective).
LOGICAL_AXES = (
    # LoRA / DoRA adapters (models/adapters.py): A [in, r] and B [r, out] split like the kernel they adapt.
    (r"attn/(q|k|v)/lora/lora_a$", ("embed", None)),
    (r"attn/(q|k|v)/lora/lora_b$", (None, "heads")),
    (r"attn/out/lora/lora_a$", ("heads", None)),
    (r"attn/out/lora/lora_b$", (None, "embed")),
    (r"fc1/lora/lora_a$", ("embed", None)),
    (r"fc1/lora/lora_b$", (None, "mlp")),
    (r"fc2/lora/lora_a$", ("mlp", None)),
    (r"fc2/lora/lora_b$", (None, "embed")),
    (r"magnitude$", "replicated"),
    (r"attn/(q|k|v)/kernel$", ("embed", "heads")),
    (r"attn/(q|k|v)/bias$", ("heads",)),
    (r"attn/out/kernel$", ("heads", "embed")),
    (r"fc1/kernel$", ("embed", "mlp")),
    (r"fc1/bias$", ("mlp",)),
    (r"fc2/kernel$", ("mlp", "embed")),
    (r"patch_embed/kernel$", (None, None, None, "embed")),
    (r"(vision|text)_positions$", (None, "embed")),
    (r"(visual|text)_(token_)?projection$", ("embed", None)),
    (r"token_embedding/embedding$", ("vocab", "embed")),
    (r"(bias|scale|class_embedding|logit_scale|logit_bias)$", "replicated"),
)


def constrain_batch(x):
  """Pins an activation's leading (batch or batch x position) dimension to the batch axes of the mesh the step is
  traced under (train_step sets it: `jax.sharding.use_abstract_mesh`); other dimensions are left to XLA. A no-op
  without one (single-device code, eval). Without it XLA's partitioner, under FSDP, may shard the blocks'
  activations along the width like the weights and all-gather them for each weight gradient: ViT-B/16 at batch 256
  on v5e:2x2 with fsdp=4 moved 54 GB of collectives per step (docs/sharding.md)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  if not batch:
    return x
  return jax.lax.with_sharding_constraint(x, P(batch, *([None] * (x.ndim - 1))))


def check_mesh_sizes(mesh_config) -> None:
  """config.mesh's sizes, before any device is known: each axis positive or -1 (= fill), at most one -1; the same
  for config.mesh.dcn. Raises naming the sizes (config.validate, and every mesh built from a config)."""
  for name, sizes, fill in (("config.mesh", [mesh_config[a] for a in MESH_AXES], "devices"),
                            ("config.mesh.dcn", list(dcn_sizes(mesh_config)), "slices or hosts")):
    if sum(a == -1 for a in sizes) > 1 or any(a == 0 or a < -1 for a in sizes):
      raise ValueError(f"{name} (data, fsdp, tensor) = {tuple(sizes)}: sizes must be positive, "
                       f"with at most one -1 (= fill with the remaining {fill})")


def mesh_shape(mesh_config, num_devices: int, name: str = "config.mesh",
               what: str = "devices") -> tuple[int, int, int]:
  """Resolves config.mesh (one axis may be -1) against the device count; raises naming the sizes."""
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  if -1 in sizes:
    rest = math.prod(s for s in sizes if s != -1)
    if num_devices % rest:
      raise ValueError(f"{name} {dict(zip(MESH_AXES, sizes))}: the fixed axes multiply to {rest}, "
                       f"which does not divide the {num_devices} {what}")
    sizes[sizes.index(-1)] = num_devices // rest
  if math.prod(sizes) != num_devices:
    raise ValueError(f"{name} {dict(zip(MESH_AXES, sizes))} multiplies to {math.prod(sizes)} but there are "
                     f"{num_devices} {what}; make the product {num_devices} or set one axis to -1")
  return tuple(sizes)


def dcn_sizes(mesh_config) -> tuple[int, int, int]:
  """config.mesh.dcn's (data, fsdp, tensor) sizes; (1, 1, 1) when absent (one fast network)."""
  dcn = mesh_config.get("dcn", None) if hasattr(mesh_config, "get") else None
  return tuple(int(dcn[a]) for a in MESH_AXES) if dcn is not None else (1, 1, 1)


def granules(devices) -> tuple[str, list]:
  """The groups of devices joined only by the slow network: on TPU the slices (devices of a multi-slice job carry
  `slice_index`; the hosts of one slice share its ICI), otherwise processes (one per host on GPU and CPU). -> (kind, [[devices of granule 0], ...])."""
  if devices[0].platform == "tpu":  # hosts of one slice share its ICI; a single-slice job's devices have no index
    kind, key = "slice", lambda d: getattr(d, "slice_index", 0) or 0
  else:
    kind, key = "process", lambda d: d.process_index
  groups = {}
  for d in devices:
    groups.setdefault(key(d), []).append(d)
  return kind, [groups[k] for k in sorted(groups)]


def make_mesh(mesh_config, devices=None) -> Mesh:
  """The (data, fsdp, tensor) mesh of config.mesh over `devices` (default: all), with Auto axis types.

  With config.mesh.dcn all 1 (the default) every device is on one fast network: `jax.make_mesh` orders them
  topology-aware (on TPU, neighbouring chips along the inner axes). Otherwise the mesh is hybrid: config.mesh.data /
  fsdp / tensor are the sizes inside one granule (a TPU slice, or a process = a host on GPU / CPU), config.mesh.dcn
  the sizes across granules, each mesh axis their product with the DCN part outermost
  (`mesh_utils.create_hybrid_device_mesh`), so only collectives along an axis with a DCN size > 1 leave a granule.
  """
  devices = jax.devices() if devices is None else list(devices)
  check_mesh_sizes(mesh_config)
  dcn = dcn_sizes(mesh_config)
  types = (AxisType.Auto,) * len(MESH_AXES)
  if all(s == 1 for s in dcn):
    shape = mesh_shape(mesh_config, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  kind, groups = granules(devices)
  plural = "processes" if kind == "process" else "slices"
  if len(groups) == 1:
    raise ValueError(f"config.mesh.dcn {dict(zip(MESH_AXES, dcn))} puts mesh axes across {plural}, but all "
                     f"{len(devices)} devices are in one {kind}: there is no slow network to cross. Set "
                     "config.mesh.dcn.data/fsdp/tensor to 1")
  sizes = {len(g) for g in groups}
  if len(sizes) > 1:
    raise ValueError(f"the {len(groups)} {plural} hold different numbers of devices ({sorted(sizes)}); a hybrid "
                     "mesh (config.mesh.dcn) needs the same number in each")
  dcn = mesh_shape(mesh_config["dcn"], len(groups), "config.mesh.dcn", plural)
  ici = mesh_shape(mesh_config, len(groups[0]), "config.mesh (sizes inside one " + kind + ")", f"devices per {kind}")
  if kind == "slice" and dcn[1] > 1 and ici[1] > 1:
    raise ValueError(f"config.mesh.fsdp={ici[1]} with config.mesh.dcn.fsdp={dcn[1]}: an fsdp axis both inside and "
                     "across TPU slices makes XLA's TPU compiler abort (libtpu 0.0.42.1: a cross-slice "
                     "reduce-scatter of a 'mixed' dimension is not supported). Put fsdp inside the slices "
                     "(config.mesh.dcn.fsdp=1) or only across them (config.mesh.fsdp=1)")
  ordered = [d for g in groups for d in g]
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, ordered, process_is_granule=kind == "process")
  return Mesh(grid, MESH_AXES, axis_types=types)


def describe_dcn(mesh: Mesh, mesh_config) -> str:
  """'' on a one-network mesh; else e.g. '; across 2 processes (the slow network): data ×2' for the log."""
  if all(s == 1 for s in dcn_sizes(mesh_config)):
    return ""
  kind, groups = granules(list(mesh.devices.flat))
  plural = "processes" if kind == "process" else "slices"
  dcn = mesh_shape(mesh_config["dcn"], len(groups), "config.mesh.dcn", plural)
  return f"; across {len(groups)} {plural} (the slow network): " + ", ".join(
      f"{a} ×{s}" for a, s in zip(MESH_AXES, dcn) if s != 1)


def granule_of(mesh: Mesh) -> list:
  """For each device of `mesh` in flat (partition-id) order, the index of its granule (slice or process)."""
  flat = list(mesh.devices.flat)
  kind, groups = granules(flat)
  index = {d.id: i for i, g in enumerate(groups) for d in g}
  return [index[d.id] for d in flat]


def process_rows(mesh: Mesh, n: int, process: int | None = None) -> np.ndarray:
  """The rows of a batch of `n` (split over the batch axes, `batch_sharding`) that `process`'s devices (default:
  this process's) hold, ascending: what that process reads so that `jax.make_array_from_process_local_data` builds
  the global batch. On a flat mesh, process p's contiguous n / processes rows; on a hybrid mesh with the fsdp or
  tensor axis across processes, a strided or the whole batch."""
  process = jax.process_index() if process is None else process
  rows = set()
  for device, index in batch_sharding(mesh).devices_indices_map((n,)).items():
    if device.process_index == process:
      rows.update(range(*index[0].indices(n)))
  return np.array(sorted(rows), np.int64)


def parse_rules(rules: str) -> dict:
  """'embed=fsdp,heads=tensor' -> {'embed': 'fsdp', 'heads': 'tensor'}; a mesh axis may be 'none'."""
  out = {}
  for item in filter(None, (r.strip() for r in rules.split(","))):
    if "=" not in item:
      raise ValueError(f"config.mesh.rules item {item!r} is not 'logical=mesh_axis'")
    logical, axis = (s.strip() for s in item.split("=", 1))
    if axis not in MESH_AXES + ("none",):
      raise ValueError(f"config.mesh.rules maps {logical!r} to {axis!r}; mesh axes are {MESH_AXES} or 'none'")
    out[logical] = None if axis == "none" else axis
  return out


def batch_shards(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_size(batch_size: int, mesh: Mesh, name: str = "config.batch_size", accum_steps: int = 1) -> int:
  """A global batch must split evenly over the mesh's batch shards (and into `accum_steps` micro-batches); raises
  naming the config keys. Returns the per-device (micro-)batch."""
  n = batch_shards(mesh)
  if accum_steps == 1 and batch_size % n:
    raise ValueError(f"{name}={batch_size} is not divisible by the {n} batch shards of the mesh "
                     f"(data × fsdp = {mesh.shape['data']} × {mesh.shape['fsdp']}); use a multiple of {n}")
  if batch_size % (accum_steps * n):
    raise ValueError(f"{name}={batch_size} must be divisible by config.grad_accum_steps={accum_steps} × "
                     f"the {n} batch shards = {accum_steps * n}")
  return batch_size // (accum_steps * n)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over data × fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


# Model families' own top-level modules and the rules of their own parameters (their heads), added by
# models.family.get as each family loads (Family.modules, Family.logical_axes); the rules go ahead of the shared ones.
FAMILY_MODULES: dict[str, tuple] = {}
FAMILY_AXES: dict[str, tuple] = {}


def add_family(family: str, modules: tuple, rules: tuple) -> None:
  FAMILY_MODULES[family], FAMILY_AXES[family] = tuple(modules), tuple(rules)


def is_framework_part(path: str) -> bool:
  """Whether parameter `path` lies in a top-level module no loaded model family has: a framework's own part."""
  top, _, rest = path.partition("/")
  return bool(rest) and top not in SHARED_MODULES and not any(top in m for m in FAMILY_MODULES.values())


def logical_axes(path: str, ndim: int):
  """A parameter's logical axes: the loaded model families' own rules (FAMILY_AXES), then a framework's own modules
  (CLIPConfig.parts, e.g. token aggregators of ~0.1M parameters at ViT-L: replicated), then the shared
  LOGICAL_AXES; the first match wins."""
  family = [r for rules in FAMILY_AXES.values() for r in rules]
  framework = [(r".", "replicated")] if is_framework_part(path) else []
  for pattern, axes in (*family, *framework, *LOGICAL_AXES):
    if re.search(pattern, path):
      axes = (None,) * ndim if axes == "replicated" else axes
      if len(axes) != ndim:
        raise ValueError(f"parameter {path} has {ndim} dims but its logical axes are {axes}")
      return axes
  raise ValueError(f"parameter {path} has no logical axes in hnclip_jax/sharding.py LOGICAL_AXES or its model "
                   "family's Family.logical_axes; add a rule")


def check_model_fits(model_cfg, mesh: Mesh, rules: dict) -> None:
  """Megatron-style splits need whole heads and whole MLP columns per device; raises naming the config field."""
  for logical, fields in (("heads", ("vision_heads", "text_heads")), ("mlp", ("vision_mlp_dim", "text_mlp_dim")),
                          ("embed", ("vision_width", "text_width")), ("vocab", ("vocab_size",))):
    axis = rules.get(logical)
    if axis is None or mesh.shape[axis] == 1:
      continue
    for field in fields:
      value = getattr(model_cfg, field)
      if value % mesh.shape[axis]:
        raise ValueError(f"config.model.{field}={value} cannot be split over mesh axis {axis!r} of size "
                         f"{mesh.shape[axis]} (config.mesh.rules maps {logical!r} to it); choose a mesh.{axis} "
                         f"that divides it or map {logical!r} to none")


def param_specs(params, mesh: Mesh, rules: dict):
  """PartitionSpec tree for a params(-shaped) tree; raises if a dimension does not divide its mesh axis."""

  def spec(path, x):
    name = _path_str(path)
    axes = [rules.get(a) if a is not None else None for a in logical_axes(name, len(x.shape))]
    for dim, axis in zip(x.shape, axes):
      if axis is not None and dim % mesh.shape[axis]:
        raise ValueError(f"parameter {name} {tuple(x.shape)}: a dimension of size {dim} cannot be split over "
                         f"mesh axis {axis!r} of size {mesh.shape[axis]}")
    return P(*axes)

  return jax.tree_util.tree_map_with_path(spec, params)


def state_shardings(abstract_state, params_key: str, mesh: Mesh, rules: dict):
  """Shardings for a train state: params by their logical axes; optimizer moments like the parameter they follow.

  An optimizer-state leaf follows the parameter whose path is a suffix of its own
  path and has its shape (Adam's mu/nu); anything else (counters) is replicated.
  """
  specs = param_specs(abstract_state[params_key], mesh, rules)
  by_path = {}
  for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]:
    by_path[_path_str(path)] = s
  shapes = {_path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract_state[params_key])[0]}

  def shard(path, x):
    name = _path_str(path)
    parts = name.split("/")
    for i in range(len(parts)):
      suffix = "/".join(parts[i:])
      if suffix in by_path and shapes[suffix] == x.shape:
        return NamedSharding(mesh, by_path[suffix])
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(shard, abstract_state)


def to_global(local_batch: dict, mesh: Mesh) -> dict:
  """Host-local numpy batch (this process's rows) -> global jax.Arrays sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


# XLA:CPU compiles element-wise producers of a matmul (LayerNorm's scale, softmax's 1/sum) into separate
# materialised broadcasts when its YNNPACK fusions are on; with them off they fuse, the MLP is 7-12% and the whole
# step a few percent faster on CPU (benchmarks/layers.py, docs/benchmarks.md). Step and embed programs on CPU
# meshes only.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(mesh):
  """XLA compiler options for the programs run on `mesh` (None: XLA's defaults)."""
  return dict(CPU_COMPILER_OPTIONS) if mesh.devices.flat[0].platform == "cpu" else None
