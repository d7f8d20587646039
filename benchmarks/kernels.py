"""Kernel benchmark: jaxcomp's ops beside jax.lax.top_k, approx_max_k, numpy.argpartition and zfpy.

    python benchmarks/kernels.py                      # n = 1M, 25M, 100M on the CPU
    python benchmarks/kernels.py --sizes 25e6 --markdown
    python benchmarks/kernels.py --device gpu         # on a GPU build (see docs/gpu.md)
    python benchmarks/kernels.py --portable --sizes 1e6,25e6 --markdown
                                                      # the XLA path beside native and lax.top_k

Every figure in one table comes from one process, measured side by side (best of --repeats after a
warm-up run), so ratios hold even on a shared, noisy machine. Results go to BENCHMARKS.md.
"""

import argparse
import functools
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from jaxcomp.cli.kernels import Row, format_table, measure, realistic_gradient
from jaxcomp.costmodel.probe import best_seconds


def measure_portable(n, ratio, rate, repeats, device):
    """jaxcomp's XLA path (implementation="xla") beside its native kernels and jax.lax.top_k, on the
    same input in one process. "speedup" is the native time over the XLA time (below 1: slower)."""
    x = jax.device_put(realistic_gradient(n), device)
    k = max(1, int(n * ratio))
    words = jax.block_until_ready(jaxcomp.zfp_encode(x, rate, implementation="native"))
    ops = [
        (
            "topk",
            f"k=n*{ratio}",
            lambda i: jax.jit(functools.partial(jaxcomp.topk, k=k, implementation=i)),
            x,
        ),
        (
            "threshold_topk",
            f"k=n*{ratio}",
            lambda i: jax.jit(functools.partial(jaxcomp.threshold_topk, k=k, implementation=i)),
            x,
        ),
        (
            "find_threshold",
            f"k=n*{ratio}",
            lambda i: jax.jit(functools.partial(jaxcomp.find_threshold, k=k, implementation=i)),
            x,
        ),
        (
            "zfp_encode",
            f"rate={rate}",
            lambda i: jax.jit(functools.partial(jaxcomp.zfp_encode, rate=rate, implementation=i)),
            x,
        ),
        (
            "zfp_decode",
            f"rate={rate}",
            lambda i: jax.jit(
                functools.partial(jaxcomp.zfp_decode, n=n, rate=rate, implementation=i)
            ),
            words,
        ),
    ]
    top_k = jax.jit(lambda v: jax.lax.top_k(jnp.abs(v), k))
    lax_seconds = best_seconds(lambda: top_k(x), repeats)
    rows = [Row(n, "jax.lax.top_k(|x|)", f"k=n*{ratio}", lax_seconds)]
    for name, param, make, operand in ops:
        native, portable = make("native"), make("xla")
        same = all(
            np.array_equal(
                np.asarray(a).view(np.uint32) if np.asarray(a).dtype == np.float32 else a,
                np.asarray(b).view(np.uint32) if np.asarray(b).dtype == np.float32 else b,
            )
            for a, b in zip(jax.tree.leaves(native(operand)), jax.tree.leaves(portable(operand)))
        )
        native_seconds = best_seconds(lambda: native(operand), repeats)
        portable_seconds = best_seconds(lambda: portable(operand), repeats)
        rows.append(Row(n, f"jaxcomp.{name} native", param, native_seconds))
        note = "bit-identical to native" if same else "DIFFERS FROM NATIVE"
        if name in ("topk", "threshold_topk"):
            note += f"; {lax_seconds / portable_seconds:.1f}x jax.lax.top_k"
        rows.append(
            Row(
                n,
                f"jaxcomp.{name} xla",
                param,
                portable_seconds,
                "native",
                native_seconds / portable_seconds,
                note,
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1e6,25e6,100e6", help="comma-separated gradient lengths"
    )
    parser.add_argument(
        "--ratios", default="0.01,0.001", help="comma-separated densities (k = n * ratio)"
    )
    parser.add_argument("--rates", default="8,16", help="comma-separated zfp rates")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--json", metavar="PATH", help="also write the rows, the machine and the command"
    )
    parser.add_argument(
        "--portable",
        action="store_true",
        help="the XLA path (implementation='xla') beside native and jax.lax.top_k instead",
    )
    args = parser.parse_args()

    device = jax.devices(args.device)[0]
    print(
        f"# jax {jax.__version__} on {device.platform} ({device.device_kind}); host "
        f"{platform.node()}, {os.cpu_count()} cores"
    )
    rows = []
    if args.portable:
        ratio, rate = float(args.ratios.split(",")[0]), int(args.rates.split(",")[0])
        for size in args.sizes.split(","):
            rows += measure_portable(int(float(size)), ratio, rate, args.repeats, device)
            print(f"measured n = {int(float(size)):,}", flush=True)
        print()
        print(format_table(rows, markdown=args.markdown))
        return
    for size in args.sizes.split(","):
        rows += measure(
            int(float(size)),
            ratios=[float(r) for r in args.ratios.split(",")],
            rates=[int(r) for r in args.rates.split(",")],
            repeats=args.repeats,
            device=device,
            numpy_baselines=args.device == "cpu",
        )
        print(f"measured n = {int(float(size)):,}", flush=True)
    print()
    print(format_table(rows, markdown=args.markdown))
    if args.json:
        write_json(args.json, rows, device)


def write_json(path, rows, device):
    """``{"command", "machine", "rows"}``: what BENCHMARKS.md's kernel table reads."""
    import dataclasses
    import json
    import sys

    machine = {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "device": f"{device.platform} ({device.device_kind})",
        "jax": jax.__version__,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "command": " ".join(["python", "benchmarks/kernels.py", *sys.argv[1:]]),
                "machine": machine,
                "rows": [dataclasses.asdict(r) for r in rows],
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
