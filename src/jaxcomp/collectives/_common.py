"""Argument checks and small pieces shared by the collectives' modules (not public: each
collective validates its own arguments with these, so every error names the argument)."""

from __future__ import annotations

import jax
import jax.extend
from jax.interpreters import batching, mlir

from jaxcomp.ops import _checks


def axis_size(axis_name, name="axis_name"):
    """Devices along ``axis_name`` (an axis or a tuple of axes of the enclosing ``shard_map``), or a
    ValueError naming ``name`` when it is not one."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}={axis_name!r} is not an axis of the enclosing shard_map's mesh; call this "
            "inside jax.shard_map and pass one of its mesh axis names"
        ) from None


def local_vector(x):
    """``x`` as this device's local 1-D float vector, or an error naming ``x``."""
    x = _checks.float_array(x, "x")
    if x.ndim != 1:
        raise ValueError(
            f"x must be this device's local 1-D vector, got shape {x.shape}; flatten it first"
        )
    return x


def one_device_total(x, axis_name):
    """``x`` as the total of a sum over one device: the same values, typed replicated (invariant)
    like every other total, so a step's updates agree on every device of a 1-device mesh too.

    XLA:CPU does not remove an all-reduce over one device (jax 0.10: it copies the vector through
    the collective, a few copies' time; docs/performance.md, "One device: no collective"), so where
    the value's type can say so this only retypes ``x`` (:data:`_replicated_p`, lowered to nothing),
    and falls back to :func:`jax.lax.psum` otherwise.

    Args:
      x: an array inside ``shard_map``.
      axis_name: an axis, or a tuple of axes, of one device in all.

    Returns:
      ``x``, typed invariant along ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: one_device_total(x, "data"), mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> hlo = f.lower(jnp.arange(3.0)).compile().as_text()
      >>> f(jnp.arange(3.0)).tolist(), "all-reduce" in hlo
      ([0.0, 1.0, 2.0], False)
    """
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if axis_size(axes) != 1:
        raise ValueError(f"one_device_total sums over one device; {axis_name!r} has more")
    mat = getattr(jax.typeof(x), "mat", None)
    if mat is None or not hasattr(mat, "varying"):  # another JAX's types: the psum is right
        return jax.lax.psum(x, axis_name)
    if not set(axes) & set(mat.varying):
        return x  # already invariant along the axes
    return _replicated_p.bind(x, axes=axes)


def psum_or_retype(x, axis_name):
    """:func:`jax.lax.psum`, or over one device in all :func:`one_device_total` (no collective).

    Args:
      x: an array inside ``shard_map``, varying along ``axis_name``.
      axis_name: an axis or a tuple of axes.

    Returns:
      The sum over the axes, typed invariant along them.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> def summed(d):  # over the first d devices
      ...     mesh = Mesh(np.array(jax.devices()[:d]), ("data",))
      ...     total = lambda x: psum_or_retype(x, "data")
      ...     return jax.shard_map(total, mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> summed(1)(jnp.arange(2.0)).tolist(), summed(2)(jnp.arange(2.0)).tolist()
      ([0.0, 1.0], [1.0])
    """
    if axis_size(axis_name) == 1:
        return one_device_total(x, axis_name)
    return jax.lax.psum(x, axis_name)


def all_gather_or_retype(x, axis_name):
    """:func:`jax.lax.all_gather` (``to="invarying"``, a new leading axis of the devices), or
    over one device in all ``x[None]`` by :func:`one_device_total` (no collective).

    Args:
      x: an array inside ``shard_map``, varying along ``axis_name``.
      axis_name: an axis or a tuple of axes.

    Returns:
      Every device's ``x``, stacked, typed invariant along the axes.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> two = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> jax.shard_map(
      ...     lambda x: all_gather_or_retype(x, "data"), mesh=two, in_specs=P("data"), out_specs=P()
      ... )(jnp.arange(2.0)).tolist()  # one row per device
      [[0.0], [1.0]]
    """
    if axis_size(axis_name) == 1:
        return one_device_total(x, axis_name)[None]
    return jax.lax.all_gather(x, axis_name, to="invarying")


def _replicated_abstract_eval(aval, *, axes):
    varying = frozenset(a for a in aval.mat.varying if a not in axes)
    return aval.update(manual_axis_type=aval.mat.update(varying=varying))


def _replicated_batched(args, dims, *, axes):
    return _replicated_p.bind(args[0], axes=axes), dims[0]


#: ``x`` retyped invariant along ``axes``, each of one device: what a psum over them returns,
#: with no collective (:func:`one_device_total`). It batches under ``vmap``; it has no
#: derivative rule (the update is not differentiated), as the FFI kernels have none.
_replicated_p = jax.extend.core.Primitive("jaxcomp_replicated_on_one_device")
_replicated_p.def_impl(lambda x, *, axes: x)
_replicated_p.def_abstract_eval(_replicated_abstract_eval)
mlir.register_lowering(_replicated_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[_replicated_p] = _replicated_batched


def check_rows(n, axis_name):
    """The devices of ``axis_name``, which must split ``n`` values into equal rows."""
    n_devices = axis_size(axis_name)
    if n % n_devices:
        raise ValueError(
            f"x has {n} values, not {n_devices} rows of equal length to reduce-scatter"
        )
    return n_devices
