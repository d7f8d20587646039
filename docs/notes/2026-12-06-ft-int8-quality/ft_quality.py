"""Fault-tolerant DiLoCo's pseudo-gradient codecs against data-parallel: final held-out loss and
bytes, 4 workers, two tasks, two learning rates.

    python ft_quality.py --tasks charlm,mlp-charlm --rows dp,ft-h50-avg,ft-h50-avg-int8 \
        --lr-scales 1,2
    python ft_quality.py --table          # the figures of results.json

``dp`` and every task are the SparseLoCo note's (``../2026-12-05-sparseloco-quality``: the same
params, batches, schedules and held-out batch; ``charlm`` is time to quality's small char-LM,
``mlp-charlm`` the quality zoo's quietest task). A ``ft-`` row is
:func:`jaxcomp.distributed.diloco_ft.diloco_ft` itself: 4 workers in threads of this process,
each on its own CPU device with its own ``Quorum`` on a coordination service in this process,
worker ``r`` training rows ``r*B/4 .. (r+1)*B/4`` of every global batch (the same samples as
dp's), Adam at the task's schedule inside, ``optax.sgd(1.0)`` outside (plain averaging, the
``diloco-h50-avg`` row's), ``-int8`` sending :class:`jaxcomp.distributed.ft_codecs.Int8` payloads
(with its error feedback), ``-eager`` running each exchange on a host thread beside the next
round (``diloco_ft(eager=True)``). Results go to ``results.json`` beside this script, one
record a run; a run there already is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-05-sparseloco-quality"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "benchmarks"))
RESULTS = os.path.join(HERE, "results.json")
WORKERS = 4
FAILURE_TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(row: str):
    """``(sync_every, codec, eager)`` of an ``ft-hH-avg[-int8][-eager]`` row."""
    from jaxcomp.distributed.ft_codecs import Int8

    parts = row.split("-")
    if parts[0] != "ft" or not parts[1].startswith("h") or parts[2] != "avg":
        raise ValueError(f"not an ft row: {row}")
    if not set(parts[3:]) <= {"int8", "eager"}:
        raise ValueError(f"unknown options in {row}")
    return int(parts[1][1:]), Int8() if "int8" in parts else None, "eager" in parts


def _worker(rank, address, task, lr, row, steps, eval_every, out):
    """One worker's run; worker 0 records the global params' held-out loss and its bytes."""
    import jax
    import optax

    from jaxcomp.distributed.diloco_ft import diloco_ft
    from jaxcomp.distributed.quorum import Quorum

    sync_every, codec, eager = _row(row)
    device = jax.devices("cpu")[rank]
    evaluate = jax.jit(task.loss_fn)
    with Quorum(address, rank, WORKERS, failure_timeout=FAILURE_TIMEOUT) as quorum:
        run = diloco_ft(
            task.loss_fn, optax.adam(lr), optax.sgd(1.0), quorum=quorum,
            sync_every=sync_every, sync_timeout=600, codec=codec, eager=eager,
        )  # fmt: skip
        state = run.init(jax.device_put(task.params, device))
        sent, curve = 0, []
        for step in range(steps):
            rows = lambda x: x[rank * len(x) // WORKERS : (rank + 1) * len(x) // WORKERS]  # noqa: E731
            state, metrics = run.step(state, jax.tree.map(rows, task.batch(step)))
            sent += metrics["bytes_sent"]
            if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
                curve.append((step + 1, float(evaluate(run.params(state), task.heldout))))
        run.params(state)  # eager: the exchange in flight ends before the quorum closes
    out[rank] = dict(heldout_loss=curve[-1][1] if curve else None, bytes=sent, curve=curve)


def _ft(name: str, row: str, scale: float, steps: int, eval_every: int) -> dict:
    """4 ``diloco_ft`` workers in threads on a service of their own: worker 0's record."""
    from sparseloco_quality import _task

    from jaxcomp.distributed import quorum

    task, lr = _task(name, scale, steps)
    address = f"127.0.0.1:{_free_port()}"
    service = quorum.host_service(address, WORKERS, failure_timeout=FAILURE_TIMEOUT)
    out, errors = {}, []

    def work(rank):
        try:
            _worker(rank, address, task, lr, row, steps, eval_every, out)
        except BaseException as e:  # raised by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(WORKERS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        service.shutdown()
    if errors:
        raise errors[0]
    return out[0]


def measure(task: str, row: str, scale: float, steps: int, eval_every: int) -> dict:
    """One run's record: the task, row, lr scale, steps, final held-out loss, bytes, seconds."""
    import sparseloco_quality

    started = time.perf_counter()
    if row.startswith("ft-"):
        record = _ft(task, row, scale, steps, eval_every)
        record.update(task=task, row=row, lr_scale=scale, steps=steps)
    else:
        record = sparseloco_quality.measure(task, row, scale, steps, eval_every)
    record["seconds"] = time.perf_counter() - started
    return record


def main(argv=None) -> int:
    import sparseloco_quality

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="charlm,mlp-charlm")
    parser.add_argument("--rows", default="dp,ft-h50-avg,ft-h50-avg-int8")
    parser.add_argument("--lr-scales", default="1,2")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=150)
    parser.add_argument("--table", action="store_true", help="print the results' table")
    args = parser.parse_args(argv)
    results = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    if args.table:
        print(sparseloco_quality.table(results))
        return 0
    sparseloco_quality.grid(args, results, measure, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
