"""The whole Spark pipeline: ``python examples/spark_demo.py [--workers 2] [--rows 200000] [--megaphone]``.

1. starts a timely cluster (``python -m timely.launch -w N examples/spark_pipeline.py``) serving
   the bridge's coordinator on a free loopback port;
2. a Spark job generates ``(key, value)`` rows and pushes them into the cluster's source
   ``events`` in ``--epochs`` writes (one epoch each), routed to the worker owning each key;
3. the cluster counts rows per key (with ``--megaphone``: a migratable keyed count that moves half
   of its bins to other workers while the writes go on);
4. Spark reads the ``counts`` sink back and checks it against its own ``groupBy("key").count()``;
5. the cluster is shut down through the bridge and the worker processes are reaped.

Exit status 0 when the check passes.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_session(cores: int = 2):
    """A loopback-only local Spark with ``format("timely")`` registered."""
    from spark_bridge.session import local_session

    return local_session(f"local[{cores}]", "timely-spark-demo", python_path=str(ROOT))


def start_cluster(workers: int, coordinator: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "timely.launch", "-w", str(workers), str(ROOT / "examples" / "spark_pipeline.py"),
           coordinator, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)


def stop_cluster(proc: subprocess.Popen, timeout: float = 30) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=1_000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--megaphone", action="store_true")
    args = p.parse_args(argv)

    from pyspark.sql import functions as F

    import spark_bridge

    coordinator = f"tcp://127.0.0.1:{free_port()}"
    proc = start_cluster(args.workers, coordinator, ["--megaphone"] if args.megaphone else [])
    try:
        spark = spark_session()
        df = spark.range(0, args.rows, numPartitions=4).selectExpr(
            f"(id * 2654435761) % {args.keys} as key", "id as value").cache()
        t0 = time.monotonic()
        for e in range(args.epochs):
            (df.where(F.col("value") % args.epochs == e).write.format("timely").mode("append")
             .option("endpoint", coordinator).option("stream", "events").option("keyColumn", "key")
             .option("timeout", "60").save())
        spark_bridge.close_stream(coordinator, "events")
        pushed = time.monotonic() - t0
        counts = (spark.read.format("timely").option("endpoint", coordinator).option("stream", "counts")
                  .option("endingEpoch", args.epochs).option("timeout", "60").load())
        agg = F.max("count") if args.megaphone else F.sum("count")
        got = {r["key"]: r["n"] for r in counts.groupBy("key").agg(agg.alias("n")).collect()}
        want = {r["key"]: r["count"] for r in df.groupBy("key").count().collect()}
        ok = got == want
        print(f"spark -> timely ({args.workers} workers{', megaphone migration' if args.megaphone else ''}): "
              f"{args.rows} rows in {args.epochs} epochs, {pushed:.2f} s")
        print(f"check: {'OK' if ok else 'MISMATCH'}: {len(got)} keys read back from timely, "
              f"{sum(got.values())} rows counted; Spark groupBy().count(): {len(want)} keys, {sum(want.values())} rows")
        spark_bridge.shutdown(coordinator)
        rc = stop_cluster(proc)
        spark.stop()
        return 0 if ok and rc == 0 else 1
    finally:
        if proc.poll() is None:
            try:
                spark_bridge.shutdown(coordinator, timeout=2)
            except Exception:
                pass
            stop_cluster(proc, 5)


if __name__ == "__main__":
    sys.exit(main())
