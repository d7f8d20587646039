"""The optax transformation :func:`compress`: compressed gradient aggregation with error feedback.

``compress`` goes first in an ``optax.chain``; its ``update`` runs inside ``jax.shard_map`` on the
data axis, takes this device's local gradients and returns the aggregated (by default averaged)
gradients, identical on every device, for the rest of the chain::

    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.01, axis_name="data"), optax.adam(1e-3))

Every method goes through one table (:data:`_COLLECTIVES`) of calls into :mod:`jaxcomp.collectives`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _checks, collectives

#: The aggregation methods :func:`compress` accepts, in the order the demo shows them.
METHODS = ("dense", "allgather_topk", "ar_topk", "hierarchical_topk", "zfp", "quantized")

_TOPK_METHODS = ("allgather_topk", "ar_topk", "hierarchical_topk")


class CompressMetrics(NamedTuple):
    """What the last :func:`compress` update measured (all float32 scalars, identical on every device)."""

    gain: jax.Array  # f32[]: compression gain sum_d ||sent_d||^2 / sum_d ||g_e,d||^2 (1 when g_e = 0)
    bytes_sent: jax.Array  # f32[]: bytes one device sends in this step's collectives
    density: jax.Array  # f32[]: fraction of gradient entries whose values are sent (1 for dense/zfp/quantized)


class CompressState(NamedTuple):
    """State of :func:`compress`. ``residual`` differs per device; the other fields are replicated."""

    residual: Any  # like the gradients: f32 array of the leaf's shape per float leaf (error not yet sent), optax.MaskedNode() elsewhere
    step: jax.Array  # i32[]: updates done so far; picks ar_topk's STAR leader, seeds the quantizer
    key: jax.Array  # u32[2] (the default PRNG's raw key): step t draws from fold_in(key, t)
    metrics: CompressMetrics


@dataclasses.dataclass(frozen=True)
class _Config:
    """The validated, static arguments of one :func:`compress` call."""

    method: str
    ratio: float | None
    k: int | None
    rate: int | None
    bits: int | None
    axes: tuple[str, ...]  # mesh axes the gradients are reduced over; (outer, inner) for hierarchical_topk
    error_feedback: bool
    granularity: str
    mean: bool
    leader: str
    selector: str
    algorithm: str
    hadamard: bool
    seed: int

    @property
    def axis_name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def k_for(self, n: int, name: str) -> int:
        """The number of values a top-k method keeps out of ``n`` (validated against ``n``)."""
        if self.ratio is not None:
            return collectives._resolve_k(n, None, self.ratio)  # the formula bytes_sent uses too
        if self.k > n:
            raise ValueError(f"k={self.k} exceeds the {n} gradient entries of {name}; pass a smaller k or ratio=")
        return self.k


# Each entry calls one collective of jaxcomp.collectives on the local 1-D vector x and returns
# (total, sent): the sum over the devices, identical everywhere, and this device's contribution.
def _dense(c: _Config, x, k, step, key):
    return collectives.psum(x, c.axis_name)


def _allgather_topk(c: _Config, x, k, step, key):
    return collectives.allgather_topk(x, k, c.axis_name, selector=c.selector)


def _ar_topk(c: _Config, x, k, step, key):
    return collectives.ar_topk(x, k, c.axis_name, leader=c.leader, step=step, selector=c.selector)


def _hierarchical_topk(c: _Config, x, k, step, key):
    outer, inner = c.axes
    return collectives.hierarchical_topk(x, k, inner, outer, selector=c.selector)


def _zfp(c: _Config, x, k, step, key):
    return collectives.zfp_allreduce(x, c.rate, c.axis_name, algorithm=c.algorithm)


def _quantized(c: _Config, x, k, step, key):
    return collectives.quantized_psum(x, c.bits, c.axis_name, key, hadamard=c.hadamard)


_COLLECTIVES: dict[str, Callable] = {
    "dense": _dense,
    "allgather_topk": _allgather_topk,
    "ar_topk": _ar_topk,
    "hierarchical_topk": _hierarchical_topk,
    "zfp": _zfp,
    "quantized": _quantized,
}


# The name each method's collective has in jaxcomp.collectives.bytes_sent.
_COLLECTIVE_NAMES = {"dense": "psum", "allgather_topk": "allgather_topk", "ar_topk": "ar_topk",
                     "hierarchical_topk": "hierarchical_topk", "zfp": "zfp_allreduce", "quantized": "quantized_psum"}


def _bytes_sent(c: _Config, n: int, k: int | None, n_devices: int, dtype) -> float:
    """Bytes one device sends to aggregate ``n`` values, from the collectives' cost model."""
    options = {
        "ar_topk": {"leader": c.leader},
        "hierarchical_topk": {"inner_size": jax.lax.axis_size(c.axes[-1])},
        "zfp": {"rate": c.rate, "algorithm": c.algorithm},
        "quantized": {"bits": c.bits, "hadamard": c.hadamard},
    }.get(c.method, {})
    if k is not None:
        options["k"] = k
    return collectives.bytes_sent(_COLLECTIVE_NAMES[c.method], n, n_devices,
                                  dtype_bytes=jnp.dtype(dtype).itemsize, **options)


def _is_float(leaf) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def _bound_axis_size(axis_name) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"compress(axis_name={axis_name!r}): update must run inside jax.shard_map over a mesh with axis "
            f"{axis_name!r} (or use jaxcomp.data_parallel); no such axis is bound here") from None


def _check_local_gradients(c: _Config, leaves):
    """Refuses gradients that were already all-reduced densely (the replicated-params trap)."""
    # With check_vma=False nothing is typed varying, so there is nothing to check.
    probe = jax.lax.pcast(jnp.zeros((), jnp.float32), c.axis_name, to="varying")
    if not set(c.axes) <= collectives._varying_axes(probe):
        return
    for leaf in leaves:
        if not set(c.axes) <= collectives._varying_axes(leaf):
            raise ValueError(
                f"compress got gradients that are replicated over {c.axis_name!r}: jax.grad of replicated "
                "params inside shard_map already all-reduced them densely, before compression. Cast the "
                f"params first: params = jax.lax.pcast(params, {c.axis_name!r}, to='varying') (or use "
                "jaxcomp.data_parallel, which does this).")


def _comm_dtype(leaves):
    """The dtype the collectives carry: the gradients' own when they share a 16-bit float, else f32."""
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        return dtypes.pop()
    return jnp.dtype(jnp.float32)


def _init_metrics():
    zero = jnp.zeros((), jnp.float32)
    return CompressMetrics(gain=zero, bytes_sent=zero, density=zero)


def _check_choice(value, name, choices, default, method, used_by):
    if value is None:
        return default
    if method not in used_by:
        raise ValueError(f"{name}= applies to method {' / '.join(repr(m) for m in used_by)} only, "
                         f"not {method!r}; remove it")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_config(method, ratio, k, rate, bits, axis_name, error_feedback, granularity, mean, leader,
                  selector, algorithm, hadamard, seed) -> _Config:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    given = {name: value for name, value in (("ratio", ratio), ("k", k), ("rate", rate), ("bits", bits))
             if value is not None}
    needs = {"dense": (), "zfp": ("rate",), "quantized": ("bits",)}.get(method, ("ratio", "k"))
    extra = sorted(set(given) - set(needs))
    if extra:
        wanted = " or ".join(f"{name}=" for name in needs) or "nothing else"
        raise ValueError(f"method {method!r} takes {wanted}; remove {', '.join(f'{name}=' for name in extra)}")
    if method in _TOPK_METHODS:
        if (ratio is None) == (k is None):
            raise ValueError(f"method {method!r} needs exactly one of ratio= (fraction of entries kept, "
                             f"e.g. 0.01) or k= (entries kept), got ratio={ratio!r}, k={k!r}")
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
                raise TypeError(f"ratio must be a float in (0, 1], got {ratio!r}")
            ratio = float(ratio)
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        else:
            k = _checks.static_int(k, "k", 1, _checks.MAX_ROW_LENGTH)
    if method == "zfp":
        if rate is None:
            raise ValueError("method 'zfp' needs rate= (bits per value, an integer in [1, 32], e.g. 8)")
        rate = _checks.static_int(rate, "rate", 1, 32)
    if method == "quantized":
        if bits is None:
            raise ValueError("method 'quantized' needs bits= (bits per value, an integer in [1, 16], e.g. 8)")
        bits = _checks.static_int(bits, "bits", 1, 16)
    if granularity not in ("model", "leaf"):
        raise ValueError(f"granularity must be 'model' or 'leaf', got {granularity!r}")
    if granularity == "leaf" and k is not None:
        raise ValueError("granularity='leaf' sizes each leaf's top-k by ratio=; pass ratio= instead of k=")
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axis_name must be a mesh axis name or a tuple of distinct ones, got {axis_name!r}")
    if method == "hierarchical_topk" and len(axes) != 2:
        raise ValueError("method 'hierarchical_topk' needs axis_name=(outer, inner), e.g. ('node', 'device'): "
                         f"the slow axis between nodes first, the fast one inside a node; got {axis_name!r}")
    for flag, name in ((error_feedback, "error_feedback"), (mean, "mean")):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    leader = _check_choice(leader, "leader", ("star", "var"), "star", method, ("ar_topk",))
    selector = _check_choice(selector, "selector", ("exact", "threshold"), "exact", method, _TOPK_METHODS)
    algorithm = _check_choice(algorithm, "algorithm", ("ring", "recursive_doubling"), "ring", method, ("zfp",))
    hadamard = _check_choice(hadamard, "hadamard", (True, False), True, method, ("quantized",))
    seed = _checks.static_int(seed, "seed", 0)
    return _Config(method=method, ratio=ratio, k=k, rate=rate, bits=bits, axes=axes,
                   error_feedback=bool(error_feedback), granularity=granularity, mean=bool(mean), leader=leader,
                   selector=selector, algorithm=algorithm, hadamard=bool(hadamard), seed=seed)


def compress(method, *, ratio=None, k=None, rate=None, bits=None, axis_name="data", error_feedback=True,
             granularity="model", mean=True, leader=None, selector=None, algorithm=None, hadamard=None,
             seed=0) -> optax.GradientTransformationExtraArgs:
    """Aggregates gradients across a mesh axis with a compressing collective and error feedback.

    Put it first in an ``optax.chain`` and call the chain's ``update`` inside ``jax.shard_map``
    with this device's local gradients (varying over ``axis_name``); it returns the aggregated
    gradients, identical on every device. Each device keeps the part of its error-fed gradient that
    the collective did not send and adds it to the next step's gradient (error feedback):
    ``g_e = g + residual; residual <- g_e - sent``.

    Gradients of replicated params are already all-reduced, densely, by ``jax.grad`` inside
    shard_map; ``update`` detects this (when shard_map checks types, the default) and raises.
    Cast params to varying first (``jax.lax.pcast(params, axis_name, to="varying")``) or use
    :func:`jaxcomp.data_parallel`. Leaves that are not floating point (ints, ``float0``) pass
    through untouched; bfloat16/float16 gradients travel in their own dtype when all leaves share
    it, and the residual is kept in float32.

    Args:
      method: ``"dense"`` (plain all-reduce), ``"allgather_topk"``, ``"ar_topk"``,
        ``"hierarchical_topk"`` (all need ``ratio`` or ``k``), ``"zfp"`` (needs ``rate``) or
        ``"quantized"`` (needs ``bits``).
      ratio: fraction of gradient entries a top-k method sends, in ``(0, 1]``
        (``k = max(1, round(ratio * n))``).
      k: number of entries a top-k method sends (``granularity="model"`` only).
      rate: zfp bits per value, integer in ``[1, 32]``.
      bits: quantized bits per value, integer in ``[1, 16]``.
      axis_name: mesh axis the gradients are reduced over, or a tuple of axes (reduced over all).
        ``"hierarchical_topk"`` needs ``(outer, inner)``: the slow axis (between nodes) first.
      error_feedback: keep what was not sent and add it to the next gradient (default True).
      granularity: ``"model"`` flattens all float leaves into one vector and compresses it as a
        whole (fused top-k keeps more accuracy than layer-wise); ``"leaf"`` compresses each leaf on
        its own (``k = round(ratio * leaf.size)`` each).
      mean: return the mean across devices (default) instead of the sum.
      leader: ``"ar_topk"`` only: ``"star"`` (round-robin, default) or ``"var"`` (largest variance).
      selector: top-k methods only: ``"exact"`` (default, :func:`jaxcomp.topk`) or ``"threshold"``
        (MSTopK, :func:`jaxcomp.threshold_topk`).
      algorithm: ``"zfp"`` only: ``"ring"`` (default) or ``"recursive_doubling"``.
      hadamard: ``"quantized"`` only: rotate by a random Hadamard transform first (default True).
      seed: seed of the state's PRNG key (the quantizer's stochastic rounding).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> def mean_grad(g):  # g: this device's gradient, varying over "data"
      ...     updates, _ = tx.update({"w": g}, tx.init({"w": g}))
      ...     return updates["w"]
      >>> f = jax.shard_map(mean_grad, mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> f(jnp.ones(4 * jax.device_count())).shape
      (4,)

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks" (arXiv 2312.02493): AR-Topk, STAR/VAR leaders, error feedback (Alg. 1), fused
      compression (§3-C3), compression gain (§2-C3).
    """
    c = _check_config(method, ratio, k, rate, bits, axis_name, error_feedback, granularity, mean, leader,
                      selector, algorithm, hadamard, seed)

    def init_fn(params):
        residual = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32) if _is_float(p) else optax.MaskedNode(), params)
        return CompressState(residual=residual, step=jnp.zeros((), jnp.int32),
                             key=jax.random.PRNGKey(c.seed), metrics=_init_metrics())

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        try:
            residuals = treedef.flatten_up_to(state.residual)
        except (ValueError, TypeError) as e:
            raise ValueError("updates do not have the structure of the params compress was initialized with: "
                             f"{e}") from None
        floats = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
        if not floats:
            return updates, state
        n_devices = math.prod(_bound_axis_size(a) for a in c.axes)
        _check_local_gradients(c, [leaves[i] for i in floats])
        comm_dtype = _comm_dtype([leaves[i] for i in floats])
        base_key = jax.random.fold_in(state.key, state.step)

        error_fed = {}
        for i in floats:
            g = leaves[i].astype(jnp.float32)
            error_fed[i] = g + residuals[i] if c.error_feedback else g

        # (positions, 1-D vector) groups the collective runs on: one for the model, one per leaf.
        if c.granularity == "model":
            groups = [(floats, jnp.concatenate([error_fed[i].ravel() for i in floats]))]
        else:
            groups = [([i], error_fed[i].ravel()) for i in floats]

        totals, sents, bytes_sent, kept = {}, {}, 0, 0
        for group_index, (positions, vector) in enumerate(groups):
            n = vector.shape[0]
            k = c.k_for(n, "the model" if c.granularity == "model" else f"leaf {positions[0]}") \
                if c.method in _TOPK_METHODS else None
            key = jax.random.fold_in(base_key, group_index)
            total, sent = _COLLECTIVES[c.method](c, vector.astype(comm_dtype), k, state.step, key)
            bytes_sent += _bytes_sent(c, n, k, n_devices, comm_dtype)
            kept += n if k is None else k
            offset = 0
            for i in positions:
                size = leaves[i].size
                totals[i] = total[offset:offset + size].reshape(leaves[i].shape)
                sents[i] = sent[offset:offset + size].reshape(leaves[i].shape).astype(jnp.float32)
                offset += size

        scale = 1.0 / n_devices if c.mean else 1.0
        out = list(leaves)
        new_residuals = list(residuals)
        for i in floats:
            out[i] = (totals[i].astype(jnp.float32) * scale).astype(leaves[i].dtype)
            if c.error_feedback:
                new_residuals[i] = error_fed[i] - sents[i]

        sent_sq = sum(jnp.sum(jnp.square(sents[i])) for i in floats)
        fed_sq = sum(jnp.sum(jnp.square(error_fed[i])) for i in floats)
        sent_sq, fed_sq = jax.lax.psum(jnp.stack([sent_sq, fed_sq]), c.axis_name)
        gain = jnp.where(fed_sq > 0, sent_sq / jnp.where(fed_sq > 0, fed_sq, 1.0), 1.0)
        total_size = sum(leaves[i].size for i in floats)
        metrics = CompressMetrics(gain=gain.astype(jnp.float32),
                                  bytes_sent=jnp.asarray(bytes_sent, jnp.float32),
                                  density=jnp.asarray(kept / total_size, jnp.float32))
        new_state = CompressState(residual=treedef.unflatten(new_residuals), step=state.step + 1,
                                  key=state.key, metrics=metrics)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_compress_state(opt_state) -> CompressState | None:
    """The first :class:`CompressState` inside an optimizer state (e.g. an ``optax.chain``'s), or None.

    Args:
      opt_state: any optax state pytree.

    Returns:
      The :class:`CompressState` found first in depth-first order, or ``None``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.compress("dense"), optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> jaxcomp.find_compress_state(state).step.tolist()
      0

    References:
      Tyagi & Swany, arXiv 2312.02493 (the state follows Alg. 1's per-worker residual).
    """
    found = [node for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CompressState))
             if isinstance(node, CompressState)]
    return found[0] if found else None
