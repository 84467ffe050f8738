"""Capabilities: the right to send data at a time on an operator output.

A :class:`Capability` is counted in the progress protocol (+1 at its output's Source when created,
-1 when dropped). Python's garbage collector must not decide when that happens, so release is
explicit: :meth:`Capability.drop`, or use the capability as a context manager. A capability that is
never dropped keeps its time open forever, exactly like a leaked capability in timely.

A capability knows only its operator's index, name and the dataflow's progress batch: it records
its changes there and nothing else (ARCHITECTURE 2.2: they travel in the step's one progress batch).
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from ..errors import CapabilityError
from ..progress.change_batch import ChangeBatch
from ..progress.reachability import Source
from ..progress.timestamp import MAX_COORDINATE, Summary, beyond_end, depth, less_equal


def _beyond(name: str, time: Any) -> CapabilityError:
    """The error of a capability at a time no worker could send (see ``MAX_COORDINATE``)."""
    return CapabilityError(f"operator '{name}': time {time!r} has a coordinate beyond {MAX_COORDINATE} (2**64 - 1), "
                           "the largest a time can have (times travel between workers as 64-bit integers)")


def _time(name: str, like: Any, time: Any) -> Any:
    """``time`` as the engine keeps times, as deep as ``like``: an ``int``, or a tuple of ints in a
    nested scope. An integer of another type (numpy's ``int64``) becomes an ``int``; anything else
    (a float, a bool, a string) is refused. Invariant relied on: the progress tracker's frontiers
    keep ints apart from other types (``MutableAntichain``'s int fast path), so a time of another
    type would be passed over there, and its time taken as complete while it is held."""
    if type(time) is not int and not (type(time) is tuple and all(type(x) is int for x in time)):
        coordinates = time if isinstance(time, tuple) else (time,)
        for x in coordinates:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise CapabilityError(f"operator '{name}': {time!r} is not a time (an int, or a tuple of ints in a "
                                      f"nested scope): its {type(x).__name__} {x!r}")
        time = tuple(int(x) for x in time) if isinstance(time, tuple) else int(time)
    if depth(time) != depth(like):
        raise CapabilityError(f"operator '{name}': time {time!r} has {depth(time)} coordinate(s), but the "
                              f"operator's times have {depth(like)} (like {like!r})")
    return time


class Capability:
    """Permission to produce data at ``time`` on output ``port`` of operator ``node``."""

    __slots__ = ("time", "port", "node", "_name", "_progress", "_live")

    def __init__(self, progress: ChangeBatch, node: int, name: str, port: int, time: Any,
                 counted: bool = True) -> None:
        self.time = time
        self.port = port
        self.node = node  # the operator's index in its dataflow
        self._name = name
        self._progress = progress  # the dataflow's progress batch of the current step
        self._live = True
        if counted:
            progress.update((Source(node, port), time), +1)

    def _check(self) -> None:
        if not self._live:
            raise CapabilityError(f"operator '{self._name}': capability at {self.time!r} used after drop")

    def owned_by(self, progress: ChangeBatch, node: int) -> bool:
        """True if this capability belongs to operator ``node`` of the dataflow counting in ``progress``."""
        return self.node == node and self._progress is progress

    def delayed(self, time: Any) -> Capability:
        """A new capability for a later (or equal) ``time`` on the same output."""
        self._check()
        time = _time(self._name, self.time, time)
        if not less_equal(self.time, time):
            raise CapabilityError(
                f"operator '{self._name}': cannot delay a capability at {self.time!r} to the earlier time {time!r}"
            )
        if beyond_end(time):
            raise _beyond(self._name, time)
        return Capability(self._progress, self.node, self._name, self.port, time)

    def downgrade(self, time: Any) -> None:
        """Move this capability forward to ``time`` (in place)."""
        self._check()
        time = _time(self._name, self.time, time)
        if not less_equal(self.time, time):
            raise CapabilityError(
                f"operator '{self._name}': cannot downgrade a capability at {self.time!r} to the earlier time {time!r}"
            )
        if time != self.time:
            if beyond_end(time):
                raise _beyond(self._name, time)
            source = Source(self.node, self.port)
            self._progress.update((source, time), +1)
            self._progress.update((source, self.time), -1)
            self.time = time

    def drop(self) -> None:
        """Release the capability; the output no longer holds ``time`` open."""
        self._check()
        self._live = False
        self._progress.update((Source(self.node, self.port), self.time), -1)

    @property
    def live(self) -> bool:
        """False once the capability was dropped."""
        return self._live

    def __enter__(self) -> Capability:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.drop()

    def __repr__(self) -> str:
        state = "" if self._live else ", dropped"
        return f"Capability(time={self.time!r}, output={self.port}{state})"


class InputInfo:
    """What the capabilities of one operator input share: the operator (its ``node`` index, its
    ``name``, its dataflow's ``progress`` batch, and ``operator`` itself, whose ``activations``
    count its invocations), the ``input`` number, and per output the ``summaries`` from this input
    to it; ``identity`` holds the outputs reached by the identity."""

    __slots__ = ("progress", "node", "name", "input", "summaries", "identity", "operator")

    def __init__(self, progress: ChangeBatch, node: int, name: str, input_port: int,
                 summaries: Sequence[Sequence[Summary]], levels: int, operator: Any) -> None:
        self.operator = operator
        self.progress = progress
        self.node = node
        self.name = name
        self.input = input_port
        self.summaries = summaries
        self.identity = frozenset(o for o, row in enumerate(summaries) if Summary.identity(levels) in row)


class InputCapability:
    """The capability that comes with a received batch: valid only while the batch is handled, in
    the operator invocation that received it (after it, the batch's time may be complete; using it
    then raises :class:`CapabilityError`: keep ``retain()`` instead).

    ``retain(output)`` / ``delayed(time, output)`` turn it into a :class:`Capability` through the
    operator's declared input->output summary.
    """

    __slots__ = ("time", "info", "call")

    def __init__(self, info: InputInfo, time: Any) -> None:
        self.time = time
        self.info = info  # shared by every batch of the input: one allocation per batch
        self.call = info.operator.activations  # the invocation it is valid in

    @property
    def valid(self) -> bool:
        """True during the operator invocation that received the batch."""
        return self.call == self.info.operator.activations

    def stale_error(self) -> CapabilityError:
        """The error of a use after the invocation that received the batch."""
        return CapabilityError(
            f"operator '{self.info.name}': the input capability at {self.time!r} was used after the invocation "
            "that received its batch (the time may be complete by now); keep cap.retain() to send later")

    @property
    def input(self) -> int:
        """The number of the input the batch arrived at."""
        return self.info.input

    def summaries(self, output: int) -> Sequence[Summary]:
        """The summaries from this capability's input to ``output`` (empty: not connected)."""
        rows = self.info.summaries
        return rows[output] if 0 <= output < len(rows) else ()

    def delayed(self, time: Any, output: int = 0) -> Capability:
        """A capability at ``time`` on ``output``; ``time`` must be reachable through the summary."""
        info = self.info
        if self.call != info.operator.activations:
            raise self.stale_error()
        summaries = self.summaries(output)
        if not summaries:
            raise CapabilityError(f"operator '{info.name}': input {info.input} is not connected to output {output}")
        time = _time(info.name, summaries[0].results_in(self.time), time)
        if not any(less_equal(s.results_in(self.time), time) for s in summaries):
            raise CapabilityError(
                f"operator '{info.name}': cannot create a capability at {time!r} from an input "
                f"message at {self.time!r} (summaries {list(summaries)})"
            )
        if beyond_end(time):
            raise _beyond(info.name, time)
        return Capability(info.progress, info.node, info.name, output, time)

    def retain(self, output: int = 0) -> Capability:
        """A capability at this message's time on ``output``."""
        return self.delayed(self.time, output)

    def __repr__(self) -> str:
        return f"InputCapability(time={self.time!r}, input={self.info.input})"
