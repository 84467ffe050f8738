"""Property tests for the progress-tracking data structures against brute-force oracles.

Covers ``ChangeBatch`` (vs a dict of sums), ``Antichain`` (vs the minimal elements of everything
inserted), ``MutableAntichain`` (vs the minimal elements of the positively counted times, with exact
frontier diffs) and the ``Summary`` laws (vs a direct, step-by-step reference semantics of
enter / leave / feedback).
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timely.progress import (
    Antichain,
    ChangeBatch,
    MutableAntichain,
    Summary,
    less_equal,
    less_than,
    minimal,
    minimum,
    to_inner,
    to_outer,
)

FAST = settings(max_examples=150, deadline=None)
MEDIUM = settings(max_examples=300, deadline=None)


# ---------------------------------------------------------------------------------------------
# Independent reference semantics
# ---------------------------------------------------------------------------------------------

def coords(t) -> tuple:
    return (t,) if isinstance(t, int) else tuple(t)


def mk_time(cs) -> object:
    cs = tuple(cs)
    return cs[0] if len(cs) == 1 else cs


def ref_le(a, b) -> bool:
    """Product order on ints / equal-length tuples, written independently of the library."""
    ca, cb = coords(a), coords(b)
    assert len(ca) == len(cb), (a, b)
    return all(x <= y for x, y in zip(ca, cb))


def summary_le(a: Summary, b: Summary) -> bool:
    """Reference order on summaries: same shape, pointwise <= (the documented definition)."""
    return (
        a.keep == b.keep
        and len(a.push) == len(b.push)
        and a.add <= b.add
        and all(x <= y for x, y in zip(a.push, b.push))
    )


def ref_minimal(elements, le) -> set:
    """Minimal elements: those with no *other* element <= them (set semantics)."""
    s = set(elements)
    return {x for x in s if not any(y != x and le(y, x) for y in s)}


# Reference semantics of a summary, as a list manipulation (not via the closed form's slicing).
def ref_apply(s: Summary, t):
    cs = list(coords(t))
    assert s.keep <= len(cs)
    while len(cs) > s.keep:
        cs.pop()
    cs[-1] += s.add
    cs.extend(s.push)
    return mk_time(cs)


# Steps of a path, as (kind, arg); each has an independent direct semantics.
def step_apply(step, t):
    kind, arg = step
    cs = list(coords(t))
    if kind == "identity":
        pass
    elif kind == "feedback":
        cs[-1] += arg
    elif kind == "enter":
        cs.append(0)
    elif kind == "leave":
        assert len(cs) >= 2
        cs.pop()
    elif kind == "general":
        return ref_apply(arg, t)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return mk_time(cs)


def step_summary(step, depth) -> Summary:
    kind, arg = step
    if kind == "identity":
        return Summary.identity(depth)
    if kind == "feedback":
        return Summary.feedback(depth, arg)
    if kind == "enter":
        return Summary.enter(depth)
    if kind == "leave":
        return Summary.leave(depth)
    return arg


def step_out_depth(step, depth) -> int:
    kind, arg = step
    if kind == "enter":
        return depth + 1
    if kind == "leave":
        return depth - 1
    if kind == "general":
        return arg.keep + len(arg.push)
    return depth


MAX_DEPTH = 4
small = st.integers(0, 6)


def times_of_depth(d: int, lo: int = 0, hi: int = 6):
    c = st.integers(lo, hi)
    return c if d == 1 else st.tuples(*([c] * d))


@st.composite
def general_summary(draw, in_depth: int, out_depth: int | None = None) -> Summary:
    """A summary applicable to times of ``in_depth`` coordinates (optionally producing ``out_depth``)."""
    if out_depth is None:
        keep = draw(st.integers(1, in_depth))
        npush = draw(st.integers(0, MAX_DEPTH - keep))
    else:
        keep = draw(st.integers(1, min(in_depth, out_depth)))
        npush = out_depth - keep
    return Summary(keep, draw(st.integers(0, 3)), tuple(draw(st.lists(st.integers(0, 3), min_size=npush, max_size=npush))))


@st.composite
def chain(draw, max_len: int = 6):
    """A depth, a compatible chain of steps starting at that depth, and a time of that depth."""
    d0 = draw(st.integers(1, 3))
    d = d0
    steps = []
    for _ in range(draw(st.integers(1, max_len))):
        options = ["identity", "feedback", "general"]
        if d < MAX_DEPTH:
            options.append("enter")
        if d >= 2:
            options.append("leave")
        kind = draw(st.sampled_from(options))
        if kind == "feedback":
            step = (kind, draw(st.integers(0, 3)))
        elif kind == "general":
            step = (kind, draw(general_summary(d)))
        else:
            step = (kind, None)
        steps.append((step, d))
        d = step_out_depth(step, d)
    t = draw(times_of_depth(d0))
    return d0, steps, d, t


# ---------------------------------------------------------------------------------------------
# ChangeBatch
# ---------------------------------------------------------------------------------------------

KEY_STRATEGIES = {
    "int": st.integers(-3, 6),
    "pair": st.tuples(st.integers(0, 3), st.integers(0, 3)),
    "loc_time": st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 1), st.booleans()), st.integers(0, 4)),
}


def model_items(model: dict) -> list:
    return sorted((k, v) for k, v in model.items() if v != 0)


def check_batch(batch: ChangeBatch, model: dict, keys) -> None:
    items = model_items(model)
    assert batch.items() == items
    assert list(batch) == items
    assert len(batch) == len(items)
    assert batch.is_empty() == (not items)
    for k in keys:
        assert batch.get(k) == model.get(k, 0)


@FAST
@given(st.data())
def test_change_batch_matches_dict_of_sums(data):
    key = data.draw(st.sampled_from(sorted(KEY_STRATEGIES)), label="key kind")
    keys = KEY_STRATEGIES[key]
    diff = st.integers(-3, 3)  # includes 0, which must be ignored
    op = st.one_of(
        st.tuples(st.just("update"), st.integers(0, 1), keys, diff),
        st.tuples(st.just("extend"), st.integers(0, 1), st.lists(st.tuples(keys, diff), max_size=8)),
        st.tuples(st.just("drain"), st.integers(0, 1)),
        st.tuples(st.just("drain_into"), st.integers(0, 1)),
        st.tuples(st.just("fresh"), st.integers(0, 1), st.lists(st.tuples(keys, diff), max_size=8)),
    )
    ops = data.draw(st.lists(op, max_size=40), label="ops")
    batches = [ChangeBatch(), ChangeBatch()]
    models: list[dict] = [{}, {}]
    seen_keys: set = set()
    for o in ops:
        i = o[1]
        if o[0] == "update":
            _, _, k, d = o
            seen_keys.add(k)
            batches[i].update(k, d)
            models[i][k] = models[i].get(k, 0) + d
        elif o[0] in ("extend", "fresh"):
            upd = o[2]
            seen_keys.update(k for k, _ in upd)
            if o[0] == "fresh":
                batches[i] = ChangeBatch(upd)
                models[i] = {}
            else:
                batches[i].extend(upd)
            for k, d in upd:
                models[i][k] = models[i].get(k, 0) + d
        elif o[0] == "drain":
            out = batches[i].drain()
            assert out == model_items(models[i])
            # sorted, unique keys, no zeros
            ks = [k for k, _ in out]
            assert ks == sorted(set(ks))
            assert all(v != 0 for _, v in out)
            models[i] = {}
        else:  # drain_into the other batch
            j = 1 - i
            batches[i].drain_into(batches[j])
            for k, v in models[i].items():
                models[j][k] = models[j].get(k, 0) + v
            models[i] = {}
        for b, m in zip(batches, models):
            check_batch(b, m, seen_keys)
    # The two batches are independent objects after any sequence of swaps (no aliasing).
    for k in list(seen_keys)[:3]:
        batches[0].update(k, 1)
        models[0][k] = models[0].get(k, 0) + 1
        check_batch(batches[0], models[0], seen_keys)
        check_batch(batches[1], models[1], seen_keys)
    # Equality depends only on the totals.
    assert (batches[0] == batches[1]) == (model_items(models[0]) == model_items(models[1]))
    assert batches[0] == ChangeBatch(model_items(models[0]))


@FAST
@given(
    st.lists(st.tuples(st.tuples(st.integers(0, 3), st.integers(0, 3)), st.integers(-2, 2)), max_size=20),
    st.randoms(use_true_random=False),
)
def test_change_batch_order_independent(updates, rnd):
    a = ChangeBatch(updates)
    shuffled = list(updates)
    rnd.shuffle(shuffled)
    b = ChangeBatch()
    for k, d in shuffled:
        b.update(k, d)
    assert a == b
    assert a.drain() == b.drain()
    assert a.is_empty() and b.is_empty()


def test_change_batch_examples():
    b = ChangeBatch([(3, 1), (1, 2), (3, -1), (2, 0)])
    assert b.items() == [(1, 2)]
    b.update(1, -2)
    assert b.is_empty() and b.drain() == []
    a = ChangeBatch([(5, 1)])
    c = ChangeBatch([(5, -1), (7, 1)])
    a.drain_into(c)
    assert a.is_empty() and c.items() == [(7, 1)]


# ---------------------------------------------------------------------------------------------
# Antichain
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Summary laws
# ---------------------------------------------------------------------------------------------

@FAST
@given(st.integers(1, 4).flatmap(lambda d: st.tuples(st.just(d), times_of_depth(d, -3, 9))))
def test_identity_law(dt):
    d, t = dt
    ident = Summary.identity(d)
    assert ident.results_in(t) == t
    assert type(ident.results_in(t)) is type(t)
    assert not ident.advances()
    assert Summary() == Summary.identity(1)


@MEDIUM
@given(chain())
def test_followed_by_agrees_with_sequential_application(c):
    d0, steps, d_end, t = c
    # each constructor agrees with the direct step semantics, and the sequential result has the right depth
    cur = t
    summaries = []
    for step, d in steps:
        s = step_summary(step, d)
        summaries.append(s)
        nxt = s.results_in(cur)
        assert nxt == step_apply(step, cur)
        assert s.output_levels(d) == len(coords(nxt))
        cur = nxt
    assert len(coords(cur)) == d_end
    assert isinstance(cur, int) == (d_end == 1)
    # left fold, right fold and every split point all give the same summary, equal to sequential application
    left = functools.reduce(lambda a, b: a.followed_by(b), summaries)
    right = functools.reduce(lambda a, b: b.followed_by(a), reversed(summaries))
    assert left == right
    assert hash(left) == hash(right)
    assert left.results_in(t) == cur
    for k in range(1, len(summaries)):
        a = functools.reduce(lambda x, y: x.followed_by(y), summaries[:k])
        b = functools.reduce(lambda x, y: x.followed_by(y), summaries[k:])
        assert a.followed_by(b) == left
        assert b.results_in(a.results_in(t)) == cur
    # the composed summary is the same function on other times of that depth too
    for other in [minimum(d0), mk_time(x + 5 for x in coords(t)), mk_time(range(d0))]:
        x = other
        for s in summaries:
            x = s.results_in(x)
        assert left.results_in(other) == x
    # identities on either side are neutral
    assert Summary.identity(d0).followed_by(left) == left
    assert left.followed_by(Summary.identity(d_end)) == left


@MEDIUM
@given(chain(), st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_summaries_are_monotone_in_time(c, bumps):
    d0, steps, _, t = c
    s = functools.reduce(lambda a, b: a.followed_by(b), (step_summary(st_, d) for st_, d in steps))
    t2 = mk_time(x + b for x, b in zip(coords(t), bumps))
    assert ref_le(t, t2)
    assert ref_le(s.results_in(t), s.results_in(t2))
    for step, d in steps:
        ss = step_summary(step, d)
        if d == d0:
            assert ref_le(ss.results_in(t), ss.results_in(t2))


@MEDIUM
@given(
    st.integers(1, 4).flatmap(
        lambda d: st.tuples(
            st.just(d),
            times_of_depth(d, -3, 9),
            st.lists(st.integers(0, 4), min_size=1, max_size=6),
        )
    )
)
def test_same_depth_summaries_advance_time(args):
    # compositions of feedback / identity at one depth never move a time backwards: t <= s(t)
    d, t, steps = args
    parts = [Summary.feedback(d, k) if k else Summary.identity(d) for k in steps]
    s = functools.reduce(lambda a, b: a.followed_by(b), parts)
    assert s == Summary(d, sum(steps), ())
    assert ref_le(t, s.results_in(t))
    assert less_equal(t, s.results_in(t))
    assert s.advances() == (sum(steps) > 0)
    assert (s.results_in(t) != t) == (sum(steps) > 0)


@MEDIUM
@given(
    st.integers(1, 4).flatmap(
        lambda d: st.tuples(st.just(d), general_summary(d, d), times_of_depth(d))
    ),
    st.integers(0, 2),
)
def test_same_depth_summaries_advance_lexicographically(args, extra):
    # Any depth-preserving summary with a positive add strictly advances a time in the
    # lexicographic order (Python tuple order), which is what makes advancing cycles terminate.
    d, s, t = args
    s = Summary(s.keep, s.add + extra, s.push)
    out = s.results_in(t)
    assert len(coords(out)) == d
    if s.add > 0:
        assert coords(out) > coords(t)
        # applying it again advances again, and the second image dominates the first (product order)
        assert ref_le(out, s.results_in(out)) and s.results_in(out) != out
    if s.keep == d:
        assert ref_le(t, out)


@st.composite
def related_summaries(draw, in_depth):
    s = draw(general_summary(in_depth))
    bigger = Summary(s.keep, s.add + draw(st.integers(0, 2)), tuple(p + draw(st.integers(0, 2)) for p in s.push))
    return s, bigger


@MEDIUM
@given(st.data())
def test_summary_order_implies_pointwise_order(data):
    d = data.draw(st.integers(1, 3))
    s1, s2 = data.draw(related_summaries(d))
    ts = data.draw(st.lists(times_of_depth(d, -2, 8), min_size=1, max_size=5))
    assert s1.less_equal(s2) and summary_le(s1, s2)
    for t in ts:
        assert ref_le(s1.results_in(t), s2.results_in(t))
    # composition is monotone in both arguments
    out = s1.keep + len(s1.push)
    nxt = data.draw(general_summary(out))
    prev_d = data.draw(st.integers(1, 3))
    # a summary from prev_d that lands on depth d
    prv = Summary.identity(d) if prev_d == d else data.draw(general_summary(prev_d, d))
    for t in ts:
        assert ref_le(s1.followed_by(nxt).results_in(t), s2.followed_by(nxt).results_in(t))
    nxt2 = Summary(nxt.keep, nxt.add + 1, nxt.push)
    assert s1.followed_by(nxt).less_equal(s1.followed_by(nxt2))
    for t in ts:
        assert ref_le(s1.followed_by(nxt).results_in(t), s1.followed_by(nxt2).results_in(t))
    tp = data.draw(times_of_depth(prev_d))
    assert ref_le(prv.followed_by(s1).results_in(tp), prv.followed_by(s2).results_in(tp))
    assert prv.followed_by(s1).less_equal(prv.followed_by(s2))


@MEDIUM
@given(st.data())
def test_summary_less_equal_is_a_partial_order_and_sound(data):
    summ = st.builds(Summary, st.integers(1, 2), st.integers(0, 2), st.lists(st.integers(0, 2), max_size=2).map(tuple))
    a, b, c = data.draw(summ), data.draw(summ), data.draw(summ)
    assert a.less_equal(a)
    assert a.less_equal(b) == summary_le(a, b)
    if a.less_equal(b) and b.less_equal(a):
        assert a == b and hash(a) == hash(b)
    if a.less_equal(b) and b.less_equal(c):
        assert a.less_equal(c)
    # soundness: less_equal implies pointwise <= on every applicable time
    if a.less_equal(b):
        ts = data.draw(st.lists(times_of_depth(max(a.keep, 1) + 1, -2, 6), min_size=1, max_size=4))
        for t in ts:
            assert ref_le(a.results_in(t), b.results_in(t))
    assert less_equal(a, b) == a.less_equal(b)
    assert less_than(a, b) == (a.less_equal(b) and a != b)
    # sorting summaries is possible (total order used only for sorting)
    sorted([a, b, c])


def test_summary_examples_and_errors():
    assert Summary.enter(1).results_in(4) == (4, 0)
    assert Summary.leave(2).results_in((4, 7)) == 4
    assert Summary.feedback(2, 3).results_in((4, 7)) == (4, 10)
    assert Summary.enter(2).results_in((1, 2)) == (1, 2, 0)
    # leave then enter resets the inner coordinate: not >= the original time
    le = Summary.leave(2).followed_by(Summary.enter(1))
    assert le == Summary(1, 0, (0,)) and le.results_in((3, 5)) == (3, 0)
    assert not le.advances() or le.push  # only push, no add
    # outer feedback between leave and enter advances the outer coordinate
    loop = Summary.leave(2).followed_by(Summary.feedback(1, 1)).followed_by(Summary.enter(1))
    assert loop == Summary(1, 1, (0,)) and loop.results_in((3, 5)) == (4, 0)
    # an inner feedback before leaving is forgotten
    assert Summary.feedback(2, 5).followed_by(Summary.leave(2)) == Summary.leave(2)
    # enter, inner feedback, leave is the identity on the outer time
    assert Summary.enter(1).followed_by(Summary.feedback(2, 4)).followed_by(Summary.leave(2)) == Summary.identity(1)
    with pytest.raises(ValueError):
        Summary(0, 0, ())
    with pytest.raises(ValueError):
        Summary(1, -1, ())
    with pytest.raises(ValueError):
        Summary(1, 0, (-1,))
    with pytest.raises(TypeError):
        Summary(3, 0, ()).results_in((1, 2))
    with pytest.raises(TypeError):
        Summary(1, 0, ()).followed_by(Summary(3, 0, ()))  # needs 3 coordinates, gets 1
    assert not Summary(1, 0, (0,)).less_equal(Summary(2, 0, ()))  # different shapes are incomparable


@FAST
@given(st.integers(1, 4).flatmap(lambda d: st.tuples(st.just(d), times_of_depth(d, 0, 9), times_of_depth(d, 0, 9))))
def test_time_helpers(args):
    d, a, b = args
    assert less_equal(a, b) == ref_le(a, b)
    assert less_than(a, b) == (ref_le(a, b) and a != b)
    assert less_equal(minimum(d), a)
    inner = to_inner(a)
    assert inner == tuple(coords(a)) + (0,)
    assert to_outer(inner) == a
    assert Summary.enter(d).results_in(a) == inner
    assert Summary.leave(d + 1).results_in(inner) == a
    if ref_le(a, b):
        assert ref_le(to_inner(a), to_inner(b))
    # Python's tuple order is a linear extension of the product order
    if ref_le(a, b):
        assert coords(a) <= coords(b)


def test_less_equal_rejects_mixed_depths():
    with pytest.raises(TypeError):
        less_equal((1, 2), (1, 2, 3))
