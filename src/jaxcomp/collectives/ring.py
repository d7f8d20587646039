"""The ring all-reduce whose every message goes through a codec, shared by ZFP and the 16-bit casts.

:func:`ring_allreduce` is the algorithm of paper 004 §III-C: a reduce-scatter of ``N - 1`` hops to
the right neighbour (:func:`jax.lax.ppermute`), each hop's message coded, then an all-gather that
forwards the owners' coded chunks unchanged. A :class:`Codec` says what a message is:
:func:`zfp_codec` (ZFP words, :func:`jaxcomp.collectives.zfp_allreduce`), or
:data:`BFLOAT16_BITS` and :data:`FLOAT16_BITS` (16-bit floats' bits typed uint16,
:func:`jaxcomp.collectives.narrow_allreduce`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import sizes
from jaxcomp.ops.zfp import zfp_decode, zfp_encode


class Codec(NamedTuple):
    """What each hop of :func:`ring_allreduce` sends: ``encode(values)`` turns a float32 chunk into
    its message (what crosses the wire); ``decode(message, length)`` turns a message, or a stack of
    them, back into float32 values, ``length`` a message."""

    encode: Callable
    decode: Callable


def zfp_codec(rate):
    """The ZFP codec at ``rate`` bits a value: messages are :func:`jaxcomp.zfp_encode`'s words.

    Args:
      rate: static int in ``[1, 32]``, ZFP bits per value.

    Returns:
      A :class:`Codec`.

    Example:
      >>> import jax.numpy as jnp
      >>> codec = zfp_codec(16)
      >>> codec.decode(codec.encode(jnp.ones(4)), 4).tolist()
      [1.0, 1.0, 1.0, 1.0]

    References:
      Lindstrom, IEEE TVCG 2014 (zfp fixed-rate mode); paper 004 §III-C (ZFP in the ring).
    """
    return Codec(
        lambda values: zfp_encode(values, rate),
        lambda words, length: zfp_decode(words, length, rate),
    )


def sixteen_bit_codec(dtype):
    """The codec whose messages are ``dtype``'s 16 bits typed uint16: XLA:CPU's collectives carry a
    bfloat16 payload as float32 (4 bytes a value), an integer one as it is, and gloo sums a float16
    one in software; moving uint16 needs no arithmetic, and the ring adds in float32 in XLA.

    Args:
      dtype: ``jnp.bfloat16`` or ``jnp.float16``.

    Returns:
      A :class:`Codec`: ``encode`` rounds float32 to ``dtype`` and bitcasts, ``decode`` widens.

    Example:
      >>> import jax.numpy as jnp
      >>> codec = sixteen_bit_codec(jnp.float16)
      >>> codec.encode(jnp.array([1.0, 2049.0])).dtype, codec.decode(codec.encode(
      ...     jnp.array([1.0, 2049.0])), 2).tolist()  # 2049 rounds to 2048 in float16
      (dtype('uint16'), [1.0, 2048.0])

    References:
      IEEE 754 binary16; Kalamkar et al., arXiv 1905.12322 (bfloat16).
    """
    dtype = jnp.dtype(dtype)

    def encode(values):
        return jax.lax.bitcast_convert_type(values.astype(dtype), jnp.uint16)

    def decode(bits, length):
        return jax.lax.bitcast_convert_type(bits, dtype).astype(jnp.float32)

    return Codec(encode, decode)


#: bfloat16 values sent as their 16 bits (:func:`sixteen_bit_codec`).
BFLOAT16_BITS = sixteen_bit_codec(jnp.bfloat16)

#: float16 values sent as their 16 bits (:func:`sixteen_bit_codec`).
FLOAT16_BITS = sixteen_bit_codec(jnp.float16)


def ring_allreduce(values, axis_name, n_devices, codec, *, own=1, scatter=False, code_owned=True):
    """A ring all-reduce of float32 ``values`` whose every message is coded by ``codec``:
    ``(total, sent)``.

    The vector is zero-padded into ``N`` chunks. In ``N - 1`` reduce-scatter hops each device
    sends the chunk it holds, coded, to its right neighbour, which decodes it and adds its own
    chunk; device ``d`` ends owning chunk ``(d + own) mod N`` fully reduced, codes it once, and the
    all-gather forwards those messages unchanged, so every device decodes the same ones and
    ``total`` is identical everywhere (typed invariant).

    Args:
      values: this device's local 1-D float32 vector.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      n_devices: static int, the devices along ``axis_name`` (at least 2).
      codec: the :class:`Codec` of every message.
      own: device ``d`` ends owning chunk ``(d + own) mod N``.
      scatter: stop after the reduce-scatter and return the owned chunk as ``total``, coded and
        decoded with ``code_owned`` (then it is the all-reduce's row bit for bit, for the same
        ``own``), else exactly as reduced.
      code_owned: with ``scatter``, whether the owned chunk is coded once more.

    Returns:
      ``(total, sent)`` in float32. ``sent``: the values less every coding error this device made
      (each chunk is coded once by each device), so the ``sent`` of all devices add up to
      ``total`` (to float32 rounding).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: ring_allreduce(x, "data", 2, BFLOAT16_BITS)[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, 2.0, 3.0, 4.0])).tolist()
      [4.0, 6.0]

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C and Alg. 1.
    """
    encode, decode = codec
    n = values.shape[0]
    chunk = sizes.ring_chunk(n, n_devices)
    chunks = jnp.pad(values, (0, n_devices * chunk - n)).reshape(n_devices, chunk)
    me = jax.lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n_devices) for i in range(n_devices)]
    # Device me starts with chunk me + start; the ring then hands it chunk me + start + 1 = me + own
    # fully reduced.
    start = own - 1
    # This device codes each chunk exactly once: chunk `me + start` raw at hop 0, chunk
    # (me + start - t) mod N as a partial sum at hop t, and the chunk it owns once fully reduced
    # (not with scatter and not code_owned). What each coding loses is this device's error on that
    # chunk: the total is the exact sum less every device's errors, so feeding back all of them
    # (not just hop 0's) feeds back all that was lost.
    partial = chunks[(me + start) % n_devices]
    message = encode(partial)
    errors = [partial - decode(message, chunk)]
    for hop in range(n_devices - 1):
        received = jax.lax.ppermute(message, axis_name, to_right)
        partial = decode(received, chunk) + chunks[(me + start - hop - 1) % n_devices]
        if scatter and not code_owned and hop == n_devices - 2:
            errors.append(jnp.zeros_like(partial))  # the owned chunk is kept as it is
            break
        message = encode(partial)  # the next hop's message; after the last hop, the owned chunk
        if hop < n_devices - 2 or scatter:
            decoded = decode(message, chunk)
            errors.append(partial - decoded)
    if scatter:
        return (decoded if code_owned else partial), _sent(chunks, errors, me + start, n)
    owned = jax.lax.all_gather(message, axis_name, to="invarying")
    if own % n_devices:
        # Row j of the gathered messages is chunk (j + own) mod N: reorder the messages (fewer
        # bytes than the decoded floats), not the decoded floats.
        owned = owned[(np.arange(n_devices) - own) % n_devices]
    total = decode(owned, chunk)
    # The owned chunk's coding error: its row of the total is the same words decoded (the codec
    # decodes each row alone), so it is not decoded a second time.
    errors.append(partial - total[(me + own) % n_devices])
    return total.reshape(-1)[:n], _sent(chunks, errors, me + start, n)


def _sent(chunks, errors, first, n):
    """The chunks less this device's coding errors: ``errors[t]`` belongs to chunk
    ``(first - t) mod N``. Each chunk is written once, in place, where it belongs (stacking the
    errors and permuting them took two more passes over the vector)."""
    n_devices = chunks.shape[0]
    sent = chunks
    for t, error in enumerate(errors):
        row = (first - t) % n_devices
        lost = jax.lax.dynamic_index_in_dim(chunks, row, keepdims=False) - error
        sent = jax.lax.dynamic_update_index_in_dim(sent, lost, row, 0)
    return sent.reshape(-1)[:n]
