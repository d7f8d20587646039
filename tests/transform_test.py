"""jaxcomp.compress: argument checks, error feedback against a numpy reference, state types."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives
from jaxcomp.optim.transform import compress

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _planted_gradients(shapes, steps, seed):
    """Per-step, per-device gradients with distinct magnitudes everywhere, so top-k has no ties."""
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(s)) for s in shapes)
    out = []
    for _ in range(steps):
        # A random permutation of distinct magnitudes per device; sums of them stay tie-free.
        mags = np.stack([rng.permutation(total) + 1.0 for _ in range(N_DEVICES)]) / total
        signs = rng.choice([-1.0, 1.0], size=mags.shape)
        flat = (mags * signs).astype(np.float32)
        leaves, offset = [], 0
        for s in shapes:
            size = int(np.prod(s))
            leaves.append(flat[:, offset : offset + size].reshape((N_DEVICES,) + s))
            offset += size
        out.append(leaves)
    return out


def _run_compress(tx, steps_of_leaves, dtype):
    """Runs tx.update inside shard_map for each step; returns per-step (outputs, residuals) as
    numpy."""
    mesh = _mesh()
    shapes = [leaf.shape[1:] for leaf in steps_of_leaves[0]]
    state = tx.init([jax.ShapeDtypeStruct(s, dtype) for s in shapes])
    residual = [np.zeros((N_DEVICES,) + s, np.float32) for s in shapes]

    def local(grads, residual, step):
        grads = [g[0] for g in grads]
        local_state = state._replace(residual=[r[0] for r in residual], step=step)
        out, new_state = tx.update(grads, local_state)
        return out, [r[None] for r in new_state.residual], new_state.step, new_state.metrics

    step_fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("data"), P("data"), P()),
            out_specs=(P(), P("data"), P(), P()),
        )
    )
    step = state.step
    history = []
    for leaves in steps_of_leaves:
        out, residual, step, metrics = step_fn(
            [jnp.asarray(x, dtype) for x in leaves], residual, step
        )
        history.append(([np.asarray(o) for o in out], [np.asarray(r) for r in residual], metrics))
    return history


def _reference(steps_of_leaves, dtype, select, error_feedback, granularity, mean=True):
    """numpy Alg. 1: g_e = g + r; sent = select(g_e per device); r = g_e - sent; out =
    sum(sent)/n."""
    shapes = [leaf.shape[1:] for leaf in steps_of_leaves[0]]
    sizes = [int(np.prod(s)) for s in shapes]
    residual = np.zeros((N_DEVICES, sum(sizes)), np.float32)
    history = []
    for step, leaves in enumerate(steps_of_leaves):
        g = np.concatenate(
            [
                np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)).reshape(N_DEVICES, -1)
                for x in leaves
            ],
            axis=1,
        )
        g_e = g + residual if error_feedback else g
        groups = (
            [(0, sum(sizes))]
            if granularity == "model"
            else [(int(np.sum(sizes[:i])), int(np.sum(sizes[: i + 1]))) for i in range(len(sizes))]
        )
        sent = np.zeros_like(g_e)
        # The collective sees g_e rounded to the communication dtype (the gradients' own).
        g_comm = np.asarray(jnp.asarray(g_e).astype(dtype).astype(jnp.float32))
        for lo, hi in groups:
            sent[:, lo:hi] = select(g_comm[:, lo:hi], step)
        if error_feedback:
            residual = g_e - sent
        total = sent.sum(axis=0) / (N_DEVICES if mean else 1)
        outs, offset = [], 0
        for s, size in zip(shapes, sizes):
            outs.append(total[offset : offset + size].reshape(s))
            offset += size
        res, offset = [], 0
        for s, size in zip(shapes, sizes):
            res.append(residual[:, offset : offset + size].reshape((N_DEVICES,) + s))
            offset += size
        history.append((outs, res))
    return history


def _own_topk(ratio):
    def select(g_e, step):
        k = max(1, round(ratio * g_e.shape[1]))
        keep = np.argsort(-np.abs(g_e), axis=1, kind="stable")[:, :k]
        sent = np.zeros_like(g_e)
        np.put_along_axis(sent, keep, np.take_along_axis(g_e, keep, axis=1), axis=1)
        return sent

    return select


def _leader_topk(ratio):
    def select(g_e, step):
        k = max(1, round(ratio * g_e.shape[1]))
        leader = step % N_DEVICES  # STAR: round-robin
        keep = np.argsort(-np.abs(g_e[leader]), kind="stable")[:k]
        sent = np.zeros_like(g_e)
        sent[:, keep] = g_e[:, keep]
        return sent

    return select


def _split_topk(ratio):
    def select(g_e, step):
        k = max(1, round(ratio * g_e.shape[1]))
        each = min(-(-k // N_DEVICES), g_e.shape[1])  # SPLIT: every device's top ceil(k / N)
        keep = np.unique(np.argsort(-np.abs(g_e), axis=1, kind="stable")[:, :each])
        sent = np.zeros_like(g_e)
        sent[:, keep] = g_e[:, keep]
        return sent

    return select


SHAPES = {
    "one": [(1,)],
    "awkward": [(3, 5), (7,), (1,)],
    "block": [(33, 4), (129,)],
}


SELECTORS = {
    "allgather_topk": _own_topk(0.2),
    "ar_topk": _split_topk(0.2),  # SPLIT, AR-Topk's default leader
    "ar_topk star": _leader_topk(0.2),
    "dense": lambda g_e, step: g_e,
}


# Method x granularity x awkward shapes x dtype, pairwise rather than the full product (each case
# compiles twice): every value of every axis appears with every method at least once.
@pytest.mark.parametrize(
    "method, granularity, shapes, dtype",
    [
        ("allgather_topk", "model", "awkward", jnp.float32),
        ("allgather_topk", "model", "awkward", jnp.bfloat16),
        ("allgather_topk", "leaf", "awkward", jnp.float32),
        ("allgather_topk", "model", "one", jnp.float32),
        ("allgather_topk", "leaf", "block", jnp.bfloat16),
        ("ar_topk", "model", "block", jnp.float32),
        ("ar_topk", "leaf", "awkward", jnp.bfloat16),
        ("ar_topk", "model", "one", jnp.bfloat16),
        ("ar_topk star", "model", "awkward", jnp.float32),
        ("ar_topk star", "leaf", "block", jnp.bfloat16),
        ("dense", "model", "awkward", jnp.bfloat16),
        ("dense", "leaf", "one", jnp.float32),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_error_feedback_matches_reference(method, granularity, shapes, dtype):
    shapes, select = SHAPES[shapes], SELECTORS[method]
    method, *leader = method.split()
    kwargs = {} if method == "dense" else {"ratio": 0.2, "leader": (leader or [None])[0]}
    grads = _planted_gradients(shapes, steps=3, seed=len(shapes))
    for error_feedback in (True, False):
        tx = compress(method, granularity=granularity, error_feedback=error_feedback, **kwargs)
        got = _run_compress(tx, grads, dtype)
        want = _reference(grads, dtype, select, error_feedback, granularity)
        for (out, residual, _), (want_out, want_residual) in zip(got, want):
            for o, w in zip(out, want_out):
                tol = 1e-6 if dtype == jnp.float32 else 1e-2
                np.testing.assert_allclose(np.asarray(o, np.float32), w, rtol=tol, atol=tol)
            for r, w in zip(residual, want_residual):
                # The residual is exactly what was not sent, accumulated (0 without feedback).
                np.testing.assert_array_equal(r, w)


def test_sum_instead_of_mean_and_metrics():
    grads = _planted_gradients([(40,)], steps=2, seed=3)
    tx = compress("allgather_topk", ratio=0.1, mean=False)
    got = _run_compress(tx, grads, jnp.float32)
    want = _reference(grads, jnp.float32, _own_topk(0.1), True, "model", mean=False)
    np.testing.assert_allclose(got[-1][0][0], want[-1][0][0], rtol=1e-6)
    metrics = got[-1][2]
    assert float(metrics.density) == pytest.approx(4 / 40)
    assert float(metrics.bytes_sent) == jaxcomp.TopK(k=4).wire_bytes(40, N_DEVICES)
    # Gain = sum ||sent||^2 / sum ||g_e||^2 over the devices, from the reference's own vectors.
    g_e = grads[1][0].reshape(N_DEVICES, -1) + want[0][1][0].reshape(N_DEVICES, -1)
    sent = _own_topk(0.1)(g_e, 1)
    np.testing.assert_allclose(float(metrics.gain), np.sum(sent**2) / np.sum(g_e**2), rtol=1e-5)


def test_dense_gain_is_one():
    got = _run_compress(compress("dense"), _planted_gradients([(5,)], 1, 0), jnp.float32)
    assert float(got[0][2].gain) == 1.0
    assert float(got[0][2].density) == 1.0


def test_non_float_leaves_pass_through_and_state_types_stay():
    mesh = _mesh()
    tx = compress("ar_topk", ratio=0.5)
    params = {
        "w": jax.ShapeDtypeStruct((6,), jnp.bfloat16),
        "count": jax.ShapeDtypeStruct((), jnp.int32),
    }
    state = tx.init(params)
    assert isinstance(state.residual["count"], optax.MaskedNode)
    assert state.residual["w"].dtype == jnp.float32
    types = {}

    def local(w, count):
        updates, new_state = tx.update({"w": w, "count": count}, state)
        types["before"] = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        types["after"] = jax.tree.map(lambda x: (x.shape, x.dtype), new_state)
        return updates["count"], updates["w"]

    count, w = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P(), P()))
    )(jnp.arange(6 * N_DEVICES, dtype=jnp.bfloat16), jnp.int32(7))
    assert count.dtype == jnp.int32 and int(count) == 7
    assert w.dtype == jnp.bfloat16 and w.shape == (6,)
    assert types["before"] == types["after"]


def test_replicated_params_trap_is_refused():
    mesh = _mesh()
    tx = compress("allgather_topk", ratio=0.5)
    w = jnp.ones(4)
    state = tx.init(w)

    def trapped(w, x):
        grads = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(
            w
        )  # w replicated: grads come back psum'ed
        return tx.update(grads, state)[0]

    f = jax.shard_map(trapped, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match="pcast"):
        jax.jit(f)(w, jnp.ones((N_DEVICES, 4)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"method": "nope"}, ValueError, "method must be a jaxcomp.methods.Method or one of"),
        ({"method": "ar_topk"}, ValueError, "exactly one of ratio"),
        ({"method": "ar_topk", "ratio": 0.1, "k": 3}, ValueError, "exactly one of ratio"),
        ({"method": "ar_topk", "ratio": 0.0}, ValueError, "ratio must be in"),
        ({"method": "ar_topk", "ratio": 1.5}, ValueError, "ratio must be in"),
        ({"method": "ar_topk", "ratio": "x"}, TypeError, "ratio"),
        ({"method": "ar_topk", "k": 0}, ValueError, "k must be"),
        ({"method": "ar_topk", "k": 2.5}, TypeError, "k must be"),
        ({"method": "ar_topk", "ratio": 0.1, "rate": 8}, ValueError, "remove rate="),
        ({"method": "dense", "ratio": 0.1}, ValueError, "remove ratio="),
        ({"method": "zfp"}, ValueError, "needs rate="),
        ({"method": "zfp", "rate": 0}, ValueError, "rate must be"),
        ({"method": "zfp", "rate": 8, "bits": 4}, ValueError, "remove bits="),
        ({"method": "quantized"}, ValueError, "needs bits="),
        ({"method": "quantized", "bits": 40}, ValueError, "bits must be"),
        ({"method": "hierarchical_topk", "ratio": 0.1}, ValueError, "axis_name=\\(outer, inner\\)"),
        ({"method": "ar_topk", "ratio": 0.1, "leader": "max"}, ValueError, "leader must be"),
        (
            {"method": "allgather_topk", "ratio": 0.1, "leader": "var"},
            ValueError,
            "leader= applies",
        ),
        ({"method": "zfp", "rate": 8, "selector": "exact"}, ValueError, "remove selector="),
        ({"method": "dense", "algorithm": "ring"}, ValueError, "remove algorithm="),
        (
            {"method": "ar_topk", "ratio": 0.1, "granularity": "layer"},
            ValueError,
            "granularity must be",
        ),
        ({"method": "dense", "axis_name": ""}, ValueError, "axis_name"),
        ({"method": "dense", "error_feedback": "yes"}, TypeError, "error_feedback"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        compress(**kwargs)


def test_k_larger_than_the_gradient_is_refused_at_trace_time():
    tx = compress("allgather_topk", k=10)
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=_mesh(), in_specs=P("data"), out_specs=P()
    )
    with pytest.raises(ValueError, match="k=10 exceeds the 4"):
        jax.jit(f)(jnp.ones(4 * N_DEVICES))


COLLECTIVE_CASES = {
    "dense": ({}, lambda x, k, key, step: collectives.psum(x, "data")),
    "allgather_topk": (
        {"ratio": 0.1},
        lambda x, k, key, step: collectives.allgather_topk(x, k, "data"),
    ),
    "ar_topk": (
        {"ratio": 0.1, "leader": "var"},
        lambda x, k, key, step: collectives.ar_topk(x, k, "data", leader="var", step=step),
    ),
    "hierarchical_topk": (
        {"ratio": 0.1, "axis_name": ("node", "data")},
        lambda x, k, key, step: collectives.hierarchical_topk(x, k, "data", "node"),
    ),
    "zfp": ({"rate": 8}, lambda x, k, key, step: collectives.zfp_allreduce(x, 8, "data")),
    "quantized": (
        {"bits": 4},
        lambda x, k, key, step: collectives.quantized_psum(x, 4, "data", key),
    ),
}


@pytest.mark.parametrize("method", list(COLLECTIVE_CASES))
def test_residual_is_exactly_what_the_collective_did_not_send(method):
    """Every method, two steps: out = total / N and residual = (g + residual) - sent, bit for bit,
    with (total, sent) from calling the collective directly on the same error-fed vector."""
    need_devices(N_DEVICES)
    options, collective = COLLECTIVE_CASES[method]
    options = dict(options)
    axis_name = options.pop("axis_name", "data")
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    mesh = Mesh(
        np.array(jax.devices()[:N_DEVICES]).reshape((2, 4) if len(axes) == 2 else (N_DEVICES,)),
        axes,
    )
    tx = compress(method, axis_name=axis_name, **options)
    n = 37
    k = max(1, round(0.1 * n))
    state = tx.init(jax.ShapeDtypeStruct((n,), jnp.float32))

    def local(g, residual, step):
        g = g.reshape(n)
        local_state = state._replace(residual=residual.reshape(n), step=step)
        out, new_state = tx.update(g, local_state)
        # The transform's key for its first (only) compressed vector at this step.
        key = jax.random.fold_in(jax.random.fold_in(state.key, step), 0)
        total, sent = collective(g + residual.reshape(n), k, key, step)
        size = np.prod([jax.lax.axis_size(a) for a in axes])
        return (
            out,
            total / size,
            new_state.residual[None],
            (g + residual.reshape(n) - sent)[None],
            new_state.step,
        )

    spec = P(axes)
    step_fn = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(P(), P(), spec, spec, P())
        )
    )
    grads = _planted_gradients([(n,)], steps=2, seed=7)
    residual, step = jnp.zeros((N_DEVICES, n), jnp.float32), state.step
    for (g,) in grads:
        out, want_out, residual, want_residual, step = step_fn(jnp.asarray(g), residual, step)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
        np.testing.assert_array_equal(np.asarray(residual), np.asarray(want_residual))
    assert np.any(np.asarray(residual)) or method == "dense"


def test_update_outside_shard_map_is_refused():
    tx = compress("dense")
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        tx.update(jnp.ones(3), tx.init(jnp.ones(3)))
