"""Reachability: from pointstamp counts to the frontier each operator input may still see.

The dataflow graph is built once (:class:`Builder`) and then frozen into a :class:`Tracker`.
Locations are operator ports: a :func:`Target` is an operator input, a :func:`Source` an operator
output. A count at a Source is capabilities held there; a count at a Target is messages in flight
to it. The tracker keeps, for every location, the *implications*: the multiset of times that could
still arrive there, each contributed by one upstream pointstamp through one path. Its frontier is
the location's implied frontier.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import CycleError
from .change_batch import ChangeBatch
from .frontier import Antichain, MutableAntichain
from .timestamp import Summary, minimal


class Location(NamedTuple):
    """An operator port: ``source`` is True for an output (Source), False for an input (Target)."""

    node: int
    port: int
    source: bool


def Source(node: int, port: int) -> Location:
    """The location of output ``port`` of operator ``node``."""
    return Location(node, port, True)


def Target(node: int, port: int) -> Location:
    """The location of input ``port`` of operator ``node``."""
    return Location(node, port, False)


Connectivity = Sequence[Sequence[Iterable[Summary]]]  # [input][output] -> summaries (antichain)


class Builder:
    """Collects operators (with input->output summaries) and edges, then builds a :class:`Tracker`."""

    def __init__(self) -> None:
        self.nodes: list[tuple[int, int, list[list[Antichain]]]] = []
        self.names: list[str] = []
        self.edges: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)

    def add_node(self, index: int, inputs: int, outputs: int, summary: Connectivity, name: str = "") -> None:
        """Add operator ``index`` (indices are dense, in creation order) with its summaries."""
        if index != len(self.nodes):
            raise ValueError(f"operator {index} added out of order (expected {len(self.nodes)})")
        if len(summary) != inputs or any(len(row) != outputs for row in summary):
            raise ValueError(f"operator {index}: connectivity must be {inputs} x {outputs}")
        self.nodes.append((inputs, outputs, [[Antichain(s) for s in row] for row in summary]))
        self.names.append(name or f"operator {index}")

    def add_edge(self, source: Location, target: Location) -> None:
        """Connect an operator output to an operator input."""
        if not source.source or target.source:
            raise ValueError(f"an edge goes from a Source to a Target, not {source} -> {target}")
        self.edges[(source.node, source.port)].append((target.node, target.port))

    def check_acyclic(self) -> None:
        """Raise :class:`CycleError` if some cycle's composed summary does not strictly advance time.

        A cycle composes into ``Summary(keep, add, push)`` where ``keep`` is the least ``keep`` ``m``
        of its operator steps (edges are identities and never lower) and ``add`` is the sum of the
        ``add`` of its steps with ``keep == m``; it advances iff that ``add`` is positive. (A feedback
        deeper than ``m`` does not count: leaving the scope forgets it, and ``leave`` then ``enter``
        maps ``(a, b)`` to ``(a, 0) <= (a, b)``.) So for each level ``m``: in the graph of edges,
        steps with ``keep > m`` and steps with ``keep == m, add == 0``, no step of the last kind may
        lie on a cycle.
        """
        edges: list[tuple[Location, Location]] = []
        steps: list[tuple[Location, Location, Summary]] = []
        for (n, o), targets in self.edges.items():
            for m, i in targets:
                edges.append((Source(n, o), Target(m, i)))
        for n, (ins, outs, summ) in enumerate(self.nodes):
            for i in range(ins):
                for o in range(outs):
                    for s in summ[i][o]:
                        steps.append((Target(n, i), Source(n, o), s))
        for level in sorted({s.keep for _, _, s in steps}):
            arcs = edges + [(a, b) for a, b, s in steps if s.keep > level or (s.keep == level and s.add == 0)]
            comp = _components(arcs)
            for a, b, s in steps:
                if s.keep == level and s.add == 0 and comp[a] == comp[b]:
                    names = self.names[a.node] if a.node == b.node else f"{self.names[a.node]}, {self.names[b.node]}"
                    raise CycleError(
                        f"a dataflow cycle does not advance time (no feedback with a positive step at "
                        f"its outermost level {level}): {names}"
                    )

    def build(self) -> Tracker:
        """Check the graph and freeze it into a tracker."""
        self.check_acyclic()
        return Tracker(self.nodes, dict(self.edges))


def _components(arcs: list) -> dict:
    """Strongly connected components (Kosaraju, iterative): vertex -> component representative."""
    succ: dict = defaultdict(list)
    pred: dict = defaultdict(list)
    for a, b in arcs:
        succ[a].append(b)
        pred[b].append(a)
    order: list = []
    seen: set = set()
    for root in list(succ) + list(pred):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(succ[root]))]
        while stack:
            v, it = stack[-1]
            for w in it:
                if w not in seen:
                    seen.add(w)
                    stack.append((w, iter(succ[w])))
                    break
            else:
                stack.pop()
                order.append(v)
    comp: dict = {}
    for root in reversed(order):
        if root in comp:
            continue
        comp[root] = root
        stack = [root]
        while stack:
            v = stack.pop()
            for w in pred[v]:
                if w not in comp:
                    comp[w] = root
                    stack.append(w)
    return comp


def _dominates(a: Summary | None, b: Summary | None) -> bool:
    """``a <= b`` between path summaries of one antichain, where ``None`` is a path of no operator
    (the empty path, or edges alone): the identity. Invariant relied on: the summaries of one
    antichain are paths between the same two locations, so all produce times of the same depth,
    the identity's where it is there. So the identity is below ``b`` exactly when ``b`` keeps every
    coordinate (pushes none), and ``a`` is below the identity exactly when it adds nothing and
    pushes only zeros."""
    if a is None:
        return b is None or not b.push
    if b is None:
        return a.add == 0 and not any(a.push)
    return a.less_equal(b)


def _insert(antichain: list, s: Summary | None) -> bool:
    """Add ``s`` to ``antichain`` (in place) unless an element is ``<=`` it; drop the elements it is
    ``<=``. True if added."""
    if any(_dominates(x, s) for x in antichain):
        return False
    antichain[:] = [x for x in antichain if not _dominates(s, x)]
    antichain.append(s)
    return True


class Tracker:
    """Maintains each operator input's implied frontier from pointstamp updates, as timely's
    ``reachability::Tracker`` does.

    Built once, the tracker knows for every location the minimal path summaries to every operator
    input (Target) it can reach (:meth:`paths`; the empty path included for a Target itself). A
    Target's *implications* are then the multiset of ``s(t)`` over every location ``L`` that reaches
    it, every minimal summary ``s`` from ``L`` to it and every time ``t`` of ``L``'s pointstamp
    frontier, each counted once; the implied frontier is its minimal elements. A change of a
    pointstamp frontier goes straight to the Targets it reaches: no walk along the paths, no
    work at locations in between, and nothing at all where a pointstamp's frontier does not move
    (such as all but the last worker's advance of an input).

    Usage: :meth:`update` any number of ``(location, time, diff)``; then :meth:`propagate_all`,
    which returns the implied frontier changes of Targets (operator inputs).
    """

    def __init__(self, nodes: Sequence[tuple[int, int, Connectivity]],
                 edges: Mapping[tuple[int, int], Sequence[tuple[int, int]]]) -> None:
        self.nodes = nodes
        self.edges = edges
        # summaries[node][input] -> list of (output, summary): one entry per antichain element.
        self.summaries = [
            [[(o, s) for o in range(outs) for s in summ[i][o]] for i in range(ins)] for ins, outs, summ in nodes
        ]
        self.pointstamps: dict[Location, MutableAntichain] = {}
        #: The implications of every Target (operator inputs read these antichains directly).
        self.implications: dict[Location, MutableAntichain] = {}
        for n, (ins, outs, _) in enumerate(nodes):
            for i in range(ins):
                self.pointstamps[Target(n, i)] = MutableAntichain()
                self.implications[Target(n, i)] = MutableAntichain()
            for o in range(outs):
                self.pointstamps[Source(n, o)] = MutableAntichain()
        # location -> [(target, [summary, or None for the empty path], integer adds or None)]: the
        # adds are the summaries as plain offsets of integer times where every one is (keep=1,
        # push=()), the whole of a dataflow without nested scopes (the hot path).
        self._reach: dict[Location, list[tuple[Location, list, list[int] | None]]] = {}
        for loc in self.pointstamps:
            reach = []
            for target, summaries in self.paths(loc).items():
                if target.source:
                    continue
                adds = None
                if all(s is None or (s.keep == 1 and not s.push) for s in summaries):
                    adds = [0 if s is None else s.add for s in summaries]
                reach.append((target, summaries, adds))
            self._reach[loc] = reach
        self._changes = ChangeBatch()
        self.total_counts = 0  # number of (location, time) frontier elements over all pointstamps

    def paths(self, location: Location) -> dict[Location, list]:
        """The minimal summaries of the paths from ``location`` to every location it reaches (an
        antichain each; ``None`` is a path of no operator: from ``location`` to itself, or along
        edges alone from a Source to the inputs it feeds). Terminates: every
        cycle advances time (``Builder.check_acyclic``), so a path around one more time is dominated."""
        found: dict[Location, list] = {location: [None]}
        stack: list[tuple[Location, Summary | None]] = [(location, None)]
        while stack:
            loc, s = stack.pop()
            if not any(x is s for x in found[loc]):
                continue  # superseded since it was queued
            if loc.source:
                nexts = [(Target(m, i), s) for m, i in self.edges.get((loc.node, loc.port), ())]
            else:
                nexts = [(Source(loc.node, o), step if s is None else s.followed_by(step))
                         for o, step in self.summaries[loc.node][loc.port]]
            for nxt, s2 in nexts:
                if _insert(found.setdefault(nxt, []), s2):
                    stack.append((nxt, s2))
        return found

    def update(self, location: Location, time: Any, diff: int) -> None:
        """Buffer a change of ``diff`` to the count of pointstamp ``(location, time)``."""
        if location not in self.pointstamps:
            raise KeyError(f"unknown location {location}")
        self._changes.update((location, time), diff)

    def update_batch(self, updates: Iterable[tuple[tuple[Location, Any], int]]) -> None:
        """Buffer many ``((location, time), diff)`` updates."""
        self._changes.extend(updates)

    def propagate_all(self) -> list[tuple[Location, Any, int]]:
        """Apply buffered updates; return every change of a Target's implied frontier as
        ``(target, time, diff)`` (per Target, its retractions before its additions)."""
        changes = self._changes.take()
        if not changes:
            return []
        by_loc: dict[Location, list] = defaultdict(list)
        for (loc, t), d in changes.items():
            by_loc[loc].append((t, d))
        pending: dict[Location, dict] = {}  # target -> {implied time: diff}
        pointstamps, reach = self.pointstamps, self._reach
        for loc, group in by_loc.items():
            moved = pointstamps[loc].update_iter(group)
            if not moved:
                continue
            for _, d in moved:
                self.total_counts += d
            for target, summaries, adds in reach[loc]:
                acc = pending.get(target)
                if acc is None:
                    acc = pending[target] = {}
                get = acc.get
                for t, d in moved:
                    if adds is not None and type(t) is int:
                        for a in adds:
                            t2 = t + a
                            acc[t2] = get(t2, 0) + d
                    else:
                        for s in summaries:
                            t2 = t if s is None else s.results_in(t)
                            acc[t2] = get(t2, 0) + d
        pushed: list[tuple[Location, Any, int]] = []
        implications = self.implications
        for target, acc in pending.items():
            for t2, d2 in implications[target].update_iter(acc.items()):
                pushed.append((target, t2, d2))
        return pushed

    def frontier(self, location: Location) -> list:
        """The implied frontier at ``location`` (as of the last :meth:`propagate_all`): the times
        that may still arrive there. Read from the implications for a Target; computed on demand
        from the pointstamps for a Source (nothing in the runtime asks for one)."""
        if not location.source:
            return self.implications[location].elements
        times: list = []
        for loc, ps in self.pointstamps.items():
            if ps.elements:
                for s in self.paths(loc).get(location, ()):
                    times.extend(t if s is None else s.results_in(t) for t in ps.elements)
        return minimal(times)

    def tracking_anything(self) -> bool:
        """True while any pointstamp has a positive frontier count or updates are buffered."""
        return self.total_counts > 0 or not self._changes.is_empty()
