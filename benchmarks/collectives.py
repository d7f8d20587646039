"""Collectives benchmark: time and bytes sent per device of every jaxcomp collective beside dense
psum.

    python benchmarks/collectives.py                     # n = 25M per device, 8 virtual CPU devices
    python benchmarks/collectives.py --size 1e6 --repeats 5 --markdown

Every device holds its own n-element float32 gradient (data parallelism) and each collective sums
them; "time" is one jitted call returning (total, sent), best of --repeats after a warm-up.
On one machine the virtual devices share its cores and the "network" is memory, so the time column
mostly measures compute overhead (selection, codec, transform, scatter), not transfer time: the
bytes column is what a real network would carry (jaxcomp.collectives.bytes_sent). Each table comes
from one process, so its ratios hold even on a shared, noisy machine. Results go to BENCHMARKS.md.
"""

import argparse
import os
import platform
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=25e6, help="gradient length per device")
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--ratios", default="0.01,0.001", help="comma-separated top-k densities")
    parser.add_argument(
        "--rates", default="8,16", help="comma-separated zfp rates (bits per value)"
    )
    parser.add_argument("--bits", default="4,8", help="comma-separated quantization widths")
    parser.add_argument(
        "--inner", type=int, default=4, help="devices per node for hierarchical_topk"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--only", default="", help="comma-separated words: run the rows whose label holds one"
    )
    return parser.parse_args()


args = parse_args()
# The device count must be fixed before JAX starts its backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxcomp import collectives, methods  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)
AXIS = "data"


def configurations(n, n_devices):
    """(label, bytes_sent kwargs, function of (x, step, key) -> (total, sent), mesh axes) rows."""
    ratios = [float(r) for r in args.ratios.split(",")]
    rates = [int(r) for r in args.rates.split(",")]
    widths = [int(b) for b in args.bits.split(",")]
    rows = [("psum", dict(method="dense"), lambda x, s, key: collectives.psum(x, AXIS), AXIS)]
    for ratio in ratios:
        k = max(1, round(ratio * n))
        rows += [
            (
                f"allgather_topk exact r={ratio}",
                dict(method="allgather_topk", k=k),
                lambda x, s, key, k=k: collectives.allgather_topk(x, k, AXIS),
                AXIS,
            ),
            (
                f"allgather_topk threshold r={ratio}",
                dict(method="allgather_topk", k=k),
                lambda x, s, key, k=k: collectives.allgather_topk(x, k, AXIS, "threshold"),
                AXIS,
            ),
            (
                f"ar_topk star r={ratio}",
                dict(method="ar_topk", k=k),
                lambda x, s, key, k=k: collectives.ar_topk(x, k, AXIS, "star", step=s),
                AXIS,
            ),
            (
                f"ar_topk star r={ratio}, broadcast by all_gather",
                dict(method="ar_topk", k=k, _all_gather=True),
                lambda x, s, key, k=k: collectives.ar_topk(
                    x, k, AXIS, "star", step=s, _broadcast="all_gather"
                ),
                AXIS,
            ),
            (
                f"ar_topk var r={ratio}",
                dict(method="ar_topk", k=k, leader="var"),
                lambda x, s, key, k=k: collectives.ar_topk(x, k, AXIS, "var"),
                AXIS,
            ),
            (
                f"ar_topk split r={ratio}",
                dict(method="ar_topk", k=k, leader="split"),
                lambda x, s, key, k=k: collectives.ar_topk(x, k, AXIS, "split"),
                AXIS,
            ),
            (
                f"hierarchical_topk {n_devices // args.inner}x{args.inner} r={ratio}",
                dict(method="hierarchical_topk", k=k, inner_size=args.inner),
                lambda x, s, key, k=k: collectives.hierarchical_topk(x, k, "gpu", "node"),
                ("node", "gpu"),
            ),
        ]
    for rate in rates:
        for algorithm in collectives.ZFP_ALGORITHMS:
            rows.append(
                (
                    f"zfp_allreduce {algorithm} rate={rate}",
                    dict(method="zfp", rate=rate, algorithm=algorithm),
                    lambda x, s, key, r=rate, a=algorithm: collectives.zfp_allreduce(x, r, AXIS, a),
                    AXIS,
                )
            )
    for bits in widths:
        for hadamard in (True, False):
            rows.append(
                (
                    f"quantized_psum bits={bits}{'' if hadamard else ' no hadamard'}",
                    dict(method="quantized", bits=bits, hadamard=hadamard),
                    lambda x, s, key, b=bits, h=hadamard: collectives.quantized_psum(
                        x, b, AXIS, key, h
                    ),
                    AXIS,
                )
            )
    return rows


def bytes_sent(n, n_devices, method, _all_gather=False, inner_size=None, **params):
    """The method's wire bytes, and for the AR-Topk broadcast by all_gather (the alternative
    ar_topk measured and set aside) the index all-reduce swapped for an all-gather."""
    sent = methods.parse(method, **params).wire_bytes(n, n_devices, inner_size=inner_size)
    if _all_gather:
        index_bytes = 4 * params["k"]
        sent += (n_devices - 1) * index_bytes - 2 * (n_devices - 1) / n_devices * index_bytes
    return sent


def best_time(fn, *fn_args):
    jax.block_until_ready(fn(*fn_args))  # compile and warm up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    n, n_devices = int(args.size), args.devices
    devices = np.array(jax.devices()[:n_devices])
    meshes = {
        AXIS: Mesh(devices, (AXIS,)),
        ("node", "gpu"): Mesh(
            devices.reshape(n_devices // args.inner, args.inner), ("node", "gpu")
        ),
    }
    print(
        f"# jax {jax.__version__}, {n_devices} virtual CPU devices on host {platform.node()} "
        f"({os.cpu_count()} cores); n = {n:,} float32 per device; best of {args.repeats}",
        flush=True,
    )
    rows = []
    words = [w for w in args.only.split(",") if w]
    for label, byte_params, fn, axes in configurations(n, n_devices):
        if words and label != "psum" and not any(w in label for w in words):
            continue
        mesh = meshes[axes]
        spec = P(axes)
        x = jax.jit(
            lambda key: jax.random.normal(key, (n_devices * n,)),
            out_shardings=NamedSharding(mesh, spec),
        )(jax.random.key(0))
        call = jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, spec))
        )
        seconds = best_time(call, x, jnp.int32(1), jax.random.key(1))
        del x
        sent = bytes_sent(n, n_devices, **byte_params)
        rows.append((label, seconds, sent))
        print(f"  {label}: {seconds:.3f} s, {sent / 1e6:.2f} MB", flush=True)
    dense_time, dense_bytes = rows[0][1], rows[0][2]
    header = ("method", "time (s)", "time / psum", "MB sent per device", "bytes / psum")
    table = [
        (label, f"{t:.3f}", f"{t / dense_time:.2f}", f"{b / 1e6:.2f}", f"{b / dense_bytes:.4f}")
        for label, t, b in rows
    ]
    print()
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for row in table:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(r[i])) for r in [header] + table) for i in range(len(header))]
        for row in [header] + table:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
