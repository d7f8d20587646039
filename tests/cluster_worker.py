"""Worker of cluster_test.py: a few data-parallel steps per method on one emulated host.

Usage: python cluster_worker.py OUT_DIR [fail]. Each process writes OUT_DIR/host<i>.npz with its
final params per method, its eth0 byte and packet counters around each method's steps, and the
bytes_sent metric. With ``fail``, process 1 exits with code 3 right after joining the job while
process 0 waits in a collective.
"""

import os
import sys

from jaxcomp.distributed import launch

launch.initialize()  # before any JAX op

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxcomp.optim.transform import compress  # noqa: E402
from jaxcomp.training.trainer import data_parallel  # noqa: E402

STEPS = 5
GLOBAL_BATCH = 16
# 655k params, 4 timed steps: the collectives' bytes dominate the headers, and the coordination
# service's own messages on the same link (tens of KB now and then) stay far below 5%.
SHAPES = {"w1": (64, 2048), "w2": (2048, 256), "b": (256,)}
METHODS = {"ar_topk": {"ratio": 0.05}, "zfp": {"rate": 8}}


def loss_fn(params, batch):
    h = jax.numpy.tanh(batch["x"] @ params["w1"]) @ params["w2"] + params["b"]
    return jax.numpy.mean((h - batch["y"]) ** 2)


def params0():
    rng = np.random.default_rng(1)
    return {
        name: (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)
        for name, shape in SHAPES.items()
    }


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield {
            "x": rng.normal(size=(GLOBAL_BATCH, 64)).astype(np.float32),
            "y": rng.normal(size=(GLOBAL_BATCH, 256)).astype(np.float32),
        }


def retransmitted_segments():
    """TCP segments this host's network namespace sent again (/proc/net/snmp is per namespace)."""
    lines = [line.split() for line in open("/proc/net/snmp") if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def counters():
    base = "/sys/class/net/eth0/statistics/"
    return np.array(
        [
            int(open(base + name).read())
            for name in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
        ]
        + [retransmitted_segments()]
    )


def run(devices, local_rows):
    """Final params per method, and per method (wire counters, bytes_sent per step)."""
    mesh = Mesh(np.array(devices), ("data",))
    out, wire = {}, {}
    for method, options in METHODS.items():
        dp = data_parallel(
            loss_fn, optax.chain(compress(method, **options), optax.adam(1e-2)), mesh
        )
        state = dp.init(params0())
        batch_list = list(batches())
        state, metrics = dp.step(
            state, dp.shard_batch(local_rows(batch_list[0]))
        )  # compile, warm up
        jax.block_until_ready(metrics["loss"])
        before = counters() if os.path.exists("/sys/class/net/eth0") else None
        for batch in batch_list[1:]:
            state, metrics = dp.step(state, dp.shard_batch(local_rows(batch)))
            jax.block_until_ready(metrics["loss"])
        if before is not None:
            wire[method] = np.concatenate(
                [
                    counters() - before,
                    [float(np.asarray(metrics["bytes_sent"].addressable_data(0)))],
                ]
            )
        for name, value in state.params.items():
            out[f"{method}/{name}"] = np.asarray(value.addressable_data(0))
    return out, wire


if __name__ == "__main__":
    if sys.argv[2:] == ["fail"]:
        from jax.experimental import multihost_utils

        if jax.process_index() == 1:
            os._exit(3)
        multihost_utils.sync_global_devices("never completes")
        raise SystemExit(0)
    rows = GLOBAL_BATCH // jax.process_count()
    lo = jax.process_index() * rows
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    params, wire = run(devices, lambda batch: {k: v[lo : lo + rows] for k, v in batch.items()})
    np.savez(
        os.path.join(sys.argv[1], f"host{jax.process_index()}.npz"),
        **params,
        **{f"wire/{m}": w for m, w in wire.items()},
    )
