"""The runtime part of an operator on one worker: its ports, summaries and installed logic.

An operator is built once (:mod:`timely.dataflow.builder`) and then only scheduled. It holds the
dataflow's shared :class:`~timely.dataflow.context.Context`, never the dataflow or the worker:
everything an invocation changes (records consumed, capabilities created or dropped, records
produced) goes into the context's progress batch for this step, so it is never split.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Protocol

from ..errors import OperatorError, TimelyError
from ..progress.frontier import Frontier, MutableAntichain
from ..progress.reachability import Location, Target
from ..progress.timestamp import Summary
from .context import Context


class Flushable(Protocol):
    """An output handle: its buffered records are sent when the operator's invocation ends."""

    def flush(self) -> None:
        """Send the records buffered so far."""


class InputPort:
    """The receiving end of one operator input on this worker: a queue of ``(time, batch)``."""

    __slots__ = ("op", "port", "queue", "levels", "frontier", "_antichains", "_fuzzer")

    def __init__(self, op: OperatorCore, port: int, levels: int) -> None:
        self.op = op
        self.port = port
        self.levels = levels
        self.queue: deque[tuple[Any, Sequence, int]] = deque()  # (time, batch, its length when delivered)
        self._fuzzer = op.ctx.fuzzer
        # The view is created once and stays valid: install() swaps the antichain behind it.
        self._antichains = [MutableAntichain()]
        self.frontier = Frontier(self._antichains)

    @property
    def antichain(self) -> MutableAntichain:
        """The tracker's counted frontier of this input (installed when the dataflow is built)."""
        return self._antichains[0]

    def install(self, antichain: MutableAntichain) -> None:
        """Make this input's frontier the tracker's implication at its location."""
        self._antichains[0] = antichain

    def deliver(self, time: Any, batch: Sequence) -> None:
        """Queue a received batch and activate the operator (when fuzzing: hand it to the fuzzer,
        which queues it at a later step)."""
        n = len(batch)
        self.op.records_in += n  # metrics (timely.metrics): per batch, never per record
        if self._fuzzer is None:
            # The length goes with the batch: it is what the sender counted as produced, and what
            # the consumer counts as consumed (a batch changed after it was sent is an error).
            self.queue.append((time, batch, n))
            self.op.activate()
        else:
            self._fuzzer.hold(self, time, batch, n)


class OutputPort:
    """The sending end of one operator output: every edge leaving it, with its channel."""

    __slots__ = ("op", "port", "levels", "channels", "_update")

    def __init__(self, op: OperatorCore, port: int, levels: int) -> None:
        self.op = op
        self.port = port
        self.levels = levels
        self.channels: list[tuple[Any, Location]] = []  # (Channel, Target location)
        self._update = op.ctx.progress.update

    def send(self, time: Any, batch: Sequence) -> None:
        """Push ``batch`` at ``time`` along every edge and count it as produced at each target."""
        if not batch:
            return
        self.op.records_out += len(batch)  # metrics (timely.metrics): records produced, once per batch
        update = self._update
        for channel, target in self.channels:
            n = channel.push(time, batch)
            update((target, time), n)


class OperatorCore:
    """One operator of a dataflow on this worker: ports, summaries, and the installed logic.

    ``logic`` is ``None`` for an operator driven from outside the dataflow (an input): it is never
    scheduled. After each invocation the registered output handles are flushed.
    """

    def __init__(self, ctx: Context, index: int, name: str) -> None:
        self.ctx = ctx
        self.index = index
        self.name = name
        self.inputs: list[InputPort] = []
        self.outputs: list[OutputPort] = []
        self.summary: list[list[list[Summary]]] = []  # [input][output] -> summaries
        self.frontier_interest = False
        self.logic: Callable[[], Any] | None = None
        self.handles: list[Flushable] = []  # output handles flushed after each invocation
        # Metrics (timely.metrics), counted per batch and per invocation so that they can stay on:
        # records received at the inputs and sent at the outputs, invocations and their seconds.
        self.records_in = 0
        self.records_out = 0
        self.activations = 0
        self.busy_seconds = 0.0

    def consumed(self, port: int, time: Any, count: int) -> None:
        """Record ``count`` records at ``time`` taken from input ``port``."""
        if count:
            self.ctx.progress.update((Target(self.index, port), time), -count)

    def activate(self) -> None:
        """Schedule this operator in the current or next step."""
        self.ctx.activations.activate(self.index)

    def schedule(self) -> None:
        """Run the logic once and flush its outputs; user exceptions become :class:`OperatorError`.

        An engine error whose ``blames_operator`` is False (a communication failure: a send waiting
        for room learned that a peer was lost) is not the operator's and passes through unwrapped,
        so that the worker's failure is seen as a consequence of the peer's; a refused oversized
        message (``MessageTooLarge``) is the operator's, and wrapped."""
        if self.logic is None:
            return
        started = perf_counter()
        try:
            self.logic()
            for handle in self.handles:
                handle.flush()
            # Batches left in an input (the logic broke out of its loop) are taken in a later
            # invocation: nothing else would schedule the operator for them (they arrived already),
            # and their time could never complete.
            for port in self.inputs:
                if port.queue:
                    self.activate()
                    break
        except OperatorError:
            raise
        except TimelyError as e:
            if not e.blames_operator:
                raise
            raise OperatorError(self.name, self.ctx.index, e) from e
        except Exception as e:
            raise OperatorError(self.name, self.ctx.index, e) from e
        finally:
            self.activations += 1
            self.busy_seconds += perf_counter() - started

    def __repr__(self) -> str:
        return f"<operator {self.index} '{self.name}'>"
