"""Cycle detection in the reachability ``Builder``: building a graph fails with ``CycleError``
exactly when some cycle does not advance time (against ``bad_cycle_oracle``), for random graphs,
rings across scope levels and hand-written loops; graphs that build propagate to the oracles' state.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from progress_reference import mk_time
from reachability import IDENT, IDENT2, Graph, bad_cycle_oracle, line, path_summaries
from reachability_checks import check_state, propagate, run_against_oracles
from reachability_strategies import graph, ring_graph, update_batches

from timely.progress import CycleError, Summary


@settings(max_examples=250, deadline=None)
@given(st.integers(1, 3).flatmap(lambda d: graph(d, acyclic_only_through_feedback=False)))
def test_build_rejects_exactly_the_non_advancing_cycles(g):
    bad = bad_cycle_oracle(g)
    if bad:
        with pytest.raises(CycleError):
            g.builder().build()
    else:
        tr = g.builder().build()
        # and a graph that builds is one on which propagation terminates
        for loc in g.locations:
            tr.update(loc, mk_time([1] * g.depth[loc]), 1)
        propagate(tr)
        check_state(tr, g, {(loc, mk_time([1] * g.depth[loc])): 1 for loc in g.locations})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ring_graph().flatmap(lambda g: st.tuples(st.just(g), update_batches(g, max_batches=3))))
def test_rings_across_scope_levels(args):
    g, batches = args
    if bad_cycle_oracle(g):
        with pytest.raises(CycleError):
            g.builder().build()
    else:
        run_against_oracles(g, batches)



REJECTED = {
    "identity self-loop": line((IDENT, 1)),
    "identity ring": line((IDENT, 1), (IDENT, 1), (IDENT, 1)),
    "inner identity ring": line((IDENT2, 2), (IDENT2, 2)),
    "leave then enter": line((("leave", None), 2), (("enter", None), 1)),
    "leave, outer identity, enter": line((("leave", None), 2), (IDENT, 1), (("enter", None), 1)),
    # the inner feedback is forgotten when leaving: (a, b) -> (a, b + 1) -> a -> (a, 0) <= (a, b)
    "inner feedback, leave, enter": line((("feedback", 1), 2), (("leave", None), 2), (("enter", None), 1)),
    "reset of the inner coordinate": line((("general", Summary(1, 0, (1,))), 2),),
    "depth 3 leave/enter": line(
        (("feedback", 2), 3), (("leave", None), 3), (("feedback", 1), 2), (("leave", None), 2), (("enter", None), 1),
        (("enter", None), 2),
    ),
}

ACCEPTED = {
    "feedback self-loop": line((("feedback", 1), 1)),
    "feedback ring": line((IDENT, 1), (("feedback", 2), 1), (IDENT, 1)),
    "inner loop": line((IDENT2, 2), (("feedback", 1), 2)),
    "outer feedback around a nested scope": line(
        (("leave", None), 2), (("feedback", 1), 1), (("enter", None), 1), (("feedback", 1), 2)
    ),
    "outer feedback, no inner feedback": line((("leave", None), 2), (("feedback", 1), 1), (("enter", None), 1)),
    "advance outer, reset inner": line((("general", Summary(1, 1, (0,))), 2),),
    "depth 3 nested loops": line(
        (("feedback", 2), 3), (("leave", None), 3), (("feedback", 1), 2), (("leave", None), 2),
        (("feedback", 1), 1), (("enter", None), 1), (("enter", None), 2),
    ),
    "line without cycle": line((IDENT, 1), (IDENT, 1), close=False),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_non_advancing_cycles_rejected(name):
    g = REJECTED[name]
    assert bad_cycle_oracle(g)
    with pytest.raises(CycleError):
        g.builder().build()


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_advancing_cycles_accepted(name):
    g = ACCEPTED[name]
    assert not bad_cycle_oracle(g)
    tr = g.builder().build()
    counts = {}
    for loc in g.locations:
        t = mk_time([3] * g.depth[loc])
        tr.update(loc, t, 1)
        counts[(loc, t)] = 1
    propagate(tr)
    check_state(tr, g, counts, path_summaries(g))
    for (loc, t) in list(counts):
        tr.update(loc, t, -1)
        counts[(loc, t)] = 0
    propagate(tr)
    check_state(tr, g, counts)
    assert all(not tr.frontier(loc) for loc in g.locations)
    assert not tr.tracking_anything()


def test_mixed_antichain_with_a_non_advancing_element_is_rejected():
    # a feedback node whose connectivity also offers an identity path: the cycle can use it
    g = Graph([(1, 1, 1, 1, [[[("feedback", 1), IDENT]]])], [((0, 0), (0, 0))])
    assert bad_cycle_oracle(g)
    with pytest.raises(CycleError):
        g.builder().build()

