"""The control stream: timestamped configuration updates that say which worker owns which bin.

A configuration update at time ``t`` says: from ``t`` on, bin ``b`` lives on worker ``w``
(DESIGN.md section 5.1). Updates are ordinary records of a timely input, broadcast to every worker by
the migratable operators, so the progress protocol orders migrations with the data: no locks, no
pause, no side channel.

Records on the control stream:

* ``("move", bin, worker)``: move one bin;
* ``("table", (w_0, ..., w_{B-1}))``: install a whole routing table (one worker per bin).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import timely


class ControlError(ValueError):
    """A configuration update that cannot be applied (unknown worker or bin, malformed table)."""


def default_table(bins: int, peers: int) -> tuple[int, ...]:
    """The initial routing table: bins dealt round robin to workers (bin ``b`` on ``b % peers``)."""
    return tuple(b % peers for b in range(bins))


def check_update(update: Any, bins: int, peers: int) -> None:
    """Raise :class:`ControlError` unless ``update`` is a valid control record."""
    if not isinstance(update, (tuple, list)) or not update:
        raise ControlError(f"control record {update!r} is not a ('move', bin, worker) or ('table', map) tuple")
    kind = update[0]
    if kind == "move":
        if len(update) != 3:
            raise ControlError(f"control record {update!r}: expected ('move', bin, worker)")
        _, b, w = update
        if not (isinstance(b, int) and 0 <= b < bins):
            raise ControlError(f"control record {update!r}: bin {b!r} does not exist (there are {bins} bins)")
        if not (isinstance(w, int) and 0 <= w < peers):
            raise ControlError(f"control record {update!r}: worker {w!r} does not exist (there are {peers} workers)")
    elif kind == "table":
        if len(update) != 2 or not isinstance(update[1], (tuple, list)):
            raise ControlError(f"control record {update!r:.200}: expected ('table', (worker per bin...))")
        table = update[1]
        if len(table) != bins:
            raise ControlError(f"routing table has {len(table)} entries, expected one per bin ({bins})")
        for b, w in enumerate(table):
            if not (isinstance(w, int) and 0 <= w < peers):
                raise ControlError(f"routing table maps bin {b} to worker {w!r}, which does not exist ({peers} workers)")
    else:
        raise ControlError(f"control record {update!r:.200}: unknown kind {kind!r} (expected 'move' or 'table')")


def apply_updates(table: Sequence[int], updates: Sequence[Any]) -> tuple[int, ...]:
    """The routing table after applying ``updates`` in order to ``table``."""
    new = list(table)
    for u in updates:
        if u[0] == "move":
            new[u[1]] = u[2]
        else:
            new = list(u[1])
    return tuple(new)


class ControlInput:
    """A validating wrapper around the control input handle.

    Every worker creates one (and advances it in step with its data input); usually only one worker
    (worker 0) sends updates. Invalid updates raise :class:`ControlError` before anything enters
    the dataflow, so a bad request never damages running state.
    """

    def __init__(self, scope: timely.Scope, bins: int = 8, name: str = "Control") -> None:
        if not 0 <= bins <= 16:
            raise ValueError(f"bins is the exponent k of 2^k bins, between 0 and 16, not {bins}")
        self.k = bins
        self.bins = 1 << bins
        self.peers = scope.peers
        self.handle = scope.new_input(name)
        self.stream = self.handle.stream

    @property
    def time(self) -> Any:
        """The control input's current time."""
        return self.handle.time

    def move(self, bin: int, worker: int) -> None:
        """From the current time on, ``bin`` lives on ``worker``."""
        u = ("move", bin, worker)
        check_update(u, self.bins, self.peers)
        self.handle.send(u)

    def moves(self, assignment: Mapping[int, int]) -> None:
        """Several moves at the current time (``{bin: worker}``), validated together first."""
        updates = [("move", b, w) for b, w in sorted(assignment.items())]
        for u in updates:
            check_update(u, self.bins, self.peers)
        self.handle.send_batch(updates)

    def install(self, table: Sequence[int]) -> None:
        """From the current time on, use the routing ``table`` (one worker per bin)."""
        u = ("table", tuple(table))
        check_update(u, self.bins, self.peers)
        self.handle.send(u)

    def advance_to(self, time: Any) -> None:
        """Advance the control input (keep it in step with the data input)."""
        self.handle.advance_to(time)

    def close(self) -> None:
        """No more configuration updates."""
        self.handle.close()
