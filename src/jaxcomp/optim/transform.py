"""The optax transformation :func:`compress`: compressed gradient aggregation with error feedback.

``compress`` goes first in an ``optax.chain``; its ``update`` runs inside ``jax.shard_map`` on the
data axis, takes this device's local gradients and returns the aggregated (by default averaged)
gradients, identical on every device, for the rest of the chain::

    tx = optax.chain(jaxcomp.compress(jaxcomp.TopK(0.01, collective="ar"), axis_name="data"), optax.adam(1e-3))

The method is a :mod:`jaxcomp.methods` object; this module knows none by name. The error-feedback
machinery (:func:`feedback_transformation`) is shared with :func:`jaxcomp.compress_auto`, which
runs one of several methods per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import methods
from jaxcomp.costmodel import ratio_choice
from jaxcomp.methods import Method
from jaxcomp.ops import _checks, _ffi, flat
from jaxcomp.optim import sharding
from jaxcomp.optim.nonfinite import NONFINITE_POLICIES, NonfinitePolicy

#: How gradients are grouped before compression: the whole model as one vector, or leaf by leaf.
GRANULARITIES = ("model", "leaf")


class CompressMetrics(NamedTuple):
    """What the last :func:`compress` update measured (scalars, identical on every device).

    ``gain`` is measured on what was aggregated: non-finite entries count as 0 there, and a sum
    that overflowed makes it NaN or Inf rather than a plausible number.
    """

    gain: (
        jax.Array
    )  # f32[]: compression gain sum_d ||sent_d||^2 / sum_d ||g_e,d||^2 (1 when g_e = 0)
    bytes_sent: jax.Array  # f32[]: bytes one device sends in this step's collectives
    density: (
        jax.Array
    )  # f32[]: fraction of gradient entries whose values are sent (1 for dense/zfp/quantized)
    method: (
        jax.Array
    )  # i32[]: the method that ran, an index into CompressState.methods (0 for compress)
    nonfinite: jax.Array  # f32[]: non-finite (NaN, ±Inf) gradient entries this step, summed over the devices (exact below 2**24)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Branches:
    """The methods a compress state can run, as static structure (no array): one for
    :func:`compress`, one per branch for :func:`jaxcomp.compress_auto`. The ``method`` metric
    indexes it; host code reads it without waiting for a device."""

    methods: tuple[Method, ...]


class CompressState(NamedTuple):
    """State of :func:`compress` and :func:`jaxcomp.compress_auto`. ``residual`` differs per device;
    the other fields are replicated."""

    residual: Any  # like the gradients: f32 array of the leaf's shape per float leaf (error not yet sent), optax.MaskedNode() elsewhere
    step: jax.Array  # i32[]: updates done so far; picks ar_topk's STAR leader, seeds the quantizer
    key: jax.Array  # u32[2] (the default PRNG's raw key): step t draws from fold_in(key, t)
    metrics: CompressMetrics
    auto: Any = None  # jaxcomp.AutoState for compress_auto, else None
    policy: NonfinitePolicy = NonfinitePolicy("zero")  # static: the nonfinite= policy (no array)
    branches: Branches = Branches(())  # static: the methods the `method` metric indexes
    velocity: Any = (
        None  # with momentum_correction: like residual, DGC's momentum per device; else None
    )
    method_state: Any = ()  # per method of `methods`: its own state (PowerSGD's Q per group), or None

    @property
    def methods(self) -> tuple[Method, ...]:
        """The methods this state runs; ``metrics.method`` is an index into them."""
        return self.branches.methods


@dataclasses.dataclass(frozen=True)
class FeedbackConfig:
    """The validated arguments every error-feedback transformation shares (see :func:`compress`)."""

    axes: tuple[str, ...]
    error_feedback: bool = True
    granularity: str = "model"
    mean: bool = True
    seed: int = 0
    nonfinite: str = "zero"
    mask: Any = dataclasses.field(
        default=None, compare=False
    )  # None, a pytree of bools or a callable
    min_size: int = 0
    momentum: float | None = None  # DGC's momentum correction

    @property
    def axis_name(self):
        """The axis, or the tuple of axes, the collectives reduce over."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @classmethod
    def check(
        cls,
        axis_name,
        error_feedback,
        granularity,
        mean,
        seed,
        nonfinite,
        mask=None,
        min_size=0,
        momentum=None,
    ) -> FeedbackConfig:
        """Validates the shared arguments, naming the one that is wrong."""
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        if (
            not axes
            or not all(isinstance(a, str) and a for a in axes)
            or len(set(axes)) != len(axes)
        ):
            raise ValueError(
                f"axis_name must be a mesh axis name or a tuple of distinct ones, got {axis_name!r}"
            )
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be 'model' or 'leaf', got {granularity!r}")
        for flag, name in ((error_feedback, "error_feedback"), (mean, "mean")):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        seed = _checks.static_int(
            seed, "seed", 0, 2**32 - 1
        )  # PRNGKey keeps 32 bits: 2**32 would be seed 0
        if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE_POLICIES} (what to do with NaN/Inf gradient "
                f"entries), got {nonfinite!r}"
            )
        min_size = _checks.static_int(min_size, "min_size", 0)
        if momentum is not None:
            if (
                isinstance(momentum, bool)
                or not isinstance(momentum, (int, float))
                or not 0 <= momentum < 1
            ):
                raise ValueError(
                    f"momentum_correction must be a momentum in [0, 1) (e.g. 0.9) or None, got "
                    f"{momentum!r}"
                )
            momentum = float(momentum)
        return cls(
            axes=axes,
            error_feedback=bool(error_feedback),
            granularity=granularity,
            mean=bool(mean),
            seed=seed,
            nonfinite=nonfinite,
            mask=mask,
            min_size=min_size,
            momentum=momentum,
        )

    def compressed(self, tree) -> list[bool]:
        """Per leaf of ``tree`` (params or gradients): whether ``mask`` and ``min_size`` let it be
        compressed; the other float leaves are summed as they are, in one fused all-reduce.
        Raises a ValueError naming ``mask`` when it does not fit ``tree``."""
        leaves, treedef = jax.tree.flatten(tree)
        if self.mask is None:
            chosen = [True] * len(leaves)
        else:
            mask = self.mask(tree) if callable(self.mask) else self.mask
            try:
                chosen = treedef.flatten_up_to(mask)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"mask must have the structure of the params (a pytree of bools, or a callable "
                    f"returning one): {e}"
                ) from None
            bad = [m for m in chosen if not isinstance(m, (bool, np.bool_))]
            if bad:
                raise ValueError(
                    f"mask must hold Python bools (True: compress the leaf), got {bad[0]!r}"
                )
        return [bool(m) and leaf.size >= self.min_size for m, leaf in zip(chosen, leaves)]


class Groups(NamedTuple):
    """What one update aggregates: the error-fed vectors of its groups (one for the model, one per
    leaf), with what a method's static cost needs to know about them."""

    vectors: list  # 1-D, in the dtype the collectives carry
    names: list  # "the model" or "leaf i", for error messages
    sizes: list  # values per vector
    n_devices: int  # devices over all of the config's axes
    inner_size: (
        int | None
    )  # devices of the last axis when there are two (hierarchical top-k's node)
    dtype_bytes: int  # bytes per value on the wire
    shapes: list | None = (
        None  # per vector: the shapes of the leaves it is made of (stateful methods)
    )
    scatter: bool = (
        False  # sharded training: vectors are shard-major and each device gets its row of the sum
    )
    values: list | None = None  # with scatter: the real values per vector (the rest is padding)


def _shaped(method: Method, groups: Groups, i: int) -> dict:
    """The ``shapes=`` keyword a stateful method's calls take for group ``i``."""
    return {"shapes": groups.shapes[i]} if method.stateful else {}


def static_cost(method: Method, groups: Groups) -> tuple[float, int, int]:
    """(bytes one device sends, values kept, sequential message steps) of ``method`` over the groups.

    Args:
      method: a :mod:`jaxcomp.methods` object.
      groups: the update's :class:`Groups`.

    Returns:
      ``(bytes, kept, steps)`` summed over the groups.

    Example:
      >>> from jaxcomp.methods import Dense
      >>> static_cost(Dense(), Groups([None], ["the model"], [1000], 8, None, 4))
      (7000.0, 1000, 14)

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I.
    """
    sent, kept, steps = 0.0, 0, 0
    for i, (n, name) in enumerate(
        zip(groups.values if groups.scatter else groups.sizes, groups.names)
    ):
        shaped = _shaped(method, groups, i)
        if groups.scatter:  # sharded training: the reduce-scatter form, on the real values
            sent += method.reduce_scatter_bytes(n, groups.n_devices, dtype_bytes=groups.dtype_bytes)
            steps += method.reduce_scatter_steps(groups.n_devices)
        else:
            sent += method.wire_bytes(
                n,
                groups.n_devices,
                dtype_bytes=groups.dtype_bytes,
                inner_size=groups.inner_size,
                **shaped,
            )
            steps += method.message_steps(groups.n_devices, inner_size=groups.inner_size)
        kept += _kept(method, n, name, shaped)
    return sent, kept, steps


def _kept(method: Method, n: int, name: str, shaped: dict) -> int:
    try:
        return method.kept(n, **shaped)
    except ValueError as e:
        raise ValueError(f"{e} (in {name})") from None


def aggregate_groups(
    method: Method, groups: Groups, axis_name, step, base_key, sparse: bool = False, states=None
):
    """Runs ``method`` on each group's vector: ``(totals, sents, states)``, one per group
    (``sparse``: each ``sent`` is ``(indices, values)``). Group ``i`` draws its randomness from
    ``fold_in(base_key, i)``.

    Args:
      method: a :mod:`jaxcomp.methods` object.
      groups: the update's :class:`Groups` (inside ``shard_map``).
      axis_name: the axis or axes to reduce over.
      step: the training step, replicated.
      base_key: this step's key, replicated.
      sparse: ask for ``(indices, values)`` sents (methods with ``sparse``).
      states: with a :attr:`~jaxcomp.methods.Method.stateful` method, its state per group (from
        :func:`init_method_state`); None otherwise.

    Returns:
      ``(totals, sents, states)``: one total and sent per group, and the method's new states (the
      ``states`` given, for a method without state).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.methods import Dense
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(x):
      ...     groups = Groups([x], ["the model"], [x.shape[0]], 2, None, 4)
      ...     return aggregate_groups(Dense(), groups, "data", 0, jax.random.key(0))[0][0]
      >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (each worker's contribution and the aggregate).
    """
    totals, sents, new_states = [], [], []
    for i, (vector, name) in enumerate(zip(groups.vectors, groups.names)):
        key = jax.random.fold_in(base_key, i)
        if groups.scatter:
            _kept(method, groups.values[i], name, {})
            total, sent = method.reduce_scatter(
                vector, axis_name, step=step, key=key, size=groups.values[i], sparse=sparse
            )
            totals.append(total)
            sents.append(sent)
            continue
        _kept(method, vector.shape[0], name, _shaped(method, groups, i))
        total, sent, state = method.aggregate(
            vector,
            axis_name,
            step=step,
            key=key,
            sparse=sparse,
            state=states[i] if method.stateful else None,
            **_shaped(method, groups, i),
        )
        new_states.append(state)
        totals.append(total)
        sents.append(sent)
    return totals, sents, tuple(new_states) if method.stateful else states


def init_method_state(methods_run: tuple[Method, ...], shapes: list) -> tuple:
    """The methods' own state (:attr:`CompressState.method_state`): per method, a tuple with its
    :meth:`~jaxcomp.methods.Method.init_state` per group of leaves (``shapes``: per group, the
    shapes of its leaves), or None for a method without state.

    Args:
      methods_run: the transformation's methods (its branches).
      shapes: per group, the tuple of its leaves' shapes.

    Returns:
      A tuple, one entry per method.

    Example:
      >>> from jaxcomp.methods import Dense, PowerSGD
      >>> state = init_method_state((Dense(), PowerSGD(2)), [((32, 16), (16,))])
      >>> state[0], [q.shape for q in state[1][0]]
      (None, [(16, 2)])

    References:
      Vogels et al., "PowerSGD", NeurIPS 2019, Alg. 1 (the warm-started Q a step keeps).
    """
    out = []
    for method in methods_run:
        if not method.stateful:
            out.append(None)
            continue
        group_states = []
        for i, group in enumerate(shapes):
            try:
                group_states.append(method.init_state(group))
            except ValueError as e:
                raise ValueError(
                    f"{method.describe()}: {e}" + (f" (in group {i})" if len(shapes) > 1 else "")
                ) from None
        out.append(tuple(group_states))
    return tuple(out)


def run_branch(
    branches: tuple[Method, ...],
    branch,
    groups: Groups,
    axis_name,
    step,
    key,
    sparse: bool,
    states: tuple,
):
    """Runs the method ``branches[branch]`` on the groups, ``branch`` static or traced
    (``lax.switch``: every branch is compiled, one runs). Each branch updates its own entry of
    ``states`` (:attr:`CompressState.method_state`) and passes the others through.

    Args:
      branches: the methods.
      branch: a Python int, or an int32 scalar (replicated).
      groups: the update's :class:`Groups`.
      axis_name: the axis or axes to reduce over.
      step: the training step.
      key: this step's key.
      sparse: ask for ``(indices, values)`` sents (only with a static ``branch``).
      states: the methods' states, one entry per branch.

    Returns:
      ``(totals, sents, states)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.methods import Dense
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(x):
      ...     groups = Groups([x], ["the model"], [x.shape[0]], 2, None, 4)
      ...     return run_branch((Dense(),), 0, groups, "data", 0, jax.random.key(0), False, (None,))[0][0]
      >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (one collective chosen per step).
    """

    def run(index):
        def branch_fn(vectors, step, key, states):
            totals, sents, own = aggregate_groups(
                branches[index],
                groups._replace(vectors=vectors),
                axis_name,
                step,
                key,
                sparse=sparse,
                states=states[index],
            )
            return totals, sents, states[:index] + (own,) + states[index + 1 :]

        return branch_fn

    if isinstance(branch, int):
        return run(branch)(groups.vectors, step, key, states)
    return jax.lax.switch(
        branch, [run(i) for i in range(len(branches))], groups.vectors, step, key, states
    )


class Aggregation(NamedTuple):
    """What a transformation's aggregation step returns to :func:`feedback_transformation`."""

    totals: list  # per group: the sum over the devices
    sents: list  # per group: this device's contribution (dense, or (indices, values) with sparse)
    bytes_sent: Any  # f32[] or float: bytes one device sent
    kept: Any  # values whose content was sent
    method: Any  # i32[] or int: index into the state's methods
    sparse: bool  # sents are (indices, values) pairs
    sends_everything: bool  # statically nothing lost: no residual, gain 1
    method_state: Any = ()  # the methods' new states (CompressState.method_state)


def feedback_transformation(
    config: FeedbackConfig,
    branches: tuple[Method, ...],
    keeps_residual: bool,
    aggregate: Callable,
    init_auto: Callable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The error-feedback transformation around an aggregation step (what :func:`compress` and
    :func:`jaxcomp.compress_auto` build on).

    Args:
      config: the shared arguments.
      branches: the methods the state records (:attr:`CompressState.methods`).
      keeps_residual: whether the state keeps a residual (error feedback that can lose anything).
      aggregate: ``(groups, state) -> (Aggregation, auto_after)`` run inside the update, where
        ``auto_after(gain)`` returns the new auto state (or is None).
      init_auto: ``() -> auto state`` for the state's ``auto`` field, or None.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = compress(methods.Dense())  # built on this
      >>> tx.init({"w": jnp.zeros(3)}).methods
      (Dense(allreduce='ring'),)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (error feedback).
    """
    c = config
    uses_auto = init_auto is not None
    policy = NonfinitePolicy(c.nonfinite)
    branches = tuple(branches)
    sends_everything = all(m.sends_everything for m in branches)

    def init_fn(params):
        if sharding.active() is not None:
            _check_scatters(branches)
        leaves, treedef = jax.tree.flatten(params)
        lay = _layout(c, params, sends_everything)
        compressed = {i for positions, _ in lay.groups for i in positions}

        def per_compressed_leaf(keep):
            return treedef.unflatten(
                [
                    jnp.zeros(leaf.shape, jnp.float32)
                    if keep and i in compressed
                    else optax.MaskedNode()
                    for i, leaf in enumerate(leaves)
                ]
            )

        shapes = [tuple(leaves[i].shape for i in positions) for positions, _ in lay.groups]
        return CompressState(
            residual=per_compressed_leaf(keeps_residual and not sends_everything),
            step=jnp.zeros((), jnp.int32),
            key=jax.random.PRNGKey(c.seed),
            metrics=_init_metrics(),
            auto=init_auto() if uses_auto else None,
            policy=policy,
            branches=Branches(branches),
            velocity=per_compressed_leaf(True) if c.momentum is not None else None,
            method_state=init_method_state(branches, shapes),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        try:
            residuals = treedef.flatten_up_to(state.residual)
            velocities = treedef.flatten_up_to(state.velocity) if c.momentum is not None else None
        except (ValueError, TypeError) as e:
            raise ValueError(
                "updates do not have the structure of the params compress was initialized with: "
                f"{e}"
            ) from None
        if uses_auto != (state.auto is not None) or state.branches != Branches(branches):
            raise ValueError(
                f"state was not made by this transformation's init (it runs "
                f"{[m.describe() for m in state.methods]}, this one {[m.describe() for m in branches]})"
            )
        if state.policy != policy:
            raise ValueError(
                f"state was made by a compress(nonfinite={state.policy.name!r}), not by this "
                f"compress(nonfinite={c.nonfinite!r})'s init"
            )
        lay = _layout(c, updates, sends_everything)
        floats = lay.floats
        if not floats:
            return updates, state
        compressed = {i for positions, _ in lay.groups for i in positions}
        kept_per_leaf = residuals if keeps_residual and not sends_everything else velocities
        if kept_per_leaf is not None and any(
            isinstance(kept_per_leaf[i], optax.MaskedNode) == (i in compressed) for i in floats
        ):
            raise ValueError(
                "mask and min_size choose other leaves to compress for these updates than for the "
                "params init saw: give a mask that depends on the params' structure and shapes only"
            )
        axis_sizes = [_bound_axis_size(a) for a in c.axes]
        n_devices = math.prod(axis_sizes)
        shards = _shards(c, branches, n_devices)  # sharded training: N, else None
        _check_local_gradients(c, [leaves[i] for i in floats])
        comm_dtype = _comm_dtype([leaves[i] for i in floats])

        groups = Groups(
            vectors=[],
            names=[name for _, name in lay.groups],
            sizes=[],
            n_devices=n_devices,
            inner_size=axis_sizes[-1] if len(axis_sizes) == 2 else None,
            dtype_bytes=jnp.dtype(comm_dtype).itemsize,
            shapes=[tuple(leaves[i].shape for i in positions) for positions, _ in lay.groups],
            scatter=shards is not None,
            values=[sum(leaves[i].size for i in positions) for positions, _ in lay.groups],
        )
        scale = 1.0 / n_devices if c.mean else 1.0
        rows = [
            _row(branches, [leaves[i] for i in positions], shards) for positions, _ in lay.groups
        ]
        out = list(leaves)
        plain_bytes, plain_kept = 0.0, 0
        if sends_everything and not uses_auto:
            # Nothing is lost, so nothing is kept: sum the gradients as they are and look at the
            # sum. A NaN or Inf on any device reaches the sum, so a finite sum proves every entry
            # was finite, for one pass over the total instead of a where and a count over every
            # gradient. Only a step whose sum is not finite (rare) sums again with the non-finite
            # entries zeroed and counts them; every device takes the same branch (the sum is
            # replicated; sharded, each device sees its shards only, so one all-reduce of a flag
            # makes them agree).
            vectors = [
                _pack([leaves[i]], shards, row).astype(comm_dtype) for i, row in zip(floats, rows)
            ]
            groups = groups._replace(vectors=vectors, sizes=[v.shape[0] for v in vectors])
            result, auto_after = aggregate(groups, state)
            finite = functools.reduce(
                jnp.logical_and, [jnp.all(jnp.isfinite(t)) for t in result.totals]
            )
            if shards is not None:
                finite = jax.lax.pmin(finite.astype(jnp.int32), c.axis_name) > 0

            def cleaned(vectors):
                zeroed = [jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v)) for v in vectors]
                again, _ = aggregate(groups._replace(vectors=zeroed), state)
                count = sum(flat.count_nonfinite(v) for v in vectors)
                return again.totals, jax.lax.psum(count, c.axis_name)

            totals, bad = jax.lax.cond(
                finite, lambda v: (result.totals, jnp.zeros((), jnp.float32)), cleaned, vectors
            )
            result = result._replace(totals=totals)
            feds = [None] * len(totals)
            gain = jnp.ones((), jnp.float32)  # everything is sent
        else:
            # Non-finite entries (NaN, ±Inf) count as 0 before anything else sees them: never sent,
            # never stored in the residual (NaN - NaN would stay NaN forever), and the residual's
            # own entry at that index is kept. The where fuses into the error-feedback add; the
            # count is one reduction over the same values.
            bad_counts, momenta = [], {}

            def finite_part(i):
                bad_counts.append(flat.count_nonfinite(leaves[i]))
                return flat.finite_values(leaves[i])

            def error_fed(i):
                g = finite_part(i)
                if c.momentum is not None:  # DGC: u = m u + g accumulates into the residual
                    g = momenta[i] = c.momentum * velocities[i] + g
                return g + residuals[i] if keeps_residual else g

            def packed(positions, row):
                """The error-fed vector of a group (for the model: all its leaves joined)."""
                if shards is not None or c.momentum is not None:
                    return _pack([error_fed(i) for i in positions], shards, row)
                # One pass on the CPU: the non-finite select, the residual's add and the join.
                fed, bad = flat.pack_error_fed(
                    [leaves[i] for i in positions],
                    [residuals[i] for i in positions] if keeps_residual else None,
                )
                bad_counts.append(bad)
                return fed

            feds = [packed(positions, row) for (positions, _), row in zip(lay.groups, rows)]
            if lay.plain:
                # The leaves mask= and min_size= leave out: summed as they are, in one all-reduce
                # (with shards: one reduce-scatter).
                parts = [finite_part(i) for i in lay.plain]
                plain = _pack(parts, shards, _row((), parts, shards)).astype(comm_dtype)
                plain_kept = sum(leaves[i].size for i in lay.plain)
                if shards is None:
                    plain_total = jax.lax.psum(plain, c.axis_name)
                    plain_bytes = _DENSE.wire_bytes(
                        plain_kept, n_devices, dtype_bytes=groups.dtype_bytes
                    )
                else:
                    plain_total = jax.lax.psum_scatter(
                        plain, c.axis_name, scatter_dimension=0, tiled=True
                    )
                    plain_bytes = _DENSE.reduce_scatter_bytes(
                        plain_kept, n_devices, dtype_bytes=groups.dtype_bytes
                    )
                _write(out, leaves, lay.plain, plain_total, scale, None, shards)
            if feds:
                vectors = [fed.astype(comm_dtype) for fed in feds]
                groups = groups._replace(vectors=vectors, sizes=[v.shape[0] for v in vectors])
                result, auto_after = aggregate(groups, state)
            else:  # every leaf is plain
                result = Aggregation([], [], 0.0, 0, 0, False, True, state.method_state)
                auto_after = None
            bad = sum(bad_counts)
            if result.sends_everything:
                gain = jnp.ones((), jnp.float32)
                bad = jax.lax.psum(bad, c.axis_name)
            else:
                # sum_d ||sent_d||^2, sum_d ||g_e,d||^2 and the non-finite count: one psum of 3 scalars.
                sent_sq = sum(_square(sent[1] if result.sparse else sent) for sent in result.sents)
                fed_sq = sum(_square(fed) for fed in feds)
                sent_sq, fed_sq, bad = jax.lax.psum(jnp.stack([sent_sq, fed_sq, bad]), c.axis_name)
                # 1 only when there was nothing to send; a sum that overflowed reports NaN or Inf.
                gain = ratio_choice.gain_from_energies(sent_sq, fed_sq)
        # "skip" and "raise": every device got the same psum'd count, so all skip together.
        skipped = (bad > 0) if c.nonfinite != "zero" else None

        new_residuals = list(residuals)
        new_velocities = list(velocities) if velocities is not None else None
        for (positions, _), row, fed, total, sent in zip(
            lay.groups, rows, feds, result.totals, result.sents
        ):
            _write(out, leaves, positions, total, scale, skipped, shards)
            if result.sends_everything:
                continue  # everything was sent: no residual
            if result.sparse:
                indices, values = sent
                # fed[i] + (-v) is fed[i] - v exactly: the same residual as fed - dense(sent).
                remaining = fed.at[indices].add(
                    -values.astype(jnp.float32), mode="drop", unique_indices=True
                )
            else:
                remaining = fed - sent.astype(jnp.float32)
            if keeps_residual:
                _keep(new_residuals, residuals, leaves, positions, remaining, skipped, shards)
            if c.momentum is not None:
                # DGC's momentum factor masking: what was sent leaves the momentum too.
                u = _pack([momenta[i] for i in positions], shards, row)
                u = (
                    u.at[indices].set(0.0, mode="drop", unique_indices=True)
                    if result.sparse
                    else jnp.where(sent != 0, 0.0, u)
                )
                _keep(new_velocities, velocities, leaves, positions, u, skipped, shards)

        total_size = sum(leaves[i].size for i in floats)
        metrics = CompressMetrics(
            gain=gain,
            bytes_sent=jnp.asarray(result.bytes_sent + plain_bytes, jnp.float32),
            density=jnp.asarray((result.kept + plain_kept) / total_size, jnp.float32),
            method=jnp.asarray(result.method, jnp.int32),
            nonfinite=bad,
        )
        new_auto = auto_after(gain) if auto_after is not None else state.auto
        method_state = result.method_state
        step = state.step + 1
        if skipped is not None:
            # A skipped step leaves the state as it was (only the metrics report it).
            step = jnp.where(skipped, state.step, step)
            new_auto = ratio_choice.where_tree(skipped, state.auto, new_auto) if uses_auto else None
            method_state = ratio_choice.where_tree(skipped, state.method_state, method_state)
        new_state = state._replace(
            residual=treedef.unflatten(new_residuals),
            step=step,
            metrics=metrics,
            auto=new_auto,
            method_state=method_state,
            velocity=treedef.unflatten(new_velocities) if velocities is not None else None,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, _checked_update(update_fn))


#: The plain all-reduce of the leaves ``mask``/``min_size`` leave out, for its byte count.
_DENSE = methods.Dense()


class _Layout(NamedTuple):
    """Which leaves an update aggregates how (positions in the flattened tree)."""

    floats: list  # every float leaf
    groups: list  # [(positions, name)]: the compressed leaves, grouped by `granularity`
    plain: list  # float leaves mask= and min_size= leave out: one fused all-reduce


def _layout(c: FeedbackConfig, tree, sends_everything: bool) -> _Layout:
    """The :class:`_Layout` of ``tree`` (the params at init, the gradients in update)."""
    leaves = jax.tree.leaves(tree)
    floats = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
    if sends_everything:
        # A method that sends everything is elementwise: per leaf it is the same sum, with no copy
        # into one vector, and a mask changes nothing.
        return _Layout(floats, [([i], f"leaf {i}") for i in floats], [])
    chosen = c.compressed(tree)
    compressed = [i for i in floats if chosen[i]]
    groups = (
        [(compressed, "the model")]
        if c.granularity == "model" and compressed
        else [([i], f"leaf {i}") for i in compressed]
    )
    return _Layout(floats, groups, [i for i in floats if not chosen[i]])


def _shards(c: FeedbackConfig, branches, n_devices: int) -> int | None:
    """With :func:`jaxcomp.optim.sharding.sharded_updates` in force, the shards per leaf (after checking
    that they are the devices ``c.axes`` reduce over and that every method can reduce-scatter);
    else None."""
    active = sharding.active()
    if active is None:
        return None
    if active.n_devices != n_devices:
        raise ValueError(
            f"the updates are sharded over {active.n_devices} devices, but compress(axis_name="
            f"{c.axis_name!r}) reduces over {n_devices}: give compress the data axes data_parallel "
            "splits the batch over"
        )
    _check_scatters(branches)
    return n_devices


def _check_scatters(branches):
    """Raises a ValueError naming the first method without a reduce-scatter form."""
    for method in branches:
        if not method.scatters:
            raise ValueError(
                f"method {method.describe()} has no reduce-scatter form, so it cannot aggregate "
                f"sharded gradients (data_parallel(shard=...)); methods that can: "
                f"{', '.join(methods.scattering())}; or train with shard=None"
            )


def _row(branches, parts, shards) -> int | None:
    """Values per device row of the shard-major vector of ``parts`` (None when not sharded): the
    shards of the parts, padded until every branch accepts the row (:meth:`Method.shard_row`)."""
    if shards is None:
        return None
    row = sum(sharding.shard_length(p.size, shards) for p in parts)
    for _ in range(8):
        padded = functools.reduce(lambda r, m: max(r, m.shard_row(r, shards)), branches, row)
        if padded == row:
            return row
        row = padded
    raise ValueError(
        f"the methods {[m.describe() for m in branches]} agree on no row length for {row} values"
    )


def _pack(parts, shards, row):
    """One vector of the parts: concatenated, or shard-major with ``shards``."""
    return flat.concat(parts) if shards is None else sharding.shard_major(parts, shards, row)


def _pieces(leaves, positions, vector, shards):
    """``(i, flat piece)`` of ``vector`` for each leaf ``i`` at ``positions``: the inverse of :func:`_pack`."""
    sizes = [leaves[i].size for i in positions]
    if shards is not None:
        return zip(positions, sharding.from_shard_major(vector, sizes, shards))
    offsets = np.cumsum([0] + sizes)
    return ((i, vector[offsets[j] : offsets[j + 1]]) for j, i in enumerate(positions))


def _write(out, leaves, positions, total, scale, skipped, shards=None):
    """Splits a group's ``total`` into its leaves' updates (zeros on a skipped step); with
    ``shards``, ``total`` is this device's row and each update is its 1-D shard of the leaf."""
    offset = 0
    for i in positions:
        size, shape = leaves[i].size, leaves[i].shape
        if shards is not None:
            size, shape = (
                sharding.shard_length(size, shards),
                (sharding.shard_length(size, shards),),
            )
        update = total[offset : offset + size].reshape(shape).astype(jnp.float32) * scale
        if skipped is not None:
            update = jnp.where(skipped, 0.0, update)
        out[i] = update.astype(leaves[i].dtype)
        offset += size


def _keep(new, old, leaves, positions, vector, skipped, shards=None):
    """Splits a group's per-device ``vector`` (residual, momentum) into its leaves, keeping the old
    values on a skipped step."""
    for i, piece in _pieces(leaves, positions, vector, shards):
        piece = piece.reshape(leaves[i].shape)
        new[i] = piece if skipped is None else jnp.where(skipped, old[i], piece)


def _square(values):
    return jnp.sum(jnp.square(values.astype(jnp.float32)))


def compress(
    method,
    *,
    axis_name="data",
    error_feedback=True,
    granularity="model",
    mean=True,
    seed=0,
    nonfinite="zero",
    warmup_steps=0,
    mask=None,
    min_size=0,
    momentum_correction=None,
    **shorthand,
) -> optax.GradientTransformationExtraArgs:
    """Aggregates gradients across a mesh axis with a compressing method and error feedback.

    Put it first in an ``optax.chain`` and call the chain's ``update`` inside ``jax.shard_map``
    with this device's local gradients (varying over ``axis_name``); it returns the aggregated
    gradients, identical on every device. Each device keeps the part of its error-fed gradient that
    the method did not send and adds it to the next step's gradient (error feedback):
    ``g_e = g + residual; residual <- g_e - sent``.

    Gradients of replicated params are already all-reduced, densely, by ``jax.grad`` inside
    shard_map; ``update`` detects this (when shard_map checks types, the default) and raises.
    Cast params to varying first (``jax.lax.pcast(params, axis_name, to="varying")``) or use
    :func:`jaxcomp.data_parallel`. Leaves that are not floating point (ints, ``float0``) pass
    through untouched; bfloat16/float16 gradients travel in their own dtype when all leaves share
    it, and the residual is kept in float32. A method that loses nothing (:class:`jaxcomp.Dense`)
    keeps no residual and sums leaf by leaf.

    **Non-finite gradients.** A NaN or ±Inf entry of a device's gradient is never sent and never
    stored in the residual, whatever the method: it counts as 0 (that index's residual is kept),
    so the other entries aggregate exactly as if it had been 0. The ``nonfinite`` metric counts
    such entries, summed over the devices (float32, identical everywhere; it rides on the psum of
    the ``gain`` sums, so it adds no collective to a compressing method). ``nonfinite=`` decides
    the step:

    * ``"zero"`` (default): train on with those entries as 0. It costs nothing beyond the count,
      never couples the chain's transformations, and one bad entry among millions does not throw
      away a step; watch the metric to see it happen.
    * ``"skip"``: if any device saw one, every device skips the step: the updates are zeros and
      this state (residual, step, key, ``compress_auto``'s choices) stays as it was; only the
      metrics report the step. :func:`jaxcomp.data_parallel` then keeps the params and the rest
      of the chain's state too; in your own step wrap the chain in :func:`jaxcomp.skip_nonfinite`.
    * ``"raise"``: the device side is ``"skip"``'s; :func:`jaxcomp.data_parallel`'s ``step``
      then raises ``FloatingPointError`` at that step (it reads the metric after every step, so
      steps no longer run ahead of the host). In your own step, check the metric yourself.

    **The string shorthand.** ``compress("ar_topk", ratio=0.01)`` is
    ``compress(TopK(0.01, collective="ar"))``: a name from :data:`jaxcomp.methods.SHORTHAND` with
    the method's options as keywords. ``compress("auto", ...)`` is
    :func:`jaxcomp.compress_auto`'s shorthand (see there).

    Args:
      method: a :mod:`jaxcomp.methods` object (:class:`jaxcomp.Dense`, :class:`jaxcomp.TopK`,
        :class:`jaxcomp.Zfp`, :class:`jaxcomp.Quantized`, or your own :class:`jaxcomp.Method`),
        or a name with its options in ``shorthand``.
      axis_name: mesh axis the gradients are reduced over, or a tuple of axes (reduced over all).
        ``TopK(collective="hierarchical")`` needs ``(outer, inner)``: the slow axis (between
        nodes) first.
      error_feedback: keep what was not sent and add it to the next gradient (default True).
      granularity: ``"model"`` flattens all float leaves into one vector and compresses it as a
        whole (fused top-k keeps more accuracy than layer-wise); ``"leaf"`` compresses each leaf on
        its own (``k = round(ratio * leaf.size)`` each).
      mean: return the mean across devices (default) instead of the sum.
      seed: seed of the state's PRNG key (the quantizer's stochastic rounding).
      nonfinite: what a step with NaN or ±Inf gradient entries does: ``"zero"`` (default; train
        on with them as 0), ``"skip"`` (every device skips the update) or ``"raise"`` (skip, and
        ``data_parallel`` raises ``FloatingPointError``); see "Non-finite gradients" above.
      warmup_steps: aggregate densely for the first this many steps, then run ``method`` (default
        0; one compiled step, switched by the step counter).
      mask: which float leaves are compressed: a pytree of bools like the params, or a callable
        ``params -> pytree``; the others are summed exactly in one fused all-reduce (default None:
        all of them).
      min_size: leaves with fewer values are summed exactly too (default 0).
      momentum_correction: DGC's momentum ``m`` in [0, 1) for :class:`jaxcomp.TopK` and
        :class:`jaxcomp.RandomK`: each device accumulates its velocity ``u = m u + g`` (not ``g``)
        and clears it where sent; follow it with an optimizer without momentum
        (``optax.sgd(lr)`` or ``optax.adam(lr, b1=0)``). Default None.
      **shorthand: with a method name only: its options (``ratio=``, ``k=``, ``rate=``,
        ``bits=``, ``leader=``, ``selector=``, ``algorithm=``, ``hadamard=``), or with
        ``"auto"`` :func:`jaxcomp.compress_auto`'s.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(jaxcomp.compress(jaxcomp.TopK(0.5, collective="ar")), optax.sgd(0.1))
      >>> def mean_grad(g):  # g: this device's gradient, varying over "data"
      ...     updates, _ = tx.update({"w": g}, tx.init({"w": g}))
      ...     return updates["w"]
      >>> f = jax.shard_map(mean_grad, mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> f(jnp.ones(4 * jax.device_count())).shape
      (4,)

      A NaN is dropped, counted and never kept (here on device 0, with the default ``"zero"``):

      >>> tx = jaxcomp.compress(jaxcomp.TopK(0.5, collective="ar"))
      >>> def metrics(g):
      ...     _, state = tx.update({"w": g}, tx.init({"w": g}))
      ...     return state.metrics.nonfinite, jnp.isnan(state.residual["w"]).any()[None]
      >>> f = jax.shard_map(metrics, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
      >>> count, nan_kept = f(jnp.ones(4 * jax.device_count()).at[1].set(jnp.nan))
      >>> float(count), bool(nan_kept.any())
      (1.0, False)

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks" (arXiv 2312.02493): AR-Topk, STAR/VAR leaders, error feedback (Alg. 1), fused
      compression (§3-C3), compression gain (§2-C3).
    """
    if method == "auto":  # the shorthand of the automatic choice
        from jaxcomp.optim.auto import compress_auto_shorthand

        for value, name in (
            (warmup_steps, "warmup_steps"),
            (momentum_correction, "momentum_correction"),
        ):
            if value:
                raise ValueError(
                    f"{name}= applies to a single method, not to 'auto' (compress_auto chooses dense "
                    f"itself while it is the cheapest)"
                )
        return compress_auto_shorthand(
            axis_name=axis_name,
            error_feedback=error_feedback,
            granularity=granularity,
            mean=mean,
            seed=seed,
            nonfinite=nonfinite,
            mask=mask,
            min_size=min_size,
            **shorthand,
        )
    config = FeedbackConfig.check(
        axis_name,
        error_feedback,
        granularity,
        mean,
        seed,
        nonfinite,
        mask,
        min_size,
        momentum_correction,
    )
    method = _parse_method(method, shorthand)
    method.check_axes(config.axes)
    warmup = max(_checks.static_int(warmup_steps, "warmup_steps", 0), method.dense_steps)
    if config.momentum is not None and not method.sparse:
        raise ValueError(
            f"momentum_correction applies to the sparsifying methods (jaxcomp.TopK, jaxcomp.RandomK), "
            f"whose sent entries it clears from the momentum; got {method.describe()}"
        )
    if warmup and method.sends_everything:
        warmup = 0  # dense already
    if warmup and not method.replicated_total:
        raise ValueError(
            f"warmup_steps needs a method whose total comes out replicated, to switch from dense "
            f"to it inside one compiled step; {method.describe()} does not (for Zfp: "
            f"algorithm='ring')"
        )
    # The methods the state records: with a warm-up, dense first (the `method` metric says which ran).
    branches = (_DENSE, method) if warmup else (method,)
    keeps_residual = config.error_feedback and not method.sends_everything
    # A method that returns its (indices, values) has the residual taken off in place, never a
    # dense `sent` built and subtracted (not across a warm-up switch: both branches send dense).
    sparse = method.sparse and not warmup

    def aggregate(groups: Groups, state: CompressState):
        key = jax.random.fold_in(state.key, state.step)
        if not warmup:
            branch, (bytes_sent, kept, _) = 0, static_cost(method, groups)
        else:
            branch = (state.step >= warmup).astype(jnp.int32)
            costs = [static_cost(m, groups) for m in branches]
            bytes_sent = jnp.asarray([cost[0] for cost in costs], jnp.float32)[branch]
            kept = jnp.asarray([cost[1] for cost in costs], jnp.float32)[branch]
        totals, sents, method_state = run_branch(
            branches, branch, groups, config.axis_name, state.step, key, sparse, state.method_state
        )
        return Aggregation(
            totals, sents, bytes_sent, kept, branch, sparse, method.sends_everything, method_state
        ), None

    return feedback_transformation(config, branches, keeps_residual, aggregate)


def _parse_method(method, shorthand) -> Method:
    auto_only = sorted(
        name for name in shorthand if name in _AUTO_ONLY and shorthand[name] is not None
    )
    if auto_only:
        raise ValueError(
            f"{', '.join(f'{name}=' for name in auto_only)} applies to method 'auto' only "
            f"(jaxcomp.compress_auto); remove it for method {method!r}"
        )
    return methods.parse(method, **shorthand)


# compress_auto's arguments, refused by a single method with a message that says where they go.
_AUTO_ONLY = (
    "candidates",
    "network",
    "decide_every",
    "adaptive_ratio",
    "ratio_range",
    "explore_steps",
    "ratio_search",
)


def _checked_update(update_fn):
    """``update_fn`` behind the argument checks that must come before any of its work."""

    def update(updates, state, params=None, **extra_args):
        _check_updates_fit_state(updates, state)
        return update_fn(updates, state, params, **extra_args)

    return update


def _check_updates_fit_state(updates, state):
    """Gradients shaped like the params ``init`` saw, and at least one value to aggregate."""
    if not isinstance(state, CompressState):
        raise TypeError(
            f"state must be the CompressState that compress's init returns, got {type(state).__name__}"
        )
    leaves, treedef = jax.tree.flatten_with_path(updates)
    try:
        residuals = treedef.flatten_up_to(state.residual)
    except (ValueError, TypeError):
        return  # update reports the structure mismatch itself
    floats = [
        (path, leaf, residual)
        for (path, leaf), residual in zip(leaves, residuals)
        if _is_float(leaf)
    ]
    for path, leaf, residual in floats:
        if (
            isinstance(residual, jax.Array | jax.ShapeDtypeStruct | np.ndarray)
            and leaf.shape != residual.shape
        ):
            raise ValueError(
                f"updates{jax.tree_util.keystr(path)} has shape {leaf.shape}, but compress was initialized with a "
                f"param of shape {residual.shape} there: pass the gradients of the params given to init"
            )
    if floats and sum(leaf.size for _, leaf, _ in floats) == 0:
        raise ValueError(
            f"updates hold no values (every float leaf is empty: shapes "
            f"{[leaf.shape for _, leaf, _ in floats]}): there is nothing to aggregate"
        )


def _is_float(leaf) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def _bound_axis_size(axis_name) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"compress(axis_name={axis_name!r}): update must run inside jax.shard_map over a mesh with axis "
            f"{axis_name!r} (or use jaxcomp.data_parallel); no such axis is bound here"
        ) from None


def _check_local_gradients(c: FeedbackConfig, leaves):
    """Refuses gradients that were already all-reduced densely (the replicated-params trap)."""
    # With check_vma=False nothing is typed varying, so there is nothing to check.
    probe = jax.lax.pcast(jnp.zeros((), jnp.float32), c.axis_name, to="varying")
    if not set(c.axes) <= _ffi.varying_axes(probe):
        return
    for leaf in leaves:
        if not set(c.axes) <= _ffi.varying_axes(leaf):
            raise ValueError(
                f"compress got gradients that are replicated over {c.axis_name!r}: jax.grad of replicated "
                "params inside shard_map already all-reduced them densely, before compression. Cast the "
                f"params first: params = jax.lax.pcast(params, {c.axis_name!r}, to='varying') (or use "
                "jaxcomp.data_parallel, which does this)."
            )


def _comm_dtype(leaves):
    """The dtype the collectives carry: the gradients' own when they share a 16-bit float, else f32."""
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        return dtypes.pop()
    return jnp.dtype(jnp.float32)


def _init_metrics():
    zero = jnp.zeros((), jnp.float32)
    return CompressMetrics(
        gain=zero, bytes_sent=zero, density=zero, method=jnp.zeros((), jnp.int32), nonfinite=zero
    )


def find_compress_state(opt_state) -> CompressState | None:
    """The first :class:`CompressState` inside an optimizer state (e.g. an ``optax.chain``'s), or None.

    Args:
      opt_state: any optax state pytree.

    Returns:
      The :class:`CompressState` found first in depth-first order, or ``None``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.compress(jaxcomp.Dense()), optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> jaxcomp.find_compress_state(state).step.tolist()
      0

    References:
      Tyagi & Swany, arXiv 2312.02493 (the state follows Alg. 1's per-worker residual).
    """
    found = compress_states(opt_state)
    return found[0] if found else None


def compress_states(opt_state) -> list[CompressState]:
    """Every :class:`CompressState` inside an optimizer state, in depth-first order.

    Args:
      opt_state: any optax state pytree.

    Returns:
      A list of :class:`CompressState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> len(compress_states(jaxcomp.compress(jaxcomp.Dense()).init({"w": jnp.zeros(3)})))
      1

    References:
      Tyagi & Swany, arXiv 2312.02493 (Alg. 1's per-worker state).
    """
    return [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CompressState))
        if isinstance(node, CompressState)
    ]
