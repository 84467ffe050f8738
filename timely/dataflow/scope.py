"""Scopes and streams: the user-facing dataflow construction API.

A :class:`Scope` is where operators are created (``worker.dataflow()`` yields the top-level scope,
``scope.iterative()`` a nested one whose times gain an inner loop coordinate). A :class:`Stream` is
one operator output; its methods add operators reading it. Every operator here is made with the
public :class:`~timely.dataflow.builder.OperatorBuilder`, as a user's own operators are.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BuildError
from ..progress.timestamp import MAX_COORDINATE, Summary
from . import keyed
from .builder import OperatorBuilder
from .capability import Capability
from .channels import Broadcast, Exchange, Key, Pact, pact_of
from .handles import Notificator, OperatorOutput
from .input import Captured, InputHandle, LoopHandle, ProbeHandle

if TYPE_CHECKING:  # pragma: no cover
    from ..worker import Worker
    from .dataflow import Dataflow



def _logic_of(result: Any, name: str) -> Callable:
    """What an operator's constructor returned, once checked to be its logic (a function)."""
    if not callable(result):
        raise BuildError(f"operator '{name}': its constructor returned {result!r:.60}, not the logic function "
                         "(does it end with `return logic`?)")
    return result

class Scope:
    """A region of a dataflow whose times have ``levels`` coordinates."""

    def __init__(self, df: Dataflow, levels: int = 1, parent: Scope | None = None) -> None:
        self.df = df
        self.levels = levels
        self.parent = parent

    @property
    def worker(self) -> Worker:
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

    def default_name(self, kind: str, f: Any = None) -> str:
        """A name for an operator the user did not name: ``Kind#index``, with ``f``'s name if it has
        one (so that two failing maps are told apart in errors)."""
        label = getattr(f, "__qualname__", None)
        index = len(self.df.operators)
        return f"{kind}#{index}" if not label or label == "<lambda>" else f"{kind}#{index}({label})"

    def new_input(self, name: str | None = None) -> InputHandle:
        """A new input; ``handle.stream`` is its stream. Only in the top-level scope (integer epochs)."""
        if self.levels != 1:
            raise BuildError("inputs live in the top-level scope; bring their streams in with enter()")
        name = name or self.default_name("Input")
        b = OperatorBuilder(self, name)
        out, stream = b.new_output()
        caps: list[Capability] = []
        b.build(lambda c: caps.extend(c))  # never scheduled: the handle drives it from outside
        handle = InputHandle(name, out, caps[0], stream)
        self.df.register_input(handle)
        self.df.worker.register_input(handle)
        return handle

    def source(self, constructor: Callable, name: str | None = None) -> Stream:
        """An operator with no input that produces data itself.

        ``constructor(capability, info)`` returns ``logic(output)``; the operator runs when activated
        (``info.activator.activate()`` / ``activate_after(seconds)``) and once when the dataflow
        starts. It sends with capabilities it holds, and must eventually drop them all.
        """
        b = OperatorBuilder(self, name or self.default_name("Source", constructor))
        out, stream = b.new_output()
        info = b.info

        def build(caps: list[Capability]) -> Callable[[], None]:
            logic = _logic_of(constructor(caps[0], info), info.name)
            return lambda: logic(out)

        b.build(build)
        info.activator.activate()
        return stream

    def feedback(self, step: int = 1, name: str = "Feedback") -> tuple[LoopHandle, Stream]:
        """A loop: returns ``(handle, stream)``; records given to ``connect_loop(handle)`` reappear on
        ``stream`` with their last time coordinate advanced by ``step`` (which must be positive)."""
        if type(step) is not int or not 0 < step <= MAX_COORDINATE:
            raise BuildError(f"feedback step must be a positive integer (a loop must advance time) of at most "
                             f"2**64 - 1, not {step!r}")
        b = OperatorBuilder(self, name)
        out, stream = b.new_output()
        handle = LoopHandle(self, b, out, Summary.feedback(self.levels, step), name)
        self.df.register_loop(handle)
        return handle, stream

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
    def _generic(self, others: Sequence[Stream], pacts: Sequence[Key | Pact | None], name: str, logic: Callable,
                 frontier: bool, notify: bool) -> Stream:
        """The one-output operator behind unary/binary and their frontier/notify variants.

        Without ``notify``, ``logic`` is a constructor ``(cap, info) -> logic(*inputs, output)``; with
        ``notify`` it is ``logic(*inputs, output, notificator)`` itself (the initial capability is
        dropped and the operator watches its input frontiers).
        """
        b = OperatorBuilder(self.scope, name)
        inputs = [b.new_input(s, pact_of(p)) for s, p in zip((self, *others), pacts)]
        out, stream = b.new_output()
        b.set_frontier_interest(frontier or notify)
        info = b.info

        def build(caps: list[Capability]) -> Callable[[], None]:
            if not notify:
                run_logic = _logic_of(logic(caps[0], info), name)
                return lambda: run_logic(*inputs, out)
            caps[0].drop()
            notificator = Notificator([i.frontier for i in inputs])

            def run() -> None:
                logic(*inputs, out, notificator)
                if notificator.available():
                    info.activator.activate()  # a requested time completed meanwhile: deliver it next step

            return run

        b.build(build)
        return stream

    def unary(self, constructor: Callable, name: str | None = None, exchange: Key | Pact | None = None,
              frontier: bool = False) -> Stream:
        """A generic one-input operator.

        ``constructor(capability, info)`` runs once and returns ``logic(input, output)``, called with
        batches: ``for cap, batch in input: output.session(cap).give_batch(...)``. The initial
        ``capability`` (at the minimum time) must be dropped or kept deliberately.
        """
        name = name or self.scope.default_name("Unary", constructor)
        return self._generic((), (exchange,), name, constructor, frontier, notify=False)

    def unary_frontier(self, constructor: Callable, name: str | None = None,
                       exchange: Key | Pact | None = None) -> Stream:
        """Like :meth:`unary`, also scheduled when the input frontier (``input.frontier``) changes."""
        return self.unary(constructor, name or self.scope.default_name("UnaryFrontier", constructor), exchange, True)

    def unary_notify(self, logic: Callable, name: str | None = None, exchange: Key | Pact | None = None) -> Stream:
        """A one-input operator with a notificator: ``logic(input, output, notificator)``.

        ``notificator.notify_at(cap.retain())`` asks for a call once the input frontier passes
        ``cap.time``; ``for cap in notificator:`` yields those times in order.
        """
        name = name or self.scope.default_name("UnaryNotify", logic)
        return self._generic((), (exchange,), name, logic, frontier=True, notify=True)

    def binary(self, other: Stream, constructor: Callable, name: str | None = None,
               exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None,
               frontier: bool = False) -> Stream:
        """A generic two-input operator: ``constructor(cap, info)`` returns ``logic(input1, input2, output)``."""
        name = name or self.scope.default_name("Binary", constructor)
        return self._generic((other,), (exchange1, exchange2), name, constructor, frontier, notify=False)

    def binary_frontier(self, other: Stream, constructor: Callable, name: str | None = None,
                        exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None) -> Stream:
        """Like :meth:`binary`, also scheduled when either input frontier changes."""
        name = name or self.scope.default_name("BinaryFrontier", constructor)
        return self.binary(other, constructor, name, exchange1, exchange2, frontier=True)

    def binary_notify(self, other: Stream, logic: Callable, name: str | None = None,
                      exchange1: Key | Pact | None = None, exchange2: Key | Pact | None = None) -> Stream:
        """A two-input operator with a notificator: ``logic(input1, input2, output, notificator)``;
        a time is delivered once both input frontiers have passed it."""
        name = name or self.scope.default_name("BinaryNotify", logic)
        return self._generic((other,), (exchange1, exchange2), name, logic, frontier=True, notify=True)

    def sink(self, logic: Callable, name: str | None = None, exchange: Key | Pact | None = None) -> None:
        """A terminal operator: ``logic(input)``, scheduled on data and on frontier changes."""
        b = OperatorBuilder(self.scope, name or self.scope.default_name("Sink", logic))
        inp = b.new_input(self, pact_of(exchange))
        b.set_frontier_interest(True)
        b.build(lambda caps: lambda: logic(inp))

    # -- batch-at-a-time pipeline operators ------------------------------------------------------
    def _forward(self, name: str, transform: Callable[[Any, Sequence], Sequence | None],
                 pact: Pact | None = None, inputs: Sequence[Stream] = ()) -> Stream:
        """An operator sending ``transform(time, batch)`` at the batch's own time (identity summary)."""
        b = OperatorBuilder(self.scope, name)
        ins = [b.new_input(s, pact) for s in (self, *inputs)]
        out, stream = b.new_output()

        def build(caps: list[Capability]) -> Callable[[], None]:
            caps[0].drop()

            def run() -> None:
                # Sending at the input batch's time is licensed by the identity summary: the
                # consumed -n at t and the produced +m at t travel in the same progress batch.
                for inp in ins:
                    for cap, batch in inp:
                        result = transform(cap.time, batch)
                        if result:
                            out.give_batch(cap, result)

            return run

        b.build(build)
        return stream

    def map(self, f: Callable[[Any], Any], name: str | None = None) -> Stream:
        """Apply ``f`` to every record."""
        return self._forward(name or self.scope.default_name("Map", f), lambda t, batch: [f(x) for x in batch])

    def map_batch(self, f: Callable[[Sequence], Sequence], name: str | None = None) -> Stream:
        """Apply ``f`` to every batch (a list or tuple of records); it returns the output batch."""
        return self._forward(name or self.scope.default_name("MapBatch", f), lambda t, batch: f(batch))

    def flat_map(self, f: Callable[[Any], Any], name: str | None = None) -> Stream:
        """Replace every record by the records of the iterable ``f(record)``."""
        return self._forward(name or self.scope.default_name("FlatMap", f),
                             lambda t, batch: [y for x in batch for y in f(x)])

    def filter(self, predicate: Callable[[Any], bool], name: str | None = None) -> Stream:
        """Keep the records for which ``predicate`` is true."""
        return self._forward(name or self.scope.default_name("Filter", predicate),
                             lambda t, batch: [x for x in batch if predicate(x)])

    def inspect(self, f: Callable[[Any], Any], name: str | None = None) -> Stream:
        """Call ``f(record)`` for every record and pass the records on."""

        def each(t: Any, batch: Sequence) -> Sequence:
            for x in batch:
                f(x)
            return batch

        return self._forward(name or self.scope.default_name("Inspect", f), each)

    def inspect_batch(self, f: Callable[[Any, Sequence], Any], name: str | None = None) -> Stream:
        """Call ``f(time, batch)`` for every batch and pass the records on."""

        def each(t: Any, batch: Sequence) -> Sequence:
            f(t, batch)
            return batch

        return self._forward(name or self.scope.default_name("InspectBatch", f), each)

    def exchange(self, key: Key = None, name: str | None = None) -> Stream:
        """Move every record to the worker chosen by the hash of its key (field index or function)."""
        return self._forward(name or self.scope.default_name("Exchange"), lambda t, batch: batch, Exchange(key))

    def broadcast(self, name: str | None = None) -> Stream:
        """Send every record to every worker."""
        return self._forward(name or self.scope.default_name("Broadcast"), lambda t, batch: batch, Broadcast())

    def concat(self, *others: Stream, name: str | None = None) -> Stream:
        """Merge this stream with ``others``."""
        return self._forward(name or self.scope.default_name("Concat"), lambda t, batch: batch, None, others)

    def partition(self, parts: int, route: Callable[[Any], int], name: str | None = None) -> list[Stream]:
        """Split into ``parts`` streams; ``route(record)`` gives each record's stream index."""
        b = OperatorBuilder(self.scope, name or self.scope.default_name("Partition", route))
        inp = b.new_input(self)
        outs, streams = zip(*(b.new_output() for _ in range(parts)))

        def build(caps: list[Capability]) -> Callable[[], None]:
            for c in caps:
                c.drop()

            def run() -> None:
                for cap, batch in inp:
                    split: list[list] = [[] for _ in range(parts)]
                    for x in batch:
                        i = route(x)
                        if not (type(i) is int and 0 <= i < parts):
                            raise ValueError(f"partition route returned {i!r} for record {x!r:.200}; expected 0..{parts - 1}")
                        split[i].append(x)
                    for out, recs in zip(outs, split):
                        if recs:
                            out.give_batch(cap, recs)

            return run

        b.build(build)
        return list(streams)

    # -- observing -----------------------------------------------------------------------------
    def probe(self) -> ProbeHandle:
        """A handle on this stream's frontier (see :class:`ProbeHandle`)."""
        handle = ProbeHandle()
        self.probe_with(handle)
        return handle

    def probe_with(self, handle: ProbeHandle) -> Stream:
        """Add this stream's frontier to ``handle``; returns the same records as a new stream.

        Once the handle has a watcher (``handle.watch(activator)``), the probe operator is also
        scheduled on frontier changes, so that the watchers wake up when it moves.
        """
        b = OperatorBuilder(self.scope, self.scope.default_name("Probe"))
        inp = b.new_input(self)
        out, stream = b.new_output()
        handle._attach(inp.frontier, b.frontier_interest_switch())  # scheduled on frontier changes once watched

        def build(caps: list[Capability]) -> Callable[[], None]:
            caps[0].drop()

            def run() -> None:
                for cap, batch in inp:
                    out.give_batch(cap, batch)
                handle._observe()

            return run

        b.build(build)
        return stream

    def capture(self) -> Captured:
        """Record every ``(time, batch)`` this worker sees, for tests and small outputs."""
        captured = Captured()
        self.sink(captured.take, name=self.scope.default_name("Capture"))
        return captured

    # -- keyed aggregations --------------------------------------------------------------------
    def count_by_key(self, key: Key = None, name: str | None = None) -> Stream:
        """Per time, emit ``(key, count)`` for each key seen, once the time is complete.

        ``key`` is a field index, a function, or ``None`` (the record itself is the key). Records are
        exchanged by key, so each key is counted on one worker.
        """
        return self.unary_notify(keyed.count_logic(key), name or self.scope.default_name("CountByKey"), Exchange(key))

    def reduce_by_key(self, reduce: Callable[[Any, Any], Any], name: str | None = None) -> Stream:
        """On a stream of ``(key, value)`` pairs, emit ``(key, reduce(reduce(v1, v2), v3)...)`` per
        key and time, once the time is complete.

        The values of a key at a time are folded in the order they arrive, which timely leaves open
        (batches come in any order, cut anywhere): ``reduce`` should be associative and commutative.
        """
        return self.unary_notify(keyed.reduce_logic(reduce), name or self.scope.default_name("ReduceByKey", reduce),
                                 Exchange(0))

    # -- scopes and loops ----------------------------------------------------------------------
    def _restamp(self, b: OperatorBuilder, out: OperatorOutput, summary: Summary, levels: int | None = None) -> None:
        """Connect this stream to ``b`` through ``summary`` and forward every batch at ``summary(t)``
        (enter, leave and feedback are all such operators)."""
        inp = b.new_input(self, None, [[summary]], levels=levels)

        def build(caps: list[Capability]) -> Callable[[], None]:
            caps[0].drop()

            def run() -> None:
                for cap, batch in inp:
                    # Sending at summary(t) is licensed by the declared input->output summary.
                    with cap.delayed(summary.results_in(cap.time)) as later:
                        out.give_batch(later, batch)

            return run

        b.build(build)

    def enter(self, inner: Scope, name: str = "Enter") -> Stream:
        """Bring this stream into the nested scope ``inner``: time ``t`` becomes ``(t, 0)``."""
        if inner.parent is not self.scope:
            raise BuildError("enter() takes a scope nested directly in this stream's scope")
        b = OperatorBuilder(inner, name)
        out, stream = b.new_output()
        self._restamp(b, out, Summary.enter(self.scope.levels), levels=self.scope.levels)
        return stream

    def leave(self, name: str = "Leave") -> Stream:
        """Take this stream out of its nested scope: time ``(t, i)`` becomes ``t``."""
        inner = self.scope
        if inner.parent is None:
            raise BuildError("leave() needs a stream inside a nested scope")
        b = OperatorBuilder(inner.parent, name)
        out, stream = b.new_output()
        self._restamp(b, out, Summary.leave(inner.levels), levels=inner.levels)
        return stream

    def connect_loop(self, handle: LoopHandle) -> None:
        """Feed this stream back into the loop opened by ``scope.feedback``."""
        if handle.connected:
            raise BuildError(f"feedback '{handle.name}' is already connected")
        if handle.scope is not self.scope:
            raise BuildError("connect_loop needs a stream of the scope the feedback was created in")
        self._restamp(handle.builder, handle.output, handle.summary)
        handle.connected = True

