"""Property tests for the ``Summary`` laws and the time helpers against the direct, step-by-step
reference semantics of enter / leave / feedback in ``progress_reference``: composition agrees with
sequential application, summaries are monotone and advance time, and their order is sound."""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from progress_reference import coords, mk_time, ref_le, step_apply, step_summary, summary_le

from timely.progress import Summary, less_equal, less_than, minimum, to_inner, to_outer

FAST = settings(max_examples=150, deadline=None)
MEDIUM = settings(max_examples=300, deadline=None)
MAX_DEPTH = 4


def step_out_depth(step, depth) -> int:
    kind, arg = step
    if kind == "enter":
        return depth + 1
    if kind == "leave":
        return depth - 1
    if kind == "general":
        return arg.keep + len(arg.push)
    return depth



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
    # An int against a tuple too (a probe of a nested scope asked about an epoch), with the same error.
    for a, b in (((1, 2), (1, 2, 3)), ((1, 0), 5), (5, (1, 0))):
        with pytest.raises(TypeError, match="cannot compare timestamps of different depths"):
            less_equal(a, b)
