"""Varying-manual-axes typing inside ``jax.shard_map``: a ``lax.cond`` whose branches type alike.

Inside ``shard_map`` (``check_vma=True``) every array is typed *varying* over the mesh axes where
it may differ between devices. Both branches of a ``lax.cond`` must return the same types, but a
state leaf that one branch makes per-device (an error-feedback residual) is passed through
unchanged by the other. :func:`cond_typed_alike` casts such outputs so the two agree.
"""

from __future__ import annotations

import jax

from jaxcomp.ops import _ffi


def varying_axes(x) -> frozenset:
    """The mesh axes an array or abstract value is typed varying over inside ``shard_map``.

    Args:
      x: an array, tracer or ``jax.ShapeDtypeStruct``.

    Returns:
      A frozenset of axis names (empty outside ``shard_map`` or for a replicated value).

    Example:
      >>> import jax.numpy as jnp
      >>> varying_axes(jnp.zeros(3))
      frozenset()

    References:
      JAX, "Shard Map" (varying manual axes, ``check_vma``), docs.jax.dev.
    """
    manual = getattr(x, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return _ffi.varying_axes(x)


def cast_varying(x, axes: frozenset):
    """``x`` typed varying over ``axes`` (it already varies over a subset of them).

    Args:
      x: an array inside ``shard_map``.
      axes: the mesh axes it must be typed varying over.

    Returns:
      ``x``, cast with ``jax.lax.pcast(..., to="varying")`` over the axes it lacked.

    Example:
      >>> import jax.numpy as jnp
      >>> cast_varying(jnp.ones(2), frozenset()).tolist()
      [1.0, 1.0]

    References:
      JAX, "Shard Map" (``jax.lax.pcast``), docs.jax.dev.
    """
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def cond_typed_alike(pred, run, wait, *operands):
    """``lax.cond(pred, run, wait, *operands)`` with both branches' outputs typed alike.

    Each output leaf is cast varying over the axes either branch makes it vary over, so a branch
    that passes a state leaf through agrees with one that makes it per-device.

    Args:
      pred: a boolean scalar.
      run: the branch taken when ``pred`` is true.
      wait: the branch taken otherwise.
      *operands: the branches' arguments.

    Returns:
      The taken branch's outputs.

    Example:
      >>> import jax.numpy as jnp
      >>> float(cond_typed_alike(jnp.bool_(True), lambda x: x + 1, lambda x: x, jnp.float32(1)))
      2.0

    References:
      JAX, "Shard Map" (``check_vma``; ``lax.cond`` inside ``shard_map``), docs.jax.dev.
    """
    axes = [varying_axes(x) for x in jax.tree.leaves(jax.eval_shape(run, *operands))]
    axes = [
        a | varying_axes(x) for a, x in zip(axes, jax.tree.leaves(jax.eval_shape(wait, *operands)))
    ]

    def typed(branch):
        def fn(*args):
            leaves, treedef = jax.tree.flatten(branch(*args))
            return treedef.unflatten([cast_varying(x, a) for x, a in zip(leaves, axes)])

        return fn

    return jax.lax.cond(pred, typed(run), typed(wait), *operands)
