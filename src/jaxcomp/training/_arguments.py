"""The arguments of :func:`jaxcomp.data_parallel`, checked: each ``check``/``*_axes`` function
returns the value the run uses, or raises an error that names the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp.optim.muon import refuse_sharded
from jaxcomp.training.trial import Trial


def check_kinds(loss_fn, tx, mesh, auto_trial, **flags) -> None:
    """Refuses an argument of ``data_parallel`` of the wrong kind, naming it."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if auto_trial is not None and not isinstance(auto_trial, Trial):
        raise TypeError(
            "auto_trial must be a jaxcomp.training.trial.Trial (e.g. Trial(candidates=2)) or "
            f"None, got {type(auto_trial).__name__}"
        )


def check_nonfinite_updates(nonfinite_updates):
    if nonfinite_updates not in ("drop", "skip"):
        raise ValueError(f"nonfinite_updates must be 'drop' or 'skip', got {nonfinite_updates!r}")
    return nonfinite_updates


def check_rollback(rollback, donate):
    if rollback is None:
        return None
    if isinstance(rollback, bool) or not isinstance(rollback, (int, np.integer)) or rollback < 1:
        raise ValueError(f"rollback must be None or a number of steps >= 1, got {rollback!r}")
    if donate:
        raise ValueError(
            "rollback keeps earlier states to return to, and donate=True deletes each state "
            "passed to step: pass one of them"
        )
    return int(rollback)


def check_gather_dtype(gather_dtype, shard):
    """``gather_dtype`` as a float ``jnp.dtype`` (or None); only with ``shard="params"``."""
    if gather_dtype is None:
        return None
    if shard != "params":
        raise ValueError(
            f"gather_dtype applies to shard='params' (the params gathered for the forward pass), "
            f"not shard={shard!r}"
        )
    try:
        gather_dtype = jnp.dtype(gather_dtype)
    except TypeError:
        raise ValueError(
            f"gather_dtype must be a float dtype such as jnp.bfloat16, got {gather_dtype!r}"
        ) from None
    if not jnp.issubdtype(gather_dtype, jnp.floating):
        raise ValueError(
            f"gather_dtype must be a float dtype such as jnp.bfloat16, got {gather_dtype}"
        )
    if gather_dtype.itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"gather_dtype={gather_dtype} needs jax_enable_x64 (without it JAX computes in float32 "
            "and the gather would silently be float32); to send fewer bytes use jnp.bfloat16"
        )
    return gather_dtype


def accumulating(tx, shard):
    """``tx``, with an ``optax.MultiSteps`` made :func:`jaxcomp.accumulate` (communicating once per
    accumulated step); a Muon ``tx`` is refused with ``shard=`` (:func:`jaxcomp.optim.muon.
    refuse_sharded`)."""
    refuse_sharded(tx, shard)
    if not isinstance(tx, optax.MultiSteps):
        return tx
    if shard is not None:
        raise ValueError(
            "gradient accumulation (optax.MultiSteps, jaxcomp.accumulate) does not combine with "
            "shard= yet: its accumulator holds whole gradients while the optimizer holds shards"
        )
    from jaxcomp.optim.accumulation import from_multisteps

    return from_multisteps(tx)


def data_axes(mesh, axis_name):
    """``axis_name`` checked against the mesh: one axis name, or a tuple of two or more."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    missing = [a for a in axes if a not in mesh.shape]
    if missing or not axes:
        raise ValueError(
            f"axis_name {axis_name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
        )
    return axes[0] if len(axes) == 1 else axes


def auto_axes(mesh):
    """The mesh's devices with Auto axes.

    jax.make_mesh's default Explicit axes would make sharding part of every type inside the step;
    the step places everything itself, so it runs on the same devices with Auto axes.
    """
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) != auto:
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return mesh


def check_max_steps_in_flight(max_steps_in_flight):
    """``max_steps_in_flight`` as a positive int, or None."""
    if max_steps_in_flight is None:
        return None
    if (
        isinstance(max_steps_in_flight, bool)
        or not isinstance(max_steps_in_flight, (int, np.integer))
        or max_steps_in_flight < 1
    ):
        raise ValueError(
            f"max_steps_in_flight must be a positive integer or None, got {max_steps_in_flight!r}"
        )
    return int(max_steps_in_flight)
