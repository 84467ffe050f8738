"""timely's errors cross process boundaries, and the context an exchange adds to a user's exception
leaves that exception intact.

* Every :class:`timely.TimelyError` pickles and unpickles (a job run in a
  ``concurrent.futures.ProcessPoolExecutor`` or a Spark task hands its exception back that way),
  keeping its class, message and attributes, whatever its constructor's arguments.
* :func:`timely.errors.raise_with_context` rebuilds an exception with the context before its
  message only when the exception is a message and nothing more; an exception carrying data keeps
  it (its class, ``args``, attributes) and gets the context as a note, which every traceback of it
  shows, the remote traceback of a :class:`timely.WorkerError` included.
"""
from __future__ import annotations

import concurrent.futures
import copy
import errno
import multiprocessing
import pickle
import traceback

import pytest
from procs import no_leftover_children

import timely
from timely.checkpoint.store import CheckpointError
from timely.cluster import WorkerError, WorkerOperatorError
from timely.comm.errors import (
    AddressInUse,
    ChannelMismatch,
    CommError,
    FramingError,
    HandshakeError,
    HostfileError,
    MessageTooLarge,
    PeerLost,
)
from timely.comm.secret import SecretError
from timely.errors import (
    BuildError,
    CapabilityError,
    CycleError,
    InputError,
    OperatorError,
    OperatorStuckError,
    ProgressMismatchError,
    ProgressOrderError,
    TimelyError,
    raise_with_context,
)
from timely.launch import JobFileError


def _raised(exc: BaseException) -> BaseException:
    """``exc`` after being raised and caught (so it has a traceback, as a real one does)."""
    try:
        raise exc
    except BaseException as e:
        return e


def _operator_error() -> OperatorError:
    cause = _raised(ValueError("bad record"))
    try:
        raise OperatorError("Map#1", 0, cause) from cause
    except OperatorError as e:
        return e


#: One instance of every error class in timely/, with constructors of every shape.
SAMPLES = [
    TimelyError("t"), CapabilityError("c"), InputError("i"), CycleError("cy"), BuildError("b"),
    ProgressMismatchError("pm"), ProgressOrderError("po"), CheckpointError("ck"), SecretError("s"),
    JobFileError("j"), CommError("co"), HandshakeError("h"), AddressInUse("a"), ChannelMismatch("ch"),
    FramingError("f"), HostfileError("hf"),
    PeerLost(3, "worker 3 lost"),
    MessageTooLarge(100, 10, "a message of 100 bytes, over the limit of 10"),
    _operator_error(),
    OperatorStuckError("Map#1", 1, 12.0, 10.0, "  File 'job.py', line 3, in f\n"),
    WorkerError(1, "worker 1 failed: ValueError: x", "Traceback ...\nValueError: x\n"),
    WorkerError(2, "worker 2 was killed by signal SIGKILL", None, 9),
    WorkerOperatorError(1, "worker 1 failed", "Traceback ...\nValueError: x\n", "Map#1", ValueError("x")),
]


def _same(back: BaseException, exc: BaseException) -> None:
    assert type(back) is type(exc)
    assert str(back) == str(exc) and back.args == exc.args
    assert vars(back).keys() == vars(exc).keys()
    for name, value in vars(exc).items():
        if isinstance(value, BaseException):  # (exceptions do not compare equal)
            assert type(getattr(back, name)) is type(value) and str(getattr(back, name)) == str(value)
        else:
            assert getattr(back, name) == value, name


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: f"{type(e).__name__}")
def test_every_timely_error_pickles_with_its_message_and_attributes(exc):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        # (fix_imports=False: protocols 0 to 2 otherwise turn the builtin TimeoutError, the
        # OperatorStuckError's cause, into an OSError, for Python 2)
        _same(pickle.loads(pickle.dumps(exc, protocol, fix_imports=False)), exc)
    _same(copy.deepcopy(exc), exc)
    _same(copy.copy(exc), exc)


def test_unpickled_errors_keep_their_classes_and_notes():
    exc = WorkerOperatorError(1, "worker 1 failed", "tb", "Map#1", KeyError("k"))
    exc.add_note("while testing")
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, WorkerError) and isinstance(back, OperatorError) and isinstance(back, TimelyError)
    assert isinstance(back, RuntimeError)
    assert (back.index, back.worker, back.operator, back.remote_traceback, back.signal) == (1, 1, "Map#1", "tb", None)
    assert isinstance(back.cause, KeyError) and back.cause.args == ("k",)
    assert back.__notes__ == ["while testing"]
    stuck = pickle.loads(pickle.dumps(OperatorStuckError("Sum", 0, 3.0, 2.0, "stack")))
    assert isinstance(stuck, OperatorError) and isinstance(stuck.cause, TimeoutError)
    assert (stuck.seconds, stuck.limit, stuck.stack) == (3.0, 2.0, "stack")
    # The message built from the cause's traceback is kept as it was (the traceback is not pickled).
    op = _operator_error()
    assert "bad record" in str(op) and 'raise exc' in str(op)
    assert str(pickle.loads(pickle.dumps(op))) == str(op)


def test_an_operator_error_whose_cause_cannot_be_pickled_pickles_naming_it():
    """A cause of a class defined in a function (or holding a lock) cannot be pickled; the error
    still crosses a process boundary, its cause a RuntimeError naming the original, its message
    (with the original traceback) unchanged. A cause that pickles stays as it is."""

    class Local(ValueError):
        pass

    exc = OperatorError("Map#1", 0, Local("bad record 7"))
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, OperatorError) and str(back) == str(exc)
    assert type(back.cause) is RuntimeError and "Local: bad record 7" in str(back.cause)
    assert exc.cause.__class__ is Local  # the original is left alone
    kept = pickle.loads(pickle.dumps(OperatorError("Map#1", 0, KeyError("k"))))
    assert type(kept.cause) is KeyError and kept.cause.args == ("k",)


def _failing_job(_: object) -> list:
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.map(lambda x: 1 / 0, name="Divide")
        inp.send(1)

    return timely.execute(main, workers=2, timeout=30)


@pytest.mark.timeout(90)
def test_a_run_in_a_process_pool_hands_back_the_users_error():
    """The pool pickles the job's exception back to the caller: were it not picklable, the pool
    would break (``BrokenProcessPool``) and the user's error would be lost."""
    with no_leftover_children():
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            with pytest.raises(WorkerOperatorError) as ei:
                pool.submit(_failing_job, None).result(timeout=60)
    exc = ei.value
    assert isinstance(exc, OperatorError) and isinstance(exc, WorkerError)
    assert exc.operator == "Divide" and exc.index in (0, 1) and exc.worker == exc.index
    assert isinstance(exc.cause, ZeroDivisionError)
    assert "operator 'Divide' failed: ZeroDivisionError('division by zero')" in str(exc)


# -- raise_with_context ------------------------------------------------------------------------

CONTEXT = "operator 'Exchange#1': exchange key failed for record 1 at time 0"


class LookupFailed(Exception):
    """An exception whose constructor takes data, not a message."""

    def __init__(self, code: int) -> None:
        super().__init__(f"lookup failed with code {code}")
        self.code = code


class PlainError(ValueError):
    """A subclass with no constructor of its own: a message and nothing more."""


def _with_context(exc: BaseException) -> BaseException:
    with pytest.raises(BaseException) as ei:
        raise_with_context(exc, CONTEXT)
    return ei.value


def _traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_an_exception_carrying_data_is_kept_with_the_context_as_a_note():
    lookup = LookupFailed(404)
    got = _with_context(lookup)
    assert got is lookup and got.code == 404 and got.args == ("lookup failed with code 404",)
    assert str(got) == "lookup failed with code 404"
    assert got.__notes__ == [CONTEXT] and CONTEXT in _traceback_text(got)

    missing = FileNotFoundError(errno.ENOENT, "no such table", "/data/t")
    got = _with_context(missing)
    assert got is missing and (got.errno, got.strerror, got.filename) == (errno.ENOENT, "no such table", "/data/t")
    assert got.__notes__ == [CONTEXT] and CONTEXT in _traceback_text(got)

    for other in (KeyError(3), ValueError("two", "args"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")):
        got = _with_context(other)
        assert got is other and got.__notes__ == [CONTEXT]
    with_attribute = ValueError("bad value")
    with_attribute.field = "price"  # type: ignore[attr-defined]
    got = _with_context(with_attribute)
    assert got is with_attribute and got.field == "price" and got.__notes__ == [CONTEXT]  # type: ignore[attr-defined]


def test_a_message_only_exception_is_rebuilt_with_the_context_in_its_message():
    for original in (KeyError("b"), ValueError("bad value"), TypeError("unhashable"), PlainError("plain")):
        got = _with_context(original)
        assert type(got) is type(original) and got.__cause__ is original
        assert got.args == (f"{CONTEXT}: {original}",)
    assert str(_with_context(KeyError("b"))) == repr(f"{CONTEXT}: 'b'")


def _key_job(key, through_operator: bool):
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            stream = inp.stream.map(lambda x: x, name="Up") if through_operator else inp.stream
            stream.exchange(key).probe()
        if worker.index == 0:
            inp.send_batch([1, 2])
        inp.close()
        worker.finish()

    return main


def _lookup_key(x):
    raise LookupFailed(404)


def _missing_key(x):
    raise FileNotFoundError(errno.ENOENT, "no such table", "/data/t")


@pytest.mark.timeout(120)
def test_an_exchange_key_error_keeps_the_users_exception_and_names_the_record():
    """On two workers the key is taken: the user's exception comes back as it was raised (its
    ``code``, ``errno``, ``filename``), and the context still shows in the error's text."""
    with no_leftover_children():
        with pytest.raises(WorkerOperatorError) as ei:
            timely.execute(_key_job(_lookup_key, True), workers=2, timeout=60)
        cause = ei.value.cause
        # (args are not compared: pickle rebuilds LookupFailed from its args, a message, not a code)
        assert type(cause) is LookupFailed and cause.code == 404
        assert "exchange key failed for record 1 at time 0" in str(ei.value)
        assert any("exchange key failed for record 1 at time 0" in n for n in cause.__notes__)

        with pytest.raises(WorkerOperatorError) as ei:
            timely.execute(_key_job(_missing_key, True), workers=2, timeout=60)
        cause = ei.value.cause
        assert type(cause) is FileNotFoundError
        assert (cause.errno, cause.strerror, cause.filename) == (errno.ENOENT, "no such table", "/data/t")
        assert "exchange key failed for record 1 at time 0" in str(ei.value)

        # Sent from main, outside any operator: a WorkerError whose remote traceback ends with the context.
        with pytest.raises(WorkerError) as ei:
            timely.execute(_key_job(_lookup_key, False), workers=2, timeout=60)
        assert "LookupFailed: lookup failed with code 404\n" in str(ei.value)
        assert "operator 'Exchange#1': exchange key failed for record 1 at time 0" in str(ei.value)
