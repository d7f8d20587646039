"""One device's loss and gradient inside ``shard_map``, for any model the user wrote for one device.

Inside ``shard_map`` with ``check_vma=True`` a ``lax.scan`` or ``lax.while_loop`` must return
a carry typed as its initial carry. A loop whose initial carry is a constant (``jnp.zeros``:
flax ``nn.RNN``'s hidden state, a running sum) and whose body mixes in this device's batch
returns a carry typed *varying*, and JAX refuses it. JAX already traces such a loop twice when
a weakly typed initial carry must be promoted; :func:`local_value_and_grad` adds one promotion
while the user's loss is traced: an initial carry is cast to vary over the axes its output
varies over. The user's model never needs to know about ``shard_map``, as a model does not need
to know about PyTorch DDP.
"""

from __future__ import annotations

import contextlib

import jax

from jaxcomp.optim import vma


def local_value_and_grad(loss_fn, has_aux, params, batch):
    """``(loss, aux, grads)`` of ``loss_fn`` on this device's shard, inside ``shard_map``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      params: the params, typed varying where each device keeps its own gradient.
      batch: this device's batch shard.

    Returns:
      ``(loss, aux, grads)``; ``aux`` is None without ``has_aux``.

    Example:
      >>> import jax.numpy as jnp
      >>> loss, aux, grads = local_value_and_grad(
      ...     lambda w, b: jnp.sum(w * b), False, jnp.ones(2), jnp.arange(2.0))
      >>> float(loss), grads.tolist()
      (1.0, [0.0, 1.0])

    References:
      JAX, "Shard Map" (``check_vma``, scan carries), docs.jax.dev; Li et al., "PyTorch
      Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020 (any module,
      unchanged).
    """
    with _carries_may_vary():
        if has_aux:
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
            return loss, aux, grads
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return loss, None, grads


@contextlib.contextmanager
def _carries_may_vary():
    """While it is open, a loop's initial carry is cast to vary where its output carry does.

    JAX's loops call ``loops._promote_weak_typed_input(value, in_aval, out_aval)`` on every
    initial carry after a first trace of the body, and trace the body again if any changed; the
    wrapper adds the cast to that promotion. Where this JAX has no such hook nothing changes,
    and JAX's own error (which says to cast the initial carry) stands."""
    try:
        from jax._src.lax.control_flow import loops
    except ImportError:  # pragma: no cover - a JAX without the private module
        yield
        return
    promote = getattr(loops, "_promote_weak_typed_input", None)
    if promote is None or getattr(promote, "_jaxcomp_varying", False):  # absent, or nested
        yield
        return

    def promote_varying(value, in_aval, out_aval):
        value, changed = promote(value, in_aval, out_aval)
        missing = vma.varying_axes(out_aval) - vma.varying_axes(value)
        if missing:
            return vma.cast_varying(value, vma.varying_axes(value) | missing), True
        return value, changed

    promote_varying._jaxcomp_varying = True
    loops._promote_weak_typed_input = promote_varying
    try:
        yield
    finally:
        loops._promote_weak_typed_input = promote
