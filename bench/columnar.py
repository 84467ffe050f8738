"""Columnar dataflows (issue 15) against the row path, bytewax and the numpy ceiling, in one run.

Keyed count, ``--records`` records per worker over ``--keys`` int64 keys, on each of ``--workers``:

* **row**: ``bench/exchange.py``'s ``exchange(0).count_by_key(0)`` as ``bench/peers.py`` runs it
  (batches of ``--row-batch``, one epoch per 64 batches and worker, at most one epoch in flight);
* **columnar**: ``columnar.from_batches(...).aggregate_by("key", {"value": "count"})`` over
  ``--columnar-records`` records per worker (the row path's count would take a fifth of a second),
  pre-generated as ``pyarrow.RecordBatch`` of ``--batch`` rows (int64 ``key``, ``value``), one epoch
  per as many records as the row path's, at most one epoch in flight;
* **ceiling**: ``bench/numpy_ceiling.py``, as many processes (two or more) and no engine, on the
  columnar path's records: numpy hashing, raw int64 bytes over pyzmq, ``np.bincount`` (batches of
  4096 and of ``--batch``);
* **bytewax** (``count_final``, ``bench/peers.py``'s set-up in ``.venv-bench``), when installed.

NEXMark Q1 and Q2 (``--events`` per worker, closed loop, ``bench/peers.py``'s driving): the row
queries of ``nexmark/queries`` against ``nexmark.columnar``'s ``q1-col``/``q2-col`` over bids
generated as ``RecordBatch`` (``--columnar-events`` per worker, one batch per epoch of as many
events as the row path's epoch).

Every figure is the median of ``--runs`` runs, each in fresh processes (``start="spawn"``):
records/s = input records (NEXMark: events) / (last worker done - first worker's start), and
records per CPU-second (user + system time of all workers, as ``bench/scaling.py``). The ratios of
the issue's targets follow the table: columnar/row (target >= 10x) and columnar/ceiling (>= 50%).
``--spark`` adds Spark -> cluster -> Spark on columns against a do-nothing Spark data source
(:func:`spark_rows`).

    .venv/bin/python bench/columnar.py                 # 2 workers, 3 runs (~2.5 min on 2 cores)
    .venv/bin/python bench/columnar.py --quick         # smoke run (~15-30 s)
    .venv/bin/python bench/columnar.py --workers 1 2 --json
    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python bench/columnar.py --workloads spark   # Spark only (~1 min)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import timely

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy_ceiling  # bench/ is not a package
import peers
from scaling import Figures


def _drive(worker: timely.Worker, inp: Any, epochs: list[list], probe: Any) -> tuple[float, float, float]:
    """Feed ``epochs`` (the records of each epoch) into ``inp`` closed loop, at most one epoch in
    flight, from a start agreed by all workers; returns (start, end, CPU seconds)."""
    from nexmark.openloop import start_together

    start, cpu = start_together(worker, delay=0.0), peers._cpu()
    for records in epochs:
        inp.send_batch(records)
        inp.advance_to(inp.time + 1)
        worker.step_while(lambda: probe.less_than(inp.time - 1))
    inp.close()
    worker.step_while(lambda: not probe.done())
    return start, time.time(), peers._cpu() - cpu


# -- the columnar keyed count (a worker) ---------------------------------------------------------
def columnar_count(worker: timely.Worker) -> dict:
    """One worker's columnar keyed count; args: records per worker, keys, batch rows, batches per epoch, gc."""
    import numpy as np
    import pyarrow as pa

    from timely import collector, columnar

    mine, keys, batch, epoch_batches = (int(a) for a in worker.args[:4])
    data = np.random.default_rng(worker.index).integers(0, keys, mine, dtype=np.int64)
    ones = np.ones(batch, dtype=np.int64)
    schema = pa.schema([("key", pa.int64()), ("value", pa.int64())])
    batches = [pa.RecordBatch.from_arrays([pa.array(data[i:i + batch]), pa.array(ones[:len(data[i:i + batch])])],
                                          schema=schema) for i in range(0, mine, batch)]
    epochs = [batches[i:i + epoch_batches] for i in range(0, len(batches), epoch_batches)]
    del data, batches
    collector.configure(worker.args[4])
    acc = [0, 0]  # keys counted here (over all epochs), records counted

    def seen(t: Any, out: Sequence) -> None:
        for b in out:
            acc[0] += b.num_rows
            acc[1] += int(b.column("value_count").to_numpy().sum())

    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = (columnar.from_batches(inp.stream, schema).aggregate_by("key", {"value": "count"})
                 .inspect_batch(seen).probe())
    start, end, cpu = _drive(worker, inp, epochs, probe)
    return {"start": start, "end": end, "cpu": cpu, "inputs": mine, "outputs": acc[1]}


# -- NEXMark Q1/Q2 on columns (a worker) -----------------------------------------------------------
def columnar_nexmark(worker: timely.Worker) -> dict:
    """One worker's columnar Q1 or Q2 (``nexmark.columnar``'s ``q1-col``, ``q2-col``); args: query,
    gc, events in total, events per epoch (one batch). This worker's share of the events
    ``[0, events)`` is generated as bid batches only (``BidColumns``: persons and auctions are
    skipped, Q1 and Q2 do not read them) but counted as events, as the row path counts them."""
    from nexmark.columnar import BID_SCHEMA, COLUMNAR_QUERIES, BidColumns
    from nexmark.model import Config, Params
    from timely import collector, columnar

    query = COLUMNAR_QUERIES[worker.args[0] + "-col"]
    events, round_events = (int(a) for a in worker.args[2:])
    gen, step = BidColumns(Config(), worker.index, worker.peers), round_events * worker.peers
    epochs = [gen.until(min(events, hi)).bids for hi in range(step, events + step, step)]  # one batch (or none) each
    collector.configure(worker.args[1])
    counted = [0]
    with worker.dataflow() as scope:
        inp = scope.new_input("Bids")
        out = query.columnar(columnar.from_batches(inp.stream, BID_SCHEMA), Params())
        probe = out.inspect_batch(lambda t, b: counted.__setitem__(0, counted[0] + sum(x.num_rows for x in b))).probe()
    start, end, cpu = _drive(worker, inp, epochs, probe)
    return {"start": start, "end": end, "cpu": cpu, "inputs": len(range(worker.index, events, worker.peers)),
            "outputs": counted[0]}


# -- the driver ----------------------------------------------------------------------------------
@dataclass
class Run(Figures):
    """One engine run's figures and its output count (records, or keys' counts summed)."""

    outputs: int = 0


def _spawn(job: Callable, workers: int, args: list[str]) -> Run:
    """One run of ``job`` on ``workers`` fresh interpreters."""
    results = timely.execute(job, workers=workers, start="spawn", timeout=900, args=args)
    return Run(sum(r["inputs"] for r in results), max(r["end"] for r in results) - min(r["start"] for r in results),
               sum(r["cpu"] for r in results), sum(r["outputs"] for r in results))


def count_paths(opts: argparse.Namespace, workers: int) -> list[tuple[str, Callable[[], Figures | None]]]:
    """The keyed count's paths on ``workers`` workers: (label, one run) each."""
    per, col_per, keys = opts.records, opts.columnar_records, opts.keys
    epoch_batches = max(1, 64 * opts.row_batch // opts.batch)  # as many records per epoch as the row path

    def col() -> Figures:
        fig = _spawn(columnar_count, workers, [str(col_per), str(keys), str(opts.batch), str(epoch_batches), opts.gc])
        if fig.outputs != col_per * workers:
            raise SystemExit(f"columnar keyed count: counted {fig.outputs:,} of {col_per * workers:,}")
        return fig

    def ceiling(batch: int) -> Callable[[], Figures]:
        return lambda: Figures(**numpy_ceiling.run_once(workers, col_per, keys, batch))

    def bytewax() -> Figures | None:
        if not os.path.exists(peers.BENCH_PY):
            return None
        r = peers.run_bytewax("count", workers, [opts.gc, str(per * workers), str(keys), str(opts.row_batch)], 900)
        if r["outputs"] != per * workers:
            raise SystemExit(f"bytewax keyed count: counted {r['outputs']:,} of {per * workers:,}")
        return Figures(r["inputs"], r["seconds"], float("nan"))  # its CPU time is not measured

    def row() -> Figures:
        # bench/peers.py's row keyed count: bench/exchange.py's dataflow, clocks started together
        fig = _spawn(peers._ours_count, workers, ["count", opts.gc, str(per * workers), str(keys), str(opts.row_batch), "64"])
        if fig.outputs != per * workers:
            raise SystemExit(f"row keyed count: counted {fig.outputs:,} of {per * workers:,}")
        return fig

    return [("row", row),
            ("columnar", col),
            # (one process exchanges nothing: no ceiling to compare with)
            *((f"ceiling (batch {b})", ceiling(b)) for b in sorted({4096, opts.batch}) if workers > 1),
            ("bytewax", bytewax)]


def nexmark_paths(opts: argparse.Namespace, query: str, workers: int) -> list[tuple[str, Callable[[], Figures | None]]]:
    """NEXMark ``query``'s row and columnar paths on ``workers`` workers (the same events per epoch)."""
    def row() -> Run:
        return _spawn(peers._ours_nexmark, workers, [query, opts.gc, str(opts.events * workers), str(opts.round),
                                                      str(opts.epoch_rounds)])

    def col() -> Run:
        return _spawn(columnar_nexmark, workers, [query, opts.gc, str(opts.columnar_events * workers),
                                                   str(opts.round * opts.epoch_rounds)])

    return [("row", row), ("columnar", col)]


def main(argv: list[str] | None = None) -> None:
    from timely import collector

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--records", type=int, default=4_000_000, help="keyed count: records per worker (row, bytewax)")
    parser.add_argument("--columnar-records", type=int, default=32_000_000,
                        help="keyed count: records per worker (columnar, ceiling: long enough to time)")
    parser.add_argument("--keys", type=int, default=10_000, help="keyed count: distinct int64 keys")
    parser.add_argument("--batch", type=int, default=65_536, help="columnar: rows per RecordBatch and worker")
    parser.add_argument("--row-batch", type=int, default=4096, help="row path: records per batch and worker")
    parser.add_argument("--events", type=int, default=4_000_000, help="NEXMark: events per worker")
    parser.add_argument("--columnar-events", type=int, default=32_000_000,
                        help="NEXMark: events per worker (columnar: long enough to time)")
    parser.add_argument("--round", type=int, default=4096, help="NEXMark row path: events per batch and worker")
    parser.add_argument("--epoch-rounds", type=int, default=16, help="NEXMark row path: batches per epoch and worker")
    parser.add_argument("--workloads", nargs="+", default=["count", "q1", "q2"], choices=["count", "q1", "q2", "spark"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gc", choices=collector.POLICIES, default="freeze")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 500k records and events per worker (columnar: 4 M), 1 run")
    parser.add_argument("--spark", action="store_true", help="also Spark -> cluster -> Spark on columns (workload spark)")
    parser.add_argument("--json", action="store_true", help="print every figure as JSON on the last line")
    parser.add_argument("--spark-rows", type=int, default=5_000_000, help="--spark: rows per write")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_spark-job"]:  # the cluster of --spark (a child process)
        timely.execute(spark_job, int(argv[2]), args=[argv[1]], start="spawn")
        return
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.records, opts.columnar_records, opts.events, opts.columnar_events = 500_000, 4_000_000, 500_000, 4_000_000
        opts.runs, opts.spark_rows = 1, 1_000_000
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; median of {opts.runs} runs; keyed count ({opts.keys:,} keys) per worker: "
          f"{opts.records:,} records (row, bytewax), {opts.columnar_records:,} (columnar, ceiling); NEXMark per worker: "
          f"{opts.events:,} events (row), {opts.columnar_events:,} (columnar); columnar batches of {opts.batch:,} rows, "
          f"row batches of {opts.row_batch:,}; gc {opts.gc}; bytewax: "
          f"{peers.BENCH_PY if os.path.exists(peers.BENCH_PY) else 'not installed (bench/peers.py --setup), skipped'}",
          flush=True)
    print(f"{'workload':<12} {'workers':>7} {'path':<20} {'records/s':>13} {'per CPU-s':>12} {'vs row':>7}", flush=True)
    table: list[dict] = []
    plan = [("keyed count", w, count_paths(opts, w)) for w in opts.workers if "count" in opts.workloads]
    plan += [(f"NEXMark {q.upper()}", w, nexmark_paths(opts, q, w)) for q in ("q1", "q2") if q in opts.workloads
             for w in opts.workers]
    for workload, workers, paths in plan:
        got: dict[str, list] = {label: [] for label, _ in paths}
        missing: set[str] = set()
        for _ in range(opts.runs):
            for label, once in paths:  # alternating: a drift of the machine's load falls on every path
                if label in missing:
                    continue
                fig = once()
                if fig is None:
                    missing.add(label)
                    continue
                got[label].append(fig)
                time.sleep(0.5)  # let the previous run's processes go
        row_rate = None
        for label, _ in paths:
            runs = got[label]
            if not runs:
                print(f"{workload:<12} {workers:>7} {label:<20} skipped: not installed", flush=True)
                continue
            rate = statistics.median(r.rate for r in runs)
            per_cpu = statistics.median(r.per_cpu_s for r in runs)
            row_rate = rate if label == "row" else row_rate
            vs = f"{rate / row_rate:.1f}x" if row_rate and label != "row" else "-"
            cpu = "-" if math.isnan(per_cpu) else f"{per_cpu:,.0f}"
            print(f"{workload:<12} {workers:>7} {label:<20} {rate:>13,.0f} {cpu:>12} {vs:>7}", flush=True)
            table.append({"workload": workload, "workers": workers, "path": label, "rate": rate,
                          "per_cpu_s": None if math.isnan(per_cpu) else per_cpu, "runs": [r.rate for r in runs]})
    targets(table)
    if opts.spark or "spark" in opts.workloads:
        table += spark_rows(opts)
    if opts.json:
        print(json.dumps(table))


def targets(table: list[dict]) -> None:
    """The issue's ratios: columnar / row (>= 10x) and columnar / best ceiling (>= 50%), per worker count."""
    def fig(workload: str, workers: int, path: str) -> dict | None:
        return next((r for r in table if (r["workload"], r["workers"], r["path"]) == (workload, workers, path)), None)

    for workers in sorted({r["workers"] for r in table}):
        col, row = fig("keyed count", workers, "columnar"), fig("keyed count", workers, "row")
        ceilings = [r for r in table if r["workload"] == "keyed count" and r["workers"] == workers
                    and r["path"].startswith("ceiling")]
        if col and row:
            print(f"keyed count, {workers} workers: columnar/row {col['rate'] / row['rate']:.1f}x (target >= 10x), "
                  f"per CPU-s {col['per_cpu_s'] / row['per_cpu_s']:.1f}x", flush=True)
        if col and ceilings:
            best = max(ceilings, key=lambda r: r["rate"])
            print(f"keyed count, {workers} workers: columnar/{best['path']} {col['rate'] / best['rate']:.0%} "
                  f"(target >= 50%), per CPU-s {col['per_cpu_s'] / best['per_cpu_s']:.0%}", flush=True)


# -- Spark -> cluster -> Spark on columns (--spark) -------------------------------------------------
SPARK_SCHEMA = "key bigint, value bigint"


def spark_job(worker: timely.Worker) -> int:
    """The cluster of ``--spark``: the Arrow source ``cols_in`` through a columnar ``select``
    (``value + 1``) into the Arrow sink ``cols_out``; args: the coordinator's endpoint."""
    import pyarrow.compute as pc

    import spark_bridge
    from timely import columnar

    coordinator = worker.args[0]
    with worker.dataflow() as scope:
        src = spark_bridge.source(scope, "cols_in", SPARK_SCHEMA, arrow=True, coordinator=coordinator)
        out = columnar.from_batches(src).select("key", value=pc.field("value") + 1)
        spark_bridge.sink(out.stream, "cols_out", SPARK_SCHEMA, arrow=True)
    worker.finish()
    return 0


def _noop_source(rows: int, partitions: int) -> type:
    """A do-nothing Python data source ``bench_noop`` of ``SPARK_SCHEMA``: its Arrow writer counts
    and drops the batches, its reader yields ``rows`` rows (numpy columns, batches of 64k) over
    ``partitions`` partitions. Defined here, it travels to Spark's workers by value."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceReader, InputPartition, WriterCommitMessage

    class NoopWriter(DataSourceArrowWriter):
        def write(self, iterator: Any) -> WriterCommitMessage:
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class NoopReader(DataSourceReader):
        def partitions(self) -> list:
            return [InputPartition(i) for i in range(partitions)]

        def read(self, partition: Any) -> Any:
            import numpy as np
            import pyarrow as pa

            lo, hi = rows * partition.value // partitions, rows * (partition.value + 1) // partitions
            for i in range(lo, hi, 65536):
                key = np.arange(i, min(hi, i + 65536), dtype=np.int64)
                yield pa.RecordBatch.from_arrays([key, key * 2 + 1], names=["key", "value"])

    class NoopSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_noop"

        def schema(self) -> str:
            return SPARK_SCHEMA

        def writer(self, schema: Any, overwrite: bool) -> NoopWriter:
            return NoopWriter()

        def reader(self, schema: Any) -> NoopReader:
            return NoopReader()

    return NoopSource


def spark_rows(opts: argparse.Namespace) -> list[dict]:
    """Spark -> cluster -> Spark on columns against the do-nothing data source, in the same session:
    each rep writes the DataFrame (``--spark-rows`` rows generated in the JVM) into the cluster,
    waits for its epoch at the sink and reads it back into Spark's ``noop`` writer; the baseline
    writes it to ``bench_noop`` and reads as many rows from ``bench_noop`` into ``noop``. Rows/s =
    rows / (write + wait + read); one warm-up (for the cluster, it checks what comes back), the
    median of ``--runs``."""
    import signal
    import subprocess

    from spark_bridge_bench import free_port

    import spark_bridge
    from spark_bridge.datasource import _SinkClient
    from spark_bridge.session import local_session

    rows, workers = opts.spark_rows, opts.workers[0]
    coordinator = f"tcp://127.0.0.1:{free_port()}"
    cluster = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_spark-job", coordinator, str(workers)],
                               start_new_session=True)
    try:
        spark = local_session("local[2]", "columnar-bench", {"spark.driver.memory": "4g",
                                                             "spark.driver.extraJavaOptions": ""})
        spark.dataSource.register(_noop_source(rows, workers))
        deadline = time.monotonic() + 60
        while not _endpoints_up(spark_bridge, coordinator):
            if cluster.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("--spark: the timely cluster did not start")
            time.sleep(0.1)
        df = spark.range(0, rows, numPartitions=4).selectExpr("id as key", "id * 2 as value")
        epoch = [0]

        def through_cluster() -> float:
            t0 = time.perf_counter()
            df.write.format("timely").mode("append").option("endpoint", coordinator).option("stream", "cols_in") \
                .option("timeout", "120").save()
            written = time.perf_counter() - t0
            client = _SinkClient({"endpoint": coordinator, "stream": "cols_out", "timeout": "120"})
            while client.latest() <= epoch[0]:
                time.sleep(0.005)
            back = (spark.read.format("timely").option("endpoint", coordinator).option("stream", "cols_out")
                    .option("startingEpoch", epoch[0]).option("endingEpoch", epoch[0] + 1).option("timeout", "120").load())
            if epoch[0] == 0:  # the warm-up: every row came back, once
                got = back.selectExpr("count(*)", "sum(value - 2 * key)").first()
                if tuple(got) != (rows, rows):
                    raise SystemExit(f"--spark: read back (rows, sum of value + 1 - value) = {tuple(got)}, expected {rows}")
            else:
                back.write.format("noop").mode("overwrite").save()
            client.release(epoch[0] + 1)
            epoch[0] += 1
            return written

        def do_nothing() -> float:
            t0 = time.perf_counter()
            df.write.format("bench_noop").mode("append").save()
            written = time.perf_counter() - t0
            spark.read.format("bench_noop").load().write.format("noop").mode("overwrite").save()
            return written

        paths = [("do-nothing data source", do_nothing), ("through the cluster", through_cluster)]
        for _, fn in paths:
            fn()  # warm-up
        times: dict[str, list[float]] = {label: [] for label, _ in paths}
        writes: dict[str, list[float]] = {label: [] for label, _ in paths}
        for _ in range(opts.runs):  # the paths alternate: a change of load shows in both
            for label, fn in paths:
                t0 = time.perf_counter()
                writes[label].append(fn())
                times[label].append(time.perf_counter() - t0)
        out = []
        for label, _ in paths:
            ts = times[label]
            out.append({"workload": "Spark -> Spark", "workers": workers, "path": label,
                        "rate": rows / statistics.median(ts), "per_cpu_s": None, "runs": [rows / t for t in ts]})
            print(f"{'Spark->Spark':<12} {workers:>7} {label:<22} {out[-1]['rate']:>11,.0f} rows/s  runs (s) "
                  + " ".join(f"{t:.2f}" for t in ts) + f"; the write alone {statistics.median(writes[label]):.2f} s",
                  flush=True)
        print(f"Spark -> cluster -> Spark on columns: {out[1]['rate'] / out[0]['rate']:.0%} of the do-nothing data "
              f"source (target >= 80%); {rows:,} rows, Spark local[2]", flush=True)
        spark_bridge.shutdown(coordinator)
        cluster.wait(60)
        spark.stop()
        return out
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGTERM)
            try:
                cluster.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(cluster.pid, signal.SIGKILL)
                cluster.wait()


def _endpoints_up(spark_bridge: Any, coordinator: str) -> bool:
    try:
        return all(spark_bridge.status(coordinator, timeout=1)["endpoints"])
    except spark_bridge.BridgeError:
        return False


if __name__ == "__main__":
    main()
