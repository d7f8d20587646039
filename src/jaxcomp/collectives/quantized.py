"""THC's homomorphic quantization: the collective :func:`quantized_psum` and its codec.

The randomized Hadamard rotation, the stochastic rounding onto ``2**bits`` levels, and the packing
of codes into uint32 fields wide enough for the sum of ``N`` codes. :func:`quantized_sum` is the
whole algorithm with its two collectives (the range's max, the codes' sum) passed in, so the
collective (:func:`quantized_psum`) and the codec's local timing (:func:`quantized_psum_local`)
run one body. THC is the paper's name; jaxcomp's names say "quantized" (the method is
:class:`jaxcomp.methods.Quantized`).

References:
  Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic Compression",
  NSDI 2024.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import sizes
from jaxcomp.collectives._common import axis_size, check_rows, local_vector, one_device_total
from jaxcomp.ops import _checks
from jaxcomp.ops.hadamard import counter_signs, counter_uniform, hadamard_transform


def pack_codes(codes, width: int):
    """uint32 words holding ``32 // width`` codes of ``width`` bits each (the last word
    zero-padded).

    Args:
      codes: a 1-D uint32 vector of codes below ``2**width``.
      width: bits per field, 1..32.

    Returns:
      The uint32 words.

    Example:
      >>> import jax.numpy as jnp
      >>> pack_codes(jnp.array([1, 2, 3], jnp.uint32), 8).tolist()  # 1 + 2 << 8 + 3 << 16
      [197121]

    References:
      Li et al., THC, NSDI 2024.
    """
    per_word = 32 // width
    codes = jnp.pad(
        codes, (0, sizes.ceil_div(codes.shape[0], per_word) * per_word - codes.shape[0])
    )
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * np.uint32(width)
    # Fields do not overlap, so the sum is a bitwise or.
    return jnp.sum(codes.reshape(-1, per_word) << shifts, axis=1, dtype=jnp.uint32)


def unpack_codes(words, width: int, length: int):
    """The first ``length`` codes of ``width`` bits held in ``words`` (the inverse
    of :func:`pack_codes`).

    Args:
      words: uint32 words from :func:`pack_codes` (or their sum over devices).
      width: bits per field.
      length: codes to return.

    Returns:
      A uint32 vector of ``length`` codes.

    Example:
      >>> import jax.numpy as jnp
      >>> unpack_codes(jnp.array([197121], jnp.uint32), 8, 3).tolist()
      [1, 2, 3]

    References:
      Li et al., THC, NSDI 2024.
    """
    per_word = 32 // width
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * np.uint32(width)
    return ((words[:, None] >> shifts) & np.uint32((1 << width) - 1)).reshape(-1)[:length]


def _rotation(key, length, rows_of, hadamard):
    """THC's randomized Hadamard rotation of ``length`` values (random signs from ``key``, then
    the orthonormal Walsh-Hadamard transform in blocks of
    :func:`jaxcomp.collectives.sizes.hadamard_block` of ``rows_of`` values), or the identity
    without ``hadamard``: ``(forward, back, signs, block)``, ``back(v, signs)`` the inverse with
    the given signs (``signs`` and ``block`` None without ``hadamard``)."""
    if not hadamard:
        return (lambda v: v), (lambda v, signs: v), None, None
    block = sizes.hadamard_block(rows_of)
    if length % block:
        raise ValueError(f"rows of {rows_of} values are not whole Hadamard blocks of {block}")
    signs = counter_signs(key, (length // block, block))
    scale = np.float32(1.0 / math.sqrt(block))

    def forward(v):
        return (hadamard_transform(v.reshape(-1, block) * signs) * scale).reshape(-1)

    def back(v, signs):
        return (hadamard_transform(v.reshape(-1, block)) * scale * signs).reshape(-1)

    return forward, back, signs, block


def _stochastic_codes(rotated, bound, levels, key, device):
    """``rotated`` stochastically rounded onto ``levels + 1`` levels over ``[-bound, bound]``
    (noise from ``key`` folded with ``device``): unbiased uint32 codes."""
    unit = jnp.where(bound > 0, bound, 1.0)  # all-zero input: any grid works, the codes cancel
    position = (rotated / unit + 1.0) * np.float32(levels / 2)  # in [0, levels]
    noise = counter_uniform(jax.random.fold_in(key, device), rotated.shape)
    return jnp.clip(jnp.floor(position + noise), 0, levels).astype(jnp.uint32)


def _summed_codes(codes, width, psum, n_devices, row):
    """The devices' sum of ``codes``, packed into fields of ``width`` bits for ``psum``: every
    code, or with ``row`` (a reduce-scatter) this device's row of ``row`` codes, each row packed
    on its own. Codes on one grid add homomorphically, and fields of ``width`` bits add without
    carrying into each other: one psum of packed words sums every code."""
    if row is None:
        return unpack_codes(psum(pack_codes(codes, width)), width, codes.shape[0])
    packed = jax.vmap(lambda c: pack_codes(c, width))(codes.reshape(n_devices, row))
    return unpack_codes(psum(packed), width, row)


def _row_signs(signs, n_devices, device, block):
    """Row ``device``'s part of the rotation's ``signs`` (None without a rotation)."""
    if signs is None:
        return None
    return jax.lax.dynamic_index_in_dim(signs.reshape(n_devices, -1, block), device, keepdims=False)


def quantized_sum(
    x, bits: int, key, hadamard: bool, n_devices: int, device, pmax, psum, scatter: bool = False
):
    """THC's quantized sum of one device's vector, with the collectives passed in:
    ``(total, sent)``.

    1. Optionally a randomized Hadamard transform (signs from ``key``).
    2. The range ``R = pmax(max |rotated|)``.
    3. Stochastic rounding onto ``2**bits`` levels over ``[-R, R]``, noise from ``key`` folded
       with ``device``.
    4. Codes packed into fields of :func:`jaxcomp.collectives.sizes.code_width` bits, summed by
       ``psum``, unpacked, dequantized and transformed back.

    Args:
      x: a 1-D float vector.
      bits: code width, 1..:data:`jaxcomp.collectives.sizes.MAX_QUANTIZATION_BITS`.
      key: a typed ``jax.random`` key, the same on every device.
      hadamard: whether to rotate first.
      n_devices: the devices whose sum the packed fields must hold.
      device: this device's index (seeds its rounding noise).
      pmax: the max over the devices (identity for one device).
      psum: the sum over the devices (identity for one device); with ``scatter``, the
        reduce-scatter of the ``[n_devices, words]`` packed rows.
      scatter: end with a reduce-scatter (sharded training): ``x`` holds ``n_devices`` rows of
        whole Hadamard blocks, each packed on its own, and ``total`` is row ``device`` of the sum.

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.linspace(-1, 1, 64)
      >>> total, sent = quantized_sum(x, 8, jax.random.key(0), True, 1, 0, lambda v: v, lambda v: v)
      >>> bool(jnp.allclose(total, x, atol=0.02))
      True

    References:
      Li et al., THC, NSDI 2024.
    """
    n = x.shape[0]
    width = sizes.code_width(bits, n_devices)
    sign_key, noise_key = jax.random.split(key)
    row = n // n_devices if scatter else None
    length = n if scatter else sizes.quantized_length(n, bool(hadamard))
    values = jnp.pad(x.astype(jnp.float32), (0, length - n))
    transform, rotate_back, signs, block = _rotation(
        sign_key, length, row if scatter else n, hadamard
    )

    def inverse(v):
        return rotate_back(v, signs)[:n]

    rotated = transform(values)
    bound = pmax(jnp.max(jnp.abs(rotated)))
    levels = 2**bits - 1
    codes = _stochastic_codes(rotated, bound, levels, noise_key, device)
    step = bound * np.float32(2 / levels)
    sent = inverse(codes.astype(jnp.float32) * step - bound)
    summed = _summed_codes(codes, width, psum, n_devices, row)
    if scatter:
        # This device's row, rotated back with its own row's signs.
        own = _row_signs(signs, n_devices, device, block)
        total = rotate_back(summed.astype(jnp.float32) * step - n_devices * bound, own)
    else:
        # Typed invariant: not stacked with sent.
        total = inverse(summed.astype(jnp.float32) * step - n_devices * bound)
    return total.astype(x.dtype), sent.astype(x.dtype)


def quantized_psum_local(x, bits, key, n_devices, hadamard=True):
    """THC's local work alone: :func:`jaxcomp.collectives.quantized_psum` with its two collectives
    taken out.

    The transform, rounding, packing and back-transforms of one device out of ``n_devices``,
    with this device's range for the agreed one and its own packed words for their sum; what
    :func:`jaxcomp.costmodel.probe.codec_seconds` times, since THC has no codec apart from its
    collective.

    Args:
      x: a 1-D float vector.
      bits: code width, as for :func:`jaxcomp.collectives.quantized_psum`.
      key: a ``jax.random`` key.
      n_devices: the devices whose sum the packed fields must hold.
      hadamard: whether to rotate first.

    Returns:
      ``(total, sent)`` as :func:`jaxcomp.collectives.quantized_psum` computes them when this
      device is alone.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> total, sent = quantized_psum_local(jnp.linspace(-1, 1, 64), 8, jax.random.key(0), 4)
      >>> bool(jnp.allclose(sent, jnp.linspace(-1, 1, 64), atol=0.02))
      True

    References:
      Li et al., THC, NSDI 2024; Agarwal et al., MLSys 2022, App. C (timing the codec on its own).
    """
    x = _checks.float_array(x, "x")
    if x.ndim != 1:
        raise ValueError(f"x must be a 1-D vector, got shape {x.shape}")
    bits = _checks.check_bits(bits)
    key = _checks.check_key(key)
    n_devices = _checks.static_int(n_devices, "n_devices", 1)
    return quantized_sum(
        x, bits, key, bool(hadamard), n_devices, 0, pmax=lambda v: v, psum=lambda v: v
    )


def _reduction(axis_name, scatter):
    """The sum of the packed codes over ``axis_name``: a psum, or with ``scatter`` a
    reduce-scatter of their ``[N, words]`` rows."""
    if scatter:

        def psum(v):
            return jax.lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=False)
    else:

        def psum(v):
            return jax.lax.psum(v, axis_name)

    return psum


def quantized_psum(x, bits, axis_name, key, hadamard=True, *, scatter=False):
    """THC homomorphic quantization: integer codes on a shared grid, summed by one integer psum.

    1. Optionally a randomized Hadamard transform (signs from ``key``, blocks of up to
       :data:`jaxcomp.collectives.sizes.MAX_HADAMARD_BLOCK`) spreads the energy, shrinking the
       range.
    2. The range ``R`` is agreed by all: :func:`jax.lax.pmax` of the local max magnitudes.
    3. Each value is stochastically rounded onto the ``2**bits`` levels spanning ``[-R, R]``
       (noise from ``key`` folded with the axis index): the codes are unbiased.
    4. The codes are packed into uint32 words, in fields wide enough for the sum of ``N`` codes
       (:func:`jaxcomp.collectives.sizes.code_width`), so one psum adds every field without
       carries; then dequantized and transformed back.

    ``sent`` is this device's codes dequantized and transformed back, so ``x - sent`` is this
    device's quantization error (zero mean). With ``N = 1`` nothing is sent: ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector.
      bits: static int in ``[1, jaxcomp.collectives.sizes.MAX_QUANTIZATION_BITS]``, the width of a
        code.
      axis_name: the mesh axis to sum over.
      key: a ``jax.random`` key, the same on every device (traced; pass a new one each step).
      hadamard: static bool, whether to apply the randomized Hadamard transform.
      scatter: end with a reduce-scatter of the integer codes: ``x`` is ``N`` rows of whole
        Hadamard blocks (:meth:`jaxcomp.Quantized.shard_row`) and ``total`` is this device's row
        of the sum (sharded training).

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (computed in float32); with ``scatter``,
      ``total`` is one row. ``E[total]`` is the exact sum.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x, key: collectives.quantized_psum(x, 8, "data", key)[0],
      ...                           mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
      >>> total = f(jnp.arange(8.0), jax.random.key(0))
      >>> bool(jnp.allclose(total, jnp.array([4.0, 6.0, 8.0, 10.0]), atol=0.2))
      True

    References:
      Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic
      Compression", NSDI 2024.
    """
    x = local_vector(x)
    bits = _checks.check_bits(bits)
    if not isinstance(hadamard, (bool, np.bool_)):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    n_devices = axis_size(axis_name)
    key = _checks.check_key(key, axis_name)
    if n_devices == 1:
        return (x if scatter else one_device_total(x, axis_name)), x
    if scatter:
        check_rows(x.shape[0], axis_name)
    return quantized_sum(
        x,
        bits,
        key,
        hadamard,
        n_devices,
        jax.lax.axis_index(axis_name),
        pmax=lambda v: jax.lax.pmax(v, axis_name),
        psum=_reduction(axis_name, scatter),
        scatter=scatter,
    )


#: jaxcomp 0.1's name of :func:`quantized_sum` (``jaxcomp.thc.thc_aggregate``), kept for one
#: release; remove it in jaxcomp 0.3 with the old module paths.
thc_aggregate = quantized_sum
