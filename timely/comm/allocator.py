"""The communication interface: numbered channels between workers.

This layer moves messages between workers. It knows nothing of timestamps, operators or progress;
a message is any msgpack-serialisable Python object (a remote allocator serialises it, the local
allocator passes it by reference, so a pushed object must not be mutated afterwards).

Contract every allocator keeps (the progress protocol relies on it, ARCHITECTURE.md section 2.3):

* Channels are identified by integers allocated in the same order on every worker.
* Delivery between one pair of workers is FIFO across *all* channels, loss-free and duplicate-free.
* A push never blocks the caller forever: when a peer is slow, the allocator buffers (bounded) and
  ``release`` waits for room while still receiving, so two workers pushing to each other cannot
  deadlock.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Set
from typing import Any, Protocol

from .mailbox import LocalPuller, LoopbackPusher, Mailbox

__all__ = ["Allocator", "LocalPuller", "LoopbackPusher", "Puller", "Pusher", "ThreadAllocator"]


class Pusher(Protocol):
    """Sends messages to one target worker on one channel.

    Besides whole messages, a pusher sends messages of the shape ``(head, items)`` gathered from
    pieces: ``encode_items(items)`` turns a piece into the pusher's form (bytes for a remote one,
    the list itself for a loopback), and ``push_items(head, bodies, count)`` sends the message made
    of ``head`` and the ``count`` items of those pieces, received as ``push((head, items))`` is.
    ``max_bytes`` bounds one message's encoding (``None``: no bound); ``len`` of a body is its size.

    ``push_buffers(head, buffers)`` sends raw buffers beside a serialised ``head``: the target's
    puller receives ``(head, buffers)``, ``head`` as a pushed message is, ``buffers`` a tuple of
    read-only buffer objects with the same bytes (a remote pusher sends each as a frame of its own
    and the receiver gets ``memoryview`` objects over the received frames, neither side copying; a
    loopback queues the very objects pushed). ``max_bytes`` bounds the head's encoding and the
    buffers together. The buffers must not be modified afterwards.
    """

    @property
    def max_bytes(self) -> int | None:
        """The largest encoded message this pusher sends (``None``: no bound)."""

    def push(self, message: Any) -> None:
        """Queue ``message`` for delivery; it is sent at the latest by the next ``release``."""

    def encode_items(self, items: list) -> Any:
        """One piece of a gathered message."""

    def push_items(self, head: Any, bodies: list, count: int) -> None:
        """Queue the message ``(head, items)`` gathered from ``bodies`` (``count`` items in all)."""

    def push_buffers(self, head: Any, buffers: Iterable[Any]) -> None:
        """Queue the message ``(head, buffers)``; ``buffers`` are objects with the buffer protocol."""


class Puller(Protocol):
    """Receives the messages of one channel from all workers, in per-sender FIFO order."""

    def pull(self) -> Any | None:
        """Return the next received message, or ``None`` when none is waiting."""

    def drain(self) -> list[Any]:
        """Return and remove every received message."""


class Allocator(Protocol):
    """Creates channels and moves their messages between ``peers`` workers."""

    index: int
    peers: int

    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        """Return one pusher per target worker (by index) and this worker's puller for ``channel``.

        ``channel`` must be larger than every channel allocated before (creation order).
        """

    def retire(self, channels: Iterable[int]) -> None:
        """Let go of ``channels``, whose dataflow has completed on this worker."""

    def receive(self) -> None:
        """Move every message that has arrived from the network into its channel's puller."""

    def release(self) -> None:
        """Flush queued sends to the network."""

    def cork(self) -> None:
        """Gather the messages pushed to each other worker until :meth:`uncork` (a hint: an
        allocator may send them at once)."""

    def uncork(self) -> None:
        """Send what was gathered since :meth:`cork`, in push order per worker."""

    def events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call.

        The worker reads only these channels' pullers: a channel whose puller holds a message must
        be reported (once) after the message was queued, or the message is never read.
        """

    def await_events(self, timeout: float | None) -> None:
        """Block until a message arrives or ``timeout`` seconds pass (``None``: no limit)."""

    def incoming(self) -> bool:
        """True when a message waits to be received or read (cheap: polled between the slices of
        background work, which give way to it)."""

    def finished(self) -> Set[int]:
        """The workers that said goodbye: they finished, and every message they sent has been
        received (into its puller) by the time they appear here."""

    def close(self) -> None:
        """Release sockets and resources; the allocator cannot be used afterwards."""


class ThreadAllocator:
    """The allocator of a single worker: every channel is a local queue, nothing is serialised."""

    def __init__(self) -> None:
        self.index = 0
        self.peers = 1
        self._mailbox = Mailbox(0)

    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        """Return the loopback pusher and the puller of ``channel``."""
        puller = self._mailbox.open(channel)
        return [self._mailbox.loopback(puller)], puller

    def retire(self, channels: Iterable[int]) -> None:
        """Drop the queues of ``channels`` (their dataflow completed)."""
        self._mailbox.retire(channels)

    def receive(self) -> None:
        """Nothing to receive: every message was queued when it was pushed."""

    def release(self) -> None:
        """Nothing to flush."""

    def cork(self) -> None:
        """Nothing to gather: pushes are queued locally."""

    def uncork(self) -> None:
        """Nothing gathered."""

    def events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call."""
        return self._mailbox.take_events()

    def await_events(self, timeout: float | None) -> None:
        """Sleep briefly: a single worker only receives from itself, so nothing can arrive."""
        if timeout:
            time.sleep(min(timeout, 0.01))

    def incoming(self) -> bool:
        """True when a channel holds a message not yet read (only this worker pushes them)."""
        return bool(self._mailbox.events)

    def finished(self) -> Set[int]:
        """No other worker: none finished."""
        return frozenset()

    def close(self) -> None:
        """Drop every queue."""
        self._mailbox.close()
