"""benchmarks/split_repeats.py: SPLIT's repeated slots counted as the collective marks them, and
the script end to end on quality.py's tiny model."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark, need_devices, subprocess_env
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "split_repeats.py"
)


def _script():
    return load_benchmark("split_repeats")


def test_count_repeats_sees_the_collectives_padding():
    """Two devices pick [0, 3] and [0, 1] of 4 shared slots: index 0 twice, one slot of padding,
    seen by each device; the wrapped function's indices are the original's."""
    need_devices(2)
    from jaxcomp.collectives import topk

    seen = []
    original = _script().count_repeats(lambda *counts: seen.append(counts))
    try:
        mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
        f = jax.jit(
            jax.shard_map(
                lambda x: topk.split_indices(x, 4, "data"),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )
        shared = f(jnp.array([9.0, 0, 0, 8, 9, 7, 0, 0]))
        jax.effects_barrier()
    finally:
        topk.split_indices = original
    assert shared.tolist() == [0, 4, 1, 3]
    assert sorted(seen) == [(1, 4, 0), (1, 4, 1)]


def test_summarize_windows_and_shares():
    summary = _script().summarize([2, 4] + [0] * 60, 8)
    assert summary[0] == {"steps": [0, 50], "mean": 6 / 50, "max": 4, "share": 6 / 50 / 8}
    assert summary[1]["steps"] == [50, 62] and summary[1]["max"] == 0


@pytest.mark.slow  # a training run of its own
def test_quick_run_counts_every_split_step(tmp_path):
    out = tmp_path / "repeats.json"
    result = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--steps", "4", "--json", str(out)],
        env=subprocess_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["counts"]) == 4 and data["slots"] > 0
    assert all(0 <= c < data["slots"] for c in data["counts"])
    assert "| SPLIT steps |" in result.stdout
    for row in ("dense", "ar_topk_star(0.01)", "allgather_topk(0.01)"):  # not SPLIT's leader
        bad = subprocess.run(
            [sys.executable, SCRIPT, "--row", row],
            env=subprocess_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2 and "with SPLIT's leader" in bad.stderr, bad.stderr[-2000:]
