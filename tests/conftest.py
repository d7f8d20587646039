"""Test session set-up: 8 virtual CPU devices, before any JAX op runs."""

import os

import pytest

# The XLA flag works for every process (including the ones multi-process tests start); the
# config option is its in-process twin. Both must be set before JAX initializes a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


def pytest_collection_modifyitems(config, items):
    """Two groups for pytest-xdist's ``--dist loadgroup`` (pyproject's ``addopts``): the tests
    that run on this process's 8 virtual devices all go to one worker, one after another (two
    8-device processes at once can deadlock XLA:CPU's in-process collectives: "Termination timeout
    for all reduce"); the ``multiprocess`` tests, which start their own 1-device processes and
    mostly wait (peers, timeouts, emulated links), run beside them on the other worker."""
    for item in items:
        group = "processes" if item.get_closest_marker("multiprocess") else "devices"
        item.add_marker(pytest.mark.xdist_group(group))
