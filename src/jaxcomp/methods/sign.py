"""``Sign``: 1 bit a value plus one scale per chunk (EF-SignSGD, 1-bit Adam's compression), or
signSGD's majority vote."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks

#: How the signs are aggregated (see :class:`Sign`).
AGGREGATIONS = ("allgather", "allreduce", "majority")

#: Values per scale by default (:data:`jaxcomp.ops.sign.DEFAULT_CHUNK`; repeated here so that the
#: cost model loads no JAX).
DEFAULT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Sign(Method):
    """Scaled signs: each device sends 1 bit a value (32 a uint32
    word, :func:`jaxcomp.ops.sign.sign_pack`) and one float32 scale, the mean ``|x|``, per ``chunk``
    values, which decode to ``±scale``.

    The decoded vector is what the device sent, so error feedback keeps ``x - decoded``
    (EF-SignSGD).

    **Quality: pair it with** :func:`jaxcomp.adam` (1-bit Adam: the signs of the momentum, not
    of the gradient): on ``benchmarks/quality.py``'s transformer it ends +0.7% above dense
    Adam's held-out loss (500 steps; +1.9% at 1500 with the variance frozen), where
    ``compress`` + ``optax.adam`` ends +34% (+19% at 1500) (BENCHMARKS.md, "Compressed
    optimizers"). The bit of ``x >= 0`` (``+0`` and ``-0`` included) is ``+``; NaN is ``-``.

    Args:
      chunk: values per scale, an integer ``>= 1`` (default 1024: the scales add 1/256 byte a
        value to the 1/8 of the signs).
      aggregation: how the devices' signs are summed:

        * ``"allgather"`` (default): an all-gather of every device's words and scales; each
          device decodes and adds them, device by device: ``(N-1) (ceil(n/32) + ceil(n/chunk)) 4``
          bytes, ``ceil(log2 N)`` steps.
        * ``"allreduce"``: every device decodes its own and one psum adds the decoded values: the
          dense bytes, ``2 (N-1)/N n d``, fewer than the all-gather's from about ``N > 16 d``
          devices (``d`` the gradient's bytes a value), and the all-reduce's steps.
        * ``"majority"``: signSGD with majority vote: the same all-gather, then the sign of the
          sum of the devices' signs (0 where they tie) times the sum of their scales, chunk by
          chunk: ``N`` times the mean scale times the vote. Each device's ``sent`` is its share
          ``total / N``, so error feedback keeps what the vote lost overall.
      allreduce: how the cost model costs ``aggregation="allreduce"``: ``"ring"`` (default) or
        ``"tree"``.

    Example:
      >>> from jaxcomp.methods import Sign
      >>> Sign().describe(), Sign().wire_bytes(4096, 8)  # 7 x (128 words + 4 scales) x 4 bytes
      ('sign', 3696.0)
      >>> Sign(aggregation="allreduce").wire_bytes(4096, 8)  # the decoded float32 in a ring
      28672.0

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019; Tang et al., "1-bit Adam", ICML 2021; Bernstein et al., "signSGD with Majority
      Vote is Communication Efficient and Fault Tolerant", ICLR 2019.
    """

    chunk: int = DEFAULT_CHUNK
    aggregation: str = "allgather"
    allreduce: str = "ring"

    name = "sign"
    shorthand = {
        "sign": {},
        "sign_allreduce": {"aggregation": "allreduce"},
        "sign_allreduce_tree": {"aggregation": "allreduce", "allreduce": "tree"},
        "sign_majority": {"aggregation": "majority"},
    }

    def __post_init__(self):
        object.__setattr__(
            self, "chunk", _checks.static_int(self.chunk, "chunk", 1, _checks.MAX_ROW_LENGTH)
        )
        _checks.check_choice(self.aggregation, "aggregation", AGGREGATIONS)
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)
        if self.allreduce != "ring" and self.aggregation != "allreduce":
            raise ValueError(
                f"allreduce={self.allreduce!r} costs aggregation='allreduce' only; got "
                f"aggregation={self.aggregation!r}"
            )

    @property
    def label(self):
        if self.aggregation == "allgather":
            return self.name
        return "_".join(
            [self.name, self.aggregation] + ([self.allreduce] if self.allreduce != "ring" else [])
        )

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        from jaxcomp import collectives
        from jaxcomp.ops.sign import sign_pack, sign_unpack

        if self.aggregation != "allreduce":
            total, sent = collectives.sign_allgather(
                x, self.chunk, axis_name, majority=self.aggregation == "majority"
            )
            return total, sent, state
        words, scales = sign_pack(x, self.chunk)
        sent = sign_unpack(words, scales, x.shape[0], self.chunk, dtype=x.dtype)
        total, _ = collectives.psum(sent, axis_name)
        return total, sent, state

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """``"allgather"``, ``"majority"``: an all-gather of ``ceil(n/32)`` words and
        ``ceil(n/chunk)`` float32 scales, ``(N-1)`` times their bytes; ``"allreduce"``: an
        all-reduce of ``n`` decoded values of ``dtype_bytes``."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        if self.aggregation == "allreduce":
            return sizes.allreduce_bytes(n * dtype_bytes, N, self.allreduce)
        packed = (
            sizes.ceil_div(n, 32) * sizes.WORD_BYTES
            + sizes.ceil_div(n, self.chunk) * sizes.SCALAR_BYTES
        )
        return float((N - 1) * packed)

    def message_steps(self, n_devices, *, inner_size=None):
        """``ceil(log2 N)`` for the all-gather (recursive doubling, as top-k's); the all-reduce's
        steps for ``"allreduce"``."""
        N = _checks.check_devices(n_devices)
        if self.aggregation == "allreduce":
            return sizes.allreduce_steps(N, self.allreduce)
        return sizes.log2_steps(N)

    def local_work(self, n_values, n_devices):
        """Packing the vector, then decoding it once (``"allreduce"``) or decoding and adding
        ``N`` devices' signs (the all-gathers, with this device's words standing in for all)."""
        import jax.numpy as jnp

        from jaxcomp.collectives.sign import gathered_sign_sum
        from jaxcomp.ops.sign import sign_pack, sign_unpack

        workers = _checks.check_devices(n_devices)

        def codec(x):
            words, scales = sign_pack(x, self.chunk)
            if self.aggregation == "allreduce":
                return sign_unpack(words, scales, n_values, self.chunk)
            return gathered_sign_sum(
                jnp.broadcast_to(words, (workers,) + words.shape),
                jnp.broadcast_to(scales, (workers,) + scales.shape),
                n_values,
                self.chunk,
                self.aggregation == "majority",
            )

        return codec
