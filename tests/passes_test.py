"""benchmarks/passes.py: its ``--methods`` entries (``@bMB`` buckets) and the update it times."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "passes.py"
)


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks_passes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


passes = _load()


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
