"""The Spark pipeline on columns: ``python examples/spark_columnar.py [--workers 2] [--rows 200000]``.

Spark writes ``(key bigint, value bigint)`` rows into the source ``events`` (one epoch per write);
the timely job keeps them as Arrow record batches end to end: per epoch it computes, for every key,
the number of rows and the sum of their values with ``timely.columnar``'s ``aggregate_by`` (rows
exchanged by key between the workers as Arrow buffers), and serves the result as the columnar sink
``totals`` (``key bigint, n bigint, total bigint``). Spark reads the totals back and checks them
against its own ``groupBy("key")``. Exactly once as every bridge job: a failed Spark task attempt
leaves nothing behind.

This file is both halves:

- the timely job, run by ``python -m timely.launch -w 2 examples/spark_columnar.py COORDINATOR``
  (its :func:`main`; the job runs until Spark calls ``spark_bridge.shutdown(COORDINATOR)``);
- the Spark driver (``python examples/spark_columnar.py``), which starts that cluster on a free
  loopback port, writes, reads, checks, shuts the cluster down and reaps it. Exit status 0 when
  the check passes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import spark_bridge
import timely

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "key bigint, value bigint"
TOTALS = "key bigint, n bigint, total bigint"


# -- the timely job -------------------------------------------------------------------------------

def main(worker: timely.Worker) -> None:
    """The job: ``events`` (Arrow batches) -> per epoch and key, count and sum -> ``totals``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from timely import columnar

    coordinator = worker.args[0] if worker.args else os.environ.get("TIMELY_SPARK_COORDINATOR")
    with worker.dataflow() as scope:
        batches = spark_bridge.source(scope, "events", SCHEMA, arrow=True, coordinator=coordinator)
        # Checked by column names and types (a batch keeps the nullability Spark gave its columns).
        events = columnar.from_batches(batches, pa.schema([("key", pa.int64()), ("value", pa.int64())]))
        totals = (events.aggregate_by("key", {"value": ["count", "sum"]})  # one batch per epoch and worker
                  .select("key", n=pc.field("value_count"), total=pc.field("value_sum")))
        spark_bridge.sink(totals.stream, "totals", TOTALS, arrow=True)
    worker.finish()


# -- the Spark driver -----------------------------------------------------------------------------

@contextlib.contextmanager
def _cluster(workers: int, coordinator: str) -> Iterator[subprocess.Popen]:
    """This file's job on ``workers`` workers (``python -m timely.launch``), in its own process
    group; shut down and reaped on the way out, killed if it does not stop."""
    from spark_demo import stop_cluster  # examples/ is on sys.path when this file runs as a script

    cmd = [sys.executable, "-m", "timely.launch", "-w", str(workers), __file__, coordinator]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(spark_bridge.BridgeError):
                spark_bridge.shutdown(coordinator, timeout=2)
        stop_cluster(proc, 10)


def run(argv: list[str] | None = None) -> int:
    """The whole pipeline (see the module docstring); 0 when Spark reads back its own totals."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=1_000)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args(argv)

    from pyspark.sql import functions as F
    from spark_demo import free_port

    from spark_bridge.session import local_session

    coordinator = f"tcp://127.0.0.1:{free_port()}"
    with _cluster(args.workers, coordinator) as proc:
        spark = local_session("local[2]", "timely-spark-columnar", python_path=str(ROOT))
        df = spark.range(0, args.rows, numPartitions=4).selectExpr(
            f"(id * 2654435761) % {args.keys} as key", "id as value").cache()
        t0 = time.monotonic()
        for e in range(args.epochs):  # one epoch per write; rows land round-robin, the job exchanges by key
            (df.where(F.col("value") % args.epochs == e).write.format("timely").mode("append")
             .option("endpoint", coordinator).option("stream", "events").option("timeout", "60").save())
        spark_bridge.close_stream(coordinator, "events")
        pushed = time.monotonic() - t0
        totals = (spark.read.format("timely").option("endpoint", coordinator).option("stream", "totals")
                  .option("endingEpoch", args.epochs).option("epochColumn", "epoch").option("timeout", "60").load())
        got = sorted(tuple(r) for r in totals.select("epoch", "key", "n", "total").collect())
        want = sorted(tuple(r) for r in df.withColumn("epoch", F.col("value") % args.epochs)
                      .groupBy("epoch", "key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
                      .select("epoch", "key", "n", "total").collect())
        ok = got == want
        print(f"spark -> timely columns ({args.workers} workers): {args.rows} rows in {args.epochs} epochs, "
              f"{pushed:.2f} s")
        print(f"check: {'OK' if ok else 'MISMATCH'}: {len(got)} (epoch, key) totals read back; "
              f"Spark groupBy: {len(want)}")
        spark_bridge.shutdown(coordinator)
        rc = proc.wait(30)
        spark.stop()
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(run())
