"""The benchmarks' process runner: one run in a fresh interpreter.

``run_fresh(fn, *args)`` calls ``fn(*args)`` in a new process started by ``multiprocessing``'s
*spawn* method (a fresh interpreter, not a fork of the driver) and returns its result. The run's
heap, peak memory and collector state then belong to it alone, not to the driver or to earlier
runs; ``fn`` usually calls ``timely.execute``, whose workers are forked from that fresh process.
``fn`` and its arguments and result must be picklable (a module-level function: in a script,
spawn imports the script again as ``__mp_main__``, so its top level must be guarded by
``if __name__ == "__main__"``).
"""
from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds a run that is stopped gets between SIGTERM and SIGKILL.
GRACE = 5.0


def _child(fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # report, do not leave the parent waiting
        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_fresh(fn: Callable[..., T], *args: Any, timeout: float | None = None, name: str = "bench-run") -> T:
    """``fn(*args)`` in a fresh process; its result.

    Raises :class:`RuntimeError` with the child's traceback if ``fn`` raised or the process died,
    and :class:`TimeoutError` after ``timeout`` seconds (``None``: no limit). The process is reaped
    before this returns, stopped first if it is still running (its timely workers die with it).
    """
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, writer), name=name)
    proc.start()
    writer.close()
    answered = False
    try:
        if not reader.poll(timeout):
            raise TimeoutError(f"{name}: no result after {timeout} s")
        try:
            status, payload = reader.recv()
        except EOFError:  # closed without a word: the process died
            status, payload = "died", None
        answered = True
    finally:
        reader.close()
        proc.join(GRACE if answered else 0)
        if proc.exitcode is None:
            proc.terminate()
            proc.join(GRACE)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    if status == "died":
        raise RuntimeError(f"{name}: the process died (exit code {proc.exitcode})")
    if status != "ok":
        raise RuntimeError(f"{name} failed: {payload}")
    return payload
