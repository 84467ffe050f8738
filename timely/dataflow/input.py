"""Inputs, probes, captures and loop handles: how a worker's driver code talks to a running dataflow."""
from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..progress.frontier import Frontier
from ..progress.timestamp import Summary, less_equal

if TYPE_CHECKING:  # pragma: no cover
    from .builder import OperatorBuilder
    from .capability import Capability
    from .handles import OperatorInput, OperatorOutput
    from .scope import Scope, Stream


class InputHandle:
    """Feeds records into a dataflow at the current epoch ``time``; ``stream`` carries them.

    ``send``/``send_batch`` add records at ``time``; ``advance_to(t)`` promises no more records
    before ``t``; ``close()`` promises no more records at all.
    """

    def __init__(self, name: str, output: OperatorOutput, cap: Capability, stream: Stream) -> None:
        self.name = name
        self.stream = stream
        self._out = output
        self._cap: Capability | None = cap
        self._buffer: list = []
        self._closed_at: Any = None
    @property
    def time(self) -> Any:
        """The epoch at which records are sent now."""
        return self._cap.time if self._cap is not None else self._closed_at

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._cap is None

    def _open(self) -> Capability:
        """The input's capability; raises if the input is closed."""
        if self._cap is None:
            raise InputError(f"input '{self.name}' is closed")
        return self._cap

    def send(self, record: Any) -> None:
        """Send one record at the current time."""
        self._open()
        self._buffer.append(record)
        if len(self._buffer) >= 4096:
            self.flush()

    def send_batch(self, records: Sequence) -> None:
        """Send many records at the current time.

        A list is handed over as is, not copied (as every batch inside the dataflow): the caller
        must not mutate it afterwards. Other sequences are copied into a list; one with a
        ``tolist()`` (a numpy array, a pandas series) through it, so its records are Python objects.
        """
        cap = self._open()
        if type(records) is not list:
            if hasattr(records, "columns") and hasattr(records, "itertuples"):  # (iterating one gives its column names)
                raise InputError(f"input '{self.name}': send_batch got a DataFrame, not a sequence of records: "
                                 "send df.itertuples(index=False, name=None) for its rows as tuples")
            tolist = getattr(records, "tolist", None)
            records = tolist() if callable(tolist) else list(records)
        if self._buffer:
            self._buffer.extend(records)
            self.flush()
        elif records:
            self._out.give_batch(cap, records)

    def flush(self) -> None:
        """Push buffered records into the dataflow."""
        if self._buffer:
            buf, self._buffer = self._buffer, []
            self._out.give_batch(self._open(), buf)

    def advance_to(self, time: Any) -> None:
        """Move the input's epoch forward to ``time``; earlier epochs can complete. An integer of
        another type (numpy's ``int64``) becomes an ``int``; a bool is refused."""
        cap = self._open()
        if isinstance(time, bool) or type(cap.time) is int and not isinstance(time, numbers.Integral):
            raise InputError(f"input '{self.name}': advance_to needs an integer epoch, not {type(time).__name__} {time!r}")
        if type(cap.time) is int:
            time = int(time)
        if not less_equal(cap.time, time):
            raise InputError(f"input '{self.name}': advance_to({time!r}) would move time backwards from {cap.time!r}")
        self.flush()
        cap.downgrade(time)

    def close(self) -> None:
        """No more records: release the input's capability (idempotent)."""
        if self._cap is None:
            return
        self.flush()
        self._closed_at = self._cap.time
        self._cap.drop()
        self._cap = None


class ProbeHandle:
    """Observes the frontier of one or more streams: which times may still appear there."""

    def __init__(self) -> None:
        self._frontiers: list[Frontier] = []  # one per probed stream (the probe operators' inputs)
        self._watchers: list[Any] = []  # activators scheduled whenever the frontier changes
        self._seen: list[Any] | None = None  # the frontier the watchers last heard of
        self._interest: list[Callable[[bool], None]] = []  # the probe operators' frontier interest

    def _attach(self, frontier: Frontier, interest: Callable[[bool], None]) -> None:
        """Add a probed stream's frontier (called by ``Stream.probe_with``). Its probe operator is
        scheduled on frontier changes (``interest``) only once the handle has watchers: reading the
        frontier needs no operator to run, and an unwatched probe run at every epoch did nothing."""
        self._frontiers.append(frontier)
        self._interest.append(interest)
        interest(bool(self._watchers))

    def _observe(self) -> None:
        """Wake the watchers if the frontier moved since they last heard (called by the probe operators)."""
        if self._watchers:
            now = self.frontier.elements()
            if now != self._seen:
                self._seen = now
                for a in self._watchers:
                    a.activate()

    def watch(self, activator: Any) -> None:
        """Schedule ``activator`` (an operator's ``info.activator``) whenever this frontier changes."""
        self._watchers.append(activator)
        for interest in self._interest:
            interest(True)

    @property
    def frontier(self) -> Frontier:
        """The minimal times that may still appear (a live, read-only view; empty: complete)."""
        return self._frontiers[0] if len(self._frontiers) == 1 else Frontier.union(self._frontiers)

    def less_than(self, time: Any) -> bool:
        """True while some time strictly before ``time`` may still appear."""
        return any(f.less_than(time) for f in self._frontiers)

    def less_equal(self, time: Any) -> bool:
        """True while some time at or before ``time`` may still appear."""
        return any(f.less_equal(time) for f in self._frontiers)

    def done(self) -> bool:
        """True once no further time may appear."""
        return all(f.is_empty() for f in self._frontiers)

    def __repr__(self) -> str:
        return f"ProbeHandle(frontier={self.frontier.elements()!r})"


class LoopHandle:
    """The entry of a feedback edge, closed by ``stream.connect_loop(handle)``."""

    def __init__(self, scope: Scope, builder: OperatorBuilder, output: OperatorOutput, summary: Summary,
                 name: str) -> None:
        self.scope = scope
        self.builder = builder
        self.output = output
        self.summary = summary
        self.name = name
        self.connected = False


class Captured:
    """The ``(time, records)`` a worker saw on a captured stream."""

    def __init__(self) -> None:
        self.batches: list[tuple[Any, list]] = []

    def take(self, inp: OperatorInput) -> None:
        """Sink logic: keep every batch of ``inp``."""
        for cap, batch in inp:
            self.batches.append((cap.time, list(batch)))

    def extract(self) -> list[tuple[Any, list]]:
        """Records grouped by time, times ascending, records sorted within a time when possible."""
        by_time: dict[Any, list] = defaultdict(list)
        for t, batch in self.batches:
            by_time[t].extend(batch)
        out = []
        for t in sorted(by_time):
            recs = by_time[t]
            try:
                recs = sorted(recs)
            except TypeError:
                pass
            out.append((t, recs))
        return out

    def records(self) -> list:
        """Every record, regardless of time."""
        return [r for _, b in self.batches for r in b]
