"""PowerSGD (jaxcomp.methods.powersgd) against a numpy reference of Vogels et al.'s Alg. 1-2."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_checkpoint_resumes, count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.costmodel import cost
from jaxcomp.methods import PowerSGD
from jaxcomp.methods.powersgd import matrix_view, orthogonalize

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8
# A kernel compressed at rank 2 (24x16: 384 values, 80 sent), a bias sent as it is, a 3-D kernel
# viewed as (6*5) x 20 (compressed), and a small matrix left dense by min_compression_rate.
SHAPES = {"w": (24, 16), "b": (16,), "conv": (6, 5, 20), "small": (3, 4)}


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _loss(params, batch):
    """Each device's gradient of a leaf is its batch row for that leaf."""
    return sum(jnp.sum(params[name] * jnp.mean(batch[name], axis=0)) for name in params)


def _batch(rng, shapes=SHAPES):
    return {
        name: rng.standard_normal((N_DEVICES, *shape)).astype(np.float32)
        for name, shape in shapes.items()
    }


def _run(method, shapes=SHAPES, **options):
    tx = optax.chain(jaxcomp.compress(method, mean=False, **options), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh())
    return dp, dp.init({name: jnp.zeros(shape) for name, shape in shapes.items()})


def _gram_schmidt(p, eps=1e-8):
    p = p.astype(np.float64).copy()
    for j in range(p.shape[1]):
        for i in range(j):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
        p[:, j] /= np.linalg.norm(p[:, j]) + eps
    return p


def _reference_step(fed, qs, rank, shapes=SHAPES):
    """numpy, float64: one PowerSGD step of the error-fed gradients ``fed[name][device]``.
    Returns (total per leaf, residual per leaf and device, new Q per compressed leaf)."""
    method = PowerSGD(rank)
    total, residual, new_q = {}, {}, {}
    # In the params' flattening order (a dict's sorted keys), as the method's state is.
    compressed = [name for name in sorted(shapes) if method.compresses(shapes[name])]
    for name in shapes:
        g = fed[name].astype(np.float64)
        if name not in compressed:
            total[name], residual[name] = g.sum(axis=0), np.zeros_like(g)
            continue
        rows, cols = matrix_view(shapes[name])
        m = g.reshape(N_DEVICES, rows, cols)
        q = np.asarray(qs[compressed.index(name)], np.float64)
        p_hat = _gram_schmidt(sum(m[d] @ q for d in range(N_DEVICES)))
        local_q = [m[d].T @ p_hat for d in range(N_DEVICES)]
        new_q[name] = sum(local_q)
        total[name] = (p_hat @ new_q[name].T).reshape(shapes[name])
        residual[name] = np.stack(
            [(m[d] - p_hat @ local_q[d].T).reshape(shapes[name]) for d in range(N_DEVICES)]
        )
    return total, residual, [new_q[name] for name in compressed]


def _check_steps_against_reference(method, shapes, steps=2):
    """``steps`` steps of ``method`` (``mean=False``, SGD lr 1): updates, residuals and the
    warm-started Q equal the float64 reference to float32 rounding. Returns the last metrics."""
    dp, state = _run(method, shapes)
    rng = np.random.default_rng(0)
    residual = {name: np.zeros((N_DEVICES, *shape)) for name, shape in shapes.items()}
    for _ in range(steps):
        batch = _batch(rng, shapes)
        cs = jaxcomp.find_compress_state(state.opt_state)
        qs = cs.method_state[0][0]
        params_before = {k: np.asarray(v, np.float64) for k, v in state.params.items()}
        fed = {name: batch[name] + residual[name] for name in shapes}
        total, residual, new_q = _reference_step(fed, qs, method.rank, shapes)
        state, metrics = dp.step(state, batch)
        cs = jaxcomp.find_compress_state(state.opt_state)
        for name in shapes:
            np.testing.assert_allclose(
                params_before[name] - np.asarray(state.params[name]),
                total[name],
                rtol=2e-4,
                atol=2e-4,
            )
            np.testing.assert_allclose(
                np.asarray(cs.residual[name]), residual[name], rtol=2e-4, atol=2e-4
            )
        for got, want in zip(cs.method_state[0][0], new_q):
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    return metrics


def test_steps_match_numpy_reference_with_warm_start_and_error_feedback():
    """Two steps: updates, residuals and the warm-started Q equal the float64 reference to float32
    rounding; the bytes and density metrics are PowerSGD's own counts."""
    rank = 2
    method = PowerSGD(rank)
    assert [method.compresses(s) for s in SHAPES.values()] == [True, False, True, False]
    metrics = _check_steps_against_reference(method, SHAPES)
    shapes = tuple(SHAPES[name] for name in sorted(SHAPES))
    n = sum(int(np.prod(s)) for s in shapes)
    assert float(metrics["bytes_sent"]) == pytest.approx(
        method.wire_bytes(n, N_DEVICES, shapes=shapes)
    )
    assert float(metrics["density"]) == pytest.approx(method.kept(n, shapes=shapes) / n)
    # 24x16 and 30x20 at rank 2, the bias and the small matrix as they are.
    assert method.kept(n, shapes=shapes) == 2 * (24 + 16) + 2 * (30 + 20) + 16 + 12


# Views repeated among leaves sent as they are: three 24x16 matrices (one a 6x4x16 kernel, whose
# most square view is 24x16), two 30x20, and one 16x40 alone.
REPEATED = {
    "a": (24, 16),
    "b": (16,),
    "c": (6, 4, 16),
    "d": (30, 20),
    "e": (24, 16),
    "f": (16, 40),
    "g": (30, 20),
    "h": (3,),
}


@pytest.mark.parametrize("stack_max", [0, 1 << 18], ids=["products apart", "products stacked"])
def test_matrices_of_one_view_together_match_the_reference(monkeypatch, stack_max):
    """Matrices of one view are orthogonalized together, and multiplied in batched products when
    small (STACK_MAX_VALUES): either way each matrix's update, residual and Q are its own, as the
    per-matrix float64 reference computes them."""
    from jaxcomp.methods import powersgd

    monkeypatch.setattr(powersgd, "STACK_MAX_VALUES", stack_max)
    method = PowerSGD(2)
    views = [matrix_view(REPEATED[k]) for k in sorted(REPEATED) if method.compresses(REPEATED[k])]
    assert powersgd.batches(views) == [(0, 1, 3), (2, 5), (4,)]
    _check_steps_against_reference(method, REPEATED, steps=3)


def test_matrices_of_one_view_compile_to_batched_products():
    """32 small matrices of one view compile to a handful of batched products, not four per
    matrix (and their Gram-Schmidt to one batched pass): the compiled update's dots do not grow
    with the number of matrices."""
    from flat_test import _compiled_update

    def dots(n_matrices):
        hlo = _compiled_update("powersgd", {"rank": 2}, [(16, 16), (16,)] * n_matrices)
        return sum(" dot(" in line for line in hlo.splitlines())

    assert dots(32) == dots(2) <= 8


def _aggregate(method):
    """``(f, n, shapes)``: ``method``'s jitted aggregate over the 8 devices of SHAPES's ``n``
    values (in the params' order), returning ``(total, sent)``."""
    from jax.sharding import PartitionSpec as P

    shapes = tuple(SHAPES[name] for name in sorted(SHAPES))
    n = sum(int(np.prod(s)) for s in shapes)
    state = method.init_state(shapes)

    def f(v):
        total, sent, _ = method.aggregate(
            v, "data", step=0, key=jax.random.key(0), state=state, shapes=shapes
        )
        return total, sent

    mapped = jax.shard_map(f, mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P("data")))
    return jax.jit(mapped), n, shapes


def test_bytes_on_the_wire_are_wire_bytes():
    """The two all-reduces in the traced step move what wire_bytes(shapes=) says."""
    from collectives_test import _collective_bytes

    method = PowerSGD(2)
    f, n, shapes = _aggregate(method)
    traced = f.trace(jnp.zeros(n * N_DEVICES, jnp.float32))
    uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {"data": N_DEVICES})
    assert not p2p and uniform == pytest.approx(method.wire_bytes(n, N_DEVICES, shapes=shapes))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_factors_keep_what_the_wire_rounds(dtype):
    """dtype=float16/bfloat16 sends P, Q and the leaves sent as they are in 16 bits: each step's
    update is the float32 reference's to the narrow type's rounding, and error feedback keeps all
    the wire lost: over the devices, what was fed less what is kept adds up to the update."""
    shapes = SHAPES
    method = PowerSGD(2, dtype=dtype)
    dp, state = _run(method, shapes)
    rng = np.random.default_rng(1)
    residual = {name: np.zeros((N_DEVICES, *shape)) for name, shape in shapes.items()}
    tolerance = 2e-3 if dtype == "float16" else 2e-2
    for _ in range(2):
        batch = _batch(rng, shapes)
        qs = jaxcomp.find_compress_state(state.opt_state).method_state[0][0]
        before = {k: np.asarray(v, np.float64) for k, v in state.params.items()}
        fed = {name: batch[name] + residual[name] for name in shapes}
        total, _, _ = _reference_step(fed, qs, method.rank, shapes)
        state, metrics = dp.step(state, batch)
        residual = {
            k: np.asarray(v, np.float64)
            for k, v in jaxcomp.find_compress_state(state.opt_state).residual.items()
        }
        for name in shapes:
            update = before[name] - np.asarray(state.params[name])
            scale = np.abs(total[name]).max()
            np.testing.assert_allclose(update, total[name], atol=tolerance * scale)
            kept = (fed[name] - residual[name]).sum(axis=0)
            np.testing.assert_allclose(kept, update, atol=1e-4 * max(scale, 1.0))
    flat_shapes = tuple(shapes[name] for name in sorted(shapes))
    n = sum(int(np.prod(s)) for s in flat_shapes)
    assert float(metrics["bytes_sent"]) == pytest.approx(
        method.wire_bytes(n, N_DEVICES, shapes=flat_shapes)
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_factors_move_what_wire_bytes_says(dtype):
    """The compiled CPU step of dtype=float16/bfloat16 sends its two all-reduces as the 16-bit
    ring (uint16 hops, an all-gather of the owned chunks) plus float16's two scalar scales, and
    those bytes are wire_bytes(shapes=): about half of float32's."""
    from cast_test import _collectives, _hlo_bytes

    method = PowerSGD(2, dtype=dtype)
    f, n, shapes = _aggregate(method)
    compiled = f.lower(jnp.zeros(n * N_DEVICES, jnp.float32)).compile()
    ops = _collectives(compiled.as_text())
    vectors = [op for op in ops if np.prod(op[1]) > 1]
    assert vectors and all(kind == "u16" for kind, _, _ in vectors), ops
    scalars = [op for op in ops if op not in vectors]
    assert scalars == ([("f32", [], "all-reduce")] * 2 if dtype == "float16" else []), ops
    wire = method.wire_bytes(n, N_DEVICES, shapes=shapes)
    assert _hlo_bytes(ops, N_DEVICES) == pytest.approx(wire)
    float32 = PowerSGD(2).wire_bytes(n, N_DEVICES, shapes=shapes)
    assert 0.45 * float32 < wire < 0.6 * float32
    assert method.message_steps(N_DEVICES) == (2 if dtype == "float16" else 1) * PowerSGD(
        2
    ).message_steps(N_DEVICES)


def test_sixteen_bit_factors_by_name():
    """ "powersgd_fp16" and "powersgd_bf16" are PowerSGD with dtype=, and say so in tables."""
    assert jaxcomp.methods.parse("powersgd_fp16", rank=4) == PowerSGD(4, dtype="float16")
    assert PowerSGD(4, dtype=jnp.bfloat16) == PowerSGD(4, dtype="bf16")
    assert PowerSGD(4, dtype="fp16").describe() == "powersgd_fp16(4)"
    assert PowerSGD(4, dtype=np.float32) == PowerSGD(4)


def test_error_feedback_identity_replicas_and_one_compile():
    """Sum of aggregates = sum of gradients - residuals over steps (to float32 rounding: the sum of
    the devices' P q_d^T is P Q^T only up to rounding); replicas identical; one compilation."""
    dp, state = _run(PowerSGD(1))
    rng = np.random.default_rng(1)
    fed = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    with count_compilations() as compiles:
        for _ in range(4):
            batch = _batch(rng)
            for name in SHAPES:
                fed[name] += batch[name].astype(np.float64).sum(axis=0)
            state, _ = dp.step(state, batch)
    assert compiles[0] == 1
    cs = jaxcomp.find_compress_state(state.opt_state)
    for name in SHAPES:
        residual = np.asarray(cs.residual[name], np.float64).sum(axis=0)
        np.testing.assert_allclose(
            -np.asarray(state.params[name]), fed[name] - residual, rtol=1e-4, atol=1e-3
        )
    for leaf in jax.tree.leaves((state.params, cs.method_state)):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])


def test_start_iter_runs_dense_first_then_powersgd():
    dp, state = _run(PowerSGD(2, start_iter=2))
    assert [m.label for m in jaxcomp.find_compress_state(state.opt_state).methods] == [
        "dense",
        "powersgd",
    ]
    rng = np.random.default_rng(2)
    ran = []
    for _ in range(3):
        state, metrics = dp.step(state, _batch(rng))
        ran.append(int(metrics["method"]))
    assert ran == [0, 0, 1]


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path):
    tx = optax.chain(jaxcomp.compress(PowerSGD(2)), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh())
    state = dp.init({name: jnp.zeros(shape) for name, shape in SHAPES.items()})
    rng = np.random.default_rng(3)
    for _ in range(2):
        state, _ = dp.step(state, _batch(rng))
    state = assert_checkpoint_resumes(dp, state, [_batch(rng) for _ in range(2)], tmp_path / "ckpt")


def test_orthogonalize_and_matrix_view():
    p = orthogonalize(jnp.asarray(np.random.default_rng(4).standard_normal((20, 3)), jnp.float32))
    np.testing.assert_allclose(np.asarray(p.T @ p), np.eye(3), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(orthogonalize(jnp.zeros((5, 2)))), np.zeros((5, 2)))
    assert (
        matrix_view((3, 3, 16, 32)) == (144, 32)
        and matrix_view((7,)) is None
        and matrix_view(()) is None
    )


@pytest.mark.parametrize(
    "shape, view",
    [
        ((24, 16), (24, 16)),  # Dense: (in, out)
        ((3, 3, 64, 64), (576, 64)),  # convolution, HWIO: (h * w * in, out)
        ((7, 7, 3, 64), (147, 64)),  # ResNet's stem
        ((1, 1, 2048, 512), (2048, 512)),  # a 1x1 convolution
        ((128, 4, 32), (128, 128)),  # attention's query/key/value: (in, heads * head_dim)
        ((4, 32, 128), (128, 128)),  # attention's output: (heads * head_dim, out)
        ((768, 12, 64), (768, 768)),  # GPT-2's
        ((3, 3, 1, 256), (9, 256)),  # depthwise: both splits are the same matrix
    ],
)
def test_matrix_view_is_the_layers_inputs_by_outputs(shape, view):
    """The most square split: flax's kernels' inputs x outputs, whichever axes hold them (the
    attention kernels' heads on either side), so their low-rank structure is what is
    approximated; viewed as (prod(shape[:-1]), shape[-1]), (128, 4, 32) was a 512 x 32 matrix
    that mixes inputs with heads."""
    assert matrix_view(shape) == view
    rows, cols = view
    assert rows * cols == np.prod(shape)


def test_cost_model_and_candidates():
    m = PowerSGD(4)
    assert m.message_steps(8) == 28 and PowerSGD(4, allreduce="tree").message_steps(8) == 12
    # Without shapes the cost model sees one square matrix: 1000x1000 at rank 4 sends 8000 values.
    assert m.kept(10**6) == 8000
    assert m.wire_bytes(10**6, 8) == 2 * 7 / 8 * 4 * 4000 * 2
    net = cost.Network.parse("1ms", "1gbit")
    assert cost.predict(m, 4e8, 8, net) < cost.predict("dense", 4e8, 8, net)
    assert cost.predict("powersgd", 4e8, 8, net, rank=4) == cost.predict(m, 4e8, 8, net)
    assert m in jaxcomp.methods.candidates(rank=4)
    assert jaxcomp.methods.parse("powersgd", rank=4) == m and m.describe() == "powersgd(4)"


def test_powersgd_is_a_compress_auto_candidate():
    """Its state rides along in every branch; the branches compile, dense runs first."""
    tx = optax.chain(
        jaxcomp.compress_auto(
            [jaxcomp.Dense(), PowerSGD(2)], network=cost.Network.parse("1ms", "100mbit")
        ),
        optax.sgd(1.0),
    )
    dp = jaxcomp.data_parallel(_loss, tx, _mesh())
    state = dp.init({name: jnp.zeros(shape) for name, shape in SHAPES.items()})
    state, metrics = dp.step(state, _batch(np.random.default_rng(5)))
    assert np.isfinite(float(metrics["gain"]))
    assert len(jaxcomp.find_compress_state(state.opt_state).method_state[1][0]) == 2


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: PowerSGD(0), "rank must be"),
        (lambda: PowerSGD(2.5), "rank must be"),
        (lambda: PowerSGD(2, start_iter=-1), "start_iter must be"),
        (lambda: PowerSGD(2, min_compression_rate=0.5), "min_compression_rate must be"),
        (lambda: PowerSGD(2, allreduce="star"), "allreduce must be one of"),
        (lambda: PowerSGD(2, dtype="int8"), "dtype must be float32, float16 or bfloat16"),
        # rank larger than every matrix: refused at init, naming rank.
        (
            lambda: jaxcomp.compress(PowerSGD(8)).init({"w": jnp.zeros((6, 5)), "b": jnp.zeros(5)}),
            "rank=8 compresses none",
        ),
        (lambda: jaxcomp.compress(PowerSGD(1)).init({"b": jnp.zeros(5)}), "have none"),
        (lambda: jaxcomp.compress("powersgd", ratio=0.1), "remove ratio="),
    ],
)
def test_bad_arguments_are_named(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


# Leaves in the order of a model that interleaves matrices and small leaves: a run of two
# leaves sent as they are, a leaf without values, a matrix left dense by its size.
PIECE_SHAPES = ((5,), (2, 3), (24, 16), (0, 4), (16,), (30, 20), (3, 4))


def test_pieces_are_the_joined_vectors_bit_for_bit():
    """aggregate(pieces=True) returns the same total and sent, cut as piece_sizes says: each
    compressed matrix, and each run of leaves sent as they are."""
    from jax.sharding import PartitionSpec as P

    from jaxcomp.ops.pieces import Pieces

    method = PowerSGD(2)
    assert method.piece_sizes(PIECE_SHAPES) == [11, 384, 16, 600, 12]
    n = sum(int(np.prod(s)) for s in PIECE_SHAPES)
    state = method.init_state(PIECE_SHAPES)

    def f(v):
        run = lambda pieces: method.aggregate(  # noqa: E731
            v,
            "data",
            step=0,
            key=jax.random.key(0),
            state=state,
            shapes=PIECE_SHAPES,
            pieces=pieces,
        )
        (total, sent, q), (t, s, q2) = run(False), run(True)
        assert isinstance(t, Pieces) and isinstance(s, Pieces)
        assert t.sizes == s.sizes == method.piece_sizes(PIECE_SHAPES)
        return total, sent, t.joined(), s.joined(), q, q2

    x = jnp.asarray(np.random.default_rng(0).standard_normal(n * N_DEVICES), jnp.float32)
    total, sent, total2, sent2, q, q2 = jax.jit(
        jax.shard_map(
            f,
            mesh=_mesh(),
            in_specs=P("data"),
            out_specs=(P(), P("data"), P(), P("data"), P(), P()),
        )
    )(x)
    for a, b in ((total, total2), (sent, sent2), (q, q2)):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("warmup", [0, 1], ids=["guardrail's switch", "warm-up and guardrail"])
@pytest.mark.parametrize("guardrail", [True, False])
def test_updates_in_pieces_are_the_joined_updates_bit_for_bit(monkeypatch, warmup, guardrail):
    """compress's update with the totals in pieces (default) equals the joined vectors' update,
    with and without the dense branch of a lax.switch (the guardrail's fallback, the warm-up)."""

    def three_steps():
        tx = optax.chain(
            jaxcomp.compress(PowerSGD(2), warmup_steps=warmup, guardrail=guardrail),
            optax.sgd(0.5),
        )
        dp = jaxcomp.data_parallel(_loss, tx, _mesh())
        state = dp.init({name: jnp.zeros(shape) for name, shape in SHAPES.items()})
        rng = np.random.default_rng(4)
        for _ in range(3):
            state, _ = dp.step(state, _batch(rng))
        cs = jaxcomp.find_compress_state(state.opt_state)
        exact = (state.params, cs.residual, cs.method_state, cs.step)
        return jax.tree.map(np.asarray, exact), jax.tree.map(np.asarray, cs.metrics)

    in_pieces, metrics = three_steps()
    monkeypatch.setattr(PowerSGD, "pieces", False)
    joined, joined_metrics = three_steps()
    for a, b in zip(jax.tree.leaves(in_pieces), jax.tree.leaves(joined)):
        np.testing.assert_array_equal(a, b)
    # The gain's energies are summed part by part: the same to float32 rounding.
    for a, b in zip(jax.tree.leaves(metrics), jax.tree.leaves(joined_metrics)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("pieces", [True, False], ids=["in pieces", "joined (the check sees it)"])
def test_the_update_joins_no_vector_of_the_gradients_size(monkeypatch, pieces):
    """No concatenate in the compiled update writes as many values as the gradients hold: the
    totals and contributions go to the leaves in pieces (the error-fed vector is one native
    pass). Joined, as before, the update writes two such vectors."""
    from flat_test import MLP8_SHAPES, _compiled_update

    monkeypatch.setattr(PowerSGD, "pieces", pieces)
    hlo = _compiled_update("powersgd", {"rank": 2}, MLP8_SHAPES)
    n = sum(int(np.prod(s)) for s in MLP8_SHAPES)
    joined = [line for line in hlo.splitlines() if f"f32[{n}]{{0}} concatenate(" in line]
    assert len(joined) == (0 if pieces else 2), f"{len(joined)} concatenates of the gradient"
