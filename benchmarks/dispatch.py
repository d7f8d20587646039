"""What a host callback in the compiled step costs: jit's dispatch of a data_parallel step.

    python benchmarks/dispatch.py [--models many_small,gpt2] [--methods ar_topk,quantized]
                                  [--devices 1] [--steps 10]

For each zoo model and method, two ``jaxcomp.data_parallel`` runs side by side: the guardrail as
it is by default (``Guardrail(callback=False)``: nothing in the step talks to the host, the
trigger is told from the finished step's state) and ``Guardrail(callback=True)`` (a
``jax.debug.callback`` in the triggered branch). A jitted function with a host callback is
dispatched by JAX's Python path instead of its C++ fast path on every call, whether the branch
runs or not. The table gives, per run, the best of ``--steps`` calls of the time until the step
call returns (dispatch) and until its state is ready (the whole step), rounds interleaved; and
the number of array arguments, which the Python path pays for one by one.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="many_small,gpt2")
    parser.add_argument("--methods", default="ar_topk,quantized")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    print("| model | method | guardrail | arguments | dispatch ms | step ms |")
    print("|---|---|---|---:|---:|---:|")
    for model in args.models.split(","):
        for method in args.methods.split(","):
            for row in measure(model, method, args.devices, args.steps):
                print(
                    f"| {model} | {method} | {row['guardrail']} | {row['arguments']} | "
                    f"{row['dispatch'] * 1e3:.1f} | {row['step'] * 1e3:.1f} |",
                    flush=True,
                )
    return 0


def measure(model_name, method, devices, steps):
    """Both guardrail settings of one model and method: best dispatch and step seconds."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training import zoo

    model = zoo.build(model_name)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    options = {"ratio": 0.01} if "topk" in method else {"bits": 8} if method == "quantized" else {}
    runs = {}
    for label, callback in (("default", False), ("callback=True", True)):
        guard = jaxcomp.Guardrail(callback=callback)
        tx = optax.chain(jaxcomp.compress(method, guardrail=guard, **options), optax.adam(1e-4))
        dp = jaxcomp.data_parallel(model.loss_fn, tx, mesh)
        state = dp.init(model.params)
        batch = dp.shard_batch(model.make_batch(np.random.default_rng(0), 2 * devices))
        runs[label] = [dp, state, batch, float("inf"), float("inf")]
    for _ in range(steps + 2):  # the first two calls compile and warm up
        for run in runs.values():
            dp, state, batch = run[:3]
            start = time.perf_counter()
            state, _ = dp.step(state, batch)
            dispatched = time.perf_counter()
            jax.block_until_ready(state)
            run[1], run[3] = state, min(run[3], dispatched - start)
            run[4] = min(run[4], time.perf_counter() - start)
    return [
        {
            "guardrail": label,
            "arguments": len(jax.tree.leaves((run[1], run[2]))),
            "dispatch": run[3],
            "step": run[4],
        }
        for label, run in runs.items()
    ]


if __name__ == "__main__":
    sys.exit(main())
