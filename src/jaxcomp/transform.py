"""The optax transformation :func:`compress`: compressed gradient aggregation with error feedback.

``compress`` goes first in an ``optax.chain``; its ``update`` runs inside ``jax.shard_map`` on the
data axis, takes this device's local gradients and returns the aggregated (by default averaged)
gradients, identical on every device, for the rest of the chain::

    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.01, axis_name="data"), optax.adam(1e-3))

Every method goes through one table (:data:`_COLLECTIVES`) of calls into :mod:`jaxcomp.collectives`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _checks, adaptive, collectives, cost

#: The aggregation methods :func:`compress` accepts, in the order the demo shows them. The
#: ``method`` metric is an index into this tuple (``"auto"`` reports the method it ran).
METHODS = ("dense", "allgather_topk", "ar_topk", "hierarchical_topk", "zfp", "quantized", "auto")

#: How long ``compress("auto")`` keeps a choice: it re-decides every this many steps by default,
#: and at once when the network moves by :data:`NETWORK_TOLERANCE` or more.
DEFAULT_DECIDE_EVERY = 100

#: Steps ``compress("auto", adaptive_ratio=True)`` runs each candidate ratio while exploring.
DEFAULT_EXPLORE_STEPS = 10

#: Relative change of latency or bandwidth that makes ``compress("auto")`` re-decide at once.
NETWORK_TOLERANCE = 0.1

_TOPK_METHODS = ("allgather_topk", "ar_topk", "hierarchical_topk")

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

    ``gain`` is measured on what was aggregated: non-finite entries count as 0 there, and a sum
    that overflowed makes it NaN or Inf rather than a plausible number.
    """

    gain: jax.Array  # f32[]: compression gain sum_d ||sent_d||^2 / sum_d ||g_e,d||^2 (1 when g_e = 0)
    bytes_sent: jax.Array  # f32[]: bytes one device sends in this step's collectives
    density: jax.Array  # f32[]: fraction of gradient entries whose values are sent (1 for dense/zfp/quantized)
    method: jax.Array  # i32[]: the method that ran, an index into jaxcomp.METHODS (for "auto": its choice)
    nonfinite: jax.Array  # f32[]: non-finite (NaN, ±Inf) gradient entries this step, summed over the devices (exact below 2**24)


class AutoState(NamedTuple):
    """What ``compress("auto")`` decides with; replicated. ``B`` candidate branches, compiled once each.

    A branch is one method at one setting (a top-k method once per candidate ratio). Set the
    network with :func:`set_network` (``jaxcomp.data_parallel`` probes it for you).
    """

    network: jax.Array  # f32[2]: (alpha seconds, beta seconds per byte) of the latest probe; NaN until one is set
    overhead: jax.Array  # f32[B]: each branch's encode + decode seconds (0 until measured)
    decided: jax.Array  # f32[2]: the network the current choice was made with (NaN before the first choice)
    choice: jax.Array  # i32[]: the chosen method, an index into the candidates
    ratio: Any  # adaptive.RatioState with adaptive_ratio=True, else None
    branch_method: jax.Array  # i32[B]: constant, each branch's method as an index into METHODS
    branch_setting: jax.Array  # f32[B]: constant, each branch's ratio (top-k), rate (zfp), bits (quantized), NaN (dense)


class CompressState(NamedTuple):
    """State of :func:`compress`. ``residual`` differs per device; the other fields are replicated."""

    residual: Any  # like the gradients: f32 array of the leaf's shape per float leaf (error not yet sent), optax.MaskedNode() elsewhere
    step: jax.Array  # i32[]: updates done so far; picks ar_topk's STAR leader, seeds the quantizer
    key: jax.Array  # u32[2] (the default PRNG's raw key): step t draws from fold_in(key, t)
    metrics: CompressMetrics
    auto: Any = None  # AutoState for method "auto", else None
    policy: NonfinitePolicy = NonfinitePolicy("zero")  # static: the nonfinite= policy (no array)


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
    nonfinite: str = "zero"
    # "auto" only:
    candidates: tuple[str, ...] = ()  # the methods it chooses among, in branch order
    ratios: tuple[float, ...] = ()  # the top-k candidates' ratios: (ratio,) or the adaptive ladder
    adaptive_ratio: bool = False
    decide_every: int = DEFAULT_DECIDE_EVERY
    explore_steps: int = 0
    network: cost.Network | None = None

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

    def branches(self) -> list[tuple[int, int, _Config]]:
        """``"auto"``'s branches: (candidate index, ratio index, config of that one method)."""
        out = []
        for m, name in enumerate(self.candidates):
            ratios = self.ratios if name in _TOPK_METHODS else (None,)
            for r, ratio in enumerate(ratios):
                out.append((m, r, dataclasses.replace(self, method=name, ratio=ratio, candidates=(), ratios=())))
        return out

    def setting(self) -> float:
        """The branch's ratio, rate or bits (NaN for dense): what :class:`AutoState` records."""
        value = {"zfp": self.rate, "quantized": self.bits}.get(self.method, self.ratio)
        return math.nan if value is None else float(value)

    def cost_method(self) -> str:
        """This method's name in :mod:`jaxcomp.cost`."""
        return cost_method(self.method, self.algorithm)


def cost_method(method: str, algorithm: str = "ring") -> str:
    """The :mod:`jaxcomp.cost` name of a :func:`compress` method: what ``"auto"`` predicts it with.

    jaxcomp's all-reduces are costed as rings (``psum`` and AR-Topk's two all-reduces).

    Args:
      method: a :data:`METHODS` entry other than ``"auto"``.
      algorithm: ``"zfp"``'s algorithm, ``"ring"`` or ``"recursive_doubling"``.

    Returns:
      A :data:`jaxcomp.cost.METHODS` entry.

    Example:
      >>> cost_method("dense"), cost_method("ar_topk"), cost_method("zfp")
      ('dense_ring', 'ar_topk_ring', 'zfp_ring')

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I (ring and tree variants).
    """
    if method == "zfp":
        return "zfp_" + algorithm
    return {"dense": "dense_ring", "ar_topk": "ar_topk_ring"}.get(method, method)


# Each entry calls one collective of jaxcomp.collectives on the local 1-D vector x and returns
# (total, sent): the sum over the devices, identical everywhere, and this device's contribution.
# ``sparse``: a top-k collective returns ``sent`` as (indices, values) pairs (see update_fn).
def _dense(c: _Config, x, k, step, key, sparse=False):
    return collectives.psum(x, c.axis_name)


def _allgather_topk(c: _Config, x, k, step, key, sparse=False):
    return collectives.allgather_topk(x, k, c.axis_name, selector=c.selector, sparse_sent=sparse)


def _ar_topk(c: _Config, x, k, step, key, sparse=False):
    return collectives.ar_topk(x, k, c.axis_name, leader=c.leader, step=step, selector=c.selector,
                               sparse_sent=sparse)


def _hierarchical_topk(c: _Config, x, k, step, key, sparse=False):
    outer, inner = c.axes
    return collectives.hierarchical_topk(x, k, inner, outer, selector=c.selector, sparse_sent=sparse)


def _zfp(c: _Config, x, k, step, key, sparse=False):
    return collectives.zfp_allreduce(x, c.rate, c.axis_name, algorithm=c.algorithm)


def _quantized(c: _Config, x, k, step, key, sparse=False):
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


def _aggregate(c: _Config, vectors, names, step, base_key, sparse=False):
    """Runs ``c``'s collective on each group's vector: (totals, sents), one per group.

    With ``sparse`` (top-k methods only) each ``sent`` is the (indices, values) pairs."""
    totals, sents = [], []
    for group_index, (vector, name) in enumerate(zip(vectors, names)):
        k = c.k_for(vector.shape[0], name) if c.method in _TOPK_METHODS else None
        total, sent = _COLLECTIVES[c.method](c, vector, k, step, jax.random.fold_in(base_key, group_index), sparse)
        totals.append(total)
        sents.append(sent)
    return totals, sents


def _static_cost(c: _Config, sizes, names, n_devices: int, dtype) -> tuple[float, int, int]:
    """(bytes one device sends, values kept, sequential message steps) of ``c``'s method over the groups."""
    inner = jax.lax.axis_size(c.axes[-1]) if c.method == "hierarchical_topk" else None
    sent, kept, steps = 0.0, 0, 0
    for n, name in zip(sizes, names):
        k = c.k_for(n, name) if c.method in _TOPK_METHODS else None
        sent += _bytes_sent(c, n, k, n_devices, dtype)
        kept += n if k is None else k
        steps += cost.message_steps(c.cost_method(), n_devices, inner_size=inner)
    return sent, kept, steps


class _AutoPlan:
    """``"auto"``'s branches with their static costs, built while tracing one update."""

    def __init__(self, c: _Config, sizes, names, n_devices: int, dtype):
        self.config = c
        self.branches = [config for _, _, config in c.branches()]
        costs = np.array([_static_cost(b, sizes, names, n_devices, dtype) for b in self.branches], np.float64)
        self.bytes, self.kept, self.steps = (costs[:, i].astype(np.float32) for i in range(3))
        # table[m, r]: the branch of candidate m at ratio r (a method without a ratio fills its row).
        self.table = np.zeros((len(c.candidates), max(1, len(c.ratios))), np.int32)
        for b, (m, r, config) in enumerate(c.branches()):
            if config.method in _TOPK_METHODS:
                self.table[m, r] = b
            else:
                self.table[m, :] = b
        self.topk_rows = np.array([m for m, name in enumerate(c.candidates) if name in _TOPK_METHODS], np.int32)
        self.topk_row = np.array([name in _TOPK_METHODS for name in c.candidates])
        self.topk_branch = np.array([b.method in _TOPK_METHODS for b in self.branches])
        self.method_ids = np.array([METHODS.index(b.method) for b in self.branches], np.int32)

    def sync_per_ratio(self, comm):
        """Predicted communication seconds of each candidate ratio by its cheapest top-k collective."""
        comm = jnp.where(jnp.isfinite(comm), comm, 0.0)  # no network yet: time counts as flat
        return jnp.min(comm[self.table[self.topk_rows, :]], axis=0)

    def decide(self, auto: AutoState, step):
        """Re-decides when due; returns (new AutoState, branch to run, predicted comm seconds per branch)."""
        c = self.config
        known = jnp.all(jnp.isfinite(auto.network))
        moved = (jnp.any(adaptive._moved(auto.decided, auto.network, NETWORK_TOLERANCE, jnp))
                 | ~jnp.all(jnp.isfinite(auto.decided)))
        due = known & ((step % c.decide_every == 0) | moved)
        decided = jnp.where(due, auto.network, auto.decided)
        comm = jnp.asarray(self.steps) * decided[0] + jnp.asarray(self.bytes) * decided[1]
        predicted = comm + auto.overhead
        ratio = auto.ratio
        if c.adaptive_ratio:
            # A moved network re-chooses the ratio from the last exploration, without exploring.
            ratio = adaptive._select(due & moved, adaptive.ratio_redecide(ratio, self.sync_per_ratio(comm)), ratio)
            r = ratio.index
            # While exploring, top-k competes at its lowest density: could it pay at all?
            r_judge = jnp.where(ratio.exploring, len(c.ratios) - 1, r)
        else:
            r = r_judge = 0
        table = jnp.asarray(self.table)
        choice = jnp.where(due, jnp.argmin(predicted[table[:, r_judge]]), auto.choice).astype(jnp.int32)
        row = choice
        if self.topk_rows.size:
            # A top-k choice runs the cheapest top-k collective at the ratio of this step.
            best = jnp.asarray(self.topk_rows)[jnp.argmin(predicted[table[self.topk_rows, r]])]
            row = jnp.where(jnp.asarray(self.topk_row)[choice], best, choice)
        branch = table[row, r]
        return auto._replace(decided=decided, choice=choice, ratio=ratio), branch, comm

    def observe(self, auto: AutoState, branch, gain, comm) -> AutoState:
        """Feeds a top-k step's gain to the ratio controller."""
        if not self.config.adaptive_ratio:
            return auto
        observed = adaptive.ratio_observe(auto.ratio, gain, auto.overhead[branch], jnp.nan,
                                          self.sync_per_ratio(comm))
        # A gain that could not be measured (NaN or Inf: the sums overflowed) teaches nothing.
        learn = jnp.asarray(self.topk_branch)[branch] & jnp.isfinite(gain)
        return auto._replace(ratio=adaptive._select(learn, observed, auto.ratio))


def _auto_init(c: _Config) -> AutoState:
    branches = [config for _, _, config in c.branches()]
    network = (np.full(2, np.nan) if c.network is None else np.array([c.network.alpha, c.network.beta]))
    return AutoState(
        network=jnp.asarray(network, jnp.float32), overhead=jnp.zeros(len(branches), jnp.float32),
        decided=jnp.full(2, jnp.nan, jnp.float32), choice=jnp.zeros((), jnp.int32),
        ratio=adaptive.ratio_init(len(c.ratios), c.explore_steps) if c.adaptive_ratio else None,
        branch_method=jnp.array([METHODS.index(b.method) for b in branches], jnp.int32),
        branch_setting=jnp.array([b.setting() for b in branches], jnp.float32))


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


def _init_metrics(method_index: int):
    zero = jnp.zeros((), jnp.float32)
    return CompressMetrics(gain=zero, bytes_sent=zero, density=zero, method=jnp.asarray(method_index, jnp.int32),
                           nonfinite=zero)


def _check_choice(value, name, choices, default, methods, used_by):
    if value is None:
        return default
    if not set(methods) & set(used_by):
        raise ValueError(f"{name}= applies to method {' / '.join(repr(m) for m in used_by)} only, "
                         f"not {' / '.join(repr(m) for m in methods)}; remove it")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_ratio(ratio):
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
        raise TypeError(f"ratio must be a float in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return ratio


_AUTO_ONLY = ("candidates", "network", "decide_every", "adaptive_ratio", "ratio_range", "explore_steps")


def _check_auto(ratio, k, rate, bits, axes, candidates, network, decide_every, adaptive_ratio, ratio_range,
                explore_steps):
    """The "auto" arguments: (candidates, ratios, decide_every, explore_steps, network)."""
    if k is not None:
        raise ValueError("method 'auto' sizes top-k by ratio= (its cost model is per ratio); pass ratio= "
                         "instead of k=")
    adaptive_ratio = False if adaptive_ratio is None else adaptive_ratio
    if not isinstance(adaptive_ratio, (bool, np.bool_)):
        raise TypeError(f"adaptive_ratio must be True or False, got {adaptive_ratio!r}")
    if adaptive_ratio:
        if ratio is not None:
            raise ValueError("adaptive_ratio=True chooses the ratio from ratio_range=; remove ratio=")
        ratios = adaptive.candidate_ratios(adaptive.DEFAULT_RATIO_RANGE if ratio_range is None else ratio_range)
    else:
        if ratio_range is not None:
            raise ValueError("ratio_range= applies with adaptive_ratio=True only; remove it or set adaptive_ratio=True")
        ratios = () if ratio is None else (_check_ratio(ratio),)
    if candidates is None:
        candidates = ["dense"]
        if ratios:
            candidates += ["allgather_topk", "ar_topk"] + (["hierarchical_topk"] if len(axes) == 2 else [])
        candidates += (["zfp"] if rate is not None else []) + (["quantized"] if bits is not None else [])
        if len(candidates) == 1:
            raise ValueError("method 'auto' needs something to compress with: ratio= (top-k methods), "
                             "adaptive_ratio=True, rate= (zfp) or bits= (quantized)")
    else:
        if isinstance(candidates, str) or not all(isinstance(m, str) for m in candidates):
            raise TypeError(f"candidates must be a sequence of method names, got {candidates!r}")
        candidates = list(candidates)
        bad = [m for m in candidates if m not in METHODS[:-1]]
        if bad or not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct methods from {METHODS[:-1]}, got {tuple(candidates)!r}")
        for method, needed, given in (("zfp", "rate=", rate), ("quantized", "bits=", bits)):
            if (method in candidates) != (given is not None):
                raise ValueError(f"{needed} goes with candidate {method!r}: pass both or neither "
                                 f"(candidates={tuple(candidates)!r})")
        topk = [m for m in candidates if m in _TOPK_METHODS]
        if bool(topk) != bool(ratios):
            raise ValueError(f"top-k candidates need ratio= (or adaptive_ratio=True), and ratio= needs a top-k "
                             f"candidate; got candidates={tuple(candidates)!r}")
    if "hierarchical_topk" in candidates and len(axes) != 2:
        raise ValueError("candidate 'hierarchical_topk' needs axis_name=(outer, inner)")
    decide_every = _checks.static_int(DEFAULT_DECIDE_EVERY if decide_every is None else decide_every,
                                      "decide_every", 1)
    explore_steps = adaptive._check_explore_steps(DEFAULT_EXPLORE_STEPS if explore_steps is None else explore_steps)
    if network is not None and not isinstance(network, cost.Network):
        raise TypeError(f"network must be a jaxcomp.cost.Network (e.g. jaxcomp.probe(mesh, axis)) or None, "
                        f"got {type(network).__name__}")
    return tuple(candidates), ratios, bool(adaptive_ratio), decide_every, explore_steps, network


def _check_config(method, ratio, k, rate, bits, axis_name, error_feedback, granularity, mean, leader,
                  selector, algorithm, hadamard, seed, nonfinite="zero", **auto) -> _Config:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axis_name must be a mesh axis name or a tuple of distinct ones, got {axis_name!r}")
    auto_config = {}
    if method == "auto":
        candidates, ratios, adaptive_ratio, decide_every, explore_steps, network = _check_auto(
            ratio, k, rate, bits, axes, **auto)
        methods = candidates
        auto_config = dict(candidates=candidates, ratios=ratios, adaptive_ratio=adaptive_ratio,
                           decide_every=decide_every, explore_steps=explore_steps, network=network)
        ratio = ratios[0] if ratios else None
    else:
        passed = [name for name in _AUTO_ONLY if auto[name] is not None]
        if passed:
            raise ValueError(f"{', '.join(f'{name}=' for name in passed)} applies to method 'auto' only; "
                             f"remove it for method {method!r}")
        methods = (method,)
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
                ratio = _check_ratio(ratio)
            else:
                k = _checks.static_int(k, "k", 1, _checks.MAX_ROW_LENGTH)
        if method == "zfp" and rate is None:
            raise ValueError("method 'zfp' needs rate= (bits per value, an integer in [1, 32], e.g. 8)")
        if method == "quantized" and bits is None:
            raise ValueError("method 'quantized' needs bits= (bits per value, an integer in [1, 16], e.g. 8)")
        if method == "hierarchical_topk" and len(axes) != 2:
            raise ValueError("method 'hierarchical_topk' needs axis_name=(outer, inner), e.g. ('node', 'device'): "
                             f"the slow axis between nodes first, the fast one inside a node; got {axis_name!r}")
    if rate is not None:
        rate = _checks.static_int(rate, "rate", 1, 32)
    if bits is not None:
        bits = _checks.static_int(bits, "bits", 1, 16)
    if granularity not in ("model", "leaf"):
        raise ValueError(f"granularity must be 'model' or 'leaf', got {granularity!r}")
    if granularity == "leaf" and k is not None:
        raise ValueError("granularity='leaf' sizes each leaf's top-k by ratio=; pass ratio= instead of k=")
    for flag, name in ((error_feedback, "error_feedback"), (mean, "mean")):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    leader = _check_choice(leader, "leader", ("star", "var"), "star", methods, ("ar_topk",))
    selector = _check_choice(selector, "selector", ("exact", "threshold"), "exact", methods, _TOPK_METHODS)
    algorithm = _check_choice(algorithm, "algorithm", ("ring", "recursive_doubling"), "ring", methods, ("zfp",))
    if method == "auto" and algorithm == "recursive_doubling":
        raise ValueError("method 'auto' runs zfp with algorithm='ring': the recursive-doubling total is typed "
                         "varying and the branches must agree; remove algorithm=")
    hadamard = _check_choice(hadamard, "hadamard", (True, False), True, methods, ("quantized",))
    seed = _checks.static_int(seed, "seed", 0, 2**32 - 1)  # PRNGKey keeps 32 bits: 2**32 would be seed 0
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES} (what to do with NaN/Inf gradient "
                         f"entries), got {nonfinite!r}")
    return _Config(method=method, ratio=ratio, k=k, rate=rate, bits=bits, axes=axes,
                   error_feedback=bool(error_feedback), granularity=granularity, mean=bool(mean), leader=leader,
                   selector=selector, algorithm=algorithm, hadamard=bool(hadamard), seed=seed, nonfinite=nonfinite,
                   **auto_config)


def compress(method, *, ratio=None, k=None, rate=None, bits=None, axis_name="data", error_feedback=True,
             granularity="model", mean=True, leader=None, selector=None, algorithm=None, hadamard=None,
             seed=0, nonfinite="zero", candidates=None, network=None, decide_every=None, adaptive_ratio=None,
             ratio_range=None, explore_steps=None) -> optax.GradientTransformationExtraArgs:
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
      this state (residual, step, key, ``"auto"``'s choices) stays as it was; only the metrics
      report the step. :func:`jaxcomp.data_parallel` then keeps the params and the rest of the
      chain's state too; in your own step wrap the chain in :func:`skip_nonfinite`.
    * ``"raise"``: the device side is ``"skip"``'s; :func:`jaxcomp.data_parallel`'s ``step``
      then raises ``FloatingPointError`` at that step (it reads the metric after every step, so
      steps no longer run ahead of the host). In your own step, check the metric yourself.

    **Automatic mode.** ``method="auto"`` compiles one branch per candidate method (a top-k
    method once per candidate ratio) and picks one per step with ``lax.switch`` on a traced
    index, so choices never recompile. It predicts each branch's time with the α-β model
    (:mod:`jaxcomp.cost`: message steps times α plus bytes sent times β, plus the branch's
    measured encode/decode time) on the network in its state, and runs the cheapest, dense
    included. It re-decides every ``decide_every`` steps and at once when the network moves by
    :data:`NETWORK_TOLERANCE` (10%) or more. The network comes from ``network=``,
    :func:`set_network`, or :func:`jaxcomp.data_parallel`, whose ``init`` probes the mesh
    (and ``reprobe`` measures it again); until one is known, ``"auto"`` runs the first candidate
    (``"dense"`` by default). All branches share one residual, which stays exact across switches:
    it always holds what the branch that ran did not send (a dense step sends it all). The
    ``method`` metric says which method ran.

    With ``adaptive_ratio=True`` the top-k ratio follows paper 000 §3-E: candidate ratios from
    ``ratio_range`` spaced by 3 (:func:`jaxcomp.adaptive.candidate_ratios`), an exploration that
    runs each for ``explore_steps`` steps (highest density first) measuring the compression
    gain, then the knee of (encode/decode time, predicted communication time, 1 / gain)
    (:func:`jaxcomp.adaptive.knee`); a new exploration starts when the mean gain of the last
    ``explore_steps`` steps moves by 10% from the chosen one, and a moved network re-chooses from
    the stored measurements. The controller (:func:`jaxcomp.adaptive.ratio_observe`) runs inside
    the step and only advances on steps that ran a top-k method; while it explores, top-k
    competes with the other methods at its lowest candidate density.

    Args:
      method: ``"dense"`` (plain all-reduce), ``"allgather_topk"``, ``"ar_topk"``,
        ``"hierarchical_topk"`` (all need ``ratio`` or ``k``), ``"zfp"`` (needs ``rate``),
        ``"quantized"`` (needs ``bits``), or ``"auto"`` (chooses among them, see above; ``ratio``,
        ``rate`` and ``bits`` set its candidates).
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
      nonfinite: what a step with NaN or ±Inf gradient entries does: ``"zero"`` (default; train
        on with them as 0), ``"skip"`` (every device skips the update) or ``"raise"`` (skip, and
        ``data_parallel`` raises ``FloatingPointError``); see "Non-finite gradients" above.
      candidates: ``"auto"`` only: the methods to choose among, in order (the first runs until a
        network is known). Default: ``"dense"``, then ``"allgather_topk"`` and ``"ar_topk"``
        with ``ratio``/``adaptive_ratio`` (and ``"hierarchical_topk"`` with two axes), ``"zfp"``
        with ``rate``, ``"quantized"`` with ``bits``.
      network: ``"auto"`` only: a :class:`jaxcomp.cost.Network` to start from, e.g.
        ``jaxcomp.probe(mesh, "data")``. Encode/decode times then count as 0 until
        :func:`set_network` gives them (``overhead=``); ``jaxcomp.data_parallel`` measures both
        when ``network`` is None.
      decide_every: ``"auto"`` only: steps between decisions (default
        :data:`DEFAULT_DECIDE_EVERY`, 100); a moved network re-decides at once.
      adaptive_ratio: ``"auto"`` only: choose the top-k ratio by paper 000 §3-E (default False).
      ratio_range: with ``adaptive_ratio``: ``(low, high)`` densities, default ``(0.001, 0.1)``.
      explore_steps: with ``adaptive_ratio``: steps per candidate ratio while exploring, and the
        window of the gain check (default :data:`DEFAULT_EXPLORE_STEPS`, 10).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`
      (with an :class:`AutoState` for ``"auto"``).

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

      A NaN is dropped, counted and never kept (here on device 0, with the default ``"zero"``):

      >>> tx = jaxcomp.compress("ar_topk", ratio=0.5)
      >>> def metrics(g):
      ...     _, state = tx.update({"w": g}, tx.init({"w": g}))
      ...     return state.metrics.nonfinite, jnp.isnan(state.residual["w"]).any()[None]
      >>> f = jax.shard_map(metrics, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
      >>> count, nan_kept = f(jnp.ones(4 * jax.device_count()).at[1].set(jnp.nan))
      >>> float(count), bool(nan_kept.any())
      (1.0, False)

      Automatic choice, here on a slow network given up front (``data_parallel`` probes it):

      >>> slow = jaxcomp.cost.Network.parse("1ms", "100mbit")
      >>> tx = jaxcomp.compress("auto", ratio=0.01, network=slow)

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks" (arXiv 2312.02493): AR-Topk, STAR/VAR leaders, error feedback (Alg. 1), fused
      compression (§3-C3), compression gain (§2-C3), choice of collective (§3-D, Eqn 5a-5c) and
      adaptive compression ratio (§3-E).
    """
    c = _check_config(method, ratio, k, rate, bits, axis_name, error_feedback, granularity, mean, leader,
                      selector, algorithm, hadamard, seed, nonfinite=nonfinite, candidates=candidates, network=network,
                      decide_every=decide_every, adaptive_ratio=adaptive_ratio, ratio_range=ratio_range,
                      explore_steps=explore_steps)
    auto = c.method == "auto"

    # A fixed "dense" sends everything and error_feedback=False keeps nothing: their residual
    # would be zeros forever, so it is not stored (and costs no pass over the gradient).
    keeps_residual = c.error_feedback and c.method != "dense"

    def init_fn(params):
        residual = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.float32) if keeps_residual and _is_float(p) else optax.MaskedNode(),
            params)
        # "auto" reports its first candidate until it has decided (what it runs without a network).
        first = METHODS.index(c.candidates[0] if auto else c.method)
        return CompressState(residual=residual, step=jnp.zeros((), jnp.int32),
                             key=jax.random.PRNGKey(c.seed), metrics=_init_metrics(first),
                             auto=_auto_init(c) if auto else None, policy=NonfinitePolicy(c.nonfinite))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        try:
            residuals = treedef.flatten_up_to(state.residual)
        except (ValueError, TypeError) as e:
            raise ValueError("updates do not have the structure of the params compress was initialized with: "
                             f"{e}") from None
        if auto != (state.auto is not None):
            raise ValueError(f"state was not made by this compress({c.method!r})'s init")
        if state.policy != NonfinitePolicy(c.nonfinite):
            raise ValueError(f"state was made by a compress(nonfinite={state.policy.name!r}), not by this "
                             f"compress(nonfinite={c.nonfinite!r})'s init")
        floats = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
        if not floats:
            return updates, state
        n_devices = math.prod(_bound_axis_size(a) for a in c.axes)
        _check_local_gradients(c, [leaves[i] for i in floats])
        comm_dtype = _comm_dtype([leaves[i] for i in floats])
        base_key = jax.random.fold_in(state.key, state.step)

        # The groups the collective runs on, as (positions, name): one for the model, one per leaf.
        if c.granularity == "model" and c.method != "dense":
            groups = [(floats, "the model")]
        else:  # a dense sum is elementwise: per leaf it is the same sum, with no copy into one vector
            groups = [([i], f"leaf {i}") for i in floats]

        # Non-finite entries (NaN, ±Inf) count as 0 before anything else sees them: never sent,
        # never stored in the residual (NaN - NaN would stay NaN forever), and the residual's own
        # entry at that index is kept. The where fuses into the error-feedback add; the count is
        # one reduction over the same values.
        bad_counts = []

        def error_fed(i):
            finite = jnp.isfinite(leaves[i])
            bad_counts.append(jnp.sum(~finite, dtype=jnp.int32).astype(jnp.float32))
            g = jnp.where(finite, leaves[i].astype(jnp.float32), 0.0)
            return g + residuals[i] if keeps_residual else g

        # The error-fed vector of each group (for the model: one concatenation of all leaves).
        feds = [jnp.concatenate([error_fed(i).ravel() for i in positions]) if len(positions) > 1
                else error_fed(positions[0]).ravel() for positions, _ in groups]
        vectors = [fed.astype(comm_dtype) for fed in feds]
        names = [name for _, name in groups]
        sizes = [vector.shape[0] for vector in vectors]
        # Fixed top-k methods hand back their (indices, values): the residual is then the error-fed
        # vector with the sent values taken off in place, never a dense `sent` built and subtracted.
        sparse = not auto and c.method in _TOPK_METHODS

        if auto:
            plan = _AutoPlan(c, sizes, names, n_devices, comm_dtype)
            auto_state, branch, comm = plan.decide(state.auto, state.step)
            runs = [functools.partial(_aggregate, config, names=names) for config in plan.branches]
            totals, sents = jax.lax.switch(
                branch, [lambda v, s, k, run=run: run(v, step=s, base_key=k) for run in runs],
                vectors, state.step, base_key)
            bytes_sent = jnp.asarray(plan.bytes)[branch]
            kept = jnp.asarray(plan.kept)[branch]
            method_index = jnp.asarray(plan.method_ids)[branch]
        else:
            totals, sents = _aggregate(c, vectors, names, state.step, base_key, sparse=sparse)
            bytes_sent, kept, _ = _static_cost(c, sizes, names, n_devices, comm_dtype)
            method_index = METHODS.index(c.method)

        scale = 1.0 / n_devices if c.mean else 1.0
        bad = sum(bad_counts)
        if c.method == "dense" and not auto:
            gain = jnp.ones((), jnp.float32)  # everything is sent
            bad = jax.lax.psum(bad, c.axis_name)
        else:
            # sum_d ||sent_d||^2, sum_d ||g_e,d||^2 and the non-finite count: one psum of 3 scalars.
            sent_sq = sum(_sent_square(sent, sparse) for sent in sents)
            fed_sq = sum(jnp.sum(jnp.square(fed)) for fed in feds)
            sent_sq, fed_sq, bad = jax.lax.psum(jnp.stack([sent_sq, fed_sq, bad]), c.axis_name)
            # 1 only when there was nothing to send; a sum that overflowed reports NaN or Inf.
            gain = jnp.where(fed_sq == 0, 1.0, sent_sq / jnp.where(fed_sq == 0, 1.0, fed_sq)).astype(jnp.float32)
        # "skip" and "raise": every device got the same psum'd count, so all skip together.
        skipped = (bad > 0) if c.nonfinite != "zero" else None

        out = list(leaves)
        new_residuals = list(residuals)
        for (positions, _), fed, total, sent in zip(groups, feds, totals, sents):
            if c.method == "dense" and not auto:
                remaining = None  # everything was sent
            elif sparse:
                indices, values = sent
                # fed[i] + (-v) is fed[i] - v exactly: the same residual as fed - dense(sent).
                remaining = fed.at[indices].add(-values.astype(jnp.float32), mode="drop", unique_indices=True)
            else:
                remaining = fed - sent.astype(jnp.float32)
            offset = 0
            for i in positions:
                size, shape = leaves[i].size, leaves[i].shape
                update = total[offset:offset + size].reshape(shape).astype(jnp.float32) * scale
                if skipped is not None:
                    update = jnp.where(skipped, 0.0, update)
                out[i] = update.astype(leaves[i].dtype)
                if keeps_residual:
                    residual = remaining[offset:offset + size].reshape(shape)
                    new_residuals[i] = residual if skipped is None else jnp.where(skipped, residuals[i], residual)
                offset += size

        total_size = sum(leaves[i].size for i in floats)
        metrics = CompressMetrics(gain=gain, bytes_sent=jnp.asarray(bytes_sent, jnp.float32),
                                  density=jnp.asarray(kept / total_size, jnp.float32),
                                  method=jnp.asarray(method_index, jnp.int32), nonfinite=bad)
        new_auto = plan.observe(auto_state, branch, gain, comm) if auto else None
        step = state.step + 1
        if skipped is not None:
            # A skipped step leaves the state as it was (only the metrics report it).
            step = jnp.where(skipped, state.step, step)
            new_auto = adaptive._select(skipped, state.auto, new_auto) if auto else None
        new_state = CompressState(residual=treedef.unflatten(new_residuals), step=step, key=state.key,
                                  metrics=metrics, auto=new_auto, policy=state.policy)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, _checked_update(update_fn))


def _sent_square(sent, sparse: bool):
    """||sent||^2 of one group's contribution (dense, or the (indices, values) of a top-k)."""
    values = sent[1] if sparse else sent
    return jnp.sum(jnp.square(values.astype(jnp.float32)))


def _checked_update(update_fn):
    """``update_fn`` behind the argument checks that must come before any of its work."""

    def update(updates, state, params=None, **extra_args):
        _check_updates_fit_state(updates, state)
        return update_fn(updates, state, params, **extra_args)

    return update


def _check_updates_fit_state(updates, state):
    """Gradients shaped like the params ``init`` saw, and at least one value to aggregate."""
    if not isinstance(state, CompressState):
        raise TypeError(f"state must be the CompressState that compress's init returns, got {type(state).__name__}")
    leaves, treedef = jax.tree.flatten_with_path(updates)
    try:
        residuals = treedef.flatten_up_to(state.residual)
    except (ValueError, TypeError):
        return  # update reports the structure mismatch itself
    floats = [(path, leaf, residual) for (path, leaf), residual in zip(leaves, residuals) if _is_float(leaf)]
    for path, leaf, residual in floats:
        if isinstance(residual, jax.Array | jax.ShapeDtypeStruct | np.ndarray) and leaf.shape != residual.shape:
            raise ValueError(
                f"updates{jax.tree_util.keystr(path)} has shape {leaf.shape}, but compress was initialized with a "
                f"param of shape {residual.shape} there: pass the gradients of the params given to init")
    if floats and sum(leaf.size for _, leaf, _ in floats) == 0:
        raise ValueError(f"updates hold no values (every float leaf is empty: shapes "
                         f"{[leaf.shape for _, leaf, _ in floats]}): there is nothing to aggregate")


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
    found = _compress_states(opt_state)
    return found[0] if found else None


def skipped_update(opt_state):
    """Whether the step that made ``opt_state`` was skipped by a ``compress(nonfinite="skip"|"raise")``.

    Read it inside the step, after ``tx.update``: a traced boolean, identical on every device (it
    comes from the ``nonfinite`` metric, a sum over the devices), or ``None`` when no
    :class:`CompressState` in ``opt_state`` can skip (none, or all with ``nonfinite="zero"``),
    so callers add no work then.

    Args:
      opt_state: the optimizer state ``tx.update`` returned.

    Returns:
      A boolean scalar (traced inside a step), or None.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("dense", nonfinite="skip").init({"w": jnp.zeros(3)})
      >>> bool(jaxcomp.skipped_update(state)), jaxcomp.skipped_update(jaxcomp.compress("dense").init({}))
      (False, None)

    References:
      optax ``apply_if_finite`` (skips a step on non-finite updates); Micikevicius et al.,
      "Mixed Precision Training", ICLR 2018, §3.2 (a step with Inf/NaN gradients is skipped).
    """
    flags = [state.metrics.nonfinite > 0 for state in _compress_states(opt_state)
             if state.policy.name != "zero"]
    if not flags:
        return None
    return functools.reduce(jnp.logical_or, flags)


def _keep_if_skipped(skipped, old_state, new_state):
    """``new_state`` where the step ran, ``old_state`` where it was skipped; CompressStates stay new.

    A compress skips its own state (residual, step, "auto") and reports the step in its metrics,
    so its new state is right either way.
    """

    def keep(new, old):
        return new if isinstance(new, CompressState) else jnp.where(skipped, old, new)

    return jax.tree.map(keep, new_state, old_state, is_leaf=lambda x: isinstance(x, CompressState))


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Makes a whole optax chain skip the steps its ``compress(nonfinite="skip")`` skips.

    ``compress(..., nonfinite="skip")`` (or ``"raise"``) keeps its own state and returns zero
    updates when any device saw a non-finite gradient entry, but the transformations after it
    would still advance on those zeros (adam's moments decay, its count grows, and the params
    move). This wrapper runs ``tx`` and, on such a step, returns zero updates and ``tx``'s
    previous state, everywhere but inside the compress states (which already kept theirs and
    report the step in their ``nonfinite`` metric). It decides with ``jnp.where`` on a scalar
    that every device agrees on, not ``lax.cond``, so it works inside ``jax.shard_map`` where
    ``optax.apply_if_finite`` fails ("cond branches must have equal output types").
    :func:`jaxcomp.data_parallel` does this by itself (and keeps the params bit for bit); use
    the wrapper in your own ``shard_map`` step. The state is ``tx``'s own.

    Args:
      tx: an optax transformation holding a :func:`compress` with ``nonfinite="skip"`` or
        ``"raise"`` (with ``"zero"`` or no compress the wrapper changes nothing).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``tx``'s ``init`` and state.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()), ("data",))
      >>> tx = jaxcomp.skip_nonfinite(optax.chain(jaxcomp.compress("dense", nonfinite="skip"), optax.adam(0.1)))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> def step(g):
      ...     updates, new_state = tx.update({"w": g}, state)
      ...     return updates["w"], new_state[1][0].count, jaxcomp.find_compress_state(new_state).metrics.nonfinite
      >>> f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> g = jnp.ones(2 * jax.device_count()).at[0].set(jnp.nan)
      >>> updates, adam_count, nonfinite = f(g)
      >>> updates.tolist(), int(adam_count), float(nonfinite)
      ([0.0, 0.0], 0, 1.0)

    References:
      optax ``apply_if_finite``; Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    inner = optax.with_extra_args_support(tx)

    def update(updates, state, params=None, **extra_args):
        new_updates, new_state = inner.update(updates, state, params, **extra_args)
        skipped = skipped_update(new_state)
        if skipped is None:
            return new_updates, new_state
        new_updates = jax.tree.map(
            lambda u: jnp.where(skipped, jnp.zeros_like(u), u) if jnp.issubdtype(u.dtype, jnp.inexact) else u,
            new_updates)
        return new_updates, _keep_if_skipped(skipped, state, new_state)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _compress_states(opt_state) -> list[CompressState]:
    return [node for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CompressState))
            if isinstance(node, CompressState)]


def _host(x) -> np.ndarray:
    """A replicated array's value on the host (also when it spans processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_shards[0].data
    return np.asarray(x)


def _branch(method_id, setting) -> tuple[str, float | int | None]:
    method = METHODS[int(method_id)]
    if np.isnan(setting):
        return method, None
    if method in ("zfp", "quantized"):
        return method, int(setting)
    return method, float(np.format_float_positional(np.float32(setting)))  # 0.01, not f32's 0.00999...


def auto_branches(opt_state) -> list[list[tuple[str, float | None]]]:
    """The branches of each ``compress("auto")`` state in ``opt_state``: ``(method, setting)`` pairs.

    ``setting`` is the branch's ratio (top-k methods), rate (``"zfp"``), bits (``"quantized"``)
    or None (``"dense"``), in the order :func:`set_network`'s ``overhead`` sequence uses.

    Args:
      opt_state: an optimizer state holding one or more :class:`CompressState` (host values).

    Returns:
      One list per ``"auto"`` state, in depth-first order.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("auto", ratio=0.01).init({"w": jnp.zeros(3)})
      >>> jaxcomp.auto_branches(state)
      [[('dense', None), ('allgather_topk', 0.01), ('ar_topk', 0.01)]]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D and §3-E (the candidates flexible communication picks from).
    """
    out = []
    for state in _compress_states(opt_state):
        if state.auto is None:
            continue
        methods, settings = _host(state.auto.branch_method), _host(state.auto.branch_setting)
        out.append([_branch(m, s) for m, s in zip(methods, settings)])
    return out


def set_network(opt_state, network: cost.Network, overhead=None):
    """Gives every ``compress("auto")`` state in ``opt_state`` a newly measured network.

    ``"auto"`` re-decides in its next step when latency or bandwidth moved by 10% or more
    (:data:`NETWORK_TOLERANCE`), otherwise at its next regular decision. Call it on the host
    between steps (:meth:`jaxcomp.DataParallel.reprobe` does, after probing).

    Args:
      opt_state: an optimizer state holding one or more :class:`CompressState`.
      network: the :class:`jaxcomp.cost.Network`, e.g. ``jaxcomp.probe(mesh, "data")``.
      overhead: optional encode + decode seconds per branch: a sequence in
        :func:`auto_branches` order, a ``{method: seconds}`` dict (missing methods keep theirs),
        or a function ``(method, setting) -> seconds``. Kept as they are when None.

    Returns:
      ``opt_state`` with the network (and overhead) replaced; everything else is untouched.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress("auto", ratio=0.01)
      >>> state = jaxcomp.set_network(tx.init({"w": jnp.zeros(3)}), jaxcomp.cost.Network.parse("1ms", "1gbit"))
      >>> [float(v) for v in state.auto.network]  # alpha seconds, beta seconds per byte
      [0.0010000000474974513, 7.999999773744548e-09]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-decide when α or β changes).
    """
    if not isinstance(network, cost.Network):
        raise TypeError(f"network must be a jaxcomp.cost.Network, got {type(network).__name__}")
    if not any(state.auto is not None for state in _compress_states(opt_state)):
        raise ValueError("opt_state holds no compress('auto') state to give a network to")
    values = np.array([network.alpha, network.beta], np.float32)

    def overhead_of(auto: AutoState):
        if overhead is None:
            return auto.overhead
        current = _host(auto.overhead).astype(np.float64)
        branches = [_branch(m, s) for m, s in zip(_host(auto.branch_method), _host(auto.branch_setting))]
        if callable(overhead):
            seconds = [overhead(method, setting) for method, setting in branches]
        elif isinstance(overhead, dict):
            unknown = set(overhead) - {method for method, _ in branches}
            if unknown:
                raise ValueError(f"overhead names methods {sorted(unknown)} that are not among the candidates "
                                 f"{sorted({method for method, _ in branches})}")
            seconds = [overhead.get(method, current[b]) for b, (method, _) in enumerate(branches)]
        else:
            seconds = list(overhead)
            if len(seconds) != len(branches):
                raise ValueError(f"overhead has {len(seconds)} entries for {len(branches)} branches {branches}")
        seconds = np.asarray(seconds, np.float64)
        if seconds.shape != (len(branches),) or not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
            raise ValueError(f"overhead must give finite seconds >= 0 per branch, got {seconds.tolist()}")
        return seconds.astype(np.float32)

    def like(old, new):
        # Keep the old leaf's placement, so a jitted step sees the same input and does not recompile.
        if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
            return jax.device_put(new, old.sharding)
        return new

    def replace(node):
        if isinstance(node, CompressState) and node.auto is not None:
            auto = node.auto
            return node._replace(auto=auto._replace(network=like(auto.network, values),
                                                    overhead=like(auto.overhead, overhead_of(auto))))
        return node

    return jax.tree.map(replace, opt_state, is_leaf=lambda x: isinstance(x, CompressState))
