"""Migratable operators: the routing operator F and the state operator S of the Megaphone paper.

For ``n`` keyed data inputs sharing one control stream::

    data_i ──► F ──(records at t, routed by the table in force at t)──► S (bins of state) ──► output
    control ─► F ──(state chunks of moving bins, at migration time t)──┘        │
               ▲                                                              │
               └──────────── probe on S's output (frontier only, no cycle) ◄──┘

F and S of one worker share the bins (Python objects in one process, as in the paper's shared
pointer). The invariants of DESIGN.md section 5 are stated where they are relied on below.
"""
from __future__ import annotations

import heapq
import pickle
import time as _time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import count, islice
from operator import itemgetter
from typing import Any

import timely
from timely import routing
from timely.dataflow import Broadcast, Distribute, ProbeHandle
from timely.dataflow.operator import InputHandle as OpInput
from timely.dataflow.operator import OperatorBuilder, OutputHandle
from timely.progress import Summary

from .control import ControlError, ControlInput, apply_updates, check_update, default_table

DEFAULT_CHUNK = 1 << 15  # state entries per state message: large bins move in bounded chunks


class MegaphoneError(RuntimeError):
    """A migratable operator cannot go on (for example: its key function failed on a record)."""


class BinState(dict):
    """A bin's state: a plain ``dict`` to the fold, which CPython's collector never untracks.

    CPython untracks a dict whose keys and values are all untracked (ints, strings, tuples of
    them) during a full collection, and tracks it again, in the young generation, as soon as a
    fresh tuple is stored in it. A long-lived keyed state frozen by ``gc.freeze()`` (or promoted to
    the old generation) thus drops back into the young generation bin by bin as records arrive,
    and the next young collection traverses every entry of every such bin at once: 99 ms over
    1.35 M entries in NEXMark Q8. Dict subclasses are never untracked, so a bin stays where the
    collector put it and a young collection sees only what is new.
    """

    __slots__ = ()


class Bin:
    """One bin on its current owner: user ``state`` (a :class:`BinState`) and pending ``timers``."""

    __slots__ = ("state", "timers")

    def __init__(self) -> None:
        self.state: dict = BinState()
        self.timers: list[tuple[Any, int, Any]] = []  # heap of (time, sequence, payload)


class Shared:
    """What F and S of one worker share: bins, the configuration history, and the migration log."""

    def __init__(self, name: str, k: int, index: int, peers: int) -> None:
        self.name = name
        self.k = k
        self.nbins = 1 << k
        self.index = index
        self.peers = peers
        table = default_table(self.nbins, peers)
        # Configurations compiled so far, ascending by time: (time, table). The first is in force
        # from the beginning of time.
        self.config_times: list[Any] = [0]
        self.config_tables: list[tuple[int, ...]] = [table]
        self.bins: list[Bin | None] = [Bin() if w == index else None for w in table]
        self.timer_bins: dict[Any, set[int]] = defaultdict(set)  # time -> bins with a timer then
        self.events: list[dict] = []
        self.s_core: Any = None
        self.left_times: list[Any] = []  # times of timers shipped away, until S rechecks their capabilities

    def table_at(self, time: Any) -> tuple[int, ...]:
        """The routing table in force at ``time`` (DESIGN 5.3: records route by their own time)."""
        return self.config_tables[bisect_right(self.config_times, time) - 1]

    def routing_table(self) -> tuple[int, ...]:
        """The newest compiled routing table (bin -> worker)."""
        return self.config_tables[-1]

    def take_bin(self, b: int) -> Bin:
        """Remove bin ``b`` from this worker (its timers leave the timer index)."""
        bin_ = self.bins[b]
        if bin_ is None:
            raise MegaphoneError(f"'{self.name}': worker {self.index} was to ship bin {b}, which it does not hold")
        self.bins[b] = None
        for t, _, _ in bin_.timers:
            self.left_times.append(t)
            bins_at = self.timer_bins.get(t)
            if bins_at is not None:
                bins_at.discard(b)
                if not bins_at:
                    del self.timer_bins[t]
        return bin_


def _key_fn(key: Any) -> Any:
    if key is None or isinstance(key, int) or callable(key):
        return key
    raise TypeError(f"key must be a field index, a function or None, not {key!r}")


class Migratable:
    """A migratable operator's handle: ``stream`` (its output), ``probe`` (on that output),
    ``routing_table()`` and ``events`` (per-step migration records of this worker)."""

    def __init__(self, stream: timely.Stream, probe: ProbeHandle, shared: Shared) -> None:
        self.stream = stream
        self.probe = probe
        self._shared = shared

    def routing_table(self) -> tuple[int, ...]:
        """Bin -> worker, as of the newest configuration this worker has compiled."""
        return self._shared.routing_table()

    @property
    def events(self) -> list[dict]:
        """Migration events on this worker: ``{"kind": "extract"|"install", "time", "bins", "entries",
        "bytes", "seconds", ...}``."""
        return self._shared.events

    def state(self) -> dict:
        """The state of every bin this worker holds, merged into one dict (for ``state_machine``:
        key -> state). Read it between steps; it changes as the dataflow runs and bins move."""
        merged: dict = {}
        for bin_ in self._shared.bins:
            if bin_ is not None:
                merged.update(bin_.state)
        return merged

    def owned_bins(self) -> list[int]:
        """The bins currently held by this worker."""
        return [b for b, x in enumerate(self._shared.bins) if x is not None]


class BinNotificator:
    """Per-bin timers: ``notify_at(time, payload)`` delivers ``payload`` to the fold at ``time``.

    Timers carry data and migrate with their bin.
    """

    __slots__ = ("_s", "_bin", "_b", "_now")

    def __init__(self, s: _StateOperator, b: int, bin_: Bin, now: Any) -> None:
        self._s = s
        self._b = b
        self._bin = bin_
        self._now = now

    def notify_at(self, time: Any, payload: Any = None) -> None:
        """Call the fold for this bin at ``time`` (not earlier than now) with ``payload`` in ``timers``."""
        if not time >= self._now:
            raise MegaphoneError(f"'{self._s.shared.name}': timer at {time!r} is earlier than the current time {self._now!r}")
        self._s.add_timer(self._b, self._bin, time, payload, self._s.caps[self._now])


class _StateOperator:
    """S: applies records at a time once every data input and the state input have passed it."""

    def __init__(self, shared: Shared, keys: Sequence[Any], fold: Callable, ports: list, state_port: Any,
                 core: Any) -> None:
        self.shared = shared
        self.keys = keys
        self.fold = fold
        self.ports = ports  # data input ports
        self.state_port = state_port
        self.frontier_ports = [*ports, state_port]
        self.core = core
        self.caps: dict[Any, timely.Capability] = {}
        self.pending: dict[Any, list[list]] = {}  # time -> per input list of batches
        self.timer_heap: list[Any] = []  # times with timers (lazy: checked against timer_bins)
        self.pending_heap: list[Any] = []  # times with pending data (lazy: checked against pending)
        self.seq = count()
        self.per_record: Callable[[dict, Any, list], None] | None = None  # state_machine's fast path

    def hold(self, time: Any, cap: Any) -> None:
        if time not in self.caps:
            self.caps[time] = cap.delayed(time) if isinstance(cap, timely.Capability) else cap.delayed(time, 0)

    def add_timer(self, b: int, bin_: Bin, time: Any, payload: Any, cap: Any) -> None:
        heapq.heappush(bin_.timers, (time, next(self.seq), payload))
        bins_at = self.shared.timer_bins[time]
        if not bins_at:
            heapq.heappush(self.timer_heap, time)
        bins_at.add(b)
        self.hold(time, cap)

    def complete(self, time: Any) -> bool:
        return not any(p.frontier.less_equal(time) for p in self.frontier_ports)

    def run(self, inputs: list[OpInput], state_in: OpInput, out: OutputHandle) -> None:
        shared = self.shared
        # 1. Install arriving state first (DESIGN 5.4: installed before any later record of the bin).
        for cap, batch in state_in:
            started = _time.perf_counter()
            nbytes = entries = 0
            bins = set()
            for _, b, payload in batch:
                data, timers = pickle.loads(payload)
                nbytes += len(payload)
                entries += len(data)
                bins.add(b)
                bin_ = shared.bins[b]
                if bin_ is None:
                    bin_ = shared.bins[b] = Bin()
                bin_.state.update(data)  # into the BinState (pickled as a plain dict: faster both ways)
                for t, p in timers:
                    self.add_timer(b, bin_, t, p, cap)
            shared.events.append({"kind": "install", "time": cap.time, "bins": sorted(bins), "entries": entries,
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
        # 3. Apply complete times in time order (DESIGN 5.5).
        applied = []
        while True:
            t = self._next_time()
            if t is None or not self.complete(t):
                break
            self._apply(t, out)
            applied.append(t)
        # 4. Release capabilities no longer needed: times just applied (data and timers done), and
        # the times of timers that left with shipped bins. Only these can have become
        # free: a held time stays needed while it has pending data or a timer on this worker.
        if shared.left_times:
            applied += shared.left_times
            shared.left_times = []
        for t in applied:
            if t in self.caps and t not in self.pending and t not in shared.timer_bins:
                self.caps.pop(t).drop()

    def _apply_records(self, t: Any, out: OutputHandle) -> None:
        """Fast path (``state_machine``: one input, no timers): each record straight into its bin."""
        shared = self.shared
        bins_held = shared.bins
        apply = self.per_record
        results: list = []
        for batch in self.pending.pop(t)[0]:
            try:
                bins = routing.bins_of(batch, self.keys[0], shared.k)
            except Exception as e:
                raise MegaphoneError(f"'{shared.name}': key function failed: {e}") from e
            for b, r in zip(bins, batch):
                bin_ = bins_held[b]
                if bin_ is None:
                    raise MegaphoneError(
                        f"'{shared.name}': records of bin {b} at time {t!r} reached worker {shared.index}, which "
                        "does not hold the bin (routing invariant violated)"
                    )
                apply(bin_.state, r, results)
        if results:
            out.give_batch(self.caps[t], results)

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

    def _apply(self, t: Any, out: OutputHandle) -> None:
        shared = self.shared
        n = len(self.ports)
        if self.per_record is not None and t not in shared.timer_bins:
            self._apply_records(t, out)
            return
        groups: dict[int, list[list]] = {}
        for i, batches in enumerate(self.pending.pop(t, [[]] * n)):
            for batch in batches:
                try:
                    bins = routing.bins_of(batch, self.keys[i], shared.k)
                except Exception as e:
                    raise MegaphoneError(f"'{shared.name}': key function failed: {e}") from e
                for b, r in zip(bins, batch):
                    g = groups.get(b)
                    if g is None:
                        g = groups[b] = [[] for _ in range(n)]
                    g[i].append(r)
        due = shared.timer_bins.pop(t, ())
        cap = self.caps[t]
        for b in sorted(set(groups) | set(due)):
            bin_ = shared.bins[b]
            if bin_ is None:
                raise MegaphoneError(
                    f"'{shared.name}': records of bin {b} at time {t!r} reached worker {shared.index}, which does not "
                    "hold the bin (routing invariant violated)"
                )
            timers = []
            while bin_.timers and bin_.timers[0][0] == t:
                timers.append(heapq.heappop(bin_.timers)[2])
            records = groups.get(b) or [[] for _ in range(n)]
            result = self.fold(t, *records, timers, bin_.state, BinNotificator(self, b, bin_, t))
            if result:
                out.session(cap).give_batch(result)  # buffered: one message per time, not per bin


class _RoutingOperator:
    """F: routes records by the configuration in force at their time; ships bins at migration times."""

    def __init__(self, shared: Shared, n: int, ctrl_port: Any, probe: ProbeHandle, chunk: int) -> None:
        self.shared = shared
        self.n = n
        self.ctrl_port = ctrl_port
        self.probe = probe
        self.chunk = chunk
        self.ctrl_pending: dict[Any, tuple[Any, list]] = {}
        self.to_extract: list[tuple[Any, tuple, tuple, Any]] = []
        self.stash: dict[Any, tuple[list, list]] = {}  # time -> (caps per input, batches per input)

    def run(self, data_in: list[OpInput], ctrl_in: OpInput, data_out: list[OutputHandle],
            state_out: OutputHandle) -> None:
        shared = self.shared
        ctrl_frontier = self.ctrl_port.frontier
        # 1. Control ingest: hold a capability at each control time on the state output.
        for cap, batch in ctrl_in:
            entry = self.ctrl_pending.get(cap.time)
            if entry is None:
                entry = self.ctrl_pending[cap.time] = (cap.retain(self.n), [])
            entry[1].extend(batch)
        # 2. Compile configurations whose time the control frontier has passed (times total order).
        for t in sorted(self.ctrl_pending):
            if ctrl_frontier.less_equal(t):
                break
            cap, updates = self.ctrl_pending.pop(t)
            for u in updates:
                try:
                    check_update(u, shared.nbins, shared.peers)
                except ControlError as e:
                    raise ControlError(f"'{shared.name}': {e}") from None
            old = shared.config_tables[-1]
            new = apply_updates(old, updates)
            shared.config_times.append(t)
            shared.config_tables.append(new)
            self.to_extract.append((t, old, new, cap))
        # 3. Ship moving bins once S has finished every time before t (DESIGN 5.4); until then the
        #    capability at t on the state output keeps S from applying anything at or after t.
        while self.to_extract and not self.probe.less_than(self.to_extract[0][0]):
            t, old, new, cap = self.to_extract.pop(0)
            self._extract(t, old, new, cap, state_out)
        # 4. New data: route now if the configuration at its time is final, else stash it (DESIGN 5.3).
        for i, inp in enumerate(data_in):
            for cap, batch in inp:
                t = cap.time
                if ctrl_frontier.less_equal(t):
                    entry = self.stash.get(t)
                    if entry is None:
                        entry = self.stash[t] = ([None] * self.n, [[] for _ in range(self.n)])
                    if entry[0][i] is None:
                        entry[0][i] = cap.retain(i)
                    entry[1][i].append(batch)
                else:
                    data_out[i].give_batch(cap, batch)
        # 5. Release stashed data whose configuration became final.
        for t in sorted(self.stash):
            if ctrl_frontier.less_equal(t):
                break
            caps, batches = self.stash.pop(t)
            for i in range(self.n):
                if caps[i] is not None:
                    for batch in batches[i]:
                        data_out[i].give_batch(caps[i], batch)
                    caps[i].drop()
        # Forget configurations no record can be routed by any more.
        # (Stashed records were consumed already: their times bound the horizon too.)
        low = [t for p in data_in for t in p.frontier.frontier] + list(self.stash)
        if low:
            horizon = min(low)
            while len(shared.config_times) > 1 and shared.config_times[1] <= horizon:
                del shared.config_times[0], shared.config_tables[0]

    def _extract(self, t: Any, old: tuple, new: tuple, cap: Any, state_out: OutputHandle) -> None:
        shared = self.shared
        me = shared.index
        started = _time.perf_counter()
        moved = [b for b in range(shared.nbins) if old[b] == me and new[b] != me]
        nbytes = entries = 0
        for b in moved:
            bin_ = shared.take_bin(b)
            state = bin_.state
            timers = [(tt, p) for tt, _, p in sorted(bin_.timers, key=itemgetter(0, 1))]
            entries += len(state)
            # Bounded chunks: one state message per chunk of at most `chunk` entries (pickled as
            # dicts, the fastest form to write and read back); timers travel with the first.
            if len(state) <= self.chunk:
                chunks = [dict(state)]
            else:
                it = iter(state.items())
                chunks = [dict(islice(it, self.chunk)) for _ in range(0, len(state), self.chunk)]
            for i, part in enumerate(chunks):
                payload = pickle.dumps((part, timers if i == 0 else []), protocol=5)
                nbytes += len(payload)
                state_out.give_batch(cap, [(new[b], b, payload)])
        cap.drop()
        if moved and shared.s_core is not None:
            shared.s_core.activate()  # S releases the capabilities of timers that left
        if moved:
            shared.events.append({"kind": "extract", "time": t, "bins": moved, "to": [new[b] for b in moved],
                                  "entries": entries, "bytes": nbytes, "seconds": _time.perf_counter() - started,
                                  "worker": me})


def _build(streams: Sequence[timely.Stream], control: Any, keys: Sequence[Any], fold: Callable, bins: int | None,
           name: str, chunk: int) -> Migratable:
    scope = streams[0].scope
    if scope.levels != 1:
        raise ValueError(f"'{name}': migratable operators need integer (top-level) timestamps")
    ctrl_stream = control.stream if isinstance(control, ControlInput) else control
    if bins is None:
        bins = control.k if isinstance(control, ControlInput) else 8
    if not 0 <= bins <= 16:
        raise ValueError(f"'{name}': bins is the exponent k of 2^k bins, between 0 and 16, not {bins}")
    keys = [_key_fn(k) for k in keys]
    n = len(streams)
    shared = Shared(name, bins, scope.index, scope.peers)
    probe = ProbeHandle()
    ident = Summary.identity(1)

    # F: inputs data_0..data_{n-1}, control; outputs data_0..data_{n-1}, state.
    fb = OperatorBuilder(scope, f"{name} F")
    for _ in range(n + 1):
        fb.new_output()
    for i, s in enumerate(streams):
        fb.new_input(s, None, [[ident] if o == i else [] for o in range(n + 1)])
    # The control input is broadcast: every F sees every update. It connects only to the state output.
    fb.new_input(ctrl_stream, Broadcast(), [[] for _ in range(n)] + [[ident]])
    fb.set_frontier_interest(True)
    f_core = fb.core
    f_op = _RoutingOperator(shared, n, f_core.inputs[n], probe, chunk)

    def build_f(caps: list) -> Callable[[], None]:
        for c in caps:
            c.drop()
        data_in = [OpInput(p) for p in f_core.inputs[:n]]
        ctrl_in = OpInput(f_core.inputs[n])
        outs = [OutputHandle(p) for p in f_core.outputs]

        def run() -> None:
            f_op.run(data_in, ctrl_in, outs[:n], outs[n])
            for o in outs:
                o.flush()

        return run

    fb.build(build_f)
    f_streams = [timely.Stream(scope, f_core.index, o) for o in range(n + 1)]

    # S: inputs data_0..data_{n-1} (routed by the table at the record's time), state (by target).
    def route_data(i: int) -> Callable:
        key = keys[i]

        def partition(time: Any, batch: Sequence, peers: int) -> list:
            try:
                return routing.route_bins(batch, key, bins, shared.table_at(time), peers)[0]
            except Exception as e:
                raise MegaphoneError(f"'{name}': key function failed: {e}") from e

        return partition

    def route_state(time: Any, batch: Sequence, peers: int) -> list:
        parts: list[list] = [[] for _ in range(peers)]
        for r in batch:
            parts[r[0]].append(r)
        return parts

    sb = OperatorBuilder(scope, name)
    sb.new_output()
    for i in range(n):
        sb.new_input(f_streams[i], Distribute(route_data(i)))
    sb.new_input(f_streams[n], Distribute(route_state))
    sb.set_frontier_interest(True)
    s_core = sb.core
    shared.s_core = s_core
    s_op = _StateOperator(shared, keys, fold, s_core.inputs[:n], s_core.inputs[n], s_core)

    def build_s(caps: list) -> Callable[[], None]:
        caps[0].drop()
        data_in = [OpInput(p) for p in s_core.inputs[:n]]
        state_in = OpInput(s_core.inputs[n])
        out = OutputHandle(s_core.outputs[0])

        def run() -> None:
            try:
                s_op.run(data_in, state_in, out)
            finally:
                out.flush()

        return run

    sb.build(build_s)
    out = timely.Stream(scope, s_core.index, 0).probe_with(probe)
    probe.watch(f_core)  # F wakes up when S's output frontier moves
    handle = Migratable(out, probe, shared)
    handle._s_op = s_op
    return handle


def unary(stream: timely.Stream, control: Any, key: Any, fold: Callable, bins: int | None = None,
          name: str = "MegaphoneUnary", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable one-input operator with per-bin state and timers.

    ``fold(time, records, timers, state, notificator)`` is called per bin for every complete time at
    which the bin has records or timers, in time order; ``state`` is the bin's dict (keyed as you
    like); ``notificator.notify_at(t, payload)`` posts ``payload`` back to this bin at ``t``; the
    iterable it returns is emitted at ``time``. ``key`` (field index, function or None) picks the
    routing key of a record; ``bins`` is k for 2^k bins (default: the control input's).
    """
    return _build([stream], control, [key], fold, bins, name, chunk)


def binary(stream1: timely.Stream, stream2: timely.Stream, control: Any, key1: Any, key2: Any, fold: Callable,
           bins: int | None = None, name: str = "MegaphoneBinary", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable two-input operator (for example a join): both inputs share one configuration.

    ``fold(time, records1, records2, timers, state, notificator)`` per bin and complete time.
    """
    return _build([stream1, stream2], control, [key1, key2], fold, bins, name, chunk)


def state_machine(stream: timely.Stream, control: Any, key: Any, fold: Callable, bins: int | None = None,
                  name: str = "StateMachine", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable per-key state machine over ``(key, value)`` records.

    ``fold(key, value, state)`` gets the key's state (``None`` at first) and returns
    ``(keep_state, outputs)``: the new state to keep (``None`` discards it) and an iterable of
    output records, emitted at the record's time. Records of one key are applied in time order.
    ``key`` picks the routing key from the record (default: field 0, the pair's key).
    """

    def logic(time: Any, records: list, timers: list, state: dict, notificator: Any) -> list:
        out: list = []
        get = state.get
        for k, v in records:
            new, outputs = fold(k, v, get(k))
            if new is None:
                state.pop(k, None)
            else:
                state[k] = new
            if outputs:
                out.extend(outputs)
        return out

    def apply(state: dict, record: Any, out: list) -> None:
        k, v = record
        new, outputs = fold(k, v, state.get(k))
        if new is None:
            state.pop(k, None)
        else:
            state[k] = new
        if outputs:
            out.extend(outputs)

    handle = _build([stream], control, [0 if key is None else key], logic, bins, name, chunk)
    handle._s_op.per_record = apply
    return handle
