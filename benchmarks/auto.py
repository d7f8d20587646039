"""What compress("auto") costs: its step beside the fixed method it chose, and its compile time.

    python benchmarks/auto.py                      # n = 4M params, 8 virtual CPU devices
    python benchmarks/auto.py --size 1e6 --repeats 20 --markdown

Each row trains the same linear model with data_parallel (loss sum(w * g), so the gradient is a
random vector per device): a fixed method, then "auto" told a slow network (1 ms, 100 Mbit/s)
so that it runs that same method through lax.switch among its compiled branches. "step" is the
median of --repeats steps after the first; "compile" is the first step's wall time (trace +
compile + run). All rows come from one process, side by side, so their ratios hold on a shared
machine. Results go to BENCHMARKS.md.
"""

import argparse
import os
import platform
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=4e6, help="parameters (float32)")
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per row")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return parser.parse_args()


args = parse_args()
# The device count must be fixed before JAX starts its backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxcomp  # noqa: E402

SLOW = jaxcomp.costmodel.cost.Network.parse("1ms", "100mbit")


def loss(w, batch):
    return jnp.sum(w * batch["g"][0])


def measure(tx, n, mesh, batch):
    dp = jaxcomp.data_parallel(loss, optax.chain(tx, optax.sgd(1e-3)), mesh)
    state = dp.init(jnp.zeros(n))
    start = time.perf_counter()
    state, metrics = dp.step(state, batch)
    jax.block_until_ready(state)
    compile_seconds = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        state, metrics = dp.step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    ran = jaxcomp.find_compress_state(state.opt_state).methods[int(metrics["method"])]
    return compile_seconds, float(np.median(times)), ran.label, float(metrics["density"])


def main():
    n = int(args.size)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    batch = {"g": rng.standard_normal((args.devices, n)).astype(np.float32)}
    configs = [  # (fixed method and options, auto options): auto must run the fixed method on SLOW
        (
            ("allgather_topk", {"ratio": 0.01}),
            {"ratio": 0.01, "candidates": ("dense", "allgather_topk")},
        ),
        (("ar_topk", {"ratio": 0.01}), {"ratio": 0.01, "rate": 8, "bits": 8}),
        (("ar_topk", {"ratio": 0.01}), {"ratio": 0.01, "candidates": ("dense", "ar_topk")}),
        # explore_steps keeps it on its first candidate ratio, 0.1, for the whole measurement.
        (("ar_topk", {"ratio": 0.1}), {"adaptive_ratio": True, "explore_steps": 10_000}),
    ]
    print(
        f"# {platform.node()}: {os.cpu_count()} cores, jax {jax.__version__}, {args.devices} "
        f"virtual CPU devices, n = {n:,}, median of {args.repeats} steps"
    )
    if args.markdown:
        print(
            "| auto options (network 1 ms, 100 Mbit/s) | branches | ran | fixed step | auto step | "
            "auto / fixed | first step (compile): fixed / auto |"
        )
        print("|---|---:|---|---:|---:|---:|---:|")
    for (method, options), auto_options in configs:
        auto_tx = jaxcomp.compress("auto", network=SLOW, **auto_options)
        branches = len(jaxcomp.auto_branches(auto_tx.init({"w": jnp.zeros(1)}))[0])
        fixed = measure(jaxcomp.compress(method, **options), n, mesh, batch)
        auto = measure(auto_tx, n, mesh, batch)
        if (auto[2], auto[3]) != (fixed[2], fixed[3]):
            raise SystemExit(
                f"auto ran {auto[2]} at density {auto[3]}, not {fixed[2]}: the comparison is "
                "meaningless"
            )
        label = ", ".join(f"{k}={v}" for k, v in auto_options.items())
        if args.markdown:
            print(
                f"| {label} | {branches} | {method} ({auto[3]:.3g}) | {1e3 * fixed[1]:.1f} ms | "
                f"{1e3 * auto[1]:.1f} ms | {auto[1] / fixed[1]:.2f} | {fixed[0]:.2f} s / "
                f"{auto[0]:.2f} s |"
            )
        else:
            print(label, branches, "fixed", fixed, "auto", auto)


if __name__ == "__main__":
    main()
