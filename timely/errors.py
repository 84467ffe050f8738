"""Every error the engine raises on purpose derives from :class:`TimelyError`.

``except timely.TimelyError`` catches what the engine reports (a misused capability or input, a
failed operator, workers that disagree, a lost peer); anything else escaping ``timely.execute`` is
a bug. Errors keep a second, conventional base where one fits (``InputError`` is a ``ValueError``),
so code written against the builtin classes still works. This module imports nothing: every layer
may raise its errors.
"""
from __future__ import annotations

import traceback
from typing import NoReturn


class TimelyError(Exception):
    """Base class of the errors the engine raises on purpose."""


class CapabilityError(TimelyError, RuntimeError):
    """A capability was misused: dropped twice, moved backwards, or used for a foreign output."""


class InputError(TimelyError, ValueError):
    """An input handle was misused (time moved backwards, used after close)."""


class CycleError(TimelyError, ValueError):
    """A dataflow cycle does not strictly advance time (an identity cycle)."""


class BuildError(TimelyError, ValueError):
    """A dataflow was built wrongly: an operator or feedback left incomplete, a stream used in the
    wrong scope, an operator added after the build phase ended."""


class ProgressMismatchError(TimelyError, RuntimeError):
    """Workers built different dataflows (operators and channels must be created in the same order)."""


class ProgressOrderError(TimelyError, RuntimeError):
    """A progress message arrived out of order, twice, or after a gap: the transport broke FIFO."""


class OperatorError(TimelyError, RuntimeError):
    """User code inside an operator raised: names the operator and the worker, keeps the traceback."""

    def __init__(self, operator: str, worker: int, cause: BaseException) -> None:
        self.operator = operator
        self.worker = worker
        self.cause = cause
        tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        super().__init__(f"worker {worker}: operator '{operator}' failed: {cause!r}\n{tb}")


class OperatorStuckError(OperatorError):
    """An operator invocation ran longer than the watchdog's limit (``timely.watchdog``)."""

    def __init__(self, operator: str, worker: int, seconds: float, limit: float, stack: str) -> None:
        self.operator = operator
        self.worker = worker
        self.seconds = seconds
        self.limit = limit
        self.stack = stack
        self.cause = TimeoutError(f"operator '{operator}' ran for {seconds:.1f} s in one invocation")
        RuntimeError.__init__(
            self, f"worker {worker}: operator '{operator}' ran for {seconds:.1f} s in one invocation, past the "
                  f"watchdog limit of {limit:g} s; its stack:\n{stack}")


def raise_with_context(exc: BaseException, context: str) -> NoReturn:
    """Raise ``exc`` with ``context`` (what was being done: the operator, record, time) before its
    message: as a new exception of the same class, caused by ``exc``, where the class can be built
    from one message (so callers still catch what they expect), else ``exc`` itself with
    ``context`` as a note (a class whose constructor needs other arguments)."""
    try:
        wrapped = type(exc)(f"{context}: {exc}")
    except Exception:
        wrapped = None
    if wrapped is None:
        exc.add_note(context)
        raise exc
    raise wrapped from exc
