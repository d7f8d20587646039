"""Stage 7, the metrics: compression gain, bytes, density, the method that ran, non-finite count.

The gain's sums and the non-finite counts travel in one psum of a few scalars, so a compressing
method pays one small collective for all of them (a method that sends everything: a psum of two).
The energies never overflow: a device whose sum of squares would exceed
:data:`~jaxcomp.costmodel.ratio_choice.PLAIN_ENERGY_LIMIT` (a gradient of ``1e20``, or a value
that overflowed) sums them scaled instead, and only then looks for non-finite entries of its
next residual; the others pay nothing for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import flat
from jaxcomp.optim.state import CompressMetrics


def gain_and_nonfinite(result, feds, count, axis_name, remainings=(), overflowed=0.0, copies=1):
    """The compression gain ``sum_d ||sent_d||^2 / sum_d ||g_e,d||^2`` and the non-finite count,
    both summed over the devices.

    The count adds up the non-finite gradient entries (``count``), the non-finite entries of each
    device's next residual ``g_e - sent`` (its own values overflowed: ``g + residual``, a 16-bit
    cast, a codec), and the non-finite total entries (``overflowed``: the sum over the devices
    overflowed; each counted once, although ``copies`` devices hold it).

    Args:
      result: the step's :class:`~jaxcomp.optim.stages.aggregation.Aggregation`.
      feds: per group, this device's error-fed vector.
      count: this device's non-finite gradient entries.
      axis_name: the axis or axes to sum over.
      remainings: per group, this device's ``g_e - sent`` (empty: none kept).
      overflowed: this device's count of non-finite total entries
        (:func:`~jaxcomp.optim.stages.guard.finite_totals`).
      copies: the devices holding each total entry
        (:func:`~jaxcomp.optim.stages.guard.total_copies`).

    Returns:
      ``(gain, count)``: float32 scalars, identical on every device; the gain is 1 when nothing
      can be lost, and finite for every finite gradient (non-finite entries count as 0 in it).

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
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (compression gain); Micikevicius et al., "Mixed
      Precision Training", ICLR 2018, §3.2 (overflow).
    """
    counts = jnp.stack([jnp.asarray(count, jnp.float32), jnp.asarray(overflowed, jnp.float32)])
    if result.sends_everything:
        counts = small.metric_sum(counts, axis_name)
        return jnp.ones((), jnp.float32), _count(counts[0], counts[1], copies)
    sents = [sent[1] if result.sparse else sent for sent in result.sents]
    # The energies (plain and scaled), this device's non-finite residual entries and the two
    # counts: one psum of 7 scalars.
    summed = small.metric_sum(
        jnp.concatenate([_energies(sents, feds, list(remainings)), counts]), axis_name
    )
    kept, total, kept_scaled, total_scaled = summed[0], summed[1], summed[2], summed[3]
    gain = ratio_choice.gain_from_energies(kept, total, kept_scaled, total_scaled)
    return gain, _count(summed[4] + summed[5], summed[6], copies)


def _count(count, overflowed, copies):
    return count + jnp.round(overflowed / copies)


def _energies(sents, feds, remainings):
    """``[sent, fed, sent scaled, fed scaled, non-finite residual entries]`` of this device.

    The plain energies bound every value (``|x| <= sqrt(energy)``), so while they are at most
    :data:`~jaxcomp.costmodel.ratio_choice.PLAIN_ENERGY_LIMIT` no ``g_e - sent`` can be
    non-finite and nothing more is read; otherwise (rare) the energies are summed scaled, over
    the finite entries, and the residual's non-finite entries counted.
    """
    plain = jnp.stack([_total(_square(x) for x in sents), _total(_square(x) for x in feds)])

    def small_values(operands):
        return jnp.concatenate([plain, jnp.zeros(3, jnp.float32)])

    def large_values(operands):
        sents, feds, remainings = operands
        return jnp.stack(
            [
                jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32),
                _total(ratio_choice.scaled_energy(x) for x in sents),
                _total(ratio_choice.scaled_energy(x) for x in feds),
                _total(flat.count_nonfinite(r) for r in remainings),
            ]
        )

    fits = jnp.all(plain <= ratio_choice.PLAIN_ENERGY_LIMIT)  # False for NaN too
    return jax.lax.cond(fits, small_values, large_values, (sents, feds, remainings))


def _total(scalars):
    return sum(scalars, jnp.zeros((), jnp.float32))


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
