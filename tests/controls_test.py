"""The controls every method takes (issue 15): dense warm-up, mask/min_size, DGC's momentum
correction, and gradient accumulation with optax.MultiSteps."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_checkpoint_resumes, count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.methods import PowerSGD, RandomK, TopK

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8
SHAPES = {"w": (16, 12), "b": (12,), "scale": (5,)}


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _loss(params, batch):
    """Each device's gradient of a leaf is its batch row for that leaf."""
    return sum(jnp.sum(params[name] * jnp.mean(batch[name], axis=0)) for name in params)


def _batch(rng):
    return {
        name: rng.standard_normal((N_DEVICES, *shape)).astype(np.float32)
        for name, shape in SHAPES.items()
    }


def _zeros():
    return {name: jnp.zeros(shape) for name, shape in SHAPES.items()}


def _run(tx, **options):
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(), **options)
    return dp, dp.init(_zeros())


def _flat(tree):
    """The model vector in the params' flattening order (sorted dict keys), per device when
    stacked."""
    return np.concatenate(
        [
            np.asarray(tree[name], np.float64).reshape(
                *np.shape(tree[name])[: -len(SHAPES[name])], -1
            )
            for name in sorted(SHAPES)
        ],
        axis=-1,
    )


# ---- warm-up ---------------------------------------------------------------------------------


@pytest.mark.parametrize("host_branches", [False, True])
def test_warmup_runs_dense_then_the_method_with_error_feedback_exact_across_the_switch(
    host_branches,
):
    """Steps 0-1 are the exact dense sum (nothing kept), step 2 on runs top-k; sum of aggregates =
    sum of gradients - residuals throughout; one compilation. With the branch picked on the host
    (jaxcomp.training.branches) step 2 is dense too, and each branch compiles once."""
    tx = optax.chain(
        jaxcomp.compress(TopK(k=10, collective="ar"), mean=False, warmup_steps=2), optax.sgd(1.0)
    )
    dp, state = _run(tx, host_branches=host_branches)
    dense_steps = 3 if host_branches else 2
    assert [m.label for m in jaxcomp.find_compress_state(state.opt_state).methods] == [
        "dense",
        "ar_topk",
    ]
    rng = np.random.default_rng(0)
    fed, ran = np.zeros(_flat(_zeros()).shape), []
    with count_compilations() as compiles:
        for step in range(4):
            batch = _batch(rng)
            before = _flat(state.params)
            state, metrics = dp.step(state, batch)
            ran.append(int(metrics["method"]))
            fed += _flat(batch).sum(axis=0)
            residual = _flat(jaxcomp.find_compress_state(state.opt_state).residual)
            if step < dense_steps:
                np.testing.assert_allclose(
                    before - _flat(state.params), _flat(batch).sum(axis=0), rtol=1e-6, atol=1e-5
                )
                assert not residual.any() and float(metrics["density"]) == pytest.approx(1.0)
            else:
                # SPLIT (the default leader) fills N ceil(k/N) slots with each device's values
                slots = N_DEVICES * -(-10 // N_DEVICES)
                assert residual.any() and float(metrics["density"]) == pytest.approx(
                    slots / fed.size
                )
            np.testing.assert_allclose(
                -_flat(state.params), fed - residual.sum(axis=0), rtol=1e-5, atol=1e-4
            )
    assert ran == [0] * dense_steps + [1] * (4 - dense_steps)
    if host_branches:  # one step per branch, each compiled once
        steps = dp.step._jitted._jitted
        assert sorted(steps) == [0, 1] and all(f._cache_size() == 1 for f in steps.values())
    else:
        assert compiles[0] == 1


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: jaxcomp.compress(TopK(0.1), warmup_steps=-1), "warmup_steps must be"),
        (lambda: jaxcomp.compress(TopK(0.1), warmup_steps=1.5), "warmup_steps must be"),
        (
            lambda: jaxcomp.compress(
                jaxcomp.Zfp(8, algorithm="recursive_doubling"), warmup_steps=3
            ),
            "replicated",
        ),
        (lambda: jaxcomp.compress("auto", ratio=0.1, warmup_steps=3), "single method"),
    ],
)
def test_warmup_bad_arguments(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


# ---- mask and min_size ---------------------------------------------------------------------------


def _all_reduce_operands(dp, state, batch):
    """(dtype, element count) of each all-reduce operand in the compiled step."""
    hlo = dp.step.lower(state, batch).compile().as_text()
    found = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match:
            found += [
                (dtype, int(np.prod([int(d) for d in dims.split(",") if d])))
                for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([\d,]*)\]", match.group(1))
            ]
    return found


@pytest.mark.parametrize(
    "option",
    [
        {"min_size": 20},
        {"mask": {"w": True, "b": False, "scale": False}},
        {"mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)},
    ],
    ids=["min_size", "mask_tree", "mask_callable"],
)
def test_left_out_leaves_are_summed_exactly_in_one_fused_all_reduce(option):
    """b and scale (12 + 5 values) go dense in ONE all-reduce of 17 floats, keep no residual and
    come out as the exact sum; w is compressed with error feedback."""
    # guardrail=False: its dense fallback branch would all-reduce w (192 floats) in the HLO.
    tx = optax.chain(
        jaxcomp.compress(TopK(k=5, collective="ar"), mean=False, guardrail=False, **option),
        optax.sgd(1.0),
    )
    dp, state = _run(tx)
    residual = jaxcomp.find_compress_state(state.opt_state).residual
    assert isinstance(residual["b"], optax.MaskedNode) and isinstance(
        residual["scale"], optax.MaskedNode
    )
    batch = _batch(np.random.default_rng(1))
    state, metrics = dp.step(state, batch)
    for name in ("b", "scale"):
        np.testing.assert_allclose(
            -np.asarray(state.params[name]), batch[name].sum(axis=0), rtol=1e-6, atol=1e-5
        )
    # AR-Topk's SPLIT leader: every device picks ceil(5 / N) of the shared indices.
    slots = N_DEVICES * -(-5 // N_DEVICES)  # the density metric counts them all
    assert np.count_nonzero(np.asarray(state.params["w"])) <= slots
    assert float(metrics["density"]) == pytest.approx((slots + 17) / (16 * 12 + 17))
    dense = jaxcomp.Dense().wire_bytes(17, N_DEVICES)
    assert float(metrics["bytes_sent"]) == pytest.approx(
        TopK(k=5, collective="ar").wire_bytes(192, N_DEVICES) + dense
    )
    # One all-reduce carries both left-out leaves; no float all-reduce is as large as w (192).
    operands = _all_reduce_operands(dp, state, batch)
    assert operands.count(("f32", 17)) == 1
    assert not any(dtype == "f32" and size >= 192 for dtype, size in operands)


def test_everything_masked_out_is_plain_dense():
    tx = optax.chain(
        jaxcomp.compress(TopK(k=5), mean=False, mask=lambda p: jax.tree.map(lambda _: False, p)),
        optax.sgd(1.0),
    )
    dp, state = _run(tx)
    batch = _batch(np.random.default_rng(2))
    state, metrics = dp.step(state, batch)
    np.testing.assert_allclose(-_flat(state.params), _flat(batch).sum(axis=0), rtol=1e-6, atol=1e-5)
    assert float(metrics["density"]) == 1.0 and float(metrics["gain"]) == 1.0


def test_powersgd_with_min_size_leaves_small_leaves_to_the_fused_all_reduce():
    tx = optax.chain(jaxcomp.compress(PowerSGD(2), mean=False, min_size=50), optax.sgd(1.0))
    dp, state = _run(tx)
    assert [q.shape for q in jaxcomp.find_compress_state(state.opt_state).method_state[0][0]] == [
        (12, 2)
    ]
    state, _ = dp.step(state, _batch(np.random.default_rng(3)))
    assert np.isfinite(_flat(state.params)).all()


@pytest.mark.parametrize(
    "option, match",
    [
        ({"mask": {"w": True}}, "mask must have the structure of the params"),
        ({"mask": {"w": 1, "b": True, "scale": True}}, "mask must hold Python bools"),
        ({"min_size": -1}, "min_size must be"),
    ],
)
def test_mask_bad_arguments(option, match):
    with pytest.raises(ValueError, match=match):
        jaxcomp.compress(TopK(0.1), **option).init(_zeros())


# ---- DGC momentum correction
# -----------------------------------------------------------------------


def test_momentum_correction_matches_numpy_reference():
    """DGC Alg. 1 with momentum correction and factor masking, per device, all-gather top-k:
    u = m u + g; v = v + u; send top-k of |v|; clear v and u where sent."""
    m, k, steps = 0.9, 6, 3
    tx = optax.chain(jaxcomp.compress(TopK(k=k), mean=False, momentum_correction=m), optax.sgd(1.0))
    dp, state = _run(tx)
    rng = np.random.default_rng(4)
    n = _flat(_zeros()).size
    u, v = np.zeros((N_DEVICES, n)), np.zeros((N_DEVICES, n))
    for _ in range(steps):
        batch = _batch(rng)
        before = _flat(state.params)
        state, _ = dp.step(state, batch)
        g = _flat(batch)
        u = m * u + g
        v = v + u
        total = np.zeros(n)
        for d in range(N_DEVICES):
            idx = np.argsort(-np.abs(v[d]), kind="stable")[:k]
            total[idx] += v[d, idx]
            v[d, idx] = 0.0
            u[d, idx] = 0.0
        np.testing.assert_allclose(before - _flat(state.params), total, rtol=1e-5, atol=1e-5)
        cs = jaxcomp.find_compress_state(state.opt_state)
        np.testing.assert_allclose(_flat(cs.residual), v, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_flat(cs.velocity), u, rtol=1e-5, atol=1e-5)


def test_momentum_and_method_state_checkpoint_round_trip(tmp_path):
    """The velocity (per device) resumes bit-identically from an orbax checkpoint."""
    tx = optax.chain(jaxcomp.compress(RandomK(0.2), momentum_correction=0.9), optax.sgd(0.1))
    dp, state = _run(tx)
    rng = np.random.default_rng(5)
    for _ in range(2):
        state, _ = dp.step(state, _batch(rng))
    state = assert_checkpoint_resumes(dp, state, [_batch(rng) for _ in range(2)], tmp_path / "ckpt")
    assert _flat(jaxcomp.find_compress_state(state.opt_state).velocity).any()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: jaxcomp.compress(jaxcomp.Zfp(8), momentum_correction=0.9), "sparsifying methods"),
        (
            lambda: jaxcomp.compress(TopK(0.1), momentum_correction=1.0),
            r"momentum_correction must be a momentum in \[0, 1\)",
        ),
        (
            lambda: jaxcomp.compress(TopK(0.1), momentum_correction="0.9"),
            "momentum_correction must be",
        ),
    ],
)
def test_momentum_bad_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---- gradient accumulation -----------------------------------------------------------------------


def test_multisteps_compresses_once_per_accumulated_step():
    """optax.MultiSteps around the chain: the compress state steps once per 3 micro-steps, the
    params move only then, by what one compressed step of the micro-steps' mean gives."""
    every = 3
    inner = optax.chain(jaxcomp.compress(TopK(k=8, collective="ar"), mean=False), optax.sgd(1.0))
    dp, state = _run(optax.MultiSteps(inner, every_k_schedule=every))
    ref_dp, ref_state = _run(inner)
    rng = np.random.default_rng(6)
    micro = [_batch(rng) for _ in range(every)]
    for i, batch in enumerate(micro):
        before = _flat(state.params)
        state, _ = dp.step(state, batch)
        cs = jaxcomp.find_compress_state(state.opt_state)
        assert int(cs.step) == (1 if i == every - 1 else 0)
        if i < every - 1:
            np.testing.assert_array_equal(_flat(state.params), before)
    mean_batch = {name: np.mean([b[name] for b in micro], axis=0) for name in SHAPES}
    ref_state, _ = ref_dp.step(ref_state, mean_batch)
    np.testing.assert_allclose(_flat(state.params), _flat(ref_state.params), rtol=1e-5, atol=1e-5)
    # The micro-steps communicate nothing: the collectives sit in the emitting branch of one
    # conditional, which runs once per accumulated step.
    hlo = dp.step.lower(state, micro[0]).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    assert "conditional(" in entry
    outside = [line for line in entry.splitlines() if re.search(r"all-reduce(-start)?\(", line)]
    assert not [line for line in outside if re.search(r"f32\[\d", line)], (
        outside
    )  # scalars (the loss) only


def test_accumulate_waits_where_optax_multisteps_cannot_run_in_shard_map():
    """Why data_parallel replaces it: MultiSteps runs the inner update on every micro-step (its
    result kept by a where: the collectives would run per micro-step) and traces its skip branch
    with the replicated accumulator, which compress refuses as already all-reduced."""
    inner = optax.chain(jaxcomp.compress(TopK(k=2, collective="ar")), optax.sgd(1.0))
    ms = optax.MultiSteps(inner, every_k_schedule=3)
    tx = jaxcomp.accumulate(inner, 3)
    mesh = _mesh()

    def steps(transform):
        def f(g):
            state = transform.init({"w": g})
            for _ in range(2):
                _, state = transform.update({"w": g}, state)
            return jaxcomp.find_compress_state(state.inner_opt_state).step

        return jax.jit(
            jax.shard_map(
                f,
                mesh=mesh,
                in_specs=jax.sharding.PartitionSpec("data"),
                out_specs=jax.sharding.PartitionSpec(),
            )
        )

    g = jnp.ones(4 * N_DEVICES)
    assert int(steps(tx)(g)) == 0  # two micro-steps of three: nothing sent yet
    with pytest.raises(Exception):  # noqa: B017  MultiSteps traces its skip branch with the replicated accumulator
        steps(ms)(g)


def test_accumulate_bad_arguments():
    with pytest.raises(ValueError, match="every_k must be"):
        jaxcomp.accumulate(optax.sgd(1.0), 0)
    with pytest.raises(TypeError, match="tx must be"):
        jaxcomp.accumulate("sgd", 2)
