"""The public operator builder and the Frontier view, as the README shows them."""
from __future__ import annotations

import time

import pytest
from conftest import property_on_workers
from hypothesis import strategies as st

import timely
from timely import Exchange, OperatorBuilder, Summary
from timely.testing import run_epochs


def split_signs(stream: timely.Stream) -> tuple[timely.Stream, timely.Stream]:
    b = OperatorBuilder(stream.scope, "SplitSigns")
    inp = b.new_input(stream, Exchange(None))
    pos, positives = b.new_output()
    neg, negatives = b.new_output()

    def constructor(caps):
        for c in caps:
            c.drop()

        def logic():
            for cap, batch in inp:
                pos.give_batch(cap, [x for x in batch if x >= 0])
                neg.give_batch(cap, [x for x in batch if x < 0])

        return logic

    b.build(constructor)
    return positives, negatives


@property_on_workers(single=15, multi=3,
                     epochs=st.lists(st.lists(st.integers(-9, 9), max_size=10), min_size=1, max_size=3))
def test_a_two_output_operator_splits_like_a_list_comprehension(workers, epochs):
    def build(s):
        positives, negatives = split_signs(s)
        return positives.map(lambda x: ("+", x)).concat(negatives.map(lambda x: ("-", x)))

    want = [(e, sorted([("+", x) for x in r if x >= 0] + [("-", x) for x in r if x < 0]))
            for e, r in enumerate(epochs) if r]
    assert run_epochs(build, epochs, workers=workers) == want


def test_a_delaying_summary_lets_the_operator_send_one_epoch_later():
    def delay(stream):
        b = OperatorBuilder(stream.scope, "Delay")
        inp = b.new_input(stream, connection=[[Summary(1, 1)]])
        out, delayed = b.new_output()

        def constructor(caps):
            caps[0].drop()

            def logic():
                for cap, batch in inp:
                    with cap.delayed(cap.time + 1) as later:
                        out.give_batch(later, list(batch))

            return logic

        b.build(constructor)
        return delayed

    assert run_epochs(delay, [[1, 2], [3]]) == [(1, [1, 2]), (2, [3])]


def test_the_shape_is_frozen_after_build():
    def main(worker):
        with worker.dataflow() as scope:
            b = OperatorBuilder(scope, "Frozen")
            b.new_input(scope.new_input().stream)
            b.build(lambda caps: None)
            with pytest.raises(timely.BuildError, match="Frozen"):
                b.new_output()
            with pytest.raises(timely.BuildError, match="Frozen"):
                b.build(lambda caps: None)

    timely.execute(main)


def test_the_activator_schedules_an_operator_from_outside():
    def main(worker):
        runs = []
        with worker.dataflow() as scope:
            b = OperatorBuilder(scope, "Poller")
            out, stream = b.new_output()
            captured = stream.capture()

            def constructor(caps):
                held = caps[0]

                def logic():
                    runs.append(held.time)
                    if len(runs) == 3:
                        out.give(held, "done")
                        held.drop()

                return logic

            b.build(constructor)
            activator = b.activator
        worker.step()
        assert runs == []  # no input, no frontier interest: runs only when activated
        for _ in range(3):
            activator.activate()
            worker.step()
        worker.step_while(worker.has_dataflows, timeout=10)
        return runs, captured.extract()

    runs, out = timely.execute(main)[0]
    assert runs == [0, 0, 0] and out == [(0, ["done"])]


def test_an_operator_scheduled_for_an_idle_worker_runs_after_the_busy_steps_and_before_parking():
    """``activate_when_idle``: the operator waits while other operators keep the worker busy and
    runs at the first step after one that did nothing, even with a step that may park; a timer
    ``when_idle`` hands it to the same wait once due."""
    def main(worker):
        log = []
        with worker.dataflow() as scope:
            busy = OperatorBuilder(scope, "Busy")
            busy.new_output()
            background = OperatorBuilder(scope, "Background")
            background.new_output()

            def busy_ctor(caps):
                caps[0].drop()
                left = [5]

                def logic():
                    if left[0]:
                        left[0] -= 1
                        log.append("busy")
                        busy.activator.activate()  # again at the next step
                return logic

            def background_ctor(caps):
                held = caps[0]

                def logic():
                    log.append("idle")
                    if log.count("idle") == 1:
                        background.activator.activate_after(0.05, when_idle=True)
                    else:
                        held.drop()
                return logic

            busy.build(busy_ctor)
            background.build(background_ctor)
            busy.activator.activate()
            background.activator.activate_when_idle()
        worker.step_while(worker.has_dataflows, timeout=10)
        return log

    assert timely.execute(main)[0] == ["busy"] * 5 + ["idle", "idle"]


def test_work_waiting_sees_other_scheduled_operators():
    """``Activator.work_waiting``: what background work checks between its pieces. False on a
    worker with nothing else to do; True once another operator is scheduled."""
    def main(worker):
        seen = []
        with worker.dataflow() as scope:
            other = OperatorBuilder(scope, "Other")
            other.new_output()
            background = OperatorBuilder(scope, "Background")
            background.new_output()

            def other_ctor(caps):
                caps[0].drop()
                return lambda: None

            def background_ctor(caps):
                held = caps[0]

                def logic():
                    seen.append(background.activator.work_waiting())
                    other.activator.activate()
                    seen.append(background.activator.work_waiting())
                    held.drop()
                return logic

            other.build(other_ctor)
            background.build(background_ctor)
            background.activator.activate_when_idle()
        worker.step_while(worker.has_dataflows, timeout=10)
        return seen

    assert timely.execute(main)[0] == [False, True]


def test_incoming_sees_a_message_from_a_peer_before_it_is_received():
    """``Allocator.incoming`` on the ZeroMQ cluster: a message worker 1 sent is seen waiting by
    worker 0, which has not stepped (received) since."""
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.exchange(lambda r: r).probe()
        if worker.index == 1:
            inp.send_batch(list(range(100)))
        inp.close()
        if worker.index == 0:
            deadline = time.monotonic() + 10
            while not worker.allocator.incoming() and time.monotonic() < deadline:
                time.sleep(0.001)
            seen = worker.allocator.incoming()
        else:
            seen = None
        worker.step_while(lambda: not probe.done(), timeout=30)
        return seen

    assert timely.execute(main, workers=2, timeout=60)[0] is True


def test_frontier_views_are_live_and_read_only():
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.probe()
        view = probe.frontier
        snapshot = list(view)
        inp.advance_to(3)
        worker.step_while(lambda: probe.less_than(3))
        assert snapshot == [0] and list(view) == [3] and view == [3]
        assert view.less_equal(3) and not view.less_than(3) and not view.is_empty()
        inp.close()
        worker.step_while(lambda: not probe.done())
        assert view.is_empty() and not view and list(view) == []
        assert not hasattr(view, "update_iter")  # a view, not the tracker's counted antichain

    timely.execute(main)
