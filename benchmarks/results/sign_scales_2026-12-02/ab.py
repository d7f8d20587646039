"""Sign's compress update three ways in one job (interleaved rounds, best of each, beside a
plain copy): compiled for sign's branch with its sent's energies read off the scales (this
change), compiled for sign's branch with the energies read off the decoded vector, and the
lax.switch between sign and the guardrail's dense fallback (what data_parallel ran before).

    python benchmarks/results/sign_scales_2026-12-02/ab.py MODEL [METHOD] [ROUNDS]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import passes  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.methods import Sign  # noqa: E402


def main():
    jaxcomp.tune_host_allocator()
    model = sys.argv[1]
    method = sys.argv[2] if len(sys.argv) > 2 else "sign"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    grads = passes.gradients(model)
    copy = jax.jit(lambda g: jax.tree.map(lambda x: x * 2, g))
    name, options = passes.method_options(method)
    runs = {"copy": lambda: copy(grads)}

    def make(label, branch, decoded):
        # Compiled while Sign says whether its sent may come decoded (the traced step keeps it).
        Sign.decoded_sent = property(
            lambda self: decoded and self.aggregation in ("allgather", "allreduce")
        )
        step, state = passes.transformation_update(jaxcomp.compress(name, **options), grads, branch)
        jax.block_until_ready(step(grads, state))
        runs[label] = lambda: step(grads, state)

    make("pinned+decoded (new)", 0, True)
    make("pinned, energies read", 0, False)
    make("switched (before)", None, False)
    best = passes.best_of_rounds(runs, rounds)
    for label, seconds in best.items():
        print(
            f"{model:9} {method:8} {label:24} {seconds * 1e3:7.1f} ms  "
            f"{seconds / best['copy']:5.2f} passes"
        )


if __name__ == "__main__":
    main()
