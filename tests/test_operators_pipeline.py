"""Record-at-a-time operators (map, map_batch, flat_map, filter, inspect, concat, partition) over
several epochs of random input, against a sequential per-epoch oracle of each worker's slice.

These operators do not move records between workers, so each worker's output is compared with the
oracle on the records that worker sent (see ``epoch_input.py`` for how the input is dealt out).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import bag, norm, property_on_workers, run
from dataflows import run_captured, run_reporting
from epoch_input import epochs_of, epochs_of2, feed1, small_ints
from hypothesis import strategies as st
from oracles import per_worker_oracle, timed

import timely

pytestmark = pytest.mark.timeout(60)

PIPELINE_CASES = {
    "map": (lambda s: s.map(lambda x: x * 3 - 1, name="M"), lambda recs: [x * 3 - 1 for x in recs]),
    "map_batch": (lambda s: s.map_batch(lambda b: [(x, x % 2) for x in b]),
                  lambda recs: [(x, x % 2) for x in recs]),
    "flat_map": (lambda s: s.flat_map(lambda x: [(x, i) for i in range(x % 4)]),
                 lambda recs: [(x, i) for x in recs for i in range(x % 4)]),
    "filter": (lambda s: s.filter(lambda x: x % 3 == 0), lambda recs: [x for x in recs if x % 3 == 0]),
    "chain": (lambda s: s.map(lambda x: x + 1).filter(lambda x: x > 0).flat_map(lambda x: [x, -x]),
              lambda recs: [y for x in recs if x + 1 > 0 for y in (x + 1, -(x + 1))]),
}


@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
@property_on_workers(epochs=epochs_of(small_ints))
def test_pipeline_operator(workers, case, epochs):
    build, oracle = PIPELINE_CASES[case]
    results = run_captured(workers, epochs, build)
    assert len(results) == workers
    for w, res in enumerate(results):
        assert timed(res) == per_worker_oracle(epochs, w, workers, oracle), f"worker {w}"


@property_on_workers(epochs=epochs_of(small_ints))
def test_map_batch_sees_batches(workers, epochs):
    """``map_batch`` gets whole batches (lists or tuples): the sum of batch lengths per time is the
    number of records this worker sent at that time."""

    def build(stream):
        kinds = set()

        def f(batch):
            kinds.add(type(batch).__name__)
            return [len(batch)]

        return stream.map_batch(f), lambda: sorted(kinds)

    results = run_reporting(workers, epochs, build)
    for w, (res, kinds) in enumerate(results):
        assert set(kinds) <= {"list", "tuple"}
        sums = defaultdict(int)
        for t, lens in res:
            sums[t] += sum(lens)
        expected = {t: len(recs[w::workers]) for t, recs in epochs if recs[w::workers]}
        assert {t: n for t, n in sums.items() if n} == expected


@property_on_workers(epochs=epochs_of(small_ints))
def test_inspect_and_inspect_batch(workers, epochs):
    def build(stream):
        seen, seen_batches = [], []
        out = (stream
               .inspect(seen.append)
               .inspect_batch(lambda t, b: seen_batches.append((t, list(b)))))
        return out, lambda: (seen, seen_batches)

    results = run_reporting(workers, epochs, build)
    for w, (res, (seen, seen_batches)) in enumerate(results):
        expected = per_worker_oracle(epochs, w, workers, lambda recs: recs)
        assert bag(seen) == Counter(r for (_, r), n in expected.items() for _ in range(n))
        assert timed(seen_batches) == expected
        assert timed(res) == expected  # records pass through unchanged


@property_on_workers(epochs=epochs_of2(small_ints, small_ints))
def test_concat(workers, epochs):
    def build(a, b):
        return a.concat(b.map(lambda x: ("b", x)), a.map(lambda x: ("neg", -x)))

    results = run_captured(workers, epochs, build, inputs=2)
    for w, res in enumerate(results):
        expected = Counter()
        for t, (ra, rb) in epochs:
            ra, rb = ra[w::workers], rb[w::workers]
            expected += Counter((t, norm(y)) for y in ra + [("b", x) for x in rb] + [("neg", -x) for x in ra])
        assert timed(res) == expected


@property_on_workers(epochs=epochs_of(small_ints), parts=st.integers(1, 4))
def test_partition(workers, epochs, parts):
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            streams = inp.stream.partition(parts, lambda x: x % parts)
            caps = [s.capture() for s in streams]
            probe = timely.ProbeHandle()
            for s in streams:
                s.probe_with(probe)
        feed1(worker, inp, epochs, probe)
        return [c.extract() for c in caps]

    results = run(main, workers)
    for w, res in enumerate(results):
        assert len(res) == parts
        for i, part in enumerate(res):
            oracle = per_worker_oracle(epochs, w, workers, lambda recs: [x for x in recs if x % parts == i])
            assert timed(part) == oracle, f"worker {w} part {i}"
