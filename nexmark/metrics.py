"""Latency histograms and timelines for the open-loop benchmark, and memory readings.

A latency sample is ``ack - scheduled``: the wall time at which the output probe passed the epoch a
record was sent at, minus the record's scheduled time (queueing included, no coordinated
omission). Memory is the resident set size read from ``/proc/self/statm`` (sampled every 100 ms by the
driver: ``getrusage``'s peak is inherited across fork and exec, so it would report the parent's).
Histograms are log-bucketed like HdrHistogram with 4 sub-bucket bits: 16 buckets per
power of two of microseconds (about 4.4% resolution), numpy arrays that merge by addition.
"""
from __future__ import annotations

import gc
import os
import time

import numpy as np

SUB = 16  # buckets per power of two
NBUCKETS = 40 * SUB  # up to 2^40 us (~12 days)
INTERVAL = 0.25  # seconds per timeline bucket (of scheduled time)
QUANTILES = (0.25, 0.5, 0.75, 0.95, 0.99, 0.999, 1.0)


def bucket_of(latency_s: np.ndarray) -> np.ndarray:
    """Histogram bucket of each latency (seconds)."""
    us = np.maximum(latency_s * 1e6, 1.0)
    return np.minimum((np.log2(us) * SUB).astype(np.int64), NBUCKETS - 1)


def bucket_value(i: int | np.ndarray) -> float | np.ndarray:
    """Upper edge of bucket ``i``, in seconds (a quantile is reported as this conservative bound)."""
    return np.power(2.0, (np.asarray(i) + 1) / SUB) * 1e-6


class Timeline:
    """Latency histograms: overall (with a warm-up and cool-down cut) and per 250 ms of scheduled time."""

    def __init__(self, duration: float, warmup: float = 2.0, cooldown: float = 2.0) -> None:
        self.duration = duration
        self.lo = min(warmup, duration / 4)
        self.hi = max(duration - cooldown, duration * 3 / 4)
        self.buckets = int(np.ceil(duration / INTERVAL)) + 1
        self.per_interval = np.zeros((self.buckets, NBUCKETS), dtype=np.int64)
        self.overall = np.zeros(NBUCKETS, dtype=np.int64)

    def record(self, scheduled: np.ndarray, ack: float) -> None:
        """Samples for records scheduled at ``scheduled`` (seconds) and acknowledged at ``ack``."""
        if not len(scheduled):
            return
        b = bucket_of(ack - scheduled)
        row = np.minimum((scheduled / INTERVAL).astype(np.int64), self.buckets - 1)
        np.add.at(self.per_interval, (row, b), 1)
        keep = (scheduled >= self.lo) & (scheduled < self.hi)
        self.overall += np.bincount(b[keep], minlength=NBUCKETS)

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


def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


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
