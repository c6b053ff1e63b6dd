"""Run as one process of a multi-process CPU job (tests/test_multihost.py starts two, twice): compiles one sharded
program and prints, as one JSON line, the JAX persistent-cache events it saw and this process's CPU topology
fingerprint (the value JAX's cache key hashes, which tests/site/sitecustomize.py replaces on CPU)."""
import json
import sys

import jax
from jax._src import monitoring

events = []
monitoring.register_event_listener(lambda e, **kw: events.append(e))
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
jax.distributed.initialize(args["coordinator_address"], int(args["num_processes"]), int(args["process_id"]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.lib import xla_client  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((2, 4), np.float32),
                                           (2 * jax.process_count(), 4))
y = jax.jit(lambda a: jnp.tanh(a) @ a.T, out_shardings=NamedSharding(mesh, P()))(x)
fingerprint = xla_client.get_topology_for_devices(list(jax.devices())).fingerprint()
print("RESULT " + json.dumps({"process": jax.process_index(), "sum": float(y.sum()), "fingerprint": fingerprint,
                              "hits": events.count("/jax/compilation_cache/cache_hits")}), flush=True)
