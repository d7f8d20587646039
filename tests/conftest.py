"""Test session set-up: 8 virtual CPU devices, before any JAX op runs."""

import os

# The XLA flag works for every process (including the ones multi-process tests start); the
# config option is its in-process twin. Both must be set before JAX initializes a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
