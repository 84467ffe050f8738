"""timely: a timely dataflow engine in Python.

``timely.execute(main, workers=N)`` runs ``main(worker)`` on ``N`` workers and returns each
worker's result; ``python -m timely.launch -w N job.py`` does the same for a job file.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import errors, routing
from .collector import batch_gc
from .comm.allocator import ThreadAllocator
from .dataflow import (
    Activator,
    Broadcast,
    Capability,
    Captured,
    Distribute,
    Exchange,
    Frontier,
    InputCapability,
    InputHandle,
    Notificator,
    OperatorBuilder,
    OperatorInfo,
    OperatorInput,
    OperatorOutput,
    Pact,
    Pipeline,
    ProbeHandle,
    Scope,
    Stream,
)
from .errors import (
    BuildError,
    CapabilityError,
    InputError,
    OperatorError,
    ProgressMismatchError,
    ProgressOrderError,
    TimelyError,
)
from .progress import Summary
from .worker import Worker


def __getattr__(name: str) -> Any:
    # The cluster's errors, without importing the cluster (and ZeroMQ) for single-worker use.
    if name in ("WorkerError", "WorkerOperatorError"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'timely' has no attribute {name!r}")


__all__ = [
    "Activator", "Broadcast", "BuildError", "Capability", "CapabilityError", "Captured", "Distribute", "Exchange",
    "Frontier", "InputCapability", "InputError", "InputHandle", "Notificator", "OperatorBuilder", "OperatorError",
    "OperatorInfo", "OperatorInput", "OperatorOutput", "Pact", "Pipeline", "ProbeHandle", "ProgressMismatchError",
    "ProgressOrderError", "Scope", "Stream", "Summary", "TimelyError", "Worker", "WorkerError", "WorkerOperatorError",
    "batch_gc", "errors", "execute", "routing",
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
