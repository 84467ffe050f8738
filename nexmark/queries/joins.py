"""Q3 (local item suggestion) and Q8 (monitor new users): incremental joins of persons and auctions.

Both are symmetric hash joins keyed by person id (= the auction's seller). A matched pair is
emitted at the later of its two records' times, so the output per time does not depend on the
order in which batches happen to arrive. Per key the state is either the person (once seen: later
auctions match at once and are not stored) or the list of auctions waiting for that person.

* Q3: auctions in category ``q3_category`` (10) joined with persons living in ``q3_states``
  (OR, ID, CA); output ``(name, city, state, auction_id)``. The state grows without bound.
* Q8: persons joined with the auctions they open in the same tumbling event-time window of
  ``q8_window_ms`` (12 h); output ``(person_id, name, auction_id)``. A window's state is dropped
  once its last epoch is complete.
"""
from __future__ import annotations

from typing import Any

import megaphone
import timely

from ..model import A_CATEGORY, A_ID, A_SELLER, A_TIME, P_CITY, P_ID, P_NAME, P_STATE, P_TIME, Params, last_epoch
from .common import HeldCaps, Streams, emit_by_time, frontier_bound


def _seen_or_wait(state: dict, person: int, auction: int, t: int) -> Any:
    """An auction's side of the native joins: the person's entry if the person has been seen (a
    tuple), else ``None`` after adding ``(auction, t)`` to the list of auctions waiting for them."""
    e = state.get(person)
    if e is None:
        state[person] = [(auction, t)]
    elif type(e) is list:
        e.append((auction, t))
    else:
        return e
    return None


def _q3_inputs(s: Streams, p: Params) -> tuple[timely.Stream, timely.Stream]:
    cat, states = p.q3_category, frozenset(p.q3_states)
    auctions = s.auctions.map_batch(lambda b: [(a[A_SELLER], a[A_ID]) for a in b if a[A_CATEGORY] == cat],
                                    name="Q3 auctions")
    persons = s.persons.map_batch(
        lambda b: [(x[P_ID], x[P_NAME], x[P_CITY], x[P_STATE]) for x in b if x[P_STATE] in states],
        name="Q3 persons")
    return auctions, persons


def q3(s: Streams, p: Params) -> timely.Stream:
    """Q3 on engine operators: a ``binary_frontier`` join exchanged by person id."""
    auctions, persons = _q3_inputs(s, p)

    def join(cap: Any, info: Any) -> Any:
        cap.drop()
        state: dict[int, Any] = {}  # person id -> (name, city, state, t) | [(auction, t), ...]
        held = HeldCaps()

        def logic(in1: Any, in2: Any, out: Any) -> None:
            bound = frontier_bound(in1.frontier, in2.frontier)  # (batches still queued count)
            for icap, batch in in1:  # auctions (seller, id)
                t = icap.time
                held.hold(icap, bound)
                res: dict[int, list] = {}
                for seller, aid in batch:
                    e = _seen_or_wait(state, seller, aid, t)
                    if e is not None:
                        res.setdefault(max(t, e[3]), []).append((e[0], e[1], e[2], aid))
                emit_by_time(out, icap, held, res)
            for icap, batch in in2:  # persons (id, name, city, state)
                t = icap.time
                held.hold(icap, bound)
                res = {}
                for pid, name, city, st in batch:
                    waiting = state.get(pid)
                    if waiting is not None:
                        for aid, ta in waiting:
                            res.setdefault(max(t, ta), []).append((name, city, st, aid))
                    state[pid] = (name, city, st, t)
                emit_by_time(out, icap, held, res)
            held.release(frontier_bound(in1.frontier, in2.frontier))

        return logic

    return auctions.binary_frontier(persons, join, name="Q3 join", exchange1=0, exchange2=0)


def q3_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q3 with the join state in a migratable binary operator keyed by person id."""
    auctions, persons = _q3_inputs(s, p)

    def fold(t: Any, auctions: list, persons: list, timers: list, state: dict, notificator: Any) -> list:
        out: list[tuple] = []
        for pid, name, city, st in persons:
            waiting = state.get(pid)
            if waiting is not None:
                out.extend((name, city, st, aid) for aid in waiting)
            state[pid] = (name, city, st)
        for seller, aid in auctions:
            e = state.get(seller)
            if e is None:
                state[seller] = [aid]
            elif type(e) is list:
                e.append(aid)
            else:
                out.append((*e, aid))
        return out

    return megaphone.binary(auctions, persons, control, 0, 0, fold, name="Q3 flex").stream


def _q8_inputs(s: Streams) -> tuple[timely.Stream, timely.Stream]:
    persons = s.persons.map_batch(lambda b: [(x[P_ID], x[P_NAME], x[P_TIME]) for x in b], name="Q8 persons")
    auctions = s.auctions.map_batch(lambda b: [(a[A_SELLER], a[A_ID], a[A_TIME]) for a in b], name="Q8 auctions")
    return persons, auctions


def q8(s: Streams, p: Params) -> timely.Stream:
    """Q8 on engine operators: a windowed ``binary_frontier`` join exchanged by person id."""
    persons, auctions = _q8_inputs(s)
    width, d = p.q8_window_ms, p.d

    def join(cap: Any, info: Any) -> Any:
        cap.drop()
        windows: dict[int, dict] = {}  # window -> person id -> (name, t) | [(auction, t), ...]
        held = HeldCaps()

        def logic(in1: Any, in2: Any, out: Any) -> None:
            bound = frontier_bound(in1.frontier, in2.frontier)  # (batches still queued count)
            for icap, batch in in1:  # persons (id, name, date_time)
                t = icap.time
                held.hold(icap, bound)
                res: dict[int, list] = {}
                for pid, name, dt in batch:
                    w = windows.get(dt // width)
                    if w is None:
                        w = windows[dt // width] = {}
                    waiting = w.get(pid)
                    if waiting is not None:
                        for aid, ta in waiting:
                            res.setdefault(max(t, ta), []).append((pid, name, aid))
                    w[pid] = (name, t)
                emit_by_time(out, icap, held, res)
            for icap, batch in in2:  # auctions (seller, id, date_time)
                t = icap.time
                held.hold(icap, bound)
                res = {}
                for seller, aid, dt in batch:
                    w = windows.get(dt // width)
                    if w is None:
                        w = windows[dt // width] = {}
                    e = _seen_or_wait(w, seller, aid, t)
                    if e is not None:
                        res.setdefault(max(t, e[1]), []).append((seller, e[0], aid))
                emit_by_time(out, icap, held, res)
            held.release(frontier_bound(in1.frontier, in2.frontier))
            bound = frontier_bound(in1.frontier, in2.frontier)
            for k in [k for k in windows if last_epoch((k + 1) * width, d) < bound]:
                del windows[k]

        return logic

    return persons.binary_frontier(auctions, join, name="Q8 join", exchange1=0, exchange2=0)


def q8_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q8 with the window state in a migratable binary operator keyed by person id; a timer per
    bin and window drops the window's entries once its last epoch is complete."""
    persons, auctions = _q8_inputs(s)
    width, d = p.q8_window_ms, p.d

    def fold(t: Any, persons: list, auctions: list, timers: list, state: dict, notificator: Any) -> list:
        out: list[tuple] = []
        # State keys: (window, person id) -> name | [auction, ...]; (window, None) marks a purge timer.
        for pid, name, dt in persons:
            k = dt // width
            waiting = state.get((k, pid))
            if waiting is not None:
                out.extend((pid, name, aid) for aid in waiting)
            state[(k, pid)] = name
            if (k, None) not in state:
                state[(k, None)] = True
                notificator.notify_at(last_epoch((k + 1) * width, d), k)
        for seller, aid, dt in auctions:
            k = dt // width
            e = state.get((k, seller))
            if e is None:
                state[(k, seller)] = [aid]
                if (k, None) not in state:
                    state[(k, None)] = True
                    notificator.notify_at(last_epoch((k + 1) * width, d), k)
            elif type(e) is list:
                e.append(aid)
            else:
                out.append((seller, e, aid))
        for k in timers:
            for key in [key for key in state if key[0] == k]:
                del state[key]
        return out

    return megaphone.binary(persons, auctions, control, 0, 0, fold, name="Q8 flex").stream
