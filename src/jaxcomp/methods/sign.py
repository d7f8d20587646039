"""``Sign``: 1 bit a value plus one scale per chunk (EF-SignSGD, 1-bit Adam's compression), or
signSGD's majority vote."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks

#: How the signs are aggregated (see :class:`Sign`).
AGGREGATIONS = ("allgather", "allreduce", "majority", "ring")

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

    **Quality: pair it with** :func:`jaxcomp.adam` (1-bit Adam: the signs of the momentum, not of
    the gradient), which holds on every task of the quality zoo, where ``compress`` + ``optax.adam``
    does not (BENCHMARKS.md, "What each method costs in quality"). On ``benchmarks/quality.py``'s
    transformer it ends close to dense Adam's held-out loss, where ``compress`` + ``optax.adam``
    ends far above it (docs/training.md, "Optimizers that know they are compressed"). The bit of
    ``x >= 0`` (``+0`` and ``-0`` included) is ``+``; NaN is ``-``.

    **Many devices: ``aggregation="ring"``.** The all-gather's bytes grow with the devices
    (``N - 1`` copies of every device's signs: on 64 devices as many as a dense all-reduce);
    the ring's stay at about a quarter byte a value (``2 (N-1)/N`` of ``n/8``), 31x fewer than
    dense's on 8 devices. Its partial sums are coded hop by hop, which costs a little quality
    against the all-gather, and it sends ``2 (N-1)`` messages in sequence where the all-gather
    needs ``log2 N``; on 4 emulated hosts both were faster than a dense ``pmean``, the ring a
    little less so (docs/notes/2026-12-05-benchmarks-until-0.2.md,
    "Signs in a ring"). With ``jaxcomp.adam(..., warmup_method=jaxcomp.Zfp(8))`` (the warm-up
    and the variance refreshes sent as ZFP) the ring stays within 3% of dense at more than ten
    times fewer bytes over a whole run (docs/training.md, "Optimizers that know they are
    compressed").

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
        * ``"ring"``: 1-bit Adam's compressed all-reduce, as a ring whose every message is
          signs (:func:`jaxcomp.collectives.sign_ring`): the partial sums of ``N`` chunks
          travel as signs through ``N - 1`` hops, then the owners' signs are all-gathered; each
          device's ``sent`` lacks every coding error it made, so error feedback keeps them (the
          paper's worker and server errors). ``2 (N-1) (ceil(c/32) + ceil(c/chunk)) 4`` bytes
          with ``c = ceil(n/N)``: about ``2/N`` of the all-gather's, the same on any number of
          devices, in ``2 (N-1)`` steps; and it decodes ``2 n`` values, not ``N n``.
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
        "sign_ring": {"aggregation": "ring"},
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

    @property
    def decoded_sent(self):
        """The all-gather's and the all-reduce's ``sent`` can come with this device's scales
        (:class:`jaxcomp.ops.sign.ScaledSigns`), whose energies the metrics read off them; the
        majority vote's and the ring's are not one device's decoded signs."""
        return self.aggregation in ("allgather", "allreduce")

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None, decoded=False):
        from jaxcomp import collectives
        from jaxcomp.ops.sign import ScaledSigns, sign_pack, sign_unpack

        if self.aggregation == "ring":
            total, sent = collectives.sign_ring(x, self.chunk, axis_name)
            return total, sent, state
        if self.aggregation != "allreduce":
            total, sent = collectives.sign_allgather(
                x,
                self.chunk,
                axis_name,
                majority=self.aggregation == "majority",
                decoded=decoded,
            )
            return total, sent, state
        words, scales = sign_pack(x, self.chunk)
        sent = sign_unpack(words, scales, x.shape[0], self.chunk, dtype=x.dtype)
        total, _ = collectives.psum(sent, axis_name)
        return total, ScaledSigns(sent, scales, self.chunk) if decoded else sent, state

    def steps_along(self, x):
        """Scaled signs of ``x``'s values, ``chunk`` by chunk in row-major order: what one
        device's signs decode to (the majority vote and the ring shape theirs the same way)."""
        from jaxcomp.ops.sign import sign_pack, sign_unpack

        flat = x.reshape(-1)
        words, scales = sign_pack(flat, self.chunk)
        return sign_unpack(words, scales, flat.shape[0], self.chunk, dtype=x.dtype).reshape(x.shape)

    @property
    def scatters(self):
        return self.aggregation == "ring"

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        from jaxcomp import collectives

        if not self.scatters:
            return super().reduce_scatter(x, axis_name, step=step, key=key, size=size)
        return collectives.sign_reduce_scatter(x, self.chunk, axis_name)

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """The ring's reduce-scatter phase: ``N - 1`` messages of ``ceil(n/N)`` values' signs."""
        if not self.scatters:
            return super().reduce_scatter_bytes(n, n_devices, dtype_bytes=dtype_bytes)
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        return float((N - 1) * self._packed(sizes.ring_chunk(n, N)))

    def reduce_scatter_steps(self, n_devices):
        if not self.scatters:
            return super().reduce_scatter_steps(n_devices)
        return sizes.reduce_scatter_steps(_checks.check_devices(n_devices))

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """``"allgather"``, ``"majority"``: an all-gather of ``ceil(n/32)`` words and
        ``ceil(n/chunk)`` float32 scales, ``(N-1)`` times their bytes; ``"allreduce"``: an
        all-reduce of ``n`` decoded values of ``dtype_bytes``; ``"ring"``: ``2 (N-1)`` messages
        of the words and scales of ``ceil(n/N)`` values."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        if self.aggregation == "allreduce":
            return sizes.allreduce_bytes(n * dtype_bytes, N, self.allreduce)
        if self.aggregation == "ring":
            return float(2 * (N - 1) * self._packed(sizes.ring_chunk(n, N)))
        return float((N - 1) * self._packed(n))

    def _packed(self, n: int) -> int:
        """Bytes of the words and scales of ``n`` values."""
        return (
            sizes.ceil_div(n, 32) * sizes.WORD_BYTES
            + sizes.ceil_div(n, self.chunk) * sizes.SCALAR_BYTES
        )

    def message_steps(self, n_devices, *, inner_size=None):
        """``ceil(log2 N)`` for the all-gather (recursive doubling, as top-k's); the all-reduce's
        steps for ``"allreduce"``; ``2 (N-1)`` for the ring."""
        N = _checks.check_devices(n_devices)
        if self.aggregation == "ring":
            return 2 * (N - 1)
        if self.aggregation == "allreduce":
            return sizes.allreduce_steps(N, self.allreduce)
        return sizes.log2_steps(N)

    def local_work(self, n_values, n_devices):
        """Packing the vector, then decoding it once (``"allreduce"``) or decoding and adding
        ``N`` devices' signs (the all-gathers, with this device's words standing in for all);
        the ring's hops (:meth:`_ring_work`)."""
        import jax.numpy as jnp

        from jaxcomp.collectives.sign import gathered_sign_sum
        from jaxcomp.ops.sign import sign_pack, sign_unpack

        workers = _checks.check_devices(n_devices)
        if self.aggregation == "ring":
            return self._ring_work(n_values, workers)

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

    def _ring_work(self, n_values: int, workers: int):
        """The ring's local work: ``N - 1`` hops coding, decoding and adding a chunk, then the
        owned chunk coded and ``N`` chunks decoded (the gathered messages; this device's stand
        in for all)."""
        import jax.numpy as jnp

        from jaxcomp.collectives.sign import sign_codec

        codec = sign_codec(self.chunk)
        c = sizes.ring_chunk(n_values, workers)

        def work(x):
            rows = jnp.pad(x, (0, workers * c - n_values)).reshape(workers, c)
            partial = rows[0]
            for hop in range(1, workers):
                partial = codec.decode(codec.encode(partial), c) + rows[hop]
            words, scales = codec.encode(partial)
            stacked = (jnp.broadcast_to(words, (workers,) + words.shape),
                       jnp.broadcast_to(scales, (workers,) + scales.shape))  # fmt: skip
            return codec.decode(stacked, c).reshape(-1)[:n_values]

        return work
