"""Watchdogs: an operator stuck in one invocation, and a worker process stopped by a signal.

The stuck-operator watchdog (:class:`Watchdog`, in each worker): a worker inside one operator
invocation for too long is reported.

An operator that blocks (a ``time.sleep``, a lock never released, a network call without a
timeout, an endless loop) stops its worker, and with it every worker waiting for its progress; from
outside the job that looks like a hang with no culprit. With ``watchdog=S`` (``timely.execute``,
``python -m timely.launch --watchdog S``), a thread of each worker checks, about every second, how
long the current operator invocation has lasted; past ``S`` seconds it prints the operator, the
worker and the worker's Python stack to stderr, then raises :class:`OperatorStuckError` in the
worker's main thread (the job ends, naming the operator), or with ``warn_only`` goes on after the
report (once per invocation).

An operator may catch the error (a retry loop around a blocking call with ``except Exception``)
and block again: the watchdog raises it again every ``S`` seconds while the same invocation goes
on. In a worker process of its own (``timely.launch``, ``timely.execute`` with several workers or a
timeout), after :data:`GIVE_UP_AFTER` such errors it stops relying on the operator: it reports the
error to the supervisor (which names the worker and the operator, as for an error the operator let
through), prints why on stderr and ends the process (exit status 1). A worker running in the
caller's own process (one worker, no timeout) is never ended that way: there the error is raised
every ``S`` seconds for as long as the invocation lasts.

The error is delivered by a signal (``SIGUSR1``) to the worker's main thread, so it interrupts a
sleeping or blocked call at once, and a pure-Python loop at its next bytecode; code stuck inside one
long C call is reported when the call returns. It is raised only inside the invocation it names: an
invocation that returned between the report and the signal's arrival is let go (its report stays
printed).

Time the process spent stopped (SIGSTOP, Ctrl-Z then ``fg``, a debugger) does not count: when the
watchdog's own wait (a second at most) ends more than :data:`SELF_PAUSE` seconds late, beyond the
CPU time the process used meanwhile, that time is taken off the current invocation. A C call that
holds the GIL and computes (the watchdog cannot run meanwhile either) uses CPU time, so it still
counts; one that holds the GIL while it blocks, and a process left without a CPU for over a second
(an overloaded host), look like a pause and do not count.

The stopped-worker watch (:class:`StoppedWorkers`, in the supervisor): a worker process stopped by
SIGSTOP / SIGTSTP for longer than a grace period is named, so that the supervisor ends the job
instead of waiting for it (:func:`timely.cluster.supervise`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

from .errors import OperatorStuckError

#: Seconds between two checks (at most; a short limit checks more often).
CHECK_EVERY = 1.0
#: A gap this long (seconds) between two rounds of the supervisor, or past the end of a wait of the
#: watchdog (with no CPU time used meanwhile), means the process was stopped itself.
SELF_PAUSE = 1.0
#: How many times the watchdog raises :class:`OperatorStuckError` in one invocation (one every
#: ``limit`` seconds) before it ends a worker process whose operator keeps catching it.
GIVE_UP_AFTER = 3
#: Seconds the watchdog gives its last words (stderr, the job's buffered stdout) before it ends the
#: process anyway (a stuck operator may hold those streams).
LAST_WORDS = 2.0


class Watchdog:
    """Watches the operator invocations of one worker (``worker`` is its index)."""

    def __init__(self, limit: float, worker: int, warn_only: bool = False) -> None:
        if not limit > 0:
            raise ValueError(f"the watchdog limit must be a positive number of seconds, not {limit!r}")
        self.limit = limit
        self.worker = worker
        self.warn_only = warn_only
        self.current: tuple[str, float] | None = None  # (operator, monotonic start) of the invocation
        # The error to raise, with the invocation (the very tuple of ``current``) it is meant for.
        self._pending: tuple[tuple[str, float], OperatorStuckError] | None = None
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._previous_handler: object = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (from the worker's main thread, which the error is raised in)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the watchdog must be started from the main thread of the worker's process")
        self._previous_handler = signal.signal(signal.SIGUSR1, self._raise)
        self._thread = threading.Thread(target=self._watch, name=f"timely-watchdog-{self.worker}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and restore the previous ``SIGUSR1`` handler (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._pending = None
        signal.signal(signal.SIGUSR1, self._previous_handler)  # type: ignore[arg-type]

    def enter(self, operator: str) -> None:
        """An invocation of ``operator`` starts."""
        self.current = (operator, time.monotonic())

    def leave(self) -> None:
        """The invocation ended."""
        self.current = None

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread, the only one that changes ``current``: the error is raised only
        # in the invocation it is meant for, not in whatever runs after that invocation returned
        # (another operator, or Worker.close(), which must get to stop()).
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is self.current:
            raise pending[1]

    def _watch(self) -> None:
        interval = min(CHECK_EVERY, self.limit / 4)
        watched: tuple[str, float] | None = None  # the invocation the counts below are about
        paused = 0.0  # seconds of it the process spent stopped
        raised = 0  # errors raised in it (warn-only: reports printed)
        while True:
            mark, cpu = time.monotonic(), time.process_time()
            if self._stop.wait(interval):
                return
            now = time.monotonic()
            # How much longer than asked the wait lasted, less the CPU time the process used
            # meanwhile: the process was stopped (SIGSTOP, Ctrl-Z, a debugger) for about that long.
            # (A computation that starves this thread of the GIL uses CPU time: it is not a pause.)
            stalled = (now - mark - interval) - (time.process_time() - cpu)
            current = self.current
            if current is not watched:
                watched, paused, raised = current, 0.0, 0
            if current is None:
                continue
            operator, started = current
            if stalled > SELF_PAUSE and started < mark + interval:
                paused += stalled  # the invocation began before the pause (not after the process resumed)
            seconds = now - started - paused
            if seconds < self.limit * (raised + 1) or self.warn_only and raised:
                continue
            raised += 1
            stack = self._stack()
            if self.warn_only or raised == 1:
                message = (f"worker {self.worker}: operator '{operator}' has run for {seconds:.1f} s in one "
                           f"invocation (watchdog limit {self.limit:g} s); its stack:\n{stack}")
            elif raised <= GIVE_UP_AFTER or (report := self._report_pipe()) is None:
                message = (f"worker {self.worker}: operator '{operator}' caught the OperatorStuckError and is "
                           f"still in the same invocation after {seconds:.1f} s; raising it again")
                if raised > GIVE_UP_AFTER:
                    message += " (the worker runs in the caller's process, which the watchdog does not end)"
            else:
                self._give_up(report, current, seconds, stack)
                continue  # (the invocation ended meanwhile)
            try:
                _say(f"timely watchdog: {message}")
            except Exception:  # (stderr closed: the error still goes)
                pass
            if not self.warn_only:
                self._pending = (current, OperatorStuckError(operator, self.worker, seconds, self.limit, stack))
                signal.pthread_kill(self._main, signal.SIGUSR1)  # type: ignore[arg-type]

    def _stack(self) -> str:
        """The main thread's Python stack, as text."""
        frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"

    @staticmethod
    def _report_pipe() -> Callable[[BaseException], None] | None:
        """How this worker process reports a failure to its supervisor (:func:`report_failures_with`),
        or ``None`` where the worker is not a process of its own (it runs in the caller's process,
        which the watchdog must not end)."""
        return _process_report

    def _give_up(self, report: Callable[[BaseException], None], current: tuple[str, float], seconds: float,
                 stack: str) -> None:
        """End this worker process, whose operator caught :data:`GIVE_UP_AFTER` errors and is still
        in the invocation ``current``: ``report`` the error to the supervisor as the worker's
        failure, say so on stderr, and exit with status 1."""
        if self.current is not current:
            return
        operator = current[0]
        error = OperatorStuckError(operator, self.worker, seconds, self.limit, stack)
        # Whatever blocks below (a stuck operator may hold stderr or stdout), the process ends.
        threading.Thread(target=_exit_after, args=(LAST_WORDS,), daemon=True).start()
        report(error)  # the supervisor names the worker and the operator
        try:
            _say(f"timely watchdog: worker {self.worker}: operator '{operator}' caught the OperatorStuckError "
                 f"{GIVE_UP_AFTER} times and has run for {seconds:.1f} s in one invocation (watchdog limit "
                 f"{self.limit:g} s); ending worker {self.worker}'s process; its stack:\n{stack}")
            sys.stdout.flush()
        except BaseException:
            pass
        os._exit(1)


#: How this process, a worker process of its own, reports a failure to its supervisor; ``None`` in
#: any other process (the caller's, running one worker in-process), which the watchdog never ends.
_process_report: Callable[[BaseException], None] | None = None


def report_failures_with(report: Callable[[BaseException], None]) -> None:
    """Declare this process a worker process of its own whose failures go to its supervisor through
    ``report`` (called by the process's body, :func:`timely.cluster._child`, before the job runs)."""
    global _process_report
    _process_report = report


def _say(line: str) -> None:
    """Write ``line`` to stderr in one write (the workers share it: lines written in pieces interleave)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(1)


class StoppedWorkers:
    """The supervisor's watch on its workers' processes: which have stayed stopped (process state
    ``T``: SIGSTOP / SIGTSTP) longer than ``grace`` seconds. Call :meth:`overdue` every round
    (well under :data:`SELF_PAUSE` seconds apart)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._since: dict[int, float] = {}  # worker -> when it was first seen stopped
        self._last = time.monotonic()

    def overdue(self, pids: dict[int, int]) -> dict[int, float]:
        """The workers of ``pids`` (index -> pid) seen stopped for longer than ``grace`` seconds,
        with those seconds."""
        now = time.monotonic()
        if now - self._last > SELF_PAUSE:
            # We were not running (the whole process group was stopped: Ctrl-Z), so we cannot tell
            # for how long a worker was stopped on its own: count again from now. This is what lets
            # a job stopped and continued as a whole go on.
            self._since.clear()
        self._last = now
        late = {}
        for i, pid in pids.items():
            if process_state(pid) == "T":
                seconds = now - self._since.setdefault(i, now)
                if seconds > self.grace:
                    late[i] = seconds
            else:
                self._since.pop(i, None)
        return late


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``None`` where there is none:
    not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (command) S ...": the command may contain spaces and parentheses, the state follows the last ')'.
    fields = stat[stat.rfind(b")") + 1:].split()
    return fields[0].decode("ascii", "replace") if fields else None
