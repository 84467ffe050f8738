"""Every error the engine raises on purpose derives from :class:`TimelyError`.

``except timely.TimelyError`` catches what the engine reports (a misused capability or input, a
failed operator, workers that disagree, a lost peer); anything else escaping ``timely.execute`` is
a bug. Errors keep a second, conventional base where one fits (``InputError`` is a ``ValueError``),
so code written against the builtin classes still works. This module imports nothing: every layer
may raise its errors.
"""
from __future__ import annotations

import pickle
import traceback
from typing import Any, NoReturn


def _rebuild(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """An instance of ``cls`` with ``args``, made without its ``__init__`` (unpickling: the state,
    its attributes, is set next)."""
    return cls.__new__(cls, *args)


class TimelyError(Exception):
    """Base class of the errors the engine raises on purpose.

    Every one pickles (so it crosses a process boundary: a job run in a
    ``concurrent.futures.ProcessPoolExecutor`` or a Spark task hands it back) with its message,
    its attributes (``cause``, ``worker``, ...) and its class, whatever its constructor's
    arguments: it is rebuilt from its ``args`` and attributes, without calling ``__init__``."""

    #: Raised while an operator runs, the error is the operator's (``Operator.schedule`` wraps it
    #: in :class:`OperatorError`), unless this is False: a communication failure met by a send
    #: (a peer lost) is not, and passes through so that the worker is seen failing because of it.
    blames_operator: bool = True

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args), self.__dict__ or None


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

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild, args, state = super().__reduce__()
        cause = state.get("cause") if state else None
        if cause is not None:
            try:
                pickle.dumps(cause, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # a class defined in a function, a cause holding a lock or a socket
                # The error must still cross a process boundary (a ProcessPoolExecutor, a Spark
                # task): its cause goes as a RuntimeError naming it, as the cluster hands it back.
                state = {**state, "cause": RuntimeError(
                    f"{type(cause).__qualname__}: {cause} (the original exception could not be pickled)")}
        return rebuild, args, state


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


#: Py_TPFLAGS_HEAPTYPE: a class defined in Python (not a builtin or C extension type).
_HEAPTYPE = 1 << 9


def _rebuildable(exc: BaseException) -> bool:
    """Whether ``exc`` is a message and nothing more, so that an exception of its class built
    from another message loses nothing: its ``args`` one string, no attribute of its own
    (``__notes__`` aside), and no class of its up to :class:`BaseException` with a constructor
    of its own (a Python ``__init__`` or ``__new__``, or a builtin's with fields beyond
    ``args``: ``OSError``'s ``errno`` and ``filename``, ``ImportError``'s ``name``, ...)."""
    if len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return False
    if any(name != "__notes__" for name in getattr(exc, "__dict__", {})):
        return False
    for cls in type(exc).__mro__:
        if cls is BaseException:
            return True
        if cls.__flags__ & _HEAPTYPE:
            if "__init__" in vars(cls) or "__new__" in vars(cls):
                return False
        elif cls.__basicsize__ != BaseException.__basicsize__:
            return False
    return False


def raise_with_context(exc: BaseException, context: str) -> NoReturn:
    """Raise ``exc`` with ``context`` (what was being done: the operator, record, time) added.

    Where ``exc`` is only a message (:func:`_rebuildable`: ``KeyError('b')``, ``ValueError(...)``),
    a new exception of the same class, with ``context`` before that message and caused by
    ``exc``, so callers still catch what they expect and its one line names the context. Else
    (a class whose constructor takes data, ``LookupFailed(404)``, ``FileNotFoundError(errno,
    strerror, filename)``, or an instance with attributes of its own) ``exc`` itself, untouched
    but for ``context`` as a note (``add_note``): every traceback of it ends with that line,
    including the remote traceback a worker process reports (:class:`timely.WorkerError`) and
    the one an :class:`OperatorError` carries."""
    if _rebuildable(exc):
        try:
            wrapped = type(exc)(f"{context}: {exc}")
        except Exception:
            pass
        else:
            raise wrapped from exc
    exc.add_note(context)
    raise exc
