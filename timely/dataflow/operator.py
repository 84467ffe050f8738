"""The operator builder and the handles an operator's logic works with.

Building an operator reserves its index (creation order, identical on every worker), connects its
inputs to upstream streams through a pact, declares its outputs and its input->output summaries,
then installs its logic. At run time the logic is invoked with batches, never one record per call.

Everything an invocation changes (records consumed, capabilities created or dropped, records
produced) goes into the dataflow's single progress batch for this step, so it is never split.
"""
from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..progress.frontier import MutableAntichain
from ..progress.reachability import Source, Target
from ..progress.timestamp import Summary, minimum
from .capability import Capability, CapabilityError, InputCapability
from .channels import Pact, Pipeline

if TYPE_CHECKING:  # pragma: no cover
    from .dataflow import Dataflow
    from .scope import Scope, Stream


class OperatorError(RuntimeError):
    """User code inside an operator raised: names the operator and the worker, keeps the traceback."""

    def __init__(self, operator: str, worker: int, cause: BaseException) -> None:
        self.operator = operator
        self.worker = worker
        self.cause = cause
        tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        super().__init__(f"worker {worker}: operator '{operator}' failed: {cause!r}\n{tb}")


class InputPort:
    """The receiving end of one operator input on this worker: a queue of ``(time, batch)``."""

    __slots__ = ("op", "port", "queue", "frontier", "levels")

    def __init__(self, op: OperatorCore, port: int, levels: int) -> None:
        self.op = op
        self.port = port
        self.levels = levels
        self.queue: deque[tuple[Any, Sequence]] = deque()
        self.frontier: MutableAntichain = MutableAntichain()  # replaced by the tracker's at freeze

    def deliver(self, time: Any, batch: Sequence) -> None:
        """Queue a received batch and activate the operator."""
        self.queue.append((time, batch))
        self.op.activate()


class OutputPort:
    """The sending end of one operator output: every edge leaving it, with its channel."""

    __slots__ = ("op", "port", "levels", "channels")

    def __init__(self, op: OperatorCore, port: int, levels: int) -> None:
        self.op = op
        self.port = port
        self.levels = levels
        self.channels: list[tuple[Any, Any]] = []  # (Channel, Target location)

    def send(self, time: Any, batch: Sequence) -> None:
        """Push ``batch`` at ``time`` along every edge and count it as produced at each target."""
        if not batch:
            return
        update = self.op.df.progress.update
        for channel, target in self.channels:
            n = channel.push(time, batch)
            update((target, time), n)


class OperatorCore:
    """The runtime part of an operator: ports, summaries, and the installed logic."""

    def __init__(self, df: Dataflow, index: int, name: str) -> None:
        self.df = df
        self.index = index
        self.name = name
        self.inputs: list[InputPort] = []
        self.outputs: list[OutputPort] = []
        self.summary: list[list[list[Summary]]] = []
        self.frontier_interest = False
        self.logic: Callable[[], Any] | None = None

    def capability_change(self, port: int, time: Any, diff: int) -> None:
        """Record a capability created (+1) or dropped (-1) at output ``port``."""
        self.df.progress.update((Source(self.index, port), time), diff)

    def consumed(self, port: int, time: Any, count: int) -> None:
        """Record ``count`` records at ``time`` taken from input ``port``."""
        if count:
            self.df.progress.update((Target(self.index, port), time), -count)

    def activate(self) -> None:
        """Schedule this operator in the current or next step."""
        self.df.activate(self.index)

    def activate_after(self, delay: float) -> None:
        """Schedule this operator once ``delay`` seconds have passed (the worker parks until then)."""
        self.df.activate_after(self.index, delay)

    def schedule(self) -> None:
        """Run the logic once; user exceptions become :class:`OperatorError`."""
        if self.logic is None:
            return
        try:
            self.logic()
        except OperatorError:
            raise
        except Exception as e:
            raise OperatorError(self.name, self.df.index, e) from e

    def __repr__(self) -> str:
        return f"<operator {self.index} '{self.name}'>"


class InputHandle:
    """What operator logic reads: ``for cap, batch in input`` drains the queued batches."""

    __slots__ = ("_port",)

    def __init__(self, port: InputPort) -> None:
        self._port = port

    def __iter__(self) -> Iterator[tuple[InputCapability, Sequence]]:
        port = self._port
        op = port.op
        queue = port.queue
        while queue:
            time, batch = queue.popleft()
            op.consumed(port.port, time, len(batch))
            yield InputCapability(op, port.port, time), batch

    def pending(self) -> bool:
        """True when batches are waiting."""
        return bool(self._port.queue)

    @property
    def frontier(self) -> MutableAntichain:
        """The times this input may still receive (read only)."""
        return self._port.frontier


class Session:
    """Buffers records given at one capability's time; flushed when the invocation ends."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: list) -> None:
        self._buffer = buffer

    def give(self, record: Any) -> None:
        """Send one record."""
        self._buffer.append(record)

    def give_batch(self, records: Sequence) -> None:
        """Send many records."""
        self._buffer.extend(records)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class OutputHandle:
    """What operator logic writes to: ``output.session(cap).give(x)`` or ``output.give_batch(cap, xs)``."""

    __slots__ = ("_port", "_buffers")

    def __init__(self, port: OutputPort) -> None:
        self._port = port
        self._buffers: dict[Any, list] = {}

    def _time_of(self, cap: Capability | InputCapability) -> Any:
        port = self._port
        op = port.op
        if isinstance(cap, Capability):
            if not cap.live:
                raise CapabilityError(f"operator '{op.name}': sending with a dropped capability at {cap.time!r}")
            if cap._op is not op:
                raise CapabilityError(
                    f"operator '{op.name}': capability belongs to operator '{cap._op.name}', not to this operator"
                )
            if cap.port != port.port:
                raise CapabilityError(
                    f"operator '{op.name}': capability for output {cap.port} used on output {port.port}"
                )
            return cap.time
        if isinstance(cap, InputCapability):
            if Summary.identity(port.levels) not in op.summary[cap._input][port.port]:
                raise CapabilityError(
                    f"operator '{op.name}': an input capability can send only through an identity summary; "
                    "use cap.delayed(time, output) or cap.retain(output)"
                )
            return cap.time
        raise CapabilityError(f"operator '{op.name}': sending needs a capability, got {cap!r}")

    def session(self, cap: Capability | InputCapability) -> Session:
        """A session sending at ``cap.time``."""
        time = self._time_of(cap)
        buf = self._buffers.get(time)
        if buf is None:
            buf = self._buffers[time] = []
        return Session(buf)

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
            for time, buf in buffers.items():
                self._port.send(time, buf)


class Notificator:
    """Delivers requested times once every input frontier has passed them, in time order.

    ``notify_at(cap)`` takes ownership of a capability; iterating yields the capabilities whose time
    is complete, each dropped after its loop body unless the body keeps it alive by delaying it.
    """

    def __init__(self, ports: list[InputPort]) -> None:
        self._ports = ports  # read port.frontier at use: the tracker installs it at freeze
        self._pending: list[Capability] = []

    def notify_at(self, cap: Capability) -> None:
        """Ask to be notified when ``cap.time`` is complete; the notificator now owns ``cap``."""
        if not isinstance(cap, Capability):
            raise CapabilityError("notify_at needs a Capability (use input_cap.retain())")
        self._pending.append(cap)

    def _complete(self, time: Any) -> bool:
        return not any(p.frontier.less_equal(time) for p in self._ports)

    def available(self) -> bool:
        """True when some requested time is complete."""
        return any(self._complete(c.time) for c in self._pending)

    def pending(self) -> list[Any]:
        """The times still awaited."""
        return sorted(c.time for c in self._pending)

    def __iter__(self) -> Iterator[Capability]:
        while True:
            ready = [c for c in self._pending if self._complete(c.time)]
            if not ready:
                return
            self._pending = [c for c in self._pending if not self._complete(c.time)]
            ready.sort(key=lambda c: c.time)
            for i, cap in enumerate(ready):
                if i and cap.time == ready[i - 1].time:
                    cap.drop()  # duplicate request for the same time: deliver once
                    continue
                try:
                    yield cap
                finally:
                    if cap.live:
                        cap.drop()


class OperatorBuilder:
    """Builds one operator: ``new_input`` / ``new_output``, then ``build(constructor)``.

    By default every input is connected to every output by the identity summary; pass
    ``connection`` (one list of summaries per output) to declare something else.
    """

    def __init__(self, scope: Scope, name: str) -> None:
        self.scope = scope
        self.df = scope.df
        self.core = self.df.add_operator(name)
        self._connections: list[list[list[Summary]] | None] = []
        self._built = False

    @property
    def index(self) -> int:
        """The operator's index in its dataflow."""
        return self.core.index

    def new_input(
        self,
        stream: Stream,
        pact: Pact | None = None,
        connection: list[list[Summary]] | None = None,
        levels: int | None = None,
    ) -> int:
        """Connect ``stream`` to a new input through ``pact``; return the input's port number.

        The stream must be in this operator's scope (times with ``levels`` coordinates, default the
        scope's); ``connection`` lists, per output, the summaries from this input to it.
        """
        if stream.scope.df is not self.df:
            raise ValueError(f"operator '{self.core.name}': stream belongs to another dataflow")
        if levels is None and stream.scope is not self.scope:
            raise ValueError(
                f"operator '{self.core.name}': stream belongs to another scope; bring it in with enter() or "
                "take it out with leave()"
            )
        core = self.core
        port = InputPort(core, len(core.inputs), levels or self.scope.levels)
        core.inputs.append(port)
        self._connections.append(connection)
        self.df.connect(stream, port, pact or Pipeline())
        return port.port

    def new_output(self, levels: int | None = None) -> int:
        """Declare a new output (times with ``levels`` coordinates, default the scope's)."""
        core = self.core
        core.outputs.append(OutputPort(core, len(core.outputs), levels or self.scope.levels))
        return len(core.outputs) - 1

    def set_frontier_interest(self, interest: bool = True) -> None:
        """Schedule the operator whenever one of its input frontiers changes."""
        self.core.frontier_interest = interest

    def build(self, constructor: Callable[[list[Capability]], Callable[[], Any]]) -> OperatorCore:
        """Install the logic: ``constructor(initial_capabilities)`` returns a zero-argument callable.

        The operator receives one capability at the minimum time per output; it should drop those it
        does not need (they keep downstream frontiers at the minimum until dropped).
        """
        if self._built:
            raise RuntimeError(f"operator '{self.core.name}' built twice")
        self._built = True
        core = self.core
        core.summary = [
            conn if conn is not None else [[Summary.identity(inp.levels)] for _ in core.outputs]
            for inp, conn in zip(core.inputs, self._connections)
        ]
        for i, row in enumerate(core.summary):
            if len(row) != len(core.outputs):
                raise ValueError(f"operator '{core.name}': input {i} connection must list {len(core.outputs)} outputs")
        # The initial capabilities are already counted: every output starts at `peers` x minimum.
        caps = [Capability(core, o.port, minimum(o.levels), counted=False) for o in core.outputs]
        core.logic = constructor(caps)
        self.df.operator_built(core)
        return core
