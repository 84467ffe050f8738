"""Columnar operators against row-by-row oracles, on 1-3 workers and under the schedule fuzzer."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import timely
from timely import columnar, routing
from timely.testing import run_epochs

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.float64())])
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

rows = st.tuples(st.one_of(st.none(), st.integers(-5, 5), st.integers(-2**63, 2**63 - 1)),
                 st.one_of(st.none(), st.sampled_from(["a", "b", "ü", "", "long" * 20])),
                 st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False)))
# epochs of batches of rows; a batch may be empty
epochs_st = st.lists(st.lists(st.lists(rows, max_size=30), max_size=4), min_size=1, max_size=3)


def as_batches(epochs: list, schema: pa.Schema = SCHEMA, dictionary: bool = False) -> list[list[pa.RecordBatch]]:
    out = []
    for epoch in epochs:
        batches = []
        for rs in epoch:
            b = pa.RecordBatch.from_pylist([dict(zip(schema.names, r)) for r in rs], schema=schema)
            if dictionary:
                b = b.set_column(1, "s", pc.dictionary_encode(b.column("s")))
            batches.append(b)
        out.append(batches)
    return out


def oracle_rows(epochs: list, f=lambda r: [r]) -> list[tuple[int, list]]:
    got = []
    for e, epoch in enumerate(epochs):
        out = [x for rs in epoch for r in rs for x in f(r)]
        if out:
            got.append((e, sorted(out, key=repr)))
    return got


def resort(result: list) -> list:
    return [(t, sorted(rs, key=repr)) for t, rs in result if rs]


@pytest.mark.parametrize("workers", [1, 3])
@SETTINGS
@given(epochs=epochs_st)
def test_select_filter_map_columns_match_rows(workers: int, epochs: list) -> None:
    def build(s: timely.Stream) -> timely.Stream:
        return (columnar.from_batches(s, SCHEMA)
                .filter(pc.field("k") > 0)
                .select("s", "k", double=pc.field("v") * 2)
                .map_columns(lambda b: {"k": b.column("k"), "n": pc.utf8_length(b.column("s"))})
                .to_rows())

    def want(r: tuple) -> list:
        k, s, _v = r
        return [(k, None if s is None else len(s))] if k is not None and k > 0 else []

    assert resort(run_epochs(build, as_batches(epochs), workers)) == oracle_rows(epochs, want)


def python_aggregate(epochs: list) -> list[tuple[int, list]]:
    out = []
    for e, epoch in enumerate(epochs):
        groups: dict = defaultdict(list)
        for rs in epoch:
            for k, s, v in rs:
                groups[(k, s)].append(v)
        res = []
        for (k, s), vs in groups.items():
            vals = [v for v in vs if v is not None]
            res.append((k, s, len(vals), sum(vals) if vals else None, min(vals) if vals else None,
                        max(vals) if vals else None, sum(vals) / len(vals) if vals else None))
        if res:
            out.append((e, sorted(res, key=repr)))
    return out


def close(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for (ta, ra), (tb, rb) in zip(a, b):
        if ta != tb or len(ra) != len(rb):
            return False
        for x, y in zip(ra, rb):
            for u, w in zip(x, y):
                if isinstance(u, float) and isinstance(w, float):
                    if not math.isclose(u, w, rel_tol=1e-9, abs_tol=1e-6):
                        return False
                elif u != w:
                    return False
    return True


@pytest.mark.parametrize("workers,dictionary,fuzz", [(1, False, None), (2, True, None), (3, False, None),
                                                      (2, False, 7)])
@SETTINGS
@given(epochs=epochs_st)
def test_aggregate_by_matches_python(workers: int, dictionary: bool, fuzz: int | None, epochs: list) -> None:
    def build(s: timely.Stream) -> timely.Stream:
        return (columnar.from_batches(s, None)
                .aggregate_by(["k", "s"], {"v": ["count", "sum", "min", "max", "mean"]})
                .to_rows())

    got = resort(run_epochs(build, as_batches(epochs, dictionary=dictionary), workers, fuzz=fuzz))
    assert close(got, python_aggregate(epochs)), (got, python_aggregate(epochs))


def test_aggregate_output_schema_and_large_strings() -> None:
    schema = pa.schema([("k", pa.large_string()), ("v", pa.int64())])
    epochs = [[pa.RecordBatch.from_pydict({"k": ["x" * 1000, "y", "x" * 1000], "v": [1, 2, 3]}, schema=schema)]]
    seen = []

    def build(s: timely.Stream) -> timely.Stream:
        agg = columnar.from_batches(s, schema).aggregate_by("k", {"v": ["sum", "count"]})
        seen.append(agg.schema)
        return agg.to_rows()

    want = [(0, sorted([("x" * 1000, 4, 2), ("y", 2, 1)]))]
    assert run_epochs(build, epochs, 2) == want
    assert run_epochs(build, epochs, 1) == want  # built in this process: the schema is seen here
    assert seen[0].names == ["k", "v_sum", "v_count"]


@pytest.mark.parametrize("workers", [2, 3])
def test_exchange_by_lands_where_the_row_exchange_does(workers: int) -> None:
    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])
    keys = [f"key{i}" for i in range(200)] + ["", "ü"]
    batch = pa.RecordBatch.from_pydict({"k": keys, "n": list(range(len(keys)))}, schema=schema)

    def main(worker: timely.Worker) -> list:
        got: list = []
        with worker.dataflow() as scope:
            inp = scope.new_input()
            (columnar.from_batches(inp.stream, schema).exchange_by("k").to_rows()
             .inspect(lambda r: got.append((worker.index, r))))
        if worker.index == 0:
            inp.send(batch)
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=30)
        return got

    placed = sorted(x for part in timely.execute(main, workers=workers, timeout=60) for x in part)
    assert placed == sorted((routing.hash64(k) % workers, (k, n)) for n, k in enumerate(keys))


def test_rows_round_trip_and_record_batches_inside_records() -> None:
    schema = pa.schema([("a", pa.int32()), ("b", pa.string())])
    data = [[(1, "x"), (2, None)], [(3, "z")]]

    def build(s: timely.Stream) -> timely.Stream:
        cols = columnar.from_rows(s, schema)
        # A batch inside an ordinary record crosses workers as Arrow IPC (a msgpack extension).
        return (cols.stream.map(lambda b: (b.num_rows % 2, b)).exchange(0)
                .flat_map(lambda kb: columnar.rows_of(kb[1])))

    assert run_epochs(build, data, 2) == [(0, [(1, "x"), (2, None)]), (1, [(3, "z")])]


def test_schema_mismatch_names_operator_and_column() -> None:
    bad = pa.RecordBatch.from_pydict({"k": pa.array([1], pa.int32()), "s": ["a"], "v": [1.0]})
    with pytest.raises(timely.WorkerError, match=r"'Checked'.*column 'k' is int32, expected int64"):
        run_epochs(lambda s: columnar.from_batches(s, SCHEMA, name="Checked").to_rows(), [[bad]], 2)


def test_missing_and_unsupported_key_columns() -> None:
    with pytest.raises(timely.BuildError, match="no column 'nope'"):
        run_epochs(lambda s: columnar.from_batches(s, SCHEMA).exchange_by("nope").to_rows(), [[]], 1)
    schema = pa.schema([("l", pa.list_(pa.int64())), ("v", pa.int64())])
    b = pa.RecordBatch.from_pydict({"l": [[1]], "v": [1]}, schema=schema)
    # The schema known: the build fails, naming the operator and the column.
    with pytest.raises(timely.BuildError, match=r"'ByList'.*key column 'l' has type list<item: int64>"):
        run_epochs(lambda s: columnar.from_batches(s, schema).exchange_by("l", name="ByList").to_rows(), [[]], 1)
    with pytest.raises(timely.BuildError, match=r"'Agg'.*key column 'l'"):
        run_epochs(lambda s: columnar.from_batches(s, schema).aggregate_by("l", {"v": "sum"}, name="Agg").to_rows(),
                   [[]], 1)
    # The schema unknown: the first batch fails, naming them.
    for workers in (1, 2):
        with pytest.raises((timely.WorkerError, timely.OperatorError), match=r"'ByList'.*'l'"):
            run_epochs(lambda s: columnar.from_batches(s).exchange_by("l", name="ByList").to_rows(),
                       [[b]], workers)


def test_aggregate_validation_at_build() -> None:
    with pytest.raises(timely.BuildError, match="'s'.*sum|sum.*'s'"):
        run_epochs(lambda s: columnar.from_batches(s, SCHEMA).aggregate_by("k", {"s": "sum"}).to_rows(), [[]], 1)
    with pytest.raises(timely.BuildError, match="median"):
        run_epochs(lambda s: columnar.from_batches(s, SCHEMA).aggregate_by("k", {"v": "median"}).to_rows(), [[]], 1)


def test_from_rows_names_the_bad_row() -> None:
    schema = pa.schema([("a", pa.int64())])
    with pytest.raises(timely.OperatorError, match=r"'Rows'.*row \('x',\): column 'a'"):
        run_epochs(lambda s: columnar.from_rows(s, schema, name="Rows").to_rows(), [[(1,), ("x",)]], 1)


def test_batches_larger_than_a_message_are_sliced() -> None:
    from timely.columnar import channels

    schema = pa.schema([("k", pa.int64()), ("pad", pa.binary())])
    n = 3000
    b = pa.RecordBatch.from_pydict({"k": list(range(n)), "pad": [b"x" * 4000] * n}, schema=schema)  # 12 MB

    def build(s: timely.Stream) -> timely.Stream:
        return (columnar.from_batches(s, schema).exchange_by("k")
                .map_columns(lambda x: {"k": x.column("k")}).to_rows())

    assert channels.GATHER_BYTES < b.nbytes
    assert run_epochs(build, [[b]], 2) == [(0, [(k,) for k in range(n)])]


def test_input_refuses_a_bad_batch_and_keeps_what_it_accepted() -> None:
    good = pa.RecordBatch.from_pydict({"k": [1, 2], "s": ["a", "b"], "v": [1.0, 2.0]}, schema=SCHEMA)
    bad = good.drop_columns(["v"])

    def main(worker: timely.Worker) -> tuple[list, list]:
        errors: list = []
        with worker.dataflow() as scope:
            inp = columnar.new_input(scope, SCHEMA, name="Bids")
            captured = inp.stream.aggregate_by("k", {"v": "sum"}).to_rows().capture()
        for sent in (good, bad, pa.Table.from_batches([bad.append_column("v", pa.array([1, 2]))]),
                     {"k": [3], "s": ["c"], "v": [3.0]}, {"k": ["x"]}):
            try:
                inp.send(sent)
            except ValueError as e:
                errors.append(str(e))
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=30)
        return errors, captured.records()

    results = timely.execute(main, workers=2, timeout=60)
    for errors, _ in results:
        assert len(errors) == 3
        assert "'Bids'" in errors[0] and "column 'v' is missing" in errors[0]
        assert "column 'v' is int64, expected double" in errors[1]
        assert "'Bids'" in errors[2]
    # every worker's accepted batches (good, then the mapping) are counted: k=1,2 twice, k=3 twice
    assert sorted(r for _, out in results for r in out) == [(1, 2.0), (2, 4.0), (3, 6.0)]


# -- integer sums never wrap; odd values and keys (found by review) --------------------------------
def _sums(schema: pa.Schema, batches: list[pa.RecordBatch], workers: int = 1, fns=("sum", "mean")) -> list:
    return run_epochs(lambda s: columnar.from_batches(s, schema).aggregate_by("k", {"v": list(fns)}).to_rows(),
                      [batches], workers, timeout=60)


def test_an_int64_sum_that_leaves_int64_fails_naming_the_column_and_key() -> None:
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    batch = pa.record_batch([[1, 1, 2], [2**63 - 1, 1, 5]], schema=schema)  # Arrow's sum wraps to -2**63
    with pytest.raises(timely.WorkerOperatorError, match=r"OverflowError.*column 'v' leaves int64 \(key \{'k': 1\}"):
        _sums(schema, [batch], workers=2)
    # ... also when the partial sums are in range and only their merge (another batch) leaves it
    agg = columnar.Aggregation("k", {"v": "sum"}, schema)
    agg.update(pa.record_batch([[1], [2**62]], schema=schema))
    agg.finish()
    for _ in range(3):
        agg.update(pa.record_batch([[1], [2**62]], schema=schema))
    with pytest.raises(OverflowError, match="column 'v'"):
        agg.finish()
    # negative, and back in range: exact
    agg = columnar.Aggregation("k", {"v": "sum"}, schema)
    agg.update(pa.record_batch([[1, 1, 1], [-(2**63), 2**62, -(2**62) - 1]], schema=schema))
    with pytest.raises(OverflowError):
        agg.finish()
    agg = columnar.Aggregation("k", {"v": "sum"}, schema)
    agg.update(pa.record_batch([[1, 1, 1], [2**63 - 1, -(2**63), 7]], schema=schema))
    assert agg.finish().to_pylist() == [{"k": 1, "v_sum": 6}]


def test_uint64_sums_are_uint64_and_means_of_large_integers_are_floats() -> None:
    schema = pa.schema([("k", pa.int64()), ("v", pa.uint64())])
    batch = pa.record_batch([pa.array([1, 1, 2]), pa.array([2**63, 5, 2**64 - 1], pa.uint64())], schema=schema)
    assert resort(_sums(schema, [batch])) == [(0, [(1, 2**63 + 5, (2**63 + 5) / 2), (2, 2**64 - 1, float(2**64 - 1))])]
    with pytest.raises(timely.OperatorError, match=r"column 'v' leaves uint64"):
        _sums(schema, [batch, batch], fns=("sum",))
    # a mean whose integer sum passes 2**53 (6,000 millisecond timestamps): a float, not an error
    ints = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    stamps = pa.record_batch([[0] * 6000, [1_700_000_000_000] * 6000], schema=ints)
    assert _sums(ints, [stamps], fns=("mean",)) == [(0, [(0, 1_700_000_000_000.0)])]


@pytest.mark.parametrize("workers", [1, 2])
def test_float_keys_minus_zero_and_zero_are_one_key_as_in_rows(workers: int) -> None:
    schema = pa.schema([("k", pa.float64()), ("v", pa.int64())])
    batch = pa.record_batch([[-0.0, 0.0, 0.0, 1.5], [1, 2, 3, 4]], schema=schema)
    got = run_epochs(lambda s: columnar.from_batches(s, schema).aggregate_by("k", {"v": "count"}).to_rows(),
                     [[batch]], workers, timeout=60)
    rows = run_epochs(lambda s: s.flat_map(lambda b: b.to_pylist()).map(lambda r: (r["k"], r["v"]))
                      .count_by_key(0), [[batch]], workers, timeout=60)
    assert resort(got) == [(0, [(0.0, 3), (1.5, 1)])] == resort(rows)


@pytest.mark.parametrize("column_type", [pa.float16(), pa.duration("s"), pa.month_day_nano_interval()])
def test_min_max_of_a_type_arrow_cannot_order_fails_at_build(column_type: pa.DataType) -> None:
    schema = pa.schema([("k", pa.int64()), ("v", column_type)])
    with pytest.raises(timely.BuildError, match=r"'Agg'.*'min' of column 'v': pyarrow has no grouped min/max"):
        run_epochs(lambda s: columnar.from_batches(s, schema).aggregate_by("k", {"v": "min"}, name="Agg").to_rows(),
                   [[]], 1)


def test_batches_of_two_schemas_at_one_time_cross_workers_intact() -> None:
    """A stream without a declared schema may carry batches of several; parts of different schemas
    never share a message (its receiver would read them all with the first one's)."""
    ints = pa.record_batch([[1, 3, 4], [1, 2, 3]], names=["k", "v"])
    floats = pa.record_batch([[1, 3, 4], [1.5, 2.5, 3.5]], names=["k", "v"])
    got = run_epochs(lambda s: columnar.from_batches(s).exchange_by("k").stream
                     .flat_map(lambda b: [(str(b.schema.field("v").type), r["k"], r["v"]) for r in b.to_pylist()]),
                     [[ints, ints.slice(0, 0), floats]], 2, timeout=60)  # (records dealt in turn: both to worker 0)
    assert resort(got) == [(0, sorted([("int64", 1, 1), ("int64", 3, 2), ("int64", 4, 3),
                                       ("double", 1, 1.5), ("double", 3, 2.5), ("double", 4, 3.5)], key=repr))]


def test_send_of_a_mapping_names_the_input_and_column() -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string())])

    def main(worker):
        with worker.dataflow() as scope:
            inp = columnar.new_input(scope, schema, name="In")
        errors = []
        for columns in ({"a": [1], "b": ["x"], "c": [9]}, {"a": [1, 2], "b": ["x"]}, {"a": [1]},
                        {"a": 1, "b": "x"}, {"a": ["q"], "b": ["x"]}, {"a": [2**70], "b": ["x"]},
                        {"a": [1], "b": [3]}):
            try:
                inp.send(columns)
            except ValueError as e:
                errors.append(str(e))
        inp.send({"a": [7], "b": ["y"]})
        inp.close()
        return errors

    (errors,) = timely.execute(main, workers=1, timeout=60)
    assert [e.split(":", 1)[0] for e in errors] == ["input 'In'"] * 7
    assert "column 'c' is not in the schema" in errors[0]
    assert "column 'b' has 1 values, column 'a' 2" in errors[1]
    assert "column 'b' of the schema is missing" in errors[2]
    assert "column 'a' is not a sequence" in errors[3]
    assert "column 'a' does not convert to int64: ArrowInvalid" in errors[4]
    # An int beyond the type (a bare OverflowError before) and a value of another type, by column.
    assert "column 'a' does not convert to int64: OverflowError" in errors[5]
    assert "column 'b' does not convert to string: ArrowTypeError" in errors[6]


def test_many_tiny_parts_stay_within_a_small_message_limit():
    """Each part adds a head and buffer slack its rows' bytes do not count: 5,000 one-row parts
    gathered for a worker under a 64 KiB limit go in several messages, each within the limit,
    every row once and in order."""
    from types import SimpleNamespace

    from timely.columnar import codec
    from timely.columnar.channels import ColumnChannel
    from timely.comm.framing import buffer_frames, encode
    from timely.comm.framing import encode_items as encode_body

    limit = 64 << 10

    class Recording:
        max_bytes = limit

        def __init__(self) -> None:
            self.sizes: list[int] = []
            self.rows: list[int] = []

        encode_items = staticmethod(encode_body)

        def push_buffers(self, head, buffers):
            frames, size = buffer_frames(buffers)
            self.sizes.append(size + len(encode(head)))
            for b in codec.decode(head[1], frames):
                self.rows.extend(b.column("a").to_pylist())

    pushers = [Recording(), Recording()]
    target = SimpleNamespace(op=SimpleNamespace(name="T"), deliver=lambda t, b: None)
    df = SimpleNamespace(index=0, peers=2, ctx=SimpleNamespace(pending=[]),
                         allocate_channel=lambda target, decoder=None: (pushers, None))
    channel = ColumnChannel(df, target, lambda t, batches, peers: [[], list(batches)])
    for i in range(5000):
        channel.push(0, [pa.record_batch({"a": pa.array([i], pa.int64()), "s": pa.array([str(i)])})])
    while df.ctx.pending:
        df.ctx.pending.pop().flush()
    assert len(pushers[1].sizes) > 1 and max(pushers[1].sizes) <= limit
    assert pushers[1].rows == list(range(5000))


def test_a_batch_sent_as_ipc_is_decoded_onto_aligned_buffers():
    # Lists (and views, structs) travel as one IPC frame, which ZeroMQ may place at any address:
    # decoded in place, Acero warned "An input buffer was poorly aligned" for every such batch.
    from timely.columnar import codec

    rb = pa.record_batch({"k": pa.array([1, 2, 3], pa.int64()), "l": pa.array([[1], [2, 3], []], pa.list_(pa.int64()))})
    meta, buffers = codec.encode([rb])
    frames = []
    for b in buffers:
        raw = bytearray(b.size + 1)
        raw[1:] = b.to_pybytes()
        frames.append(memoryview(raw)[1:])  # at an odd address
    (back,) = codec.decode(meta, frames)
    assert back.equals(rb)
    for column in back.columns:
        for buf in column.buffers():
            assert buf is None or buf.address % 8 == 0


def test_a_schema_of_no_columns_takes_an_empty_mapping():
    def main(worker):
        with worker.dataflow() as scope:
            inp = columnar.new_input(scope, pa.schema([]))
        inp.send({})  # (an IndexError before)
        inp.close()
        worker.finish()
        return True

    assert timely.execute(main) == [True]


def test_filter_refuses_view_columns_when_the_stream_is_built():
    # The check on an empty batch passed (no filter kernel runs on zero rows): the job failed on
    # its first batch instead.
    from timely.errors import BuildError

    def main(worker):
        with worker.dataflow() as scope:
            inp = columnar.new_input(scope, pa.schema([("k", pa.int64()), ("s", pa.string_view())]))
            with pytest.raises(BuildError, match=r"filter does not take string_view or binary_view columns yet "
                                                 r"\(column 's'\)"):
                inp.stream.filter(pc.field("k") > 1)
        inp.close()
        worker.finish()
        return True

    assert timely.execute(main) == [True]


MIXED = pa.schema([("k", pa.int64()), ("s", pa.string())])


def _mixed_batch(epoch: int, worker: int) -> pa.RecordBatch:
    rng = np.random.default_rng(epoch * 10 + worker)
    keys = rng.integers(0, 50, 40).tolist()
    strings = ["x" * n for n in rng.choice([0, 1, 5, 50, 300], 40).tolist()]
    return pa.RecordBatch.from_arrays([pa.array(keys, pa.int64()), pa.array(strings)], schema=MIXED)


def _mixed_exchange_job(worker):
    out = []
    with worker.dataflow() as scope:
        inp = columnar.new_input(scope, MIXED)
        moved = inp.stream.exchange_by("k")
        moved.to_rows().inspect(lambda r: out.append((worker.index, r[0], len(r[1]))))
        probe = moved.probe()
    for e in range(5):
        inp.send(_mixed_batch(e, worker.index))
        inp.advance_to(e + 1)
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=40)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", [1024, 2048])
def test_a_part_near_a_small_message_limit_is_measured_and_cut_to_fit(limit):
    """A part's message carries its head and a slice's buffers from the byte-aligned start, more
    than its rows' bytes: under a limit of 1-2 KiB a single part went over it (MessageTooLarge).
    Parts near the limit are measured, compacted or halved."""
    from timely.cluster import execute_cluster

    results = execute_cluster(_mixed_exchange_job, 3, timeout=60, max_message_bytes=limit)
    got = sorted((k, n) for result in results for _, k, n in result)
    expected = sorted((k, len(s)) for e in range(5) for w in range(3)
                      for k, s in zip(*(c.to_pylist() for c in _mixed_batch(e, w).columns)))
    assert got == expected
    placed = {(w, k) for result in results for w, k, _ in result}
    assert len({k for _, k in placed}) == len(placed)  # every key on one worker
