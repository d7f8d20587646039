"""The top-k kernel and SPLIT's merge of the gathered indices, timed alone (best of 15 calls),
with whichever jaxcomp is importable: kernels.sh runs it with 7fb6bd0's and with this tree's.

Rows: jaxcomp.topk and jaxcomp.threshold_topk on a standard normal vector of 25.2M values (the
zoo's 25M models) and 124.4M (GPT-2 small's), k = 1% and 1%/4 (what each of 4 SPLIT devices
selects); the merge of N ascending runs of k/N indices (SPLIT's all-gather on N devices) with
jaxcomp.ops.topk.merged_indices where this jaxcomp has it, else the sort it replaced; a plain
copy of the 25.2M vector (x * 2) for scale. Prints one json line per row.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp

jaxcomp.tune_host_allocator()


def best_ms(fn, *args, reps=15):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def old_merge(runs, pad):  # 7fb6bd0's split_indices
    ordered = jnp.sort(runs.reshape(-1))
    repeat = jnp.concatenate([jnp.zeros(1, bool), ordered[1:] == ordered[:-1]])
    return jnp.where(repeat, jnp.int32(pad), ordered)


try:
    from jaxcomp.ops.topk import merged_indices as merge
except ImportError:
    merge = old_merge

rng = np.random.default_rng(0)
rows = []
for n in (25_200_000, 124_400_000):
    x = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
    if n < 10**8:
        rows.append(("copy", n, 0, best_ms(jax.jit(lambda v: v * 2), x)))
    for k in (n // 100, n // 400):
        rows.append(("topk", n, k, best_ms(jax.jit(lambda v, k=k: jaxcomp.topk(v, k)), x)))
    k = n // 100
    rows.append(
        ("threshold_topk", n, k, best_ms(jax.jit(lambda v: jaxcomp.threshold_topk(v, k)), x))
    )
    del x
    for devices in (4, 8):
        each = n // 100 // devices
        runs = np.stack([np.sort(rng.choice(n, each, replace=False)) for _ in range(devices)])
        runs = jnp.asarray(runs, jnp.int32)
        rows.append(
            (f"merge of {devices} runs", n, each, best_ms(jax.jit(lambda r: merge(r, n)), runs))
        )
for op, n, k, ms in rows:
    print(json.dumps({"op": op, "n": n, "k": k, "ms": round(ms, 2)}), flush=True)
