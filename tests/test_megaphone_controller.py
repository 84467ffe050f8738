"""The migration controller, its control endpoint and the ``python -m megaphone.rebalance`` CLI.

* Gating logic against a fake control input and a fake probe: a step is issued only once the probe
  has passed the previous step's issue time, one step at a time.
* A live keyed count (``megaphone.state_machine``) driven by a controller on one worker (every table
  maps to worker 0 there, so steps are moves to worker 0: still issued and gated), against a
  sequential count; on two workers (when the process cluster exists) with real moves.
* The endpoint answers table / status / rebalance and rejects bad requests without changing anything;
  the CLI follows a live migration, reports rejections and times out naming the endpoint.
"""
from __future__ import annotations

import functools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import zmq
from conftest import norm
from hypothesis import given, settings
from hypothesis import strategies as st

import megaphone
import timely
from megaphone.control import ControlInput
from megaphone.controller import Controller, StepEvent
from megaphone.endpoint import ControlEndpoint, EndpointError, request
from megaphone.plan import plan
from megaphone.rebalance import main as cli_main
from megaphone.table import TableError, balanced, skewed
from timely.errors import TimelyError

ROOT = Path(__file__).resolve().parent.parent
HAVE_CLUSTER = (ROOT / "timely" / "cluster.py").exists()
STEP_TIMEOUT = 30


# -- fakes ------------------------------------------------------------------------------------

class FakeControl:
    """Records what the controller sends; ``time`` and ``closed`` are set by the test."""

    def __init__(self, k: int = 3, peers: int = 3) -> None:
        self.k = k
        self.nbins = 1 << k
        self.peers = peers
        self.time = 0
        self.closed = False
        self.sent: list[tuple[int, dict]] = []

    def moves(self, assignment):
        self.sent.append((self.time, dict(assignment)))


class FakeProbe:
    """A probe whose frontier is a single time set by the test (``None``: complete)."""

    def __init__(self) -> None:
        self.frontier = 0

    def less_equal(self, t) -> bool:
        return self.frontier is not None and self.frontier <= t


# -- gating ------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_steps_issued_one_at_a_time_after_the_previous_completes():
    control, probe = FakeControl(), FakeProbe()
    log = []
    ctl = Controller(control, probe, on_progress=lambda ev, what: log.append((what, ev.index, ev.issue_time)))
    assert not ctl.busy and not ctl.tick()
    mid = ctl.start([{0: 1}, {3: 2, 4: 0}, {0: 2}])
    assert mid == 0 and ctl.busy
    assert ctl.planned_table == (2, 1, 2, 2, 0, 2, 0, 1) and ctl.current_table == (0, 1, 2, 0, 1, 2, 0, 1)

    control.time = 5
    assert ctl.tick()  # nothing in flight: step 0 goes out at the current control time
    assert control.sent == [(5, {0: 1})]
    assert ctl.current_table[0] == 1 and ctl.in_flight.issue_time == 5
    for frontier in (0, 3, 5):  # the probe has not passed 5: no new step, however often we tick
        probe.frontier = frontier
        control.time += 1
        assert not ctl.tick()
    assert len(control.sent) == 1 and ctl.in_flight.index == 0
    probe.frontier = 6  # step 0 complete (and everything before it drained)
    control.time = 9
    assert ctl.tick()
    assert control.sent[-1] == (9, {3: 2, 4: 0})
    assert log == [("issued", 0, 5), ("completed", 0, 5), ("issued", 1, 9)]
    assert not ctl.tick()  # probe at 6 <= 9
    probe.frontier = 10
    control.time = 12
    assert ctl.tick() and control.sent[-1] == (12, {0: 2})
    probe.frontier = None
    assert not ctl.tick() and not ctl.busy
    assert ctl.current_table == ctl.planned_table
    assert [e.state for e in ctl.events] == ["completed"] * 3
    assert [e.issue_time for e in ctl.completed] == [5, 9, 12]
    assert all(e.duration is not None and e.duration >= 0 and e.completed_at >= e.issued_at for e in ctl.events)
    assert ctl.events[1].bins == [3, 4]


@pytest.mark.timeout(30)
def test_rebalance_plans_from_the_planned_table_and_validates():
    control, probe = FakeControl(k=3, peers=3), FakeProbe()
    ctl = Controller(control, probe)
    start = ctl.current_table
    target = skewed(start, peers=3)
    m0 = ctl.rebalance(target, "batched")
    assert ctl.planned_table == target
    m1 = ctl.rebalance(balanced(8, 3), "fluid")  # back again, queued behind the first migration
    assert (m0, m1) == (0, 1) and ctl.planned_table == start
    assert [len(e.moves) for e in ctl.events if e.migration == 1] == [1] * len(
        plan(target, start, "fluid"))
    before = list(ctl.events)
    for bad, msg in [({9: 0}, r"step 1: move of bin 9 to worker 0: bin 9 does not exist \(there are 8 bins\)"),
                     ({0: 3}, r"worker 3 does not exist \(there are 3 workers\)"),
                     ({0: -1}, "worker -1 does not exist"), ({True: 0}, "bin True is not an integer")]:
        with pytest.raises(TableError, match=msg):
            ctl.start([{1: 0}, bad])
    with pytest.raises(ValueError, match="unknown migration strategy"):
        ctl.rebalance(start, "sideways")
    with pytest.raises(TableError, match="expected one per bin"):
        ctl.rebalance([0, 1], "fluid")
    with pytest.raises(TableError, match="target table, bin 2: worker 5 does not exist"):
        ctl.rebalance([0, 0, 5, 0, 0, 0, 0, 0], "fluid")
    assert ctl.events == before and ctl.planned_table == start  # nothing queued by a bad request
    assert ctl.start([{}, {}]) == 2 and len(ctl.events) == len(before)  # empty steps are dropped
    with pytest.raises(TableError, match="one per bin"):
        Controller(control, probe, table=[0, 1])
    with pytest.raises(TableError, match=r"initial table, bin 3: worker 3 does not exist \(there are 3 workers\)"):
        Controller(control, probe, table=[0, 1, 2, 3, 0, 1, 2, 0])


@pytest.mark.timeout(30)
def test_no_step_is_issued_on_a_closed_control_input():
    control, probe = FakeControl(), FakeProbe()
    ctl = Controller(control, probe)
    ctl.start([{0: 1}])
    control.closed = True
    assert not ctl.tick() and control.sent == [] and ctl.busy


# -- the control input ---------------------------------------------------------------------------

def control_input_job(worker):
    """Invalid updates on a live control input, then valid ones; returns the errors and the records."""
    with worker.dataflow() as scope:
        control = ControlInput(scope, k=2)
        captured = control.stream.capture()
        probe = control.stream.probe()
        errors = []
        for kwargs in ({"k": 17}, {"k": -1}, {"k": True}):
            try:
                ControlInput(scope, **kwargs)
            except TableError as e:
                errors.append(str(e))
        old = ControlInput(scope, k=3)
    for bad in (lambda: control.move(4, 0), lambda: control.move(0, 1), lambda: control.moves({0: 0, 1: 5}),
                lambda: control.install([0, 0, 0]), lambda: control.install([0, 0, 0, "0"])):
        try:
            bad()
        except TableError as e:
            errors.append(str(e))
    control.moves({3: 0, 1: 0})
    control.advance_to(1)
    control.install([0, 0, 0, 0])
    control.close()
    old.close()
    closed = control.closed
    worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
    return {"errors": errors, "records": captured.extract(), "closed": closed, "old": (old.k, old.nbins)}


@pytest.mark.timeout(60)
def test_control_input_validates_before_sending():
    [res] = timely.execute(control_input_job, workers=1)
    assert res["errors"] == [
        "k is the exponent of 2^k bins, an integer from 0 to 16, not 17",
        "k is the exponent of 2^k bins, an integer from 0 to 16, not -1",
        "k is the exponent of 2^k bins, an integer from 0 to 16, not True",
        "move of bin 4 to worker 0: bin 4 does not exist (there are 4 bins)",
        "move of bin 0 to worker 1: worker 1 does not exist (there are 1 workers)",
        "move of bin 1 to worker 5: worker 5 does not exist (there are 1 workers)",
        "routing table has 3 entries, expected one per bin (4)",
        "routing table, bin 3: worker '0' is not an integer",
    ]
    # Nothing of a rejected call entered the dataflow (not even the valid move of {0: 0, 1: 5}).
    assert [(t, sorted(batch)) for t, batch in res["records"]] == [
        (0, [("move", 1, 0), ("move", 3, 0)]), (1, [("table", (0, 0, 0, 0))])]
    assert res["closed"] and res["old"] == (3, 8)


# -- a live keyed count ------------------------------------------------------------------------

def count_fold(key, value, state):
    n = (state or 0) + value
    return n, [(key, n)]


def sequential_count(epochs):
    """Per (time, key): the records' count and the key's running total at the end of that time."""
    totals: Counter = Counter()
    out: dict = {}
    for t, records in enumerate(epochs):
        for k, v in records:
            totals[k] += v
            n, _ = out.get((t, k), (0, 0))
            out[t, k] = (n + 1, totals[k])
    return out


def observed_count(outputs):
    """The same summary from ``(time, key, running count)`` outputs: one output per applied record,
    the largest being the total after the time (within a time, records of a key may apply in any
    order, so the intermediate values depend on it; the final one does not)."""
    out: dict = {}
    for t, k, c in outputs:
        n, m = out.get((t, k), (0, None))
        out[t, k] = (n + 1, c if m is None else max(m, c))
    return out


def count_job(worker, k: int, epochs: list, steps=None, target=None, strategy: str = "batched"):
    """A keyed count with a controller on worker 0 running ``steps`` or a rebalance to ``target``.

    Data keeps arriving while the migration runs; worker 0 keeps advancing (with no data) until the
    migration has completed. Returns outputs, the controller's events, a log of gating checks, the
    compiled routing table and the bins this worker holds.
    """
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = ControlInput(scope, k=k)
        m = megaphone.state_machine(data.stream, control, 0, count_fold)
        captured = m.stream.capture()
    violations: list[str] = []
    ctl: Controller | None = None
    if worker.index == 0:
        def check(ev: StepEvent, what: str) -> None:
            if what == "issued" and ev.index > 0:
                assert ctl is not None
                prev = [e for e in ctl.events if e.migration == ev.migration and e.index == ev.index - 1][0]
                if prev.state != "completed" or m.probe.less_equal(prev.issue_time):
                    violations.append(f"step {ev.index} issued before step {ev.index - 1} completed")
            if what == "completed" and m.probe.less_equal(ev.issue_time):
                violations.append(f"step {ev.index} marked complete while the probe is at {m.probe.frontier}")

        ctl = Controller(control, m.probe, on_progress=check)
        if steps is not None:
            ctl.start(steps)
        if target is not None:
            ctl.rebalance(target, strategy)
    epoch = 0
    deadline = time.monotonic() + STEP_TIMEOUT
    while epoch < len(epochs) or (ctl is not None and ctl.busy):
        if epoch < len(epochs):
            data.send_batch(epochs[epoch][worker.index::worker.peers])
        epoch += 1
        data.advance_to(epoch)
        control.advance_to(epoch)
        if ctl is not None:
            ctl.tick()
        worker.step_while(lambda: m.probe.less_than(epoch - 2), timeout=STEP_TIMEOUT)
        if time.monotonic() > deadline:
            raise TimeoutError("migration did not complete")
    data.close()
    control.close()
    worker.step_while(lambda: not m.probe.done(), timeout=STEP_TIMEOUT)
    return {
        "outputs": [(t, *r) for t, batch in captured.extract() for r in batch],
        "events": [e.as_dict() for e in ctl.events] if ctl else [],
        "violations": violations,
        "table": list(m.routing_table()),
        "owned": m.owned_bins(),
        "log": [(e["kind"], e["time"], e["bins"]) for e in m.events],
    }


keys = st.one_of(st.integers(0, 40), st.sampled_from(["a", "b", "c", "dd"]))
epochs_st = st.lists(st.lists(st.tuples(keys, st.integers(1, 3)), max_size=15), min_size=1, max_size=12)


@pytest.mark.timeout(120)
@settings(max_examples=15, deadline=None)
@given(k=st.integers(4, 6), epochs=epochs_st, seed=st.integers(0, 2**16))
def test_live_count_with_controller_one_worker(k, epochs, seed):
    rng = random.Random(seed)
    nbins = 1 << k
    steps = [{b: 0 for b in rng.sample(range(nbins), rng.randint(1, 4))} for _ in range(rng.randint(1, 5))]
    [res] = timely.execute(functools.partial(count_job, k=k, epochs=epochs, steps=steps), workers=1)
    assert res["violations"] == []
    assert observed_count(res["outputs"]) == sequential_count(epochs)
    evs = res["events"]
    assert len(evs) == len(steps) and all(e["state"] == "completed" for e in evs)
    assert [e["moves"] for e in evs] == [sorted([b, w] for b, w in s.items()) for s in steps]
    times = [e["issue_time"] for e in evs]
    assert times == sorted(set(times)), "steps are issued at distinct, increasing times"
    assert res["table"] == [0] * nbins


# -- the endpoint --------------------------------------------------------------------------------

def ask(ctl: Controller, ep: ControlEndpoint, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw ``payload`` to the endpoint and tick the controller until the reply arrives."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(ep.endpoint)
        s.send(payload)
        deadline = time.monotonic() + timeout
        while not s.poll(5):
            ctl.tick()
            assert time.monotonic() < deadline, "no reply from the endpoint"
        return s.recv()
    finally:
        s.close(0)


def ask_msgpack(ctl, ep, req):
    return msgpack.unpackb(ask(ctl, ep, msgpack.packb(req)), raw=False, strict_map_key=False)


def ask_json(ctl, ep, req):
    return json.loads(ask(ctl, ep, json.dumps(req).encode()))


@pytest.fixture
def fake_endpoint():
    control, probe = FakeControl(k=3, peers=3), FakeProbe()
    ctl = Controller(control, probe)
    ep = ControlEndpoint(ctl, "tcp://127.0.0.1:*")
    try:
        yield ctl, ep, control, probe
    finally:
        ep.close()


@pytest.mark.timeout(30)
def test_endpoint_table_status_rebalance(fake_endpoint):
    ctl, ep, control, probe = fake_endpoint
    assert ep.endpoint.startswith("tcp://127.0.0.1:")
    r = ask_msgpack(ctl, ep, {"op": "table"})
    assert r == {"ok": True, "table": [0, 1, 2, 0, 1, 2, 0, 1], "planned": [0, 1, 2, 0, 1, 2, 0, 1],
                 "nbins": 8, "peers": 3}
    r = ask_json(ctl, ep, {"op": "rebalance", "table": [0, 0, 0, 0, 1, 2, 0, 1], "strategy": "fluid"})
    assert r == {"ok": True, "migration": 0, "steps": 2, "moves": 2, "strategy": "fluid"}
    # The tick that answered the request also issued the first step (nothing was in flight).
    assert control.sent == [(0, {1: 0})]
    assert not ctl.tick()  # the probe has not passed time 0
    s = ask_msgpack(ctl, ep, {"op": "status"})
    assert s["ok"] and s["busy"] and not s["done"] and s["steps"] == 2
    assert [e["bins"] for e in s["in_flight"]] == [[1]] and [e["bins"] for e in s["queued"]] == [[2]]
    assert s["in_flight"][0]["elapsed"] >= 0
    probe.frontier = 1
    control.time = 1
    ctl.tick()
    probe.frontier = 2
    ctl.tick()
    s = ask_json(ctl, ep, {"op": "status", "migration": 0})
    assert s["done"] and [e["bins"] for e in s["completed"]] == [[1], [2]]
    assert all(e["duration"] >= 0 for e in s["completed"])
    s = ask_json(ctl, ep, {"op": "status", "migration": 0, "since": 1})  # paging: from the 2nd on
    assert [e["bins"] for e in s["completed"]] == [[2]] and s["completed_count"] == 2
    s = ask_msgpack(ctl, ep, {"op": "status", "limit": 1})
    assert [e["bins"] for e in s["completed"]] == [[1]] and s["completed_count"] == 2
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "moves": {3: 2, 5: 1}})  # int keys (msgpack)
    assert r["ok"] and r["moves"] == 2 and r["steps"] == 1  # batched: 0->2 and 2->1 form one matching
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": [[3, 2]]})  # already planned there: no step
    assert r["ok"] and r["steps"] == 0
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": {"0": 1}})  # JSON object keys are strings
    assert r["ok"] and r["moves"] == 1
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "balanced": True, "strategy": "all_at_once"})
    assert r["ok"] and r["steps"] == 1
    assert ctl.planned_table == balanced(8, 3)
    assert ask_msgpack(ctl, ep, {"op": "table"})["planned"] == list(balanced(8, 3))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("req, error", [
    ({"op": "explode"}, "unknown op 'explode'"),
    ({"nop": 1}, "unknown op None"),
    ([1, 2], "must be a map"),
    ({"op": "rebalance", "table": [0] * 7}, "7 entries, expected one per bin (8)"),
    ({"op": "rebalance", "table": [0] * 7 + [3]}, "target table, bin 7: worker 3 does not exist (there are 3 workers)"),
    ({"op": "rebalance", "table": [0] * 7 + ["x"]}, "worker 'x' is not an integer"),
    ({"op": "rebalance", "table": "0,1"}, "'table' must be a list"),
    ({"op": "rebalance", "moves": [[8, 0]]}, "bin 8 does not exist (there are 8 bins)"),
    ({"op": "rebalance", "moves": [[1, -1]]}, "worker -1 does not exist"),
    ({"op": "rebalance", "moves": [[1, 0], [2, 3]]}, "move of bin 2 to worker 3: worker 3 does not exist"),
    ({"op": "rebalance", "moves": [[1]]}, "not a [bin, worker] pair"),
    ({"op": "rebalance", "moves": 5}, "'moves' must be"),
    ({"op": "rebalance"}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "moves": [[0, 1]]}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "strategy": "sudden"}, "unknown strategy 'sudden'"),
    ({"op": "status", "migration": 4}, "migration 4 does not exist"),
    ({"op": "status", "since": -1}, "'since' must be >= 0"),
    ({"op": "status", "limit": "all"}, "limit 'all' is not an integer"),
])
def test_endpoint_rejects_bad_requests(fake_endpoint, req, error):
    ctl, ep, control, probe = fake_endpoint
    before = (ctl.planned_table, len(ctl.events))
    r = ask_msgpack(ctl, ep, req)
    assert r["ok"] is False and error in r["error"]
    r = ask_json(ctl, ep, req) if isinstance(req, dict) else r
    assert r["ok"] is False and error in r["error"]
    assert (ctl.planned_table, len(ctl.events)) == before and control.sent == []


@pytest.mark.timeout(30)
def test_endpoint_rejects_undecodable_payloads(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    assert "not valid JSON" in json.loads(ask(ctl, ep, b"{not json"))["error"]
    r = msgpack.unpackb(ask(ctl, ep, b"\xc1"), raw=False)
    assert r["ok"] is False and "not valid msgpack" in r["error"]


@pytest.mark.timeout(30)
def test_endpoint_poll_never_blocks(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    t0 = time.monotonic()
    for _ in range(200):
        ctl.tick()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(EndpointError, match="cannot bind"):
        ControlEndpoint(ctl, ep.endpoint)  # the address is taken


# -- the CLI ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "megaphone.rebalance", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


class FakeJob:
    """A fake job in a thread: control time advances and the probe follows it two ticks behind."""

    def __init__(self, k: int = 3, peers: int = 3) -> None:
        self.control, self.probe = FakeControl(k, peers), FakeProbe()
        self.ctl = Controller(self.control, self.probe)
        self.ep = ControlEndpoint(self.ctl, "tcp://127.0.0.1:*")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.control.time += 1
            self.probe.frontier = self.control.time - 2
            self.ctl.tick()
            time.sleep(0.002)

    def __enter__(self) -> FakeJob:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ep.close()


@pytest.mark.timeout(90)
def test_cli_follows_a_migration_to_completion():
    with FakeJob(k=3, peers=3) as job:
        r = run_cli("--endpoint", job.ep.endpoint, "--table", "2,2,2,0,0,0,1,1", "--strategy", "batched",
                    "--status")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        steps = plan(balanced(8, 3), [2, 2, 2, 0, 0, 0, 1, 1], "batched")
        assert lines[0] == f"migration 0: {sum(map(len, steps))} bins in {len(steps)} steps (batched)"
        step_lines = [ln for ln in lines if ln.startswith("step ")]
        assert len(step_lines) == len(steps)
        for i, (ln, step) in enumerate(zip(step_lines, steps)):
            assert ln.startswith(f"step {i + 1}/{len(steps)}: {len(step)} bins {sorted(step)}".replace("'", ""))
            assert ln.endswith(" ms")
        assert any(ln.startswith("migration 0 complete") for ln in lines)
        assert "table (8 bins, 3 workers): 2,2,2,0,0,0,1,1" in r.stdout
        assert job.ctl.current_table == (2, 2, 2, 0, 0, 0, 1, 1) and not job.ctl.busy

        r = run_cli("--endpoint", job.ep.endpoint, "--move", "0:1", "--move", "7:0", "--strategy", "fluid")
        assert r.returncode == 0, r.stderr
        assert "migration 1: 2 bins in 2 steps (fluid)" in r.stdout
        assert job.ctl.current_table == (1, 2, 2, 0, 0, 0, 1, 0)

        r = run_cli("--endpoint", job.ep.endpoint, "--balanced", "--no-wait")
        assert r.returncode == 0 and "migration 2:" in r.stdout
        r = run_cli("--endpoint", job.ep.endpoint, "--status")
        assert r.returncode == 0 and "table (8 bins, 3 workers)" in r.stdout

        r = run_cli("--endpoint", job.ep.endpoint, "--move", "3:7")
        assert r.returncode == 1
        assert "rejected" in r.stderr and "worker 7 does not exist" in r.stderr


@pytest.mark.timeout(60)
def test_cli_times_out_naming_the_endpoint():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = run_cli("--endpoint", endpoint, "--balanced", "--timeout", "0.5")
    assert r.returncode == 3
    assert f"control endpoint {endpoint} did not answer within 0.5 s" in r.stderr
    assert time.monotonic() - t0 < 30
    r = run_cli("--endpoint", endpoint)
    assert r.returncode == 2 and "give --table, --balanced, --move or --status" in r.stderr
    r = run_cli("--endpoint", endpoint, "--move", "3-1")
    assert r.returncode == 2 and "BIN:WORKER" in r.stderr


def endpoint_job(worker, k: int, ready: threading.Event, stop: threading.Event, box: dict):
    """A live one-worker keyed count exposing a control endpoint until ``stop`` is set."""
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = ControlInput(scope, k=k)
        m = megaphone.state_machine(data.stream, control, 0, count_fold)
        captured = m.stream.capture()
    ctl = Controller(control, m.probe)
    ep = ControlEndpoint(ctl, "tcp://127.0.0.1:*", routing_table=m.routing_table)
    box["endpoint"] = ep.endpoint
    box["controller"] = ctl
    ready.set()
    epoch, sent = 0, []
    try:
        while not stop.is_set() or ctl.busy:
            records = [(epoch % 5, 1), (epoch % 3, 1)]
            sent.append(records)
            data.send_batch(records)
            epoch += 1
            data.advance_to(epoch)
            control.advance_to(epoch)
            ctl.tick()
            worker.step_while(lambda: m.probe.less_than(epoch - 2), timeout=STEP_TIMEOUT)
            time.sleep(0.001)
    finally:
        ep.close()
    data.close()
    control.close()
    worker.step_while(lambda: not m.probe.done(), timeout=STEP_TIMEOUT)
    box["sent"] = sent
    box["outputs"] = [(t, *r) for t, batch in captured.extract() for r in batch]
    return None


@pytest.mark.timeout(90)
def test_cli_against_a_live_job():
    ready, stop, box = threading.Event(), threading.Event(), {}
    errors: list[BaseException] = []

    def target():
        try:
            timely.execute(functools.partial(endpoint_job, k=4, ready=ready, stop=stop, box=box), workers=1)
        except BaseException as e:  # surfaced below
            errors.append(e)
            ready.set()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        assert ready.wait(30) and not errors, errors
        ep = box["endpoint"]
        r = run_cli("--endpoint", ep, "--status")
        assert r.returncode == 0, r.stderr
        assert f"table (16 bins, 1 workers): {','.join(['0'] * 16)}" in r.stdout
        assert f"operator routing table: {','.join(['0'] * 16)}" in r.stdout
        # One worker: every table maps to worker 0, so a rebalance has no moves ...
        r = run_cli("--endpoint", ep, "--balanced")
        assert r.returncode == 0 and "migration 0: 0 bins in 0 steps" in r.stdout, r.stderr
        # ... and a move elsewhere is rejected, changing nothing.
        r = run_cli("--endpoint", ep, "--move", "3:1")
        assert r.returncode == 1 and "worker 1 does not exist (there are 1 workers)" in r.stderr
        reply = request(ep, {"op": "table"}, 10)
        assert reply["ok"] and reply["routing_table"] == [0] * 16
        # The endpoint keeps the job running: data flowed the whole time.
        s = request(ep, {"op": "status"}, 10)
        assert s["ok"] and s["control_time"] > 0
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    assert observed_count(box["outputs"]) == sequential_count(box["sent"])


@pytest.mark.timeout(30)
def test_cli_main_in_process_reports_timeout(capsys):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    assert cli_main(["--endpoint", endpoint, "--status", "--timeout", "0.2"]) == 3
    assert endpoint in capsys.readouterr().err
    assert cli_main(["--endpoint", "nowhere://at-all", "--balanced"]) == 3  # cannot even connect
    assert "cannot talk to control endpoint nowhere://at-all" in capsys.readouterr().err
    with pytest.raises(EndpointError) as e:
        request("nowhere://at-all", {"op": "table"})
    assert isinstance(e.value, TimelyError) and isinstance(e.value, OSError)


# -- two workers: real moves (needs the process cluster) -------------------------------------

two_workers = pytest.mark.skipif(not HAVE_CLUSTER, reason="timely/cluster.py (multi-process cluster) not there yet")


@two_workers
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["all_at_once", "fluid", "batched"])
def test_two_workers_rebalance_moves_bins(strategy):
    k = 4
    rng = random.Random(7)
    epochs = [[(rng.randrange(60), 1) for _ in range(40)] for _ in range(10)]
    start = balanced(1 << k, 2)
    target = skewed(start)
    results = timely.execute(
        functools.partial(count_job, k=k, epochs=epochs, target=target, strategy=strategy), workers=2)
    assert all(r["violations"] == [] for r in results)
    outputs = [o for r in results for o in r["outputs"]]
    assert observed_count(outputs) == sequential_count(epochs)
    evs = results[0]["events"]
    assert len(evs) == len(plan(start, target, strategy)) and all(e["state"] == "completed" for e in evs)
    for r in results:
        assert list(norm(r["table"])) == list(target)
    owned = [b for r in results for b in r["owned"]]
    assert sorted(owned) == list(range(1 << k)), "every bin lives on exactly one worker"
    assert all(target[b] == w for w, r in enumerate(results) for b in r["owned"])


@two_workers
@pytest.mark.timeout(300)
@settings(max_examples=4, deadline=None)
@given(epochs=epochs_st, seed=st.integers(0, 2**16), strategy=st.sampled_from(["all_at_once", "fluid", "batched"]))
def test_two_workers_random_plans(epochs, seed, strategy):
    k = 3
    rng = random.Random(seed)
    target = [rng.randrange(2) for _ in range(1 << k)]
    results = timely.execute(
        functools.partial(count_job, k=k, epochs=epochs, target=target, strategy=strategy), workers=2)
    assert all(r["violations"] == [] for r in results)
    assert observed_count([o for r in results for o in r["outputs"]]) == sequential_count(epochs)
    assert all(list(norm(r["table"])) == target for r in results)
    assert sorted(b for r in results for b in r["owned"]) == list(range(1 << k))


def cli_cluster_job(worker, k: int, port: int, epochs: int):
    """Worker 0 serves a control endpoint on ``port`` and runs until one migration requested through
    it has completed (or 60 s pass); the other workers send their data and close their inputs."""
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = ControlInput(scope, k=k)
        m = megaphone.state_machine(data.stream, control, 0, count_fold)
        captured = m.stream.capture()
    sent = []
    if worker.index == 0:
        ctl = Controller(control, m.probe)
        ep = ControlEndpoint(ctl, f"tcp://127.0.0.1:{port}", routing_table=m.routing_table)
        deadline = time.monotonic() + 60
        epoch = 0
        try:
            while time.monotonic() < deadline and not (ctl.events and not ctl.busy):
                records = [(f"k{(epoch * 7 + i) % 50}", 1) for i in range(10)] if epoch < epochs else []
                sent.append(records)
                data.send_batch(records)
                epoch += 1
                data.advance_to(epoch)
                control.advance_to(epoch)
                ctl.tick()
                worker.step_while(lambda: m.probe.less_than(epoch - 2), timeout=STEP_TIMEOUT)
                time.sleep(0.002)
            for _ in range(20):  # answer the CLI's last status polls
                ctl.tick()
                time.sleep(0.01)
        finally:
            ep.close()
    data.close()
    control.close()
    worker.step_while(lambda: not m.probe.done(), timeout=STEP_TIMEOUT)
    return {"sent": sent, "outputs": [(t, *r) for t, batch in captured.extract() for r in batch],
            "table": list(m.routing_table()), "owned": m.owned_bins()}


@two_workers
@pytest.mark.timeout(300)
def test_cli_against_a_live_two_worker_job():
    k, port = 4, free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    box: dict = {}

    def target():
        try:
            box["results"] = timely.execute(
                functools.partial(cli_cluster_job, k=k, port=port, epochs=200), workers=2)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for the job to come up
            try:
                assert request(endpoint, {"op": "table"}, 0.5)["ok"]
                break
            except Exception:
                assert time.monotonic() < deadline and "error" not in box, box.get("error")
        goal = skewed(balanced(1 << k, 2))
        r = run_cli("--endpoint", endpoint, "--table", ",".join(map(str, goal)), "--strategy", "batched",
                    "--timeout", "20")
        assert r.returncode == 0, r.stderr
        steps = plan(balanced(1 << k, 2), goal, "batched")
        assert len([ln for ln in r.stdout.splitlines() if ln.startswith("step ")]) == len(steps)
    finally:
        t.join(120)
    assert not t.is_alive() and "error" not in box, box.get("error")
    results = box["results"]
    sent = results[0]["sent"]
    assert observed_count([o for r in results for o in r["outputs"]]) == sequential_count(sent)
    assert all(list(norm(r["table"])) == list(goal) for r in results)
    assert all(goal[b] == w for w, r in enumerate(results) for b in r["owned"])
