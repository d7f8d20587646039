"""The quality zoo with the guardrail's burn-in check off (the code before it): run from the
repository root, with quality_zoo.py's arguments."""

import pathlib
import runpy
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import jaxcomp.optim.stages.divergence as divergence  # noqa: E402

divergence.BURN_IN_SLACK = float("inf")
sys.argv = ["quality_zoo.py"] + sys.argv[1:]
runpy.run_path(str(BENCHMARKS / "quality_zoo.py"), run_name="__main__")
