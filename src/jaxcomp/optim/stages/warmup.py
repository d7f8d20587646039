"""The warm-up's switch: aggregate densely (or with a method that sends every value) for the first
steps, then run the method.

Both branches are compiled into one step; the step counter picks one (``lax.switch``), so the
switch never recompiles. :func:`jaxcomp.data_parallel` compiles a step per branch instead, for a
sparse method (:mod:`jaxcomp.optim.pinning`), and runs the method from one step after the
warm-up. The ``method`` metric says which ran.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp import methods
from jaxcomp.methods import Method
from jaxcomp.ops import _checks
from jaxcomp.optim.stages.aggregation import Groups, static_cost

#: The method of the warm-up steps.
DENSE = methods.Dense()


def warmup_length(method: Method, warmup_steps) -> int:
    """The dense steps before ``method`` runs: ``warmup_steps``, at least the method's own
    :attr:`~jaxcomp.methods.Method.dense_steps`, and 0 for a method that is dense already.

    Args:
      method: the :mod:`jaxcomp.methods` object.
      warmup_steps: the ``warmup_steps=`` argument, an int >= 0.

    Returns:
      The number of warm-up steps.

    Example:
      >>> from jaxcomp.methods import Dense, TopK
      >>> warmup_length(TopK(0.1), 5), warmup_length(Dense(), 5)
      (5, 0)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (warm-up training).
    """
    warmup = max(_checks.static_int(warmup_steps, "warmup_steps", 0), method.dense_steps)
    if warmup and method.sends_everything:
        warmup = 0  # dense already
    return warmup


def check_switchable(method: Method, warmup: int) -> None:
    """Refuses a warm-up before a method whose total is not replicated (the switch needs one type).

    Args:
      method: the :mod:`jaxcomp.methods` object.
      warmup: :func:`warmup_length`'s result.

    Returns:
      None; raises a ValueError naming ``warmup_steps``.

    Example:
      >>> from jaxcomp.methods import Zfp
      >>> check_switchable(Zfp(8, algorithm="recursive_doubling"), 10)
      Traceback (most recent call last):
      ValueError: warmup_steps needs a method whose total comes out replicated, ...

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    if warmup and not method.replicated_total:
        raise ValueError(
            f"warmup_steps needs a method whose total comes out replicated, to switch from dense "
            f"to it inside one compiled step; {method.describe()} does not (for Zfp: "
            f"algorithm='ring')"
        )


def check_warmup_method(warmup_method, warmup_steps) -> Method:
    """The method of the warm-up steps: ``warmup_method`` parsed and checked, :data:`DENSE` for
    None.

    A warm-up is there so that the optimizer starts from what a dense run sees (Adam's variance,
    DGC's first steps), so its method must send every value (not a sparsifier), come out
    replicated (one ``lax.switch`` holds both branches), keep no state of its own and need no
    warm-up itself: a cast (:class:`jaxcomp.Cast`), :class:`jaxcomp.Zfp` (ring) or
    :class:`jaxcomp.Quantized`, which send 2-8x fewer bytes than dense on those steps.

    Args:
      warmup_method: None, a :mod:`jaxcomp.methods` object or a shorthand name.
      warmup_steps: the ``warmup_steps=`` argument (refused if 0: there is nothing to warm up).
        A method that sends everything has no warm-up (:func:`warmup_length`), and
        :func:`branches` then leaves the warm-up's method out.

    Returns:
      The method.

    Example:
      >>> from jaxcomp.methods import TopK, Zfp
      >>> check_warmup_method(Zfp(8), 10).describe()
      'zfp(8)'
      >>> check_warmup_method(TopK(0.1), 10)
      Traceback (most recent call last):
      ValueError: warmup_method must send every value (a cast, zfp or quantized), ...

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (warm-up training); Tang et al.,
      "1-bit Adam", ICML 2021, §4 (the warm-up that estimates Adam's variance).
    """
    if warmup_method is None:
        return DENSE
    if not isinstance(warmup_method, (Method, str)):
        raise TypeError(
            "warmup_method must be None, a jaxcomp.methods.Method or a method name, got "
            f"{type(warmup_method).__name__}"
        )
    try:
        method = methods.parse(warmup_method)
    except ValueError as e:
        raise ValueError(f"warmup_method={warmup_method!r}: {e}") from None
    if not warmup_steps:
        raise ValueError(f"warmup_method={method.describe()} needs warmup_steps > 0")
    if method.sparse or method.stateful or method.dense_steps or not method.replicated_total:
        raise ValueError(
            "warmup_method must send every value (a cast, zfp or quantized), keep no state of "
            "its own and come out replicated (for Zfp: algorithm='ring'), got "
            f"{method.describe()}"
        )
    return method


def branches(method: Method, warmup: int, warmup_method: Method = DENSE) -> tuple[Method, ...]:
    """The methods the state records: with a warm-up, its method (dense by default) first, then
    ``method``.

    Args:
      method: the :mod:`jaxcomp.methods` object.
      warmup: :func:`warmup_length`'s result.
      warmup_method: the warm-up's method (:func:`check_warmup_method`).

    Returns:
      ``(warmup_method, method)`` or ``(method,)``.

    Example:
      >>> from jaxcomp.methods import TopK
      >>> [m.describe() for m in branches(TopK(0.1), 3)]
      ['dense', 'allgather_topk(0.1)']

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    return (warmup_method, method) if warmup else (method,)


def choose(runs: tuple[Method, ...], groups: Groups, step, warmup: int, fallback=None):
    """The branch this step runs and its static cost: ``(branch, bytes one device sends, values
    kept)``; a Python int and floats without a warm-up or a guardrail, traced scalars with one.

    Args:
      runs: :func:`branches`'s result.
      groups: the update's :class:`~jaxcomp.optim.stages.aggregation.Groups`.
      step: the state's step counter.
      warmup: :func:`warmup_length`'s result.
      fallback: the guardrail's flag (:func:`jaxcomp.optim.stages.divergence.falling_back`):
        when true, the step runs ``DENSE`` (which ``runs`` then holds); None without one.

    Returns:
      ``(branch, bytes_sent, kept)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import TopK
      >>> groups = Groups([None], ["the model"], [1000], 8, None, 4)
      >>> runs = branches(TopK(0.1), 3)
      >>> [float(x) for x in choose(runs, groups, jnp.int32(5), 3)]
      [1.0, 5600.0, 100.0]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    if not warmup and fallback is None:
        bytes_sent, kept, _ = static_cost(runs[0], groups)
        return 0, bytes_sent, kept
    branch = (step >= warmup).astype(jnp.int32) if warmup else jnp.zeros((), jnp.int32)
    if fallback is not None:
        branch = jnp.where(fallback, runs.index(DENSE), branch).astype(jnp.int32)
    costs = [static_cost(m, groups) for m in runs]
    bytes_sent = jnp.asarray([cost[0] for cost in costs], jnp.float32)[branch]
    kept = jnp.asarray([cost[1] for cost in costs], jnp.float32)[branch]
    return branch, bytes_sent, kept
