"""Resuming a :func:`jaxcomp.data_parallel` state on another number of devices.

A state saved on ``N`` devices holds three kinds of optimizer-state leaves
(:mod:`jaxcomp.training.layout`):

- replicated leaves (step counters, keys, PowerSGD's ``Q``, the optimizer's state without
  ``shard=``): the same on every device and of the same shape on any mesh; carried as they are;
- the error-feedback residual (and DGC's velocity with ``momentum_correction``), one per device,
  stored ``[N, *shape]``: what each device has not sent yet. The next aggregate is
  ``agg = c * sum_d (g_d + r_d)`` with ``c = 1/N`` (``mean=True``) or ``1`` (``mean=False``), so
  the residuals add ``c * sum_d r_d`` to it. On ``N'`` devices each gets ``r' = sum_d r_d / N``
  (``mean=True``: then ``sum_j r'_j / N' = sum_d r_d / N``) or ``r' = sum_d r_d / N'``
  (``mean=False``: then ``sum_j r'_j = sum_d r_d``): the first aggregate after the resize adds the
  same residual mass as the next step on ``N`` devices would have, and nothing that was held back
  is lost (:func:`redistribute_residual`);
- with ``shard=``, the optimizer's shards (and with ``shard="params"`` the params), ``[N, m]``:
  device ``d`` owns values ``[d m, (d + 1) m)`` of the flattened, zero-padded leaf
  (:func:`jaxcomp.optim.sharding.shard_of`). They are gathered and split again into ``[N', m']``
  exactly (:func:`reshard_leaf`).

:func:`saved_shapes` gives the shapes such a state was saved with, for orbax to restore it onto
this mesh; :func:`resize_state` turns it into this run's state. A model's own state
(``has_state=True``) is replicated, the same on any mesh: it is carried as it is.
"""

from __future__ import annotations

import copy
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.optim.state import CompressState, compress_states
from jaxcomp.training.state import TrainState, avals_of, tree_key

_CARRY, _MASS, _SHARD = "carry", "mass", "shard"


def _as_if_on(layout, n_devices: int):
    """``layout`` with ``n_devices`` shards (its shapes only: the mesh is not used)."""
    other = copy.copy(layout)
    other.n_devices = int(n_devices)
    other._masks = layout._masks  # which leaves are per device does not depend on N
    other._shapes = {}
    return other


def saved_shapes(layout, avals, n_devices: int, placed: bool = True, model_state=None):
    """The :class:`TrainState` of ``jax.ShapeDtypeStruct`` that this run's configuration (``tx``,
    ``shard=``) saves on ``n_devices`` devices: the target for restoring such a checkpoint onto
    this run's mesh before :func:`resize_state`.

    Args:
      layout: this run's :class:`jaxcomp.training.layout.Layout`.
      avals: the whole params, as ``jax.ShapeDtypeStruct`` s.
      n_devices: the devices the state was saved on.
      placed: give each a sharding on ``layout.mesh``: per-device leaves split over the data axis
        where ``n_devices`` divides evenly, else replicated; every other leaf replicated.
      model_state: the model's state (arrays or avals; ``has_state=True``), or None.

    Returns:
      A :class:`TrainState` of ``jax.ShapeDtypeStruct``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
      >>> w = jax.ShapeDtypeStruct((3,), jnp.float32)
      >>> saved_shapes(dp.layout, w, 8).opt_state[0].residual.shape
      (8, 3)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals); Rajbhandari et al., ZeRO,
      SC 2020 (sharded optimizer state).
    """
    old = _as_if_on(layout, n_devices)
    state_def, mask = layout.per_device_mask(avals)
    n = old.n_devices
    leaves = jax.tree.leaves(jax.eval_shape(old.tx_init, avals, old.shard_avals(avals)))
    split = NamedSharding(layout.mesh, P(layout.axis_name if n % layout.n_devices == 0 else None))
    whole = NamedSharding(layout.mesh, P())

    def shape(leaf, per_device):
        dims = ((n,) if per_device else ()) + tuple(leaf.shape)
        where = (split if per_device else whole) if placed else None
        return jax.ShapeDtypeStruct(dims, leaf.dtype, sharding=where)

    if layout.shard == "params":
        params = jax.tree.map(lambda a: shape(a, True), old.shard_avals(avals))
        layout._shapes[_key(params)] = avals  # whole_avals knows these shards now
    else:
        params = jax.tree.map(lambda a: shape(a, False), avals)
    opt_state = state_def.unflatten([shape(x, m) for x, m in zip(leaves, mask)])
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole if placed else None)
    model_state = jax.tree.map(lambda a: shape(a, False), avals_of(model_state))
    return TrainState(params=params, opt_state=opt_state, step=step, model_state=model_state)


def _key(stored):
    return tree_key(avals_of(stored))


def saved_device_count(layout, avals, shapes, model_state=None) -> int:
    """The device count a checkpoint of this run's configuration was saved on, from the shapes of
    its leaves (e.g. orbax's metadata).

    Args:
      layout: this run's :class:`jaxcomp.training.layout.Layout`.
      avals: the whole params, as ``jax.ShapeDtypeStruct`` s.
      shapes: the shape of every array of the checkpoint (any order).
      model_state: the model's state (arrays or avals; ``has_state=True``), or None.

    Returns:
      The ``N`` whose :func:`saved_shapes` has exactly these shapes (this run's own count where
      no leaf depends on it); raises ``ValueError`` when none has, naming what was found.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
      >>> w = jax.ShapeDtypeStruct((3,), jnp.float32)
      >>> saved = saved_shapes(dp.layout, w, 8, placed=False)  # e.g. from orbax's metadata
      >>> saved_device_count(dp.layout, w, [x.shape for x in jax.tree.leaves(saved)])
      8

    References:
      Rajbhandari et al., ZeRO, SC 2020 (state partitioned over N data-parallel ranks).
    """
    found = sorted(tuple(s) for s in shapes)
    candidates = [layout.n_devices] + sorted({s[0] for s in found if s} - {layout.n_devices})
    for n in candidates:
        want = sorted(
            tuple(x.shape)
            for x in jax.tree.leaves(saved_shapes(layout, avals, n, False, model_state))
        )
        if want == found:
            return n
    raise ValueError(
        f"the checkpoint's arrays (shapes {found}) are not the state of this data_parallel's tx "
        f"and shard={layout.shard!r} for these params on any device count "
        f"(tried {candidates}): it was saved by another tx, shard= or params"
    )


def redistribute_residual(stacked, n_devices: int, mean: bool = True):
    """Per-device residuals ``[N, *shape]`` as ``n_devices`` equal ones that add the same mass to
    the next aggregate (the module's docstring derives it).

    Args:
      stacked: the residuals of ``N`` devices, ``[N, *shape]``.
      n_devices: ``N'``, the devices of the new run.
      mean: the run's ``compress(mean=...)``: average (``True``) or sum the devices' gradients.

    Returns:
      ``[N', *shape]``: ``sum_d r_d / N`` on every device (``mean=True``), or ``sum_d r_d / N'``.

    Example:
      >>> import jax.numpy as jnp
      >>> redistribute_residual(jnp.array([[1.0], [3.0], [0.0], [4.0]]), 2).tolist()
      [[2.0], [2.0]]
      >>> redistribute_residual(jnp.array([[1.0], [3.0], [0.0], [4.0]]), 2, mean=False).tolist()
      [[4.0], [4.0]]

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019 (the residual is gradient
      not yet applied); Tyagi & Swany, arXiv 2312.02493, Alg. 1.
    """
    total = jnp.sum(stacked, axis=0)
    share = total / (stacked.shape[0] if mean else n_devices)
    return jnp.broadcast_to(share.astype(stacked.dtype), (n_devices,) + share.shape)


def reshard_leaf(stacked, n_devices: int, length: int):
    """A leaf's ``N`` shards ``[N, m]`` as ``n_devices`` shards ``[N', length]``: the same values
    in the same flat positions (the layout of :func:`jaxcomp.optim.sharding.shard_of`).

    Every value of the leaf lies before ``min(N m, N' m')``; what lies beyond is padding, dropped
    or zero-filled.

    Args:
      stacked: ``[N, m]``, device ``d``'s shard in row ``d``.
      n_devices: ``N'``.
      length: ``m'``, one new shard's length.

    Returns:
      ``[N', m']``.

    Example:
      >>> import jax.numpy as jnp
      >>> reshard_leaf(jnp.array([[0.0, 1], [2, 3], [4, 0], [0, 0]]), 2, 3).tolist()
      [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (even partitions of every tensor).
    """
    flat = stacked.reshape(-1)
    want = n_devices * length
    flat = flat[:want] if flat.size >= want else jnp.pad(flat, (0, want - flat.size))
    return flat.reshape(n_devices, length)


def _roles(layout, opt_state, mask):
    """Each optimizer-state leaf's role: carried, residual mass, or an optimizer shard."""
    is_compress = lambda x: isinstance(x, CompressState)  # noqa: E731

    def of_node(node):
        if not is_compress(node):
            return jax.tree.map(lambda _: _SHARD if layout.shard else "other", node)
        mass = lambda t: jax.tree.map(lambda _: _MASS, t)  # noqa: E731
        rest = jax.tree.map(lambda _: "compress", node._replace(residual=None, velocity=None))
        return rest._replace(residual=mass(node.residual), velocity=mass(node.velocity))

    roles = jax.tree.leaves(jax.tree.map(of_node, opt_state, is_leaf=is_compress))
    return [role if per_device else _CARRY for role, per_device in zip(roles, mask)]


def check_resizable(layout, state, n_from: int):
    """Refuses a state of ``n_from`` devices that :func:`resize_state` cannot carry over: per-device
    leaves that are neither residuals nor optimizer shards (e.g. a gradient accumulator), naming
    each.

    Args:
      layout: this run's :class:`jaxcomp.training.layout.Layout`.
      state: the :class:`TrainState` of ``n_from`` devices.
      n_from: the devices it was made on (for the message).

    Returns:
      ``(avals, state_def, roles)``: the whole params' avals, the optimizer state's treedef and
      each leaf's role (``"carry"``, ``"mass"`` or ``"shard"``); raises ``ValueError`` otherwise.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
      >>> roles = check_resizable(dp.layout, dp.init(jnp.ones(3)), 2)[2]
      >>> roles[0], set(roles[1:])  # the residual, then step, key, metrics, guardrail, ...
      ('mass', {'carry'})

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals).
    """
    avals = layout.whole_avals(state.params)
    state_def, mask = layout.per_device_mask(avals)
    roles = _roles(layout, state.opt_state, mask)
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    ]
    odd = [path for path, role in zip(paths, roles) if role not in (_CARRY, _MASS, _SHARD)]
    if odd:
        raise ValueError(
            f"this state was saved on {n_from} devices and this data_parallel runs on "
            f"{layout.n_devices}, but opt_state leaves {odd} differ per device and are neither "
            "error-feedback residuals nor optimizer shards, so they cannot be carried to another "
            f"device count. Resume on {n_from} devices, or gather the params (params(state)) on "
            "the old mesh and init anew"
        )
    return avals, state_def, roles


def resize_state(layout, state, *, mean: bool = True, n_from: int | None = None) -> TrainState:
    """``state`` of a run on ``N`` devices as the state of this run on ``N'``: replicated leaves
    kept, residuals redistributed (:func:`redistribute_residual`), shards re-split
    (:func:`reshard_leaf`); the module's docstring says why each is exact.

    Args:
      layout: this run's :class:`jaxcomp.training.layout.Layout`.
      state: a :class:`TrainState` restored with :func:`saved_shapes` (any placement).
      mean: the run's ``compress(mean=...)``.
      n_from: ``N``; read off the state when None.

    Returns:
      The :class:`TrainState`, laid out on this run's mesh.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> devices = np.array(jax.devices())
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.sum(w * b)
      >>> four = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:4], ("data",)))
      >>> two = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:2], ("data",)))
      >>> resize_state(two.layout, four.init(jnp.ones(3))).opt_state[0].residual.shape
      (2, 3)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals); Rajbhandari et al., ZeRO,
      SC 2020 (sharded optimizer state and params).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    n_from = n_from or device_count_of(layout, state)
    avals = layout.whole_avals(state.params)
    if n_from == layout.n_devices or (state.model_state is None) == layout.has_state:
        # the same count, or a model_state this run does not expect (check_state says so)
        layout.check_state(state)
        return jax.device_put(state, layout.state_sharding(avals, state.model_state))
    expected = saved_shapes(layout, avals, n_from, False, state.model_state)
    if jax.tree.structure(expected) != jax.tree.structure(state) or [
        x.shape for x in jax.tree.leaves(expected)
    ] != [tuple(jax.numpy.shape(x)) for x in jax.tree.leaves(state)]:
        raise ValueError(
            f"state is not a state of this data_parallel's tx and shard={layout.shard!r} saved on "
            f"{n_from} devices: restore it with dp.state_shapes(params, n_devices={n_from})"
        )
    _, state_def, roles = check_resizable(layout, state, n_from)
    placed = saved_shapes(layout, avals, n_from, model_state=state.model_state)
    state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, placed))
    new = jax.eval_shape(layout.initial_state, avals)
    new_leaves = state_def.flatten_up_to(new.opt_state)
    n = layout.n_devices

    def convert(state):
        out = []
        for leaf, want, role in zip(state_def.flatten_up_to(state.opt_state), new_leaves, roles):
            if role == _MASS:
                out.append(redistribute_residual(leaf, n, mean))
            elif role == _SHARD:
                out.append(reshard_leaf(leaf, n, want.shape[1]))
            else:
                out.append(leaf)
        params = state.params
        if layout.shard == "params":
            params = jax.tree.map(lambda p, w: reshard_leaf(p, n, w.shape[1]), params, new.params)
        opt_state = state_def.unflatten(out)
        return TrainState(params, opt_state, state.step, state.model_state)

    shardings = layout.state_sharding(avals, state.model_state)
    resized = jax.jit(convert, out_shardings=shardings)(state)
    _warn_auto(resized, n_from, n)
    return resized


def device_count_of(layout, state) -> int:
    """The device count ``state`` was made on: the leading axis of its per-device leaves.

    Args:
      layout: this run's :class:`jaxcomp.training.layout.Layout`.
      state: a :class:`TrainState` of this run's ``tx`` and ``shard=``, on any mesh.

    Returns:
      ``N`` (this run's count when no leaf is per device); raises ``ValueError`` when the
      leaves disagree.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> devices = np.array(jax.devices())
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.sum(w * b)
      >>> four = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:4], ("data",)))
      >>> two = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:2], ("data",)))
      >>> device_count_of(two.layout, four.init(jnp.ones(3)))
      4

    References:
      Rajbhandari et al., ZeRO, SC 2020 (state partitioned over N data-parallel ranks).
    """
    avals = layout.whole_avals(state.params)
    state_def, mask = layout.per_device_mask(avals)
    try:
        leaves = state_def.flatten_up_to(state.opt_state)
    except (ValueError, TypeError):
        return layout.n_devices  # check_state says what is wrong
    stacked = [jnp.shape(x)[0] for x, m in zip(leaves, mask) if m and jnp.ndim(x)]
    if layout.shard == "params":
        stacked += [jnp.shape(p)[0] for p in jax.tree.leaves(state.params)]
    counts = set(stacked)
    if len(counts) > 1:
        raise ValueError(
            f"state's per-device leaves disagree on the device count ({sorted(counts)}): it is "
            "not a state of this data_parallel"
        )
    return counts.pop() if counts else layout.n_devices


def _warn_auto(state, n_from: int, n_to: int):
    """``compress_auto`` chose with a network measured on the old mesh: say to measure again."""
    if any(s.auto is not None for s in compress_states(state.opt_state)):
        warnings.warn(
            f"the state moved from {n_from} to {n_to} devices: compress_auto's network (latency, "
            "bandwidth) and branch timings were measured on the old mesh; call "
            "dp.reprobe(state) so it chooses for this one",
            stacklevel=3,
        )
