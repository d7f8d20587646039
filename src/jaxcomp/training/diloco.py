"""Low-communication training, DiLoCo-style: :func:`diloco` and :class:`DiLoCo`.

Workers (the positions on the mesh's outer, slow axis) each take ``sync_every`` inner optimizer
steps alone; then the pseudo-gradient, the global params minus the worker's own, is averaged over
the outer axis through a :func:`jaxcomp.compress` (any method, with error feedback) and an outer
optimizer applies it to the global params, from which every worker restarts. With ``fragments``
the params are exchanged a fragment at a time on a staggered schedule, and with ``delay`` the
result is applied some inner steps after its exchange (Streaming DiLoCo). The conventions are
:func:`jaxcomp.data_parallel`'s: ``init``, a jitted ``step`` with traced counters (one
compilation), ``shard_batch``, ``params``. The step itself is :mod:`.outer`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.methods import Dense, Method
from jaxcomp.ops._ffi import lowering_platform
from jaxcomp.optim.compression import compress as make_compress
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.transform import compress_states, find_compress_state
from jaxcomp.training.dispatch import DEFAULT_MAX_STEPS_IN_FLIGHT, BoundedStep
from jaxcomp.training.inner import DILOCO_SHARD_MODES, EXCHANGE_MODES, Inner
from jaxcomp.training.layout import Layout
from jaxcomp.training.outer import DiLoCoState, Schedule, diloco_step, strided_groups
from jaxcomp.training.state import avals_of, check_params, tree_key

__all__ = ["DEFAULT_MIXING", "DiLoCo", "DiLoCoState", "diloco"]

#: Streaming DiLoCo's mixing factor alpha for a delayed fragment: local <- a*local + (1-a)*global.
DEFAULT_MIXING = 0.5


class _Plan:
    """What a run derives from its params' shapes: the schedule, the outer compress's layout per
    fragment, the state's specs and shapes."""

    def __init__(self, run, avals):
        check_params(avals)
        leaves = jax.tree.leaves(avals)
        if run.fragments > len(leaves):
            raise ValueError(
                f"fragments={run.fragments} is more than the {len(leaves)} leaves of params: "
                "a fragment is a group of whole leaves; pass fragments <= the number of leaves"
            )
        _refuse_inner_compress(run.inner.user_tx, avals)
        groups = strided_groups(len(leaves), run.fragments)
        self.schedule = Schedule(run.sync_every, run.fragments, run.delay, groups)
        self.group_avals = [[leaves[i] for i in group] for group in groups]
        # What the outer compress sees: the fragment's leaves, or this device's blocks of them.
        self.block_avals = [run.inner.block_avals(g) for g in self.group_avals]
        try:
            self.masks = [run.compress_layout.per_device_mask(b) for b in self.block_avals]
        except (ValueError, NameError) as error:
            axis_error = ("differ per device", "no such axis")
            if isinstance(error, ValueError) and not any(m in str(error) for m in axis_error):
                raise
            raise ValueError(
                f"compress must aggregate the pseudo-gradients over outer_axis="
                f"{run.outer_axis!r} and return the same average on every worker, e.g. "
                f"jaxcomp.compress('ar_topk', ratio=0.1, axis_name={run.outer_axis!r}) "
                f"(or pass the method alone: diloco builds the compress); {error}"
            ) from None
        self.splits = run.inner.splits
        self.specs = self._specs(run, avals)

    def _specs(self, run, avals):
        """The :class:`DiLoCoState` of ``PartitionSpec`` s."""
        worker = P(run.outer_axis)
        return DiLoCoState(
            global_params=jax.tree.map(lambda _: P(), avals),
            local_params=jax.tree.map(lambda _: worker, avals),
            inner_state=jax.tree.map(lambda _: run.inner.spec, run.inner.state_avals(avals)),
            outer_state=tuple(
                jax.tree.map(lambda _: P(), jax.eval_shape(run.outer_tx.init, g))
                for g in self.group_avals
            ),
            compress_state=tuple(
                state_def.unflatten([run.inner.exchange_spec(m) for m in mask])
                for state_def, mask in self.masks
            ),
            pending=tuple(jax.tree.map(lambda _: P(), g) for g in self.group_avals)
            if run.delay
            else (),
            step=P(),
        )

    def compress_rows(self, compress_state, fragment: int, take: bool):
        """The per-worker leaves of a fragment's compress state: this worker's row (``take``) or
        stacked back into a row of ``[n_workers, ...]``."""
        state_def, mask = self.masks[fragment]
        leaves = state_def.flatten_up_to(compress_state)
        stacked = [m or self.splits for m in mask]  # a split exchange stacks every leaf
        return state_def.unflatten(
            [(x[0] if take else x[None]) if r else x for x, r in zip(leaves, stacked)]
        )


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
        self.sync_every, self.fragments, self.delay = schedule
        self.mixing, self.has_aux, self.worker_metrics, max_steps_in_flight, donate = options
        self.donate = donate
        self.compress_layout = Layout(compress_tx, mesh, self.outer_axis)
        self.n_workers = mesh.shape[self.outer_axis]
        self.data_axes = (
            self.outer_axis if self.inner_axis is None else (self.outer_axis, self.inner_axis)
        )
        self._plans = {}
        self._shapes = {}
        self._probe_names = []  # set while tracing: what each fragment's trigger warning names
        self.step = BoundedStep(
            jax.jit(self._step, donate_argnums=(0,) if donate else ()),
            max_steps_in_flight,
            watch=(self._trigger_probes, _tell_triggers),
        )

    # -- layout --------------------------------------------------------------------------------

    def plan(self, avals) -> _Plan:
        """The schedule and layout for params of these shapes (cached)."""
        key = tree_key(avals)
        if key not in self._plans:
            self._plans[key] = _Plan(self, avals)
        return self._plans[key]

    def state_sharding(self, params):
        """The :class:`DiLoCoState` of ``NamedSharding`` s that :meth:`init` lays the state out
        with (replicated, or over the outer axis: each worker's params, inner optimizer state and
        error-feedback residual)."""
        specs = self.plan(avals_of(params)).specs
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def state_shapes(self, params):
        """The :class:`DiLoCoState` of ``jax.ShapeDtypeStruct`` (with shardings) that :meth:`init`
        returns: the target for restoring a checkpoint."""
        avals = avals_of(params)
        key = tree_key(avals)
        if key not in self._shapes:
            shapes = jax.eval_shape(self._initial_state, avals)
            self._shapes[key] = jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                shapes,
                self.state_sharding(avals),
            )
        return self._shapes[key]

    def check_state(self, state):
        """Refuses a state that :meth:`init` of this run did not make for its params; returns the
        params' avals."""
        if not isinstance(state, DiLoCoState):
            raise TypeError(
                f"state must be the DiLoCoState that init returns, got {type(state).__name__}"
            )
        avals = avals_of(state.global_params)
        want = self.state_shapes(avals)
        got_leaves, got_def = jax.tree.flatten(state)
        want_leaves, want_def = jax.tree.flatten(want)
        if got_def != want_def or any(
            tuple(np.shape(g)) != w.shape for g, w in zip(got_leaves, want_leaves)
        ):
            raise ValueError(
                "state does not fit this diloco run: it was made by another inner_tx, outer_tx, "
                "compress, fragments, delay, shard, exchange or mesh (or for other params). Build "
                "it with init(params) of this run, or restore a checkpoint with "
                "restore(path, params)"
            )
        return avals

    # -- the public entry points ---------------------------------------------------------------

    def init(self, params) -> DiLoCoState:
        """Lays out ``params`` as the global params and every worker's copy, with the inner,
        outer and compress states.

        Args:
          params: pytree of float arrays, the whole params.

        Returns:
          A :class:`DiLoCoState` with step 0.
        """
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
        shardings = self.state_sharding(params)
        return jax.jit(self._initial_state, out_shardings=shardings)(params)

    def params(self, state: DiLoCoState):
        """The global params of ``state`` (the model after the last outer step), replicated.

        Args:
          state: a :class:`DiLoCoState` of this run.

        Returns:
          The params pytree.
        """
        self.check_state(state)
        return state.global_params

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

    def restore(self, path, params) -> DiLoCoState:
        """Restores an orbax checkpoint (``ocp.StandardCheckpointer().save(path, state)``) of
        this run onto its mesh.

        Args:
          path: the checkpoint directory.
          params: the whole params or their shapes.

        Returns:
          The :class:`DiLoCoState`, bit for bit as saved.
        """
        import orbax.checkpoint as ocp

        return ocp.StandardCheckpointer().restore(path, self.state_shapes(params))

    # -- inside jit ----------------------------------------------------------------------------

    def _initial_state(self, params):
        avals = avals_of(params)
        plan = self.plan(avals)
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
            pending=tuple([jnp.zeros_like(x) for x in g] for g in groups) if self.delay else (),
            step=jnp.zeros((), jnp.int32),
        )

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
        plan = self.plan(self.check_state(state))
        with lowering_platform(self.compress_layout.platform):  # trace the mesh's branches only
            new_state, metrics = diloco_step(self, plan, state, batch)
        pairs = zip(state.compress_state, new_state.compress_state)
        probes = [divergence.trigger_probe(*map(find_compress_state, pair)) for pair in pairs]
        self._probe_names = [None if p is None else p[1:] for p in probes]
        return new_state, metrics, (new_state.step, [None if p is None else p[0] for p in probes])

    def _trigger_probes(self, args, out):
        """The outer compress's guardrail probes of a dispatched step, per fragment."""
        probes = [
            None if scalars is None else (scalars, *names)
            for scalars, names in zip(out[2][1], self._probe_names)
        ]
        return probes if any(p is not None for p in probes) else None

    def metric_specs(self):
        """The metrics' ``PartitionSpec`` s: per worker with ``worker_metrics``, else replicated."""
        loss = P(self.outer_axis) if self.worker_metrics else P()
        specs = {"loss": loss, "bytes_sent": P(), "synced": P()}
        return {**specs, "aux": loss} if self.has_aux else specs


def _tell_triggers(probes):
    for probe in probes:
        divergence.tell_trigger(probe)


def _refuse_inner_compress(inner_tx, avals):
    """inner_tx must not aggregate: a worker's inner steps are its own (and its inner axis's)."""
    if compress_states(jax.eval_shape(inner_tx.init, avals)):
        raise ValueError(
            "inner_tx holds a jaxcomp.compress: the inner steps of a diloco worker do not "
            "aggregate over the outer axis, and over inner_axis diloco averages the gradients "
            "itself (densely). Pass the plain optimizer, e.g. optax.adamw(4e-4)"
        )


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
    mixing: float | None = None,
    has_aux: bool = False,
    worker_metrics: bool = False,
    shard: str | None = None,
    exchange: str | None = None,
    max_steps_in_flight: int | None = DEFAULT_MAX_STEPS_IN_FLIGHT,
    donate: bool = False,
) -> DiLoCo:
    """DiLoCo: workers train alone for ``sync_every`` steps, then exchange compressed
    pseudo-gradients over the slow axis and take one outer step.

    Worker ``w`` (position ``w`` on ``outer_axis``) holds its own params and ``inner_tx`` state
    and takes one inner step per :attr:`DiLoCo.step` on its block of the batch. After every
    ``sync_every``-th inner step, each worker's pseudo-gradient ``delta_w = global - local_w`` goes
    through ``compress`` (averaged over ``outer_axis``, with error feedback: each worker keeps
    what it did not send in its residual), ``outer_tx`` applies the average to the global params
    (``global <- outer_tx(global, mean_w delta_w)``), and every worker restarts from the new
    global params; the inner optimizer states are kept. The sync is a ``lax.cond`` on the traced
    step counter inside the one compiled step: a step without a sync runs no collective over
    ``outer_axis`` at all (with ``worker_metrics=True`` not even the loss's mean), so it sends 0
    bytes there, and there is one compilation for both kinds of step.

    **Streaming** (``fragments=F``): the leaves of ``params`` (``jax.tree.leaves`` order) are
    split into F fragments, strided (leaf ``i`` in fragment ``i % F``, Streaming DiLoCo's strided
    pattern). Fragment ``f`` is exchanged after inner steps ``o_f, o_f + H, o_f + 2H, ...`` with
    ``o_f = (f + 1) * H // F``: each fragment every H steps, the exchanges spread evenly, so a
    sync moves about ``1/F`` of the params. Each fragment has its own compress state (residual)
    and outer optimizer state. **Delay** (``delay=tau``): a fragment's averaged pseudo-gradient,
    exchanged after step ``c``, is kept in the state and applied after step ``c + tau``; the
    workers, who kept training meanwhile, then mix: ``local <- mixing * local + (1 - mixing) *
    global`` (Streaming DiLoCo's merge; ``mixing`` defaults to 0.5). With ``delay=0`` the workers
    take the global params as they are. What overlaps: the step is one XLA program, so on
    XLA:CPU the exchange runs inside the step that starts it (its collectives are synchronous;
    the inner steps of the next ``tau`` calls run after it, not beside it). ``delay`` gives the
    algorithm Streaming DiLoCo analyses (the result lands ``tau`` steps late) bit for bit; the
    wall-clock overlap would need the collective to be started in one program and awaited in a
    later one, which XLA's async collectives do only within a program (on GPU they overlap the
    exchange with the same step's inner computation). docs/training.md, "DiLoCo", measures it.

    **Two-level mesh** (``inner_axis``): a worker is the row of devices at one position of
    ``outer_axis``; they split the worker's batch block and average their gradients over
    ``inner_axis`` every inner step (a dense all-reduce through :mod:`jaxcomp.collectives`, at the
    head of the inner chain: :func:`jaxcomp.training.inner.inner_mean`); with
    ``shard="optimizer"`` a reduce-scatter, each device updating its shards, and an all-gather of
    the params instead (ZeRO stage 1 over the row). The outer exchange is split over the row
    (``exchange="split"``): device ``i`` of every worker sends the ``i``-th block of each leaf
    to device ``i`` of the other workers, and the row all-gathers the averaged blocks, so the
    slow axis carries each value once per worker, not once per device (``bytes_sent`` is per
    device: the block's bytes).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), on one
        device's shard of the batch.
      inner_tx: each worker's optimizer, without any ``jaxcomp.compress``; default
        ``optax.adamw(4e-4, weight_decay=0.1)`` (the paper's inner learning rate and weight decay;
        add its warm-up and cosine schedule yourself). An ``optax.MultiSteps`` around it
        accumulates gradients inside the inner steps (``sync_every`` counts calls of ``step``,
        i.e. micro-steps; make it a multiple of the accumulation).
      outer_tx: the outer optimizer on the averaged pseudo-gradient; default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (the paper's). ``optax.sgd(1.0)`` is
        plain parameter averaging (FedAvg / local SGD); on short runs it did better here (1500
        steps of a small char-LM, 4 workers, H = 50: +8% held-out loss against data-parallel,
        the paper's +20%), and ``optax.sgd(1.0, momentum=0.3, nesterov=True)`` best of 12
        settings (+6%; docs/training.md, section 7).
      mesh: a ``jax.sharding.Mesh`` with ``outer_axis`` (and ``inner_axis``), no other axes; a
        1-device mesh is 1 worker.
      sync_every: H, inner steps between two exchanges of a fragment (>= 1).
      compress: how the pseudo-gradients travel: None (dense, exact), a
        :class:`jaxcomp.Method` (``jaxcomp.TopK(0.1)``), a shorthand name (``"ar_topk"``,
        ``"quantized"``, ``"auto"`` ...; built as ``jaxcomp.compress(name, axis_name=outer_axis)``,
        error feedback on), or an already-built ``jaxcomp.compress(..., axis_name=outer_axis)``
        (needed for options: ``jaxcomp.compress("auto", ratio=0.01, axis_name="workers",
        network=jaxcomp.Network(...))``; diloco does not probe the network for ``auto``).
      outer_axis: the slow mesh axis the workers lie on.
      inner_axis: the fast mesh axis each worker's inner steps are data-parallel over, or None.
      fragments: F, fragments of the params synced on a staggered schedule (1 <= F <= H, and at
        most the number of leaves).
      delay: tau, inner steps between a fragment's exchange and its application (0 <= tau < H).
      mixing: alpha of the delayed merge (in [0, 1]); only with ``delay > 0``; default 0.5.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` goes to the metrics like the loss.
      worker_metrics: report ``loss`` (and ``aux``) per worker, ``[n_workers]``, instead of the
        mean over all devices; then nothing crosses ``outer_axis`` outside a sync.
      shard: None, or ``"optimizer"`` (needs ``inner_axis``): ZeRO stage 1 over each worker's
        row, every device keeps the inner optimizer state of its ``1/n`` shard of each leaf
        (:mod:`jaxcomp.training.inner`); the worker's params stay whole on every device, as the
        outer exchange reads them. ``"params"`` is refused.
      exchange: how a two-level mesh's row sends the pseudo-gradient over ``outer_axis``:
        ``"split"`` (the default with ``inner_axis``): each device of the row sends only its
        ``1/n`` block of every leaf (along the leaf's longest axis, so a matrix stays a matrix)
        through ``compress`` with its own error-feedback residual, and the row all-gathers the
        averaged blocks: ``n`` times fewer bytes per device over the slow axis (a hierarchical
        all-reduce). ``"whole"``: every device sends all of it (the row's devices repeat the
        same exchange). Without ``inner_axis``: None or ``"whole"``.
      max_steps_in_flight: as :func:`jaxcomp.data_parallel`'s.
      donate: as :func:`jaxcomp.data_parallel`'s: ``step`` writes the new state (every worker's
        params and inner optimizer state, the global params, the outer states and residuals)
        over its input, which is deleted. Default False: a step that fails on a lost worker
        leaves its input, the last sync's global params, intact (docs/training.md, section 7).

    Returns:
      A :class:`DiLoCo`: ``init(params) -> DiLoCoState``, ``step(state, batch) -> (state,
      metrics)`` (jitted), ``shard_batch``, ``params(state)`` (the global params),
      ``worker_params(state)``, ``state_shapes(params)`` and ``restore(path, params)``. The
      metrics: ``loss`` (the mean over all devices of this inner step's loss), ``bytes_sent``
      (the bytes one device sent in this step's outer exchanges, from the compress's own
      ``bytes_sent``; 0 on a step without one: sum it over steps for the total, divide by the
      steps for the average), ``synced`` (bool: an exchange ran in this step) and ``aux``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("workers",))
      >>> loss = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
      >>> run = jaxcomp.diloco(loss, optax.sgd(0.1), mesh=mesh, sync_every=2,
      ...                      compress=jaxcomp.TopK(0.5))
      >>> state = run.init(jnp.zeros(3))
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
      >>> state, metrics = run.step(state, batch)
      >>> bool(metrics["synced"]), float(metrics["bytes_sent"])
      (False, 0.0)
      >>> state, metrics = run.step(state, batch)
      >>> bool(metrics["synced"]), float(metrics["bytes_sent"]) > 0
      (True, True)

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
      (arXiv 2311.08105), Alg. 1 (inner AdamW, outer Nesterov, pseudo-gradients); Douillard et
      al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512), fragments,
      delayed application and the mixing merge; Karimireddy et al., ICML 2019 (error feedback).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    inner_tx = optax.adamw(4e-4, weight_decay=0.1) if inner_tx is None else inner_tx
    if isinstance(inner_tx, optax.MultiSteps):
        inner_tx = inner_tx.gradient_transformation()
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer_tx is None else outer_tx
    for value, name in ((inner_tx, "inner_tx"), (outer_tx, "outer_tx")):
        if not isinstance(value, optax.GradientTransformation):
            raise TypeError(f"{name} must be an optax GradientTransformation, got {value!r}")
    mesh = _check_mesh(mesh, outer_axis, inner_axis)
    inner = Inner(
        inner_tx,
        mesh,
        outer_axis,
        inner_axis,
        _check_shard(shard, inner_axis),
        _check_exchange(exchange, inner_axis),
    )
    schedule = _check_schedule(sync_every, fragments, delay)
    mixing = _check_mixing(mixing, delay)
    compress_tx = _outer_compress(compress, outer_axis)
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be True or False, got {donate!r}")
    in_flight = _check_in_flight(max_steps_in_flight)
    options = (mixing, bool(has_aux), bool(worker_metrics), in_flight, donate)
    return DiLoCo(loss_fn, inner, outer_tx, compress_tx, mesh, schedule, options)


def _check_mesh(mesh, outer_axis, inner_axis):
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


def _check_shard(shard, inner_axis):
    """``shard`` checked: None, or "optimizer" on a two-level mesh."""
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
    return shard


def _check_exchange(exchange, inner_axis):
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
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_schedule(sync_every, fragments, delay):
    """``(H, F, tau)`` checked: H >= 1, 1 <= F <= H, 0 <= tau < H."""
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
    return sync_every, fragments, delay


def _check_mixing(mixing, delay):
    if mixing is None:
        return DEFAULT_MIXING
    if not delay:
        raise ValueError(
            "mixing applies to a delayed fragment (delay > 0); with delay=0 the workers restart "
            "from the global params"
        )
    if not 0.0 <= float(mixing) <= 1.0:
        raise ValueError(f"mixing must be in [0, 1], got {mixing!r}")
    return float(mixing)


def _check_in_flight(max_steps_in_flight):
    if max_steps_in_flight is None:
        return None
    return _positive_int(max_steps_in_flight, "max_steps_in_flight", 1)


def _outer_compress(compress, outer_axis):
    """The outer exchange as a transformation: built from None, a method or a name."""
    if compress is None:
        return make_compress(Dense(), axis_name=outer_axis)
    if isinstance(compress, (Method, str)):
        return make_compress(compress, axis_name=outer_axis)
    if isinstance(compress, optax.GradientTransformation):
        return compress
    raise TypeError(
        "compress must be None, a jaxcomp.Method, a method name or a jaxcomp.compress(...) "
        f"transformation, got {type(compress).__name__}"
    )
