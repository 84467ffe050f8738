"""The ZeroMQ allocator: numbered channels between worker processes.

Sockets. Every worker binds one ``ROUTER`` socket (its endpoint, inbound only) and connects one
``DEALER`` socket to every other worker's ``ROUTER`` (outbound only, one per peer). So each ordered
pair of workers (i -> j) has exactly one connection, i's ``DEALER`` to j's ``ROUTER``, and it carries
every channel from i to j: **progress relies on this per-pair FIFO** (a batch's increments reach j
before any later decrement from i). ZeroMQ's ``DEALER`` never drops at its high-water mark (a
non-blocking send fails with ``EAGAIN`` instead), and nothing here uses PUB/SUB.

Framing. One pushed message is one two-frame ZeroMQ message: a 16-byte header and a msgpack
payload (:mod:`timely.comm.framing`). Payloads decode with ``use_list=False``: tuples round-trip as
tuples and lists arrive as tuples. ``push_buffers(head, buffers)`` sends one ``DATA_BUFFERS``
message of 2 + n frames: the header, the msgpack ``head``, then each buffer as a frame of its own,
sent without copying (ZeroMQ keeps a reference until it is sent: the buffers must not be modified
afterwards) and received without copying: the puller gets ``(head, buffers)``, ``buffers`` a tuple
of read-only ``memoryview`` objects over the received frames (at no particular alignment). It shares
the sequence numbers, the FIFO order, the backlog and the limits of every other message: its size is
the head's encoding plus all buffers. A push to this worker itself is a local loopback: the object
(or ``(head, tuple(buffers))``) is queued by reference, never serialised.

Handshake. Each ``DEALER`` first sends ``HELLO`` (job token, worker index, number of workers,
message size limit); the listener answers ``WELCOME`` or ``REJECT`` with a reason. A peer of another
job (another token) is rejected and raises :class:`HandshakeError` on its side, so two jobs on one
machine never cross-talk. The constructor returns once every peer has been greeted in both
directions. Before its ``HELLO`` is accepted, a connection's messages are validated (frame count,
sizes, kind) and a bad one is refused and logged, rate-limited (:mod:`timely.comm.gate`); no frame
over ``max_message_bytes`` is ever buffered (ZeroMQ's ``MAXMSGSIZE`` disconnects its sender).

Security. With a job ``secret`` (:mod:`timely.comm.secret`), every connection uses CURVE: traffic
is encrypted, and only processes that hold the secret can connect at all; a worker with another
secret (or none) fails the start-up with a :class:`HandshakeError` saying so. Without one, anyone
who can reach an endpoint can connect, and only the token check keeps them out of the job.

Backpressure. Sends are non-blocking. What ZeroMQ cannot take (its queue to a peer holds ``hwm``
messages) waits in a per-peer backlog; ``release`` flushes, and while a peer's backlog exceeds
``backlog_bytes`` it waits for room *while receiving into pullers*, so two workers pushing at each
other cannot deadlock and a slow consumer slows its producers. Received messages the worker has
not taken yet (its mailbox) are bounded too: past ``mailbox_bytes`` nothing more is read from
ZeroMQ (so the senders' queues fill and they wait), and ``release`` stops waiting (the worker must
read its mailbox first). Messages for channels this worker has not allocated yet do not count
until it does (see :mod:`timely.comm.mailbox`). Nothing is ever dropped.

Goodbye. ``close()`` sends ``GOODBYE`` after the last data message to every peer, then keeps
receiving until each live peer answers ``ACK`` (it has read the ``GOODBYE``, hence everything before
it) or has said ``GOODBYE`` itself (it finished and needs nothing more). Only then are the sockets
closed: lingering alone is not enough, since a receiver whose queue is full drops what it had not
yet queued when the connection closes.

Failure. A ``DEALER`` whose connection drops (socket monitor; the kernel's TCP probes catch silent hosts)
while that peer has not said ``GOODBYE`` makes ``receive``/``release``/``await_events`` raise
:class:`PeerLost` naming the peer, after ``goodbye_grace`` seconds without any message from it. A
peer that fails sends ``ABORT`` with a reason first, when it can.

Modules. :class:`ZmqAllocator` (here) implements the :class:`~timely.comm.allocator.Allocator`
protocol on two parts: a :class:`~timely.comm.mailbox.Mailbox` (the channels' receive queues, no
sockets) and :class:`~timely.comm.links.Links` (the sockets, handshake, backpressure, failure
detection and goodbye), which keeps one :class:`~timely.comm.peer.Peer` per other worker. The
errors are in :mod:`timely.comm.errors`.
"""
from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

from .allocator import Puller, Pusher
from .errors import AddressInUse, ChannelMismatch, CommError, HandshakeError, MessageTooLarge, PeerLost
from .framing import MAX_CHANNEL, MAX_SOURCE, encode_gathered, encode_items
from .gate import check_token
from .links import Links
from .mailbox import Mailbox
from .peer import Peer, Tuning
from .secret import JobSecret

# The errors callers catch, importable from here as well as from timely.comm.errors.
__all__ = ["AddressInUse", "ChannelMismatch", "CommError", "HandshakeError", "MessageTooLarge", "PeerLost",
           "ZmqAllocator"]

#: The fewest messages a ZeroMQ queue holds, whatever the byte budget (small messages need room).
HWM_FLOOR = 16
#: The most messages a ZeroMQ queue holds (``SNDHWM`` / ``RCVHWM`` are C ints).
HWM_MAX = (1 << 31) - 1
#: Bounds of ``max_message_bytes``: bundles carry each part's length as a u32, and a HELLO fits.
MIN_MESSAGE_BYTES = 1024
MAX_MESSAGE_BYTES = 1 << 31
#: The longest ``heartbeat_timeout``, in seconds (about 24.8 days): it becomes ``TCP_MAXRT`` in
#: milliseconds, a C int.
MAX_HEARTBEAT_TIMEOUT = ((1 << 31) - 1) // 1000

#: The integer options: (least, most) values (``hwm`` may also be ``None``: derived).
_INTEGER_OPTIONS: dict[str, tuple[int, int | None]] = {
    "max_message_bytes": (MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES), "inflight_bytes": (1, None), "hwm": (1, HWM_MAX),
    "backlog_bytes": (0, None), "mailbox_bytes": (1, None), "receive_batch": (1, None), "receive_bytes": (1, None)}
#: The options in seconds: (least, whether the least is allowed, most).
_SECONDS_OPTIONS: dict[str, tuple[float, bool, float]] = {
    "startup_timeout": (0.0, False, math.inf), "heartbeat_ivl": (0.0, True, math.inf),
    "heartbeat_timeout": (0.0, False, MAX_HEARTBEAT_TIMEOUT), "goodbye_grace": (0.0, True, math.inf),
    "close_timeout": (0.0, True, math.inf)}


def check_options(options: Mapping[str, Any]) -> None:
    """Check the :class:`ZmqAllocator` options among ``options`` (others are ignored): raise
    :class:`TypeError` or :class:`ValueError` naming the first bad one and its value.

    Sizes are integers (bytes, or messages for ``hwm`` and ``receive_batch``): at least 1 (a
    ``mailbox_bytes``, ``receive_batch`` or ``receive_bytes`` of 0 would stop all reading),
    ``backlog_bytes`` at least 0, ``max_message_bytes`` from :data:`MIN_MESSAGE_BYTES` to
    :data:`MAX_MESSAGE_BYTES`, ``hwm`` (unless ``None``) at most :data:`HWM_MAX`. Times are
    numbers of seconds: ``startup_timeout`` positive, ``heartbeat_timeout`` positive and at most
    :data:`MAX_HEARTBEAT_TIMEOUT`, ``heartbeat_ivl`` (0: no probes) finite, the others non-negative.
    Callers that fork workers call it first, so that a bad option fails the call, not every worker.
    """
    for name, (least, most) in _INTEGER_OPTIONS.items():
        if name not in options or (name == "hwm" and options[name] is None):
            continue
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, not {value!r}")
        number = int(value)
        if number < least:
            raise ValueError(f"{name} must be at least {least}, not {number}")
        if most is not None and number > most:
            raise ValueError(f"{name} must be at most {most}, not {number}")
    for name, (low, inclusive, high) in _SECONDS_OPTIONS.items():
        if name not in options:
            continue
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number of seconds, not {value!r}")
        seconds = float(value)
        if not (seconds >= low if inclusive else seconds > low):  # (NaN fails too)
            kind = "non-negative" if inclusive else "positive"
            raise ValueError(f"{name} must be a {kind} number of seconds, not {value!r}")
        if seconds > high:
            raise ValueError(f"{name} must be at most {high} seconds, not {value!r}")
        if name == "heartbeat_ivl" and seconds == math.inf:
            raise ValueError(f"{name} must be a finite number of seconds (0: no probes), not {value!r}")


class _RemotePusher:
    """Pushes to another worker over its connection (serialised at push time)."""

    __slots__ = ("push", "push_buffers", "_send_payload", "max_bytes")

    encode_items = staticmethod(encode_items)

    def __init__(self, peer: Peer, channel: int) -> None:
        # push(message) serialises and sends (or queues in the peer's backlog), through a partial:
        # on the hot path, without a Python frame of its own. It raises MessageTooLarge, having
        # sent nothing, when the encoding exceeds max_message_bytes; so does push_buffers(head,
        # buffers) when the head's encoding and the buffers together do.
        self.push: Callable[[Any], None] = functools.partial(peer.push, channel)
        self.push_buffers: Callable[[Any, Iterable[Any]], None] = functools.partial(peer.push_buffers, channel)
        self._send_payload: Callable[[bytes], None] = functools.partial(peer.push_payload, channel)
        self.max_bytes = peer.max_message_bytes

    def push_items(self, head: Any, bodies: list, count: int) -> None:
        """Send ``(head, items)``, the ``count`` items encoded in ``bodies`` by :meth:`encode_items`."""
        self._send_payload(encode_gathered(head, bodies, count))


class ZmqAllocator:
    """An :class:`~timely.comm.allocator.Allocator` for worker ``index`` of ``peers`` over ZeroMQ.

    ``endpoints[j]`` is the address worker ``j`` listens on (``ipc://path`` or ``tcp://host:port``);
    this worker binds ``bind`` if given, else ``endpoints[index]``. ``token`` identifies the job:
    every worker of a job must use the same one (at most
    :data:`~timely.comm.gate.MAX_TOKEN_BYTES` bytes). Bad options raise at once
    (:func:`check_options`). The constructor blocks until every peer is
    connected (at most ``startup_timeout`` seconds). Create it after any ``fork``. With ``secret``
    (every worker of the job the same), links are authenticated and encrypted with CURVE.

    Memory, in bytes. A remote pusher refuses a message whose encoding (for ``push_buffers``,
    the head's encoding and all buffers together) exceeds ``max_message_bytes`` (default 8 MiB)
    with :class:`MessageTooLarge`, sending nothing; no worker accepts a larger frame. Per ordered
    pair of workers (i -> j) there are at most:

    - in i's backlog for j: ``backlog_bytes`` (default 16 MiB) plus one message, before ``release``
      waits (it stops waiting early only while i's own mailbox is full, so that two workers
      flooding each other cannot deadlock);
    - inside ZeroMQ: ``hwm`` messages in i's send queue and ``hwm`` in j's receive queue, each at
      most ``max_message_bytes``: ``2 * hwm * max_message_bytes`` bytes, plus the kernel's socket
      buffers. ``hwm`` defaults to ``max(HWM_FLOOR, inflight_bytes // (2 * max_message_bytes))``,
      which keeps this under ``inflight_bytes`` (default 256 MiB: hwm 16) whenever the floor does
      not apply; an explicit ``hwm`` (messages) overrides it.

    and j's mailbox (received, not yet taken by j's dataflows, from all peers together) holds at
    most ``mailbox_bytes`` (default 16 MiB) plus one message, besides messages for channels it has
    not allocated yet.

    Tuning: ``heartbeat_ivl`` /
    ``heartbeat_timeout`` seconds (TCP keepalive probes, and the time data may stay unacknowledged:
    :meth:`Tuning.apply <timely.comm.peer.Tuning.apply>`) detect a silent peer host or a cut link
    (generous: a peer busy in one long step stops reading once its inbound queue is full, and its
    kernel then advertises no room; a crashed process is noticed at once by its closed
    connection); ``goodbye_grace``
    seconds separate a dropped connection from :class:`PeerLost`; ``close_timeout`` bounds the
    wait for acknowledgements in ``close``; ``receive`` moves at most ``receive_batch`` messages
    or about ``receive_bytes`` of payload per call (the rest waits in ZeroMQ, which keeps
    backpressure on fast senders; small steps also decode faster, in memory still in cache).
    """

    def __init__(self, index: int, peers: int, endpoints: list[str], token: str, *,
                 bind: str | None = None, secret: JobSecret | None = None, max_message_bytes: int = 8 << 20,
                 inflight_bytes: int = 256 << 20, hwm: int | None = None, backlog_bytes: int = 16 << 20,
                 mailbox_bytes: int = 16 << 20, startup_timeout: float = 30.0, heartbeat_ivl: float = 1.0,
                 heartbeat_timeout: float = 30.0, goodbye_grace: float = 1.0, close_timeout: float = 30.0,
                 receive_batch: int = 256, receive_bytes: int = 256 << 10) -> None:
        if not 0 <= index < peers:
            raise ValueError(f"worker index {index} out of range for {peers} workers")
        if peers - 1 > MAX_SOURCE:
            raise ValueError(f"at most {MAX_SOURCE + 1} workers are supported, not {peers}")
        if len(endpoints) != peers:
            raise ValueError(f"{len(endpoints)} endpoints given for {peers} workers")
        check_token(token)
        check_options({"max_message_bytes": max_message_bytes, "inflight_bytes": inflight_bytes, "hwm": hwm,
                       "backlog_bytes": backlog_bytes, "mailbox_bytes": mailbox_bytes,
                       "startup_timeout": startup_timeout, "heartbeat_ivl": heartbeat_ivl,
                       "heartbeat_timeout": heartbeat_timeout, "goodbye_grace": goodbye_grace,
                       "close_timeout": close_timeout, "receive_batch": receive_batch, "receive_bytes": receive_bytes})
        if hwm is None:
            hwm = min(HWM_MAX, max(HWM_FLOOR, inflight_bytes // (2 * max_message_bytes)))
        self.index = index
        self.peers = peers
        self._mailbox = Mailbox(index)
        # None for a single worker: every push is then a loopback, and nothing is opened.
        self._links: Links | None = None
        if peers > 1:
            tuning = Tuning(hwm=hwm, max_message_bytes=max_message_bytes, backlog_bytes=backlog_bytes,
                            mailbox_bytes=mailbox_bytes, startup_timeout=startup_timeout,
                            heartbeat_ivl=heartbeat_ivl, heartbeat_timeout=heartbeat_timeout,
                            goodbye_grace=goodbye_grace, close_timeout=close_timeout,
                            receive_batch=receive_batch, receive_bytes=receive_bytes)
            self._links = Links(index, endpoints, token, bind or endpoints[index], self._mailbox, tuning, secret)

    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        """Return one pusher per worker (by index) and this worker's puller for ``channel``."""
        if channel > MAX_CHANNEL:
            raise ValueError(f"channel id {channel} does not fit the wire header")
        links = self._links
        try:
            puller = self._mailbox.open(channel)
        except ChannelMismatch as exc:
            if links is not None:
                links.fail(exc)  # recorded: later calls raise it too, and close aborts
            raise
        pushers: list[Pusher] = [
            self._mailbox.loopback(puller) if j == self.index or links is None
            else _RemotePusher(links.peer(j), channel)
            for j in range(self.peers)
        ]
        return pushers, puller

    def retire(self, channels: Iterable[int]) -> None:
        """Drop the queues of ``channels`` (their dataflow completed)."""
        self._mailbox.retire(channels)

    def receive(self) -> None:
        """Move every message that has arrived into its channel's puller."""
        if self._links is not None:
            self._links.receive()

    def release(self) -> None:
        """Flush queued sends; while some peer's backlog is over its bound, wait (receiving)."""
        if self._links is not None:
            self._links.release()

    def events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call.

        The caller reads those channels' pullers: received messages count against
        ``mailbox_bytes`` until they are reported here (past it, nothing more is received)."""
        return self._mailbox.take_events()

    def await_events(self, timeout: float | None) -> None:
        """Park on the ZeroMQ poller until a message arrives or ``timeout`` seconds pass.

        Backlogged sends keep flowing while parked (a parked worker must not withhold data or
        progress its peers wait for).
        """
        if self._links is not None:
            self._links.raise_if_failed()
            if not self._mailbox.events:
                self._links.wait_for_message(timeout)
                return
        if not self._mailbox.events and timeout:
            time.sleep(min(timeout, 0.01))

    def incoming(self) -> bool:
        """True when a message waits: received and not yet read, or readable from the network."""
        return bool(self._mailbox.events) or (self._links is not None and self._links.readable())

    def finished(self) -> Set[int]:
        """The workers that said goodbye (their data, delivered before it, is in the pullers)."""
        return frozenset() if self._links is None else self._links.finished

    def cork(self) -> None:
        """Gather the messages pushed to each peer from now on; :meth:`uncork` sends them as one
        message per peer (a ``BUNDLE``), in order. A flush of many channels and progress to many
        peers then costs one ZeroMQ message per peer, not one per channel and peer."""
        if self._links is not None:
            self._links.cork()

    def uncork(self) -> None:
        """Send what :meth:`cork` gathered, and send each push at once again."""
        if self._links is not None:
            self._links.uncork()

    @property
    def refused(self) -> int:
        """How many messages this worker refused from connections that had not completed the
        handshake (strangers, other jobs, garbage); each is logged, rate-limited, and ignored."""
        return 0 if self._links is None else self._links.refusals.count

    def close(self, abort: str | None = None) -> None:
        """Say goodbye and release the sockets.

        Normal close: send ``GOODBYE`` after the last queued message and wait (receiving, at most
        ``close_timeout`` seconds) until every live peer has read it or said goodbye itself. A peer
        lost meanwhile is not an error here: this worker's work is done, and the lost worker's own
        failure is reported by whoever supervises it. With ``abort`` (a one-line reason), tell the
        peers this worker failed, and close without waiting.
        """
        if self._links is not None:
            self._links.close(abort)

    def __repr__(self) -> str:
        return f"ZmqAllocator(index={self.index}, peers={self.peers})"
