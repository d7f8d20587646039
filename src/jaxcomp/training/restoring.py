"""Where a :func:`jaxcomp.data_parallel` state lies, and how a saved one comes back:
:class:`Restoring`, the part of :class:`jaxcomp.training.trainer.DataParallel` that lays out,
resizes and restores states (``state_sharding``, ``state_shapes``, ``resize``, ``restore``).

What each leaf's layout is comes from :mod:`.layout`; carrying a state to another device count
from :mod:`.resize`; reading a checkpoint of an earlier version from :mod:`.checkpoint`. A model's
own state (``has_state=True``) is replicated; each of these takes it as ``model_state=`` (its
arrays or shapes), since the params alone do not say what it is.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxcomp.training import checkpoint
from jaxcomp.training import model_state as model_states
from jaxcomp.training import resize as resizing
from jaxcomp.training.state import TrainState, avals_of


class Restoring:
    """``state_sharding``, ``state_shapes``, ``resize`` and ``restore`` of a run whose
    :class:`jaxcomp.training.layout.Layout` is ``self.layout``."""

    def state_sharding(self, params, model_state=None):
        """The :class:`TrainState` of ``NamedSharding`` s that ``init`` lays the state out with.

        Args:
          params: the whole params (arrays or ``jax.ShapeDtypeStruct``), also with
            ``shard="params"``.
          model_state: with ``has_state=True``, the model's state (arrays or shapes).

        Returns:
          A :class:`TrainState` pytree of ``jax.sharding.NamedSharding``, e.g. for restoring a
          checkpoint onto the mesh.
        """
        avals = avals_of(params)
        self.layout.remember_shapes(avals)
        return self.layout.state_sharding(avals, model_state)

    def state_shapes(self, params, n_devices: int | None = None, *, model_state=None):
        """The :class:`TrainState` of ``jax.ShapeDtypeStruct`` (with shardings) that ``init``
        returns for ``params``: the target for restoring a checkpoint (e.g. orbax's
        ``StandardCheckpointer().restore(path, dp.state_shapes(params))``).

        Args:
          params: the whole params (arrays or ``jax.ShapeDtypeStruct``).
          n_devices: the devices the checkpoint was saved on, when not this run's: the shapes it
            was saved with, placed on this mesh, to restore and hand to :meth:`resize`.
          model_state: with ``has_state=True``, the model's state (arrays or shapes): required
            there, refused without it.

        Returns:
          A :class:`TrainState` of ``jax.ShapeDtypeStruct``.

        Raises:
          ValueError: ``model_state`` given where ``has_state=False``, or missing where True.
        """
        model_state = model_states.check_initial(model_state, self.layout.has_state, "state_shapes")
        avals, model_avals = avals_of(params), avals_of(model_state)
        if n_devices is not None and int(n_devices) != self.n_devices:
            self.layout.remember_shapes(avals)
            return resizing.saved_shapes(self.layout, avals, int(n_devices), True, model_avals)
        shardings = self.state_sharding(params, model_avals)
        shapes = jax.eval_shape(self.layout.initial_state, avals, model_avals)
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings
        )

    def resize(self, state: TrainState, params=None, *, mean: bool = True) -> TrainState:
        """The state of a run of the same ``tx`` and ``shard=`` on another number of devices, as
        the state of this one: shards split again exactly, each device's residual summed and
        spread evenly, the model's state carried as it is (docs/training.md, "Resuming on
        another number of devices").

        Args:
          state: the :class:`TrainState` of ``N`` devices, e.g. restored with
            ``state_shapes(params, n_devices=N)`` (or the state itself, in one process).
          params: the whole params or their shapes; needed with ``shard="params"`` unless
            :meth:`state_shapes` was called with them.
          mean: as the run's ``jaxcomp.compress(mean=...)`` (averaged or summed gradients).

        Returns:
          The :class:`TrainState` on this mesh.

        Example:
          >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
          >>> devices = np.array(jax.devices())
          >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.adam(0.1))
          >>> loss = lambda w, b: jnp.sum(w * b)
          >>> four = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:4], ("data",)))
          >>> two = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:2], ("data",)))
          >>> state = two.resize(four.init(jnp.ones(3)))
          >>> state.opt_state[0].residual.shape
          (2, 3)

        References:
          Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals); Karimireddy et al.,
          ICML 2019 (error feedback); Rajbhandari et al., ZeRO, SC 2020 (sharded state).
        """
        if params is not None:
            avals = avals_of(params)
            self.layout.remember_shapes(avals)
            if self.shard == "params" and isinstance(state, TrainState):
                counts = {np.shape(p)[0] for p in jax.tree.leaves(state.params) if np.ndim(p)}
                for n in counts:
                    resizing.saved_shapes(self.layout, avals, n, placed=False)
        return resizing.resize_state(self.layout, state, mean=mean)

    def restore(self, path, params, *, model_state=None, mean: bool = True) -> TrainState:
        """Restores an orbax checkpoint of this run's ``tx`` and ``shard=``, saved on any number of
        devices, onto this mesh (:meth:`resize` when the count differs).

        Args:
          path: the checkpoint directory (``ocp.StandardCheckpointer().save(path, state)``).
          params: the whole params or their shapes.
          model_state: with ``has_state=True``, the model's state (arrays or shapes).
          mean: as the run's ``jaxcomp.compress(mean=...)``.

        Returns:
          The :class:`TrainState` on this mesh; ``ValueError`` (naming the shapes found) for a
          checkpoint of another ``tx``, ``shard=``, params or model state, before orbax reads
          any array. A checkpoint saved before ``TrainState`` had ``model_state`` restores into
          a run with ``has_state=False``.

        Example:
          >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp, tempfile
          >>> import orbax.checkpoint as ocp
          >>> devices = np.array(jax.devices())
          >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.adam(0.1))
          >>> loss = lambda w, b: jnp.sum(w * b)
          >>> four = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:4], ("data",)))
          >>> path = tempfile.mkdtemp() + "/ckpt"
          >>> ckpt = ocp.StandardCheckpointer()
          >>> ckpt.save(path, four.init(jnp.ones(3))); ckpt.wait_until_finished()
          >>> two = jaxcomp.data_parallel(loss, tx, jax.sharding.Mesh(devices[:2], ("data",)))
          >>> two.restore(path, jnp.ones(3)).opt_state[0].residual.shape
          (2, 3)

        References:
          Rajbhandari et al., ZeRO, SC 2020 (sharded state); Tyagi & Swany, arXiv 2312.02493,
          Alg. 1 (per-worker residuals).
        """
        import orbax.checkpoint as ocp

        avals, model_avals = avals_of(params), avals_of(model_state)
        checkpointer = ocp.StandardCheckpointer()
        metadata = checkpointer.metadata(path)
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
        target = self.state_shapes(params, model_state=model_avals)
        checkpoint.check_model_state(path, tree, target)
        shapes = checkpoint.completed_shapes(tree, target)
        n = resizing.saved_device_count(self.layout, avals, shapes, model_avals)
        target = self.state_shapes(params, n_devices=n, model_state=model_avals)
        state = checkpoint.restore(checkpointer, path, target, tree)
        return self.resize(state, params, mean=mean)
