"""Old and new compress side by side: each option set's updates and states over 5 steps (a NaN
step and a 30x step among them) to an .npz, and its compiled update's instructions (the
multiset of shape and opcode, hashed) to a .json.

    OLD=/tmp/old/src python equiv.py old   # a worktree of the commit before, its .so copied in
    python equiv.py new
    python equiv.py --compare old new > identical.json
"""

import hashlib
import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
if os.environ.get("OLD"):  # import the old tree instead of the editable install
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["OLD"])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SHAPES = {"wte": (64, 48), "w1": (48, 96), "w2": (96, 48), "ln": (48,), "b": (96,), "i": (3,)}
CONFIGS = {
    "dense": ("dense", {}),
    "dense_skip": ("dense", {"nonfinite": "skip"}),
    "ar_topk": ("ar_topk", {"ratio": 0.05}),
    "ar_topk_noguard": ("ar_topk", {"ratio": 0.05, "guardrail": False}),
    "ar_topk_skip": ("ar_topk", {"ratio": 0.05, "nonfinite": "skip"}),
    "allgather_topk_mom": ("allgather_topk", {"ratio": 0.05, "momentum_correction": 0.9}),
    "topk_warm": ("allgather_topk", {"ratio": 0.05, "warmup_steps": 2}),
    "zfp_min": ("zfp", {"rate": 8, "min_size": 100}),
    "quantized_leaf": ("quantized", {"bits": 4, "granularity": "leaf"}),
    "bf16": ("bf16", {}),
    "powersgd": ("powersgd", {"rank": 2}),
    "sign_noef": ("sign", {"error_feedback": False}),
    "randomk_sum": ("randomk", {"ratio": 0.05, "mean": False}),
    "auto": ("auto", {}),
    "topk_buckets": ("allgather_topk", {"ratio": 0.05, "bucket_mb": 0.01}),
}


def params():
    return {k: jnp.zeros(s, jnp.int32 if k == "i" else jnp.float32) for k, s in SHAPES.items()}


def gradients():
    rng = np.random.default_rng(0)
    steps = []
    for t in range(5):
        g = {k: rng.normal(size=(8,) + s).astype(np.float32) for k, s in SHAPES.items()}
        g = {k: v * (30.0 if t == 3 else 1.0) for k, v in g.items()}
        g["i"] = np.zeros((8, 3), np.int32)
        if t == 2:
            g["w1"][3, 1, 2] = np.nan
        steps.append(g)
    return steps


def instructions(text: str) -> dict:
    ops = sorted(
        m.group(1) + " " + m.group(2)
        for m in (
            re.match(r"\s*(?:ROOT )?%?\S+ = (\S+) (\S+?)\(", line) for line in text.split("\n")
        )
        if m
    )
    return {"ops": len(ops), "sha": hashlib.sha256("\n".join(ops).encode()).hexdigest()[:16]}


def run(prefix: str) -> None:
    import jaxcomp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    arrays, compiled = {}, {}
    for name, (method, options) in CONFIGS.items():
        tx = jaxcomp.compress(method, **options)
        state = tx.init(params())
        spec = jax.tree.map(lambda _: P("data"), params())

        def per_device(g, s, tx=tx):
            return tx.update(jax.tree.map(lambda x: x[0], g), s)

        f = jax.jit(
            jax.shard_map(
                per_device, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), P()), check_vma=False
            )
        )
        steps = gradients()
        compiled[name] = instructions(f.lower(steps[0], state).compile().as_text())
        leaves = []
        for g in steps:
            update, state = f(g, state)
            leaves += [np.asarray(x) for x in jax.tree.leaves((update, state))]
        arrays.update({f"{name}__{i}": a for i, a in enumerate(leaves)})
    np.savez(prefix + ".npz", **arrays)
    with open(prefix + ".json", "w") as f:
        json.dump(compiled, f, indent=1)


def compare(old: str, new: str) -> dict:
    a, b = np.load(old + ".npz"), np.load(new + ".npz")
    ca, cb = (json.load(open(p + ".json")) for p in (old, new))
    out = {}
    for name in CONFIGS:
        keys = [f"{name}__{i}" for i in range(sum(k.startswith(name + "__") for k in a.files))]
        same = all(
            k in b.files and a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True)
            for k in keys
        ) and len(keys) == sum(k.startswith(name + "__") for k in b.files)
        out[name] = {
            "arrays": len(keys),
            "bit_identical": bool(same),
            "instructions": [ca[name]["ops"], cb[name]["ops"]],
            "same_instructions": ca[name] == cb[name],
        }
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        print(json.dumps(compare(sys.argv[2], sys.argv[3]), indent=1))
    else:
        run(sys.argv[1])
