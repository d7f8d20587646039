"""Scaled signs at the collective level: every device's packed signs and scales all-gathered, and
decoded and added device by device (EF-SignSGD), or turned into signSGD's majority vote.

The codec is :mod:`jaxcomp.ops.sign`; the method, with its all-reduce variant, is
:class:`jaxcomp.methods.Sign`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives._common import axis_size, local_vector
from jaxcomp.ops.sign import check_chunk, sign_pack, sign_unpack, sign_unpack_sum


def gathered_sign_sum(all_words, all_scales, n: int, chunk: int, majority: bool):
    """The aggregate of every device's packed signs and scales, as the all-gather delivers them.

    Devices are added one after another, so the order is fixed; the sum is one native pass on the
    CPU (:func:`jaxcomp.ops.sign.sign_unpack_sum`), and no more than one decoded vector is live
    at a time elsewhere.

    Args:
      all_words: uint32 ``[N, ceil(n / 32)]``, each device's packed signs.
      all_scales: float32 ``[N, ceil(n / chunk)]``, each device's scales.
      n: values per vector.
      chunk: values per scale.
      majority: signSGD's majority vote: the sign of the sum of the devices' signs (0 where they
        tie) times the sum of their scales, chunk by chunk; else the sum of the decoded vectors.

    Returns:
      float32 ``[n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops.sign import sign_pack
      >>> words, scales = sign_pack(jnp.array([1.0, -3.0]), 2)  # scale 2: decodes to [2, -2]
      >>> two = lambda a: jnp.stack([a, a])
      >>> gathered_sign_sum(two(words), two(scales), 2, 2, majority=False).tolist()
      [4.0, -4.0]

    References:
      Karimireddy et al., ICML 2019 (EF-SignSGD); Bernstein et al., ICLR 2019 (majority vote).
    """
    if not majority:  # one native pass on the CPU, the loop elsewhere
        return sign_unpack_sum(all_words, all_scales, n, chunk)

    ones = jnp.ones(all_scales.shape[1:], jnp.float32)

    def vote(d, carry):
        votes, scales = carry  # votes: sums of +-1, exact in float32 up to 2^24 devices
        return votes + sign_unpack(all_words[d], ones, n, chunk), scales + all_scales[d]

    votes, scales = jax.lax.fori_loop(
        0, all_words.shape[0], vote, (jnp.zeros(n, jnp.float32), jnp.zeros_like(ones))
    )
    plus = jnp.repeat(scales, chunk, total_repeat_length=scales.shape[0] * chunk)[:n]
    return jnp.sign(votes) * plus


def sign_allgather(x, chunk, axis_name, *, majority=False):
    """Scaled signs aggregated by all-gathering every device's packed signs and scales.

    Each device packs ``x`` into 1 bit a value and one float32 scale (the mean ``|x|``) per
    ``chunk`` values (:func:`jaxcomp.sign_pack`); an all-gather delivers every device's words and
    scales to every device, which decodes and adds them (:func:`gathered_sign_sum`).

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      chunk: static int ``>= 1``, values per scale.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      majority: signSGD's majority vote instead of the sum (see :func:`gathered_sign_sum`).

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (computed in float32): ``total`` is typed
      invariant; ``sent`` is this device's decoded signs (so ``x - sent`` is what the signs
      lost), or with ``majority`` its share ``total / N`` of the vote.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.sign_allgather(x, 2, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, -3.0, 1.0, 1.0])).tolist()  # devices send [2, -2] and [1, 1]
      [3.0, -1.0]

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019; Bernstein et al., "signSGD with Majority Vote is Communication Efficient and
      Fault Tolerant", ICLR 2019.
    """
    x = local_vector(x)
    chunk = check_chunk(chunk)
    axis_size(axis_name)
    n = x.shape[0]
    words, scales = sign_pack(x, chunk)
    all_words = jax.lax.all_gather(words, axis_name, to="invarying")
    all_scales = jax.lax.all_gather(scales, axis_name, to="invarying")
    total = gathered_sign_sum(all_words, all_scales, n, chunk, majority)
    if majority:
        sent = total / all_words.shape[0]
    else:
        sent = sign_unpack(words, scales, n, chunk)
    return total.astype(x.dtype), sent.astype(x.dtype)
