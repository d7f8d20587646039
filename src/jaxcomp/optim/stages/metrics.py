"""The metrics stage: compression gain, bytes, density, the method that ran, non-finite count.

The gain's sums and the non-finite counts travel in one psum of a few scalars, so a compressing
method pays one small collective for all of them (a method that sends everything: a psum of two).
The energies never overflow: a device whose sum of squares would exceed
:data:`~jaxcomp.costmodel.ratio_choice.PLAIN_ENERGY_LIMIT` (a gradient of ``1e20``, or a value
that overflowed) sums them scaled instead, and only then looks for non-finite entries of its
next residual; the others pay nothing for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import pieces
from jaxcomp.optim.stages.flight import InFlight, Stage, init_nested, wrapped
from jaxcomp.optim.state import CompressMetrics, init_metrics
from jaxcomp.optim.vma import cond_typed_alike


class MetricsState(NamedTuple):
    """The metrics stage's state: the last step's :class:`~jaxcomp.CompressMetrics`."""

    metrics: CompressMetrics
    inner: Any = None


def metrics_stage(inner: Stage) -> Stage:
    """The step's metrics, from what the stages inside it measured and summed.

    Outside the ``nonfinite=`` policy's stage: a skipped step keeps every other state and
    reports what it saw.

    Args:
      inner: the stage it wraps.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with a :class:`MetricsState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> jaxcomp.compress(jaxcomp.Dense()).init(jnp.zeros(3)).metrics.gain.tolist()
      0.0

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3.
    """

    def update(flight: InFlight, state: MetricsState):
        flight, state = wrapped(inner, flight, state)
        grads, result = flight.grads, flight.result
        plain_bytes, plain_kept = flight.plain
        measured = step_metrics(
            flight.gain,
            result.bytes_sent + plain_bytes,
            result.kept + plain_kept,
            result.method,
            flight.nonfinite,
            sum(grads.leaves[i].size for i in grads.layout.floats),
            *flight.fallbacks,
        )
        return flight, state._replace(metrics=measured)

    stage = Stage(
        lambda params: init_nested(stage, params, metrics=init_metrics()),
        update,
        MetricsState,
        inner,
    )
    return stage


def gain_and_nonfinite(result, feds, count, axis_name, check_totals=None, comm_dtype=jnp.float32):
    """The compression gain ``sum_d ||sent_d||^2 / sum_d ||g_e,d||^2`` and the non-finite count,
    both summed over the devices.

    The count adds up the non-finite gradient entries (``count``), the non-finite entries of each
    device's error-fed vector and of what it sent (its own values overflowed: ``g + residual``, a
    16-bit cast, a codec), and the non-finite total entries (the sum over the devices overflowed,
    each counted once). The energies bound the totals (``|total_i| <= N sqrt(sum_d
    ||sent_d||^2)``), so the totals are only read (``check_totals``) on the rare step whose
    summed energy could reach ``comm_dtype``'s largest value; every device takes the same branch
    (it is decided on the summed energies).

    Args:
      result: the step's :class:`~jaxcomp.optim.stages.aggregation.Aggregation`.
      feds: per group, this device's error-fed vector.
      count: this device's non-finite gradient entries.
      axis_name: the axis or axes to sum over.
      check_totals: ``() -> count`` of the non-finite total entries, already agreed over the
        devices, or None (nothing to check).
      comm_dtype: the dtype the totals are in.

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
      >>> f = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> gain, count = f(jnp.ones(4))
      >>> float(gain), float(count)
      (0.5, 0.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (compression gain); Micikevicius et al., "Mixed
      Precision Training", ICLR 2018, §3.2 (overflow).
    """
    gain, count, _ = summed_metrics(result, feds, count, axis_name, check_totals, comm_dtype)
    return gain, count


class Energies(NamedTuple):
    """The energies the guardrail reads (:mod:`.divergence`), summed over the devices."""

    gradient: jax.Array  # f32[]: sum_d ||g_d||^2 (the finite entries), 0 when not asked for
    fed: jax.Array  # f32[]: sum_d ||g_e,d||^2; inf when a device's exceeded the plain limit


def summed_metrics(
    result,
    feds,
    count,
    axis_name,
    check_totals=None,
    comm_dtype=jnp.float32,
    gradient=None,
    fed_energies=None,
):
    """:func:`gain_and_nonfinite`, with the energies the guardrail needs: ``gradient`` (this
    device's gradient energy) rides in the same psum, one scalar more.

    Args:
      result: the step's :class:`~jaxcomp.optim.stages.aggregation.Aggregation`.
      feds: per group, this device's error-fed vector.
      count: this device's non-finite gradient entries.
      axis_name: the axis or axes to sum over.
      check_totals: as for :func:`gain_and_nonfinite`.
      comm_dtype: the dtype the totals are in.
      gradient: this device's gradient energy (float32 scalar), or None (not summed).
      fed_energies: per group, :func:`jaxcomp.ops.flat.energies` of its fed vector when the
        packing already summed them (:func:`jaxcomp.ops.flat.pack_error_fed`), else None (then
        they are summed here, one more read of the vector).

    Returns:
      ``(gain, count, energies)``: :func:`gain_and_nonfinite`'s two and an :class:`Energies`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.optim.stages.aggregation import Aggregation
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(x):
      ...     result = Aggregation([x], [x * jnp.array([1.0, 0.0])], 0.0, 1, 0, False, False)
      ...     _, _, e = summed_metrics(result, [x], jnp.float32(0), "data", gradient=x.sum())
      ...     return e.gradient, e.fed
      >>> f = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> [float(e) for e in f(jnp.ones(4))]
      [4.0, 4.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3; Karimireddy et al., "Error Feedback Fixes
      SignSGD", ICML 2019 (the residual's bound).
    """
    count = jnp.asarray(count, jnp.float32)
    if result.sends_everything:
        summed = small.metric_sum(count, axis_name)
        checked = check_totals() if check_totals is not None else 0.0
        zero = jnp.zeros((), jnp.float32)
        return jnp.ones((), jnp.float32), jnp.round(summed) + checked, Energies(zero, zero)
    # A cast sent every value rounded: its gain is 1 to the rounding, and its sents are not read
    # (never built without error feedback). The check below bounds the totals by the fed
    # vectors' energies then: a rounding moves a value by at most 2**-8 of it, well inside the
    # bound's factor of 4.
    sents = None if result.rounds_only else result.sents
    sents = sents and [sent[1] if result.sparse else sent for sent in sents]
    # The energies (plain and scaled), this device's own non-finite entries and the gradients'
    # count (and the gradient's energy): one psum of 6 (7) scalars.
    parts = [_energies(sents, feds, fed_energies), count[None]]
    if gradient is not None:
        parts.append(jnp.asarray(gradient, jnp.float32)[None])
    summed = small.metric_sum(jnp.concatenate(parts), axis_name)
    kept, total, kept_scaled, total_scaled = summed[0], summed[1], summed[2], summed[3]
    gain = ratio_choice.gain_from_energies(kept, total, kept_scaled, total_scaled)
    count = jnp.round(summed[4] + summed[5])
    energies = Energies(
        summed[6] if gradient is not None else jnp.zeros((), jnp.float32),
        jnp.where(total_scaled > 0, jnp.inf, total).astype(jnp.float32),
    )
    if check_totals is None:
        return gain, count, energies
    # Every |total_i| <= N max_d ||sent_d|| <= N sqrt(kept): at most a quarter of the largest
    # value while kept <= (largest / 4N)**2 (any finite kept for float32 and bfloat16).
    largest = float(jnp.finfo(comm_dtype).max)
    limit = min((largest / (4.0 * jax.lax.axis_size(axis_name))) ** 2, _F32_MAX)
    safe = jnp.isfinite(kept) & (kept <= limit) & (kept_scaled == 0) & (summed[4] == 0)
    # Typed alike: on a 2-D mesh summed over one axis the count varies over the other.
    overflowed = cond_typed_alike(safe, lambda: jnp.zeros((), jnp.float32), check_totals)
    return gain, count + overflowed, energies


_F32_MAX = float(jnp.finfo(jnp.float32).max)


def _energies(sents, feds, fed_energies=None):
    """``[sent, fed, sent scaled, fed scaled, non-finite entries of sent and fed]`` of this
    device, in one pass over each vector (a variadic reduce); ``sents`` None: what was sent is
    the fed vectors (their energies twice, their non-finite entries once).

    A device whose plain energies exceed
    :data:`~jaxcomp.costmodel.ratio_choice.PLAIN_ENERGY_LIMIT` (or are not finite) reports the
    scaled ones instead, over the finite entries.
    """
    known = fed_energies or [None] * len(feds)
    fed_parts = [_one_pass(x) if e is None else tuple(e) for x, e in zip(feds, known)]
    parts = (fed_parts if sents is None else [_one_pass(x) for x in sents], fed_parts)
    (sent, sent_scaled, sent_bad), (fed, fed_scaled, fed_bad) = (
        [_total(p[i] for p in group) for i in range(3)] for group in parts
    )
    if sents is None:
        sent_bad = jnp.zeros((), jnp.float32)
    fits = (sent <= ratio_choice.PLAIN_ENERGY_LIMIT) & (fed <= ratio_choice.PLAIN_ENERGY_LIMIT)
    zero = jnp.zeros((), jnp.float32)
    return jnp.stack(
        [
            jnp.where(fits, sent, zero),
            jnp.where(fits, fed, zero),
            jnp.where(fits, zero, sent_scaled),
            jnp.where(fits, zero, fed_scaled),
            sent_bad + fed_bad,
        ]
    )


def _one_pass(values):
    """``(sum x^2, sum over finite x of (x * ENERGY_SCALE)^2, non-finite entries)``."""
    return tuple(pieces.energies(values, ratio_choice.ENERGY_SCALE))


def _total(scalars):
    return sum(scalars, jnp.zeros((), jnp.float32))


def step_metrics(
    gain, bytes_sent, kept, method, nonfinite, total_size: int, fallback=0.0, fallbacks=0.0
) -> CompressMetrics:
    """The :class:`~jaxcomp.CompressMetrics` of a step.

    Args:
      gain: the compression gain.
      bytes_sent: bytes one device sent, all collectives of the step.
      kept: values whose content was sent.
      method: index of the method that ran.
      nonfinite: non-finite entries, summed over the devices.
      total_size: float values in the gradients.
      fallback: 1 on a step the guardrail triggered or fell back on, else 0.
      fallbacks: the guardrail's triggers so far.

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
        fallback=jnp.asarray(fallback, jnp.float32),
        fallbacks=jnp.asarray(fallbacks, jnp.float32),
    )
