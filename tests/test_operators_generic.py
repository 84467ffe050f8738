"""The generic operators (unary, unary_frontier, unary_notify and their binary forms) running user
logic over several epochs of random input, against sequential per-epoch oracles: records, the
times they are emitted at, and the worker they are processed on."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import norm, property_on_workers, run
from dataflows import run_captured, run_reporting
from epoch_input import epochs_of, epochs_of2, feed1, pairs, small_ints, words
from hypothesis import strategies as st
from oracles import global_oracle, hash_worker, merged, per_worker_oracle, sliced_pair_oracle, timed, to_zero

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("exchange", [None, 0])
@property_on_workers(epochs=epochs_of(pairs))
def test_unary(workers, exchange, epochs):
    def build(stream):
        infos = []

        def double(cap, info):
            infos.append((info.name, info.worker, info.peers))
            cap.drop()

            def logic(inp, out):
                for c, batch in inp:
                    with out.session(c) as s:
                        s.give_batch([(k, 2 * v) for k, v in batch])
                        s.give(("n", len(batch)))
            return logic

        return stream.unary(double, name="Double", exchange=exchange), lambda: infos

    results = run_reporting(workers, epochs, build)
    total = Counter()
    for w, (res, infos) in enumerate(results):
        assert norm(infos) == (("Double", w, workers),)
        data = Counter({k: n for k, n in timed(res).items() if k[1][0] != "n"})
        counts = defaultdict(int)
        for (t, r), n in timed(res).items():
            if r[0] == "n":
                counts[t] += r[1] * n
        # the ("n", len) markers account for every record this worker processed
        assert dict(counts) == {t: c for t, c in Counter(t for t, _ in data.elements()).items()}
        if exchange is None:
            assert data == per_worker_oracle(epochs, w, workers, lambda recs: [(k, 2 * v) for k, v in recs])
        else:
            assert all(hash_worker(r[0], workers) == w for _, r in data)
        total += data
    assert total == global_oracle(epochs, lambda recs: [(k, 2 * v) for k, v in recs])


def buffer_until_complete(emitted):
    """The README's unary_frontier example, recording each emission's (time, frontier passed)."""

    def constructor(cap, info):
        cap.drop()
        stash = {}

        def logic(inp, out):
            for c, batch in inp:
                if c.time not in stash:
                    stash[c.time] = (c.retain(), [])
                stash[c.time][1].extend(batch)
            for t in sorted(stash):
                if not inp.frontier.less_equal(t):
                    held, records = stash.pop(t)
                    out.give_batch(held, sorted(records))
                    emitted.append(t)
                    held.drop()

        return logic

    return constructor


@property_on_workers(epochs=epochs_of(pairs))
def test_unary_frontier(workers, epochs):
    def main(worker):
        emitted = []
        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.unary_frontier(buffer_until_complete(emitted), name="Buffer", exchange=0)
            cap = out.capture()
            probe = out.probe()
        feed1(worker, inp, epochs, probe)
        return cap.batches, emitted

    results = run(main, workers)
    total = Counter()
    for w, (batches, emitted) in enumerate(results):
        # One sorted batch per time, emitted in time order, each time once.
        assert list(emitted) == sorted(set(emitted))
        assert [norm(t) for t, _ in batches] == list(emitted)
        for t, recs in batches:
            assert list(norm(recs)) == sorted(norm(recs))
            assert all(hash_worker(r[0], workers) == w for r in recs)
        total += timed(batches)
    assert total == global_oracle(epochs, lambda recs: recs)


@property_on_workers(epochs=epochs_of(small_ints))
def test_unary_notify(workers, epochs):
    def build(stream):
        totals = {}

        def sum_per_time(inp, out, notificator):
            for c, batch in inp:
                if c.time not in totals:
                    notificator.notify_at(c.retain())
                totals[c.time] = totals.get(c.time, 0) + sum(batch)
            for c in notificator:
                out.session(c).give((c.time, totals.pop(c.time)))

        return stream.unary_notify(sum_per_time, name="Sum", exchange=to_zero)

    results = run_captured(workers, epochs, build)
    expected = Counter((t, (t, sum(recs))) for t, recs in epochs if recs)
    home = hash_worker(0, workers)  # every record has key 0: all on worker hash64(0) % peers
    assert timed(results[home]) == expected
    assert all(not res for w, res in enumerate(results) if w != home)


@pytest.mark.parametrize("exchange", [None, 0])
@property_on_workers(epochs=epochs_of2(pairs, pairs))
def test_binary(workers, exchange, epochs):
    def build(a, b):
        def merge(cap, info):
            cap.drop()

            def logic(in1, in2, out):
                for c, batch in in1:
                    out.give_batch(c, [("L", k, v) for k, v in batch])
                for c, batch in in2:
                    out.give_batch(c, [("R", k, -v) for k, v in batch])
            return logic

        return a.binary(b, merge, name="Merge", exchange1=exchange, exchange2=exchange)

    def oracle(recs):
        ra, rb = recs
        return [("L", k, v) for k, v in ra] + [("R", k, -v) for k, v in rb]

    results = run_captured(workers, epochs, build, inputs=2)
    for w, res in enumerate(results):
        if exchange is None:
            assert timed(res) == sliced_pair_oracle(epochs, w, workers, oracle), f"worker {w}"
        else:
            assert all(hash_worker(r[1], workers) == w for _, r in timed(res))
    assert merged(results) == global_oracle(epochs, oracle)


@property_on_workers(epochs=epochs_of2(pairs, st.tuples(st.integers(0, 6), words)))
def test_binary_frontier_join(workers, epochs):
    """A per-time equi-join held until both input frontiers pass the time."""

    def join(cap, info):
        cap.drop()
        left, right = defaultdict(list), defaultdict(list)
        held = {}

        def logic(in1, in2, out):
            for inp, side in ((in1, left), (in2, right)):
                for c, batch in inp:
                    if c.time not in held:
                        held[c.time] = c.retain()
                    side[c.time].extend(batch)
            for t in sorted(held):
                if not in1.frontier.less_equal(t) and not in2.frontier.less_equal(t):
                    c = held.pop(t)
                    index = defaultdict(list)
                    for k, v in right.pop(t, []):
                        index[k].append(v)
                    out.give_batch(c, [(k, a, b) for k, a in left.pop(t, []) for b in index[k]])
                    c.drop()
        return logic

    def oracle(recs):
        ra, rb = recs
        return [(k, x, y) for k, x in ra for k2, y in rb if k == k2]

    results = run_captured(
        workers, epochs, lambda a, b: a.binary_frontier(b, join, name="Join", exchange1=0, exchange2=0), inputs=2)
    assert merged(results) == global_oracle(epochs, oracle)
    for w, res in enumerate(results):
        assert all(hash_worker(r[0], workers) == w for _, r in timed(res))


@property_on_workers(epochs=epochs_of2(small_ints, small_ints))
def test_binary_notify(workers, epochs):
    def build(a, b):
        state = {}

        def logic(in1, in2, out, notificator):
            for sign, inp in ((1, in1), (-1, in2)):
                for c, batch in inp:
                    if c.time not in state:
                        state[c.time] = [0, 0]
                        notificator.notify_at(c.retain())
                    state[c.time][0] += sign * sum(batch)
                    state[c.time][1] += len(batch)
            for c in notificator:
                assert not in1.frontier.less_equal(c.time) and not in2.frontier.less_equal(c.time)
                out.session(c).give((c.time, *state.pop(c.time)))

        return a.binary_notify(b, logic, name="Diff", exchange1=to_zero, exchange2=to_zero)

    results = run_captured(workers, epochs, build, inputs=2)
    expected = Counter((t, (t, sum(ra) - sum(rb), len(ra) + len(rb))) for t, (ra, rb) in epochs if ra or rb)
    home = hash_worker(0, workers)
    assert timed(results[home]) == expected
    assert all(not res for w, res in enumerate(results) if w != home)


def _batch_sizes(sends):
    """The ``(time, batch length)`` pairs a unary operator's logic sees when ``sends`` (``(time,
    records)`` pairs, in order) are all queued before it runs."""
    import timely

    def main(worker):
        seen = []

        def recorder(cap, info):
            cap.drop()

            def logic(inp, out):
                for c, batch in inp:
                    seen.append((c.time, len(batch)))
                    out.give_batch(c, batch)
            return logic

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.unary(recorder, name="Recorder").probe()
        for t, records in sends:
            if t > inp.time:
                inp.advance_to(t)
            inp.send_batch(records)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=30)
        return seen

    return timely.execute(main)[0]


def test_small_batches_of_one_time_reach_the_logic_joined_and_large_ones_as_they_are():
    from timely.dataflow.handles import MERGE_RECORDS

    big = MERGE_RECORDS
    sends = [(0, [1] * 8), (0, [2] * 8), (0, [3] * 8), (0, [4] * big), (0, [5] * 8), (1, [6] * 8), (1, [7] * 3)]
    # Joined while each is under MERGE_RECORDS and the time is the same; a large batch is not copied.
    assert _batch_sizes(sends) == [(0, 24), (0, big), (0, 8), (1, 11)]
