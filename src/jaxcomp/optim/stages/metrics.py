"""Stage 7, the metrics: compression gain, bytes, density, the method that ran, non-finite count.

The gain's two sums and the non-finite count travel in one psum of three scalars, so a
compressing method pays one small collective for all of them.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.costmodel import ratio_choice
from jaxcomp.optim.state import CompressMetrics


def gain_and_nonfinite(result, feds, count, axis_name):
    """The compression gain ``sum_d ||sent_d||^2 / sum_d ||g_e,d||^2`` and the non-finite count,
    both summed over the devices.

    Args:
      result: the step's :class:`~jaxcomp.optim.stages.aggregation.Aggregation`.
      feds: per group, this device's error-fed vector.
      count: this device's non-finite entries.
      axis_name: the axis or axes to sum over.

    Returns:
      ``(gain, count)``: float32 scalars, identical on every device; the gain is 1 when nothing
      can be lost, NaN or Inf when a sum overflowed.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.optim.stages.aggregation import Aggregation
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(x):
      ...     result = Aggregation([x], [x * jnp.array([1.0, 0.0])], 0.0, 1, 0, False, False)
      ...     return gain_and_nonfinite(result, [x], jnp.float32(0), "data")
      >>> gain, count = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.ones(4))
      >>> float(gain), float(count)
      (0.5, 0.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (compression gain).
    """
    if result.sends_everything:
        return jnp.ones((), jnp.float32), small.metric_sum(count, axis_name)
    # sum_d ||sent_d||^2, sum_d ||g_e,d||^2 and the non-finite count: one psum of 3 scalars.
    sent_sq = sum(_square(sent[1] if result.sparse else sent) for sent in result.sents)
    fed_sq = sum(_square(fed) for fed in feds)
    sent_sq, fed_sq, count = small.metric_sum(jnp.stack([sent_sq, fed_sq, count]), axis_name)
    # 1 only when there was nothing to send; a sum that overflowed reports NaN or Inf.
    return ratio_choice.gain_from_energies(sent_sq, fed_sq), count


def step_metrics(gain, bytes_sent, kept, method, nonfinite, total_size: int) -> CompressMetrics:
    """The :class:`~jaxcomp.CompressMetrics` of a step.

    Args:
      gain: the compression gain.
      bytes_sent: bytes one device sent, all collectives of the step.
      kept: values whose content was sent.
      method: index of the method that ran.
      nonfinite: non-finite entries, summed over the devices.
      total_size: float values in the gradients.

    Returns:
      A :class:`~jaxcomp.CompressMetrics` (``density = kept / total_size``).

    Example:
      >>> step_metrics(1.0, 40.0, 5, 0, 0.0, 10).density.tolist()
      0.5

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3.
    """
    return CompressMetrics(
        gain=gain,
        bytes_sent=jnp.asarray(bytes_sent, jnp.float32),
        density=jnp.asarray(kept / total_size, jnp.float32),
        method=jnp.asarray(method, jnp.int32),
        nonfinite=nonfinite,
    )


def _square(values):
    return jnp.sum(jnp.square(values.astype(jnp.float32)))
