"""timely: a timely dataflow engine in Python.

``timely.execute(main, workers=N)`` runs ``main(worker)`` on ``N`` workers and returns each
worker's result; ``python -m timely.launch -w N job.py`` does the same for a job file.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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
    OperatorStuckError,
    ProgressMismatchError,
    ProgressOrderError,
    TimelyError,
)
from .progress import Summary
from .worker import Worker

if TYPE_CHECKING:
    from .comm.secret import JobSecret


def __getattr__(name: str) -> Any:
    # The cluster's errors, without importing the cluster (and ZeroMQ) for single-worker use.
    if name in ("WorkerError", "WorkerOperatorError"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'timely' has no attribute {name!r}")


__all__ = [
    "Activator", "Broadcast", "BuildError", "Capability", "CapabilityError", "Captured", "Distribute", "Exchange",
    "Frontier", "InputCapability", "InputError", "InputHandle", "Notificator", "OperatorBuilder", "OperatorError",
    "OperatorInfo", "OperatorInput", "OperatorOutput", "OperatorStuckError", "Pact", "Pipeline", "ProbeHandle",
    "ProgressMismatchError",
    "ProgressOrderError", "Scope", "Stream", "Summary", "TimelyError", "Worker", "WorkerError", "WorkerOperatorError",
    "batch_gc", "errors", "execute", "routing",
]


def execute(main: Callable[[Worker], Any], workers: int = 1, args: Sequence[str] | None = None, *,
            timeout: float | None = None, start: str = "fork", fuzz: int | None = None,
            watchdog: float | None = None, secret: str | JobSecret | None = None, checkpoint: str | None = None,
            checkpoint_every: int = 10, restarts: int = 0, progress: str = "direct") -> list[Any]:
    """Run ``main(worker)`` on ``workers`` workers; return each worker's result, by index.

    Workers are processes exchanging data over ZeroMQ, started by ``start``: ``"fork"`` (the
    default) forks them from the calling process, so ``main`` may be a closure; ``"spawn"`` starts
    each as a fresh interpreter (multiprocessing's spawn), whose heap, peak memory and collector
    state are then its own, and needs a picklable ``main`` (a module-level function, or a
    ``functools.partial`` of one; :class:`TypeError` otherwise). Results must be picklable.
    ``timeout`` seconds (``None``: no limit) bound the run: on expiry every worker is stopped and
    reaped and :class:`TimeoutError` raised. One worker with ``start="fork"`` and no ``timeout``
    runs in the calling process, with an in-process allocator (a timeout needs a process that can
    be stopped, so it makes even one worker a child process). After ``main`` returns, inputs it
    left open are closed and the worker runs its dataflows to completion. A failed worker raises
    :class:`WorkerError` (:class:`WorkerOperatorError` for an operator's error) after the others
    are stopped; ``workers < 1``, an unknown ``start`` or a ``timeout`` that is not positive raise
    :class:`ValueError` (a string for ``args``, or a ``fuzz`` that is not an integer: :class:`TypeError`).
    ``fuzz=SEED`` runs every worker under the schedule fuzzer
    (:mod:`timely.dataflow.fuzz`): batches are split, reordered and delayed, and operators scheduled
    spuriously, as timely allows; a failure on one worker reproduces with the same seed.
    ``watchdog=S`` ends the run with :class:`~timely.errors.OperatorStuckError` (the operator, the
    worker and its stack) when one operator invocation lasts longer than ``S`` seconds.
    A worker process that stays stopped (SIGSTOP / SIGTSTP) longer than
    :data:`timely.cluster.STOPPED_GRACE` seconds is killed, and the run fails naming it.
    ``secret`` is the job secret, its text or a :class:`~timely.comm.secret.JobSecret` (``None``:
    ``TIMELY_SECRET`` / ``TIMELY_SECRET_FILE`` if set, else no secret): the workers' links are
    then authenticated and encrypted (CURVE), and ``worker.secret`` holds it for the job's own
    servers (:class:`~timely.comm.secret.SecretError` for an empty or unreadable secret).
    ``checkpoint`` (a directory or fsspec URL) turns checkpoints on, every ``checkpoint_every``
    epochs (:mod:`timely.checkpoint`; ``worker.checkpoint``); a failed run is then started again,
    up to ``restarts`` times, every worker resuming from the latest complete checkpoint (one line
    per restart on stderr; ``restarts`` needs ``checkpoint``: :class:`ValueError` otherwise).
    ``progress="relay"`` sends every worker's progress through worker 0, which forwards it, several
    batches to a message, instead of to every worker (``"direct"``, the default): linear instead of
    quadratic progress messages in the number of workers, for one more hop (:class:`ValueError`
    for another value).
    """
    from .comm.secret import resolve  # (ZeroMQ: only when a job runs)

    job_secret = resolve(secret)
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args must be a sequence of strings (the job's arguments), not one string: {args!r}")
    if fuzz is not None:
        if not isinstance(fuzz, numbers.Integral) or isinstance(fuzz, bool):
            raise TypeError(f"fuzz must be an integer seed or None, not {fuzz!r}")
        fuzz = int(fuzz)
    if watchdog is not None and not watchdog > 0:  # (before any worker starts, on one worker as on many)
        raise ValueError(f"the watchdog limit must be a positive number of seconds, not {watchdog!r}")
    if restarts and checkpoint is None:
        raise ValueError("restarts need checkpoint=DIR to resume from")
    config = None
    if checkpoint is not None:
        from .checkpoint.checkpointer import CheckpointConfig

        config = CheckpointConfig(checkpoint, checkpoint_every)
    if workers == 1 and start == "fork" and timeout is None and not restarts:
        alloc = ThreadAllocator()
        try:
            return [Worker(alloc, args or [], fuzz, watchdog, secret=job_secret, checkpoint=config,
                           progress=progress).run(main)]
        finally:
            alloc.close()
    from .cluster import execute_cluster  # validates workers, timeout and start

    return execute_cluster(main, workers, args or [], timeout=timeout, start=start, fuzz=fuzz, watchdog=watchdog,
                           secret=job_secret, checkpoint=config, restarts=restarts, progress=progress)
