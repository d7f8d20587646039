"""The summary's GPU section: what has run on a GPU, read from the logs ``ci/gpu_check.sh`` left
(no GPU result file holds a number yet), with the account in docs/gpu.md linked, not quoted."""

from __future__ import annotations

import os
import re

from summary import common

RUN = common.result("gpu_h200_2026-11-28")
#: ``ci/gpu_check.sh``'s stages in its order, what each does; the run left a log for some.
STAGES = {
    "env": "the GPU, its driver, Python, jax and nvcc",
    "build": "an in-place build of the CPU and CUDA modules",
    "tests": "`tests/gpu_test.py` (CUDA kernels against the CPU's, training on one GPU) and "
    "`tests/cuda_module_test.py`",
    "kernels": "`benchmarks/kernels.py --device gpu` against docs/gpu.md's speed targets",
    "passes": "`benchmarks/passes.py` on the GPU: each method's local work",
}
FILES = tuple(os.path.join(RUN, f"{stage}.log") for stage in ("env", "build", "tests"))
DOC = os.path.join("docs", "gpu.md")
#: The start of docs/gpu.md's heading for the run (the rest, device and date, is read from it).
HEADING = "On a GPU, once"

STILL_SHORT = (
    "**Still short:** the fixes for what failed have not run on a GPU since; the top-k "
    "comparisons, the top-k methods training on one GPU and every speed target in docs/gpu.md "
    "(`benchmarks/kernels.py`, `benchmarks/passes.py`) are still to run on one."
)


def _read(path: str) -> str:
    with open(os.path.join(common.ROOT, path)) as f:
        return f.read()


def machine(env: str) -> str:
    """``"NVIDIA H200 (driver ..., ... MiB), jax ..., nvcc ..., N cores"`` from env.log."""
    lines = env.strip().splitlines()
    gpu = [field.strip() for field in lines[1].split(",")]
    jax = next((line for line in lines if line.startswith("jax ")), "jax ?").split()[1]
    nvcc = re.search(r"release ([\d.]+), (V[\d.]+)", env)
    compiler = f", nvcc {nvcc.group(1)} ({nvcc.group(2)})" if nvcc else ""
    return f"{gpu[0]} (driver {gpu[1]}, {gpu[2]}), jax {jax}{compiler}, {lines[-1]} cores"


def built(log: str) -> str:
    """What build.log says: the steps ninja ran and whether the CUDA module loaded."""
    steps = re.findall(r"^\[(\d+)/(\d+)\]", log, flags=re.M)
    ran = f"{steps[-1][0]} of {steps[-1][1]} build steps" if steps else "no build step"
    loaded = re.search(r"^HAS_CUDA (\w+)", log, flags=re.M)
    return f"{ran}; `HAS_CUDA` {loaded.group(1) if loaded else 'not printed'}"


def tested(log: str) -> str:
    """pytest's last line: ``"36 failed, 38 passed in 40.59s"``."""
    summary = re.findall(r"^=* ?(\d+ \w+(?:, \d+ \w+)* in [\d.]+s)", log, flags=re.M)
    return summary[-1] if summary else "no pytest summary"


def failures(log: str) -> list:
    """``[(test file, test, failed cases, errors)]``: pytest's failure sections grouped by test
    function; ``errors`` says each distinct error once, with its count when the cases differ."""
    parts = re.split(r"^_{3,} (\S+) _{3,}$", log, flags=re.M)
    grouped = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        where = re.search(r"^(tests/\S+\.py):\d+", body, flags=re.M)
        key = (where.group(1) if where else "?", name.split("[")[0])
        errors = grouped.setdefault(key, {})
        error = first_error(body)
        errors[error] = errors.get(error, 0) + 1
    out = []
    for (path, test), errors in grouped.items():
        told = [e if len(errors) == 1 else f"{e} ({n})" for e, n in errors.items()]
        out.append((path, test, sum(errors.values()), "; ".join(told)))
    return out


def first_error(body: str) -> str:
    """The first exception of a failure section: its class and the first sentence of its
    message (the message's numbers, sizes and operands, as N)."""
    lines = [line[1:].strip() for line in body.splitlines() if re.match(r"E\s+\S", line)]
    for at, line in enumerate(lines):
        found = re.search(r"(\w+(?:Error|Exception))\b:?\s*(.*)$", line)
        if found:
            name, message = found.groups()
            if not message and at + 1 < len(lines):
                message = lines[at + 1]
            message = re.sub(r"\s*\[executable_name=[^\]]*\]", "", message)
            message = re.split(r"\. |, so ", message)[0].strip()
            return f"`{name}`: {re.sub(r'[0-9]+', 'N', message)}"
    return "?"


def doc_link() -> str:
    """A link to docs/gpu.md's section on the run, titled as the heading reads."""
    heading = next(
        line.lstrip("#").strip()
        for line in _read(DOC).splitlines()
        if line.startswith("#") and line.lstrip("#").strip().startswith(HEADING)
    )
    anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    return f'[docs/gpu.md, "{heading}"]({DOC}#{anchor})'


def section() -> str:
    """The Markdown of the section."""
    logs = {s: os.path.join(RUN, f"{s}.log") for s in STAGES}
    have = {s: p for s, p in logs.items() if os.path.exists(os.path.join(common.ROOT, p))}
    found = {"env": machine, "build": built, "tests": tested}
    lines = [
        "## What has run on a GPU",
        "",
        "One run of `ci/gpu_check.sh` on a lent GPU: each stage's log, and what it says. What the "
        f"failures were and how they were fixed, and what passed: {doc_link()}.",
        "",
        f'Command: `ci/gpu_check.sh OUT` (docs/gpu.md, "Verify and benchmark on a GPU"); '
        f"machine: {machine(_read(logs['env']))}. Results: {common.sources(FILES)}.",
        "",
        "| stage | what it runs | log | found |",
        "|---|---|---|---|",
    ]
    for stage, what in STAGES.items():
        if stage in have:
            text = _read(have[stage])
            shown = found[stage](text) if stage in found else "see the log"
            lines.append(f"| {stage} | {what} | `{os.path.basename(have[stage])}` | {shown} |")
        else:
            lines.append(f"| {stage} | {what} | - | not run: no log |")
    lines += [
        "",
        "| test file | test | failed cases | error (cases, where they differ) |",
        "|---|---|---:|---|",
    ]
    for path, test, count, error in failures(_read(logs["tests"])):
        lines.append(f"| `{path}` | `{test}` | {count} | {error} |")
    lines += ["", STILL_SHORT]
    return "\n".join(lines)
