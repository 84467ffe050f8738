"""The metrics transport: every worker's :class:`Reporter` sends a snapshot every ``interval``
seconds to the :class:`Hub` on worker 0, which keeps each worker's last two snapshots and derives
rates from them (records per second, busy milliseconds per second, records per bin per second).

The transport is a ZeroMQ PUSH -> PULL pair beside the dataflows, not a dataflow: it needs no
operator on any worker, costs the workers one small message per interval (a background thread
reads the counters), and keeps running while the dataflows are busy or stuck, which is when one
wants to see them. The Prometheus endpoint, the dashboard and Megaphone's AutoBalancer all read
the hub of worker 0. A snapshot that cannot be sent at once (worker 0 gone or slow) is dropped.
"""
from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from .core import FOLDED_INDEX

#: Seconds :meth:`Reporter.stop` waits for the reporter's thread (its last report and socket close).
STOP_WAIT = 2.0


def _rate(new: float, old: float, seconds: float) -> float:
    return (new - old) / seconds if seconds > 0 else 0.0


def _integer(x: Any) -> bool:
    """An integer (not a bool): Python's or numpy's."""
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def _number(x: Any) -> bool:
    """A finite real number (not a bool): rates are differences of them, and NaN is not JSON."""
    if type(x) is int:
        return True
    if type(x) is float:
        return math.isfinite(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    return isinstance(x, numbers.Integral) or math.isfinite(float(x))


def _numbers(xs: Any) -> bool:
    return isinstance(xs, (list, tuple)) and all(_number(x) for x in xs)


def _operator_row(row: Any) -> bool:
    """``[dataflow, index, name, records_in, records_out, busy_seconds, activations]``."""
    return (isinstance(row, (list, tuple)) and len(row) >= 7 and isinstance(row[0], str) and _integer(row[1])
            and isinstance(row[2], str) and all(_number(v) for v in row[3:7]))


def _source(src: Any) -> bool:
    """A source's figures as :meth:`Hub.view` reads them (kinds "bins" and "counters"; others are kept
    as they are, a dict, and not read)."""
    if not isinstance(src, dict):
        return False
    kind = src.get("kind")
    if kind == "bins":
        records: Any = src.get("records")
        state: Any = src.get("state")
        owned: Any = src.get("owned", ())
        counters: Any = src.get("counters", {})
        return (_numbers(records) and _numbers(state) and len(records) == len(state)
                and isinstance(owned, (list, tuple)) and all(_integer(b) and 0 <= b < len(records) for b in owned)
                and isinstance(counters, dict) and all(isinstance(k, str) and _number(v) for k, v in counters.items()))
    if kind == "counters":
        values = src.get("values", {})
        return (isinstance(src.get("prefix", ""), str) and isinstance(values, dict)
                and all(isinstance(k, str) and (v is None or isinstance(v, (str, bool)) or _number(v))
                        for k, v in values.items()))
    return True


def _checked(snap: Any, peers: int) -> dict | None:
    """``snap`` if :meth:`Hub.view` can read it (a copy without its malformed optional entries), else
    None. Required: ``worker`` (an index below ``peers``), ``mono`` (a finite number), ``operators``
    (rows, see :func:`_operator_row`), ``received_bytes`` and ``backlog_bytes`` (numbers)."""
    if not isinstance(snap, dict):
        return None
    w: Any = snap.get("worker")
    if not (_integer(w) and 0 <= w < peers and _number(snap.get("mono")) and _number(snap.get("received_bytes"))
            and _number(snap.get("backlog_bytes"))):
        return None
    ops = snap.get("operators")
    if not isinstance(ops, (list, tuple)) or not all(_operator_row(r) for r in ops):
        return None
    out = dict(snap)
    out["worker"] = int(w)
    lags = snap.get("lags")
    out["lags"] = {name: {"frontier": lag.get("frontier"), "lag_s": lag.get("lag_s")}
                   for name, lag in (lags.items() if isinstance(lags, dict) else ())
                   if isinstance(name, str) and isinstance(lag, dict)
                   and (lag.get("lag_s") is None or _number(lag.get("lag_s")))
                   and (lag.get("frontier") is None or isinstance(lag.get("frontier"), str) or _number(lag.get("frontier")))}
    sources = snap.get("sources")
    out["sources"] = {name: src for name, src in (sources.items() if isinstance(sources, dict) else ())
                      if isinstance(name, str) and _source(src)}
    ck = snap.get("checkpoint")
    if ck is not None and not (isinstance(ck, dict) and all(isinstance(k, str) and _number(v) for k, v in ck.items())):
        out["checkpoint"] = None
    return out


class Hub:
    """Worker 0's gathering point: binds ``address`` (a ZeroMQ PULL socket; None: only local
    :meth:`put` calls) and keeps the newest two snapshots of each worker."""

    def __init__(self, address: str | None, peers: int) -> None:
        self.peers = peers
        self._lock = threading.Lock()
        self._latest: dict[int, dict] = {}
        self._previous: dict[int, dict] = {}
        self.received = 0  # snapshots taken in
        self.rejected = 0  # messages dropped as malformed (see put)
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self.address = address
        if address is not None:
            self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
            try:
                sock.bind(address)
            except zmq.ZMQError as e:
                sock.close(0)
                self._ctx.term()
                raise OSError(f"the metrics hub cannot bind {address}: {e}") from e
            self._thread = threading.Thread(target=self._serve, args=(sock,), name="timely-metrics-hub", daemon=True)
            self._thread.start()

    def _serve(self, sock: zmq.Socket) -> None:
        # Invariant: no message ends this thread (a bad one is counted in ``rejected`` and skipped).
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    snap = msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False, strict_map_key=False)
                except zmq.Again:
                    continue
                except Exception:  # (not msgpack, or msgpack of no Python value)
                    self._reject()
                    continue
                try:
                    self.put(snap)
                except Exception:  # (put checks every field view() reads; this is the last guard)
                    self._reject()
        finally:
            sock.close(0)

    def _reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def put(self, snap: dict) -> None:
        """Take one worker's snapshot (the previous one is kept for rates). A snapshot without the
        fields :meth:`view` reads, or with values of other types, is counted in :attr:`rejected` and
        dropped; malformed optional entries (a lag, a source, the checkpoint's figures) are left out."""
        clean = _checked(snap, self.peers)
        with self._lock:
            if clean is None:
                self.rejected += 1
                return
            w = clean["worker"]
            old = self._latest.get(w)
            if old is not None and old["mono"] >= clean["mono"]:
                return  # out of order
            if old is not None:
                self._previous[w] = old
            self._latest[w] = clean
            self.received += 1

    def latest(self) -> dict[int, dict]:
        """The newest snapshot of each worker heard from (by worker index)."""
        with self._lock:
            return dict(self._latest)

    def wait(self, condition: Callable[[dict[int, dict]], bool], timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until ``condition(latest())`` holds; its last value."""
        deadline = time.monotonic() + timeout
        while not condition(self.latest()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def view(self) -> dict[str, Any]:
        """Every worker's newest figures with rates over its last interval: ``operators`` (rows with
        ``records_in_per_s``, ``records_out_per_s``, ``busy_ms_per_s``), ``workers`` (busy, bytes,
        backlog), ``bins`` (per keyed source: per-bin records per second and state entries summed
        over workers, and each bin's owner), ``lags`` and ``counters`` (sources of kind "counters":
        ``{"prefix", "values"}``, such as Megaphone's controller); ``heard`` lists the workers heard from, ``rated``
        those heard from twice (whose rates are known). A ``bins`` entry's ``reports`` holds, per
        worker, its newest report's time (``time.monotonic``) and its per-bin records; its
        ``retired`` is true when every worker reported the source's final counts (collected: its
        dataflow completed)."""
        with self._lock:
            latest, previous = dict(self._latest), dict(self._previous)
        ops: list[dict[str, Any]] = []
        workers: list[dict[str, Any]] = []
        bins: dict[str, dict[str, Any]] = {}
        lags: list[dict[str, Any]] = []
        counters: list[dict[str, Any]] = []
        for w in sorted(latest):
            new, old = latest[w], previous.get(w)
            dt = new["mono"] - old["mono"] if old is not None else 0.0
            old_ops = {(r[0], r[1]): r for r in old["operators"]} if old is not None else {}
            busy = 0.0
            for row in new["operators"]:
                o = old_ops.get((row[0], row[1]))
                # (the folded row of dataflows completed earlier grows only by folding: no rate; a
                # row the previous report lacked is a dataflow built since, its counters from 0:
                # dataflows shorter than the interval did all their work between two reports)
                rates = [0.0 if old is None or row[1] == FOLDED_INDEX else _rate(row[i], o[i] if o is not None else 0, dt)
                         for i in (3, 4, 5)]
                busy += rates[2]
                ops.append({"worker": w, "dataflow": row[0], "index": row[1], "operator": row[2],
                            "records_in": row[3], "records_out": row[4], "busy_seconds": row[5],
                            "activations": row[6], "records_in_per_s": rates[0], "records_out_per_s": rates[1],
                            "busy_ms_per_s": 1000.0 * rates[2]})
            recv_rate = _rate(new["received_bytes"], old["received_bytes"], dt) if old is not None else 0.0
            workers.append({"worker": w, "busy_ms_per_s": 1000.0 * busy, "received_bytes": new["received_bytes"],
                            "received_bytes_per_s": recv_rate, "backlog_bytes": new["backlog_bytes"],
                            "age_s": time.monotonic() - new["mono"] if w == 0 else None,
                            "checkpoint": new.get("checkpoint")})
            for name, lag in new.get("lags", {}).items():
                lags.append({"worker": w, "probe": name, **lag})
            for name, src in new.get("sources", {}).items():
                if src.get("kind") == "counters":
                    counters.append({"worker": w, "source": name, "prefix": src.get("prefix", name),
                                     "values": dict(src.get("values", {}))})
                if src.get("kind") != "bins":
                    continue
                nb = len(src["records"])
                agg = bins.setdefault(name, {"records_per_s": [0.0] * nb, "records": [0] * nb, "state": [0] * nb,
                                             "owner": [-1] * nb, "workers": {}, "reports": {}, "retired": True})
                if len(agg["records"]) != nb:
                    continue  # (another worker reported another number of bins: not the same source)
                # retired: every worker reports its final counts (the operator is gone everywhere)
                agg["retired"] = agg["retired"] and src.get("retired") is True
                olds = (old or {}).get("sources", {}).get(name)
                for b in range(nb):
                    agg["records"][b] += src["records"][b]
                    agg["state"][b] += src["state"][b]
                    if olds is not None and len(olds.get("records", ())) == nb:
                        agg["records_per_s"][b] += _rate(src["records"][b], olds["records"][b], dt)
                for b in src["owned"]:
                    agg["owner"][b] = w
                agg["workers"][w] = src.get("counters", {})
                agg["reports"][w] = (new["mono"], list(src["records"]))
        return {"operators": ops, "workers": workers, "bins": bins, "lags": lags, "counters": counters, "peers": self.peers,
                "heard": sorted(latest), "rated": sorted(w for w in latest if w in previous)}

    def close(self) -> None:
        """Stop receiving (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class Reporter:
    """A worker's background thread: ``snapshot()`` every ``interval`` seconds, handed to ``hub``
    (worker 0) or pushed to ``address`` (the others); a last one when stopped.

    Invariant: only the reporter's thread uses its ZeroMQ socket (a socket is not thread-safe); it
    also sends the last report and closes the socket and its context when stopped."""

    def __init__(self, snapshot: Callable[[], dict], interval: float, hub: Hub | None = None,
                 address: str | None = None) -> None:
        self.snapshot = snapshot
        self.interval = interval
        self.hub = hub
        self.sent = 0
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        if hub is None and address is not None:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 500)
            self._sock.setsockopt(zmq.SNDHWM, 4)
            self._sock.connect(address)
        self._thread = threading.Thread(target=self._run, name="timely-metrics-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.report()
            self.report()  # the last one
        finally:
            if self._sock is not None:
                self._sock.close(500)  # (up to 0.5 s to deliver the last report)
            if self._ctx is not None:
                self._ctx.term()

    def report(self) -> None:
        """Take and hand over one snapshot now (on the reporter's thread: it pushes on its socket)."""
        try:
            snap = self.snapshot()
        except Exception:  # (a counter changed shape under the thread: skip this interval)
            return
        if self.hub is not None:
            self.hub.put(snap)
        elif self._sock is not None:
            try:
                self._sock.send(msgpack.packb(snap, use_bin_type=True, default=repr), zmq.NOBLOCK)
            except (zmq.ZMQError, ValueError, TypeError, OverflowError):  # (worker 0 slow or gone; a value msgpack refuses)
                return
        self.sent += 1

    def stop(self) -> None:
        """Stop the thread, which sends one last report and closes its socket; wait up to
        :data:`STOP_WAIT` seconds for it (a thread still inside a slow ``snapshot()`` then finishes on
        its own: a daemon, it never holds the process). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=STOP_WAIT)
