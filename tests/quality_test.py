"""benchmarks/quality.py: the training-quality benchmark runs end to end on a tiny model."""

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import load_benchmark, subprocess_env

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "quality.py"
)


def run(tmp_path, *args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        env=subprocess_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # a training run of its own
def test_quick_run_writes_finite_losses_bytes_and_a_plot(tmp_path):
    result = run(
        tmp_path,
        "--quick",
        "--methods",
        "dense,allgather_topk(0.01),auto-topk@100mbit",
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "quality.json") as f:
        data = json.load(f)
    dense, topk, auto = data["results"]
    assert (dense["name"], topk["name"]) == ("dense", "allgather_topk(0.01)")
    for r in (dense, topk, auto):
        assert len(r["train_loss"]) == data["config"]["steps"]
        assert all(math.isfinite(v) for v in r["train_loss"])
        # Six steps from random init: near the uniform guess over 128 characters, and finite.
        assert math.isfinite(r["heldout_loss"]) and 0 < r["heldout_loss"] < math.log(128) + 1
        assert r["eval_curve"][-1] == [data["config"]["steps"], r["heldout_loss"]]
    assert 0 < topk["bytes_per_step"] < dense["bytes_per_step"]
    # The mean over the run: dense sends the same every step; one method runs no choices.
    assert dense["mean_bytes_per_step"] == dense["bytes_per_step"]
    assert dense["choices"] == topk["choices"] == {}
    # auto told a slow network: it counts the steps each candidate ran, every step once.
    assert sum(auto["choices"].values()) == data["config"]["steps"]
    assert set(auto["choices"]) <= {"dense", "allgather_topk(0.01)", "ar_topk(0.01)", "zfp(8)"} | {
        "quantized(4)"
    }
    assert auto["options"]["network"] == "α=1 ms, bandwidth=100 Mbit/s"
    assert data["corpus"] and all(
        f["bytes"] > 0 and os.path.isfile(f["path"]) for f in data["corpus"]
    )
    assert (tmp_path / "quality.png").stat().st_size > 1000
    assert "| allgather_topk(0.01) |" in result.stdout
    assert "| auto-topk@100mbit (ran: " in result.stdout


def test_unknown_method_is_refused_naming_the_option(tmp_path):
    result = run(tmp_path, "--quick", "--methods", "dense,nope", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "--methods" in result.stderr and "nope" in result.stderr


def _quality_module():
    return load_benchmark("quality")


def test_adam_frozen_variance_is_adam_until_the_freeze_then_linear_in_the_gradients():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    quality = _quality_module()
    schedule = optax.linear_schedule(1e-3, 5e-3, 6)
    grads = jax.random.normal(jax.random.key(0), (9, 5)) * jnp.arange(1, 6)
    frozen, adam = quality.adam_frozen_variance(schedule, freeze_after=4), optax.adam(schedule)
    state, adam_state = frozen.init(jnp.zeros(5)), adam.init(jnp.zeros(5))
    for step in range(4):
        update, state = frozen.update(grads[step], state)
        expected, adam_state = adam.update(grads[step], adam_state)
        np.testing.assert_allclose(update, expected, rtol=1e-6, atol=1e-9)
    # After the freeze: v and its bias correction stay; the update is lr * m_hat / sqrt(v_hat), m as
    # Adam's.
    nu = state.nu
    np.testing.assert_array_equal(nu, adam_state[0].nu)
    mu = np.asarray(state.mu, np.float64)
    for step in range(4, 9):
        update, state = frozen.update(grads[step], state)
        np.testing.assert_array_equal(state.nu, nu)
        mu = 0.9 * mu + 0.1 * np.asarray(grads[step], np.float64)
        expected = (
            -schedule(step) * (mu / (1 - 0.9 ** (step + 1))) / (np.sqrt(nu / (1 - 0.999**4)) + 1e-8)
        )
        np.testing.assert_allclose(update, expected, rtol=1e-4, atol=1e-8)
    # Linear: 3 steps of g, or 3g at once, move the params as far in total (Adam would move the
    # burst less).
    one = jnp.ones(5)
    totals = []
    for burst in ([one, one, one] + [0 * one] * 150, [3 * one] + [0 * one] * 152):
        tx = quality.adam_frozen_variance(1e-2, freeze_after=1)
        # Far past Adam's bias correction of the momentum, which would weigh the two differently.
        state = tx.init(jnp.zeros(5))._replace(
            count=jnp.asarray(1000, jnp.int32), nu=jnp.full(5, 1e-3)
        )
        total = 0.0
        for g in burst:
            update, state = tx.update(g, state)
            total = total + update
        totals.append(np.asarray(total))
    np.testing.assert_allclose(totals[0], totals[1], rtol=1e-3)


def test_optimizer_names_build_what_they_say_and_bad_names_are_refused():
    import re

    import jax.numpy as jnp
    import numpy as np
    import optax
    import pytest

    quality = _quality_module()
    config = quality.Config(steps=10, warmup=2)

    def schedule(peak):  # the script's warm-up + cosine, to its peak
        return optax.warmup_cosine_decay_schedule(0.0, peak, 2, 10, end_value=0.1 * peak)

    def second_update(tx):  # the first is 0: the schedule starts at 0
        grads = jnp.asarray([1.0, -2.0, 3.0])
        state = tx.init(jnp.zeros(3))
        _, state = tx.update(grads, state)
        return np.asarray(tx.update(0.5 * grads, state)[0])

    expected = {
        "adam": optax.adam(schedule(config.learning_rate)),
        "adam(b1=0,lr=1e-3)": optax.adam(schedule(1e-3), b1=0.0),
        "adam(frozen=3)": quality.adam_frozen_variance(schedule(config.learning_rate), 3),
        "sgd(lr=0.3)": optax.sgd(schedule(0.3)),
        "sgd(lr=0.3,momentum=0.9)": optax.sgd(schedule(0.3), momentum=0.9),
    }
    for name, tx in expected.items():
        np.testing.assert_allclose(
            second_update(quality.optimizer(name, config)),
            second_update(tx),
            rtol=1e-6,
            err_msg=name,
        )
    for bad in ("rmsprop", "sgd(momentum=0.9)", "adam(b1=x)", "adam(momentum=0.9)"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            quality.optimizer(bad, config)


def test_rows_have_unique_comma_free_names_and_known_optimizers():
    quality = _quality_module()
    assert quality.MODELS["small"] == quality.Config()
    # --methods splits on commas; every variant's whole optimizer must build.
    rows = quality.rows() + quality.variants()
    assert len({row.name for row in rows}) == len(rows)
    assert not [row.name for row in rows if "," in row.name]
    for row in rows:
        assert quality.transformation(row, quality.Config()).init is not None
    # The default run is the issues' list: dense, 10 methods and auto, each once.
    names = [row.name for row in quality.rows()]
    assert names[0] == "dense" and names[-1] == "auto@1gbit" and len(names) == 12


def test_large_model_has_a_few_million_parameters():
    quality = _quality_module()
    assert 2_000_000 < quality.count_params(quality.MODELS["large"]) < 5_000_000
