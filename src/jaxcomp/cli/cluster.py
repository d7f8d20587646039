"""``jaxcomp cluster``: run a ``jax.distributed`` script on N emulated hosts with rate-limited
links.

    jaxcomp cluster --hosts 4 --rate 1gbit -- train.py --steps 10

The command line over :class:`jaxcomp.distributed.cluster.Cluster` (which says how the hosts are
built): it starts the script once per host, then prints each host's exit code and the bytes its
link carried. ``jaxcomp cluster --cleanup`` removes what a killed run left behind.
``--allocator tuned`` starts every host with :data:`jaxcomp.ops.allocator.ENVIRONMENT` (XLA:CPU's
large buffers kept on the heap: faster steps, each host keeping its peak heap).
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxcomp.distributed.cluster import (
    DEFAULT_SUBNET,
    Cluster,
    ClusterError,
    cleanup,
    format_rate,
    sigterm_as_interrupt,
)
from jaxcomp.ops import allocator


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxcomp cluster",
        description="Run a jax.distributed script on N emulated hosts (network namespaces, "
        "tbf-limited links).",
    )
    parser.add_argument(
        "--hosts", type=int, default=2, help="emulated hosts, one process each (default 2)"
    )
    parser.add_argument(
        "--rate",
        default="1gbit",
        help="link rate both ways: 10gbit, 1gbit, 100mbit, none (default 1gbit)",
    )
    parser.add_argument(
        "--delay", default=None, help="one-way delay per link (needs netem; an error without it)"
    )
    parser.add_argument(
        "--devices-per-host", type=int, default=1, help="CPU devices per process (default 1)"
    )
    parser.add_argument(
        "--subnet",
        default=DEFAULT_SUBNET,
        help=f"private /24 of the hosts (default {DEFAULT_SUBNET})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before every process is killed"
    )
    parser.add_argument(
        "--allocator",
        choices=allocator.ALLOCATORS,
        default="glibc",
        help="the hosts' malloc: 'glibc' as it is (the default), or 'tuned': started with "
        "jaxcomp.ops.allocator.ENVIRONMENT, buffers over 32 MB kept on the heap (faster steps "
        "on XLA:CPU; each host keeps its peak heap)",
    )
    parser.add_argument(
        "--cleanup", action="store_true", help="delete namespaces left by killed runs, then exit"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="script.py [args...] or -m module [args...]"
    )
    return parser


def _cleanup() -> int:
    removed = cleanup()
    print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def _checked_command(parser, args) -> list[str]:
    """The script and its arguments, with the flags checked (bad ones exit through argparse)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name a script to run (after --)")
    if args.devices_per_host < 1:
        parser.error(f"--devices-per-host must be >= 1, got {args.devices_per_host}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    return command


def _run(cluster: Cluster, command, args) -> int:
    """Builds the cluster, runs the job, prints each host's exit code and bytes; the job's code."""
    with sigterm_as_interrupt(), cluster:
        print(
            f"jaxcomp cluster: {args.hosts} hosts at {format_rate(cluster.rate)} "
            f"({cluster.address(0)}..{cluster.address(args.hosts - 1)})",
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        codes = cluster.run(
            command,
            devices_per_host=args.devices_per_host,
            timeout=args.timeout,
            env=allocator.environment(args.allocator),
        )
        elapsed = time.monotonic() - start
        for host, (code, counts) in enumerate(zip(codes, cluster.counters())):
            print(
                f"host {host} ({cluster.address(host)}): exit {code}, sent {counts['tx_bytes']:,} "
                f"B, received {counts['rx_bytes']:,} B",
                file=sys.stderr,
            )
        print(f"jaxcomp cluster: {elapsed:.1f} s", file=sys.stderr)
        return next((c for c in codes if c), 0)


def main(argv=None) -> int:
    """Runs ``jaxcomp cluster``; returns the first failing host's exit code, else 0.

    ``jaxcomp cluster --hosts N [--rate R] [--devices-per-host D] [--timeout S]
    [--allocator tuned] script.py [args...]``

    Args:
      argv: the arguments after ``cluster`` (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
      0 when every host's process exits with 0, else the first failing one's code; 2 when the
      cluster cannot be built (bad flags exit with status 2, as argparse does).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.cleanup:
            return _cleanup()
        command = _checked_command(parser, args)
        cluster = Cluster(args.hosts, rate=args.rate, delay=args.delay, subnet=args.subnet)
    except ValueError as e:
        parser.error(str(e))
    except ClusterError as e:
        print(f"jaxcomp cluster: {e}", file=sys.stderr)
        return 2
    try:
        return _run(cluster, command, args)
    except ClusterError as e:
        print(f"jaxcomp cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
