"""Model compatibility: flax models of every common family train through ``data_parallel`` and
``diloco`` with no change to the model, as any module trains under PyTorch DDP.

Each model is written for one device: its loss never names a mesh axis except where the family
needs one (synchronized BatchNorm, through flax's own ``axis_name``). The RNN's carry starts as
``jnp.zeros`` (flax ``nn.RNN``), which ``shard_map``'s varying-type check refused before
``training/gradients.py``. The compressed step keeps no dense all-reduce of the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import need_devices
from jax.sharding import Mesh
from train_test import _all_reduces

import jaxcomp

N = 8
ROWS = 32  # the global batch: 4 rows a device
STEPS = 12


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(4)(nn.gelu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


class _Cnn(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


class _Gru(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.RNN(nn.GRUCell(16))(x.reshape(x.shape[0], 8, -1))  # carry: jnp.zeros
        return nn.Dense(4)(h[:, -1])


class _Lstm(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.RNN(nn.OptimizedLSTMCell(16))(x.reshape(x.shape[0], 8, -1))
        return nn.Dense(4)(h[:, -1])


class _Transformer(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16)(x.reshape(x.shape[0], 8, -1))
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, deterministic=True)(nn.LayerNorm()(x))
        x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
        return nn.Dense(4)(x.mean(axis=1))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(16)(nn.tanh(x)), None


class _Scanned(nn.Module):
    """Four blocks stacked with ``nn.scan`` (their params stacked on a leading axis)."""

    @nn.compact
    def __call__(self, x, train=True):
        blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        x, _ = blocks()(nn.Dense(16)(x.reshape(x.shape[0], -1)), None)
        return nn.Dense(4)(x)


class _Dropout(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(nn.Dropout(0.2, deterministic=not train)(x))


class _BatchNorm(nn.Module):
    """Train-mode BatchNorm; ``axis_name`` averages its batch statistics over the devices."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(32)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        return nn.Dense(4)(nn.relu(x))


LINEN = {
    "mlp": _Mlp,
    "cnn": _Cnn,
    "gru": _Gru,
    "lstm": _Lstm,
    "transformer": _Transformer,
    "scan": _Scanned,
    "dropout": _Dropout,
    "batchnorm": _BatchNorm,
}


def _batch(seed=0):
    """Images 8x8x2 whose label is the quadrant with the most mass; per-row dropout keys."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 8, 8, 2)).astype(np.float32)
    quadrants = x.reshape(ROWS, 2, 4, 2, 4, 2).sum(axis=(2, 4, 5)).reshape(ROWS, 4)
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), ROWS))
    return {"x": x, "y": quadrants.argmax(axis=1).astype(np.int32), "key": np.asarray(keys)}


def _linen(name, axis_name):
    """``(params, loss_fn)`` of a linen model, its loss written for one device."""
    module = LINEN[name](axis_name) if name == "batchnorm" else LINEN[name]()
    variables = module.init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, jnp.zeros((2, 8, 8, 2))
    )
    others = {k: v for k, v in variables.items() if k != "params"}

    def loss_fn(params, batch):
        rngs = {"dropout": jax.random.wrap_key_data(batch["key"][0])}  # a key per device shard
        logits, _ = module.apply(
            {"params": params, **others}, batch["x"], rngs=rngs, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return variables["params"], loss_fn


class _NnxAttention(nnx.Module):
    """Rows of the image as tokens: self-attention, a layer norm, a linear head."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(16, 32, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=4, in_features=32, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        tokens = self.embed(x.reshape(x.shape[0], 8, 16))
        tokens = self.norm(tokens + self.attention(tokens))
        return self.head(tokens.mean(axis=1))


NNX = {
    "nnx-mlp": lambda: nnx.Sequential(
        lambda x: x.reshape(x.shape[0], -1),
        nnx.Linear(128, 32, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(32, 4, rngs=nnx.Rngs(1)),
    ),
    "nnx-cnn": lambda: nnx.Sequential(
        nnx.Conv(2, 8, (3, 3), rngs=nnx.Rngs(0)),
        nnx.relu,
        lambda x: x.reshape(x.shape[0], -1),
        nnx.Linear(8 * 8 * 8, 4, rngs=nnx.Rngs(1)),
    ),
    "nnx-attention": lambda: _NnxAttention(nnx.Rngs(0)),
}


def _nnx(name):
    """``(params, loss_fn)`` of an nnx model: ``nnx.split`` and ``nnx.merge`` around the loss."""
    graphdef, params = nnx.split(NNX[name](), nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return params, loss_fn


def _model(name, axis_name="data"):
    return _nnx(name) if name in NNX else _linen(name, axis_name)


MODELS = list(LINEN) + list(NNX)


def _mesh(axis_name):
    need_devices(N)
    return Mesh(np.array(jax.devices()[:N]), (axis_name,))


@pytest.mark.parametrize("name", MODELS)
def test_trains_through_data_parallel_unchanged(name):
    """A compressed step (sign through Adam, no guardrail branch to hide a dense all-reduce) on
    one batch: the loss falls, and no all-reduce carries 10% of the gradient."""
    params, loss_fn = _model(name)
    tx = optax.chain(jaxcomp.compress("sign", guardrail=False), optax.adam(3e-3))
    dp = jaxcomp.data_parallel(loss_fn, tx, _mesh("data"))
    state, batch, losses = dp.init(params), _batch(), []
    for _ in range(STEPS):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    n_params = sum(p.size for p in jax.tree.leaves(params))
    hlo = dp.step.lower(state, batch).compile().as_text()
    large = [line for _, size, line in _all_reduces(hlo) if size >= 0.1 * n_params]
    assert not large, "\n".join(large)


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("mlp", "gru", "nnx-mlp") else pytest.param(n, marks=pytest.mark.slow)
        for n in MODELS
    ],
)
def test_trains_through_diloco_unchanged(name):
    """Eight workers, a sync every 4 inner steps: the global params' loss falls. BatchNorm
    keeps each worker's statistics its own (no axis), as DiLoCo's workers train alone."""
    params, loss_fn = _model(name, axis_name=None)
    run = jaxcomp.diloco(loss_fn, optax.adam(3e-3), mesh=_mesh("workers"), sync_every=4)
    state, batch = run.init(params), _batch()
    before = float(jax.jit(loss_fn)(params, jax.tree.map(lambda a: a[:4], batch)))
    for _ in range(STEPS):
        state, metrics = run.step(state, batch)
    after = float(jax.jit(loss_fn)(run.params(state), jax.tree.map(lambda a: a[:4], batch)))
    assert np.isfinite(float(metrics["loss"])) and after < before, (before, after)


# -- BatchNorm's running averages kept: has_state=True ---------------------------------------


def _stateful_batchnorm(axis_name=None):
    """``(params, batch_stats, loss_fn, new_stats)`` of the BatchNorm model with ``has_state``:
    the loss reads the running averages and returns the ones ``apply`` updated; ``new_stats``
    is the same forward pass alone, jitted, for the references."""
    module = _BatchNorm(axis_name)
    variables = module.init(jax.random.key(0), jnp.zeros((2, 8, 8, 2)))

    def forward(params, batch_stats, batch):
        logits, updated = module.apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, updated["batch_stats"]

    new_stats = jax.jit(lambda p, s, b: forward(p, s, b)[1])
    return variables["params"], variables["batch_stats"], forward, new_stats


def _rows(batch, block, n_blocks):
    """Block ``block`` of ``n_blocks`` of the batch's rows: what one device trains on."""
    size = ROWS // n_blocks
    return jax.tree.map(lambda a: a[block * size : (block + 1) * size], batch)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _same_on_every_device(tree):
    """Every device's copy of each replicated leaf, checked bit for bit against the first."""
    for leaf in jax.tree.leaves(tree):
        first = np.asarray(leaf.addressable_shards[0].data)
        assert len(leaf.addressable_shards) == N
        for shard in leaf.addressable_shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)


@pytest.mark.parametrize("flax_axis", [None, "data"])
def test_batchnorm_running_averages_through_data_parallel(flax_axis):
    """has_state=True: each step's running averages are the mean of what each device computed
    from its own shard (by hand, from the state before the step), identical on every device, and
    they move away from their initial values while the loss falls. With flax's own ``axis_name``
    the devices' statistics already agree, and stay as flax computed them."""
    params, stats, loss_fn, new_stats = _stateful_batchnorm(flax_axis)
    tx = optax.chain(jaxcomp.compress("sign", guardrail=False), optax.adam(3e-3))
    dp = jaxcomp.data_parallel(loss_fn, tx, _mesh("data"), has_state=True)
    state, batch, losses = dp.init(params, stats), _batch(), []
    for _ in range(STEPS):
        if flax_axis is None:  # a BatchNorm without an axis name needs no mesh for its reference
            own = [new_stats(state.params, state.model_state, _rows(batch, d, N)) for d in range(N)]
            want = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *_host(own))
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
        _same_on_every_device(state.model_state)
        if flax_axis is None:
            jax.tree.map(
                lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6),
                _host(state.model_state),
                want,
            )
    assert losses[-1] < losses[0], losses
    for moved, initial in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(stats)):
        assert np.all(np.isfinite(np.asarray(moved)))
        assert np.abs(np.asarray(moved) - np.asarray(initial)).max() > 1e-3


def test_batchnorm_statistics_cross_in_one_joined_all_reduce():
    """The running mean and variance (32 values each) cross the devices as one vector of 64 in
    one all-reduce, not one per leaf, and no all-reduce carries them apart."""
    params, stats, loss_fn, _ = _stateful_batchnorm()
    tx = optax.chain(jaxcomp.compress("sign", guardrail=False), optax.adam(3e-3))
    dp = jaxcomp.data_parallel(loss_fn, tx, _mesh("data"), has_state=True)
    hlo = dp.step.lower(dp.init(params, stats), _batch()).compile().as_text()
    sizes = [size for dtype, size, _ in _all_reduces(hlo) if dtype == "f32"]
    assert sizes.count(64) == 1 and 32 not in sizes, sizes


@pytest.mark.parametrize("inner", [None, 2])
def test_batchnorm_running_averages_through_diloco(inner):
    """has_state=True through diloco: between syncs each worker's running averages are its own
    (over an inner axis, the mean of its devices' blocks), and at each sync every worker holds
    the workers' mean; each checked by hand from the state before the step."""
    params, stats, loss_fn, new_stats = _stateful_batchnorm()
    need_devices(N)
    workers = N // (inner or 1)
    devices = np.array(jax.devices()[:N]).reshape((workers, inner) if inner else (N,))
    mesh = Mesh(devices, ("workers", "inner") if inner else ("workers",))
    run = jaxcomp.diloco(
        loss_fn,
        optax.adam(3e-3),
        mesh=mesh,
        sync_every=4,
        inner_axis="inner" if inner else None,
        has_state=True,
    )
    state, batch = run.init(params, stats), _batch()
    for _ in range(STEPS):
        local, model_state = _host(state.local_params), _host(state.model_state)
        own = []
        for w in range(workers):
            row = lambda tree, w=w: jax.tree.map(lambda a: a[w], tree)  # noqa: E731
            blocks = [
                new_stats(row(local), row(model_state), _rows(batch, w * (inner or 1) + i, N))
                for i in range(inner or 1)
            ]
            own.append(jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *_host(blocks)))
        state, metrics = run.step(state, batch)
        if bool(metrics["synced"]):
            mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *own)
            own = [mean] * workers
        want = jax.tree.map(lambda *xs: np.stack(xs), *own)
        jax.tree.map(
            lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6),
            _host(state.model_state),
            want,
        )
        got = jax.tree.leaves(_host(state.model_state))
        spread = max(float(np.ptp(leaf, axis=0).max()) for leaf in got)
        assert (spread == 0) == bool(metrics["synced"]), spread  # bit for bit after a sync
    for moved, initial in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(stats)):
        assert np.abs(np.asarray(moved)[0] - np.asarray(initial)).max() > 1e-3
