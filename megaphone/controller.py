"""The migration controller: issue the steps of a plan over the control input, one at a time.

A step is issued at the control input's current time ``t``; it is complete once the probe on the
migratable operator's output has passed ``t`` (``not probe.less_equal(t)``): the moved bins were
installed on their new owners *and* every record up to ``t`` was applied, so the backlog queued
behind the step has drained before the next step starts (DESIGN.md 5.6, the paper's "gap").

Driving it
----------
Only the worker that sends on the control input (worker 0) has a :class:`Controller`; it calls
:meth:`Controller.tick` once per iteration of its driver loop, *after* advancing its inputs, so a
step goes out at the newest control time. Every other worker creates the same :class:`ControlInput`
and simply advances it in step with its data input (it never sends on it)::

    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, bins=8)
        counts = megaphone.state_machine(data.stream, control, 0, fold)
    controller = megaphone.Controller(control, counts.probe) if worker.index == 0 else None
    if controller:
        controller.rebalance(megaphone.skewed(controller.current_table), "batched")
    for epoch in range(rounds):
        data.send_batch(records(epoch))
        data.advance_to(epoch + 1)
        control.advance_to(epoch + 1)        # every worker: control in lockstep with data
        if controller:
            controller.tick()                # worker 0 only: maybe issue the next step
        worker.step_while(lambda: counts.probe.less_than(epoch - lag))

:class:`ControlEndpoint` lets a running job be rebalanced from outside (``python -m
megaphone.rebalance``): a ZeroMQ ROUTER socket polled without blocking from :meth:`Controller.tick`.
"""
from __future__ import annotations

import json
import time as _time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from .control import default_table
from .plan import STRATEGIES, balanced, check_table, plan

if TYPE_CHECKING:
    from timely import ProbeHandle

    from .control import ControlInput

Step = dict[int, int]


@dataclass
class StepEvent:
    """One migration step: what moved, when it was issued and when it completed."""

    migration: int  # the migration (a start()/rebalance() call) this step belongs to
    index: int  # position of the step within its migration, from 0
    steps: int  # number of steps of that migration
    moves: Step  # {bin: worker}
    issue_time: Any = None  # logical (control input) time at which the step was issued
    issued_at: float | None = None  # wall clock (time.time()) when issued
    completed_at: float | None = None  # wall clock when the probe passed issue_time
    duration: float | None = None  # seconds from issue to completion (monotonic clock)
    _issued_mono: float | None = field(default=None, repr=False)

    @property
    def bins(self) -> list[int]:
        """The bins moved by this step, ascending."""
        return sorted(self.moves)

    @property
    def state(self) -> str:
        """``"queued"``, ``"in_flight"`` or ``"completed"``."""
        if self.issued_at is None:
            return "queued"
        return "in_flight" if self.completed_at is None else "completed"

    def as_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly dict (moves as ``[[bin, worker], ...]``)."""
        d = asdict(self)
        del d["_issued_mono"]
        d["moves"] = [[b, w] for b, w in sorted(self.moves.items())]
        d["bins"] = self.bins
        d["state"] = self.state
        if self.state == "in_flight" and self._issued_mono is not None:
            d["elapsed"] = _time.monotonic() - self._issued_mono
        return d


class Controller:
    """Issues migration steps over ``control`` as ``probe`` (on the migratable output) allows.

    ``table`` is the routing table in force when the controller starts (default: the control
    input's round-robin default table). The controller tracks the table from then on; it assumes it
    is the only sender on the control input. ``on_progress(event, what)`` is called with
    ``what`` = ``"issued"`` or ``"completed"`` for every step. Completion is noticed by
    :meth:`tick`, so durations have the resolution of the driver loop.

    ``control`` needs ``bins``, ``peers``, ``time`` and ``moves(dict)``; ``probe`` needs
    ``less_equal(t)`` (a :class:`ControlInput` and a ``Migratable.probe``, or test doubles).
    """

    def __init__(self, control: ControlInput, probe: ProbeHandle, table: Sequence[int] | None = None,
                 on_progress: Callable[[StepEvent, str], None] | None = None) -> None:
        self.control = control
        self.probe = probe
        self.bins: int = control.bins
        self.peers: int = control.peers
        initial = tuple(default_table(self.bins, self.peers) if table is None else table)
        if len(initial) != self.bins:
            raise ValueError(f"initial table has {len(initial)} entries, expected one per bin ({self.bins})")
        check_table(initial, "initial", self.peers)
        self._issued_table: tuple[int, ...] = initial  # after every issued step
        self._planned_table: tuple[int, ...] = initial  # after every queued step
        self.on_progress = on_progress
        self.events: list[StepEvent] = []  # every step ever started, in order
        self._queue: deque[StepEvent] = deque()
        self._in_flight: StepEvent | None = None
        self._migrations = 0
        self._pollers: list[Callable[[], None]] = []

    # -- queuing ------------------------------------------------------------------------------
    def start(self, steps: Sequence[Mapping[int, int]]) -> int:
        """Queue ``steps`` (``{bin: worker}`` dicts) as one migration; return its id.

        Every move is validated first (bin and worker exist); on error nothing is queued. Empty
        steps are dropped.
        """
        checked: list[Step] = []
        for i, step in enumerate(steps):
            moves: Step = {}
            for b, w in dict(step).items():
                if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.bins:
                    raise ValueError(f"step {i}: bin {b!r} does not exist (there are {self.bins} bins)")
                if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < self.peers:
                    raise ValueError(f"step {i}: worker {w!r} does not exist (there are {self.peers} workers)")
                moves[b] = w
            if moves:
                checked.append(moves)
        mid = self._migrations
        self._migrations += 1
        table = list(self._planned_table)
        for i, moves in enumerate(checked):
            ev = StepEvent(migration=mid, index=i, steps=len(checked), moves=moves)
            self.events.append(ev)
            self._queue.append(ev)
            for b, w in moves.items():
                table[b] = w
        self._planned_table = tuple(table)
        return mid

    def rebalance(self, target: Sequence[int], strategy: str = "batched") -> int:
        """Plan a migration from the planned table (after queued steps) to ``target``; queue it."""
        target = tuple(target)
        if len(target) != self.bins:
            raise ValueError(f"target table has {len(target)} entries, expected one per bin ({self.bins})")
        return self.start(plan(self._planned_table, target, strategy, peers=self.peers))

    # -- driving ------------------------------------------------------------------------------
    def add_poller(self, poll: Callable[[], None]) -> None:
        """Call ``poll()`` at the start of every :meth:`tick` (used by :class:`ControlEndpoint`)."""
        self._pollers.append(poll)

    def tick(self) -> bool:
        """Poll endpoints, note a completed step, issue the next one if allowed; True if issued.

        Call once per driver iteration on the worker owning the control input, after advancing it.
        """
        for poll in self._pollers:
            poll()
        ev = self._in_flight
        if ev is not None:
            if self.probe.less_equal(ev.issue_time):
                return False  # the previous step (or the backlog behind it) is not done yet
            ev.completed_at = _time.time()
            ev.duration = _time.monotonic() - (ev._issued_mono or 0.0)
            self._in_flight = None
            self._notify(ev, "completed")
        if not self._queue or getattr(getattr(self.control, "handle", None), "closed", False):
            return False
        ev = self._queue.popleft()
        self.control.moves(ev.moves)
        ev.issue_time = self.control.time
        ev.issued_at = _time.time()
        ev._issued_mono = _time.monotonic()
        self._in_flight = ev
        table = list(self._issued_table)
        for b, w in ev.moves.items():
            table[b] = w
        self._issued_table = tuple(table)
        self._notify(ev, "issued")
        return True

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
        return self._in_flight is not None or bool(self._queue)

    @property
    def current_table(self) -> tuple[int, ...]:
        """The routing table after every step issued so far."""
        return self._issued_table

    @property
    def planned_table(self) -> tuple[int, ...]:
        """The routing table once every queued step has been issued."""
        return self._planned_table

    @property
    def in_flight(self) -> StepEvent | None:
        """The step issued and not yet complete, if any."""
        return self._in_flight

    @property
    def queued(self) -> list[StepEvent]:
        """Steps not yet issued, in order."""
        return list(self._queue)

    @property
    def completed(self) -> list[StepEvent]:
        """Steps completed so far, in order."""
        return [e for e in self.events if e.completed_at is not None]

    def status(self, migration: int | None = None, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """A msgpack/JSON-friendly summary, of every step or of one ``migration``'s.

        ``completed`` lists completed steps from the ``since``-th on (in completion order, at most
        ``limit``; ``completed_count`` has the total), ``queued`` the first ``limit`` queued steps
        (``queued_count`` all of them); ``done`` is true once every step has completed.
        """
        evs = [e for e in self.events if migration is None or e.migration == migration]
        done = [e for e in evs if e.state == "completed"]
        queued = [e for e in evs if e.state == "queued"]
        return {
            "busy": self.busy,
            "migrations": self._migrations,
            "control_time": self.control.time,
            "steps": len(evs),
            "queued": [e.as_dict() for e in queued[:limit]],
            "queued_count": len(queued),
            "in_flight": [e.as_dict() for e in evs if e.state == "in_flight"],
            "completed": [e.as_dict() for e in done[since:since + limit]],
            "completed_count": len(done),
            "done": len(done) == len(evs),
        }


# -- the control endpoint ---------------------------------------------------------------------

class RequestError(ValueError):
    """A malformed control-endpoint request."""


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool):
        raise RequestError(f"{what} {x!r} is not an integer")
    if isinstance(x, str) and x.strip().lstrip("-").isdigit():
        return int(x)
    if not isinstance(x, int):
        raise RequestError(f"{what} {x!r} is not an integer")
    return x


class ControlEndpoint:
    """Answers requests about, and rebalance requests for, a running job's :class:`Controller`.

    Binds a ZeroMQ ROUTER socket at ``endpoint`` (``tcp://127.0.0.1:*`` picks a free port; the bound
    address is :attr:`endpoint`). It is polled without blocking from :meth:`Controller.tick`, so
    requests are answered between driver iterations and never stall the worker. Requests are msgpack
    maps, or JSON objects (a payload starting with ``{``); the reply uses the same encoding:

    * ``{"op": "table"}`` -> ``{"ok": true, "table": [...], "planned": [...], "bins", "peers"}``
      (plus ``"routing_table"``, the operator's compiled table, if ``routing_table=`` was given);
    * ``{"op": "status", "migration": id?, "since": n?, "limit": n?}`` -> ``{"ok": true, "busy",
      "queued", "in_flight", "completed", "done", ...}`` with per-step bins, times and durations
      (see :meth:`Controller.status`);
    * ``{"op": "rebalance", "strategy": "batched", "table": [...] | "balanced": true |
      "moves": [[bin, worker], ...] or {bin: worker}}`` -> ``{"ok": true, "migration": id,
      "steps": n, "moves": m}``.

    An invalid request gets ``{"ok": false, "error": "..."}`` and changes nothing.
    """

    def __init__(self, controller: Controller, endpoint: str = "tcp://127.0.0.1:*",
                 routing_table: Callable[[], Sequence[int]] | None = None, max_requests: int = 16) -> None:
        self.controller = controller
        self.routing_table = routing_table
        self.max_requests = max_requests
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"control endpoint cannot bind {endpoint}: {e}") from e
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        controller.add_poller(self.poll)
        self.requests = 0

    def poll(self) -> int:
        """Answer the requests waiting now (at most ``max_requests``); never blocks."""
        if self._sock.closed:
            return 0
        n = 0
        while n < self.max_requests:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            self.requests += 1
            envelope, payload = frames[:-1], frames[-1]
            is_json = payload[:1] == b"{"
            reply = self.handle(payload, is_json)
            data = json.dumps(reply).encode() if is_json else msgpack.packb(reply, use_bin_type=True)
            try:
                self._sock.send_multipart([*envelope, data], zmq.NOBLOCK)
            except zmq.Again:
                pass  # the client went away: ROUTER drops the reply
        return n

    def handle(self, payload: bytes, is_json: bool | None = None) -> dict[str, Any]:
        """Decode and answer one request (never raises: errors become error replies)."""
        try:
            if is_json is None:
                is_json = payload[:1] == b"{"
            try:
                req = json.loads(payload) if is_json else msgpack.unpackb(payload, raw=False, strict_map_key=False)
            except Exception as e:
                raise RequestError(f"request is not valid {'JSON' if is_json else 'msgpack'}: {e}") from None
            return {"ok": True, **self.answer(req)}
        except (RequestError, ValueError) as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug must not stop the job: report it to the client
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def answer(self, req: Any) -> dict[str, Any]:
        """The reply fields for a decoded request; raises :class:`RequestError` if it is invalid."""
        if not isinstance(req, dict):
            raise RequestError(f"request must be a map with an 'op' field, not {type(req).__name__}")
        op = req.get("op")
        c = self.controller
        if op == "table":
            out: dict[str, Any] = {"table": list(c.current_table), "planned": list(c.planned_table),
                                   "bins": c.bins, "peers": c.peers}
            if self.routing_table is not None:
                out["routing_table"] = list(self.routing_table())
            return out
        if op == "status":
            mid = req.get("migration")
            if mid is not None:
                mid = _int(mid, "migration")
                if not 0 <= mid < c.migrations:
                    raise RequestError(f"migration {mid} does not exist ({c.migrations} so far)")
            since = _int(req.get("since", 0), "since")
            limit = _int(req.get("limit", 1000), "limit")
            if since < 0 or limit < 1:
                raise RequestError(f"'since' must be >= 0 and 'limit' >= 1 (got {since} and {limit})")
            return c.status(mid, since, limit)
        if op == "rebalance":
            return self._rebalance(req)
        raise RequestError(f"unknown op {op!r} (expected 'table', 'status' or 'rebalance')")

    def _rebalance(self, req: dict) -> dict[str, Any]:
        c = self.controller
        strategy = req.get("strategy", "batched")
        if strategy not in STRATEGIES:
            raise RequestError(f"unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
        given = [k for k in ("table", "balanced", "moves") if req.get(k) not in (None, False)]
        if len(given) != 1:
            raise RequestError("a rebalance request needs exactly one of 'table', 'balanced' or 'moves'")
        if given[0] == "table":
            raw = req["table"]
            if not isinstance(raw, (list, tuple)):
                raise RequestError(f"'table' must be a list of workers, one per bin, not {type(raw).__name__}")
            target = [_int(w, "worker") for w in raw]
            if len(target) != c.bins:
                raise RequestError(f"routing table has {len(target)} entries, expected one per bin ({c.bins})")
        elif given[0] == "balanced":
            target = list(balanced(c.bins, c.peers))
        else:
            raw = req["moves"]
            pairs = list(raw.items()) if isinstance(raw, dict) else raw
            if not isinstance(pairs, (list, tuple)):
                raise RequestError("'moves' must be a list of [bin, worker] pairs or a {bin: worker} map")
            target = list(c.planned_table)
            for p in pairs:
                if not isinstance(p, (list, tuple)) or len(p) != 2:
                    raise RequestError(f"move {p!r} is not a [bin, worker] pair")
                b, w = _int(p[0], "bin"), _int(p[1], "worker")
                if not 0 <= b < c.bins:
                    raise RequestError(f"bin {b} does not exist (there are {c.bins} bins)")
                target[b] = w
        for b, w in enumerate(target):
            if not 0 <= w < c.peers:
                raise RequestError(f"bin {b} cannot move to worker {w}, which does not exist ({c.peers} workers)")
        steps = plan(c.planned_table, target, strategy, peers=c.peers)
        mid = c.start(steps)
        return {"migration": mid, "steps": len(steps), "moves": sum(len(s) for s in steps), "strategy": strategy}

    def close(self) -> None:
        """Close the socket (pending requests are dropped)."""
        if not self._sock.closed:
            self._sock.close(0)
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> ControlEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
