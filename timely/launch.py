"""Run a job file on worker processes: ``python -m timely.launch -w N job.py [args...]``.

Each worker process imports ``job.py`` and calls its ``main(worker)``; ``worker.args`` holds the
arguments after the job file. Across hosts, every host runs the same command with a shared hostfile
(one ``host[:baseport]`` line per host) and its own ``--host-index``::

    python -m timely.launch -w 4 --hostfile hosts.txt --host-index 0 job.py   # on host 0
    python -m timely.launch -w 4 --hostfile hosts.txt --host-index 1 job.py   # on host 1

Worker indices are global: ``host_index * N + local index``. Worker ``l`` of a host listens on
``baseport + l`` over tcp; on one host, workers talk over Unix sockets (``--transport ipc``, the
default) or loopback tcp from ``--port``.

Exit status: 0 when every worker on this host finished cleanly; 1 when a worker raised (its index
and traceback are printed), died (its index and signal are printed), stayed stopped by SIGSTOP /
SIGTSTP longer than ``--stopped-grace`` seconds (it is killed; a stop of the whole job, Ctrl-Z then
``fg``, is not one), or ``--timeout`` expired, after stopping the others (with ``--checkpoint DIR
--restarts R``, a worker that dies or raises first restarts the job from the latest checkpoint in
DIR, up to R times, one line each: ``timely.recovery``; ``--timeout`` bounds all the runs together); 2 for a usage error (a bad
option, an unreadable or empty ``--secret-file``) or a job file that cannot run (syntax error, no
``main``, a ``main`` that is not a function, or one that is an ``async def`` or a generator function
or returns a coroutine or generator, which would never run), before any worker runs the job; 130
on Ctrl-C, 143 on SIGTERM, 129 on SIGHUP; 141 (SIGPIPE, nothing printed, never restarted) when the
job's output pipe was closed (``job | head``).

Each worker's standard output and error are line-buffered: the workers' lines, in a file or a
pipe, never tear one another apart.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .cluster import STOPPED_GRACE, Outcome, local_endpoints, primary_failure, run_worker, signal_name, supervise
from .cluster import failure_error as failure_error  # re-exported: spark_bridge.barrier raises as timely.execute does
from .comm.endpoints import DEFAULT_PORT, hostfile_endpoints, parse_hostfile
from .comm.errors import HostfileError
from .comm.gate import check_token
from .comm.secret import JobSecret, SecretError, resolve
from .comm.zmq_allocator import MAX_HEARTBEAT_TIMEOUT
from .errors import TimelyError
from .recovery import run_restarting
from .worker import MainNotRunError, check_main

if TYPE_CHECKING:
    from .checkpoint.checkpointer import CheckpointConfig

#: Name the job module is imported under in each worker.
JOB_MODULE = "timely_job"


class JobFileError(TimelyError, ValueError):
    """A job file that cannot be run (missing, a syntax error, no ``main``)."""


class _UsageError(TimelyError, ValueError):
    """A command line that cannot run (reported with exit status 2, before any worker starts)."""


def check_job(path: str) -> None:
    """Compile ``path`` and check it defines ``main`` at top level, without running it."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise JobFileError(f"cannot read job file {path}: {exc.strerror}") from None
    try:
        tree = ast.parse(source, path)
        compile(tree, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or path}:{exc.lineno}" + (f":{exc.offset}" if exc.offset else "")
        text = f"\n    {exc.text.rstrip()}" if exc.text else ""
        raise JobFileError(f"{where}: {type(exc).__name__}: {exc.msg}{text}") from None
    except ValueError as exc:  # e.g. null bytes
        raise JobFileError(f"{path}: {exc}") from None
    if not _defines(tree.body, "main"):
        raise JobFileError(f"{path}: the job file defines no main(worker) function at top level")


def _defines(body: list[ast.stmt], name: str) -> bool:
    """True if the statements bind ``name`` at module level (def, assignment, import, or inside
    a top-level if / try / with block)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name or a.name == "*" for a in node.names):
                return True
        nested: list[list[ast.stmt]] = []
        if isinstance(node, (ast.If, ast.For, ast.While)):
            nested = [node.body, node.orelse]
        elif isinstance(node, ast.With):
            nested = [node.body]
        elif isinstance(node, ast.Try):
            nested = [node.body, node.orelse, node.finalbody] + [h.body for h in node.handlers]
        if any(_defines(b, name) for b in nested):
            return True
    return False


def load_job(path: str) -> Any:
    """Import the job file as module :data:`JOB_MODULE` (its directory goes first on ``sys.path``)."""
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(JOB_MODULE, path)
    if spec is None or spec.loader is None:
        raise JobFileError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[JOB_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # (a missing module, an error at import: a restart would repeat it)
        raise JobFileError(f"{path}: importing the job file raised {type(exc).__name__}: {exc}") from exc
    return module


def job_token(job: str, args: Sequence[str], hosts: list[tuple[str, int]], workers: int) -> str:
    """A token every host derives alike for the same job (file contents, args, hosts, size)."""
    h = hashlib.sha256()
    with open(job, "rb") as f:
        h.update(f.read())
    h.update(repr((list(args), hosts, workers)).encode())
    return h.hexdigest()[:32]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m timely.launch",
        description="Run job.py's main(worker) on N worker processes (per host).",
        epilog="Arguments after the job file are passed to the job as worker.args.")
    p.add_argument("-w", "--workers", type=int, default=1, metavar="N", help="worker processes on this host (default 1)")
    p.add_argument("--hostfile", metavar="FILE", help="one host[:baseport] line per host; every host runs -w N workers")
    p.add_argument("--host-index", type=int, default=0, metavar="I", help="this host's line in the hostfile (from 0)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="BASE",
                   help=f"first tcp port (default {DEFAULT_PORT}); worker l of a host listens on BASE+l")
    p.add_argument("--transport", choices=["ipc", "tcp"], default=None,
                   help="ipc (Unix sockets, one host only; the default without a hostfile) or tcp")
    p.add_argument("--token", default=os.environ.get("TIMELY_TOKEN"),
                   help="job token shared by all hosts (default: derived from the job file, args and hostfile)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the job secret: every host's workers talk over CURVE (authenticated and encrypted), and "
                        "worker.secret holds it for the job's servers (default: env TIMELY_SECRET, or the file "
                        "named by TIMELY_SECRET_FILE; none: links are open to whoever can reach them)")
    p.add_argument("--startup-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for all workers to connect (default 30)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                   help="a peer host silent for S seconds (TCP keepalive probes unanswered, or data "
                        "unacknowledged) is lost (default 30: generous, as a worker busy in one long step stops "
                        "reading; a crashed process is noticed at once)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop the job after S seconds (with --restarts: all its runs together)")
    p.add_argument("--watchdog", type=float, default=None, metavar="S",
                   help="end the job when one operator invocation lasts longer than S seconds, naming it "
                        "and printing the worker's stack")
    p.add_argument("--watchdog-warn", action="store_true",
                   help="with --watchdog: only print the report, let the job go on")
    p.add_argument("--stopped-grace", type=float, default=STOPPED_GRACE, metavar="S",
                   help="end the job when a worker stays stopped (SIGSTOP/SIGTSTP) longer than S seconds "
                        f"(default {STOPPED_GRACE:g}); a stop of the whole job (Ctrl-Z, then fg) is not one")
    p.add_argument("--progress", choices=["direct", "relay"], default="direct",
                   help="how progress travels: direct (every worker sends its progress to every worker, the "
                        "default) or relay (through worker 0, which forwards it, several batches to a message: "
                        "2(N-1) progress messages per round instead of N(N-1), for one more hop); every host "
                        "must use the same")
    ck = p.add_argument_group("checkpoints and recovery")
    ck.add_argument("--checkpoint", metavar="DIR",
                    help="take checkpoints in DIR (a directory or an fsspec URL) and resume from the latest one found "
                         "there; the same DIR with another -w rescales the job")
    ck.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="epochs between checkpoints (10)")
    ck.add_argument("--restarts", type=int, default=0, metavar="R",
                    help="on one host: when a worker dies or raises, start all workers again from the latest "
                         "checkpoint, up to R times (default 0)")
    ob = p.add_argument_group("observing and steering (one host)")
    ob.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="serve every worker's metrics for Prometheus on PORT (worker 0, loopback unless --metrics-host)")
    ob.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                    help="address of the Prometheus endpoint and the dashboard (default 127.0.0.1)")
    ob.add_argument("--dashboard", type=int, default=None, metavar="PORT",
                    help="serve a live dashboard on PORT (worker 0): operators, worker load, lag, bins, migrations; "
                         "the job's megaphone.Controller on worker 0 connects itself to it")
    ob.add_argument("--metrics-interval", type=float, default=1.0, metavar="S",
                    help="seconds between each worker's metrics reports (default 1)")
    ob.add_argument("--autobalance", nargs="?", const="", default=None, metavar="OPTS",
                    help="let megaphone.AutoBalancer move bins when the load is uneven; OPTS: comma-separated "
                         "knob=value (threshold, hold, cooldown, window, target, min_busy, interval, strategy); the job's "
                         "megaphone.Controller on worker 0 starts it (controller.balancer)")
    p.add_argument("--fuzz", type=int, default=None, metavar="SEED",
                   help="run under the schedule fuzzer seeded by SEED (batches split, reordered, delayed)")
    p.add_argument("job", help="the job file: a Python file defining main(worker)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the job (worker.args)")
    return p


def _error(message: str) -> int:
    sys.stderr.write(f"timely.launch: error: {message}\n")
    return 2


def _report(outcomes: list[Outcome]) -> None:
    """Print the primary failure (with its traceback) and one line for every other failure."""
    first = primary_failure(outcomes)
    if first.status == "error":
        sys.stderr.write(f"timely.launch: worker {first.index} failed:\n{(first.traceback or '').rstrip()}\n")
    else:
        sys.stderr.write(f"timely.launch: {first.describe()}\n")
    for o in outcomes:
        if o.failed and o is not first:
            sys.stderr.write(f"timely.launch: {o.describe()}\n")


class _Terminated(BaseException):
    """SIGTERM or SIGHUP received by the launcher (``args[0]``: the signal)."""


def _bare_autobalance(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--autobalance JOB.py ...``: the job file follows a bare ``--autobalance`` (whose OPTS are
    optional), not its OPTS (``knob=value`` pairs), so argparse must not take it as them. The scan
    of the launcher's options skips the values of those that take one (``-w 2``), as ``parser``
    defines them, and stops at the job file: what follows it is the job's."""
    i = 0
    while i < len(argv) - 1:
        arg = argv[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break  # the job file (or the end of the options)
        action = _option(parser, arg)
        if action is not None and action.dest == "autobalance" and "=" not in arg:
            following = argv[i + 1]
            if "=" not in following and (following.endswith(".py") or os.path.isfile(following)):
                return [*argv[:i], "--autobalance=", *argv[i + 1:]]
            i += 1 if following.startswith("-") else 2  # its OPTS, if they follow
            continue
        i += 2 if action is not None and action.nargs is None and _value_follows(arg, action) else 1
    return argv


def _option(parser: argparse.ArgumentParser, arg: str) -> argparse.Action | None:
    """The action of the launcher option ``arg`` (``--name``, ``--name=value``, ``-w``, ``-w2``,
    or an unambiguous abbreviation of a long name, as argparse allows); ``None`` if unknown."""
    actions = parser._option_string_actions
    name = arg.split("=", 1)[0] if arg.startswith("--") else arg
    if name in actions:
        return actions[name]
    if arg.startswith("--"):
        matches = {actions[o] for o in actions if o.startswith("--") and o.startswith(name)}
        return matches.pop() if len(matches) == 1 else None
    return actions.get(arg[:2])  # -w2: a short option with its value attached


def _value_follows(arg: str, action: argparse.Action) -> bool:
    """Whether the value of ``action``, written as ``arg``, is the next argument (not ``--name=v``
    or ``-wV``)."""
    return "=" not in arg if arg.startswith("--") else arg in action.option_strings


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the job on this host's workers and return the exit status."""
    parser = _parser()
    opts = parser.parse_args(_bare_autobalance(sys.argv[1:] if argv is None else list(argv), parser))
    try:
        if opts.workers < 1:
            raise _UsageError(f"-w must be at least 1, not {opts.workers}")
        if opts.timeout is not None and not opts.timeout > 0:
            raise _UsageError(f"--timeout must be a positive number of seconds, not {opts.timeout:g}")
        if opts.watchdog is not None and not opts.watchdog > 0:
            raise _UsageError(f"--watchdog must be a positive number of seconds, not {opts.watchdog:g}")
        for option, seconds in (("--heartbeat-timeout", opts.heartbeat_timeout),
                                ("--startup-timeout", opts.startup_timeout)):
            if not 0 < seconds < math.inf:
                raise _UsageError(f"{option} must be a positive number of seconds, not {seconds:g}")
        if opts.heartbeat_timeout > MAX_HEARTBEAT_TIMEOUT:  # (TCP_MAXRT: milliseconds in a C int)
            raise _UsageError(f"--heartbeat-timeout must be at most {MAX_HEARTBEAT_TIMEOUT} seconds (about 24 days), "
                              f"not {opts.heartbeat_timeout:g}")
        if opts.token is not None:  # (a longer one could never complete the workers' handshake)
            try:
                check_token(opts.token, "--token (or TIMELY_TOKEN)")
            except ValueError as exc:
                raise _UsageError(str(exc)) from None
        if (opts.hostfile or opts.transport == "tcp") and not 0 < opts.port <= 65536 - opts.workers:
            raise _UsageError(f"--port {opts.port}: the {opts.workers} worker(s) of a host would listen on ports "
                              f"{opts.port} to {opts.port + opts.workers - 1}, which must lie within 1-65535")
        if not opts.stopped_grace > 0:
            raise _UsageError(f"--stopped-grace must be a positive number of seconds, not {opts.stopped_grace:g}")
        if opts.checkpoint_every < 1:
            raise _UsageError(f"--checkpoint-every must be at least 1, not {opts.checkpoint_every}")
        if opts.restarts < 0:
            raise _UsageError(f"--restarts must be at least 0, not {opts.restarts}")
        if opts.restarts and not opts.checkpoint:
            raise _UsageError("--restarts needs --checkpoint DIR to resume from")
        if opts.restarts and opts.hostfile:
            raise _UsageError("--restarts works on one host only (without --hostfile)")
        if opts.watchdog_warn and opts.watchdog is None:
            raise _UsageError("--watchdog-warn needs --watchdog S")
        autobalance = _check_observe(opts)
        check_job(opts.job)
        try:
            secret = resolve(None, opts.secret_file)  # once here, not in every worker
        except SecretError as exc:
            raise _UsageError(str(exc)) from None
        with contextlib.ExitStack() as cleanup:
            endpoints, bind, token = _addresses(opts, cleanup)
            cleanup.enter_context(_metrics_env(opts, autobalance))
            return _run(opts, endpoints, bind, token, secret)
    except (_UsageError, JobFileError, HostfileError) as exc:
        return _error(str(exc))


def _check_observe(opts: argparse.Namespace) -> dict[str, Any] | None:
    """Check the metrics and AutoBalancer options; return the AutoBalancer's knobs (None: off)."""
    if opts.metrics_port is not None and not 0 <= opts.metrics_port < 65536:
        raise _UsageError(f"--metrics-port must be a port number, not {opts.metrics_port}")
    if opts.dashboard is not None and not 0 <= opts.dashboard < 65536:
        raise _UsageError(f"--dashboard must be a port number, not {opts.dashboard}")
    if opts.dashboard is not None and opts.dashboard == opts.metrics_port and opts.dashboard != 0:
        raise _UsageError(f"--metrics-port and --dashboard are both {opts.dashboard}: give them different ports")
    if not 0 < opts.metrics_interval < math.inf:
        raise _UsageError(f"--metrics-interval must be a positive, finite number of seconds, not {opts.metrics_interval:g}")
    if (opts.metrics_port is not None or opts.autobalance is not None or opts.dashboard is not None) and opts.hostfile:
        raise _UsageError("--metrics-port, --dashboard and --autobalance work on one host only (without --hostfile)")
    if opts.autobalance is None:
        return None
    knobs: dict[str, Any] = {}
    for item in filter(None, opts.autobalance.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise _UsageError(f"--autobalance: {item!r} is not knob=value")
        try:
            knobs[name.strip()] = value.strip() if name.strip() == "strategy" else float(value)
        except ValueError:
            raise _UsageError(f"--autobalance: {name}={value!r} is not a number") from None
    # Checked here, before any worker starts (the AutoBalancer on worker 0 would refuse them later).
    from megaphone.autobalance import DEFAULTS, STRATEGIES, BalancePolicy, check_count, check_interval

    unknown = sorted(set(knobs) - set(DEFAULTS))
    if unknown:
        raise _UsageError(f"--autobalance: unknown knob(s) {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    if knobs.get("strategy", "auto") not in ("auto", *STRATEGIES):
        raise _UsageError(f"--autobalance: strategy={knobs['strategy']!r} is not auto or one of {', '.join(STRATEGIES)}")
    policy = {**DEFAULTS, **knobs}
    try:
        for knob in ("hold", "window"):  # (whole numbers: int() truncated 2.7, and overflowed on inf)
            policy[knob] = check_count(knob, policy[knob])
            if knob in knobs:
                knobs[knob] = policy[knob]
        BalancePolicy(2, float(policy["threshold"]), None if policy["target"] is None else float(policy["target"]),
                      policy["hold"], float(policy["cooldown"]), policy["window"], float(policy["min_busy"]))
        check_interval(policy["interval"])
    except ValueError as e:
        raise _UsageError(f"--autobalance: {e}") from None
    return knobs


@contextlib.contextmanager
def _metrics_env(opts: argparse.Namespace, autobalance: dict[str, Any] | None) -> Any:
    """With metrics or the AutoBalancer asked for: the workers' configuration (:mod:`timely.metrics`)
    in the environment they inherit, its hub socket in a private directory; both removed after."""
    if opts.metrics_port is None and autobalance is None and opts.dashboard is None:
        yield
        return
    import tempfile

    from .metrics import ENV, MetricsConfig

    with tempfile.TemporaryDirectory(prefix="timely-metrics-") as d:
        config = MetricsConfig(hub=f"ipc://{d}/hub", interval=opts.metrics_interval, port=opts.metrics_port,
                               dashboard=opts.dashboard, host=opts.metrics_host, autobalance=autobalance)
        previous = os.environ.get(ENV)
        os.environ[ENV] = config.to_env()
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous


def _addresses(opts: argparse.Namespace, cleanup: contextlib.ExitStack) -> tuple[list[str], dict[int, str], str]:
    """Every worker's endpoint, the addresses this host's workers bind (if not their endpoints)
    and the job token. Temporary ipc directories are removed by ``cleanup``."""
    n = opts.workers
    if not opts.hostfile:
        if opts.host_index != 0:
            raise _UsageError("--host-index needs --hostfile")
        endpoints = cleanup.enter_context(local_endpoints(n, opts.transport or "ipc", opts.port))
        return endpoints, {}, opts.token or secrets.token_hex(16)
    if opts.transport == "ipc":
        raise _UsageError("--transport ipc works on one host only; a hostfile needs tcp")
    try:
        with open(opts.hostfile) as f:
            hosts = parse_hostfile(f.read(), opts.port, opts.hostfile, opts.workers)
    except OSError as exc:
        raise _UsageError(f"cannot read hostfile {opts.hostfile}: {exc.strerror}") from None
    if not 0 <= opts.host_index < len(hosts):
        raise _UsageError(f"--host-index {opts.host_index} is not a line of {opts.hostfile} ({len(hosts)} hosts)")
    # Every line must resolve here (a peer's that does not would wait out the start-up timeout,
    # blamed on secrets); ZeroMQ binds to addresses or interfaces, not names: this host's own line's.
    addresses = {}
    for line, (name, _) in enumerate(hosts, 1):
        if name not in addresses:
            try:
                addresses[name] = str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
            except OSError as exc:
                raise _UsageError(f"cannot resolve host {name!r} (host {line} of {opts.hostfile}): {exc}") from None
    host, base = hosts[opts.host_index]
    address = addresses[host]
    address = f"[{address}]" if ":" in address else address
    first = opts.host_index * n
    bind = {first + local: f"tcp://{address}:{base + local}" for local in range(n)}
    return hostfile_endpoints(hosts, n), bind, opts.token or job_token(opts.job, opts.args, hosts, n)


def _run(opts: argparse.Namespace, endpoints: list[str], bind: dict[int, str], token: str,
         secret: JobSecret | None) -> int:
    """Run this host's workers; return the exit status (the failures are printed)."""
    n, peers = opts.workers, len(endpoints)
    first = opts.host_index * n
    job, job_args = opts.job, list(opts.args)
    alloc_options = {"startup_timeout": opts.startup_timeout, "heartbeat_timeout": opts.heartbeat_timeout,
                     "heartbeat_ivl": min(1.0, opts.heartbeat_timeout / 4)}
    config = None
    if opts.checkpoint:
        from .checkpoint.checkpointer import CheckpointConfig  # (fsspec: only for jobs with checkpoints)

        config = CheckpointConfig(opts.checkpoint, opts.checkpoint_every)

    def entry(config: CheckpointConfig | None, index: int, report: Callable[[Any], None]) -> None:
        sys.argv = [job, *job_args]
        module = load_job(job)
        job_main = getattr(module, "main", None)
        if not callable(job_main):
            raise JobFileError(f"{job}: main is {type(job_main).__name__} {job_main!r:.60}, not a function of the worker")
        try:
            check_main(job_main)
            run_worker(job_main, index, peers, endpoints, token, job_args, lambda _result: report(None),
                       opts.fuzz, opts.watchdog, opts.watchdog_warn, secret, checkpoint=config, bind=bind.get(index),
                       progress=opts.progress,
                       **alloc_options)
        except MainNotRunError as exc:  # an async or generator main (or one returning a coroutine)
            raise JobFileError(f"{job}: {exc}") from None

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    # SIGTERM and SIGHUP (the terminal closed) stop the workers and clean up like Ctrl-C; an ignored
    # SIGHUP (nohup) stays ignored.
    stops = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, on_sigterm) for s in stops}
    began = time.monotonic()  # --timeout bounds the job, all its restarts together
    try:
        outcomes = run_restarting(
            lambda config: supervise(functools.partial(entry, config), range(first, first + n), timeout=opts.timeout,
                                     stopped_grace=opts.stopped_grace, since=began),
            opts.restarts, config, lambda line: sys.stderr.write(f"timely.launch: {line}\n"),
            deadline=None if opts.timeout is None else began + opts.timeout)
    except KeyboardInterrupt:
        sys.stderr.write("timely.launch: interrupted; workers stopped\n")
        return 130
    except _Terminated as stop:
        signum = stop.args[0]
        sys.stderr.write(f"timely.launch: {signal_name(signum)} received; workers stopped\n")
        return 128 + signum
    except TimeoutError as exc:
        sys.stderr.write(f"timely.launch: timeout: {exc}; workers stopped\n")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failures = [o for o in outcomes if o.failed]
    if not failures:
        return 0
    first = primary_failure(outcomes)
    if first.status == "killed" and first.signal == signal.SIGPIPE:
        return 128 + signal.SIGPIPE  # the output's reader went away (`| head`): end quietly
    _report(outcomes)
    if _job_file_failure(outcomes):
        return 2  # the job file cannot run: a usage error, like a syntax error
    return 1


def _job_file_failure(outcomes: list[Outcome]) -> bool:
    """Whether the run failed only because the job file cannot run: every worker that failed by
    itself raised :class:`JobFileError`. Workers the supervisor stopped (still importing a slower
    job file, say) and those that only lost a peer are consequences, not failures of their own."""
    own = [o for o in outcomes if o.failed and o.status != "stopped" and not o.secondary]
    return bool(own) and all(o.status == "error" and (o.summary or "").split(":")[0].endswith("JobFileError")
                             for o in own)


if __name__ == "__main__":
    sys.exit(main())
