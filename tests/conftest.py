"""Test session set-up: 8 virtual CPU devices, before any JAX op runs."""

import os
import shutil
import tempfile

# The XLA flag works for every process (including the ones multi-process tests start); the
# config option is its in-process twin. Both must be set before JAX initializes a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests compile thousands of small programs and run each a few times: LLVM's machine-code
# optimization (-O2 by default) is much of their compile time. At -O0 donate_test's top-k and
# PowerSGD cases took 32 s instead of 46, the zoo and quality tests (which train) 79 s instead
# of 94; a fresh-clone CI's pytest took 30:18 instead of 35:23 (with 35 more tests). XLA's HLO
# passes are unchanged: the fusions, collectives and aliasing that the tests read from compiled
# HLO are the ones users get (the optimized HLO of top-k's, PowerSGD's and ZFP's steps is the
# same text either way). Benchmarks compile with the defaults. JAXCOMP_TEST_XLA_OPT=1 keeps -O2.
if (
    os.environ.get("JAXCOMP_TEST_XLA_OPT") != "1"
    and "xla_backend_optimization_level" not in (os.environ["XLA_FLAGS"])
):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache for the whole run, shared by the xdist workers and the
# processes the tests start (they inherit the environment): many tests compile programs another
# test compiled already (a step of the same method, mesh and model). A cold cache took
# donate_test and pinning_test from 134 s to 116 s. The main process makes it (before xdist
# starts its workers) and removes it at the end. JAX keys an entry by the program, the compile
# options and the XLA flags. "Finished XLA compilation" (helpers.count_compilations) is logged
# for a cache hit too. A step read from the cache keeps the stack-frame tables of the compile
# that wrote it: compare HLO texts without them.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxcomp-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """A multi-process test is a slow one: it waits for ``pytest -m slow``."""
    import pytest

    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)
