"""``jaxcomp netbench --to-loss --fault-tolerant``: time to quality of fault-tolerant DiLoCo
(:func:`jaxcomp.distributed.diloco_ft.diloco_ft`) on an emulated cluster, undisturbed and with
one worker SIGKILLed mid-run and restarted.

    sudo jaxcomp netbench --to-loss --fault-tolerant --hosts 4 --rate 100mbit --model small \\
        --steps 4500 --max-steps 6000 --eval-every 150 --kill-at-step 1800 --restart-after 60 \\
        --dp-from benchmarks/results/time_to_quality_cluster_small_4500_100mbit.json --out o

Each emulated host (:class:`jaxcomp.distributed.cluster.Cluster`, one network namespace behind a
``tbf`` link at ``--rate``) runs one worker, a JAX program of its own
(:mod:`jaxcomp.cli._ft_worker`): the char-LM of ``--to-loss``, Adam on its schedule
inside, plain averaging outside (``optax.sgd(1.0)``, the ``diloco-h50-avg`` row's), float32
pseudo-gradients (or with ``--compress int8``, 8 bits a value with error feedback) exchanged
through the coordination service's key-value store every ``--sync-every`` steps. The service
runs in a process of the launcher's, in the cluster's bridge namespace at ``<subnet>.254`` (its
own link is not shaped; every host's is): no worker hosts it, so any worker may die. The run
``--runs kill`` SIGKILLs worker ``--kill-worker`` once it has committed the sync at
``--kill-at-step`` and restarts it ``--restart-after`` seconds later; with
``--kill-service`` it SIGKILLs the service instead, once worker 0 has committed that sync, and
restarts it at the same address (the workers keep their state and reconnect).

Worker 0's curve is the run's: the held-out loss of the global params every ``--eval-every``
steps (every worker evaluates the same bits and stops at the same sync: at the target or at
``--max-steps``), training wall-clock and CPU seconds with the compilation and evaluations left
out, bytes it put, and bytes its ``eth0`` sent; the record is ``--to-loss``'s
(``time_to_quality.json``), each row with its processes (exit codes, CPU seconds, whether one
hung). The target is the final loss of ``dp`` in ``--dp-from`` (a ``--to-loss`` result of the
same model, steps and rate, whose ``dp`` row is copied in with its source), or none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from jaxcomp.cli import _report
from jaxcomp.training import charlm

#: The service's address in the cluster's subnet (the hosts are .1 to .N).
SERVICE_HOST = 254


def _row_name(args, kill):
    name = f"diloco-ft-h{args.sync_every}-avg" + ("-int8" if args.compress == "int8" else "")
    name += "-eager" if args.eager else ""
    if kill:
        victim = "service" if args.kill_service else args.kill_worker
        name += f"-kill{victim}-restart{args.restart_after:g}s"
    return name


def _config(args):
    base = charlm.QUICK if args.quick else charlm.MODELS[args.model]
    return dataclasses.replace(base, steps=args.steps)


class _Run:
    """One run on a built cluster: the service, a worker per host, the kill and the restart."""

    def __init__(self, cluster, args, folder, port, target, kill):
        self.cluster, self.args, self.folder, self.kill = cluster, args, folder, kill
        self.address = f"{cluster.subnet}.{SERVICE_HOST}:{port}"
        self.target, self.popens, self.killed = target, {}, None
        self.service = self.restarted = None

    def _log(self, rank, incarnation, what="jsonl"):
        return os.path.join(self.folder, f"worker{rank}.{incarnation}.{what}")

    def events(self, rank, incarnation):
        try:
            with open(self._log(rank, incarnation)) as f:
                return [json.loads(line) for line in f if line.startswith("{")]
        except (FileNotFoundError, json.JSONDecodeError):  # not yet, or a line half written
            return []

    def _python(self, namespace, *arguments, **popen):
        command = ["ip", "netns", "exec", namespace, sys.executable, "-m"]
        command += ["jaxcomp.cli._ft_worker", *arguments]
        return subprocess.Popen(command, cwd=self.folder, start_new_session=True, **popen)

    def start_service(self):
        a = self.args
        bind = f"0.0.0.0:{self.address.rsplit(':', 1)[1]}"
        self.service = self._python(
            self.cluster.bridge_namespace,
            *("serve", bind, str(a.hosts), str(a.failure_timeout)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.folder, "service.err"), "w"),
            text=True,
        )
        ready, _, _ = select.select([self.service.stdout], [], [], 120)  # bounded: no hang
        if not ready or self.service.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the coordination service did not start ({self.folder})")

    def start_worker(self, rank, incarnation):
        a = self.args
        options = dict(model="quick" if a.quick else a.model, steps=a.steps, seed=0)
        options.update(max_steps=a.max_steps, eval_every=a.eval_every, sync_every=a.sync_every)
        options.update(sync_timeout=a.sync_timeout, failure_timeout=a.failure_timeout)
        options.update(rank=rank, workers=a.hosts, address=self.address, target=self.target)
        options.update(incarnation=incarnation, pace=a.pace, compress=a.compress, eager=a.eager)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        flags = env.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
        self.popens[rank, incarnation] = self._python(
            self.cluster.namespace(rank),
            *("train", json.dumps(options)),
            stdout=open(self._log(rank, incarnation), "w"),
            stderr=open(self._log(rank, incarnation, "err"), "w"),
            env=env,
        )

    def _kill_due(self):
        """SIGKILLs the worker (or with ``--kill-service``, the service) once the worker (worker
        0) committed the sync at ``--kill-at-step``; restarts it ``--restart-after`` seconds
        later."""
        a = self.args
        rank = 0 if a.kill_service else a.kill_worker
        if self.killed is None:
            syncs = [e for e in self.events(rank, 0) if e["event"] == "sync"]
            if syncs and syncs[-1]["step"] >= a.kill_at_step:
                victim = self.service if a.kill_service else self.popens[rank, 0]
                os.killpg(victim.pid, signal.SIGKILL)  # a worker is reaped by poll()
                self.killed = time.monotonic()
        elif self.restarted is None and time.monotonic() >= self.killed + a.restart_after:
            if a.kill_service:
                self.service.wait()
                self.start_service()
            else:
                self.start_worker(rank, 1)
            self.restarted = time.monotonic()

    def run(self):
        """Starts everything, waits (bounded), and returns ``{(rank, incarnation): exit code or
        None for a process that was still running at the deadline or the grace after worker 0
        ended (it hung)}``."""
        a = self.args
        deadline, grace, codes = time.monotonic() + a.timeout, None, {}
        try:
            self.start_service()
            for rank in range(a.hosts):
                self.start_worker(rank, 0)
            while any(p.poll() is None for p in self.popens.values()):
                if self.kill:
                    self._kill_due()
                if grace is None and self.popens[0, 0].poll() is not None:
                    grace = time.monotonic() + 3 * a.failure_timeout + 30
                if time.monotonic() > min(deadline, grace or deadline):
                    break
                time.sleep(0.1)
        finally:
            for key, p in self.popens.items():
                codes[key] = p.poll()
                if codes[key] is None:
                    _kill(p)
            if self.service is not None:
                self.service.stdin.close()
                try:
                    self.service.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _kill(self.service)
        return codes


def _kill(popen):
    """SIGKILLs ``popen``'s process group and reaps it."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass
    popen.wait()


def _victim(run):
    """The rank of the worker the run kills, or None."""
    return run.args.kill_worker if run.kill and not run.args.kill_service else None


def _process(run, key, code):
    """What a worker process did: its exit, CPU seconds, syncs and when it was killed."""
    events = run.events(*key)
    last_cpu = [e["cpu_total"] for e in events if "cpu_total" in e]
    done = next((e for e in events if e["event"] == "done"), None)
    syncs = [e for e in events if e["event"] == "sync"]
    joined = next((e for e in syncs if e["joined"]), None)
    return dict(
        rank=key[0],
        incarnation=key[1],
        exit=code,
        hung=code is None,
        cpu=last_cpu[-1] if last_cpu else None,
        syncs=len(syncs),
        first_step=syncs[0]["step"] if syncs else None,
        done=done,
        joined=None if joined is None else {k: joined[k] for k in ("step", "members", "t")},
        killed_t=run.killed if key == (_victim(run), 0) else None,
        restarted_t=run.restarted if key == (_victim(run), 1) else None,
        started_t=events[0]["t"] if events else None,
    )


def _result(run, codes, started):
    """The row in ``--to-loss``'s format, with its processes, from worker 0's events."""
    a = run.args
    evals = [e for e in run.events(0, 0) if e["event"] == "eval"]
    keys = ("step", "seconds", "cpu", "loss", "bytes", "wire")
    curve = [{k: e.get(k) for k in keys} for e in evals]
    processes = [_process(run, key, code) for key, code in sorted(codes.items())]
    options = dict(kind="diloco_ft", sync_every=a.sync_every, outer="avg", compress=a.compress)
    options.update(failure_timeout=a.failure_timeout, workers=a.hosts, eager=a.eager)
    if run.kill:
        victim = {"kill_service": True} if a.kill_service else {"kill_worker": a.kill_worker}
        options.update(victim, kill_at_step=a.kill_at_step, restart_after=a.restart_after)
    row = dict(
        name=_row_name(a, run.kill),
        curve=curve,
        steps=curve[-1]["step"] if curve else 0,
        options=options,
        processes=processes,
        wall=time.monotonic() - started,
    )
    if run.kill and a.kill_service:
        row.update(service=dict(killed_t=run.killed, restarted_t=run.restarted))
    return row


def _runs(args, target):
    """The runs asked for on one cluster: their rows."""
    from jaxcomp.distributed.cluster import Cluster, sigterm_as_interrupt

    kills = {"both": (False, True), "undisturbed": (False,), "kill": (True,)}[args.runs]
    rows = []
    with sigterm_as_interrupt(), Cluster(args.hosts, rate=args.rate) as cluster:
        ip = f"{cluster.subnet}.{SERVICE_HOST}/24"
        address = ["ip", "-n", cluster.bridge_namespace, "addr", "add", ip, "dev", "br0"]
        subprocess.run(address, check=True, capture_output=True)
        for index, kill in enumerate(kills):
            with tempfile.TemporaryDirectory(prefix="jaxcomp-ft-") as folder:
                print(
                    f"{_row_name(args, kill)}: {args.hosts} hosts at {args.rate}", file=sys.stderr
                )
                run = _Run(cluster, args, folder, 7740 + index, target, kill)
                started = time.monotonic()
                codes = run.run()
                rows.append(_result(run, codes, started))
                if args.keep_logs:
                    _keep(folder, os.path.join(args.keep_logs, rows[-1]["name"]))
    return rows


def _keep(folder, where):
    import shutil

    shutil.copytree(folder, where, dirs_exist_ok=True)


def _dp(args, config):
    """``--dp-from``'s dp row at ``--rate`` (checked: the same model and steps), with its
    source; None without the flag."""
    if not args.dp_from:
        return None
    with open(args.dp_from) as f:
        record = json.load(f)
    same = {k: v for k, v in dataclasses.asdict(config).items() if k != "steps"}
    theirs = {k: record["config"].get(k) for k in same}
    if theirs != same or record["config"]["steps"] != args.steps:
        raise SystemExit(f"--dp-from {args.dp_from}: another model or --steps ({record['config']})")
    for rate, rows in record["panels"]:
        dp = next((r for r in rows if r["name"] == "dp"), None)
        if rate == args.rate and dp is not None:
            return dict(dp, source=dict(file=args.dp_from, command=record.get("command")))
    raise SystemExit(f"--dp-from {args.dp_from}: no dp row at {args.rate}")


def _ratio(rows):
    """The killed run's seconds to the target over the undisturbed run's (None unless both
    reached it)."""
    from jaxcomp.training.to_loss_loop import summarize

    runs = {r["options"].get("kill_at_step") is not None: r for r in rows if "processes" in r}
    if len(runs) < 2 or "target" not in runs[False]:
        return None
    undisturbed, killed = (summarize(runs[k], runs[k]["target"], 1) for k in (False, True))
    if undisturbed["to_target"] is None or killed["to_target"] is None:
        return None
    return killed["to_target"] / undisturbed["to_target"]


def _describe(rows, target):
    """Lines per run: time to the target, steps, the processes' CPU seconds and exits."""
    lines = []
    for r in rows:
        reached = next((p for p in r["curve"][1:] if target and p["loss"] <= target), None)
        when = f"{reached['seconds']:.1f} s" if reached else "target not reached"
        last = r["curve"][-1] if r["curve"] else {}
        lines.append(
            f"{r['name']}: {when}, {r['steps']} steps, final loss {last.get('loss', math.nan):.4f},"
            f" wall {r['wall']:.1f} s (with start-up and evaluations)"
        )
        for p in r["processes"]:
            lines.append(
                f"  worker {p['rank']}.{p['incarnation']}: exit {p['exit']}, "
                f"{'HUNG, ' if p['hung'] else ''}cpu {p['cpu'] or 0:.1f} s, {p['syncs']} syncs"
                + (f", joined at step {p['joined']['step']}" if p["joined"] else "")
            )
    return lines


def _parser():
    parser = argparse.ArgumentParser(
        prog="jaxcomp netbench --to-loss --fault-tolerant",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each")
    parser.add_argument("--rate", default="100mbit", help="every host link's rate")
    parser.add_argument("--model", default="small", choices=sorted(charlm.MODELS))
    parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps")
    parser.add_argument("--steps", type=int, default=300, help="the schedule's (and dp's) steps")
    parser.add_argument("--max-steps", type=int, help="the cap (default 3x --steps)")
    parser.add_argument("--eval-every", type=int, help="a multiple of H (default ~steps / 10)")
    parser.add_argument("--sync-every", type=int, default=50, help="H, inner steps per sync")
    parser.add_argument("--failure-timeout", type=int, default=10, help="seconds: heartbeats")
    parser.add_argument(
        "--compress",
        choices=("none", "int8"),
        default="none",
        help="pseudo-gradients as float32, or 8 bits a value with error feedback (ft_codecs.Int8)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="each sync's exchange on a host thread beside the next H steps, applied a round late",
    )
    parser.add_argument("--sync-timeout", type=float, default=600.0, help="seconds a barrier")
    parser.add_argument("--runs", choices=("both", "undisturbed", "kill"), default="both")
    parser.add_argument("--kill-worker", type=int, default=2, help="the worker killed (not 0)")
    parser.add_argument(
        "--kill-service",
        action="store_true",
        help="kill the coordination service instead of a worker (after worker 0's sync)",
    )
    parser.add_argument("--kill-at-step", type=int, help="after this sync (default --steps / 2)")
    parser.add_argument("--restart-after", type=float, default=60.0, help="seconds after it")
    parser.add_argument("--dp-from", help="a --to-loss time_to_quality.json: dp, the target")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument(
        "--pace", type=float, default=0.0, help="seconds each worker sleeps a step (tests)"
    )
    parser.add_argument("--out", help="write time_to_quality.json here")
    parser.add_argument("--keep-logs", help="copy the workers' logs here")
    return parser


def _check(parser, args):
    """Flag errors and defaults, before anything runs."""
    for flag in ("hosts", "steps", "max_steps", "eval_every", "sync_every", "failure_timeout"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    args.max_steps = args.max_steps or 3 * args.steps
    h = args.sync_every
    args.eval_every = args.eval_every or max(h, round(args.steps / 10 / h) * h)
    if args.eval_every % h:
        parser.error(f"--eval-every {args.eval_every} must be a multiple of --sync-every {h}")
    args.kill_at_step = args.kill_at_step or args.steps // 2
    if args.max_steps < args.steps:
        parser.error("--max-steps must be >= --steps")
    if not 1 <= args.kill_worker < args.hosts:
        parser.error(f"--kill-worker must be in [1, {args.hosts}): worker 0's curve is the run's")
    if _config(args).batch % args.hosts:
        parser.error(f"--hosts {args.hosts} must divide the model's batch {_config(args).batch}")
    if not (math.isfinite(args.restart_after) and args.restart_after >= 0):
        parser.error("--restart-after must be seconds >= 0")


def main(argv=None) -> int:
    """Runs ``jaxcomp netbench --to-loss --fault-tolerant`` (see the module's docstring).

    Args:
      argv: the arguments after ``--fault-tolerant`` (default ``sys.argv[1:]``); ``--help``
        lists them.

    Returns:
      0, or 1 when a worker hung or a surviving worker failed (bad flags exit with status 2).

    Example:
      >>> main(["--quick", "--hosts", "4", "--steps", "12", "--sync-every", "2",
      ...       "--kill-at-step", "4", "--restart-after", "3", "--runs", "kill",
      ...       "--out", "o"])  # doctest: +SKIP
      0

    References:
      Mattson et al., "MLPerf Training Benchmark" (MLSys 2020): time to a target quality;
      Douillard et al., "DiLoCo" (arXiv 2311.08105); torchft (meta-pytorch/torchft): a quorum
      per step, the model of :mod:`jaxcomp.distributed.quorum`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    config = _config(args)
    dp = _dp(args, config)
    target = None if dp is None else dp["curve"][-1]["loss"]
    rows = _runs(args, target)
    for r in rows:
        r["target"] = target
    ratio = _ratio(rows)
    print("\n".join(_describe(rows, target)))
    if ratio is not None:
        print(f"killed and restarted over undisturbed, to dp's loss {target:.4f}: {ratio:.2f}x")
    title = (
        f"char-LM, {charlm.count_params(config) / 1e6:.2f}M params, {config.batch} sequences of "
        f"{config.context} characters a step, {args.hosts} emulated hosts, fault-tolerant DiLoCo"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = dict(command=["jaxcomp", "netbench", "--to-loss", "--fault-tolerant", *argv])
        record.update(machine=_report.machine())
        record.update(config=dataclasses.asdict(config), title=title, ratio=ratio)
        record.update(panels=[(args.rate, ([dp] if dp else []) + rows)])
        with open(os.path.join(args.out, "time_to_quality.json"), "w") as f:
            json.dump(record, f)
    failed = [p for r in rows for p in r["processes"] if p["hung"] or _failed(args, r, p)]
    return 1 if failed else 0


def _failed(args, row, process):
    """A process that ended badly: any but the killed incarnation with a non-zero exit."""
    killed = row["options"].get("kill_worker") == process["rank"] and process["incarnation"] == 0
    return process["exit"] != (-signal.SIGKILL if killed else 0)
