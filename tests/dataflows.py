"""Dataflows shared by the dataflow tests: run a dataflow over random epochs on every worker, and
the halving loop that the loop and frontier tests build (in a top-level or a nested scope)."""
from __future__ import annotations

from conftest import run
from epoch_input import feed, feed1


def halving_loop(scope, stream):
    """``stream`` concatenated with a loop in ``scope`` that feeds back the halves of its values
    greater than 1 (one trip adds 1 to the innermost time coordinate): each value ``x`` halves down
    to 1 in ``bit_length(x) - 1`` trips; 0 and 1 leave the loop at once. Returns the loop's body."""
    handle, loop = scope.feedback(1)
    body = stream.concat(loop)
    body.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(handle)
    return body


def run_reporting(workers: int, epochs, build, inputs: int = 1) -> list:
    """Run ``build`` on ``workers`` workers over ``epochs`` (fed by :func:`feed`); per worker,
    ``(captured output, report())``.

    ``build(stream)`` (with ``inputs=2``: ``build(stream_a, stream_b)`` and two-input epochs) runs
    in the worker while its dataflow is built and returns ``(output stream, report)``: ``report()``
    is called once the dataflow has completed, for what the operators recorded on that worker.
    """

    assert inputs in (1, 2), inputs

    def main(worker):
        with worker.dataflow() as scope:
            handles = [scope.new_input()] if inputs == 1 else [scope.new_input("A"), scope.new_input("B")]
            out, report = build(*(h.stream for h in handles))
            cap = out.capture()
            probe = out.probe()
        if inputs == 1:
            feed1(worker, handles[0], epochs, probe)
        else:
            feed(worker, handles, epochs, probe)
        return cap.extract(), report()

    return run(main, workers)


def run_captured(workers: int, epochs, build, inputs: int = 1) -> list:
    """:func:`run_reporting` for a ``build`` that returns just the output stream: per worker, what
    the output captured (``capture().extract()``)."""
    return [out for out, _ in run_reporting(workers, epochs, lambda *s: (build(*s), list), inputs)]
