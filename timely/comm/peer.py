"""One worker's connection to another: socket set-up, the outbound queue and the handshake checks.

A worker reaches peer ``j`` through one ``DEALER`` socket connected to ``j``'s ``ROUTER``
(:class:`Peer`), so each ordered pair of workers has exactly one connection and it is FIFO. The
data pushed to ``j`` (``push``, gathered payloads, ``push_buffers``) is framed, numbered and
checked against the message size limit here (:mod:`timely.comm.framing` has the frame layout).

Backpressure. Sends are non-blocking. What ZeroMQ cannot take (its queue to a peer holds ``hwm``
messages) waits in the peer's backlog, in order; :meth:`Peer.flush` sends it once ZeroMQ has
room. A message of several frames waits whole and is sent whole (its first frame is the only one
that can be refused). Bounding the backlog (waiting while receiving) is the allocator's job.
"""
from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import zmq

from .endpoints import ipc_path_in_use
from .errors import AddressInUse, CommError, MessageTooLarge
from .framing import HEADER, VERSION, Kind, buffer_frames, bundle, bundle_overhead, encode, pack_header
from .secret import CURVE_OVERHEAD

if TYPE_CHECKING:
    from .secret import JobSecret

# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
NOBLOCK = int(zmq.NOBLOCK)
NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
SNDMORE = int(zmq.SNDMORE)

#: What a ``DEALER``'s monitor reports: a dropped connection (a closed one, or one the kernel's
#: liveness probes gave up on), or a failed ZMTP / CURVE handshake.
HANDSHAKE_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: EVENT_CONNECTED: a second connection of a DEALER is ZeroMQ's reconnect after a reset link,
#: which the listener's ROUTER sees as a stranger (it refuses all it sends): what was in flight
#: is lost, so the worker fails (``Links._on_monitor``).
MONITORED = int(zmq.EVENT_DISCONNECTED) | int(zmq.EVENT_CONNECTED) | HANDSHAKE_FAILED

#: Linux's bounds on keepalive probes (``TCP_KEEPCNT``) and on their idle time and interval in
#: seconds (``TCP_KEEPIDLE``, ``TCP_KEEPINTVL``): beyond them setsockopt fails, and libzmq then
#: drops every connection attempt (a job that never starts).
MAX_KEEPALIVE_PROBES = 127
MAX_KEEPALIVE_SECONDS = 32767


@dataclass(frozen=True)
class Tuning:
    """The settings of a worker's connections; :class:`~timely.comm.zmq_allocator.ZmqAllocator`
    documents each (and gives their defaults); :meth:`apply` sets them on a socket."""

    hwm: int
    max_message_bytes: int
    backlog_bytes: int
    mailbox_bytes: int
    startup_timeout: float
    heartbeat_ivl: float
    heartbeat_timeout: float
    goodbye_grace: float
    close_timeout: float
    receive_batch: int
    receive_bytes: int

    def apply(self, sock: zmq.Socket, secure: bool = False) -> None:
        """Set the socket options (queue and message bounds, host liveness) on ``sock``, before it
        binds or connects; ``secure``: it will use CURVE (a job secret).

        Liveness is the kernel's, never ZMTP heartbeats: TCP keepalive probes every
        ``heartbeat_ivl`` seconds (whole seconds, at least 1) on an idle connection, and
        ``TCP_USER_TIMEOUT`` (libzmq's ``TCP_MAXRT``) of ``heartbeat_timeout`` on one with data
        unacknowledged, so a host that stops answering, or a cut link, drops the connection after
        about ``heartbeat_timeout`` seconds. (libzmq 4.3 aborts the whole process, ``Assertion
        failed: !_io_error`` in stream_engine_base.cpp, when a connection closes while its inbound
        queue is full, as under backpressure, and a ZMTP heartbeat of that connection is then due
        or a PING is then read: a 2-core run of 8 and 16 workers lost a worker to it. Kernel
        probes run no code of libzmq's.) A process that is stopped but whose host is up is not
        detected here: its supervisor (``timely.cluster``, the launcher) ends the run.
        ``heartbeat_ivl`` 0 turns the probes off; they apply to tcp connections only. A timeout over
        ``MAX_KEEPALIVE_PROBES`` intervals spaces the probes out (the kernel's bounds).
        """
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        # IPv6 addresses (a hostfile's [addr]:port lines) are refused without it (ENODEV); IPv4
        # ones work as before.
        sock.setsockopt(zmq.IPV6, 1)
        # A peer that sends a larger frame is disconnected before it is buffered. Ours never do:
        # a payload over max_message_bytes is refused at push (MessageTooLarge), and the limit
        # counts a frame as it travels, so under CURVE its encryption's overhead too.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + HEADER.size + (CURVE_OVERHEAD if secure else 0))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        if self.heartbeat_ivl > 0:
            # Whole seconds within the kernel's bounds; at most MAX_KEEPALIVE_PROBES probes, spaced
            # to span heartbeat_timeout (TCP_MAXRT: milliseconds, a C int; ZmqAllocator checks
            # heartbeat_timeout against MAX_HEARTBEAT_TIMEOUT).
            idle = min(MAX_KEEPALIVE_SECONDS, max(1, round(self.heartbeat_ivl)))
            ivl = min(MAX_KEEPALIVE_SECONDS, max(idle, math.ceil(self.heartbeat_timeout / MAX_KEEPALIVE_PROBES)))
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, ivl)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT,
                            min(MAX_KEEPALIVE_PROBES, max(1, math.ceil(self.heartbeat_timeout / ivl))))
            sock.setsockopt(zmq.TCP_MAXRT, max(1, int(self.heartbeat_timeout * 1000)))


class Peer:
    """Worker ``index``, seen from worker ``me``: its ``DEALER`` (with a disconnect monitor), the
    data messages pushed to it (serialised, numbered, refused over ``max_message_bytes``), the
    backlog of messages ZeroMQ could not take yet, and handshake / goodbye state."""

    __slots__ = ("me", "index", "endpoint", "dealer", "monitor", "max_message_bytes", "on_backlog", "backlog",
                 "backlog_bytes", "send_seq", "recv_seq", "rid", "hello", "welcomed", "goodbye", "acked",
                 "lost_deadline", "corked", "corked_bytes", "connections", "backlog_bound", "on_over_bound")

    def __init__(self, me: int, index: int, endpoint: str, dealer: zmq.Socket, monitor: zmq.Socket,
                 max_message_bytes: int) -> None:
        self.me = me
        self.index = index
        self.endpoint = endpoint
        self.dealer = dealer
        self.monitor = monitor
        self.max_message_bytes = max_message_bytes
        # Called with this peer when a push starts its backlog (the owner then watches for room).
        self.on_backlog: Callable[[Peer], object] = _ignore
        # Messages ZeroMQ could not take yet, oldest first; sent strictly in this order (FIFO).
        # Each is (header, payload, buffers, size): buffers are the frames after the payload
        # (empty for a two-frame message), size the bytes of all its frames.
        self.backlog: deque[tuple[bytes, bytes, tuple, int]] = deque()
        self.backlog_bytes = 0
        self.send_seq = 0          # next DATA sequence number we send to this peer
        self.recv_seq = 0          # next DATA sequence number we expect from this peer
        self.rid: bytes | None = None  # routing id of its inbound connection on our ROUTER
        self.hello = False         # it greeted our ROUTER
        self.welcomed = False      # its ROUTER accepted our DEALER
        self.connections = 0       # connections our DEALER made to it (more than one: a reconnect)
        self.backlog_bound: float = math.inf  # backlog bytes past which a queued message waits (Links)
        self.on_over_bound: Callable[[Peer], None] = lambda peer: None
        self.goodbye = False       # it closed cleanly: it sends and needs nothing more
        self.acked = False         # it read our GOODBYE (and so all our data)
        # When its connection dropped, the time it is declared lost unless it says GOODBYE first;
        # infinite while connected.
        self.lost_deadline = math.inf
        # While corked (a list): the (channel, payload) messages pushed since, sent by uncork as
        # one BUNDLE message, in order; None: every push goes out at once.
        self.corked: list[tuple[int, bytes]] | None = None
        self.corked_bytes = 0

    @property
    def dropped(self) -> bool:
        """Its connection dropped (it may still say goodbye before its deadline)."""
        return self.lost_deadline != math.inf

    @property
    def settled(self) -> bool:
        """It needs nothing more from us: it read our GOODBYE, said its own, or is gone."""
        return self.acked or self.goodbye or self.dropped

    def push(self, channel: int, message: Any) -> None:
        """Serialise ``message`` and send it on ``channel`` (or queue it in the backlog)."""
        if self.goodbye:
            return  # it closed after finishing every dataflow: nothing it could still need
        try:
            payload = encode(message)
        except Exception as exc:
            raise self._unencodable(channel, exc) from exc
        self.push_payload(channel, payload)

    def push_payload(self, channel: int, payload: bytes) -> None:
        """Send an encoded message on ``channel`` (or queue it in the backlog)."""
        if self.goodbye:
            return
        if len(payload) > self.max_message_bytes:  # refused whole, before it takes a sequence number
            self._too_large(channel, len(payload))
        if self.corked is not None:
            if self.corked_bytes + len(payload) + bundle_overhead(len(self.corked) + 1) > self.max_message_bytes:
                self._send_corked()  # (a new list)
            self.corked.append((channel, payload))
            self.corked_bytes += len(payload)
            return
        self._send_numbered(Kind.DATA, channel, payload)

    def _send_numbered(self, kind: Kind, channel: int, payload: bytes) -> None:
        """Send a two-frame message that takes the next sequence number (or queue it)."""
        head = pack_header(kind, self.me, channel, self.send_seq)
        self.send_seq += 1
        if self.send(head, payload):
            self.on_backlog(self)

    def cork(self) -> None:
        """Gather the messages pushed from now on until :meth:`uncork`, which sends them as one."""
        if self.corked is None:
            self.corked = []
            self.corked_bytes = 0

    def uncork(self) -> None:
        """Send the messages gathered since :meth:`cork` (one ``BUNDLE``, or the one message as
        it is) and push at once again."""
        if self.corked is not None:
            self._send_corked()
            self.corked = None

    def _send_corked(self) -> None:
        """Send the gathered messages as one message, in order; stay corked."""
        parts = self.corked
        if not parts:
            return
        self.corked = []
        self.corked_bytes = 0
        if self.goodbye:
            return
        if len(parts) == 1:
            self._send_numbered(Kind.DATA, *parts[0])
        else:  # under max_message_bytes with its index (push_payload saw to it)
            self._send_numbered(Kind.BUNDLE, 0, bundle(parts))

    def push_buffers(self, channel: int, head: Any, buffers: Iterable[Any]) -> None:
        """Send ``(head, buffers)`` on ``channel`` as one ``DATA_BUFFERS`` message (or queue it in
        the backlog): ``head`` serialised, then each buffer a frame of its own, not copied."""
        if self.goodbye:
            return
        try:
            payload = encode(head)
        except Exception as exc:
            raise self._unencodable(channel, exc) from exc
        if self.corked:
            self._send_corked()  # FIFO: what was pushed before goes first
        frames, size = buffer_frames(buffers)
        size += len(payload)
        if size > self.max_message_bytes:  # all frames together; refused whole, as in push_payload
            self._too_large(channel, size)
        header = pack_header(Kind.DATA_BUFFERS, self.me, channel, self.send_seq)
        self.send_seq += 1
        if self.send_buffers(header, payload, frames, size + HEADER.size):
            self.on_backlog(self)

    def send(self, head: bytes, payload: bytes) -> bool:
        """Send one two-frame message now, or queue it behind older ones. Return True when this
        started a backlog (the caller then watches the ``DEALER`` for room)."""
        # FIFO: a message goes straight out only when nothing older is waiting for this peer.
        if self.backlog:
            self._queue(head, payload, (), len(payload) + HEADER.size)
            return False
        send = self.dealer.send
        try:
            # EAGAIN is only possible on the first frame: once it is taken, ZeroMQ takes the
            # whole multipart message (atomic delivery), so a message is never half-sent.
            send(head, NOBLOCK_MORE)
        except zmq.Again:
            self._queue(head, payload, (), len(payload) + HEADER.size)
            return True
        send(payload, 0, copy=False)
        return False

    def send_buffers(self, head: bytes, payload: bytes, buffers: tuple, size: int) -> bool:
        """:meth:`send` for a message of more frames: ``head``, ``payload`` then each of
        ``buffers`` (C-contiguous buffer objects, sent without copying; ZeroMQ keeps a reference
        until each is sent). ``size`` is the bytes of all frames together."""
        if self.backlog:
            self._queue(head, payload, buffers, size)
            return False
        try:
            self.dealer.send(head, NOBLOCK_MORE)  # as in send: only the first frame can fail
        except zmq.Again:
            self._queue(head, payload, buffers, size)
            return True
        self._send_rest(payload, buffers)
        return False

    def flush(self) -> bool:
        """Send as much of the backlog as ZeroMQ takes; return True once it is empty."""
        backlog = self.backlog
        send = self.dealer.send
        try:
            while backlog:
                head, payload, buffers, size = backlog[0]
                send(head, NOBLOCK_MORE)  # as in send: only the first frame can fail
                if buffers:
                    self._send_rest(payload, buffers)
                else:  # a two-frame message
                    send(payload, 0, copy=False)
                backlog.popleft()
                self.backlog_bytes -= size
        except zmq.Again:
            return False
        return True

    def drop_backlog(self) -> None:
        """Forget the backlog: the peer said goodbye and needs nothing more."""
        self.backlog.clear()
        self.backlog_bytes = 0

    def close(self, linger_ms: int) -> None:
        """Close the monitor and the ``DEALER`` (which may linger ``linger_ms`` to send its last)."""
        try:
            self.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.dealer.close(linger_ms)

    def _unencodable(self, channel: int, exc: Exception) -> TypeError:
        return TypeError(f"cannot send a message to worker {self.index} on channel {channel}: "
                         f"{exc} (messages must be msgpack-serialisable)")

    def _too_large(self, channel: int, size: int) -> NoReturn:
        limit = self.max_message_bytes
        raise MessageTooLarge(size, limit, (
            f"worker {self.me}: a message of {size} bytes to worker {self.index} on channel "
            f"{channel} exceeds max_message_bytes ({limit}); split it"))

    def _queue(self, head: bytes, payload: bytes, buffers: tuple, size: int) -> None:
        self.backlog.append((head, payload, buffers, size))
        self.backlog_bytes += size
        if self.backlog_bytes - size > self.backlog_bound:
            # Over its bound before this message, within one step (a flush of a large batch): wait
            # for room now, not at the step's release, so at most the bound plus one message waits.
            self.on_over_bound(self)

    def _send_rest(self, payload: bytes, buffers: tuple) -> None:
        """The frames after an accepted header frame: they cannot fail with EAGAIN (ZeroMQ
        checks its high-water mark only at a message's first frame), so no flag is NOBLOCK."""
        send = self.dealer.send
        frames = (payload, *buffers)
        for frame in frames[:-1]:
            send(frame, SNDMORE, copy=False)
        send(frames[-1], 0, copy=False)


def _ignore(peer: Peer) -> None:
    """The default ``on_backlog``: nobody watches."""


def connect_peer(ctx: zmq.Context, tuning: Tuning, secret: JobSecret | None, me: int, peers: int, token: str,
                 index: int, endpoint: str) -> Peer:
    """Connect a ``DEALER`` from worker ``me`` to worker ``index`` (a CURVE client with a
    ``secret``) and queue our ``HELLO`` on it."""
    dealer = ctx.socket(zmq.DEALER)
    tuning.apply(dealer, secure=secret is not None)
    if secret is not None:
        secret.connect(dealer)
    peer = Peer(me, index, endpoint, dealer, dealer.get_monitor_socket(MONITORED), tuning.max_message_bytes)
    try:
        dealer.connect(endpoint)
    except zmq.ZMQError as exc:
        peer.close(0)
        raise CommError(f"worker {me}: cannot connect to worker {index} at {endpoint}: {exc}") from None
    hello = encode({"token": token, "index": me, "peers": peers, "version": VERSION,
                    "max_message_bytes": tuning.max_message_bytes})
    # Queued until the connection is up (ZMQ_IMMEDIATE is off), then sent first.
    dealer.send_multipart([pack_header(Kind.HELLO, me), hello], NOBLOCK)
    return peer


def bind_router(ctx: zmq.Context, tuning: Tuning, secret: JobSecret | None, me: int, address: str) -> zmq.Socket:
    """Bind worker ``me``'s ``ROUTER`` on ``address`` (a CURVE server with a ``secret``, whose
    context must be guarded by ``secret.guard``); raise :class:`AddressInUse` if it is taken."""
    router = ctx.socket(zmq.ROUTER)
    tuning.apply(router, secure=secret is not None)
    if secret is not None:
        secret.serve(router)
    # ROUTER_MANDATORY: a reply that cannot be routed fails instead of vanishing silently.
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    where = f"worker {me} cannot listen on {address}"
    try:
        if address.startswith("ipc://"):
            path = address[len("ipc://"):]
            if ipc_path_in_use(path):
                raise AddressInUse(f"{where}: another process is listening there "
                                   "(another job using the same ipc directory?)")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            router.bind(address)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise AddressInUse(f"{where}: address already in use (another job on this port? "
                                   "choose another base port)") from None
            raise CommError(f"{where}: {exc}") from None
    except BaseException:
        router.close(0)
        raise
    return router
