"""State a model keeps beside its params (BatchNorm's running averages): ``has_state=True`` of
:func:`jaxcomp.data_parallel` and :func:`jaxcomp.diloco`.

The loss then reads and returns it: ``loss_fn(params, model_state, batch) -> (loss,
new_model_state)`` (``((loss, aux), new_model_state)`` with ``has_aux``). Each device computes its
own new state from its batch shard; :func:`averaged` makes it one again, the mean of the
devices' float leaves in one joined all-reduce (:func:`jaxcomp.collectives.small.joined_mean`),
as PyTorch users expect of DDP's buffers kept the same on every replica. :func:`as_aux` turns
such a loss into a plain ``(loss, aux)`` one for ``jax.value_and_grad``, checking what it returns
while it is traced; :func:`check_initial` checks what ``init`` is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.optim.vma import varying_axes

_SHAPE = (
    "with has_state=True, loss_fn(params, model_state, batch) must return (loss, "
    "new_model_state){aux}, the new state of the same structure, shapes and dtypes as "
    "model_state"
)


def check_initial(model_state, has_state: bool, entry: str = "init"):
    """Refuses the ``model_state`` given to ``init`` where the run's ``has_state`` does not want
    one, or wants one and got none; returns it.

    Args:
      model_state: what ``init`` was given (a pytree of arrays, or None).
      has_state: the run's ``has_state``.
      entry: the function's name, for the message.

    Returns:
      ``model_state``; raises ``ValueError`` (naming the argument and the way out) or
      ``TypeError`` (a leaf that is not an array).

    Example:
      >>> import jax.numpy as jnp
      >>> check_initial({"mean": jnp.zeros(3)}, True)["mean"].shape
      (3,)
      >>> check_initial(None, True)
      Traceback (most recent call last):
      ValueError: this run has has_state=True: ...

    References:
      Ioffe & Szegedy, "Batch Normalization", ICML 2015 (the running averages a model keeps).
    """
    if has_state and model_state is None:
        raise ValueError(
            f"this run has has_state=True: pass the model's initial state as well, "
            f"{entry}(params, model_state) (e.g. variables['batch_stats'] of a linen model)"
        )
    if not has_state and model_state is not None:
        raise ValueError(
            f"{entry}(params, model_state) was given a model_state, but this run has "
            "has_state=False: pass has_state=True (and a loss_fn(params, model_state, batch) "
            "that returns (loss, new_model_state)), or leave model_state out"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(model_state):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(
                f"model_state{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
                "array: every leaf of model_state must be an array"
            )
    return model_state


def as_aux(loss_fn, has_aux: bool, model_state):
    """``loss_fn(params, model_state, batch)`` as ``loss(params, batch) -> (loss, (aux,
    new_model_state))``, for ``jax.value_and_grad(..., has_aux=True)``.

    Args:
      loss_fn: the user's loss, with ``has_state=True``.
      has_aux: whether it returns ``((loss, aux), new_model_state)``.
      model_state: the state it reads (this device's).

    Returns:
      The wrapped loss; ``aux`` is None without ``has_aux``. While it is traced it raises
      ``ValueError`` naming ``loss_fn`` when the loss returns another shape, or a new state of
      another structure, shape or dtype than ``model_state``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> loss = lambda w, s, b: (jnp.sum(w * b), {"seen": s["seen"] + b.sum()})
      >>> wrapped = as_aux(loss, False, {"seen": jnp.float32(0)})
      >>> (value, (aux, new)), grads = jax.value_and_grad(wrapped, has_aux=True)(
      ...     jnp.ones(2), jnp.arange(2.0))
      >>> float(value), aux, float(new["seen"]), grads.tolist()
      (1.0, None, 1.0, [0.0, 1.0])

    References:
      flax, ``Module.apply(..., mutable=["batch_stats"])`` (the updated collections it returns).
    """
    aux_shape = ", with has_aux=True ((loss, aux), new_model_state)" if has_aux else ""

    def loss(params, batch):
        out = loss_fn(params, model_state, batch)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(_SHAPE.format(aux=aux_shape) + f"; it returned {_kind(out)}")
        value, new_state = out
        if has_aux and (not isinstance(value, (tuple, list)) or len(value) != 2):
            raise ValueError(_SHAPE.format(aux=aux_shape) + f"; its first is {_kind(value)}")
        value, aux = value if has_aux else (value, None)
        _check_new(new_state, model_state, aux_shape)
        return value, (aux, new_state)

    return loss


def _kind(x) -> str:
    """What ``x`` is, for a message: a tuple of 3, an array of shape (2,), a dict."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if hasattr(x, "shape"):
        return f"an array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _check_new(new_state, model_state, aux_shape):
    """Refuses a new model state that does not fit the old one, naming the first difference."""
    want, got = jax.tree.structure(model_state), jax.tree.structure(new_state)
    if want != got:
        raise ValueError(
            _SHAPE.format(aux=aux_shape) + f"; its new_model_state is of structure {got}, "
            f"model_state of {want}"
        )
    pairs = zip(jax.tree_util.tree_leaves_with_path(model_state), jax.tree.leaves(new_state))
    for (path, old), new in pairs:
        if jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != jnp.result_type(old):
            raise ValueError(
                _SHAPE.format(aux=aux_shape) + f"; new_model_state{jax.tree_util.keystr(path)} "
                f"is {jnp.result_type(new)}{list(jnp.shape(new))}, model_state's "
                f"{jnp.result_type(old)}{list(jnp.shape(old))}"
            )


def averaged(new_state, axis_name, old_state=None, skipped=None, own_integers=False):
    """The model state every device keeps (inside ``shard_map``): the mean over ``axis_name`` of
    each float leaf that differs over it, in one joined all-reduce; a leaf the same on every
    device is kept as it is.

    Args:
      new_state: this device's new model state (what the loss returned).
      axis_name: the data axis, or tuple of axes, to average over.
      old_state: the state before the step: a mean that is not finite keeps its entry's old
        value (as the params keep theirs), or None.
      skipped: a replicated boolean scalar: the step was skipped, ``old_state`` is kept whole.
      own_integers: an integer leaf that differs over the axes stays each device's own (diloco's
        workers, which store their state per worker); else it is refused.

    Returns:
      The model state, its float leaves typed invariant over ``axis_name``; ``ValueError``
      where an integer leaf differs per device and ``own_integers`` is False (a count of what
      one device saw cannot be averaged, nor stored once for all).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: averaged({"mean": x}, "data")["mean"], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jnp.array([1.0, 3.0])).tolist()
      [2.0]

    References:
      Ioffe & Szegedy, "Batch Normalization", ICML 2015; Li et al., "PyTorch Distributed", VLDB
      2020 (buffers kept the same on every replica).
    """
    axes = frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    flat, treedef = jax.tree_util.tree_flatten_with_path(new_state)
    leaves = [leaf for _, leaf in flat]
    differ = [i for i, leaf in enumerate(leaves) if varying_axes(leaf) & axes]
    if own_integers:
        differ = [i for i in differ if jnp.issubdtype(leaves[i].dtype, jnp.inexact)]
    for i in differ:
        if not jnp.issubdtype(leaves[i].dtype, jnp.inexact):
            raise ValueError(
                f"new_model_state{jax.tree_util.keystr(flat[i][0])} has dtype "
                f"{leaves[i].dtype} and differs per device: only float leaves are averaged "
                "over the devices; an integer leaf must be the same on every device"
            )
    for i, mean in zip(differ, small.joined_mean([leaves[i] for i in differ], axis_name)):
        leaves[i] = mean
    if old_state is not None:
        old = treedef.flatten_up_to(old_state)
        leaves = [_finite_or(new, o) for new, o in zip(leaves, old)]
        if skipped is not None:
            leaves = [jnp.where(skipped, o, new) for new, o in zip(leaves, old)]
    return treedef.unflatten(leaves)


def _finite_or(new, old):
    """``new`` where it is finite, ``old`` elsewhere (float leaves; others as they are)."""
    if not jnp.issubdtype(new.dtype, jnp.inexact):
        return new
    return jnp.where(jnp.isfinite(new), new, old)
