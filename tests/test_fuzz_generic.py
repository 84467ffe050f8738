"""The generic operators and the keyed aggregations under the schedule fuzzer, on 1-3 workers, with
small operators written as users write them (emit per batch; buffer until the frontier passes;
notificator-based per-time sums; a join held until both frontiers pass), against sequential
per-epoch oracles: unary, unary_frontier, unary_notify, binary, binary_frontier, binary_notify,
count_by_key and reduce_by_key.

Hypothesis draws the fuzz seed with the data: an operator that is right only for some orders of
delivery (first batch of a time taken as all of it, a time assumed complete when its batch came)
fails for some seed.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import FUZZ_SEEDS, norm, property_on_workers, run
from dataflows import run_captured, run_reporting, sum_per_time
from epoch_input import epochs_of, epochs_of2, feed1, pairs, small_ints, word_pairs, words
from hypothesis import strategies as st
from oracles import global_oracle, hash_worker, merged, per_worker_oracle, sliced_pair_oracle, timed, to_zero
from test_operators_generic import buffer_until_complete

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("exchange", [None, 0], ids=["pipeline", "exchange"])
@property_on_workers(single=10, multi=2, epochs=epochs_of(pairs), seed=FUZZ_SEEDS)
def test_unary(workers, exchange, epochs, seed):
    """A per-batch operator that also counts its batch's records: the counts add up per time,
    whatever the batches were cut into."""

    def double(cap, info):
        cap.drop()

        def logic(inp, out):
            for c, batch in inp:
                with out.session(c) as s:
                    s.give_batch([(k, 2 * v) for k, v in batch])
                    s.give(("n", len(batch)))
        return logic

    results = run_captured(workers, epochs, lambda s: s.unary(double, exchange=exchange), fuzz=seed)
    total = Counter()
    for w, res in enumerate(results):
        data = Counter({(t, r): n for (t, r), n in timed(res).items() if r[0] != "n"})
        counts = Counter()
        for (t, r), n in timed(res).items():
            if r[0] == "n":
                counts[t] += r[1] * n
        assert counts == Counter(t for t, _ in data.elements())
        if exchange is None:
            assert data == per_worker_oracle(epochs, w, workers, lambda recs: [(k, 2 * v) for k, v in recs])
        total += data
    assert total == global_oracle(epochs, lambda recs: [(k, 2 * v) for k, v in recs])


@property_on_workers(single=15, multi=3, epochs=epochs_of(pairs), seed=FUZZ_SEEDS)
def test_unary_frontier_buffers_until_the_frontier_passes(workers, epochs, seed):
    """The README's buffering operator: it emits each time once, in time order, with every record
    of the time (the capture behind it may get that batch cut in pieces)."""

    def main(worker):
        emitted = []
        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.unary_frontier(buffer_until_complete(emitted), name="Buffer", exchange=0)
            cap = out.capture()
            probe = out.probe()
        feed1(worker, inp, epochs, probe)
        return cap.batches, emitted

    total = Counter()
    for w, (batches, emitted) in enumerate(run(main, workers, fuzz=seed)):
        assert list(emitted) == sorted(set(emitted)) == sorted({norm(t) for t, _ in batches})
        assert all(hash_worker(r[0], workers) == w for _, recs in batches for r in recs)
        total += timed(batches)
    assert total == global_oracle(epochs, lambda recs: recs)


def check_sums(results, workers, expected):
    """Every time delivered once, in order, complete, on the home worker of key 0 only."""
    home = hash_worker(0, workers)
    for w, (res, log) in enumerate(results):
        assert all(done for _, done in log), "a time was delivered before its frontier passed"
        assert [t for t, _ in log] == sorted({t for t, _ in log}), "times out of order or twice"
        assert timed(res) == (expected if w == home else Counter())


@property_on_workers(single=15, multi=3, epochs=epochs_of(small_ints), seed=FUZZ_SEEDS)
def test_unary_notify_per_time_sums(workers, epochs, seed):
    def build(stream):
        log = []
        return stream.unary_notify(sum_per_time({}, log), name="Sum", exchange=to_zero), lambda: log

    expected = Counter((t, (t, sum(recs), len(recs))) for t, recs in epochs if recs)
    check_sums(run_reporting(workers, epochs, build, fuzz=seed), workers, expected)


@property_on_workers(single=15, multi=3, epochs=epochs_of2(small_ints, small_ints), seed=FUZZ_SEEDS)
def test_binary_notify_per_time_differences(workers, epochs, seed):
    def build(a, b):
        log = []
        out = a.binary_notify(b, sum_per_time({}, log), name="Diff", exchange1=to_zero, exchange2=to_zero)
        return out, lambda: log

    expected = Counter((t, (t, sum(ra) - sum(rb), len(ra) + len(rb))) for t, (ra, rb) in epochs if ra or rb)
    check_sums(run_reporting(workers, epochs, build, inputs=2, fuzz=seed), workers, expected)


@pytest.mark.parametrize("exchange", [None, 0], ids=["pipeline", "exchange"])
@property_on_workers(single=10, multi=2, epochs=epochs_of2(pairs, pairs), seed=FUZZ_SEEDS)
def test_binary(workers, exchange, epochs, seed):
    def merge(cap, info):
        cap.drop()

        def logic(in1, in2, out):
            for c, batch in in1:
                out.give_batch(c, [("L", k, v) for k, v in batch])
            for c, batch in in2:
                out.give_batch(c, [("R", k, -v) for k, v in batch])
        return logic

    def oracle(recs):
        ra, rb = recs
        return [("L", k, v) for k, v in ra] + [("R", k, -v) for k, v in rb]

    results = run_captured(workers, epochs, lambda a, b: a.binary(b, merge, exchange1=exchange, exchange2=exchange),
                           inputs=2, fuzz=seed)
    for w, res in enumerate(results):
        if exchange is None:
            assert timed(res) == sliced_pair_oracle(epochs, w, workers, oracle)
        else:
            assert all(hash_worker(r[1], workers) == w for _, r in timed(res))
    assert merged(results) == global_oracle(epochs, oracle)


def join(cap, info):
    """A per-time equi-join on field 0, each time held until both input frontiers have passed it."""
    cap.drop()
    left, right, held = defaultdict(list), defaultdict(list), {}

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


@property_on_workers(single=15, multi=3, epochs=epochs_of2(pairs, st.tuples(st.integers(0, 6), words)),
                     seed=FUZZ_SEEDS)
def test_binary_frontier_join(workers, epochs, seed):
    results = run_captured(workers, epochs, lambda a, b: a.binary_frontier(b, join, exchange1=0, exchange2=0),
                           inputs=2, fuzz=seed)
    assert merged(results) == global_oracle(epochs, lambda recs: [(k, x, y) for k, x in recs[0]
                                                                 for k2, y in recs[1] if k == k2])
    assert all(hash_worker(r[0], workers) == w for w, res in enumerate(results) for _, r in timed(res))


@property_on_workers(single=15, multi=3, epochs=epochs_of(st.one_of(small_ints, words)), seed=FUZZ_SEEDS)
def test_count_by_key(workers, epochs, seed):
    results = run_captured(workers, epochs, lambda s: s.count_by_key(), fuzz=seed)
    assert merged(results) == global_oracle(epochs, lambda recs: Counter(recs).items())
    assert all(hash_worker(key, workers) == w for w, res in enumerate(results) for _, (key, _) in timed(res))


def reduce_oracle(f):
    """Per epoch, ``(key, f(...))`` folded sequentially over the epoch's values of each key."""

    def oracle(recs):
        acc: dict = {}
        for k, v in recs:
            acc[k] = f(acc[k], v) if k in acc else v
        return acc.items()

    return oracle


REDUCERS = {"sum": lambda a, b: a + b, "max": max, "min": min}


@pytest.mark.parametrize("reducer", sorted(REDUCERS))
@property_on_workers(single=10, multi=2, epochs=epochs_of(word_pairs), seed=FUZZ_SEEDS)
def test_reduce_by_key(workers, reducer, epochs, seed):
    """A commutative and associative reduction: the same result whatever order the values of a key
    arrive in."""
    f = REDUCERS[reducer]
    results = run_captured(workers, epochs, lambda s: s.reduce_by_key(f), fuzz=seed)
    assert merged(results) == global_oracle(epochs, reduce_oracle(f))


@property_on_workers(single=15, multi=2, epochs=epochs_of(st.tuples(words, words)), seed=FUZZ_SEEDS)
def test_reduce_by_key_folds_every_value_once_in_some_order(workers, epochs, seed):
    """A reduction that is not commutative (joining strings) sees the values of a key at a time in
    their arrival order, which is not defined: each value is folded in exactly once."""
    results = run_captured(workers, epochs, lambda s: s.reduce_by_key(lambda a, b: a + "," + b), fuzz=seed)
    got = Counter()
    for (t, (k, joined)), n in merged(results).items():
        got[t, (k, tuple(sorted(joined.split(","))))] += n

    def values_per_key(recs):
        values = defaultdict(list)
        for k, v in recs:
            values[k].append(v)
        return [(k, tuple(sorted(vs))) for k, vs in values.items()]

    assert got == global_oracle(epochs, values_per_key)
