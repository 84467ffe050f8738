"""Reference semantics of timestamps and path summaries, written independently of ``timely.progress``.

Times are ints (one coordinate) or tuples (one per scope level, outermost first). A *step* is one
hop of a path as ``(kind, arg)``: ``("identity", None)``, ``("feedback", k)`` (add ``k`` to the
innermost coordinate), ``("enter", None)`` (push a 0), ``("leave", None)`` (pop the innermost) or
``("general", summary)`` (a :class:`Summary`: keep ``keep`` coordinates, add ``add`` to the last
kept one, push ``push``). The progress tests check the library against these definitions.
"""
from __future__ import annotations

from timely.progress import Summary


def coords(t) -> tuple:
    """The coordinates of a time, as a tuple."""
    return (t,) if isinstance(t, int) else tuple(t)


def mk_time(cs) -> object:
    """The time with coordinates ``cs``: an int for one coordinate, else a tuple."""
    cs = tuple(cs)
    return cs[0] if len(cs) == 1 else cs


def ref_le(a, b) -> bool:
    """Product order on ints / equal-length tuples."""
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


def ref_minimal(elements, le=ref_le) -> set:
    """Minimal elements: those with no *other* element <= them (set semantics)."""
    s = set(elements)
    return {x for x in s if not any(y != x and le(y, x) for y in s)}


def ref_apply(s: Summary, t):
    """``s`` applied to ``t`` as a list manipulation (not via the closed form's slicing)."""
    cs = list(coords(t))
    assert s.keep <= len(cs)
    while len(cs) > s.keep:
        cs.pop()
    cs[-1] += s.add
    cs.extend(s.push)
    return mk_time(cs)


def step_apply(step, t):
    """The time one step takes ``t`` to (direct semantics, independent of ``Summary.results_in``)."""
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
    """The library's summary for a step from a location with ``depth`` coordinates."""
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
