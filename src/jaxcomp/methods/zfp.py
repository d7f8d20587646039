"""``Zfp``: ZFP fixed-rate compression inside a point-to-point all-reduce."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import ZFP_ALGORITHMS, sizes
from jaxcomp.methods.base import Method
from jaxcomp.ops import _checks
from jaxcomp.ops.zfp_format import row_words

#: jaxcomp 0.1's name here of :data:`jaxcomp.collectives.ZFP_ALGORITHMS` (the same tuple).
ALGORITHMS = ZFP_ALGORITHMS


@dataclasses.dataclass(frozen=True)
class Zfp(Method):
    """ZFP fixed-rate compression at the collective level: every hop sends ``rate`` bits a value.

    Args:
      rate: ZFP bits per value on the wire, an integer in ``[1, 32]`` (8 is a good start).
      algorithm: ``"ring"`` (default; reduce-scatter then all-gather of compressed chunks) or
        ``"recursive_doubling"`` (log2 N exchanges of the whole compressed vector; its total is
        typed varying, so :func:`jaxcomp.compress_auto` does not take it).

    Example:
      >>> from jaxcomp.methods import Zfp
      >>> Zfp(8).describe(), Zfp(8).message_steps(8)
      ('zfp(8)', 14)

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III; Lindstrom,
      IEEE TVCG 2014 (zfp fixed-rate mode).
    """

    rate: int
    algorithm: str = "ring"

    name = "zfp"
    shorthand = {
        "zfp": {},
        "zfp_ring": {},
        "zfp_recursive_doubling": {"algorithm": "recursive_doubling"},
    }
    codec_skipped_on_one_device = True  # the ring returns its input when there is no neighbour
    # Error feedback stays on by default (unlike the casts): without it ZFP 8 ended measurably
    # above dense Adam's loss over longer runs on the quality benchmark, and level with it with
    # it (docs/notes/2026-12-05-benchmarks-until-0.2.md, "ZFP without error feedback").
    feeds_back_by_default = True

    def __post_init__(self):
        object.__setattr__(self, "rate", _checks.check_rate(self.rate))
        _checks.check_choice(self.algorithm, "algorithm", ZFP_ALGORITHMS)

    @property
    def replicated_total(self):
        return self.algorithm == "ring"

    @property
    def label(self):
        return self.name if self.algorithm == "ring" else f"{self.name}_{self.algorithm}"

    @property
    def setting(self):
        return self.rate

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        from jaxcomp import collectives

        total, sent = collectives.zfp_allreduce(x, self.rate, axis_name, algorithm=self.algorithm)
        return total, sent, state

    @property
    def scatters(self):
        return self.algorithm == "ring"

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        from jaxcomp import collectives

        if not self.scatters:
            return super().reduce_scatter(x, axis_name, step=step, key=key, size=size)
        return collectives.zfp_reduce_scatter(x, self.rate, axis_name)

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """The ring's reduce-scatter phase: ``N - 1`` compressed chunks of ``ceil(n/N)`` values."""
        if not self.scatters:
            return super().reduce_scatter_bytes(n, n_devices, dtype_bytes=dtype_bytes)
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        return float((N - 1) * row_words(sizes.ring_chunk(n, N), self.rate) * sizes.WORD_BYTES)

    def reduce_scatter_steps(self, n_devices):
        if not self.scatters:
            return super().reduce_scatter_steps(n_devices)
        return sizes.reduce_scatter_steps(_checks.check_devices(n_devices))

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """``"ring"``: ``2 (N-1)`` compressed chunks of ``ceil(n/N)`` values;
        ``"recursive_doubling"``: the whole compressed vector once per round, ``log2 p`` rounds for
        ``p`` the largest power of two ``<= N``, plus one when ``N`` is not a power of two (the
        busiest device)."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        if self.algorithm == "ring":
            return float(
                2 * (N - 1) * row_words(sizes.ring_chunk(n, N), self.rate) * sizes.WORD_BYTES
            )
        p = sizes.power_of_two_below(N)
        rounds = p.bit_length() - 1 + (1 if p != N else 0)
        return float(rounds * row_words(n, self.rate) * sizes.WORD_BYTES)

    def message_steps(self, n_devices, *, inner_size=None):
        """``"ring"``: ``2(N-1)``; ``"recursive_doubling"``: ``log2 p``, plus a fold-in and a
        fold-out step when ``p < N`` (paper 004 §III-E)."""
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0
        if self.algorithm == "ring":
            return 2 * (N - 1)
        p = sizes.power_of_two_below(N)
        rounds = p.bit_length() - 1
        return rounds if p == N else rounds + 2

    def local_work(self, n_values, n_devices):
        """The codec work of one device: for the ring, each of the ``N`` chunks coded once (raw,
        as a partial sum, or the owned chunk) and decoded once for error feedback, ``N-1``
        received chunks decoded and added, and all ``N`` owned chunks decoded (``N`` chunk encodes
        and ``3N-1`` chunk decodes: one encode and three decodes of the gradient); else one encode
        and one decode."""
        import jax.numpy as jnp

        from jaxcomp.ops.zfp import zfp_decode, zfp_encode

        rate, workers = self.rate, _checks.check_devices(n_devices)

        def codec(x):
            if self.algorithm != "ring" or workers == 1:
                return zfp_decode(zfp_encode(x, rate), n_values, rate)
            chunk = sizes.ring_chunk(n_values, workers)
            chunks = jnp.pad(x, (0, chunk * workers - n_values)).reshape(workers, chunk)
            partial = chunks[0]
            words = zfp_encode(partial, rate)
            lost = [partial - zfp_decode(words, chunk, rate)]
            for hop in range(1, workers):
                partial = zfp_decode(words, chunk, rate) + chunks[hop]
                words = zfp_encode(partial, rate)
                lost.append(partial - zfp_decode(words, chunk, rate))
            owned = jnp.broadcast_to(words, (workers,) + words.shape)
            return (zfp_decode(owned, chunk, rate) - jnp.stack(lost)).reshape(-1)[:n_values]

        return codec
