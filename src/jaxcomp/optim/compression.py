"""The optax transformation :func:`compress`: compressed gradient aggregation with error feedback.

``compress`` goes first in an ``optax.chain``; its ``update`` runs inside ``jax.shard_map`` on the
data axis, takes this device's local gradients and returns the aggregated (by default averaged)
gradients, identical on every device, for the rest of the chain::

    tx = optax.chain(
        jaxcomp.compress(jaxcomp.TopK(0.01, collective="ar"), axis_name="data"), optax.adam(1e-3)
    )

The method is a :mod:`jaxcomp.methods` object; this module knows none by name. The update is the
pipeline of :func:`jaxcomp.optim.feedback.feedback_transformation`; what ``compress`` adds is its
aggregation: the method, after a dense warm-up (:mod:`jaxcomp.optim.stages.warmup`).
``compress("auto", ...)`` hands over to :func:`jaxcomp.compress_auto`.
"""

from __future__ import annotations

import optax

from jaxcomp import methods
from jaxcomp.methods import Method
from jaxcomp.optim import pinning
from jaxcomp.optim.auto_shorthand import compress_auto_shorthand
from jaxcomp.optim.config import (
    UNSET,
    FeedbackConfig,
    default_buckets,
    default_feedback,
    deprecated_keywords,
)
from jaxcomp.optim.feedback import feedback_transformation
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.stages import momentum as momentum_stage
from jaxcomp.optim.stages import warmup as warmup_stage
from jaxcomp.optim.stages.aggregate import AggregateState
from jaxcomp.optim.stages.aggregation import (
    Aggregation,
    Groups,
    rounds_only,
    run_branch,
    static_cost,
)
from jaxcomp.optim.stages.flight import InFlight


def compress(
    method,
    *,
    axis_name="data",
    error_feedback="auto",
    granularity="model",
    mean=UNSET,
    seed=UNSET,
    nonfinite="zero",
    warmup_steps=0,
    warmup_method=None,
    mask=None,
    min_size=0,
    momentum_correction=None,
    guardrail=True,
    bucket_mb="auto",
    **shorthand,
) -> optax.GradientTransformationExtraArgs:
    """Aggregates gradients across a mesh axis with a compressing method and error feedback.

    First in an ``optax.chain``: its ``update``, inside ``jax.shard_map`` on this device's
    gradients, returns their aggregate, the same on every device (docs/training.md, section 1).

    Args:
      method: a :mod:`jaxcomp.methods` object, its name (options in ``shorthand``), or ``"auto"``.
      axis_name: the mesh axis reduced over, or a tuple of axes (the slow one first).
      error_feedback: ``"auto"`` (default: on but for the casts), True, False, or a decay in (0, 1).
      granularity: ``"model"`` (default: all float leaves as one vector) or ``"leaf"``.
      mean: deprecated (the update is the mean; for the sum, chain ``optax.scale(n)`` after).
      seed: deprecated (the state's PRNG key is seeded with 0).
      nonfinite: a step with NaN or ±Inf entries: ``"zero"`` (default), ``"skip"`` or ``"raise"``.
      warmup_steps: run ``warmup_method`` for the first this many steps (default 0).
      warmup_method: None (default: :class:`jaxcomp.Dense`) or a method that sends every value.
      mask: which float leaves are compressed: a pytree of bools, or ``params -> pytree``.
      min_size: leaves with fewer values are summed exactly (default 0).
      momentum_correction: DGC's momentum in [0, 1) for top-k and random-k (default None).
      guardrail: dense fallback when training diverges: True (default), a ``Guardrail``, or False.
      bucket_mb: ``"auto"`` (default), None (one message), or a bucket's size in MiB.
      **shorthand: a named method's options (``ratio=``, ``rate=``, ``bits=``, ...).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`CompressState`.

    Raises:
      ValueError: an unknown method, or an option it does not take (the message names it).

    Example:
      >>> import jax, numpy as np, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.compress(jaxcomp.TopK(0.5, collective="ar")), optax.sgd(0.1))
      >>> step = lambda g: tx.update({"w": g}, tx.init({"w": g}))[0]["w"]  # g: this device's
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> mean = jax.shard_map(step, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())
      >>> mean(np.ones(4 * jax.device_count())).shape
      (4,)

    References:
      Tyagi & Swany, arXiv 2312.02493: AR-Topk, error feedback (Alg. 1), fused compression (§3-C3).
    """
    options = {name: value for name, value in locals().items() if name not in _NOT_OPTIONS}
    if method == "auto":  # the shorthand of the automatic choice
        return _compress_auto(**options, **shorthand)
    return _compress_one(_parse_method(method, shorthand), **options)


#: ``compress``'s arguments that are not options passed on as they are.
_NOT_OPTIONS = ("method", "shorthand")


def _compress_one(
    method: Method,
    *,
    axis_name,
    error_feedback,
    granularity,
    mean,
    seed,
    nonfinite,
    warmup_steps,
    warmup_method,
    mask,
    min_size,
    momentum_correction,
    guardrail,
    bucket_mb,
):
    """:func:`compress` of one method (not ``"auto"``): its checks, branches and aggregation."""
    mean, seed = deprecated_keywords("compress", 3, mean=mean, seed=seed)
    config = FeedbackConfig.check(
        axis_name,
        default_feedback(error_feedback, [m for m in (method, warmup_method) if m is not None]),
        granularity,
        mean,
        seed,
        nonfinite,
        mask,
        min_size,
        momentum_correction,
        guardrail,
        default_buckets(bucket_mb, method.buckets_by_default),
    )
    method.check_axes(config.axes)
    warmup = warmup_stage.warmup_length(method, warmup_steps)
    warmup_method = warmup_stage.check_warmup_method(warmup_method, warmup_steps)
    momentum_stage.check(method, config.momentum)
    warmup_stage.check_switchable(method, warmup)
    # The methods the state records: with a warm-up, its method first (the `method` metric says
    # which ran).
    branches = warmup_stage.branches(method, warmup, warmup_method)
    # The guardrail's dense fallback reuses the warm-up's switch (dense last: the method keeps
    # index 0 of the `method` metric).
    falls_back = config.guardrail is not None and divergence.can_fall_back(method, config.guardrail)
    if falls_back and warmup_stage.DENSE not in branches:
        branches = branches + (warmup_stage.DENSE,)
    keeps_residual = config.error_feedback and not method.sends_everything
    # A method that returns its (indices, values) has the residual taken off in place, never a
    # dense `sent` built and subtracted (not across a switch: both branches send dense).
    sparse = method.sparse and len(branches) == 1
    aggregate = _aggregation(config, method, branches, warmup, sparse, falls_back)
    return feedback_transformation(
        config, branches, keeps_residual, aggregate, falls_back=falls_back, warmup=warmup
    )


def _aggregation(
    config: FeedbackConfig, method: Method, branches, warmup: int, sparse: bool, falls_back: bool
):
    """``compress``'s aggregation stage: the warm-up's branch (or the guardrail's fallback), then
    the method over the groups."""

    def aggregate(groups: Groups, flight: InFlight, state: AggregateState):
        fallback = flight.fallback if falls_back else None
        branch, bytes_sent, kept = warmup_stage.choose(
            branches, groups, flight.step, warmup, fallback
        )
        # A step compiled for one branch (data_parallel's, pinning) runs it as compress of that
        # one method would: a sparse method with its in-place residual.
        pinned = pinning.static_choice(flight.record, None)
        if pinned is not None:
            branch, (bytes_sent, kept, _) = pinned, static_cost(branches[pinned], groups)
        runs_sparse = sparse if pinned is None else branches[pinned].sparse
        totals, sents, method_state, vectors = run_branch(
            branches,
            branch,
            groups,
            config.axis_name,
            flight.step,
            flight.key,
            runs_sparse,
            state.method_state,
            pieces=True,
        )
        return Aggregation(
            totals,
            sents,
            bytes_sent,
            kept,
            branch,
            runs_sparse,
            method.sends_everything,
            method_state,
            vectors,
            rounds_only(branches, branch),
        ), None

    return aggregate


def _compress_auto(*, warmup_steps, warmup_method, momentum_correction, **arguments):
    """``compress("auto", ...)``: refuses the single-method options, then hands over."""
    for value, name in (
        (warmup_steps, "warmup_steps"),
        (warmup_method, "warmup_method"),
        (momentum_correction, "momentum_correction"),
    ):
        if value:
            raise ValueError(
                f"{name}= applies to a single method, not to 'auto' (compress_auto chooses dense "
                f"itself while it is the cheapest)"
            )
    return compress_auto_shorthand(**arguments)


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
