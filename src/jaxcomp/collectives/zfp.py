"""ZFP at the collective level: an all-reduce (a ring, or recursive doubling) and a reduce-scatter
whose every message is ZFP fixed-rate words (:mod:`jaxcomp.ops.zfp`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives import ZFP_ALGORITHMS, sizes
from jaxcomp.collectives._common import axis_size, check_rows, local_vector, one_device_total
from jaxcomp.collectives.ring import ring_allreduce, zfp_codec
from jaxcomp.ops import _checks
from jaxcomp.ops._checks import check_choice
from jaxcomp.ops.zfp import zfp_decode, zfp_encode


def zfp_allreduce(x, rate, axis_name, algorithm="ring"):
    """All-reduce with ZFP fixed-rate compression at the collective level, from point-to-point
    steps.

    ``"ring"``: the vector is zero-padded into ``N`` chunks of ``ceil(n/N)`` values. In ``N-1``
    reduce-scatter hops (:func:`jax.lax.ppermute` to the right neighbour) each device compresses the
    chunk it sends once, and the receiver decodes it and adds its own chunk. The owner of each fully
    reduced chunk compresses it once; the all-gather phase then forwards those compressed words
    unchanged (:func:`jax.lax.all_gather` of the words: the ring all-gather with no recompression),
    and every device, the owner included, decodes the same words, so ``total`` is identical
    everywhere.

    ``"recursive_doubling"``: with ``p`` the largest power of two ``<= N`` and ``r = N - p``, the
    first ``2r`` devices fold pairwise (even sends its compressed vector to odd, which adds it);
    ``p`` devices then run ``log2 p`` rounds, each exchanging the compressed partial sum with the
    partner at distance ``1, 2, 4, ...`` and adding both decoded vectors (each device uses the
    decoded version of its own words, so partners stay bit-identical); finally the partners send the
    compressed result back to the folded devices and every device decodes those same words.

    ``sent`` for the ring: ``x`` less every codec error this device made. Each device codes each
    chunk exactly once (its own chunk raw at the first hop, a partial sum at each later hop, the
    chunk it owns once fully reduced), and ``total`` is the exact sum less all those errors, so the
    ``sent`` of all devices add up to ``total`` (up to float32 rounding) and error feedback,
    ``x - sent``, feeds back everything the ring lost, re-coded partial sums included. Feeding back
    only the first hop's error (each device's own vector coded alone) keeps an error that was never
    made on the chunks a device did not send raw and drops the partial sums' errors; on the
    char-level model of ``benchmarks/quality.py`` that cost held-out loss
    (docs/notes/2026-12-05-benchmarks-until-0.2.md, "Training quality"). For recursive doubling
    ``sent`` is ``x`` decoded as first encoded (the first exchange's error; the partial sums' errors
    are shared by the partners and fed back by none). With ``N = 1`` nothing is sent or compressed:
    ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      rate: static int in ``[1, 32]``, ZFP bits per value on the wire.
      axis_name: the mesh axis to sum over.
      algorithm: ``"ring"`` or ``"recursive_doubling"``.

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (sums in float32). Under ``check_vma=True`` the
      ring's ``total`` is typed invariant; recursive doubling's is typed varying (it comes from
      ``ppermute``) although its value is the same on every device.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.zfp_allreduce(x, 16, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> bool(jnp.allclose(f(jnp.arange(8.0)), jnp.array([4.0, 6.0, 8.0, 10.0]), atol=1e-2))
      True

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C..F and
      Alg. 1-2; Lindstrom, IEEE TVCG 2014 (zfp fixed-rate mode).
    """
    x = local_vector(x)
    rate = _checks.check_rate(rate)
    algorithm = check_choice(algorithm, "algorithm", ZFP_ALGORITHMS)
    n_devices = axis_size(axis_name)
    if n_devices == 1:
        return one_device_total(x, axis_name), x
    values = x.astype(jnp.float32)
    if algorithm == "ring":
        total, sent = _zfp_ring(values, rate, axis_name, n_devices)
    else:
        total, sent = _zfp_recursive_doubling(values, rate, axis_name, n_devices)
    return total.astype(x.dtype), sent.astype(x.dtype)


def _zfp_ring(values, rate, axis_name, n_devices, scatter=False):
    """The ZFP ring: ``(total, sent)``; with ``scatter``, only its reduce-scatter phase, arranged so
    that device ``d`` ends owning chunk ``d``, and ``total`` is that chunk, exactly as reduced
    (not coded again: no all-gather follows). The all-reduce's device ``d`` owns chunk ``d + 1``."""
    return ring_allreduce(
        values,
        axis_name,
        n_devices,
        zfp_codec(rate),
        own=0 if scatter else 1,
        scatter=scatter,
        code_owned=not scatter,
    )


def _zfp_recursive_doubling(values, rate, axis_name, n_devices):
    n = values.shape[0]
    me = jax.lax.axis_index(axis_name)
    p = sizes.power_of_two_below(n_devices)
    extra = n_devices - p
    # Devices 2i (i < extra) fold into 2i + 1; the p remaining devices are renumbered 0..p-1.
    folded = (me < 2 * extra) & (me % 2 == 0)

    def device(rank):
        return 2 * rank + 1 if rank < extra else rank + extra

    own_words = zfp_encode(values, rate)
    partial = values
    if extra:
        received = jax.lax.ppermute(
            own_words, axis_name, [(2 * i, 2 * i + 1) for i in range(extra)]
        )
        partner = (me < 2 * extra) & (me % 2 == 1)
        partial = jnp.where(partner, values + zfp_decode(received, n, rate), values)
    distance = 1
    while distance < p:
        words = zfp_encode(partial, rate)
        received = jax.lax.ppermute(
            words, axis_name, [(device(r), device(r ^ distance)) for r in range(p)]
        )
        both = zfp_decode(jnp.stack([words, received]), n, rate)
        partial = both[0] + both[1]
        distance *= 2
    if extra:
        words = zfp_encode(partial, rate)
        received = jax.lax.ppermute(words, axis_name, [(2 * i + 1, 2 * i) for i in range(extra)])
        partial = zfp_decode(jnp.where(folded, received, words), n, rate)
    return partial, zfp_decode(own_words, n, rate)


def zfp_reduce_scatter(x, rate, axis_name):
    """The reduce-scatter phase of :func:`zfp_allreduce`'s ring: device ``d`` gets chunk ``d`` of
    the sum.

    ``x`` (``N`` chunks of ``n / N`` values) goes round the ring in ``N - 1`` hops; each hop sends
    one chunk ZFP-coded at ``rate`` bits a value, the receiver decodes it and adds its own chunk.
    After the last hop device ``d`` holds chunk ``d`` fully reduced, which it keeps as it is: no
    all-gather follows, so it is not coded again (one coding error fewer than the all-reduce).

    ``sent``: ``x`` less every coding error this device made (each chunk but its own is coded once
    by it), so the ``sent`` of all devices add up to the sum (up to float32 rounding) and error
    feedback keeps all the ring lost. With ``N = 1``: ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector, ``N`` chunks of equal length.
      rate: static int in ``[1, 32]``, ZFP bits per value on the wire.
      axis_name: the mesh axis to sum over.

    Returns:
      ``(shard, sent)``: chunk ``d`` of the sum (``n / N`` values) and ``x``'s ``sent``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.zfp_reduce_scatter(x, 16, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> bool(jnp.allclose(f(jnp.arange(8.0)), jnp.array([4.0, 6.0, 8.0, 10.0]), atol=1e-2))
      True

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C (the ring's
      reduce-scatter); Rajbhandari et al., ZeRO, SC 2020 (gradient partitioning).
    """
    x = local_vector(x)
    rate = _checks.check_rate(rate)
    n_devices = check_rows(x.shape[0], axis_name)
    if n_devices == 1:
        return x, x
    shard, sent = _zfp_ring(x.astype(jnp.float32), rate, axis_name, n_devices, scatter=True)
    return shard.astype(x.dtype), sent.astype(x.dtype)
