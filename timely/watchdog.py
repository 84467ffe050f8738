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

The error is delivered by a signal (``SIGUSR1``) to the worker's main thread, so it interrupts a
sleeping or blocked call at once, and a pure-Python loop at its next bytecode; code stuck inside one
long C call is reported when the call returns.

The stopped-worker watch (:class:`StoppedWorkers`, in the supervisor): a worker process stopped by
SIGSTOP / SIGTSTP for longer than a grace period is named, so that the supervisor ends the job
instead of waiting for it (:func:`timely.cluster.supervise`).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from types import FrameType

from .errors import OperatorStuckError

#: Seconds between two checks (at most; a short limit checks more often).
CHECK_EVERY = 1.0
#: A gap this long (seconds) between two rounds of the supervisor means it was stopped itself.
SELF_PAUSE = 1.0


class Watchdog:
    """Watches the operator invocations of one worker (``worker`` is its index)."""

    def __init__(self, limit: float, worker: int, warn_only: bool = False) -> None:
        if not limit > 0:
            raise ValueError(f"the watchdog limit must be a positive number of seconds, not {limit!r}")
        self.limit = limit
        self.worker = worker
        self.warn_only = warn_only
        self.current: tuple[str, float] | None = None  # (operator, monotonic start) of the invocation
        self._error: OperatorStuckError | None = None
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
        signal.signal(signal.SIGUSR1, self._previous_handler)  # type: ignore[arg-type]

    def enter(self, operator: str) -> None:
        """An invocation of ``operator`` starts."""
        self.current = (operator, time.monotonic())

    def leave(self) -> None:
        """The invocation ended."""
        self.current = None

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _watch(self) -> None:
        reported: tuple[str, float] | None = None
        while not self._stop.wait(min(CHECK_EVERY, self.limit / 4)):
            current = self.current
            if current is None or current is reported or time.monotonic() - current[1] < self.limit:
                continue
            reported = current
            operator, started = current
            frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
            seconds = time.monotonic() - started
            message = (f"worker {self.worker}: operator '{operator}' has run for {seconds:.1f} s in one invocation "
                       f"(watchdog limit {self.limit:g} s); its stack:\n{stack}")
            print(f"timely watchdog: {message}", file=sys.stderr, flush=True)
            if not self.warn_only:
                self._error = OperatorStuckError(operator, self.worker, seconds, self.limit, stack)
                signal.pthread_kill(self._main, signal.SIGUSR1)  # type: ignore[arg-type]


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
