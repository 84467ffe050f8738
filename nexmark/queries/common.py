"""What the query builders share: the event streams, held capabilities, and per-time reducers."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import timely
from timely import Capability


class Streams(NamedTuple):
    """The three NEXMark event streams of one dataflow (see :mod:`nexmark.model` for layouts)."""

    persons: timely.Stream
    auctions: timely.Stream
    bids: timely.Stream


NEVER = float("inf")  # the bound of an empty frontier


def frontier_bound(*frontiers: timely.Frontier) -> Any:
    """The earliest time any of these input frontiers may still deliver (``NEVER`` if none).

    Queries run in the top-level scope, whose times are integers (totally ordered): a time ``t``
    is complete on every input exactly when ``t < frontier_bound(...)``.
    """
    return min([t for f in frontiers for t in f], default=NEVER)


class HeldCaps:
    """Capabilities kept at the times of stored join records, for results at the later time.

    A symmetric join emits a matched pair at the later of its two records' times. When a record at
    ``t`` is matched by one at an earlier time ``t' < t`` (which may arrive later, on the other
    input), the result is due at ``t``, so a capability at ``t`` is kept while some input frontier is
    still before ``t``. Holding it costs no latency: the operator's output frontier is bounded by
    its input frontiers anyway.
    """

    __slots__ = ("caps",)

    def __init__(self) -> None:
        self.caps: dict[Any, Capability] = {}

    def hold(self, icap: Any, bound: Any) -> None:
        """Keep a capability at ``icap.time`` if some input may still deliver an earlier time
        (``bound`` is :func:`frontier_bound` of the inputs)."""
        t = icap.time
        if bound < t and t not in self.caps:
            self.caps[t] = icap.retain()

    def cap(self, icap: Any, t: Any) -> Any:
        """The capability to send at ``t``: the input's own, or the one held at ``t``."""
        if t == icap.time:
            return icap
        return self.caps[t]

    def release(self, bound: Any) -> None:
        """Drop the capabilities whose time every input frontier has reached."""
        if self.caps:
            for t in [t for t in self.caps if t <= bound]:
                self.caps.pop(t).drop()


def emit_by_time(out: Any, icap: Any, held: HeldCaps, results: dict) -> None:
    """Send ``{time: [records]}`` results, each at its time (see :class:`HeldCaps`)."""
    for t, recs in results.items():
        out.give_batch(held.cap(icap, t), recs)


def per_time_best(stream: timely.Stream, group: int, score: Callable[[tuple], Any], name: str) -> timely.Stream:
    """Per time and per value of field ``group``: the record with the highest ``score``.

    Records are exchanged by ``group``; the result of a time is emitted once the time is complete
    (used as the global stage of windowed top-1 queries).
    """
    pending: dict[Any, list] = {}

    def logic(inp: Any, out: Any, notificator: Any) -> None:
        for cap, batch in inp:
            acc = pending.get(cap.time)
            if acc is None:
                acc = pending[cap.time] = []
                notificator.notify_at(cap.retain())
            acc.extend(batch)
        for cap in notificator:
            best: dict[Any, tuple] = {}
            for r in pending.pop(cap.time, ()):
                g = r[group]
                cur = best.get(g)
                if cur is None or score(r) > score(cur):
                    best[g] = r
            if best:
                out.give_batch(cap, list(best.values()))

    return stream.unary_notify(logic, name, exchange=group)


def per_time_groups(stream: timely.Stream, key: int | timely.Pact | None, apply: Callable[[Any, list], list],
                    name: str) -> timely.Stream:
    """Collect each time's records (exchanged by field ``key``, or by the pact ``key``; ``None``: not
    exchanged); once the time is complete call ``apply(time, records)`` and emit what it returns at
    that time."""
    pending: dict[Any, list] = defaultdict(list)

    def logic(inp: Any, out: Any, notificator: Any) -> None:
        for cap, batch in inp:
            if cap.time not in pending:
                notificator.notify_at(cap.retain())
            pending[cap.time].extend(batch)
        for cap in notificator:
            result = apply(cap.time, pending.pop(cap.time, []))
            if result:
                out.give_batch(cap, result)

    return stream.unary_notify(logic, name, exchange=key)
