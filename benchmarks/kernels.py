"""Kernel benchmark: jaxcomp's ops beside jax.lax.top_k, approx_max_k, numpy.argpartition and zfpy.

    python benchmarks/kernels.py                      # n = 1M, 25M, 100M on the CPU
    python benchmarks/kernels.py --sizes 25e6 --markdown
    python benchmarks/kernels.py --device gpu         # on a GPU build (see docs/gpu.md)

Every figure in one table comes from one process, measured side by side (best of --repeats after a
warm-up run), so ratios hold even on a shared, noisy machine. Results go to BENCHMARKS.md.
"""

import argparse
import os
import platform

import jax

from jaxcomp.kernel_demo import format_table, measure


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,25e6,100e6", help="comma-separated gradient lengths")
    parser.add_argument("--ratios", default="0.01,0.001", help="comma-separated densities (k = n * ratio)")
    parser.add_argument("--rates", default="8,16", help="comma-separated zfp rates")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()

    device = jax.devices(args.device)[0]
    print(f"# jax {jax.__version__} on {device.platform} ({device.device_kind}); host {platform.node()}, "
          f"{os.cpu_count()} cores")
    rows = []
    for size in args.sizes.split(","):
        rows += measure(int(float(size)), ratios=[float(r) for r in args.ratios.split(",")],
                        rates=[int(r) for r in args.rates.split(",")], repeats=args.repeats, device=device,
                        numpy_baselines=args.device == "cpu")
        print(f"measured n = {int(float(size)):,}", flush=True)
    print()
    print(format_table(rows, markdown=args.markdown))


if __name__ == "__main__":
    main()
