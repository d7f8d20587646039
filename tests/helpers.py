"""Small test helpers owned by the project (no jax._src): compile counting, tree comparison."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import time

import jax
import numpy as np
import pytest


def adam_bound(t: int, b1: float = 0.9, b2: float = 0.999) -> float:
    """The largest ``m_hat^2 / v_hat`` optax.adam can reach at step ``t``, summed term by term
    (a reference for jaxcomp.adam's variance floor)."""
    weights_m = (1 - b1) * b1 ** np.arange(t) / (1 - b1**t)
    weights_v = (1 - b2) * b2 ** np.arange(t) / (1 - b2**t)
    return float(np.sum(weights_m**2 / weights_v))


def need_devices(count: int):
    """Fails (not skips) when fewer than ``count`` devices exist: CI must never pass silently."""
    if jax.device_count() < count:
        pytest.fail(
            f"this test needs {count} devices, found {jax.device_count()}; "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )


@contextlib.contextmanager
def count_compilations():
    """Counts XLA compilations inside the block: ``with count_compilations() as n: ...; n[0]``."""
    count = [0]

    class _Handler(logging.Handler):
        def emit(self, record):
            # One such record per XLA compilation (small helper jits included: compare counts
            # between a first and a second call, not against an absolute number).
            if record.getMessage().startswith("Finished XLA compilation"):
                count[0] += 1

    handler = _Handler()
    logger = logging.getLogger("jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    with jax.log_compiles(True):
        try:
            yield count
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)


def all_reduced_arrays(hlo: str) -> int:
    """How many arrays a compiled program's all-reduces carry, from its HLO text (XLA:CPU runs a
    tuple all-reduce as one collective per operand, so this counts collectives)."""
    calls = re.findall(r" all-reduce(?:-start)?\(([^)]*)\)", hlo)
    return sum(len(re.findall(r"%[\w.\-]+", call)) for call in calls)


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees of arrays."""
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b, f"tree structures differ: {tree_a} vs {tree_b}"
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_checkpoint_resumes(dp, state, batches, path, restore=None):
    """Saves ``state`` with orbax, restores it onto the same shardings (or with
    ``restore(path)``, a run's own ``restore``), checks it bit for bit, then runs ``dp.step`` on
    ``batches`` from both and checks they stay bit-identical. Returns the state after the
    batches."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored = checkpointer.restore(path, target) if restore is None else restore(path)
    assert_trees_equal(restored, state)
    for batch in batches:
        state, _ = dp.step(state, batch)
        restored, _ = dp.step(restored, batch)
    assert_trees_equal(restored, state)
    return state


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(path) -> list:
    """The JSON objects a worker process printed one per line into ``path``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def wait_for(predicate, seconds, what) -> None:
    """Polls ``predicate`` every 0.1 s; fails the test naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

#: The checkout's benchmarks/ folder (scripts, not a package).
BENCHMARKS_DIR = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks")


_SERVE = """
import sys
from jaxcomp.distributed import quorum
port, workers, failure_timeout = map(int, sys.argv[1:])
service = quorum.host_service(f"[::]:{port}", workers, failure_timeout=failure_timeout)
print("READY", flush=True)
sys.stdin.read()
service.shutdown()
"""


def service_process(port: int, workers: int, failure_timeout: int):
    """JAX's coordination service (``quorum.host_service``) in a process of its own, on ``port``,
    until its stdin closes or it is killed: a ``subprocess.Popen``, returned once it listens."""
    import subprocess

    command = [sys.executable, "-c", _SERVE, str(port), str(workers), str(failure_timeout)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env(), text=True
    )
    assert process.stdout.readline().strip() == "READY"
    return process


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` imported as the module ``benchmarks_<name>``
    (registered in ``sys.modules``, where dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", os.path.join(BENCHMARKS_DIR, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def subprocess_env(**overrides):
    """Environment for a Python subprocess that must import the same jaxcomp as this process.

    In CI jaxcomp is the installed package; in a development tree (``make dev``, run with
    ``PYTHONPATH=<checkout>``) it is the checkout. Putting the checkout on the path regardless
    would shadow the installed package with sources that have no compiled module. Start such
    subprocesses with ``cwd`` outside the checkout too: ``python -c``/``-m`` put the working
    directory first on ``sys.path``.
    """
    import jaxcomp

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomp.__file__)))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_parent, TESTS_DIR, *inherited]))
    env.update(overrides)
    return env


def cluster_hosts_import_this_jaxcomp(monkeypatch):
    """For a test that starts an emulated cluster's hosts from this process (``Cluster``, the
    netbench and benchmark drivers): checks that the cluster can be built (CI runs as root: a
    missing capability is a failure, not a skip) and puts this jaxcomp on the hosts'
    ``PYTHONPATH`` for the test's duration."""
    from jaxcomp.distributed import cluster

    cluster.check_support()
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])


class EntryGraph:
    """The data dependencies of a compiled module's ENTRY computation (``compile().as_text()``):
    each instruction's kind, operands and transitive ancestors, and the computations it calls.

    Example: ``EntryGraph(hlo).ancestors("all-reduce.3") & EntryGraph(hlo).dots()``, the dots
    that all-reduce waits for.
    """

    def __init__(self, hlo: str):
        self.hlo = hlo
        self.entry = hlo[hlo.index("\nENTRY") :]
        self.operands, self.kinds, self.order, self.lines = {}, {}, [], {}
        for line in self.entry.splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = \S+ ([a-z][a-z\-]*)\((.*)$", line)
            if m is None:
                m = re.match(r"\s*(?:ROOT )?%(\S+) = \(.*?\) ([a-z][a-z\-]*)\((.*)$", line)
            if m is None:
                continue
            name, kind, rest = m.groups()
            self.operands[name] = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            self.kinds[name] = kind
            self.order.append(name)
            self.lines[name] = line
        self.bodies = dict(re.findall(r"\n%(\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
        self._seen = {}

    def ancestors(self, name: str) -> set:
        """Every instruction ``name`` depends on, transitively."""
        if name not in self._seen:
            self._seen[name] = set()
            found = set()
            for o in self.operands.get(name, []):
                found |= {o} | self.ancestors(o)
            self._seen[name] = found
        return self._seen[name]

    def collective_conditionals(self) -> list:
        """The entry's conditionals whose branches run a collective (in program order)."""
        collective = re.compile(
            r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
        )
        return [
            name
            for name in self.order
            if self.kinds[name] == "conditional" and collective.search(self.calls(name))
        ]

    def dots(self) -> set:
        """The entry's dots and the fusions that run one (XLA:CPU's library fusions)."""
        fused = {
            name
            for name in self.order
            if self.kinds[name] == "fusion" and " dot(" in self.calls(name, transitive=False)
        }
        return fused | {n for n in self.order if self.kinds[n] == "dot"}

    def calls(self, name: str, transitive: bool = True) -> str:
        """The text of the computations instruction ``name`` calls (fusions, branches, bodies),
        with theirs when ``transitive``."""
        todo = self._called(self.lines[name])
        seen, text = set(), []
        while todo:
            computation = todo.pop()
            if computation in seen or computation not in self.bodies:
                continue
            seen.add(computation)
            body = self.bodies[computation]
            text.append(body)
            if transitive:
                todo.extend(self._called(body))
        return "\n".join(text)

    @staticmethod
    def _called(text: str) -> list:
        names = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", text)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
            names += re.findall(r"%([\w.\-]+)", group)
        return names


def allocator_check_script(directory) -> str:
    """A script, written into ``directory``, that exits 0 when its process started with the
    allocator its first argument names (``jaxcomp.ops.allocator.started_with``), else 3: what
    the launchers' ``--allocator`` tests run in every process."""
    import pathlib

    script = pathlib.Path(directory) / "check_allocator.py"
    script.write_text(
        "import sys\nfrom jaxcomp.ops import allocator\n"
        "sys.exit(0 if allocator.started_with() == sys.argv[1] else 3)\n"
    )
    return str(script)


def run_resumable(args, cwd, results_file):
    """Runs a benchmark command that appends its runs to ``cwd / results_file``, then runs it
    again and checks that nothing ran twice (it resumes). Returns the first run's completed
    process and its ``results``."""
    import json
    import subprocess

    first = subprocess.run(args, env=subprocess_env(), cwd=cwd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    with open(cwd / results_file) as f:
        results = json.load(f)["results"]
    again = subprocess.run(args, env=subprocess_env(), cwd=cwd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    with open(cwd / results_file) as f:
        assert len(json.load(f)["results"]) == len(results)  # nothing ran twice
    return first, results
