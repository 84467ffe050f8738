"""Fakes and a live job shared by the megaphone controller, endpoint and CLI tests.

* :class:`FakeControl` and :class:`FakeProbe` stand in for a control input and a probe, so that the
  controller's gating can be driven by hand;
* :class:`LiveCount` is a real keyed running count (``megaphone.state_machine`` with
  :func:`count_fold`) on one worker, checked with :func:`observed_count` == :func:`sequential_count`;
* :func:`running_job` runs a multi-worker job in a thread until its control endpoint answers.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import megaphone
import timely
from megaphone.control import ControlInput
from megaphone.controller import Controller
from megaphone.endpoint import EndpointError, request

STEP_TIMEOUT = 30


class FakeControl:
    """Records what the controller sends; ``time`` and ``closed`` are set by the test."""

    def __init__(self, k: int = 3, peers: int = 3) -> None:
        self.k = k
        self.nbins = 1 << k
        self.peers = peers
        self.time = 0
        self.closed = False
        self.sent: list[tuple[int, dict]] = []

    def moves(self, assignment):
        self.sent.append((self.time, dict(assignment)))


class FakeProbe:
    """A probe whose frontier is a single time set by the test (``None``: complete)."""

    def __init__(self) -> None:
        self.frontier = 0

    def less_equal(self, t) -> bool:
        return self.frontier is not None and self.frontier <= t


def count_fold(key, value, state):
    """A running count per key: the new total is the state and the output."""
    n = (state or 0) + value
    return n, [(key, n)]


def sequential_count(epochs):
    """Per (time, key): the records' count and the key's running total at the end of that time."""
    totals: Counter = Counter()
    out: dict = {}
    for t, records in enumerate(epochs):
        for k, v in records:
            totals[k] += v
            n, _ = out.get((t, k), (0, 0))
            out[t, k] = (n + 1, totals[k])
    return out


def observed_count(outputs):
    """The same summary from ``(time, key, running count)`` outputs: one output per applied record,
    the largest being the total after the time (within a time, records of a key may apply in any
    order, so the intermediate values depend on it; the final one does not)."""
    out: dict = {}
    for t, k, c in outputs:
        n, m = out.get((t, k), (0, None))
        out[t, k] = (n + 1, c if m is None else max(m, c))
    return out


class LiveCount:
    """A keyed running count over ``2^k`` bins on one worker (the bins on the first ``workers``
    workers, default all); its data and control inputs advance together, one epoch per
    :meth:`advance`. ``machine`` is the megaphone operator handle; ``chunk``: the most entries in
    one state message of a bin moving whole (the operator's default when None)."""

    def __init__(self, worker, k: int, workers: int | None = None, chunk: int | None = None) -> None:
        self.worker = worker
        with worker.dataflow() as scope:
            self.data = scope.new_input()
            self.control = ControlInput(scope, k=k, workers=workers)
            self.machine = megaphone.state_machine(self.data.stream, self.control, 0, count_fold,
                                                   **({} if chunk is None else {"chunk": chunk}))
            self.captured = self.machine.stream.capture()
        self.epoch = 0
        self.sent: list[list] = []  # the records sent at each epoch, in order

    def advance(self, records: list, ctl: Controller | None = None) -> None:
        """Send ``records`` at the current epoch, move both inputs to the next one, tick ``ctl``
        (which may issue a migration step at the new epoch) and step until the output is at most
        two epochs behind."""
        self.sent.append(records)
        self.data.send_batch(records)
        self.epoch += 1
        self.data.advance_to(self.epoch)
        self.control.advance_to(self.epoch)
        if ctl is not None:
            ctl.tick()
        self.worker.step_while(lambda: self.machine.probe.less_than(self.epoch - 2), timeout=STEP_TIMEOUT)

    def finish(self) -> list:
        """Close both inputs and run the count to completion; its outputs as ``(time, key, count)``."""
        self.data.close()
        self.control.close()
        self.worker.step_while(lambda: not self.machine.probe.done(), timeout=STEP_TIMEOUT)
        # The probe is done once S's output is, but the capture (another consumer of that output) may
        # still hold batches the schedule fuzzer delayed: run the dataflow to completion.
        self.worker.finish()
        return [(t, *r) for t, batch in self.captured.extract() for r in batch]


@contextlib.contextmanager
def running_job(main: Callable[[Any], Any], workers: int, endpoint: str, join: float,
                **execute: Any) -> Iterator[dict]:
    """Run ``timely.execute(main, workers, **execute)`` in a thread; enter once the job's control
    endpoint answers (60 s at most), and on leaving wait ``join`` seconds for the job to end. The
    yielded dict gets ``"results"``, or ``"error"`` if the job raised."""
    box: dict = {}

    def target() -> None:
        try:
            box["results"] = timely.execute(main, workers=workers, **execute)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for the job to come up
            try:
                assert request(endpoint, {"op": "table"}, 0.5)["ok"]
                break
            except EndpointError:
                assert time.monotonic() < deadline and "error" not in box, box.get("error")
        yield box
    finally:
        t.join(join)
    assert not t.is_alive() and "error" not in box, box.get("error")
