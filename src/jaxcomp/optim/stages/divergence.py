"""The guardrail stage: training that diverges because of compression falls back to dense.

Each step it reads two energies the metrics stage's psum already sums over the devices
(:mod:`.metrics`): ``G = sum_d ||g_d||^2``, the gradients' (finite entries, before the
residual), and ``F = sum_d ||g_e,d||^2``, the error-fed one, with the step's compression gain.
A step is *suspect* when (a) ``G > factor**2 * mean`` (``mean`` a
running mean of ``G`` that a sample pulls at most :data:`FOLLOW` times its value) or (b)
``F * gain**2 > (2 * factor)**2 * mean`` (a residual past error feedback's own bound), with
limits :data:`BURN_IN_SLACK` times looser during the ``burn_in`` steps; it triggers after
``patience`` suspect steps in a row, or at once when (c) ``G`` or ``F`` is not finite.

The triggering step sends no update and clears the residual and DGC's velocity; the next
``window`` steps aggregate with the dense branch (the warm-up's switch, :mod:`.warmup`), or, for
a method that cannot switch inside a compiled step, rest. The host hears of a trigger from the
finished step's state (:func:`tell_trigger`) or, with ``Guardrail(callback=True)``, from a
``jax.debug.callback``. docs/training.md, "Guardrails", explains each choice and its cost.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.methods import Method
from jaxcomp.ops import _checks
from jaxcomp.optim import host

#: How far one step's gradient energy can pull the running mean: a sample counts as at most this
#: many times the mean (``G`` above it counts as ``FOLLOW * mean``).
FOLLOW = 2.0

#: During the burn-in the limits are this many times looser (an energy 100 times the mean of
#: the steps seen so far at the default ``factor``): the guardrail watches from the first step,
#: and the early steps of a healthy run, whose scale is still settling, do not trigger it.
BURN_IN_SLACK = 4.0

#: A window doubles for each trigger in a row, at most this many times (``window * 32``).
MAX_DOUBLINGS = 5

_LOG = logging.getLogger("jaxcomp")


@dataclasses.dataclass(frozen=True)
class Guardrail:
    """When :func:`jaxcomp.compress` falls back to dense because training diverges.

    See :mod:`jaxcomp.optim.stages.divergence` for what is measured and what it costs.

    Args:
      factor: trigger when the gradient norm exceeds ``factor`` times its running RMS (default
        5, ``> 1``); the residual's bound scales with it too.
      window: dense steps after a trigger before the method runs again (default 50, ``>= 1``).
      burn_in: steps whose plain mean starts the running mean (default 20, ``>= 1``); during
        them the limits are :data:`BURN_IN_SLACK` times looser.
      decay: the running mean's decay per step (default 0.98, in ``(0, 1)``).
      dense_fallback: whether a trigger switches to dense for the window (True) or only clears
        the residual and pauses the detector (False). Default None: dense, except for the
        sparse methods (:class:`jaxcomp.TopK`, :class:`jaxcomp.RandomK`), whose residual is
        updated in place at the sent indices; a dense branch beside them needs a dense ``sent``
        instead, which made their CPU step markedly slower (docs/training.md, "Guardrails").
      callback: whether the compiled step itself tells the host of a trigger (a
        ``jax.debug.callback`` in the triggered branch; default False). A host callback anywhere in
        a jitted function takes every call of it off jit's fast C++ dispatch, onto Python's, which
        costs time per array argument on every step, a lot for a model of many leaves
        (docs/training.md, "Guardrails"). Without it :func:`jaxcomp.data_parallel` tells the host
        from the finished steps' states (:func:`tell_trigger`); in a loop of your own, read the
        ``fallbacks`` metric, or pass ``callback=True``.
      patience: suspect steps in a row that trigger (default 2, ``>= 1``): a single outlier
        step (one batch whose gradient is far above the running RMS) is trained on as dense
        would; a non-finite statistic triggers at once.

    Example:
      >>> Guardrail(factor=5.0).window
      50

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (dense warm-up); Karimireddy et
      al., "Error Feedback Fixes SignSGD", ICML 2019, Thm. II (the residual's bound).
    """

    factor: float = 5.0
    window: int = 50
    burn_in: int = 20
    decay: float = 0.98
    dense_fallback: bool | None = None
    callback: bool = False
    patience: int = 2  # last: a positional Guardrail(...) of before keeps its meaning

    def __post_init__(self):
        if not isinstance(self.callback, bool):
            raise TypeError(f"Guardrail callback must be True or False, got {self.callback!r}")
        if self.dense_fallback not in (None, True, False):
            raise TypeError(
                f"Guardrail dense_fallback must be None, True or False, got {self.dense_fallback!r}"
            )
        for name in ("factor", "decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
                raise TypeError(f"Guardrail {name} must be a number, got {value!r}")
        if not 1.0 < self.factor < 1e9:
            raise ValueError(f"Guardrail factor must be in (1, 1e9), got {self.factor!r}")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"Guardrail decay must be in (0, 1), got {self.decay!r}")
        object.__setattr__(self, "factor", float(self.factor))
        object.__setattr__(self, "decay", float(self.decay))
        object.__setattr__(self, "window", _checks.static_int(self.window, "window", 1))
        object.__setattr__(self, "burn_in", _checks.static_int(self.burn_in, "burn_in", 1))
        object.__setattr__(self, "patience", _checks.static_int(self.patience, "patience", 1))


class GuardrailState(NamedTuple):
    """The guardrail's state in :attr:`jaxcomp.CompressState.divergence` (replicated)."""

    mean: jax.Array  # f32[]: running mean of the gradients' energy G (0 before the first step)
    seen: jax.Array  # i32[]: steps whose G went into the mean
    left: jax.Array  # i32[]: fallback (or cool-down) steps left; 0 when the method runs
    fallbacks: jax.Array  # i32[]: triggers so far
    streak: jax.Array  # i32[]: triggers in a row (each doubles the window)
    calm: jax.Array  # i32[]: steps the method ran since the last window ended
    suspect: jax.Array  # i32[]: suspect steps in a row that have not triggered (yet)


def check(guardrail) -> Guardrail | None:
    """The ``guardrail=`` argument as a :class:`Guardrail`, or None when it is off.

    Args:
      guardrail: True (the defaults), False or None (off), or a :class:`Guardrail`.

    Returns:
      A :class:`Guardrail` or None; raises a TypeError naming ``guardrail`` otherwise.

    Example:
      >>> check(True) == Guardrail(), check(False)
      (True, None)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    if guardrail is True or isinstance(guardrail, np.bool_) and guardrail:
        return Guardrail()
    if guardrail is None or guardrail is False or isinstance(guardrail, np.bool_):
        return None
    if not isinstance(guardrail, Guardrail):
        raise TypeError(
            f"guardrail must be True, False or a jaxcomp.Guardrail(factor=, window=, burn_in=, "
            f"decay=), got {guardrail!r}"
        )
    return guardrail


def can_fall_back(method: Method, guardrail: Guardrail | None = None) -> bool:
    """Whether a fallback switches ``method`` to dense inside one compiled step.

    Args:
      method: the :mod:`jaxcomp.methods` object.
      guardrail: the :class:`Guardrail` (its ``dense_fallback``), or None for the defaults.

    Returns:
      True when its total comes out replicated, it loses something (dense has nothing to fall
      back from), and ``dense_fallback`` is True, or None and the method is not sparse.

    Example:
      >>> from jaxcomp.methods import Quantized, TopK, Zfp
      >>> can_fall_back(Quantized(4)), can_fall_back(Zfp(8, algorithm="recursive_doubling"))
      (True, False)
      >>> can_fall_back(TopK(0.1)), can_fall_back(TopK(0.1), Guardrail(dense_fallback=True))
      (False, True)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    chosen = None if guardrail is None else guardrail.dense_fallback
    wanted = not method.sparse if chosen is None else chosen
    return wanted and method.replicated_total and not method.sends_everything


def init() -> GuardrailState:
    """The guardrail's state before the first step.

    Returns:
      A :class:`GuardrailState` of zeros.

    Example:
      >>> int(init().fallbacks)
      0

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    zero = jnp.zeros((), jnp.int32)
    return GuardrailState(jnp.zeros((), jnp.float32), zero, zero, zero, zero, zero, zero)


def falling_back(state: GuardrailState | None):
    """Whether this step runs the dense fallback (a replicated boolean), or None without a
    guardrail.

    Args:
      state: the :class:`GuardrailState`, or None.

    Returns:
      ``state.left > 0`` or None.

    Example:
      >>> bool(falling_back(init()._replace(left=jnp.int32(3))))
      True

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    return None if state is None else state.left > 0


def suspect(guardrail: Guardrail, state: GuardrailState, gradient, fed, gain):
    """Whether this step is suspect: (a) or (b) of the module docstring (or (c)), after the
    burn-in and outside a fallback window (a replicated boolean).

    Args:
      guardrail: the :class:`Guardrail`.
      state: the state before the step.
      gradient: ``G``, the gradients' energy summed over the devices.
      fed: ``F``, the error-fed energy summed over the devices (inf when it overflowed).
      gain: the step's compression gain.

    Returns:
      A boolean scalar.

    Example:
      >>> state = init()._replace(mean=jnp.float32(1.0), seen=jnp.int32(50))
      >>> g = Guardrail()
      >>> bool(suspect(g, state, 24.0, 1.0, 1.0)), bool(suspect(g, state, 26.0, 1.0, 1.0))
      (False, True)

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019, Thm. II (the residual's
      bound ``2 / gain``).
    """
    warming = state.seen < guardrail.burn_in  # the mean of a few steps: a looser limit
    limit = jnp.where(warming, BURN_IN_SLACK, 1.0) * guardrail.factor**2 * state.mean
    blown_up = ~(gradient <= limit)  # NaN and inf too
    runaway = ~(fed * jnp.square(gain) <= 4.0 * limit)
    ready = (state.seen > 0) & (state.left == 0)
    return ready & (blown_up | runaway)


def triggered(guardrail: Guardrail, state: GuardrailState, gradient, fed, gain):
    """Whether this step triggers the fallback (a replicated boolean): the ``patience``-th
    :func:`suspect` step in a row, or a suspect step whose ``G`` or ``F`` is not finite.

    Args:
      guardrail, state, gradient, fed, gain: as for :func:`suspect`.

    Returns:
      A boolean scalar.

    Example:
      >>> state = init()._replace(mean=jnp.float32(1.0), seen=jnp.int32(50))
      >>> g = Guardrail()  # patience 2
      >>> bool(triggered(g, state, 26.0, 1.0, 1.0))  # the first suspect step
      False
      >>> bool(triggered(g, state._replace(suspect=jnp.int32(1)), 26.0, 1.0, 1.0))
      True
      >>> bool(triggered(g, state, jnp.inf, 1.0, 1.0))  # (c): at once
      True

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019, Thm. II.
    """
    overflowed = ~jnp.isfinite(gradient) | ~jnp.isfinite(fed)
    persists = state.suspect + 1 >= guardrail.patience
    return suspect(guardrail, state, gradient, fed, gain) & (persists | overflowed)


def window_length(guardrail: Guardrail, state: GuardrailState):
    """The length of the window a trigger now starts: ``window``, doubled for each trigger in a
    row (one that comes less than ``4 * window`` method steps after the last window ended), at
    most :data:`MAX_DOUBLINGS` times; and the new streak.

    Args:
      guardrail: the :class:`Guardrail`.
      state: the state before the step.

    Returns:
      ``(length, streak)``: int32 scalars.

    Example:
      >>> state = init()._replace(fallbacks=jnp.int32(1), streak=jnp.int32(1))
      >>> [int(x) for x in window_length(Guardrail(window=10), state)]
      [20, 2]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    again = (state.fallbacks > 0) & (state.calm < 4 * guardrail.window)
    streak = jnp.where(again, state.streak + 1, 1).astype(jnp.int32)
    doublings = jnp.minimum(streak - 1, MAX_DOUBLINGS)
    return (guardrail.window * jnp.left_shift(1, doublings)).astype(jnp.int32), streak


def advance(
    guardrail: Guardrail, state: GuardrailState, trigger, gradient, fed, gain
) -> GuardrailState:
    """The state after a step: the running mean takes ``G`` in (not a triggering step's; during a
    window it may only come down, as the model recovers), the window counts down or starts, the
    suspect steps in a row are counted (and start again from 0 on a trigger).

    Args:
      guardrail: the :class:`Guardrail`.
      state: the state before the step.
      trigger: :func:`triggered`'s result.
      gradient: ``G`` of the step.
      fed: ``F`` of the step.
      gain: the step's compression gain.

    Returns:
      The new :class:`GuardrailState`.

    Example:
      >>> state = advance(Guardrail(), init(), jnp.bool_(False), jnp.float32(4.0), 4.0, 1.0)
      >>> float(state.mean), int(state.seen)
      (4.0, 1)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    suspicious = suspect(guardrail, state, gradient, fed, gain)
    seen = state.seen.astype(jnp.float32)
    finite = jnp.isfinite(gradient)
    sample = jnp.where(finite, gradient, state.mean)
    averaged = state.mean + (sample - state.mean) / (seen + 1.0)  # the burn-in: a plain mean
    ceiling = jnp.where(state.left > 0, 1.0, FOLLOW) * state.mean
    smoothed = guardrail.decay * state.mean + (1.0 - guardrail.decay) * jnp.minimum(sample, ceiling)
    mean = jnp.where(state.seen < guardrail.burn_in, averaged, smoothed)
    take = ~trigger & finite
    length, streak = window_length(guardrail, state)
    return GuardrailState(
        mean=jnp.where(take, mean, state.mean).astype(jnp.float32),
        seen=state.seen + take.astype(jnp.int32),
        left=jnp.where(trigger, length, jnp.maximum(state.left - 1, 0)).astype(jnp.int32),
        fallbacks=state.fallbacks + trigger.astype(jnp.int32),
        streak=jnp.where(trigger, streak, state.streak).astype(jnp.int32),
        calm=jnp.where(trigger | (state.left > 0), 0, state.calm + 1).astype(jnp.int32),
        suspect=jnp.where(suspicious & ~trigger, state.suspect + 1, 0).astype(jnp.int32),
    )


def report(trigger, step, gradient, mean, window, axis_name, description: str, fallback: bool):
    """Tells the host about a trigger, from inside the compiled step: a callback in the taken
    branch of a ``lax.cond`` only, so a step that does not trigger never waits for the host.

    Args:
      trigger: the replicated flag.
      step: the step counter.
      gradient: ``G`` of the step.
      mean: the running mean before it.
      window: the window's length (:func:`window_length`).
      axis_name: the axis or axes of the devices (inside ``shard_map``): the first one tells.
      description: the method's name.
      fallback: whether it falls back to dense (else the residual is only cleared).

    Returns:
      None.

    Example:
      >>> import numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def quiet(step):
      ...     report(jnp.bool_(False), step, 1.0, 1.0, 50, "data", "randomk(0.01)", True)
      ...     return step
      >>> int(jax.shard_map(quiet, mesh=mesh, in_specs=P(), out_specs=P())(jnp.int32(3)))
      3

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """

    def tell(device, step, gradient, mean, window):
        if int(device) == 0:  # every device calls; the first one tells
            _tell(int(step), float(gradient), float(mean), int(window), description, fallback)

    def call(*operands):
        jax.debug.callback(tell, *operands)

    device = jax.lax.axis_index(axis_name)
    jax.lax.cond(trigger, call, lambda *_: None, device, step, gradient, mean, window)


_WARNED: list = []  # whether this process has warned once


def trigger_probe(before, after):
    """What :func:`tell_trigger` needs to know whether a step triggered the guardrail, taken
    from its compress states as it is dispatched: a few scalars computed with the step, kept
    while it is in flight instead of the whole state. None without a guardrail.

    With ``Guardrail(callback=False)`` (the default) nothing in the compiled step tells the host
    (a host callback would take every call off jit's fast dispatch);
    :func:`jaxcomp.data_parallel` calls this and :func:`tell_trigger` around every step instead.

    Args:
      before: the step's input :class:`jaxcomp.CompressState` (or None).
      after: its output :class:`jaxcomp.CompressState`.

    Returns:
      None, or ``(scalars, description, falls_back)``: ``scalars`` is ``(step, fallbacks
      before, fallbacks after, the running mean square, steps the response lasts)`` as device
      arrays (read only by :func:`tell_trigger`, after the step), ``description`` the lossy
      methods' names joined by ``/`` (what the warning names), ``falls_back`` whether the
      response aggregates densely (else the guardrail only rests; the residual is cleared
      either way).

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("randomk", ratio=0.5).init(jnp.zeros(4))
      >>> tell_trigger(trigger_probe(state, state))  # no new trigger: says nothing

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    guarded = None if after is None else after.divergence
    if guarded is None or before is None or before.divergence is None or after.branches.tells:
        return None  # no guardrail, or it tells the host itself
    lossy = "/".join(m.describe() for m in after.methods if not m.sends_everything)
    scalars = (before.step, before.divergence.fallbacks, guarded.fallbacks, guarded.mean)
    return (*scalars, guarded.left), lossy, after.branches.falls_back


def tell_trigger(probe) -> None:
    """Logs a trigger, as ``Guardrail(callback=True)`` would from inside the step (less the
    gradient norm), from a :func:`trigger_probe` of a step that has run: a warning from logger
    ``"jaxcomp"``, and a ``RuntimeWarning`` once per process.

    Args:
      probe: :func:`trigger_probe`'s result, or None (nothing to tell).

    Returns:
      None.

    Example:
      >>> tell_trigger(None)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    if probe is None:
        return
    (step, before, after, mean, left), description, fallback = probe
    if int(host.scalar(after)) > int(host.scalar(before)):
        _tell(
            int(host.scalar(step)),
            None,
            float(host.scalar(mean)),
            int(host.scalar(left)),
            description,
            fallback,
        )


def _tell(step: int, gradient, mean: float, window: int, description: str, fallback: bool):
    what = (
        f"it aggregates densely for {window} steps"
        if fallback
        else f"the guardrail rests for {window} steps"
    )
    message = (
        f"jaxcomp.compress({description}): training diverges at step {step} ("
        + (f"gradient norm {np.sqrt(gradient):.3g}, " if gradient is not None else "")
        + f"running RMS {np.sqrt(mean):.3g}); the residual is cleared and "
        f"{what} before the method runs again (see the 'fallbacks' metric)"
    )
    _LOG.warning(message)
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
