"""Dataflows shared by the dataflow tests: run a dataflow over random epochs on every worker (under
the schedule fuzzer with ``fuzz=SEED``), the halving loop that the loop and frontier tests build
(in a top-level or a nested scope), and a notificator-based per-time sum as users write it."""
from __future__ import annotations

from conftest import run
from epoch_input import feed, feed1

from timely import ProbeHandle


def halving_loop(scope, stream):
    """``stream`` concatenated with a loop in ``scope`` that feeds back the halves of its values
    greater than 1 (one trip adds 1 to the innermost time coordinate): each value ``x`` halves down
    to 1 in ``bit_length(x) - 1`` trips; 0 and 1 leave the loop at once. Returns the loop's body."""
    handle, loop = scope.feedback(1)
    body = stream.concat(loop)
    body.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(handle)
    return body


def run_reporting(workers: int, epochs, build, inputs: int = 1, fuzz: int | None = None) -> list:
    """Run ``build`` on ``workers`` workers over ``epochs`` (fed by :func:`feed`), under the schedule
    fuzzer seeded ``fuzz`` if given; per worker, ``(captured output, report())``.

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

    return run(main, workers, fuzz)


def run_captured(workers: int, epochs, build, inputs: int = 1, fuzz: int | None = None) -> list:
    """:func:`run_reporting` for a ``build`` that returns just the output stream: per worker, what
    the output captured (``capture().extract()``)."""
    return [out for out, _ in run_reporting(workers, epochs, lambda *s: (build(*s), list), inputs, fuzz)]


def run_branches(workers: int, epochs, builds, fuzz: int | None = None) -> list:
    """Run every ``build(stream)`` of ``builds`` on one input in one dataflow over ``epochs`` (fed
    by :func:`feed1`); per worker, the list of what each build's output captured."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            outs = [build(inp.stream) for build in builds]
            caps = [out.capture() for out in outs]
            probe = ProbeHandle()
            for out in outs:
                out.probe_with(probe)
        feed1(worker, inp, epochs, probe)
        return [cap.extract() for cap in caps]

    return run(main, workers, fuzz)


def sum_per_time(totals, log):
    """Notify logic for ``unary_notify`` / ``binary_notify``, written as users write it: once a time
    is complete, ``(time, sum of input 1 - sum of input 2, number of records)``. ``totals`` is its
    per-time state (a fresh dict); ``log`` gets each time delivered, with whether every input
    frontier had passed it."""

    def logic(*args):
        *inputs, out, notificator = args
        for sign, inp in zip((1, -1), inputs):
            for c, batch in inp:
                if c.time not in totals:
                    totals[c.time] = [0, 0]
                    notificator.notify_at(c.retain())
                totals[c.time][0] += sign * sum(batch)
                totals[c.time][1] += len(batch)
        for c in notificator:
            log.append((c.time, not any(i.frontier.less_equal(c.time) for i in inputs)))
            out.session(c).give((c.time, *totals.pop(c.time)))

    return logic
