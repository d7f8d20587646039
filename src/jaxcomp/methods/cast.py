"""``Cast``: the gradient is all-reduced in a 16-bit float (bfloat16 or float16), the baseline
every compressed method should be compared with."""

from __future__ import annotations

import dataclasses
import math

from jaxcomp import _checks, layout
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS

#: The narrow types, by canonical name, with the names they are also known by and their short label.
NARROW_TYPES = {"bfloat16": ("bf16",), "float16": ("fp16", "f16", "half")}

#: The largest finite float16.
FLOAT16_MAX = 65504.0


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
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)
    for canonical, aliases in NARROW_TYPES.items():
        if name == canonical or name in aliases:
            return canonical
    raise ValueError(f"dtype must be bfloat16 or float16 (jnp.bfloat16, jnp.float16 or one of "
                     f"{[n for c, a in NARROW_TYPES.items() for n in (c, *a)]}), got {dtype!r}")


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


@dataclasses.dataclass(frozen=True)
class Cast(Method):
    """The gradient crosses the wire in a 16-bit float: one all-reduce of ``n`` narrow values, what
    Horovod's fp16 compression and PyTorch's ``fp16_compress_hook``/``bf16_compress_hook`` do.

    With error feedback (the default of :func:`jaxcomp.compress`) what the cast rounded away is kept
    and sent later; the rounding of the sum itself (the all-reduce adds in the narrow type) is not.
    float16's range ends at 65504: with ``scale`` every device first multiplies by one power of two
    chosen from the largest ``|x|`` over all devices (one extra all-reduce of a scalar), so the sum
    cannot overflow and small gradients keep their precision; bfloat16 has float32's range and needs
    none.

    Where the bytes are saved depends on the backend's collectives: NCCL reduces 16-bit floats
    natively, but the all-reduce of XLA's CPU collectives (gloo, multi-host CPU clusters) was
    measured carrying bfloat16 as float32, the full 4 bytes a value, while ``bytes_sent`` and the
    cost model count 2 (BENCHMARKS.md, "Sharded training at 1 Gbit"). On such a cluster the cast
    saves nothing on the wire; the rounding it costs stays.

    Args:
      dtype: ``jnp.bfloat16`` / ``"bfloat16"`` or ``jnp.float16`` / ``"float16"`` (aliases ``"bf16"``,
        ``"fp16"``).
      scale: scale by a shared power of two before the cast; ``None`` (default) means yes for
        float16 and no for bfloat16.
      allreduce: how the cost model costs the all-reduce, ``"ring"`` (default) or ``"tree"``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import Cast
      >>> Cast(jnp.bfloat16).describe(), Cast(jnp.bfloat16).wire_bytes(1000, 8)  # half of Dense's 7000
      ('bf16', 3500.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling against float16's
      range); Sergeev & Del Balso, "Horovod", 2018 (fp16 compression of all-reduce).
    """

    dtype: str = "bfloat16"
    scale: bool | None = None
    allreduce: str = "ring"

    name = "cast"
    scatters = True

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

    def _scale(self, x, axis_name):
        """The shared power of two (one pmax of a scalar) with :attr:`scaled`, else 1."""
        import jax
        import jax.numpy as jnp

        if not self.scaled:
            return jnp.float32(1.0)
        axes = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
        n_devices = math.prod(jax.lax.axis_size(a) for a in axes)
        global_max = jax.lax.pmax(jnp.max(jnp.abs(x)).astype(jnp.float32), axis_name)
        return power_of_two_scale(global_max, n_devices)

    def aggregate(self, x, axis_name, *, step, key, sparse=False):
        import jax

        return self._sum(x, axis_name, lambda v: jax.lax.psum(v, axis_name))

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        import jax

        return self._sum(x, axis_name, lambda v: jax.lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=True))

    def _sum(self, x, axis_name, collective):
        """``(collective(narrow x) / s, narrow x / s)``: the sum (or this device's shard of it) and
        what was sent, both back in ``x``'s dtype."""
        import jax.numpy as jnp

        s = self._scale(x, axis_name)
        narrow = self.encode(x, s)
        total = collective(narrow).astype(jnp.float32) / s
        return total.astype(x.dtype), (narrow.astype(jnp.float32) / s).astype(x.dtype)

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """A reduce-scatter of ``n`` 2-byte values, plus the scale's all-reduce when :attr:`scaled`."""
        n, _ = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        return layout.reduce_scatter_bytes(2 * n, N) + (
            layout.allreduce_bytes(4, N, self.allreduce) if self.scaled else 0.0)

    def reduce_scatter_steps(self, n_devices):
        N = _checks.check_devices(n_devices)
        return layout.reduce_scatter_steps(N) + (layout.allreduce_steps(N, self.allreduce) if self.scaled else 0)

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """One all-reduce of ``n`` 2-byte values (``2 (N-1)/N * 2n`` as a ring), plus the scale's
        all-reduce of one float32 when :attr:`scaled`."""
        n, _ = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        return layout.allreduce_bytes(2 * n, N, self.allreduce) + (
            layout.allreduce_bytes(4, N, self.allreduce) if self.scaled else 0.0)

    def message_steps(self, n_devices, *, inner_size=None):
        steps = layout.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)
        return 2 * steps if self.scaled else steps

    def local_work(self, n_values, n_devices):
        import jax.numpy as jnp

        def codec(x):
            s = power_of_two_scale(jnp.max(jnp.abs(x)), n_devices) if self.scaled else 1.0
            narrow = self.encode(x, s)
            return narrow.astype(jnp.float32) / s

        return codec
