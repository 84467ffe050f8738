"""Random reachability graphs for the ``Builder`` / ``Tracker`` tests, and brute-force oracles.

A :class:`Graph` is one flat graph (Naiad style) of nodes with int times, or nested times up to
depth 3 through enter / leave / feedback nodes; its steps are those of ``progress_reference``.
Oracles:

* :func:`reach_oracle`: a brute-force search over (location, time) pairs from every positively
  counted pointstamp, using the direct semantics of each step (not ``Summary.results_in``);
* :func:`summary_oracle`: all minimal path summaries between every pair of locations, by a bounded
  fixpoint over ``Summary.followed_by`` (:func:`path_summaries`), applied to the positive pointstamps;
* :func:`bad_cycle_oracle`: does some cycle map a time to one ``<=`` itself (so it never advances)?
"""
from __future__ import annotations

from collections import defaultdict

from progress_reference import mk_time, ref_le, ref_minimal, step_apply, step_summary, summary_le

from timely.progress import Builder, Source, Summary, Target


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
                    summ = {step_summary(s, din): s for s in steps[i][o]}
                    for x, s in summ.items():
                        if not any(y != x and summary_le(y, x) for y in summ):
                            self.succ_min[Target(n, i)].append((Source(n, o), s))
        for (n, o), (m, i) in edges:
            self.succ[Source(n, o)].append((Target(m, i), None))
            self.succ_min[Source(n, o)].append((Target(m, i), None))

    def builder(self) -> Builder:
        b = Builder()
        for n, (din, _, ins, outs, steps) in enumerate(self.nodes):
            b.add_node(n, ins, outs, [[[step_summary(s, din) for s in steps[i][o]] for o in range(outs)] for i in range(ins)])
        for (n, o), (m, i) in self.edges:
            b.add_edge(Source(n, o), Target(m, i))
        return b

    def advance(self, loc, t, minimal_only: bool = False):
        for nxt, step in (self.succ_min if minimal_only else self.succ)[loc]:
            yield nxt, (t if step is None else step_apply(step, t))

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
        if any(ref_le(x, t) for x in explored[loc]):
            continue
        explored[loc] = [x for x in explored[loc] if not ref_le(t, x)] + [t]
        yield loc, t
        stack.extend(graph.advance(loc, t))


def reach_oracle(graph: Graph, counts: dict) -> dict:
    """Expected implication frontier of every location: minimal times reachable from positive counts."""
    explored: dict = defaultdict(list)
    seeds = [(loc, t) for (loc, t), c in counts.items() if c > 0]
    for _ in _explore(graph, seeds, explored):
        pass
    return {loc: ref_minimal(explored[loc]) for loc in graph.locations}


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
                s2 = s if step is None else s.followed_by(step_summary(step, graph.depth[loc]))
                if any(x.less_equal(s2) for x in found[nxt]):
                    continue
                found[nxt] = [x for x in found[nxt] if not s2.less_equal(x)] + [s2]
                stack.append((nxt, s2))
        paths[a] = found
    return paths


def summary_oracle(graph: Graph, paths: dict, counts: dict) -> dict:
    out: dict = {loc: [] for loc in graph.locations}
    for (src, t), c in counts.items():
        if c > 0:
            for dst, summaries in paths[src].items():
                out[dst].extend(s.results_in(t) for s in summaries)
    return {loc: ref_minimal(ts) for loc, ts in out.items()}


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
            if l2 == loc and ref_le(t, t0):
                return True
        for l2, t in _explore(graph, seeds, explored):
            for l3, t3 in graph.advance(l2, t):
                if l3 == loc and ref_le(t3, t0):
                    return True
    return False


def line(*steps_and_depths, close=True) -> Graph:
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


#: Depth-preserving steps that do not advance time, at depth 1 and 2.
IDENT = ("general", Summary(1, 0, ()))
IDENT2 = ("general", Summary(2, 0, ()))
