"""What importing jaxcomp costs: ``python -X importtime`` of the package, the cost model and the
advisor, and the wall time of ``jaxcomp advise --help``, each in a fresh interpreter.

    python benchmarks/imports.py                        # the jaxcomp this Python imports
    python benchmarks/imports.py --path src --path /tmp/old   # compare source trees side by side

Reports the median of ``--repeats`` runs of the sum of the top-level imports' cumulative times, and
whether JAX was loaded. Results go to BENCHMARKS.md.
"""

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time

# Each case with its spellings: the layered package's (issue 23) first, then the flat 0.1 tree's, so
# that trees from before and after the move compare side by side.
CASES = (
    ("import jaxcomp",),
    ("import jaxcomp.costmodel.cost", "import jaxcomp.cost"),
    ("import jaxcomp.cli.advise", "import jaxcomp.advise"),
    ("import jaxcomp; jaxcomp.compress",),
)


def import_seconds(code, path, repeats):
    """Median seconds of the top-level imports of ``code``, and whether ``jax`` was imported."""
    env = dict(os.environ, PYTHONPATH=path or "")
    times, jax_loaded = [], False
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code],
            env=env,
            capture_output=True,
            text=True,
            cwd="/",
        )
        if out.returncode:
            return None, out.stderr
        total = 0
        for line in out.stderr.splitlines():
            match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
            if match and len(match.group(2)) == 1:
                total += int(match.group(1))
            if match and match.group(3) == "jax":
                jax_loaded = True
        times.append(total / 1e6)
    return statistics.median(times), jax_loaded


def _first_that_imports(spellings, path, repeats):
    """``(code, seconds, jax_loaded)`` of the first spelling the tree at ``path`` can import."""
    for code in spellings:
        seconds, jax_loaded = import_seconds(code, path, repeats)
        if seconds is not None:
            return code, seconds, jax_loaded
    raise SystemExit(
        f"none of {spellings} imports from {path or 'the installed jaxcomp'}:\n{jax_loaded}"
    )


def help_seconds(path, repeats):
    env = dict(os.environ, PYTHONPATH=path or "")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "jaxcomp", "advise", "--help"],
            env=env,
            capture_output=True,
            cwd="/",
            check=True,
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--path",
        action="append",
        default=None,
        help="a directory to import jaxcomp from (PYTHONPATH); repeat to compare trees",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    paths = args.path or [None]
    print(
        f"# {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, median "
        f"of {args.repeats} fresh interpreters"
    )
    print("| jaxcomp from | what | import time | loads JAX |")
    print("|---|---|---:|---|")
    for path in paths:
        for spellings in CASES:
            code, seconds, jax_loaded = _first_that_imports(spellings, path, args.repeats)
            print(
                f"| {path or 'installed'} | `{code}` | {seconds:.3f} s | "
                f"{'yes' if jax_loaded else 'no'} |"
            )
        print(
            f"| {path or 'installed'} | `python -m jaxcomp advise --help` (wall, interpreter "
            f"included) | {help_seconds(path, args.repeats):.3f} s | |"
        )


if __name__ == "__main__":
    main()
