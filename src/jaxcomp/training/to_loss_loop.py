"""The timed loop of time to quality: step a compiled run, evaluate the held-out loss on a
schedule, stop at a target, and record the curve; and the curve's figures.

The clock runs over the steps only; the evaluations are left out. In a multi-process job every
process runs the loop (each with its rows of every batch); process 0 evaluates and every process
waits for its result. :mod:`jaxcomp.training.to_loss` builds the rows' runs and calls it.
"""

from __future__ import annotations

import time


class _Clock:
    """Wall-clock and CPU seconds of the training steps, with evaluations left out."""

    def __init__(self):
        self.seconds = self.cpu = 0.0

    def start(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self):
        self.seconds += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def _local(tree):
    """This process's copy of replicated arrays, on its first local device."""
    import jax

    from jaxcomp.optim import host

    return jax.device_put(jax.tree.map(host.value, tree), jax.local_devices()[0])


def _held_out(evaluate, params, heldout):
    """The held-out loss of ``params``, evaluated by process 0 and broadcast to every host: the
    hosts agree on it, and leave together (the clock restarts on every host at once)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    mine = jax.process_index() == 0
    loss = float(evaluate(_local(params), heldout)) if mine else 0.0
    if jax.process_count() == 1:
        return loss
    return float(multihost_utils.broadcast_one_to_all(np.float32(loss)))


def timed_curve(
    run,
    state,
    batch,
    *,
    steps,
    eval_every,
    evaluate,
    params,
    heldout,
    target=None,
    log=None,
    wire=None,
):
    """Steps ``run`` for ``steps`` steps, or until an evaluation reaches ``target``; the curve.

    Args:
      run: a ``data_parallel`` or ``diloco`` run (its ``step``, ``shard_batch`` and ``params``).
      state: the run's state, its step compiled already (the clock counts no compilation).
      batch: ``batch(step)``, this process's batch of a step.
      steps: the most steps to run.
      eval_every: steps between held-out evaluations (and after the last step).
      evaluate: ``evaluate(params, heldout)``, the held-out loss.
      params: the initial params: the curve's step 0.
      heldout: the held-out batch.
      target: stop at the first evaluation at or below this held-out loss (None: never).
      log: called with a line per evaluation.
      wire: a callable returning the bytes this host's network interface has sent, or None.

    Returns:
      One point per evaluation: ``{"step", "seconds", "cpu", "loss", "bytes", "wire"}``
      (training time, CPU time, held-out loss, the run's bytes sent per device so far, and what
      ``wire()`` grew by, or None).

    Example:
      >>> import types, jax.numpy as jnp
      >>> halving = types.SimpleNamespace(  # a stand-in run: a step halves, sending 4 bytes
      ...     step=lambda s, b: (s / 2, {"bytes_sent": jnp.float32(4.0)}),
      ...     shard_batch=lambda b: b, params=lambda s: s)
      >>> curve = timed_curve(halving, jnp.float32(8.0), lambda step: {}, steps=3,
      ...                     eval_every=1, evaluate=lambda p, _: p, params=jnp.float32(8.0),
      ...                     heldout=None, target=2.0)
      >>> [(p["step"], p["loss"], p["bytes"]) for p in curve]
      [(0, 8.0, 0.0), (1, 4.0, 4.0), (2, 2.0, 8.0)]

    References:
      Mattson et al., "MLPerf Training Benchmark" (MLSys 2020): time to a target quality, the
      measure of training speed.
    """
    import jax

    from jaxcomp.optim import host

    clock, sent, total, wire0 = _Clock(), [], 0.0, wire and wire()
    curve = [dict(step=0, seconds=0.0, cpu=0.0, loss=_held_out(evaluate, params, heldout))]
    curve[0].update(bytes=0.0, wire=0 if wire0 is not None else None)
    for step in range(steps):
        clock.start()
        state, metrics = run.step(state, run.shard_batch(batch(step)))
        sent.append(metrics["bytes_sent"])
        if (step + 1) % eval_every and step + 1 < steps:
            clock.stop()
            continue
        jax.block_until_ready(state)
        clock.stop()
        loss = _held_out(evaluate, run.params(state), heldout)
        total += sum(float(host.scalar(b)) for b in sent)
        sent.clear()  # read once each: the host reads them at evaluations only
        wired = None if wire0 is None else wire() - wire0
        curve.append(dict(step=step + 1, seconds=clock.seconds, cpu=clock.cpu, loss=loss))
        curve[-1].update(bytes=total, wire=wired)
        if log:
            log(f"step {step + 1}, held-out {loss:.4f}, {clock.seconds:.1f} s")
        if target is not None and loss <= target:
            break
    return curve


def summarize(result, target, steps):
    """The row's table figures.

    Args:
      result: what :func:`train` returned for the row.
      target: the held-out loss to reach (dp's final loss).
      steps: dp's steps: the loss after as many samples is reported too.

    Returns:
      A dict: ``to_target`` (seconds to the first evaluation at or below ``target``, None if
      never), ``bytes_to_target`` and ``wire_to_target`` (bytes until then), ``loss_at_steps``
      (the last evaluation at or before ``steps``), ``final_loss``, ``steps`` run, and
      ``step_seconds`` and ``step_cpu`` (wall-clock and CPU seconds a step).

    Example:
      >>> curve = [dict(step=s, seconds=2.0 * s, cpu=s, loss=3.0 - 0.1 * s, bytes=10.0 * s,
      ...               wire=None) for s in (0, 5, 10)]
      >>> figures = summarize(dict(name="r", curve=curve), target=2.5, steps=5)
      >>> figures["to_target"], figures["loss_at_steps"], figures["step_seconds"]
      (10.0, 2.5, 2.0)

    References:
      Mattson et al., "MLPerf Training Benchmark" (MLSys 2020): time to a target quality.
    """
    curve = result["curve"]
    reached = next((p for p in curve[1:] if p["loss"] <= target), None)
    at_steps = [p for p in curve if p["step"] <= steps][-1]
    last = curve[-1]
    return dict(
        name=result["name"],
        to_target=None if reached is None else reached["seconds"],
        bytes_to_target=None if reached is None else reached["bytes"],
        wire_to_target=None if reached is None else reached["wire"],
        loss_at_steps=at_steps["loss"],
        final_loss=last["loss"],
        steps=last["step"],
        step_seconds=last["seconds"] / last["step"],
        step_cpu=last["cpu"] / last["step"],
    )
