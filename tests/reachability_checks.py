"""Checks of a live ``Tracker`` against the oracles of ``reachability.py``: its pointstamps,
implication frontiers and counts, the changes it reports, and an incremental run against one from
scratch (:func:`run_against_oracles`, the core of the tracker property tests)."""
from __future__ import annotations

import contextlib
import signal
from collections import defaultdict

from progress_reference import ref_minimal
from reachability import Graph, bad_cycle_oracle, path_summaries, reach_oracle, summary_oracle

from timely.progress import Tracker


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (rather than hang) if propagation does not terminate."""

    def handler(signum, frame):
        raise Timeout(f"did not finish within {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def propagate(tracker: Tracker):
    with time_limit(3):
        return tracker.propagate_all()


def frontiers(tracker: Tracker, g: Graph) -> dict:
    return {loc: set(tracker.frontier(loc)) for loc in g.locations}


def target_frontiers(tracker: Tracker, g: Graph) -> dict:
    """:func:`frontiers` of the Targets alone."""
    return {loc: set(tracker.frontier(loc)) for loc in targets(g)}


def positive_frontier(counts: dict, loc) -> set:
    return ref_minimal(t for (l, t), c in counts.items() if l == loc and c > 0)


def targets(g: Graph) -> list:
    """The operator inputs of ``g``: the locations whose implications the tracker keeps."""
    return [loc for loc in g.locations if not loc.source]


def expected_implication_counts(tracker: Tracker, g: Graph, paths: dict) -> dict:
    """Each Target's implication counts are exactly one count per (location reaching it, minimal
    path summary from there, time of that location's pointstamp frontier), with the minimal
    summaries of the brute-force ``path_summaries``: no stale or self-sustaining counts."""
    exp: dict = {loc: defaultdict(int) for loc in targets(g)}
    for src in g.locations:
        for t in tracker.pointstamps[src].elements:
            for dst, summaries in paths[src].items():
                if not dst.source:
                    for s in summaries:
                        exp[dst][s.results_in(t)] += 1
    return {loc: {t: c for t, c in cs.items() if c} for loc, cs in exp.items()}


def check_state(tracker: Tracker, g: Graph, counts: dict, paths=None) -> None:
    positive = {k: c for k, c in counts.items() if c > 0}
    # pointstamps hold the exact counts (including negative ones) and their positive frontier
    for loc in g.locations:
        ps = tracker.pointstamps[loc]
        assert ps.counts == {t: c for (l, t), c in counts.items() if l == loc and c != 0}
        assert set(ps.elements) == positive_frontier(counts, loc)
    assert tracker.total_counts == sum(len(tracker.pointstamps[loc].elements) for loc in g.locations)
    assert tracker.tracking_anything() == bool(positive)
    # implication frontiers equal the brute-force oracle(s)
    expected = reach_oracle(g, counts)
    got = frontiers(tracker, g)
    assert got == expected, {loc: (got[loc], expected[loc]) for loc in g.locations if got[loc] != expected[loc]}
    if paths is not None:
        assert summary_oracle(g, paths, counts) == expected
        # implication counts are those of the current pointstamp frontiers (nothing stale): the
        # times counted, compared as sets. How many times one is counted depends on how many of
        # the path summaries that reach it an antichain keeps: a summary that resets an inner
        # coordinate to 0 is below the identity, which the tracker sees where the identity is a path
        # of edges and the reference order (one shape) does not; either way the frontier is the same.
        got_counts = {loc: tracker.implications[loc].counts for loc in targets(g)}
        assert all(c > 0 for counts in got_counts.values() for c in counts.values()), got_counts
        assert ({loc: set(cs) for loc, cs in got_counts.items()}
                == {loc: set(cs) for loc, cs in expected_implication_counts(tracker, g, paths).items()})


def apply_changes(prev: dict, changes, g: Graph) -> dict:
    """Apply the returned changes (of Targets' frontiers), in order, to a copy of the previous
    frontiers (strictly); the result holds the Targets alone (the tracker reports no Source)."""
    cur = {loc: set(ts) for loc, ts in prev.items() if not loc.source}
    for loc, t, d in changes:
        assert d in (1, -1), (loc, t, d)
        if d == 1:
            assert t not in cur[loc], ("added twice", loc, t)
            cur[loc].add(t)
        else:
            assert t in cur[loc], ("removed while absent", loc, t)
            cur[loc].remove(t)
    return cur


def fresh_tracker(g: Graph, counts: dict) -> Tracker:
    tr = g.builder().build()
    for (loc, t), c in counts.items():
        if c:
            tr.update(loc, t, c)
    propagate(tr)
    return tr



def run_against_oracles(g: Graph, batches) -> None:
    assert not bad_cycle_oracle(g), g  # the generator only makes advancing cycles
    tracker = g.builder().build()
    paths = path_summaries(g)
    counts: dict = defaultdict(int)
    prev = frontiers(tracker, g)
    assert all(not f for f in prev.values()) and not tracker.tracking_anything()
    for batch in batches:
        pending: dict = defaultdict(int)
        was_positive = any(c > 0 for c in counts.values())
        for loc, t, d in batch:
            tracker.update(loc, t, d)
            counts[(loc, t)] += d
            pending[(loc, t)] += d
        # buffered updates count as "tracking" until propagated, unless they cancel out
        assert tracker.tracking_anything() == (any(pending.values()) or was_positive)
        changes = propagate(tracker)
        check_state(tracker, g, counts, paths)
        new = frontiers(tracker, g)
        assert apply_changes(prev, changes, g) == target_frontiers(tracker, g)
        if not any(pending.values()):
            assert changes == [] and new == prev
        prev = new
        # incremental == from scratch
        scratch = fresh_tracker(g, counts)
        assert frontiers(scratch, g) == new
        assert {l: scratch.implications[l].counts for l in targets(g)} == {
            l: tracker.implications[l].counts for l in targets(g)
        }
        assert scratch.total_counts == tracker.total_counts
        # a second propagation with nothing buffered changes nothing
        assert propagate(tracker) == []
