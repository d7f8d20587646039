"""`jaxcomp demo` reads at a glance (issue 25): a verdict table computed from the numbers, one
column of panels per family with distinct lines and the legend outside, and random-k's optimizer
pairing. Built from made-up results: no training, a few seconds."""

import csv
import math

import jax.numpy as jnp
import matplotlib.pyplot
import numpy as np
import optax
import pytest

from jaxcomp.cli import demo

START = 2.30  # the eval loss of the initial params (ln 10, chance level)
DENSE_HITS = 352  # of 359 test images


def _result(name, family, hits, losses, bytes_sent=1000.0, note=""):
    """A run's results as :func:`demo.train` returns them, with ``hits`` of 359 images right at
    the end and the eval losses ``losses`` after step 0."""
    steps = range(0, 25 * (len(losses) + 1), 25)
    curve = list(zip(steps, [START, *losses]))
    return {
        "name": name,
        "family": family,
        "note": note,
        "train_loss": np.full(50, 1.0),
        "eval_curve": curve,
        "accuracy_curve": [(step, 0.1 + 0.8 * i / len(losses)) for i, step in enumerate(steps)],
        "eval_loss": losses[-1],
        "eval_accuracy": hits / 359,
        "bytes_sent": bytes_sent,
        "density": bytes_sent / 100_000,
        "method": name,
        "gain": 1.0,
        "step_time": 0.004,
    }


RESULTS = [
    _result("dense", "", DENSE_HITS, [0.5, 0.1], bytes_sent=100_000.0, note="the reference"),
    # 0.84 points below dense: within; 1.11 below: not (the test set has 359 images).
    _result("ar_topk", demo.TOPK, DENSE_HITS - 3, [0.6, 0.12], bytes_sent=2000.0),
    _result("allgather_topk_noef", demo.TOPK, DENSE_HITS - 4, [0.6, 0.2], note="no EF"),
    _result("zfp", demo.CODECS, DENSE_HITS + 2, [0.5, 0.09], bytes_sent=25_000.0),
    # slow but never above twice the start: "no", not "diverged"
    _result("randomk_noef", demo.SPARSE_AND_LOW_RANK, 276, [2.2, 1.7]),
    # blew up and came back: diverged all the same
    _result("randomk", demo.SPARSE_AND_LOW_RANK, 300, [2.1 * START, 0.5]),
    _result("sign", demo.SPARSE_AND_LOW_RANK, 40, [1e5, math.nan]),
    _result("auto", demo.AUTO, DENSE_HITS, [0.5, 0.1]),
]
EXPECTED = {
    "dense": "yes",
    "ar_topk": "yes",
    "allgather_topk_noef": "no",
    "zfp": "yes",
    "randomk_noef": "no",
    "randomk": "diverged",
    "sign": "diverged",
    "auto": "yes",
}


def test_verdict_table_has_its_columns_and_verdicts_from_the_numbers():
    lines = demo.format_table(RESULTS).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(demo.TABLE_HEADER)
    rows = {
        cells[0]: cells
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    }
    column = {title: i for i, title in enumerate(demo.TABLE_HEADER)}
    assert {
        name: cells[column["within 1 pt of dense?"]] for name, cells in rows.items()
    } == EXPECTED
    assert rows["ar_topk"][column["vs dense (pt)"]] == f"{-300 / 359:+.2f}"
    assert rows["ar_topk"][column["vs dense"]] == "0.0200"
    assert rows["ar_topk"][column["eval accuracy"]] == f"{100 * 349 / 359:.2f}%"
    assert rows["allgather_topk_noef"][column["setting / trade-off"]] == "no EF"
    # Without a dense run there is nothing to be within.
    alone = demo.verdicts([r for r in RESULTS if r["name"] != "dense"])
    assert {v["run"]: v["within"] for v in alone}["zfp"] == "-"
    assert math.isnan(alone[0]["bytes_vs_dense"])


def test_verdict_files_hold_the_table_and_its_numbers(tmp_path):
    md, path = demo.save_tables(RESULTS, str(tmp_path))
    with open(md) as f:
        assert f.read() == demo.format_table(RESULTS) + "\n"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["run"] for row in rows] == [r["name"] for r in RESULTS]
    assert {row["run"]: row["within"] for row in rows} == EXPECTED
    ar_topk = rows[1]
    assert float(ar_topk["bytes_vs_dense"]) == 0.02
    assert float(ar_topk["accuracy"]) == pytest.approx(100 * 349 / 359)


def test_plot_has_a_column_per_family_dense_in_each_and_the_legend_outside():
    fig = demo.figure(RESULTS)
    axes = np.array(fig.axes).reshape(2, -1)
    families = [demo.TOPK, demo.CODECS, demo.SPARSE_AND_LOW_RANK, demo.AUTO]
    assert axes.shape == (2, len(families))
    fig.canvas.draw()
    for column, family in enumerate(families):
        ax_loss, ax_accuracy = axes[:, column]
        assert ax_loss.get_title().startswith(family)
        assert ax_loss.get_yscale() == "log"
        members = [r["name"] for r in RESULTS if r["family"] == family]
        for ax in (ax_loss, ax_accuracy):
            lines = ax.get_lines()
            assert len(lines) == 1 + len(members)
            assert lines[0].get_color() == "black"  # dense, the reference
            looks = {(line.get_color(), str(line.get_linestyle())) for line in lines}
            assert len(looks) == len(lines), f"{family}: two lines look alike"
        legend = ax_accuracy.get_legend()
        labels = [text.get_text() for text in legend.get_texts()]
        assert [label.split(":")[0] for label in labels] == ["dense", *members]
        # Below its column: it covers no curve.
        box, panel = legend.get_window_extent(), ax_accuracy.get_window_extent()
        assert box.y1 < panel.y0
    diverged = [
        t.get_text() for t in axes[1, 2].get_legend().get_texts() if "diverged" in t.get_text()
    ]
    assert [label.split(":")[0] for label in diverged] == ["randomk", "sign"]
    matplotlib.pyplot.close(fig)


def test_runs_have_a_family_and_random_k_its_pairing():
    all_runs = demo.runs(0.01)
    assert {run.family for run in all_runs.values()} == {"", *demo.FAMILIES}
    paired = {name for name, run in all_runs.items() if run.momentum_free}
    assert paired == {"randomk", "randomk_10x"}
    assert all_runs["randomk_10x"].method.ratio == pytest.approx(0.1)
    assert demo.runs(0.5)["randomk_10x"].method.ratio == 1.0


@pytest.mark.parametrize(
    "name, momentum_free, steps",
    [
        ("momentum", False, [-0.05, -0.05 * 1.9]),  # heavy ball: the velocity grows toward 10 g
        ("momentum", True, [-0.5, -0.5]),  # no momentum, momentum SGD's steady step
        ("adam", True, [-0.05, -0.05]),  # b1=0: every step is lr * sign(g) for a constant g
    ],
)
def test_optimizer_pairing_reference(name, momentum_free, steps):
    tx = demo.make_optimizer(name, 0.05, momentum_free)
    g = {"w": jnp.ones(3)}
    state = tx.init(g)
    for expected in steps:
        update, state = tx.update(g, state)
        np.testing.assert_allclose(update["w"], expected, rtol=1e-5)
    assert isinstance(tx, optax.GradientTransformation)
