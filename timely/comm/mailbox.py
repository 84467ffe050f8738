"""The receive side of one worker's channels: per-channel queues and the channels with news.

Every allocator keeps one :class:`Mailbox`. A remote allocator hands it each decoded message with
:meth:`Mailbox.deliver`; a push to this worker itself goes straight into the channel's queue
through a :class:`LoopbackPusher`, by reference (``push_buffers`` queues ``(head,
tuple(buffers))``). A peer may run ahead and send on a channel this worker has not allocated yet:
those messages wait in the mailbox until the channel is allocated.

Unread bytes. :attr:`Mailbox.unread_bytes` counts the encoded size of the peers' messages (with
their buffers, for ``push_buffers``) the worker has not taken yet: delivered, and not yet reported
by :meth:`Mailbox.take_events` (the worker reads every reported channel's puller right after
taking its events). The remote allocator stops reading from the network while it is over its
budget, so a slow worker holds a bounded amount of received data and its senders wait.

Messages waiting for a channel not allocated yet do not count until it is allocated (then they
are unread on it, until the next take): they are held however large. Invariant relied on: what
lets this worker reach that channel (the last messages of the dataflows before it, from any peer)
comes over the same connection, so stopping to read because a peer ran ahead could stop this
worker for good.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from .errors import ChannelMismatch


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

    max_bytes: int | None = None  # nothing is encoded

    def push(self, message: Any) -> None:
        """Queue ``message`` (by reference: it must not be mutated afterwards)."""
        self._puller.queue.append(message)
        self._events.add(self._puller.channel)

    @staticmethod
    def encode_items(items: list) -> list:
        """A piece of a gathered message: the list itself, by reference."""
        return items

    def push_items(self, head: Any, bodies: list, count: int) -> None:
        """Queue ``(head, items)``, the items of the pieces ``bodies`` in order."""
        self.push((head, [item for body in bodies for item in body]))

    def push_buffers(self, head: Any, buffers: Iterable[Any]) -> None:
        """Queue ``(head, tuple(buffers))``, the buffers by reference (not copied, not checked)."""
        self.push((head, tuple(buffers)))


class Mailbox:
    """The pullers of worker ``index``, by channel, and the set of channels that received messages.

    ``events`` is shared with the :class:`LoopbackPusher` objects this mailbox hands out.
    """

    __slots__ = ("index", "events", "unread_bytes", "_pullers", "_last", "_pending", "_pending_from",
                 "_pending_bytes", "_retired", "_retired_below")

    def __init__(self, index: int) -> None:
        self.index = index
        self.events: set[int] = set()
        self.unread_bytes = 0  # see the module docstring
        self._pullers: dict[int, LocalPuller] = {}
        self._last = -1  # the last channel allocated; channels are allocated in increasing order
        self._pending: dict[int, list[Any]] = {}  # messages for channels not allocated yet
        self._pending_from: dict[int, int] = {}  # the first worker that sent on such a channel
        self._pending_bytes: dict[int, int] = {}  # their encoded size, by channel
        # Channels of completed dataflows (retire): every channel below _retired_below, and these.
        self._retired: set[int] = set()
        self._retired_below = 0

    def open(self, channel: int) -> LocalPuller:
        """Create the puller of ``channel``, holding whatever peers already sent on it.

        ``channel`` must be larger than every channel opened before (``ValueError`` otherwise). A
        message waiting for a smaller channel that was skipped raises :class:`ChannelMismatch`.
        """
        if channel <= self._last:
            raise ValueError(f"channel {channel} allocated out of creation order (last was {self._last})")
        early = [c for c in self._pending if c < channel]
        if early:
            raise self._mismatch(early[0], channel, self._pending_from[early[0]])
        self._last = channel
        puller = self._pullers[channel] = LocalPuller(channel)
        # A peer may be ahead of us: what it already sent on this channel is waiting here.
        waiting = self._pending.pop(channel, None)
        self._pending_from.pop(channel, None)
        self.unread_bytes += self._pending_bytes.pop(channel, 0)  # unread now, until the next take_events
        if waiting:
            puller.queue.extend(waiting)
            self.events.add(channel)
        return puller

    def loopback(self, puller: LocalPuller) -> LoopbackPusher:
        """A pusher from this worker to itself on ``puller``'s channel."""
        return LoopbackPusher(puller, self.events)

    def deliver(self, source: int, channel: int, message: Any, size: int) -> None:
        """Queue ``message`` from worker ``source`` (``size``: its encoded bytes); raise
        :class:`ChannelMismatch` if ``channel`` was skipped by this worker (it can never be
        allocated any more)."""
        puller = self._pullers.get(channel)
        if puller is not None:
            puller.queue.append(message)
            self.events.add(channel)
            self.unread_bytes += size
        elif channel > self._last:
            if channel not in self._pending:  # the sender is ahead of us
                self._pending[channel] = []
                self._pending_from[channel] = source
                self._pending_bytes[channel] = 0
            self._pending[channel].append(message)
            self._pending_bytes[channel] += size  # not unread yet (see the module docstring)
        elif channel < self._retired_below or channel in self._retired:
            pass  # its dataflow completed here, so the message changes no count (nothing reads it)
        else:
            raise self._mismatch(channel, self._last, source)

    def retire(self, channels: Iterable[int]) -> None:
        """Drop the queues of ``channels``, whose dataflow has completed on this worker (it holds no
        pointstamp, so a message still arriving on one cannot change a count: it is dropped)."""
        for channel in channels:
            if self._pullers.pop(channel, None) is not None:
                self._retired.add(channel)
                self.events.discard(channel)
        while self._retired_below in self._retired:  # channels are allocated in order: keep the set small
            self._retired.discard(self._retired_below)
            self._retired_below += 1

    def take_events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call.

        The caller reads these channels' pullers now: nothing counts as unread any more."""
        ev = sorted(self.events)
        self.events.clear()
        self.unread_bytes = 0
        return ev

    def close(self) -> None:
        """Drop every queue."""
        self._pullers.clear()
        self._pending.clear()
        self._pending_from.clear()
        self._pending_bytes.clear()
        self.unread_bytes = 0

    def _mismatch(self, channel: int, allocated: int, source: int) -> ChannelMismatch:
        return ChannelMismatch(
            f"worker {self.index}: worker {source} sent a message on channel {channel}, which this worker "
            f"never allocated (it has reached channel {allocated}); channels are matched by creation order, "
            "so every worker must build the same dataflows in the same order")
