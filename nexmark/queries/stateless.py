"""Q0 (pass-through), Q1 (currency conversion) and Q2 (selection): no state.

The Megaphone variants route records through a migratable operator keyed by the auction (or the
event id for Q0), as Megaphone's ``q*_flex`` do: they measure the cost of the routing and staging
machinery itself. Records come out at their own time in both variants.
"""
from __future__ import annotations

from typing import Any

import megaphone
import timely

from ..model import Params
from .common import Streams


def q0(s: Streams, p: Params) -> timely.Stream:
    """Q0: every event, unchanged (persons, auctions and bids on one stream)."""
    return s.persons.concat(s.auctions, s.bids, name="Q0")


def q0_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q0 through a migratable operator keyed by the event's id (a bid's auction)."""
    def fold(t: Any, records: list, timers: list, state: dict, notificator: Any) -> list:
        return records

    events = s.persons.concat(s.auctions, s.bids, name="Q0 events")
    return megaphone.unary(events, control, 0, fold, name="Q0 flex").stream


def _q1(batch: Any) -> list:
    return [(a, b, price * 89 // 100, t) for a, b, price, t in batch]


def q1(s: Streams, p: Params) -> timely.Stream:
    """Q1: every bid with its price converted to euros, ``price * 89 // 100`` (Megaphone's rate)."""
    return s.bids.map_batch(_q1, name="Q1")


def q1_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q1 through a migratable operator keyed by auction."""
    def fold(t: Any, records: list, timers: list, state: dict, notificator: Any) -> list:
        return _q1(records)

    return megaphone.unary(s.bids, control, 0, fold, name="Q1 flex").stream


def _q2(skip: int) -> Any:
    def select(batch: Any) -> list:
        return [(a, price) for a, _, price, _ in batch if a % skip == 0]

    return select


def q2(s: Streams, p: Params) -> timely.Stream:
    """Q2: ``(auction, price)`` of the bids on auctions whose id is a multiple of ``q2_skip`` (123)."""
    return s.bids.map_batch(_q2(p.q2_skip), name="Q2")


def q2_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q2 through a migratable operator keyed by auction."""
    select = _q2(p.q2_skip)

    def fold(t: Any, records: list, timers: list, state: dict, notificator: Any) -> list:
        return select(records)

    return megaphone.unary(s.bids, control, 0, fold, name="Q2 flex").stream
