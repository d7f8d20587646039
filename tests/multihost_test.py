"""jax.distributed: 2 processes x 4 CPU devices (gloo) train like 1 process x 8 devices."""

import os

import multihost_worker
import numpy as np
import pytest
from helpers import allocator_check_script, need_devices, subprocess_env

from jaxcomp.distributed.launch import launch


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    need_devices(8)
    out = tmp_path / "params.npz"
    env_path = os.environ.get("PYTHONPATH")
    # launch() passes this process's environment on to the workers.
    os.environ["PYTHONPATH"] = subprocess_env()["PYTHONPATH"]
    try:
        code = launch(
            [multihost_worker.__file__, str(out)],
            num_processes=2,
            devices_per_process=4,
            timeout=240,
        )
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
    code = launch(
        ["-c", "import sys, os; sys.exit(3 if os.environ['JAXCOMP_PROCESS_ID'] == '1' else 0)"],
        num_processes=2,
    )
    assert code == 3


def test_launcher_starts_the_processes_with_the_allocator_asked_for(tmp_path):
    from jaxcomp.distributed.launch import main

    script = allocator_check_script(tmp_path)  # exits 0 if started with its argument's
    assert launch([script, "tuned"], num_processes=2, allocator="tuned") == 0
    assert launch([script, "tuned"], num_processes=1) == 3  # glibc's, the default
    assert launch([script, "glibc"], num_processes=1) == 0
    assert main(["-n", "1", "--allocator", "tuned", script, "tuned"]) == 0
    with pytest.raises(ValueError, match="allocator must be one of"):
        launch(["x.py"], num_processes=1, allocator="jemalloc")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"command": [], "num_processes": 2}, "command"),
        ({"command": ["x.py"], "num_processes": 0}, "num_processes"),
        (
            {"command": ["x.py"], "num_processes": 2, "devices_per_process": 0},
            "devices_per_process",
        ),
    ],
)
def test_launcher_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_hosts": 2}, "coordinator"),
        ({"coordinator": "10.0.0.1", "num_hosts": 2, "host_id": 1}, "HOST:PORT"),
        ({"coordinator": "10.0.0.1:7733", "num_hosts": 2, "host_id": 2}, "host_id"),
        ({"coordinator": "10.0.0.1:7733", "port": 7733}, "port"),
        ({"interface": ""}, "interface"),
    ],
)
def test_launcher_multi_host_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(["x.py"], num_processes=1, **kwargs)


def test_several_hosts_number_their_processes_and_pass_the_interface():
    from jaxcomp.distributed.launch import process_env

    script = (
        "import os, sys; e = os.environ; sys.exit(0 if (e['JAXCOMP_PROCESS_ID'], "
        "e['JAXCOMP_NUM_PROCESSES'], e['JAXCOMP_COORDINATOR_ADDRESS'], e['JAXCOMP_INTERFACE']) in "
        "[('2', '4', '10.0.0.1:7733', 'lo'), ('3', '4', '10.0.0.1:7733', 'lo')] else 5)"
    )
    assert (
        launch(
            ["-c", script],
            num_processes=2,
            coordinator="10.0.0.1:7733",
            num_hosts=2,
            host_id=1,
            interface="lo",
        )
        == 0
    )
    assert "JAXCOMP_INTERFACE" not in process_env(
        "h:1", 2, 0, 1, base={"JAXCOMP_INTERFACE": "eth9"}
    )


def test_an_interface_that_does_not_exist_is_named():
    from jaxcomp.distributed.launch import use_gloo_interface

    with pytest.raises(ValueError, match="does not exist"):
        use_gloo_interface("nope0")
