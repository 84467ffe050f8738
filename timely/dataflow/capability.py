"""Capabilities: the right to send data at a time on an operator output.

A :class:`Capability` is counted in the progress protocol (+1 at its output's Source when created,
-1 when dropped). Python's garbage collector must not decide when that happens, so release is
explicit: :meth:`Capability.drop`, or use the capability as a context manager. A capability that is
never dropped keeps its time open forever, exactly like a leaked capability in timely.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..progress.timestamp import less_equal

if TYPE_CHECKING:  # pragma: no cover
    from .operator import OperatorCore


class CapabilityError(RuntimeError):
    """A capability was misused: dropped twice, moved backwards, or used for a foreign output."""


class Capability:
    """Permission to produce data at ``time`` on output ``port`` of an operator."""

    __slots__ = ("time", "_op", "port", "_live")

    def __init__(self, op: OperatorCore, port: int, time: Any, counted: bool = True) -> None:
        self.time = time
        self._op = op
        self.port = port
        self._live = True
        if counted:
            op.capability_change(port, time, +1)

    def _check(self) -> None:
        if not self._live:
            raise CapabilityError(f"operator '{self._op.name}': capability at {self.time!r} used after drop")

    def delayed(self, time: Any) -> Capability:
        """A new capability for a later (or equal) ``time`` on the same output."""
        self._check()
        if not less_equal(self.time, time):
            raise CapabilityError(
                f"operator '{self._op.name}': cannot delay a capability at {self.time!r} to the earlier time {time!r}"
            )
        return Capability(self._op, self.port, time)

    def downgrade(self, time: Any) -> None:
        """Move this capability forward to ``time`` (in place)."""
        self._check()
        if not less_equal(self.time, time):
            raise CapabilityError(
                f"operator '{self._op.name}': cannot downgrade a capability at {self.time!r} to the earlier time {time!r}"
            )
        if time != self.time:
            self._op.capability_change(self.port, time, +1)
            self._op.capability_change(self.port, self.time, -1)
            self.time = time

    def drop(self) -> None:
        """Release the capability; the output no longer holds ``time`` open."""
        self._check()
        self._live = False
        self._op.capability_change(self.port, self.time, -1)

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


class InputCapability:
    """The capability that comes with a received batch: valid only while the batch is handled.

    ``retain(output)`` / ``delayed(time, output)`` turn it into a :class:`Capability` through the
    operator's declared input->output summary.
    """

    __slots__ = ("time", "_op", "_input")

    def __init__(self, op: OperatorCore, input_port: int, time: Any) -> None:
        self.time = time
        self._op = op
        self._input = input_port

    def delayed(self, time: Any, output: int = 0) -> Capability:
        """A capability at ``time`` on ``output``; ``time`` must be reachable through the summary."""
        summaries = self._op.summary[self._input][output]
        if not summaries:
            raise CapabilityError(
                f"operator '{self._op.name}': input {self._input} is not connected to output {output}"
            )
        if not any(less_equal(s.results_in(self.time), time) for s in summaries):
            raise CapabilityError(
                f"operator '{self._op.name}': cannot create a capability at {time!r} from an input "
                f"message at {self.time!r} (summaries {list(summaries)})"
            )
        return Capability(self._op, output, time)

    def retain(self, output: int = 0) -> Capability:
        """A capability at this message's time on ``output``."""
        return self.delayed(self.time, output)

    def __repr__(self) -> str:
        return f"InputCapability(time={self.time!r}, input={self._input})"
