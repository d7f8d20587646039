"""Fault-tolerant DiLoCo with eager rounds (``diloco_ft(eager=True)``): two workers in this
process against ``jaxcomp.diloco(eager=True)``, an exchange that runs beside the inner steps,
and a worker behind the others that joins, sends nothing for a round, then trains."""

import time

import jax
import numpy as np
import pytest
from diloco_ft_test import INNER, OUTER, H, batch, initial_params, loss_fn, two_workers
from helpers import need_devices

import jaxcomp
from jaxcomp.distributed.diloco_ft import diloco_ft
from jaxcomp.distributed.quorum import Quorum

# OUTER has momentum, as the non-eager tests' and diloco's eager reference: they warn
pytestmark = pytest.mark.filterwarnings("ignore:.*\\(eager=True\\) with an outer_tx")


def flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]).tolist()


class Workers:
    rank, num_workers = 0, 2

    def members(self, sync, timeout=None):
        raise AssertionError("nothing may be sent")

    commit = put = get = reconnect = members


def test_eager_defaults_to_averaging_and_warns_of_momentum():
    run = diloco_ft(loss_fn, INNER, quorum=Workers(), sync_every=H, eager=True)
    update, _ = run.outer_tx.update({"w": np.ones(2)}, run.outer_tx.init({"w": np.ones(2)}))
    assert update["w"].tolist() == [-1.0, -1.0]  # optax.sgd(1.0)
    with pytest.warns(RuntimeWarning, match=r"diloco_ft\(eager=True\).*momentum oscillates"):
        diloco_ft(loss_fn, INNER, OUTER, quorum=Workers(), sync_every=H, eager=True)
    with pytest.raises(TypeError, match="num_workers"):
        diloco_ft(loss_fn, quorum=type("Q", (Workers,), {"num_workers": None})(), sync_every=H,
                  eager=True)  # fmt: skip


def test_two_eager_workers_match_diloco_eager():
    """Each round applies the average of the round before and restarts each worker from the
    consensus plus its own fresh progress, as ``diloco(eager=True)`` does inside XLA."""
    need_devices(2)
    steps = 4 * H
    results = two_workers(steps, eager=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("workers",))
    reference = jaxcomp.diloco(loss_fn, INNER, OUTER, mesh=mesh, sync_every=H, eager=True)
    state = reference.init(initial_params())
    # diloco runs a round at the start of the step after it is due: one step more runs the
    # round of step 4H, whose consensus (what params() returns) no inner step changes
    for step in range(steps + 1):
        both = [batch(r, step) for r in (0, 1)]
        state, _ = reference.step(state, jax.tree.map(lambda *x: np.concatenate(x), *both))
    expected = reference.params(state)
    for rank in (0, 1):
        params, synced, final, _ = results[rank]
        # round 1 only launches the first exchange; each later round applies the one before
        applied = [(s + 1) % H == 0 and s + 1 > H for s in range(steps)]
        assert synced == [(True, 2, (0, 1)) if a else (False, 0, ()) for a in applied]
        assert final.step == steps and final.sync == steps // H - 1
        np.testing.assert_allclose(flat(params), flat(expected), rtol=1e-5, atol=1e-6)
    assert flat(results[0][0]) == flat(results[1][0])


class SlowQuorum(Quorum):
    """A quorum whose commit takes a second more: an exchange of 1 s or more."""

    def commit(self, sync, timeout=None):
        time.sleep(1.0)
        return super().commit(sync, timeout=timeout)


def test_the_exchange_runs_beside_the_inner_steps():
    """An exchange of 1 s or more under rounds of 3 steps of at least 0.5 s: between a round's
    launch and the next round's wait the worker steps for 1.5 s or more, so at least that much of
    the exchange is hidden, however loaded the machine (no bound on the wait alone)."""
    need_devices(2)
    results = two_workers(3 * H, eager=True, quorum_class=SlowQuorum, pace=0.5)
    for rank in (0, 1):
        every = results[rank][3]
        rounds = [m for m in every if m["synced"]]
        assert len(rounds) == 2
        for m in rounds:
            assert m["exchange_seconds"] >= 1.0, m
            # the wait is what outlived 1.5 s of steps (0.2 s: the thread's wake-up under load)
            assert m["waited"] <= max(0.0, m["exchange_seconds"] - 1.5) + 0.2, m


def test_a_worker_behind_joins_sends_nothing_for_a_round_then_trains():
    """Worker 0 resumes at sync 2, worker 1 starts afresh: behind in its first exchange, it takes
    worker 0's consensus a round later, adds nothing to the next average, then adds its own; the
    two end with the same consensus."""
    need_devices(2)
    first = two_workers(3 * H, eager=True)

    def start(run, rank):
        return first[0][2] if rank == 0 else run.init(initial_params())

    results = two_workers(4 * H, eager=True, start=start)
    rounds = {r: [m for m in results[r][3] if m["synced"]] for r in (0, 1)}
    assert [m["trained"] for m in rounds[0]] == [(0,), (0,), (0, 1)]
    assert [m["joined"] for m in rounds[1]] == [True, False, False]
    assert [m["trained"] for m in rounds[1]] == [(0,), (0,), (0, 1)]
    assert results[0][2].step == results[1][2].step == 7 * H
    assert results[0][2].sync == results[1][2].sync == 5
    assert flat(results[0][0]) == flat(results[1][0])
