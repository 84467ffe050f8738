"""Automatic rebalancing: move bins when the load on the workers stays uneven.

:class:`BalancePolicy` is the decision, a pure class tested on synthetic load traces: it is fed the
records per second of every bin (and, optionally, every worker's busy fraction) at each evaluation,
averages them over a ``window`` of evaluations, and once the busiest worker's load has exceeded the
mean by more than ``threshold`` for ``hold`` consecutive evaluations, plans a target table
(:func:`even`) that brings it under ``target`` (below ``threshold``: hysteresis) moving few bins,
preferring small ones. After a plan it keeps quiet for ``cooldown`` seconds, and it never plans
while a migration runs.

:class:`AutoBalancer` drives it on worker 0: it reads the per-bin rates that every worker reports
to worker 0's metrics hub (:mod:`timely.metrics`: the per-bin counts travel with the metrics
snapshots, not through a dataflow, so gathering them needs no operator in the job and keeps going
while the dataflow is overloaded), evaluates the policy every ``interval`` seconds from
:meth:`Controller.tick <megaphone.Controller.tick>` (it registers as a poller) and starts the plan as
one batched migration. It also estimates how many workers the observed rates need
(:func:`workers_needed`, DS2's true processing rate: records per busy second).
"""
from __future__ import annotations

import math
import queue
import sys
import threading
import time as _time
from collections import deque
from collections.abc import Sequence
from itertools import islice
from typing import Any

from timely import TimelyError, Worker

from .controller import Controller
from .plan import STRATEGIES
from .table import Table, apply, balanced, move_updates, rebalance_kind, validate_move

#: The policy's knobs and their defaults (also the launcher's ``--autobalance knob=value,...``).
DEFAULTS: dict[str, Any] = {"threshold": 0.25, "target": None, "hold": 3, "cooldown": 10.0, "window": 3,
                            "min_busy": 0.0, "interval": 1.0, "strategy": "auto"}
#: The decisions an :class:`AutoBalancer` keeps (:attr:`AutoBalancer.decisions`: the newest), and
#: the moved bins they may name in all (the newest decision always stays): a decision keeps its
#: moves, some 120 bytes a bin. Read when the AutoBalancer is created.
MAX_DECISIONS = 256
MAX_DECISION_BINS = 100_000
#: With ``strategy="auto"``: a plan whose moved bins hold at most this many state entries in all runs
#: all at once, a larger one batched.
SMALL_MOVE = 100_000


def choose_strategy(moved: Sequence[int], sizes: Sequence[float] | None, small: float = SMALL_MOVE) -> str:
    """The strategy ``"auto"`` picks for moving the bins ``moved`` (``sizes``: state entries per bin).

    A batched plan takes one step per sender -> receiver matching, and each step waits for the
    previous one to complete; on an overloaded worker (the very case a rebalance is for) each
    completion waits for its backlog, so spreading one worker's hot bins over n others takes n
    slow steps. Bins holding little state move all at once (their stall is short); large ones go
    batched, whose steps keep each stall small."""
    if sizes is None:
        return "batched"
    return "all_at_once" if sum(sizes[b] for b in moved) <= small else "batched"



def worker_loads(loads: Sequence[float], table: Sequence[int], peers: int) -> list[float]:
    """The load of each worker: the sum of the loads of the bins ``table`` gives it."""
    out = [0.0] * peers
    for b, w in enumerate(table):
        out[w] += loads[b]
    return out


def imbalance(loads: Sequence[float], table: Sequence[int], peers: int) -> float:
    """How far the busiest worker's load exceeds the mean, relative to the mean (0: even)."""
    wl = worker_loads(loads, table, peers)
    mean = sum(wl) / peers
    return max(wl) / mean - 1.0 if mean > 0 else 0.0


def even(loads: Sequence[float], table: Sequence[int], peers: int, target: float,
         sizes: Sequence[float] | None = None) -> Table:
    """A table close to ``table`` whose busiest worker is at most ``target`` over the mean, if moves
    of whole bins allow: bins go one at a time from the busiest to the least busy worker, each the
    bin that best narrows their gap (so few move), the smaller state first among equals (``sizes``).
    Every move strictly lowers the busier of its two workers' loads (also in floating point: a move
    that rounding makes useless is not made), so it ends; where it ends early no bin of the busiest
    worker fits the gap, and that worker is within one bin's load of the mean."""
    owner = list(table)
    wl = worker_loads(loads, owner, peers)
    mean = sum(wl) / peers
    held: list[set[int]] = [set() for _ in range(peers)]
    for b, w in enumerate(owner):
        held[w].add(b)
    for _ in range(len(owner) * peers):
        hi = max(range(peers), key=lambda w: (wl[w], -w))
        lo = min(range(peers), key=lambda w: (wl[w], w))
        if wl[hi] <= mean * (1.0 + target):
            break
        gap = wl[hi] - wl[lo]
        fits = [b for b in held[hi] if 0 < loads[b] < gap]
        if not fits:
            break
        b = min(fits, key=lambda b: (max(wl[hi] - loads[b], wl[lo] + loads[b]), sizes[b] if sizes else 0, b))
        if not max(wl[hi] - loads[b], wl[lo] + loads[b]) < wl[hi]:
            break  # lost in rounding (a load far below the others'): moving it would change nothing
        held[hi].discard(b)
        held[lo].add(b)
        owner[b] = lo
        wl[hi] -= loads[b]
        wl[lo] += loads[b]
    return tuple(owner)


def workers_needed(records_per_s: Sequence[float], busy: Sequence[float], utilization: float = 0.8) -> int | None:
    """DS2's estimate of the workers the observed rates need: each worker's true processing rate is
    its records per busy second (``records_per_s[w] / busy[w]``, busy as seconds per second); the
    job needs the total rate over the mean true rate, at ``utilization``. None without busy time."""
    rates = [r / b for r, b in zip(records_per_s, busy) if b > 0 and r > 0]
    if not rates:
        return None
    capacity = sum(rates) / len(rates) * utilization
    return max(1, math.ceil(sum(records_per_s) / capacity))


class BalancePolicy:
    """When to rebalance and to what (see the module documentation for the knobs)."""

    def __init__(self, peers: int, threshold: float = 0.25, target: float | None = None, hold: int = 3,
                 cooldown: float = 10.0, window: int = 3, min_busy: float = 0.0) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be positive, not {threshold}")
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be a positive integer, not {peers!r}")
        for knob, value in (("hold", hold), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{knob} must be a positive integer (evaluations), not {value!r}")
        if not 0 <= cooldown < math.inf:
            raise ValueError(f"cooldown must be a finite number of seconds, at least 0, not {cooldown!r}")
        if not 0 <= min_busy <= 1:
            raise ValueError(f"min_busy is a share of a worker's time, from 0 to 1, not {min_busy!r}")
        self.peers = peers
        self.threshold = threshold
        self.target = threshold / 2 if target is None else target
        if not 0 <= self.target < threshold:
            raise ValueError(f"target ({self.target}) must be below threshold ({threshold}): that is the hysteresis")
        self.hold = hold
        self.cooldown = cooldown
        self.min_busy = min_busy
        self._window: deque[list[float]] = deque(maxlen=window)
        self._streak = 0
        self._quiet_until = -math.inf
        self.last_imbalance = 0.0

    def loads(self) -> list[float]:
        """The per-bin loads averaged over the window."""
        n = len(self._window)
        return [sum(col) / n for col in zip(*self._window)] if n else []

    def plan(self, loads: Sequence[float], table: Sequence[int], now: float, busy: Sequence[float] | None = None,
             migrating: bool = False, sizes: Sequence[float] | None = None) -> Table | None:
        """Take one observation (records per second per bin under ``table`` at ``now`` seconds);
        return a target table to migrate to, or None. ``busy``: each worker's busy fraction (with
        ``min_busy``, an uneven but idle job is left alone); ``migrating``: a migration runs (no plan,
        and the streak restarts); ``sizes``: per-bin state sizes (ties prefer small bins)."""
        self._window.append([float(x) for x in loads])
        avg = self.loads()
        self.last_imbalance = imbalance(avg, table, self.peers)
        if migrating or now < self._quiet_until:
            self._streak = 0
            return None
        over = self.last_imbalance > self.threshold
        if busy is not None and self.min_busy > 0 and max(busy, default=0.0) < self.min_busy:
            over = False
        self._streak = self._streak + 1 if over else 0
        if self._streak < self.hold:
            return None
        self._streak = 0
        target = even(avg, table, self.peers, self.target, sizes)
        if tuple(target) == tuple(table):
            return None  # no move of whole bins helps
        self._quiet_until = now + self.cooldown
        return target


def check_count(knob: str, value: Any) -> int:
    """The AutoBalancer's ``hold`` or ``window`` (``knob``) as an int: a whole number of evaluations,
    else ``ValueError`` naming it (``int()`` truncated 2.7 to 2 silently, and raised OverflowError
    for inf). :class:`BalancePolicy` checks that it is positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{knob} must be a whole number of evaluations, not {value!r}")
    return int(value)


def check_interval(value: Any) -> float:
    """The AutoBalancer's ``interval`` as seconds: a finite number, 0 or more (0: at every metrics
    report), else ``ValueError`` naming it (a negative or nan one acted as 0, silently)."""
    seconds = float(value)
    if not 0 <= seconds < math.inf:
        raise ValueError(f"interval must be a number of seconds, 0 or more, not {value!r}")
    return seconds


class AutoBalancer:
    """Runs a :class:`BalancePolicy` on worker 0's metrics and starts its plans on ``controller``.

    ``worker`` is worker 0 (its ``metrics.hub`` has every worker's per-bin rates: run the job with
    ``--autobalance`` or ``--metrics-port``, or a :class:`timely.metrics.MetricsConfig`); ``name`` is
    the migratable operator's name (default: the only one reported with the controller's number of
    bins; with several, it does not balance and says so once on stderr). :attr:`decisions` lists what
    was decided, the newest :data:`MAX_DECISIONS` (and :data:`MAX_DECISION_BINS` moved bins in
    all), each ``{"at", "migration", "imbalance", "bins", "moves": {bin: new worker}, "strategy"}``;
    :attr:`decided` counts every decision since the start; :attr:`needed` is the latest
    :func:`workers_needed` estimate."""

    def __init__(self, controller: Controller, worker: Any, name: str | None = None, **knobs: Any) -> None:
        unknown = set(knobs) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown AutoBalancer knob(s) {sorted(unknown)} (known: {', '.join(DEFAULTS)})")
        opts = {**DEFAULTS, **knobs}
        hub = getattr(getattr(worker, "metrics", None), "hub", None)
        if hub is None:
            raise ValueError("the AutoBalancer needs worker 0's metrics hub: run the job with --autobalance or "
                             "--metrics-port (or set timely.metrics.ENV), and create it on worker 0")
        self.controller = controller
        self.hub = hub
        self.name = name
        self.strategy = str(opts["strategy"])
        if self.strategy != "auto" and self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r} (expected auto or one of {', '.join(STRATEGIES)})")
        self.interval = check_interval(opts["interval"])
        self.policy = BalancePolicy(controller.peers, float(opts["threshold"]),
                                    None if opts["target"] is None else float(opts["target"]),
                                    check_count("hold", opts["hold"]), float(opts["cooldown"]),
                                    check_count("window", opts["window"]), float(opts["min_busy"]))
        self.decisions: deque[dict[str, Any]] = deque()  # the newest (see _decided)
        self.max_decisions, self.max_decision_bins = MAX_DECISIONS, MAX_DECISION_BINS
        self._decision_bins = 0  # the bins they name
        self.decided = 0  # every decision since the start
        self.needed: int | None = None
        self._next = 0.0
        self._seen = -1
        self._reports: dict[int, tuple[float, list[int]]] = {}  # per worker: the report last seen
        self._rates: dict[int, list[float]] = {}  # per worker: per-bin records/s between its last two seen
        self._ambiguous = False  # said once that several operators could be meant
        controller.add_poller(self.poll)

    def _only_operator(self, bins: dict[str, Any]) -> str | None:
        """The one migratable operator reported with this controller's number of bins (operators
        of another ``k`` have another control input). Several: None, and one line on stderr
        asking for ``name`` (balancing by one of them would move the others' bins blindly)."""
        nbins = self.controller.nbins
        names = sorted(n for n, agg in bins.items()
                       if agg["reports"] and not agg.get("retired")  # (a completed operator's final counts)
                       and all(len(counts) == nbins for _, counts in agg["reports"].values()))
        if len(names) > 1:
            if not self._ambiguous:
                self._ambiguous = True
                print(f"megaphone.AutoBalancer: several migratable operators have {nbins} bins "
                      f"({', '.join(names)}): give AutoBalancer(..., name=...); not balancing", file=sys.stderr)
            return None
        return names[0] if names else None

    def _bin_rates(self, reports: dict[int, tuple[float, list[int]]]) -> list[float] | None:
        """Per-bin records per second, summed over the workers: each worker's over the span between
        the report seen at the previous evaluation and its newest, by that worker's own report
        times (a worker whose reports fall unevenly into evaluations, two in one and none in the
        next, would otherwise read 4/3 and 2/3 of its load: with many workers, an imbalance that is
        not there). A worker with no new report keeps its rates. None until every worker has some."""
        for w, (mono, counts) in reports.items():
            last = self._reports.get(w)
            if last is not None and mono <= last[0]:
                continue  # no new report from this worker
            self._reports[w] = (mono, counts)
            if last is not None and len(last[1]) == len(counts):
                self._rates[w] = [(x - y) / (mono - last[0]) for x, y in zip(counts, last[1])]
        if len(self._rates) < self.controller.peers:
            return None
        return [sum(col) for col in zip(*self._rates.values())]

    def poll(self) -> None:
        """Evaluate the policy if ``interval`` has passed and new reports arrived (a poller of
        :meth:`Controller.tick <megaphone.Controller.tick>`). Nothing once the control input is
        closed (no migration can start; a driver may tick on while it drains); a migration the
        controller refuses is reported on stderr, and the job runs on."""
        now = _time.monotonic()
        closed = getattr(getattr(self.controller, "control", None), "closed", False)  # (a stand-in may have none)
        if now < self._next or self.hub.received == self._seen or closed:
            return
        self._next = now + self.interval
        self._seen = self.hub.received
        view = self.hub.view()
        bins = view["bins"]
        name = self.name if self.name is not None else self._only_operator(bins)
        agg = bins.get(name) if name is not None else None
        if agg is None or len(view["rated"]) < self.controller.peers:
            return  # some worker's rates are not known yet: its bins would look idle
        rates = self._bin_rates(agg["reports"])
        if rates is None:
            return
        c = self.controller
        busy = [0.0] * c.peers
        for w in view["workers"]:
            if w["worker"] < c.peers:
                busy[w["worker"]] = w["busy_ms_per_s"] / 1000.0
        self.needed = workers_needed(worker_loads(rates, c.planned_table, c.peers), busy)
        target = self.policy.plan(rates, c.planned_table, now, busy, c.busy, agg["state"])
        if target is None:
            return
        moved = [b for b, (w0, w1) in enumerate(zip(c.planned_table, target)) if w0 != w1]
        strategy = choose_strategy(moved, agg["state"]) if self.strategy == "auto" else self.strategy
        try:
            mid = c.rebalance(target, strategy)
        except TimelyError as e:  # (a TableError: the worker must not fail for a rebalance it chose)
            print(f"megaphone.AutoBalancer: the migration of bins {moved[:8]}{' ...' if len(moved) > 8 else ''} "
                  f"was refused ({e}); not rebalancing now", file=sys.stderr)
            return
        # The moves only: the whole target table is nbins entries (65,536 at k=16) per decision.
        self._decided({"at": _time.time(), "migration": mid, "imbalance": self.policy.last_imbalance,
                       "bins": moved, "moves": {b: int(target[b]) for b in moved}, "strategy": strategy})

    def _decided(self, decision: dict[str, Any]) -> None:
        """Keep ``decision``, the oldest leaving past ``max_decisions`` or ``max_decision_bins``."""
        self.decided += 1
        kept = self.decisions
        if not kept:
            self._decision_bins = 0  # (a reader may have emptied it)
        kept.append(decision)
        self._decision_bins += len(decision["bins"])
        while kept and (len(kept) > self.max_decisions
                        or (self._decision_bins > self.max_decision_bins and len(kept) > 1)):
            self._decision_bins -= len(kept.popleft()["bins"])


class Steering:
    """Worker 0's ``controller`` (and ``balancer``) seen and steered from the dashboard
    (:mod:`timely.dashboard`): the page's requests are queued by the server's thread and answered by
    :meth:`poll`, a poller of :meth:`Controller.tick <megaphone.Controller.tick>`, on the worker's
    thread; :meth:`status` is a copy refreshed there too."""

    def __init__(self, controller: Controller, balancer: AutoBalancer | None = None) -> None:
        self.controller = controller
        self.balancer = balancer
        self._requests: queue.Queue[tuple[Any, threading.Event, list[Any]]] = queue.Queue()
        self._lock = threading.Lock()  # a request is either taken by poll() or given up by submit()
        self._status: dict[str, Any] = {}
        self._next = 0.0
        self._watched_until = 0.0  # refreshed only while a page asks (a step's as_dict is not free)
        self._refresh()
        controller.add_poller(self.poll)

    def status(self) -> dict[str, Any]:
        """The table, the planned table, the latest migration steps, the AutoBalancer's newest
        decisions and how many it made (as of the last refresh: kept fresh, every 0.2 s, for 10 s
        after each call)."""
        self._watched_until = _time.monotonic() + 10.0
        return self._status

    def submit(self, req: Any, timeout: float) -> tuple[bool, dict[str, Any]]:
        """Queue a rebalance request (``{"strategy"?, "table" | "balanced" | "moves"}``) and wait for
        its answer: ``(ok, reply)``. A request the job has not taken within ``timeout`` seconds is
        given up: it never runs (the page was told it did not)."""
        done, answer = threading.Event(), [False, {}, "queued"]  # type: tuple[threading.Event, list[Any]]
        self._requests.put((req, done, answer))  # answer: [ok, reply, state], filled by poll()
        if not done.wait(timeout):
            with self._lock:
                given_up = answer[2] == "queued"
                if given_up:
                    answer[2] = "given up"
            if given_up:
                return False, {"error": f"the job did not take the request within {timeout:g} s, so it will "
                                        "not run (worker 0 calls controller.tick() between its epochs)"}
            done.wait()  # taken just now: its answer comes at once
        return bool(answer[0]), dict(answer[1])

    def poll(self) -> None:
        """Answer the queued requests, refresh the status (at most every 0.2 s while a page reads it,
        and after each request)."""
        asked = False
        while True:
            try:
                req, done, answer = self._requests.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if answer[2] == "given up":
                    continue
                answer[2] = "taken"
            asked = True
            try:
                answer[1] = self.rebalance(req)
                answer[0] = True
            except (TimelyError, ValueError, TypeError) as e:
                answer[1] = {"error": str(e)}
            done.set()
        now = _time.monotonic()
        if asked or self._next <= now < self._watched_until:
            self._refresh()

    def rebalance(self, req: Any) -> dict[str, Any]:
        """Start the migration a dashboard request asks for; raise on a malformed one (nothing moves)."""
        c = self.controller
        if not isinstance(req, dict):
            raise ValueError("a rebalance request is a JSON object")
        strategy = req.get("strategy", "batched")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
        kind = rebalance_kind(req)
        if kind == "balanced":
            target: Sequence[int] = balanced(c.nbins, c.peers)
        elif kind == "table":
            target = req["table"]
            if not isinstance(target, list) or not all(isinstance(w, int) and not isinstance(w, bool) for w in target):
                raise ValueError("'table' must be a list of worker numbers, one per bin")
        else:
            pairs = req["moves"]
            if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and
                                                      all(isinstance(x, int) and not isinstance(x, bool) for x in p)
                                                      for p in pairs):
                raise ValueError("'moves' must be a list of [bin, worker] pairs of integers")
            if not pairs:  # (an empty migration, started for nothing)
                raise ValueError("'moves' is empty: give at least one [bin, worker] pair")
            moves: dict[int, int] = {}
            for b, w in pairs:
                b, w = validate_move(b, w, c.nbins, c.peers)
                if moves.setdefault(b, w) != w:  # one target per bin (the same move twice is harmless)
                    raise ValueError(f"bin {b} is moved to both worker {moves[b]} and worker {w}")
            target = apply(c.planned_table, move_updates(moves))
        mid = c.rebalance(target, strategy)
        steps = [e for e in c.events if e.migration == mid]
        return {"migration": mid, "steps": len(steps), "moves": sum(len(e.moves) for e in steps)}

    def _refresh(self) -> None:
        c, b = self.controller, self.balancer
        self._next = _time.monotonic() + 0.2
        self._status = {
            "table": list(c.current_table), "planned": list(c.planned_table), "nbins": c.nbins, "peers": c.peers,
            "busy": c.busy, "migrations": c.migrations, "steps": [e.as_dict() for e in _newest(c.events, 64)],
            "decisions": _newest(b.decisions, 16) if b is not None else None,
            "decided": b.decided if b is not None else None,  # all of them (decisions: the newest 16)
            "needed": b.needed if b is not None else None,
            "imbalance": b.policy.last_imbalance if b is not None else None,
        }


def _newest(log: Sequence[Any] | deque[Any], n: int) -> list[Any]:
    """The newest ``n`` entries of ``log`` (a deque or a list), oldest first."""
    return list(islice(log, max(0, len(log) - n), None))


class ControllerMetrics:
    """The controller's figures as a :mod:`timely.metrics` source (Prometheus ``megaphone_controller_*``):
    migrations started, steps queued, in flight and completed, the last step's seconds, and the
    AutoBalancer's imbalance, decisions and DS2 estimate where one runs."""

    def __init__(self, controller: Controller, balancer: AutoBalancer | None = None) -> None:
        self.controller = controller
        self.balancer = balancer
        self.metrics_name = "controller"
        self.index = 0  # worker 0's

    def metrics(self) -> dict[str, Any]:
        """A "counters" source: ``{"kind", "prefix", "values"}``."""
        c, b = self.controller, self.balancer
        # Running totals kept by the controller (its events log is bounded, and rescanning it on
        # every report cost the reporter thread time in proportion to the job's history).
        last = c.last_step_seconds
        values: dict[str, Any] = {
            "migrations": c.migrations, "steps_completed": c.steps_completed,
            "steps_queued": c.steps_queued, "steps_in_flight": int(c.in_flight is not None),
            "last_step_seconds": last if last is not None else 0.0,
            "step_seconds": c.step_seconds,
        }
        if b is not None:
            values.update(imbalance=b.policy.last_imbalance, decisions=b.decided)
            if b.needed is not None:
                values["workers_needed"] = b.needed
        return {"kind": "counters", "prefix": "megaphone_controller", "values": values}


def attach(controller: Controller | None, worker: Any, name: str | None = None) -> AutoBalancer | None:
    """Connect worker 0's ``controller`` to what the launcher asked for (a
    :class:`~megaphone.Controller` built on a :class:`~megaphone.ControlInput` does it itself; once
    per controller): the AutoBalancer
    (``--autobalance knob=value,...``, returned), the dashboard (``--dashboard PORT``: the page
    then shows the table and the steps, and can start rebalances) and the metrics (the controller's
    ``megaphone_controller_*`` figures). None on other workers (``controller`` None) or without
    ``--autobalance``."""
    metrics = getattr(worker, "metrics", None)
    config = getattr(metrics, "config", None)
    if controller is None or metrics is None or config is None:
        return None
    if getattr(controller, "_attached", False):  # a Controller attaches itself when built
        return controller.balancer
    controller._attached = True  # type: ignore[attr-defined]
    balancer = None
    if config.autobalance is not None:
        balancer = AutoBalancer(controller, worker, name, **config.autobalance)
    dashboard = getattr(metrics, "dashboard", None)
    if dashboard is not None:
        dashboard.connect(Steering(controller, balancer))
    source = ControllerMetrics(controller, balancer)
    metrics.held.append(source)  # (sources are held weakly)
    Worker.add_metrics_source(source)
    return balancer
