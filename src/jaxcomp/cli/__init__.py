"""The ``jaxcomp`` command: ``jaxcomp demo``, ``jaxcomp kernels``, ``jaxcomp advise``."""

from __future__ import annotations

import importlib
import sys

# Subcommand -> (module with main(argv) -> int, one-line help). Modules import lazily so that
# `jaxcomp --help` stays fast.
COMMANDS = {
    "demo": (
        "jaxcomp.cli.demo",
        "train a small flax model data-parallel on 8 virtual devices, once per method",
    ),
    "advise": (
        "jaxcomp.cli.advise",
        "will gradient compression help? predicted step time per method",
    ),
    "netbench": (
        "jaxcomp.cli.netbench",
        "step time per method on an emulated cluster of N hosts at given link rates",
    ),
    "cluster": (
        "jaxcomp.cli.cluster",
        "run a jax.distributed script on N emulated hosts with rate-limited links",
    ),
    "kernels": (
        "jaxcomp.cli.kernels",
        "the three kernels on a realistic gradient, beside jax.lax.top_k and zfpy",
    ),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxcomp COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        print("\n`jaxcomp COMMAND --help` shows a command's options.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"jaxcomp: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
