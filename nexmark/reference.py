"""Plain sequential reference computations of Q0-Q8 over a finite list of stamped events.

Each function takes the events as three lists of ``(epoch, record)`` pairs (the epoch each record
was stamped with; see :mod:`nexmark.model`) and returns the query's output as a multiset
(:class:`collections.Counter`) of ``(epoch, record)`` pairs. The definitions are written directly
from the query semantics in :mod:`nexmark.queries`, without any incremental state, so that they are
obviously right (and slow: use a few thousand events).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import NamedTuple

from .model import Params, last_epoch


class Stamped(NamedTuple):
    """Events with the epoch they were sent at: lists of ``(epoch, record)``."""

    persons: list
    auctions: list
    bids: list


def q0(ev: Stamped, p: Params) -> Counter:
    """Every event at its own epoch."""
    return Counter([*ev.persons, *ev.auctions, *ev.bids])


def q1(ev: Stamped, p: Params) -> Counter:
    """Every bid, price in euros (``* 89 // 100``)."""
    return Counter((t, (a, b, price * 89 // 100, dt)) for t, (a, b, price, dt) in ev.bids)


def q2(ev: Stamped, p: Params) -> Counter:
    """``(auction, price)`` of the bids whose auction is a multiple of ``q2_skip``."""
    return Counter((t, (a, price)) for t, (a, _, price, _) in ev.bids if a % p.q2_skip == 0)


def q3(ev: Stamped, p: Params) -> Counter:
    """Every (category-10 auction, person in OR/ID/CA) pair with ``seller == id``, at the later epoch."""
    out: Counter = Counter()
    for ta, a in ev.auctions:
        if a[8] != p.q3_category:
            continue
        for tp, person in ev.persons:
            if person[0] == a[7] and person[5] in p.q3_states:
                out[(max(ta, tp), (person[1], person[4], person[5], a[0]))] += 1
    return out


def closed(ev: Stamped, p: Params) -> list[tuple[int, tuple]]:
    """``(epoch, (auction, seller, category, expires, price, bidder))`` for every auction with a valid
    bid: the highest price wins, then the earlier bid, then the lower bidder."""
    bids_of = defaultdict(list)
    for _, b in ev.bids:
        bids_of[b[0]].append(b)
    out = []
    for _, a in ev.auctions:
        aid, reserve, opened, expires = a[0], a[4], a[5], a[6]
        valid = [b for b in bids_of[aid] if b[2] >= reserve and opened <= b[3] < expires]
        if valid:
            win = max(valid, key=lambda b: (b[2], -b[3], -b[1]))
            out.append((last_epoch(expires, p.d), (aid, a[7], a[8], expires, win[2], win[1])))
    return out


def _per_time(records: list[tuple[int, tuple]], step: Callable[[list], list]) -> Counter:
    by_time = defaultdict(list)
    for t, r in records:
        by_time[t].append(r)
    return Counter((t, r) for t in sorted(by_time) for r in step(by_time[t]))


def q4(ev: Stamped, p: Params) -> Counter:
    """Per epoch and category closing an auction then: the average of all its closing prices so far."""
    prices = defaultdict(list)

    def step(batch: list) -> list:
        for c in batch:
            prices[c[2]].append(c[4])
        return [(cat, sum(prices[cat]) // len(prices[cat])) for cat in {c[2] for c in batch}]

    return _per_time(closed(ev, p), step)


def q6(ev: Stamped, p: Params) -> Counter:
    """Per epoch and seller closing an auction then: the average of the seller's last 10 closing
    prices (closings ordered by expiry, then auction id)."""
    history = defaultdict(list)

    def step(batch: list) -> list:
        for c in sorted(batch, key=lambda c: (c[3], c[0])):
            history[c[1]].append(c[4])
        return [(s, sum(history[s][-10:]) // len(history[s][-10:])) for s in {c[1] for c in batch}]

    return _per_time(closed(ev, p), step)


def q5(ev: Stamped, p: Params) -> Counter:
    """For every slide end ``s`` whose window ``[s - W, s)`` holds a bid: the auction with most bids
    (lowest id on ties), at epoch ``last_epoch(s)``."""
    width, slide = p.q5_window_ms, p.q5_slide_ms
    # The auctions of the bids in each slide-long slice [i * slide, (i + 1) * slide) of event time:
    # a window [end - W, end) is the slices (end - W) // slide .. end // slide - 1 (W and end are
    # multiples of the slide).
    by_slice = defaultdict(list)
    for _, b in ev.bids:
        by_slice[b[3] // slide].append(b[0])
    if not by_slice:
        return Counter()
    out: Counter = Counter()
    for k in range(min(by_slice) + 1, max(by_slice) + width // slide + 1):
        end = k * slide
        counts = Counter(a for i in range((end - width) // slide, k) for a in by_slice.get(i, ()))
        if counts:
            top = max(counts, key=lambda a: (counts[a], -a))
            out[(last_epoch(end, p.d), (end, top, counts[top]))] += 1
    return out


def q7(ev: Stamped, p: Params) -> Counter:
    """Per tumbling window holding a bid: its highest bid (earlier, then lower auction, then lower
    bidder on ties), at the window's last epoch."""
    width = p.q7_window_ms
    windows = defaultdict(list)
    for _, b in ev.bids:
        windows[b[3] // width].append(b)
    out: Counter = Counter()
    for k, bids in windows.items():
        a, bidder, price, dt = max(bids, key=lambda b: (b[2], -b[3], -b[0], -b[1]))
        out[(last_epoch((k + 1) * width, p.d), ((k + 1) * width, a, bidder, price, dt))] += 1
    return out


def q8(ev: Stamped, p: Params) -> Counter:
    """Every (person, auction) pair with ``seller == id`` in the same tumbling window, at the later epoch."""
    width = p.q8_window_ms
    out: Counter = Counter()
    for ta, a in ev.auctions:
        for tp, person in ev.persons:
            if person[0] == a[7] and person[6] // width == a[5] // width:
                out[(max(ta, tp), (person[0], person[1], a[0]))] += 1
    return out


REFERENCE: dict[str, Callable[[Stamped, Params], Counter]] = {
    "q0": q0, "q1": q1, "q2": q2, "q3": q3, "q4": q4, "q5": q5, "q6": q6, "q7": q7, "q8": q8,
}

