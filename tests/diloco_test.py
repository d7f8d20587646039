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
from helpers import assert_trees_equal, count_compilations, need_devices
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
    batches = _batches(4)
    state = run.init(_params())
    for t, batch in enumerate(batches):
        before = state
        state, metrics = run.step(state, batch)
        if t % 2 == 0:
            continue
        assert bool(metrics["synced"]) and float(metrics["bytes_sent"]) > 0
        # Each worker's params after its inner step, by hand (SGD): the pseudo-gradient.
        residual_old = jaxcomp.find_compress_state(before.compress_state[0]).residual
        residual_new = jaxcomp.find_compress_state(state.compress_state[0]).residual
        for i, name in enumerate(sorted(_params())):
            moved = np.asarray(before.global_params[name]) - np.asarray(state.global_params[name])
            sent = []
            for w in range(workers):
                w_params = jax.tree.map(lambda x: x[w], before.local_params)
                block = jax.tree.map(lambda x: np.split(np.asarray(x), workers)[w], batch)
                local = w_params[name] - lr * jax.grad(_loss)(w_params, block)[name]
                delta = before.global_params[name] - local
                sent.append(delta + residual_old[i][w] - residual_new[i][w])
            np.testing.assert_allclose(np.mean(sent, axis=0), moved, rtol=1e-4, atol=2e-6)
            for w in range(workers):
                np.testing.assert_array_equal(
                    state.local_params[name][w], state.global_params[name]
                )
        assert any(np.abs(np.asarray(r)).max() > 0 for r in residual_new)  # it did compress


def test_streaming_fragments_with_delay_match_reference():
    """Three leaves in two strided fragments, H = 4 (fragment 0 after steps 2, 6, ...; fragment
    1 after 4, 8, ...), each applied one step late with the 0.5 mix; 4 workers, 10 steps."""
    inner_tx = optax.adam(0.05)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    run = jaxcomp.diloco(
        _loss, inner_tx, outer_tx, mesh=_mesh(4), sync_every=4, fragments=2, delay=1
    )
    batches = _batches(10)
    state, metrics = _run(run, batches)
    reference = reference_diloco(
        inner_tx, outer_tx, _params(), batches, 4, 4, fragments=2, delay=1, mixing=0.5
    )
    _assert_matches(state, reference)
    assert [t + 1 for t, m in enumerate(metrics) if m["synced"]] == [2, 4, 6, 8, 10]
    # Each exchange moves one fragment: ("b", "w") then ("c",), in leaf order b, c, w.
    sent = [float(m["bytes_sent"]) for m in metrics if m["synced"]]
    assert sent[0] > sent[1] > 0 and sent[0] == sent[2]


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


def test_checkpoint_resumes_bit_identically(tmp_path):
    """Compressed (TopK: residuals), streaming with a delay (pending exchange): save after 3
    steps, restore with run.restore, continue 5 steps: bit for bit the uninterrupted run."""
    import orbax.checkpoint as ocp

    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), mesh=_mesh(4), sync_every=4, fragments=2, delay=1,
        compress=jaxcomp.TopK(0.5),
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
        (dict(ok, delay=1, mixing=2.0), ValueError, "mixing must be in"),
        (dict(ok, shard="optimizer"), ValueError, "shard='optimizer' is not supported"),
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
