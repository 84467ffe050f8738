"""The control stream: timestamped configuration updates that say which worker owns which bin.

A configuration update at time ``t`` says: from ``t`` on, bin ``b`` lives on worker ``w``
(ARCHITECTURE.md section 5.1). Updates are ordinary records of a timely input, broadcast to every
worker by the migratable operators, so the progress protocol orders migrations with the data: no
locks, no pause, no side channel. The updates of one time are applied in a canonical order,
whatever order they arrive in (:func:`megaphone.table.canonical`); :class:`ControlInput` refuses
those whose effect would depend on their order. The records and their validation are those of
:mod:`megaphone.table`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import timely

from .table import TableError, balanced, move_updates, validate_k, validate_move, validate_table


class ControlInput:
    """A validating wrapper around the control input handle of ``2**k`` bins.

    Every worker creates one (and advances it with its data input, one time ahead); usually only one worker
    (worker 0) sends updates. Invalid updates raise :class:`~megaphone.table.TableError`, naming
    the input (``name``) and the call, before anything enters the dataflow, so a bad request never
    damages running state. Bins and workers may be numpy integers; they are sent as ``int``.
    """

    def __init__(self, scope: timely.Scope, k: int = 8, name: str = "Control", workers: int | None = None) -> None:
        self.name = name
        self.k = validate_k(k)
        self.nbins = 1 << k
        self.peers = scope.peers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                    or not 1 <= workers <= self.peers):
            raise TableError(f"control input '{name}': workers must be an integer from 1 to {self.peers} "
                             f"(the job's workers), not {workers!r}")
        #: The table the migratable operators on this input start from: the bins spread over the first
        #: ``workers`` workers (default: all); the others are *spare*, holding no bin until a migration
        #: moves bins onto them (scale-out within a running job). In a job started from a checkpoint,
        #: the operators' restored table once they are built (:mod:`megaphone.checkpoint`).
        self.initial = balanced(self.nbins, self.peers if workers is None else workers)
        #: The operator whose restore from a checkpoint set :attr:`initial` to the restored routing
        #: table (the same on every worker), if any; the other operators on this input must agree.
        self.restored_by: str | None = None
        self.handle = scope.new_input(name)
        self.stream = self.handle.stream
        #: The job secret of the worker that built this input (:attr:`timely.Worker.secret`): the
        #: default of a :class:`~megaphone.endpoint.ControlEndpoint` serving its controller.
        self.secret = getattr(scope.worker, "secret", None)
        #: The worker that built this input: a :class:`~megaphone.Controller` on it connects to the
        #: launcher's ``--dashboard``, ``--autobalance`` and metrics (:func:`megaphone.autobalance.attach`).
        self.worker = scope.worker
        self._sent: tuple[Any, tuple | None, dict[int, int]] = (None, None, {})  # (time, table, moves) sent then
        self._copied: list[timely.ProbeHandle] = []  # Migratable.copied of every operator on this input

    @property
    def time(self) -> Any:
        """The control input's current time."""
        return self.handle.time

    @property
    def copied(self) -> CopiedProbe:
        """The copies ahead of every migratable operator built on this input (their
        ``Migratable.copied`` together): ``less_equal(t)`` while one of them has a copy requested at
        or before ``t`` not yet staged (:mod:`megaphone.precopy`)."""
        return CopiedProbe(self._copied)

    def attach(self, copied: timely.ProbeHandle) -> None:
        """Called by each migratable operator built on this input with its ``copied`` probe."""
        self._copied.append(copied)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: no more updates can be sent."""
        return bool(self.handle.closed)

    def move(self, bin: int, worker: int) -> None:
        """From the current time on, ``bin`` lives on ``worker`` (integers: ``int`` or numpy's)."""
        self._moves({bin: worker}, "move")

    def moves(self, assignment: Mapping[int, int]) -> None:
        """Several moves at the current time (``{bin: worker}``), validated together first."""
        self._moves(assignment, "moves")

    def _moves(self, assignment: Mapping[int, int], method: str) -> None:
        with self._naming(method):
            checked = self._checked(assignment)
            self._check_open()  # before anything is recorded
            self._record(None, checked)
        self.handle.send_batch(move_updates(checked))

    def precopy(self, assignment: Mapping[int, int]) -> None:
        """Start copying bins ahead of a later move (``{bin: worker}``, :mod:`megaphone.precopy`):
        the routing table does not change; a move of a bin to the worker it was copied to, once
        :attr:`Migratable.copied <megaphone.Migratable.copied>` has passed this time, ships only
        what changed since."""
        with self._naming("precopy"):
            checked = self._checked(assignment)
        self.handle.send_batch([("precopy", b, w) for b, w in sorted(checked.items())])

    def replicate(self, assignment: Mapping[int, int]) -> None:
        """Keep a standby replica of each bin on a worker (``{bin: worker}``, :mod:`megaphone.precopy`):
        the owner copies the bin there as :meth:`precopy` does, then refreshes the copy with the
        changed keys every ``megaphone.precopy.REFRESH`` seconds; a move of the bin to that worker
        ships only what changed since the last staged refresh, with no copy ahead first. The
        replica ends when its bin moves (to it or elsewhere), or when a copy or replica of the bin
        is asked for on another worker."""
        with self._naming("replicate"):
            checked = self._checked(assignment)
        self.handle.send_batch([("replica", b, w) for b, w in sorted(checked.items())])

    def install(self, table: Sequence[int]) -> None:
        """From the current time on, use the routing ``table``: a sequence of ``2**k`` worker
        indices, one per bin."""
        with self._naming("install"):
            checked = validate_table(table, self.nbins, self.peers)
            self._check_open()  # before anything is recorded
            self._record(checked, {})
        self.handle.send(("table", checked))

    def _checked(self, assignment: Any) -> dict[int, int]:
        """``assignment`` as ``{bin: worker}`` of ints, once checked; raises :class:`TableError`."""
        if not isinstance(assignment, Mapping):
            raise TableError(f"expected a {{bin: worker}} mapping, not {type(assignment).__name__} {assignment!r:.60}")
        return dict(validate_move(b, w, self.nbins, self.peers) for b, w in assignment.items())

    def _check_open(self) -> None:
        """Raise :class:`timely.InputError` if the control input is closed."""
        if self.handle.closed:
            raise timely.InputError(f"control input '{self.name}' is closed")

    @contextlib.contextmanager
    def _naming(self, method: str) -> Iterator[None]:
        """Prefix the :class:`TableError` raised in the block with this input's name and ``method``."""
        try:
            yield
        except TableError as e:
            raise TableError(f"control input '{self.name}', {method}(): {e}") from None

    def _record(self, table: tuple | None, moves: dict[int, int]) -> None:
        """Note updates about to be sent at the current time; raise :class:`TableError` (sending
        nothing) if their effect would depend on their order: the updates of one time are applied
        in a canonical order, tables before moves (:func:`megaphone.table.canonical`), so a time
        takes at most one table, before any move, and moves each bin to one worker."""
        time, sent_table, sent_moves = self._sent
        if time != self.time:
            sent_table, sent_moves = None, {}
        if table is not None and (sent_moves or sent_table not in (None, table)):
            raise TableError(f"a routing table at time {self.time!r} must be the first and only one of its time")
        for b, w in moves.items():
            if sent_moves.get(b, w) != w:
                raise TableError(f"bin {b} was already moved to worker {sent_moves[b]} at time {self.time!r}")
        self._sent = (self.time, table if table is not None else sent_table, {**sent_moves, **moves})

    def advance_to(self, time: Any) -> None:
        """Advance the control input: with the data input, best one time ahead of it (a step
        issued now then takes effect at the next time, and its bins leave while the current time's
        data are processed: README, "Control one time ahead of the data")."""
        self.handle.advance_to(time)

    def close(self) -> None:
        """No more configuration updates."""
        self.handle.close()


class CopiedProbe:
    """Several ``Migratable.copied`` probes as one (:attr:`ControlInput.copied`)."""

    def __init__(self, probes: Sequence[timely.ProbeHandle]) -> None:
        self.probes = probes

    def less_equal(self, time: Any) -> bool:
        """True while some copy requested at or before ``time`` is not staged yet."""
        return any(p.less_equal(time) for p in self.probes)
