"""Device mesh from config and the shardings of batches and parameters."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the global batch is split over these


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Resolves config.mesh (one axis may be -1) against the device count; raises naming the sizes."""
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  if -1 in sizes:
    rest = math.prod(s for s in sizes if s != -1)
    if num_devices % rest:
      raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes multiply to {rest}, "
                       f"which does not divide the {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // rest
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} multiplies to {math.prod(sizes)} but there are "
                     f"{num_devices} devices; make the product equal the device count or set one axis to -1")
  return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def batch_shards(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_size(batch_size: int, mesh: Mesh, name: str = "config.batch_size") -> None:
  n = batch_shards(mesh)
  if batch_size % n:
    raise ValueError(f"{name}={batch_size} is not divisible by the {n} batch shards of the mesh "
                     f"(data × fsdp = {mesh.shape['data']} × {mesh.shape['fsdp']}); use a multiple of {n}")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over data × fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def param_shardings(params, mesh: Mesh):
  """Shardings of a params-shaped tree (data parallelism: replicated)."""
  return jax.tree.map(lambda _: replicated(mesh), params)


def to_global(local_batch: dict, mesh: Mesh) -> dict:
  """Host-local numpy batch (this process's rows) -> global jax.Arrays sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
