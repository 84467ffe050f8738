"""Reachability: from pointstamp counts to the frontier each operator input may still see.

The dataflow graph is built once (:class:`Builder`) and then frozen into a :class:`Tracker`.
Locations are operator ports: a :func:`Target` is an operator input, a :func:`Source` an operator
output. A count at a Source is capabilities held there; a count at a Target is messages in flight
to it. The tracker keeps, for every location, the *implications*: the multiset of times that could
still arrive there, each contributed by one upstream pointstamp through one path. Its frontier is
the location's implied frontier.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ..errors import CycleError
from .change_batch import ChangeBatch
from .frontier import Antichain, MutableAntichain
from .timestamp import Summary, _coords


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


def _heap_key(t: Any) -> tuple:
    # Times of different depths share the worklist; compare them by their coordinates.
    return _coords(t)


class Tracker:
    """Incrementally maintains each location's implied frontier from pointstamp updates.

    Usage: :meth:`update` any number of ``(location, time, diff)``; then :meth:`propagate_all`,
    which returns the implication changes at Targets (operator input frontier changes).
    """

    def __init__(self, nodes, edges) -> None:
        self.nodes = nodes
        self.edges = edges
        # summaries[node][input] -> list of (output, summary): one entry per antichain element.
        self.summaries = [
            [[(o, s) for o in range(outs) for s in summ[i][o]] for i in range(ins)] for ins, outs, summ in nodes
        ]
        self.pointstamps: dict[Location, MutableAntichain] = {}
        self.implications: dict[Location, MutableAntichain] = {}
        for n, (ins, outs, _) in enumerate(nodes):
            for i in range(ins):
                self.pointstamps[Target(n, i)] = MutableAntichain()
                self.implications[Target(n, i)] = MutableAntichain()
            for o in range(outs):
                self.pointstamps[Source(n, o)] = MutableAntichain()
                self.implications[Source(n, o)] = MutableAntichain()
        self._changes = ChangeBatch()
        self.total_counts = 0  # number of (location, time) frontier elements over all pointstamps

    def update(self, location: Location, time: Any, diff: int) -> None:
        """Buffer a change of ``diff`` to the count of pointstamp ``(location, time)``."""
        if location not in self.pointstamps:
            raise KeyError(f"unknown location {location}")
        self._changes.update((location, time), diff)

    def update_batch(self, updates: Iterable[tuple[tuple[Location, Any], int]]) -> None:
        """Buffer many ``((location, time), diff)`` updates."""
        self._changes.extend(updates)

    def propagate_all(self) -> list[tuple[Location, Any, int]]:
        """Apply buffered updates; return every implication frontier change as ``(location, time, diff)``."""
        worklist: list = []
        by_loc: dict[Location, list] = defaultdict(list)
        for (loc, t), d in self._changes.drain():
            by_loc[loc].append((t, d))
        for loc, group in by_loc.items():
            for t, d in self.pointstamps[loc].update_iter(group):
                self.total_counts += d
                heapq.heappush(worklist, (_heap_key(t), loc, t, d))
        pushed: list[tuple[Location, Any, int]] = []
        while worklist:
            key, loc, t, d = heapq.heappop(worklist)
            # Merge every further entry for the same (time, location).
            while worklist and worklist[0][0] == key and worklist[0][1] == loc:
                d += heapq.heappop(worklist)[3]
            if not d:
                continue
            for t2, d2 in self.implications[loc].update_iter(((t, d),)):
                pushed.append((loc, t2, d2))
                if loc.source:
                    for m, i in self.edges.get((loc.node, loc.port), ()):
                        heapq.heappush(worklist, (_heap_key(t2), Target(m, i), t2, d2))
                else:
                    for o, s in self.summaries[loc.node][loc.port]:
                        t3 = s.results_in(t2)
                        heapq.heappush(worklist, (_heap_key(t3), Source(loc.node, o), t3, d2))
        return pushed

    def frontier(self, location: Location) -> list:
        """The implied frontier at ``location`` (as of the last :meth:`propagate_all`)."""
        return self.implications[location].elements

    def tracking_anything(self) -> bool:
        """True while any pointstamp has a positive frontier count or updates are buffered."""
        return self.total_counts > 0 or not self._changes.is_empty()
