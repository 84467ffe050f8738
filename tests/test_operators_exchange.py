"""Operators that move records between workers (exchange, broadcast) and the keyed aggregations
built on them (count_by_key, reduce_by_key), against sequential per-epoch oracles.

Placement is part of the contract (README: record ``r`` goes to worker ``hash64(key(r)) % peers``),
so besides conservation every output record is checked to be on the worker its key names.
"""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import property_on_workers, run, workers_param
from dataflows import run_captured
from epoch_input import epochs_of, feed1, pairs, small_ints, word_pairs, words
from hypothesis import strategies as st
from oracles import first_field, global_oracle, hash_worker, merged, timed

pytestmark = pytest.mark.timeout(60)

EXCHANGE_CASES = {
    "field0": (pairs, 0, lambda r: r[0]),
    "callable": (pairs, lambda r: r[1] % 5, lambda r: r[1] % 5),
    "none_int": (small_ints, None, lambda r: r),
    "none_str": (words, None, lambda r: r),
    "field0_str": (word_pairs, 0, lambda r: r[0]),
}


@pytest.mark.parametrize("case", sorted(EXCHANGE_CASES))
@property_on_workers(data=st.data())
def test_exchange(workers, case, data):
    elements, key, keyfn = EXCHANGE_CASES[case]
    epochs = data.draw(epochs_of(elements), label="epochs")
    results = run_captured(workers, epochs, lambda s: s.exchange(key))
    # Conservation: every record arrives exactly once, at its own time.
    assert merged(results) == global_oracle(epochs, lambda recs: recs)
    # Placement: record r is on worker hash64(key(r)) % peers (README), so each key on one worker.
    for w, res in enumerate(results):
        for t, recs in res:
            for r in recs:
                assert hash_worker(keyfn(r), workers) == w, (r, w)


@property_on_workers(epochs=epochs_of(pairs))
def test_broadcast(workers, epochs):
    results = run_captured(workers, epochs, lambda s: s.broadcast())
    expected = global_oracle(epochs, lambda recs: recs)
    for w, res in enumerate(results):
        assert timed(res) == expected, f"worker {w} did not see every record once"


@workers_param
def test_exchange_key_defined_inside_main(workers):
    """README style: ``exchange=lambda ...`` written inside ``main``. Each worker process creates its
    own function object, so nothing about the dataflow may depend on its identity or address."""

    def main(worker):
        # Workers typically do worker-dependent work (load their share of the input) before they
        # build the dataflow, so their heaps differ; the function objects below then differ too.
        share = [[i] for i in range(100 * worker.index)]
        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.exchange(lambda r: r % 7).count_by_key(lambda r: r % 3)
            cap = out.capture()
            probe = out.probe()
        feed1(worker, inp, [(0, list(range(30))), (2, list(range(10)))], probe)
        del share
        return cap.extract()

    expected = Counter()
    for t, recs in [(0, list(range(30))), (2, list(range(10)))]:
        expected += Counter((t, kv) for kv in Counter(r % 3 for r in recs).items())
    assert merged(run(main, workers)) == expected


@pytest.mark.parametrize("keying", ["none", "field", "callable"])
@property_on_workers(epochs=epochs_of(words))
def test_count_by_key(workers, keying, epochs):
    def build(stream):
        if keying == "none":
            return stream.count_by_key()
        if keying == "field":
            return stream.map(lambda w: (w, 1)).count_by_key(0)
        return stream.map(lambda w: (w.upper(), len(w))).count_by_key(first_field)

    results = run_captured(workers, epochs, build)
    conv = (lambda w: w.upper()) if keying == "callable" else (lambda w: w)
    expected = global_oracle(epochs, lambda recs: Counter(conv(r) for r in recs).items())
    assert merged(results) == expected
    for w, res in enumerate(results):
        for t, recs in res:
            for key, _ in recs:
                assert hash_worker(key, workers) == w


@pytest.mark.parametrize("op", ["sum", "max", "min_pair"])
@property_on_workers(epochs=epochs_of(word_pairs))
def test_reduce_by_key(workers, op, epochs):
    reducers = {
        "sum": lambda a, b: a + b,
        "max": max,
        "min_pair": lambda a, b: min(a, b),
    }
    reduce = reducers[op]
    def build(stream):
        if op == "min_pair":
            stream = stream.map(lambda kv: (kv[0], (kv[1], kv[0])))
        return stream.reduce_by_key(reduce)

    def oracle(recs):
        acc = {}
        for k, v in recs:
            if op == "min_pair":
                v = (v, k)
            acc[k] = reduce(acc[k], v) if k in acc else v
        return acc.items()

    assert merged(run_captured(workers, epochs, build)) == global_oracle(epochs, oracle)
