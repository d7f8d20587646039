"""jaxcomp.tune_host_allocator: large blocks stay on the heap, in a process of its own (the
setting is process-wide and permanent, so this test process keeps glibc's defaults)."""

import subprocess
import sys

import pytest
from helpers import subprocess_env

from jaxcomp.ops import allocator

# What every probe below starts with: glibc's malloc, free and mallinfo2 (whose hblkhd counts
# the bytes glibc holds mapped) through ctypes.
MALLINFO = """
import ctypes, json, sys
from jaxcomp.ops import allocator

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
"""

# Allocates and frees a 64 MB block twice and reports glibc's mmapped bytes while it is held:
# above the 32 MB threshold glibc maps every such block, unless tuned.
PROBE = (
    MALLINFO
    + """
tuned = allocator.tune_host_allocator() if sys.argv[1] == "tune" else None
mapped = []
for _ in range(2):
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    mapped.append(libc.mallinfo2().hblkhd)
    libc.free(block)
print(json.dumps({"tuned": tuned, "mapped": mapped}))
"""
)


def _probe(mode, env=None):
    import json

    base = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        cwd="/",  # not the checkout: -c puts the working directory first on sys.path
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_large_blocks_stay_on_the_heap_once_tuned():
    assert all(m >= 64 << 20 for m in _probe("default")["mapped"])  # glibc maps each one
    # Tuned, the block is not mapped (what was mapped before, the interpreter's, stays).
    tuned = _probe("tune")
    assert tuned["tuned"] is True
    assert all(m < 64 << 20 for m in tuned["mapped"])
    # The environment variables do the same for a process about to start.
    assert all(m < 64 << 20 for m in _probe("default", allocator.environment("tuned"))["mapped"])


# The same from a thread started after the settings, as XLA:CPU's worker threads run each step:
# 100 MB, above the 64 MB a thread arena's heap holds, which glibc maps whatever M_MMAP_MAX says
# unless every thread is on the main heap (M_ARENA_MAX = 1). A thread that had its arena before
# keeps it: what a call after JAX's backend started leaves (and warns of).
THREAD = (
    MALLINFO
    + """
import threading
mapped, tuned, settings = [], threading.Event(), sys.argv[1]

def allocate():
    libc.free(libc.malloc(64))  # the thread's arena, if it had none yet
    tuned.wait()
    block = libc.malloc(100 << 20)
    ctypes.memset(block, 1, 100 << 20)
    mapped.append(libc.mallinfo2().hblkhd)
    libc.free(block)

worker = threading.Thread(target=allocate)
if settings == "late":  # the thread has its arena before the settings
    worker.start()
if settings in ("early", "late"):
    allocator.tune_host_allocator()
tuned.set()
if settings != "late":
    worker.start()
worker.join()
print(json.dumps(mapped[0]))
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_worker_thread_started_after_tuning_keeps_large_blocks_on_the_heap():
    def probe(settings, env=None):
        run = subprocess.run(
            [sys.executable, "-c", THREAD, settings],
            env={**subprocess_env(), **(env or {})},
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
        return int(run.stdout)

    assert probe("default") >= 100 << 20  # glibc maps it
    assert probe("early") < 100 << 20  # mapped (100 MB) without M_ARENA_MAX
    assert probe("late") >= 100 << 20  # the thread's own arena still maps it
    # Started with the environment, every thread is on the main heap from the first.
    assert probe("default", allocator.environment("tuned")) < 100 << 20


def test_tuning_after_the_backend_started_warns(monkeypatch):
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda code, value: 1)  # changes nothing
    monkeypatch.setattr(allocator, "_backend_started", lambda: True)
    with pytest.warns(RuntimeWarning, match="before any JAX operation"):
        assert allocator.tune_host_allocator() is True
    monkeypatch.setattr(allocator, "_backend_started", lambda: False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allocator.tune_host_allocator() is True


def test_backend_started_reads_jax():
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    assert allocator._backend_started() is True


def test_environment_and_started_with_agree():
    assert allocator.environment("glibc") == {}
    tuned = allocator.environment("tuned")
    assert tuned == allocator.ENVIRONMENT and tuned is not allocator.ENVIRONMENT
    assert allocator.started_with(tuned) == "tuned"
    assert allocator.started_with({"PATH": "/bin"}) == "glibc"
    assert allocator.started_with({**tuned, "MALLOC_TOP_PAD_": "1"}) == "custom"
    with pytest.raises(ValueError, match="allocator must be one of"):
        allocator.environment("jemalloc")


def test_without_mallopt_it_warns_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    with pytest.warns(RuntimeWarning, match="no mallopt"):
        assert allocator.tune_host_allocator() is False


def test_a_refused_setting_is_reported(monkeypatch):
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda code, value: 0)
    with pytest.warns(RuntimeWarning, match="mallopt refused M_MMAP_MAX"):
        assert allocator.tune_host_allocator() is False


# Holds 256 MB in 8 MB blocks with a small block above them, frees the large ones (the small one
# keeps the heap's top, so glibc cannot trim it) and reports the resident memory at each stage.
HELD = """
import ctypes, json, sys
from jaxcomp.ops import allocator

def resident_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS:"))

if sys.argv[1] == "tune":
    allocator.tune_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(8 << 20) for _ in range(32)]
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
pin = libc.malloc(1024)
held = resident_mb()
for block in blocks:
    libc.free(block)
freed = resident_mb()
released = allocator.release_host_memory()
print(json.dumps({"held": held, "freed": freed, "released": released, "after": resident_mb()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_host_memory_returns_what_the_tuned_heap_keeps():
    import json

    run = subprocess.run(
        [sys.executable, "-c", HELD, "tune"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    mb = json.loads(run.stdout)
    assert mb["freed"] > mb["held"] - 32, mb  # tuned: the freed 256 MB stay resident
    assert mb["released"] is True
    assert mb["after"] < mb["freed"] - 200, mb  # and the call gives them back


def test_release_host_memory_without_malloc_trim_changes_nothing(monkeypatch):
    import warnings

    monkeypatch.setattr(allocator, "_malloc_trim", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allocator.release_host_memory() is False
