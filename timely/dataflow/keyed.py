"""Keyed aggregations per time: the logic of ``count_by_key`` and ``reduce_by_key``."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from .channels import Key
from .handles import Notificator, OperatorInput, OperatorOutput

NotifyLogic = Callable[[OperatorInput, OperatorOutput, Notificator], None]


def key_getter(key: Key) -> Callable[[Any], Any] | None:
    """A function of the record for ``key`` (field index or function); ``None``: the whole record."""
    if key is None:
        return None
    if isinstance(key, int):
        return itemgetter(key)
    return key


def count_logic(key: Key) -> NotifyLogic:
    """Notify logic emitting ``(key, count)`` per key once each time is complete."""
    getter = key_getter(key)
    counts: dict[Any, Counter] = defaultdict(Counter)

    def logic(inp: OperatorInput, out: OperatorOutput, notificator: Notificator) -> None:
        for cap, batch in inp:
            if cap.time not in counts:
                notificator.notify_at(cap.retain())
            counts[cap.time].update(batch if getter is None else map(getter, batch))
        for done in notificator:
            out.give_batch(done, list(counts.pop(done.time).items()))

    return logic


def reduce_logic(reduce: Callable[[Any, Any], Any]) -> NotifyLogic:
    """Notify logic folding the values of ``(key, value)`` pairs per key, emitted once each time is
    complete; the values of a time are folded in their arrival order, which is not defined."""
    state: dict[Any, dict] = {}

    def logic(inp: OperatorInput, out: OperatorOutput, notificator: Notificator) -> None:
        for cap, batch in inp:
            acc = state.get(cap.time)
            if acc is None:
                acc = state[cap.time] = {}
                notificator.notify_at(cap.retain())
            for k, v in batch:
                acc[k] = reduce(acc[k], v) if k in acc else v
        for done in notificator:
            out.give_batch(done, list(state.pop(done.time).items()))

    return logic
