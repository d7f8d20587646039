"""An emulated cluster on one Linux machine: N hosts in network namespaces behind rate-limited
links.

    jaxcomp cluster --hosts 4 --rate 1gbit -- train.py --steps 10

builds four hosts, each a network namespace with one interface ``eth0`` (a veth) plugged into a
bridge in a namespace of its own, shapes both directions of every host link with ``tc qdisc ...
tbf`` at ``rate``, and starts ``train.py`` once per host as the processes of one
``jax.distributed`` job (the script calls :func:`jaxcomp.distributed.launch.initialize`). The root
namespace is never touched; everything is torn down on exit, error, timeout and Ctrl-C
(``jaxcomp cluster --cleanup`` removes what a killed run left). Needs root, iproute2's ``ip`` and
``tc`` and the ``tbf`` qdisc; added delay needs ``netem``, and asking for it without is an error.
docs/network.md ("The emulated cluster") is the guide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxcomp.distributed import launch
from jaxcomp.distributed.rates import format_rate, parse_rate  # noqa: F401  (here too)

#: Namespace names start with this, then the creating process's id: ``jaxcomp-<pid>-h0``.
PREFIX = "jaxcomp-"

#: The interface every emulated host has (what gloo is told to bind to).
INTERFACE = "eth0"

#: The /24 the hosts are numbered in: host i is ``<subnet>.<i + 1>``.
DEFAULT_SUBNET = "10.213.0"


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or a host process failed."""


def _run(*args, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode:
        raise ClusterError(
            f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def check_support() -> None:
    """Raises :class:`ClusterError` saying what is missing, before anything is created.

    Checks the platform (Linux), root, the ``ip`` and ``tc`` commands and network namespaces.

    Returns:
      None when everything an emulated cluster needs is here.

    Example:
      >>> import os
      >>> check_support() if os.geteuid() == 0 else None  # root on Linux with iproute2: passes

    References:
      Linux network namespaces, veth and ``tc-tbf(8)`` (iproute2); docs/network.md, section 2.
    """
    missing = []
    if sys.platform != "linux":
        missing.append(f"Linux network namespaces (this is {sys.platform})")
    elif os.geteuid() != 0:
        missing.append(
            "root: network namespaces, veth links and qdiscs need CAP_NET_ADMIN and CAP_SYS_ADMIN "
            "(run as root, or under sudo)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (Debian/Ubuntu: apt-get install iproute2)")
    if sys.platform == "linux" and not os.path.exists("/proc/self/ns/net"):
        missing.append("network namespace support in the kernel (/proc/self/ns/net is absent)")
    if missing:
        raise ClusterError(
            "jaxcomp cluster cannot emulate hosts here; missing: " + "; ".join(missing)
        )


@dataclasses.dataclass
class HostProcess:
    """One host's process of a job started by :meth:`Cluster.start`."""

    host: int
    popen: subprocess.Popen


class Cluster:
    """N emulated hosts joined by a bridge, each link shaped to ``rate`` in both directions.

    Use it as a context manager; it builds everything on entry and tears everything down on exit,
    whatever happened inside.

    Args:
      hosts: number of hosts, ``>= 1``.
      rate: link rate of every host in both directions (``"1gbit"``, ``"100mbit"``, bits per
        second as a number), or None for no limit.
      delay: one-way delay to add per link (``"1ms"``). Needs the ``netem`` qdisc; a kernel
        without it raises :class:`ClusterError` when the cluster is built.
      subnet: the first three octets of the private /24 the hosts are numbered in.
      burst: tbf bucket in bytes (default: 4 ms at ``rate``, at least 32 KiB).

    Example:
      >>> from jaxcomp.distributed.cluster import Cluster
      >>> with Cluster(2, rate="100mbit") as cluster:  # doctest: +SKIP
      ...     codes = cluster.run(["train.py", "--steps", "10"], timeout=600)
      ...     sent = [c["tx_bytes"] for c in cluster.counters()]  # bytes each host's eth0 sent
      >>> codes  # doctest: +SKIP
      [0, 0]
    """

    def __init__(
        self,
        hosts: int,
        rate=None,
        *,
        delay=None,
        subnet: str = DEFAULT_SUBNET,
        burst: int | None = None,
    ):
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be an integer in [1, 250], got {hosts!r}")
        self.hosts = hosts
        self.rate = parse_rate(rate)
        self.delay = None if delay in (None, 0, "0", "0ms") else str(delay)
        if (
            not re.fullmatch(r"(10|172\.(1[6-9]|2[0-9]|3[01])|192\.168)(\.\d{1,3}){1,2}", subnet)
            or subnet.count(".") != 2
            or any(int(o) > 255 for o in subnet.split("."))
        ):
            raise ValueError(
                f"subnet must be three octets of a private network, e.g. '10.213.0', got {subnet!r}"
            )
        self.subnet = subnet
        if burst is not None and (
            isinstance(burst, bool) or not isinstance(burst, int) or burst < 1600
        ):
            raise ValueError(f"burst must be an integer number of bytes >= 1600, got {burst!r}")
        self.burst = burst
        self.name = f"{PREFIX}{os.getpid()}"
        self.namespaces: list[str] = []
        self.processes: list[HostProcess] = []
        self._baseline: list[dict] | None = None

    # -- names --------------------------------------------------------------------------------

    @property
    def bridge_namespace(self) -> str:
        return f"{self.name}-br"

    def namespace(self, host: int) -> str:
        """The network namespace of ``host`` (for ``ip netns exec``)."""
        return f"{self.name}-h{host}"

    def address(self, host: int) -> str:
        """The IPv4 address of ``host``'s ``eth0``."""
        return f"{self.subnet}.{host + 1}"

    # -- building and tearing down ------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        """Builds the namespaces, bridge, links and qdiscs (everything made is undone on
        failure)."""
        check_support()
        if self.delay is not None:
            raise ClusterError(
                f"delay={self.delay!r} needs the netem qdisc, which this kernel lacks or which "
                "cannot be checked without creating a namespace; jaxcomp cluster emulates rate "
                "only (tbf)"
                if not _has_netem()
                else "delay is not supported by jaxcomp cluster yet; emulate rate only"
            )
        try:
            self._add_namespace(self.bridge_namespace)
            _run("ip", "-n", self.bridge_namespace, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_namespace, "link", "set", "br0", "up")
            for host in range(self.hosts):
                ns = self.namespace(host)
                self._add_namespace(ns)
                port = f"h{host}"
                # Made inside the bridge's namespace with its peer placed straight into the host's:
                # nothing is ever created in the root namespace.
                veth = f"link add {port} type veth peer name {INTERFACE} netns {ns}"
                _run("ip", "-n", self.bridge_namespace, *veth.split())
                _run("ip", "-n", self.bridge_namespace, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge_namespace, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
                _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(host)
        except BaseException:
            self.close()
            raise
        self._baseline = self._read_counters()

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)

    def _shape(self, host: int) -> None:
        """tbf on both directions of ``host``'s link: its eth0 (upload) and its bridge port
        (download)."""
        for ns, dev in ((self.namespace(host), INTERFACE), (self.bridge_namespace, f"h{host}")):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if self.rate is None:
                continue
            bytes_per_second = self.rate / 8
            burst = self.burst or max(32 * 1024, int(bytes_per_second * 0.004))
            # The queue holds 50 ms at rate: deep enough that TCP reaches the rate, bounded so the
            # queue cannot hide a slow link.
            limit = burst + int(bytes_per_second * 0.05)
            tbf = f"tbf rate {int(self.rate)}bit burst {burst} limit {limit}"
            result = _run(
                "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf.split(), check=False
            )
            if result.returncode:
                raise ClusterError(
                    f"the kernel refused the tbf qdisc ({result.stderr.strip()}); jaxcomp cluster "
                    "needs sch_tbf to limit the rate (or pass rate=None)"
                )

    def set_rate(self, rate) -> None:
        """Changes every link's rate (both directions) while the cluster runs; None removes the
        limit."""
        self.rate = parse_rate(rate)
        for host in range(self.hosts):
            self._shape(host)

    def close(self) -> None:
        """Kills the host processes and deletes every namespace this cluster made (idempotent)."""
        self.stop()
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces = []

    # -- processes ----------------------------------------------------------------------------

    def start(
        self,
        command: Sequence[str],
        *,
        devices_per_host: int = 1,
        port: int = 7733,
        env=None,
        stdout=None,
        stderr=None,
        cwd=None,
    ) -> list[HostProcess]:
        """Starts ``python *command`` once per host, as the processes of one ``jax.distributed``
        job, which they join with :func:`jaxcomp.distributed.launch.initialize`.

        Args:
          command: arguments after ``python``: a script and its arguments, or ``["-m", ...]``.
          devices_per_host: CPU devices each process gets.
          port: the coordinator's port on host 0.
          env: extra environment variables for every process.
          stdout, stderr: passed to ``subprocess.Popen`` (default: inherited).
          cwd: the processes' working directory (default: this one's). ``-m module`` puts it
            first on ``sys.path``: run from a source checkout, that would import the checkout
            instead of the installed package.

        Returns:
          One :class:`HostProcess` per host.
        """
        if not self.namespaces:
            raise ClusterError(
                "the cluster is not built: use it as a context manager or call create() first"
            )
        if self.processes:
            raise ClusterError("a job is already running on this cluster; wait() for it first")
        command = list(command)
        if not command:
            raise ValueError("command must name a script (or -m module) to run")
        for host in range(self.hosts):
            host_env = launch.process_env(
                f"{self.address(0)}:{port}",
                self.hosts,
                host,
                devices_per_host,
                interface=INTERFACE,
                base=dict(os.environ, **(env or {})),
            )
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace(host), sys.executable, *command],
                env=host_env,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                start_new_session=True,
            )
            self.processes.append(HostProcess(host, popen))
        return self.processes

    def wait(self, timeout: float | None = None) -> list[int]:
        """Waits for the job; on the first failure (or timeout) the other processes are killed.

        Returns:
          Each host's exit code (124 for a process killed at the timeout, negative for a signal).
        """
        codes, _ = launch.wait_all(
            [p.popen for p in self.processes], timeout=timeout, kill=self._kill
        )
        self.processes = []
        return codes

    def run(
        self, command: Sequence[str], *, timeout: float | None = None, **start_options
    ) -> list[int]:
        """:meth:`start` then :meth:`wait`: each host's exit code."""
        self.start(command, **start_options)
        return self.wait(timeout)

    def _kill(self, popen: subprocess.Popen, sig=signal.SIGTERM) -> None:
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Kills every process of the running job (and their children)."""
        for process in self.processes:
            if process.popen.poll() is None:
                self._kill(process.popen, signal.SIGKILL)
        for process in self.processes:
            try:
                process.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.processes = []

    # -- what crossed the wire ----------------------------------------------------------------

    def _read_counters(self) -> list[dict]:
        """Each host's ``eth0`` counters: ``tx_bytes``, ``rx_bytes``, ``tx_packets``,
        ``rx_packets``."""
        keys = [(way, what) for what in ("bytes", "packets") for way in ("tx", "rx")]
        out = []
        for host in range(self.hosts):
            command = ("ip", "-n", self.namespace(host), "-s", "-j", "link", "show", INTERFACE)
            stats = json.loads(_run(*command).stdout)[0]["stats64"]
            out.append({f"{way}_{what}": stats[way][what] for way, what in keys})
        return out

    def counters(self) -> list[dict]:
        """Bytes and packets each host's ``eth0`` sent and received since the cluster was built."""
        if self._baseline is None:
            raise ClusterError("the cluster is not built")
        now = self._read_counters()
        return [
            {key: value - base[key] for key, value in current.items()}
            for current, base in zip(now, self._baseline)
        ]


def read_interface_counters(interface: str = INTERFACE, *, settle: float = 0.0) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``interface`` in this process's network namespace (Linux sysfs).

    A process inside an emulated host reads its own link this way, e.g. around the steps of one
    method; read with ``settle`` after them, since a collective can finish while this host's last
    sends still wait in the link's ``tbf`` queue.

    Args:
      interface: the interface's name (default ``eth0``, an emulated host's link).
      settle: seconds to wait at most for two reads 20 ms apart to agree on the bytes sent
        (default 0: one read). The bytes received are the peers' sends and may still move.

    Returns:
      Bytes sent and received since the interface came up, link-layer headers included.

    Example:
      >>> read_interface_counters("lo")[0] >= 0
      True
      >>> tx, rx = read_interface_counters("lo", settle=0.5)

    References:
      Linux ``/sys/class/net/<interface>/statistics`` (what ``ip -s link`` prints).
    """
    counters = _interface_counters(interface)
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL)
        again = _interface_counters(interface)
        settled = again[0] == counters[0]
        counters = again
        if settled:
            break
    return counters


#: Seconds between two reads of :func:`read_interface_counters` with ``settle``.
_SETTLE_POLL = 0.02


def _interface_counters(interface: str) -> tuple[int, int]:
    base = f"/sys/class/net/{interface}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except OSError as e:
        raise ClusterError(
            f"cannot read the byte counters of interface {interface!r}: {e}"
        ) from None


def _has_netem() -> bool:
    if os.path.exists("/sys/module/sch_netem"):
        return True
    try:
        with open("/proc/modules") as f:
            return any("sch_netem" in line for line in f)
    except OSError:
        return False


def leftovers() -> list[str]:
    """Namespaces left by jaxcomp clusters whose creating process no longer runs.

    Returns:
      Their names (``jaxcomp-<pid>-br``, ``jaxcomp-<pid>-h<i>``).

    Example:
      >>> isinstance(leftovers(), list)
      True

    References:
      Linux network namespaces, veth and ``tc-tbf(8)`` (iproute2); docs/network.md, section 2.
    """
    result = _run("ip", "netns", "list", check=False)
    stale = []
    for line in result.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-(br|h\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    return stale


def cleanup() -> list[str]:
    """Deletes the namespaces (with their links and qdiscs) that killed clusters left.

    Returns:
      The names of the namespaces deleted.

    Example:
      >>> cleanup()  # doctest: +SKIP
      []

    References:
      Linux network namespaces, veth and ``tc-tbf(8)`` (iproute2); docs/network.md, section 2.
    """
    check_support()
    stale = leftovers()
    for name in stale:
        _run("ip", "netns", "del", name, check=False)
    return stale


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises ``KeyboardInterrupt``, so that ``with Cluster(...)`` tears
    down (Python's default SIGTERM ends the process at once, leaving namespaces and processes).

    Returns:
      A context manager; the previous handler is restored on exit.

    Example:
      >>> with sigterm_as_interrupt():
      ...     pass

    References:
      Python ``signal`` module; ``kill(1)``'s default signal.
    """

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
