"""A process's memory as a netbench job records it: the training state's bytes on this device and
the process's peak resident memory (Linux)."""

from __future__ import annotations


def state_bytes(state) -> int:
    """Bytes of ``state``'s arrays on this process's first device (its shard of each)."""
    import jax

    return sum(
        leaf.addressable_shards[0].data.nbytes
        for leaf in jax.tree.leaves(state)
        if isinstance(leaf, jax.Array)
    )


def reset_peak_memory() -> None:
    """Starts a new peak of this process's resident memory (Linux: ``5`` to
    ``/proc/self/clear_refs`` resets ``VmHWM``); does nothing where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_resident_bytes() -> int:
    """This process's peak resident memory since :func:`reset_peak_memory` (``VmHWM``), 0 where
    unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
