"""Antichains: frontiers of partially ordered times, fixed (:class:`Antichain`) or counted
(:class:`MutableAntichain`, native: ``native/progress.pyx``). The empty antichain means
"complete": no further time is possible."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .._native.progress import MutableAntichain
from .timestamp import less_equal, less_than, minimal

__all__ = ["Antichain", "Frontier", "MutableAntichain"]


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
