"""benchmarks/one_device.py: its flags, and the steps it times on a small model."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

from jaxcomp.training import zoo

one_device = load_benchmark("one_device")


def _tiny_model():
    """A zoo.Model of two small dense layers, so that the test compiles in seconds."""
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.1, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.1, jnp.float32),
    }

    def loss_fn(params, batch):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    def make_batch(rng, size):
        return {
            "x": rng.standard_normal((size, 16)).astype(np.float32),
            "y": rng.standard_normal((size, 4)).astype(np.float32),
        }

    return zoo.Model("tiny", "two dense layers", params, loss_fn, make_batch, 16 * 32 + 32 * 4, 2)


def test_every_method_and_auto_step_and_are_timed_beside_the_plain_step():
    rows = one_device.measure(_tiny_model(), ["dense", "ar_topk", "auto"], repeats=1, batch_size=4)
    assert [r["method"] for r in rows] == ["dense", "ar_topk", "auto"]
    for r in rows:
        assert r["seconds"] > 0 and r["plain_seconds"] > 0
        assert r["vs_plain"] == pytest.approx(r["seconds"] / r["plain_seconds"])
    assert "| tiny | 0.0M | auto |" in one_device.table(rows)


def test_the_compressed_step_trains_as_the_plain_one_on_one_device():
    """Dense on one device is the plain SGD step: the same params after one step."""
    model = _tiny_model()
    batch = model.make_batch(np.random.default_rng(1), 4)
    plain = one_device.plain_step(model, batch)()[0]
    state, _ = one_device.compressed_step(model, batch, "dense")()
    for name in plain:
        np.testing.assert_allclose(
            np.asarray(state.params[name]), np.asarray(plain[name]), rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--methods", "dense,nope"], "--methods: nope not one of"),
        (["--models", "tiny"], "--models: tiny not one of"),
        (["--repeats", "0"], "at least 1"),
    ],
)
def test_bad_flags_are_refused_naming_them(argv, match, capsys):
    with pytest.raises(SystemExit):
        one_device.parse_args(argv)
    assert match in capsys.readouterr().err
