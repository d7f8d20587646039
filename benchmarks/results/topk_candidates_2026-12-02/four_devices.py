"""The compress update of each method named on the command line (ratio 0.01) on mlp4096's shapes,
4 CPU devices in one process, each its own random gradient (SPLIT's real all-gather and merge):
best and median of 12 calls after one warm-up. Used by four_devices.sh."""

import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
import jaxcomp

jaxcomp.tune_host_allocator()
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.training import zoo

shapes = zoo.build("mlp4096", abstract=True).params
leaves, treedef = jax.tree.flatten(shapes)
rng = np.random.default_rng(0)
mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
grads = treedef.unflatten([rng.standard_normal((4,) + s.shape, np.float32) for s in leaves])
grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("data")))
for method in sys.argv[1:]:
    tx = jaxcomp.compress(method, ratio=0.01)
    state = jax.jit(tx.init)(treedef.unflatten([jnp.zeros(s.shape, s.dtype) for s in leaves]))

    def update(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, s)

    step = jax.jit(
        jax.shard_map(
            update, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P(), P()), check_vma=False
        )
    )
    jax.block_until_ready(step(grads, state))
    ts = []
    for _ in range(12):
        t = time.perf_counter()
        jax.block_until_ready(step(grads, state))
        ts.append(time.perf_counter() - t)
    print(method, f"best {min(ts) * 1e3:.1f} ms, median {np.median(ts) * 1e3:.1f} ms", flush=True)
