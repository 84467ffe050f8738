"""timely.testing: run_epochs against sequential oracles, on 1-3 workers."""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import property_on_workers, workers_param
from hypothesis import strategies as st

import timely
from timely.testing import bag, normalize, run_epochs

EPOCHS = st.lists(st.lists(st.integers(-5, 5), max_size=12), min_size=1, max_size=4)


@property_on_workers(single=15, multi=3, epochs=EPOCHS)
def test_count_by_key_matches_a_sequential_count(workers, epochs):
    got = run_epochs(lambda s: s.count_by_key(), epochs, workers=workers)
    want = [(e, sorted(Counter(recs).items())) for e, recs in enumerate(epochs) if recs]
    assert got == want


@workers_param
def test_records_keep_their_epoch_and_lists_come_back_as_tuples(workers):
    epochs = [[[1, 2], [3]], [], [[4]]]
    got = run_epochs(lambda s: s.map(lambda r: [r, len(r)]), epochs, workers=workers)
    assert got == [(0, [((1, 2), 2), ((3,), 1)]), (2, [((4,), 1)])]


def test_a_failing_operator_raises_the_operator_error():
    def boom(x):
        raise ValueError(f"bad record {x}")

    with pytest.raises(timely.OperatorError, match="bad record 7") as ei:
        run_epochs(lambda s: s.map(boom), [[7]])
    assert "Map#" in str(ei.value) and "boom" in str(ei.value)


def test_a_dataflow_that_never_completes_times_out():
    def hold_forever(stream):
        return stream.unary(lambda cap, info: (lambda inp, out: [None for _ in inp]), name="Holder")

    with pytest.raises(TimeoutError):
        run_epochs(hold_forever, [[1]], timeout=0.5)


def test_normalize_and_bag():
    assert normalize([1, [2, (3, [4])]]) == (1, (2, (3, (4,))))
    assert bag([[1], (1,), 2]) == {(1,): 2, 2: 1}
