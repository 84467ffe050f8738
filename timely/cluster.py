"""Running workers as supervised processes on this host.

:func:`execute_cluster` runs ``main(worker)`` in ``workers`` processes connected by a
:class:`~timely.comm.zmq_allocator.ZmqAllocator` and returns their results by index.
:func:`supervise` is the process supervision it is built on, shared with ``python -m timely.launch``:

* children are forked (``start="fork"``: closures work) or started as fresh interpreters
  (``start="spawn"``: the entry must be picklable); either way they create their ZeroMQ context
  only once they run;
* each child dies with its parent (``PR_SET_PDEATHSIG`` = SIGKILL on Linux), ignores SIGINT (the
  parent handles Ctrl-C for all), exits cleanly on SIGTERM, and exits as soon as its entry is done
  (``os._exit``: neither its other threads nor a spawned interpreter's teardown hold it);
* the parent waits on result pipes and process sentinels with timeouts, never blocking forever;
  when a worker fails or dies (even by SIGKILL), the others are stopped (SIGTERM, then SIGKILL
  after ``grace`` seconds) and every child is reaped before :func:`supervise` returns;
* a worker that stays stopped (SIGSTOP / SIGTSTP, Linux's process state ``T``) longer than
  ``stopped_grace`` seconds is killed and reported as such, a failure like any other. A stop of the
  whole process group (Ctrl-Z on the launcher) stops the parent too: it only counts stopped time it
  was awake to see, so after ``fg`` the job goes on. A worker stopped by a debugger (state ``t``)
  is left alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import gc
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .comm.endpoints import free_loopback_ports, ipc_endpoints, loopback_endpoints
from .comm.errors import PeerLost
from .comm.secret import JobSecret, resolve
from .errors import OperatorError, TimelyError
from .watchdog import StoppedWorkers, report_failures_with

if TYPE_CHECKING:
    from .checkpoint.checkpointer import CheckpointConfig

__all__ = ["START_METHODS", "WorkerError", "WorkerOperatorError", "Outcome", "supervise", "run_worker",
           "execute_cluster", "local_endpoints"]

#: How worker processes start: forked from the caller, or as fresh interpreters (multiprocessing's methods).
START_METHODS = ("fork", "spawn")

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
STOP_GRACE = 3.0
#: Seconds to keep collecting outcomes after the first failure (to find the root cause).
COLLECT_WINDOW = 0.5
#: Seconds a worker may stay stopped (SIGSTOP / SIGTSTP) before the job ends.
STOPPED_GRACE = 5.0
_PR_SET_PDEATHSIG = 1


class WorkerError(TimelyError, RuntimeError):
    """A worker raised or died. ``index`` names it; ``remote_traceback`` holds its traceback text
    (``None`` if it died without one) and ``signal`` the signal that killed it, if any."""

    def __init__(self, index: int, message: str, remote_traceback: str | None = None,
                 signal_number: int | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.remote_traceback = remote_traceback
        self.signal = signal_number


class WorkerOperatorError(WorkerError, OperatorError):
    """User code in an operator raised on a worker process: both a :class:`WorkerError` and a
    :class:`~timely.errors.OperatorError` (``operator``, ``worker``, remote traceback). ``cause``
    is the user's exception as unpickled here or, if it cannot be, a ``RuntimeError`` naming it."""

    def __init__(self, index: int, message: str, remote_traceback: str | None, operator: str,
                 cause: BaseException) -> None:
        RuntimeError.__init__(self, message)  # neither base's __init__: the message is built already
        self.index = self.worker = index
        self.remote_traceback = remote_traceback
        self.signal = None
        self.operator = operator
        self.cause = cause


@dataclass
class Outcome:
    """How one worker process ended.

    ``status`` is ``"ok"`` (result delivered, exit status 0), ``"error"`` (raised; ``traceback``),
    ``"killed"`` (died by ``signal``), ``"exited"`` (exited with ``exitcode`` without a result),
    ``"suspended"`` (stayed stopped by SIGSTOP / SIGTSTP longer than the supervisor's
    ``stopped_grace``, so it killed it; ``summary`` says for how long) or ``"stopped"`` (stopped by
    the supervisor because another worker failed). ``secondary`` marks a
    failure caused by another worker's (the worker lost a peer).
    """

    index: int
    status: str = "running"
    result: Any = None
    traceback: str | None = None
    summary: str | None = None
    secondary: bool = False
    exitcode: int | None = None
    signal: int | None = None
    operator: str | None = None  # the operator whose user code raised, if that was the failure
    cause: BaseException | None = None  # the exception that operator's user code raised

    @property
    def failed(self) -> bool:
        """True if the worker raised, died, or was stopped."""
        return self.status in ("error", "killed", "exited", "suspended", "stopped")

    def describe(self) -> str:
        """One line naming the worker and how it ended."""
        if self.status == "error":
            return f"worker {self.index} failed: {self.summary}"
        if self.status == "killed":
            return f"worker {self.index} was killed by signal {signal_name(self.signal)}"
        if self.status == "exited":
            return f"worker {self.index} exited with status {self.exitcode} without a result"
        if self.status == "suspended":
            return f"worker {self.index} was stopped by a signal (SIGSTOP or SIGTSTP) {self.summary}"
        if self.status == "stopped":
            return f"worker {self.index} was stopped"
        return f"worker {self.index}: {self.status}"


def signal_name(number: int | None) -> str:
    """``SIGKILL`` for 9, and so on."""
    if number is not None:
        try:
            return signal.Signals(number).name
        except ValueError:
            pass
    return f"signal {number}"


#: Files whose frames are left out at the top of a reported traceback (the runner's own).
_RUNNER_FILES = {__file__, os.path.join(os.path.dirname(__file__), "launch.py")}


class _Stopped(BaseException):
    """Raised in a worker by SIGTERM: the supervisor is stopping it."""


def _die_with_parent(parent_pid: int) -> None:
    # Linux only: the kernel SIGKILLs us when the parent (thread) dies, even by SIGKILL.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stopped()


def _default_sigterm() -> None:
    """In a process forked by a worker's job: SIGTERM's default action, not the worker's handler."""
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # (not the main thread: cannot happen right after a fork, but never fail one)
        pass


def _line_buffered(stream: Any) -> None:
    """Make ``stream`` (a text stream) write what it holds at every newline, in one write, if it
    can: line buffering, and no write-through (which would write every ``write`` call apart)."""
    try:
        stream.reconfigure(line_buffering=True, write_through=False)
    except (AttributeError, ValueError, OSError):  # not an io.TextIOWrapper (replaced by the caller), or closed
        pass


def _ignore_signal(signum: int, frame: Any) -> None:
    """A signal handler that does nothing (see :func:`_child`)."""


def _child(entry: Callable[[int, Callable[[Any], None]], None], index: int,
           conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    """Body of a worker process: run ``entry(index, report)`` and report how it went."""
    _die_with_parent(parent_pid)
    # Ctrl-C: the parent stops everyone. A handler that does nothing rather than SIG_IGN: an
    # ignored SIGINT would be inherited by every program the job runs (exec keeps it), which a
    # Ctrl-C then could not stop; a handler is reset to the default by exec.
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # SIGUSR2 prints every thread's stack to standard error: the supervisor's report of a worker
    # still running at its timeout (a hang shows where it hangs). SIGUSR1 is the watchdog's.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    # SIGPIPE stays ignored (Python's default): a socket the worker writes to (the dashboard's, a
    # client that closed its download early) raises BrokenPipeError there instead of killing the
    # worker. Output into a closed pipe (`job | head`) still ends the worker as it ends a Unix tool:
    # _end_if_output_closed turns that BrokenPipeError into death by SIGPIPE.

    if callable(signal.getsignal(signal.SIGHUP)):
        # A handler of the parent's (the launcher's: stop the workers) is not ours; an ignored
        # SIGHUP (nohup) stays ignored.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    # Processes the job forks (a multiprocessing.Pool's) are not workers: SIGTERM ends them as it
    # ends any process, not with the worker's _Stopped.
    os.register_at_fork(after_in_child=_default_sigterm)
    # Every worker writes to the same standard output and error: block buffering flushes in the
    # middle of a line, and unbuffered output (PYTHONUNBUFFERED, -u) writes print's text and its
    # newline apart, tearing the workers' lines apart (in a file or a pipe). Line-buffered, each
    # line goes out whole, in one write.
    _line_buffered(sys.stdout)
    _line_buffered(sys.stderr)

    def report(result: Any) -> None:
        _send_report(conn, pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))

    # A watchdog whose operator keeps catching its error ends this process, reporting it here first.
    report_failures_with(functools.partial(_report_failure, conn))

    code = 0
    try:
        try:
            entry(index, report)
        except _Stopped:
            code = 128 + signal.SIGTERM
        except BaseException as exc:
            _end_if_output_closed(exc)
            code = 1
            _report_failure(conn, exc)
    except _Stopped:
        # SIGTERM while reporting a failure: the supervisor has already chosen which failure to
        # report and is stopping everyone; ours is not needed, and must not print a traceback.
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the end is near: no _Stopped from here on
        try:
            conn.close()
        except Exception:
            pass
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError as exc:
            _end_if_output_closed(exc)
    os._exit(code)  # not the interpreter's teardown: seconds for a large heap, before the parent sees the end


#: The signal that makes a worker print its threads' stacks (:func:`_dump_stacks`).
STACKS_SIGNAL = signal.SIGUSR2


def _dump_stacks(procs: dict[int, Any]) -> None:
    """Have each of ``procs`` (worker index -> process, still running) print its threads' stacks
    to standard error under a line naming it, one worker after the other (their lines would
    interleave otherwise)."""
    for index, proc in procs.items():
        sys.stderr.write(f"timely: worker {index} (pid {proc.pid}) still running at the timeout; its stacks:\n")
        sys.stderr.flush()
        try:
            os.kill(proc.pid, STACKS_SIGNAL)
        except (ProcessLookupError, TypeError):
            continue
        time.sleep(0.1)


def _end_if_output_closed(exc: BaseException) -> None:
    """Die by SIGPIPE, as a Unix tool does, if ``exc`` comes from writing into a standard output or
    error whose reader went away (``job | head``); return otherwise (a socket's BrokenPipeError is
    an ordinary failure, or the job's own to handle)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    broken = False
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        broken |= isinstance(e, BrokenPipeError)
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    if broken and any(_reader_gone(fd) for fd in (1, 2)):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
        signal.pause()  # SIGPIPE is not blocked: not reached


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe whose every reader has closed it (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever the mask
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _report_failure(conn: multiprocessing.connection.Connection, exc: BaseException) -> None:
    """Send the supervisor the text of a worker's failure ``exc``, its summary and operator."""
    summary = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[0]
    if isinstance(exc, OperatorError) and exc.cause.__traceback__ is not None:
        # The user's exception with its traceback, then one line naming the operator: the
        # OperatorError's own message and frames would repeat the same traceback twice.
        text = "".join(traceback.format_exception(type(exc.cause), exc.cause, exc.cause.__traceback__))
        text += f"\n{summary}\n"
    else:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _RUNNER_FILES:
            tb = tb.tb_next  # start the traceback at the job's code, not at the runner's frames
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    operator, cause = (exc.operator, _pickled(exc.cause)) if isinstance(exc, OperatorError) else (None, None)
    try:
        _send_report(conn, pickle.dumps(("error", text, summary, _lost_a_peer(exc), operator, cause)))
    except Exception:
        pass


def _lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a consequence of another worker's failure: :class:`PeerLost`, also when
    an operator's error wraps it (an operator that catches and re-raises it as its own)."""
    return isinstance(exc, PeerLost) or isinstance(exc, OperatorError) and isinstance(exc.cause, PeerLost)


#: A report's length, before its bytes, on the pipe from a worker to the supervisor.
_REPORT_LENGTH = struct.Struct("!Q")


def _send_report(conn: multiprocessing.connection.Connection, data: bytes) -> None:
    """Write one report to the supervisor: its length, then its bytes (blocking until all is written)."""
    view = memoryview(_REPORT_LENGTH.pack(len(data)) + data)
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view):]


class _ReportPipe:
    """The supervisor's end of one worker's report pipe, read without blocking: the supervisor
    takes what has arrived and keeps a partial report until its end comes, so a worker stopped
    (SIGSTOP) or stuck halfway through writing a large result never stops the supervisor, whose
    timeout and stopped-worker checks must go on."""

    def __init__(self, conn: multiprocessing.connection.Connection, index: int) -> None:
        self.conn = conn
        self.index = index
        self._buffer = bytearray()
        os.set_blocking(conn.fileno(), False)

    def fileno(self) -> int:
        """The pipe's descriptor (for ``multiprocessing.connection.wait``)."""
        return self.conn.fileno()

    def read(self) -> tuple[list[bytes], bool]:
        """The complete reports that arrived since the last call, and whether the pipe is closed
        (the worker's end: what it left half written is dropped)."""
        closed = False
        while True:
            try:
                chunk = os.read(self.conn.fileno(), 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            self._buffer += chunk
        reports = []
        head = _REPORT_LENGTH.size
        while len(self._buffer) >= head:
            (size,) = _REPORT_LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < head + size:
                break
            reports.append(bytes(self._buffer[head:head + size]))
            del self._buffer[:head + size]
        return reports, closed

    def close(self) -> None:
        """Close the supervisor's end."""
        self.conn.close()


def _pickled(cause: BaseException) -> tuple[bytes | None, str]:
    """``cause`` pickled (``None`` if it cannot be) and its one-line summary, to rebuild it with
    :func:`_unpickled` in the parent (which may lack its class: a job file's module)."""
    summary = "".join(traceback.format_exception_only(type(cause), cause)).strip()
    try:
        return pickle.dumps(cause, protocol=pickle.HIGHEST_PROTOCOL), summary
    except Exception:
        return None, summary


def _unpickled(cause: tuple[bytes | None, str]) -> BaseException:
    data, summary = cause
    if data is not None:
        try:
            exc = pickle.loads(data)
            if isinstance(exc, BaseException):
                return exc
        except Exception:
            pass
    return RuntimeError(f"{summary} (raised in a worker process)")


def supervise(entry: Callable[[int, Callable[[Any], None]], None], indices: Sequence[int], *,
              grace: float = STOP_GRACE, timeout: float | None = None, collect: float = COLLECT_WINDOW,
              on_failure: Callable[[Outcome], None] | None = None, start: str = "fork",
              stopped_grace: float = STOPPED_GRACE, since: float | None = None) -> list[Outcome]:
    """Run ``entry(index, report)`` in one child process per index; return their outcomes.

    ``report(value)`` hands a picklable result to the parent. A worker succeeds when it reported
    and exited with status 0. When one fails, ``on_failure`` is called once with the first failure
    and the others are stopped ``collect`` seconds later (meanwhile further outcomes are gathered,
    to tell the root cause from its consequences). ``timeout`` seconds (``None``: no limit) bounds the whole run; on
    expiry everyone is stopped and :class:`TimeoutError` raised. The timeout counts from ``since``
    (a :func:`time.monotonic` reading; ``None``: this call), so that the attempts of a restarted
    job share one timeout; if it has expired already, :class:`TimeoutError` is raised before any
    child starts. Every child is reaped on return, on error and on ``KeyboardInterrupt``.
    ``start`` is one of :data:`START_METHODS`: ``"fork"`` forks the children from this process,
    ``"spawn"`` starts each as a fresh interpreter, which needs a picklable ``entry``
    (:class:`TypeError` otherwise, before any child starts). A worker that stays stopped (SIGSTOP /
    SIGTSTP) for ``stopped_grace`` seconds is killed (SIGKILL) and
    fails with status ``"suspended"``; time the supervisor itself spent stopped does not count.
    """
    if start not in START_METHODS:
        raise ValueError(f"start must be one of {', '.join(map(repr, START_METHODS))}, not {start!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    if not stopped_grace > 0:
        raise ValueError(f"stopped_grace must be a positive number of seconds, not {stopped_grace!r}")
    if start == "spawn":
        _require_picklable(entry, "the worker entry")
    ctx: Any = multiprocessing.get_context(start)  # a fork or spawn context, with .Process
    outcomes = {i: Outcome(i) for i in indices}
    procs: dict[int, Any] = {}
    conns: dict[Any, int] = {}
    began = time.monotonic() if since is None else since
    if timeout is not None and time.monotonic() - began >= timeout:
        raise TimeoutError(f"workers {list(indices)} not started: the run's {timeout} s have passed")
    try:
        for i in indices:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(entry, i, writer, os.getpid()),
                               name=f"timely-worker-{i}", daemon=False)
            proc.start()
            writer.close()
            procs[i] = proc
            conns[_ReportPipe(reader, i)] = i
        live = {procs[i].sentinel: i for i in indices}
        stop_at: float | None = None
        watch = StoppedWorkers(stopped_grace)
        while live:
            if timeout is not None and time.monotonic() - began > timeout:
                _dump_stacks({i: procs[i] for i in sorted(live.values())})
                raise TimeoutError(f"workers {sorted(live.values())} still running after {timeout} s "
                                   "(their stacks are on standard error)")
            for obj in multiprocessing.connection.wait([*conns, *live], timeout=0.2):
                if isinstance(obj, _ReportPipe):
                    _read_report(obj, conns, outcomes)
                elif obj in live:
                    i = live.pop(obj)
                    _reap(procs[i], outcomes[i], conns)
            watched = {i: procs[i].pid for i in live.values() if outcomes[i].status != "suspended"}
            for i, seconds in watch.overdue(watched).items():
                _kill_suspended(procs[i], outcomes[i], seconds)
            failures = [o for o in outcomes.values() if o.failed]
            if failures and stop_at is None:
                stop_at = time.monotonic() + collect
            if stop_at is not None and time.monotonic() >= stop_at:
                if on_failure is not None:
                    on_failure(primary_failure(list(outcomes.values())))
                    on_failure = None
                _stop(procs, live, outcomes, conns, grace)
                live.clear()
        if on_failure is not None and any(o.failed for o in outcomes.values()):
            on_failure(primary_failure(list(outcomes.values())))
    finally:
        try:
            _stop(procs, {p.sentinel: i for i, p in procs.items() if p.exitcode is None}, outcomes, conns, grace)
        except BaseException:  # a second Ctrl-C, SIGTERM or SIGHUP during the grace: no more grace
            # (escaping without killing them, the interpreter's exit would then wait for workers
            # that ignore SIGTERM, for ever)
            _kill(procs)
            raise
        finally:
            for c in list(conns):
                c.close()
    return [outcomes[i] for i in indices]


def _kill(procs: dict[int, Any]) -> None:
    """SIGKILL every worker still alive, then reap them all."""
    for proc in procs.values():
        if proc.exitcode is None:
            try:
                proc.kill()
            except OSError:
                pass
    for proc in procs.values():
        proc.join(5.0)


def _kill_suspended(proc: Any, out: Outcome, seconds: float) -> None:
    """End the worker that stayed stopped ``seconds`` seconds: SIGKILL (it cannot run a SIGTERM
    handler while stopped) and record why; its sentinel then reaps it."""
    try:
        proc.kill()
    except OSError:
        pass
    out.status = "suspended"
    out.summary = f"and stayed stopped for {seconds:.1f} s; it was killed"


def _require_picklable(obj: Any, what: str) -> None:
    """Raise :class:`TypeError` naming ``what`` unless ``obj`` pickles (as ``start="spawn"`` needs)."""
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"start='spawn' runs every worker in a fresh interpreter, so {what} must be picklable "
                        f"(a module-level function, or a functools.partial of one): {exc}") from exc


def _read_report(conn: _ReportPipe, conns: dict[Any, int], outcomes: dict[int, Outcome]) -> None:
    """Take the reports that arrived on ``conn`` into the worker's outcome (closed: forget it)."""
    reports, closed = conn.read()
    if closed:
        del conns[conn]
        conn.close()
    for data in reports:
        _take_report(conn.index, data, outcomes[conn.index])


def _take_report(i: int, data: bytes, out: Outcome) -> None:
    try:
        message = pickle.loads(data)
    except Exception as exc:  # a result that cannot be unpickled here
        message = ("error", f"the result of worker {i} cannot be unpickled: {exc!r}", repr(exc), False, None, None)
    if message[0] == "ok":
        out.result = message[1]
        out.status = "reported"  # "ok" once it also exits with status 0
    else:
        _, out.traceback, out.summary, out.secondary, out.operator, cause = message
        out.cause = None if cause is None else _unpickled(cause)
        out.status = "error"


def _reap(proc: Any, out: Outcome, conns: dict[Any, int]) -> None:
    """Record how ``proc`` ended (after reading whatever it still had to say)."""
    proc.join(1.0)
    for c, i in list(conns.items()):
        if i == out.index:
            _read_report(c, conns, {out.index: out})  # (all it wrote: its end of the pipe is closed)
    code = proc.exitcode
    out.exitcode = code
    if out.status in ("error", "suspended"):
        return
    if code is not None and code < 0:
        out.status, out.signal = "killed", -code
    elif code == 128 + signal.SIGTERM and out.status != "reported":
        # Ended by a SIGTERM: from whoever sent it. _stop turns this into "stopped" for the
        # workers the supervisor stopped itself.
        out.status, out.signal = "killed", signal.SIGTERM
    elif code == 0 and out.status == "reported":
        out.status = "ok"
    else:
        out.status = "exited"


def _stop(procs: dict[int, Any], live: dict[Any, int], outcomes: dict[int, Outcome],
          conns: dict[Any, int], grace: float) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after ``grace`` s, reap them all."""
    for i in live.values():
        if procs[i].exitcode is None:
            try:
                procs[i].terminate()
            except OSError:
                pass
    deadline = time.monotonic() + grace
    pending = dict(live)
    while pending and time.monotonic() < deadline:
        for s in multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
            pending.pop(s, None)
    for i in pending.values():
        try:
            procs[i].kill()
        except OSError:
            pass
    for i in live.values():
        procs[i].join(5.0)
        out = outcomes[i]
        if out.status in ("running", "reported"):
            _reap(procs[i], out, conns)
            if out.status in ("exited", "killed") and not out.secondary:
                out.status = "stopped"  # we stopped it; it did not fail by itself


def primary_failure(outcomes: list[Outcome]) -> Outcome:
    """The failure to report: the first that was not caused by losing a peer, if any."""
    failed = [o for o in outcomes if o.failed and o.status != "stopped"]
    for o in failed:
        if not o.secondary:
            return o
    return failed[0] if failed else next(o for o in outcomes if o.failed)


def run_worker(main: Callable[[Any], Any], index: int, peers: int, endpoints: list[str], token: str,
               args: Sequence[str], report: Callable[[Any], None], fuzz: int | None = None,
               watchdog: float | None = None, watchdog_warn: bool = False, secret: JobSecret | None = None,
               checkpoint: CheckpointConfig | None = None, progress: str = "direct", **options: Any) -> None:
    """The per-process run sequence: allocator -> ``Worker`` -> ``main`` -> ``finish`` -> report -> close.

    ``fuzz`` seeds the worker's schedule fuzzer (``None``: none); ``watchdog`` (seconds) and
    ``watchdog_warn`` configure its stuck-operator watchdog. ``secret`` (the job secret, or
    ``None``) secures the worker-to-worker links and becomes :attr:`Worker.secret
    <timely.worker.Worker.secret>`, for the job's own servers. ``checkpoint`` configures the
    worker's checkpoints (:attr:`Worker.checkpoint <timely.worker.Worker.checkpoint>`); ``progress``
    is the :class:`~timely.worker.Worker`'s (``"direct"`` or ``"relay"``). On failure the allocator is closed
    with ``abort`` so the peers learn at once which worker failed.
    """
    from .comm.zmq_allocator import ZmqAllocator
    from .worker import Worker

    alloc = ZmqAllocator(index, peers, endpoints, token, secret=secret, **options)
    # Everything alive now (modules, the job's globals) lives for the whole run: keep the garbage
    # collector off it, so that collections triggered by decoded batches stay cheap.
    gc.collect()
    gc.freeze()
    try:
        job_id = hashlib.sha256(b"timely-job/" + token.encode()).hexdigest()[:32]  # the token stays secret
        report(Worker(alloc, list(args), fuzz, watchdog, watchdog_warn, secret=secret, job_id=job_id,
                      checkpoint=checkpoint, progress=progress).run(main))
    except BaseException as exc:
        reason = "stopped" if isinstance(exc, _Stopped) else f"{type(exc).__name__}: {exc}"
        alloc.close(abort=reason)
        raise
    alloc.close()


@contextlib.contextmanager
def local_endpoints(workers: int, transport: str, base_port: int | None = None) -> Iterator[list[str]]:
    """The endpoints of ``workers`` workers on this host, valid inside the ``with`` block.

    ``"ipc"``: Unix sockets in a private temporary directory, removed on exit; ``"tcp"``: ports on
    127.0.0.1, from ``base_port`` on, or ports that were free a moment ago when it is ``None``.
    """
    if transport == "tcp":
        if base_port is None:
            yield [loopback_endpoints(port, 1)[0] for port in free_loopback_ports(workers)]
        else:
            yield loopback_endpoints(base_port, workers)
        return
    if transport != "ipc":
        raise ValueError(f"transport must be 'ipc' or 'tcp', not {transport!r}")
    directory = tempfile.mkdtemp(prefix="timely-")
    try:
        yield ipc_endpoints(directory, workers)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def execute_cluster(main: Callable[[Any], Any], workers: int, args: Sequence[str] | None = None, *,
                    transport: str = "ipc", timeout: float | None = None, grace: float = STOP_GRACE,
                    start: str = "fork", fuzz: int | None = None, watchdog: float | None = None,
                    secret: str | JobSecret | None = None, checkpoint: CheckpointConfig | None = None,
                    restarts: int = 0, progress: str = "direct", **options: Any) -> list[Any]:
    """Run ``main(worker)`` in ``workers`` processes on this host; return each result by index.

    Results must be picklable. ``transport`` is ``"ipc"`` (Unix sockets in a private temporary
    directory) or ``"tcp"`` (free ports on 127.0.0.1). ``timeout`` (seconds, for the whole run: with
    restarts, every attempt gets what the earlier ones left) and ``start`` are
    :func:`supervise`'s (with ``start="spawn"``, ``main`` must be picklable); ``fuzz`` seeds every
    worker's schedule fuzzer (:mod:`timely.dataflow.fuzz`); ``watchdog`` is every worker's
    stuck-operator limit in seconds (:mod:`timely.watchdog`). ``secret`` is the job secret (its
    text or a :class:`~timely.comm.secret.JobSecret`; ``None``: from the environment, see
    :func:`~timely.comm.secret.resolve`): the workers' links use CURVE, and every worker's
    :attr:`~timely.worker.Worker.secret` is it. ``progress`` is how progress travels (``"direct"``
    or ``"relay"``, :class:`~timely.worker.Worker`). ``options`` go to the
    :class:`~timely.comm.zmq_allocator.ZmqAllocator`. With ``checkpoint``, the workers take
    checkpoints, and up to ``restarts`` times a failed run is started again from the latest one
    (:mod:`timely.recovery`; one line per restart on stderr). Raises :class:`WorkerError` naming the first
    worker that failed (with its traceback text) after stopping the others; a ``main`` that is an
    ``async def`` or a generator function raises :class:`TypeError` before any worker starts.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    from .worker import check_main

    check_main(main)  # an async or generator main: TypeError now, not an empty run of every worker
    if start == "spawn":
        _require_picklable(main, "main")
    from .comm.zmq_allocator import check_options
    from .dataflow.dataflow import check_progress_mode

    check_options(options)  # the allocator's options: a bad one raises here, not in every worker
    token = secrets.token_hex(16)
    options["secret"] = resolve(secret)
    options["progress"] = check_progress_mode(progress)  # before any worker starts
    from .recovery import run_restarting

    began = time.monotonic()  # the timeout bounds the run, all its attempts together
    with local_endpoints(workers, transport) as endpoints:
        def attempt(config: CheckpointConfig | None) -> list[Outcome]:
            entry = functools.partial(_cluster_worker, main, workers, endpoints, token, list(args or []), fuzz,
                                      watchdog, {**options, "checkpoint": config})
            return supervise(entry, range(workers), grace=grace, timeout=timeout, start=start, since=began)

        outcomes = run_restarting(attempt, restarts, checkpoint, lambda line: sys.stderr.write(f"timely: {line}\n"),
                                  deadline=None if timeout is None else began + timeout)
    if any(o.failed for o in outcomes):
        raise failure_error(outcomes)
    return [o.result for o in outcomes]


def _cluster_worker(main: Callable[[Any], Any], peers: int, endpoints: list[str], token: str, args: list[str],
                    fuzz: int | None, watchdog: float | None, options: dict[str, Any], index: int,
                    report: Callable[[Any], None]) -> None:
    """An :func:`execute_cluster` worker (at module level: ``start="spawn"`` pickles it by name)."""
    run_worker(main, index, peers, endpoints, token, args, report, fuzz, watchdog, **options)


def failure_error(outcomes: list[Outcome]) -> WorkerError:
    """The :class:`WorkerError` describing a failed run (its primary failure, then the rest)."""
    first = primary_failure(outcomes)
    message = first.describe()
    if first.traceback:
        message += "\n\nRemote traceback (worker %d):\n%s" % (first.index, first.traceback.rstrip())
    others = [o.describe() for o in outcomes if o.failed and o is not first]
    if others:
        message += "\n\nThen: " + "; ".join(others)
    if first.operator is not None and first.cause is not None:
        return WorkerOperatorError(first.index, message, first.traceback, first.operator, first.cause)
    return WorkerError(first.index, message, first.traceback, first.signal)
