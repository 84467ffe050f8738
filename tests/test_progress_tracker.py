"""Property tests for the reachability ``Builder`` / ``Tracker`` against brute-force oracles.

Random small graphs (one flat graph, Naiad style) with int times, or nested times up to depth 3
through enter / leave / feedback nodes, plus random batches of pointstamp updates (positive and
negative, transiently negative counts allowed). Oracles:

* ``reach_oracle``: a brute-force search over (location, time) pairs from every positively counted
  pointstamp, using a direct semantics of each step written here (not ``Summary.results_in``);
* ``summary_oracle``: all minimal path summaries between every pair of locations, by a bounded
  fixpoint over ``Summary.followed_by``, applied to the positive pointstamps;
* ``bad_cycle_oracle``: does some cycle map a time to one ``<=`` itself (so it never advances)?
"""
from __future__ import annotations

import contextlib
import signal
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timely.progress import Builder, CycleError, Source, Summary, Target, Tracker

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Reference semantics
# ---------------------------------------------------------------------------------------------

def coords(t) -> tuple:
    return (t,) if isinstance(t, int) else tuple(t)


def mk_time(cs):
    cs = tuple(cs)
    return cs[0] if len(cs) == 1 else cs


def le(a, b) -> bool:
    ca, cb = coords(a), coords(b)
    assert len(ca) == len(cb), (a, b)
    return all(x <= y for x, y in zip(ca, cb))


def minimal_set(elements) -> set:
    s = set(elements)
    return {x for x in s if not any(y != x and le(y, x) for y in s)}


def summary_le(a: Summary, b: Summary) -> bool:
    return a.keep == b.keep and len(a.push) == len(b.push) and a.add <= b.add and all(
        x <= y for x, y in zip(a.push, b.push)
    )


def apply_step(step, t):
    """Direct semantics of one node step (independent of ``Summary.results_in``)."""
    kind, arg = step
    cs = list(coords(t))
    if kind == "enter":
        cs.append(0)
    elif kind == "leave":
        cs.pop()
    elif kind == "feedback":
        cs[-1] += arg
    elif kind == "general":  # arg = (keep, add, push)
        keep, add, push = arg
        del cs[keep:]
        cs[-1] += add
        cs.extend(push)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return mk_time(cs)


def to_summary(step, depth) -> Summary:
    kind, arg = step
    if kind == "enter":
        return Summary.enter(depth)
    if kind == "leave":
        return Summary.leave(depth)
    if kind == "feedback":
        return Summary.feedback(depth, arg)
    return Summary(*arg)


# ---------------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------------

class Graph:
    """A random graph description: node ports with depths, node steps, edges."""

    def __init__(self, nodes, edges) -> None:
        # nodes[n] = (in_depth, out_depth, inputs, outputs, steps[i][o] -> list of steps)
        self.nodes = nodes
        self.edges = edges  # list of ((n, o), (m, i))
        self.depth = {}
        for n, (din, dout, ins, outs, _) in enumerate(nodes):
            for i in range(ins):
                self.depth[Target(n, i)] = din
            for o in range(outs):
                self.depth[Source(n, o)] = dout
        self.locations = sorted(self.depth)
        # successor steps of each location: (next location, step or None for an edge)
        self.succ = defaultdict(list)
        # the same, keeping only one step per minimal summary of a cell (the connectivity antichain)
        self.succ_min = defaultdict(list)
        for n, (din, dout, ins, outs, steps) in enumerate(nodes):
            for i in range(ins):
                for o in range(outs):
                    for s in steps[i][o]:
                        self.succ[Target(n, i)].append((Source(n, o), s))
                    summ = {to_summary(s, din): s for s in steps[i][o]}
                    for x, s in summ.items():
                        if not any(y != x and summary_le(y, x) for y in summ):
                            self.succ_min[Target(n, i)].append((Source(n, o), s))
        for (n, o), (m, i) in edges:
            self.succ[Source(n, o)].append((Target(m, i), None))
            self.succ_min[Source(n, o)].append((Target(m, i), None))

    def builder(self) -> Builder:
        b = Builder()
        for n, (din, _, ins, outs, steps) in enumerate(self.nodes):
            b.add_node(n, ins, outs, [[[to_summary(s, din) for s in steps[i][o]] for o in range(outs)] for i in range(ins)])
        for (n, o), (m, i) in self.edges:
            b.add_edge(Source(n, o), Target(m, i))
        return b

    def advance(self, loc, t, minimal_only: bool = False):
        for nxt, step in (self.succ_min if minimal_only else self.succ)[loc]:
            yield nxt, (t if step is None else apply_step(step, t))

    def __repr__(self) -> str:
        return f"Graph(nodes={self.nodes!r}, edges={self.edges!r})"


def _explore(graph: Graph, seeds, explored, limit: int = 20000):
    """Search (location, time) pairs from ``seeds``, pruning times >= an explored time at a location.

    Steps are monotone, so pruning dominated times loses no minimal time; termination follows from
    Dickson's lemma (coordinates are bounded below). Yields every newly explored pair.
    """
    stack = list(seeds)
    steps = 0
    while stack:
        loc, t = stack.pop()
        steps += 1
        assert steps < limit, "oracle search did not terminate"
        if any(le(x, t) for x in explored[loc]):
            continue
        explored[loc] = [x for x in explored[loc] if not le(t, x)] + [t]
        yield loc, t
        stack.extend(graph.advance(loc, t))


def reach_oracle(graph: Graph, counts: dict) -> dict:
    """Expected implication frontier of every location: minimal times reachable from positive counts."""
    explored = defaultdict(list)
    seeds = [(loc, t) for (loc, t), c in counts.items() if c > 0]
    for _ in _explore(graph, seeds, explored):
        pass
    return {loc: minimal_set(explored[loc]) for loc in graph.locations}


def path_summaries(graph: Graph, limit: int = 20000) -> dict:
    """paths[a][b]: the minimal summaries of all paths a -> b (identity included for a == b)."""
    paths = {}
    for a in graph.locations:
        found = defaultdict(list)
        found[a].append(Summary.identity(graph.depth[a]))
        stack = [(a, found[a][0])]
        steps = 0
        while stack:
            loc, s = stack.pop()
            steps += 1
            assert steps < limit, "summary fixpoint did not terminate"
            if s not in found[loc]:
                continue  # superseded since it was queued
            for nxt, step in graph.succ[loc]:
                s2 = s if step is None else s.followed_by(to_summary(step, graph.depth[loc]))
                if any(x.less_equal(s2) for x in found[nxt]):
                    continue
                found[nxt] = [x for x in found[nxt] if not s2.less_equal(x)] + [s2]
                stack.append((nxt, s2))
        paths[a] = found
    return paths


def summary_oracle(graph: Graph, paths: dict, counts: dict) -> dict:
    out = {loc: [] for loc in graph.locations}
    for (src, t), c in counts.items():
        if c > 0:
            for dst, summaries in paths[src].items():
                out[dst].extend(s.results_in(t) for s in summaries)
    return {loc: minimal_set(ts) for loc, ts in out.items()}


BIG = 60


def bad_cycle_oracle(graph: Graph) -> bool:
    """True if some cycle (of length >= 1) maps some time to a time <= itself: it does not advance.

    Composite cycle summaries only depend on the coordinates they keep, so a cycle that fails to
    advance does so on the time (BIG, ..., BIG) for BIG beyond every constant it can push.
    """
    for loc in graph.locations:
        t0 = mk_time([BIG] * graph.depth[loc])
        explored = defaultdict(list)
        explored[loc].append(t0)
        seeds = list(graph.advance(loc, t0))
        for l2, t in seeds:
            if l2 == loc and le(t, t0):
                return True
        for l2, t in _explore(graph, seeds, explored):
            for l3, t3 in graph.advance(l2, t):
                if l3 == loc and le(t3, t0):
                    return True
    return False


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

@st.composite
def op_step(draw, depth: int, advancing: bool = False):
    """A depth-preserving operator step: a general (keep, add, push) summary."""
    keep = draw(st.integers(1, depth))
    add = draw(st.integers(1 if advancing else 0, 2))
    push = tuple(draw(st.lists(st.integers(0, 2), min_size=depth - keep, max_size=depth - keep)))
    return ("general", (keep, add, push))


@st.composite
def node(draw, max_depth: int):
    kinds = ["op", "op", "feedback"]
    d = draw(st.integers(1, max_depth))
    if d < max_depth:
        kinds.append("enter")
    if d > 1:
        kinds.append("leave")
    kind = draw(st.sampled_from(kinds))
    if kind == "op":
        ins, outs = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        steps = [[draw(st.lists(op_step(d), max_size=2)) for _ in range(outs)] for _ in range(ins)]
        return kind, (d, d, ins, outs, steps)
    outs = draw(st.integers(1, 2))
    if kind == "feedback":
        step = ("feedback", draw(st.integers(1, 2)))
        dout = d
    elif kind == "enter":
        step, dout = ("enter", None), d + 1
    else:
        step, dout = ("leave", None), d - 1
    return kind, (d, dout, 1, outs, [[[step] for _ in range(outs)]])


def min_keep(spec) -> int:
    din, dout, ins, outs, steps = spec
    keeps = [din, dout]
    for row in steps:
        for cell in row:
            for kind, arg in cell:
                if kind == "general":
                    keeps.append(arg[0])
    return min(keeps)


@st.composite
def graph(draw, max_depth: int, acyclic_only_through_feedback: bool, max_nodes: int = 6):
    """Random graph. With ``acyclic_only_through_feedback`` every cycle is well formed by construction:
    backward edges (to a node at or before the source) must enter a feedback node of depth d, and
    every node between them keeps at least d coordinates (so the cycle's lowest level is the feedback's).
    """
    kinds_specs = draw(st.lists(node(max_depth), min_size=1, max_size=max_nodes))
    kinds = [k for k, _ in kinds_specs]
    nodes = [s for _, s in kinds_specs]
    sources = [(n, o) for n, spec in enumerate(nodes) for o in range(spec[3])]
    targets = [(m, i) for m, spec in enumerate(nodes) for i in range(spec[2])]
    edges = []
    if sources and targets:
        picks = draw(st.lists(st.tuples(st.sampled_from(sources), st.sampled_from(targets)), max_size=12))
        # bias towards cycles: a ring through random nodes (output 0 -> input 0, where they exist)
        ring = draw(st.lists(st.integers(0, len(nodes) - 1), max_size=5))
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if nodes[a][3] and nodes[b][2]:
                picks.append(((a, 0), (b, 0)))
        for (n, o), (m, i) in picks:
            if nodes[n][1] != nodes[m][0]:
                continue  # depths must match
            if acyclic_only_through_feedback and m <= n:
                if kinds[m] != "feedback":
                    continue
                d = nodes[m][0]
                if any(min_keep(nodes[w]) < d for w in range(m, n + 1)):
                    continue
            edges.append(((n, o), (m, i)))
    return Graph(nodes, edges)


@st.composite
def ring_graph(draw, max_depth: int = 3):
    """A closed walk through depth space (enter / leave / feedback / general steps) as a ring of
    nodes, plus random chords from second outputs: most cycles cross scope levels."""
    d0 = draw(st.integers(1, max_depth))
    d = d0
    specs = []
    for _ in range(draw(st.integers(1, 7))):
        kinds = ["op", "feedback"] + (["enter"] if d < max_depth else []) + (["leave"] if d > 1 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "op":
            step, dout = draw(op_step(d)), d
        elif kind == "feedback":
            step, dout = ("feedback", draw(st.integers(1, 2))), d
        elif kind == "enter":
            step, dout = ("enter", None), d + 1
        else:
            step, dout = ("leave", None), d - 1
        specs.append((d, dout, step))
        d = dout
    while d != d0:  # close the walk
        step, dout = (("enter", None), d + 1) if d < d0 else (("leave", None), d - 1)
        specs.append((d, dout, step))
        d = dout
    nodes = []
    for din, dout, step in specs:
        outs = draw(st.integers(1, 2))
        nodes.append((din, dout, 1, outs, [[[step] for _ in range(outs)]]))
    n = len(nodes)
    edges = [((k, 0), ((k + 1) % n, 0)) for k in range(n)]
    for k in range(n):
        if nodes[k][3] == 2:
            matching = [m for m in range(n) if nodes[m][0] == nodes[k][1]]
            edges.append(((k, 1), (draw(st.sampled_from(matching)), 0)))
    return Graph(nodes, edges)


@st.composite
def update_batches(draw, g: Graph, max_batches: int = 6):
    locs = g.locations
    if not locs:
        return []

    def upd():
        loc = draw(st.sampled_from(locs))
        d = g.depth[loc]
        t = draw(st.integers(0, 4)) if d == 1 else tuple(draw(st.lists(st.integers(0, 3), min_size=d, max_size=d)))
        return loc, t, draw(st.sampled_from([-2, -1, -1, 1, 1, 1, 2]))

    batches = []
    for _ in range(draw(st.integers(1, max_batches))):
        batches.append([upd() for _ in range(draw(st.integers(0, 6)))])
    return batches


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

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


def positive_frontier(counts: dict, loc) -> set:
    return minimal_set(t for (l, t), c in counts.items() if l == loc and c > 0)


def expected_implication_counts(tracker: Tracker, g: Graph) -> dict:
    """Local consistency: each location's implication counts are exactly its own pointstamp frontier
    plus, for every incoming step, the image of the upstream location's implication frontier."""
    exp = {loc: defaultdict(int) for loc in g.locations}
    for loc in g.locations:
        for t in tracker.pointstamps[loc].elements:
            exp[loc][t] += 1
        for t in tracker.frontier(loc):
            for nxt, t2 in g.advance(loc, t, minimal_only=True):
                exp[nxt][t2] += 1
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
    # implication counts are consistent with the current frontiers (no stale or self-sustaining counts)
    assert {loc: tracker.implications[loc].counts for loc in g.locations} == expected_implication_counts(tracker, g)


def apply_changes(prev: dict, changes, g: Graph) -> dict:
    """Apply the returned changes, in order, to a copy of the previous frontiers (strictly)."""
    cur = {loc: set(ts) for loc, ts in prev.items()}
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


# ---------------------------------------------------------------------------------------------
# Tests: cycle detection
# ---------------------------------------------------------------------------------------------

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


def line(*steps_and_depths, close=True):
    """A ring (or line) of single-input single-output nodes with the given (step, in_depth) pairs."""
    nodes = []
    for step, din in steps_and_depths:
        kind = step[0]
        dout = din + 1 if kind == "enter" else din - 1 if kind == "leave" else din
        nodes.append((din, dout, 1, 1, [[[step]]]))
    n = len(nodes)
    edges = [((k, 0), (k + 1, 0)) for k in range(n - 1)]
    if close:
        edges.append(((n - 1, 0), (0, 0)))
    return Graph(nodes, edges)


IDENT = ("general", (1, 0, ()))
IDENT2 = ("general", (2, 0, ()))

REJECTED = {
    "identity self-loop": line((IDENT, 1)),
    "identity ring": line((IDENT, 1), (IDENT, 1), (IDENT, 1)),
    "inner identity ring": line((IDENT2, 2), (IDENT2, 2)),
    "leave then enter": line((("leave", None), 2), (("enter", None), 1)),
    "leave, outer identity, enter": line((("leave", None), 2), (IDENT, 1), (("enter", None), 1)),
    # the inner feedback is forgotten when leaving: (a, b) -> (a, b + 1) -> a -> (a, 0) <= (a, b)
    "inner feedback, leave, enter": line((("feedback", 1), 2), (("leave", None), 2), (("enter", None), 1)),
    "reset of the inner coordinate": line((("general", (1, 0, (1,))), 2),),
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
    "advance outer, reset inner": line((("general", (1, 1, (0,))), 2),),
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


# ---------------------------------------------------------------------------------------------
# Tests: tracker vs oracles
# ---------------------------------------------------------------------------------------------

def graphs_and_updates(max_depth: int):
    return graph(max_depth, acyclic_only_through_feedback=True).flatmap(
        lambda g: st.tuples(st.just(g), update_batches(g))
    )


def run_against_oracles(g: Graph, batches) -> None:
    assert not bad_cycle_oracle(g), g  # the generator only makes advancing cycles
    tracker = g.builder().build()
    paths = path_summaries(g)
    counts: dict = defaultdict(int)
    prev = frontiers(tracker, g)
    assert all(not f for f in prev.values()) and not tracker.tracking_anything()
    for batch in batches:
        pending = defaultdict(int)
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
        assert apply_changes(prev, changes, g) == new
        if not any(pending.values()):
            assert changes == [] and new == prev
        prev = new
        # incremental == from scratch
        scratch = fresh_tracker(g, counts)
        assert frontiers(scratch, g) == new
        assert {l: scratch.implications[l].counts for l in g.locations} == {
            l: tracker.implications[l].counts for l in g.locations
        }
        assert scratch.total_counts == tracker.total_counts
        # a second propagation with nothing buffered changes nothing
        assert propagate(tracker) == []


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
        assert one.implications[loc].counts == many.implications[loc].counts
    assert one.total_counts == many.total_counts
    assert one.tracking_anything() == many.tracking_anything()
    # both change streams take the empty state to the same final frontiers
    empty = {loc: set() for loc in g.locations}
    assert apply_changes(empty, changes_one, g) == apply_changes(empty, all_changes, g) == frontiers(one, g)
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
