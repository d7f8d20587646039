"""Keeping XLA:CPU's large buffers on the heap: :func:`tune_host_allocator`.

XLA:CPU allocates its buffers with the C library's ``malloc``. glibc serves every block above its
mmap threshold (at most 32 MB on 64-bit Linux) with a fresh ``mmap`` and unmaps it when it is
freed, so each step writes such buffers (a 64 MB gradient leaf, the 100 MB flat vector of a 25M
model, the executable's temporaries) into new pages: a page fault and a zeroed page every 4 KB.
On this project's machine that made a large ``jnp.zeros`` several times slower, and every
method's update, the plain copy included, markedly slower (docs/performance.md, "A second
trap").

jax 0.10 runs each step on XLA:CPU's worker threads, and glibc gives every thread an arena of
its own (up to 8 per core), whose heaps hold at most 64 MB: a larger block there is mapped
afresh whatever ``M_MMAP_MAX`` says. The settings therefore keep every thread on the one main
heap (``M_ARENA_MAX = 1``), and they must be in force before JAX starts its backend: a thread
keeps the arena it was given first.

:func:`tune_host_allocator` tells glibc to serve large blocks from the heap and to keep freed
memory for the next step; :data:`ENVIRONMENT` does the same for a process about to start (glibc
reads it at start-up). jaxcomp never does this behind a user's back: the process keeps its peak
heap instead of returning it to the system, which is what a training loop wants and a notebook
that trains once and goes on may not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings

#: glibc's ``mallopt`` parameter numbers (``malloc.h``).
_CODES = {"M_TRIM_THRESHOLD": -1, "M_TOP_PAD": -2, "M_MMAP_MAX": -4, "M_ARENA_MAX": -8}

#: The settings, as ``mallopt`` takes them: no mmap for large blocks, free memory kept up to 2 GiB
#: at the top of the heap, the heap grown 1 GiB at a time, and every thread on the main heap (a
#: thread's own arena maps any block over 64 MB).
SETTINGS = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1, "M_TOP_PAD": 2**30, "M_ARENA_MAX": 1}

#: The same settings as glibc's environment variables, for a process about to start (glibc names
#: the arena's without the trailing underscore).
ENVIRONMENT = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
    "MALLOC_TOP_PAD_": str(2**30),
    "MALLOC_ARENA_MAX": "1",
}


def _libc_function(name: str):
    """A function of the C library (glibc's ``mallopt``, ``malloc_trim``), or None where it has
    none (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def _mallopt():
    """glibc's ``mallopt``, or None."""
    return _libc_function("mallopt")


def _malloc_trim():
    """glibc's ``malloc_trim``, or None."""
    return _libc_function("malloc_trim")


def tune_host_allocator() -> bool:
    """Serves XLA:CPU's large buffers from the heap and keeps freed memory for reuse (glibc only).

    Call it once, **before JAX's first operation** (right after ``import jax``, before
    ``jax.devices()`` or any array): XLA:CPU runs each step on worker threads that JAX starts
    with its backend, and a thread keeps the malloc arena it first got, so a later call leaves
    those threads mapping every block over 64 MB afresh, and warns. Tuned early, a large model's
    update ran several times faster than with glibc's defaults; tuned after the first step, no
    faster (docs/performance.md). It helps every
    large-model job on XLA:CPU, compressed or not. The price: the process keeps its peak heap,
    up to 2 GiB of freed memory at the top, instead of returning it to the system, and a process
    that allocates large buffers of changing sizes can grow: a ``jaxcomp netbench`` host that
    trained resnet50 with eight methods in a row was killed for memory.
    ``jaxcomp cluster``, ``python -m jaxcomp.distributed.launch``, ``jaxcomp netbench``,
    ``benchmarks/peers.py`` and ``benchmarks/passes.py`` take ``--allocator tuned`` to start
    their processes with :data:`ENVIRONMENT`.

    Returns:
      True when glibc took the settings (with a ``RuntimeWarning`` when JAX's backend had
      already started, which they then miss); False (with a ``RuntimeWarning``) where the C
      library has no ``mallopt`` or refused one, and nothing changed.

    Example:
      >>> import jaxcomp
      >>> jaxcomp.tune_host_allocator()  # doctest: +SKIP
      True

    References:
      glibc manual, "Malloc Tunable Parameters" (``M_ARENA_MAX``, ``M_MMAP_MAX``,
      ``M_TRIM_THRESHOLD``, ``M_TOP_PAD``); docs/performance.md, "A second trap: every buffer
      over 32 MB is a fresh mmap" and "Worker threads" (the measurements).
    """
    mallopt = _mallopt()
    if mallopt is None:
        warnings.warn(
            "jaxcomp.tune_host_allocator: this C library has no mallopt (not glibc); the "
            "allocator is unchanged",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    refused = [name for name, value in SETTINGS.items() if mallopt(_CODES[name], value) != 1]
    if refused:
        warnings.warn(
            f"jaxcomp.tune_host_allocator: mallopt refused {', '.join(refused)}; the allocator "
            "may be partly changed",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    if _backend_started():
        warnings.warn(
            "jaxcomp.tune_host_allocator: called after JAX started its backend, so the worker "
            "threads XLA:CPU runs each step on keep their own malloc arenas, where glibc maps "
            "every block over 64 MB afresh: the steps stay as slow as untuned. Call it right "
            "after `import jax`, before any JAX operation, or start the process with "
            "jaxcomp.ops.allocator.ENVIRONMENT in its environment",
            RuntimeWarning,
            stacklevel=2,
        )
    return True


def _backend_started() -> bool:
    """Whether JAX has started a backend (and with it XLA:CPU's worker threads); False where
    this JAX cannot say."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def environment(allocator: str) -> dict[str, str]:
    """The environment variables that start a process with ``allocator``.

    Args:
      allocator: ``"tuned"`` (:data:`ENVIRONMENT`) or ``"glibc"`` (glibc's defaults: nothing).

    Returns:
      A dict of variables to add to the process's environment.

    Example:
      >>> environment("glibc"), environment("tuned")["MALLOC_MMAP_MAX_"]
      ({}, '0')

    References:
      glibc manual, "Memory Allocation Tunables".
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    return dict(ENVIRONMENT) if allocator == "tuned" else {}


#: The allocators a benchmark can start its hosts with.
ALLOCATORS = ("tuned", "glibc")


def started_with(environ=None) -> str:
    """Which allocator this process was started with, read from its environment.

    Args:
      environ: the environment to read (default ``os.environ``).

    Returns:
      ``"tuned"`` (every variable of :data:`ENVIRONMENT` at its value), ``"glibc"`` (none of
      them set) or ``"custom"`` (anything else).

    Example:
      >>> started_with({}), started_with(ENVIRONMENT), started_with({"MALLOC_MMAP_MAX_": "1"})
      ('glibc', 'tuned', 'custom')

    References:
      glibc manual, "Memory Allocation Tunables".
    """
    environ = os.environ if environ is None else environ
    if all(environ.get(k) == v for k, v in ENVIRONMENT.items()):
        return "tuned"
    return "glibc" if not any(k in environ for k in ENVIRONMENT) else "custom"


def release_host_memory() -> bool:
    """Returns the heap memory that is free back to the system (glibc's ``malloc_trim(0)``).

    A process that trains one model after another (a notebook trying several methods, a
    benchmark host running each method in turn) keeps what the earlier ones freed: glibc returns
    only the top of the heap, and with :func:`tune_host_allocator` not even that. On GPT-2's
    shapes in one process, after ``del state``, ``jax.clear_caches()`` and ``gc.collect()`` the
    process still held 6.6 GB after four methods; this call took it to 1.8 GB. Call it after
    dropping a run's state and executables, not during training: the next steps would fault the
    pages in again. Works with glibc's defaults and with the tuned settings alike.

    Returns:
      True when glibc released memory, False when there was none to release or the C library
      has no ``malloc_trim`` (not glibc: nothing changes, and no warning).

    Example:
      >>> import jaxcomp
      >>> # after `del state; jax.clear_caches(); gc.collect()` of a finished run:
      >>> jaxcomp.release_host_memory() in (True, False)
      True

    References:
      glibc manual, "Memory Allocation Tunables" and ``malloc_trim(3)``; docs/performance.md,
      "A second trap" (the measurement).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
