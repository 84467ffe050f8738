"""Open-loop latency measurement (the Megaphone paper's method), shared by every benchmark that
feeds a dataflow from its worker loop (``nexmark.driver`` for ``bench/nexmark_bench.py``, and
``bench/migration.py``).

* :class:`Schedule`: when each record is due. Record ``n`` of the global sequence is scheduled
  ``n / rate`` seconds after the schedule's time 0, fixed in advance whether or not the system
  keeps up (open loop: no coordinated omission); worker ``index`` of ``peers`` owns records
  ``index, index + peers, ...``. Time is cut into epochs of ``epoch_ms`` milliseconds; a record
  belongs to the epoch of its scheduled time. A measured phase may start at epoch ``origin`` (after
  a history replayed before measuring): measured epoch ``e`` is epoch ``origin + e``, and measured
  seconds count from its start.
* :class:`Completions`: the wall time at which the output passed each measured epoch. A driver
  announces every round it sends (:meth:`Completions.sent`: the epochs below some bound went out
  stamped with a logical time) and polls the output probe; a round is complete once the probe has
  passed its stamp, and so are its epochs.
* :func:`latencies`: per record, the completion time of its epoch minus its scheduled time
  (queueing included), computed with numpy from the per-epoch completion times;
  :func:`acknowledged`: records acknowledged per interval of wall time (throughput).
* :func:`start_together`: a wall-clock start time agreed by every worker once all are ready.

Wall times are ``time.time()`` (one clock for every process on the host); a measured phase's times
are seconds after its start. Quantiles, timelines and process readings are in
:mod:`nexmark.metrics`; tables and plots in :mod:`nexmark.report`.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

import timely


class Schedule:
    """``rate`` records per second in total (all workers), epochs of ``epoch_ms`` ms, seen by worker
    ``index`` of ``peers``; the measured phase starts at epoch ``origin``.

    Positions (:meth:`records`) number this worker's own records from its first one in the
    measured phase: ``0, 1, ...``.
    """

    def __init__(self, rate: int, epoch_ms: int = 1, index: int = 0, peers: int = 1, origin: int = 0) -> None:
        if rate < 1 or epoch_ms < 1:
            raise ValueError(f"rate and epoch_ms must be positive integers, not {rate} and {epoch_ms}")
        if not 0 <= index < peers:
            raise ValueError(f"worker index {index} is not one of {peers} peers")
        self.rate = rate
        self.epoch_ms = epoch_ms
        self.epoch = epoch_ms / 1000  # seconds per epoch
        self.index = index
        self.peers = peers
        self.origin = origin
        self._base = self._owned(self.first(0))

    def first(self, e: Any) -> Any:
        """The global number of the first record due in measured epoch ``e`` or later (``e`` an int
        or an integer array): ``ceil((origin + e) * epoch_ms * rate / 1000)``, in exact integers."""
        return -((-(self.origin + e) * self.epoch_ms * self.rate) // 1000)

    def _owned(self, n: Any) -> Any:
        """How many of this worker's records have global numbers below ``n``."""
        return np.maximum(0, -((self.index - n) // self.peers))

    def records(self, lo: int, hi: int | None = None) -> tuple[int, int]:
        """``(first, end)`` positions of this worker's records of measured epochs ``[lo, hi)``
        (``hi`` defaults to ``lo + 1``)."""
        hi = lo + 1 if hi is None else hi
        return int(self._owned(self.first(lo)) - self._base), int(self._owned(self.first(hi)) - self._base)

    def counts(self, lo: int, hi: int) -> np.ndarray:
        """This worker's number of records in each measured epoch of ``[lo, hi)``."""
        return np.diff(self._owned(self.first(np.arange(lo, hi + 1, dtype=np.int64))))

    def numbers(self, lo: int, hi: int) -> np.ndarray:
        """The global numbers of this worker's records of measured epochs ``[lo, hi)``."""
        a, b = self.records(lo, hi)
        return self.index + self.peers * (self._base + np.arange(a, b, dtype=np.int64))

    def seconds(self, n: Any) -> Any:
        """Scheduled time of record(s) ``n``, in seconds after the start of the measured phase."""
        return n / self.rate - self.origin * self.epoch

    def due(self, elapsed: float) -> int:
        """How many measured epochs have entirely passed ``elapsed`` seconds after the start."""
        return max(0, int(elapsed * 1000 // self.epoch_ms))


class Completions:
    """When the output passed each of ``epochs`` measured epochs: ``completion[e]``, seconds after
    ``start`` (NaN until then).

    Announce each round with :meth:`sent`; epochs complete in order, so ``completion`` is
    non-decreasing and ``next`` is the first epoch not yet complete. Either :meth:`watch` the
    probe (the tracker is then polled whenever the probe's frontier moves, inside the worker's
    step), or call :meth:`poll` after every step.

    Frontiers move when a worker step begins (progress is received and propagated first, then
    operators run), so a driver that calls :meth:`step_started` right before each step has
    completions charged at the moment the worker learned them, not after other operators that run
    later in the same step (for example a migration's state extraction scheduled before the probe).
    Without it, completions are charged when observed.
    """

    def __init__(self, epochs: int, start: float) -> None:
        self.completion = np.full(epochs, np.nan)
        self.start = start
        self.next = 0
        self.rounds: deque[tuple[Any, int]] = deque()  # (stamp, end epoch) of rounds not yet complete
        self._announced = 0  # the end epoch of the last round sent
        self._probe: Any = None
        self._step_start: float | None = None

    def sent(self, end: int, stamp: Any) -> None:
        """The records of the epochs before ``end`` not yet announced went out at logical time
        ``stamp``: they are complete once the output probe has passed ``stamp``."""
        if end > self._announced:
            self.rounds.append((stamp, end))
            self._announced = end

    def step_started(self) -> None:
        """Note the wall time at which the worker's next step begins."""
        self._step_start = time.time()

    def poll(self, probe: Any = None) -> int:
        """Record the rounds the probe (default: the watched one) has passed; return ``next``."""
        probe = self._probe if probe is None else probe
        rounds = self.rounds
        if probe is None or not rounds or probe.less_equal(rounds[0][0]):
            return self.next
        now = (time.time() if self._step_start is None else self._step_start) - self.start
        # Invariant: rounds are sent with non-decreasing stamps, so they complete in order.
        while rounds and not probe.less_equal(rounds[0][0]):
            _, end = rounds.popleft()
            self.completion[self.next:end] = now
            self.next = end
        return self.next

    def watch(self, probe: Any) -> None:
        """Be polled by ``probe`` (a ``timely.ProbeHandle``) whenever its frontier changes."""
        self._probe = probe
        probe.watch(self)

    def unwatch(self) -> None:
        """Stop following the probe (before its dataflow is shut down: a closed dataflow's probe
        passes every time)."""
        self._probe = None

    def activate(self) -> None:
        """The probe's callback: :meth:`poll`."""
        if self._probe is not None:
            self.poll()


def latencies(schedule: Schedule, completion: np.ndarray, lo: int = 0,
              hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(scheduled, latency)`` in seconds of this worker's records of measured epochs ``[lo, hi)``
    (default: all of ``completion``): a record's latency is the completion time of its epoch minus
    its scheduled time (NaN for an epoch not complete)."""
    hi = len(completion) if hi is None else hi
    scheduled = schedule.seconds(schedule.numbers(lo, hi))
    return scheduled, np.repeat(np.asarray(completion[lo:hi], dtype=np.float64), schedule.counts(lo, hi)) - scheduled


def acknowledged(schedule: Schedule, completion: np.ndarray, width: float) -> np.ndarray:
    """This worker's records acknowledged in each ``width`` seconds of wall time after the start."""
    done = np.isfinite(completion)
    counts = schedule.counts(0, len(completion))[done]
    return np.bincount((completion[done] / width).astype(np.int64), weights=counts).astype(np.int64)


def start_together(worker: timely.Worker, delay: float = 0.1, timeout: float = 60.0) -> float:
    """Agree with every other worker on a wall-clock start, ``delay`` seconds after the last of
    them got here, and wait for it; return it (a ``time.time()`` value).

    Builds a dataflow: every worker calls it at the same point of its sequence of dataflows. An
    offset between the workers' clocks would add to the latency of those ahead, since every epoch
    needs every worker to reach it.
    """
    ready: list[float] = []
    with worker.dataflow("start line") as scope:
        inp = scope.new_input("Ready")
        probe = inp.stream.broadcast().inspect(ready.append).probe()
    inp.send(time.time())
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=timeout)
    start = max(ready) + delay
    while (left := start - time.time()) > 0:
        worker.step_or_park(left)
    return start
