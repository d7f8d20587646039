"""Eager DiLoCo against synchronous DiLoCo and data-parallel: final held-out loss, 4 workers.

    python eager_quality.py --tasks charlm,mlp-charlm --lr-scales 1,2
    python eager_quality.py --table          # the figures of results.json

The harness of ``../2026-12-05-sparseloco-quality/sparseloco_quality.py`` (same tasks, params,
batches, schedules and table), with its zoo runs built from the whole row (fragments, delay and
``eager`` too), and its own results file beside this script.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-05-sparseloco-quality"))

import sparseloco_quality as harness  # noqa: E402

ROWS = (
    "dp,diloco-h50,diloco-h50-avg,diloco-h50-avg-eager,diloco-h50-avg-int8,"
    "diloco-h50-avg-eager4-int8"
)


def _zoo_run(task, row: str, lr, devices):
    """The zoo task's run of ``row``: ``data_parallel`` for dp, else ``jaxcomp.diloco`` with
    every setting of the to_loss row (its H, fragments, delay, eager, outer optimizer, codec, and
    Muon inside for a ``-muon`` row)."""
    import numpy as np
    import optax
    import quality_zoo
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training import to_loss

    if row == "dp":
        tx = quality_zoo.transformation("dense", lr)
        return jaxcomp.data_parallel(task.loss_fn, tx, Mesh(np.array(devices), ("data",)))
    options = dict(to_loss._row_options(row))
    options.pop("kind")
    method = to_loss.codec(options.pop("compress", None) or "none")
    inner = jaxcomp.muon(lr) if options.pop("inner", None) == "muon" else optax.adam(lr)
    return jaxcomp.diloco(
        task.loss_fn,
        inner,
        to_loss._outer(options.pop("outer")),
        mesh=Mesh(np.array(devices), ("workers",)),
        compress=method and jaxcomp.compress(method, axis_name="workers"),
        **options,
    )


if __name__ == "__main__":
    harness._zoo_run = _zoo_run
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv += ["--out", os.path.join(HERE, "results.json")]
    if "--rows" not in argv:
        argv += ["--rows", ROWS]
    sys.exit(harness.main(argv))
