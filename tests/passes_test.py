"""benchmarks/passes.py: its ``--methods`` entries (``@bMB`` buckets) and the update it times."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

passes = load_benchmark("passes")


def test_method_entries_take_a_bucket_size():
    assert passes.method_options("ar_topk") == ("ar_topk", {"ratio": 0.01})
    assert passes.method_options("ar_topk@b25") == ("ar_topk", {"ratio": 0.01, "bucket_mb": 25.0})
    assert passes.method_options("dense@b0.5") == ("dense", {"bucket_mb": 0.5})
    for bad, match in (("nope", "not one of"), ("dense@bx", "megabytes")):
        with pytest.raises(ValueError, match=match):
            passes.method_options(bad)


def test_bad_methods_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        passes.parse_args(["--methods", "dense,ar_topk@bfast"])
    assert "--methods" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["dense", "dense@b0.001", "ar_topk@b0.001"])
def test_the_timed_update_is_compress_on_one_device(method):
    """With buckets or without, the update on one device returns every leaf's aggregate (dense:
    the gradient itself; top-k: a sparse part of it)."""
    rng = np.random.default_rng(0)
    grads = {"a": jnp.asarray(rng.standard_normal((40, 30)), jnp.float32), "b": jnp.ones(7)}
    step, state = passes.update_function(method, grads)
    updates, _ = step(grads, state)
    for name, g in grads.items():
        u = np.asarray(updates[name])
        assert u.shape == g.shape
        sent = u != 0
        np.testing.assert_allclose(u[sent], np.asarray(g)[sent], rtol=1e-6)
        assert sent.all() if method.startswith("dense") else 0 < sent.sum() < u.size or name == "b"
    assert jax.tree.structure(updates) == jax.tree.structure(grads)


def test_best_of_rounds_keeps_each_runs_fastest_call():
    """Every run is called in every round (a warm-up and two timed calls each), and its figure is
    the fastest timed call."""
    calls = {"a": 0, "b": 0}

    def run(name):
        def call():
            calls[name] += 1

        return call

    best = passes.best_of_rounds({"a": run("a"), "b": run("b")}, 3)
    assert calls == {"a": 9, "b": 9}
    assert set(best) == {"a", "b"} and all(0 <= s < 0.1 for s in best.values())


def test_powersgd_batches_one_at_a_time_is_a_group_per_matrix():
    """benchmarks/powersgd_batches.py's "one at a time" puts each matrix in a group of its own
    (the update before the grouping), and gives the grouping back after."""
    from jaxcomp.methods import powersgd

    script = load_benchmark("powersgd_batches")
    views = [(64, 64), (8, 8), (64, 64)]
    with script.mode("one at a time"):
        assert powersgd.batches(views) == [(0,), (1,), (2,)]
    with script.mode("batched"):
        assert powersgd.batches(views) == [(0, 2), (1,)]
    assert powersgd.batches(views) == [(0, 2), (1,)]
    assert script.parse_args(["--models", "many_small"]).models == ["many_small"]


def test_the_update_is_compiled_for_the_branch_data_parallel_runs():
    """Sign beside the guardrail's dense fallback: data_parallel compiles its steps for sign's
    branch (jaxcomp.optim.pinning), and so does the timed update unless ``switched``; THC, which
    gains nothing from it, keeps the switch either way, and top-k has no fallback to switch to."""
    grads = {"a": jnp.ones((40, 30)), "b": jnp.ones(7)}
    for method, pins in (("sign", True), ("quantized", False), ("ar_topk", False)):
        cases = []
        for switched in (False, True):
            step, state = passes.update_function(method, grads, switched)
            cases.append(step.lower(grads, state).as_text().count("stablehlo.case"))
        assert (cases[1] > cases[0]) == pins, (method, cases)
