"""The Spark pipeline on columns, end to end: Spark -> a 2-worker columnar job -> Spark.

The job is ``examples/spark_columnar.py`` run by ``python -m timely.launch -w 2`` (sparkjob's
:class:`LaunchedJob`, in its own process group, shut down through the bridge and reaped): Arrow
batches from ``spark_bridge.source(..., arrow=True)``, ``columnar.aggregate_by`` per epoch (rows
exchanged by key between the workers), ``spark_bridge.sink(..., arrow=True)``. What Spark reads
back must equal Spark SQL's ``groupBy`` over the same writes, each (epoch, key) exactly once,
also when a Spark task fails on its first attempt (``local[2,2]``: a second attempt runs) after
having pushed rows.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
    pytest.skip("Spark needs Java 17+ (no java on PATH, no JAVA_HOME)", allow_module_level=True)

from sparkjob import LaunchedJob, stop_jvm

import spark_bridge

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "spark_columnar.py"


@pytest.fixture(scope="module")
def spark():
    """A loopback-only local Spark (two cores, a task may be attempted twice), stopped with its
    JVM after the module."""

    from spark_bridge.session import local_session

    session = local_session("local[2,2]", "timely-columnar-tests", python_path=str(ROOT), register=False)
    yield session
    session.stop()
    stop_jvm()


def columnar_job(tmp_path: Path) -> LaunchedJob:
    """The example's job on 2 workers, serving the bridge on an ipc socket in ``tmp_path``."""
    job = LaunchedJob(tmp_path)
    job.cmd = [sys.executable, "-m", "timely.launch", "-w", "2", str(EXAMPLE), job.endpoint]
    return job


def write(df, ep: str, **options) -> None:
    w = df.write.format("timely").mode("append").option("endpoint", ep).option("stream", "events")
    for k, v in {"timeout": 60, **options}.items():
        w = w.option(k, str(v))
    w.save()


def spark_totals(df, epoch: int) -> list[tuple]:
    from pyspark.sql import functions as F

    rows = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")).collect()
    return [(epoch, r["key"], r["n"], r["total"]) for r in rows]


@pytest.mark.timeout(300)
def test_columnar_totals_equal_spark_groupby_exactly_once_with_a_task_retry(spark, tmp_path):
    from pyspark.sql import functions as F

    @F.udf("bigint")
    def flaky(x):
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc.attemptNumber() == 0 and tc.partitionId() == 0 and x == 9_900:
            raise RuntimeError("injected failure of the first attempt")
        return x

    df0 = spark.range(0, 40_000, numPartitions=4).selectExpr("(id * 7919) % 501 as key", "id as value")
    df1 = spark.range(0, 10_000, numPartitions=2).selectExpr("id % 37 as key", "id * 3 as value")
    df2 = spark.range(0, 20_000, numPartitions=2).selectExpr("id % 11 as key", "id as value")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")  # the failed attempt pushes first
    try:
        with columnar_job(tmp_path) as job:
            write(df0, job.endpoint)                    # epoch 0: round-robin, every key on both workers
            write(df1, job.endpoint, keyColumn="key")   # epoch 1: routed by key hash
            write(df2.select("key", flaky("value").alias("value")), job.endpoint)  # epoch 2: a retried task
            spark_bridge.close_stream(job.endpoint, "events")
            got = sorted(tuple(r) for r in (
                spark.read.format("timely").option("endpoint", job.endpoint).option("stream", "totals")
                .option("endingEpoch", 3).option("epochColumn", "epoch").option("timeout", 60).load()
                .select("epoch", "key", "n", "total").collect()))
            stats = spark_bridge.status(job.endpoint)["stats"]["events"]
            job.stop()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    # Sorted lists, not sums: a key aggregated on both workers would come back twice.
    assert got == sorted(spark_totals(df0, 0) + spark_totals(df1, 1) + spark_totals(df2, 2))
    assert stats["epochs"] == 3 and stats["rows"] == 70_000 and stats["staged_tokens"] == 0


@pytest.mark.timeout(300)
def test_example_pipeline_checks_itself(tmp_path):
    """``python examples/spark_columnar.py`` runs the whole pipeline and exits 0 on a match."""
    import subprocess

    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--rows", "30000", "--keys", "97", "--epochs", "3"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "check: OK" in out
