"""Q5 (hot items, sliding window) and Q7 (highest bid, tumbling window).

Windows are in event time (``date_time``, ms); the window ending at ``x`` is reported at epoch
``last_epoch(x, d)`` once that epoch is complete, so the time dilation ``d`` maps long event-time
windows onto short runs.

* Q5: every ``q5_slide_ms`` the auction with the most bids in the last ``q5_window_ms``:
  ``(window_end, auction, count)``, ties to the lower auction id; only windows holding a bid.
* Q7: per tumbling window of ``q7_window_ms`` the highest bid:
  ``(window_end, auction, bidder, price, date_time)``; ties to the earlier bid, then the lower
  auction, then the lower bidder.

Both are two-stage: a keyed (or worker-local) stage computes a partial top-1 per window, and a
global stage, exchanged by window end, takes the best of the partial results.
"""
from __future__ import annotations

from typing import Any

import megaphone
import timely

from ..model import B_AUCTION, B_BIDDER, B_PRICE, B_TIME, Params, last_epoch
from .common import Streams, frontier_bound, per_time_best


def _q5_score(r: tuple) -> tuple:
    return (r[2], -r[1])


class SlidingCounts:
    """Per-auction bid counts over a sliding window, advanced one slide at a time.

    ``slices`` holds the counts of each slide-long slice of event time that has not yet left the
    window; ``counts`` the sums over the slices in the window ending at ``next_end - slide``;
    ``next_end`` the end of the next window to report (``None`` while no bid is held).

    Bids may be added in any order and in any cut into calls, as long as a window is advanced only
    once every bid before its end has been added (its epoch is complete): then a bid never lands in
    a slice that is already counted, and a bid in a slice before ``next_end``'s can only be one
    whose windows were skipped while ``counts`` was empty, so ``next_end`` moves back to it.
    """

    __slots__ = ("slide", "span", "slices", "counts", "next_end")

    def __init__(self, window: int, slide: int) -> None:
        self.slide = slide
        self.span = window // slide  # slices per window
        self.slices: dict[int, dict[int, int]] = {}
        self.counts: dict[int, int] = {}
        self.next_end: int | None = None

    def add(self, bids: Any) -> None:
        """Count the bids ``(auction, bidder, price, date_time)`` in their slices."""
        slide, slices = self.slide, self.slices
        first = None  # the earliest slice this call creates (the only per-slice, not per-bid, work)
        for b in bids:
            k = b[B_TIME] // slide
            sl = slices.get(k)
            if sl is None:
                sl = slices[k] = {}
                if first is None or k < first:
                    first = k
            a = b[B_AUCTION]
            sl[a] = sl.get(a, 0) + 1
        # A new slice is never counted yet (see the class): one before the slice that ``next_end``
        # adds next was skipped while no bid was held, so its window is the next to report.
        if first is not None and (self.next_end is None or (first + 1) * slide < self.next_end):
            self.next_end = (first + 1) * slide

    def advance(self) -> tuple[int, int, int] | None:
        """Close the window ending at ``next_end``: ``(end, auction, count)`` of its top auction
        (``None`` if it holds no bid); move ``next_end`` on (to ``None`` when nothing is held)."""
        end = self.next_end
        assert end is not None, "advance() is called only while a window is held (next_end set)"
        k = end // self.slide - 1
        counts = self.counts
        for a, c in self.slices.get(k, {}).items():
            counts[a] = counts.get(a, 0) + c
        old = self.slices.pop(k - self.span, None)
        if old:
            for a, c in old.items():
                left = counts[a] - c
                if left:
                    counts[a] = left
                else:
                    del counts[a]
        top = None
        if counts:
            a, c = max(counts.items(), key=lambda ac: (ac[1], -ac[0]))
            top = (end, a, c)
        self.next_end = end + self.slide
        if not counts:
            later = [s for s in self.slices if s >= k + 1]
            self.next_end = (min(later) + 1) * self.slide if later else None
            if not later:
                self.slices.clear()
        return top


def q5(s: Streams, p: Params) -> timely.Stream:
    """Q5 on engine operators: sliding counts per worker (bids exchanged by auction), then a
    global top-1 per window."""
    d = p.d

    def build(cap: Any, info: Any) -> Any:
        cap.drop()
        win = SlidingCounts(p.q5_window_ms, p.q5_slide_ms)
        held: list[Any] = [None]

        def logic(inp: Any, out: Any) -> None:
            for icap, batch in inp:
                win.add(batch)
                if win.next_end is None:
                    continue  # an empty batch
                # The batch may have moved the next window back (a bid of an earlier slice than
                # those held): its epoch is still at least the batch's time, so ``delayed`` holds.
                due = last_epoch(win.next_end, d)
                if held[0] is None or held[0].time > due:
                    new = icap.delayed(due)
                    if held[0] is not None:
                        held[0].drop()
                    held[0] = new
            cap = held[0]
            bound = frontier_bound(inp.frontier)
            while win.next_end is not None and last_epoch(win.next_end, d) < bound:
                due = last_epoch(win.next_end, d)
                top = win.advance()
                if top is not None:
                    if cap.time != due:
                        cap.downgrade(due)
                    out.give(cap, top)
            if cap is not None:
                if win.next_end is None:
                    cap.drop()
                    held[0] = None
                elif cap.time != last_epoch(win.next_end, d):
                    cap.downgrade(last_epoch(win.next_end, d))

        return logic

    local = s.bids.unary_frontier(build, name="Q5 sliding counts", exchange=B_AUCTION)
    return per_time_best(local, 0, _q5_score, "Q5 top auction")


def q5_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q5 with the sliding counts migratable (per bin, a timer at each window's epoch)."""
    d = p.d

    def fold(t: Any, bids: list, timers: list, state: dict, notificator: Any) -> list:
        win = state.get("w")
        if win is None:
            win = state["w"] = SlidingCounts(p.q5_window_ms, p.q5_slide_ms)
        win.add(bids)
        out = []
        while win.next_end is not None and last_epoch(win.next_end, d) <= t:
            top = win.advance()
            if top is not None:
                out.append(top)
        if win.next_end is None:
            del state["w"]
            state.pop("timer", None)
        elif state.get("timer") != last_epoch(win.next_end, d):
            state["timer"] = last_epoch(win.next_end, d)
            notificator.notify_at(state["timer"])
        return out

    local = megaphone.unary(s.bids, control, B_AUCTION, fold, name="Q5 flex").stream
    return per_time_best(local, 0, _q5_score, "Q5 top auction")


def _q7_key(b: tuple) -> tuple:
    return (b[B_PRICE], -b[B_TIME], -b[B_AUCTION], -b[B_BIDDER])


def _q7_score(r: tuple) -> tuple:
    return (r[3], -r[4], -r[1], -r[2])


def _q7_record(end: int, b: tuple) -> tuple:
    return (end, b[B_AUCTION], b[B_BIDDER], b[B_PRICE], b[B_TIME])


def q7(s: Streams, p: Params) -> timely.Stream:
    """Q7 on engine operators: a worker-local pre-reduce per window, then a global maximum."""
    width, d = p.q7_window_ms, p.d

    def build(cap: Any, info: Any) -> Any:
        cap.drop()
        best: dict[int, tuple] = {}  # window -> (key, bid)
        caps: dict[int, Any] = {}  # window -> capability at its epoch

        def logic(inp: Any, out: Any) -> None:
            for icap, batch in inp:
                for b in batch:
                    k = b[B_TIME] // width
                    cur = best.get(k)
                    if cur is None:
                        best[k] = (_q7_key(b), b)
                        caps[k] = icap.delayed(last_epoch((k + 1) * width, d))
                    elif b[B_PRICE] >= cur[0][0]:
                        key = _q7_key(b)
                        if key > cur[0]:
                            best[k] = (key, b)
            if caps:
                bound = frontier_bound(inp.frontier)
                for k in sorted(k for k, c in caps.items() if c.time < bound):
                    cap = caps.pop(k)
                    out.give(cap, _q7_record((k + 1) * width, best.pop(k)[1]))
                    cap.drop()

        return logic

    local = s.bids.unary_frontier(build, name="Q7 pre-reduce")
    return per_time_best(local, 0, _q7_score, "Q7 maximum")


def q7_flex(s: Streams, control: Any, p: Params) -> timely.Stream:
    """Q7 with the per-window partial maxima migratable (bids keyed by auction, as Megaphone's
    ``q7_flex``); a timer per bin and window reports the bin's maximum."""
    width, d = p.q7_window_ms, p.d

    def fold(t: Any, bids: list, timers: list, state: dict, notificator: Any) -> list:
        for b in bids:
            k = b[B_TIME] // width
            cur = state.get(k)
            if cur is None:
                state[k] = (_q7_key(b), b)
                notificator.notify_at(last_epoch((k + 1) * width, d), k)
            elif b[B_PRICE] >= cur[0][0]:
                key = _q7_key(b)
                if key > cur[0]:
                    state[k] = (key, b)
        return [_q7_record((k + 1) * width, state.pop(k)[1]) for k in timers]

    local = megaphone.unary(s.bids, control, B_AUCTION, fold, name="Q7 flex").stream
    return per_time_best(local, 0, _q7_score, "Q7 maximum")
