"""This process's CPU backend, set before JAX builds it (no JAX op ran yet): the network interface
gloo binds to, the CPU collectives' timeout and the CPU device count."""

from __future__ import annotations

import os
import sys

from jaxcomp.distributed._job_env import LOCAL_DEVICES, with_flag


def configure_cpu(interface: str | None, seconds: int) -> None:
    """gloo's interface, the collectives' timeout and the CPU device count, before JAX's CPU
    client."""
    import jax

    if interface is not None:
        use_gloo_interface(interface)
    # XLA reads XLA_FLAGS when the CPU client is built, which is after this (no JAX op ran yet).
    os.environ["XLA_FLAGS"] = with_flag(
        os.environ.get("XLA_FLAGS", ""), "xla_cpu_collective_timeout_seconds", seconds
    )
    jax.config.update("jax_num_cpu_devices", int(os.environ[LOCAL_DEVICES]))


def use_gloo_interface(interface: str) -> None:
    """Makes JAX's CPU collectives (gloo) bind to ``interface``; call before any JAX op.

    JAX has no public option for this (its CPU client always builds gloo from the hostname), so
    this re-registers the ``"cpu"`` backend factory through the public
    ``jax.extend.backend.register_backend_factory`` with a factory that differs from JAX's own in
    one argument: it builds the gloo collectives with ``interface=``. That factory uses three
    private names, the least that can do it: ``jax._src.distributed.global_state`` (the
    coordinator client gloo needs), ``jax._src.xla_bridge.make_cpu_client`` (JAX's own CPU client
    builder, so every other setting stays JAX's) and ``jaxlib._jax.make_gloo_tcp_collectives``.
    Tested with jax 0.10.x; a jax without them raises a clear error here.

    Args:
      interface: a network interface of this host, e.g. ``"eth0"``.

    Example:
      >>> from jaxcomp.distributed.launch import use_gloo_interface
      >>> use_gloo_interface("lo")  # doctest: +SKIP
    """
    _check_interface(interface)
    try:
        from jax._src import distributed, xla_bridge
        from jax.extend.backend import register_backend_factory
        from jaxlib import _jax

        make_collectives = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"this jax has no way to choose gloo's interface that jaxcomp knows ({e}); set the "
            "hostname to resolve to the interface's address instead"
        ) from None

    def cpu_client_on_interface():
        client = distributed.global_state.client
        collectives = (
            None
            if client is None
            else make_collectives(distributed_client=client, interface=interface)
        )
        return make_cpu_client(collectives=collectives)

    register_backend_factory("cpu", cpu_client_on_interface, priority=0, fail_quietly=False)


def _check_interface(interface) -> None:
    """A ValueError unless ``interface`` names a network interface of this host (Linux)."""
    if not isinstance(interface, str) or not interface or "/" in interface:
        raise ValueError(
            f"interface must be a network interface name such as 'eth0', got {interface!r}"
        )
    if sys.platform == "linux" and not os.path.exists(f"/sys/class/net/{interface}"):
        present = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
        raise ValueError(
            f"interface {interface!r} does not exist on this host "
            f"(interfaces: {', '.join(present)})"
        )
