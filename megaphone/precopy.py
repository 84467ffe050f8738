"""Pre-copy: move a large bin's state ahead of its hand-over, then only what changed meanwhile.

A plain Megaphone move stops the bin at the migration time while the old owner extracts, ships and
the new owner installs all of its state: with large bins that is the latency spike. Pre-copy splits
the move in two (Rhino's hand-over; Kafka Streams' warm-up replicas):

1. **Copy ahead.** A control record ``("precopy", b, w)`` at time ``t0`` asks the owner of bin ``b``
   to copy it to worker ``w``. F on the owner (:class:`PreCopier`) snapshots the bin (a shallow
   copy) and sends its entries in chunks of at most ``chunk`` entries on a side output, spending at
   most ``budget`` seconds at a time and ``share`` of the worker's time (more while the worker is
   idle, up to :data:`MAX_SHARE`: :meth:`PreCopier.step`), while S keeps serving the bin. From the
   snapshot on, the bin's state records every key that S reaches
   (:class:`TrackedState`). S on ``w`` stages the chunks
   (:class:`Staging`) without serving them. The side edge is not connected to S's output: a copy
   in flight holds no record back. Its frontier, seen through a probe on S's *ack* output
   (connected only from that edge), passes ``t0`` once every copy of ``t0`` has been sent and
   staged: that is how the controller knows the copy is done.
2. **Hand-over.** The ordinary move of ``b`` to ``w`` at a later time ``t`` then ships only the
   keys reached since the snapshot (their values, or their deletion) and the bin's timers: a
   *delta*, installed on top of the staged copy. Where the copy cannot be used (not done, or made
   for another worker, or S reached more than half of the bin meanwhile, or iterated over the whole
   bin) the bin moves whole and the stale copy is dropped; the events say which and why.

**Standby replicas.** A control record ``("replica", b, w)`` starts the same copy, but it stays:
once staged, the owner keeps tracking the bin and, every :data:`REFRESH` seconds, sends the
current values (or deletions) of the keys reached since the previous refresh, a *refresh*, at the
time of a data record F is routing (F's data inputs are connected to the copy edge for that). The
refreshes of one interval form a *round* under one capability: :meth:`PreCopier.step` visits the
replicas one by one within the copies' time slices, so no activation does a whole round. A
refresh starts only once the previous one (or the copy) is staged, so refreshes apply in order and
at most one is in flight per replica. A move of the bin to ``w`` then ships only the keys reached
since the newest staged refresh (the refresh in flight's keys too, when it is not staged yet): the
same delta hand-over, without a copy ahead first. A move elsewhere drops the replica; so does a
copy or replica of the bin requested on another worker (a ``(target, b, None, identity, sent)``
record on the copy edge tells the replica's worker to drop what it staged). The record that ends
a copy (a delta, or a drop) says how many chunks it sent: its target ignores the ones still in
flight, then forgets the copy once the last has come, so nothing is kept per ended copy. A fold that iterates the bin
voids the tracking: the replica is copied again at its next refresh.

Only the row operators' dict state (:class:`~megaphone.bins.BinState`) is pre-copied; a bin of
fewer than ``min_entries`` entries, or of another state (:func:`megaphone.aggregate`'s Arrow
tables), moves whole.

The invariant relied on (by the delta's correctness): every key whose value may differ from the
copy sent is in the tracked set. ``state_machine``, whose records change only their own key's
entry, tracks in S's record path (``Shared.tracked``, a set add per record of a tracked bin); the
other row operators' folds get a :class:`TrackedState`. Tracking begins with the snapshot; any later read or write of a
key through the state dict adds it (a value changed in place is reached first, so the chunk that
carries it, made later, may be newer than the snapshot: the delta sends it again); a fold that
iterates the bin marks it wholly changed. So a fold
must reach the state only through the dict it is given (a value kept elsewhere and changed later
is not seen).
"""
from __future__ import annotations

import math
import pickle
import time as _time
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

from timely.routing import gather

from .bins import Bin, BinState, MegaphoneError, Shared

if TYPE_CHECKING:
    from timely import Capability, OperatorOutput

#: Entries per pre-copy chunk (one state message each). A slice gives way to a peer's message
#: after the chunk it is sending: 512 entries take about 50 us to cut and pack, 40 us to unpack, in a
#: warm loop (1,024 left a hand-over epoch 1.2-1.7 ms later than the others, 512 0.3-0.8 ms;
#: bench/RESULTS.md).
CHUNK = 512
#: Seconds of copying per activation of F, at most (the rest of the activation serves records).
BUDGET = 0.0005
#: Seconds a slice on an idle worker runs before it gives way to other work that waits (a peer's
#: message): shorter slices would cost more in their own overhead than they save.
MIN_SLICE = 0.0001
#: Share of a worker's time the copies may take whatever the worker does (the rate limit that keeps
#: steady latency).
SHARE = 0.05
#: Beyond :data:`SHARE`, the copies may take up to this fraction of the time the worker's thread was
#: idle (neither on a CPU nor waiting for one) over the last :data:`IDLE_WINDOW` or so, up to
#: :data:`MAX_SHARE`.
IDLE_FRACTION = 0.5
#: The most of a worker's time the copies take, however idle it is (at most :data:`SHARE` when lower).
MAX_SHARE = 0.25
#: The most seconds a slice on an idle worker may run beyond :data:`BUDGET` and :data:`MIN_SLICE`
#: to catch up on the copying its pace allowed while no idle moment came (its *arrears*: the time
#: since the rate limit ended, times the paced share). Where idle moments are rarer than the rate
#: limit (a worker among many peers wakes for each one's message), each slice gave way after one
#: chunk and the copy went at a chunk per idle moment, whatever the share (4 workers on 2 cores: a
#: slice every 6.5 ms, 1.3 chunks each). A peer's message waits at most this much longer.
MAX_ARREARS = 0.001
#: Seconds over which the worker's idle time is averaged for the pace (an exponentially weighted
#: mean of the gaps between slices). The last gap alone was too short a window: a gap that held an
#: epoch's work paced the next slice at SHARE, and as every slice waits ``spent / share`` after it,
#: those slow slices set the pace (4 M keys on 2 workers: the copies took 7% of worker 0's time,
#: paced at 11% on harmonic average; averaged, 10% and 19%, a third more copied per second).
IDLE_WINDOW = 0.25
#: Bins with fewer entries move whole (a copy ahead would not pay for its bookkeeping).
MIN_ENTRIES = 256
#: A delta larger than this fraction of its bin's entries falls back to a whole move.
MAX_DELTA_FRACTION = 0.5
#: Seconds between two refreshes of a standby replica (the changes since the previous one).
REFRESH = 1.0

#: Keys reached per tracked state (by ``id``) since its copy began.
_reached: dict[int, set] = {}
#: Tracked states (by ``id``) that were iterated over: wholly changed.
_overflow: set[int] = set()


def _thread_times() -> tuple[float, float] | None:
    """Seconds this thread has run on a CPU and waited for one (``/proc/thread-self/schedstat``),
    or None where that is not available."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return None


def paced_share(share: float, wall: float, busy: float) -> float:
    """The share of the worker's time a copy slice is paced at: ``share``, or more when the worker's
    thread was busy (running or waiting for a CPU) only ``busy`` of the last ``wall`` seconds:
    :data:`IDLE_FRACTION` of the idle time, at most :data:`MAX_SHARE`."""
    if wall <= 0:
        return share
    return max(share, min(MAX_SHARE, IDLE_FRACTION * max(0.0, 1.0 - busy / wall)))


def smoothed_busy(previous: float | None, wall: float, busy: float) -> float | None:
    """The share of time the worker's thread was busy, averaged over about :data:`IDLE_WINDOW`
    seconds: ``previous`` (None: no reading yet) updated with ``busy`` seconds of the last
    ``wall``."""
    if wall <= 0:
        return previous
    now = min(1.0, max(0.0, busy / wall))
    if previous is None:
        return now
    return previous + (1.0 - math.exp(-wall / IDLE_WINDOW)) * (now - previous)


def _reach(state: dict, key: Any) -> None:
    _reached[id(state)].add(key)


def _reach_all(state: BinState) -> None:
    """The fold reached every key (it iterated): the copy is void; stop tracking this state."""
    _overflow.add(id(state))
    state.__class__ = BinState


class TrackedState(BinState):
    """A bin's state while it is pre-copied: a dict that records every key reached through it.

    Installed by switching the class of the bin's :class:`BinState` (same layout); switched back at
    the hand-over. Iterating or bulk-changing it marks every key reached (see the module docs).
    """

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        _reach(self, key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        """``dict.get``; records ``key`` as reached."""
        _reach(self, key)
        return dict.get(self, key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        _reach(self, key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        _reach(self, key)
        dict.__delitem__(self, key)

    def pop(self, key: Any, *default: Any) -> Any:
        """``dict.pop``; records ``key`` as reached."""
        _reach(self, key)
        return dict.pop(self, key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``dict.setdefault``; records ``key`` as reached."""
        _reach(self, key)
        return dict.setdefault(self, key, default)

    def __iter__(self) -> Any:
        _reach_all(self)
        return dict.__iter__(self)

    def keys(self) -> Any:
        """``dict.keys``; marks every key reached (the copy is void)."""
        _reach_all(self)
        return dict.keys(self)

    def values(self) -> Any:
        """``dict.values``; marks every key reached (the copy is void)."""
        _reach_all(self)
        return dict.values(self)

    def items(self) -> Any:
        """``dict.items``; marks every key reached (the copy is void)."""
        _reach_all(self)
        return dict.items(self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update``; marks every key reached (the copy is void)."""
        _reach_all(self)
        dict.update(self, *args, **kwargs)

    def popitem(self) -> Any:
        """``dict.popitem``; marks every key reached (the copy is void)."""
        _reach_all(self)
        return dict.popitem(self)

    def clear(self) -> None:
        """``dict.clear``; marks every key reached (the copy is void)."""
        _reach_all(self)
        dict.clear(self)

    def copy(self) -> dict:
        """A plain ``dict`` copy; marks every key reached (the copy is void)."""
        _reach_all(self)
        return dict.copy(self)

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]
        _reach_all(self)
        dict.update(self, other)
        return self

    def __copy__(self) -> BinState:  # copy.copy: the fold may change the values the copy shares
        _reach_all(self)
        return BinState(self)

    def __reduce__(self) -> Any:
        # Pickled (a checkpoint's BinDump, on its writer thread) as the plain state it is, without
        # reaching anything: not dict.copy(self), whose merge calls self.keys() (a dict subclass
        # overriding __iter__), which voided the copy and switched the class from that thread.
        # A view's items are read from the dict itself. (copy.deepcopy comes here too: its copy
        # shares no value with the bin, so it reaches nothing either.)
        return (BinState, (dict(dict.items(self)),))

    @classmethod
    def fromkeys(cls, iterable: Any, value: Any = None) -> BinState:
        """``dict.fromkeys``: a new plain :class:`BinState` (a new state is not tracked: made as a
        :class:`TrackedState`, it had no reached set)."""
        return cast(BinState, BinState.fromkeys(iterable, value))


class Copy:
    """One bin being (or done being) copied ahead to ``target``; a standby replica when ``replica``."""

    __slots__ = ("b", "target", "cap", "t0", "state", "items", "left", "entries", "nbytes", "seconds", "began",
                 "replica", "gen", "before", "refreshing", "rkeys", "rleft", "refreshes", "rentries", "rbytes", "sent",
                 "noted")

    def __init__(self, b: int, target: int, cap: Capability, state: BinState, replica: bool = False) -> None:
        self.b = b
        self.target = target
        self.cap: Capability | None = cap  # at t0 on the pre-copy output, until every chunk is sent
        self.t0 = cap.time
        self.state = state
        # The snapshot (a shallow copy, at C speed): what the target gets ahead; every key changed
        # after it is tracked from the same moment on.
        snapshot = dict.copy(state)
        self.left = len(snapshot)
        self.items = iter(snapshot.items())
        self.entries = 0
        self.nbytes = 0
        self.seconds = 0.0  # spent copying
        self.began = _time.monotonic()
        self.replica = replica
        # A replica's refreshes. `gen`: the time of the newest refresh sent (t0 before the first);
        # `before`: the keys it carries (reached between the previous refresh's snapshot and its
        # own), still owed to the target while it is not staged; `refreshing`/`rkeys`/`rleft`: the
        # refresh being sent, under its round's capability (PreCopier.round), and the keys left.
        self.gen = self.t0
        self.before: set = set()
        self.refreshing = False
        self.rkeys: Any = None
        self.sent = 0  # chunks sent, the copy's and its refreshes' (the end's record says how many)
        self.rleft = 0
        self.refreshes = 0
        self.rentries = 0
        self.rbytes = 0
        # The "skipped" reason last logged for a request of this copy again (PreCopier.start): the
        # same request repeated is logged once, not every time.
        self.noted: str | None = None

    @property
    def done(self) -> bool:
        """Every chunk has been sent."""
        return self.cap is None


class PreCopier:
    """F's side on one worker: the copies of bins this worker owns, sent as time allows."""

    def __init__(self, shared: Shared, chunk: int | None = None, budget: float | None = None,
                 min_entries: int | None = None, share: float | None = None, refresh: float | None = None) -> None:
        self.shared = shared
        self.chunk = CHUNK if chunk is None else chunk  # defaults: this module's, when built
        self.budget = BUDGET if budget is None else budget
        self.share = SHARE if share is None else share
        self.resume = 0.0  # perf_counter time before which no copying is done (the rate limit)
        self._latest = 0.0  # perf_counter time the last ``latest`` asked for comes (see step)
        # How long past the rate limit a slice waits for an idle worker before it runs anyway: as
        # long as the rate limit after the previous slice (at first, after a whole budget). A
        # slice cut short (it gave way) is followed by a short wait: the copy keeps its pace.
        self._grace = self.budget / self.share
        self._slice_end: tuple[float, tuple[float, float] | None] | None = None  # (perf_counter, thread times)
        self._busy: float | None = None  # the thread's busy share between slices (smoothed_busy)
        self.min_entries = MIN_ENTRIES if min_entries is None else min_entries
        self.refresh_every = REFRESH if refresh is None else refresh
        self.next_refresh = 0.0  # monotonic time of the next refresh round
        self.copies: dict[int, Copy] = {}
        self.active: set[int] = set()  # bins whose copy or refresh has chunks left to send
        self.replicas = 0  # copies that are replicas
        # The refresh round being sent: its capability (at a data time, on the copy edge), the
        # replicas it has still to visit (last first), and the `copied` probe's test.
        self.round: Capability | None = None
        self.round_bins: list[int] = []
        self.delivered: Callable[[Any], bool] = lambda t: False
        #: True when the worker has other work (``Activator.work_waiting``): a slice on an idle
        #: worker then ends after the chunk it is sending, once it ran :attr:`min_slice` (set by F;
        #: every slice sends one chunk at least). A slice run because it is overdue on a busy
        #: worker does not give way: it is what keeps such a worker copying at :attr:`share`.
        self.waiting: Callable[[], bool] = lambda: False
        self._gives_way = True  # the current slice ends when other work waits
        self.min_slice = MIN_SLICE
        self.max_arrears = MAX_ARREARS
        self._arrears = 0.0  # seconds the current slice may run beyond budget and min_slice (step)
        self._behind = False  # the last slice left chunks to send: time past `resume` is owed copying

    def _yield(self, began: float) -> bool:
        """The slice begun at ``began`` ends now: its :attr:`budget` is spent, or it ran
        :attr:`min_slice` and other work waits (each after its arrears: :meth:`step`)."""
        spent = _time.perf_counter() - began - self._arrears
        return spent > self.budget or (self._gives_way and spent > self.min_slice and self.waiting())

    @property
    def sending(self) -> bool:
        """Some copy or refresh round has chunks left: :meth:`step` has work."""
        return bool(self.active or self.round is not None)

    def start(self, b: int, target: int, cap: Capability, out: OperatorOutput, replica: bool = False) -> None:
        """Begin copying bin ``b`` to ``target`` (``cap``: at the request's time on the pre-copy
        output ``out``); ``replica``: keep the copy as a standby replica, refreshed until the bin moves.
        Bins this worker does not hold and small bins are not copied (they move whole). A bin
        copied to ``target`` already keeps that copy (which stays on as a replica when ``replica``);
        a copy or replica of it on another worker is dropped there, and the new one begins. A
        skipped request is logged (a ``"skipped"`` event); one repeated for a copy already there
        only once per copy and reason."""
        shared = self.shared
        bin_ = shared.bins[b]
        other = self.copies.get(b)
        ours = target != shared.index and shared.routing_table()[b] == shared.index
        reason = None
        quiet = False  # the same request for this copy was logged already
        if not ours:
            reason = "not held here"
        elif bin_ is None:
            reason = "not arrived yet (its move here is under way)"
        elif other is not None and other.target == target:
            reason = f"a {'replica' if other.replica else 'copy'} is on worker {target} already"
            if replica and not other.replica:  # the copy under way stays on as a replica
                other.replica = True
                self.replicas += 1
                reason += " (kept as a replica)"
            quiet = other.noted == reason
            other.noted = reason
        else:
            if other is not None:
                # The request moves the bin's copy to `target`: the one elsewhere gives way, and its
                # target drops it (also when no new copy is made below: a small bin, not rows).
                self._end(other)
                self._end_round_without_replicas()
                out.give_batch(cap, [self._drop_record(other)])
                shared.log({"kind": "replica" if other.replica else "precopy", "time": cap.time,
                            "bins": [b], "to": [other.target],
                            "dropped": "a copy to another worker was requested", "worker": shared.index})
            if not isinstance(bin_.state, BinState):  # (a TrackedState is one: the bin's copy elsewhere tracks it)
                reason = "state is not a dict of rows"
            elif len(bin_.state) < self.min_entries:
                reason = f"small ({len(bin_.state)} entries)"
        if reason is not None:
            cap.drop()
            if target != shared.index and (bin_ is not None or ours) and not quiet:
                shared.log({"kind": "precopy", "time": cap.time, "bins": [b], "to": [target],
                            "skipped": reason, "worker": shared.index, "replica": replica})
            return
        assert bin_ is not None
        self._begin(b, target, cap, bin_.state, replica)

    def _end(self, copy: Copy) -> tuple[set, bool]:
        """Stop ``copy`` (its bin leaves, or another copy replaces it): no more chunks, no more
        tracking. The keys reached since its snapshot, and whether the fold iterated the bin."""
        del self.copies[copy.b]
        self.active.discard(copy.b)
        self.replicas -= copy.replica
        copy.refreshing = False
        if copy.cap is not None:
            copy.cap.drop()
            copy.cap = None
        return self._untrack(copy)

    def close(self) -> None:
        """End every copy and replica (no move can use them: the control input has ended), and the
        refresh round; what their targets staged goes with the dataflow."""
        for copy in list(self.copies.values()):
            self._end(copy)
            self.shared.log({"kind": "replica" if copy.replica else "precopy", "time": copy.t0, "bins": [copy.b],
                             "to": [copy.target], "dropped": "the control input has ended",
                             "worker": self.shared.index})
        self._end_round_without_replicas()

    def _drop_record(self, copy: Copy) -> tuple:
        """The copy-edge record telling ``copy``'s target to drop it: (target, bin, no payload,
        identity, chunks sent)."""
        return (copy.target, copy.b, None, (copy.t0, self.shared.index), copy.sent)

    def _begin(self, b: int, target: int, cap: Capability, state: BinState, replica: bool) -> None:
        self.shared.thaw(b)  # a checkpoint's dump of the bin first (megaphone.checkpoint.BinDump)
        _overflow.discard(id(state))  # a mark left from an earlier copy (or an object with its id) is stale
        copy = self.copies[b] = Copy(b, target, cap, state, replica)  # the snapshot, while the state is a plain BinState
        self.active.add(b)
        self.replicas += replica
        self._track(copy, set())
        if not self.shared.records_keys:
            state.__class__ = TrackedState

    def _track(self, copy: Copy, keys: set) -> None:
        """From now on, record the keys of ``copy``'s bin reached in ``keys``: S's record path does
        (``Shared.records_keys``: ``state_machine``), else the bin's :class:`TrackedState`."""
        if self.shared.records_keys:
            self.shared.tracked[copy.b] = keys
        else:
            _reached[id(copy.state)] = keys

    def _reached(self, copy: Copy) -> set:
        """The keys of ``copy``'s bin reached since its copy's (or last refresh's) snapshot."""
        if self.shared.records_keys:
            return self.shared.tracked.get(copy.b, set())
        return _reached.get(id(copy.state), set())

    def _untrack(self, copy: Copy) -> tuple[set, bool]:
        """Stop tracking ``copy``'s bin; the keys reached, and whether the fold iterated the bin."""
        if self.shared.records_keys:
            return self.shared.tracked.pop(copy.b, set()), False
        state = copy.state
        key = id(state)
        whole = key in _overflow
        _overflow.discard(key)
        if type(state) is TrackedState:
            state.__class__ = BinState  # type: ignore[assignment]
        return _reached.pop(key, set()), whole

    def refresh_due(self) -> bool:
        """A refresh round of the replicas is due (cheap: called on every activation of F)."""
        return self.replicas > 0 and _time.monotonic() >= self.next_refresh

    def refresh(self, cap: Capability, delivered: Callable[[Any], bool]) -> None:
        """Start a refresh round at ``cap``'s time (a data time, on the copy edge; kept until the
        round is sent): :meth:`step` then visits the replicas one by one, paced as the copies are,
        and refreshes each whose previous refresh (or copy) is staged (``delivered(time)``) and
        whose bin changed since. A replica whose tracking was voided (the fold iterated the bin)
        is copied again instead. A round still being sent makes this one skipped (``cap`` dropped)."""
        self.next_refresh = _time.monotonic() + self.refresh_every
        self.delivered = delivered
        if self.round is not None:
            cap.drop()
            return
        self.round = cap
        self.round_bins = sorted((b for b, c in self.copies.items() if c.replica), reverse=True)

    def _visit(self, b: int, out: OperatorOutput, began: float) -> bool:
        """Refresh replica ``b`` in the current round if it is due; False once the slice's time is up."""
        round_ = self.round
        assert round_ is not None
        copy = self.copies.get(b)
        if copy is None or not copy.replica or not copy.done or copy.refreshing or not self.delivered(copy.gen):
            return True
        if id(copy.state) in _overflow:  # the tracking is void: a new copy (the staged one is dropped)
            self._end(copy)
            out.give_batch(round_, [self._drop_record(copy)])
            self.shared.log({"kind": "replica", "time": round_.time, "bins": [b], "to": [copy.target],
                             "recopy": "the fold iterated over the bin", "worker": self.shared.index})
            self._begin(b, copy.target, round_.delayed(round_.time), copy.state, True)
            return True
        reached = self._reached(copy)
        if not reached:
            return True
        self._track(copy, set())  # the refresh's snapshot: changes from now on are the next one's
        copy.before = reached
        # One chunk: the set itself (it is never changed again); more: an iterator over its keys.
        copy.rkeys = reached if len(reached) <= self.chunk else iter(list(reached))
        copy.rleft = len(reached)
        copy.gen = round_.time
        copy.refreshing = True
        self.active.add(b)
        return self._refresh_chunks(copy, out, began)

    def _refresh_chunks(self, copy: Copy, out: OperatorOutput, began: float) -> bool:
        """Send ``copy``'s refresh chunks: the keys' values now (newer than its snapshot is fine:
        a key changed since is tracked for the next refresh, and sent again), deletions by name.
        False once the slice's time is up."""
        codec = self.shared.codec
        assert self.round is not None  # (a round ends only once none of its refreshes has chunks left)
        while copy.rleft > 0:
            keys = copy.rkeys if type(copy.rkeys) is set else list(islice(copy.rkeys, self.chunk))
            copy.rleft -= len(keys)
            part, deleted = gather(copy.state, keys)  # one lookup a key, not TrackedState's: reaches nothing
            payload = codec.pack(part, [])
            # The deleted keys travel pickled, as the state's do (a key need not be msgpack's: a date).
            gone = pickle.dumps(deleted, protocol=pickle.HIGHEST_PROTOCOL) if deleted else b""
            out.give_batch(self.round, [(copy.target, copy.b, payload, (copy.t0, self.shared.index), gone)])
            copy.sent += 1
            copy.rentries += len(keys)
            copy.rbytes += codec.nbytes(payload)
            if self._yield(began):
                if copy.rleft == 0:
                    self._refreshed(copy)
                return False
        self._refreshed(copy)
        return True

    def _refreshed(self, copy: Copy) -> None:
        copy.refreshing = False
        copy.rkeys = None
        copy.refreshes += 1
        self.active.discard(copy.b)

    def _end_round_without_replicas(self) -> None:
        """A round with no replica left to visit ends now (its capability with it)."""
        if self.round is not None and self.replicas == 0:  # (only replicas refresh)
            self.round.drop()
            self.round = None
            self.round_bins = []

    def replica_status(self) -> dict[int, dict[str, Any]]:
        """The standby replicas of bins held here: ``{bin: {"worker", "staged", "refreshes",
        "entries", "bytes", "pending"}}`` (``staged``: the first copy was sent in full; ``entries``
        and ``bytes``: sent by refreshes so far; ``pending``: keys changed since the last refresh)."""
        return {b: {"worker": c.target, "staged": c.done, "refreshes": c.refreshes, "entries": c.rentries,
                    "bytes": c.rbytes, "pending": len(self._reached(c))}
                for b, c in self.copies.items() if c.replica}

    def step(self, out: OperatorOutput, busy: bool = False) -> tuple[float, float | None] | None:
        """Send chunks for at most :attr:`budget` seconds, unless the rate limit says wait, or the
        worker is ``busy`` (records came in this activation: they go first); while some copy still
        has chunks, ``(idle, latest)``: come back on an idle worker after ``idle`` seconds, and
        after ``latest`` seconds (``None``: as already asked) even if the worker is never idle.

        When: a slice runs when the worker has nothing else to do (``Activator.activate_when_idle``),
        so that no record waits behind it, except a record that arrives during it (at most
        :attr:`budget`). A slice that has waited beyond the rate limit for an idle worker as long as
        that limit lasted (``spent / share`` after a slice of ``spent`` seconds, at the share it
        was paced at; at first :attr:`budget` / :attr:`share`) runs at the next activation all the
        same: a worker that is never idle still copies, at about half of :attr:`share`, one whose
        thread is idle but whose every activation routes records at about half of its paced share,
        and a slice that gave way early is followed by a short wait.

        The rate limit: a slice of ``spent`` seconds is followed by ``spent / share - spent`` without
        copying, where ``share`` is :attr:`share` or, if more, :data:`IDLE_FRACTION` of the share of
        time this worker's thread was idle between slices over the last :data:`IDLE_WINDOW` or so
        (neither running nor waiting for a CPU: a worker that waits for a core taken by others is
        not idle), at most
        :data:`MAX_SHARE`. A busy worker copies at about half of :attr:`share`; an idle one up to
        ``MAX_SHARE / share`` times as fast (5x by default), in slices of :attr:`budget` that delay a record by at most that.

        A slice on an idle worker that comes later than the rate limit allowed, while the copy had
        chunks left, runs its arrears first (the time since the limit ended times the paced share,
        at most :attr:`max_arrears`) before it counts its budget or gives way: otherwise, where idle
        moments come less often than the limit allows, the copy would go at a chunk per idle moment."""
        began = _time.perf_counter()
        overdue = self.resume + self._grace
        if began < self.resume or (busy and began < overdue):
            # Not due (on a busy worker: not overdue): come back when idle, and at the latest when
            # overdue. The latter is asked for once per rate limit: a copy begun after the
            # previous slice had sent everything (no ``latest`` pending) must not wait for an idle
            # moment that a worker never idle, routing no records here, would never have.
            if self._latest < overdue:
                self._latest = overdue
                return max(0.0, self.resume - began), overdue - began
            return max(0.0, self.resume - began), None
        self._gives_way = not busy  # (busy here: overdue, it runs its budget whatever waits)
        share = self.share
        last = self._slice_end
        times = _thread_times()
        if last is not None and last[1] is not None and times is not None:
            self._busy = smoothed_busy(self._busy, began - last[0],
                                       (times[0] - last[1][0]) + (times[1] - last[1][1]))
            if self._busy is not None:
                share = paced_share(share, 1.0, self._busy)
        # Arrears: a slice on an idle worker that comes later than its rate limit allowed (no idle
        # moment came sooner) may also copy what the pace allowed meanwhile, up to max_arrears; a
        # copy that had sent everything owes nothing for the time it had nothing to send.
        self._arrears = 0.0
        if self._gives_way and self._behind:
            self._arrears = min(self.max_arrears, max(0.0, began - self.resume) * share)
        try:
            more = self._send(out, began)
        finally:
            end = _time.perf_counter()
            self.resume = began + (end - began) / share  # this slice, then (1 - share) of idle copying
            self._grace = (end - began) / share
            self._slice_end = (end, _thread_times())
            self._arrears = 0.0
        self._behind = more is not None
        if more is None:
            return None
        wait = self.resume - end
        self._latest = self.resume + self._grace
        return wait, wait + self._grace

    def _send(self, out: OperatorOutput, began: float) -> float | None:
        codec = self.shared.codec
        me = self.shared.index
        for b in sorted(self.active):
            copy = self.copies[b]
            if copy.cap is not None:
                first = copy.nbytes == 0  # (an empty bin sends one empty chunk)
                while copy.left > 0 or first:  # at least one chunk: it makes the target stage the bin
                    first = False
                    t = _time.perf_counter()
                    part = dict(islice(copy.items, self.chunk))
                    copy.left -= len(part)
                    payload = codec.pack(part, [])
                    out.give_batch(copy.cap, [(copy.target, copy.b, payload, (copy.t0, me))])
                    copy.sent += 1
                    copy.entries += len(part)
                    copy.nbytes += codec.nbytes(payload)
                    copy.seconds += _time.perf_counter() - t
                    if self._yield(began):
                        return 0.0
                copy.cap.drop()
                copy.cap = None
                copy.items = iter(())
                self.shared.log({"kind": "precopy", "time": copy.t0, "bins": [copy.b], "to": [copy.target],
                                 "entries": copy.entries, "bytes": copy.nbytes, "seconds": copy.seconds,
                                 "wall": _time.monotonic() - copy.began, "worker": me,
                                 "replica": copy.replica})
            elif copy.refreshing:
                if not self._refresh_chunks(copy, out, began):
                    return 0.0
                continue
            self.active.discard(b)
        # The refresh round: the replicas not visited yet, as the slice's time allows.
        while self.round is not None:
            if not self.round_bins:
                self.round.drop()
                self.round = None
                break
            if not self._visit(self.round_bins.pop(), out, began) or self._yield(began):
                return 0.0
        return 0.0 if self.active else None  # (a replica copied again, in the round, has chunks left)

    def hand_over(self, b: int, bin_: Bin, target: int,
                  delivered: Callable[[Any], bool]) -> tuple[bytes | None, Copy | None, str]:
        """Bin ``b`` leaves for ``target`` now: stop its copy, if any (``delivered(t0)``: every copy
        requested at ``t0`` is staged). Returns the delta's payload (``None``: move it whole), the
        copy, and the reason for a whole move of a copied bin."""
        copy = self.copies.get(b)
        if copy is None:
            return None, None, ""
        done = copy.done
        state = copy.state
        reached, whole = self._end(copy)
        if copy.gen != copy.t0 and not delivered(copy.gen):
            reached |= copy.before  # a refresh not staged yet: its keys are owed too
        # Only now: the round's capability is what says a refresh with chunks left is not staged.
        self._end_round_without_replicas()
        if copy.target != target:
            return None, copy, f"the copy went to worker {copy.target}"
        if not done:
            return None, copy, "the copy was not done"
        if not delivered(copy.t0):
            return None, copy, "the copy was not staged yet"
        if whole:
            return None, copy, "the fold iterated over the bin"
        if len(reached) > MAX_DELTA_FRACTION * max(len(state), 1):
            return None, copy, f"{len(reached)} of {len(state)} keys changed during the copy"
        updates, deleted = gather(state, reached)
        return pickle.dumps((updates, deleted, bin_.pending_timers()), protocol=pickle.HIGHEST_PROTOCOL), copy, ""


class Staging:
    """S's side on one worker: copies received ahead, per bin and copy, until their hand-over."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        # bin -> {copy identity (its t0 and source worker): state so far}. A bin has more than one
        # copy here only briefly: its old owner's, not ended yet, beside its new owner's. They are
        # kept apart, not ordered by t0: a replica copied again at a refresh round's data time may
        # have a later t0 than the new owner's copy requested at a control time after the bin left.
        self.staged: dict[int, dict[tuple[Any, int], BinState]] = {}
        # Per (bin, copy): the chunks received so far, of copies not ended or ended with chunks
        # still in flight. Per bin: the copies of several bins requested at one time from one
        # worker share their identity.
        self.received: dict[tuple[int, tuple[Any, int]], int] = {}
        # (bin, copy) installed or dropped with chunks still in flight: how many it sent in all.
        # Its later chunks are ignored; it is forgotten once they have all come.
        self.ended: dict[tuple[int, tuple[Any, int]], int] = {}

    def chunk(self, b: int, payload: Any, ident: tuple[Any, int], deleted: bytes = b"") -> None:
        """Stage one chunk of the copy ``ident`` (its time and source worker) of bin ``b``: entries,
        and for a replica's refresh the keys ``deleted`` since. A chunk of a copy already installed
        or dropped is ignored (a refresh not yet staged at its hand-over may arrive after it). Every
        copy is staged apart until its own end (a delta or a drop), whatever the order its chunks
        and other copies' come in (timely delivers different times in any order)."""
        ident = tuple(ident)  # a list after crossing processes
        key = (b, ident)
        n = self.received[key] = self.received.get(key, 0) + 1
        sent = self.ended.get(key)
        if sent is not None:
            if n >= sent:  # the last chunk in flight: nothing more of this copy can come
                del self.ended[key], self.received[key]
            return
        copies = self.staged.setdefault(b, {})
        state = copies.get(ident)
        if state is None:
            state = copies[ident] = BinState()
        part, _ = self.shared.codec.unpack(payload)
        state.update(part)
        for k in pickle.loads(deleted) if deleted else ():
            state.pop(k, None)

    def _unstage(self, b: int, ident: tuple[Any, int]) -> BinState | None:
        """Remove (and return) the copy ``ident`` of bin ``b`` staged here, if any."""
        copies = self.staged.get(b)
        if copies is None:
            return None
        state = copies.pop(ident, None)
        if not copies:
            del self.staged[b]
        return state

    def _end(self, b: int, ident: tuple[Any, int], sent: int) -> None:
        """The copy ``ident`` of bin ``b`` ended after sending ``sent`` chunks."""
        key = (b, ident)
        if self.received.get(key, 0) >= sent:
            self.received.pop(key, None)
        else:
            self.ended[key] = sent

    def drop(self, b: int, ident: tuple[Any, int], sent: int) -> None:
        """The copy ``ident`` of bin ``b``, of ``sent`` chunks, will not be used (the bin moved
        whole, or a copy elsewhere replaced it)."""
        ident = tuple(ident)
        self._unstage(b, ident)
        self._end(b, ident, sent)

    def discard(self, b: int) -> None:
        """Bin ``b`` arrived whole: every copy staged for it is stale (their ends still come)."""
        self.staged.pop(b, None)

    def install(self, b: int, payload: bytes, ident: tuple[Any, int], sent: int) -> tuple[BinState, list, int]:
        """The state of bin ``b``: its staged copy (of ``sent`` chunks) with the delta ``payload``
        applied; its timers; the entries the delta carried."""
        ident = tuple(ident)
        state = self._unstage(b, ident)
        if state is None:
            raise MegaphoneError(f"'{self.shared.name}': worker {self.shared.index} got the hand-over of bin {b} "
                                 f"without its copy ahead {ident!r}")
        self._end(b, ident, sent)  # a refresh still in flight must not reach the installed bin
        updates, deleted, timers = pickle.loads(payload)
        state.update(updates)
        for k in deleted:
            state.pop(k, None)
        return state, timers, len(updates) + len(deleted)
