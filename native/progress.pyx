# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False
"""Progress tracking's hot paths (built as ``timely._native.progress``).

Every step that receives progress applies it here: the pointstamp counts move, the frontiers that
move reach the operator inputs they imply, and those inputs' frontiers move. In pure Python this
cost 50-80 µs per step of a NEXMark dataflow, paid once per progress message received, so once per
peer and epoch (``bench/RESULTS.md``). The definitions are the same as the pure-Python ones they
replaced (``timely.progress.frontier``, ``timely.progress.reachability``), and the tests check them
against the same brute-force oracles.
"""
import heapq


cdef inline bint _le(object a, object b) except -1:
    """The partial order on times, as ``timely.progress.timestamp.less_equal``."""
    if type(a) is int:
        return a <= b
    if type(a) is tuple:
        if len(<tuple>a) != len(b):
            raise TypeError(f"cannot compare timestamps of different depths: {a!r} and {b!r}")
        for x, y in zip(<tuple>a, b):
            if x > y:
                return False
        return True
    return a.less_equal(b)


cdef class MutableAntichain:
    """A multiset of times with integer counts and the frontier of those with positive count.

    Counts may be transiently negative (a worker may see a decrement before the increment it
    cancels); only strictly positive counts contribute to the frontier. ``elements`` is the
    frontier (a list replaced, never changed in place, when it moves); ``counts`` the non-zero
    counts.
    """

    cdef public dict counts
    cdef public list elements
    # Integer times are totally ordered: the frontier is the least positive time, found in a
    # min-heap of the times that entered the positive set (entries whose count has since dropped
    # to zero are discarded lazily). A rebuild then costs O(log n), not a sort of every time held:
    # an operator may hold thousands of capabilities (a timer per pending time). Tuple times
    # (nested scopes) take the general path.
    cdef list _heap

    def __init__(self):
        self.counts = {}
        self.elements = []
        self._heap = []

    def update_iter(self, updates):
        """Apply ``(time, diff)`` updates; return the frontier's changes as ``(time, +1|-1)`` pairs."""
        return self.apply(updates)

    cdef list apply(self, object updates):
        cdef dict counts = self.counts
        cdef list frontier = self.elements
        cdef list heap = self._heap
        cdef bint rebuild = False
        cdef long long c0, c1, d
        cdef object t
        cdef list new
        for t, dd in updates:
            d = dd
            if d == 0:
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
                rebuild = True
                for f in frontier:
                    if _le(f, t):
                        rebuild = False
                        break
            else:
                # t left: the frontier changes only if t was one of its elements.
                rebuild = t in frontier
        if not rebuild:
            return []
        if heap or not counts:
            new = self._least_int()
        else:
            new = []
            for t in sorted([t for t, c in counts.items() if c > 0]):
                for x in new:
                    if _le(x, t):
                        break
                else:
                    new.append(t)
        if new == frontier:
            return []
        self.elements = new
        if len(frontier) == 1 and len(new) == 1:  # the integer case: one time replaces another
            return [(frontier[0], -1), (new[0], 1)]
        old = set(frontier)
        nset = set(new)
        return [(t, -1) for t in frontier if t not in nset] + [(t, 1) for t in new if t not in old]

    cdef list _least_int(self):
        """The frontier of integer times: ``[least positive time]`` or ``[]``."""
        cdef list heap = self._heap
        cdef dict counts = self.counts
        if len(heap) > 2 * len(counts) + 64:
            # Mostly stale entries (times that came and went above the least one): start afresh.
            heap[:] = [t for t, c in counts.items() if c > 0]
            heapq.heapify(heap)
        while heap and counts.get(heap[0], 0) <= 0:
            heapq.heappop(heap)
        return [heap[0]] if heap else []

    def less_equal(self, t):
        """True if some frontier element is ``<= t``."""
        for x in self.elements:
            if _le(x, t):
                return True
        return False

    def less_than(self, t):
        """True if some frontier element is ``< t``."""
        for x in self.elements:
            if x != t and _le(x, t):
                return True
        return False

    def count_for(self, t):
        """The count of exactly ``t``."""
        return self.counts.get(t, 0)

    def is_empty(self):
        """True when the frontier is empty."""
        return not self.elements

    def __repr__(self):
        return f"MutableAntichain(frontier={self.elements!r})"


def propagate(dict changes, dict pointstamps, dict reach):
    """Apply ``changes`` (``{(location, time): diff}``) to the ``pointstamps`` antichains and carry
    every move of a pointstamp frontier to the Targets it reaches (``reach``: location -> list of
    ``(target, its implications antichain, summaries, integer adds or None)``, ``Tracker._reach``),
    then apply those to the Targets' implications. Return ``(pushed, moved)``: every change of a
    Target's implied frontier as ``(target, time, diff)`` (per Target, its retractions before its
    additions), and the net change in the number of pointstamp frontier elements."""
    cdef dict by_loc = {}
    cdef dict pending = {}  # implications antichain -> {implied time: diff} (identity hashing)
    cdef dict acc
    cdef list group, moved, pushed = []
    cdef long long total = 0
    cdef long long d, da
    cdef object loc, t, t2, target, implied, summaries, adds, key
    cdef MutableAntichain antichain
    for key, d in changes.items():
        loc = (<tuple>key)[0]
        t = (<tuple>key)[1]
        group = by_loc.get(loc)
        if group is None:
            by_loc[loc] = [(t, d)]
        else:
            group.append((t, d))
    targets = {}
    for loc, group in by_loc.items():
        moved = (<MutableAntichain>pointstamps[loc]).apply(group)
        if not moved:
            continue
        for t, d in moved:
            total += d
        for target, implied, summaries, adds in reach[loc]:
            acc = pending.get(implied)
            if acc is None:
                acc = pending[implied] = {}
                targets[implied] = target
            for t, d in moved:
                if adds is not None and type(t) is int:
                    for a in adds:
                        t2 = t + a
                        da = acc.get(t2, 0)
                        acc[t2] = da + d
                else:
                    for s in summaries:
                        t2 = t if s is None else s.results_in(t)
                        da = acc.get(t2, 0)
                        acc[t2] = da + d
    for implied, acc in pending.items():
        antichain = <MutableAntichain>implied
        moved = antichain.apply(acc.items())
        if moved:
            target = targets[implied]
            for t2, d in moved:
                pushed.append((target, t2, d))
    return pushed, total
