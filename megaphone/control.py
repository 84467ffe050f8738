"""The control stream: timestamped configuration updates that say which worker owns which bin.

A configuration update at time ``t`` says: from ``t`` on, bin ``b`` lives on worker ``w``
(ARCHITECTURE.md section 5.1). Updates are ordinary records of a timely input, broadcast to every worker by
the migratable operators, so the progress protocol orders migrations with the data: no locks, no
pause, no side channel. The records and their validation are those of :mod:`megaphone.table`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import timely

from .table import move_updates, validate_k, validate_update


class ControlInput:
    """A validating wrapper around the control input handle of ``2**k`` bins.

    Every worker creates one (and advances it in step with its data input); usually only one worker
    (worker 0) sends updates. Invalid updates raise :class:`~megaphone.table.TableError` before
    anything enters the dataflow, so a bad request never damages running state.
    """

    def __init__(self, scope: timely.Scope, k: int = 8, name: str = "Control") -> None:
        self.k = validate_k(k)
        self.nbins = 1 << k
        self.peers = scope.peers
        self.handle = scope.new_input(name)
        self.stream = self.handle.stream

    @property
    def time(self) -> Any:
        """The control input's current time."""
        return self.handle.time

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: no more updates can be sent."""
        return bool(self.handle.closed)

    def move(self, bin: int, worker: int) -> None:
        """From the current time on, ``bin`` lives on ``worker``."""
        self.moves({bin: worker})

    def moves(self, assignment: Mapping[int, int]) -> None:
        """Several moves at the current time (``{bin: worker}``), validated together first."""
        updates = move_updates(assignment)
        for u in updates:
            validate_update(u, self.nbins, self.peers)
        self.handle.send_batch(updates)

    def install(self, table: Sequence[int]) -> None:
        """From the current time on, use the routing ``table`` (one worker per bin)."""
        u = ("table", tuple(table))
        validate_update(u, self.nbins, self.peers)
        self.handle.send(u)

    def advance_to(self, time: Any) -> None:
        """Advance the control input (keep it in step with the data input)."""
        self.handle.advance_to(time)

    def close(self) -> None:
        """No more configuration updates."""
        self.handle.close()
