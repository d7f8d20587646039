"""jaxcomp.data_parallel: no dense all-reduce, identical replicas, checkpoints, flax models."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_checkpoint_resumes, assert_trees_equal, count_compilations, need_devices
from jax.sharding import Mesh

from jaxcomp.costmodel.cost import Network
from jaxcomp.optim.transform import compress
from jaxcomp.training.trainer import data_parallel

N_DEVICES = 8

METHODS = {
    "dense": {},
    "allgather_topk": {"ratio": 0.01},
    "ar_topk": {"ratio": 0.01},
    "hierarchical_topk": {"ratio": 0.01, "axis_name": ("node", "device")},
    "zfp": {"rate": 8},
    "quantized": {"bits": 8},
}


def _mesh(axis_name="data"):
    need_devices(N_DEVICES)
    devices = np.array(jax.devices()[:N_DEVICES])
    if isinstance(axis_name, tuple):  # (outer, inner): 2 "nodes" of 4 devices
        return Mesh(devices.reshape(2, 4), axis_name)
    return Mesh(devices, (axis_name,))


def _mlp_params(seed=0, hidden=32, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w1": (jax.random.normal(k1, (16, hidden)) / 4).astype(dtype),
        "b1": jnp.zeros(hidden, dtype),
        "w2": (jax.random.normal(k2, (hidden, 10)) / 6).astype(dtype),
        "b2": jnp.zeros(10, dtype),
    }


def _mlp_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(seed, size=64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, 16)).astype(np.float32)
    return {"x": x, "y": (x[:, :10].argmax(axis=1)).astype(np.int32)}


def _all_reduces(hlo_text):
    """(element type, element count) of every operand of every all-reduce in compiled HLO text."""
    found = []
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match:
            for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([\d,]*)\]", match.group(1)):
                found.append(
                    (dtype, int(np.prod([int(d) for d in dims.split(",") if d])), line.strip())
                )
    return found


def _replicas_identical(tree):
    for leaf in jax.tree.leaves(tree):
        first = np.asarray(leaf.addressable_shards[0].data)
        for shard in leaf.addressable_shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)


@pytest.mark.parametrize("method", list(METHODS))
def test_compressed_step_has_no_dense_all_reduce_and_replicas_stay_identical(method):
    kwargs = dict(METHODS[method])
    axis_name = kwargs.pop("axis_name", "data")
    mesh = _mesh(axis_name)
    # Without the guardrail: its dense fallback (a branch that runs only after a divergence) would
    # put the dense all-reduce in the compiled step (divergence_test checks it stays out of ENTRY).
    tx = optax.chain(
        compress(method, axis_name=axis_name, guardrail=False, **kwargs), optax.adam(1e-2)
    )
    dp = data_parallel(_mlp_loss, tx, mesh, axis_name=axis_name)
    params = _mlp_params()
    n_params = sum(p.size for p in jax.tree.leaves(params))
    state = dp.init(params)
    batches = [_batch(i % 5) for i in range(50)]
    state, metrics = dp.step(state, batches[0])
    first_loss = float(metrics["loss"])
    with count_compilations() as compilations:
        for batch in batches[1:]:
            state, metrics = dp.step(state, batch)
    assert compilations[0] == 0, "the step recompiled"
    assert int(state.step) == 50
    assert float(metrics["loss"]) < first_loss
    _replicas_identical(state.params)

    hlo = dp.step.lower(state, batches[0]).compile().as_text()
    large = [(dtype, line) for dtype, size, line in _all_reduces(hlo) if size >= 0.1 * n_params]
    if method == "dense":
        assert any(dtype == "f32" for dtype, _ in large), (
            "dense should all-reduce the whole gradient"
        )
    elif method == "quantized":
        # THC sums integer codes of every entry, packed in uint32 words (8 devices x 8-bit codes:
        # 11-bit fields, two to a word), never the float gradient.
        assert large and all(dtype == "u32" for dtype, _ in large), large
    else:
        assert not large, f"{method} all-reduces >= 10% of the {n_params} params:\n" + "\n".join(
            line for _, line in large
        )


def test_dense_equals_full_batch_gradient_descent():
    dp = data_parallel(_mlp_loss, optax.chain(compress("dense"), optax.sgd(0.5)), _mesh())
    params = _mlp_params(dtype=jnp.float32)
    state = dp.init(params)
    for i in range(3):
        batch = _batch(i)
        state, metrics = dp.step(state, batch)
        loss, grads = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_residual_layout(error_feedback):
    tx = optax.chain(
        compress("allgather_topk", ratio=0.05, error_feedback=error_feedback), optax.sgd(0.1)
    )
    dp = data_parallel(_mlp_loss, tx, _mesh())
    state = dp.init(_mlp_params())
    state, _ = dp.step(state, _batch(0))
    residual = state.opt_state[0].residual
    if error_feedback:
        # One residual per device, stacked over the data axis, and they differ between devices.
        assert residual["w1"].shape == (N_DEVICES, 16, 32)
        assert residual["w1"].sharding.spec == jax.sharding.PartitionSpec("data")
        assert not np.array_equal(np.asarray(residual["w1"][0]), np.asarray(residual["w1"][1]))
    else:
        # Nothing is fed back, so nothing is stored: no memory and no pass over the gradient.
        assert isinstance(residual["w1"], optax.MaskedNode)


@pytest.mark.parametrize(
    "options",
    [
        {"method": "ar_topk", "ratio": 0.05},
        # "auto" mid-exploration: the controller's state must resume too.
        {
            "method": "auto",
            "adaptive_ratio": True,
            "explore_steps": 2,
            "network": Network.parse("1ms", "1gbit"),
        },
    ],
    ids=["ar_topk", "auto"],
)
def test_checkpoint_round_trip_resumes_bit_identically(tmp_path, options):
    tx = optax.chain(compress(**options), optax.adam(1e-2))
    dp = data_parallel(_mlp_loss, tx, _mesh())
    state = dp.init(_mlp_params())
    for i in range(3):
        state, _ = dp.step(state, _batch(i))
    assert_checkpoint_resumes(dp, state, [_batch(i) for i in range(3, 6)], tmp_path / "ckpt")


def test_flax_nnx_model_with_aux():
    model = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 10, rngs=nnx.Rngs(1))
    )
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}

    tx = optax.chain(compress("ar_topk", ratio=0.05), optax.adam(1e-2))
    dp = data_parallel(loss_fn, tx, _mesh(), has_aux=True)
    state = dp.init(params)
    losses = []
    for i in range(10):
        state, metrics = dp.step(state, _batch(i % 2))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert 0.0 <= float(metrics["aux"]["accuracy"]) <= 1.0
    _replicas_identical(state.params)
    nnx.update(model, state.params)  # the trained params go back into the model
    logits = model(jnp.asarray(_batch(0)["x"]))
    assert logits.shape == (64, 10)


def test_flax_linen_model():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))

    model = MLP()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    dp = data_parallel(
        loss_fn, optax.chain(compress("allgather_topk", ratio=0.05), optax.adam(1e-2)), _mesh()
    )
    state = dp.init(params)
    first = None
    for i in range(10):
        state, metrics = dp.step(state, _batch(i % 2))
        first = float(metrics["loss"]) if first is None else first
    assert float(metrics["loss"]) < first
    _replicas_identical(state.params)


def test_bad_arguments_are_named():
    mesh = _mesh()
    tx = optax.chain(compress("dense"), optax.sgd(0.1))
    with pytest.raises(ValueError, match="axis_name 'batch' is not an axis"):
        data_parallel(_mlp_loss, tx, mesh, axis_name="batch")
    with pytest.raises(TypeError, match="loss_fn"):
        data_parallel(None, tx, mesh)
    with pytest.raises(TypeError, match="tx"):
        data_parallel(_mlp_loss, "adam", mesh)
    dp = data_parallel(_mlp_loss, tx, mesh)
    state = dp.init(_mlp_params())
    with pytest.raises(ValueError, match="divisible"):
        dp.step(state, _batch(0, size=12))
    # An aggregation whose total differs per device: each device would apply its own update.
    zfp = compress("zfp", rate=8, algorithm="recursive_doubling")
    with pytest.raises(ValueError, match="must aggregate"):
        data_parallel(_mlp_loss, optax.chain(zfp, optax.sgd(0.1)), mesh).init(_mlp_params())


def test_explicit_mesh_from_make_mesh_trains_like_an_auto_mesh():
    need_devices(N_DEVICES)
    explicit = jax.make_mesh((N_DEVICES,), ("data",), devices=jax.devices()[:N_DEVICES])
    results = []
    for mesh in (explicit, _mesh()):
        dp = data_parallel(
            _mlp_loss, optax.chain(compress("ar_topk", ratio=0.05), optax.sgd(0.1)), mesh
        )
        state = dp.init(_mlp_params())
        for i in range(2):
            state, _ = dp.step(state, _batch(i))
        results.append(state.params)
    assert_trees_equal(*results)


# Every method at a setting that trains a small MLP in a few steps.
EVERY_METHOD = [
    ("dense", {}),
    ("allgather_topk", {"ratio": 0.1}),
    ("ar_topk", {"ratio": 0.1}),
    ("ar_topk_star", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.1}),
    ("sign", {}),
    ("sign_ring", {}),
    ("bf16", {}),
    ("fp16", {}),
    ("powersgd", {"rank": 2}),
    ("powersgd_fp16", {"rank": 2}),
    ("zfp", {"rate": 8}),
    ("quantized", {"bits": 4}),
]


# 1 device (a user's first try) and 3 (a ring that does not split) run always; 2 and 8 with -m slow.
@pytest.mark.parametrize(
    "n_devices",
    [1, pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(8, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("method, options", EVERY_METHOD, ids=[m for m, _ in EVERY_METHOD])
def test_every_method_trains_on_1_2_3_and_8_devices(method, options, n_devices):
    """A 1-device mesh is the first thing users try: ZFP and THC used to fail there ("tx returns
    updates that differ per device"), their one-device total not typed replicated."""
    need_devices(n_devices)
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.1, jnp.float32),
        "b": jnp.zeros(32),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.1, jnp.float32),
    }
    x = rng.standard_normal((24, 16)).astype(np.float32)

    def loss_fn(p, batch):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"] + p["b"]) @ p["w2"] - batch["y"]) ** 2)

    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    dp = data_parallel(loss_fn, optax.chain(compress(method, **options), optax.adam(3e-2)), mesh)
    state, batch = dp.init(params), dp.shard_batch({"x": x, "y": x[:, :4] * 0.5})
    losses = []
    for _ in range(20):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], (method, n_devices, losses)


def test_a_step_of_many_leaves_says_its_compile_can_take_minutes(monkeypatch, caplog):
    """XLA compiles each leaf's work as loops of its own (30-40 s for 4,000 small leaves on 2
    cores): the trace says so once, above ``MANY_LEAVES`` and not below."""
    import logging

    from jaxcomp.training import _telling as telling

    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    dp = data_parallel(
        lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2),
        optax.chain(compress("dense"), optax.adam(0.1)),
        mesh,
    )
    state = dp.init(params)
    batch = dp.shard_batch(jnp.ones((2, 4)))
    n_leaves = len(jax.tree.leaves(state))
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        dp.step.trace(state, batch)
        assert "compiling a step" not in caplog.text  # well below the default
        monkeypatch.setattr(telling, "MANY_LEAVES", n_leaves)
        jax.clear_caches()
        dp.step.trace(state, batch)
    assert f"compiling a step whose state has {n_leaves} leaves" in caplog.text
    assert "docs/performance.md" in caplog.text


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_a_plain_optax_optimizer_trains_as_after_a_dense_compress(shard):
    """What a user tries first: data_parallel(loss, optax.adam(lr), mesh) averages the
    gradients densely, bit for bit as optax.chain(compress("dense"), optax.adam(lr))."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    loss = lambda w, b: jnp.mean((b - w) ** 2)  # noqa: E731
    batch = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100
    plain = data_parallel(loss, optax.adam(0.1), mesh, shard=shard)
    dense = optax.chain(compress("dense"), optax.adam(0.1))
    chained = data_parallel(loss, dense, mesh, shard=shard)
    a, b = plain.init(jnp.zeros(16)), chained.init(jnp.zeros(16))
    for _ in range(3):
        a, metrics = plain.step(a, batch)
        b, _ = chained.step(b, batch)
    np.testing.assert_array_equal(plain.params(a), chained.params(b))
    assert float(metrics["bytes_sent"]) > 0
