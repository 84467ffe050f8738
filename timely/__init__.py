"""timely: a timely dataflow engine in Python.

``timely.execute(main, workers=N)`` runs ``main(worker)`` on ``N`` workers and returns each
worker's result; ``python -m timely.launch -w N job.py`` does the same for a job file.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .comm.allocator import ThreadAllocator
from .dataflow import (
    Capability,
    CapabilityError,
    InputError,
    InputHandle,
    OperatorError,
    ProbeHandle,
    Scope,
    Stream,
)
from .progress import Summary
from .worker import Worker, batch_gc


def __getattr__(name: str) -> Any:
    # The cluster's errors, without importing the cluster (and ZeroMQ) for single-worker use.
    if name in ("WorkerError", "WorkerOperatorError"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'timely' has no attribute {name!r}")

__all__ = [
    "Capability", "CapabilityError", "InputError", "InputHandle", "OperatorError", "ProbeHandle", "Scope",
    "Stream", "Summary", "Worker", "WorkerError", "WorkerOperatorError", "execute",
]


def execute(main: Callable[[Worker], Any], workers: int = 1, args: Sequence[str] | None = None) -> list[Any]:
    """Run ``main(worker)`` on ``workers`` workers; return each worker's result, by index.

    One worker runs in the calling process; more run as separate processes exchanging data over
    ZeroMQ. After ``main`` returns, inputs it left open are closed and the worker runs its dataflows
    to completion.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if workers == 1:
        alloc = ThreadAllocator()
        try:
            with batch_gc():
                worker = Worker(alloc, args or [])
                result = main(worker)
                worker.finish()
            return [result]
        finally:
            alloc.close()
    from .cluster import execute_cluster

    return execute_cluster(main, workers, args or [])
