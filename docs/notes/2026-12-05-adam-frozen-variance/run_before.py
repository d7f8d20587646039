"""benchmarks/quality_zoo.py against jaxcomp as of d695157, before the variance floor: the
"before" runs of the note. Unpack that commit's package beside its compiled module first:

    git archive d695157 src/jaxcomp | tar -x -C /tmp/old
    cp .venv/lib/python3.11/site-packages/jaxcomp/_jaxcomp_cpu*.so /tmp/old/src/jaxcomp/
    python run_before.py --tasks mlp-charlm --pairings dense,adam:dense,adam:sign \\
        --lr-scales 1,2 --schedules constant --out /tmp/old/before

The editable install's import hook is dropped so that the old sources load; the old step has no
``rejected`` metric, so it counts 0.
"""

import os
import sys

sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, "/tmp/old/src")
import jaxcomp  # noqa: E402

assert jaxcomp.__file__.startswith("/tmp/old"), jaxcomp.__file__
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "..", "benchmarks"))
import quality_zoo  # noqa: E402

_train = quality_zoo.train


def train(task, pairing, lr_scale, schedule, steps, devices):
    """quality_zoo.train with a zero ``rejected`` metric added to the old step's metrics."""
    import jax

    import jaxcomp.training.step as step

    original = step._metrics

    def metrics(*args):
        out = original(*args)
        out["rejected"] = jax.numpy.zeros_like(out["loss"])
        return out

    step._metrics = metrics
    return _train(task, pairing, lr_scale, schedule, steps, devices)


quality_zoo.train = train
sys.exit(quality_zoo.main(sys.argv[1:]))
