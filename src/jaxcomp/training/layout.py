"""Where a :func:`jaxcomp.data_parallel` run keeps its state, and what its ``tx`` sees.

A :class:`Layout` holds the run's ``tx``, mesh, data axes and ``shard=`` mode. ``tx`` sees the
whole params, or with ``shard=`` each device's ``1/N`` shard of every leaf
(:mod:`jaxcomp.optim.sharding`). Optimizer-state leaves that differ per device (the
error-feedback residual; with ``shard=``, the optimizer's shards) are stored with a leading axis
of size ``n_devices`` sharded over the data axis; every other leaf, and the params, is
replicated (with ``shard="params"`` the params are stored as each leaf's shards, ``[N, m]``).
Which leaves differ is read off shard_map's types (:mod:`jaxcomp.training.mask`). A model's own
state (``has_state=True``: BatchNorm's running averages) is replicated as well
(:mod:`jaxcomp.training.model_state`).
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import sizes
from jaxcomp.ops._ffi import lowering_platform, platform_of, varying_axes
from jaxcomp.optim import sharding
from jaxcomp.optim.state import CompressState, compress_states
from jaxcomp.training import boundary
from jaxcomp.training import mask as mask_lib
from jaxcomp.training.state import TrainState, avals_of, check_params, tree_key

_LOG = logging.getLogger("jaxcomp")

_WAY_OUT = (
    "its per-device leaves (error-feedback residuals; with shard=, the optimizer's and params' "
    "shards) are laid out per device. Carry it over with dp.resize(state, params) (in memory), "
    "or restore the checkpoint with dp.restore(path, params) (orbax; or restore onto "
    "dp.state_shapes(params, n_devices=<saved count>) and call dp.resize): the residuals are "
    "summed and spread over the new devices, the shards re-split exactly (docs/training.md, "
    "'Resuming on another number of devices')"
)


class Layout:
    """The layout of one data_parallel run: ``tx``'s view of the params and the state's shardings.

    Attributes:
      tx, mesh, axis_name, shard, gather_dtype, has_state: as :func:`jaxcomp.data_parallel` was
        given them (``mesh`` with Auto axes).
      axes: ``axis_name`` as a tuple.
      n_devices: the devices over the data axes (the shards of each leaf).
    """

    def __init__(self, tx, mesh, axis_name, shard=None, gather_dtype=None, has_state=False):
        self.tx = tx
        self.has_state = has_state
        self.mesh = mesh
        self.axis_name = axis_name
        self.shard = shard
        self.gather_dtype = gather_dtype
        self.axes = tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)
        self.n_devices = math.prod(mesh.shape[a] for a in self.axes)
        # tx is traced for the mesh's platform only (jaxcomp.ops._ffi.lowering_platform).
        self.platform = platform_of(mesh.devices.flat)
        self._settled = False  # whether a plain tx got its dense mean (:meth:`_settle`)
        self._masks = {}  # tree_key(avals) -> (state_def, mask)
        self._expected = {}  # tree_key(avals) -> the leaves of tx.init's state
        # shard="params": the structure and shard shapes of params -> their full avals
        self._shapes = {}

    # -- what tx sees: the whole params, or this device's shards of them -------------------------

    def shard_avals(self, avals):
        """The avals of one device's shards of ``avals``
        (1-D, :func:`jaxcomp.optim.sharding.shard_length`)."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                (sharding.shard_length(math.prod(a.shape), self.n_devices),), a.dtype
            ),
            avals,
        )

    def tx_init(self, params, shards=None):
        """``tx.init`` as this run lays it out: of the params, or (sharded) of this device's shards,
        with every compress state still made from the whole params (error feedback keeps the
        residual of the whole local gradient)."""
        self._settle(params)
        with lowering_platform(self.platform):
            if self.shard is None:
                return self.tx.init(params)
            with sharding.sharded_updates(self.n_devices):  # refused without a reduce-scatter form
                whole = self.tx.init(params)
                of_shards = self.tx.init(shards)
        is_compress = lambda x: isinstance(x, CompressState)  # noqa: E731
        return jax.tree.map(
            lambda w, s: w if is_compress(w) else s, whole, of_shards, is_leaf=is_compress
        )

    def _settle(self, params):
        """Puts a dense mean in front of a ``tx`` that holds no compress (a plain optax
        optimizer), once, from the first params it sees: each device would otherwise update
        the params from its own gradient. PyTorch's DDP averages a plain optimizer's gradients
        the same way."""
        if self._settled:
            return
        self._settled = True
        with lowering_platform(self.platform):
            plain = not compress_states(jax.eval_shape(self.tx.init, params))
        if plain:
            from jaxcomp.methods import Dense
            from jaxcomp.optim.compression import compress

            self.tx = optax.chain(compress(Dense(), axis_name=self.axis_name), self.tx)
            _LOG.info(
                "data_parallel: tx holds no jaxcomp.compress; its gradients are averaged densely "
                "first, as optax.chain(jaxcomp.compress('dense'), tx)"
            )

    def tx_update(self, grads, opt_state, params):
        """``tx.update``; sharded, inside :func:`jaxcomp.optim.sharding.sharded_updates`. Traced
        for the mesh's platform only (:func:`jaxcomp.ops._ffi.lowering_platform`)."""
        with lowering_platform(self.platform):
            if self.shard is None:
                return self.tx.update(grads, opt_state, params)
            with sharding.sharded_updates(self.n_devices):
                return self.tx.update(grads, opt_state, params)

    def my_shards(self, params):
        """This device's shard of each leaf of the whole ``params`` (inside ``shard_map``)."""
        me = jax.lax.axis_index(self.axis_name)
        return jax.tree.map(lambda p: sharding.shard_of(p, self.n_devices, me), params)

    def gather_bytes(self, avals) -> float:
        """Bytes one device sends in a step's all-gather of the params (sharded modes): ``(N-1)/N``
        of every leaf's ``N`` shards, in ``gather_dtype`` or the leaf's dtype."""
        return sum(
            sizes.reduce_scatter_bytes(
                self.n_devices
                * sharding.shard_length(math.prod(a.shape), self.n_devices)
                * jnp.dtype(self.gather_dtype or a.dtype).itemsize,
                self.n_devices,
            )
            for a in jax.tree.leaves(avals)
        )

    # -- the whole params of a stored state ------------------------------------------------------

    def whole_avals(self, params):
        """The whole params' avals, from whole params, or from a sharded state's params."""
        avals = avals_of(params)
        if self.shard != "params":
            return avals
        key = tree_key(avals)
        if key in self._shapes:
            return self._shapes[key]
        self._refuse_unknown_shards(jax.tree.leaves(avals))
        return avals

    def _refuse_unknown_shards(self, leaves):
        """Sharded params this layout has no whole shapes for: made for another mesh, or unseen."""
        counts = {a.shape[0] for a in leaves if len(a.shape) == 2}
        if (
            len(counts) == 1
            and all(len(a.shape) == 2 for a in leaves)
            and counts != {self.n_devices}
        ):
            raise ValueError(
                f"state.params are shards for {counts.pop()} devices, but this data_parallel "
                f"shards over {self.n_devices}: {_WAY_OUT}"
            )
        if all(len(a.shape) == 2 and a.shape[0] == self.n_devices for a in leaves):
            raise ValueError(
                "these are sharded params (shard='params'): call init(params) or "
                "state_sharding(params) of this data_parallel with the whole params first (e.g. "
                "before restoring a checkpoint), so that it knows each leaf's shape"
            )

    def remember_shapes(self, avals):
        """With ``shard="params"``, remembers the whole ``avals`` behind their stored shards."""
        if self.shard == "params":
            stored = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((self.n_devices,) + a.shape, a.dtype),
                self.shard_avals(avals),
            )
            self._shapes[tree_key(stored)] = avals

    # -- layout of the optimizer state ---------------------------------------------------------

    def per_device_mask(self, params):
        """``(state_def, mask)``: the optimizer state's structure and which of its leaves differ
        per device (:func:`jaxcomp.training.mask.per_device_mask`, cached per params shapes)."""
        check_params(params)
        avals = avals_of(params)
        cache_key = tree_key(avals)
        if cache_key not in self._masks:
            self._masks[cache_key] = mask_lib.per_device_mask(self, avals)
        return self._masks[cache_key]

    def state_specs(self, avals, model_state=None):
        """The :class:`TrainState` of ``PartitionSpec`` s of the state of whole params ``avals``
        (and of ``model_state``, arrays or avals, replicated)."""
        state_def, mask = self.per_device_mask(avals)
        opt_specs = state_def.unflatten([P(self.axis_name) if m else P() for m in mask])
        param_spec = P(self.axis_name) if self.shard == "params" else P()
        return TrainState(
            params=jax.tree.map(lambda _: param_spec, avals),
            opt_state=opt_specs,
            step=P(),
            model_state=jax.tree.map(lambda _: P(), model_state),
        )

    def state_sharding(self, avals, model_state=None):
        """:meth:`state_specs` as ``NamedSharding`` s on the mesh."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.state_specs(avals, model_state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def check_state(self, state):
        """Refuses a state whose optimizer state was not made for its params by this ``tx``, or
        whose ``model_state`` this run's ``has_state`` does not expect; returns the whole params'
        avals."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be the TrainState that init returns, got {type(state).__name__}"
            )
        if (state.model_state is None) == self.has_state:
            raise ValueError(
                "state.model_state is None, but this data_parallel has has_state=True: build "
                "the state with init(params, model_state)"
                if self.has_state
                else "state holds a model_state, but this data_parallel has has_state=False: "
                "pass has_state=True to data_parallel, or build the state with init(params)"
            )
        avals = self.whole_avals(state.params)
        state_def, _ = self.per_device_mask(avals)
        if not self._fits(state_def, state.opt_state, self.state_avals(avals).opt_state):
            self._refuse_other_count(state)
            raise ValueError(
                "state.opt_state does not fit state.params: it was made for other params (or by "
                "another tx, or by a data_parallel with another shard= or mesh). Build the state "
                "with init(params) of this data_parallel, and keep params and opt_state together; "
                f"expected opt_state of structure {state_def}"
            )
        return avals

    def _refuse_other_count(self, state):
        """A state of this ``tx`` made on another number of devices: says so, and the way out."""
        from jaxcomp.training import resize

        try:
            count = resize.device_count_of(self, state)
        except ValueError:
            return
        if count != self.n_devices:
            raise ValueError(
                f"this state was made on {count} devices, but this data_parallel runs on "
                f"{self.n_devices}: {_WAY_OUT}"
            )

    def _expected_opt_state(self, avals) -> list:
        """The leaves of ``tx.init``'s state for these params, traced once per params' shapes
        (``dp.params(state)`` checks the state on every call, outside any jit)."""
        key = tree_key(avals)
        if key not in self._expected:
            shards = self.shard_avals(avals) if self.shard else None
            self._expected[key] = jax.tree.leaves(jax.eval_shape(self.tx_init, avals, shards))
        return self._expected[key]

    @staticmethod
    def _fits(state_def, opt_state, expected) -> bool:
        """Whether ``opt_state`` has the structure and shapes of ``expected``
        (:meth:`state_avals`'s)."""
        try:
            leaves = state_def.flatten_up_to(opt_state)
        except (ValueError, TypeError):
            return False
        # Both come from tx_init's structure: as many leaves, in the same order.
        return all(
            tuple(np.shape(leaf)) == tuple(want.shape)
            for leaf, want in zip(leaves, state_def.flatten_up_to(expected))
        )

    # -- the initial state ---------------------------------------------------------------------

    def initial_state(self, params, model_state=None):
        """The initial :class:`TrainState` of replicated ``params`` (traced, e.g. under
        ``jax.jit``), with ``model_state`` as it is (replicated).

        Unsharded, ``tx.init`` runs once outside ``shard_map`` (it names no mesh axis:
        :meth:`_expected_opt_state` traces it there too) and each per-device leaf is its
        broadcast to ``[N, ...]``, the rows :meth:`mapped_initial_state` makes. XLA's partitioner
        takes time quadratic in the operands of a ``shard_map`` (one per leaf), which on a model
        of 1,000 leaves made this compile take many seconds (docs/performance.md).
        """
        if self.shard is not None:
            return self.mapped_initial_state(params, model_state)
        state_def, mask = self.per_device_mask(avals_of(params))
        leaves = jax.tree.leaves(self.tx_init(params))
        leaves = [
            jnp.broadcast_to(leaf, (self.n_devices, *jnp.shape(leaf))) if per_device else leaf
            for leaf, per_device in zip(leaves, mask)
        ]
        return TrainState(
            params=params,
            opt_state=state_def.unflatten(leaves),
            step=jnp.zeros((), jnp.int32),
            model_state=model_state,
        )

    def mapped_initial_state(self, params, model_state=None):
        """:meth:`initial_state` made inside ``shard_map``, each device its row (sharded runs
        need it: each device inits its own shards); ``model_state`` joins it outside, as it
        is."""
        avals = avals_of(params)
        state_def, mask = self.per_device_mask(avals)
        specs = self.state_specs(avals)

        def this_devices_row(leaf):
            """A per-device leaf as this device's row of its ``[N, ...]`` stack (typed varying)."""
            if not set(self.axes) <= varying_axes(leaf):
                leaf = jax.lax.pcast(leaf, self.axis_name, to="varying")
            return leaf[None]

        def local_init(params):
            shards = self.my_shards(params) if self.shard else None
            leaves = jax.tree.leaves(self.tx_init(params, shards))
            leaves = [
                this_devices_row(leaf) if per_device else leaf
                for leaf, per_device in zip(leaves, mask)
            ]
            stored = jax.tree.map(lambda x: x[None], shards) if self.shard == "params" else params
            return TrainState(
                params=stored, opt_state=state_def.unflatten(leaves), step=jnp.zeros((), jnp.int32)
            )

        (state,) = boundary.packed_shard_map(
            lambda params: (local_init(params),),
            mesh=self.mesh,
            in_specs=(jax.tree.map(lambda _: P(), avals),),
            out_specs=(specs,),
            in_avals=avals,
            out_avals=self.state_avals(avals),
        )(params)
        return state._replace(model_state=model_state)

    def state_avals(self, avals, model_state=None) -> TrainState:
        """The avals of the :class:`TrainState` of whole params ``avals`` (and ``model_state``)
        as ``init`` returns it (each per-device leaf, and ``shard="params"``'s params, stacked
        ``[N, ...]``)."""
        state_def, mask = self.per_device_mask(avals)

        def stacked(a):
            return jax.ShapeDtypeStruct((self.n_devices, *a.shape), a.dtype)

        opt = [stacked(e) if m else e for e, m in zip(self._expected_opt_state(avals), mask)]
        params = jax.tree.map(stacked, self.shard_avals(avals)) if self.shard == "params" else avals
        return TrainState(
            params=params,
            opt_state=state_def.unflatten(opt),
            step=jax.ShapeDtypeStruct((), jnp.int32),
            model_state=avals_of(model_state),
        )
