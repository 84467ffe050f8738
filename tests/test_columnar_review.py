"""Columnar defects found by review: view types across workers, float16 keys, empty tables of the
wrong schema, concat and nullability, zero-column rows, integer sums in any batch order."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import megaphone
import timely
from timely import columnar
from timely.columnar import ColumnDistribute, kernels
from timely.testing import run_epochs


def resort(result: list) -> list:
    return [(t, sorted(rs, key=repr)) for t, rs in result if rs]


# -- string_view / binary_view columns cross workers ------------------------------------------------
VIEWS = pa.schema([("k", pa.string_view()), ("b", pa.binary_view()), ("v", pa.int64())])


def _views(n: int) -> pa.RecordBatch:
    keys = [None if i % 7 == 0 else f"key {i % 5} with more than twelve bytes" for i in range(n)]
    return pa.record_batch([pa.array(keys, pa.string_view()),
                            pa.array([None if i % 3 == 0 else b"x" * (i % 20) for i in range(n)], pa.binary_view()),
                            pa.array(range(n))], schema=VIEWS)


def test_take_rows_and_filter_rows_keep_view_types() -> None:
    b = _views(20)
    nested = pa.record_batch([pa.array([{"s": "a"}, None, {"s": "long enough to be out of line"}],
                                       pa.struct([("s", pa.string_view())])),
                              pa.array([["a"], None, ["b", None]], pa.list_(pa.string_view()))], names=["st", "l"])
    for batch, idx in ((b, [19, 0, 3, 3]), (b.slice(5, 10), [9, 0]), (nested, [2, 0])):
        got = kernels.take_rows(batch, pa.array(idx))
        assert got.schema.equals(batch.schema)
        assert got.to_pylist() == [batch.to_pylist()[i] for i in idx]
        mask = pa.array([i % 2 == 0 for i in range(batch.num_rows)])
        got = kernels.filter_rows(batch, mask)
        assert got.schema.equals(batch.schema)
        assert got.to_pylist() == batch.to_pylist()[::2]


@pytest.mark.parametrize("workers", [1, 2])
def test_view_columns_exchange_and_aggregate_across_workers(workers: int) -> None:
    b = _views(40)

    def build(s: timely.Stream) -> timely.Stream:
        out = columnar.from_batches(s, VIEWS).exchange_by("k").exchange_by("b")
        # each row with whether its batch kept the view types
        return out.stream.flat_map(lambda x: [(x.schema.equals(VIEWS), r) for r in columnar.rows_of(x)])

    got = run_epochs(build, [[b, b.slice(3, 30)]], workers, timeout=60)
    rows = columnar.rows_of(b) + columnar.rows_of(b.slice(3, 30))
    assert resort(got) == [(0, sorted(((True, r) for r in rows), key=repr))]

    agg = run_epochs(lambda s: columnar.from_batches(s, VIEWS).aggregate_by("k", {"v": "sum"}).to_rows(),
                     [[b, b]], workers, timeout=60)
    expected: dict = {}
    for k, v in zip(b.column("k").to_pylist(), b.column("v").to_pylist()):
        expected[k] = expected.get(k, 0) + 2 * v
    assert resort(agg) == [(0, sorted(expected.items(), key=repr))]


def test_megaphone_aggregate_with_a_string_view_key_moves_bins() -> None:
    schema = pa.schema([("key", pa.string_view()), ("price", pa.int64())])
    keys = ["a", "b", None, "a", "a long key that is stored out of line"]

    def main(worker: timely.Worker) -> list:
        with worker.dataflow() as scope:
            bids = scope.new_input()
            control = megaphone.ControlInput(scope, k=3)
            totals = megaphone.aggregate(columnar.from_batches(bids.stream, schema), control, "key",
                                         {"price": ["sum", "count"]})
            out: list = []
            totals.batches.inspect_batch(lambda t, bs: out.extend((t, r) for b in bs for r in b.to_pylist()))
        for epoch in range(3):
            if worker.index == 0 and epoch == 1:
                control.moves({b: 0 for b in range(8)})
            bids.send(pa.RecordBatch.from_arrays([pa.array(keys, pa.string_view()), pa.array([1, 2, 3, 4, 5])],
                                                 schema=schema))
            bids.advance_to(epoch + 1)
            control.advance_to(epoch + 1)
            worker.step_while(lambda: totals.probe.less_than(epoch + 1))
        bids.close()
        control.close()
        worker.step_while(worker.has_dataflows, timeout=30)
        return out

    rows = sorted(((t, r["key"], r["price_sum"], r["price_count"]) for w in timely.execute(main, workers=2, timeout=60)
                   for t, r in w), key=repr)
    per_epoch = {"a": (5, 2), "b": (2, 1), None: (3, 1), keys[4]: (5, 1)}  # sum, count per worker per epoch
    assert rows == sorted(((t, k, s * 2 * (t + 1), c * 2 * (t + 1)) for t in range(3)
                           for k, (s, c) in per_epoch.items()), key=repr)


def test_a_pyarrow_error_while_routing_names_the_routing_operator() -> None:
    def partition(time: object, batches: list, peers: int) -> list:
        raise pa.ArrowNotImplementedError("no kernel for this")

    def build(s: timely.Stream) -> timely.Stream:
        def constructor(cap, info):
            cap.drop()
            return lambda i, o: [o.give_batch(c, b) for c, b in i]
        return columnar.BatchStream(s.unary(constructor, "Router", ColumnDistribute(partition)), None).to_rows()

    with pytest.raises(timely.WorkerError, match=r"operator 'Router': cannot route a batch at time 0: no kernel"):
        run_epochs(build, [[pa.record_batch({"x": [1]})]], 2, timeout=60)


# -- float16 keys --------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
def test_float16_keys_aggregate_with_minus_zero_as_zero(workers: int) -> None:
    schema = pa.schema([("k", pa.float16()), ("v", pa.int64())])
    b = pa.record_batch([pa.array(np.array([0.5, 1.0, 0.5, -0.0, 0.0], np.float16)), pa.array([1, 2, 3, 4, 5])],
                        schema=schema)
    got = run_epochs(lambda s: columnar.from_batches(s, schema).aggregate_by("k", {"v": "sum"}).to_rows(),
                     [[b, b]], workers, timeout=60)
    assert resort(got) == [(0, [(0.0, 18), (0.5, 8), (1.0, 4)])]
    agg = kernels.Aggregation("k", {"v": "count"}, schema)
    agg.update(b)
    out = agg.finish()
    assert out.schema.field("k").type == pa.float16()
    assert not np.signbit(out.column("k").to_numpy(zero_copy_only=False)).any()


def test_megaphone_aggregate_with_a_float16_key() -> None:
    schema = pa.schema([("key", pa.float16()), ("price", pa.int64())])

    def main(worker: timely.Worker) -> list:
        with worker.dataflow() as scope:
            bids = scope.new_input()
            control = megaphone.ControlInput(scope, k=3)
            totals = megaphone.aggregate(columnar.from_batches(bids.stream, schema), control, "key", {"price": "sum"})
            out: list = []
            totals.batches.inspect_batch(lambda t, bs: out.extend((t, r) for b in bs for r in b.to_pylist()))
        bids.send(pa.record_batch([pa.array(np.array([0.5, 1.0, 0.5], np.float16)), pa.array([1, 2, 3])],
                                  schema=schema))
        bids.advance_to(1)
        control.advance_to(1)
        bids.close()
        control.close()
        worker.step_while(worker.has_dataflows, timeout=30)
        return out

    rows = sorted((t, r["key"], r["price_sum"]) for w in timely.execute(main, workers=2, timeout=60) for t, r in w)
    assert rows == [(0, 0.5, 8), (0, 1.0, 4)]


# -- BatchInput.send of a Table, BatchStream.concat, from_rows without columns ------------------------
def test_send_of_an_empty_table_of_another_schema_is_refused() -> None:
    schema = pa.schema([("a", pa.int64())])

    def main(worker: timely.Worker) -> list:
        with worker.dataflow() as scope:
            inp = columnar.new_input(scope, schema, name="In")
        errors = []
        for table in (pa.table({"zzz": pa.array([], pa.string())}), pa.table({"a": pa.array([], pa.int32())})):
            try:
                inp.send(table)
            except ValueError as e:
                errors.append(str(e))
        # an empty table of the schema, nullability aside, is fine
        inp.send(pa.schema([pa.field("a", pa.int64(), nullable=False)]).empty_table())
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=30)
        return errors

    (errors,) = timely.execute(main, workers=1, timeout=60)
    assert len(errors) == 2
    assert "'In'" in errors[0] and "column 'a' is missing" in errors[0]
    assert "column 'a' is int32, expected int64" in errors[1]


def test_concat_ignores_nullability_and_metadata_and_names_a_real_difference() -> None:
    a = pa.schema([pa.field("a", pa.int64())])

    def main(worker: timely.Worker) -> list:
        out = []
        for other in (pa.schema([pa.field("a", pa.int64(), nullable=False)]), a.with_metadata({"origin": "spark"}),
                      pa.schema([pa.field("a", pa.int32())])):
            try:
                with worker.dataflow() as scope:
                    columnar.new_input(scope, a).stream.concat(columnar.new_input(scope, other).stream)
                out.append("ok")
            except timely.BuildError as e:
                out.append(str(e))
        return out

    (out,) = timely.execute(main, workers=1, timeout=60)
    assert out[:2] == ["ok", "ok"]
    assert "column 'a' is int32, expected int64" in out[2]


@pytest.mark.parametrize("workers", [1, 2])
def test_from_rows_without_columns_keeps_every_row(workers: int) -> None:
    empty = pa.schema([])
    got = run_epochs(lambda s: columnar.from_rows(s, empty).to_rows(), [[(), (), ()], [()]], workers, timeout=60)
    assert resort(got) == [(0, [(), (), ()]), (1, [()])]
    with pytest.raises((timely.WorkerError, timely.OperatorError), match=r"'Rows'.*row \(1,\) does not have the 0 columns"):
        run_epochs(lambda s: columnar.from_rows(s, empty, name="Rows").to_rows(), [[(), (1,)]], 1, timeout=60)


# -- integer sums: only the final sum must fit, whatever the order of the batches ----------------------
@pytest.mark.parametrize("buffer_rows, max_partials", [(kernels.BUFFER_ROWS, kernels.MAX_PARTIALS), (1, 1), (2, 2)])
def test_an_integer_sum_that_fits_does_not_fail_in_any_batch_order(monkeypatch: pytest.MonkeyPatch,
                                                                   buffer_rows: int, max_partials: int) -> None:
    monkeypatch.setattr(kernels, "BUFFER_ROWS", buffer_rows)
    monkeypatch.setattr(kernels, "MAX_PARTIALS", max_partials)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    batches = [pa.record_batch([[1, 1, 2], [2**62, 2**62, 1]], schema=schema),  # 2**63 for key 1: out of range
               pa.record_batch([[1, 2], [-1, None]], schema=schema),              # ... and back in
               pa.record_batch([[1, 1], [-(2**62), 2**62]], schema=schema)]
    for order in ([0, 1, 2], [0, 2, 1], [2, 0, 1], [1, 0, 2]):
        agg = kernels.Aggregation("k", {"v": ["sum", "mean", "count"]}, schema)
        for i in order:
            agg.update(batches[i])
        assert sorted(agg.finish().to_pylist(), key=lambda r: r["k"]) == [
            {"k": 1, "v_sum": 2**63 - 1, "v_mean": (2**63 - 1) / 5, "v_count": 5},
            {"k": 2, "v_sum": 1, "v_mean": 1.0, "v_count": 1}]
    # a final sum out of range still fails, naming the column and the key, in every order
    for order in ([0, 2], [2, 0]):
        agg = kernels.Aggregation("k", {"v": "sum"}, schema)
        for i in order:
            agg.update(batches[i])
        with pytest.raises(OverflowError, match=r"column 'v' leaves int64 \(key \{'k': 1\}"):
            agg.finish()
