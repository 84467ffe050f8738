"""Scopes and streams: the user-facing dataflow construction API.

A :class:`Scope` is where operators are created (``worker.dataflow()`` yields the top-level scope,
``scope.iterative()`` a nested one whose times gain an inner loop coordinate). A :class:`Stream` is
one operator output; its methods add operators reading it.
"""
from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from ..progress.timestamp import Summary
from .capability import Capability
from .channels import Broadcast, Exchange, Key, Pact, pact_of
from .input import InputHandle, LoopHandle, ProbeHandle
from .operator import InputHandle as OpInput
from .operator import Notificator, OperatorBuilder, OutputHandle

if TYPE_CHECKING:  # pragma: no cover
    from ..worker import Worker
    from .dataflow import Dataflow


class OperatorInfo(NamedTuple):
    """What an operator constructor learns about the operator being built.

    ``activator.activate()`` schedules the operator again; ``activator.activate_after(seconds)``
    schedules it once the delay has passed (for operators that poll something outside the dataflow).
    """

    name: str
    index: int
    worker: int
    peers: int
    activator: Any


class Scope:
    """A region of a dataflow whose times have ``levels`` coordinates."""

    def __init__(self, df: Dataflow, levels: int = 1, parent: Scope | None = None) -> None:
        self.df = df
        self.levels = levels
        self.parent = parent

    @property
    def worker(self) -> "Worker":
        """The worker building this scope."""
        return self.df.worker

    @property
    def index(self) -> int:
        """This worker's index."""
        return self.df.index

    @property
    def peers(self) -> int:
        """The number of workers."""
        return self.df.peers

    def new_input(self, name: str = "Input") -> InputHandle:
        """A new input; ``handle.stream`` is its stream. Only in the top-level scope (integer epochs)."""
        if self.levels != 1:
            raise ValueError("inputs live in the top-level scope; bring their streams in with enter()")
        b = OperatorBuilder(self, name)
        b.new_output()
        caps: list[Capability] = []
        core = b.build(lambda c: caps.extend(c))
        core.logic = None  # an input is driven by its handle, never scheduled
        handle = InputHandle(core, caps[0])
        handle.stream = Stream(self, core.index, 0)
        self.df.register_input(handle)
        self.df.worker._open_inputs.append(handle)
        return handle

    def source(self, constructor: Callable, name: str = "Source") -> Stream:
        """An operator with no input that produces data itself.

        ``constructor(capability, info)`` returns ``logic(output)``; the operator runs when activated
        (``info.activator.activate()`` / ``activate_after(seconds)``) and once when the dataflow
        starts. It sends with capabilities it holds, and must eventually drop them all.
        """
        b = OperatorBuilder(self, name)
        b.new_output()
        core = b.core

        def build(caps: list[Capability]):
            logic = constructor(caps[0], OperatorInfo(name, core.index, self.index, self.peers, core))
            out = OutputHandle(core.outputs[0])

            def run() -> None:
                logic(out)
                out.flush()

            return run

        b.build(build)
        core.activate()
        return Stream(self, core.index, 0)

    def feedback(self, step: int = 1, name: str = "Feedback") -> tuple[LoopHandle, Stream]:
        """A loop: returns ``(handle, stream)``; records given to ``connect_loop(handle)`` reappear on
        ``stream`` with their last time coordinate advanced by ``step`` (which must be positive)."""
        if step <= 0:
            raise ValueError(f"feedback step must be positive (a loop must advance time), not {step}")
        b = OperatorBuilder(self, name)
        b.new_output()
        handle = LoopHandle(self, b, Summary.feedback(self.levels, step), name)
        self.df.register_loop(handle)
        return handle, Stream(self, b.index, 0)

    @contextlib.contextmanager
    def iterative(self) -> Iterator[Scope]:
        """A nested scope for loops: its times are ``(outer, ..., inner)`` tuples."""
        yield Scope(self.df, self.levels + 1, self)


class Stream:
    """One operator output: a stream of ``(time, batch)`` messages. Methods add operators."""

    __slots__ = ("scope", "node", "port")

    def __init__(self, scope: Scope, node: int, port: int) -> None:
        self.scope = scope
        self.node = node
        self.port = port

    # -- generic operators ---------------------------------------------------------------------
    def _info(self, b: OperatorBuilder, name: str) -> OperatorInfo:
        return OperatorInfo(name, b.index, self.scope.index, self.scope.peers, b.core)

    def _generic(self, others: Sequence[Stream], pacts: Sequence[Key | Pact | None], name: str, logic: Callable,
                 frontier: bool, notify: bool) -> Stream:
        """The one-output operator behind unary/binary and their frontier/notify variants.

        Without ``notify``, ``logic`` is a constructor ``(cap, info) -> logic(*inputs, output)``; with
        ``notify`` it is ``logic(*inputs, output, notificator)`` itself (the initial capability is
        dropped and the operator watches its input frontiers).
        """
        b = OperatorBuilder(self.scope, name)
        for stream, pact in zip((self, *others), pacts):
            b.new_input(stream, pact_of(pact))
        b.new_output()
        b.set_frontier_interest(frontier or notify)
        core = b.core

        def build(caps: list[Capability]):
            out = OutputHandle(core.outputs[0])
            args: list[Any] = [OpInput(p) for p in core.inputs] + [out]
            if notify:
                caps[0].drop()
                notificator = Notificator(core.inputs)
                args.append(notificator)
                run_logic = logic
            else:
                run_logic = logic(caps[0], self._info(b, name))

            def run() -> None:
                run_logic(*args)
                out.flush()
                if notify and notificator.available():
                    core.activate()  # a requested time completed meanwhile: deliver it next step

            return run

        b.build(build)
        return Stream(self.scope, b.index, 0)

    def unary(self, constructor: Callable, name: str = "Unary", exchange: Key | Pact | None = None,
              frontier: bool = False) -> Stream:
        """A generic one-input operator.

        ``constructor(capability, info)`` runs once and returns ``logic(input, output)``, called with
        batches: ``for cap, batch in input: output.session(cap).give_batch(...)``. The initial
        ``capability`` (at the minimum time) must be dropped or kept deliberately.
        """
        return self._generic((), (exchange,), name, constructor, frontier, notify=False)

    def unary_frontier(self, constructor: Callable, name: str = "UnaryFrontier",
                       exchange: Key | Pact | None = None) -> Stream:
        """Like :meth:`unary`, also scheduled when the input frontier (``input.frontier``) changes."""
        return self.unary(constructor, name, exchange, frontier=True)

    def unary_notify(self, logic: Callable, name: str = "UnaryNotify",
                     exchange: Key | Pact | None = None) -> Stream:
        """A one-input operator with a notificator: ``logic(input, output, notificator)``.

        ``notificator.notify_at(cap.retain())`` asks for a call once the input frontier passes
        ``cap.time``; ``for cap in notificator:`` yields those times in order.
        """
        return self._generic((), (exchange,), name, logic, frontier=True, notify=True)

    def binary(self, other: Stream, constructor: Callable, name: str = "Binary",
               exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None,
               frontier: bool = False) -> Stream:
        """A generic two-input operator: ``constructor(cap, info)`` returns ``logic(input1, input2, output)``."""
        return self._generic((other,), (exchange1, exchange2), name, constructor, frontier, notify=False)

    def binary_frontier(self, other: Stream, constructor: Callable, name: str = "BinaryFrontier",
                        exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None) -> Stream:
        """Like :meth:`binary`, also scheduled when either input frontier changes."""
        return self.binary(other, constructor, name, exchange1, exchange2, frontier=True)

    def binary_notify(self, other: Stream, logic: Callable, name: str = "BinaryNotify",
                      exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None) -> Stream:
        """A two-input operator with a notificator: ``logic(input1, input2, output, notificator)``;
        a time is delivered once both input frontiers have passed it."""
        return self._generic((other,), (exchange1, exchange2), name, logic, frontier=True, notify=True)

    def sink(self, logic: Callable, name: str = "Sink", exchange: Key | Pact | None = None) -> None:
        """A terminal operator: ``logic(input)``, scheduled on data and on frontier changes."""
        b = OperatorBuilder(self.scope, name)
        b.new_input(self, pact_of(exchange))
        b.set_frontier_interest(True)
        core = b.core
        b.build(lambda caps: (lambda inp=OpInput(core.inputs[0]): logic(inp)))

    # -- batch-at-a-time pipeline operators ------------------------------------------------------
    def _forward(self, name: str, transform: Callable[[Any, Sequence], Sequence | None],
                 pact: Pact | None = None, inputs: Sequence[Stream] = ()) -> Stream:
        """An operator sending ``transform(time, batch)`` at the batch's own time (identity summary)."""
        b = OperatorBuilder(self.scope, name)
        for s in (self, *inputs):
            b.new_input(s, pact)
        b.new_output()
        core = b.core
        ports = core.inputs
        out = core.outputs[0]

        def build(caps: list[Capability]):
            caps[0].drop()

            def run() -> None:
                # Sending at the input batch's time is licensed by the identity summary: the
                # consumed -n at t and the produced +m at t travel in the same progress batch.
                for port in ports:
                    queue = port.queue
                    while queue:
                        time, batch = queue.popleft()
                        core.consumed(port.port, time, len(batch))
                        result = transform(time, batch)
                        if result:
                            out.send(time, result)

            return run

        b.build(build)
        return Stream(self.scope, b.index, 0)

    def map(self, f: Callable[[Any], Any], name: str = "Map") -> Stream:
        """Apply ``f`` to every record."""
        return self._forward(name, lambda t, batch: [f(x) for x in batch])

    def map_batch(self, f: Callable[[Sequence], Sequence], name: str = "MapBatch") -> Stream:
        """Apply ``f`` to every batch (a list or tuple of records); it returns the output batch."""
        return self._forward(name, lambda t, batch: f(batch))

    def flat_map(self, f: Callable[[Any], Any], name: str = "FlatMap") -> Stream:
        """Replace every record by the records of the iterable ``f(record)``."""
        return self._forward(name, lambda t, batch: [y for x in batch for y in f(x)])

    def filter(self, predicate: Callable[[Any], bool], name: str = "Filter") -> Stream:
        """Keep the records for which ``predicate`` is true."""
        return self._forward(name, lambda t, batch: [x for x in batch if predicate(x)])

    def inspect(self, f: Callable[[Any], Any], name: str = "Inspect") -> Stream:
        """Call ``f(record)`` for every record and pass the records on."""

        def each(t: Any, batch: Sequence) -> Sequence:
            for x in batch:
                f(x)
            return batch

        return self._forward(name, each)

    def inspect_batch(self, f: Callable[[Any, Sequence], Any], name: str = "InspectBatch") -> Stream:
        """Call ``f(time, batch)`` for every batch and pass the records on."""

        def each(t: Any, batch: Sequence) -> Sequence:
            f(t, batch)
            return batch

        return self._forward(name, each)

    def exchange(self, key: Key = None, name: str = "Exchange") -> Stream:
        """Move every record to the worker chosen by the hash of its key (field index or function)."""
        return self._forward(name, lambda t, batch: batch, Exchange(key))

    def broadcast(self, name: str = "Broadcast") -> Stream:
        """Send every record to every worker."""
        return self._forward(name, lambda t, batch: batch, Broadcast())

    def concat(self, *others: Stream, name: str = "Concat") -> Stream:
        """Merge this stream with ``others``."""
        return self._forward(name, lambda t, batch: batch, None, others)

    def partition(self, parts: int, route: Callable[[Any], int], name: str = "Partition") -> list[Stream]:
        """Split into ``parts`` streams; ``route(record)`` gives each record's stream index."""
        b = OperatorBuilder(self.scope, name)
        b.new_input(self)
        for _ in range(parts):
            b.new_output()
        core = b.core
        port = core.inputs[0]

        def build(caps: list[Capability]):
            for c in caps:
                c.drop()

            def run() -> None:
                while port.queue:
                    time, batch = port.queue.popleft()
                    core.consumed(0, time, len(batch))
                    split: list[list] = [[] for _ in range(parts)]
                    for x in batch:
                        i = route(x)
                        if not (type(i) is int and 0 <= i < parts):
                            raise ValueError(f"partition route returned {i!r} for record {x!r:.200}; expected 0..{parts - 1}")
                        split[i].append(x)
                    for out, recs in zip(core.outputs, split):
                        out.send(time, recs)

            return run

        b.build(build)
        return [Stream(self.scope, b.index, o) for o in range(parts)]

    # -- observing -----------------------------------------------------------------------------
    def probe(self) -> ProbeHandle:
        """A handle on this stream's frontier (see :class:`ProbeHandle`)."""
        handle = ProbeHandle()
        self.probe_with(handle)
        return handle

    def probe_with(self, handle: ProbeHandle) -> Stream:
        """Add this stream's frontier to ``handle``; returns the same records as a new stream."""
        out = self._forward("Probe", lambda t, batch: batch)
        core = self.scope.df.operators[out.node]
        handle._attach(core.inputs[0])
        # Scheduled on frontier changes too, so that operators watching the probe wake up.
        core.frontier_interest = True
        forward = core.logic
        port = core.inputs[0]
        seen: list = [None]

        def run() -> None:
            forward()
            if handle._watchers and port.frontier.frontier != seen[0]:
                seen[0] = list(port.frontier.frontier)
                handle._changed()

        core.logic = run
        return out

    def capture(self) -> Captured:
        """Record every ``(time, batch)`` this worker sees, for tests and small outputs."""
        captured = Captured()
        self.sink(lambda inp: captured._take(inp), name="Capture")
        return captured

    # -- keyed aggregations --------------------------------------------------------------------
    def count_by_key(self, key: Key = None, name: str = "CountByKey") -> Stream:
        """Per time, emit ``(key, count)`` for each key seen, once the time is complete.

        ``key`` is a field index, a function, or ``None`` (the record itself is the key). Records are
        exchanged by key, so each key is counted on one worker.
        """
        getter = _key_getter(key)
        counts: dict[Any, Counter] = defaultdict(Counter)

        def logic(inp: OpInput, out: OutputHandle, notificator: Notificator) -> None:
            for cap, batch in inp:
                if cap.time not in counts:
                    notificator.notify_at(cap.retain())
                counts[cap.time].update(batch if getter is None else map(getter, batch))
            for cap in notificator:
                out.give_batch(cap, list(counts.pop(cap.time).items()))

        return self.unary_notify(logic, name, Exchange(key))

    def reduce_by_key(self, reduce: Callable[[Any, Any], Any], name: str = "ReduceByKey") -> Stream:
        """On a stream of ``(key, value)`` pairs, emit ``(key, reduce(reduce(v1, v2), v3)...)`` per
        key and time, once the time is complete."""
        state: dict[Any, dict] = {}

        def logic(inp: OpInput, out: OutputHandle, notificator: Notificator) -> None:
            for cap, batch in inp:
                acc = state.get(cap.time)
                if acc is None:
                    acc = state[cap.time] = {}
                    notificator.notify_at(cap.retain())
                for k, v in batch:
                    acc[k] = reduce(acc[k], v) if k in acc else v
            for cap in notificator:
                out.give_batch(cap, list(state.pop(cap.time).items()))

        return self.unary_notify(logic, name, Exchange(0))

    # -- scopes and loops ----------------------------------------------------------------------
    def _restamp(self, b: OperatorBuilder, summary: Summary, levels: int | None = None) -> None:
        """Connect this stream to ``b`` through ``summary`` and forward every batch at ``summary(t)``
        (enter, leave and feedback are all such operators)."""
        b.new_input(self, None, [[summary]], levels=levels)
        core = b.core
        port, out = core.inputs[0], core.outputs[0]

        def build(caps: list[Capability]):
            caps[0].drop()

            def run() -> None:
                # Sending at summary(t) is licensed by the declared input->output summary.
                while port.queue:
                    time, batch = port.queue.popleft()
                    core.consumed(0, time, len(batch))
                    out.send(summary.results_in(time), batch)

            return run

        b.build(build)

    def enter(self, inner: Scope, name: str = "Enter") -> Stream:
        """Bring this stream into the nested scope ``inner``: time ``t`` becomes ``(t, 0)``."""
        if inner.parent is not self.scope:
            raise ValueError("enter() takes a scope nested directly in this stream's scope")
        b = OperatorBuilder(inner, name)
        b.new_output()
        self._restamp(b, Summary.enter(self.scope.levels), levels=self.scope.levels)
        return Stream(inner, b.index, 0)

    def leave(self, name: str = "Leave") -> Stream:
        """Take this stream out of its nested scope: time ``(t, i)`` becomes ``t``."""
        inner = self.scope
        if inner.parent is None:
            raise ValueError("leave() needs a stream inside a nested scope")
        b = OperatorBuilder(inner.parent, name)
        b.new_output()
        self._restamp(b, Summary.leave(inner.levels), levels=inner.levels)
        return Stream(inner.parent, b.index, 0)

    def connect_loop(self, handle: LoopHandle) -> None:
        """Feed this stream back into the loop opened by ``scope.feedback``."""
        if handle.connected:
            raise ValueError(f"feedback '{handle.name}' is already connected")
        if handle.scope is not self.scope:
            raise ValueError("connect_loop needs a stream of the scope the feedback was created in")
        self._restamp(handle.builder, handle.summary)
        handle.connected = True


def _key_getter(key: Key) -> Callable[[Any], Any] | None:
    if key is None:
        return None
    if isinstance(key, int):
        return itemgetter(key)
    return key


class Captured:
    """The ``(time, records)`` a worker saw on a captured stream."""

    def __init__(self) -> None:
        self.batches: list[tuple[Any, list]] = []

    def _take(self, inp: OpInput) -> None:
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
