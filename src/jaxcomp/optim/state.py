"""The state of :func:`jaxcomp.compress` and :func:`jaxcomp.compress_auto`, and its metrics.

:class:`CompressState` holds each stage's own state: the error-feedback residual, DGC's velocity,
the methods' states, the step counter and PRNG key, ``compress_auto``'s choice, and the metrics
of the last step; :func:`find_compress_state` finds it inside an optax chain's state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.methods import Method

#: What :func:`compress` does with non-finite gradient entries (NaN, ±Inf), its ``nonfinite=``
#: argument; the first is the default. In every policy such entries are never sent and never
#: stored in the residual, and the ``nonfinite`` metric counts them.
NONFINITE_POLICIES = ("zero", "skip", "raise")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NonfinitePolicy:
    """The ``nonfinite=`` policy of a :func:`compress`, kept in its state as static structure.

    It holds no array (a pytree with no leaves), so it costs nothing in a step, a checkpoint or a
    sharding, and host code (:func:`skip_nonfinite`, :func:`jaxcomp.data_parallel`) reads it
    while tracing, without waiting for a device.
    """

    name: str  # one of NONFINITE_POLICIES


class CompressMetrics(NamedTuple):
    """What the last :func:`compress` update measured (scalars, identical on every device).

    ``gain`` is measured on what was aggregated: non-finite entries count as 0 there, and it
    stays finite for huge finite gradients (a device whose sum of squares would exceed 2**100
    sums it with its values scaled by 2**-80).
    """

    # f32[]: compression gain sum_d ||sent_d||^2 / sum_d ||g_e,d||^2 (1 when g_e = 0, and for a
    # method that only rounds: Method.rounds_only)
    gain: jax.Array
    # f32[]: bytes one device sends in this step's collectives
    bytes_sent: jax.Array
    # f32[]: fraction of each device's gradient entries whose values are sent (1 for
    # dense/zfp/quantized; AR-Topk's SPLIT counts its N ceil(k/N) slots: Method.kept_on)
    density: jax.Array
    # i32[]: the method that ran, an index into CompressState.methods (0 for compress)
    method: jax.Array
    # f32[]: non-finite (NaN, ±Inf) entries this step, summed over the devices (exact below
    # 2**24): in a device's gradient or error-fed values, and entries of the sum over the
    # devices that overflowed although every device's was finite (each counted once)
    nonfinite: jax.Array
    # f32[]: 1 on a step the guardrail triggered or that ran its dense fallback, else 0
    fallback: jax.Array
    # f32[]: the guardrail's triggers so far (jaxcomp.Guardrail; 0 when it is off)
    fallbacks: jax.Array


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Branches:
    """The methods a compress state can run, as static structure (no array): one for
    :func:`compress`, one per branch for :func:`jaxcomp.compress_auto`. The ``method`` metric
    indexes it; host code reads it without waiting for a device. ``tells``: the guardrail tells
    the host from inside the step (``Guardrail(callback=True)``), so host code need not;
    ``falls_back``: a trigger switches to dense for the window (else it clears the residual and
    rests), which is what the host says of a trigger; ``warmup``: the dense steps before the
    method runs (:func:`jaxcomp.optim.pinning.next_branch` reads it); ``mean``: the update is the
    mean over the devices (else their sum); ``own_defaults``: a step compiled for one branch runs
    that branch's own buckets and error feedback (``compress_auto``'s ``"auto"``); ``buckets``:
    the vectors go in buckets (``bucket_mb=``), which only a step compiled for one branch sends
    while the backward pass runs (a ``lax.switch`` waits for all of its operands)."""

    methods: tuple[Method, ...]
    tells: bool = False
    falls_back: bool = False
    warmup: int = 0
    mean: bool = True
    own_defaults: bool = False
    buckets: bool = False


class CompressState(NamedTuple):
    """State of :func:`compress` and :func:`jaxcomp.compress_auto`. ``residual`` differs per device;
    the other fields are replicated."""

    # like the gradients: f32 array of the leaf's shape per float leaf (error not yet sent),
    # optax.MaskedNode() elsewhere
    residual: Any
    step: jax.Array  # i32[]: updates done so far; picks AR-Topk's STAR leader, seeds the quantizer
    key: jax.Array  # u32[2] (the default PRNG's raw key): step t draws from fold_in(key, t)
    metrics: CompressMetrics
    auto: Any = None  # jaxcomp.AutoState for compress_auto, else None
    policy: NonfinitePolicy = NonfinitePolicy("zero")  # static: the nonfinite= policy (no array)
    branches: Branches = Branches(())  # static: the methods the `method` metric indexes
    velocity: Any = (
        None  # with momentum_correction: like residual, DGC's momentum per device; else None
    )
    # per method of `methods`: its own state (PowerSGD's Q per group), or None
    method_state: Any = ()
    # with a guardrail (jaxcomp.Guardrail): its GuardrailState (replicated scalars); else None
    divergence: Any = None
    # with branches the host pins (jaxcomp.optim.pinning.can_pin): i32[], the branch the update
    # before asked for (pinning.next_branch of its input), which the host runs; else None
    asked: Any = None

    @property
    def methods(self) -> tuple[Method, ...]:
        """The methods this state runs; ``metrics.method`` is an index into them."""
        return self.branches.methods


def init_metrics() -> CompressMetrics:
    """The metrics of a state no update has run on yet: all zero.

    Returns:
      A :class:`CompressMetrics` of zeros (``method`` int32, the rest float32).

    Example:
      >>> init_metrics().bytes_sent.tolist()
      0.0

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (the compression gain).
    """
    zero = jnp.zeros((), jnp.float32)
    return CompressMetrics(
        gain=zero,
        bytes_sent=zero,
        density=zero,
        method=jnp.zeros((), jnp.int32),
        nonfinite=zero,
        fallback=zero,
        fallbacks=zero,
    )


def find_compress_state(opt_state) -> CompressState | None:
    """The first :class:`CompressState` inside an optimizer state (e.g. an ``optax.chain``'s), or
    None.

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
    return next(_walk(opt_state), None)


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
    return list(_walk(opt_state))


def _walk(node):
    """The :class:`CompressState` s under ``node``, depth first, lazily: a caller that wants the
    first stops there (``data_parallel`` looks twice a step, and a full walk of a 1,000-leaf
    model's Adam state is not free)."""
    if isinstance(node, CompressState):
        yield node
        return
    level = jax.tree_util.default_registry.flatten_one_level(node)
    for child in level[0] if level is not None else ():
        yield from _walk(child)
