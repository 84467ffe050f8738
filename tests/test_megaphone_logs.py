"""Megaphone's logs stay bounded over a long job, and the totals reported from them stay exact.

* ``AutoBalancer.decisions``: the newest ``MAX_DECISIONS``, each with its moves (not the whole target
  table, nbins entries); the ``_decisions`` metric counts every decision since the start.
* ``Controller.events``: the newest steps of finished migrations up to ``max_events``, but every
  step of a migration still running (the endpoint's status pages through them); the
  ``megaphone_controller_*`` totals are running counters, exact after the log wrapped.
* ``Shared.events`` / ``Migratable.events``: the newest ``megaphone.bins.MAX_EVENTS``; the
  install/extract counters of the metrics total every event since the start, without rescanning.
* A replica/copy request repeated for a bin that has one already is logged once, not every time.
"""
from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
from megaphone_jobs import STEP_TIMEOUT, FakeControl, FakeProbe
from test_megaphone_replicas import Cap, Edge

import megaphone
import megaphone.autobalance as ab
import megaphone.bins as bins_mod
import megaphone.controller as controller_mod
import timely
from megaphone.autobalance import AutoBalancer, ControllerMetrics, Steering
from megaphone.bins import Shared
from megaphone.controller import Controller
from megaphone.endpoint import status
from megaphone.precopy import PreCopier
from megaphone.table import balanced

# -- AutoBalancer.decisions ------------------------------------------------------------------------


class StubController:
    """What the AutoBalancer needs of a controller: a planned table that its rebalances replace."""

    def __init__(self, nbins: int, peers: int) -> None:
        self.nbins, self.peers, self.busy = nbins, peers, False
        self.planned_table = balanced(nbins, peers)
        self.migrations = 0
        self.pollers: list = []
        # what the dashboard's status and the metrics read: no steps run here
        self.events: list = []
        self.steps_completed, self.step_seconds, self.last_step_seconds, self.steps_queued = 0, 0.0, None, 0
        self.in_flight = None

    @property
    def current_table(self):
        return self.planned_table

    def add_poller(self, poll) -> None:
        self.pollers.append(poll)

    def rebalance(self, target, strategy) -> int:
        self.planned_table = tuple(target)
        self.migrations += 1
        return self.migrations - 1


class StubHub:
    """Worker 0's metrics hub: every worker reports its per-bin record counts at each evaluation."""

    def __init__(self, nbins: int, peers: int) -> None:
        self.nbins, self.peers = nbins, peers
        self.received, self.t = 0, 0.0
        self.counts = [[0] * nbins for _ in range(peers)]

    def report(self, hot: list[int]) -> None:
        self.received += 1
        self.t += 1.0
        for w in range(self.peers):
            for b in hot:
                self.counts[w][b] += 100_000
            self.counts[w][w] += 1
        self._view = {"bins": {"op": {"reports": {w: (self.t, list(self.counts[w])) for w in range(self.peers)},
                                      "state": [1] * self.nbins}},
                      "rated": list(range(self.peers)),
                      "workers": [{"worker": w, "busy_ms_per_s": 500.0} for w in range(self.peers)]}

    def view(self) -> dict:
        return self._view


def test_autobalancer_keeps_the_newest_decisions_as_moves_and_counts_them_all(monkeypatch):
    monkeypatch.setattr(ab, "MAX_DECISIONS", 8, raising=False)
    nbins, peers = 1 << 8, 2
    c, hub = StubController(nbins, peers), StubHub(nbins, peers)
    balancer = AutoBalancer(c, SimpleNamespace(metrics=SimpleNamespace(hub=hub)),
                            interval=0.0, cooldown=0.0, hold=1, window=1, threshold=0.2)
    steering = Steering(c, balancer)  # type: ignore[arg-type]
    made = 0
    for _ in range(40):
        before = c.planned_table
        # all the load on (some of) the bins worker 0 holds now: always uneven, always a plan
        hub.report(list(itertools.islice((b for b in range(nbins) if before[b] == 0), 16)))
        balancer._next = 0.0
        balancer.poll()
        if c.planned_table != before:
            made += 1
            d = balancer.decisions[-1]
            assert "target" not in d, "a decision keeps its moves, not the whole table"
            assert d["moves"] == {b: c.planned_table[b] for b in range(nbins) if before[b] != c.planned_table[b]}
            assert sorted(d["moves"]) == d["bins"] and d["migration"] == c.migrations - 1
            assert {"at", "migration", "imbalance", "bins", "strategy"} <= set(d)
    assert made > 8, "the stub should make the policy decide every time"
    assert len(balancer.decisions) == 8 and balancer.decided == made
    assert [d["migration"] for d in balancer.decisions] == list(range(made - 8, made))  # the newest
    values = ControllerMetrics(c, balancer).metrics()["values"]  # type: ignore[arg-type]
    assert values["decisions"] == made  # every decision since the start, not the ones kept
    steering._refresh()
    assert [d["migration"] for d in steering.status()["decisions"]] == list(range(made - 8, made))
    assert steering.status()["decided"] == made  # the dashboard's count: all, not the 16 it lists
    # Large decisions: the bins they name are bounded too (the newest always stays).
    balancer.max_decision_bins = 40  # (applies from the next decision on)
    for _ in range(10):
        before = c.planned_table
        hub.report(list(itertools.islice((b for b in range(nbins) if before[b] == 0), 16)))
        balancer._next = 0.0
        balancer.poll()
        if c.planned_table != before:
            kept = [len(d["bins"]) for d in balancer.decisions]
            assert sum(kept) <= 40 or len(kept) == 1, kept
    assert balancer.decisions[-1]["migration"] == c.migrations - 1 and balancer.decided == c.migrations


# -- Controller.events -----------------------------------------------------------------------------


def run_to_completion(ctl: Controller, control: FakeControl, probe: FakeProbe) -> None:
    """Tick until every queued step is issued and complete (each completes at the next tick)."""
    while ctl.busy:
        control.time += 1
        probe.frontier = control.time  # passes every step issued before
        ctl.tick()


def test_controller_keeps_the_newest_steps_and_exact_totals():
    control, probe = FakeControl(k=3, peers=2), FakeProbe()
    durations: list[float] = []

    def progress(ev, what):
        if what == "completed":
            durations.append(ev.duration)

    ctl = Controller(control, probe, table=balanced(8, 2), on_progress=progress, max_events=10)
    table = list(ctl.current_table)
    for m in range(50):  # 50 migrations of 3 steps each
        ctl.start([{b: 1 - table[b]} for b in (m % 8, (m + 3) % 8, (m + 5) % 8)])
        for b in (m % 8, (m + 3) % 8, (m + 5) % 8):
            table[b] = 1 - table[b]
        run_to_completion(ctl, control, probe)
        assert len(ctl.events) <= 10
    assert list(ctl.current_table) == table
    assert [e.migration for e in ctl.events] == [47] * 3 + [48] * 3 + [49] * 3  # the newest, whole
    assert ctl.steps_completed == 150 == len(durations) and ctl.step_seconds == pytest.approx(sum(durations))
    values = ControllerMetrics(ctl).metrics()["values"]
    assert values["steps_completed"] == 150 and values["migrations"] == 50
    assert values["step_seconds"] == pytest.approx(sum(durations))
    assert values["last_step_seconds"] == durations[-1]
    assert values["steps_queued"] == 0 and values["steps_in_flight"] == 0
    steering = Steering(ctl)
    assert [s["migration"] for s in steering.status()["steps"]] == [e.migration for e in ctl.events]


def test_controller_bounds_the_moves_its_log_holds():
    control, probe = FakeControl(k=5, peers=2), FakeProbe()
    ctl = Controller(control, probe, table=balanced(32, 2), max_moves=10)
    for m in range(20):  # one step of 4 moves each: two migrations fit
        ctl.start([{b: (m + 1) % 2 for b in range(4 * (m % 8), 4 * (m % 8) + 4)}])
        run_to_completion(ctl, control, probe)
        assert sum(len(e.moves) for e in ctl.events) <= 10
    assert [e.migration for e in ctl.events] == [18, 19] and ctl.steps_completed == 20
    big = ctl.start([{b: 1 - w for b, w in enumerate(ctl.current_table)}])  # 32 moves: the newest stays
    run_to_completion(ctl, control, probe)
    assert [e.migration for e in ctl.events] == [big]
    ctl.start([{0: 0}])
    assert [e.migration for e in ctl.events] == [big, big + 1]  # (the one that finished last stays too)


def test_controller_keeps_every_step_of_a_running_migration():
    """A migration longer than the bound (fluid: one bin per step) keeps all its steps while it runs
    and while it is the newest or the one that finished last: the endpoint's status pages through
    them (``since``, as ``python -m megaphone.rebalance`` follows one); they go, all at once, once
    a newer one has finished too."""
    control, probe = FakeControl(k=6, peers=2), FakeProbe()
    ctl = Controller(control, probe, table=balanced(64, 2), max_events=5)
    ctl.start([{0: 1}, {1: 0}])
    run_to_completion(ctl, control, probe)
    mid = ctl.rebalance([1 - w for w in ctl.current_table], "fluid")  # 64 steps
    assert len(ctl.events) == 66, "the queued steps of a running migration stay in the log"
    assert ctl.steps_queued == 64 and ControllerMetrics(ctl).metrics()["values"]["steps_queued"] == 64
    assert [e.migration for e in ctl.events] == [0, 0] + [mid] * 64, "the one that finished last stays"
    seen = 0
    while ctl.busy:
        control.time += 1
        probe.frontier = control.time
        ctl.tick()
        s = status(ctl, mid, since=seen)
        assert s["steps"] == 64 and s["completed_count"] == ctl.steps_completed - 2
        assert [e["index"] for e in s["completed"]] == list(range(seen, s["completed_count"]))
        seen = s["completed_count"]
    assert seen == 64 and s["done"] and len(ctl.events) == 64, "the newest migration stays whole"
    assert ctl.steps_completed == 66
    nxt = ctl.start([{0: 0}])
    assert [e.migration for e in ctl.events] == [mid] * 64 + [nxt]  # (mid finished last: it stays)


def test_controller_default_bound():
    control, probe = FakeControl(k=3, peers=2), FakeProbe()
    ctl = Controller(control, probe, table=balanced(8, 2))
    bound = 10_000
    table = list(ctl.current_table)
    for m in range(bound + 50):
        table[m % 8] = 1 - table[m % 8]
        ctl.start([{m % 8: table[m % 8]}])
        run_to_completion(ctl, control, probe)
    assert len(ctl.events) == bound and ctl.events[0].migration == 50
    assert ctl.max_events == controller_mod.MAX_EVENTS == bound
    assert ctl.steps_completed == bound + 50


# -- Shared.events / Migratable.events -------------------------------------------------------------


def test_shared_log_is_bounded_and_the_metrics_count_every_event(monkeypatch):
    monkeypatch.setattr(bins_mod, "MAX_EVENTS", 100, raising=False)
    shared = Shared("op", 3, 0, 2)
    for i in range(1000):
        shared.log({"kind": "extract", "time": i, "bins": [0], "to": [1], "entries": 1, "bytes": 10,
                    "seconds": 0.5, "worker": 0})
        shared.log({"kind": "install", "time": i, "bins": [1], "entries": 1, "bytes": 3, "seconds": 0.25,
                    "worker": 0})
        shared.log({"kind": "precopy", "time": i, "bins": [2], "to": [1], "skipped": "small", "worker": 0})
    assert len(shared.events) == 100 and shared.events[-1]["kind"] == "precopy"
    assert shared.events[0]["time"] == 966  # the newest 100: 966's install on
    counters = shared.metrics()["counters"]
    assert counters == {"installs": 1000, "install_bytes": 3000, "install_seconds": pytest.approx(250.0),
                        "extracts": 1000, "extract_bytes": 10_000, "extract_seconds": pytest.approx(500.0)}
    shared.events.clear()  # a reader may empty the log: the totals stand
    assert shared.metrics()["counters"]["installs"] == 1000


def test_shared_log_bounds_the_bins_its_events_name(monkeypatch):
    monkeypatch.setattr(bins_mod, "MAX_EVENT_BINS", 50, raising=False)
    shared = Shared("op", 8, 0, 2)
    for i in range(10):
        shared.log({"kind": "install", "time": i, "bins": list(range(20)), "bytes": 1, "seconds": 0.0})
        assert sum(len(e["bins"]) for e in shared.events) <= 50
    assert [e["time"] for e in shared.events] == [8, 9]
    shared.log({"kind": "extract", "time": 10, "bins": list(range(200)), "bytes": 2, "seconds": 0.0})
    assert [e["time"] for e in shared.events] == [10]  # the newest stays, however many bins it names
    counters = shared.metrics()["counters"]
    assert (counters["installs"], counters["install_bytes"], counters["extracts"]) == (10, 10, 1)


def test_shared_metrics_do_not_rescan_the_log():
    shared = Shared("op", 3, 0, 2)
    for i in range(200_000):
        shared.log({"kind": "install", "time": i, "bins": [1], "entries": 1, "bytes": 1, "seconds": 0.0})
    assert len(shared.events) == bins_mod.MAX_EVENTS == 10_000
    began = time.perf_counter()
    for _ in range(100):
        shared.metrics()
    assert (time.perf_counter() - began) / 100 < 0.005, "a report costs what the bins cost, not the history"
    assert shared.metrics()["counters"]["installs"] == 200_000


def ping_pong_job(worker, epochs: int):
    """Two workers; worker 0 starts a migration (to a skewed table, then back) whenever idle."""
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=4)
        m = megaphone.state_machine(data.stream, control, 0, lambda key, v, s: ((s or 0) + v, ()))
    ctl = Controller(control, m.probe, max_events=4) if worker.index == 0 else None
    completed = [0]
    if ctl is not None:
        ctl.on_progress = lambda ev, what: completed.__setitem__(0, completed[0] + (what == "completed"))
    for e in range(epochs):
        data.send_batch([((e * 31 + i) % 200, 1) for i in range(30)])
        data.advance_to(e + 1)
        control.advance_to(e + 2)
        if ctl is not None:
            if not ctl.busy:
                cur = ctl.current_table
                target = megaphone.skewed(cur) if ctl.migrations % 2 == 0 else balanced(ctl.nbins, ctl.peers)
                ctl.rebalance(target, "all_at_once")
            ctl.tick()
        worker.step_while(lambda: m.probe.less_than(e), timeout=STEP_TIMEOUT)
    data.close()
    control.close()
    worker.step_while(lambda: not m.probe.done(), timeout=STEP_TIMEOUT)
    shared = m._shared
    out = {"events": list(m.events), "counters": shared.metrics()["counters"], "full": shared.full_log}
    if ctl is not None:
        out.update(steps=len(ctl.events), completed=completed[0], metrics=ControllerMetrics(ctl).metrics()["values"])
    return out


def test_a_long_migrating_job_keeps_its_logs_bounded_and_its_totals_exact(monkeypatch):
    monkeypatch.setattr(bins_mod, "MAX_EVENTS", 6, raising=False)
    log = Shared.log

    def spy(self, event):  # every event logged, kept apart: what the totals must count
        if not hasattr(self, "full_log"):
            self.full_log = []
        self.full_log.append(event)
        log(self, event)

    monkeypatch.setattr(Shared, "log", spy)
    results = timely.execute(lambda w: ping_pong_job(w, 80), workers=2, timeout=120)
    for r in results:
        full = r["full"]
        assert len(full) > 6 and r["events"] == full[-6:], "the newest events, no more"
        for kind in ("install", "extract"):
            evs = [e for e in full if e["kind"] == kind]
            assert r["counters"][kind + "s"] == len(evs) > 0
            assert r["counters"][kind + "_bytes"] == sum(e["bytes"] for e in evs)
            assert r["counters"][kind + "_seconds"] == pytest.approx(sum(e["seconds"] for e in evs))
    r0 = results[0]
    assert r0["steps"] <= 4 < r0["completed"], "the controller's log wrapped"
    assert r0["metrics"]["steps_completed"] == r0["completed"]


# -- repeated replica requests ---------------------------------------------------------------------


def test_a_repeated_replica_request_is_logged_once():
    owner = Shared("model", 1, 0, 3)
    for key in range(10):
        owner.bins[0].state[key] = key
    edge = Edge()
    f = PreCopier(owner, chunk=3, budget=0.0, min_entries=0, share=1.0, refresh=0.0)
    f.start(0, 1, Cap(edge, 1), edge, replica=True)
    for t in range(2, 50):
        f.start(0, 1, Cap(edge, t), edge, replica=True)
        f.start(0, 1, Cap(edge, t), edge)  # a copy asked for: the replica is one already
    assert [e["skipped"] for e in owner.events] == ["a replica is on worker 1 already"]
    assert [c.time for c in edge.caps] == [1] and f.replicas == 1
    # A replica elsewhere is another copy: its first repeat is logged again, once.
    f.start(0, 2, Cap(edge, 60), edge, replica=True)
    for t in range(61, 70):
        f.start(0, 2, Cap(edge, t), edge, replica=True)
    assert [(e.get("dropped"), e.get("skipped")) for e in owner.events] == [
        (None, "a replica is on worker 1 already"), ("a copy to another worker was requested", None),
        (None, "a replica is on worker 2 already")]
    assert f.copies[0].target == 2 and f.replicas == 1


class _Control:
    nbins, peers, closed = 8, 2, False

    def __init__(self):
        self.time = 0

    def moves(self, m):
        self.time += 1

    def precopy(self, m):
        pass


class _Probe:
    def __init__(self):
        self.done = -1

    def less_equal(self, t):
        return t > self.done


def test_a_followed_migration_that_just_finished_stays_in_the_log_and_a_trimmed_one_says_so():
    """The log dropped a migration whose last step had just completed while a newer one waited: its
    follower's next poll found no steps, took that for done and never printed the last step."""
    import io

    import megaphone.rebalance as rb
    from megaphone.controller import Controller
    from megaphone.endpoint import status

    control, probe = _Control(), _Probe()
    c = Controller(control, probe, table=[0] * 8, max_events=4)
    c.rebalance([1, 1, 1, 1, 0, 0, 0, 0], "fluid")  # migration 0: four steps, the log's bound
    while c.busy:
        c.tick()
        probe.done = control.time
    followed = c.rebalance([0, 0, 1, 1, 0, 0, 0, 0], "fluid")  # two steps
    c.tick()
    probe.done = control.time
    c.tick()
    seen = len(status(c, migration=followed)["completed"])
    assert seen == 1
    c.tick()
    probe.done = control.time
    newer = c.rebalance([0, 0, 0, 0, 0, 0, 0, 1], "fluid")  # queued before the last step is seen done
    c.tick()  # the followed migration's last step completes: the log is over its bound
    s = status(c, migration=followed, since=seen)
    assert [e["index"] for e in s["completed"]] == [1] and s["done"] and not s["trimmed"]
    assert status(c)["completed_total"] == c.steps_completed == 6
    # Once the newer one has finished too, the followed one may leave the log: status says so.
    while c.busy:
        c.tick()
        probe.done = control.time
    c.rebalance([1, 0, 0, 0, 0, 0, 0, 0], "fluid")
    while c.busy:
        c.tick()
        probe.done = control.time
    assert not any(e.migration == followed for e in c.events) and newer > followed
    assert status(c, migration=followed)["trimmed"]
    out = io.StringIO()
    calls = []

    def call(endpoint, req, timeout, secret):
        calls.append(req)
        return status(c, req.get("migration"), req.get("since", 0))

    original, rb.call = rb.call, call
    try:
        rb.follow("x", followed, 2, 1.0, 0.0, out)
    finally:
        rb.call = original
    assert "no longer in the controller's log" in out.getvalue() and len(calls) == 1
