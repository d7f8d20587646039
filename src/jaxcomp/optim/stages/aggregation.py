"""The method's collective over the groups of error-fed vectors (run by :mod:`.aggregate`).

A group is the whole model (one vector) or one leaf (``granularity``); :class:`Groups` carries
the vectors with what a method's static cost needs. :func:`run_branch` runs one of several
methods (``lax.switch`` on a traced index: warm-up and :func:`jaxcomp.compress_auto`), each
updating its own state (:attr:`jaxcomp.CompressState.method_state`, e.g. PowerSGD's Q).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import small
from jaxcomp.methods import Method
from jaxcomp.ops import _ffi, scatter
from jaxcomp.ops import pieces as pieces_ops
from jaxcomp.ops.pieces import Pieces


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
    buckets: list | None = None  # per vector, its bucket (bucket_mb=): sent after the one before


def _shaped(method: Method, groups: Groups, i: int) -> dict:
    """The ``shapes=`` keyword a stateful method's calls take for group ``i``."""
    return {"shapes": groups.shapes[i]} if method.stateful else {}


def static_cost(method: Method, groups: Groups) -> tuple[float, int, int]:
    """(bytes one device sends, values kept, sequential message steps) of ``method`` over the
    groups.

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
        if n == 0:  # a leaf without values sends nothing
            continue
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
        kept += _kept(method, n, name, shaped, groups.n_devices)
    return sent, kept, steps


def as_one_group(groups: Groups, vectors: list) -> tuple[Groups, Any]:
    """``vectors`` (one per group of ``groups``) as one group, and the function that splits its
    total back into one per group: for a method whose sum is elementwise (one that sends
    everything), the total of the concatenation is the concatenation of the totals.

    One collective instead of one per group: the guard's second sum
    (:func:`jaxcomp.optim.stages.guard.guarded_totals`) of a model of 1,000 leaves compiles as
    one all-reduce, not 1,000 more. Sharded (``groups.scatter``), each vector is ``N`` rows
    (shard-major) and so is the concatenation: row ``d`` is every group's row ``d`` in turn.

    Args:
      groups: the update's :class:`Groups`.
      vectors: per group, a 1-D vector of that group's length.

    Returns:
      ``(one, split)``: a :class:`Groups` of one vector, unbucketed, and ``split(total)``, the
      list of per-group totals (or rows) of its total.

    Example:
      >>> import jax.numpy as jnp
      >>> groups = Groups([None, None], ["leaf 0", "leaf 1"], [2, 1], 8, None, 4)
      >>> one, split = as_one_group(groups, [jnp.ones(2), jnp.zeros(1)])
      >>> one.vectors[0].tolist(), [t.tolist() for t in split(one.vectors[0] * 8)]
      ([1.0, 1.0, 0.0], [[8.0, 8.0], [0.0]])

    References:
      Sergeev & Del Balso, "Horovod", arXiv 1802.05799, §4 (tensor fusion: many small
      all-reduces as one).
    """
    rows = groups.n_devices if groups.scatter else 1
    widths = [v.shape[0] // rows for v in vectors]
    flat_vector = jnp.concatenate([v.reshape(rows, -1) for v in vectors], axis=1).reshape(-1)
    one = groups._replace(
        vectors=[flat_vector],
        names=["the model"],
        sizes=[flat_vector.shape[0]],
        shapes=None if groups.shapes is None else [sum(groups.shapes, ())],
        values=None if groups.values is None else [sum(groups.values)],
        buckets=None,
    )

    def split(total):
        if total.dtype == jnp.float32:  # one native pass on the CPU: no compiled loop per group
            return scatter.split_scaled(total, [(w,) for w in widths])
        return jnp.split(total, np.cumsum(widths)[:-1].tolist())

    return one, split


def _kept(method: Method, n: int, name: str, shaped: dict, n_devices: int | None = None) -> int:
    """``method``'s kept values of group ``name`` (:meth:`~jaxcomp.methods.Method.kept_on` with
    ``n_devices``), its errors naming the group."""
    try:
        if n_devices is None:
            return method.kept(n, **shaped)
        return method.kept_on(n, n_devices, **shaped)
    except ValueError as e:
        raise ValueError(f"{e} (in {name})") from None


def aggregate_groups(
    method: Method,
    groups: Groups,
    axis_name,
    step,
    base_key,
    sparse: bool = False,
    states=None,
    pieces: bool = False,
    decoded: bool = False,
):
    """Runs ``method`` on each group's vector: ``(totals, sents, states, vectors)``, one per group
    (``sparse``: each ``sent`` is ``(indices, values)``). Group ``i`` draws its randomness from
    ``fold_in(base_key, i)``; with ``groups.buckets`` each bucket waits for the one before
    (:func:`after_previous_bucket`).

    Args:
      method: a :mod:`jaxcomp.methods` object.
      groups: the update's :class:`Groups` (inside ``shard_map``).
      axis_name: the axis or axes to reduce over.
      step: the training step, replicated.
      base_key: this step's key, replicated.
      sparse: ask for ``(indices, values)`` sents (methods with ``sparse``).
      states: with a :attr:`~jaxcomp.methods.Method.stateful` method, its state per group (from
        :func:`init_method_state`); None otherwise.
      pieces: a method with :attr:`~jaxcomp.methods.Method.pieces` may return a group's total
        and sent as :class:`jaxcomp.ops.pieces.Pieces` (not when sharded).
      decoded: a method with :attr:`~jaxcomp.methods.Method.decoded_sent` may return a group's
        sent as :class:`jaxcomp.ops.sign.ScaledSigns` (not when sharded).

    Returns:
      ``(totals, sents, states, vectors)``: one total and sent per group, the method's new states
      (the ``states`` given, for a method without state), and the vectors as the collectives read
      them (a bucket's made to wait for the bucket before): use these afterwards, not
      ``groups.vectors``, or XLA keeps a copy of each.

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
    n = len(groups.vectors)
    totals, sents, new_states, vectors = [None] * n, [None] * n, [None] * n, [None] * n
    for i in sorted(range(n), key=lambda g: 0 if groups.buckets is None else groups.buckets[g]):
        vector, name = groups.vectors[i], groups.names[i]
        key = jax.random.fold_in(base_key, i)
        vectors[i] = vector = after_previous_bucket(vector, groups.buckets, i, totals)
        if vector.size == 0:  # a leaf without values (shape (0, 3)): nothing to send or keep
            # (a psum of nothing, typed replicated like every total; a row of nothing when sharded)
            totals[i] = vector if groups.scatter else small.metric_sum(vector, axis_name)
            sents[i] = (jnp.zeros((0,), jnp.int32), vector) if sparse else vector
            new_states[i] = states[i] if method.stateful else None
        elif groups.scatter:
            _kept(method, groups.values[i], name, {})
            totals[i], sents[i] = method.reduce_scatter(
                vector, axis_name, step=step, key=key, size=groups.values[i], sparse=sparse
            )
        else:
            _kept(method, vector.shape[0], name, _shaped(method, groups, i))
            totals[i], sents[i], new_states[i] = method.aggregate(
                vector,
                axis_name,
                step=step,
                key=key,
                sparse=sparse,
                state=states[i] if method.stateful else None,
                **_shaped(method, groups, i),
                **({"pieces": True} if pieces and method.pieces else {}),
                **({"decoded": True} if decoded and method.decoded_sent else {}),
            )
    return totals, sents, tuple(new_states) if method.stateful else states, vectors


def after_previous_bucket(vector, buckets, i: int, totals: list):
    """Group ``i``'s vector, made to wait for the totals of the bucket before its own (no wait
    without buckets, or in the first bucket).

    The dependency keeps each bucket's collectives apart and in order: XLA's collective combiner
    merges collectives that do not depend on each other into one, which waits for the last
    gradient of the backward pass. Chained, the first bucket (the leaves the backward pass
    finishes first) is sent while the backward pass goes on.

    Args:
      vector: group ``i``'s vector.
      buckets: per group, the rank at which its bucket is sent (0 first), or None.
      i: the group.
      totals: per group, its total, or None where it is not aggregated yet (every group of an
        earlier bucket is).

    Returns:
      ``vector``, made to depend on the totals of the bucket ranked just before its own
      (:func:`depends_on`).

    Example:
      >>> import jax.numpy as jnp
      >>> after_previous_bucket(jnp.ones(2), [0, 1], 1, [jnp.zeros(3)]).tolist()
      [1.0, 1.0]

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 (buckets reduced in order, during the
      backward pass).
    """
    if buckets is None or buckets[i] == 0:
        return vector
    previous = [t for t, b in zip(totals, buckets) if b == buckets[i] - 1 and t is not None]
    return depends_on(vector, jax.tree.leaves(previous))  # a sparse total: its pairs


def depends_on(vector, values):
    """``vector``, bit for bit, made to depend on every array of ``values`` in a way no XLA pass
    removes (XLA:CPU drops optimization barriers before its collective combiner runs).

    One element of each value is read; a population count above 32 (never true, which XLA
    cannot prove) gives the index and the amount of a scatter-add into ``vector``: at run time 0
    added at index 0. A scatter at a traced index stays in place (XLA writes into ``vector``'s
    buffer, no copy); a static ``.at[0].add`` becomes a fusion that also reads ``vector`` and
    cannot share its buffer, which cost one copy per bucket.

    Args:
      vector: a 1-D array.
      values: arrays ``vector`` must wait for.

    Returns:
      ``vector``'s values (``-0.0`` at index 0 may become ``+0.0``).

    Example:
      >>> import jax.numpy as jnp
      >>> depends_on(jnp.arange(3.0), [jnp.ones(5)]).tolist()
      [0.0, 1.0, 2.0]

    References:
      XLA ``CseBarrierExpander`` (removes optimization barriers) and ``AllReduceCombiner``.
    """
    values = [v for v in values if v.size]
    if not values or vector.size == 0:
        return vector
    bits = [
        jax.lax.bitcast_convert_type(v.ravel()[0].astype(jnp.float32), jnp.uint32) for v in values
    ]
    never = jax.lax.population_count(functools.reduce(jnp.bitwise_xor, bits)) > 32
    zero = jnp.where(never, 1, 0)
    return vector.at[zero].add(zero.astype(vector.dtype), mode="drop")


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
    pieces: bool = False,
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
      pieces: as for :func:`aggregate_groups`; under ``lax.switch`` the other branches' totals
        and sents are then cut into the same parts. With a static ``branch`` it also lets a
        method return its sent as :class:`jaxcomp.ops.sign.ScaledSigns` (``decoded``).

    Returns:
      ``(totals, sents, states, vectors)`` (as :func:`aggregate_groups`; under ``lax.switch``
      buckets are not chained, a conditional waits for all its operands anyway, and ``vectors``
      are ``groups.vectors``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.methods import Dense
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(x):
      ...     groups = Groups([x], ["the model"], [x.shape[0]], 2, None, 4)
      ...     key = jax.random.key(0)
      ...     return run_branch((Dense(),), 0, groups, "data", 0, key, False, (None,))[0][0]
      >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (one collective chosen per step).
    """
    switched = not isinstance(branch, int)
    leafwise = switched and pieces and not groups.scatter and any(m.pieces for m in branches)
    run = functools.partial(_branch, branches, axis_name, sparse, pieces, switched, leafwise)

    if isinstance(branch, int):
        return run(branch, groups)(groups.vectors, step, key, states)
    unchained = groups._replace(buckets=None)
    totals, sents, states = jax.lax.switch(
        branch,
        [lambda *a, i=i: run(i, unchained)(*a)[:3] for i in range(len(branches))],
        groups.vectors,
        step,
        key,
        states,
    )
    return totals, sents, states, groups.vectors


def _branch(branches, axis_name, sparse, pieces, switched, leafwise, index, groups):
    """``run_branch``'s function of branch ``index``: ``(vectors, step, key, states) ->
    (totals, sents, states, sent vectors)``, each branch returning the same structure."""

    def branch_fn(vectors, step, key, states):
        totals, sents, own, sent_vectors = aggregate_groups(
            branches[index],
            groups._replace(vectors=vectors),
            axis_name,
            step,
            key,
            sparse=sparse,
            states=states[index],
            pieces=pieces,
            decoded=pieces and not switched,
        )
        if leafwise:  # every branch returns the same structure
            totals, sents = (_alike(branches, v, groups.shapes) for v in (totals, sents))
        # Typed per device like the vectors: a method whose `sent` comes out typed replicated
        # (an FFI result: Sign's majority vote) must still match dense's in lax.switch.
        sents = _ffi.like_varying_operands(sents, vectors)
        return totals, sents, states[:index] + (own,) + states[index + 1 :], sent_vectors

    return branch_fn


def _alike(branches, vectors: list, shapes: list) -> list:
    """Per group its vector cut as the branches with :attr:`~jaxcomp.methods.Method.pieces`
    cut theirs (``piece_sizes``), so that every branch of a ``lax.switch`` returns the same
    structure; joined where they cut it differently."""
    out = []
    for vector, group in zip(vectors, shapes):
        cuts = {tuple(m.piece_sizes(group)) for m in branches if m.pieces}
        if len(cuts) == 1 and vector.size:
            (sizes,) = cuts
            out.append(vector if isinstance(vector, Pieces) else Pieces.split(vector, sizes))
        else:
            out.append(pieces_ops.joined(vector))
    return out


class Aggregation(NamedTuple):
    """What a transformation's aggregation step returns to the aggregation stage
    (:mod:`jaxcomp.optim.stages.aggregate`)."""

    totals: list  # per group: the sum over the devices
    sents: list  # per group: this device's contribution (dense, or (indices, values) with sparse)
    bytes_sent: Any  # f32[] or float: bytes one device sent
    kept: Any  # values whose content was sent
    method: Any  # i32[] or int: index into the state's methods
    sparse: bool  # sents are (indices, values) pairs
    sends_everything: bool  # statically nothing lost: no residual, gain 1
    method_state: Any = ()  # the methods' new states (CompressState.method_state)
    vectors: list | None = None  # per group, the vector as sent (bucketed: chained), else None
    rounds_only: bool = False  # statically every branch sends all, rounded: gain 1, sents unread


def rounds_only(methods, branch=None) -> bool:
    """Whether every method a step may run sends every value, at most rounded
    (:attr:`jaxcomp.methods.Method.rounds_only`, or loses nothing): the metrics then take the
    error-fed vectors for what was sent, and never read the sents.

    Args:
      methods: the branches' methods.
      branch: the branch the step runs: a Python int (that method alone), or None or a traced
        index (any of them).

    Returns:
      A Python bool.

    Example:
      >>> from jaxcomp.methods import Cast, Dense, TopK
      >>> rounds_only([Cast("bf16"), Dense()]), rounds_only([Cast("bf16"), TopK(0.01)])
      (True, False)
      >>> rounds_only([Cast("bf16"), TopK(0.01)], branch=0)
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (the compression gain).
    """
    runs = [methods[branch]] if isinstance(branch, int) else methods
    return all(m.rounds_only or m.sends_everything for m in runs)
