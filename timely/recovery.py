"""Recovery: run a job again from its latest complete checkpoint when a worker dies or raises.

:func:`run_restarting` wraps one supervised run of every worker (``attempt``): after a failure, if
restarts remain, it starts all workers again (fresh processes) and they resume from the newest
complete manifest under the checkpoint URL, their sources replaying from its epoch. A failure of
the checkpoints themselves (a corrupt or foreign checkpoint, a full disk: :class:`CheckpointError`)
or a job file that cannot run is not retried: it would fail again. Nor is a worker killed by
SIGPIPE: the job's output pipe was closed (``job | head``), and its reader wants no more.
"""
from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .cluster import Outcome, primary_failure

if TYPE_CHECKING:
    from .checkpoint.checkpointer import CheckpointConfig

__all__ = ["run_restarting", "retryable"]

#: Failures (exception class names) that a restart would only repeat (a job that calls sys.exit
#: means to stop).
_FINAL = ("CheckpointError", "JobFileError", "SystemExit")


def retryable(failure: Outcome) -> bool:
    """True unless ``failure`` is one a restart would repeat (see :data:`_FINAL`): the worker's own
    exception, or the cause of an operator's failure (a full disk under the exactly-once sink is
    an ``OperatorError`` caused by a ``CheckpointError``), or any exception that caused those; nor
    is a worker killed by SIGPIPE (its output's reader went away: ``job | head``)."""
    if failure.status == "killed" and failure.signal == signal.SIGPIPE:
        return False
    if failure.status != "error":
        return True
    kinds = {(failure.summary or "").split(":")[0].rsplit(".", 1)[-1]}
    seen: set[int] = set()
    exc = failure.cause
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kinds.update(cls.__name__ for cls in type(exc).__mro__)
        exc = exc.__cause__
    return not kinds.intersection(_FINAL)


def run_restarting(attempt: Callable[[CheckpointConfig | None], list[Outcome]], restarts: int,
                   config: CheckpointConfig | None, log: Callable[[str], object],
                   deadline: float | None = None) -> list[Outcome]:
    """Run ``attempt(config)`` (one run of every worker with that checkpoint configuration,
    returning their outcomes) and, while it fails retryably and fewer than ``restarts`` restarts
    were made, run it again with the next ``config.attempt``; ``log`` gets one line per restart
    (which worker failed, the epoch the job resumes from). Returns the last outcomes.

    ``deadline`` (a :func:`time.monotonic` reading, ``None``: none) is the end of the run's
    timeout, which ``attempt`` enforces (every attempt gets what is left of it): a failure once it
    has passed is not restarted (``log`` says so) but returned."""
    if restarts < 0:
        raise ValueError(f"restarts must be at least 0, not {restarts}")
    if restarts and config is None:
        raise ValueError("restarts need checkpoints (a checkpoint directory) to resume from")
    made = 0
    while True:
        outcomes = attempt(config if config is None else dataclasses.replace(config, attempt=made))
        if made >= restarts or not any(o.failed for o in outcomes):
            return outcomes
        first = primary_failure(outcomes)
        if not retryable(first):
            return outcomes
        if deadline is not None and time.monotonic() >= deadline:
            log(f"{first.describe()}; not restarted: the run's timeout has expired")
            return outcomes
        assert config is not None
        from .checkpoint.checkpointer import JOB  # (fsspec: only once a job with checkpoints failed)
        from .checkpoint.store import CheckpointError, Store

        try:
            manifest = Store(config.url, JOB).latest()
        except CheckpointError as e:
            log(f"{first.describe()}; not restarted: {e}")
            return outcomes
        made += 1
        where = "the start (no checkpoint yet)" if manifest is None else f"the checkpoint of epoch {manifest.epoch}"
        log(f"{first.describe()}; restart {made} of {restarts}: every worker resumes from {where}")
