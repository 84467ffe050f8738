"""The closed-auctions sub-plan shared by Q4 and Q6, and the two queries built on it.

Closed auctions: bids are joined with their auction (exchanged by auction id); an auction closes
at ``expires``, and its winning bid is the highest valid one (``price >= reserve`` and
``date_time <= bid time < expires``; ties go to the earlier bid, then the lower bidder id). An
auction with a valid bid yields ``(auction, seller, category, expires, price, bidder)`` at epoch
``last_epoch(expires)``, once that epoch is complete.

Bids may arrive before their auction (ids up to 10 ahead are drawn): they are kept as pending
until no auction they could be valid for can still arrive (their own epoch has completed), then
dropped. Bids for an auction that has closed are dropped at once (a recently closed auction leaves
a tombstone); they cannot be valid, since the auction closed only after every bid before its
expiry had arrived.

* Q4: per category, the running average ``sum // count`` of closing prices, emitted at each time
  for every category that closed an auction then.
* Q6: per seller, the average ``sum // n`` of the closing prices of their last 10 closed auctions
  (ordered by ``(expires, auction)``), emitted at each time for every seller that changed.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

import megaphone
import timely

from ..model import (
    A_CATEGORY,
    A_EXPIRES,
    A_ID,
    A_RESERVE,
    A_SELLER,
    A_TIME,
    B_BIDDER,
    B_PRICE,
    B_TIME,
    Params,
    last_epoch,
)
from .common import Streams, frontier_bound, per_time_groups

# Closed auction record fields.
C_AUCTION, C_SELLER, C_CATEGORY, C_EXPIRES, C_PRICE, C_BIDDER = range(6)

CLOSED = ()  # the state of a closed auction (a tombstone)
TOMBS = -1  # state key of a bin's tombstone queue (auction ids are positive)
TOMBSTONES = 4096  # closed auctions remembered per worker (native)
BIN_TOMBSTONES = 64  # closed auctions remembered per bin (Megaphone)


def _auction_info(s: Streams) -> timely.Stream:
    """Auctions projected to ``(id, seller, category, reserve, date_time, expires)``."""
    return s.auctions.map_batch(
        lambda b: [(a[A_ID], a[A_SELLER], a[A_CATEGORY], a[A_RESERVE], a[A_TIME], a[A_EXPIRES]) for a in b],
        name="Auction info")


def _best(bid: tuple, info: tuple, best: tuple | None) -> tuple | None:
    """The better of ``best`` (a key ``(price, -date_time, -bidder)``) and ``bid``, if the bid is
    valid for the auction ``info`` = ``(seller, category, reserve, date_time, expires)``."""
    price = bid[B_PRICE]
    if price < info[2] or (best is not None and price < best[0]):
        return best
    dt = bid[B_TIME]
    if info[3] <= dt < info[4]:
        key = (price, -dt, -bid[B_BIDDER])
        if best is None or key > best:
            return key
    return best


def _closed(aid: int, info: tuple, best: tuple) -> tuple:
    return (aid, info[0], info[1], info[4], best[0], -best[2])


def _open(state: dict, a: tuple) -> tuple[int, tuple]:
    """Record the auction ``a`` (projected), validating the bids that were waiting for it."""
    aid, info = a[0], a[1:]
    e = state.get(aid)
    best = None
    if e:  # pending bids (an auction id arrives once: never a known auction or a tombstone)
        for bid in e[1]:
            best = _best(bid, info, best)
    state[aid] = [info, best]
    return aid, info


def _bury(state: dict, tombs: deque, aid: int, limit: int) -> None:
    """Replace a closed auction by a tombstone (later bids for it are invalid and dropped at once);
    forget the oldest tombstone beyond ``limit`` (a bid arriving after that is merely kept as
    pending until it expires)."""
    state[aid] = CLOSED
    tombs.append(aid)
    if len(tombs) > limit:
        old = tombs.popleft()
        if state.get(old) == CLOSED:
            del state[old]


def closed_auctions(s: Streams, p: Params) -> timely.Stream:
    """Closed auctions on engine operators (``binary_frontier``, one capability at the earliest
    pending close)."""
    d = p.d
    info_stream = _auction_info(s)

    def build(cap: Any, op: Any) -> Any:
        cap.drop()
        # auction -> [info, best] (open) | [None, pending bids, latest bid epoch] | CLOSED
        state: dict[int, Any] = {}
        tombs: deque = deque()
        closing: list[tuple[int, int]] = []  # heap of (close epoch, auction)
        expiring: list[tuple[int, int]] = []  # heap of (epoch after which pending bids may die, auction)
        held: list[Any] = [None]  # capability at the earliest close epoch

        def logic(bids_in: Any, auctions_in: Any, out: Any) -> None:
            # Auctions first: bids for an auction opened in the same batch then skip the pending path.
            for icap, batch in auctions_in:
                for a in batch:
                    aid, info = _open(state, a)
                    close = last_epoch(info[4], d)
                    heapq.heappush(closing, (close, aid))
                    if held[0] is None or held[0].time > close:
                        new = icap.delayed(close)
                        if held[0] is not None:
                            held[0].drop()
                        held[0] = new
            for icap, batch in bids_in:
                for bid in batch:
                    aid = bid[0]
                    e = state.get(aid)
                    if e is None:
                        g = bid[B_TIME] // d
                        state[aid] = [None, [bid], g]
                        heapq.heappush(expiring, (g, aid))
                    elif not e:
                        continue  # the auction has closed: the bid is too late
                    elif e[0] is None:
                        e[1].append(bid)
                        if bid[B_TIME] // d > e[2]:
                            e[2] = bid[B_TIME] // d
                    elif bid[B_PRICE] >= e[0][2]:  # at least the reserve: maybe the best so far
                        e[1] = _best(bid, e[0], e[1])
            bound = frontier_bound(bids_in.frontier, auctions_in.frontier)
            cap = held[0]
            while closing and closing[0][0] < bound:
                close, aid = heapq.heappop(closing)
                info, best = state[aid]
                _bury(state, tombs, aid, TOMBSTONES)
                if best is not None:
                    if cap.time != close:
                        cap.downgrade(close)
                    out.give(cap, _closed(aid, info, best))
            if cap is not None:
                if closing:
                    if cap.time != closing[0][0]:
                        cap.downgrade(closing[0][0])
                else:
                    cap.drop()
                    held[0] = None
            while expiring and expiring[0][0] < bound:
                g, aid = heapq.heappop(expiring)
                e = state.get(aid)
                if e and e[0] is None:
                    if e[2] <= g:
                        del state[aid]
                    else:
                        heapq.heappush(expiring, (e[2], aid))

        return logic

    return s.bids.binary_frontier(info_stream, build, name="Closed auctions", exchange1=0, exchange2=0)


def closed_auctions_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Closed auctions in a migratable binary operator keyed by auction id; closing and the expiry
    of pending bids are per-bin timers, so they migrate with the state."""
    d = p.d

    def fold(t: Any, bids: list, auctions: list, timers: list, state: dict, notificator: Any) -> list:
        out = []
        closing_now = []
        for a in auctions:
            aid, info = _open(state, a)
            close = last_epoch(info[4], d)
            if close == t:
                closing_now.append(aid)
            else:
                notificator.notify_at(close, 2 * aid)
        for bid in bids:
            aid = bid[0]
            e = state.get(aid)
            if e is None:
                g = bid[B_TIME] // d
                state[aid] = [None, [bid], g]
                notificator.notify_at(g + 1, 2 * aid + 1)
            elif not e:
                continue
            elif e[0] is None:
                e[1].append(bid)
                if bid[B_TIME] // d > e[2]:
                    e[2] = bid[B_TIME] // d
            elif bid[B_PRICE] >= e[0][2]:
                e[1] = _best(bid, e[0], e[1])
        # Timers: 2 * auction closes it, 2 * auction + 1 expires its pending bids (a sign, as
        # before, lost auction 0: Config's first_auction_id may be 0).
        for x in (*timers, *(2 * aid for aid in closing_now)):
            aid, expire = divmod(x, 2)
            e = state.get(aid)
            if not e:
                continue
            if not expire and e[0] is not None:
                tombs = state.get(TOMBS)
                if tombs is None:
                    tombs = state[TOMBS] = deque()
                _bury(state, tombs, aid, BIN_TOMBSTONES)
                if e[1] is not None:
                    out.append(_closed(aid, e[0], e[1]))
            elif expire and e[0] is None:
                if e[2] < t:
                    del state[aid]
                else:
                    notificator.notify_at(e[2] + 1, x)
        return out

    m = megaphone.binary(s.bids, _auction_info(s), control, 0, 0, fold, name="Closed auctions flex")
    return m.stream


def _q4_update(sums: dict, closed: list) -> list:
    """Q4's step: add the closing prices to their categories' sums; the changed averages."""
    changed = set()
    for c in closed:
        cat = c[C_CATEGORY]
        acc = sums.get(cat)
        if acc is None:
            acc = sums[cat] = [0, 0]
        acc[0] += c[C_PRICE]
        acc[1] += 1
        changed.add(cat)
    return [(cat, sums[cat][0] // sums[cat][1]) for cat in sorted(changed)]


def _q6_update(last: dict, closed: list) -> list:
    """Q6's step: append the closing prices to their sellers' last 10; the changed averages."""
    changed = set()
    closed.sort(key=lambda c: (c[C_EXPIRES], c[C_AUCTION]))
    for c in closed:
        seller = c[C_SELLER]
        prices = last.get(seller)
        if prices is None:
            prices = last[seller] = deque(maxlen=10)
        prices.append(c[C_PRICE])
        changed.add(seller)
    return [(seller, sum(last[seller]) // len(last[seller])) for seller in sorted(changed)]


def _per_closed(s: Streams, p: Params, control: Any, key: int, update: Callable[[dict, list], list],
                name: str) -> timely.Stream:
    """Closed auctions, then per time ``update(state, closed auctions)`` with the state keyed by
    field ``key``: on engine operators without ``control``, else with both the auction state and
    this state migratable."""
    if control is None:
        state: dict = {}
        return per_time_groups(closed_auctions(s, p), key, lambda t, closed: update(state, closed), f"{name} average")

    def fold(t: Any, closed: list, timers: list, state: dict, notificator: Any) -> list:
        return update(state, closed)

    return megaphone.unary(closed_auctions_flex(s, control, p), control, key, fold, name=f"{name} flex").stream


def q4(s: Streams, p: Params) -> timely.Stream:
    """Q4 on engine operators: closed auctions, then a per-category running average."""
    return _per_closed(s, p, None, C_CATEGORY, _q4_update, "Q4")


def q4_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q4 with both the auction state and the per-category sums migratable."""
    return _per_closed(s, p, control, C_CATEGORY, _q4_update, "Q4")


def q6(s: Streams, p: Params) -> timely.Stream:
    """Q6 on engine operators: closed auctions, then per seller the average of the last 10."""
    return _per_closed(s, p, None, C_SELLER, _q6_update, "Q6")


def q6_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q6 with both the auction state and the per-seller prices migratable."""
    return _per_closed(s, p, control, C_SELLER, _q6_update, "Q6")
