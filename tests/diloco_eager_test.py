"""jaxcomp.diloco(eager=True) against a single-process reference that loops over the workers.

The reference (:func:`reference_eager`) is plain optax on unsharded arrays, written from the
paper's description: each fragment's round, due after inner step ``c``, runs before step
``c + 1``'s gradient; the average of the workers' progress is exchanged for the next round, the
global params take the outer step with the previous round's average, and every worker restarts
from ``global + u(avg + delta_w / n)``.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from diloco_test import _assert_matches, _batches, _loss, _mesh, _params, _run
from helpers import EntryGraph, assert_checkpoint_resumes, assert_trees_equal

import jaxcomp

# The reference tests drive eager rounds with the paper's Nesterov on purpose (a stateful outer
# optimizer exercises the restart formula); the warning it earns is tested on its own below.
pytestmark = pytest.mark.filterwarnings("ignore:diloco\\(eager=True\\) with an outer_tx")


def reference_eager(inner_tx, outer_tx, params, batches, workers, sync_every, fragments=1):
    """Eager DiLoCo in one process, worker by worker; returns (global params, [worker params])."""
    leaves, treedef = jax.tree.flatten(params)
    global_leaves = list(leaves)
    local = [list(leaves) for _ in range(workers)]
    start = [list(leaves) for _ in range(workers)]
    inner_states = [inner_tx.init(params) for _ in range(workers)]
    groups = [list(range(f, len(leaves), fragments)) for f in range(fragments)]
    outer_states = [outer_tx.init([leaves[i] for i in g]) for g in groups]
    average = [[np.zeros_like(leaves[i]) for i in g] for g in groups]
    for t, batch in enumerate(batches):
        for f, group in enumerate(groups):
            first = (f + 1) * sync_every // fragments
            if t < first or (t - first) % sync_every:
                continue
            old = [global_leaves[i] for i in group]
            delta = [[start[w][i] - local[w][i] for i in group] for w in range(workers)]
            for w in range(workers):
                own = [a + d / workers for a, d in zip(average[f], delta[w])]
                updates, _ = outer_tx.update(own, outer_states[f], old)
                for i, new in zip(group, optax.apply_updates(old, updates)):
                    local[w][i] = start[w][i] = new
            if t > first:
                updates, outer_states[f] = outer_tx.update(average[f], outer_states[f], old)
                for i, new in zip(group, optax.apply_updates(old, updates)):
                    global_leaves[i] = new
            average[f] = [sum(d[j] for d in delta) / workers for j in range(len(group))]
        for w in range(workers):
            w_params = treedef.unflatten(local[w])
            block = jax.tree.map(lambda x: np.split(np.asarray(x), workers)[w], batch)
            grads = jax.grad(_loss)(w_params, block)
            updates, inner_states[w] = inner_tx.update(grads, inner_states[w], w_params)
            local[w] = jax.tree.leaves(optax.apply_updates(w_params, updates))
    return treedef.unflatten(global_leaves), [treedef.unflatten(lo) for lo in local]


@pytest.mark.parametrize("fragments", [1, 2])
def test_eager_rounds_match_the_reference(fragments):
    """4 workers, H = 4, Adam inside and Nesterov outside, 13 steps (three rounds of each
    fragment: the first applies nothing to the global params, the next two the average one
    round late): the compiled run is the reference; each round is reported by the step after
    its due step."""
    inner_tx, outer_tx = optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)
    run = jaxcomp.diloco(
        _loss, inner_tx, outer_tx, mesh=_mesh(4), sync_every=4, fragments=fragments, eager=True
    )
    batches = _batches(13)
    state, metrics = _run(run, batches)
    _assert_matches(state, reference_eager(inner_tx, outer_tx, _params(), batches, 4, 4, fragments))
    due = [4, 8, 12] if fragments == 1 else [2, 4, 6, 8, 10, 12]
    assert [t for t, m in enumerate(metrics) if m["synced"]] == due  # step t + 1 runs it
    assert all(float(m["bytes_sent"]) > 0 for m in metrics if m["synced"])


def test_params_are_the_consensus_with_the_waiting_average():
    """params(state) between rounds is the global params the next round's outer step gives
    (the waiting average applied through the outer optimizer, Nesterov here); before any
    round, the initial params."""
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), outer_tx, mesh=_mesh(4), sync_every=3, fragments=1, eager=True
    )
    batches = _batches(11)
    state, _ = _run(run, batches[:2])
    assert_trees_equal(run.params(state), _params())
    state, _ = _run(run, batches[2:8], state)  # rounds ran in steps 4 and 7
    flushed = run.params(state)
    later, _ = _run(run, batches[8:], state)  # the next round runs in step 10
    for got, want in zip(jax.tree.leaves(flushed), jax.tree.leaves(later.global_params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(flushed["w"], state.global_params["w"])


def test_eager_on_a_two_level_mesh_matches_the_reference():
    """A 4x2 mesh, each worker's exchange split over its row and ZeRO inside: the same
    algorithm (the row's gradients averaged, then the eager rounds)."""
    inner_tx, outer_tx = optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)
    run = jaxcomp.diloco(
        _loss, inner_tx, outer_tx, mesh=_mesh(4, 2), sync_every=4, fragments=2, eager=True,
        inner_axis="data", shard="optimizer",
    )  # fmt: skip
    batches = _batches(11)
    state, _ = _run(run, batches)
    _assert_matches(state, reference_eager(inner_tx, outer_tx, _params(), batches, 4, 4, 2))


def test_an_eager_exchange_does_not_wait_for_the_gradient():
    """Read from the compiled step: each fragment's eager round (a conditional holding the
    outer compress's collectives) depends on none of the step's dots."""
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), mesh=_mesh(4), sync_every=4, fragments=2, eager=True,
        compress=jaxcomp.Quantized(8),
    )  # fmt: skip
    state = run.init(_params())
    graph = EntryGraph(run.step.lower(state, _batches(1)[0]).compile().as_text())
    rounds = graph.collective_conditionals()
    assert len(rounds) == 2, rounds  # one per fragment
    dots = graph.dots()
    assert dots and not any(dots & graph.ancestors(name) for name in rounds)


def test_compressed_eager_rounds_train_and_resume_bit_identically(tmp_path):
    """Top-k pseudo-gradients with error feedback: the loss falls, bytes are those of top-k,
    and a checkpoint taken mid-round (a waiting average and the workers' starts in the state)
    resumes bit for bit."""
    run = jaxcomp.diloco(
        _loss, optax.adam(0.05), mesh=_mesh(4), sync_every=3, fragments=1, eager=True,
        compress=jaxcomp.TopK(0.5),
    )  # fmt: skip
    batches = _batches(14)
    state, metrics = _run(run, batches[:5])
    average, start = state.pending[0]
    assert any(np.abs(np.asarray(a)).max() > 0 for a in average)
    assert all(s.shape[0] == 4 for s in start)
    restore = lambda path: run.restore(path, _params())  # noqa: E731
    state = assert_checkpoint_resumes(run, state, batches[5:], tmp_path / "ckpt", restore)
    first = float(metrics[0]["loss"])
    assert np.mean([float(_loss(run.params(state), b)) for b in batches[:3]]) < first


def test_an_eager_run_with_outer_momentum_warns():
    """Nesterov outside eager rounds warns (momentum on a round-late average oscillates);
    plain SGD, the default and a synchronous run with Nesterov do not."""
    ok = dict(mesh=_mesh(2), sync_every=4)
    nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
    with pytest.warns(RuntimeWarning, match="momentum oscillates"):
        jaxcomp.diloco(_loss, optax.sgd(0.1), nesterov, eager=True, **ok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxcomp.diloco(_loss, optax.sgd(0.1), optax.sgd(0.5), eager=True, **ok)
        jaxcomp.diloco(_loss, optax.sgd(0.1), eager=True, **ok)
        jaxcomp.diloco(_loss, optax.sgd(0.1), nesterov, **ok)


def test_eager_arguments_raise_clear_errors():
    ok = dict(mesh=_mesh(2), sync_every=4)
    cases = [
        (dict(ok, eager=1), TypeError, "eager must be True or False"),
        (dict(ok, eager=True, delay=1), ValueError, "leave delay=0, got delay=1"),
        (dict(ok, eager=True, mixing=0.5), ValueError, "with eager=True each worker restarts"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=re.escape(match)):
            jaxcomp.diloco(_loss, optax.sgd(0.1), **kwargs)
    eager = jaxcomp.diloco(_loss, optax.sgd(0.1), eager=True, **ok)
    plain = jaxcomp.diloco(_loss, optax.sgd(0.1), **ok)
    # Without an outer_tx, eager rounds average (an outer SGD with lr 1): momentum on an
    # average that arrives a round late oscillates.
    grads = {"w": jnp.full(3, 2.0)}
    updates, _ = eager.outer_tx.update(grads, eager.outer_tx.init(grads))
    np.testing.assert_array_equal(updates["w"], -grads["w"])
    with pytest.raises(ValueError, match="delay, eager, shard"):
        eager.step(plain.init(_params()), _batches(1)[0])
