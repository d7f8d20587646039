"""compress_auto's "auto" defaults per branch: a step data_parallel compiles for one candidate
buckets and feeds back as that candidate's own compress would."""

import jax
import numpy as np
import optax
from buckets_test import _collective_dependencies, _loss, _params, _train

import jaxcomp
from jaxcomp.methods import QUALITY_SAFE
from jaxcomp.optim import config as config_module
from jaxcomp.optim import pinning


def test_compress_auto_buckets_each_branch_as_its_own_compress_would(monkeypatch):
    """compress_auto over dense and top-k: the step data_parallel compiles for dense sends
    buckets during the backward pass, as compress("dense") does; the one for top-k and the step
    that chooses on the device send one message at the end. The step compiled for the branch the
    device chose trains the same params as the switched step."""
    monkeypatch.setattr(config_module, "DEFAULT_BUCKET_MB", 0.2)
    candidates = [jaxcomp.Dense(), jaxcomp.methods.parse("ar_topk", ratio=0.05)]
    tx = optax.chain(jaxcomp.compress_auto(candidates), optax.sgd(0.1))
    dp, state, batch = _train(tx, 2, steps=1)
    steps = dp.step._jitted
    waits = {}
    for branch in (0, 1, None):
        hlo = steps._step(branch).lower(state, batch).compile().as_text()
        waits[branch], dots = _collective_dependencies(hlo)
    assert min(waits[0]) < dots and min(waits[1]) == dots and min(waits[None]) == dots, waits
    switched = steps.run(None, state, batch)[0]
    ran = int(jaxcomp.find_compress_state(switched.opt_state).metrics.method)
    pinned = steps.run(ran, state, batch)[0]  # the branch the device chose, compiled alone
    for a, b in zip(jax.tree.leaves(pinned.params), jax.tree.leaves(switched.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Every step decides on the same predicted costs: the buckets' reckoned as one message.
    comm = [
        jaxcomp.find_compress_state(steps.run(b, state, batch)[0].opt_state).auto.comm
        for b in (0, None)
    ]
    assert np.all(np.isfinite(comm[0])), comm
    np.testing.assert_array_equal(*comm)


def test_compress_autos_default_candidates_are_pinned_for_their_own_defaults():
    """Dense, bf16 and ZFP: none sparse, but dense and the cast bucket and run without error
    feedback where ZFP does not, so data_parallel compiles a step per branch; given one message
    and error feedback for all, it keeps the switch (with buckets for all it would not: a
    switch holds every bucket until the backward pass is done)."""
    params = _params()
    own = jaxcomp.compress_auto(QUALITY_SAFE).init(params)
    same = jaxcomp.compress_auto(QUALITY_SAFE, bucket_mb=None, error_feedback=True).init(params)
    bucketed = jaxcomp.compress_auto(QUALITY_SAFE, bucket_mb=25, error_feedback=True).init(params)
    assert bucketed.branches.buckets and pinning.can_pin(bucketed)
    assert own.branches.own_defaults and pinning.can_pin(own)
    assert not same.branches.own_defaults and not pinning.can_pin(same)


def test_the_cast_branch_steps_as_the_cast_and_leaves_the_residual_as_it_was():
    """After a ZFP step (which leaves a residual), the bf16 branch's step updates the params as
    compress("bf16") does (no error feedback, its default) and keeps ZFP's residual for ZFP's
    next step, bit for bit; the switched step adds it in."""
    tx = optax.chain(jaxcomp.compress_auto(QUALITY_SAFE), optax.sgd(0.1))
    dp, state, batch = _train(tx, 2, steps=1)
    steps = dp.step._jitted
    after_zfp = steps.run(2, state, batch)[0]
    residual = jaxcomp.find_compress_state(after_zfp.opt_state).residual
    assert max(float(np.abs(r).max()) for r in jax.tree.leaves(residual)) > 0
    after_cast = steps.run(1, after_zfp, batch)[0]
    kept = jaxcomp.find_compress_state(after_cast.opt_state).residual
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(residual)):
        np.testing.assert_array_equal(a, b)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    cast = jaxcomp.data_parallel(_loss, optax.chain(jaxcomp.compress("bf16"), optax.sgd(0.1)), mesh)
    fixed = cast.step(cast.init(after_zfp.params), batch)[0]
    for a, b in zip(jax.tree.leaves(after_cast.params), jax.tree.leaves(fixed.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    switched = steps.run(None, after_zfp, batch)[0]
    moved = jaxcomp.find_compress_state(switched.opt_state).residual
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(residual))
    )
