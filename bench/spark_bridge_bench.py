"""Spark bridge throughput: rows/s from a Spark DataFrame into a timely cluster and back.

    python bench/spark_bridge_bench.py [--rows 5000000] [--workers 2] [--reps 3] [--partitions 4]

Starts ``python -m timely.launch -w W bench/spark_bridge_bench.py --job ...`` (this file is also the
timely job: sources whose rows are counted, and sources echoed into sinks), builds a local[2] SparkSession, and
for a DataFrame of ``--rows`` ``(key bigint, value bigint)`` rows generated in the JVM measures, in
the same run, with one untimed warm-up and the median of ``--reps`` timed runs:

- ``into (arrow)``: ``df.write.format("timely")...save()`` into a source built with ``arrow=True``
  (records are Arrow RecordBatches). The time runs until Spark's commit returns, i.e. until every
  worker has emitted the epoch into its dataflow.
- ``into (rows)``: the same into a source yielding Python tuples (the worker converts Arrow to rows
  before the commit is acknowledged).
- ``into (rows, keyColumn)``: rows routed by ``hash64(key) % workers`` on the Spark side.
- ``back (arrow)`` / ``back (rows)``: ``spark.read.format("timely")`` of one completed epoch of an
  echoing sink into ``write.format("noop")`` (the epoch is written, untimed, and complete first).
- baselines: ``df.toLocalIterator()`` (iterating every row) and ``df.toArrow()``.

Prints the exact command, the core count and a table; nothing is written to disk.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "key bigint, value bigint"


# -- the timely job (run by timely.launch) -------------------------------------------------------------
def main(worker):
    """Job: sources ``events_arrow`` (RecordBatches) and ``events_rows`` (tuples) whose records are
    counted; sources ``echo_in_arrow`` / ``echo_in_rows`` echoed into sinks ``echo_arrow`` /
    ``echo_rows`` (for the read-back measurement)."""
    import spark_bridge

    args = worker.args
    coordinator = args[args.index("--job") + 1]
    seen = [0]

    def count_arrow(t, batch):
        seen[0] += sum(rb.num_rows for rb in batch)

    def count_rows(t, batch):
        seen[0] += len(batch)

    with worker.dataflow() as scope:
        spark_bridge.source(scope, "events_arrow", SCHEMA, arrow=True, coordinator=coordinator) \
            .inspect_batch(count_arrow)
        spark_bridge.source(scope, "events_rows", SCHEMA, coordinator=coordinator).inspect_batch(count_rows)
        a = spark_bridge.source(scope, "echo_in_arrow", SCHEMA, arrow=True, coordinator=coordinator)
        spark_bridge.sink(a, "echo_arrow", SCHEMA, arrow=True)
        r = spark_bridge.source(scope, "echo_in_rows", SCHEMA, coordinator=coordinator)
        spark_bridge.sink(r, "echo_rows", SCHEMA)
    worker.finish()
    return seen[0]


# -- the driver ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def run(argv=None) -> int:
    p = argparse.ArgumentParser(description="Spark bridge throughput")
    p.add_argument("--rows", type=int, default=5_000_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--skip-baselines", action="store_true")
    args = p.parse_args(argv)

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"cores: {os.cpu_count()}  rows: {args.rows:,}  timely workers: {args.workers}  "
          f"spark: local[2], {args.partitions} partitions  reps: {args.reps} (+1 warm-up), medians")
    print("load average at start: %.2f %.2f %.2f" % os.getloadavg())

    import spark_bridge
    from spark_bridge.datasource import _SinkClient

    coordinator = f"tcp://127.0.0.1:{free_port()}"
    cluster = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", str(args.workers), __file__,
                                "--job", coordinator], cwd=ROOT, start_new_session=True)
    try:
        from spark_bridge.session import local_session

        # The JVM options of LOOPBACK_CONF trade peak speed for start-up: the benchmark keeps the defaults.
        spark = local_session("local[2]", "spark-bridge-bench",
                              {"spark.driver.memory": "4g", "spark.driver.extraJavaOptions": ""})
        deadline = time.monotonic() + 60
        while True:
            try:
                if all(spark_bridge.status(coordinator, timeout=1)["endpoints"]):
                    break
            except spark_bridge.BridgeError:
                pass
            if cluster.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("timely cluster did not start")
            time.sleep(0.1)

        df = spark.range(0, args.rows, numPartitions=args.partitions).selectExpr("id as key", "id * 2 as value")
        results = []

        def into(stream, **opts):
            def go():
                w = (df.write.format("timely").mode("append").option("endpoint", coordinator)
                     .option("stream", stream).option("timeout", "120"))
                for k, v in opts.items():
                    w = w.option(k, v)
                w.save()
            return go

        epochs = {"echo_arrow": 0, "echo_rows": 0}

        def back(sink):
            client = _SinkClient({"endpoint": coordinator, "stream": sink, "timeout": "120"})
            fill = into(sink.replace("echo_", "echo_in_"))

            def go():
                fill()  # untimed: put one epoch into the echoing source
                e = epochs[sink]
                while client.latest() <= e:  # the epoch is complete (not timed separately)
                    time.sleep(0.01)
                t0 = time.perf_counter()
                (spark.read.format("timely").option("endpoint", coordinator).option("stream", sink)
                 .option("startingEpoch", e).option("endingEpoch", e + 1).option("timeout", "120").load()
                 .write.format("noop").mode("overwrite").save())
                dt = time.perf_counter() - t0
                client.release(e + 1)
                epochs[sink] = e + 1
                return dt
            return go

        for label, fn in [("into the cluster (arrow source)", into("events_arrow")),
                          ("into the cluster (rows source)", into("events_rows")),
                          ("into the cluster (rows source, keyColumn)", into("events_rows", keyColumn="key"))]:
            med, times = timed(fn, args.reps)
            results.append((label, med, times))
        for label, sink in [("back to Spark (arrow sink)", "echo_arrow"), ("back to Spark (rows sink)", "echo_rows")]:
            go = back(sink)
            go()  # warm-up (reads the first epoch)
            times = [go() for _ in range(args.reps)]
            results.append((label, statistics.median(times), times))
        if not args.skip_baselines:
            def local_iter():
                n = 0
                for _ in df.toLocalIterator():
                    n += 1
                assert n == args.rows

            results.append(("baseline: df.toLocalIterator()", *timed(local_iter, args.reps)))
            results.append(("baseline: df.toArrow()", *timed(lambda: df.toArrow(), args.reps)))

        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
        width = max(len(r[0]) for r in results)
        print(f"{'path':<{width}}  {'median s':>9}  {'M rows/s':>9}  runs (s)")
        for label, med, times in results:
            print(f"{label:<{width}}  {med:>9.3f}  {args.rows / med / 1e6:>9.2f}  "
                  + " ".join(f"{t:.3f}" for t in times))
        spark_bridge.shutdown(coordinator)
        cluster.wait(60)
        spark.stop()
        return 0
    finally:
        if cluster.poll() is None:
            try:
                os.killpg(cluster.pid, signal.SIGTERM)
                cluster.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(cluster.pid, signal.SIGKILL)
                cluster.wait()


if __name__ == "__main__":
    sys.exit(run())
