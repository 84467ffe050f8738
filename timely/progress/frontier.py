"""Antichains: frontiers of partially ordered times, fixed (:class:`Antichain`) or counted
(:class:`MutableAntichain`). The empty antichain means "complete": no further time is possible."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

from .timestamp import less_equal, less_than, minimal


class Antichain:
    """A set of mutually incomparable elements (times or summaries)."""

    __slots__ = ("elements",)

    def __init__(self, elements: Iterable[Any] = ()) -> None:
        self.elements: list[Any] = []
        for e in elements:
            self.insert(e)

    def insert(self, e: Any) -> bool:
        """Add ``e`` unless some element is ``<= e``; drop the elements ``e`` is ``<=``. True if added."""
        for x in self.elements:
            if less_equal(x, e):
                return False
        self.elements = [x for x in self.elements if not less_equal(e, x)]
        self.elements.append(e)
        return True

    def less_equal(self, t: Any) -> bool:
        """True if some element is ``<= t``."""
        return any(less_equal(x, t) for x in self.elements)

    def less_than(self, t: Any) -> bool:
        """True if some element is ``< t``."""
        return any(less_than(x, t) for x in self.elements)

    def dominates(self, other: Antichain) -> bool:
        """``self <= other``: every element of ``other`` has an element of ``self`` ``<=`` it."""
        return all(self.less_equal(b) for b in other.elements)

    def is_empty(self) -> bool:
        """True for the empty antichain (no further time possible)."""
        return not self.elements

    def __iter__(self):
        return iter(self.elements)

    def __len__(self) -> int:
        return len(self.elements)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Antichain):
            other = other.elements
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return sorted(self.elements) == sorted(other)

    def __repr__(self) -> str:
        return f"Antichain({sorted(self.elements)!r})"


class MutableAntichain:
    """A multiset of times with integer counts and the frontier of those with positive count.

    Counts may be transiently negative (a worker may see a decrement before the increment it
    cancels); only strictly positive counts contribute to the frontier.
    """

    __slots__ = ("counts", "elements", "_heap")

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}
        self.elements: list[Any] = []  # the frontier: minimal times of positive count
        # Integer times are totally ordered: the frontier is the least positive time, found in a
        # min-heap of the times that entered the positive set (entries whose count has since
        # dropped to zero are discarded lazily). A rebuild then costs O(log n), not a sort of every
        # time held: an operator may hold thousands of capabilities (a timer per pending time).
        # Tuple times (nested scopes) take the general path.
        self._heap: list[int] = []

    def update_iter(self, updates: Iterable[tuple[Any, int]]) -> list[tuple[Any, int]]:
        """Apply ``(time, diff)`` updates; return the frontier's changes as ``(time, +1|-1)`` pairs."""
        counts = self.counts
        frontier = self.elements
        heap = self._heap
        rebuild = False
        for t, d in updates:
            if not d:
                continue
            c0 = counts.get(t, 0)
            c1 = c0 + d
            if c1:
                counts[t] = c1
            else:
                del counts[t]
            if (c0 > 0) == (c1 > 0):
                continue  # t neither entered nor left the set of positive times
            if type(t) is int:  # the frontier of integer times is [least positive time] or []
                if c1 > 0:
                    heapq.heappush(heap, t)
                    rebuild = rebuild or not frontier or t < frontier[0]
                else:
                    rebuild = rebuild or t == frontier[0]
                continue
            if rebuild:
                continue
            if c1 > 0:
                # t entered: the frontier changes unless an element already is <= t.
                rebuild = not any(less_equal(f, t) for f in frontier)
            else:
                # t left: the frontier changes only if t was one of its elements.
                rebuild = t in frontier
        if not rebuild:
            return []
        if heap or not counts:
            new = self._least_int()
        else:
            new = []
            for t in sorted(t for t, c in counts.items() if c > 0):
                if not any(less_equal(x, t) for x in new):
                    new.append(t)
        if new == frontier:
            return []
        old = set(frontier)
        nset = set(new)
        self.elements = new
        return [(t, -1) for t in frontier if t not in nset] + [(t, 1) for t in new if t not in old]

    def _least_int(self) -> list[int]:
        """The frontier of integer times: ``[least positive time]`` or ``[]``."""
        heap, counts = self._heap, self.counts
        if len(heap) > 2 * len(counts) + 64:
            # Mostly stale entries (times that came and went above the least one): start afresh.
            heap[:] = [t for t, c in counts.items() if c > 0]
            heapq.heapify(heap)
        while heap and counts.get(heap[0], 0) <= 0:
            heapq.heappop(heap)
        return [heap[0]] if heap else []

    def less_equal(self, t: Any) -> bool:
        """True if some frontier element is ``<= t``."""
        return any(less_equal(x, t) for x in self.elements)

    def less_than(self, t: Any) -> bool:
        """True if some frontier element is ``< t``."""
        return any(less_than(x, t) for x in self.elements)

    def count_for(self, t: Any) -> int:
        """The count of exactly ``t``."""
        return self.counts.get(t, 0)

    def is_empty(self) -> bool:
        """True when the frontier is empty."""
        return not self.elements

    def __repr__(self) -> str:
        return f"MutableAntichain(frontier={self.elements!r})"


class Frontier:
    """A read-only view of the times that may still appear somewhere: an input, a probed stream.

    The view is live: it follows the tracker as the dataflow runs (read it between or during steps;
    copy ``list(frontier)`` to keep a snapshot). Iterating yields its minimal times in ascending
    order; an empty frontier (``frontier.is_empty()``, ``not frontier``) means no further time can
    appear. One view may cover several antichains (a probe on several streams): it is then their
    union's minimal elements.
    """

    __slots__ = ("_antichains",)

    def __init__(self, antichains: list[MutableAntichain]) -> None:
        self._antichains = antichains  # shared, not copied: the view follows them

    @staticmethod
    def union(frontiers: Iterable[Frontier]) -> Frontier:
        """One view over the times of several frontiers (taken once they are installed)."""
        return Frontier([a for f in frontiers for a in f._antichains])

    def less_than(self, t: Any) -> bool:
        """True while some time strictly before ``t`` may still appear."""
        return any(less_than(x, t) for a in self._antichains for x in a.elements)

    def less_equal(self, t: Any) -> bool:
        """True while some time at or before ``t`` may still appear."""
        return any(less_equal(x, t) for a in self._antichains for x in a.elements)

    def is_empty(self) -> bool:
        """True once no further time may appear."""
        return all(not a.elements for a in self._antichains)

    def elements(self) -> list[Any]:
        """The minimal times that may still appear, ascending (a new list)."""
        if len(self._antichains) == 1:
            return sorted(self._antichains[0].elements)
        return sorted(minimal(x for a in self._antichains for x in a.elements))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements())

    def __len__(self) -> int:
        return len(self.elements())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Frontier):
            return self.elements() == other.elements()
        if isinstance(other, (list, tuple)):
            return self.elements() == sorted(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # live and mutable: not hashable

    def __repr__(self) -> str:
        return f"Frontier({self.elements()!r})"
