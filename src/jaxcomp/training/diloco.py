"""Low-communication training, DiLoCo-style: :func:`diloco` and :class:`DiLoCo`.

Workers (the positions on the mesh's outer, slow axis) each take ``sync_every`` inner optimizer
steps alone; then the pseudo-gradient, the global params minus the worker's own, is averaged over
the outer axis through a :func:`jaxcomp.compress` (any method, with error feedback) and an outer
optimizer applies it to the global params, from which every worker restarts. With ``fragments``
the params are exchanged a fragment at a time on a staggered schedule, and with ``delay`` the
result is applied some inner steps after its exchange (Streaming DiLoCo). The conventions are
:func:`jaxcomp.data_parallel`'s: ``init``, a jitted ``step`` with traced counters (one
compilation), ``shard_batch``, ``params``, ``has_state``. The step itself is :mod:`.outer`, the
layout of its state :mod:`.diloco_plan`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.ops._ffi import lowering_platform
from jaxcomp.optim.host import local_copy
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.state import find_compress_state
from jaxcomp.training import _diloco_arguments as arguments
from jaxcomp.training import checkpoint
from jaxcomp.training import model_state as model_states
from jaxcomp.training._eager import flushed
from jaxcomp.training.diloco_plan import Plan
from jaxcomp.training.dispatch import DEFAULT_MAX_STEPS_IN_FLIGHT, BoundedStep
from jaxcomp.training.inner import Inner
from jaxcomp.training.layout import Layout
from jaxcomp.training.outer import DiLoCoState, diloco_step
from jaxcomp.training.state import avals_of, tree_key

__all__ = ["DEFAULT_MIXING", "DiLoCo", "DiLoCoState", "diloco"]

DEFAULT_MIXING = arguments.DEFAULT_MIXING


class DiLoCo:
    """The object :func:`diloco` returns: ``init``, ``step``, ``shard_batch``, ``params``,
    ``state_shapes`` and ``restore``."""

    def __init__(self, loss_fn, inner, outer_tx, compress_tx, mesh, schedule, options):
        self.loss_fn = loss_fn
        self.inner = inner
        self.outer_tx = outer_tx
        self.compress_tx = compress_tx
        self.mesh = mesh
        self.outer_axis, self.inner_axis = inner.outer_axis, inner.inner_axis
        self.sync_every, self.fragments, self.delay, self.eager = schedule
        self.mixing, self.has_aux, self.worker_metrics, max_steps_in_flight, donate, raises = (
            options[:6]
        )
        self.has_state = options[6]
        self.donate = donate
        self.compress_layout = Layout(compress_tx, mesh, self.outer_axis)
        self.n_workers = mesh.shape[self.outer_axis]
        self.data_axes = (
            self.outer_axis if self.inner_axis is None else (self.outer_axis, self.inner_axis)
        )
        self._plans = {}
        self._shapes = {}
        self._flush = {}  # per plan: the jitted consensus with the waiting averages (eager)
        self._probe_names = []  # set while tracing: what each fragment's trigger warning names
        self.step = BoundedStep(
            jax.jit(self._step, donate_argnums=(0,) if donate else ()),
            max_steps_in_flight,
            check=_raise_on_nonfinite if raises else None,
            watch=(self._trigger_probes, _tell),
        )

    # -- layout --------------------------------------------------------------------------------

    def plan(self, avals, model_state=None) -> Plan:
        """The schedule and layout for params (and a model state) of these shapes (cached)."""
        model_avals = avals_of(model_state)
        key = (tree_key(avals), tree_key(model_avals))
        if key not in self._plans:
            self._plans[key] = Plan(self, avals, model_avals)
        return self._plans[key]

    def state_sharding(self, params, model_state=None):
        """The :class:`DiLoCoState` of ``NamedSharding`` s that :meth:`init` lays the state out
        with (replicated, or over the outer axis: each worker's params, inner optimizer state,
        model state and error-feedback residual)."""
        specs = self.plan(avals_of(params), model_state).specs
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def state_shapes(self, params, *, model_state=None):
        """The :class:`DiLoCoState` of ``jax.ShapeDtypeStruct`` (with shardings) that :meth:`init`
        returns: the target for restoring a checkpoint (with ``has_state=True``, of the model
        state ``model_state``, arrays or shapes)."""
        model_state = model_states.check_initial(model_state, self.has_state, "state_shapes")
        avals, model_avals = avals_of(params), avals_of(model_state)
        key = (tree_key(avals), tree_key(model_avals))
        if key not in self._shapes:
            shapes = jax.eval_shape(self._initial_state, avals, model_avals)
            self._shapes[key] = jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                shapes,
                self.state_sharding(avals, model_avals),
            )
        return self._shapes[key]

    def check_state(self, state):
        """Refuses a state that :meth:`init` of this run did not make for its params; returns the
        params' avals."""
        if not isinstance(state, DiLoCoState):
            raise TypeError(
                f"state must be the DiLoCoState that init returns, got {type(state).__name__}"
            )
        if (state.model_state is None) == self.has_state:
            raise ValueError(
                f"state.model_state is {'None' if self.has_state else 'set'}, but this diloco "
                f"run has has_state={self.has_state}: build the state with init(params"
                f"{', model_state' if self.has_state else ''}) of this run"
            )
        avals = avals_of(state.global_params)
        want = self.state_shapes(avals, model_state=_row_avals(state.model_state))
        got_leaves, got_def = jax.tree.flatten(state)
        want_leaves, want_def = jax.tree.flatten(want)
        if got_def != want_def or any(
            tuple(np.shape(g)) != w.shape for g, w in zip(got_leaves, want_leaves)
        ):
            raise ValueError(
                "state does not fit this diloco run: it was made by another inner_tx, outer_tx, "
                "compress, fragments, delay, eager, shard, exchange or mesh (or for other "
                "params). Build "
                "it with init(params) of this run, or restore a checkpoint with "
                "restore(path, params)"
            )
        return avals

    # -- the public entry points ---------------------------------------------------------------

    def init(self, params, model_state=None) -> DiLoCoState:
        """Lays out ``params`` as the global params and every worker's copy, with the inner,
        outer and compress states (and with ``has_state=True`` every worker's copy of
        ``model_state``).

        Args:
          params: pytree of float arrays, the whole params.
          model_state: with ``has_state=True``, the model's initial state; required there,
            refused without it.

        Returns:
          A :class:`DiLoCoState` with step 0.
        """
        model_state = model_states.check_initial(model_state, self.has_state)
        params = (params, model_state)
        if jax.process_count() == 1:
            params = jax.tree.map(
                lambda x: (
                    jax.device_put(x, NamedSharding(self.mesh, P()))
                    if isinstance(x, jax.Array)
                    else x
                ),
                params,
            )
        else:
            params = jax.tree.map(np.asarray, params)
        shardings = self.state_sharding(*params)
        return jax.jit(self._initial_state, out_shardings=shardings)(*params)

    def params(self, state: DiLoCoState):
        """The global params of ``state`` (the model after the last outer step), replicated;
        with ``eager=True``, with the average exchanged for the next round applied too.

        Args:
          state: a :class:`DiLoCoState` of this run.

        Returns:
          The params pytree.
        """
        avals = self.check_state(state)
        if not self.eager:
            return state.global_params
        plan = self.plan(avals, _row_avals(state.model_state))
        if plan not in self._flush:
            self._flush[plan] = jax.jit(lambda state: flushed(self, plan, state))
        return self._flush[plan](state)

    def worker_params(self, state: DiLoCoState):
        """Every worker's own params: each leaf ``[n_workers, *shape]``.

        Args:
          state: a :class:`DiLoCoState` of this run.

        Returns:
          ``state.local_params``.
        """
        self.check_state(state)
        return state.local_params

    def shard_batch(self, batch):
        """Builds the global batch from this process's rows, split over the outer (and inner)
        axes: worker ``w`` trains on the ``w``-th block of rows.

        Args:
          batch: pytree of arrays whose leading axis is this process's share of the global batch.

        Returns:
          The same pytree as global arrays, ready for :attr:`step`.
        """
        sharding = NamedSharding(self.mesh, P(self.data_axes))
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
        )

    def restore(self, path, params, *, model_state=None) -> DiLoCoState:
        """Restores an orbax checkpoint (``ocp.StandardCheckpointer().save(path, state)``) of
        this run onto its mesh; one saved before the state had ``model_state`` restores into a
        run with ``has_state=False``.

        Args:
          path: the checkpoint directory.
          params: the whole params or their shapes.
          model_state: with ``has_state=True``, the model's state (arrays or shapes).

        Returns:
          The :class:`DiLoCoState`, bit for bit as saved.
        """
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        metadata = checkpointer.metadata(path)
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
        target = self.state_shapes(params, model_state=model_state)
        return checkpoint.restore(checkpointer, path, target, tree)

    # -- inside jit ----------------------------------------------------------------------------

    def _initial_state(self, params, model_state=None):
        avals = avals_of(params)
        plan = self.plan(avals, model_state)
        leaves = jax.tree.leaves(params)
        groups = [[leaves[i] for i in group] for group in plan.schedule.groups]

        def per_worker(x):
            return jnp.broadcast_to(x, (self.n_workers, *jnp.shape(x)))

        return DiLoCoState(
            global_params=params,
            local_params=jax.tree.map(per_worker, params),
            inner_state=self.inner.initial_state(params),
            outer_state=tuple(self.outer_tx.init(g) for g in groups),
            compress_state=tuple(self._initial_compress(plan, f, g) for f, g in enumerate(groups)),
            pending=tuple(self._initial_pending(g) for g in groups)
            if self.delay or self.eager
            else (),
            step=jnp.zeros((), jnp.int32),
            model_state=jax.tree.map(per_worker, model_state),
        )

    def _initial_pending(self, leaves):
        """A fragment's pending entry: no average yet, and with ``eager`` every worker starting
        from the initial params."""
        average = [jnp.zeros_like(x) for x in leaves]
        if not self.eager:
            return average
        return average, [jnp.broadcast_to(x, (self.n_workers, *x.shape)) for x in leaves]

    def _initial_compress(self, plan, fragment: int, leaves):
        """Fragment ``fragment``'s initial outer compress state: of its leaves, or (split
        exchange) of one device's blocks, its per-device leaves laid out for every device."""
        if not self.inner.splits:
            return self.compress_layout.initial_state(leaves).opt_state
        blocks = [jnp.zeros(a.shape, a.dtype) for a in plan.block_avals[fragment]]
        state = self.compress_layout.initial_state(blocks).opt_state
        state_def, mask = plan.masks[fragment]
        rows = [
            self.inner.exchange_rows(x, m) for x, m in zip(state_def.flatten_up_to(state), mask)
        ]
        return state_def.unflatten(rows)

    def _step(self, state: DiLoCoState, batch):
        """``(state, metrics, watch)``: the step, and the new step counter and each fragment's
        guardrail scalars as outputs of their own (what the host reads after dispatch must not
        be a leaf of a state the next step may donate; :class:`BoundedStep`)."""
        _check_batch(batch, self)
        plan = self.plan(self.check_state(state), _row_avals(state.model_state))
        with lowering_platform(self.compress_layout.platform):  # trace the mesh's branches only
            new_state, metrics = diloco_step(self, plan, state, batch)
        pairs = zip(state.compress_state, new_state.compress_state)
        probes = [divergence.trigger_probe(*map(find_compress_state, pair)) for pair in pairs]
        self._probe_names = [None if p is None else p[1:] for p in probes]
        scalars = [None if p is None else p[0] for p in probes]
        return new_state, metrics, (new_state.step, scalars, metrics["healed"])

    def _trigger_probes(self, args, out):
        """What the host reads of a dispatched step once it has run: the outer compress's
        guardrail probes, per fragment, and the fraction of devices whose state was healed."""
        probes = [
            None if scalars is None else (scalars, *names)
            for scalars, names in zip(out[2][1], self._probe_names)
        ]
        return probes, out[2][0], out[2][2]

    def metric_specs(self):
        """The metrics' ``PartitionSpec`` s: per worker with ``worker_metrics``, else replicated."""
        loss = P(self.outer_axis) if self.worker_metrics else P()
        specs = {"loss": loss, "bytes_sent": P(), "synced": P(), "healed": loss, "nonfinite": loss}
        return {**specs, "aux": loss} if self.has_aux else specs


def _row_avals(stacked):
    """The avals of one worker's row of leaves stacked ``[n_workers, ...]`` (None stays None)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), stacked)


def _tell(probe):
    """Tells the host what a step that has run did: the guardrail's triggers, and (once per
    process) a worker whose state held non-finite entries, healed at a sync."""
    triggers, step, healed = probe
    for trigger in triggers:
        divergence.tell_trigger(trigger)
    if not _HEALED and np.any(np.asarray(local_copy(healed)) > 0):
        _HEALED.append(True)
        message = (
            f"jaxcomp.diloco: at step {int(local_copy(step))} a worker's params or inner "
            "optimizer state held non-finite entries; they start again from the global params "
            "and the inner optimizer's initial state (the 'healed' metric)"
        )
        _LOG.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _raise_on_nonfinite(state, metrics):
    """``compress(nonfinite="raise")``: a sync whose pseudo-gradients held NaN or Inf raises,
    with the state the step returned (its global params and outer state unchanged)."""
    count = float(np.sum(np.asarray(metrics["nonfinite"])))
    if count:
        error = FloatingPointError(
            f"step {int(local_copy(state.step))}: the pseudo-gradients held {count:.0f} "
            "non-finite entries and the outer compress has nonfinite='raise'. The sync was "
            "dropped: the global params and the outer state are as they were, and the error's "
            "`state` holds them. Find the worker's cause, or pass nonfinite='skip' (drop such "
            "syncs) or 'zero' (drop those entries) to the outer jaxcomp.compress"
        )
        error.state = state
        raise error


_LOG = logging.getLogger("jaxcomp")
_HEALED: list = []  # whether this process has warned once of a healed worker


def _check_batch(batch, run):
    """Refuses a batch the devices cannot split evenly."""
    n = run.n_workers * (run.mesh.shape[run.inner_axis] if run.inner_axis else 1)
    if not jax.tree.leaves(batch):
        raise ValueError("batch holds no arrays: pass the global batch as a pytree of arrays")
    for leaf in jax.tree.leaves(batch):
        if leaf.ndim == 0 or leaf.shape[0] % n or leaf.shape[0] == 0:
            raise ValueError(
                f"batch leaves need a non-empty leading (global batch) axis divisible by the {n} "
                f"devices of {run.data_axes!r}, got shape {leaf.shape}"
            )


def diloco(
    loss_fn: Callable,
    inner_tx: optax.GradientTransformation | None = None,
    outer_tx: optax.GradientTransformation | None = None,
    mesh: jax.sharding.Mesh | None = None,
    sync_every: int = 500,
    compress=None,
    *,
    outer_axis: str = "workers",
    inner_axis: str | None = None,
    fragments: int = 1,
    delay: int = 0,
    eager: bool = False,
    mixing: float | None = None,
    has_aux: bool = False,
    has_state: bool = False,
    worker_metrics: bool = False,
    shard: str | None = None,
    exchange: str | None = None,
    max_steps_in_flight: int | None = DEFAULT_MAX_STEPS_IN_FLIGHT,
    donate: bool = False,
) -> DiLoCo:
    """DiLoCo: workers train alone, and every ``sync_every`` steps take one outer step together.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's shard.
      inner_tx: each worker's optimizer, without a ``compress`` (default: the paper's AdamW).
      outer_tx: the averaged pseudo-gradient's optimizer (default: Nesterov; eager: averaging).
      mesh: a ``jax.sharding.Mesh`` with ``outer_axis`` (and ``inner_axis``) and no other axis.
      sync_every: H, the inner steps between two exchanges of a fragment (default 500).
      compress: None (dense), a method, its name, or a ``jaxcomp.compress`` over ``outer_axis``.
      outer_axis: the slow mesh axis the workers lie on.
      inner_axis: the fast axis each worker's inner steps are data-parallel over, or None.
      fragments: F, the parts of the params exchanged on a staggered schedule (default 1).
      delay, mixing: tau, the steps from a fragment's exchange to its application (default 0),
        and the local params' weight in the merge then (default 0.5).
      eager: exchange beside the next round, apply a round late, restart eagerly (False).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` goes to the metrics.
      has_state: ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, per worker.
      worker_metrics: report the loss per worker; then nothing but a sync crosses ``outer_axis``.
      shard: None, or ``"optimizer"`` (with ``inner_axis``): ZeRO-1 over each worker's row.
      exchange: with ``inner_axis``, ``"split"`` (default: a block per device) or ``"whole"``.
      max_steps_in_flight, donate: as :func:`jaxcomp.data_parallel`'s (``donate`` default False).

    Returns:
      A :class:`DiLoCo` with ``init(params)`` and ``step(state, batch) -> (state, metrics)``
      (docs/training.md, section 7).

    Raises:
      ValueError, TypeError: an option out of range, an argument of the wrong kind.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("workers",))
      >>> run = jaxcomp.diloco(lambda w, x: jnp.mean((x @ w - 1) ** 2), mesh=mesh, sync_every=2)
      >>> state, metrics = run.step(run.init(jnp.zeros(3)), jnp.ones((8, 3)))
      >>> bool(metrics["synced"]), bool(run.step(state, jnp.ones((8, 3)))[1]["synced"])
      (False, True)

    References:
      "DiLoCo" (arXiv 2311.08105), "Streaming DiLoCo" (2501.18512), "Eager Updates" (2502.12996).
    """
    schedule = arguments.check_schedule(sync_every, fragments, delay, eager)
    inner_tx, outer_tx = arguments.optimizers(loss_fn, inner_tx, outer_tx, donate, schedule)
    mesh = arguments.check_mesh(mesh, outer_axis, inner_axis)
    inner = Inner(
        inner_tx,
        mesh,
        outer_axis,
        inner_axis,
        arguments.check_shard(shard, inner_axis, inner_tx),
        arguments.check_exchange(exchange, inner_axis),
    )
    mixing = arguments.check_mixing(mixing, delay, eager)
    compress_tx, raises = arguments.outer_compress(compress, outer_axis)
    in_flight = arguments.check_in_flight(max_steps_in_flight)
    if not isinstance(has_state, bool):
        raise TypeError(f"has_state must be True or False, got {has_state!r}")
    options = (mixing, bool(has_aux), bool(worker_metrics), in_flight, donate, raises, has_state)
    return DiLoCo(loss_fn, inner, outer_tx, compress_tx, mesh, schedule, options)
