"""On GPT-2's shapes, the compiled update of three methods with ``nonfinite="skip"``: its
instructions over arrays of 10k values or more, and every opcode's count.

    OLD=/tmp/old/src python hlo_skip.py hlo_skip_7b29543.json
    python hlo_skip.py hlo_skip_after.json
"""

import collections
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

import jaxcomp  # noqa: E402

SHAPES = {"wte": (512, 768), "w1": (768, 3072), "w2": (3072, 768), "ln": (768,), "b": (3072,)}
CONFIGS = [
    ("ar_topk_skip", "ar_topk", {"ratio": 0.01, "nonfinite": "skip"}),
    ("powersgd_skip", "powersgd", {"rank": 4, "nonfinite": "skip"}),
    (
        "topk_mom_skip",
        "allgather_topk",
        {"ratio": 0.01, "momentum_correction": 0.9, "nonfinite": "skip"},
    ),
]


def counted(text: str) -> dict:
    big, kinds = 0, collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?\S+ = (\w+)\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
        if m:
            kinds[m.group(3)] += 1
            dims = [int(x) for x in m.group(2).split(",") if x]
            big += bool(dims) and int(np.prod(dims)) >= 10000
    return {"big": big, "kinds": dict(kinds)}


def main(path: str) -> None:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    out = {}
    for name, method, options in CONFIGS:
        tx = jaxcomp.compress(method, **options)
        spec = jax.tree.map(lambda _: P("data"), params)

        def per_device(g, s, tx=tx):
            return tx.update(jax.tree.map(lambda x: x[0], g), s)

        f = jax.jit(
            jax.shard_map(
                per_device, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), P()), check_vma=False
            )
        )
        g = jax.tree.map(lambda p: jnp.zeros((8,) + p.shape), params)
        out[name] = counted(f.lower(g, tx.init(params)).compile().as_text())
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
