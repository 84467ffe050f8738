"""Property tests for ``Antichain`` (vs the minimal elements of everything inserted, for several
partial orders) and ``MutableAntichain`` (vs the minimal elements of the positively counted times,
with exact frontier diffs), against the reference order of ``progress_reference``."""
from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from progress_reference import ref_le, ref_minimal, summary_le

from timely.progress import Antichain, MutableAntichain, Summary, minimal

FAST = settings(max_examples=150, deadline=None)
MEDIUM = settings(max_examples=300, deadline=None)
small = st.integers(0, 6)


@functools.total_ordering
class LexPair:
    """A lexicographically (totally) ordered pair: exercises the ``a.less_equal(b)`` dispatch."""

    __slots__ = ("v",)

    def __init__(self, a: int, b: int) -> None:
        self.v = (a, b)

    def less_equal(self, other: LexPair) -> bool:
        return self.v <= other.v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LexPair) and self.v == other.v

    def __hash__(self) -> int:
        return hash(self.v)

    def __lt__(self, other: LexPair) -> bool:
        return self.v < other.v

    def __repr__(self) -> str:
        return f"Lex{self.v}"


ELEMENT_KINDS = {
    "int": (st.integers(-2, 8), ref_le),
    "pair": (st.tuples(small, small), ref_le),
    "triple": (st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), ref_le),
    "lex": (st.builds(LexPair, st.integers(0, 3), st.integers(0, 3)), lambda a, b: a.v <= b.v),
    "summary": (
        st.builds(
            Summary,
            st.integers(1, 2),
            st.integers(0, 3),
            st.lists(st.integers(0, 3), max_size=1).map(tuple),
        ),
        summary_le,
    ),
}


@MEDIUM
@given(st.data())
def test_antichain_insert_is_minimal_elements(data):
    kind = data.draw(st.sampled_from(sorted(ELEMENT_KINDS)), label="kind")
    elems, le = ELEMENT_KINDS[kind]
    inserted = data.draw(st.lists(elems, max_size=20), label="inserted")
    probes = data.draw(st.lists(elems, min_size=1, max_size=10), label="probes")
    a = Antichain()
    so_far: list = []
    for e in inserted:
        expect_added = not any(le(x, e) for x in so_far)
        assert a.insert(e) == expect_added
        so_far.append(e)
        # always an antichain, no duplicates, == minimal elements of everything inserted so far
        assert len(a.elements) == len(set(a.elements))
        assert set(a.elements) == ref_minimal(so_far, le)
        for x in a.elements:
            for y in a.elements:
                assert x == y or not le(x, y)
    assert Antichain(inserted) == a
    assert set(minimal(inserted)) == ref_minimal(inserted, le)
    for t in probes:
        assert a.less_equal(t) == any(le(x, t) for x in inserted)
        assert a.less_than(t) == any(le(x, t) and x != t for x in inserted)
    assert a.is_empty() == (not inserted)
    assert len(a) == len(ref_minimal(inserted, le))
    # dominates: every element of the other antichain has an element of this one <= it
    b = Antichain(probes)
    assert a.dominates(b) == all(any(le(x, p) for x in inserted) for p in probes)
    # the empty antichain dominates nothing but the empty antichain, which everything dominates
    assert a.dominates(Antichain())
    assert Antichain().dominates(b) == (len(b) == 0)


@FAST
@given(st.lists(st.tuples(small, small), max_size=15), st.randoms(use_true_random=False))
def test_antichain_equality_ignores_order(elems, rnd):
    shuffled = list(elems)
    rnd.shuffle(shuffled)
    a, b = Antichain(elems), Antichain(shuffled)
    assert a == b
    assert a == sorted(ref_minimal(elems, ref_le))


def test_antichain_examples():
    a = Antichain()
    assert a.insert((1, 2)) and a.insert((2, 1))
    assert not a.insert((2, 2))
    assert a.insert((0, 5))
    assert sorted(a) == [(0, 5), (1, 2), (2, 1)]
    assert a.insert((0, 0))
    assert list(a) == [(0, 0)]
    assert a.less_equal((3, 3)) and not a.less_than((0, 0))
    assert Antichain([3, 1, 2]).elements == [1]


# ---------------------------------------------------------------------------------------------
# MutableAntichain
# ---------------------------------------------------------------------------------------------

MA_KINDS = {
    "int": st.integers(0, 6),
    "pair": st.tuples(st.integers(0, 3), st.integers(0, 3)),
    "triple": st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
}


@MEDIUM
@given(st.data())
def test_mutable_antichain_matches_oracle(data):
    kind = data.draw(st.sampled_from(sorted(MA_KINDS)), label="kind")
    times = MA_KINDS[kind]
    batches = data.draw(
        st.lists(st.lists(st.tuples(times, st.integers(-2, 2)), max_size=6), max_size=25), label="batches"
    )
    probes = data.draw(st.lists(times, min_size=1, max_size=5), label="probes")
    ma = MutableAntichain()
    counts: dict = {}
    for batch in batches:
        old = list(ma.elements)
        diff = ma.update_iter(batch)
        for t, d in batch:
            counts[t] = counts.get(t, 0) + d
        positive = [t for t, c in counts.items() if c > 0]
        expect = ref_minimal(positive, ref_le)
        new = ma.elements
        assert len(new) == len(set(new))
        assert set(new) == expect
        # counts are exact, including transiently negative ones; zeros are dropped
        assert ma.counts == {t: c for t, c in counts.items() if c != 0}
        for t in counts:
            assert ma.count_for(t) == counts[t]
        # the diff turns the old frontier into the new one exactly, and is empty when nothing changed
        assert all(d in (1, -1) for _, d in diff)
        assert len(diff) == len({t for t, _ in diff})
        cur = set(old)
        for t, d in diff:
            if d == 1:
                assert t not in cur
                cur.add(t)
            else:
                assert t in cur
                cur.remove(t)
        assert cur == set(new)
        if set(old) == set(new):
            assert diff == []
        for p in probes:
            assert ma.less_equal(p) == any(ref_le(x, p) for x in positive)
            assert ma.less_than(p) == any(ref_le(x, p) and x != p for x in positive)
        assert ma.is_empty() == (not positive)


@MEDIUM
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(-2, 2)), min_size=50, max_size=600),
       st.integers(1, 40))
def test_mutable_antichain_int_heap_matches_oracle(updates, every):
    """Integer times take the heap path: long runs of times entering and leaving above a held
    least time leave stale heap entries (and set off the heap's compaction); the frontier must
    stay the least positive time after every batch."""
    ma = MutableAntichain()
    ma.update_iter([(0, 1)])  # held throughout the first half: times above it come and go
    counts = {0: 1}
    for i in range(0, len(updates), every):
        batch = updates[i:i + every]
        if i >= len(updates) // 2 and counts.get(0):
            batch = batch + [(0, -counts[0])]  # release the held time halfway
        ma.update_iter(batch)
        for t, d in batch:
            counts[t] = counts.get(t, 0) + d
        positive = [t for t, c in counts.items() if c > 0]
        assert ma.elements == ([min(positive)] if positive else [])
        assert ma.counts == {t: c for t, c in counts.items() if c != 0}


def test_mutable_antichain_transient_negative():
    ma = MutableAntichain()
    assert ma.update_iter([((1, 1), -1)]) == []  # a decrement seen before its increment
    assert ma.elements == [] and ma.count_for((1, 1)) == -1
    assert ma.update_iter([((2, 0), 1)]) == [((2, 0), 1)]
    assert sorted(ma.update_iter([((1, 1), 2)])) == [((1, 1), 1)]
    assert sorted(ma.elements) == [(1, 1), (2, 0)]
    assert sorted(ma.update_iter([((0, 0), 1), ((0, 0), -1)])) == []
    assert sorted(ma.update_iter([((0, 1), 1)])) == [((0, 1), 1), ((1, 1), -1)]
    assert sorted(ma.update_iter([((2, 0), -1), ((0, 1), -1), ((1, 1), -1)])) == [((0, 1), -1), ((2, 0), -1)]
    assert ma.elements == [] and ma.is_empty()

