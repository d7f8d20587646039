"""jaxcomp.diloco against a single-process reference that loops over the workers explicitly.

The reference (:func:`reference_diloco`) is plain optax on unsharded arrays: each worker's inner
steps on its block of the batch, the averaged pseudo-gradient, the outer step, the restart (or,
delayed, Streaming DiLoCo's mix). The compiled run must match it to float tolerance with dense
exchanges; compressed exchanges are checked by error-feedback conservation.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EntryGraph, assert_trees_equal, count_compilations, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp

ROWS = 24  # divisible by 1, 2, 3, 4 and 8 workers (and by the 8 devices of a 4x2 mesh)


def _loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"] + params["c"] * batch["x"][:, :1]
    return jnp.mean((pred - batch["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
        "b": jnp.zeros(2, jnp.float32),
        "c": jnp.full((1,), 0.5, jnp.float32),
    }


def _batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": jnp.asarray(rng.normal(size=(ROWS, 3)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(ROWS, 2)), jnp.float32),
        }
        for _ in range(steps)
    ]


def _mesh(workers, inner=None):
    need_devices(workers * (inner or 1))
    devices = np.array(jax.devices()[: workers * (inner or 1)])
    if inner is None:
        return Mesh(devices, ("workers",))
    return Mesh(devices.reshape(workers, inner), ("workers", "data"))


def reference_diloco(
    inner_tx, outer_tx, params, batches, workers, sync_every, fragments=1, delay=0, mixing=0.5,
    inner=1,
):  # fmt: skip
    """DiLoCo in one process, worker by worker; returns (global params, [worker params])."""
    leaves, treedef = jax.tree.flatten(params)
    global_leaves = list(leaves)
    local = [list(leaves) for _ in range(workers)]
    inner_states = [inner_tx.init(params) for _ in range(workers)]
    groups = [list(range(f, len(leaves), fragments)) for f in range(fragments)]
    outer_states = [outer_tx.init([leaves[i] for i in g]) for g in groups]
    pending = [None] * fragments
    for t, batch in enumerate(batches):
        for w in range(workers):
            w_params = treedef.unflatten(local[w])
            block = jax.tree.map(lambda x: np.split(np.asarray(x), workers)[w], batch)
            parts = [jax.tree.map(lambda x: np.split(x, inner)[i], block) for i in range(inner)]
            grads = [jax.grad(_loss)(w_params, part) for part in parts]
            grads = jax.tree.map(lambda *g: sum(g) / inner, *grads)
            updates, inner_states[w] = inner_tx.update(grads, inner_states[w], w_params)
            local[w] = jax.tree.leaves(optax.apply_updates(w_params, updates))
        count = t + 1
        for f, group in enumerate(groups):
            first = (f + 1) * sync_every // fragments
            if count >= first and (count - first) % sync_every == 0:
                pending[f] = [
                    sum(global_leaves[i] - local[w][i] for w in range(workers)) / workers
                    for i in group
                ]
            if count >= first + delay and (count - first - delay) % sync_every == 0:
                old = [global_leaves[i] for i in group]
                updates, outer_states[f] = outer_tx.update(pending[f], outer_states[f], old)
                for i, new in zip(group, optax.apply_updates(old, updates)):
                    global_leaves[i] = new
                    for w in range(workers):
                        keep = mixing * local[w][i] if delay else 0.0
                        local[w][i] = keep + (1 - mixing if delay else 1.0) * new
    return treedef.unflatten(global_leaves), [treedef.unflatten(lo) for lo in local]


def _run(run, batches, state=None):
    state = run.init(_params()) if state is None else state
    metrics = []
    for batch in batches:
        state, m = run.step(state, batch)
        metrics.append(m)
    return state, metrics


def _assert_matches(state, reference, rtol=2e-5, atol=2e-6):
    global_params, local = reference
    np.testing.assert_allclose(
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.global_params)]),
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(global_params)]),
        rtol=rtol,
        atol=atol,
    )
    for w, worker in enumerate(local):
        for got, want in zip(jax.tree.leaves(state.local_params), jax.tree.leaves(worker)):
            np.testing.assert_allclose(np.asarray(got)[w], want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_matches_reference_with_paper_defaults(workers):
    """Default inner AdamW (a larger lr) and outer Nesterov, dense exchange, H = 3, 7 steps:
    the compiled run is the reference; one compilation; bytes only on sync steps."""
    inner_tx = optax.adamw(0.05, weight_decay=0.1)
    run = jaxcomp.diloco(_loss, inner_tx, mesh=_mesh(workers), sync_every=3)
    batches = _batches(7)
    state, metrics = _run(run, batches[:1])
    with count_compilations() as compiled:
        state, more = _run(run, batches[1:], state)
    assert compiled[0] == 0
    metrics += more
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    _assert_matches(state, reference_diloco(inner_tx, outer_tx, _params(), batches, workers, 3))
    assert [bool(m["synced"]) for m in metrics] == [t % 3 == 2 for t in range(7)]
    sent = [float(m["bytes_sent"]) for m in metrics]
    assert all(b == 0 for b, m in zip(sent, metrics) if not m["synced"])
    assert all(b > 0 for b, m in zip(sent, metrics) if m["synced"]) or workers == 1
    assert state.local_params["w"].shape == (workers, 3, 2)
    assert workers == 1 or state.local_params["w"].sharding.spec == P("workers")
    np.testing.assert_array_equal(run.params(state)["w"], state.global_params["w"])


def test_sync_every_step_is_data_parallel():
    """H = 1, dense, outer SGD lr 1 without momentum: the average of the workers' SGD-momentum
    steps is data-parallel SGD momentum on the averaged gradient (the updates are linear)."""
    mesh = _mesh(8)
    inner_tx = optax.sgd(0.1, momentum=0.9)
    run = jaxcomp.diloco(_loss, inner_tx, optax.sgd(1.0), mesh=mesh, sync_every=1)
    dp = jaxcomp.data_parallel(
        _loss, optax.chain(jaxcomp.compress("dense", axis_name="workers"), inner_tx), mesh,
        "workers",
    )  # fmt: skip
    batches = _batches(5)
    state, metrics = _run(run, batches)
    dp_state = dp.init(_params())
    for batch in batches:
        dp_state, dp_metrics = dp.step(dp_state, batch)
    for got, want in zip(jax.tree.leaves(run.params(state)), jax.tree.leaves(dp_state.params)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert all(bool(m["synced"]) for m in metrics)


def _syncs(run, batches):
    """``(state before, state after, batch)`` of every second step of ``run`` (H = 2): the
    syncs, each checked to have sent bytes."""
    state = run.init(_params())
    for t, batch in enumerate(batches):
        before = state
        state, metrics = run.step(state, batch)
        if t % 2:
            assert bool(metrics["synced"]) and float(metrics["bytes_sent"]) > 0
            yield before, state, batch


def _sgd_pseudo_gradients(before, batch, name, workers, lr):
    """Each worker's pseudo-gradient of leaf ``name`` after one inner SGD step from ``before``,
    by hand (global minus the worker's params after the step on its block of ``batch``)."""
    deltas = []
    for w in range(workers):
        w_params = jax.tree.map(lambda x: x[w], before.local_params)
        block = jax.tree.map(lambda x: np.split(np.asarray(x), workers)[w], batch)
        local = w_params[name] - lr * jax.grad(_loss)(w_params, block)[name]
        deltas.append(before.global_params[name] - local)
    return deltas


@pytest.mark.parametrize("method", ["ar_topk", "quantized", "zfp", "auto"])
def test_compressed_exchange_conserves_error_feedback(method):
    """TopK, 8-bit quantized, 8-bit zfp and compress_auto pseudo-gradients, outer SGD lr 1
    (global <- global - mean sent): at each sync, mean over workers of (delta + old residual -
    new residual) is exactly what moved the global params, and the workers restart from them."""
    method = {
        "ar_topk": jaxcomp.TopK(0.5, collective="ar"),
        "quantized": jaxcomp.Quantized(8),
        "zfp": jaxcomp.Zfp(8),
        "auto": jaxcomp.compress(
            "auto", ratio=0.5, axis_name="workers", network=jaxcomp.Network(1e-2, 1e7)
        ),
    }[method]
    workers, lr = 4, 0.1
    run = jaxcomp.diloco(
        _loss, optax.sgd(lr), optax.sgd(1.0), mesh=_mesh(workers), sync_every=2, compress=method
    )
    for before, state, batch in _syncs(run, _batches(4)):
        # Each worker's params after its inner step, by hand (SGD): the pseudo-gradient.
        residual_old = jaxcomp.find_compress_state(before.compress_state[0]).residual
        residual_new = jaxcomp.find_compress_state(state.compress_state[0]).residual
        for i, name in enumerate(sorted(_params())):
            moved = np.asarray(before.global_params[name]) - np.asarray(state.global_params[name])
            deltas = _sgd_pseudo_gradients(before, batch, name, workers, lr)
            sent = [d + residual_old[i][w] - residual_new[i][w] for w, d in enumerate(deltas)]
            np.testing.assert_allclose(np.mean(sent, axis=0), moved, rtol=1e-4, atol=2e-6)
            for w in range(workers):
                np.testing.assert_array_equal(
                    state.local_params[name][w], state.global_params[name]
                )
        assert any(np.abs(np.asarray(r)).max() > 0 for r in residual_new)  # it did compress


@pytest.mark.parametrize("inner", [None, 2], ids=["workers", "split-over-2"])
def test_streaming_fragments_with_delay_match_reference(inner):
    """Three leaves in two strided fragments, H = 4 (fragment 0 after steps 2, 6, ...; fragment
    1 after 4, 8, ...), each applied one step late with the 0.5 mix; 4 workers, 10 steps; on a
    4x2 mesh too, each fragment's exchange split over the row (ZeRO inside)."""
    inner_tx = optax.adam(0.05)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    two_level = dict(inner_axis="data", shard="optimizer") if inner else {}
    run = jaxcomp.diloco(
        _loss, inner_tx, outer_tx, mesh=_mesh(4, inner), sync_every=4, fragments=2, delay=1,
        **two_level,
    )  # fmt: skip
    batches = _batches(10)
    state, metrics = _run(run, batches)
    reference = reference_diloco(
        inner_tx, outer_tx, _params(), batches, 4, 4, fragments=2, delay=1, mixing=0.5,
        inner=inner or 1,
    )  # fmt: skip
    _assert_matches(state, reference)
    # An exchange due after step c runs (and is reported) in step c + 1, before its gradient:
    # the one due after step 10 would run in step 11.
    assert [t + 1 for t, m in enumerate(metrics) if m["synced"]] == [3, 5, 7, 9]
    # Each exchange moves one fragment: ("b", "w") then ("c",), in leaf order b, c, w.
    sent = [float(m["bytes_sent"]) for m in metrics if m["synced"]]
    assert sent[0] > sent[1] > 0 and sent[0] == sent[2]


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("inner", [None, 2], ids=["workers", "split-over-2"])
def test_a_delayed_exchange_does_not_wait_for_the_gradient(delay, inner):
    """Streaming DiLoCo's overlap, read from the compiled step: with a delay, each fragment's
    exchange (a conditional holding the outer compress's collectives) depends on none of the
    step's dots, so XLA's runtime can run it beside the forward and backward passes; without
    one it waits for them (it sends the params the inner step just made)."""
    two_level = dict(inner_axis="data", shard="optimizer") if inner else {}
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), mesh=_mesh(4, inner), sync_every=4, fragments=2, delay=delay,
        compress=jaxcomp.Quantized(8), **two_level,
    )  # fmt: skip
    state = run.init(_params())
    graph = EntryGraph(run.step.lower(state, _batches(1)[0]).compile().as_text())
    exchanges = graph.collective_conditionals()
    assert len(exchanges) == 2, exchanges  # one per fragment
    dots = graph.dots()
    assert dots
    assert [bool(dots & graph.ancestors(name)) for name in exchanges] == [delay == 0] * 2


def test_two_level_mesh_matches_reference():
    """A 4x2 mesh: 4 workers, each data-parallel over 2 devices (gradients averaged over
    "data" every step), synced over "workers" every 2 steps; per-worker metrics."""
    mesh = _mesh(4, inner=2)
    inner_tx = optax.adam(0.05)
    run = jaxcomp.diloco(
        _loss, inner_tx, mesh=mesh, sync_every=2, inner_axis="data", worker_metrics=True
    )
    batches = _batches(5)
    state, metrics = _run(run, batches)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    _assert_matches(state, reference_diloco(inner_tx, outer_tx, _params(), batches, 4, 2, inner=2))
    assert metrics[0]["loss"].shape == (4,)
    first = [
        _loss(_params(), jax.tree.map(lambda x: x[6 * w : 6 * w + 6], batches[0])) for w in range(4)
    ]
    np.testing.assert_allclose(metrics[0]["loss"], first, rtol=1e-6)
    _assert_no_outer_collective_outside_sync(run, state, batches[0], mesh)


@pytest.mark.parametrize("workers,inner,accumulate", [(4, 2, 1), (2, 3, 1), (2, 2, 2), (1, 1, 1)])
def test_zero_over_the_inner_axis_matches_reference(workers, inner, accumulate):
    """shard="optimizer" on a workers x inner mesh: each device keeps the AdamW moments of its
    1/inner shard of every leaf (the "w" leaf's 6 values padded to inner * ceil(6 / inner)); the
    run matches the per-worker reference and the unsharded run, with optax.MultiSteps inside
    the inner steps too; the compiled step reduce-scatters over the inner axis, and nothing but
    the sync crosses workers."""
    mesh = _mesh(workers, inner=inner)
    inner_tx = optax.adamw(0.05, weight_decay=0.1)
    if accumulate > 1:
        inner_tx = optax.MultiSteps(inner_tx, every_k_schedule=accumulate)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    kwargs = dict(mesh=mesh, sync_every=2 * accumulate, inner_axis="data", worker_metrics=True)
    run = jaxcomp.diloco(_loss, inner_tx, outer_tx, shard="optimizer", **kwargs)
    batches = _batches(5 * accumulate)
    state, _ = _run(run, batches)
    reference = reference_diloco(
        inner_tx, outer_tx, _params(), batches, workers, 2 * accumulate, inner=inner
    )
    _assert_matches(state, reference)
    whole, _ = _run(jaxcomp.diloco(_loss, inner_tx, outer_tx, **kwargs), batches)
    _assert_trees_close(state.global_params, whole.global_params)
    _assert_trees_close(state.local_params, whole.local_params)
    m = -(-6 // inner)  # the shard of "w" (3 x 2 values)
    mu = jax.tree.leaves(state.inner_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    adam = next(x for x in mu if isinstance(x, optax.ScaleByAdamState))
    assert adam.mu["w"].shape == (workers * inner, m)
    assert {s.data.shape for s in adam.mu["w"].addressable_shards} == {(1, m)}
    assert workers * inner == 1 or adam.mu["w"].sharding.spec == P(("workers", "data"))
    if workers * inner > 1:
        hlo = run.step.lower(state, batches[0]).compile().as_text()
        # The 3 small leaves' gradients in one reduce-scatter, their shards in one all-gather
        # (the inner step's; the sync's branch has one more), not one per leaf.
        scatters = re.findall(r" reduce-scatter(?:-start)?\(", hlo)
        assert inner == 1 or len(scatters) == 1, scatters
        assert inner == 1 or len(re.findall(r" all-gather(?:-start)?\(", hlo)) == 2
        _assert_no_outer_collective_outside_sync(run, state, batches[0], mesh)


def _np_block(leaf, n, i):
    """Device i's block of a leaf in a split exchange: along the longest axis (moved first),
    zero-padded to n * ceil(length / n)."""
    x = np.asarray(leaf).reshape(np.shape(leaf) or (1,))
    x = np.moveaxis(x, int(np.argmax(x.shape)), 0)
    m = -(-x.shape[0] // n)
    x = np.concatenate([x, np.zeros((n * m - x.shape[0],) + x.shape[1:], x.dtype)])
    return x[i * m : (i + 1) * m]


@pytest.mark.parametrize("method", ["ar_topk", "quantized", "zfp", "powersgd", "sign"])
def test_split_exchange_sends_each_device_its_block(method):
    """A 4x2 mesh with exchange="split" (the default with inner_axis) and ZeRO: device i of every
    worker compresses only block i of each leaf, with its own residual. Outer SGD lr 1: at each
    sync, for every block, the mean over workers of (block of delta + old residual - new
    residual) is exactly the block of what moved the global params, and every device of every
    worker restarts from them; each device sends fewer bytes than with exchange="whole"."""
    method = {
        "ar_topk": jaxcomp.TopK(0.5, collective="ar"),
        "quantized": jaxcomp.Quantized(8),
        "zfp": jaxcomp.Zfp(8),
        "powersgd": jaxcomp.PowerSGD(1, min_compression_rate=1),
        "sign": jaxcomp.Sign(),
    }[method]
    workers, inner, lr = 4, 2, 0.1
    kwargs = dict(mesh=_mesh(workers, inner), sync_every=2, compress=method, inner_axis="data")
    run = jaxcomp.diloco(_loss, optax.sgd(lr), optax.sgd(1.0), shard="optimizer", **kwargs)
    residual = lambda s: jaxcomp.find_compress_state(s.compress_state[0]).residual  # noqa: E731
    assert residual(run.init(_params()))[2].shape == (workers * inner, 2, 2)  # "w": 2-row blocks
    for before, state, batch in _syncs(run, _batches(4)):
        # On the host: indexing the sharded residuals eagerly would run XLA:CPU collectives over
        # the 8 virtual devices, which can abort while another 8-device test process runs.
        old, new = ([np.asarray(r) for r in residual(s)] for s in (before, state))
        for k, name in enumerate(sorted(_params())):
            moved = np.asarray(before.global_params[name]) - np.asarray(state.global_params[name])
            deltas = _sgd_pseudo_gradients(before, batch, name, workers, lr)
            for i in range(inner):
                sent = [
                    _np_block(d, inner, i) + old[k][w * inner + i] - new[k][w * inner + i]
                    for w, d in enumerate(deltas)
                ]
                # The padding's entries are sent too (a rotation or a block codec mixes them
                # in) and dropped from the result: only the leaf's own entries moved.
                real = _np_block(np.ones_like(moved), inner, i) > 0
                np.testing.assert_allclose(
                    np.mean(sent, axis=0)[real], _np_block(moved, inner, i)[real], rtol=1e-4,
                    atol=2e-6,
                )  # fmt: skip
            for w in range(workers):
                np.testing.assert_array_equal(
                    state.local_params[name][w], state.global_params[name]
                )
    assert any(np.abs(np.asarray(r)).max() > 0 for r in residual(state))  # it did compress


@pytest.mark.parametrize("method", ["ar_topk", "quantized", "zfp", "sign", "fp16"])
def test_split_exchange_halves_each_devices_bytes_on_a_2_device_row(method):
    """One 64 x 16 leaf, 2 workers of 2 devices: with exchange="split" each device sends half
    of what it sends with exchange="whole" (its 32 x 16 block)."""
    method = {
        "ar_topk": jaxcomp.TopK(0.25, collective="ar"),
        "quantized": jaxcomp.Quantized(8),
        "zfp": jaxcomp.Zfp(8),
        "sign": jaxcomp.Sign(),
        "fp16": "fp16",
    }[method]
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)}

    def loss(p, b):
        return jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)

    sent = {}
    for exchange in ("split", "whole"):
        run = jaxcomp.diloco(
            loss, optax.sgd(0.1), mesh=_mesh(2, 2), sync_every=1, compress=method,
            inner_axis="data", exchange=exchange,
        )  # fmt: skip
        _, metrics = run.step(run.init(params), batch)
        sent[exchange] = float(metrics["bytes_sent"])
    # (sign: a 4-byte scale per device beside the 64 or 128 bytes of signs)
    assert sent["split"] == pytest.approx(sent["whole"] / 2, rel=0.05), sent


def _assert_trees_close(got, want, rtol=2e-5, atol=2e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _assert_no_outer_collective_outside_sync(run, state, batch, mesh):
    """In the compiled HLO, every collective whose replica groups span workers lies in a
    computation reachable only through a conditional's branch (the sync); outside them only the
    inner axis's collectives run."""
    hlo = run.step.lower(state, batch).compile().as_text()
    computations = dict(re.findall(r"^(?:ENTRY )?%?(\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S))
    entry = re.search(r"^ENTRY %?(\S+)", hlo, re.M).group(1)
    worker_of = {d.id: w for w, row in enumerate(mesh.devices) for d in row}
    collective = re.compile(
        r" (all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)(-start)?\("
    )

    def spans_workers(line):
        groups = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        text = groups.group(1) if groups else (pairs.group(1) if pairs else "")
        sets = [{int(i) for i in g.split(",") if i} for g in re.findall(r"\{([\d,]*)\}", text)]
        return any(len({worker_of[i] for i in s}) > 1 for s in sets)

    seen, todo, outer_in_branch, inner_seen = set(), [entry], False, 0
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in computations[name].splitlines():
            if collective.search(line):
                assert not spans_workers(line), f"outer-axis collective outside the sync: {line}"
                inner_seen += 1
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                branch_text = "\n".join(
                    computations[b.strip().lstrip("%")] for b in branches.split(",")
                )
                outer_in_branch |= "replica_groups" in branch_text
    assert outer_in_branch  # the sync's collectives are in a branch
    assert inner_seen  # the inner axis's gradient mean runs on every step


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_checkpoint_resumes_bit_identically(tmp_path, shard):
    """Compressed (TopK: residuals), streaming with a delay (pending exchange): save after 3
    steps, restore with run.restore, continue 5 steps: bit for bit the uninterrupted run. With
    shard="optimizer", on a 4x2 mesh whose inner Adam state is split over the inner axis."""
    import orbax.checkpoint as ocp

    two_level = dict(mesh=_mesh(4, inner=2), inner_axis="data", shard=shard) if shard else {}
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), sync_every=4, fragments=2, delay=1,
        compress=jaxcomp.TopK(0.5), **({"mesh": _mesh(4)} | two_level),
    )  # fmt: skip
    batches = _batches(8)
    state, _ = _run(run, batches[:3])  # fragment 0 exchanged at step 2, applied at 3
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = run.restore(tmp_path / "ckpt", _params())
    assert_trees_equal(restored, state)
    uninterrupted, _ = _run(run, batches[3:], state)
    resumed, _ = _run(run, batches[3:], restored)
    assert_trees_equal(resumed, uninterrupted)


TWO_LEVEL_METHODS = {
    "ar_topk": jaxcomp.TopK(0.5, collective="ar"),
    "allgather_topk": jaxcomp.TopK(0.5),
    "randomk": jaxcomp.RandomK(0.5),
    "quantized": jaxcomp.Quantized(8),
    "zfp": jaxcomp.Zfp(8),
    "sign": jaxcomp.Sign(),
    "powersgd": jaxcomp.PowerSGD(1, min_compression_rate=1),
    "fp16": "fp16",
    "bf16": "bf16",
    "auto": "auto",
}


@pytest.mark.parametrize(
    "method",
    [
        m if m in ("ar_topk", "zfp") else pytest.param(m, marks=pytest.mark.slow)
        for m in sorted(TWO_LEVEL_METHODS)
    ],
)
def test_every_method_on_the_two_level_mesh_resumes_bit_identically(tmp_path, method):
    """Every method as the outer compressor on a 2x2 mesh (split exchange, ZeRO inside): it
    syncs, sends bytes, and a checkpoint taken between syncs resumes bit for bit."""
    import orbax.checkpoint as ocp

    compress = TWO_LEVEL_METHODS[method]
    if compress == "auto":
        network = jaxcomp.Network(1e-2, 1e7)
        compress = jaxcomp.compress("auto", ratio=0.5, axis_name="workers", network=network)
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), mesh=_mesh(2, 2), sync_every=2, compress=compress,
        inner_axis="data", shard="optimizer",
    )  # fmt: skip
    batches = _batches(4)
    state, _ = _run(run, batches[:1])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = run.restore(tmp_path / "ckpt", _params())
    uninterrupted, metrics = _run(run, batches[1:], state)
    resumed, _ = _run(run, batches[1:], restored)
    assert_trees_equal(resumed, uninterrupted)
    assert [bool(m["synced"]) for m in metrics] == [True, False, True]
    assert float(metrics[0]["bytes_sent"]) > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(uninterrupted))


@pytest.mark.parametrize(
    "inner, donate", [(None, False), (2, False), (None, True)], ids=["workers", "split", "donated"]
)
def test_a_diverging_exchange_is_told_to_the_host_once(inner, donate, caplog):
    """The outer compress's guardrail: a batch with 1000x targets makes one sync's
    pseudo-gradient an outlier; the guardrail triggers there and the host logs it once, from
    the finished step's state (no host callback in the step), on a 1-D mesh and on a split
    exchange whose guardrail state is laid out a row per device."""
    import logging

    guard = jaxcomp.Guardrail(burn_in=3, window=2, patience=1)  # at the spike itself
    method = jaxcomp.compress(jaxcomp.TopK(0.5), axis_name="workers", guardrail=guard)
    two_level = dict(inner_axis="data", shard="optimizer") if inner else {}
    run = jaxcomp.diloco(
        _loss, optax.sgd(0.05), optax.sgd(1.0), mesh=_mesh(2, inner), sync_every=1,
        compress=method, donate=donate, **two_level,
    )  # fmt: skip
    assert not run.step.trace(run.init(_params()), _batches(1)[0]).jaxpr.effects
    batches = _batches(16)
    batches[6] = {"x": batches[6]["x"], "y": batches[6]["y"] * 1000.0}
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        state, _ = _run(run, batches)  # 9 steps after the spike: the bound retires it
    told = [
        r.getMessage() for r in caplog.records if "training diverges at step 6" in r.getMessage()
    ]
    assert len(told) == 1 and "topk(0.5)" in told[0], told
    assert (
        int(np.ravel(jaxcomp.find_compress_state(state.compress_state[0]).divergence.fallbacks)[0])
        == 1
    )


@pytest.mark.parametrize("inner", [None, 2], ids=["workers", "split-over-2"])
def test_a_donated_run_is_the_undonated_one_bit_for_bit(inner):
    """donate=True: each step writes over its input state (deleted), and the run is the same,
    with int8 pseudo-gradients, 2 fragments and a delay, on a 1-D mesh and a split exchange
    with ZeRO over the row; the params given to init survive."""
    two_level = dict(inner_axis="data", shard="optimizer") if inner else {}
    finals = []
    params = _params()
    for donate in (False, True):
        run = jaxcomp.diloco(
            _loss, optax.adam(0.05), mesh=_mesh(2, inner), sync_every=2,
            compress=jaxcomp.Quantized(8), fragments=2, delay=1, donate=donate, **two_level,
        )  # fmt: skip
        state = run.init(params)
        for batch in _batches(5):
            before = state
            state, _ = run.step(state, batch)
            deleted = [x.is_deleted() for x in jax.tree.leaves(before) if x.size > 1]
            assert all(deleted) if donate else not any(deleted)
        finals.append(jax.tree.map(np.asarray, state))
    assert_trees_equal(finals[1], finals[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    with pytest.raises(TypeError, match="donate must be True or False"):
        jaxcomp.diloco(_loss, mesh=_mesh(2), donate=1)


def test_gradient_accumulation_inside_inner_steps():
    """optax.MultiSteps(sgd, 2) as inner_tx: each worker updates every 2nd micro-step; H = 4
    micro-steps; matches the reference running the same MultiSteps per worker."""
    inner_tx = optax.MultiSteps(optax.sgd(0.2), every_k_schedule=2)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    run = jaxcomp.diloco(_loss, inner_tx, outer_tx, mesh=_mesh(2), sync_every=4)
    batches = _batches(6)
    state, _ = _run(run, batches[:1])
    np.testing.assert_array_equal(state.local_params["w"][0], _params()["w"])  # accumulated only
    state, _ = _run(run, batches[1:], state)
    _assert_matches(state, reference_diloco(inner_tx, outer_tx, _params(), batches, 2, 4))


def test_bad_arguments_raise_clear_errors():
    mesh = _mesh(2)
    ok = dict(mesh=mesh, sync_every=4)
    cases = [
        (dict(ok, sync_every=0), ValueError, "sync_every"),
        (dict(ok, fragments=5), ValueError, "fragments=5 > sync_every=4"),
        (dict(ok, delay=4), ValueError, "delay=4 must be < sync_every=4"),
        (dict(ok, mixing=0.3), ValueError, "mixing applies"),
        (dict(ok, delay=1, mixing=2.0), ValueError, "mixing must be a finite number in [0, 1]"),
        (dict(ok, shard="optimizer"), ValueError, "pass inner_axis= (a two-level mesh"),
        (dict(ok, shard="params"), ValueError, "shard='params' is not supported by diloco"),
        (dict(ok, shard="zero"), ValueError, "shard must be one of (None, 'optimizer')"),
        (dict(ok, exchange="split"), ValueError, "exchange='split' splits the outer exchange"),
        (dict(ok, exchange="half"), ValueError, "exchange must be one of ('split', 'whole')"),
        (dict(ok, outer_axis="pods"), ValueError, "missing"),
        (dict(ok, mesh=_mesh(2, inner=2)), ValueError, "unused"),
        (dict(ok, inner_axis="workers"), ValueError, "must differ"),
        (dict(ok, compress=3), TypeError, "compress must be"),
        (dict(ok, mesh=None), TypeError, "mesh must be"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=re.escape(match)):
            jaxcomp.diloco(_loss, optax.sgd(0.1), **kwargs)
    with pytest.raises(TypeError, match="inner_tx must be"):
        jaxcomp.diloco(_loss, "adam", **ok)
    with pytest.raises(ValueError, match="fragments=4 is more than the 3 leaves"):
        jaxcomp.diloco(_loss, optax.sgd(0.1), mesh=mesh, sync_every=4, fragments=4).init(_params())
    with pytest.raises(ValueError, match="inner_tx holds a jaxcomp.compress"):
        tx = optax.chain(jaxcomp.compress("dense", axis_name="workers"), optax.sgd(0.1))
        jaxcomp.diloco(_loss, tx, **ok).init(_params())
    with pytest.raises(ValueError, match="compress must aggregate the pseudo-gradients over"):
        jaxcomp.diloco(_loss, compress=jaxcomp.compress("dense"), **ok).init(_params())
    run = jaxcomp.diloco(_loss, optax.sgd(0.1), **ok)
    with pytest.raises(TypeError, match="DiLoCoState"):
        run.step(_params(), _batches(1)[0])
    state = run.init(_params())
    with pytest.raises(ValueError, match="divisible by the 2 devices"):
        run.step(state, {"x": jnp.ones((3, 3)), "y": jnp.ones((3, 2))})
    other = jaxcomp.diloco(_loss, optax.adam(0.1), **ok)
    with pytest.raises(ValueError, match="does not fit this diloco run"):
        other.step(state, _batches(1)[0])
