"""Loops under the schedule fuzzer, on 1-3 workers: feedback in the top-level scope (each trip adds
1 to the epoch) and in nested scopes (``enter``/``leave``, times ``(epoch, iteration)``), with a
notificator inside the loop, against plain Python oracles of where each record lands in time.

Hypothesis draws the fuzz seed with the data. Inside a loop the fuzzer also reorders batches of
different iterations, and holds the records of one iteration while the next is being computed.
"""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import FUZZ_SEEDS, property_on_workers, run
from dataflows import halving_loop, sum_per_time
from epoch_input import STEP_TIMEOUT, epochs_of, finish, send_epoch
from hypothesis import strategies as st
from oracles import merged

pytestmark = pytest.mark.timeout(120)


def halvings(x):
    """The values ``x`` takes in the halving loop, one per trip: ``x, x >> 1, ..., 1`` (0 alone)."""
    return [x >> i for i in range(max(x.bit_length(), 1))]


@property_on_workers(single=20, multi=5, epochs=epochs_of(st.integers(0, 300), max_size=10), seed=FUZZ_SEEDS)
def test_top_level_feedback(workers, epochs, seed):
    """x at epoch e is at epoch e + i as x >> i; it leaves as 1 at epoch e + bit_length(x) - 1."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            values = halving_loop(scope, inp.stream)
            ones = values.filter(lambda x: x == 1)
            c_values, c_ones = values.capture(), ones.capture()
            probe = ones.probe()
        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
            worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
        inp.close()
        finish(worker)
        return c_values.extract(), c_ones.extract()

    results = run(main, workers, fuzz=seed)
    assert merged(results, 0) == Counter((e + i, v) for e, recs in epochs for x in recs
                                         for i, v in enumerate(halvings(x)))
    assert merged(results, 1) == Counter((e + x.bit_length() - 1, 1) for e, recs in epochs for x in recs if x)


@property_on_workers(single=20, multi=5, epochs=epochs_of(st.integers(0, 1000), max_size=10), seed=FUZZ_SEEDS)
def test_nested_scope_with_a_notificator_in_the_loop(workers, epochs, seed):
    """The halving loop in a nested scope: per inner time ``(epoch, iteration)`` a ``unary_notify``
    sums the values of that iteration once it is complete, and ``leave()`` takes the ones out at
    their epoch."""

    def main(worker):
        log = []
        with worker.dataflow() as scope:
            inp = scope.new_input()
            with scope.iterative() as inner:
                body = halving_loop(inner, inp.stream.enter(inner))
                sums = body.unary_notify(sum_per_time({}, log), name="IterationSums", exchange=lambda x: 0)
                c_sums = sums.capture()
                p_inner = sums.probe()
                left = body.filter(lambda x: x == 1).leave()
            c_left = left.capture()
            probe = left.probe()
        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
            worker.step_while(lambda: probe.less_than(t + 1) or p_inner.less_than((t + 1, 0)), timeout=STEP_TIMEOUT)
        inp.close()
        finish(worker)
        return c_sums.extract(), c_left.extract(), log

    results = run(main, workers, fuzz=seed)
    per_iteration: dict = {}
    for e, recs in epochs:
        for x in recs:
            for i, v in enumerate(halvings(x)):
                s, n = per_iteration.get((e, i), (0, 0))
                per_iteration[e, i] = (s + v, n + 1)
    assert merged(results, 0) == Counter(((e, i), ((e, i), s, n)) for (e, i), (s, n) in per_iteration.items())
    assert merged(results, 1) == Counter((e, 1) for e, recs in epochs for x in recs if x)
    for _, _, log in results:
        assert all(done for _, done in log), "an iteration was delivered before it was complete"
        assert len(log) == len({tuple(t) for t, _ in log}), "an iteration was delivered twice"
