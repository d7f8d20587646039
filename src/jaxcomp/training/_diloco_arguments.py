"""The arguments of :func:`jaxcomp.diloco`, checked: each function returns the value the run
uses, or raises an error that names the argument."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp.methods import Dense, Method
from jaxcomp.ops import _checks
from jaxcomp.optim.accumulation import every_k_of
from jaxcomp.optim.compression import compress as make_compress
from jaxcomp.optim.muon import refuse_sharded
from jaxcomp.optim.state import compress_states
from jaxcomp.training.inner import DILOCO_SHARD_MODES, EXCHANGE_MODES

#: Streaming DiLoCo's mixing factor alpha for a delayed fragment: local <- a*local + (1-a)*global.
DEFAULT_MIXING = 0.5


def optimizers(loss_fn, inner_tx, outer_tx, donate, schedule):
    """``(inner_tx, outer_tx)``, the paper's where None (with eager rounds, the outer one is
    plain averaging: momentum on an average one round late oscillates); refuses an argument of
    the wrong kind, and an accumulation that does not divide the schedule's ``sync_every``."""
    sync_every, _, _, eager = schedule
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    inner_tx = optax.adamw(4e-4, weight_decay=0.1) if inner_tx is None else inner_tx
    if isinstance(inner_tx, optax.MultiSteps):
        every_k = every_k_of(inner_tx)
        if every_k is not None and isinstance(sync_every, int) and sync_every % every_k:
            raise ValueError(
                f"sync_every={sync_every} must be a multiple of inner_tx's accumulation "
                f"(optax.MultiSteps every_k_schedule={every_k}): sync_every counts micro-steps, "
                "and a sync in the middle of an accumulation would send a partial update"
            )
        inner_tx = inner_tx.gradient_transformation()
    if outer_tx is None:
        outer_tx = optax.sgd(1.0) if eager else optax.sgd(0.7, momentum=0.9, nesterov=True)
    for value, name in ((inner_tx, "inner_tx"), (outer_tx, "outer_tx")):
        if not isinstance(value, optax.GradientTransformation):
            raise TypeError(f"{name} must be an optax GradientTransformation, got {value!r}")
    warn_eager_momentum(outer_tx, eager)
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be True or False, got {donate!r}")
    return inner_tx, outer_tx


def check_mesh(mesh, outer_axis, inner_axis):
    """The mesh with Auto axes; refuses missing, repeated or extra axes."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    axes = (outer_axis,) if inner_axis is None else (outer_axis, inner_axis)
    if inner_axis == outer_axis:
        raise ValueError(f"inner_axis and outer_axis must differ, both are {outer_axis!r}")
    missing = [a for a in axes if a not in mesh.shape]
    extra = [a for a in mesh.axis_names if a not in axes]
    if missing or extra:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)} must be exactly outer_axis={outer_axis!r}"
            f"{f' and inner_axis={inner_axis!r}' if inner_axis else ''}: "
            f"{f'missing {missing}' if missing else f'unused {extra}'}"
        )
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) != auto:
        # The step places everything itself; Explicit axes would type every value inside it.
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return mesh


def check_shard(shard, inner_axis, inner_tx=None):
    """``shard`` checked: None, or "optimizer" on a two-level mesh with an inner optimizer that
    is not Muon."""
    if shard == "params":
        raise ValueError(
            "shard='params' is not supported by diloco: the outer exchange reads each worker's "
            "whole params (global minus local) on every device of its row, so they stay whole; "
            "shard='optimizer' splits the inner optimizer state over inner_axis"
        )
    if shard not in DILOCO_SHARD_MODES:
        raise ValueError(f"shard must be one of {DILOCO_SHARD_MODES}, got {shard!r}")
    if shard is not None and inner_axis is None:
        raise ValueError(
            f"shard={shard!r} splits each worker's inner optimizer state over its inner_axis: "
            "pass inner_axis= (a two-level mesh, e.g. Mesh(devices.reshape(4, 2), "
            "('workers', 'data')) with inner_axis='data'), or shard=None"
        )
    if inner_tx is not None:
        refuse_sharded(inner_tx, shard, "inner_tx")
    return shard


def check_exchange(exchange, inner_axis):
    """``exchange`` checked; None is "split" on a two-level mesh, else "whole"."""
    if exchange is None:
        return "whole" if inner_axis is None else "split"
    if exchange not in EXCHANGE_MODES:
        raise ValueError(f"exchange must be one of {EXCHANGE_MODES} or None, got {exchange!r}")
    if exchange == "split" and inner_axis is None:
        raise ValueError(
            "exchange='split' splits the outer exchange over the devices of a worker's row: "
            "pass inner_axis= (a two-level mesh), or exchange=None"
        )
    return exchange


def _positive_int(value, name, minimum):
    """``value`` as an int from ``minimum`` to the largest step counter (int32)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > _MAX_STEPS:
        raise ValueError(f"{name} must be at most {_MAX_STEPS} (an int32 step count), got {value}")
    return int(value)


#: The largest count a step counter holds (int32).
_MAX_STEPS = 2**31 - 1


def check_schedule(sync_every, fragments, delay, eager=False):
    """``(H, F, tau, eager)`` checked: H >= 1, 1 <= F <= H, 0 <= tau < H, and eager a bool
    with no delay (its rounds are applied one round late)."""
    sync_every = _positive_int(sync_every, "sync_every", 1)
    fragments = _positive_int(fragments, "fragments", 1)
    delay = _positive_int(delay, "delay", 0)
    if fragments > sync_every:
        raise ValueError(
            f"fragments={fragments} > sync_every={sync_every}: each fragment is exchanged at its "
            "own step of the H-step period, so there can be at most H of them"
        )
    if delay >= sync_every:
        raise ValueError(
            f"delay={delay} must be < sync_every={sync_every}: a fragment's result must be "
            "applied before the fragment's next exchange"
        )
    if not isinstance(eager, bool):
        raise TypeError(f"eager must be True or False, got {eager!r}")
    if eager and delay:
        raise ValueError(
            f"eager=True applies each fragment's exchange one round (sync_every={sync_every} "
            f"steps) late by itself: leave delay=0, got delay={delay}"
        )
    return sync_every, fragments, delay, eager


def warn_eager_momentum(outer_tx, eager, what: str = "diloco", stacklevel: int = 4) -> None:
    """With eager rounds, warns of an ``outer_tx`` whose update of the same pseudo-gradient
    changes from one step to the next (momentum): on an average that arrives a round late it
    oscillates (docs/training.md, "Eager rounds"). A probe on a small vector, on the host;
    ``what`` names the caller, ``stacklevel`` points the warning at the user's call."""
    if not eager:
        return
    probe = {"w": jnp.ones(4, jnp.float32)}
    try:
        first, state = outer_tx.update(probe, outer_tx.init(probe), probe)
        second, _ = outer_tx.update(probe, state, probe)
        steady = np.allclose(np.asarray(first["w"]), np.asarray(second["w"]), rtol=1e-5)
    except Exception:  # an outer_tx the probe cannot drive: say nothing
        return
    if not steady:
        warnings.warn(
            f"{what}(eager=True) with an outer_tx whose update grows with momentum: on an "
            "average that arrives a round late, momentum oscillates and training can diverge. "
            "Plain averaging (outer_tx=None, optax.sgd(1.0)) or a small lr without momentum is "
            "stable",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def check_mixing(mixing, delay, eager=False):
    if mixing is None:
        return DEFAULT_MIXING
    if eager:
        raise ValueError(
            "mixing applies to a delayed fragment (delay > 0); with eager=True each worker "
            "restarts from its eager params, not a mix"
        )
    if not delay:
        raise ValueError(
            "mixing applies to a delayed fragment (delay > 0); with delay=0 the workers restart "
            "from the global params"
        )
    return _checks.static_float(mixing, "mixing", 0, 1)


def check_in_flight(max_steps_in_flight):
    if max_steps_in_flight is None:
        return None
    return _positive_int(max_steps_in_flight, "max_steps_in_flight", 1)


def outer_compress(compress, outer_axis):
    """``(transformation, raises)``: the outer exchange, built from None, a method or a name, and
    whether its ``nonfinite="raise"`` makes the host check every step."""
    if compress is None:
        return make_compress(Dense(), axis_name=outer_axis), False
    if isinstance(compress, (Method, str)):
        return make_compress(compress, axis_name=outer_axis), False
    if isinstance(compress, optax.GradientTransformation):
        states = _states_of(compress)
        if not all(s.branches.mean for s in states):
            raise ValueError(
                "compress= must average the pseudo-gradients over the workers: pass "
                "jaxcomp.compress(..., mean=True) (the default), not mean=False (their sum)"
            )
        return compress, any(s.policy.name == "raise" for s in states)
    raise TypeError(
        "compress must be None, a jaxcomp.Method, a method name or a jaxcomp.compress(...) "
        f"transformation, got {type(compress).__name__}"
    )


def _states_of(compress) -> list:
    """The compress states a transformation's ``init`` makes (their static records: the mean,
    the policy), from the shapes of a small matrix; none where its method refuses them (the
    run's own ``init`` then says why)."""
    probe = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    try:
        return compress_states(jax.eval_shape(compress.init, probe))
    except (ValueError, TypeError):
        return []
