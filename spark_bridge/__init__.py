"""Spark bridge: PySpark jobs push DataFrames into a running timely cluster and read its outputs back,
exactly once.

Timely side (in the job's ``main(worker)``)::

    import spark_bridge
    with worker.dataflow() as scope:
        events = spark_bridge.source(scope, "events", "key bigint, value bigint",
                                     coordinator="tcp://127.0.0.1:7447")
        counts = events.count_by_key(0)
        spark_bridge.sink(counts, "counts", "key bigint, count bigint")

Spark side::

    spark_bridge.register(spark)            # or have pyspark_timely on the Python path
    df.write.format("timely").mode("append") \\
        .option("endpoint", "tcp://127.0.0.1:7447").option("stream", "events").save()
    spark.read.format("timely").option("endpoint", ...).option("stream", "counts").load()
    spark_bridge.shutdown("tcp://127.0.0.1:7447")   # lets the job's dataflows complete

See the section "Spark bridge: PySpark in, PySpark out, exactly once" of ``README.md`` for every option
and the delivery guarantees; ``spark_bridge/protocol.py`` for the wire protocol.
"""
from __future__ import annotations

from typing import Any

from .client import close_stream, shutdown, status
from .errors import (
    BadEndpoint,
    BridgeError,
    ClusterStopping,
    CommitPending,
    CommitUnconfirmed,
    CoordinatorUnreachable,
    SchemaMismatch,
    UnknownStream,
    WorkerUnreachable,
)
from .operators import arrow_to_rows, sink, source
from .schema import SchemaError
from .server import serve, server_of

__all__ = [
    "BadEndpoint", "BridgeError", "ClusterStopping", "CommitPending", "CommitUnconfirmed", "CoordinatorUnreachable",
    "SchemaError", "SchemaMismatch", "UnknownStream", "WorkerUnreachable", "arrow_to_rows", "close_stream", "endpoint",
    "register", "run", "serve", "shutdown", "sink", "source", "status", "stop",
]


def register(spark: Any) -> None:
    """Register ``format("timely")`` with ``spark`` (a SparkSession)."""
    from .datasource import register as _register

    _register(spark)


def run(spark: Any, job: str, workers: int, args: Any = (), **options: Any) -> list[Any]:
    """Run the job file ``job`` on ``workers`` timely workers as one Spark barrier stage of the
    session ``spark`` (task ``i`` is worker ``i``); return each worker's result by index, or raise
    like ``timely.execute``. See :func:`spark_bridge.barrier.submit` for ``options`` and the section
    "Running on a Spark cluster" of ``README.md``."""
    from .barrier import run as _run

    return _run(spark, job, workers, args, **options)


def endpoint(worker: Any) -> str | None:
    """The coordinator endpoint this worker's bridge serves (worker 0: the bound address, useful with
    ``tcp://127.0.0.1:0``)."""
    s = server_of(worker)
    return None if s is None else s.coordinator_endpoint


def stop(worker: Any) -> None:
    """Stop the bridge on this worker, as ``shutdown`` does cluster-wide: on worker 0 every source
    closes; writes in flight fail; sinks stop keeping the worker alive."""
    s = server_of(worker)
    if s is not None:
        s.stop()
