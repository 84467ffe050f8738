"""The bridge's streams on one worker, by name: registration, lookups and the checks of a plan.

No sockets: the server asks, and sends what it gets back (an entry, or an error reply).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import protocol as P
from . import schema as S
from .ledger import CommitLedger, Staging
from .routing import hashable
from .sinkbuffer import SinkBuffer


@dataclass(eq=False)
class Source:
    """One named source on this worker."""

    name: str
    fields: list | None  # the declared schema; None accepts any
    arrow: bool
    staging: Staging
    ledger: CommitLedger  # used on worker 0 only
    control: Any = None  # activator of the SparkCommits operator, which publishes the ledger's decisions
    data: Any = None  # activator of the SparkSource operator


@dataclass(eq=False)
class Sink:
    """One named sink on this worker."""

    buffer: SinkBuffer
    activator: Any = None  # of the SparkSink operator


class Streams:
    """The sources and sinks of one worker; names are unique across both."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.sources: dict[str, Source] = {}
        self.sinks: dict[str, Sink] = {}

    def add_source(self, name: str, fields: list | None, arrow: bool) -> Source:
        """Register the source ``name``."""
        self._check_name(name)
        src = self.sources[name] = Source(name, fields, arrow, Staging(name, self.worker), CommitLedger(name))
        return src

    def add_sink(self, name: str, fields: list, arrow: bool) -> Sink:
        """Register the sink ``name`` (raises if a type of ``fields`` has no Arrow equivalent)."""
        self._check_name(name)
        sink = self.sinks[name] = Sink(SinkBuffer(name, fields, arrow, self.worker))
        return sink

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"spark_bridge: a stream name must be a non-empty string, not {name!r}")
        if name in self.sources or name in self.sinks:
            raise ValueError(f"spark_bridge: a source or sink named '{name}' already exists on this worker")

    def known(self) -> str:
        """Every stream, for error messages."""
        return (f"sources: {', '.join(sorted(self.sources)) or '(none)'}; "
                f"sinks: {', '.join(sorted(self.sinks)) or '(none)'}")

    def _unknown(self, name: Any, kind: str, job: str) -> dict:
        other, hint = (self.sinks, "sink: read it with spark.read") if kind == "source" else (
            self.sources, "source: write it with df.write")
        where = f" (it is a {hint})" if name in other else ""
        return P.error(f"unknown stream '{name}': the timely job at {job} has no {kind} of that name{where}; "
                       f"{self.known()}", "unknown_stream")

    def source(self, name: Any, job: str) -> Source | dict:
        """The source ``name``, or the error reply saying it does not exist (``job``: our coordinator)."""
        src = self.sources.get(name)
        return src if src is not None else self._unknown(name, "source", job)

    def plan(self, req: dict, job: str) -> dict:
        """Check a plan request (the stream exists, is open, the schema and key fit): ``ok(fields=...)``
        or the error reply."""
        name, kind = str(req.get("stream")), req.get("kind")
        if kind == "read":
            sink = self.sinks.get(name)
            return self._unknown(name, "sink", job) if sink is None else P.ok(fields=sink.buffer.fields)
        if kind != "write":
            return P.error(f"unknown plan kind {kind!r}")
        src = self.source(name, job)
        if isinstance(src, dict):
            return src
        if not src.ledger.open:
            return P.error(f"stream '{name}' is closed: the timely job accepts no more writes to it", "stopping")
        actual = [tuple(f) for f in req.get("schema") or []]
        bad = None if src.fields is None else S.mismatch(name, src.fields, actual)
        if bad:
            return P.error(bad, "schema")
        key = req.get("key")
        if key is not None and key not in [n for n, _ in actual]:
            return P.error(f"stream '{name}': key column '{key}' is not a column of the DataFrame "
                           f"({', '.join(n for n, _ in actual)})", "schema")
        if key is not None and not hashable(dict(actual)[key]):
            return P.error(f"stream '{name}': option 'keyColumn' names column '{key}' of type {dict(actual)[key]}, "
                           f"which cannot be hashed to a worker (hash64 takes boolean, integer, float, double, "
                           f"string and binary columns, and arrays and maps of them); choose another key "
                           f"column or cast it (e.g. to string or bigint)", "schema")
        return P.ok(fields=src.fields)

    def stats(self) -> dict:
        """Per-source counters, for the status reply."""
        return {n: {"epochs": s.ledger.epochs, "rows": s.ledger.rows, "dropped_rows": s.staging.dropped_rows,
                    "duplicate_rows": s.staging.duplicate_rows, "expired_rows": s.staging.expired_rows,
                    "staged_tokens": len(s.staging.tokens)}
                for n, s in self.sources.items()}
