"""Collectives on a mesh spanning two processes (jax.distributed, gloo) match the one-process
run."""

import subprocess
import sys

import collectives_worker as worker
import jax
import numpy as np
import pytest
from helpers import free_port, need_devices, subprocess_env
from jax.sharding import Mesh

TIMEOUT_S = 180


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    need_devices(8)
    num_processes = 2
    port = free_port()
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    outputs = [tmp_path / f"process{i}.npz" for i in range(num_processes)]
    processes = [
        subprocess.Popen(
            [sys.executable, worker.__file__, str(i), str(num_processes), str(port), str(out)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outputs)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, log in zip(processes, logs):
        assert process.returncode == 0, f"worker failed:\n{log[-3000:]}"

    rows = {}
    for out in outputs:
        with np.load(out) as data:
            rows.update({key: data[key] for key in data.files})
    n_devices = num_processes * worker.LOCAL_DEVICES
    X = worker.gradients(n_devices, 501)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), (worker.AXIS,))
    expected = worker.run(mesh, X)
    for name, results in expected.items():
        for label, array in zip(("total", "sent"), results):
            single = np.asarray(array).reshape(n_devices, -1)
            multi = np.stack([rows[f"{name}/{label}/{position}"] for position in range(n_devices)])
            np.testing.assert_array_equal(multi, single, err_msg=f"{name} {label}")
            if label == "total":
                np.testing.assert_array_equal(multi, np.broadcast_to(multi[0], multi.shape))
