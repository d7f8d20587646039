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

import jax
import optax

from jaxcomp import methods
from jaxcomp.methods import Method
from jaxcomp.optim import pinning
from jaxcomp.optim.auto import compress_auto_shorthand
from jaxcomp.optim.config import FeedbackConfig, default_buckets, default_feedback
from jaxcomp.optim.feedback import feedback_transformation
from jaxcomp.optim.stages import divergence
from jaxcomp.optim.stages import momentum as momentum_stage
from jaxcomp.optim.stages import warmup as warmup_stage
from jaxcomp.optim.stages.aggregation import Aggregation, Groups, run_branch, static_cost
from jaxcomp.optim.state import CompressState


def compress(
    method,
    *,
    axis_name="data",
    error_feedback="auto",
    granularity="model",
    mean=True,
    seed=0,
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
    keeps no residual and sums each large leaf where it lies and the small ones (at most 65,536
    values) as one vector: XLA:CPU runs a merged all-reduce as one collective per leaf, a network
    round trip each over gloo (docs/performance.md, "One collective per leaf").

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

    **Guardrails** (``guardrail=``, on by default). Compression must not make training diverge
    silently. Each step measures the gradients' energy ``G`` (one more scalar in the psum of the
    ``gain`` sums: no collective is added, no host sync) against a running mean of it, and the
    error-fed energy against error feedback's bound; when the gradient norm exceeds ``factor``
    times its running RMS (after ``burn_in`` steps), the residual grows past ``factor`` times the
    bound, or either energy overflows, that step sends no update, the residual (and
    ``momentum_correction``'s velocity) is cleared, and the next ``window`` steps aggregate
    densely (the warm-up's switch; a trigger soon after a window doubles the next one), then the
    method runs again. The ``fallback`` metric is 1 on those steps and ``fallbacks`` counts the
    triggers; :func:`jaxcomp.data_parallel` and :func:`jaxcomp.diloco` log each one once the
    step has run (logger ``"jaxcomp"``, and a ``RuntimeWarning`` once; in a loop of your own,
    read ``fallbacks`` or pass ``Guardrail(callback=True)``, which costs jit's fast dispatch). A
    method whose total is not replicated (``Zfp(algorithm="recursive_doubling")``) cannot switch:
    the guardrail only clears its residual and rests for the window. :class:`jaxcomp.Dense`
    has nothing to fall back from: its step is the same with or without it. The cost: one
    reduction over the gradients a step and, for top-k and random-k, the residual updated from a
    dense ``sent`` instead of in place; on CPU top-k's step takes 1.3-2x as long, ZFP's and THC's
    a few percent longer (:mod:`jaxcomp.optim.stages.divergence`, docs/training.md).

    **Buckets** (``bucket_mb=``). XLA merges independent collectives into one (its collective
    combiner), and a whole-model vector needs every gradient, so without buckets nothing is sent
    before the backward pass ends. With ``bucket_mb`` (by default for dense and the casts) the
    leaves are cut into buckets, the last leaves first (the backward pass finishes them first),
    and each bucket's collectives depend on the previous bucket's totals: they stay apart, run in
    order, and the XLA:CPU runtime runs them beside the rest of the backward pass
    (docs/performance.md measures it). Dense gives bit-identical results with or without
    buckets; the casts the same values to the order of their roundings (on the CPU their ring's
    chunks follow the message's length, and float16's shared scale is the bucket's); a method
    that selects or codes compresses each bucket on its own.

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
      error_feedback: keep what was not sent and add it to the next gradient: True, False, or
        ``"auto"`` (the default): on for every method but the casts
        (:attr:`jaxcomp.Method.feeds_back_by_default`), whose only loss is each value's
        rounding; without it they keep a plain optimizer's loss on the quality benchmark and
        save a gradient's memory and passes a step (BENCHMARKS.md, "The casts without error
        feedback").
      granularity: ``"model"`` flattens all float leaves into one vector and compresses it as a
        whole (fused top-k keeps more accuracy than layer-wise); ``"leaf"`` compresses each leaf on
        its own (``k = round(ratio * leaf.size)`` each; for dense, one all-reduce per leaf).
      mean: return the mean across devices (default) instead of the sum.
      seed: seed of the state's PRNG key (the quantizer's stochastic rounding).
      nonfinite: what a step with NaN or ±Inf gradient entries does: ``"zero"`` (default; train
        on with them as 0), ``"skip"`` (every device skips the update) or ``"raise"`` (skip, and
        ``data_parallel`` raises ``FloatingPointError``); see "Non-finite gradients" above.
      warmup_steps: aggregate densely for the first this many steps, then run ``method`` (default
        0; one compiled step, switched by the step counter).
      warmup_method: what the warm-up steps send: None (default) for :class:`jaxcomp.Dense`, or a
        method that sends every value and keeps a plain optimizer's quality, e.g.
        ``jaxcomp.Zfp(8)`` (4x fewer bytes on those steps; its coding errors are fed back as the
        method's are). Needs ``warmup_steps``; a method that sends everything has no warm-up.
      mask: which float leaves are compressed: a pytree of bools like the params, or a callable
        ``params -> pytree``; the others are summed exactly in one fused all-reduce (default None:
        all of them).
      min_size: leaves with fewer values are summed exactly too (default 0).
      momentum_correction: DGC's momentum ``m`` in [0, 1) for :class:`jaxcomp.TopK` and
        :class:`jaxcomp.RandomK`: each device accumulates its velocity ``u = m u + g`` (not ``g``)
        and clears it where sent; follow it with an optimizer without momentum
        (``optax.sgd(lr)`` or ``optax.adam(lr, b1=0)``). Default None.
      guardrail: True (default: ``jaxcomp.Guardrail()``, factor 5, window 50, burn-in 20,
        decay 0.98), a :class:`jaxcomp.Guardrail` with other settings, or False to turn it off;
        see "Guardrails" above.
      bucket_mb: ``"auto"`` (default): buckets of 25 MiB
        (:data:`jaxcomp.optim.config.DEFAULT_BUCKET_MB`) for a method bucketed by default
        (:attr:`jaxcomp.Method.buckets_by_default`: :class:`jaxcomp.Dense`, the same result,
        faster on the emulated cluster on every zoo model measured, 2.1x on 1,030 small leaves;
        :class:`jaxcomp.Cast`, 1.04-1.23x faster on three zoo models at 1 Gbit), one message
        for the methods that select or code.
        None: the gradient is aggregated as one message (or one per leaf, which XLA merges into
        one), after the whole backward pass. A size in MiB (PyTorch DDP's
        ``bucket_cap_mb`` is 25): the leaves are cut into buckets of about that size, the last
        leaves first, and each bucket is aggregated after the previous one, so the first buckets
        travel while the backward pass computes the others (see "Buckets" above). With
        ``granularity="model"`` each bucket is compressed as one vector (top-k keeps
        ``ratio`` of each bucket).
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
      >>> f = jax.jit(jax.shard_map(mean_grad, mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.ones(4 * jax.device_count())).shape
      (4,)

      A NaN is dropped, counted and never kept (here on device 0, with the default ``"zero"``):

      >>> tx = jaxcomp.compress(jaxcomp.TopK(0.5, collective="ar"))
      >>> def metrics(g):
      ...     _, state = tx.update({"w": g}, tx.init({"w": g}))
      ...     return state.metrics.nonfinite, jnp.isnan(state.residual["w"]).any()[None]
      >>> sm = jax.shard_map(metrics, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
      >>> f = jax.jit(sm)
      >>> count, nan_kept = f(jnp.ones(4 * jax.device_count()).at[1].set(jnp.nan))
      >>> float(count), bool(nan_kept.any())
      (1.0, False)

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks" (arXiv 2312.02493): AR-Topk, STAR/VAR leaders, error feedback (Alg. 1), fused
      compression (§3-C3), compression gain (§2-C3).
    """
    if method == "auto":  # the shorthand of the automatic choice
        return _compress_auto(
            warmup_steps=warmup_steps,
            warmup_method=warmup_method,
            momentum_correction=momentum_correction,
            axis_name=axis_name,
            error_feedback=error_feedback,
            granularity=granularity,
            mean=mean,
            seed=seed,
            nonfinite=nonfinite,
            mask=mask,
            min_size=min_size,
            guardrail=guardrail,
            bucket_mb=bucket_mb,
            **shorthand,
        )
    method = _parse_method(method, shorthand)
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

    def aggregate(groups: Groups, state: CompressState):
        key = jax.random.fold_in(state.key, state.step)
        fallback = divergence.falling_back(state.divergence) if falls_back else None
        branch, bytes_sent, kept = warmup_stage.choose(
            branches, groups, state.step, warmup, fallback
        )
        # A step compiled for one branch (data_parallel's, pinning) runs it as compress of that
        # one method would: a sparse method with its in-place residual.
        pinned = pinning.static_choice(state.branches, None)
        if pinned is not None:
            branch, (bytes_sent, kept, _) = pinned, static_cost(branches[pinned], groups)
        runs_sparse = sparse if pinned is None else branches[pinned].sparse
        totals, sents, method_state, vectors = run_branch(
            branches,
            branch,
            groups,
            config.axis_name,
            state.step,
            key,
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
