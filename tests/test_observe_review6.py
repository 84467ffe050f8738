"""Review 6 of the observing side (timely.metrics, timely.dashboard, megaphone.autobalance,
megaphone.rebalance): the AutoBalancer on a closed control input, abandoned migrations in the CLI
and the planned table, counters that never go backwards, unique source names, a failing lag probe,
and the launcher's and the dashboard's refusals."""
from __future__ import annotations

import gc
import http.client
import json
import re
import time
import types

import pytest
from megaphone_jobs import FakeControl, FakeProbe
from procs import no_leftover_children
from test_autobalance import _TwoOperatorsHub as _Hub
from test_megaphone_cli import FakeJob

import megaphone
import timely
from megaphone.autobalance import AutoBalancer, Steering
from megaphone.controller import Controller
from megaphone.endpoint import call
from megaphone.rebalance import EXIT_ABANDONED
from megaphone.rebalance import main as cli_main
from megaphone.table import TableError
from timely.launch import main as launch_main
from timely.metrics import ENV, LagProbe, MetricsConfig, core


def count_fold(key, value, state):
    return (state or 0) + value, ()


def _balancer(hub: _Hub) -> tuple[Controller, FakeControl, AutoBalancer]:
    control = FakeControl(k=4, peers=2)
    controller = Controller(control, FakeProbe())
    worker = types.SimpleNamespace(metrics=types.SimpleNamespace(hub=hub))
    return controller, control, AutoBalancer(controller, worker, interval=0.0, hold=1, window=1)


# -- 1. the AutoBalancer once the control input is closed --------------------------------------------
def test_the_autobalancer_leaves_a_closed_control_input_alone():
    """Ticking on after the close (while the job drains) is supported: the policy would fire, and
    the AutoBalancer's rebalance raised TableError out of tick(), failing worker 0."""
    hub = _Hub({"mine": 16})
    controller, control, balancer = _balancer(hub)
    control.closed = True
    for _ in range(4):
        hub.advance()
        controller.tick()
    assert balancer.decided == 0 and controller.migrations == 0 and control.sent == []


def test_a_rebalance_the_controller_refuses_is_reported_and_the_job_runs(capfd):
    hub = _Hub({"mine": 16})
    controller, control, balancer = _balancer(hub)

    def refuse(target, strategy="batched", precopy=False):
        raise TableError("refused for the test")

    controller.rebalance = refuse
    for _ in range(3):
        hub.advance()
        controller.tick()
    err = capfd.readouterr().err
    assert "megaphone.AutoBalancer: the migration of bins" in err and "refused for the test" in err
    assert balancer.decided == 0


# -- 2. abandoned migrations: the planned table and the CLI ---------------------------------------------
def test_abandoned_steps_leave_the_planned_table():
    control = FakeControl(k=3, peers=2)
    probe = FakeProbe()
    ctl = Controller(control, probe)
    start = ctl.current_table
    ctl.start([{0: 1}, {2: 1}, {4: 1}])
    assert ctl.tick()  # the first step in flight
    control.closed = True
    ctl.tick()
    issued = tuple(1 if b == 0 else w for b, w in enumerate(start))
    assert ctl.current_table == issued and ctl.planned_table == issued  # (was: bins 2 and 4 moved too)
    probe.frontier = None
    ctl.tick()
    assert ctl.planned_table == ctl.current_table == issued and not ctl.busy


class _ClosingJob(FakeJob):
    """A fake job in a thread whose control input closes once the first step of a migration is
    issued (the rest of it is abandoned)."""

    def __init__(self) -> None:
        super().__init__(k=3, peers=2)

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.control.closed:
                self.control.time += 1
                if self.ctl.events and self.ctl.events[0].issued_at is not None:
                    self.control.closed = True
            # (closed: the data drain, and the step in flight completes)
            self.probe.frontier = self.control.time + 1 if self.control.closed else self.control.time - 2
            self.ctl.tick()
            time.sleep(0.002)


@pytest.mark.timeout(60)
def test_the_cli_reports_an_abandoned_migration_and_fails(capsys):
    with _ClosingJob() as job:
        code = cli_main(["--endpoint", job.ep.endpoint, "--table", "1,1,1,1,0,0,0,0", "--strategy", "fluid"])
        out, err = capsys.readouterr()
        steps = len(job.ctl.events)
        assert steps > 1 and code == EXIT_ABANDONED, (out, err)
        assert f"migration 0 abandoned: {steps - 1} of {steps} steps were never issued" in out
        assert "complete:" not in out and f"{steps - 1} of {steps} steps abandoned" in err
        table = call(job.ep.endpoint, {"op": "table"}, 5.0)
        assert table["planned"] == table["table"]  # the endpoint's planned table: what will happen
    assert "4 if the job closed its control input" in " ".join(megaphone.rebalance.parser().format_help().split())


# -- 3. counters never go backwards ----------------------------------------------------------------------
def _count(worker: timely.Worker, records: list, k: int = 2, epochs: int = 1) -> None:
    """A dataflow "count" with a Megaphone operator "count" that applies ``records`` in each of
    ``epochs`` times, run to completion (the job keeps no handle of it)."""
    with worker.dataflow(name="count") as scope:
        d = scope.new_input()
        control = megaphone.ControlInput(scope, k=k)
        m = megaphone.state_machine(d.stream, control, 0, count_fold, name="count")
    for e in range(epochs):
        d.send_batch([(r + e * 1000, v) for r, v in records])
        d.advance_to(e + 1)
        control.advance_to(e + 1)
        worker.step_while(lambda: m.probe.less_than(e + 1))
    d.close()
    control.close()
    worker.step_while(lambda: not m.probe.done())


def _later_dataflows(worker: timely.Worker, sizes: list[int]) -> list[dict[str, int]]:
    """One Megaphone dataflow after another (all named "count"), each let go when done; the bins
    sources' total records after each."""
    seen = []
    for n in sizes:
        _count(worker, [(i, 1) for i in range(n)])
        gc.collect()
        srcs = worker.metrics.snapshot()["sources"]
        seen.append({k: sum(v["records"]) for k, v in srcs.items() if v.get("kind") == "bins"})
        assert all(v.get("retired") is True for v in srcs.values() if v.get("kind") == "bins")
    return seen


def test_a_collected_operators_counts_are_kept():
    """A completed, collected Megaphone dataflow's per-bin counts stay (they vanished: the counter
    megaphone_bin_records went back to 0); a later operator of the same name is numbered."""
    seen = timely.execute(lambda w: _later_dataflows(w, [100, 30]), workers=1)[0]
    assert seen == [{"count": 100}, {"count": 100, "count #2": 30}]


def test_collected_operators_beyond_the_bound_are_folded(monkeypatch):
    monkeypatch.setattr(core, "KEEP_RETIRED_SOURCES", 2)
    seen = timely.execute(lambda w: _later_dataflows(w, [1, 2, 4, 8, 16]), workers=1)[0]
    assert seen[-1] == {"(completed earlier, 4 bins)": 1 + 2 + 4, "count #4": 8, "count #5": 16}
    assert [sum(s.values()) for s in seen] == [1, 3, 7, 15, 31]  # every record, always


def _ending_job(worker: timely.Worker):
    """Both workers apply records; worker 1 ends first, then worker 0 lets its dataflow go; worker 0
    samples the hub's per-bin total meanwhile."""
    _count(worker, [(worker.index * 100_000 + i, 1) for i in range(101)], k=3, epochs=3)
    if worker.index == 1:
        return None  # its metrics close with the worker, its operator collected
    deadline = time.monotonic() + 30
    while worker.step() and time.monotonic() < deadline:  # until the worker lets the dataflow go
        time.sleep(0.001)
    gc.collect()
    hub = worker.metrics.hub
    totals = []

    def total() -> int:
        agg = hub.view()["bins"].get("count")
        totals.append(0 if agg is None else sum(agg["records"]))
        return totals[-1]

    hub.wait(lambda _: total() == 606, 20)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # more reports: worker 0's operator is collected now
        total()
        time.sleep(0.05)
    # (worker 1's may have been reported live in its last report: collected or not, it counts once)
    return totals, hub.latest()[0]["sources"].get("count", {}).get("retired")


@pytest.mark.timeout(120)
def test_per_bin_counters_survive_the_workers_end(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, MetricsConfig(hub=f"ipc://{tmp_path}/hub", interval=0.05).to_env())
    with no_leftover_children():
        totals, retired = timely.execute(_ending_job, workers=2, timeout=90)[0]
    assert totals[-1] == 606 and retired, totals
    assert all(a <= b for a, b in zip(totals, totals[1:])), totals  # never backwards


# -- 4. two operators of one name ---------------------------------------------------------------------
def test_two_operators_of_one_name_are_reported_apart():
    def job(worker: timely.Worker):
        with worker.dataflow() as scope:
            a, b = scope.new_input(), scope.new_input()
            control = megaphone.ControlInput(scope, k=3)
            m1 = megaphone.state_machine(a.stream, control, 0, count_fold)
            m2 = megaphone.state_machine(b.stream, control, 0, count_fold)
        a.send_batch([(i, 1) for i in range(100)])
        b.send_batch([(i, 1) for i in range(7)])
        for x in (a, b, control):
            x.close()
        worker.step_while(lambda: not (m1.probe.done() and m2.probe.done()))
        return {k: sum(v["records"]) for k, v in worker.metrics.snapshot()["sources"].items()}

    assert timely.execute(job, workers=1)[0] == {"StateMachine": 100, "StateMachine #2": 7}


def _two_operators_job(worker: timely.Worker):
    with worker.dataflow() as scope:
        a, b = scope.new_input(), scope.new_input()
        control = megaphone.ControlInput(scope, k=3)
        m1 = megaphone.state_machine(a.stream, control, 0, count_fold)
        m2 = megaphone.state_machine(b.stream, control, 0, count_fold)
    controller = megaphone.Controller(control, m1.probe)
    assert controller.balancer is not None
    hub = worker.metrics.hub
    e = 0
    while hub.received < 4 and e < 2000:  # (reports every 0.02 s)
        a.send_batch([(i, 1) for i in range(20)])
        b.send_batch([(i, 1) for i in range(5)])
        e += 1
        for x in (a, b, control):
            x.advance_to(e)
        controller.tick()
        worker.step_while(lambda: m1.probe.less_than(e) or m2.probe.less_than(e))
        time.sleep(0.005)
    for x in (a, b, control):
        x.close()
    worker.step_while(lambda: not (m1.probe.done() and m2.probe.done()))
    return controller.balancer.decided


def test_the_autobalancer_says_when_two_operators_of_one_name_could_be_meant(monkeypatch, capfd):
    """The two shared one metrics entry (the last overwrote the first), so the AutoBalancer saw one."""
    monkeypatch.setenv(ENV, MetricsConfig(interval=0.02, autobalance={"interval": 0.0}).to_env())
    assert timely.execute(_two_operators_job, workers=1)[0] == 0
    err = capfd.readouterr().err
    assert err.count("several migratable operators have 8 bins (StateMachine, StateMachine #2)") == 1


def test_a_retired_operator_is_not_one_the_autobalancer_could_mean(capfd):
    hub = _Hub({"done": 16, "mine": 16}, retired=("done",))
    controller, _, balancer = _balancer(hub)
    for _ in range(3):
        hub.advance()
        controller.tick()
    assert balancer.decided == 1 and "several" not in capfd.readouterr().err


# -- 5. a lag probe that raises ----------------------------------------------------------------------
def test_a_failing_wall_of_loses_its_lag_only(capfd):
    probe = types.SimpleNamespace(frontier=[3])

    def wall_of(t):
        return {}["oops"]

    lag = LagProbe("out", probe, wall_of)
    assert lag.read(time.time()) == {"frontier": 3, "lag_s": None}
    assert lag.read(time.time()) == {"frontier": 3, "lag_s": None}
    err = capfd.readouterr().err
    assert err.count("lag probe 'out' raised KeyError('oops')") == 1

    def job(worker: timely.Worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.map(lambda x: x).probe()
        worker.metrics.track("out", out, wall_of)
        inp.send_batch(list(range(10)))
        inp.advance_to(1)
        worker.step_while(lambda: out.less_than(1))
        snap = worker.metrics.snapshot()  # raised KeyError: every report of the worker was dropped
        inp.close()
        worker.step_while(lambda: not out.done())
        return snap["lags"], sum(r[3] for r in snap["operators"] if r[2].startswith("Map"))

    assert timely.execute(job, workers=1)[0] == ({"out": {"frontier": 1, "lag_s": None}}, 10)


# -- 6. the launcher's values ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--metrics-interval", "inf"], "--metrics-interval must be a positive, finite number of seconds, not inf"),
    (["--autobalance", "window=inf"], "--autobalance: window must be a whole number of evaluations, not inf"),
    (["--autobalance", "hold=inf"], "--autobalance: hold must be a whole number of evaluations, not inf"),
    (["--autobalance", "hold=2.7"], "--autobalance: hold must be a whole number of evaluations, not 2.7"),
    (["--autobalance", "window=nan"], "--autobalance: window must be a whole number of evaluations, not nan"),
])
def test_the_launcher_refuses_values_that_are_no_numbers_of_their_kind(tmp_path, capsys, argv, message):
    job = tmp_path / "job.py"
    job.write_text("def main(worker):\n    pass\n")
    assert launch_main([*argv, str(job)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_autobalancer_refuses_a_fraction_of_an_evaluation():
    hub = _Hub({"mine": 16})
    worker = types.SimpleNamespace(metrics=types.SimpleNamespace(hub=hub))
    for knob in ("hold", "window"):
        with pytest.raises(ValueError, match=f"{knob} must be a whole number of evaluations, not 2.7"):
            AutoBalancer(Controller(FakeControl(k=4, peers=2), FakeProbe()), worker, **{knob: 2.7})
    assert AutoBalancer(Controller(FakeControl(k=4, peers=2), FakeProbe()), worker, hold=2.0).policy.hold == 2


# -- minor: the dashboard's refusals and the ports bound --------------------------------------------------
class _Controller:
    peers, nbins, busy, migrations = 2, 4, False, 0
    current_table = planned_table = (0, 1, 0, 1)

    def __init__(self) -> None:
        self.started: list = []
        self.events: list = []

    def add_poller(self, poll) -> None:
        pass

    def rebalance(self, target, strategy):
        self.started.append(list(target))
        return len(self.started)


@pytest.mark.parametrize("req, message", [
    ({"balanced": "no"}, "'balanced' must be true or false, not 'no'"),
    ({"balanced": 1}, "'balanced' must be true or false, not 1"),
    ({"moves": []}, "'moves' is empty: give at least one [bin, worker] pair"),
])
def test_the_dashboard_refuses_a_request_that_asks_for_nothing_clear(req, message):
    c = _Controller()
    with pytest.raises(ValueError, match=re.escape(message)):
        Steering(c).rebalance(req)
    assert c.started == []
    assert Steering(c).rebalance({"balanced": True, "moves": None})["migration"] == 1


def test_a_body_too_large_for_the_dashboard_is_answered_in_json():
    from timely.dashboard import MAX_REQUEST_BYTES, Dashboard

    class _Steering:
        def status(self) -> dict:
            return {}

        def submit(self, req, timeout):
            raise AssertionError("a request too large reached the job")

    dash = Dashboard(types.SimpleNamespace(hub=None, graph=dict), port=0)
    dash.connect(_Steering())
    try:
        conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=15)
        body = b'{"table": [' + b"0," * (MAX_REQUEST_BYTES // 2) + b"0]}"
        try:
            conn.request("POST", "/api/rebalance", body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):  # (the server may answer before it read it all)
            pass
        reply = conn.getresponse()
        assert reply.status == 413 and reply.getheader("Content-Type") == "application/json"
        assert json.loads(reply.read()) == {"ok": False, "error": f"the request body is larger than "
                                                                  f"{MAX_REQUEST_BYTES} bytes"}
        conn.close()
    finally:
        dash.close()


def test_free_ports_are_printed(monkeypatch, capfd):
    """--metrics-port 0 and --dashboard 0 bound a free port that nobody could learn."""
    monkeypatch.setenv(ENV, MetricsConfig(port=0, dashboard=0, interval=0.05).to_env())

    def job(worker: timely.Worker):
        return worker.metrics.servers[0].port, worker.metrics.dashboard.port

    port, dashboard = timely.execute(job, workers=1)[0]
    err = capfd.readouterr().err
    assert f"timely.metrics: the Prometheus endpoint listens on http://127.0.0.1:{port}/metrics\n" in err
    assert f"timely.dashboard: serving on http://127.0.0.1:{dashboard}/\n" in err


def test_the_hub_marks_an_operator_retired_once_every_worker_reports_it_so():
    from timely.metrics import Hub

    def snap(w: int, mono: float, retired: bool) -> dict:
        src = {"kind": "bins", "records": [w, 1], "state": [0, 0], "owned": [], "counters": {}}
        return {"worker": w, "mono": mono, "operators": [], "received_bytes": 0, "backlog_bytes": 0,
                "sources": {"count": {**src, "retired": True} if retired else src}}

    hub = Hub(None, 2)
    hub.put(snap(0, 1.0, True))
    hub.put(snap(1, 1.0, False))
    assert hub.view()["bins"]["count"]["retired"] is False  # worker 1's still runs
    hub.put(snap(1, 2.0, True))
    agg = hub.view()["bins"]["count"]
    assert agg["retired"] is True and agg["records"] == [1, 2]
