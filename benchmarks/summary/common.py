"""What every section of the summary shares: where the results are, reading them, and saying
which commit and date a result file comes from."""

from __future__ import annotations

import functools
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join("benchmarks", "results")


def load(path: str):
    """The JSON of ``path``, relative to the repository's root."""
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def result(name: str) -> str:
    """``benchmarks/results/<name>``: the path of a result file, relative to the root."""
    return os.path.join(RESULTS, name)


@functools.cache  # one git call a file, however many tables name it
def stamp(path: str) -> str:
    """``"<short commit> <date>"`` of the last commit that touched ``path`` (relative to the
    root), or ``"uncommitted"``."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h %ad", "--date=short", "--", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return out or "uncommitted"


def sources(paths) -> str:
    """``"`a.json` (abc1234 2026-12-02), ..."``: the files a table read, with their stamps."""
    return ", ".join(f"`{p}` ({stamp(p)})" for p in paths)
