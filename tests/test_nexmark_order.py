"""NEXMark under delivery orders that timely allows: regression tests for order assumptions.

Timely promises nothing about the order of the batches of one time (on one worker two
``send_batch`` calls at one epoch are two batches), and a record may be stamped with an epoch
earlier than its own (a lagging driver), so a later epoch can bring an earlier event time.
"""
from __future__ import annotations

import pytest

import megaphone
import timely
from nexmark import QUERIES, Params, Streams

Q5_SMALL = Params(d=100, q5_window_ms=20, q5_slide_ms=10)


def run_q5(rounds: list[list[tuple]], flex: bool) -> list:
    """Q5 on one worker with ``Q5_SMALL``: ``rounds[e]`` are the batches of bids sent at epoch
    ``e``, each followed by 20 steps (so each reaches the operator on its own); the sorted output."""

    def main(worker: timely.Worker) -> list:
        with worker.dataflow() as scope:
            p, a, b = (scope.new_input() for _ in range(3))
            control = megaphone.ControlInput(scope, k=2) if flex else None
            cap = QUERIES["q5"].build(Streams(p.stream, a.stream, b.stream), Q5_SMALL, control).capture()
        for epoch, batches in enumerate(rounds):
            for i in (p, a, b, control):
                if i is not None:
                    i.advance_to(epoch)
            for batch in batches:
                b.send_batch(batch)
                for _ in range(20):
                    worker.step()
        for i in (p, a, b, control):
            if i is not None:
                i.close()
        worker.finish()
        return sorted((t, tuple(r)) for t, rs in cap.extract() for r in rs)

    return timely.execute(main, workers=1)[0]


@pytest.mark.timeout(60)
def test_q5_second_batch_of_an_epoch_with_an_earlier_slice():
    """The issue's reproduction: the second batch of epoch 0 holds an earlier slice (4) than the
    first (5); both windows of each bid are reported (it used to fail with a ``KeyError``)."""
    rounds = [[[(1001, 1, 500, 50)], [(1000, 2, 700, 45)]]]  # (auction, bidder, price, date_time)
    assert run_q5(rounds, flex=False) == [(0, (50, 1000, 1)), (0, (60, 1000, 1)), (0, (70, 1001, 1))]
    assert run_q5(rounds, flex=True) == [(0, (50, 1000, 1)), (0, (60, 1000, 1)), (0, (70, 1001, 1))]


@pytest.mark.parametrize("flex", [False, True], ids=["native", "megaphone"])
@pytest.mark.timeout(60)
def test_q5_later_epoch_with_an_earlier_slice(flex):
    """A bid of epoch 1 stamped early (at 0) comes before a bid of the same auction in an earlier
    slice stamped 1 (as two lagging workers stamp them): the later epoch's bid still counts in its
    windows (both variants used to skip them)."""
    rounds = [[[(1000, 1, 500, 150)]], [[(1000, 2, 700, 120)]]]
    assert run_q5(rounds, flex) == [(1, (130, 1000, 1)), (1, (140, 1000, 1)),
                                    (1, (160, 1000, 1)), (1, (170, 1000, 1))]
