"""Sharded training (issue 11): data_parallel(shard="optimizer" | "params") and the methods'
reduce-scatter forms, on 8 devices and on a 2x4 mesh."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from collectives_test import _collective_bytes
from helpers import assert_checkpoint_resumes, count_compilations, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.methods import Cast, Dense, PowerSGD, Quantized, RandomK, Sign, TopK, Zfp
from jaxcomp.optim import sharding

N = 8


def _mesh():
    need_devices(N)
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def _mesh_2x4():
    need_devices(N)
    return Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("node", "device"))


# ---- the layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1], [5], [8], [13, 3, 64, 1]])
def test_shard_layout_against_numpy(sizes):
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=s).astype(np.float32) for s in sizes]
    m = [-(-s // N) for s in sizes]
    row = sum(m) + 3
    vector = np.asarray(sharding.shard_major([jnp.asarray(p) for p in parts], N, row))
    # Row d: device d's shard of each part, then padding.
    want = np.zeros((N, row), np.float32)
    offset = 0
    for part, mi in zip(parts, m):
        padded = np.zeros(N * mi, np.float32)
        padded[: part.size] = part
        want[:, offset : offset + mi] = padded.reshape(N, mi)
        for d in range(N):
            np.testing.assert_array_equal(
                np.asarray(sharding.shard_of(jnp.asarray(part), N, d)),
                padded[d * mi : (d + 1) * mi],
            )
        np.testing.assert_array_equal(
            np.asarray(sharding.unshard(jnp.asarray(padded.reshape(N, mi)), part.shape)), part
        )
        offset += mi
    np.testing.assert_array_equal(vector, want.reshape(-1))
    for got, part in zip(sharding.from_shard_major(jnp.asarray(vector), sizes, N), parts):
        np.testing.assert_array_equal(np.asarray(got), part)
    if sum(m) > 1:
        with pytest.raises(ValueError, match="row=1 is shorter"):
            sharding.shard_major([jnp.asarray(p) for p in parts], N, 1)


# ---- each method's reduce-scatter, against its all-reduce ---------------------------------------


def _run_both(method, x, row):
    """``(total, sent)`` of ``aggregate`` and ``(shard rows, sent)`` of ``reduce_scatter`` on the
    same per-device vectors ``x`` ([N, N * row])."""
    key = jax.random.key(3)

    def both(v):
        v = v[0]
        total, sent, _ = method.aggregate(v, "data", step=jnp.int32(1), key=key)
        shard, sent_rs = method.reduce_scatter(
            v, "data", step=jnp.int32(1), key=key, size=v.shape[0]
        )
        return total, sent[None], shard, sent_rs[None]

    out = jax.jit(
        jax.shard_map(
            both, mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P("data"), P("data"), P("data"))
        )
    )(x)
    return [np.asarray(o) for o in out]


@pytest.mark.parametrize(
    "method",
    [
        Dense(),
        Cast("bfloat16"),
        Cast("float16"),
        TopK(0.1),
        TopK(k=7, collective="ar"),
        TopK(k=7, collective="ar", leader="split"),
        TopK(0.05, selector="threshold"),
        Sign(16, aggregation="ring"),
    ],
    ids=["dense", "bf16", "fp16", "allgather_topk", "ar_topk", "ar_split", "mstopk", "sign_ring"],
)
def test_exact_reduce_scatter_is_the_all_reduce_split(method):
    """Dense, Cast and TopK reduce-scatter the very sum their all-reduce computes: device d's
    shard is row d of it bit for bit (Dense: to XLA's summation order), with the same sent. The
    ring of signs codes the same chunks in the same order either way, so its shard is its
    all-reduce's row bit for bit too."""
    row = 37
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, N * row)), jnp.float32)
    total, sent, shard, sent_rs = _run_both(method, x, row)
    assert shard.shape == (N * row,)
    if isinstance(method, Dense):
        np.testing.assert_allclose(shard, total, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(shard, total)
    np.testing.assert_array_equal(sent_rs, sent)


@pytest.mark.parametrize(
    "method",
    [Zfp(8), Zfp(16), Quantized(4), Quantized(8, hadamard=False)],
    ids=["zfp8", "zfp16", "thc4", "thc8-plain"],
)
def test_lossy_reduce_scatter_sums_what_each_device_sent(method):
    """ZFP's ring reduce-scatter and THC's integer-code reduce-scatter: each shard is the sum of
    what the devices sent (so error feedback keeps exactly what was lost), close to the exact
    sum."""
    row = 1024 if isinstance(method, Quantized) else 300
    x = jnp.asarray(np.random.default_rng(2).normal(size=(N, N * row)), jnp.float32)
    total, _, shard, sent = _run_both(method, x, row)
    exact = np.asarray(x, np.float64).sum(axis=0)
    np.testing.assert_allclose(shard, sent.astype(np.float64).sum(axis=0), rtol=1e-5, atol=2e-4)
    # As accurate as the all-reduce (ZFP: one coding fewer; THC: other blocks, other noise).
    error, error_allreduce = (np.sqrt(np.mean((t - exact) ** 2)) for t in (shard, total))
    assert 0 < error < 1.2 * error_allreduce, (error, error_allreduce)


@pytest.mark.parametrize(
    "method, n",
    [
        (Dense(), 1003),
        (Zfp(8), 1003),
        (Quantized(4), 1003),
        (TopK(0.01), 1003),
        (TopK(0.05, collective="ar", leader="split"), 1003),
        (Sign(64, aggregation="ring"), 1003),
    ],
    ids=["dense", "zfp", "thc", "topk", "ar_split", "sign_ring"],
)
def test_reduce_scatter_bytes_are_what_the_collectives_move(method, n):
    """The casts' jaxpr holds both platforms' sums (the CPU's ring and the psum, chosen when
    lowered): cast_test reads their reduce-scatter bytes off the compiled CPU program."""
    row = method.shard_row(-(-n // N), N)
    key = jax.random.key(0)
    traced = jax.jit(
        jax.shard_map(
            lambda v: method.reduce_scatter(v, "data", step=jnp.int32(0), key=key, size=n),
            mesh=_mesh(),
            in_specs=P("data"),
            out_specs=(P("data"), P("data")),
        )
    ).trace(jnp.zeros(N * N * row, jnp.float32))
    uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {"data": N})
    model = method.reduce_scatter_bytes(N * row, N)
    assert uniform + max(p2p.values(), default=0) == pytest.approx(model)
    if not isinstance(method, TopK):
        assert model < method.wire_bytes(N * row, N)  # half an all-reduce, or less


@pytest.mark.parametrize(
    "method",
    [
        Sign(),
        PowerSGD(2),
        RandomK(0.1),
        TopK(0.1, collective="hierarchical"),
        Zfp(8, algorithm="recursive_doubling"),
    ],
    ids=["sign", "powersgd", "randomk", "hierarchical", "zfp-rd"],
)
def test_methods_without_a_reduce_scatter_say_so(method):
    assert not method.scatters
    axis = ("node", "device") if method.axes_needed == 2 else "data"
    mesh = _mesh_2x4() if method.axes_needed == 2 else _mesh()
    tx = optax.chain(jaxcomp.compress(method, axis_name=axis), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(_loss, tx, mesh, axis, shard="optimizer")
    with pytest.raises(ValueError, match="no reduce-scatter form.*methods that can: Dense"):
        dp.init(_params())


# ---- training ----------------------------------------------------------------------------------


def _loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(12, 19)) / 4, jnp.float32),
        "b1": jnp.zeros(19, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(19, 3)) / 4, jnp.float32),
    }


def _batches(steps=4, rows=32):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.normal(size=(rows, 12)).astype(np.float32)
        yield {
            "x": jnp.asarray(x),
            "y": jnp.asarray(np.stack([x[:, 0], x[:, 1] * x[:, 2], -x[:, 3]], 1)),
        }


def _train(method, shard, mesh=None, axis="data", steps=4, **options):
    tx = optax.chain(jaxcomp.compress(method, axis_name=axis, **options), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(_loss, tx, mesh or _mesh(), axis, shard=shard)
    state = dp.init(_params())
    losses = []
    for batch in _batches(steps):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    return dp, state, losses, metrics


# (method, how close the sharded run must stay to the replicated one after 4 adam steps)
TRAINED = [
    (Dense(), 1e-6),
    (Cast("bfloat16"), 1e-3),
    (TopK(0.2), 1e-6),
    (TopK(0.2, collective="ar"), 1e-6),
    (Zfp(12), 0.05),
    (Quantized(6), 0.05),
]


@pytest.mark.parametrize("shard", ["optimizer", pytest.param("params", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "method, tol", TRAINED, ids=["dense", "bf16", "allgather_topk", "ar_topk", "zfp", "thc"]
)
def test_sharded_training_matches_replicated(method, tol, shard):
    """Dense and top-k aggregate the same sum either way (to float rounding: the sharded step is
    another XLA program); bf16's CPU ring rounds each partial sum to bfloat16 in an order set by the
    chunk a value falls in, and the sharded layout puts values in other chunks, so it agrees to
    bfloat16's rounding; ZFP and THC code other chunks/blocks, so they agree to their
    compression error. The params stay identical on every device."""
    _, ref_state, ref_losses, _ = _train(method, None)
    dp, state, losses, metrics = _train(method, shard)
    params = dp.params(state)
    for name, want in ref_state.params.items():
        np.testing.assert_allclose(
            np.asarray(params[name]), np.asarray(want), rtol=tol, atol=tol, err_msg=name
        )
        shards = [np.asarray(s.data) for s in params[name].addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])
    np.testing.assert_allclose(losses, ref_losses, rtol=max(tol, 1e-6))
    assert float(metrics["gather_bytes"]) > 0 and float(metrics["bytes_sent"]) > 0


@pytest.mark.parametrize("method", [Dense(), TopK(0.2), Quantized(8)], ids=["dense", "topk", "thc"])
def test_sharded_training_on_a_2x4_mesh(method):
    mesh = _mesh_2x4()
    axis = ("node", "device")
    _, ref, _, _ = _train(method, None, mesh, axis)
    dp, state, _, _ = _train(method, "params", mesh, axis)
    tol = 0.05 if isinstance(method, Quantized) else 1e-6
    for name, want in ref.params.items():
        np.testing.assert_allclose(
            np.asarray(dp.params(state)[name]), np.asarray(want), rtol=tol, atol=tol
        )
    assert state.params["w1"].sharding.spec == P(axis)


def _collectives(hlo):
    """``[(op, shape)]`` of the collectives in compiled HLO text."""
    return re.findall(
        r"= (\S+) (all-reduce|reduce-scatter|all-gather|collective-permute)(?:-start)?\(", hlo
    )


@pytest.mark.parametrize("shard", ["optimizer", "params"])
@pytest.mark.parametrize("method", ["dense", "bf16", "quantized"])
def test_compiled_step_reduce_scatters_and_gathers(method, shard):
    """No float all-reduce of gradient size: the gradient is reduce-scattered (THC: as integer
    codes), the params all-gathered."""
    options = {"bits": 4} if method == "quantized" else {}
    tx = optax.chain(jaxcomp.compress(method, **options), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(), shard=shard)
    state = dp.init(_params())
    ops = _collectives(dp.step.lower(state, next(_batches())).compile().as_text())
    n_values = sum(p.size for p in jax.tree.leaves(_params()))
    # bf16 on the CPU: the ring's reduce-scatter phase, uint16 hops (XLA:CPU's reduce-scatter
    # would carry bfloat16 as float32).
    scattered = ("u16", "collective-permute") if method == "bf16" else (None, "reduce-scatter")
    assert any(
        op == scattered[1] and (scattered[0] is None or shape.startswith(scattered[0]))
        for shape, op in ops
    ), ops
    # The params' three leaves are small: one all-gather for them (not one per leaf).
    gathers = [shape for shape, op in ops if op == "all-gather"]
    assert len(gathers) == 1 or (method == "bf16" and len(gathers) == 2), ops
    for shape, op in ops:
        if op == "all-reduce" and shape.startswith(("f32", "bf16", "f16", "(")):
            sizes = [
                int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                for dims in re.findall(r"\[([\d,]*)\]", shape)
            ]
            assert max(sizes) < n_values // N, (shape, ops)
    if method == "quantized":
        assert any(op == "reduce-scatter" and shape.startswith("u32") for shape, op in ops), ops


def _bytes_per_device(tree):
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("method", ["dense", "zfp"])
def test_memory_per_device_is_a_shard(method):
    """From the arrays' shardings: with shard="params", params plus optimizer state (the
    error-feedback residual aside, which is per device and whole by design) take 1/N of the
    replicated run's bytes, plus padding and adam's step count."""
    big = {"w": jnp.zeros((256, 96)), "b": jnp.zeros(96), "v": jnp.zeros(1001)}
    options = {"rate": 8} if method == "zfp" else {}
    states = {}
    for shard in (None, "optimizer", "params"):
        tx = optax.chain(jaxcomp.compress(method, **options), optax.adam(1e-2))
        states[shard] = jaxcomp.data_parallel(_loss, tx, _mesh(), shard=shard).init(big)

    def split(state):
        compress_state = jaxcomp.find_compress_state(state.opt_state)
        residual = _bytes_per_device(compress_state.residual)
        return (
            _bytes_per_device(state.params),
            _bytes_per_device(state.opt_state) - residual,
            residual,
        )

    full_params, full_opt, full_residual = split(states[None])
    for shard in ("optimizer", "params"):
        params, opt, residual = split(states[shard])
        slack = 64 * 4 * 3  # padding of each leaf to whole shards, adam's count
        assert opt <= full_opt / N + slack, (shard, opt, full_opt)
        assert residual == full_residual  # error feedback: the whole local gradient, per device
        assert params == (
            full_params if shard == "optimizer" else pytest.approx(full_params / N, abs=slack)
        )
    if method == "dense":
        assert full_residual == 0
        # ZeRO-3 without a residual: everything is 1/N.
        assert (
            _bytes_per_device(states["params"]) <= _bytes_per_device(states[None]) / N + 2 * slack
        )


def test_one_compile_and_a_checkpoint_resumes_bit_for_bit(tmp_path):
    tx = optax.chain(jaxcomp.compress("allgather_topk", ratio=0.2), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params")
    state = dp.init(_params())
    batches = list(_batches(4))
    state, _ = dp.step(state, batches[0])
    with count_compilations() as compiled:
        for batch in batches[1:]:
            state, _ = dp.step(state, batch)
    assert compiled[0] == 0
    assert_checkpoint_resumes(dp, state, batches[:2], tmp_path / "ckpt")
    # A fresh data_parallel (as after a restart) restores onto the layout state_shapes gives.
    import orbax.checkpoint as ocp

    fresh = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params")
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", fresh.state_shapes(_params()))
    fresh.step(restored, batches[0])


def test_restoring_onto_another_device_count_is_refused(tmp_path):
    """Stepping a state of 8 devices on 4 is refused, naming both counts and dp.resize (which
    carries it over: tests/resize_test.py)."""
    tx = optax.chain(jaxcomp.compress("dense"), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params")
    state = dp.init(_params())
    four = jaxcomp.data_parallel(
        _loss, tx, Mesh(np.array(jax.devices()[:4]), ("data",)), shard="params"
    )
    four.init(_params())  # knows the params' shapes
    with pytest.raises(
        ValueError, match=r"shards for 8 devices, but this data_parallel shards over 4.*dp\.resize"
    ):
        four.step(state, next(_batches()))
    # shard="optimizer": the params are whole, the optimizer's shards do not fit.
    dp8 = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="optimizer")
    dp4 = jaxcomp.data_parallel(
        _loss, tx, Mesh(np.array(jax.devices()[:4]), ("data",)), shard="optimizer"
    )
    with pytest.raises(ValueError, match=r"made on 8 devices, but this data_parallel runs on 4"):
        dp4.step(dp8.init(_params()), next(_batches()))


def test_bf16_gather_keeps_exact_master_shards():
    """gather_dtype=bfloat16 (ZeRO++'s qwZ): the forward pass sees params rounded to bf16, the
    stored shards keep accumulating exact float32 updates."""
    tx = optax.chain(jaxcomp.compress("dense"), optax.sgd(1e-3))
    exact = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params")
    rounded = jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params", gather_dtype=jnp.bfloat16)
    a, b = exact.init(_params()), rounded.init(_params())
    for batch in _batches(3):
        a, ma = exact.step(a, batch)
        b, mb = rounded.step(b, batch)
    assert float(mb["gather_bytes"]) == pytest.approx(float(ma["gather_bytes"]) / 2)
    pa, pb = exact.params(a), rounded.params(b)
    assert pb["w1"].dtype == jnp.float32
    diff = max(float(jnp.abs(pa[k] - pb[k]).max()) for k in pa)
    assert 0 < diff < 1e-3  # the bf16 forward changes the gradient a little
    # The stored shards are not bf16-rounded values: exact updates accumulate in them.
    w = np.asarray(pb["w1"])
    assert not np.array_equal(w, np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32)))


def test_bad_arguments_are_named():
    tx = optax.chain(jaxcomp.compress("dense"), optax.adam(1e-2))
    with pytest.raises(ValueError, match="shard must be None, 'optimizer' or 'params'"):
        jaxcomp.data_parallel(_loss, tx, _mesh(), shard="zero3")
    with pytest.raises(ValueError, match="gather_dtype applies to shard='params'"):
        jaxcomp.data_parallel(_loss, tx, _mesh(), shard="optimizer", gather_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="gather_dtype must be a float dtype"):
        jaxcomp.data_parallel(_loss, tx, _mesh(), shard="params", gather_dtype=jnp.int8)
    with pytest.raises(ValueError, match="does not combine with shard"):
        jaxcomp.data_parallel(_loss, optax.MultiSteps(tx, 2), _mesh(), shard="optimizer")
    with pytest.raises(ValueError, match="sharded over 8 devices, but compress"):
        mesh = _mesh_2x4()
        bad = optax.chain(jaxcomp.compress("dense", axis_name="device"), optax.sgd(0.1))
        jaxcomp.data_parallel(_loss, bad, mesh, ("node", "device"), shard="optimizer").init(
            _params()
        )


@pytest.mark.parametrize("nonfinite", ["zero", "skip"])
@pytest.mark.parametrize("method", ["dense", "bf16"])
def test_nonfinite_gradients_agree_with_the_replicated_run(method, nonfinite):
    """A NaN in one device's batch: every device takes the same branch (sharded, each sees its own
    shards only, so they agree through one all-reduce of a flag), the count is the replicated
    run's, and so are the params."""
    results = {}
    for shard in (None, "params"):
        tx = optax.chain(jaxcomp.compress(method, nonfinite=nonfinite), optax.sgd(0.1))
        dp = jaxcomp.data_parallel(_loss, tx, _mesh(), shard=shard)
        state = dp.init(_params())
        counts = []
        for i, batch in enumerate(_batches(3)):
            if i == 1:
                batch = {**batch, "x": batch["x"].at[5, 2].set(jnp.nan)}
            state, metrics = dp.step(state, batch)
            counts.append(float(metrics["nonfinite"]))
        results[shard] = counts, jax.tree.map(np.asarray, dp.params(state))
    assert results["params"][0] == results[None][0] and results[None][0][1] > 0
    for name, want in results[None][1].items():
        tol = (
            1e-3 if method == "bf16" else 1e-6
        )  # bf16: the ring's roundings differ by layout (above)
        np.testing.assert_allclose(
            results["params"][1][name], want, rtol=tol, atol=tol, err_msg=name
        )


def test_cost_model_and_advise_know_the_sharded_form(capsys):
    from jaxcomp.cli import advise
    from jaxcomp.costmodel import cost

    net = cost.Network.parse("0.1ms", "1gbit")
    nbytes, workers = 4e8, 8
    # A reduce-scatter plus an all-gather is one ring all-reduce: sharded dense costs the same.
    assert cost.volume_bytes("dense", nbytes, workers, shard=True) == pytest.approx(
        cost.volume_bytes("dense", nbytes, workers)
    )
    assert cost.message_steps("dense", workers, shard=True) == cost.message_steps("dense", workers)
    # ZFP compresses only the gradient's half: its reduce-scatter, plus the params' dense
    # all-gather.
    zfp = Zfp(8)
    n = int(nbytes // 4)
    assert cost.volume_bytes(zfp, nbytes, workers, shard=True) == pytest.approx(
        zfp.reduce_scatter_bytes(n, workers) + (workers - 1) / workers * nbytes
    )
    assert cost.predict(zfp, nbytes, workers, net, shard=True) > cost.predict(
        zfp, nbytes, workers, net
    )
    assert cost.volume_bytes(
        "dense", nbytes, workers, shard=True, gather_bytes=2
    ) < cost.volume_bytes("dense", nbytes, workers, shard=True)
    assert (
        advise.main(
            [
                "--params",
                "25e6",
                "--workers",
                "8",
                "--bandwidth",
                "1gbit",
                "--backward-ms",
                "50",
                "--shard",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "sharded (--shard)" in out and "zfp" in out and "quantized" in out
    first_words = {line.split()[0] for line in out.splitlines() if line.split()}
    assert "sign_ring" in first_words  # the ring of signs has a reduce-scatter form
    for name in ("sign", "sign_allreduce", "powersgd", "randomk", "hierarchical_topk"):
        assert name not in first_words


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_the_ring_of_signs_trains_sharded(shard):
    """The ring of signs codes other chunks in the sharded layout than in the replicated one, so
    the two runs differ by the signs' error; sharded, it trains as the replicated run does, and
    the params stay identical on every device."""
    _, _, ref_losses, _ = _train(Sign(aggregation="ring"), None, steps=12)
    dp, state, losses, metrics = _train(Sign(aggregation="ring"), shard, steps=12)
    assert losses[-1] < 0.7 * losses[0] and ref_losses[-1] < 0.7 * ref_losses[0]
    assert losses[-1] < 1.2 * ref_losses[-1]
    for leaf in jax.tree.leaves(dp.params(state)):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])
    n_params = sum(leaf.size for leaf in jax.tree.leaves(_params()))
    assert 0 < float(metrics["bytes_sent"]) < Sign().wire_bytes(n_params, N) / 2  # half a ring
