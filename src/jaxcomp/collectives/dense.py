"""Dense sums: the plain all-reduce and reduce-scatter, the max of the devices' values, and the
16-bit (bfloat16 or float16) all-reduce that sends 2 bytes a value on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives import BFLOAT16_ALGORITHMS
from jaxcomp.collectives._common import (
    axis_size,
    check_rows,
    local_vector,
    psum_or_retype,
)
from jaxcomp.collectives.ring import BFLOAT16_BITS, FLOAT16_BITS, ring_allreduce
from jaxcomp.ops._checks import check_choice
from jaxcomp.ops._ffi import platform_dependent

#: The ring's codec per wire type (:func:`narrow_allreduce`).
_CODECS = {"bfloat16": BFLOAT16_BITS, "float16": FLOAT16_BITS}


def psum(x, axis_name):
    """Dense all-reduce: :func:`jax.lax.psum` under the collectives' ``(total, sent)`` interface.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector.
      axis_name: the mesh axis to sum over.

    Returns:
      ``(total, sent)``: the sum over the axis (dtype of ``x``, XLA's all-reduce) and
      ``x`` itself (nothing is lost, so error feedback stays zero).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.psum(x, "data")[0], mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> f(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      The dense baseline of Tyagi & Swany, arXiv 2312.02493, Table I (ring and tree all-reduce).
    """
    x = local_vector(x)
    return psum_or_retype(x, axis_name), x


def psum_scatter(x, axis_name):
    """Dense reduce-scatter: device ``d`` gets row ``d`` of the sum (:func:`jax.lax.psum_scatter`).

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector, ``N`` rows of equal length.
      axis_name: the mesh axis, or tuple of axes, to sum over (device ``d``'s position along
        them is its row).

    Returns:
      ``(shard, sent)``: row ``d`` of the sum (``n / N`` values, dtype of ``x``, typed varying)
      and ``x`` itself (nothing is lost).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.psum_scatter(x, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> f(jnp.arange(8.0)).tolist()  # devices hold [0, 1, 2, 3] and [4, 5, 6, 7]
      [4.0, 6.0, 8.0, 10.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (gradients reduce-scattered to their owners).
    """
    x = local_vector(x)
    if check_rows(x.shape[0], axis_name) == 1:  # one device's row is all of x
        return x, x
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True), x


def pmax(x, axis_name):
    """The elementwise maximum over the devices of ``axis_name`` (:func:`jax.lax.pmax`): what a
    shared scale or range is agreed from.

    Unlike the sums, this is not a ``(total, sent)`` collective: nothing of ``x`` is sent on to
    the aggregate, only its maximum is agreed.

    Args:
      x: a float array, usually a scalar (one device's largest magnitude).
      axis_name: the mesh axis, or tuple of axes.

    Returns:
      The maximum, of ``x``'s shape and dtype, the same on every device (typed invariant).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.pmax(jnp.max(x), "data"),
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> float(f(jnp.array([1.0, 5.0, 3.0, 2.0])))
      5.0

    References:
      Li et al., THC, NSDI 2024 (the range all devices share); Micikevicius et al., ICLR 2018
      (one loss scale for all).
    """
    axis_size(axis_name)
    return jax.lax.pmax(x, axis_name)


def bfloat16_allreduce(x, axis_name, *, scatter=False, algorithm="auto"):
    """All-reduce in bfloat16 that sends 2 bytes a value on every backend:
    :func:`narrow_allreduce` with ``dtype="bfloat16"``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      scatter: sharded training: ``total`` is only this device's row of the sum.
      algorithm: ``"auto"`` (the ring on the CPU, the psum elsewhere), ``"ring"`` or ``"psum"``.

    Returns:
      ``(total, sent)`` in ``x``'s dtype, as :func:`narrow_allreduce`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.bfloat16_allreduce(x, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, 2.0, 3.0, 1.0 / 256])).tolist()  # 2 + 1/256 rounds to 2 in bfloat16
      [4.0, 2.0]

    References:
      Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", arXiv 1905.12322.
    """
    return narrow_allreduce(x, axis_name, "bfloat16", scatter=scatter, algorithm=algorithm)


def _dtype_name(dtype) -> str:
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {dtype!r}") from None


def narrow_allreduce(x, axis_name, dtype, *, scatter=False, algorithm="auto"):
    """All-reduce in a 16-bit float (bfloat16 or float16) that sends 2 bytes a value on every
    backend, at the cost of the CPU's own arithmetic.

    On the CPU, whose collectives carry bfloat16 as float32 and add float16 in software
    (docs/performance.md, "float16 by the ring"), this is a ring of :func:`jax.lax.ppermute`
    hops whose messages are the 16-bit values' bits typed uint16
    (:func:`jaxcomp.collectives.ring.sixteen_bit_codec`): ``N-1`` reduce-scatter hops, each
    partial sum rounded to ``dtype`` and widened to float32 to add the next chunk, then an
    :func:`jax.lax.all_gather` of each device's fully reduced chunk, rounded once. Elsewhere it is
    one :func:`jax.lax.psum` of ``x`` cast to ``dtype``; :func:`jax.lax.platform_dependent` picks
    when the step is lowered. float16's range ends at 65504: the caller scales ``x`` so that the
    sum fits (:class:`jaxcomp.methods.Cast` does).

    ``sent``: by the ring, ``x`` less every rounding this device made, so the devices' ``sent``
    add up to ``total`` (up to float32 rounding); by the psum, ``x`` rounded to ``dtype``. With
    ``N = 1`` nothing is sent: ``total = sent = x`` rounded to ``dtype``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      dtype: ``"bfloat16"`` or ``"float16"`` (or the jnp types), what crosses the wire.
      scatter: sharded training: ``x`` is ``N`` rows of equal length and ``total`` is only this
        device's row of the sum: the ring's reduce-scatter phase (device ``d``'s row, rounded
        once, the all-reduce's row bit for bit), or one :func:`jax.lax.psum_scatter`.
      algorithm: ``"auto"`` (the ring on the CPU, the psum elsewhere), ``"ring"`` or ``"psum"``
        on every platform.

    Returns:
      ``(total, sent)`` in ``x``'s dtype (the ring adds in float32); ``total`` is typed invariant
      (replicated) under ``check_vma=True``; with ``scatter`` it is one row, typed varying.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: collectives.narrow_allreduce(x, "data", "float16")[0],
      ...     mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, 2048.0, 3.0, 1.0])).tolist()  # 2049 rounds to 2048 in float16
      [4.0, 2048.0]

    References:
      IEEE 754 binary16; Kalamkar et al., arXiv 1905.12322 (bfloat16); the ring of "GPU
      compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C.
    """
    x = local_vector(x)
    name = check_choice(_dtype_name(dtype), "dtype", tuple(_CODECS))
    algorithm = check_choice(algorithm, "algorithm", BFLOAT16_ALGORITHMS)
    n_devices = check_rows(x.shape[0], axis_name) if scatter else axis_size(axis_name)

    def by_ring(v):
        # Device d owns chunk d in both forms, and the reduce-scatter rounds it as the all-reduce
        # does: the sharded step's shard is the replicated step's row bit for bit.
        total, sent = ring_allreduce(
            v.astype(jnp.float32),
            axis_name,
            n_devices,
            _CODECS[name],
            own=0,
            scatter=scatter,
        )
        return total.astype(v.dtype), sent.astype(v.dtype)

    def by_psum(v):
        # psum / psum_scatter: on one device the cast alone, with no collective.
        total, narrow = (psum_scatter if scatter else psum)(v.astype(jnp.dtype(name)), axis_name)
        return total.astype(v.dtype), narrow.astype(v.dtype)

    # One device sends nothing: the psum of one is the cast alone.
    if algorithm == "psum" or n_devices == 1:
        return by_psum(x)
    if algorithm == "ring":
        return by_ring(x)
    return platform_dependent(x, cpu=by_ring, default=by_psum)
