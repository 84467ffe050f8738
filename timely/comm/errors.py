"""The errors of the communication layer.

Each derives from :class:`timely.errors.TimelyError` and keeps a conventional builtin base
(``RuntimeError``, or ``ValueError`` for a bad hostfile). :class:`CommError` and its subclasses are
fatal: the job cannot continue, except :class:`MessageTooLarge`, which only refuses one push
(the caller splits the message). Nothing here knows of timestamps or dataflows.
"""
from __future__ import annotations

from ..errors import TimelyError

__all__ = ["AddressInUse", "ChannelMismatch", "CommError", "FramingError", "HandshakeError", "HostfileError",
           "MessageTooLarge", "PeerLost"]


class CommError(TimelyError, RuntimeError):
    """A fatal communication failure: the job cannot continue."""

    blames_operator = False  # (met by an operator's send, it is not that operator's failure)


class PeerLost(CommError):
    """A peer worker failed, was killed, or became unreachable. ``peer`` is its index."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class HandshakeError(CommError):
    """Start-up failed: a peer rejected us (another job, another size) or never answered."""


class AddressInUse(CommError):
    """The endpoint this worker must listen on is taken by another process."""


class ChannelMismatch(CommError):
    """A peer used a channel id this worker never allocated: the workers built different dataflows."""


class FramingError(CommError):
    """A frame that does not follow this protocol (another program, or another version)."""


class MessageTooLarge(CommError):
    """A pushed message whose encoding (``size`` bytes) exceeds the ``limit`` of the allocator's
    ``max_message_bytes``; nothing was sent, so the caller may split it and push the parts."""

    blames_operator = True  # (the operator's records were too large)

    def __init__(self, size: int, limit: int, message: str) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class HostfileError(TimelyError, ValueError):
    """A hostfile that cannot be parsed."""
