"""S, the state operator of the Megaphone paper: it holds the bins of keyed state and applies the
records of a time once every data input and the state input have passed it.

Invariants of ARCHITECTURE.md section 5 relied on here: state arriving for a bin is installed before any
later record of the bin (5.4), and times are applied in order (5.5). With checkpoints, S offers a
checkpoint epoch before it applies any time at or after it (the cut of :mod:`megaphone.checkpoint`).
"""
from __future__ import annotations

import heapq
import time as _time
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

from timely import Capability, Frontier, InputCapability, OperatorInput, OperatorOutput, routing

from .bins import Bin, MegaphoneError, Shared
from .precopy import Staging

PerRecord = Callable[[dict, Any, list], None]  # (bin state, record, outputs): state_machine's fold
#: Applies a whole complete time at once, for an operator without timers: ``(time, batches per
#: input, shared) -> output records``, the bins being ``shared.bins`` (state_machine, columnar).
PerTime = Callable[[Any, list[list], Shared], list]


def per_record_time(key: Any, apply: PerRecord) -> PerTime:
    """The :data:`PerTime` of ``state_machine``: each record of one input straight into its bin."""

    def apply_time(t: Any, batches: list[list], shared: Shared) -> list:
        bins_held = shared.bins
        dirty = shared.dirty
        results: list = []
        for batch in batches[0]:
            try:
                bins = routing.bins_of(batch, key, shared.k, shared.bin_records)  # counts the per-bin load
            except Exception as e:
                raise MegaphoneError(f"'{shared.name}': key function failed: {e}") from e
            if dirty is not None:
                if shared.frozen:  # copy on write: bins a checkpoint has not serialised yet
                    for b in set(bins).intersection(shared.frozen):
                        shared.thaw(b)
                dirty.update(bins)
                changed = shared.changed
                if changed is not None:  # the state keys each bin changed (its records' keys)
                    for b in set(bins).difference(changed):
                        changed[b] = set()
                    routing.add_keys(bins, batch, changed)  # a bin offered whole (None) stays whole
            if shared.tracked:  # bins copied ahead or replicated: the keys reached since (megaphone.precopy)
                routing.add_keys(bins, batch, shared.tracked)
            for b, r in zip(bins, batch):
                bin_ = bins_held[b]
                if bin_ is None:
                    shared.bin_for_record(b, t)  # raises: this worker does not hold the bin
                    continue
                apply(bin_.state, r, results)
        return results

    return apply_time


class BinNotificator:
    """Per-bin timers: ``notify_at(time, payload)`` delivers ``payload`` to the fold at ``time``.

    Timers carry data and migrate with their bin.
    """

    __slots__ = ("_s", "_bin", "_b", "_now")

    def __init__(self, s: StateOperator, b: int, bin_: Bin, now: Any) -> None:
        self._s = s
        self._b = b
        self._bin = bin_
        self._now = now

    def notify_at(self, time: Any, payload: Any = None) -> None:
        """Call the fold for this bin at ``time`` (not earlier than now) with ``payload`` in ``timers``."""
        if not time >= self._now:
            raise MegaphoneError(f"'{self._s.shared.name}': timer at {time!r} is earlier than the current time {self._now!r}")
        self._s.add_timer(self._b, self._bin, time, payload, self._s.caps[self._now])


class StateOperator:
    """S: applies records at a time once every data input and the state input have passed it."""

    def __init__(self, shared: Shared, keys: Sequence[Any], fold: Callable | None, frontiers: Sequence[Frontier],
                 per_time: PerTime | None = None) -> None:
        self.shared = shared
        self.keys = keys
        self.fold = fold
        self.n = len(keys)  # data inputs
        self.frontiers = frontiers  # of every data input and of the state input
        self.caps: dict[Any, Capability] = {}
        self.pending: dict[Any, list[list]] = {}  # time -> per input list of batches
        self.timer_heap: list[Any] = []  # times with timers (lazy: checked against timer_bins)
        self.pending_heap: list[Any] = []  # times with pending data (lazy: checked against pending)
        self.seq = count()
        self.per_time = per_time  # the fast path of operators without timers (state_machine, columnar)
        self.staging = Staging(shared)

    def hold(self, time: Any, cap: Capability | InputCapability) -> None:
        """Keep a capability at ``time`` on the output (once per time)."""
        if time not in self.caps:
            self.caps[time] = cap.delayed(time) if isinstance(cap, Capability) else cap.delayed(time, 0)

    def add_timer(self, b: int, bin_: Bin, time: Any, payload: Any, cap: Capability | InputCapability) -> None:
        """Post ``payload`` to bin ``b`` at ``time``; hold the output at ``time`` until it fires."""
        heapq.heappush(bin_.timers, (time, next(self.seq), payload))
        bins_at = self.shared.timer_bins[time]
        if not bins_at:
            heapq.heappush(self.timer_heap, time)
        bins_at.add(b)
        self.hold(time, cap)

    def complete(self, time: Any) -> bool:
        """True once no data input and not the state input can still receive ``time``."""
        return not any(f.less_equal(time) for f in self.frontiers)

    def run(self, inputs: list[OperatorInput], state_in: OperatorInput, out: OperatorOutput,
            copy_in: OperatorInput) -> None:
        """One activation: stage copies ahead, install arriving bins, stash data, apply complete
        times in order."""
        shared = self.shared
        staging = self.staging
        # 0. Copies ahead (megaphone.precopy): staged, not served, until their hand-over.
        for _, batch in copy_in:
            for r in batch:  # (target, bin, payload, copy identity[, keys deleted: a replica's refresh])
                if r[2] is None:  # the copy was replaced by one to another worker: (..., chunks it sent)
                    staging.drop(r[1], r[3], r[4])
                else:
                    staging.chunk(r[1], r[2], r[3], r[4] if len(r) > 4 else b"")
        # 1. Install arriving state first (ARCHITECTURE 5.4: installed before any later record of the bin).
        for cap, batch in state_in:
            started = _time.perf_counter()
            nbytes = entries = 0
            bins = set()
            codec = shared.codec
            for record in batch:
                b = record[1]
                if len(record) == 6:  # a copy ahead's hand-over: ("delta" | "drop", its identity, chunks sent)
                    if record[3] == "drop":
                        staging.drop(b, record[4], record[5])
                        continue
                    if shared.bins[b] is not None:
                        raise MegaphoneError(f"'{shared.name}': worker {shared.index} got the hand-over of bin {b}, "
                                             "which it holds already")
                    state, timers, n = staging.install(b, record[2], record[4], record[5])
                    bin_ = shared.bins[b] = Bin(state)
                    nbytes += len(record[2])
                    entries += n
                else:
                    payload = record[2]
                    staging.discard(b)  # arriving whole: a copy staged for it is stale
                    part, timers = codec.unpack(payload)
                    nbytes += codec.nbytes(payload)
                    entries += codec.size(part)
                    bin_ = shared.install_part(b, part)
                bins.add(b)
                if shared.dirty is not None:
                    shared.dirty.add(b)  # moved in: this worker offers it at its next checkpoint epoch
                if shared.changed is not None:
                    shared.changed[b] = None  # whole
                for t, p in timers:
                    self.add_timer(b, bin_, t, p, cap)
            if bins:  # (a batch of only "drop" records installs nothing)
                shared.log({"kind": "install", "time": cap.time, "bins": sorted(bins), "entries": entries,
                            "bytes": nbytes, "seconds": _time.perf_counter() - started,
                            "worker": shared.index})
        # 2. Stash data until its time is complete on every data input and on the state input.
        for i, inp in enumerate(inputs):
            for cap, batch in inp:
                t = cap.time
                per_input = self.pending.get(t)
                if per_input is None:
                    per_input = self.pending[t] = [[] for _ in inputs]
                    heapq.heappush(self.pending_heap, t)
                    self.hold(t, cap)
                per_input[i].append(batch)
        # 3. Apply complete times in time order (ARCHITECTURE 5.5).
        applied = []
        ck = shared.checkpoint
        while True:
            t = self._next_time()
            if t is None or not self.complete(t):
                break
            if ck is not None and t >= ck.next_epoch:
                ck.offer_before(t + 1)  # the cut: epochs up to t before anything at t is applied
            self._apply(t, out)
            applied.append(t)
        if ck is not None:
            ck.offer_passed(self.frontiers)  # every time before them applied, none after
        # 4. Release capabilities no longer needed: times just applied (data and timers done), and
        # the times of timers that left with shipped bins. Only these can have become
        # free: a held time stays needed while it has pending data or a timer on this worker.
        if shared.left_times:
            applied += shared.left_times
            shared.left_times = []
        for t in applied:
            if t in self.caps and t not in self.pending and t not in shared.timer_bins:
                self.caps.pop(t).drop()

    def _next_time(self) -> Any:
        heap = self.timer_heap
        while heap and heap[0] not in self.shared.timer_bins:
            heapq.heappop(heap)  # every timer at that time fired or left with its bin
        data = self.pending_heap
        while data and data[0] not in self.pending:
            heapq.heappop(data)  # applied
        if heap and data:
            return min(heap[0], data[0])
        return heap[0] if heap else data[0] if data else None

    def _apply(self, t: Any, out: OperatorOutput) -> None:
        shared = self.shared
        n = self.n
        if self.per_time is not None and t not in shared.timer_bins:
            results = self.per_time(t, self.pending.pop(t), shared)
            if results:
                out.give_batch(self.caps[t], results)
            return
        assert self.fold is not None, "an operator without a fold has no timers"
        groups: dict[int, list[list]] = {}
        for i, batches in enumerate(self.pending.pop(t, [[]] * n)):
            for batch in batches:
                try:
                    bins = routing.bins_of(batch, self.keys[i], shared.k, shared.bin_records)  # and the load
                except Exception as e:
                    raise MegaphoneError(f"'{shared.name}': key function failed: {e}") from e
                for b, r in zip(bins, batch):
                    g = groups.get(b)
                    if g is None:
                        g = groups[b] = [[] for _ in range(n)]
                    g[i].append(r)
        due = shared.timer_bins.pop(t, ())
        cap = self.caps[t]
        touched = sorted(set(groups) | set(due))
        if shared.dirty is not None:
            shared.dirty.update(touched)
            if shared.changed is not None:
                for b in touched:
                    shared.changed[b] = None  # keys unknown here: offered whole
        for b in touched:
            bin_ = shared.bins[b] or shared.bin_for_record(b, t)
            shared.thaw(b)  # copy on write (megaphone.checkpoint.BinDump)
            timers = []
            while bin_.timers and bin_.timers[0][0] == t:
                timers.append(heapq.heappop(bin_.timers)[2])
            records = groups.get(b) or [[] for _ in range(n)]
            result = self.fold(t, *records, timers, bin_.state, BinNotificator(self, b, bin_, t))
            if result:
                out.session(cap).give_batch(result)  # buffered: one message per time, not per bin
