"""Bins and what F and S of one worker share: the bins held here, the configuration history, and
the migration log (Python objects in one process, as the paper's shared pointer)."""
from __future__ import annotations

import pickle
from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from timely import Activator, TimelyError, Worker

from .table import Table, balanced

if TYPE_CHECKING:
    from .checkpoint import BinCheckpoint
    from .precopy import PreCopier


#: The migration events a worker's log (``Shared.events``, ``Migratable.events``) keeps: the newest.
#: Read when an operator is built (set ``megaphone.bins.MAX_EVENTS`` before building the dataflow;
#: ``None``: every event). The metrics' migration totals count every event, whatever the log keeps.
MAX_EVENTS: int | None = 10_000
#: The bins the events in that log may name in all (their ``"bins"``), past which the oldest leave
#: too (the newest event always stays): an event names every bin it moved, some 45 bytes each, so
#: at 2^16 bins a log of whole-table moves would otherwise hold gigabytes. Read when an operator is
#: built, as ``MAX_EVENTS``; ``None``: no such bound.
MAX_EVENT_BINS: int | None = 1_000_000

#: The ``kind`` of the events that the migration counters of :meth:`Shared.metrics` total.
_COUNTED = ("install", "extract")


class MegaphoneError(TimelyError, RuntimeError):
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
    """One bin on its current owner: its ``state`` (made, shipped and installed by the operator's
    :class:`StateCodec`) and pending ``timers``."""

    __slots__ = ("state", "timers")

    def __init__(self, state: Any) -> None:
        self.state = state
        self.timers: list[tuple[Any, int, Any]] = []  # heap of (time, sequence, payload)

    def pending_timers(self) -> list[tuple[Any, Any]]:
        """The ``(time, payload)`` of the bin's timers, in the order they fire (as they travel)."""
        return [(t, p) for t, _, p in sorted(self.timers, key=itemgetter(0, 1))]


class StateCodec:
    """How the state of a bin is made, cut into bounded chunks, shipped and installed.

    This one is the row operators': a :class:`BinState` dict, shipped in chunks of at most ``chunk``
    entries, each pickled with the bin's timers as one ``bytes`` payload (the fastest form to write
    and read back). :class:`megaphone.columns.ColumnCodec` ships Arrow record batches instead.
    A payload is whatever the state records may carry (bytes, or msgpack-able values).
    """

    def empty(self) -> Any:
        """The state of a bin that holds nothing yet."""
        return BinState()

    def size(self, part: Any) -> int:
        """Entries in a state or chunk (for the migration events)."""
        return len(part)

    def chunks(self, state: Any, chunk: int) -> list[Any]:
        """``state`` in parts of at most ``chunk`` entries: at least one part, even when empty (the
        first carries the timers and makes the receiver hold the bin)."""
        if len(state) <= chunk:
            return [dict(state)]
        it = iter(state.items())
        return [dict(islice(it, chunk)) for _ in range(0, len(state), chunk)]

    def pack(self, part: Any, timers: list) -> Any:
        """One chunk and ``timers`` (``(time, payload)`` pairs) as a state record's payload."""
        return pickle.dumps((part, timers), protocol=5)

    def unpack(self, payload: Any) -> tuple[Any, list]:
        """The ``(part, timers)`` of a payload of :meth:`pack`."""
        part, timers = pickle.loads(payload)
        return part, timers

    def nbytes(self, payload: Any) -> int:
        """Bytes of a payload (for the migration events)."""
        return len(payload)

    def install(self, state: Any, part: Any) -> Any:
        """``state`` with the chunk ``part`` added (a bin's chunks arrive one by one)."""
        state.update(part)
        return state

    def dumps(self, state: Any, timers: list) -> bytes:
        """A whole bin (``state`` and its ``(time, payload)`` timers) as bytes for a checkpoint: a
        copy, which the bin may change after. By default :meth:`pack`'s payload (a pickle)."""
        return self.pack(state, timers)

    def loads(self, data: bytes) -> tuple[Any, list]:
        """The ``(state, timers)`` of bytes of :meth:`dumps`: a bin's whole state, ready to hold."""
        return self.unpack(data)

    def merged(self, states: Sequence[Any]) -> Any:
        """The states of several bins as one (:meth:`megaphone.Migratable.state`)."""
        merged: dict = {}
        for state in states:
            # dict's own items: reading a bin copied ahead (a TrackedState) must not count as the
            # fold iterating it, which would void its copy (megaphone.precopy)
            merged.update(dict.items(state))
        return merged


#: The codec of the row operators (``unary``, ``binary``, ``state_machine``).
ROWS = StateCodec()


class Shared:
    """What F and S of one worker share: bins, the configuration history, and the migration log."""

    def __init__(self, name: str, k: int, index: int, peers: int, codec: StateCodec = ROWS,
                 initial: Table | None = None) -> None:
        self.name = name
        self.codec = codec
        self.k = k
        self.nbins = 1 << k
        self.index = index
        self.peers = peers
        table = balanced(self.nbins, peers) if initial is None else initial
        # Configurations compiled so far, ascending by time: (time, table). The first is in force
        # from the beginning of time.
        self.config_times: list[Any] = [0]
        self.config_tables: list[Table] = [table]
        self.bins: list[Bin | None] = [Bin(codec.empty()) if w == index else None for w in table]
        self.timer_bins: dict[Any, set[int]] = defaultdict(set)  # time -> bins with a timer then
        # The migration log: the newest MAX_EVENTS events, naming MAX_EVENT_BINS bins at most
        # (append with log()); `counters` totals the installs and extracts since the start, also
        # those the log no longer holds.
        self.events: deque[dict] = deque()
        self.max_events, self.max_event_bins = MAX_EVENTS, MAX_EVENT_BINS
        self._event_bins = 0  # the bins the events in the log name
        self.counters: dict[str, Any] = {"installs": 0, "install_bytes": 0, "install_seconds": 0.0,
                                         "extracts": 0, "extract_bytes": 0, "extract_seconds": 0.0}
        self.s_activator: Activator | None = None  # schedules S (set when S is built)
        self.precopier: PreCopier | None = None  # F's copies ahead and replicas (set when F is built)
        # True where S's record path records the state keys each record reaches (state_machine: its
        # key) in `tracked`, per bin being copied ahead or replicated (megaphone.precopy).
        self.records_keys = False
        self.tracked: dict[int, set] = {}
        self.left_times: list[Any] = []  # times of timers shipped away, until S rechecks their capabilities
        # With checkpoints (megaphone.checkpoint): the bins changed since their last offer (state or
        # timers touched by S, or installed by a migration), and the participant. None without.
        self.dirty: set[int] | None = None
        # With checkpoints, per dirty bin the state keys changed since its last offer, where known
        # (state_machine records them; None: unknown, the bin is offered whole).
        self.changed: dict[int, set | None] | None = None
        self.checkpoint: BinCheckpoint | None = None
        # With checkpoints, the bins offered whole and not yet serialised (megaphone.checkpoint.BinDump):
        # thaw(b) before anything changes bin b's state.
        self.frozen: dict[int, Callable[[], bytes]] = {}
        # Load (timely.metrics, megaphone.autobalance): records S applied per bin, counted by
        # routing.bins_of in the pass that computes the bins.
        self.bin_records = np.zeros(self.nbins, dtype=np.int64)
        # Named `name`, numbered by the worker if an earlier operator of this worker had the name
        # ("StateMachine #2": every worker builds them in the same order, so all agree).
        self.metrics_name = name
        records, counters = self.bin_records, self.counters  # (not self: the source is held weakly)
        # Once this is collected (its dataflow completed), the worker reports these final counts in
        # its place: the per-bin and migration counters never go backwards (bins held: none).
        self.metrics_final: Callable[[], dict[str, Any]] = lambda: {
            "kind": "bins", "records": records.tolist(), "state": [0] * len(records), "owned": [],
            "counters": dict(counters)}
        Worker.add_metrics_source(self)

    def metrics(self) -> dict[str, Any]:
        """This worker's figures for :mod:`timely.metrics` (a "bins" source): records applied per bin
        (cumulative), state entries per bin held here, the bins held, and migration counters."""
        size = self.codec.size
        bins = list(self.bins)
        return {"kind": "bins", "records": self.bin_records.tolist(),
                "state": [0 if b is None else int(size(b.state)) for b in bins],
                "owned": [i for i, b in enumerate(bins) if b is not None], "counters": dict(self.counters)}

    def log(self, event: dict) -> None:
        """Append ``event`` to the migration log (the oldest leave past ``MAX_EVENTS`` events or
        ``MAX_EVENT_BINS`` bins named), counting an install's or extract's bytes and seconds in
        :attr:`counters`."""
        kind = event.get("kind")
        if kind in _COUNTED:
            counters = self.counters
            counters[kind + "s"] += 1
            counters[kind + "_bytes"] += int(event.get("bytes", 0))
            counters[kind + "_seconds"] += float(event.get("seconds", 0.0))
        events = self.events
        if not events:
            self._event_bins = 0  # (a reader may have emptied it)
        events.append(event)
        self._event_bins += len(event.get("bins", ()))
        most, limit = self.max_events, self.max_event_bins
        while events and ((most is not None and len(events) > most)
                          or (limit is not None and self._event_bins > limit and len(events) > 1)):
            self._event_bins -= len(events.popleft().get("bins", ()))

    def thaw(self, b: int) -> None:
        """Bin ``b`` is about to change: serialise it first if a checkpoint still needs its state
        at the cut (copy on write). A no-op for the other bins."""
        dump = self.frozen.get(b)
        if dump is not None:
            dump()  # removes it from frozen

    def install_part(self, b: int, part: Any) -> Bin:
        """Add the chunk ``part`` of bin ``b``, moving here whole (its first chunk makes the bin);
        return the bin.

        A copy of the bin may be under way already (megaphone.precopy: asked for at a later time,
        compiled before every chunk arrived): the chunk's keys changed since its snapshot, so the
        keys ``state_machine`` tracks get them (a :class:`~megaphone.precopy.TrackedState` voids
        its copy by itself on the bulk update)."""
        bin_ = self.bins[b]
        if bin_ is None:
            bin_ = self.bins[b] = Bin(self.codec.empty())
        self.thaw(b)
        bin_.state = self.codec.install(bin_.state, part)
        tracked = self.tracked.get(b) if self.tracked else None
        if tracked is not None:
            tracked.update(part)  # a chunk of a dict state: its keys
        return bin_

    def table_at(self, time: Any) -> Table:
        """The routing table in force at ``time`` (ARCHITECTURE 5.3: records route by their own time)."""
        return self.config_tables[bisect_right(self.config_times, time) - 1]

    def routing_table(self) -> Table:
        """The newest compiled routing table (bin -> worker)."""
        return self.config_tables[-1]

    def take_bin(self, b: int) -> Bin:
        """Remove bin ``b`` from this worker (its timers leave the timer index)."""
        bin_ = self.bins[b]
        if bin_ is None:
            raise MegaphoneError(f"'{self.name}': worker {self.index} was to ship bin {b}, which it does not hold")
        self.bins[b] = None
        if self.dirty is not None:
            self.dirty.discard(b)  # offered up to now by the checkpoint's cut; the new owner marks it
        if self.changed is not None:
            self.changed.pop(b, None)
        if self.checkpoint is not None:
            self.checkpoint.left(b)
        for t, _, _ in bin_.timers:
            self.left_times.append(t)
            bins_at = self.timer_bins.get(t)
            if bins_at is not None:
                bins_at.discard(b)
                if not bins_at:
                    del self.timer_bins[t]
        return bin_

    def bin_for_record(self, b: int, t: Any) -> Bin:
        """Bin ``b``, which a record at time ``t`` was routed here for (ARCHITECTURE 5.3: this worker holds it)."""
        bin_ = self.bins[b]
        if bin_ is None:
            raise MegaphoneError(
                f"'{self.name}': records of bin {b} at time {t!r} reached worker {self.index}, which does not "
                "hold the bin (routing invariant violated)"
            )
        return bin_
