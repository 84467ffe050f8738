"""The public operator builder: the one way every operator, in timely and outside it, is made.

Building an operator reserves its index (creation order, identical on every worker), connects its
inputs to upstream streams through a pact, declares its outputs and its input->output summaries,
then installs its logic::

    b = OperatorBuilder(scope, "Double")
    inp = b.new_input(stream, Exchange(0))
    out, doubled = b.new_output()

    def constructor(caps):           # one capability per output, at the minimum time
        caps[0].drop()
        def logic():
            for cap, batch in inp:
                out.give_batch(cap, [2 * x for x in batch])
        return logic

    b.build(constructor)

The logic runs when the operator is scheduled (data arrived, its activator fired, or, with
:meth:`OperatorBuilder.set_frontier_interest`, an input frontier moved); the outputs are flushed
after each run. After :meth:`build` the operator's shape is frozen.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BuildError
from ..progress.timestamp import Summary, minimum
from .capability import Capability
from .channels import Pact, Pipeline
from .context import Activator
from .handles import OperatorInput, OperatorOutput
from .operator import InputPort, OutputPort

if TYPE_CHECKING:  # pragma: no cover
    from .scope import Scope, Stream

Constructor = Callable[[list[Capability]], "Callable[[], object] | None"]


@dataclass(frozen=True)
class OperatorInfo:
    """What an operator learns about itself: its ``name``, ``index`` in the dataflow, this
    ``worker`` of ``peers``, and its ``activator`` (``activate()``, ``activate_after(seconds)``)."""

    name: str
    index: int
    worker: int
    peers: int
    activator: Activator


class OperatorBuilder:
    """Builds one operator in ``scope``: ``new_input`` / ``new_output``, then ``build(constructor)``.

    By default every input is connected to every output by the identity summary; pass
    ``connection`` (one list of summaries per output) to ``new_input`` to declare something else.
    """

    def __init__(self, scope: Scope, name: str) -> None:
        self.scope = scope
        self._df = scope.df
        self._core = self._df.add_operator(name)
        self._connections: list[list[list[Summary]] | None] = []
        self._built = False

    @property
    def index(self) -> int:
        """The operator's index in its dataflow."""
        return self._core.index

    @property
    def name(self) -> str:
        """The operator's name (in errors and the dataflow's shape)."""
        return self._core.name

    @property
    def activator(self) -> Activator:
        """Schedules this operator: ``activate()`` now, ``activate_after(seconds)`` later."""
        return Activator(self._core.ctx.activations, self._core.index)

    @property
    def info(self) -> OperatorInfo:
        """Name, index, worker, peers and activator of the operator being built."""
        return OperatorInfo(self.name, self.index, self.scope.index, self.scope.peers, self.activator)

    def _check_open(self, what: str) -> None:
        if self._built:
            raise BuildError(f"operator '{self.name}': cannot {what} after build()")

    def new_input(self, stream: Stream, pact: Pact | None = None, connection: list[list[Summary]] | None = None,
                  levels: int | None = None) -> OperatorInput:
        """Connect ``stream`` to a new input through ``pact`` (default: pipeline); return its handle.

        The stream must be in this operator's scope (unless ``levels`` names the depth of the
        stream's times, for operators that cross scopes); ``connection`` lists, per output, the
        summaries from this input to it.
        """
        self._check_open("add an input")
        core = self._core
        if stream.scope.df is not self._df:
            raise BuildError(f"operator '{core.name}': stream belongs to another dataflow")
        if levels is None and stream.scope is not self.scope:
            raise BuildError(
                f"operator '{core.name}': stream belongs to another scope; bring it in with enter() or "
                "take it out with leave()"
            )
        port = InputPort(core, len(core.inputs), levels or self.scope.levels)
        core.inputs.append(port)
        self._connections.append(connection)
        self._df.connect(stream, port, pact or Pipeline())
        return OperatorInput(port)

    def new_output(self, levels: int | None = None) -> tuple[OperatorOutput, Stream]:
        """Declare a new output; return its handle and the stream it produces.

        Its times have ``levels`` coordinates (default: the scope's); the stream belongs to the
        scope of that depth.
        """
        from .scope import Stream  # scope.py builds its operators with this module

        self._check_open("add an output")
        core = self._core
        port = OutputPort(core, len(core.outputs), levels or self.scope.levels)
        core.outputs.append(port)
        handle = OperatorOutput(port)
        core.handles.append(handle)
        return handle, Stream(self.scope, core.index, port.port)

    def set_frontier_interest(self, interest: bool = True) -> None:
        """Schedule the operator whenever one of its input frontiers changes."""
        self._check_open("change frontier interest")
        self._core.frontier_interest = interest

    def frontier_interest_switch(self) -> Callable[[bool], None]:
        """:meth:`set_frontier_interest` as a callable that also works once the dataflow runs: a
        probe is scheduled on frontier changes only while someone watches it."""
        core = self._core

        def switch(interest: bool) -> None:
            core.frontier_interest = interest

        return switch

    def build(self, constructor: Constructor) -> None:
        """Install the logic: ``constructor(capabilities)`` returns a zero-argument callable.

        The constructor receives one capability at the minimum time per output; it should drop those
        it does not need (they keep downstream frontiers at the minimum until dropped). It may return
        ``None`` for an operator that is never scheduled (an input driven from outside).
        """
        self._check_open("build")
        self._built = True
        core = self._core
        core.summary = [
            conn if conn is not None else [[Summary.identity(inp.levels)] for _ in core.outputs]
            for inp, conn in zip(core.inputs, self._connections)
        ]
        for i, row in enumerate(core.summary):
            if len(row) != len(core.outputs):
                raise BuildError(f"operator '{core.name}': input {i} connection must list {len(core.outputs)} outputs")
            levels = core.inputs[i].levels
            for o, summaries in enumerate(row):
                for s in summaries:
                    if not isinstance(s, Summary) or s.keep > levels or \
                            s.output_levels(levels) != core.outputs[o].levels:
                        raise BuildError(f"operator '{core.name}': the summary {s!r} from input {i} to output {o} "
                                         f"does not fit the ports: the input's times have {levels} coordinate(s), "
                                         f"the output's {core.outputs[o].levels}")
        # The initial capabilities are already counted: every output starts at `peers` x minimum.
        progress = core.ctx.progress
        caps = [Capability(progress, core.index, core.name, o.port, minimum(o.levels), counted=False)
                for o in core.outputs]
        core.logic = constructor(caps)
        self._df.operator_built(core)
