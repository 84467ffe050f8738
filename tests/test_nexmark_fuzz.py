"""Every NEXMark query, native and Megaphone, under the engine's schedule fuzzer.

Hypothesis draws the fuzzer's seed, the generator's seed and configuration, and the query
parameters from their whole valid range (windows and slides of one epoch or less included), how
the events are stamped (each at its own epoch, or runs of epochs stamped early by each worker on
its own), and for the Megaphone variants random bin moves while the query runs. The output, a
multiset of ``(epoch, record)``, must equal :mod:`nexmark.reference` on the same stamped events.
"""
from __future__ import annotations

import pytest
from conftest import property_on_workers
from hypothesis import strategies as st

from nexmark.harness import Run, diff, execute, expected, random_moves
from nexmark.model import US_STATES, Config, Params
from nexmark.queries import QUERIES


@st.composite
def runs(draw: st.DrawFn) -> Run:
    """A harness run of query ``"q0"`` (the test sets the query, the variant and the workers)."""
    d = draw(st.integers(1, 100))  # ms of event time per epoch

    def span(epochs: int) -> st.SearchStrategy[int]:  # event-time ms: one epoch or less half the time
        return st.integers(1, d) | st.integers(1, epochs * d)

    slide = draw(span(8))
    params = Params(
        d=d,
        q5_slide_ms=slide,
        q5_window_ms=slide * draw(st.integers(1, 8)),
        q7_window_ms=draw(span(32)),
        q8_window_ms=draw(span(64)),
        q2_skip=draw(st.integers(1, 10) | st.integers(1, 300)),
        q3_category=draw(st.integers(10, 14)),  # the generator's categories
        q3_states=tuple(draw(st.lists(st.sampled_from(US_STATES), min_size=1, unique=True))),
    ).check()
    config = Config(rate=draw(st.integers(20_000, 200_000)), time_dilation=d,
                    seed=draw(st.integers(-2**31, 2**31 - 1)), in_flight_auctions=draw(st.integers(1, 100)))
    return Run("q0", config, draw(st.integers(1, 3000)), params, lag=draw(st.integers(0, 4)),
               batching=draw(st.none() | st.integers(0, 2**16)), fuzz=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("flex", [False, True], ids=["native", "megaphone"])
@pytest.mark.parametrize("query", sorted(QUERIES))
@pytest.mark.timeout(180)
@property_on_workers(single=30, multi=8, run=runs(), moves=st.integers(0, 2**16), k=st.integers(1, 6))
def test_query_under_the_schedule_fuzzer_matches_reference(workers, query, flex, run, moves, k):
    run.query, run.workers, run.flex, run.k = query, workers, flex, k
    if workers > 1:
        run.timeout = 120  # forked workers are stopped and reaped if the run hangs
    if flex:
        run.moves = random_moves(moves, run.epochs, k, workers, count=6)
    got, want = execute(run), expected(run)
    assert got == want, f"{query} ({'megaphone' if flex else 'native'}, {workers} workers):\n" + diff(got, want)
