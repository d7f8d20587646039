"""jax.distributed: 2 processes x 4 CPU devices (gloo) train like 1 process x 8 devices."""

import os

import numpy as np
import pytest

from jaxcomp.launch import launch
import multihost_worker
from helpers import need_devices, subprocess_env


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    need_devices(8)
    out = tmp_path / "params.npz"
    env_path = os.environ.get("PYTHONPATH")
    # launch() passes this process's environment on to the workers.
    os.environ["PYTHONPATH"] = subprocess_env()["PYTHONPATH"]
    try:
        code = launch([multihost_worker.__file__, str(out)], num_processes=2, devices_per_process=4, timeout=240)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    assert code == 0, f"the 2-process run failed with exit code {code}"
    got = np.load(out)
    want = multihost_worker.run()
    assert sorted(got.files) == sorted(want)
    for name, value in want.items():
        # Same algorithm and data; only the all-reduce's summation order differs (gloo between
        # processes vs XLA's in-process reduction), so values agree to float32 rounding.
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=1e-7, err_msg=name)


def test_launcher_reports_the_first_failure():
    code = launch(["-c", "import sys, os; sys.exit(3 if os.environ['JAXCOMP_PROCESS_ID'] == '1' else 0)"],
                  num_processes=2)
    assert code == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"command": [], "num_processes": 2}, "command"),
    ({"command": ["x.py"], "num_processes": 0}, "num_processes"),
    ({"command": ["x.py"], "num_processes": 2, "devices_per_process": 0}, "devices_per_process"),
])
def test_launcher_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(**kwargs)

