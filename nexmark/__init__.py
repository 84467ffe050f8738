"""NEXMark on timely-py: a columnar event generator, queries Q0-Q8 (native and Megaphone), a
sequential reference, and the harness used by the tests and by ``bench/nexmark_bench.py``.

Events are plain tuples on three streams (persons, auctions, bids); see :mod:`nexmark.model` for
the layouts and the time base (event time in ms, epochs of one wall-clock ms, time dilation).

The benchmarks' measurement stack lives here too, shared by every script under ``bench/``:
:mod:`nexmark.openloop` (open-loop schedules, per-epoch completions, latencies, a common start),
:mod:`nexmark.metrics` (latency histograms, timelines, quantiles, process readings),
:mod:`nexmark.report` (tables and plots),
:mod:`nexmark.driver` (a NEXMark run) and :mod:`nexmark.keyed` (the keyed-count migration run).
"""
from .generator import EventBatch, Generator, generate
from .model import Config, Params, last_epoch
from .queries import QUERIES, Query, Streams

__all__ = ["QUERIES", "Config", "EventBatch", "Generator", "Params", "Query", "Streams", "generate", "last_epoch"]
