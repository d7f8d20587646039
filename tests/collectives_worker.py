"""One process of tests/collectives_multiprocess_test.py: runs collectives on a mesh spanning
processes.

    python tests/collectives_worker.py PROCESS_ID NUM_PROCESSES PORT OUTPUT.npz

Each process owns 4 CPU devices; the mesh holds all of them, process by process, so mesh position
``i`` is process ``i // 4``, local device ``i % 4``. It writes the rows of every (total, sent) its
devices hold, keyed by mesh position.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LOCAL_DEVICES = 4
AXIS = "data"


def cases():
    """(name, function of the local vector) pairs; the test runs the same ones in one process."""
    from jaxcomp import collectives

    return [
        ("ar_topk_star", lambda x: collectives.ar_topk(x, 9, AXIS, "star", step=jnp.int32(3))),
        ("ar_topk_var", lambda x: collectives.ar_topk(x, 9, AXIS, "var")),
        ("zfp_ring", lambda x: collectives.zfp_allreduce(x, 8, AXIS, "ring")),
        (
            "zfp_recursive_doubling",
            lambda x: collectives.zfp_allreduce(x, 8, AXIS, "recursive_doubling"),
        ),
    ]


def gradients(n_devices, n):
    """Small integers: every sum is exact in any order, whichever all-reduce gloo runs."""
    return np.random.default_rng(11).integers(-40, 41, (n_devices, n)).astype(np.float32)


def run(mesh, X):
    """Every case on ``mesh``: {name: (total, sent)} as global arrays sharded by mesh position."""
    sharding = NamedSharding(mesh, P(AXIS))
    flat = X.reshape(-1)
    x = jax.make_array_from_callback(flat.shape, sharding, lambda index: flat[index])
    out = {}
    for name, fn in cases():
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS), P(AXIS))))
        out[name] = f(x)
    return out


def main():
    # The test imports this module for cases() and run(); only a worker process changes its devices,
    # before its backend starts.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    process_id, num_processes, port, output = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert jax.process_count() == num_processes and len(devices) == num_processes * LOCAL_DEVICES, (
        f"expected {num_processes} processes of {LOCAL_DEVICES} devices, got {jax.process_count()} "
        f"and {len(devices)} devices"
    )
    print(
        f"process {process_id}: {len(devices)} devices, {jax.process_count()} processes", flush=True
    )
    mesh = Mesh(np.array(devices), (AXIS,))
    X = gradients(len(devices), 501)
    rows = {}
    for name, results in run(mesh, X).items():
        for label, array in zip(("total", "sent"), results):
            for shard in array.addressable_shards:
                position = shard.index[0].start // X.shape[1]
                rows[f"{name}/{label}/{position}"] = np.asarray(shard.data)
    np.savez(output, **rows)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
