"""The migration controller (``megaphone.controller``) and the control input it drives.

* Gating logic against a fake control input and a fake probe: a step is issued only once the probe
  has passed the previous step's issue time, one step at a time.
* A live keyed count (``megaphone.state_machine``) driven by a controller on one worker (every table
  maps to worker 0 there, so steps are moves to worker 0: still issued and gated), against a
  sequential count; on two workers with real moves.
"""
from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest
from conftest import norm
from hypothesis import given, settings
from hypothesis import strategies as st
from megaphone_jobs import STEP_TIMEOUT, FakeControl, FakeProbe, LiveCount, observed_count, sequential_count

import timely
from megaphone.control import ControlInput
from megaphone.controller import Controller, StepEvent
from megaphone.plan import plan
from megaphone.table import TableError, balanced, skewed, validate_move, validate_table, validate_update


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
    assert list(ctl.events) == before and ctl.planned_table == start  # nothing queued by a bad request
    assert ctl.start([{}, {}]) == 2 and len(ctl.events) == len(before)  # empty steps are dropped
    with pytest.raises(TableError, match="one per bin"):
        Controller(control, probe, table=[0, 1])
    with pytest.raises(TableError, match=r"initial table, bin 3: worker 3 does not exist \(there are 3 workers\)"):
        Controller(control, probe, table=[0, 1, 2, 3, 0, 1, 2, 0])


@pytest.mark.timeout(30)
def test_start_checks_the_shape_of_its_steps_and_queues_nothing_on_error():
    """``start`` takes a sequence of ``{bin: worker}`` mappings or lists of ``(bin, worker)``
    pairs; anything else, or a bin moved to two workers in one step (which the control input and
    the endpoint refuse), is a :class:`TableError` naming the step, and nothing is queued."""
    control, probe = FakeControl(k=3, peers=3), FakeProbe()
    ctl = Controller(control, probe)
    for bad, msg in [({0: 1}, "steps must be a sequence of steps .* not dict"),
                     ("ab", "steps must be a sequence .* not str 'ab'"),
                     (5, "steps must be a sequence .* not int 5"),
                     ([{0: 1}, 5], r"step 1: expected a \{bin: worker\} mapping or a list of \(bin, worker\) pairs, not int 5"),
                     ([{0: 1}, "01"], "step 1: expected .* not str '01'"),
                     ([[(3, 1), (3, 2)]], "step 0: bin 3 is moved to both worker 1 and worker 2"),
                     ([{0: 1}, [(3, 1), (3, np.int64(2))]], "step 1: bin 3 is moved to both worker 1 and worker 2"),
                     ([[(3, 1, 0)]], r"step 0: move \(3, 1, 0\) is not a \(bin, worker\) pair"),
                     ([[3]], "step 0: move 3 is not a .bin, worker. pair"),
                     ([["ab"]], "step 0: move 'ab' is not a .bin, worker. pair"),
                     ([[(9, 1)]], "step 0: move of bin 9 to worker 1: bin 9 does not exist")]:
        with pytest.raises(TableError, match=msg):
            ctl.start(bad)
        assert not ctl.busy and list(ctl.events) == [] and ctl.migrations == 0  # nothing queued
    assert ctl.planned_table == ctl.current_table
    # Pairs (also a numpy array of them, or the same move twice) and mappings, mixed:
    mid = ctl.start([[(3, 1), (3, 1)], {4: 2}, np.array([[0, 2], [1, 0]]), []])
    assert mid == 0 and [e.moves for e in ctl.events] == [{3: 1}, {4: 2}, {0: 2, 1: 0}]
    assert all(type(b) is int and type(w) is int for e in ctl.events for b, w in e.moves.items())


@pytest.mark.timeout(30)
def test_no_step_is_issued_on_a_closed_control_input():
    """Steps not issued when the control input closes are abandoned, so the controller is no
    longer busy (they stayed queued, and a driver looping `while controller.busy` spun for ever);
    a step in flight still completes."""
    from megaphone.endpoint import status

    control, probe = FakeControl(), FakeProbe()
    seen = []
    ctl = Controller(control, probe, on_progress=lambda ev, what: seen.append((ev.index, what)))
    ctl.start([{0: 1}, {1: 1}, {2: 1}])
    assert ctl.tick() and len(control.sent) == 1  # the first step in flight
    control.closed = True
    assert not ctl.tick() and len(control.sent) == 1 and ctl.busy  # (the first is still in flight)
    assert [e.state for e in ctl.events] == ["in_flight", "abandoned", "abandoned"]
    assert seen == [(0, "issued"), (1, "abandoned"), (2, "abandoned")]
    probe.frontier = control.time + 1
    assert not ctl.tick() and not ctl.busy
    assert [e.state for e in ctl.events] == ["completed", "abandoned", "abandoned"]
    s = status(ctl)
    assert s["done"] and s["abandoned_count"] == 2 and s["completed_count"] == 1 and not s["busy"]
    # A migration asked for afterwards is refused (it was queued, and stayed 'queued' for ever).
    with pytest.raises(TableError, match="the control input is closed"):
        ctl.rebalance([1] * ctl.nbins)
    assert ctl.migrations == 1


def test_a_migration_with_nothing_to_move_is_done_not_trimmed_and_copying_steps_show():
    from megaphone.endpoint import status

    control, probe = FakeControl(), FakeProbe()
    ctl = Controller(control, probe)
    mid = ctl.rebalance(list(ctl.planned_table))
    assert status(ctl, mid) | {} == {**status(ctl, mid), "trimmed": False, "steps": 0, "done": True}
    moved = ctl.start([{0: 1}])
    ctl.events[-1].copy_time = 1  # its bins are being copied ahead (megaphone.precopy)
    s = status(ctl, moved)
    assert [e["state"] for e in s["copying"]] == ["copying"] and not s["queued"] and not s["in_flight"]


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
                lambda: control.install([0, 0, 0]), lambda: control.install([0, 0, 0, "0"]),
                lambda: control.install(None), lambda: control.moves([(0, 0)]),
                lambda: control.move(np.bool_(True), 0), lambda: control.install([0, 0, False, 0])):
        try:
            bad()
        except TableError as e:
            errors.append(str(e))
    control.moves({3: 0, np.int64(1): np.int32(0)})  # numpy integers are bins and workers too
    control.advance_to(1)
    control.install(np.zeros(4, dtype=np.int64))
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
        "control input 'Control', move(): move of bin 4 to worker 0: bin 4 does not exist (there are 4 bins)",
        "control input 'Control', move(): move of bin 0 to worker 1: worker 1 does not exist (there are 1 workers)",
        "control input 'Control', moves(): move of bin 1 to worker 5: worker 5 does not exist (there are 1 workers)",
        "control input 'Control', install(): routing table has 3 entries, expected one per bin (4)",
        "control input 'Control', install(): routing table, bin 3: worker '0' is not an integer",
        "control input 'Control', install(): routing table must be a sequence of 4 workers, one per bin, "
        "not NoneType None",
        "control input 'Control', moves(): expected a {bin: worker} mapping, not list [(0, 0)]",
        "control input 'Control', move(): move of bin np.True_ to worker 0: bin np.True_ is not an integer",
        "control input 'Control', install(): routing table, bin 2: worker False is not an integer",
    ]
    # Nothing of a rejected call entered the dataflow (not even the valid move of {0: 0, 1: 5}), and
    # numpy integers entered it as ints.
    records = [(t, sorted(batch)) for t, batch in res["records"]]
    assert records == [(0, [("move", 1, 0), ("move", 3, 0)]), (1, [("table", (0, 0, 0, 0))])]
    assert all(type(x) is int for _, batch in records for u in batch for x in (u[1:] if u[0] == "move" else u[1]))
    assert res["closed"] and res["old"] == (3, 8)


def test_validation_takes_numpy_integers_as_ints_and_refuses_bools():
    assert validate_move(np.int64(3), np.uint8(1), 4, 2) == (3, 1)
    assert validate_update(("move", np.int32(2), np.int64(0)), 4, 2) == ("move", 2, 0)
    for table in ([np.int64(0), 1, np.int16(1), 0], np.array([0, 1, 1, 0])):
        checked = validate_table(table, 4, 2)
        assert checked == (0, 1, 1, 0) and all(type(w) is int for w in checked)
        assert validate_update(("table", table), 4, 2) == ("table", (0, 1, 1, 0))
    for bad in (np.bool_(True), True, 1.0, "1"):
        with pytest.raises(TableError, match="is not an integer"):
            validate_move(bad, 0, 4, 2)
    with pytest.raises(TableError, match=r"bin 4 does not exist \(there are 4 bins\)"):
        validate_move(np.int64(4), 0, 4, 2)
    with pytest.raises(TableError, match="must be a sequence of 4 workers, one per bin, not NoneType None"):
        validate_table(None, 4, 2)


# -- a live keyed count ------------------------------------------------------------------------

def count_job(worker, k: int, epochs: list, steps=None, target=None, strategy: str = "batched"):
    """A keyed count with a controller on worker 0 running ``steps`` or a rebalance to ``target``.

    Data keeps arriving while the migration runs; worker 0 keeps advancing (with no data) until the
    migration has completed. Returns outputs, the controller's events, a log of gating checks, the
    compiled routing table and the bins this worker holds.
    """
    job = LiveCount(worker, k)
    m = job.machine
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

        ctl = Controller(job.control, m.probe, on_progress=check)
        if steps is not None:
            ctl.start(steps)
        if target is not None:
            ctl.rebalance(target, strategy)
    deadline = time.monotonic() + STEP_TIMEOUT
    while job.epoch < len(epochs) or (ctl is not None and ctl.busy):
        job.advance(epochs[job.epoch][worker.index::worker.peers] if job.epoch < len(epochs) else [], ctl)
        if time.monotonic() > deadline:
            raise TimeoutError("migration did not complete")
    return {
        "outputs": job.finish(),
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


# -- two workers: real moves ------------------------------------------------------------------

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


@pytest.mark.timeout(30)
def test_a_step_the_control_input_refuses_is_issued_again_at_the_next_tick():
    """The control input refuses a step at a time where a conflicting move was sent by hand; the
    error reaches the caller, and the step stays queued (it was taken off the queue first, and
    its event stayed 'queued' for ever)."""

    class Refusing(FakeControl):
        refuse = True

        def moves(self, assignment):
            if self.refuse:
                self.refuse = False
                raise TableError(f"bin 0 is moved to two workers at time {self.time}")
            super().moves(assignment)

    control, probe = Refusing(), FakeProbe()
    ctl = Controller(control, probe)
    ctl.start([{0: 1}, {3: 2}])
    control.time = 5
    with pytest.raises(TableError, match="two workers"):
        ctl.tick()
    assert control.sent == [] and ctl.busy and ctl.in_flight is None
    control.time = 6
    assert ctl.tick() and control.sent == [(6, {0: 1})]
    probe.frontier = 7
    control.time = 8
    assert ctl.tick() and control.sent[-1] == (8, {3: 2})
    probe.frontier = None
    assert not ctl.tick() and not ctl.busy
    assert [e.state for e in ctl.events] == ["completed", "completed"]


@pytest.mark.timeout(30)
def test_a_copy_request_the_control_input_refuses_leaves_the_step_queued():
    class Refusing(FakeControl):
        refuse = True
        copies: list = []

        def precopy(self, assignment):
            if self.refuse:
                self.refuse = False
                raise TableError(f"bin 0 is copied to two workers at time {self.time}")
            self.copies.append((self.time, dict(assignment)))

    control, probe, copied = Refusing(), FakeProbe(), FakeProbe()
    ctl = Controller(control, probe, copied=copied)
    ctl.start([{0: 1}], precopy=True)
    control.time = 5
    with pytest.raises(TableError, match="copied to two workers"):
        ctl.tick()
    assert control.copies == [] and ctl.busy
    control.time = 6
    assert ctl.tick() and control.copies == [(6, {0: 1})]  # copied again, not lost
    copied.frontier = 7  # the copy is staged
    control.time = 7
    assert ctl.tick() and control.sent == [(7, {0: 1})]


def _closed_control_job(worker):
    import megaphone

    errors = []
    with worker.dataflow() as scope:
        control = megaphone.ControlInput(scope, k=2, name="C")
        data = scope.new_input()
        machine = megaphone.state_machine(data.stream, control, 0, lambda k, v, s: (v, [(k, v)]))
    control.close()
    data.close()
    for attempt in (lambda: control.move(1, 0), lambda: control.install([0] * 4)):
        try:
            attempt()
        except timely.InputError as e:
            errors.append(str(e))
    worker.step_while(lambda: not machine.probe.done(), timeout=STEP_TIMEOUT)
    return errors


@pytest.mark.timeout(60)
def test_a_closed_control_input_refuses_moves_and_tables_without_remembering_them():
    # The move was recorded before the closed input refused it: the table after it then failed
    # with "a routing table at time 1 must be the first and only one of its time".
    assert timely.execute(_closed_control_job) == [["control input 'C' is closed"] * 2]
