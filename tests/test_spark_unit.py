"""Spark bridge without a JVM: schemas, key routing, and the staging / commit protocol driven directly
through the bridge's client functions against a timely job running in a thread."""
from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")
np = pytest.importorskip("numpy")
pytest.importorskip("pyspark")

import spark_bridge
import timely
from sparkjob import ThreadJob
from spark_bridge import datasource as D
from spark_bridge import schema as S
from spark_bridge.routing import hash_int64, owners
from timely.routing import hash64

SCHEMA = "key bigint, value bigint"


# -- schemas --------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_parse_ddl_and_arrow_types():
    fields = S.parse("key BIGINT, value double, name string, s struct<a:int, b:array<string>>, "
                     "d decimal(10,2), m map<string,long>, `odd name` timestamp")
    assert fields == [("key", "bigint"), ("value", "double"), ("name", "string"),
                      ("s", "struct<a:int,b:array<string>>"), ("d", "decimal(10,2)"),
                      ("m", "map<string,bigint>"), ("odd name", "timestamp")]
    sch = S.arrow_schema(fields)
    assert sch.field("s").type == pa.struct([("a", pa.int32()), ("b", pa.list_(pa.string()))])
    assert sch.field("odd name").type == pa.timestamp("us", tz="UTC")
    assert S.parse(S.ddl(fields)) == fields
    assert S.parse(sch) == fields
    assert S.parse([("k", "long"), ("v", pa.float64())]) == [("k", "bigint"), ("v", "double")]
    with pytest.raises(S.SchemaError, match="unsupported type 'interval'"):
        S.parse("a interval")
    with pytest.raises(S.SchemaError, match="repeats"):
        S.parse("a int, a int")


@pytest.mark.timeout(30)
def test_schema_mismatch_messages_name_column_and_types():
    declared = S.parse(SCHEMA)
    assert S.mismatch("ev", declared, S.parse("key long, value bigint")) is None
    msg = S.mismatch("ev", declared, S.parse("key bigint, value string"))
    assert "column 'value'" in msg and "string" in msg and "bigint" in msg
    assert "missing" in S.mismatch("ev", declared, S.parse("key bigint"))
    assert "'extra'" in S.mismatch("ev", declared, S.parse("key bigint, value bigint, extra int"))
    assert "order" in S.mismatch("ev", declared, S.parse("value bigint, key bigint"))


@pytest.mark.timeout(30)
def test_vectorised_key_hash_equals_hash64():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.integers(-2**63, 2**63 - 1, size=2000, dtype=np.int64),
                             np.array([0, 1, -1, 2**63 - 1, -2**63], dtype=np.int64)])
    assert [int(h) for h in hash_int64(values)] == [hash64(int(v)) for v in values]
    for peers in (2, 3, 8):
        assert owners(pa.array(values), peers).tolist() == [hash64(int(v)) % peers for v in values]
        strs = ["a", "bb", None, "ü"]
        assert owners(pa.array(strs), peers).tolist() == [hash64(s) % peers for s in strs]
        assert owners(pa.array([1, None, 3]), peers).tolist() == [hash64(x) % peers for x in (1, None, 3)]


# -- protocol against a running job (no Spark) -----------------------------------------------------------
def capture_job(scope, ep):
    ev = spark_bridge.source(scope, "events", SCHEMA, coordinator=ep)
    cap = ev.capture()
    spark_bridge.sink(ev.map(lambda r: (r[0], r[1] * 10)), "tenfold", SCHEMA)
    return cap.extract


def batch(keys, values=None):
    values = keys if values is None else values
    return pa.RecordBatch.from_arrays([pa.array(keys, pa.int64()), pa.array(values, pa.int64())],
                                      names=["key", "value"])


def read_all(ep, sink, start, end):
    r = D.TimelyBatchReader({"endpoint": ep, "stream": sink, "startingEpoch": str(start),
                             "endingEpoch": str(end), "epochColumn": "epoch", "timeout": "10"})
    return sorted((row["epoch"], row["key"], row["value"]) for p in r.partitions() for b in r.read(p)
                  for row in b.to_pylist())


FUZZ = pytest.mark.parametrize("fuzz", [None, 3, 11], ids=["plain", "fuzz3", "fuzz11"])  # schedule fuzzer seeds


@pytest.mark.timeout(60)
@FUZZ
def test_commit_publishes_only_winning_attempts_once(fuzz):
    with ThreadJob(capture_job, fuzz) as job:
        opts = {"endpoint": job.endpoint, "stream": "events", "timeout": "10"}
        plan = D._plan_write(opts, SCHEMA, False, "q1", 0)
        loser = D._write(plan, iter([batch([1, 2, 3])]), 0)  # a failed attempt: never committed
        winner = D._write(plan, iter([batch([4, 5]), batch([6])]), 0)
        assert winner.rows == [3]
        assert D._commit(plan, [winner], 0)["epoch"] == 0
        again = D._commit(plan, [winner], 0)  # idempotent
        assert again["epoch"] == 0 and again["duplicate"]
        # a late write for the committed batch is discarded, acknowledged as a duplicate
        D._write(plan, iter([batch([7])]), 0)
        plan2 = D._plan_write(opts, SCHEMA, False, "q2", 0)
        m = D._write(plan2, iter([batch([8, 9], [80, 90])]), 0)
        D._abort(plan2, [m], 0)  # aborted: contributes nothing
        plan3 = D._plan_write(opts, SCHEMA, False, "q3", 0)
        m = D._write(plan3, iter([batch([10], [100])]), 0)
        assert D._commit(plan3, [None, m], 0)["epoch"] == 1
        assert read_all(job.endpoint, "tenfold", 0, 2) == [(0, 4, 40), (0, 5, 50), (0, 6, 60), (1, 10, 1000)]
        st = spark_bridge.status(job.endpoint)["stats"]["events"]
        assert st["epochs"] == 2 and st["rows"] == 4 and st["staged_tokens"] == 0
        assert st["dropped_rows"] == 3 + 2
        assert loser.rows == [3]
        result = job.stop()
    assert result == [(0, [(4, 4), (5, 5), (6, 6)]), (1, [(10, 100)])]


@pytest.mark.timeout(60)
@FUZZ
def test_streaming_batches_are_epochs_and_replays_are_ignored(fuzz):
    with ThreadJob(capture_job, fuzz) as job:
        opts = {"endpoint": job.endpoint, "stream": "events", "timeout": "10"}
        plan = D._plan_write(opts, SCHEMA, False, "stream-ck", None)
        for b in range(3):
            m = D._write(plan, iter([batch([b])]), b)
            assert D._commit(plan, [m], b)["epoch"] == b
        # Spark replays batch 2 (its commit was not recorded in the checkpoint), then goes on
        m = D._write(plan, iter([batch([2])]), 2)
        assert D._commit(plan, [m], 2)["duplicate"]
        m = D._write(plan, iter([batch([3])]), 3)
        assert D._commit(plan, [m], 3)["epoch"] == 3
        st = spark_bridge.status(job.endpoint)["stats"]["events"]
        assert st["duplicate_rows"] == 1 and st["epochs"] == 4
        result = job.stop()
    assert result == [(b, [(b, b)]) for b in range(4)]


@pytest.mark.timeout(60)
def test_errors_are_clear():
    with ThreadJob(capture_job) as job:
        opts = {"endpoint": job.endpoint, "stream": "events", "timeout": "5"}
        with pytest.raises(spark_bridge.UnknownStream, match="unknown stream 'nope'.*sources: events"):
            D._plan_write({**opts, "stream": "nope"}, SCHEMA, False, "q", 0)
        with pytest.raises(spark_bridge.UnknownStream, match="it is a sink"):
            D._plan_write({**opts, "stream": "tenfold"}, SCHEMA, False, "q", 0)
        with pytest.raises(spark_bridge.SchemaMismatch, match="column 'value' has type string .* declares bigint"):
            D._plan_write(opts, "key bigint, value string", False, "q", 0)
        with pytest.raises(spark_bridge.SchemaMismatch, match="key column 'k'"):
            D._plan_write({**opts, "keyColumn": "k"}, SCHEMA, False, "q", 0)
        with pytest.raises(spark_bridge.BridgeError, match="append-only"):
            D._plan_write(opts, SCHEMA, True, "q", 0)
        plan = D._plan_write(opts, SCHEMA, False, "q", 0)
        m = D._write(plan, iter([batch([1])]), 0)
        spark_bridge.shutdown(job.endpoint)
        with pytest.raises(spark_bridge.BridgeError):
            D._commit(plan, [m], 0)
        assert job.stop() == []
    with pytest.raises(spark_bridge.CoordinatorUnreachable, match="tcp://127.0.0.1:9 did not answer"):
        D._plan_write({"endpoint": "tcp://127.0.0.1:9", "stream": "events", "timeout": "0.3"}, SCHEMA, False, "q", 0)


@pytest.mark.timeout(60)
def test_idle_bridge_does_not_spin():
    import os
    import time

    with ThreadJob(capture_job) as job:
        time.sleep(1.5)  # let the poll interval back off
        t0, c0 = time.monotonic(), os.times()
        time.sleep(2.0)
        c1 = os.times()
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        assert cpu / (time.monotonic() - t0) < 0.2, f"idle bridge used {cpu:.2f} s of CPU in 2 s"
        job.stop()


@pytest.mark.timeout(60)
def test_sink_records_that_do_not_fit_the_schema_fail_the_job_clearly():
    def job_build(scope, ep):
        ev = spark_bridge.source(scope, "events", SCHEMA, coordinator=ep)
        spark_bridge.sink(ev.map(lambda r: (str(r[0]), r[1])), "bad", SCHEMA)
        return lambda: None

    job = ThreadJob(job_build)
    with job:
        plan = D._plan_write({"endpoint": job.endpoint, "stream": "events", "timeout": "3"}, SCHEMA, False, "q", 0)
        m = D._write(plan, iter([batch([1, 2])]), 0)
        with pytest.raises(spark_bridge.BridgeError):
            D._commit(plan, [m], 0)
        job.thread.join(10)
        assert isinstance(job.error, timely.OperatorError)
        assert "SparkSink[bad]" in str(job.error) and "column 'key' (bigint)" in str(job.error)


def test_nested_field_names_that_need_quotes_keep_them():
    """`a b` and `c,d` inside a struct: the DDL sent to Spark, a re-parse of it, the Arrow schema
    and a Spark StructType all keep the names (the quotes were dropped: Spark could not parse the
    DDL, and a StructType failed as "unsupported type 'b'")."""
    import pyarrow as pa

    from spark_bridge import schema as S

    fields = S.parse("s struct<`a b`: int, `c,d`: bigint>")
    assert fields == [("s", "struct<`a b`:int,`c,d`:bigint>")]
    assert S.parse(S.ddl(fields)) == fields
    assert S.arrow_schema(fields).field("s").type == pa.struct([("a b", pa.int32()), ("c,d", pa.int64())])
    assert S.parse(S.arrow_schema(fields)) == fields
    types = pytest.importorskip("pyspark.sql.types")
    spark = types.StructType([types.StructField("s", types.StructType([
        types.StructField("a b", types.IntegerType()), types.StructField("c,d", types.LongType())]))])
    assert S.parse(spark) == fields
