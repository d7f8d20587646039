"""Worker of diloco_cluster_test.py: jaxcomp.diloco with one worker per emulated host.

Usage: python diloco_worker.py OUT_DIR MODE [worker_metrics | zero], with MODE ``train`` (every
process runs STEPS inner steps, syncing every SYNC_EVERY with 8-bit pseudo-gradients,
``jaxcomp.Quantized(8)``, and writes its final global params to OUT_DIR/host<i>.npz) or ``kill``
(process 1 SIGKILLs itself before inner step KILL_AT, between two syncs). With
``worker_metrics`` the steps between syncs run no collective at all (each worker keeps its own
loss); without, they all-reduce the loss, a scalar. With ``zero`` each process is a worker of
all its devices: a two-level mesh (``workers`` over the processes, ``data`` over each one's
devices) with ``shard="optimizer"``, the inner Adam state split over the devices of a host.

Every process prints its ``mesh`` axes, ``step N`` as it goes, ``synced N`` after each sync
(and saves the global params it holds then to OUT_DIR/synced<i>.npz), ``stopping T`` /
``raised NAME T`` with T its ``time.monotonic()`` (one clock for every process of the machine),
and, once something was raised, saves the global params of the last state it holds to
OUT_DIR/after<i>.npz: what a script's ``except`` would checkpoint.
"""

import os
import signal
import sys
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.distributed import launch

STEPS, SYNC_EVERY, KILL_AT = 10, 4, 6
ROWS = 8  # per worker


def loss_fn(params, batch):
    pred = jax.numpy.tanh(batch["x"] @ params["w"]) @ params["v"] + params["b"]
    return jax.numpy.mean((pred - batch["y"]) ** 2)


def params0():
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(16, 32)) / 4).astype(np.float32),
        "v": (rng.normal(size=(32, 4)) / 6).astype(np.float32),
        "b": np.zeros(4, np.float32),
    }


def global_batches(workers):
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        yield {
            "x": rng.normal(size=(ROWS * workers, 16)).astype(np.float32),
            "y": rng.normal(size=(ROWS * workers, 4)).astype(np.float32),
        }


def build(mesh, worker_metrics=False):
    two_level = dict(inner_axis="data", shard="optimizer") if len(mesh.axis_names) == 2 else {}
    return jaxcomp.diloco(
        loss_fn,
        optax.adam(1e-2),
        mesh=mesh,
        sync_every=SYNC_EVERY,
        compress=jaxcomp.Quantized(8),
        worker_metrics=worker_metrics,
        **two_level,
    )


def make_mesh(devices, zero=False):
    """One worker per process: ``("workers",)``, or with ``zero`` a row of each process's
    devices on ``("workers", "data")``."""
    if not zero:
        return Mesh(np.array(devices), ("workers",))
    workers = len({d.process_index for d in devices})
    rows = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(rows).reshape(workers, -1), ("workers", "data"))


def held_params(state):
    """This process's copy of the replicated global params, on the host."""
    return {k: np.asarray(v.addressable_data(0)) for k, v in state.global_params.items()}


def run(out_dir, mode, process_id, worker_metrics=False, zero=False):
    """This process's part of the job (see the module docstring)."""

    def save(name, params):
        np.savez(os.path.join(out_dir, f"{name}{process_id}.npz"), **params)

    mesh = make_mesh(jax.devices(), zero)
    workers = mesh.shape["workers"]
    print("mesh " + " ".join(f"{k}={v}" for k, v in mesh.shape.items()), flush=True)
    dl = build(mesh, worker_metrics)
    state = dl.init(params0())
    try:
        for step, batch in enumerate(global_batches(workers)):
            if mode == "kill" and process_id == 1 and step == KILL_AT:
                print(f"stopping {time.monotonic():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            mine = jax.tree.map(lambda x: x[process_id * ROWS : (process_id + 1) * ROWS], batch)
            # Dispatch is asynchronous: a failed step raises when its state is waited for, so
            # keep the last finished state until the new one is ready.
            new_state, _ = dl.step(state, dl.shard_batch(mine))
            state = jax.block_until_ready(new_state)
            print(f"step {step}", flush=True)
            if (step + 1) % SYNC_EVERY == 0:
                save("synced", held_params(state))
                print(f"synced {step}", flush=True)
    except BaseException as e:
        print(f"raised {type(e).__name__} {time.monotonic():.3f}", flush=True)
        save("after", held_params(state))  # the last state this process holds is intact
        raise
    save("host", held_params(state))


def reference(devices, workers=None):
    """The ``train`` job's final global params in one process, on ``devices``: one a worker, or
    (``workers``) a ``workers x len(devices) / workers`` two-level mesh."""
    if workers is None:
        mesh = Mesh(np.array(devices), ("workers",))
    else:
        mesh = Mesh(np.array(devices).reshape(workers, -1), ("workers", "data"))
    dl = build(mesh)
    state = dl.init(params0())
    for batch in global_batches(mesh.shape["workers"]):
        state, _ = dl.step(state, dl.shard_batch(batch))
    return {k: np.asarray(v) for k, v in dl.params(state).items()}


if __name__ == "__main__":
    pid = launch.initialize()  # before any JAX op
    run(sys.argv[1], sys.argv[2], pid, sys.argv[3:] == ["worker_metrics"], sys.argv[3:] == ["zero"])
