"""Restoring a checkpoint of a :func:`jaxcomp.data_parallel` run written by this version or by
an earlier one: :func:`restore`.

orbax restores a checkpoint into a target of the same structure only. A field that a later
version added to the state (:data:`ADDED`) is missing from an earlier version's checkpoint; its
other arrays are restored by their paths (the NamedTuple field names orbax saves them under),
and each added field is filled from the restored state as that version would have read it. A
field added empty (``model_state``, None where the model keeps no state) holds no array, but
orbax refuses a target with a key the checkpoint lacks, so such a checkpoint is restored by
paths too. A checkpoint with arrays this version does not have, or without arrays it cannot
fill, is refused with a message that names them.
"""

from __future__ import annotations

import jax

from jaxcomp.optim import pinning
from jaxcomp.optim.state import CompressState

#: The fields added to the state since the first release, by name: the version that added
#: them. Their value in a checkpoint of before is filled in by :func:`_filled`.
ADDED = {"asked": "0.3"}


def restore(checkpointer, path, target, tree):
    """The state saved at ``path``, restored into ``target``'s structure and shardings.

    Args:
      checkpointer: an ``orbax.checkpoint.StandardCheckpointer``.
      path: the checkpoint directory.
      target: the state of ``jax.ShapeDtypeStruct`` s (with shardings) to restore into (a
        :class:`~jaxcomp.training.state.TrainState` or a ``DiLoCoState``).
      tree: the checkpoint's metadata tree (nested dicts and lists of array metadata).

    Returns:
      The restored state, of ``target``'s structure.

    Raises:
      ValueError: the checkpoint has arrays ``target`` lacks, or lacks arrays that are not in
        :data:`ADDED`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp, tempfile
      >>> import orbax.checkpoint as ocp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("dense"), optax.sgd(0.1))
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
      >>> path, ckpt = tempfile.mkdtemp() + "/ckpt", ocp.StandardCheckpointer()
      >>> ckpt.save(path, dp.init(jnp.ones(3))); ckpt.wait_until_finished()
      >>> tree = ckpt.metadata(path).item_metadata.tree
      >>> restore(ckpt, path, dp.state_shapes(jnp.ones(3)), tree).params.tolist()
      [1.0, 1.0, 1.0]

    References:
      orbax-checkpoint, ``StandardCheckpointer`` (restoring into a target structure).
    """
    saved = dict(_saved_arrays(tree))
    wanted = {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if not missing and not extra and _keys_present(tree, target):
        return checkpointer.restore(path, target)
    check_model_state(path, tree, target)
    unknown = [p for p in missing if p[-1] not in ADDED]
    if extra or unknown:
        raise ValueError(
            f"the checkpoint at {path} does not fit this run's state: it lacks "
            f"{['.'.join(p) for p in unknown]} and has {['.'.join(p) for p in extra]} that this "
            f"state does not. It was written by another tx, params or shard= (or by a jaxcomp "
            f"newer than this one; fields added since the first release: {ADDED})"
        )
    restored = dict(_saved_arrays(checkpointer.restore(path, _as_saved(tree, wanted))))
    leaves = [restored.get(p, wanted[p]) for p in wanted]
    return _filled(jax.tree.unflatten(jax.tree.structure(target), leaves))


def check_model_state(path, tree, target):
    """Refuses a checkpoint with a model state for a target without one, or the other way.

    Args:
      path: the checkpoint directory (for the message).
      tree: the checkpoint's metadata tree.
      target: this run's state of ``jax.ShapeDtypeStruct`` s.

    Returns:
      None; raises ``ValueError`` saying which ``has_state`` the checkpoint was saved with.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp.training.state import TrainState
      >>> mean = jax.ShapeDtypeStruct((3,), jnp.float32)
      >>> check_model_state("ckpt", {"model_state": {"mean": mean}}, TrainState(0, 0, 0, None))
      Traceback (most recent call last):
      ValueError: the checkpoint at ckpt holds a model_state (saved with has_state=True) ...

    References:
      orbax-checkpoint, ``StandardCheckpointer.metadata``.
    """
    saved = any(p[0] == "model_state" for p, _ in _saved_arrays(tree))
    wanted = bool(jax.tree.leaves(getattr(target, "model_state", None)))
    if saved and not wanted:
        raise ValueError(
            f"the checkpoint at {path} holds a model_state (saved with has_state=True) and this "
            "run has none: restore it with has_state=True and restore(path, params, "
            "model_state=...)"
        )
    if wanted and not saved:
        raise ValueError(
            f"the checkpoint at {path} holds no model_state: it was saved with has_state=False "
            "(or before the field existed). Restore it with has_state=False, or start the "
            "model state anew with init(params, model_state)"
        )


def completed_shapes(tree, target) -> list:
    """The shapes of the checkpoint's arrays, and of the fields of :data:`ADDED` it lacks (as
    ``target`` has them, whatever the device count: they are replicated scalars), so that a
    checkpoint of before counts its devices as one of now.

    Args:
      tree: the checkpoint's metadata tree.
      target: this run's state of ``jax.ShapeDtypeStruct`` s, on any device count.

    Returns:
      A list of shapes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> completed_shapes({"step": jax.ShapeDtypeStruct((), jnp.int32)}, {"step": jnp.int32(0)})
      [()]

    References:
      orbax-checkpoint, ``StandardCheckpointer.metadata``.
    """
    saved = dict(_saved_arrays(tree))
    wanted = {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
    added = [leaf for p, leaf in wanted.items() if p not in saved and p[-1] in ADDED]
    arrays = [tuple(leaf.shape) for leaf in saved.values() if hasattr(leaf, "shape")]
    return arrays + [tuple(a.shape) for a in added]


def _keys_present(tree, target) -> bool:
    """Whether every field of ``target``, an empty (None) one too, is a key of the checkpoint's
    ``tree``: orbax restores directly into a target of the same keys only."""
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)[0]
    for keys, leaf in flat:
        if leaf is not None:
            continue
        node = tree
        for key in _path(keys):
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return False
    return True


def _path(keys) -> tuple:
    """A key path as orbax names it: NamedTuple fields and dict keys by name, items by index."""
    return tuple(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in keys)


def _saved_arrays(tree, prefix=()):
    """``(path, leaf)`` of every array (or array metadata) of a nested dict and list tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _saved_arrays(value, prefix + (str(key),))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _saved_arrays(value, prefix + (str(i),))
    elif tree is not None:
        yield prefix, tree


def _as_saved(tree, wanted):
    """The metadata tree with each array's metadata replaced by the target's leaf at its path:
    a target of the checkpoint's own structure, with this run's shardings."""

    def walk(node, prefix):
        if isinstance(node, dict):
            return {k: walk(v, prefix + (str(k),)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v, prefix + (str(i),)) for i, v in enumerate(node)]
        return None if node is None else wanted[prefix]

    return walk(tree, ())


def _filled(state):
    """``state`` with each added field a checkpoint lacked filled in: a compress state's
    ``asked`` (still a ``ShapeDtypeStruct``) is the branch its restored state asks for, which is
    what the host read before the field existed."""

    def fill(node):
        if isinstance(node, CompressState) and isinstance(node.asked, jax.ShapeDtypeStruct):
            ask = jax.jit(pinning.next_branch, out_shardings=node.asked.sharding)
            return node._replace(asked=ask(node._replace(asked=None)))
        return node

    return jax.tree.map(fill, state, is_leaf=lambda x: isinstance(x, CompressState))
