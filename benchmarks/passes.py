"""Each method's local work in passes over the gradient: its update's time over a plain copy's.

    python benchmarks/passes.py [--models mlp4096,mlp2041,gpt2,resnet50,many_small] [--repeats 5]
    python benchmarks/passes.py --models gpt2 --methods ar_topk,ar_topk@b25  # with buckets beside

For every model of the zoo (:mod:`jaxcomp.training.zoo`) and every method, one device runs the
``compress`` update alone (inside ``jax.shard_map``, as in training, compiled for the branch
``data_parallel`` compiles its steps for; ``--switched``: the device's ``lax.switch`` between the
method and the guardrail's dense fallback; on one device the collectives move nothing) on
random gradients of the model's parameter shapes, and the same job times a plain copy of
those gradients (``g * 2``: read every value once, write it once, into a new buffer as the
update's outputs are). The ratio is the method's local work in *passes*: what
error feedback, packing, selection, codecs and unpacking cost in units of the cheapest thing a
step could do with the gradient. The issue's targets: at most 4 passes for top-k, random-k, sign
and the casts (PowerSGD: beside its matmuls), at most 8 for ZFP and THC.

With ``--allocator tuned`` the process first calls :func:`jaxcomp.tune_host_allocator`; by
default it keeps glibc's, under which the update's 100 MB vectors are fresh pages every call and
the copy's leaves under 32 MB are not (docs/performance.md).

Rounds interleave the methods (each call in a round: one warm-up, then the best of 2) and each
figure is the best round, so that a busy machine skews every method alike. Results go to stdout as a
table and to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import numpy as np

#: Methods and the compress() options each runs with: the issue's list, at their usual settings.
METHODS = {
    "dense": ("dense", {}),
    "allgather_topk": ("allgather_topk", {"ratio": 0.01}),
    "ar_topk": ("ar_topk", {"ratio": 0.01}),
    "randomk": ("randomk", {"ratio": 0.01}),
    "sign": ("sign", {}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "powersgd": ("powersgd", {"rank": 4}),
    "powersgd_fp16": ("powersgd_fp16", {"rank": 4}),
    "zfp": ("zfp", {"rate": 8}),
    "quantized": ("quantized", {"bits": 4}),
}

#: The issue's ceiling per method, in passes.
TARGETS = {"zfp": 8, "quantized": 8, "dense": 4}


def parse_args(argv=None):
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(zoo.NAMES),
        help=f"zoo models (default all: {','.join(zoo.NAMES)})",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="methods (default all)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds; the best counts (default 5)"
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--allocator",
        choices=("tuned", "glibc"),
        default="glibc",
        help="'glibc' keeps its defaults (the default): every buffer over 32 MB is fresh pages "
        "each call, which a copy into leaves under 32 MB does not pay; 'tuned' calls "
        "jaxcomp.tune_host_allocator() first (large buffers on the heap)",
    )
    parser.add_argument(
        "--switched",
        action="store_true",
        help="time the update as a jitted compress outside data_parallel runs it (the device "
        "chooses between the method and the guardrail's dense fallback by lax.switch); by "
        "default the branch is compiled in as data_parallel's steps compile it",
    )
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.methods = [m for m in args.methods.split(",") if m]
    for name in args.models:
        if name not in zoo.NAMES:
            parser.error(f"--models: {name!r} is not a zoo model ({', '.join(zoo.NAMES)})")
    for name in args.methods:
        try:
            method_options(name)
        except ValueError as error:
            parser.error(f"--methods: {error}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def gradients(model_name: str):
    """Random float32 gradients of the zoo model's parameter shapes, on the first device."""
    from jaxcomp.training import zoo

    shapes = zoo.build(model_name, abstract=True).params
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(shapes)
    return jax.device_put(
        treedef.unflatten([rng.standard_normal(s.shape, np.float32) for s in leaves]),
        jax.devices()[0],
    )


def method_options(method: str):
    """``(name, compress options)`` of a ``--methods`` entry: a :data:`METHODS` key, optionally
    with ``@bMB`` for ``compress(..., bucket_mb=MB)`` (``ar_topk@b25``)."""
    base, _, bucket = method.partition("@b")
    if base not in METHODS:
        raise ValueError(f"{method!r} is not one of {', '.join(METHODS)} (optionally with @bMB)")
    name, options = METHODS[base]
    if not bucket:
        return name, options
    try:
        return name, {**options, "bucket_mb": float(bucket)}
    except ValueError:
        raise ValueError(f"{method!r}: @b takes a number of megabytes, e.g. @b25") from None


def update_function(method: str, grads, switched: bool = False):
    """A jitted ``(grads, state) -> (updates, state)`` of ``compress(method)`` on one device, and
    its first state: compiled for the branch the state asks for where ``data_parallel``'s steps
    are (:func:`jaxcomp.optim.pinning.next_branch`: a sparse method, or sign's decoded sent,
    beside the guardrail's dense fallback), or with ``switched`` the device's ``lax.switch``
    over the branches (a jitted ``compress`` update outside ``data_parallel``)."""
    import jaxcomp
    from jaxcomp.optim import pinning

    name, options = method_options(method)
    tx = jaxcomp.compress(name, **options)
    branch = None if switched else pinning.next_branch(jax.jit(tx.init)(grads))
    return transformation_update(tx, grads, None if branch is None else int(branch))


def transformation_update(tx, grads, branch=None):
    """A jitted ``(grads, state) -> (updates, state)`` of the transformation ``tx`` (axis
    ``"data"``) on one device, and its first state; ``branch``: the compress state's branch,
    compiled as a static choice (jaxcomp.optim.pinning, what data_parallel's steps do), or None
    (the device chooses)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxcomp.optim import pinning

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def update(g, state):
        g = jax.lax.pcast(g, "data", to="varying")  # this device's own gradient, as in training
        with pinning.pinned(branch):
            return tx.update(g, state)

    step = jax.jit(
        jax.shard_map(update, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    )
    return step, jax.jit(tx.init)(grads)


def measure(
    model_name: str, methods, repeats: int, allocator: str = "glibc", switched: bool = False
) -> list[dict]:
    """One model's rows: per method the update's best time and its passes over the copy's."""
    grads = gradients(model_name)
    copy = jax.jit(lambda g: jax.tree.map(lambda x: x * 2, g))
    runs = {"copy": lambda: copy(grads)}
    for method in methods:
        step, state = update_function(method, grads, switched)
        runs[method] = lambda step=step, state=state: step(grads, state)
    best = best_of_rounds(runs, repeats)
    n = sum(x.size for x in jax.tree.leaves(grads))
    leaves = len(jax.tree.leaves(grads))
    return [
        {
            "model": model_name,
            "params": n,
            "leaves": leaves,
            "method": m,
            "seconds": best[m],
            "copy_seconds": best["copy"],
            "passes": best[m] / best["copy"],
            "target": TARGETS.get(m.partition("@")[0], 4),
            "allocator": allocator,
            "switched": switched,
        }
        for m in methods
    ]


def best_of_rounds(runs: dict, repeats: int) -> dict:
    """``{name: seconds}``: the best of ``repeats`` rounds that call each of ``runs`` (no-argument
    functions) in turn, each call a warm-up and the best of 2, so that a busy machine skews every
    run alike."""
    from jaxcomp.costmodel.probe import best_seconds  # one warm-up call, then the best of the rest

    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            best[name] = min(best[name], best_seconds(fn, 2))
    return best


def markdown(columns: str, rows, cells) -> str:
    """A markdown table: ``columns`` is its header row (``"name|ms:"``: a trailing ``:`` right
    aligns), ``cells(row)`` each row's cells as strings."""
    names = [c.rstrip(":") for c in columns.split("|")]
    rule = ["---:" if c.endswith(":") else "---" for c in columns.split("|")]
    lines = ["| " + " | ".join(names) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def table(rows) -> str:
    """The rows as a markdown table, one line per model and method."""
    return markdown(
        "model|params:|leaves:|method|update ms:|copy ms:|passes:|target:|within",
        rows,
        lambda r: [
            r["model"],
            f"{r['params'] / 1e6:.1f}M",
            str(r["leaves"]),
            r["method"],
            f"{r['seconds'] * 1e3:.1f}",
            f"{r['copy_seconds'] * 1e3:.1f}",
            f"{r['passes']:.1f}",
            f"<= {r['target']}",
            "yes" if r["passes"] <= r["target"] else "**no**",
        ],
    )


def run_models(names, measure_one, table, json_path=None) -> list:
    """Measures each model in turn (``measure_one(name) -> rows``), saying when each is done,
    then prints ``table(rows)`` and writes the rows to ``json_path`` (if given)."""
    rows = []
    for name in names:
        rows += measure_one(name)
        print(f"# {name} done", flush=True)
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.allocator == "tuned":
        import jaxcomp

        jaxcomp.tune_host_allocator()  # before the first buffer: the gradients, the states
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, jax "
        f"{jax.__version__}, {len(jax.devices())} device(s), allocator {args.allocator}"
        f"{', switched' if args.switched else ''}",
        flush=True,
    )
    run_models(
        args.models,
        lambda name: measure(name, args.methods, args.repeats, args.allocator, args.switched),
        table,
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
