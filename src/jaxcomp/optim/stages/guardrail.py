"""The guardrail stage of a :func:`jaxcomp.compress` update: it watches the compressed
training for divergence and, on a trigger, clears the residual and falls back to dense for a
window (:mod:`.divergence` measures and decides; this stage wires it in).

On the way in it declares this device's gradient energy for the aggregation's one psum and
tells the stages inside it whether this step runs the dense fallback; on the way out it reads
the summed energies and the gain, decides the trigger (never on a step the ``nonfinite=``
policy skips) and tells the stages outside it, whose residual and velocity a trigger clears.
Its state is :attr:`jaxcomp.CompressState.divergence`, None where nothing is compressed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxcomp.ops import flat
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.stages.flight import InFlight, Stage, init_nested, wrapped


class GuardrailStageState(NamedTuple):
    """The guardrail stage's state: a :class:`~.divergence.GuardrailState`, or None."""

    divergence: Any
    inner: Any = None


def guardrail_stage(
    inner: Stage, guardrail: divergence.Guardrail, axis_name, falls_back: bool, watches
) -> Stage:
    """The divergence guardrail around ``inner``.

    Args:
      inner: the stage it wraps.
      guardrail: the :class:`jaxcomp.Guardrail`.
      axis_name: the axis or axes of the devices (the callback's first device tells).
      falls_back: a trigger starts the dense fallback (else it clears the residual and rests).
      watches: ``params -> bool``: whether anything is compressed (else no state, no watch).

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with a :class:`GuardrailStageState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> int(jaxcomp.compress("allgather_topk", ratio=0.5).init(jnp.zeros(4)).divergence.fallbacks)
      0

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3; Karimireddy et al., "Error
      Feedback Fixes SignSGD", ICML 2019 (the residual's bound).
    """

    def init(params):
        return init_nested(stage, params, divergence=divergence.init() if watches(params) else None)

    def update(flight: InFlight, state: GuardrailStageState):
        guarded = state.divergence
        if guarded is None or flight.alone is not None:
            return wrapped(inner, flight, state)
        flight = flight._replace(
            gradient=_gradient_energy(flight),
            fallback=divergence.falling_back(guarded) if falls_back else None,
        )
        flight, state = wrapped(inner, flight, state)
        trigger = divergence.triggered(guardrail, guarded, *flight.energies, flight.gain)
        if flight.skipped is not None:
            trigger = trigger & ~flight.skipped
        if guardrail.callback:  # else the host hears of it from the state (tell_trigger)
            _report(guardrail, flight, guarded, trigger, axis_name, falls_back)
        advanced = divergence.advance(guardrail, guarded, trigger, *flight.energies, flight.gain)
        fallback = trigger | divergence.falling_back(guarded)
        flight = flight._replace(trigger=trigger, fallbacks=(fallback, advanced.fallbacks))
        return flight, state._replace(divergence=advanced)

    stage = Stage(init, update, GuardrailStageState, inner)
    return stage


def _report(guardrail, flight: InFlight, guarded, trigger, axis_name, falls_back: bool):
    """``Guardrail(callback=True)``: the host hears of a trigger from inside the step."""
    lossy = [m.describe() for m in flight.record.methods if not m.sends_everything]
    divergence.report(
        trigger,
        flight.step,
        flight.energies.gradient,
        guarded.mean,
        divergence.window_length(guardrail, guarded)[0],
        axis_name,
        "/".join(lossy),
        falls_back,
    )


def _gradient_energy(flight: InFlight):
    """This device's energy of the compressed leaves' finite gradient values: from the one-pass
    packing where every group had it, else summed here (one more read)."""
    packs = flight.packs
    if packs and all(p is not None for p in packs):
        return sum(p.gradient for p in packs)
    grads = flight.grads
    return sum(flat.finite_energy(grads.leaves[i]) for i in sorted(grads.layout.compressed))
