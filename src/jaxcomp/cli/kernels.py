"""``jaxcomp kernels``: the three kernels on a realistic gradient, beside JAX's top-k and zfpy.

``benchmarks/kernels.py`` builds its table from the same measurements (:func:`measure`), so the demo
and the benchmark cannot disagree about what is timed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from jaxcomp.cli import _report
from jaxcomp.costmodel.probe import best_seconds


def realistic_gradient(n: int, seed: int = 0) -> np.ndarray:
    """A float32 vector shaped like a flattened network gradient.

    Layers have very different scales (log-uniform over 4 orders of magnitude), and within a
    layer values are heavy-tailed (Student-t, 3 degrees of freedom), as measured gradients are.

    Args:
      n: number of values.
      seed: numpy seed.

    Returns:
      float32 numpy array of shape ``(n,)``.

    Example:
      >>> from jaxcomp.cli.kernels import realistic_gradient
      >>> realistic_gradient(10).shape
      (10,)

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (ResNet-50 / BERT gradient sizes used for timing).
    """
    rng = np.random.default_rng(seed)
    layers = max(1, min(64, n // 1024))
    bounds = np.linspace(0, n, layers + 1).astype(np.int64)
    scales = 10.0 ** rng.uniform(-5, -1, size=layers)
    scale = np.repeat(scales, np.diff(bounds)).astype(np.float32)
    return (rng.standard_t(3, size=n).astype(np.float32) * scale).astype(np.float32)


@dataclass
class Row:
    """One measured operation."""

    n: int
    op: str
    param: str
    seconds: float
    baseline: str = ""
    speedup: float = float("nan")  # baseline seconds / seconds
    error: str = ""


def _zfpy():
    try:
        import zfpy
    except ImportError:  # zfpy is a demo/test dependency, not a runtime one
        return None
    return zfpy


def _rmse(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def measure(
    n: int,
    ratios=(0.01, 0.001),
    rates=(8,),
    repeats: int = 3,
    device=None,
    numpy_baselines: bool = True,
):
    """Times jaxcomp's kernels and their baselines side by side on one realistic gradient.

    Args:
      n: gradient length.
      ratios: densities; k = n * ratio.
      rates: zfp rates (bits per value).
      repeats: timed runs per op (best is kept).
      device: a ``jax.Device`` to run on (default: the default device).
      numpy_baselines: also time ``numpy.argpartition`` and ``zfpy`` (host baselines).

    Returns:
      A list of :class:`Row`, each op with its speedup over the named baseline.

    Example:
      >>> from jaxcomp.cli.kernels import measure
      >>> rows = measure(4096, ratios=(0.01,), rates=(8,), repeats=1)
      >>> "jaxcomp.topk" in {r.op for r in rows}
      True

    References:
      Agarwal et al., MLSys 2022, Table 2/3: encode-decode overhead decides whether compression
      pays.
    """
    device = device or jax.devices()[0]
    host = realistic_gradient(n)
    x = jax.device_put(host, device)
    rows: list[Row] = []
    for ratio in ratios:
        rows += _topk_rows(x, host, ratio, repeats, numpy_baselines)
    zfpy = _zfpy() if numpy_baselines else None
    for rate in rates:
        rows += _zfp_rows(x, host, rate, repeats, zfpy)
    return rows


def _topk_rows(x, host, ratio, repeats, numpy_baselines) -> list[Row]:
    """jaxcomp's two top-k selections beside ``jax.lax.top_k``, ``approx_max_k`` and numpy's."""
    n = host.size
    k = max(1, int(round(n * ratio)))
    param = f"k=n*{ratio:g}"
    lax_topk = jax.jit(lambda v: jax.lax.top_k(jnp.abs(v), k))
    approx = jax.jit(lambda v: jax.lax.approx_max_k(jnp.abs(v), k))
    ours = jax.jit(lambda v: jaxcomp.topk(v, k))
    ours_thr = jax.jit(lambda v: jaxcomp.threshold_topk(v, k))
    t_lax = best_seconds(lambda: lax_topk(x), repeats)
    t_approx = best_seconds(lambda: approx(x), repeats)
    t_ours = best_seconds(lambda: ours(x), repeats)
    t_thr = best_seconds(lambda: ours_thr(x), repeats)
    # Quality of the threshold selection: the smallest selected magnitude relative to the
    # exact k-th largest.
    kth = float(np.partition(np.abs(host), n - k)[n - k])
    thr_min = float(jnp.min(jnp.abs(ours_thr(x)[0])))
    rows = [
        Row(n, "jax.lax.top_k(|x|)", param, t_lax),
        Row(n, "jax.lax.approx_max_k(|x|)", param, t_approx, "jax.lax.top_k", t_lax / t_approx),
        Row(n, "jaxcomp.topk", param, t_ours, "jax.lax.top_k", t_lax / t_ours, "exact"),
        Row(
            n,
            "jaxcomp.threshold_topk",
            param,
            t_thr,
            "jax.lax.top_k",
            t_lax / t_thr,
            f"min selected / k-th = {thr_min / kth:.4f}" if kth > 0 else "",
        ),
    ]
    if numpy_baselines:
        t_np = best_seconds(lambda: np.argpartition(np.abs(host), n - k)[n - k :], repeats)
        rows.append(Row(n, "numpy.argpartition", param, t_np, "jax.lax.top_k", t_lax / t_np))
        rows.append(
            Row(n, "jaxcomp.topk", param, t_ours, "numpy.argpartition", t_np / t_ours, "exact")
        )
    return rows


def _zfp_rows(x, host, rate, repeats, zfpy) -> list[Row]:
    """jaxcomp's ZFP encode and decode, beside zfpy's (when installed) and their errors."""
    n = host.size
    param = f"rate={rate}"
    enc = jax.jit(lambda v: jaxcomp.zfp_encode(v, rate))
    dec = jax.jit(lambda w: jaxcomp.zfp_decode(w, n, rate))
    words = enc(x)
    t_enc = best_seconds(lambda: enc(x), repeats)
    t_dec = best_seconds(lambda: dec(words), repeats)
    err = _rmse(dec(words), host)
    if zfpy is None:
        return [
            Row(n, "jaxcomp.zfp_encode", param, t_enc, error=f"rmse {err:.3e}"),
            Row(n, "jaxcomp.zfp_decode", param, t_dec),
        ]
    t_zenc = best_seconds(lambda: zfpy.compress_numpy(host, rate=rate, write_header=False), repeats)
    blob = zfpy.compress_numpy(host, rate=rate)
    t_zdec = best_seconds(lambda: zfpy.decompress_numpy(blob), repeats)
    zerr = _rmse(zfpy.decompress_numpy(blob), host)
    return [
        Row(n, "zfpy.compress", param, t_zenc, error=f"rmse {zerr:.3e}"),
        Row(
            n,
            "jaxcomp.zfp_encode",
            param,
            t_enc,
            "zfpy.compress",
            t_zenc / t_enc,
            f"rmse {err:.3e} ({err / zerr:.3f}x zfpy)",
        ),
        Row(n, "zfpy.decompress", param, t_zdec),
        Row(n, "jaxcomp.zfp_decode", param, t_dec, "zfpy.decompress", t_zdec / t_dec),
    ]


def format_table(rows, markdown: bool = False) -> str:
    """Renders rows as an aligned text table, or as a Markdown table."""
    header = ["n", "op", "param", "ms", "speedup", "vs", "notes"]
    body = [
        [
            f"{r.n:,}",
            r.op,
            r.param,
            f"{r.seconds * 1e3:.2f}",
            "" if r.speedup != r.speedup else f"{r.speedup:.1f}x",
            r.baseline,
            r.error,
        ]
        for r in rows
    ]
    return _report.format_table(header, body, markdown=markdown)


def main(argv=None) -> int:
    """Entry point of ``jaxcomp kernels``."""
    parser = argparse.ArgumentParser(prog="jaxcomp kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=25e6, help="gradient length (default 25M)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per kernel, >= 1")
    args = parser.parse_args(argv)
    n = int(args.n)
    if n < 1000:
        parser.error("--n must be at least 1000")
    if args.repeats < 1:
        parser.error(
            f"--repeats must be at least 1 (timed runs; the fastest counts), got {args.repeats}"
        )
    print(
        f"jaxcomp {jaxcomp.__version__} kernels on a realistic {n:,}-value float32 gradient "
        f"({jax.devices()[0].platform}, {jax.devices()[0].device_kind})"
    )
    print(format_table(measure(n, repeats=args.repeats)))
    return 0
