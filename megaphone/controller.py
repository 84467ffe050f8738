"""The migration controller: issue the steps of a plan over the control input, one at a time.

A step is issued at the control input's current time ``t``; it is complete once the probe on the
migratable operator's output has passed ``t`` (``not probe.less_equal(t)``): the moved bins were
installed on their new owners *and* every record up to ``t`` was applied, so the backlog queued
behind the step has drained before the next step starts (ARCHITECTURE.md 5.6, the paper's "gap").

Driving it
----------
Only the worker that sends on the control input (worker 0) has a :class:`Controller`; it calls
:meth:`Controller.tick` once per iteration of its driver loop, *after* advancing its inputs, so a
step goes out at the newest control time. Every other worker creates the same :class:`ControlInput`
and simply advances it with its data input (it never sends on it), best one time ahead: a step
at the control's time ``t`` then has its table final, and its bins leave, while the data before
``t`` are still being processed, instead of one round of messages after them (README, "Control
one time ahead of the data")::

    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=8)
        counts = megaphone.state_machine(data.stream, control, 0, fold)
    controller = megaphone.Controller(control, counts.probe) if worker.index == 0 else None
    if controller:
        controller.rebalance(megaphone.skewed(controller.current_table), "batched")
    for epoch in range(rounds):
        data.send_batch(records(epoch))
        data.advance_to(epoch + 1)
        control.advance_to(epoch + 2)        # every worker: control one time ahead of the data
        if controller:
            controller.tick()                # worker 0 only: maybe issue the next step
        worker.step_while(lambda: counts.probe.less_than(epoch - lag))

The controller knows nothing of sockets: :class:`megaphone.endpoint.ControlEndpoint` registers a
poller (:meth:`Controller.add_poller`) to answer outside requests from :meth:`Controller.tick`.
"""
from __future__ import annotations

import time as _time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from .plan import Step, plan, prepare
from .table import Table, TableError, apply, balanced, move_updates, validate_move, validate_table

#: The default of :class:`Controller`'s ``max_events``: the steps its :attr:`~Controller.events` log
#: keeps, in whole migrations, the newest (beyond it: the newest migration and every unfinished one).
MAX_EVENTS = 10_000
#: The default of :class:`Controller`'s ``max_moves``: the moves the steps in that log may hold in
#: all (a step keeps its ``{bin: worker}`` moves, some 70 bytes each: at 2^16 bins a log of
#: whole-table migrations would otherwise hold gigabytes), with the same exceptions.
MAX_MOVES = 1_000_000


def _steps(steps: Any) -> list:
    """:meth:`Controller.start`'s ``steps`` as a list, once checked that they are a sequence (of
    steps), not one step's mapping or a string; raises :class:`TableError`."""
    if isinstance(steps, (Mapping, str, bytes)) or not isinstance(steps, Iterable):
        raise TableError(f"steps must be a sequence of steps ({{bin: worker}} mappings or lists of (bin, worker) "
                         f"pairs), not {type(steps).__name__} {steps!r:.60}")
    return list(steps)


class Control(Protocol):
    """What the controller needs of the control input (a :class:`~megaphone.control.ControlInput`)."""

    nbins: int
    peers: int

    @property
    def time(self) -> Any:
        """The control input's current time: a step issued now takes effect at it."""

    @property
    def closed(self) -> bool:
        """True once the control input is closed: no more steps can be issued."""

    def moves(self, assignment: Mapping[int, int]) -> None:
        """Move bins at the current time (``{bin: worker}``)."""

    def precopy(self, assignment: Mapping[int, int]) -> None:
        """Start copying bins ahead of a later move (``{bin: worker}``); the table does not change."""


class Probe(Protocol):
    """What the controller needs of the probe on the migratable output (a ``timely.ProbeHandle``)."""

    def less_equal(self, time: Any) -> bool:
        """True while the probed output may still produce records at or before ``time``."""


@dataclass
class StepEvent:
    """One migration step: what moved, when it was issued and when it completed."""

    migration: int  # the migration (a start()/rebalance() call) this step belongs to
    index: int  # position of the step within its migration, from 0
    steps: int  # number of steps of that migration
    moves: Step  # {bin: worker}
    issue_time: Any = None  # logical (control input) time at which the step was issued (the hand-over)
    issued_at: float | None = None  # wall clock (time.time()) when issued
    completed_at: float | None = None  # wall clock when the probe passed issue_time
    duration: float | None = None  # seconds from issue to completion (monotonic clock)
    precopy: bool = False  # the bins are copied ahead, then handed over (megaphone.precopy)
    copy_time: Any = None  # logical time at which the copy ahead was requested
    copy_at: float | None = None  # wall clock (time.time()) when the copy ahead was requested
    copy_seconds: float | None = None  # seconds from the copy request to the hand-over
    abandoned: bool = False  # never issued: the control input closed first
    _issued_mono: float | None = field(default=None, repr=False)
    _copy_mono: float | None = field(default=None, repr=False)

    @property
    def bins(self) -> list[int]:
        """The bins moved by this step, ascending."""
        return sorted(self.moves)

    @property
    def state(self) -> str:
        """``"queued"``, ``"copying"`` (ahead of the hand-over), ``"in_flight"``, ``"completed"`` or
        ``"abandoned"`` (the control input closed before it was issued)."""
        if self.abandoned:
            return "abandoned"
        if self.issued_at is None:
            return "copying" if self.copy_time is not None else "queued"
        return "in_flight" if self.completed_at is None else "completed"

    def as_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly dict (moves as ``[[bin, worker], ...]``)."""
        d = asdict(self)
        del d["_issued_mono"], d["_copy_mono"]
        d["moves"] = [[b, w] for b, w in sorted(self.moves.items())]
        d["bins"] = self.bins
        d["state"] = self.state
        if self.state == "in_flight" and self._issued_mono is not None:
            d["elapsed"] = _time.monotonic() - self._issued_mono
        return d


class Controller:
    """Issues migration steps over ``control`` as ``probe`` (on the migratable output) allows.

    ``table`` is the routing table in force when the controller starts (default: the one every
    migratable operator on ``control`` starts from, ``control.initial``: in a job started from a
    checkpoint, the table the operators restored, so create the controller after building them).
    The controller tracks the table from then on; it
    assumes it is the only sender on the control input. ``on_progress(event, what)`` is called with
    ``what`` = ``"copying"`` (a copy ahead requested), ``"issued"``, ``"completed"`` or ``"abandoned"``
    (never issued: the control input closed first) for every step. Completion is noticed by
    :meth:`tick`, so durations have the resolution of the driver loop.

    ``control`` is a :class:`~megaphone.control.ControlInput` and ``probe`` a ``Migratable.probe``
    (or test doubles: see :class:`Control` and :class:`Probe`). ``copied`` (default:
    ``control.copied``, the copies of every operator on the control input) enables pre-copied
    migrations (``precopy=True``): each step first copies its bins ahead
    (:meth:`ControlInput.precopy <megaphone.ControlInput.precopy>`), and is issued (handed over)
    once ``copied`` has passed the copy's time and the previous step has completed (``what`` =
    ``"copying"`` before ``"issued"``). The copies are pipelined: the next step's copy runs while
    the current step hands over.

    :attr:`events` is a bounded log (a ``deque``) of whole migrations: the newest, up to
    ``max_events`` steps (default :data:`MAX_EVENTS`) and ``max_moves`` moves (default
    :data:`MAX_MOVES`) in all (``None``: no such bound), and beyond those bounds still the newest
    migration, the one whose step completed last (its follower's next poll finds its last step),
    and every one with a step queued, copying or in flight. Older migrations leave it whole, oldest
    first, so what it has of a migration (the control endpoint's ``status``, which says
    ``trimmed`` for one it no longer holds) is all of it or nothing. The totals
    (:attr:`steps_completed`, :attr:`step_seconds`) count every step since the start, whatever the
    log still holds.
    """

    def __init__(self, control: Control, probe: Probe, table: Sequence[int] | None = None,
                 on_progress: Callable[[StepEvent, str], None] | None = None, copied: Probe | None = None,
                 max_events: int | None = MAX_EVENTS, max_moves: int | None = MAX_MOVES) -> None:
        self.control = control
        self.probe = probe
        self.copied = copied if copied is not None else getattr(control, "copied", None)
        prepare()  # the planner's import now, not in the middle of the first migration
        self.nbins: int = control.nbins
        self.peers: int = control.peers
        if table is None:  # the table the operators start from (spare workers: megaphone.ControlInput)
            table = getattr(control, "initial", None) or balanced(self.nbins, self.peers)
        initial = table
        initial = validate_table(initial, self.nbins, self.peers, "initial")
        self._issued_table: Table = initial  # after every issued step
        self._planned_table: Table = initial  # after every queued step
        self.on_progress = on_progress
        for name, bound in (("max_events", max_events), ("max_moves", max_moves)):
            if bound is not None and bound < 0:
                raise ValueError(f"{name} must be >= 0 or None, not {bound}")
        self.max_events, self.max_moves = max_events, max_moves
        # The steps started, in order, of the newest migrations (see the class documentation).
        self.events: deque[StepEvent] = deque()
        self._logged_moves = 0  # the moves of the steps in it
        self._steps_completed = 0  # every step completed since the start (the log may hold fewer)
        self._step_seconds = 0.0  # their durations, summed
        self._last_step_seconds: float | None = None  # the latest completed step's
        self._last_done: int | None = None  # the migration of the latest completed step
        self._queue: deque[StepEvent] = deque()
        self._in_flight: StepEvent | None = None  # issued, not yet complete
        self._ahead: StepEvent | None = None  # its bins are being copied ahead (the next to issue)
        self._migrations = 0
        #: The newest migrations that had nothing to move (the target was the planned table).
        self.empty_migrations: deque[int] = deque(maxlen=1024)
        self._pollers: list[Callable[[], object]] = []
        #: The :class:`~megaphone.AutoBalancer` the launcher's ``--autobalance`` started on this
        #: controller, if any (the dashboard and the metrics are connected too).
        self.balancer: Any = None
        worker = getattr(control, "worker", None)
        if worker is not None:
            from .autobalance import attach  # (it imports this module)

            self.balancer = attach(self, worker)

    # -- queuing ------------------------------------------------------------------------------
    def start(self, steps: Sequence[Mapping[int, int] | Iterable[tuple[int, int]]], precopy: bool = False) -> int:
        """Queue ``steps`` (a sequence of ``{bin: worker}`` mappings, or of lists of ``(bin, worker)``
        pairs) as one migration; return its id. ``precopy``: copy each step's bins ahead, then hand
        them over (needs ``copied``; bins that are small or not dicts of rows move whole:
        :mod:`megaphone.precopy`).

        Every step and move is validated first (a mapping or list of pairs, bin and worker exist, a
        bin moved to one worker per step); on error (a :class:`~megaphone.table.TableError` naming
        the step) nothing is queued. Empty steps are dropped.
        """
        if precopy and self.copied is None:
            raise ValueError("a pre-copied migration needs the controller's copied probe "
                             "(Controller(..., copied=migratable.copied))")
        if self.control.closed:
            raise TableError("the control input is closed: no migration can be issued any more")
        checked = [moves for i, step in enumerate(_steps(steps)) if (moves := self._checked_step(i, step))]
        mid = self._migrations
        self._migrations += 1
        if not checked:
            self.empty_migrations.append(mid)  # (status: done, not "trimmed")
        if not self.events:
            self._logged_moves = 0  # (a reader may have emptied the log)
        for i, moves in enumerate(checked):
            ev = StepEvent(migration=mid, index=i, steps=len(checked), moves=moves, precopy=precopy)
            self.events.append(ev)
            self._logged_moves += len(moves)
            self._queue.append(ev)
            self._planned_table = apply(self._planned_table, move_updates(moves))
        self._trim()
        return mid

    def _checked_step(self, i: int, step: Any) -> Step:
        """Step ``i`` of :meth:`start` as ``{bin: worker}`` of ints, once checked; raises :class:`TableError`."""
        if isinstance(step, Mapping):
            pairs: Any = step.items()
        elif isinstance(step, (str, bytes)) or not isinstance(step, Iterable):
            raise TableError(f"step {i}: expected a {{bin: worker}} mapping or a list of (bin, worker) pairs, "
                             f"not {type(step).__name__} {step!r:.60}")
        else:
            pairs = step
        moves: Step = {}
        for pair in pairs:
            sequence = isinstance(pair, Sequence) or getattr(pair, "ndim", None) == 1  # (a numpy row too)
            if isinstance(pair, (str, bytes)) or not sequence or len(pair) != 2:
                raise TableError(f"step {i}: move {pair!r:.60} is not a (bin, worker) pair")
            try:
                b, w = validate_move(pair[0], pair[1], self.nbins, self.peers)  # numpy integers become ints
            except TableError as e:
                raise TableError(f"step {i}: {e}") from None
            # One worker per bin and step (as ControlInput.moves and the control endpoint ask): of
            # two, neither is "the" move. The same move twice is harmless.
            if moves.get(b, w) != w:
                raise TableError(f"step {i}: bin {b} is moved to both worker {moves[b]} and worker {w}")
            moves[b] = w
        return moves

    def rebalance(self, target: Sequence[int], strategy: str = "batched", precopy: bool = False) -> int:
        """Plan a migration from the planned table (after queued steps) to ``target``; queue it
        (``precopy``: see :meth:`start`).

        Raises :class:`~megaphone.table.TableError` for a target that is not a table of this
        controller's bins and workers, :class:`ValueError` for an unknown strategy.
        """
        target = validate_table(target, self.nbins, self.peers, "target")
        return self.start(plan(self._planned_table, target, strategy, peers=self.peers), precopy)

    # -- driving ------------------------------------------------------------------------------
    def add_poller(self, poll: Callable[[], object]) -> None:
        """Call ``poll()`` at the start of every :meth:`tick` (a control endpoint answers requests)."""
        self._pollers.append(poll)

    def tick(self) -> bool:
        """Run the pollers, note a completed step, copy the next one ahead and issue the next one if
        allowed; True if a step was issued or its copy requested.

        Call once per driver iteration on the worker owning the control input, after advancing it.
        """
        for poll in self._pollers:
            poll()
        ev = self._in_flight
        if ev is not None and not self.probe.less_equal(ev.issue_time):
            ev.completed_at = _time.time()
            ev.duration = _time.monotonic() - (ev._issued_mono or 0.0)
            self._in_flight = None
            self._steps_completed += 1
            self._step_seconds += ev.duration
            self._last_step_seconds = ev.duration
            self._last_done = ev.migration
            self._trim()
            self._notify(ev, "completed")
        if self.control.closed:
            # No step can be issued any more: the ones not issued are abandoned (so `busy` ends:
            # a driver looping `while controller.busy` would spin for ever).
            for ev in ([self._ahead] if self._ahead is not None else []) + list(self._queue):
                ev.abandoned = True
                self._notify(ev, "abandoned")
            self._ahead = None
            self._queue.clear()
            # Their moves will never happen: the planned table is the issued one (invariant: the
            # planned table is the issued table plus the moves of the steps not yet issued).
            self._planned_table = self._issued_table
            return False
        did = False
        queue = self._queue
        current = self._in_flight
        if (self._ahead is None and queue and queue[0].precopy
                and (current is None or not queue[0].moves.keys() & current.moves.keys())):
            # Pipelined: the next step's bins are copied while the current step hands over (one
            # copy ahead at a time, requested just before it is needed: the deltas stay small;
            # copying every step's bins at once made the hand-overs ship what changed meanwhile).
            # Not a bin the current step still moves: its new owner may not have installed it.
            ev = queue.popleft()
            try:
                self.control.precopy(ev.moves)
            except BaseException:
                queue.appendleft(ev)  # refused (a conflicting request at this time): the step stays queued
                raise
            self._ahead = ev
            ev.copy_time, ev.copy_at, ev._copy_mono = self.control.time, _time.time(), _time.monotonic()
            self._notify(ev, "copying")
            did = True
        if self._in_flight is not None:
            return did  # the previous step (or the backlog behind it) is not done yet
        ev = self._ahead
        ahead = ev is not None
        if ev is not None:
            assert self.copied is not None
            if self.copied.less_equal(ev.copy_time):
                return did  # its copy is not staged yet
            ev.copy_seconds = _time.monotonic() - (ev._copy_mono or 0.0)
            self._ahead = None
        elif queue:
            ev = queue.popleft()
        else:
            return did
        try:
            self._issue(ev)
        except BaseException:
            # Refused (a move of the same bin to another worker sent by hand at this control time):
            # the step is not lost; the next tick issues it again, at a later time.
            if ahead:
                self._ahead = ev
            else:
                queue.appendleft(ev)
            raise
        return True

    def _issue(self, ev: StepEvent) -> None:
        """Send the step's moves at the control input's current time (a hand-over, after a copy)."""
        self.control.moves(ev.moves)
        ev.issue_time = self.control.time
        ev.issued_at = _time.time()
        ev._issued_mono = _time.monotonic()
        self._in_flight = ev
        self._issued_table = apply(self._issued_table, move_updates(ev.moves))
        self._notify(ev, "issued")

    def _trim(self) -> None:
        """Beyond ``max_events`` steps or ``max_moves`` moves, drop the oldest migrations from the
        log, each whole (its steps lie together: :meth:`start` appends them at once), but not the
        newest, not the one whose step completed last, and not one still running: the steps run in
        the order they were started (one queue, one step in flight), so a migration older than the
        oldest unfinished step's is finished. A client following a migration (``python -m
        megaphone.rebalance``: the endpoint's ``status`` with ``since``) thus sees every step of it,
        also of one longer than the bounds, unless two newer migrations finished before its next
        poll (``status`` then says ``trimmed``)."""
        events = self.events

        def over() -> bool:
            return ((self.max_events is not None and len(events) > self.max_events)
                    or (self.max_moves is not None and self._logged_moves > self.max_moves))

        if not over():
            return
        pending = [e for e in (self._in_flight, self._ahead, self._queue[0] if self._queue else None) if e is not None]
        keep = min((e.migration for e in pending), default=self._migrations - 1)
        if self._last_done is not None:  # and the one that finished last: its follower's last poll finds it
            keep = min(keep, self._last_done)
        while events and events[0].migration < keep and over():
            oldest = events[0].migration
            while events and events[0].migration == oldest:
                self._logged_moves -= len(events.popleft().moves)

    def _notify(self, ev: StepEvent, what: str) -> None:
        if self.on_progress is not None:
            self.on_progress(ev, what)

    # -- observing ----------------------------------------------------------------------------
    @property
    def migrations(self) -> int:
        """The number of migrations started so far (ids are ``0 .. migrations - 1``)."""
        return self._migrations

    @property
    def busy(self) -> bool:
        """True while a step is queued or in flight."""
        return self._in_flight is not None or self._ahead is not None or bool(self._queue)

    @property
    def current_table(self) -> Table:
        """The routing table after every step issued so far."""
        return self._issued_table

    @property
    def planned_table(self) -> Table:
        """The routing table once every queued step has been issued."""
        return self._planned_table

    @property
    def in_flight(self) -> StepEvent | None:
        """The step issued and not yet complete, if any; else the step being copied ahead, if any."""
        return self._in_flight if self._in_flight is not None else self._ahead

    @property
    def completed(self) -> list[StepEvent]:
        """The completed steps the log still holds (:attr:`events`), in order."""
        return [e for e in self.events if e.completed_at is not None]

    @property
    def steps_completed(self) -> int:
        """The number of steps completed since the start (also those the log no longer holds)."""
        return self._steps_completed

    @property
    def step_seconds(self) -> float:
        """The seconds of every step completed since the start, summed (issue to completion)."""
        return self._step_seconds

    @property
    def last_step_seconds(self) -> float | None:
        """The seconds the latest completed step took (None before the first)."""
        return self._last_step_seconds

    @property
    def steps_queued(self) -> int:
        """The number of steps queued (not yet copying ahead or issued)."""
        return len(self._queue)
