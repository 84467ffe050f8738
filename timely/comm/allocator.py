"""The communication interface: numbered channels between workers.

This layer moves messages between workers. It knows nothing of timestamps, operators or progress;
a message is any msgpack-serialisable Python object (a remote allocator serialises it, the local
allocator passes it by reference, so a pushed object must not be mutated afterwards).

Contract every allocator keeps (the progress protocol relies on it, DESIGN.md section 2.3):

* Channels are identified by integers allocated in the same order on every worker.
* Delivery between one pair of workers is FIFO across *all* channels, loss-free and duplicate-free.
* A push never blocks the caller forever: when a peer is slow, the allocator buffers (bounded) and
  ``release`` waits for room while still receiving, so two workers pushing to each other cannot
  deadlock.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class Pusher(Protocol):
    """Sends messages to one target worker on one channel."""

    def push(self, message: Any) -> None:
        """Queue ``message`` for delivery; it is sent at the latest by the next ``release``."""


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

    def receive(self) -> None:
        """Move every message that has arrived from the network into its channel's puller."""

    def release(self) -> None:
        """Flush queued sends to the network."""

    def events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call."""

    def await_events(self, timeout: float | None) -> None:
        """Block until a message arrives or ``timeout`` seconds pass (``None``: no limit)."""

    def close(self) -> None:
        """Release sockets and resources; the allocator cannot be used afterwards."""


class LocalPuller:
    """A FIFO queue of messages for one channel (used by every allocator for its receive side)."""

    __slots__ = ("queue", "channel")

    def __init__(self, channel: int) -> None:
        self.channel = channel
        self.queue: deque[Any] = deque()

    def pull(self) -> Any | None:
        """Return the next message, or ``None``."""
        return self.queue.popleft() if self.queue else None

    def drain(self) -> list[Any]:
        """Return and remove every queued message."""
        items = list(self.queue)
        self.queue.clear()
        return items


class LoopbackPusher:
    """Pushes straight into a puller of the same process, marking the channel as active."""

    __slots__ = ("_puller", "_events")

    def __init__(self, puller: LocalPuller, events: set[int]) -> None:
        self._puller = puller
        self._events = events

    def push(self, message: Any) -> None:
        self._puller.queue.append(message)
        self._events.add(self._puller.channel)


class ThreadAllocator:
    """The allocator of a single worker: every channel is a local queue, nothing is serialised."""

    def __init__(self) -> None:
        self.index = 0
        self.peers = 1
        self._pullers: dict[int, LocalPuller] = {}
        self._events: set[int] = set()
        self._last = -1

    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        if channel <= self._last:
            raise ValueError(f"channel {channel} allocated out of creation order (last was {self._last})")
        self._last = channel
        puller = LocalPuller(channel)
        self._pullers[channel] = puller
        return [LoopbackPusher(puller, self._events)], puller

    def receive(self) -> None:
        pass

    def release(self) -> None:
        pass

    def events(self) -> list[int]:
        ev = sorted(self._events)
        self._events.clear()
        return ev

    def await_events(self, timeout: float | None) -> None:
        # A single worker only receives from itself: nothing can arrive while it waits.
        if timeout:
            import time

            time.sleep(min(timeout, 0.01))

    def close(self) -> None:
        self._pullers.clear()
