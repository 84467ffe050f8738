"""Notifications seen from the user API: ``unary_notify`` delivers each time once, in order, only
after its frontier passed and all its records arrived; ``binary_notify`` waits for both inputs.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import property_on_workers, run
from epoch_input import STEP_TIMEOUT, epochs_of, mine
from hypothesis import strategies as st
from oracles import timed, to_zero

from timely.routing import hash64

pytestmark = pytest.mark.timeout(60)


@property_on_workers(epochs=epochs_of(st.integers(0, 30), max_size=10), overlap=st.booleans())
def test_notifications_in_order_once_complete(workers, epochs, overlap):
    """Times are delivered once each (even when requested for every batch), in increasing order, only
    once the frontier has passed them and after all their records arrived; the output sent with the
    delivered capability carries the per-time totals."""

    def main(worker):
        counts = defaultdict(int)
        log = []

        def logic(inp, out, notificator):
            for c, batch in inp:
                counts[c.time] += len(batch)
                notificator.notify_at(c.retain())  # possibly many requests for one time
            for c in notificator:
                log.append((c.time, not inp.frontier.less_equal(c.time), counts[c.time]))
                out.session(c).give((c.time, counts.pop(c.time)))

        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.unary_notify(logic, name="Notify", exchange=None)
            cap = out.capture()
            probe = out.probe()
        for t, recs in epochs:
            inp.advance_to(t)
            part = mine(recs, worker)
            for i in range(0, len(part), 2):  # several batches per time
                inp.send_batch(part[i:i + 2])
                worker.step()
            inp.advance_to(t + 1)
            if not overlap:
                worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
        return log, cap.extract()

    for w, (log, res) in enumerate(run(main, workers)):
        expected = {t: len(recs[w::workers]) for t, recs in epochs if recs[w::workers]}
        times = [t for t, _, _ in log]
        assert times == sorted(expected), f"worker {w}: delivered {times}"
        assert all(passed for _, passed, _ in log), "delivered before the frontier passed"
        assert {t: n for t, _, n in log} == expected, "delivered before all records arrived"
        assert timed(res) == Counter((t, (t, n)) for t, n in expected.items())


@property_on_workers(single=15, multi=2, data=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4))
def test_binary_notify_waits_for_both_inputs(workers, data):
    """With input A ahead of input B, times are not delivered until B passes them too."""
    def main(worker):
        log = []
        sums = defaultdict(int)

        def logic(in1, in2, out, notificator):
            for inp in (in1, in2):
                for c, batch in inp:
                    if c.time not in sums:
                        notificator.notify_at(c.retain())
                    sums[c.time] += sum(batch)
            for c in notificator:
                ok = not in1.frontier.less_equal(c.time) and not in2.frontier.less_equal(c.time)
                log.append((c.time, ok))
                out.session(c).give((c.time, sums.pop(c.time)))

        with worker.dataflow() as scope:
            a, b = scope.new_input("A"), scope.new_input("B")
            out = a.stream.binary_notify(b.stream, logic, exchange1=to_zero, exchange2=to_zero)
            cap = out.capture()
            probe = out.probe()
        stalls = []
        for t, (x, y) in enumerate(data):
            if worker.index == 0:
                a.send(x)
                b.send(y)
            a.advance_to(t + 1)
            for _ in range(10):
                worker.step()
            stalls.append([tt for tt, _ in log if tt >= t])  # must stay empty: B still at t
            b.advance_to(t + 1)
            worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
        a.close()
        b.close()
        worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
        return log, stalls, cap.extract()

    results = run(main, workers)
    home = hash64(0) % workers  # every record has key 0
    log, stalls, res = results[home]
    assert all(s == [] for s in stalls)
    assert [t for t, _ in log] == list(range(len(data)))
    assert all(ok for _, ok in log)
    assert timed(res) == Counter((t, (t, x + y)) for t, (x, y) in enumerate(data))
    for log2, stalls2, res2 in results[:home] + results[home + 1:]:
        assert not log2 and not res2



@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_notification_loop_left_early_delivers_the_rest_later(workers):
    """``for cap in notificator: ...; break`` handles one completed time per invocation: the
    others are delivered in later invocations, each once (a duplicate request of the time just
    delivered is dropped), and the dataflow completes."""
    import timely

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()

            def one_time_per_call(i, out, notificator):
                for cap, batch in i:
                    notificator.notify_at(cap.retain())
                    notificator.notify_at(cap.retain())  # twice: delivered once
                for cap in notificator:
                    out.give(cap, (cap.time, worker.index))
                    break

            got = inp.stream.unary_notify(one_time_per_call, name="OnePerCall").capture()
        for epoch in range(4):
            inp.send("x")
            inp.advance_to(epoch + 1)
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=20)
        return got.extract()

    results = timely.execute(main, workers=workers, timeout=60)
    delivered = sorted(r for result in results for _, records in result for r in records)
    assert delivered == sorted((t, w) for t in range(4) for w in range(workers))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leave_early", [False, True])
def test_a_time_requested_twice_and_given_back_as_a_timer_is_delivered_once(leave_early):
    """Two requests for one time (one per batch, as ``notify_at(cap.retain())`` in the input loop
    makes them): the first delivered capability is given back downgraded, a timer that fires again
    later. The second request is still a duplicate of the time delivered (the duplicate check
    compared with the given-back capability's new time, so it delivered the time twice and the
    timer then fired twice per period)."""
    import timely

    def main(worker):
        deliveries = []

        def logic(inp, out, notificator):
            for cap, _ in inp:
                notificator.notify_at(cap.retain())
            for cap in notificator:
                deliveries.append(cap.time)
                if cap.time < 200:
                    cap.downgrade(cap.time + 100)
                    notificator.notify_at(cap)
                if leave_early:
                    break

        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.unary_notify(logic, name="Timer")
        inp.send_batch([1])
        inp.flush()
        worker.step()
        inp.send_batch([2])  # a second batch at time 0: a second request for it
        inp.advance_to(1)
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=STEP_TIMEOUT)
        return deliveries

    assert timely.execute(main, workers=1, timeout=60) == [[0, 100, 200]]
