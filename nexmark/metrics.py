"""Latency histograms, timelines and quantiles of open-loop runs, and readings of the process.

A latency sample is the time between a record's scheduled time and the moment the output probe
passed its epoch (see :mod:`nexmark.openloop`). Histograms are log-bucketed like HdrHistogram
with 4 sub-bucket bits: 16 buckets per power of two of microseconds (about 4.4% resolution),
numpy arrays that merge by addition, so that workers' results combine and memory stays bounded
however long the run; a quantile is reported as its bucket's upper edge. :func:`percentiles`
gives exact ones where all the samples are at hand.

Memory is the resident set size read from ``/proc/self/statm`` (``getrusage``'s peak is
inherited across fork and exec, so it would report the parent's).
"""
from __future__ import annotations

import gc
import os
import resource
import threading
import time
from typing import Any

import numpy as np

SUB = 16  # buckets per power of two
NBUCKETS = 40 * SUB  # up to 2^40 us (~12 days)
INTERVAL = 0.25  # seconds per timeline bucket (of scheduled time; the paper's 250 ms)
QUANTILES = (0.25, 0.5, 0.75, 0.95, 0.99, 0.999, 1.0)


def bucket_of(latency_s: np.ndarray) -> np.ndarray:
    """Histogram bucket of each latency (seconds)."""
    us = np.maximum(latency_s * 1e6, 1.0)
    return np.minimum((np.log2(us) * SUB).astype(np.int64), NBUCKETS - 1)


def bucket_value(i: int | np.ndarray) -> float | np.ndarray:
    """Upper edge of bucket ``i``, in seconds (a quantile is reported as this conservative bound)."""
    return np.power(2.0, (np.asarray(i) + 1) / SUB) * 1e-6


class Timeline:
    """Latency histograms: overall, over the records scheduled in ``[lo, hi)`` (a warm-up and a
    cool-down cut, ``warmup`` and ``cooldown`` seconds but at most a quarter of the run each), and
    per :data:`INTERVAL` of scheduled time, over ``duration`` seconds."""

    def __init__(self, duration: float, warmup: float = 2.0, cooldown: float = 2.0) -> None:
        self.duration = duration
        self.lo = min(warmup, duration / 4)
        self.hi = max(duration - cooldown, duration * 3 / 4)
        self.buckets = int(np.ceil(duration / INTERVAL)) + 1
        self.per_interval = np.zeros((self.buckets, NBUCKETS), dtype=np.int64)
        self.overall = np.zeros(NBUCKETS, dtype=np.int64)

    def record(self, scheduled: np.ndarray, latency: np.ndarray) -> None:
        """Samples for records scheduled at ``scheduled`` with these latencies (seconds; NaN, a
        record never acknowledged, is skipped)."""
        keep = np.isfinite(latency)
        scheduled, latency = scheduled[keep], latency[keep]
        if not len(scheduled):
            return
        b = bucket_of(latency)
        row = np.clip((scheduled / INTERVAL).astype(np.int64), 0, self.buckets - 1)
        np.add.at(self.per_interval, (row, b), 1)
        cut = (scheduled >= self.lo) & (scheduled < self.hi)
        self.overall += np.bincount(b[cut], minlength=NBUCKETS)

    def rows(self) -> list[tuple[float, float, float, float, int]]:
        """``(start s, p50, p99, max, samples)`` of every interval with samples."""
        out = []
        for i, hist in enumerate(self.per_interval):
            n = int(hist.sum())
            if n:
                p50, p99, mx = quantiles(hist, (0.5, 0.99, 1.0))
                out.append((i * INTERVAL, p50, p99, mx, n))
        return out

    def to_bytes(self) -> dict:
        """A msgpack-friendly form (for returning from a worker process)."""
        return {"duration": self.duration, "lo": self.lo, "hi": self.hi,
                "per_interval": self.per_interval.tobytes(), "overall": self.overall.tobytes()}

    @classmethod
    def merged(cls, parts: list[dict]) -> Timeline:
        """The sum of the timelines of several workers."""
        first = parts[0]
        t = cls(first["duration"])
        t.lo, t.hi = first["lo"], first["hi"]
        for p in parts:
            t.per_interval += np.frombuffer(p["per_interval"], dtype=np.int64).reshape(t.per_interval.shape)
            t.overall += np.frombuffer(p["overall"], dtype=np.int64)
        return t


def quantiles(hist: np.ndarray, qs: tuple = QUANTILES) -> list[float]:
    """Latency quantiles (seconds) of a histogram; NaN when it is empty."""
    total = int(hist.sum())
    if not total:
        return [float("nan")] * len(qs)
    cum = np.cumsum(hist)
    return [float(bucket_value(int(np.searchsorted(cum, max(1, int(np.ceil(q * total))))))) for q in qs]


def percentiles(lat: np.ndarray, qs: tuple[float, ...] = (50, 90, 99, 99.9)) -> dict[str, float]:
    """Exact ``{"n", "p50", ..., "max"}`` of latency samples (seconds; NaN samples skipped, NaN
    figures when none is left)."""
    lat = lat[np.isfinite(lat)]
    out: dict[str, float] = {"n": float(len(lat))}
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(lat, q)) if len(lat) else float("nan")
    out["max"] = float(lat.max()) if len(lat) else float("nan")
    return out


# -- readings of this process ------------------------------------------------------------------

def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``; 0 if unreadable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; kernel high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def runqueue_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (``/proc/thread-self/schedstat``,
    second field): how much other processes on the machine delayed it. 0.0 if unavailable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a daemon thread.

    ``samples`` is a list of ``(time.time() - start, bytes)``; use as a context manager or call
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
        """Stop sampling (after a last sample); return the samples."""
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


class GcPauses:
    """Collector pauses of this process while active: ``(start s, generation, seconds)`` of every
    collection longer than ``floor`` seconds, and the number of collections per generation.

    A ``gc.callbacks`` hook: it costs two clock reads per collection, nothing per allocation.
    """

    def __init__(self, floor: float = 0.002) -> None:
        self.floor = floor
        self.origin = 0.0
        self.counts = [0, 0, 0]
        self.long: list[tuple[float, int, float]] = []
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        gen = info["generation"]
        self.counts[gen] += 1
        took = now - self._started
        if took >= self.floor:
            self.long.append((self._started - self.origin, gen, took))

    def start(self, origin: float) -> None:
        """Record from now on; pause start times count from ``origin`` (a ``perf_counter`` value)."""
        self.origin = origin
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """Stop recording."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict:
        """A msgpack/JSON-friendly copy."""
        return {"counts": list(self.counts), "long": [list(x) for x in self.long]}
