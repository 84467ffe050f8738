"""Property tests for the reachability ``Tracker`` against brute-force oracles (``reachability.py``):
random graphs and random batches of pointstamp updates, propagated incrementally, must give the
oracles' frontiers and counts whatever the batching; plus hand-written examples.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reachability_checks import apply_changes, frontiers, propagate, run_against_oracles, target_frontiers
from reachability_strategies import graphs_and_updates

from timely.progress import Builder, Source, Summary, Target

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(graphs_and_updates(1))
def test_tracker_matches_oracle_int_times(args):
    run_against_oracles(*args)


@SETTINGS
@given(graphs_and_updates(2))
def test_tracker_matches_oracle_nested_depth2(args):
    run_against_oracles(*args)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_and_updates(3))
def test_tracker_matches_oracle_nested_depth3(args):
    run_against_oracles(*args)


@SETTINGS
@given(
    st.integers(1, 2).flatmap(lambda d: graphs_and_updates(d)),
    st.lists(st.integers(0, 40), max_size=6),
)
def test_batch_grouping_does_not_matter(args, cuts):
    g, batches = args
    updates = [u for b in batches for u in b]
    # one tracker sees everything as one batch
    one = g.builder().build()
    for loc, t, d in updates:
        one.update(loc, t, d)
    changes_one = propagate(one)
    # another sees the same updates split into consecutive batches at random points
    many = g.builder().build()
    points = sorted({c % (len(updates) + 1) for c in cuts} | {0, len(updates)})
    all_changes = []
    for a, b in zip(points, points[1:]):
        for loc, t, d in updates[a:b]:
            many.update(loc, t, d)
        all_changes.extend(propagate(many))
    assert frontiers(one, g) == frontiers(many, g)
    for loc in g.locations:
        assert one.pointstamps[loc].counts == many.pointstamps[loc].counts
        if not loc.source:
            assert one.implications[loc].counts == many.implications[loc].counts
    assert one.total_counts == many.total_counts
    assert one.tracking_anything() == many.tracking_anything()
    # both change streams take the empty state to the same final frontiers
    empty = {loc: set() for loc in g.locations}
    assert apply_changes(empty, changes_one, g) == apply_changes(empty, all_changes, g) == target_frontiers(one, g)
    # and update_batch is the same as individual updates
    batch = g.builder().build()
    batch.update_batch(((loc, t), d) for loc, t, d in updates)
    propagate(batch)
    assert frontiers(batch, g) == frontiers(one, g)


# ---------------------------------------------------------------------------------------------
# Tests: hand-written examples
# ---------------------------------------------------------------------------------------------

def test_loop_example_int_times():
    # 0: input op (no inputs, 1 output) -> 1: op (identity) -> 2: feedback(+1) -> back to 1
    b = Builder()
    b.add_node(0, 0, 1, [])
    b.add_node(1, 2, 1, [[[Summary(1, 0)]], [[Summary(1, 0)]]])
    b.add_node(2, 1, 1, [[[Summary.feedback(1, 1)]]])
    b.add_edge(Source(0, 0), Target(1, 0))
    b.add_edge(Source(1, 0), Target(2, 0))
    b.add_edge(Source(2, 0), Target(1, 1))
    tr = b.build()
    tr.update(Source(0, 0), 0, 1)
    changes = tr.propagate_all()
    assert tr.frontier(Target(1, 0)) == [0]
    assert tr.frontier(Target(1, 1)) == [1]
    assert tr.frontier(Target(2, 0)) == [0]
    assert (Target(1, 1), 1, 1) in changes
    assert tr.total_counts == 1 and tr.tracking_anything()
    # the input advances to 5 while a message at 2 is in flight to the operator
    tr.update(Source(0, 0), 5, 1)
    tr.update(Source(0, 0), 0, -1)
    tr.update(Target(1, 0), 2, 1)
    tr.propagate_all()
    assert tr.frontier(Target(1, 0)) == [2]
    assert tr.frontier(Target(1, 1)) == [3]
    assert tr.total_counts == 2
    tr.update(Source(0, 0), 5, -1)
    tr.update(Target(1, 0), 2, -1)
    tr.propagate_all()
    assert all(not tr.frontier(loc) for loc in tr.implications)
    assert not tr.tracking_anything() and tr.total_counts == 0


def test_transient_negative_counts_do_not_imply_anything():
    b = Builder()
    b.add_node(0, 0, 1, [])
    b.add_node(1, 1, 0, [[]])
    b.add_edge(Source(0, 0), Target(1, 0))
    tr = b.build()
    tr.update(Target(1, 0), 3, -1)  # the decrement arrives before the increment
    assert tr.propagate_all() == []
    assert tr.frontier(Target(1, 0)) == [] and not tr.tracking_anything()
    tr.update(Target(1, 0), 3, 1)
    assert tr.propagate_all() == []
    assert tr.pointstamps[Target(1, 0)].counts == {}


def test_builder_validation():
    b = Builder()
    with pytest.raises(ValueError):
        b.add_node(1, 0, 0, [])
    with pytest.raises(ValueError):
        b.add_node(0, 1, 1, [[]])
    b.add_node(0, 1, 1, [[[Summary(1, 1)]]])
    with pytest.raises(ValueError):
        b.add_edge(Target(0, 0), Source(0, 0))
    tr = b.build()
    with pytest.raises(KeyError):
        tr.update(Target(5, 0), 0, 1)
