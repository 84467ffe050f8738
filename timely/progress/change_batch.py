"""``ChangeBatch``: a consolidating multiset of ``(key, diff)`` updates, the unit of progress messages."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class ChangeBatch:
    """Accumulates integer diffs per key; zero totals vanish.

    Keys are timestamps or ``(location, timestamp)`` pairs. ``drain`` and ``items`` return the
    non-zero totals sorted by key (Python order, a linear extension of the partial order), so two
    batches with the same totals drain identically, whatever the order of their updates.
    """

    __slots__ = ("_counts",)

    def __init__(self, updates: Iterable[tuple[Any, int]] = ()) -> None:
        self._counts: dict[Any, int] = {}
        self.extend(updates)

    def update(self, key: Any, diff: int) -> None:
        """Add ``diff`` to the count of ``key``."""
        if diff:
            c = self._counts.get(key, 0) + diff
            if c:
                self._counts[key] = c
            else:
                del self._counts[key]

    def extend(self, updates: Iterable[tuple[Any, int]]) -> None:
        """Apply every ``(key, diff)`` of ``updates``."""
        counts = self._counts
        for key, diff in updates:
            if diff:
                c = counts.get(key, 0) + diff
                if c:
                    counts[key] = c
                else:
                    del counts[key]

    def drain_into(self, other: ChangeBatch) -> None:
        """Move every update into ``other`` and leave this batch empty."""
        if not other._counts:
            other._counts, self._counts = self._counts, other._counts
        else:
            other.extend(self._counts.items())
            self._counts = {}

    def items(self) -> list[tuple[Any, int]]:
        """The non-zero ``(key, total)`` pairs, sorted by key."""
        return sorted(self._counts.items())

    def drain(self) -> list[tuple[Any, int]]:
        """Return :meth:`items` and clear the batch."""
        out = sorted(self._counts.items())
        self._counts = {}
        return out

    def take(self) -> dict[Any, int]:
        """The non-zero totals as a dict, in no particular order, leaving the batch empty."""
        out = self._counts
        self._counts = {}
        return out

    def get(self, key: Any) -> int:
        """The total of ``key`` (0 when absent)."""
        return self._counts.get(key, 0)

    def is_empty(self) -> bool:
        """True when every total is zero."""
        return not self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChangeBatch) and self._counts == other._counts

    def __repr__(self) -> str:
        return f"ChangeBatch({self.items()!r})"
