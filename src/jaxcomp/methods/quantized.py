"""``Quantized``: THC's homomorphic quantization, summed by one integer all-reduce."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks


@dataclasses.dataclass(frozen=True)
class Quantized(Method):
    """THC: integer codes on a grid every device shares, packed and summed by one psum.

    Args:
      bits: code width, an integer in ``[1, 16]`` (4-8 is THC's useful range).
      hadamard: rotate by a random Hadamard transform first (default True): the range shrinks,
        so the same bits lose less.
      allreduce: how the cost model costs its all-reduces, ``"ring"`` (default) or ``"tree"``.

    One range spans the whole vector, so with ``compress(..., granularity="model")`` (the default)
    the largest gradient of the model sets every leaf's grid: a leaf whose gradients are ten times
    smaller gets rounding noise above its signal, and Adam, which normalizes each coordinate,
    turns that noise into full-size steps. ``granularity="leaf"`` gives each leaf its own range: on
    ``benchmarks/quality.py``'s transformer that took 4 bits to within 3% of a tuned dense's
    held-out loss, and so did :func:`jaxcomp.adam` (the momentum quantized) at model granularity
    (docs/training.md, "What the methods cost in model quality").

    Example:
      >>> from jaxcomp.methods import Quantized
      >>> Quantized(4).wire_bytes(1024, 4)  # 6-bit fields, 5 codes a word: 205 words
      1236.0

    References:
      Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic
      Compression", NSDI 2024.
    """

    bits: int
    hadamard: bool = True
    allreduce: str = "ring"

    name = "quantized"
    shorthand = {"quantized": {}}
    codec_skipped_on_one_device = True  # quantized_psum returns its input on one device

    def __post_init__(self):
        object.__setattr__(self, "bits", _checks.check_bits(self.bits))
        object.__setattr__(self, "hadamard", _checks.check_flag(self.hadamard, "hadamard"))
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)

    @property
    def setting(self):
        return self.bits

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        from jaxcomp import collectives

        total, sent = collectives.quantized_psum(
            x, self.bits, axis_name, key, hadamard=self.hadamard
        )
        return total, sent, state

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """An all-reduce of the codes (``n``, padded to whole Hadamard blocks) packed into uint32
        words of :func:`jaxcomp.collectives.sizes.codes_per_word` codes, plus one of the float32
        range."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        codes = (
            sizes.packed_words(sizes.quantized_length(n, self.hadamard), self.bits, N)
            * sizes.WORD_BYTES
        )
        return sizes.allreduce_bytes(codes, N, self.allreduce) + sizes.allreduce_bytes(
            sizes.SCALAR_BYTES, N, self.allreduce
        )

    def shard_row(self, m, n_devices):
        """Whole Hadamard blocks of a row (each device rotates its own row back)."""
        return sizes.quantized_length(m, self.hadamard)

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        from jaxcomp import collectives

        return collectives.quantized_psum(
            x, self.bits, axis_name, key, hadamard=self.hadamard, scatter=True
        )

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        """A reduce-scatter of the rows' packed codes (``n`` values in ``N`` rows of whole Hadamard
        blocks), plus the all-reduce of the float32 range."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        row = sizes.quantized_length(sizes.ceil_div(n, N), self.hadamard)
        codes = N * sizes.packed_words(row, self.bits, N) * sizes.WORD_BYTES
        return sizes.reduce_scatter_bytes(codes, N) + sizes.allreduce_bytes(
            sizes.SCALAR_BYTES, N, self.allreduce
        )

    def reduce_scatter_steps(self, n_devices):
        N = _checks.check_devices(n_devices)
        return sizes.reduce_scatter_steps(N) + sizes.allreduce_steps(N, self.allreduce)

    def message_steps(self, n_devices, *, inner_size=None):
        """Two all-reduces: the shared range, then the packed codes."""
        return 2 * sizes.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)

    def local_work(self, n_values, n_devices):
        """THC's whole local work (:func:`jaxcomp.collectives.quantized.quantized_psum_local`)."""
        import jax

        from jaxcomp.collectives.quantized import quantized_psum_local

        workers = max(2, _checks.check_devices(n_devices))

        def codec(x):
            total, sent = quantized_psum_local(
                x, self.bits, jax.random.key(0), workers, hadamard=self.hadamard
            )
            return total + sent

        return codec
