"""Timestamps, their partial order, and path summaries.

A timestamp is an ``int`` in a top-level scope, and a tuple of ints ``(outer, ..., inner)`` inside
nested iterative scopes (one coordinate per level). Tuples are ordered as *products*: ``a <= b`` iff
every coordinate is ``<=``. Python's own ``<`` on tuples (lexicographic) is a linear extension of the
product order, so it is used for sorting and consolidation, never for frontier logic.

A :class:`Summary` describes how a path through the dataflow changes a time. The dataflow is one flat
graph (as in Naiad): entering a nested scope appends a coordinate, leaving it drops one, and a feedback
edge adds to the last coordinate. Every such path composes into the closed form

    ``s(t) = t[:keep-1] + (t[keep-1] + add,) + push``

(the first ``keep`` coordinates are kept, the last kept one is advanced by ``add``, then the constant
coordinates ``push`` are appended). A time with a single coordinate is an ``int``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, overload

Time = int | tuple


def depth(t: Time) -> int:
    """Number of coordinates of ``t`` (1 for an int)."""
    return len(t) if isinstance(t, tuple) else 1


#: The largest value of a time's coordinate: times travel between workers as msgpack uint64, so a
#: larger one could not be sent (checked where capabilities are made, on one worker as on many).
MAX_COORDINATE = 2**64 - 1


def beyond_end(t: Time) -> bool:
    """True if a coordinate of ``t`` exceeds :data:`MAX_COORDINATE`."""
    if type(t) is int:
        return t > MAX_COORDINATE
    return type(t) is tuple and any(type(x) is int and x > MAX_COORDINATE for x in t)


@overload
def less_equal(a: Time, b: Time) -> bool: ...
@overload
def less_equal(a: Summary, b: Summary) -> bool: ...
def less_equal(a: Any, b: Any) -> bool:
    """The partial order: ints by value, tuples coordinate-wise (product order), summaries by ``<=``."""
    if type(a) is int:
        if type(b) is tuple:
            raise TypeError(f"cannot compare timestamps of different depths: {a!r} and {b!r}")
        return a <= b
    if type(a) is tuple:
        if type(b) is not tuple or len(a) != len(b):
            raise TypeError(f"cannot compare timestamps of different depths: {a!r} and {b!r}")
        for x, y in zip(a, b):
            if x > y:
                return False
        return True
    return a.less_equal(b)


@overload
def less_than(a: Time, b: Time) -> bool: ...
@overload
def less_than(a: Summary, b: Summary) -> bool: ...
def less_than(a: Any, b: Any) -> bool:
    """``a <= b`` and ``a != b`` in the partial order."""
    return a != b and less_equal(a, b)


def minimum(levels: int = 1) -> Time:
    """The least timestamp with ``levels`` coordinates: ``0`` or ``(0, ..., 0)``."""
    return 0 if levels == 1 else (0,) * levels


def to_inner(t: Time) -> tuple:
    """Enter a nested scope: append an inner coordinate 0."""
    return t + (0,) if isinstance(t, tuple) else (t, 0)


def to_outer(t: tuple) -> Time:
    """Leave a nested scope: drop the inner coordinate."""
    return t[0] if len(t) == 2 else t[:-1]


def _coords(t: Time) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _time(coords: tuple) -> Time:
    return coords[0] if len(coords) == 1 else coords


class Summary:
    """A path summary ``t -> t[:keep-1] + (t[keep-1] + add,) + push`` (see the module docstring).

    Summaries are immutable and hashable. ``Summary.identity(d)`` maps times of depth ``d`` to
    themselves; :meth:`results_in` applies a summary, :meth:`followed_by` composes two.
    """

    __slots__ = ("keep", "add", "push", "_key")

    def __init__(self, keep: int = 1, add: int = 0, push: tuple = ()) -> None:
        if keep < 1:
            raise ValueError(f"a summary keeps at least one coordinate, not {keep}")
        if add < 0 or any(p < 0 for p in push):
            raise ValueError("a summary may not move time backwards (negative add or push)")
        self.keep = keep
        self.add = add
        self.push = tuple(push)
        self._key = (keep, add, self.push)

    @classmethod
    def identity(cls, levels: int = 1) -> Summary:
        """The summary that leaves times of ``levels`` coordinates unchanged."""
        return cls(levels, 0, ())

    @classmethod
    def feedback(cls, levels: int, step: int) -> Summary:
        """Advance the last of ``levels`` coordinates by ``step`` (a loop's feedback edge)."""
        return cls(levels, step, ())

    @classmethod
    def enter(cls, levels: int) -> Summary:
        """Enter a nested scope from a scope whose times have ``levels`` coordinates."""
        return cls(levels, 0, (0,))

    @classmethod
    def leave(cls, levels: int) -> Summary:
        """Leave a nested scope whose times have ``levels`` coordinates."""
        return cls(levels - 1, 0, ())

    def results_in(self, t: Time) -> Time:
        """The time a record at ``t`` has after following this path."""
        if type(t) is int and self.keep == 1 and not self.push:
            return t + self.add
        c = _coords(t)
        k = self.keep
        if k > len(c):
            raise TypeError(f"summary {self!r} needs times of at least {k} coordinates, got {t!r}")
        return _time(c[: k - 1] + (c[k - 1] + self.add,) + self.push)

    def followed_by(self, other: Summary) -> Summary:
        """The summary of this path followed by ``other``: ``other(self(t))`` for every ``t``."""
        k1, k2 = self.keep, other.keep
        if k2 < k1:
            return other
        if k2 == k1:
            return Summary(k1, self.add + other.add, other.push)
        j = k2 - k1 - 1  # index in self.push of the coordinate ``other`` advances
        if j >= len(self.push):
            raise TypeError(f"cannot compose {self!r} with {other!r}: depths do not match")
        return Summary(k1, self.add, self.push[:j] + (self.push[j] + other.add,) + other.push)

    def less_equal(self, other: Summary) -> bool:
        """``self(t) <= other(t)`` for every ``t``; summaries of different shapes are incomparable."""
        if self.keep != other.keep or len(self.push) != len(other.push):
            return False
        return self.add <= other.add and all(a <= b for a, b in zip(self.push, other.push))

    def advances(self) -> bool:
        """True when the summary strictly advances some coordinate (a cycle needs one such step)."""
        return self.add > 0 or any(self.push)

    def output_levels(self, input_levels: int) -> int:
        """Depth of the times this summary produces from times of ``input_levels`` coordinates."""
        return self.keep + len(self.push)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Summary) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __lt__(self, other: Summary) -> bool:  # a total order, for sorting only
        return self._key < other._key

    def __repr__(self) -> str:
        return f"Summary(keep={self.keep}, add={self.add}, push={self.push})"


def minimal(elements: Iterable) -> list:
    """The minimal elements of ``elements`` under :func:`less_equal`, without duplicates."""
    out: list = []
    for e in elements:
        if any(less_equal(x, e) for x in out):
            continue
        out = [x for x in out if not less_equal(e, x)]
        out.append(e)
    return out
