"""The figures of the note ``2026-12-05-fault-tolerant-diloco.md`` from ``probe.py``'s JSON.

    python summarize.py results.json > summary.json

For each scenario and process: exit code, seconds from the kill to its exit, to its first error,
to its first step on fewer processes than the job and to its first step with the restarted
process back, the last error's message, and where its main thread was when the probe killed it
at its deadline (innermost frames first). Times count from the faulty process's
``killing-self`` event.
"""

from __future__ import annotations

import json
import sys


def _first(events, kind, test=lambda e: True):
    return next((e for e in events if e["event"] == kind and test(e)), None)


def _since(event, t0):
    return None if event is None else round(event["t"] - t0, 2)


def _frame(line: str) -> str:
    """``File ".../multihost_utils.py", line 540 in _live_devices`` as
    ``multihost_utils.py:540 _live_devices``."""
    path, _, rest = line.partition('", line ')
    number, _, function = rest.partition(" in ")
    return f"{path.rsplit('/', 1)[-1]}:{number} {function}"


def summarize(record: dict) -> dict:
    killed = next(
        e["t"] for r in record["records"] for e in r["events"] if e["event"] == "killing-self"
    )
    n = record["processes"]
    rows = []
    for r in record["records"]:
        events = [e for e in r["events"] if e["t"] >= killed]
        error = _first(events, "error")
        errors = [e for e in events if e["event"] == "error"]
        shrunk = _first(events, "step", lambda e: len(e["processes"]) < n)
        regrown = None
        if shrunk is not None:
            regrown = _first(
                events, "step", lambda e: len(e["processes"]) == n and e["t"] > shrunk["t"]
            )
        steps = [e for e in events if e["event"] == "step"]
        rows.append(
            {
                "role": r["role"],
                "process": r["process"],
                "incarnation": r["incarnation"],
                "returncode": r["returncode"],
                "exit_s": round(r["exited_t"] - killed, 2) if r.get("exited_t") else None,
                "first_error_s": _since(error, killed),
                "errors": len(errors),
                "error_kinds": sorted({e["kind"] for e in errors}),
                "first_step_without_faulty_s": _since(shrunk, killed),
                "first_step_with_all_again_s": _since(regrown, killed),
                "steps_after_kill": len(steps),
                "last_processes": steps[-1]["processes"] if steps else None,
                "last_total": steps[-1]["total"] if steps else None,
                "last_error": errors[-1]["message"][:240] if errors else None,
                "fatal": next((x[:300] for x in r["fatal_log"] if "Terminating" in x), None),
                "stack_at_deadline": [_frame(x) for x in r.get("stack_at_deadline", [])[:3]],
            }
        )
    return {"faulty": record["faulty"], "rows": rows}


def main() -> None:
    with open(sys.argv[1]) as f:
        results = json.load(f)
    json.dump({k: summarize(v) for k, v in results.items()}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
