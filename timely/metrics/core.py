"""One worker's metrics: what its operators, allocator and registered sources have counted so far.

The counting itself lives where the work is done, once per batch or per invocation, never per
record: :class:`~timely.dataflow.operator.OperatorCore` counts the records arriving at its inputs
(``len(batch)`` per delivered batch), the records it sends, its invocations and the seconds they
took (``time.perf_counter`` around each ``schedule()``); the worker's step counts the bytes it took
from its peers. :class:`WorkerMetrics` only reads those counters into a :func:`snapshot`: a
msgpack-friendly dict, cumulative (rates are differences of two snapshots, taken by
:class:`~timely.metrics.hub.Hub`).

Libraries built on timely add their own figures as *sources* (:func:`add_source`): Megaphone's bins
report their per-bin record counts and state sizes this way. A source is any object with a
``metrics() -> dict`` method; it is held weakly and reported under its ``metrics_name``, which the
worker of its ``index`` makes unique (a repeat is numbered, ``"StateMachine #2"``, in the order
the sources are built: the same on every worker). A source with a ``metrics_final`` (a function
that holds the source's counters but not the source) is reported after it is collected with what
that returns, so that its counters never go backwards (as :meth:`WorkerMetrics.retire` keeps the
counts of completed dataflows).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Environment variable carrying the metrics configuration (JSON, see :class:`MetricsConfig`): the
#: launcher sets it for ``--metrics-port``, ``--dashboard`` and ``--autobalance``; forked and spawned
#: workers inherit it.
ENV = "TIMELY_METRICS"

_sources: list[weakref.ref] = []
_sources_lock = threading.Lock()
#: Per worker index, the metrics of this process's (newest) worker with it: it names the sources of
#: that index and keeps their final counts (``WorkerMetrics._adopt``).
_owners: dict[int, weakref.ref] = {}


def add_source(source: Any) -> None:
    """Report ``source.metrics()`` (a dict of msgpack-able values) with every snapshot of the
    workers of this process, under ``source.metrics_name`` (held weakly: it stops when collected),
    made unique among the sources of the worker of ``source.index`` (see the module documentation),
    if that worker runs in this process."""
    with _sources_lock:  # (named before any report can see it)
        ref = _owners.get(getattr(source, "index", None))  # type: ignore[arg-type]
        owner = ref() if ref is not None else None
        if owner is not None:
            owner._adopt(source)
        _sources[:] = [r for r in _sources if r() is not None]
        _sources.append(weakref.ref(source))


def sources() -> list[Any]:
    """The live sources registered by :func:`add_source`, in registration order."""
    with _sources_lock:
        return [s for s in (r() for r in _sources) if s is not None]


@dataclass(frozen=True)
class MetricsConfig:
    """Where a job's metrics go: ``hub`` (a ZeroMQ address worker 0 binds and the others push to),
    ``interval`` (seconds between a worker's snapshots), ``port`` (the Prometheus endpoint on
    worker 0, or None), ``dashboard`` (the dashboard's port, or None), ``host`` (the address both
    bind, loopback by default) and ``autobalance`` (the AutoBalancer's options, or None)."""

    hub: str | None = None
    interval: float = 1.0
    port: int | None = None
    dashboard: int | None = None
    host: str = "127.0.0.1"
    autobalance: dict | None = None

    def __post_init__(self) -> None:
        interval = self.interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < float("inf"):
            # (0 would make every worker's reporter thread spin; a string would end it silently)
            raise ValueError(f"metrics interval must be a positive number of seconds, not {interval!r}")

    def to_env(self) -> str:
        """This configuration as the value of :data:`ENV`."""
        return json.dumps(self.__dict__)

    @staticmethod
    def from_env(environ: Any = None) -> MetricsConfig | None:
        """The configuration in :data:`ENV`, or None when it is not set (metrics stay local)."""
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return None
        try:
            fields = json.loads(raw)
            return MetricsConfig(**fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{ENV} is not a metrics configuration ({e}): {raw[:120]!r}") from None


class LagProbe:
    """An output watched for its frontier and, given ``wall_of`` (a time -> Unix seconds), for its
    lag: how long ago (wall clock) the earliest incomplete time was due."""

    __slots__ = ("name", "probe", "wall_of", "failed")

    def __init__(self, name: str, probe: Any, wall_of: Callable[[Any], float] | None) -> None:
        self.name = name
        self.probe = probe
        self.wall_of = wall_of
        self.failed = False  # wall_of raised once (said so on stderr, once)

    def read(self, now: float) -> dict[str, Any]:
        """``{"frontier": t or None (complete), "lag_s": seconds or None}``."""
        try:
            times = list(self.probe.frontier)
        except RuntimeError:  # changed while read (the reporter thread): report it next time
            return {"frontier": None, "lag_s": None}
        if not times:
            return {"frontier": None, "lag_s": 0.0 if self.wall_of else None}
        t = times[0]
        lag = None
        if self.wall_of is not None:
            try:
                lag = max(0.0, now - float(self.wall_of(t)))
            except Exception as e:  # the job's function: its lag is unknown, the other figures go on
                if not self.failed:
                    self.failed = True
                    sys.stderr.write(f"timely.metrics: the wall_of of lag probe {self.name!r} raised {e!r} for time "
                                     f"{t!r:.60}; its lag is not reported while it does (said once)\n")
            else:
                if lag != lag or lag == math.inf:  # (nan, or a time due at -inf: not a lag; nan is not JSON)
                    lag = None
        return {"frontier": t if isinstance(t, (int, float)) else repr(t), "lag_s": lag}


#: Completed dataflows whose operators a worker reports one by one (the newest); the counts of
#: older ones are summed into one row whose dataflow and operator are :data:`FOLDED_LABEL` and
#: whose index is :data:`FOLDED_INDEX`. That row grows only as dataflows are folded into it, so
#: the hub gives it no rate.
KEEP_RETIRED = 64
FOLDED_LABEL = "(completed earlier)"
FOLDED_INDEX = -1
#: Collected sources whose final counts a worker reports one by one (the newest, marked
#: ``"retired": True``); the final per-bin counts of older "bins" sources are summed into one
#: source per number of bins, named :data:`FOLDED_SOURCE` (also retired).
KEEP_RETIRED_SOURCES = 16
FOLDED_SOURCE = "(completed earlier, {} bins)"


class WorkerMetrics:
    """The metrics of one worker (``worker.metrics``): :meth:`snapshot` reads every counter."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.index: int = worker.index
        self.received_bytes = 0  # bytes taken from peers' messages (counted by the worker's step)
        self._unread = 0  # the mailbox's unread bytes after the last take, carried to the next step
        self._mailbox = getattr(worker.allocator, "_mailbox", None)
        self._links = getattr(worker.allocator, "_links", None)
        self.lags: list[LagProbe] = []
        #: The final rows of the newest :data:`KEEP_RETIRED` dataflows that completed, a list per
        #: dataflow; older ones are summed into :attr:`folded`.
        self.retired: deque[list[list[Any]]] = deque()
        self.folded: list[Any] | None = None  # the one row (FOLDED_LABEL) of the rest, or None
        #: Held while the worker moves completed dataflows from its list to :attr:`retired`, and
        #: while a report reads both (invariant: a report sees each dataflow's rows exactly once).
        self.lock = threading.Lock()
        self.hub: Any = None  # worker 0 with a configuration: the Hub gathering every worker's snapshots
        self.reporter: Any = None
        self.servers: list[Any] = []  # closed with the worker (the Prometheus endpoint, the dashboard)
        self.dashboard: Any = None  # worker 0 with --dashboard: the timely.dashboard.Dashboard
        self.held: list[Any] = []  # sources kept alive as long as the worker (add_source holds them weakly)
        self.config: MetricsConfig | None = None
        # The sources of this worker (add_source): each one's name, made unique in build order, and
        # while it lives a weak reference and its metrics_final; once collected, its final figures
        # (the newest KEEP_RETIRED_SOURCES; older ones folded). Invariant: a snapshot reports each
        # source's counts exactly once, live or final. Guarded by _sources_lock.
        self._names: set[str] = set()
        self._name_next: dict[str, int] = {}
        self._adopted: list[tuple[weakref.ref, str, Callable[[], dict]]] = []
        self._finals: dict[str, dict] = {}  # name -> final figures, oldest first
        self._folded: dict[str, dict] = {}  # FOLDED_SOURCE name -> the older ones' summed
        with _sources_lock:
            _owners[self.index] = weakref.ref(self)

    # -- counted by the worker ----------------------------------------------------------------------
    def before_take(self) -> int:
        """The mailbox's unread bytes before the step takes its events (see :meth:`after_take`)."""
        mailbox = self._mailbox
        return 0 if mailbox is None else mailbox.unread_bytes

    def after_take(self, before: int) -> None:
        """Count the bytes received since the last take: unread before this take minus what was
        left unread after the last one."""
        mailbox = self._mailbox
        if mailbox is not None:
            self.received_bytes += max(0, before - self._unread)
            self._unread = mailbox.unread_bytes

    def backlog_bytes(self) -> int:
        """Bytes waiting to be sent to peers (ZeroMQ could not take them yet)."""
        links = self._links
        if links is None:
            return 0
        try:
            return sum(p.backlog_bytes for p in list(links._peers.values()))
        except (AttributeError, RuntimeError):
            return 0

    # -- registered by jobs ---------------------------------------------------------------------------
    def track(self, name: str, probe: Any, wall_of: Callable[[Any], float] | None = None) -> None:
        """Report ``probe``'s frontier as ``name`` and, given ``wall_of(time) -> Unix seconds`` (when
        a time was due), the output's lag behind the wall clock."""
        self.lags.append(LagProbe(name, probe, wall_of))

    def _adopt(self, source: Any) -> None:
        """Make ``source.metrics_name`` unique among this worker's sources (a repeat of a name gets
        the next free number, ``"name #2"``, as the worker numbers its dataflows' labels: every
        worker builds the same sources in the same order, so all agree), and with a
        ``metrics_final``, keep its final figures once it is collected (:func:`add_source`, which
        holds ``_sources_lock``)."""
        base = str(source.metrics_name)
        name, n = base, self._name_next.get(base, 1)
        if n > 1:
            name = f"{base} #{n}"
        while name in self._names:
            n += 1
            name = f"{base} #{n}"
        self._name_next[base] = n + 1
        self._names.add(name)
        source.metrics_name = name
        final = getattr(source, "metrics_final", None)
        if callable(final):
            self._adopted.append((weakref.ref(source), name, final))

    def _retain(self) -> dict[str, dict]:
        """The final figures of this worker's collected sources (taken now from those collected
        since the last call), the oldest folded (:data:`KEEP_RETIRED_SOURCES`)."""
        with _sources_lock:
            if any(ref() is None for ref, _, _ in self._adopted):
                alive = []
                for entry in self._adopted:
                    ref, name, final = entry
                    if ref() is not None:
                        alive.append(entry)
                        continue
                    try:
                        figures = dict(final())
                    except Exception:  # (a source must not stop the reports)
                        continue
                    figures["retired"] = True
                    self._finals[name] = figures
                self._adopted = alive
                while len(self._finals) > KEEP_RETIRED_SOURCES:
                    self._fold(self._finals.pop(next(iter(self._finals))))
            return {**self._folded, **self._finals}

    def _fold(self, figures: dict) -> None:
        """Add a collected "bins" source's final counts to the folded one of its number of bins
        (other kinds are let go). A new dict each time: a snapshot may hold the previous one."""
        records = figures.get("records")
        if figures.get("kind") != "bins" or not isinstance(records, list):
            return
        name = FOLDED_SOURCE.format(len(records))
        old = self._folded.get(name)
        counters = dict(figures.get("counters") or {})
        if old is not None:
            records = [a + b for a, b in zip(old["records"], records)]
            for key, value in old["counters"].items():
                counters[key] = counters.get(key, 0) + value
        self._folded[name] = {"kind": "bins", "records": records, "state": [0] * len(records), "owned": [],
                              "counters": counters, "retired": True}

    # -- reading --------------------------------------------------------------------------------------
    @staticmethod
    def rows(dataflows: list[Any]) -> list[list[Any]]:
        """``[dataflow, index, name, records_in, records_out, busy_seconds, activations]`` per
        operator of ``dataflows`` (inputs included: they count the records sent)."""
        rows = []
        for df in dataflows:
            for op in list(getattr(df, "operators", ())):
                rows.append([df.label, op.index, op.name, op.records_in, op.records_out, op.busy_seconds,
                             op.activations])
        return rows

    def graph(self) -> dict[str, dict[str, list]]:
        """Per live dataflow its operators ``[[index, name], ...]`` and edges ``[[from, to], ...]``."""
        out: dict[str, dict[str, list]] = {}
        for df in list(getattr(self.worker, "_dataflows", ())):
            ops = list(getattr(df, "operators", ()))
            edges = sorted({(op.index, target.node) for op in ops for port in op.outputs for _, target in port.channels})
            out[df.label] = {"nodes": [[op.index, op.name] for op in ops], "edges": [list(e) for e in edges]}
        return out

    def retire(self, dataflows: list[Any]) -> None:
        """Keep the final counts of ``dataflows``, which have completed (the worker lets them go,
        holding :attr:`lock` for both). Past :data:`KEEP_RETIRED` completed dataflows, the oldest
        are summed into one row: a worker that runs dataflow after dataflow keeps a bounded
        snapshot (one row per operator of 50,000 dataflows passed the hub's message limit, and
        its metrics were dropped) and a bounded set of Prometheus labels."""
        for df in dataflows:
            self.retired.append(self.rows([df]))
        while len(self.retired) > KEEP_RETIRED:
            for row in self.retired.popleft():
                if self.folded is None:
                    self.folded = [FOLDED_LABEL, FOLDED_INDEX, FOLDED_LABEL, 0, 0, 0.0, 0]
                for i in range(3, 7):
                    self.folded[i] += row[i]

    def operators(self) -> list[list[Any]]:
        """The rows (:meth:`rows`) of every dataflow of the worker, completed ones included, each
        dataflow once (the oldest completed ones in one row, :data:`FOLDED_LABEL`)."""
        with self.lock:
            live = list(getattr(self.worker, "_dataflows", ()))
            folded = [] if self.folded is None else [list(self.folded)]
            return folded + [row for rows in self.retired for row in rows] + self.rows(live)

    def snapshot(self) -> dict[str, Any]:
        """Every counter of this worker now (cumulative), as a msgpack-friendly dict."""
        now = time.time()
        snap: dict[str, Any] = {
            "worker": self.index, "time": now, "mono": time.monotonic(), "operators": self.operators(),
            "received_bytes": self.received_bytes, "backlog_bytes": self.backlog_bytes(),
            "lags": {p.name: p.read(now) for p in self.lags}, "sources": {},
        }
        live = sources()  # (held while the final figures are read: a source is live or retained, not neither)
        finals = self._retain()
        for source in live:
            if getattr(source, "index", self.index) != self.index:
                continue  # another worker's, in a process that ran several (tests)
            try:
                snap["sources"][source.metrics_name] = source.metrics()
            except Exception as e:  # a source must not stop the reports
                snap["sources"][getattr(source, "metrics_name", "?")] = {"error": repr(e)}
        del live
        for name, figures in finals.items():  # (after the live ones: the dashboard shows the first)
            snap["sources"].setdefault(name, figures)
        ck = getattr(self.worker, "checkpoint", None)
        if ck is not None:
            snap["checkpoint"] = ck.stats()
        return snap

    def close(self) -> None:
        """Stop the reporter, the hub and the servers (idempotent)."""
        if self.reporter is not None:
            self.reporter.stop()  # (its last report has the final counts of the sources collected)
            self.reporter = None
        with _sources_lock:
            if _owners.get(self.index) is not None and _owners[self.index]() is self:
                del _owners[self.index]  # (a later worker of this index in this process names its own)
        for server in self.servers:
            try:
                server.close()
            except Exception:
                pass
        self.servers = []
        if self.hub is not None:
            self.hub.close()
            self.hub = None
