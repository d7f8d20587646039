"""``Cast``: the gradient is all-reduced in a 16-bit float (bfloat16 or float16), 2 bytes a value on
the wire, the baseline every compressed method should be compared with."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks

#: The narrow types, by canonical name, with the names they are also known by and their short label.
NARROW_TYPES = {"bfloat16": ("bf16",), "float16": ("fp16", "f16", "half")}

#: The largest finite float16.
FLOAT16_MAX = 65504.0


def dtype_name(dtype) -> str:
    """The name a dtype goes by, whether given as a name, a type or a ``numpy`` dtype.

    Args:
      dtype: a name (returned as it is), a type such as ``jnp.float16``, or a ``numpy`` dtype.

    Returns:
      The name, not yet made canonical (:func:`canonical_dtype` does that).

    Example:
      >>> import numpy as np
      >>> dtype_name(np.float16), dtype_name(np.dtype("float32")), dtype_name("bf16")
      ('float16', 'float32', 'bf16')

    References:
      The NumPy dtype names; IEEE 754 binary16.
    """
    return dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)


def canonical_dtype(dtype) -> str:
    """``"bfloat16"`` or ``"float16"`` for a dtype given as a type, a ``numpy`` dtype or a name.

    Args:
      dtype: ``jnp.bfloat16``, ``jnp.float16``, ``np.float16``, ``np.dtype("float16")``, or one of
        the names ``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``, ``"f16"``, ``"half"``.

    Returns:
      The canonical name.

    Example:
      >>> import numpy as np
      >>> canonical_dtype(np.float16), canonical_dtype("bf16")
      ('float16', 'bfloat16')

    References:
      IEEE 754 binary16; the bfloat16 format of Kalamkar et al., arXiv 1905.12322.
    """
    name = dtype_name(dtype)
    for canonical, aliases in NARROW_TYPES.items():
        if name == canonical or name in aliases:
            return canonical
    raise ValueError(
        f"dtype must be bfloat16 or float16 (jnp.bfloat16, jnp.float16 or one of "
        f"{[n for c, a in NARROW_TYPES.items() for n in (c, *a)]}), got {dtype!r}"
    )


def power_of_two_scale(global_max, n_devices: int):
    """The power of two ``s`` that puts a sum of ``n_devices`` values of magnitude up to
    ``global_max`` just inside float16's range: ``s = 2**floor(log2(65504 / (n_devices * max)))``,
    the exponent clipped to ``[-60, 60]`` (1 for an all-zero gradient). Multiplying by a power of
    two is exact, so the scale adds no rounding of its own; it also lifts small gradients out of
    float16's subnormals.

    Args:
      global_max: the largest ``|x|`` over every device (a float32 scalar, replicated).
      n_devices: how many values are summed.

    Returns:
      float32 scalar ``s``.

    Example:
      >>> import jax.numpy as jnp
      >>> float(power_of_two_scale(jnp.float32(1.0), 8))  # 8 * 1 * 4096 = 32768 <= 65504
      4096.0

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling by powers of two).
    """
    import jax.numpy as jnp

    room = FLOAT16_MAX / (n_devices * jnp.maximum(global_max, jnp.finfo(jnp.float32).tiny))
    exponent = jnp.clip(jnp.floor(jnp.log2(room)), -60.0, 60.0).astype(jnp.int32)
    # ldexp, not exp2: XLA's exp2 is not exact at integers (exp2(30.) is 2**30 - 960 on the CPU).
    return jnp.where(global_max > 0, jnp.ldexp(jnp.float32(1.0), exponent), 1.0).astype(jnp.float32)


def shared_scale(x, axis_name):
    """:func:`power_of_two_scale` of the largest ``|x|`` over every device on ``axis_name`` (one
    :func:`jaxcomp.collectives.pmax` of a scalar), for a sum over all of them.

    Args:
      x: this device's float array.
      axis_name: the mesh axis, or tuple of axes, the sum runs over.

    Returns:
      float32 scalar, the same on every device.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: shared_scale(x, "data"), mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> float(f(jnp.array([1.0, -2.0])))  # 65504 / (2 * 2) rounds down to 2**13
      8192.0

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling by powers of two).
    """
    import jax.numpy as jnp

    from jaxcomp import collectives
    from jaxcomp.collectives._common import axis_size

    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    n_devices = axis_size(axes)  # the product of the axes' sizes
    global_max = collectives.pmax(jnp.max(jnp.abs(x)).astype(jnp.float32), axis_name)
    return power_of_two_scale(global_max, n_devices)


def narrow_sum(x, axis_name, dtype, *, scaled: bool, scatter: bool = False):
    """The sum over the devices of ``x`` in a 16-bit float, 2 bytes a value on the wire:
    :func:`jaxcomp.collectives.narrow_allreduce` of ``x`` times :func:`shared_scale` (with
    ``scaled``; float16's range ends at 65504), divided back. What :class:`Cast` sends, and what
    :class:`jaxcomp.methods.PowerSGD` sends its factors as with ``dtype=``.

    Args:
      x: this device's 1-D float vector.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      dtype: ``"bfloat16"`` or ``"float16"``.
      scaled: multiply by the shared power of two first.
      scatter: this device's row of the sum only (sharded training).

    Returns:
      ``(total, sent)`` in ``x``'s dtype: ``sent`` is ``x`` less this device's roundings (the
      CPU's ring), or ``x`` rounded (a psum), so error feedback keeps what the wire lost.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: narrow_sum(x, "data", "float16", scaled=True)[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> # 3e-6 alone would be a float16 subnormal; scaled by 2**13 it keeps 11 bits
      >>> f(jnp.array([1e-6, 3.0, 2e-6, 1.0])).tolist()
      [3.0007213354110718e-06, 4.0]

    References:
      IEEE 754 binary16; Sergeev & Del Balso, "Horovod", 2018 (fp16 compression of all-reduce).
    """
    import jax.numpy as jnp

    from jaxcomp import collectives

    s = shared_scale(x, axis_name) if scaled else jnp.float32(1.0)
    total, sent = collectives.narrow_allreduce(
        x.astype(jnp.float32) * s, axis_name, dtype, scatter=scatter
    )
    return (total / s).astype(x.dtype), (sent / s).astype(x.dtype)


def narrow_bytes(n: int, n_devices: int, *, scaled: bool, allreduce: str = "ring") -> float:
    """Bytes one device sends for :func:`narrow_sum` of ``n`` values over ``n_devices``: as a
    ring, ``2 (N-1)`` chunks of ``ceil(n/N)`` 2-byte values (the CPU's ring of uint16 hops; a psum
    elsewhere, the same but for the padding), plus the scale's all-reduce of one float32 when
    ``scaled``.

    Args:
      n: values summed.
      n_devices: devices summing them.
      scaled: whether the scale's scalar all-reduce is sent too.
      allreduce: ``"ring"`` (default) or ``"tree"``, as :class:`Cast`'s ``allreduce``.

    Returns:
      Bytes, a float (0 on one device).

    Example:
      >>> narrow_bytes(1000, 8, scaled=False)  # 14 chunks of 125 values, 2 bytes each
      3500.0

    References:
      Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009 (the ring's bytes).
    """
    if n_devices == 1:
        return 0.0
    if allreduce == "ring":
        values = float(2 * (n_devices - 1) * sizes.ring_chunk(n, n_devices) * 2)
    else:
        values = sizes.allreduce_bytes(2 * n, n_devices, allreduce)
    return values + (sizes.allreduce_bytes(4, n_devices, allreduce) if scaled else 0.0)


@dataclasses.dataclass(frozen=True)
class Cast(Method):
    """The gradient crosses the wire in a 16-bit float, 2 bytes a value: what Horovod's fp16
    compression and PyTorch's ``fp16_compress_hook``/``bf16_compress_hook`` do.

    float16's range ends at 65504: with ``scale`` every device first multiplies by one power of
    two chosen from the largest ``|x|`` over all devices (one extra all-reduce of a scalar,
    :func:`jaxcomp.collectives.pmax`), so the sum cannot overflow and small gradients keep their
    precision; bfloat16 has float32's range and needs none.

    Both types are summed by :func:`jaxcomp.collectives.narrow_allreduce`. NCCL and the TPU reduce
    them natively, so on GPU and TPU it is one psum in the narrow type. On the CPU (gloo,
    multi-host CPU clusters) it is a ring of ``jax.lax.ppermute`` hops whose messages are the
    16-bit values' bits typed uint16: ``2 (N-1)`` chunks of ``ceil(n/N)`` values, 2 bytes each,
    what :meth:`wire_bytes` counts. Each hop's receiver adds its own chunk in float32 and rounds
    the partial sum to the narrow type for the next hop. gloo carries a bfloat16 all-reduce as
    float32, 4 bytes a value, and sums a float16 one in software, value by value, which costs
    more host CPU a step than the ring (docs/performance.md, "float16 by the ring").

    Error feedback is off by default for the casts (``compress(error_feedback="auto")``,
    :attr:`feeds_back_by_default`), as in PyTorch's fp16 and bf16 hooks: on the quality benchmark
    both casts kept dense Adam's loss without it, as with it, and each host saves a gradient's
    memory and a little time a step (docs/training.md, "The optax chain", error feedback).
    With ``error_feedback=True`` what the
    cast rounded away is kept and sent later. The psum's own rounding (it adds in the narrow
    type) is not; the ring's is: its ``sent`` is ``x`` less every rounding this device made along
    the ring, so error feedback keeps all the ring lost.

    Args:
      dtype: ``jnp.bfloat16`` / ``"bfloat16"`` or ``jnp.float16`` / ``"float16"`` (aliases
        ``"bf16"``, ``"fp16"``).
      scale: scale by a shared power of two before the cast; ``None`` (default) means yes for
        float16 and no for bfloat16.
      allreduce: how the cost model costs the all-reduce, ``"ring"`` (default) or ``"tree"``
        (a backend's tree all-reduce, NCCL's; both types go by the ring on the CPU whatever this
        says).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import Cast
      >>> # half of Dense's 7000
      >>> Cast(jnp.bfloat16).describe(), Cast(jnp.bfloat16).wire_bytes(1000, 8)
      ('bf16', 3500.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling against float16's
      range); Sergeev & Del Balso, "Horovod", 2018 (fp16 compression of all-reduce).
    """

    dtype: str = "bfloat16"
    scale: bool | None = None
    allreduce: str = "ring"

    name = "cast"
    # Each value is rounded alone: in buckets only the ring's order of roundings changes, and the
    # step was faster with them on every zoo model measured (docs/performance.md, "Overlapping
    # the backward pass").
    buckets_by_default = True
    # What a step loses is each value's rounding to 16 bits: without error feedback both casts
    # kept a plain optimizer's loss in every quality cell, as with it, and a host saves a
    # gradient's memory and a little time a step (docs/notes/2026-12-05-benchmarks-until-0.2.md,
    # "The casts without error feedback").
    feeds_back_by_default = False
    # Its gain is 1 to a 16-bit rounding: the metrics do not read what it sent, so that without
    # error feedback the ring never builds it (docs/notes/2026-12-06-casts-passes.md).
    rounds_only = True
    shorthand = {"bf16": {"dtype": "bfloat16"}, "fp16": {"dtype": "float16"}}

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.scale is not None:
            object.__setattr__(self, "scale", _checks.check_flag(self.scale, "scale"))
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)

    @property
    def scaled(self) -> bool:
        """Whether a shared power-of-two scale is applied (``scale``, or its default)."""
        return self.dtype == "float16" if self.scale is None else self.scale

    @property
    def wire_dtype(self) -> str | None:
        """float16 unscaled: its sums can overflow (65504) where float32's would not."""
        return None if self.scaled or self.dtype == "bfloat16" else self.dtype

    @property
    def label(self):
        variant = "" if self.allreduce == "ring" else f"_{self.allreduce}"
        return f"{NARROW_TYPES[self.dtype][0]}{variant}"

    def _narrow(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def encode(self, x, s):
        """``x`` times the scale ``s``, in the narrow type: what crosses the wire."""
        import jax.numpy as jnp

        return (x.astype(jnp.float32) * s).astype(self._narrow())

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        return (*self._sum(x, axis_name, scatter=False), state)

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        return self._sum(x, axis_name, scatter=True)

    def _sum(self, x, axis_name, *, scatter):
        """``(total, sent)`` by :func:`narrow_sum` in :attr:`dtype`, scaled as :attr:`scaled`."""
        return narrow_sum(x, axis_name, self.dtype, scaled=self.scaled, scatter=scatter)

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """A reduce-scatter of ``n`` 2-byte values (``n`` is ``N`` rows: bfloat16's ring sends
        ``N - 1`` of them), plus the scale's all-reduce when :attr:`scaled`."""
        n, _ = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        return sizes.reduce_scatter_bytes(2 * n, N) + (
            sizes.allreduce_bytes(4, N, self.allreduce) if self.scaled else 0.0
        )

    def reduce_scatter_steps(self, n_devices):
        N = _checks.check_devices(n_devices)
        return sizes.reduce_scatter_steps(N) + (
            sizes.allreduce_steps(N, self.allreduce) if self.scaled else 0
        )

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """One all-reduce of ``n`` 2-byte values, plus the scale's all-reduce of one float32 when
        :attr:`scaled` (:func:`narrow_bytes`)."""
        n, _ = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        return narrow_bytes(n, N, scaled=self.scaled, allreduce=self.allreduce)

    def message_steps(self, n_devices, *, inner_size=None):
        steps = sizes.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)
        return 2 * steps if self.scaled else steps

    def local_work(self, n_values, n_devices):
        import jax.numpy as jnp

        def codec(x):
            s = power_of_two_scale(jnp.max(jnp.abs(x)), n_devices) if self.scaled else 1.0
            narrow = self.encode(x, s)
            return narrow.astype(jnp.float32) / s

        return codec
