"""The handles an operator's logic works with: read an input, write an output, await times.

``for cap, batch in input`` drains the batches queued at an input (each with an
:class:`InputCapability`); ``output.session(cap).give(x)`` / ``output.give_batch(cap, xs)`` send
at a capability's time; a :class:`Notificator` delivers requested times once the inputs' frontiers
have passed them. Logic is invoked with batches, never one record per call.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import CapabilityError
from ..progress.frontier import Frontier
from ..progress.reachability import Target
from ..progress.timestamp import Summary
from .capability import Capability, InputCapability, InputInfo
from .operator import InputPort, OutputPort

#: Consecutive batches of one time queued at an input, each of fewer records than this, reach the
#: logic as one list (of up to about :data:`MERGED_RECORDS`): among 16 workers an exchanged stream
#: arrives in 16 parts per batch, and an operator's cost per batch (its capability, its results'
#: sessions, its progress update) would otherwise grow with the number of peers.
MERGE_RECORDS = 1024
MERGED_RECORDS = 4096


class OperatorInput:
    """One input of an operator: iterate it for ``(capability, batch)`` pairs; ``frontier`` tells
    which times may still arrive. A batch is read-only (other consumers of the stream on this
    worker get the same list); its capability is valid in this invocation only. Batch boundaries
    carry no meaning: small batches of one time may arrive joined (:data:`MERGE_RECORDS`)."""

    __slots__ = ("_port", "_info")

    def __init__(self, port: InputPort) -> None:
        self._port = port
        self._info: InputInfo | None = None  # made at the first batch: the summaries are set at build

    @property
    def port(self) -> int:
        """This input's number on its operator."""
        return self._port.port

    def __iter__(self) -> Iterator[tuple[InputCapability, Sequence]]:
        port = self._port
        op = port.op
        info = self._info
        if info is None:
            info = self._info = InputInfo(op.ctx.progress, op.index, op.name, port.port, op.summary[port.port],
                                          port.levels, op)
        update = op.ctx.progress.update
        target = Target(op.index, port.port)
        queue = port.queue
        while queue:
            time, batch, n = queue.popleft()
            if len(batch) != n:
                _changed(op.name, time, n, len(batch))
            if queue and n < MERGE_RECORDS and queue[0][0] == time and queue[0][2] < MERGE_RECORDS:
                # Small batches of one time queued one after another (the parts of an exchange
                # among many peers) reach the logic as one: its cost per batch would exceed theirs.
                merged = list(batch)
                while queue and queue[0][0] == time and queue[0][2] < MERGE_RECORDS and n < MERGED_RECORDS:
                    _, more, m = queue.popleft()
                    if len(more) != m:
                        _changed(op.name, time, m, len(more))
                    merged += more
                    n += m
                batch = merged
            if n:
                update((target, time), -n)  # consumed: in this step's progress batch
            yield InputCapability(info, time), batch

    @property
    def frontier(self) -> Frontier:
        """The times this input may still receive (a live, read-only view)."""
        return self._port.frontier


def _changed(operator: str, time: Any, sent: int, now: int) -> None:
    """Raise for a batch whose length changed between its sending and its consumption: the
    progress counts hold the length it was sent with, so its time could never complete."""
    raise CapabilityError(
        f"operator '{operator}': a batch it received at time {time!r} was sent with {sent} records and holds "
        f"{now} now: a list given to give_batch or send_batch is handed over, and must not be changed after")


class Session:
    """Buffers records given at one capability's time; flushed when the invocation ends. A
    session kept past a flush (:meth:`OperatorOutput.flush`, or the end of the invocation) sends
    into a new buffer, once its capability is checked again (a stale input capability raises
    :class:`CapabilityError`)."""

    __slots__ = ("_output", "_cap", "_buffer", "_flushes")

    def __init__(self, output: OperatorOutput, cap: Capability | InputCapability, buffer: list) -> None:
        self._output = output
        self._cap = cap
        self._buffer = buffer
        self._flushes = output._flushes  # the buffer is the output's until its next flush

    def _current(self) -> list:
        if self._flushes != self._output._flushes:  # (the old buffer was sent, and counted)
            self._buffer = self._output._buffer_for(self._cap)
            self._flushes = self._output._flushes
        return self._buffer

    def give(self, record: Any) -> None:
        """Send one record."""
        self._current().append(record)

    def give_batch(self, records: Sequence) -> None:
        """Send many records."""
        self._current().extend(records)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class OperatorOutput:
    """One output of an operator: ``output.session(cap).give(x)`` or ``output.give_batch(cap, xs)``.

    Records given through a session are buffered per time and sent when the operator's invocation
    ends (or at :meth:`flush`).
    """

    __slots__ = ("_port", "_buffers", "_flushes")

    def __init__(self, port: OutputPort) -> None:
        self._port = port
        self._buffers: dict[Any, list] = {}
        self._flushes = 0  # flushes that sent buffers (a session's buffer is valid until the next)

    @property
    def port(self) -> int:
        """This output's number on its operator."""
        return self._port.port

    def _time_of(self, cap: Capability | InputCapability) -> Any:
        port = self._port
        op = port.op
        # The common cases first, checked inline: this costs per batch, not per record.
        if type(cap) is InputCapability:
            info = cap.info
            if (port.port in info.identity and info.node == op.index and info.progress is op.ctx.progress
                    and cap.call == op.activations):
                return cap.time
        elif type(cap) is Capability:
            if cap.live and cap.port == port.port and cap.owned_by(op.ctx.progress, op.index):
                return cap.time
        return self._refuse(cap)

    def _refuse(self, cap: Any) -> Any:
        """Raise the :class:`CapabilityError` that says why ``cap`` cannot send on this output."""
        port = self._port
        op = port.op
        if isinstance(cap, Capability):
            if not cap.live:
                raise CapabilityError(f"operator '{op.name}': sending with a dropped capability at {cap.time!r}")
            if not cap.owned_by(op.ctx.progress, op.index):
                raise CapabilityError(f"operator '{op.name}': capability belongs to another operator ({cap!r})")
            if cap.port != port.port:
                raise CapabilityError(
                    f"operator '{op.name}': capability for output {cap.port} used on output {port.port}"
                )
            return cap.time
        if isinstance(cap, InputCapability):
            if cap.info.node != op.index or cap.info.progress is not op.ctx.progress:
                raise CapabilityError(f"operator '{op.name}': the input capability belongs to operator "
                                      f"'{cap.info.name}'")
            if not cap.valid:
                raise cap.stale_error()
            if Summary.identity(port.levels) not in cap.summaries(port.port):
                raise CapabilityError(
                    f"operator '{op.name}': an input capability can send only through an identity summary; "
                    "use cap.delayed(time, output) or cap.retain(output)"
                )
            return cap.time
        raise CapabilityError(f"operator '{op.name}': sending needs a capability, got {cap!r}")

    def session(self, cap: Capability | InputCapability) -> Session:
        """A session sending at ``cap.time``."""
        return Session(self, cap, self._buffer_for(cap))

    def _buffer_for(self, cap: Capability | InputCapability) -> list:
        time = self._time_of(cap)
        buf = self._buffers.get(time)
        if buf is None:
            buf = self._buffers[time] = []
        return buf

    def give(self, cap: Capability | InputCapability, record: Any) -> None:
        """Send one record at ``cap.time``."""
        self.session(cap).give(record)

    def give_batch(self, cap: Capability | InputCapability, records: Sequence) -> None:
        """Send a batch at ``cap.time`` (the list is sent as is when nothing else is buffered)."""
        time = self._time_of(cap)
        buf = self._buffers.get(time)
        if buf is None:
            self._port.send(time, records)
        else:
            buf.extend(records)

    def flush(self) -> None:
        """Send every buffered record."""
        if self._buffers:
            buffers, self._buffers = self._buffers, {}
            self._flushes += 1  # sessions holding these buffers take new ones
            for time, buf in buffers.items():
                self._port.send(time, buf)


_NONE = object()  # no time delivered yet (compares unequal to every time)


class Notificator:
    """Delivers requested times once every input frontier has passed them, in time order.

    ``notify_at(cap)`` takes ownership of a capability; iterating yields the capabilities whose time
    is complete, each dropped after its loop body unless the body gave it back to ``notify_at``
    (after ``cap.downgrade(later)``: a timer that fires again) or keeps a copy (``cap.delayed(t)``).
    """

    def __init__(self, frontiers: Sequence[Frontier]) -> None:
        self._frontiers = list(frontiers)
        self._pending: list[Capability] = []

    def notify_at(self, cap: Capability) -> None:
        """Ask to be notified when ``cap.time`` is complete; the notificator now owns ``cap``."""
        if not isinstance(cap, Capability):
            raise CapabilityError("notify_at needs a Capability (use input_cap.retain())")
        if not cap.live:
            raise CapabilityError(f"notify_at: the capability at {cap.time!r} was dropped")
        self._pending.append(cap)

    def _complete(self, time: Any) -> bool:
        return not any(f.less_equal(time) for f in self._frontiers)

    def available(self) -> bool:
        """True when some requested time is complete."""
        return any(self._complete(c.time) for c in self._pending)

    def __iter__(self) -> Iterator[Capability]:
        while True:
            ready = [c for c in self._pending if self._complete(c.time)]
            if not ready:
                return
            self._pending = [c for c in self._pending if not self._complete(c.time)]
            ready.sort(key=lambda c: c.time)
            taken = 0  # ready[:taken] were delivered (or dropped as duplicates)
            # The time last delivered, read before the loop body runs: a body may give its
            # capability back downgraded (a timer), so the capability no longer says it.
            delivered: Any = _NONE
            try:
                for i, cap in enumerate(ready):
                    taken = i + 1
                    if cap.time == delivered:
                        cap.drop()  # duplicate request for the same time: deliver once
                        continue
                    delivered = cap.time
                    try:
                        yield cap
                    finally:
                        if cap.live and not any(c is cap for c in self._pending):  # (not given back)
                            cap.drop()
            finally:
                # A loop left early (break, next(iter(...))) leaves the rest for a later loop:
                # every capability taken from _pending is delivered or dropped, or held there
                # (invariant: otherwise its time would stay open for good). A duplicate of the
                # time just delivered is dropped: a time is delivered once.
                for cap in ready[taken:]:
                    if cap.time == delivered:
                        cap.drop()
                    else:
                        self._pending.append(cap)
