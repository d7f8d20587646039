"""Data-parallel training with a compressing optax chain: :func:`data_parallel`
and :class:`DataParallel`.

The step is one ``jax.jit`` around one ``jax.shard_map`` over the data axis, in which each device
differentiates its own batch shard and nothing is all-reduced until :func:`jaxcomp.compress` runs
its collective. This module is the entry point; the pieces live beside it, one concept each:

- :mod:`.state`: :class:`TrainState` and the params a run accepts;
- :mod:`.layout`: what ``tx`` sees (the whole params or this device's shards) and where each
  leaf of the state lies on the mesh;
- :mod:`.restoring`: the state's shardings and shapes, resized and restored from a checkpoint;
- :mod:`.model_state`: a model's own state (``has_state=True``), averaged over the devices;
- :mod:`.mask`: which optimizer-state leaves differ per device (read off shard_map's types);
- :mod:`.step`: the step on each device, a pipeline of named stages;
- :mod:`.boundary`: many small state leaves cross the step's ``shard_map`` as a few arrays;
- :mod:`.dispatch`: how many steps may run ahead of the host;
- :mod:`.branches`: one compiled step per branch of the compress state, picked on the host;
- :mod:`.trial`: timing ``compress_auto``'s leading candidates' whole steps;
- :mod:`.reprobe`: measuring the network again for ``compress_auto``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.optim import pinning, sharding
from jaxcomp.optim.host import local_copy
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.state import compress_states, find_compress_state
from jaxcomp.training import _arguments as arguments
from jaxcomp.training import _telling as telling
from jaxcomp.training import boundary
from jaxcomp.training import model_state as model_states
from jaxcomp.training import reprobe as reprobing
from jaxcomp.training.branches import REPORT_DELAY, PinnedSteps, pinned_record, pinned_report
from jaxcomp.training.dispatch import DEFAULT_MAX_STEPS_IN_FLIGHT, BoundedStep
from jaxcomp.training.layout import Layout
from jaxcomp.training.restoring import Restoring
from jaxcomp.training.rollback import RollbackStep
from jaxcomp.training.state import TrainState, avals_of
from jaxcomp.training.step import train_step
from jaxcomp.training.trial import Trial, TrialSteps

#: ``data_parallel``'s default trial of ``compress_auto``'s leading candidates.
DEFAULT_TRIAL = Trial()

__all__ = ["DEFAULT_MAX_STEPS_IN_FLIGHT", "DataParallel", "TrainState", "data_parallel"]


class DataParallel(Restoring):
    """The object :func:`data_parallel` returns: ``init``, ``step``, ``shard_batch`` and ``params``
    (and :class:`~jaxcomp.training.restoring.Restoring`'s ``state_shapes``, ``resize``,
    ``restore``).

    Its ``layout`` (:class:`jaxcomp.training.layout.Layout`) says where each leaf of the state lies.
    """

    def __init__(
        self,
        loss_fn,
        tx,
        mesh,
        axis_name,
        has_aux,
        max_steps_in_flight=DEFAULT_MAX_STEPS_IN_FLIGHT,
        shard=None,
        gather_dtype=None,
        donate=False,
        host_branches=True,
        auto_trial=DEFAULT_TRIAL,
        rollback=None,
        nonfinite_updates="drop",
        has_state=False,
    ):
        self.loss_fn = loss_fn
        self.nonfinite_updates = nonfinite_updates
        self.has_aux = has_aux
        self.layout = Layout(tx, mesh, axis_name, shard, gather_dtype, has_state)
        self.max_steps_in_flight = max_steps_in_flight
        self.donate = donate
        # Set while tracing the step: tx holds a compress(nonfinite="raise"); the guardrail's
        # static part of a trigger probe (what its warning names).
        self._raises_on_nonfinite = False
        self._probe_names = None
        self._gather_params = {}  # the stored params' structure and shapes -> jitted gather
        self._trial_steps = TrialSteps(
            PinnedSteps(self._jit_step, REPORT_DELAY if host_branches else None),
            auto_trial if host_branches else None,
        )
        self.step = BoundedStep(
            self._trial_steps,
            max_steps_in_flight,
            self._check_nonfinite,
            (self._probe, telling.tell_step),
        )
        if rollback is not None:
            self.step = RollbackStep(self.step, rollback)

    tx = property(lambda self: self.layout.tx, doc="The optax transformation.")
    mesh = property(lambda self: self.layout.mesh, doc="The mesh (with Auto axes).")
    axis_name = property(lambda self: self.layout.axis_name, doc="The data axis or axes.")
    shard = property(lambda self: self.layout.shard, doc="The ``shard=`` mode.")
    gather_dtype = property(lambda self: self.layout.gather_dtype, doc="``gather_dtype``.")
    n_devices = property(lambda self: self.layout.n_devices, doc="Devices over the data axes.")
    has_state = property(lambda self: self.layout.has_state, doc="``has_state``.")

    # -- the public entry points ---------------------------------------------------------------

    def init(self, params, model_state=None) -> TrainState:
        """Lays out ``params`` over the mesh (replicated, or each device's shards with
        ``shard="params"``) and ``tx.init`` (per device where it differs per device).

        Args:
          params: pytree of float arrays, the whole params, the same on every process.
          model_state: with ``has_state=True``, the model's initial state (e.g. a linen model's
            ``variables["batch_stats"]``), replicated; required there, refused without it.

        Returns:
          A :class:`TrainState` with step 0.

        Raises:
          ValueError: ``model_state`` given where ``has_state=False``, or missing where True.
        """
        model_state = model_states.check_initial(model_state, self.has_state)
        avals = avals_of(params)
        self.layout.remember_shapes(avals)
        multi_process = jax.process_count() > 1

        def host_value(x):
            # jit reads numpy as "the same on every process"; a process-local jax.Array would not
            # be.
            if multi_process and isinstance(x, jax.Array) and x.is_fully_addressable:
                return np.asarray(x)
            if not multi_process and isinstance(x, jax.Array):
                return jax.device_put(x, NamedSharding(self.mesh, P()))
            return x

        params, model_state = jax.tree.map(host_value, (params, model_state))
        shardings = self.state_sharding(avals, model_state)
        state = jax.jit(self.layout.initial_state, out_shardings=shardings)(params, model_state)
        if reprobing.probe_axis(self.layout) is not None and any(
            s.auto is not None and not np.all(np.isfinite(np.asarray(local_copy(s.auto.network))))
            for s in compress_states(state.opt_state)
        ):
            state = self.reprobe(state)
        return state

    def params(self, state: TrainState):
        """The whole params of ``state``, replicated over the mesh: ``state.params`` itself, or with
        ``shard="params"`` its shards gathered (exactly, whatever ``gather_dtype``).

        Args:
          state: a :class:`TrainState` of this data_parallel.

        Returns:
          The params pytree, as :meth:`init` was given it.

        Raises:
          TypeError: ``state`` is not a :class:`TrainState`; ValueError: it is the state of another
          data_parallel (another ``tx``, ``shard=`` or mesh).
        """
        self.layout.check_state(state)
        if self.shard != "params":
            return state.params
        key = (
            jax.tree.structure(state.params),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(state.params)),
        )
        if key not in self._gather_params:  # one compile, not one per call (an eval loop)
            self._gather_params[key] = self._params_gather(state.params)
        return self._gather_params[key](state.params)[0]

    def _params_gather(self, stored_params):
        """A jitted function: the stored params' shards -> ``(whole params,)``."""
        avals = self.layout.whole_avals(stored_params)

        def gather(stored):
            return sharding.gather_whole(
                jax.tree.map(lambda s: s[0], stored), avals, self.axis_name
            )

        gathered = boundary.packed_shard_map(
            lambda stored: (gather(stored),),
            mesh=self.mesh,
            in_specs=(jax.tree.map(lambda _: P(self.axis_name), avals),),
            out_specs=(jax.tree.map(lambda _: P(), avals),),
            in_avals=stored_params,
            out_avals=avals,
        )
        return jax.jit(gathered)

    def reprobe(self, state: TrainState, *, codec: bool = True, **probe_options) -> TrainState:
        """Measures the network (and each branch's local work) again and hands them to
        ``compress_auto``.

        :meth:`init` calls it when a :func:`jaxcomp.compress_auto` has no ``network=``. Call it from
        every process, between steps, as often as the network may change (say every few hundred
        steps); ``compress_auto`` re-decides at its next step when latency or bandwidth moved by 10%
        or more. The first axis of ``axis_name`` with 2 or more devices is probed (the slow one
        for ``("node", "device")``); with a single device :meth:`init` does not probe.

        Args:
          state: the :class:`TrainState`.
          codec: also time each branch's local work as the method asks
            (:func:`jaxcomp.optim.timing.overhead_seconds`, on every device at once; the slowest
            process's time counts) so that compute enters the choice, as in paper 002's model.
          **probe_options: passed to :func:`jaxcomp.probe_network` (``sizes``, ``repeats``); it
            always measures anew (``cache=False``).

        Returns:
          The state with the new network in every ``compress_auto`` state.

        Example:
          >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
          >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
          >>> tx = optax.chain(
          ...     jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)]), optax.sgd(0.1)
          ... )
          >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
          >>> state = dp.reprobe(dp.init(jnp.zeros(4)), codec=False)
          >>> bool(jaxcomp.find_compress_state(state.opt_state).auto.network[1] > 0)
          True

        References:
          Tyagi & Swany, arXiv 2312.02493, §3-E (re-measure α and β, re-decide); Agarwal et al.,
          MLSys 2022, §3.1 (encode/decode time in the step).
        """
        state = reprobing.remeasure(self.layout, state, codec=codec, **probe_options)
        self._trial_steps.restart()  # the measured steps were cleared: time them again
        return state

    def shard_batch(self, batch):
        """Builds the global batch from this process's rows (all rows when there is one process).

        Args:
          batch: pytree of arrays whose leading axis is this process's share of the global batch.

        Returns:
          The same pytree as global arrays split over the data axis, ready for :attr:`step`.
        """
        sharding = NamedSharding(self.mesh, P(self.axis_name))
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
        )

    # -- the step ------------------------------------------------------------------------------

    def _jit_step(self, branch):
        """The jitted step that runs ``branch`` of the compress state (None: the device
        chooses), for :class:`PinnedSteps`."""
        step = functools.partial(self._step, branch=branch)
        return jax.jit(step, donate_argnums=(0,) if self.donate else ())

    def _step(self, state: TrainState, batch, branch=None):
        """``(state, metrics, watch)``: :func:`train_step`'s two, and what the host reads of the
        step once it has run (:class:`BoundedStep`, :class:`PinnedSteps`): the new step counter,
        the guardrail's trigger scalars and the branch asked for next, outputs of their own, so
        that nothing the host reads late is a leaf of a state the next step may donate."""
        telling.tell_of_a_long_compile(len(jax.tree.leaves(state)))
        record = None if branch is None else pinned_record(state.opt_state)
        with pinning.pinned(branch, record):
            new_state, metrics = train_step(
                self.layout,
                self.loss_fn,
                self.has_aux,
                state,
                batch,
                self._note_nonfinite_policy,
                self.nonfinite_updates,
            )
        probe = divergence.trigger_probe(
            find_compress_state(state.opt_state), find_compress_state(new_state.opt_state)
        )
        self._probe_names = None if probe is None else probe[1:]
        report = None if branch is None else pinned_report(new_state.opt_state)
        scalars = None if probe is None else probe[0]
        return new_state, metrics, (new_state.step, scalars, report, metrics.get("rejected"))

    def _probe(self, args, out):
        """What the host reads of a dispatched step once it has run, from the step's own
        outputs: the guardrail's probe (:func:`.divergence.trigger_probe`), and the new step
        counter with the flag of an update that was rejected as not finite."""
        scalars = out[2][1]
        trigger = None if scalars is None else (scalars, *self._probe_names)
        return trigger, (out[2][0], out[2][3])

    def _note_nonfinite_policy(self, raises: bool):
        self._raises_on_nonfinite = raises

    def _check_nonfinite(self, state, metrics):
        """``compress(nonfinite="raise")``: a step whose gradients held NaN or Inf raises here,
        with the state the step returned (params and optimizer state unchanged) as the error's
        ``state``."""
        if not self._raises_on_nonfinite:
            return
        count = float(metrics["nonfinite"])  # waits for this step: "raise" runs one step at a time
        if count:
            step = int(local_copy(state.step)) - 1
            error = telling.nonfinite_error(step, count, self.donate)
            error.state = state
            raise error


def data_parallel(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name="data",
    *,
    has_aux: bool = False,
    max_steps_in_flight: int | None = DEFAULT_MAX_STEPS_IN_FLIGHT,
    shard: str | None = None,
    gather_dtype=None,
    donate: bool = False,
    host_branches: bool = True,
    auto_trial: Trial | None = DEFAULT_TRIAL,
    rollback: int | None = None,
    nonfinite_updates: str = "drop",
    has_state: bool = False,
) -> DataParallel:
    """A data-parallel training step around a compressing optax chain.

    Each device differentiates its batch shard, ``tx`` aggregates (docs/training.md, section 2).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's shard.
      tx: an optax transformation; one without a ``jaxcomp.compress`` is averaged densely first.
      mesh: a ``jax.sharding.Mesh`` with ``axis_name`` (every device of every process).
      axis_name: the data axis, or a tuple of axes; the batch is split over all of them.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux``, averaged, goes to the metrics.
      max_steps_in_flight: dispatched steps that may still run when ``step`` returns (default 8).
      shard: None (default), ``"optimizer"`` (ZeRO-1/2) or ``"params"`` (ZeRO-3 / FSDP).
      gather_dtype: with ``shard="params"``, the dtype the params are gathered in (default theirs).
      donate: ``step`` writes its new state over its input, which is deleted (default False).
      host_branches: pick a switching compress state's branch on the host (default True).
      auto_trial: how ``compress_auto``'s leading candidates' steps are timed (None: not at all).
      rollback: every how many steps a state to roll back to is kept (default None: none).
      nonfinite_updates: ``"drop"`` (default: a non-finite entry keeps its value) or ``"skip"``.
      has_state: ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, averaged.

    Returns:
      A :class:`DataParallel` with ``init(params)`` and ``step(state, batch) -> (state, metrics)``.

    Raises:
      ValueError: an option out of range; TypeError: an argument of the wrong kind.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), tx, mesh)
      >>> n = 8 * jax.device_count()
      >>> state, metrics = dp.step(dp.init(jnp.zeros(3)), {"x": jnp.ones((n, 3)), "y": jnp.ones(n)})
      >>> float(metrics["loss"])
      1.0

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals, replicated model);
      Rajbhandari et al., "ZeRO", SC 2020; Wang et al., "ZeRO++", ICLR 2024 (quantized gather).
    """
    if shard not in sharding.SHARD_MODES:
        raise ValueError(f"shard must be None, 'optimizer' or 'params', got {shard!r}")
    gather_dtype = arguments.check_gather_dtype(gather_dtype, shard)
    tx = arguments.accumulating(tx, shard)
    flags = {"donate": donate, "host_branches": host_branches, "has_state": has_state}
    arguments.check_kinds(loss_fn, tx, mesh, auto_trial, **flags)
    axis_name = arguments.data_axes(mesh, axis_name)
    return DataParallel(
        loss_fn,
        tx,
        arguments.auto_axes(mesh),
        axis_name,
        bool(has_aux),
        arguments.check_max_steps_in_flight(max_steps_in_flight),
        shard,
        gather_dtype,
        donate,
        host_branches,
        auto_trial,
        arguments.check_rollback(rollback, donate),
        arguments.check_nonfinite_updates(nonfinite_updates),
        has_state,
    )
