"""Open-loop latency measurement, the paper's way (DESIGN.md section 7), with numpy.

Generic pieces for benchmarks that feed a dataflow from the worker loop:

* :class:`OpenLoopSchedule`: records' scheduled times, fixed in advance from a rate (open loop: a
  record is due at its scheduled time whether or not the system keeps up), grouped into epochs of
  ``epoch`` seconds (a record is stamped with the epoch of its scheduled time).
* :class:`CompletionTracker`: the wall time at which an output probe passed each epoch.
* :func:`latencies`: per-record latency = completion of its epoch - its scheduled time (queueing
  included, no coordinated omission), computed arithmetically from the per-epoch completion times.
* :func:`timeline` (per-250 ms buckets of scheduled time: p50/p99/max), :func:`summary`,
  :func:`log_histogram` (HdrHistogram-like, 16 buckets per power of two).
* :class:`RssSampler`: a thread reading ``/proc/self/statm`` (the reference harness's ``statm_RSS``).

Times are seconds; wall times are ``time.time()`` (one clock for every process on the host).
"""
from __future__ import annotations

import math
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BUCKET = 0.25  # seconds of scheduled time per timeline bucket (the paper's 250 ms)


class OpenLoopSchedule:
    """``rate`` records per second for ``duration`` seconds on one of ``peers`` workers.

    Worker ``index`` owns records ``index, index + peers, ...`` of the global sequence whose record
    ``i`` is scheduled at ``i / (rate * peers)``: the workers' schedules interleave. ``epoch`` is the
    epoch length in seconds; ``epochs`` the number of epochs; records of epoch ``e`` (scheduled in
    ``[e * epoch, (e + 1) * epoch)``) are ``offsets[e]:offsets[e + 1]``.
    """

    def __init__(self, rate: float, duration: float, epoch: float, index: int = 0, peers: int = 1) -> None:
        if rate <= 0 or duration <= 0 or epoch <= 0:
            raise ValueError("rate, duration and epoch must be positive")
        self.rate = rate
        self.duration = duration
        self.epoch = epoch
        self.epochs = int(math.ceil(duration / epoch - 1e-9))
        n = int(rate * duration)
        self.scheduled = (np.arange(n, dtype=np.float64) + index / peers) / rate
        self.epoch_of = np.minimum((self.scheduled / epoch).astype(np.int64), self.epochs - 1)
        counts = np.bincount(self.epoch_of, minlength=self.epochs)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.scheduled)

    def due(self, elapsed: float) -> int:
        """How many epochs have fully passed after ``elapsed`` seconds (epochs ``< due`` may be sent)."""
        return max(0, min(int(elapsed / self.epoch), self.epochs))

    def records(self, e: int) -> tuple[int, int]:
        """``(lo, hi)``: the records of epoch ``e``."""
        return int(self.offsets[e]), int(self.offsets[e + 1])


class CompletionTracker:
    """Notes when an output probe passes each epoch (``completion[e]``, seconds after ``start``).

    ``logical(e)`` is the dataflow time of epoch ``e``; epoch ``e`` is complete once
    ``not probe.less_equal(logical(e))``. Either :meth:`watch` the probe (the tracker is then called
    back when the probe's frontier moves, inside the worker's step), or call :meth:`poll` after
    every step.

    Frontiers move when a worker step begins (progress is received and propagated first, then
    operators run), so a driver that calls :meth:`step_started` right before each step has
    completions charged at the moment the worker learned them, not after other operators that run
    later in the same step (for example a migration's state extraction scheduled before the probe).
    Without it, completions are charged when observed.
    """

    def __init__(self, epochs: int, logical: Callable[[int], Any], start: float) -> None:
        self.completion = np.full(epochs, np.nan)
        self.logical = logical
        self.start = start
        self.next = 0  # the first epoch not yet seen complete
        self._probe: Any = None
        self._step_start: float | None = None

    def step_started(self) -> None:
        """Note the wall time at which the worker's next step begins."""
        self._step_start = time.time()

    def poll(self, probe: Any = None) -> int:
        """Record newly complete epochs; return how many epochs are complete."""
        probe = self._probe if probe is None else probe
        n = len(self.completion)
        if probe is None:
            return self.next
        if self.next < n and not probe.less_equal(self.logical(self.next)):
            now = (time.time() if self._step_start is None else self._step_start) - self.start
            while self.next < n and not probe.less_equal(self.logical(self.next)):
                self.completion[self.next] = now
                self.next += 1
        return self.next

    def watch(self, probe: Any) -> None:
        """Be called back by ``probe`` (a timely ``ProbeHandle``) whenever its frontier changes."""
        self._probe = probe
        probe.watch(self)

    def unwatch(self) -> None:
        """Stop following the probe (before its dataflow is shut down: a closed dataflow's probe
        passes every time)."""
        self._probe = None

    def activate(self) -> None:  # the probe's callback
        if self._probe is not None:
            self.poll()

def latencies(scheduled: np.ndarray, epoch_of: np.ndarray, completion: np.ndarray) -> np.ndarray:
    """Per-record latency (seconds): completion of the record's epoch minus its scheduled time."""
    return completion[epoch_of] - scheduled


def summary(lat: np.ndarray, qs: tuple[float, ...] = (50, 90, 99, 99.9)) -> dict[str, float]:
    """``{"n", "p50", ..., "max"}`` of latencies (seconds); NaN when empty."""
    lat = lat[np.isfinite(lat)]
    out: dict[str, float] = {"n": float(len(lat))}
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(lat, q)) if len(lat) else float("nan")
    out["max"] = float(lat.max()) if len(lat) else float("nan")
    return out


def timeline(scheduled: np.ndarray, lat: np.ndarray, bucket: float = BUCKET,
             end: float | None = None) -> dict[str, np.ndarray]:
    """Per ``bucket`` of scheduled time: ``start``, ``count``, ``p50``, ``p99``, ``max`` (NaN if empty)."""
    if end is None:
        end = float(scheduled.max()) if len(scheduled) else 0.0
    nb = max(1, int(math.ceil(end / bucket - 1e-9)))
    idx = np.minimum((scheduled / bucket).astype(np.int64), nb - 1)
    order = np.lexsort((lat, idx))  # by bucket, then latency: percentiles by index arithmetic
    idx_s, lat_s = idx[order], lat[order]
    bounds = np.searchsorted(idx_s, np.arange(nb + 1))
    out = {k: np.full(nb, np.nan) for k in ("p50", "p99", "max")}
    counts = np.diff(bounds)
    for b in range(nb):
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            seg = lat_s[lo:hi]
            n = hi - lo
            out["p50"][b] = seg[min(n - 1, int(0.50 * n))]
            out["p99"][b] = seg[min(n - 1, int(0.99 * n))]
            out["max"][b] = seg[-1]
    out["start"] = np.arange(nb) * bucket
    out["count"] = counts
    return out


def log_histogram(lat: np.ndarray, sub: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """HdrHistogram-like: ``(upper edges in seconds, counts)`` with ``sub`` buckets per power of two
    of microseconds (about 4.4 % relative resolution at 16), empty buckets dropped."""
    us = np.maximum(lat[np.isfinite(lat)] * 1e6, 1.0)
    b = (np.log2(us) * sub).astype(np.int64)
    counts = np.bincount(b)
    nz = np.nonzero(counts)[0]
    return np.power(2.0, (nz + 1) / sub) * 1e-6, counts[nz]


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def runqueue_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (``/proc/thread-self/schedstat``,
    second field): how much other processes on the machine delayed it. 0.0 if unavailable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; kernel high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a daemon thread.

    ``samples`` is a list of ``(seconds after start, bytes)``; use as a context manager or call
    :meth:`stop`.
    """

    def __init__(self, interval: float = 0.05, start: float | None = None) -> None:
        self.interval = interval
        self.start = time.time() if start is None else start
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time() - self.start, rss_bytes()))
            self._stop.wait(self.interval)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time() - self.start, rss_bytes()))
        return self.samples

    def __enter__(self) -> RssSampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def peak_between(samples: list[tuple[float, int]], lo: float, hi: float) -> int:
    """The largest RSS sample taken in ``[lo, hi]`` (0 if none)."""
    return max((b for t, b in samples if lo <= t <= hi), default=0)
