"""A model's own state beside its params (``has_state=True``): what init and the step refuse, how
it is averaged, sharded runs, skipped steps, and checkpoints with and without it (orbax, the
layout saved before ``TrainState`` had ``model_state`` included)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.training import checkpoint, model_state

N = 8
ROWS = 16


def _loss(params, state, batch):
    """A linear model that keeps the running mean of its inputs (momentum 0.5) and a step
    counter (an integer, the same on every device)."""
    loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    mean = 0.5 * state["mean"] + 0.5 * batch["x"].mean(axis=0)
    return loss, {"mean": mean, "seen": state["seen"] + 1}


PARAMS = {"w": jnp.zeros(3)}
STATE = {"mean": jnp.zeros(3), "seen": jnp.int32(0)}
TX = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}


def _mesh(n=N, axis="data"):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), (axis,))


def _dp(n=N, loss=_loss, **options):
    return jaxcomp.data_parallel(loss, TX, _mesh(n), has_state=True, **options)


def _shard_means(batch, n, mean=0.0):
    """Each device's new running mean, by hand: one block of rows each."""
    blocks = np.split(batch["x"], n)
    return [0.5 * np.asarray(mean) + 0.5 * b.mean(axis=0) for b in blocks]


def test_the_state_is_averaged_and_its_integers_kept():
    dp = _dp()
    state = dp.init(PARAMS, STATE)
    assert state.model_state["mean"].sharding.spec == jax.sharding.PartitionSpec()
    state, _ = dp.step(state, _batch())
    np.testing.assert_allclose(
        state.model_state["mean"], np.mean(_shard_means(_batch(), N), axis=0), rtol=1e-6
    )
    assert int(state.model_state["seen"]) == 1
    state, _ = dp.step(state, _batch(1))
    assert int(state.model_state["seen"]) == 2


def test_init_refuses_a_missing_or_an_unexpected_model_state():
    with pytest.raises(ValueError, match=r"has_state=True: pass .*init\(params, model_state"):
        _dp().init(PARAMS)
    plain = jaxcomp.data_parallel(lambda w, b: jnp.sum(w["w"]), TX, _mesh())
    with pytest.raises(ValueError, match="has_state=False"):
        plain.init(PARAMS, STATE)
    with pytest.raises(TypeError, match=r"model_state\['mean'\] is a str"):
        _dp().init(PARAMS, {"mean": "zeros"})
    with pytest.raises(TypeError, match="has_state must be True or False"):
        jaxcomp.data_parallel(_loss, TX, _mesh(), has_state=1)
    run = jaxcomp.diloco(_loss, mesh=_mesh(axis="workers"), has_state=True)
    with pytest.raises(ValueError, match="has_state=True"):
        run.init(PARAMS)
    with pytest.raises(ValueError, match="has_state=True"):  # a state without one
        _dp().step(plain.init(PARAMS), _batch())


@pytest.mark.parametrize(
    "loss, message",
    [
        (lambda p, s, b: _loss(p, s, b)[0], r"loss_fn\(.*\(loss, new_model_state\).*an array"),
        (lambda p, s, b: (_loss(p, s, b)[0], {"mean": s["mean"]}), "structure"),
        (
            lambda p, s, b: (_loss(p, s, b)[0], {**s, "mean": jnp.zeros(4)}),
            r"new_model_state\['mean'\] is float32\[4\], model_state's float32\[3\]",
        ),
        (
            lambda p, s, b: (_loss(p, s, b)[0], {**s, "seen": s["seen"] + 0.5}),
            r"new_model_state\['seen'\] is float32\[\], model_state's int32\[\]",
        ),
    ],
)
def test_a_loss_of_the_wrong_shape_is_named_before_it_runs(loss, message):
    dp = _dp(loss=loss)
    with pytest.raises(ValueError, match=message):
        dp.step.lower(dp.init(PARAMS, STATE), _batch())


def test_has_aux_returns_loss_aux_and_state():
    def loss(params, state, batch):
        value, new = _loss(params, state, batch)
        return (value, {"double": 2 * value}), new

    dp = _dp(loss=loss, has_aux=True)
    state, metrics = dp.step(dp.init(PARAMS, STATE), _batch())
    np.testing.assert_allclose(metrics["aux"]["double"], 2 * metrics["loss"], rtol=1e-6)
    assert int(state.model_state["seen"]) == 1
    with pytest.raises(ValueError, match=r"\(\(loss, aux\), new_model_state\)"):
        _dp(has_aux=True).step.lower(dp.init(PARAMS, STATE), _batch())


def test_an_integer_that_differs_per_device_is_refused():
    def loss(params, state, batch):
        value, new = _loss(params, state, batch)
        return value, {**new, "seen": state["seen"] + (batch["x"][0, 0] > 0).astype(jnp.int32)}

    dp = _dp(loss=loss)
    with pytest.raises(ValueError, match=r"new_model_state\['seen'\] has dtype int32"):
        dp.step.lower(dp.init(PARAMS, STATE), _batch())


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_sharded_runs_keep_the_same_state(shard):
    plain, sharded = _dp(), _dp(shard=shard)
    a, b = plain.init(PARAMS, STATE), sharded.init(PARAMS, STATE)
    for seed in range(3):
        a, _ = plain.step(a, _batch(seed))
        b, _ = sharded.step(b, _batch(seed))
    np.testing.assert_allclose(a.model_state["mean"], b.model_state["mean"], rtol=1e-6)
    assert int(b.model_state["seen"]) == 3


def test_a_skipped_step_keeps_the_state():
    tx = optax.chain(jaxcomp.compress("dense", nonfinite="skip"), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(), has_state=True)
    state, _ = dp.step(dp.init(PARAMS, STATE), _batch())
    bad = _batch(1)
    bad["y"][0] = np.nan  # a non-finite gradient on one device: the step is skipped
    skipped, _ = dp.step(state, bad)
    assert_trees_equal(skipped.model_state, state.model_state)
    assert_trees_equal(skipped.params, state.params)


def test_averaged_keeps_a_mean_that_is_not_finite_at_its_old_value():
    mesh = _mesh(2)

    def step(x, old):
        return model_state.averaged({"m": x}, "data", {"m": old})["m"]

    P = jax.sharding.PartitionSpec
    f = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    got = f(jnp.array([[1.0, np.inf], [3.0, 0.0]]), jnp.array([[-1.0, 7.0]]))
    np.testing.assert_array_equal(got, [[2.0, 7.0]])


# -- checkpoints -------------------------------------------------------------------------------


def _save(path, state):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()


def test_a_checkpoint_with_model_state_round_trips(tmp_path):
    """Saved with orbax, restored by dp.restore (on this count and on 4 devices): the same
    state, and the next steps from it are bit for bit those of the state itself."""
    dp = _dp()
    state, _ = dp.step(dp.init(PARAMS, STATE), _batch())
    _save(tmp_path / "ckpt", state)
    restored = dp.restore(tmp_path / "ckpt", PARAMS, model_state=STATE)
    assert_trees_equal(restored, state)
    saved = state
    for seed in (1, 2):
        state, _ = dp.step(state, _batch(seed))
        restored, _ = dp.step(restored, _batch(seed))
    assert_trees_equal(restored, state)
    four = _dp(4)
    moved = four.restore(tmp_path / "ckpt", PARAMS, model_state=STATE)
    assert moved.opt_state[0].residual["w"].shape == (4, 3)
    assert_trees_equal(moved.model_state, saved.model_state)
    assert_trees_equal(moved, four.resize(saved))


def test_resize_carries_the_model_state():
    eight, four = _dp(), _dp(4)
    state, _ = eight.step(eight.init(PARAMS, STATE), _batch())
    resized = four.resize(state)
    assert_trees_equal(resized.model_state, state.model_state)
    assert resized.model_state["mean"].sharding.mesh.devices.size == 4
    four.step(resized, _batch(1))  # it runs on the new mesh


def test_restore_refuses_a_checkpoint_of_the_other_has_state(tmp_path):
    plain = jaxcomp.data_parallel(lambda w, b: jnp.sum(w["w"] * b["x"]), TX, _mesh())
    _save(tmp_path / "plain", plain.init(PARAMS))
    with pytest.raises(ValueError, match="holds no model_state"):
        _dp().restore(tmp_path / "plain", PARAMS, model_state=STATE)
    _save(tmp_path / "stateful", _dp().init(PARAMS, STATE))
    with pytest.raises(ValueError, match="holds a model_state"):
        plain.restore(tmp_path / "stateful", PARAMS)
    with pytest.raises(ValueError, match=r"state_shapes\(params, model_state"):
        _dp().state_shapes(PARAMS)


class _TrainStateBefore(NamedTuple):
    """``TrainState`` as it was before the ``model_state`` field."""

    params: Any
    opt_state: Any
    step: jax.Array


@pytest.mark.parametrize("n_saved", [N, 4])
def test_a_checkpoint_saved_before_model_state_restores(tmp_path, n_saved):
    """A checkpoint of the layout before ``model_state`` existed (no such key at all) restores
    into a run with has_state=False, on the same and on another device count."""
    loss = lambda w, b: jnp.mean((b["x"] @ w["w"] - b["y"]) ** 2)  # noqa: E731
    saved_on = jaxcomp.data_parallel(loss, TX, _mesh(n_saved))
    state, _ = saved_on.step(saved_on.init(PARAMS), _batch())
    _save(tmp_path / "before", _TrainStateBefore(state.params, state.opt_state, state.step))
    metadata = ocp.StandardCheckpointer().metadata(tmp_path / "before")
    assert "model_state" not in metadata.item_metadata.tree
    dp = jaxcomp.data_parallel(loss, TX, _mesh())
    restored = dp.restore(tmp_path / "before", PARAMS)
    assert restored.model_state is None
    assert_trees_equal(restored.params, state.params)
    assert int(restored.step) == 1
    if n_saved == N:
        assert_trees_equal(restored, state)
    dp.step(restored, _batch(1))


def test_check_model_state_names_the_saved_has_state():
    target = jaxcomp.TrainState(0, 0, 0, {"m": jax.ShapeDtypeStruct((3,), jnp.float32)})
    with pytest.raises(ValueError, match="holds no model_state"):
        checkpoint.check_model_state("ckpt", {"params": {}}, target)
    checkpoint.check_model_state("ckpt", {"model_state": {"m": object()}}, target)


# -- diloco ----------------------------------------------------------------------------------


def _diloco(**options):
    return jaxcomp.diloco(
        _loss, optax.sgd(0.1), mesh=_mesh(axis="workers"), sync_every=2, has_state=True, **options
    )


def test_diloco_keeps_each_workers_state_and_averages_it_at_a_sync(tmp_path):
    run = _diloco()
    state = run.init(PARAMS, STATE)
    assert state.model_state["mean"].shape == (N, 3)
    state, metrics = run.step(state, _batch())
    own = np.stack(_shard_means(_batch(), N))
    assert not bool(metrics["synced"])
    np.testing.assert_allclose(state.model_state["mean"], own, rtol=1e-6)
    np.testing.assert_array_equal(state.model_state["seen"], np.ones(N))
    state, metrics = run.step(state, _batch(1))
    assert bool(metrics["synced"])
    second = [0.5 * o + 0.5 * b.mean(axis=0) for o, b in zip(own, np.split(_batch(1)["x"], N))]
    want = np.broadcast_to(np.mean(second, axis=0), (N, 3))
    np.testing.assert_allclose(state.model_state["mean"], want, rtol=1e-6)
    assert np.ptp(np.asarray(state.model_state["mean"]), axis=0).max() == 0
    _save(tmp_path / "ckpt", state)
    assert_trees_equal(run.restore(tmp_path / "ckpt", PARAMS, model_state=STATE), state)


class _DiLoCoStateBefore(NamedTuple):
    global_params: Any
    local_params: Any
    inner_state: Any
    outer_state: tuple
    compress_state: tuple
    pending: tuple
    step: jax.Array


def test_a_diloco_checkpoint_saved_before_model_state_restores(tmp_path):
    loss = lambda w, b: jnp.mean((b["x"] @ w["w"] - b["y"]) ** 2)  # noqa: E731
    run = jaxcomp.diloco(loss, optax.sgd(0.1), mesh=_mesh(axis="workers"), sync_every=2)
    state, _ = run.step(run.init(PARAMS), _batch())
    _save(tmp_path / "before", _DiLoCoStateBefore(*state[:7]))
    restored = run.restore(tmp_path / "before", PARAMS)
    assert restored.model_state is None
    assert_trees_equal(restored, state)
    with pytest.raises(ValueError, match="holds no model_state"):
        _diloco().restore(tmp_path / "before", PARAMS, model_state=STATE)
