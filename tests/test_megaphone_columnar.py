"""Megaphone on columns: ``megaphone.aggregate`` over streams of record batches, under random
migrations (and the schedule fuzzer), against a sequential computation of the running aggregates.

Random tables per epoch (int64, string, large string or dictionary-encoded keys, some null; int64
values with nulls; string values for min/max; empty batches), cut into random batches that the
workers send in turn; worker 0 issues random moves at random epochs (:func:`drive` of
``test_megaphone_ops.py``). The output must be, per time, one row per key that had rows at that
time with the key's running aggregates; after each epoch every bin lives where the table says.
"""
from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest
from conftest import FUZZ_SEEDS, property_on_workers, run
from hypothesis import given, settings
from hypothesis import strategies as st
from test_megaphone_ops import check_ownership, draw_moves, megaphone_job

import megaphone
import timely
from timely import BuildError, columnar

pytestmark = pytest.mark.timeout(300)

AGGREGATIONS = {"v": ["sum", "count", "min", "max", "mean"], "s": ["min", "max"]}
KEY_TYPES = {"int64": pa.int64(), "string": pa.string(), "large_string": pa.large_string(),
             "dictionary": pa.dictionary(pa.int32(), pa.string())}

int_keys = st.one_of(st.integers(0, 30), st.integers(-(2**63), 2**63 - 1), st.none())
str_keys = st.one_of(st.sampled_from(["a", "b", "cc", "", "é", "long key " * 3]), st.text(max_size=4), st.none())
values = st.one_of(st.integers(-100, 100), st.none())
texts = st.one_of(st.text("abcxyz", max_size=3), st.none())


def schema_of(key_type: str) -> pa.Schema:
    return pa.schema([("key", KEY_TYPES[key_type]), ("v", pa.int64()), ("s", pa.string())])


def draw_epoch(data, key_type: str, label: str) -> list[list[tuple]]:
    """One epoch's rows, cut into batches (some empty)."""
    keys = int_keys if key_type == "int64" else str_keys
    rows = st.tuples(keys, values, texts)
    return data.draw(st.lists(st.lists(rows, max_size=12), max_size=5), label=label)


def to_batch(rows: list[tuple], schema: pa.Schema) -> pa.RecordBatch:
    columns: list = list(zip(*rows)) if rows else [() for _ in schema]
    return pa.RecordBatch.from_arrays([pa.array(list(c), type=f.type) for c, f in zip(columns, schema)],
                                      schema=schema)


def sequential(epochs: list[list[list[tuple]]]) -> Counter:
    """Per time and key that had rows then: the running aggregates after the time, as a multiset of
    ``(time, key, v_sum, v_count, v_min, v_max, v_mean, s_min, s_max)``."""
    state: dict = {}
    out: Counter = Counter()
    for t, batches in enumerate(epochs):
        seen = []
        for key, v, s in (r for b in batches for r in b):
            st_ = state.setdefault(key, {"vs": [], "ss": []})
            if v is not None:
                st_["vs"].append(v)
            if s is not None:
                st_["ss"].append(s)
            if key not in seen:
                seen.append(key)
        for key in seen:
            vs, ss = state[key]["vs"], state[key]["ss"]
            total = sum(vs)
            out[(t, key, total if vs else None, len(vs), min(vs, default=None), max(vs, default=None),
                 total / len(vs) if vs else None, min(ss, default=None), max(ss, default=None))] += 1
    return out


def observed(results) -> Counter:
    """The output rows of every worker in the form of :func:`sequential`."""
    out: Counter = Counter()
    for captured, _ in results:
        for t, batches in captured:
            for b in batches:
                for r in b.to_pylist():
                    out[(t, r["key"], r["v_sum"], r["v_count"], r["v_min"], r["v_max"], r["v_mean"],
                         r["s_min"], r["s_max"])] += 1
    return out


def aggregate_job(epochs, moves, k: int, key_type: str, declared: bool = True):
    """The job: per epoch the batches of ``epochs`` (as record batches, shared out among the workers
    in turn), ``moves`` issued by worker 0; state shipped in chunks of 3 rows."""
    schema = schema_of(key_type)
    batches = [([to_batch(b, schema) for b in epoch],) for epoch in epochs]

    def build(streams, control):
        stream = columnar.from_batches(streams[0], schema if declared else None)
        return megaphone.aggregate(stream, control, "key", AGGREGATIONS, chunk=3)

    return megaphone_job(batches, moves, k, build)


def check_aggregate(workers: int, data, fuzz: int | None = None) -> None:
    key_type = data.draw(st.sampled_from(sorted(KEY_TYPES)), label="key type")
    k = data.draw(st.integers(1, 5), label="k")
    n = data.draw(st.integers(1, 5), label="epochs")
    epochs = [draw_epoch(data, key_type, f"epoch{e}") for e in range(n)]
    moves = draw_moves(data, k, workers, n)
    declared = data.draw(st.booleans(), label="schema declared")
    results = run(aggregate_job(epochs, moves, k, key_type, declared), workers, fuzz)
    assert observed(results) == sequential(epochs)
    check_ownership(results, workers, k)


@property_on_workers(single=20, multi=4, data=st.data())
def test_running_aggregates_under_random_migrations(workers, data):
    check_aggregate(workers, data)


@property_on_workers(single=10, multi=3, data=st.data(), seed=FUZZ_SEEDS)
def test_running_aggregates_under_the_schedule_fuzzer(workers, data, seed):
    check_aggregate(workers, data, fuzz=seed)


def test_every_bin_moves_and_back():
    """All bins go to worker 1 and back to worker 0 while keys keep arriving: the state (and the
    migration events) travel as Arrow, and the totals stay exact."""
    epochs = [[[(key, e, "x") for key in range(40)]] for e in range(6)]
    everything = {b: 1 for b in range(8)}
    moves = [{}, everything, {}, {b: 0 for b in range(8)}, {}, {}]
    results = run(aggregate_job(epochs, moves, 3, "int64"), 2)
    assert observed(results) == sequential(epochs)
    check_ownership(results, 2, 3)


def test_state_is_a_table_of_running_aggregates():
    """``Migratable.state()`` is the running aggregates of the bins a worker holds, as a table; the
    rows applied are counted per bin (the load the metrics and the AutoBalancer read)."""
    schema = schema_of("string")

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            control = megaphone.ControlInput(scope, k=2)
            m = megaphone.aggregate(columnar.from_batches(inp.stream, schema), control, "key", {"v": "sum"})
        inp.send(to_batch([("a", 1, None), ("b", None, None), ("a", 2, None)], schema))
        inp.advance_to(1)
        control.advance_to(1)
        worker.step_while(lambda: m.probe.less_than(1))
        return m.state(), m.batches.schema, m._shared.bin_records.tolist()

    [(state, out_schema, load)] = run(main, 1)
    assert isinstance(state, pa.Table)
    bin_a, bin_b = (megaphone.bins_of([(key,)], 0, 2)[0] for key in ("a", "b"))
    assert load == [2 * (b == bin_a) + (b == bin_b) for b in range(4)]  # rows applied per bin (metrics)
    assert sorted(state.to_pylist(), key=lambda r: r["key"]) == [{"key": "a", "v_sum": 3}, {"key": "b", "v_sum": None}]
    assert out_schema == pa.schema([("key", pa.string()), ("v_sum", pa.int64())])


@settings(max_examples=50, deadline=None)
@given(key_type=st.sampled_from(sorted(KEY_TYPES)), k=st.integers(0, 16), data=st.data())
def test_columnar_bin_of_a_key_is_the_row_bin(key_type, k, data):
    """A key falls in the same bin whether it travels in a row or in a record batch."""
    keys = data.draw(st.lists(int_keys if key_type == "int64" else str_keys, max_size=30))
    column = pa.array(keys, type=KEY_TYPES[key_type])
    batch = pa.RecordBatch.from_arrays([column], names=["key"])
    assert megaphone.bins_of_column(batch, "key", k).tolist() == megaphone.bins_of(keys, None, k)


def test_bad_key_column_fails_at_build_naming_operator_and_column():
    def build(schema, key="key", aggregations=None):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                control = megaphone.ControlInput(scope, k=2)
                megaphone.aggregate(columnar.from_batches(inp.stream, schema), control, key,
                                    aggregations or {"v": "sum"}, name="Totals")

        return main

    ok = pa.schema([("key", pa.int64()), ("v", pa.int64())])
    with pytest.raises(BuildError, match=r"'Totals'.*'nokey'"):
        run(build(ok, key="nokey"), 1)
    with pytest.raises(BuildError, match=r"'Totals'.*'key'.*list"):
        run(build(pa.schema([("key", pa.list_(pa.int64())), ("v", pa.int64())])), 1)
    with pytest.raises(BuildError, match=r"'Totals'.*'v'.*'median'"):
        run(build(ok, aggregations={"v": "median"}), 1)
    with pytest.raises(BuildError, match=r"'Totals'.*'w'"):
        run(build(ok, aggregations={"w": "sum"}), 1)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(("batch", "message"), [
    (pa.RecordBatch.from_pydict({"other": [1, 2], "v": [1, 2]}), r"'Totals'.*'key'"),
    (pa.RecordBatch.from_pydict({"key": [[1], [2]], "v": [1, 2]}), r"'Totals'.*'key'.*list"),
])
def test_bad_key_column_fails_at_run_naming_operator_and_column(workers, batch, message):
    """Without a declared schema the first batch is checked: a missing or unhashable key column
    fails naming the operator and the column, on one worker as on several."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            control = megaphone.ControlInput(scope, k=2)
            m = megaphone.aggregate(columnar.from_batches(inp.stream), control, "key", {"v": "sum"}, name="Totals")
        if worker.index == 0:
            inp.send(batch)
        inp.close()
        control.close()
        worker.step_while(lambda: not m.probe.done())

    with pytest.raises(timely.WorkerOperatorError, match=r"MegaphoneError: " + message):
        timely.execute(main, workers=workers, timeout=60)


def test_batch_of_another_schema_fails_naming_the_column():
    schema = pa.schema([("key", pa.int64()), ("v", pa.int64())])

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            control = megaphone.ControlInput(scope, k=2)
            m = megaphone.aggregate(columnar.BatchStream(inp.stream, schema), control, "key", {"v": "sum"},
                                    name="Totals")
        inp.send(pa.RecordBatch.from_pydict({"key": [1], "v": ["x"]}))
        inp.close()
        control.close()
        worker.step_while(lambda: not m.probe.done())

    with pytest.raises(timely.WorkerOperatorError, match=r"MegaphoneError: 'Totals'.*'v' is string"):
        timely.execute(main, workers=1, timeout=60)


def test_batches_differing_only_in_nullability_are_accepted_and_running_sums_never_wrap():
    """Spark marks columns ``not null`` that a declared schema leaves nullable: Megaphone accepts
    them as the other columnar operators do. A running integer sum that would leave int64 fails
    naming the operator, the column and the key (Arrow's sums wrap around)."""
    declared = pa.schema([("key", pa.int64()), ("v", pa.int64())])
    strict = pa.schema([pa.field("key", pa.int64(), nullable=False), pa.field("v", pa.int64(), nullable=False)])

    def job(values):
        return lambda worker: main(worker, values)

    def main(worker, values):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            control = megaphone.ControlInput(scope, k=2)
            m = megaphone.aggregate(columnar.BatchStream(inp.stream, declared), control, "key", {"v": "sum"},
                                    name="Totals")
            out = []
            m.batches.to_rows().inspect(out.append)
        for v in values:
            if worker.index == 0:
                inp.send(pa.RecordBatch.from_pydict({"key": [1], "v": [v]}, schema=strict))
            inp.advance_to(inp.time + 1)
            control.advance_to(inp.time)
        inp.close()
        control.close()
        worker.step_while(lambda: not m.probe.done())
        return out

    got = [r for rows in timely.execute(job([2**62, 2**62 - 1]), workers=2, timeout=60) for r in rows]
    assert sorted(got) == [(1, 2**62), (1, 2**63 - 1)]
    overflow = r"MegaphoneError: 'Totals'.*column 'v' leaves int64 \(key \{'key': 1\}"
    with pytest.raises(timely.WorkerOperatorError, match=overflow):
        timely.execute(job([2**62, 2**62]), workers=2, timeout=60)
