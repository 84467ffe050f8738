"""Spark bridge end to end: local-mode PySpark writing into and reading from a running timely job.

One session-scoped SparkSession (``local[2,2]``: two cores, a task may be attempted twice; UI off;
2 shuffle partitions; loopback only). ``format("timely")`` is found by Spark itself through the
``pyspark_timely`` module (no ``register`` call). Every timely job runs in a background thread of
this process and is shut down (and joined) by its context manager, also when a test fails.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
if not (os.environ.get("JAVA_HOME") or __import__("shutil").which("java")):
    pytest.skip("Spark needs Java 17+ (no java on PATH, no JAVA_HOME)", allow_module_level=True)
pq = pytest.importorskip("pyarrow.parquet")

from sparkjob import LaunchedJob, ThreadJob, stop_jvm  # noqa: E402

import spark_bridge  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
SCHEMA = "key bigint, value bigint"


@pytest.fixture(scope="session")
def spark():
    from spark_bridge.session import local_session

    # Spark's Python workers find pyspark_timely (auto-registration) and spark_bridge on ROOT.
    session = local_session("local[2,2]", "timely-bridge-tests", python_path=ROOT, register=False)
    yield session
    session.stop()
    stop_jvm()


def agg_job(scope, ep):
    """events -> per epoch and key: (key, count, sum of values), served as the sink 'agg'."""
    ev = spark_bridge.source(scope, "events", SCHEMA, coordinator=ep)
    cap = ev.capture()
    agg = (ev.map(lambda r: (r[0], (1, r[1])))
           .reduce_by_key(lambda a, b: (a[0] + b[0], a[1] + b[1]))
           .map(lambda kv: (kv[0], kv[1][0], kv[1][1])))
    spark_bridge.sink(agg, "agg", "key bigint, n bigint, total bigint")
    return cap.extract


def write(df, ep, stream="events", **options):
    w = df.write.format("timely").mode("append").option("endpoint", ep).option("stream", stream)
    for k, v in options.items():
        w = w.option(k, str(v))
    w.save()


def read_agg(spark, ep, **options):
    r = spark.read.format("timely").option("endpoint", ep).option("stream", "agg").option("epochColumn", "epoch")
    for k, v in options.items():
        r = r.option(k, str(v))
    return sorted(tuple(row) for row in r.load().collect())


def spark_agg(df, epoch):
    from pyspark.sql import functions as F

    rows = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")).collect()
    return sorted((r["key"], r["n"], r["total"], epoch) for r in rows)


def rows_of(df):
    return Counter((r["key"], r["value"]) for r in df.collect())


def captured(result):
    return Counter(tuple(r) for _, recs in result for r in recs)


@pytest.mark.timeout(240)
def test_batch_round_trip_equals_spark_sql(spark):
    df1 = spark.range(0, 50_000, numPartitions=4).selectExpr("id % 13 as key", "id as value")
    df2 = spark.range(0, 20_000, numPartitions=3).selectExpr("(id * 7) % 5 as key", "id * 3 as value")
    with ThreadJob(agg_job) as job:
        write(df1, job.endpoint)                       # epoch 0, round-robin over workers
        write(df2, job.endpoint, keyColumn="key")      # epoch 1, routed by key hash
        got = read_agg(spark, job.endpoint, endingEpoch=2)
        assert got == sorted(spark_agg(df1, 0) + spark_agg(df2, 1))
        # a read of one epoch
        assert read_agg(spark, job.endpoint, startingEpoch=1, endingEpoch=2) == spark_agg(df2, 1)
        result = job.stop()
    assert [t for t, _ in result] == [0, 1]
    assert captured(result) == rows_of(df1) + rows_of(df2)


def secret_agg_job(scope, ep):
    """``agg_job`` on a bridge that admits only clients holding the secret ``spark sesame``."""
    spark_bridge.serve(scope.worker, ep, secret="spark sesame")
    return agg_job(scope, ep)


@pytest.mark.timeout(240)
def test_a_job_with_a_secret_is_written_and_read_only_with_it(spark, tmp_path):
    df = spark.range(0, 5_000, numPartitions=2).selectExpr("id % 7 as key", "id as value")
    secret_file = tmp_path / "secret"
    secret_file.write_text("spark sesame\n")
    with ThreadJob(secret_agg_job, secret="spark sesame") as job:
        with pytest.raises(Exception, match=r"did not answer.*option 'secret'"):
            write(df, job.endpoint, timeout=0.5)
        with pytest.raises(Exception, match=r"did not answer"):
            read_agg(spark, job.endpoint, timeout=0.5, secret="not it")
        write(df, job.endpoint, secret="spark sesame", keyColumn="key")   # the executors get the keys too
        assert read_agg(spark, job.endpoint, endingEpoch=1, secretFile=secret_file) == spark_agg(df, 0)
        result = job.stop()
    assert captured(result) == rows_of(df)


@pytest.mark.timeout(240)
def test_task_failing_on_first_attempt_counts_once(spark):
    from pyspark.sql import functions as F

    @F.udf("bigint")
    def flaky(x):
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc.attemptNumber() == 0 and tc.partitionId() == 0 and x == 9_900:
            raise RuntimeError("injected failure of the first attempt")
        return x

    df = spark.range(0, 20_000, numPartitions=2).selectExpr("id % 11 as key", "id as value")
    flaky_df = df.select("key", flaky("value").alias("value"))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    try:
        with ThreadJob(agg_job) as job:
            write(flaky_df, job.endpoint)
            assert read_agg(spark, job.endpoint, endingEpoch=1) == spark_agg(df, 0)
            stats = job.stats()
            result = job.stop()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert captured(result) == rows_of(df)
    assert stats["epochs"] == 1 and stats["rows"] == 20_000 and stats["staged_tokens"] == 0
    # the failed attempt had pushed rows before it died; they were staged and then dropped
    assert stats["dropped_rows"] > 0


@pytest.mark.timeout(240)
def test_aborted_batch_contributes_nothing(spark):
    from pyspark.sql import functions as F

    @F.udf("bigint")
    def broken(x):
        if x == 7_000:
            raise RuntimeError("this write always fails")
        return x

    good = spark.range(0, 5_000, numPartitions=2).selectExpr("id % 3 as key", "id as value")
    bad = spark.range(0, 10_000, numPartitions=2).select((F.col("id") % 3).alias("key"), broken("id").alias("value"))
    with ThreadJob(agg_job) as job:
        with pytest.raises(Exception, match="this write always fails"):
            write(bad, job.endpoint)
        write(good, job.endpoint)
        assert read_agg(spark, job.endpoint, endingEpoch=1) == spark_agg(good, 0)
        deadline = time.monotonic() + 10
        while job.stats()["staged_tokens"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = job.stats()
        result = job.stop()
    assert captured(result) == rows_of(good)
    assert stats["epochs"] == 1 and stats["staged_tokens"] == 0


def _parquet_files(directory: Path, parts: list[list[tuple[int, int]]], first: int = 0) -> None:
    directory.mkdir(exist_ok=True)
    for i, rows in enumerate(parts, start=first):
        table = pa.table({"key": pa.array([k for k, _ in rows], pa.int64()),
                          "value": pa.array([v for _, v in rows], pa.int64())})
        tmp = directory / f".part-{i:04d}.tmp"
        pq.write_table(table, tmp)
        os.utime(tmp, (1_000_000 + i, 1_000_000 + i))  # file order = batch order
        tmp.rename(directory / f"part-{i:04d}.parquet")


def _stream_into(spark, ep, src: Path, checkpoint: Path):
    df = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(src)))
    q = (df.writeStream.format("timely").option("endpoint", ep).option("stream", "events")
         .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert not q.isActive
    if q.exception():
        raise q.exception()


@pytest.mark.timeout(240)
def test_streaming_write_with_replay_after_restart(spark, tmp_path):
    src, ck = tmp_path / "in", tmp_path / "ck"
    parts = [[(i % 4, i + 100 * b) for i in range(50 + 10 * b)] for b in range(4)]
    _parquet_files(src, parts[:3])
    with ThreadJob(agg_job) as job:
        _stream_into(spark, job.endpoint, src, ck)  # micro-batches 0, 1, 2 -> epochs 0, 1, 2
        assert job.stats()["epochs"] == 3
        # Spark crashed after our commit of batch 2 but before recording it: the restart replays it
        (ck / "commits" / "2").unlink()
        (ck / "commits" / ".2.crc").unlink(missing_ok=True)
        _stream_into(spark, job.endpoint, src, ck)
        stats = job.stats()
        assert stats["epochs"] == 3 and stats["duplicate_rows"] == len(parts[2])
        _parquet_files(src, parts[3:], first=3)
        _stream_into(spark, job.endpoint, src, ck)  # batch 3 -> epoch 3
        assert job.stats()["epochs"] == 4
        got = read_agg(spark, job.endpoint, endingEpoch=4)
        all_rows = spark.read.parquet(str(src))
        result = job.stop()
    assert captured(result) == Counter(r for p in parts for r in p)
    assert [t for t, _ in result] == [0, 1, 2, 3]
    per_key = Counter()
    for key, n, total, _epoch in got:
        per_key[key] += n
    expected = {r["key"]: r["count"] for r in all_rows.groupBy("key").count().collect()}
    assert dict(per_key) == expected


@pytest.mark.timeout(240)
def test_streaming_read_releases_on_commit_and_never_duplicates(spark, tmp_path):
    df0 = spark.range(0, 3_000, numPartitions=2).selectExpr("id % 5 as key", "id as value")
    df1 = spark.range(0, 1_000, numPartitions=2).selectExpr("id % 7 as key", "id as value")
    ck = tmp_path / "read-ck"
    seen: list = []

    def run_reader(ep):
        def collect(batch_df, batch_id):
            seen.extend((batch_id, *tuple(r)) for r in batch_df.collect())

        q = (spark.readStream.format("timely").option("endpoint", ep).option("stream", "agg")
             .option("epochColumn", "epoch").load()
             .writeStream.foreachBatch(collect).option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start())
        q.awaitTermination(120)
        if q.exception():
            raise q.exception()

    def sink_status(ep):
        from spark_bridge.client import request_worker
        from spark_bridge.protocol import Op

        info = spark_bridge.status(ep)
        return request_worker(info["endpoints"][0], 0, Op.STATUS, {"sink": "agg"}, 5)

    with ThreadJob(agg_job) as job:
        write(df0, job.endpoint)
        _wait_complete(job.endpoint, 1)
        run_reader(job.endpoint)
        first = sorted(r[1:] for r in seen)
        assert sorted((k, n, t, e) for k, n, t, e in first) == spark_agg(df0, 0)
        run_reader(job.endpoint)  # nothing new: no batch, no duplicate
        assert len(seen) == len(first)
        write(df1, job.endpoint)
        _wait_complete(job.endpoint, 2)
        run_reader(job.endpoint)
        assert sorted(r[1:] for r in seen) == sorted(spark_agg(df0, 0) + spark_agg(df1, 1))
        # epoch 0 was committed by the reader (Spark commits a batch when the next one starts)
        assert sink_status(job.endpoint)["released"] >= 1
        job.stop()


def _wait_complete(ep, epochs, timeout=30):
    from spark_bridge.datasource import _SinkClient

    c = _SinkClient({"endpoint": ep, "stream": "agg", "timeout": "5"})
    deadline = time.monotonic() + timeout
    while c.latest() < epochs:
        assert time.monotonic() < deadline, "sink did not complete in time"
        time.sleep(0.02)


@pytest.mark.timeout(240)
def test_clear_errors(spark):
    df = spark.range(0, 100).selectExpr("id as key", "id as value")
    with pytest.raises(Exception, match=r"timely coordinator at tcp://127.0.0.1:9 did not answer"):
        write(df, "tcp://127.0.0.1:9", timeout=0.5)
    with ThreadJob(agg_job) as job:
        with pytest.raises(Exception, match=r"unknown stream 'nope'"):
            write(df, job.endpoint, stream="nope")
        with pytest.raises(Exception, match=r"unknown stream 'nope'"):
            spark.read.format("timely").option("endpoint", job.endpoint).option("stream", "nope").load().collect()
        with pytest.raises(Exception, match=r"column 'value' has type string in the DataFrame but the timely job "
                                            r"declares bigint"):
            write(df.selectExpr("key", "cast(value as string) as value"), job.endpoint)
        with pytest.raises(Exception, match=r"column 'total' has type string in the schema given to the read"):
            spark.read.format("timely").schema("key bigint, n bigint, total string") \
                .option("endpoint", job.endpoint).option("stream", "agg").load().collect()
        with pytest.raises(Exception, match="append-only"):
            df.write.format("timely").mode("overwrite").option("endpoint", job.endpoint) \
                .option("stream", "events").save()
        assert job.stats()["epochs"] == 0
        job.stop()


@pytest.mark.timeout(240)
def test_cluster_stopping_mid_write_fails_the_job_and_applies_nothing(spark):
    from pyspark.sql import functions as F

    @F.pandas_udf("bigint")
    def slow(s):
        import time as _t

        _t.sleep(0.05)
        return s

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        df = spark.range(0, 60_000, numPartitions=2).select((F.col("id") % 3).alias("key"), slow("id").alias("value"))
        with ThreadJob(agg_job) as job:
            def stop_when_staging():  # shut down once rows of the write are staged on the worker
                deadline = time.monotonic() + 60
                while job.stats()["staged_tokens"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                spark_bridge.shutdown(job.endpoint, timeout=5)

            stopper = threading.Thread(target=stop_when_staging, daemon=True)
            stopper.start()
            t0 = time.monotonic()
            with pytest.raises(Exception, match=r"shutting down|did not answer|accepted no data") as info:
                write(df, job.endpoint, timeout=3)
            print("SPARK ERROR:", [l for l in str(info.value).splitlines() if "timely" in l][:3])
            stopper.join()
            assert time.monotonic() - t0 < 60
            result = job.stop()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert result == []  # no epoch, no row


# -- a two-worker cluster (python -m timely.launch -w 2): sparkjob.LaunchedJob ----------------------------


def _read_counts(spark, ep, epochs):
    return (spark.read.format("timely").option("endpoint", ep).option("stream", "counts")
            .option("endingEpoch", epochs).option("epochColumn", "epoch").load())


@pytest.mark.timeout(240)
def test_two_workers_keyed_writes_land_on_key_owners_exactly_once(spark, tmp_path):
    from timely.routing import hash64

    df = spark.range(0, 40_000, numPartitions=4).selectExpr("(id * 7919) % 501 as key", "id as value")
    src, ck = tmp_path / "in", tmp_path / "ck"
    parts = [[(i % 37, i) for i in range(200 * (b + 1))] for b in range(2)]
    _parquet_files(src, parts)
    with LaunchedJob(tmp_path) as job:
        write(df, job.endpoint, keyColumn="key")            # epoch 0, rows routed to their key's owner
        write(df.where("value % 2 = 0"), job.endpoint)      # epoch 1, round-robin
        _stream_into(spark, job.endpoint, src, ck)          # epochs 2, 3
        got = _read_counts(spark, job.endpoint, 4)
        per_epoch = {(r["epoch"], r["key"]): r["count"] for r in got.collect()}
        captures = job.stop()
    want0 = {(0, r["key"]): r["count"] for r in df.groupBy("key").count().collect()}
    want1 = {(1, r["key"]): r["count"] for r in df.where("value % 2 = 0").groupBy("key").count().collect()}
    want_stream = {}
    for e, p in enumerate(parts, start=2):
        for k, _v in p:
            want_stream[(e, k)] = want_stream.get((e, k), 0) + 1
    assert per_epoch == {**want0, **want1, **want_stream}
    assert len(captures) == 2
    seen = Counter()
    for cap in captures:
        for epoch, recs in cap["epochs"]:
            seen.update((epoch, k, v) for k, v in recs)
            if epoch == 0:  # the keyed write: every row on the worker owning its key
                assert all(hash64(k) % 2 == cap["worker"] for k, _ in recs)
    expected = Counter((0, r["key"], r["value"]) for r in df.collect())
    expected.update((1, r["key"], r["value"]) for r in df.where("value % 2 = 0").collect())
    for e, p in enumerate(parts, start=2):
        expected.update((e, k, v) for k, v in p)
    assert seen == expected
    assert all(any(e == 1 for e, _ in c["epochs"]) for c in captures)  # round-robin reached both workers


@pytest.mark.timeout(240)
def test_two_workers_megaphone_count_with_migration_equals_spark(spark, tmp_path):
    from pyspark.sql import functions as F

    df = spark.range(0, 30_000, numPartitions=4).selectExpr("(id * 2654435761) % 300 as key", "id as value")
    epochs = 4
    with LaunchedJob(tmp_path, extra=["--megaphone"]) as job:
        for e in range(epochs):
            write(df.where(F.col("value") % epochs == e), job.endpoint, keyColumn="key")
        spark_bridge.close_stream(job.endpoint, "events")
        got = {r["key"]: r["n"] for r in _read_counts(spark, job.endpoint, epochs)
               .groupBy("key").agg(F.max("count").alias("n")).collect()}
        job.stop()
    want = {r["key"]: r["count"] for r in df.groupBy("key").count().collect()}
    assert got == want
    log = job.log.read_text()
    events = [int(x.split(": ")[1].split(" ")[0]) for x in log.splitlines() if "migration events" in x]
    assert len(events) == 2 and sum(events) > 0, log
