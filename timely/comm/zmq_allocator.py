"""The ZeroMQ allocator: numbered channels between worker processes.

Sockets. Every worker binds one ``ROUTER`` socket (its endpoint, inbound only) and connects one
``DEALER`` socket to every other worker's ``ROUTER`` (outbound only, one per peer). So each ordered
pair of workers (i -> j) has exactly one connection, i's ``DEALER`` to j's ``ROUTER``, and it carries
every channel from i to j: **progress relies on this per-pair FIFO** (a batch's increments reach j
before any later decrement from i). ZeroMQ's ``DEALER`` never drops at its high-water mark (a
non-blocking send fails with ``EAGAIN`` instead), and nothing here uses PUB/SUB.

Framing. One pushed message is one two-frame ZeroMQ message: a 16-byte header and a msgpack
payload (:mod:`timely.comm.framing`). Payloads decode with ``use_list=False``: tuples round-trip as
tuples and lists arrive as tuples. A push to this worker itself is a local loopback: the object is
queued by reference, never serialised.

Handshake. Each ``DEALER`` first sends ``HELLO`` (job token, worker index, number of workers); the
listener answers ``WELCOME`` or ``REJECT`` with a reason. A peer of another job (another token) is
rejected and raises :class:`HandshakeError` on its side, so two jobs on one machine never
cross-talk. The constructor returns once every peer has been greeted in both directions.

Backpressure. Sends are non-blocking. What ZeroMQ cannot take (its queue to a peer holds ``hwm``
messages) waits in a per-peer backlog; ``release`` flushes, and while a peer's backlog exceeds
``backlog_bytes`` it waits for room *while receiving into pullers*, so two workers pushing at each
other cannot deadlock and a slow consumer slows its producers. Memory per peer is thus bounded by
about ``2 * hwm`` messages in ZeroMQ (plus the kernel's socket buffers), ``backlog_bytes`` and one
push.

Goodbye. ``close()`` sends ``GOODBYE`` after the last data message to every peer, then keeps
receiving until each live peer answers ``ACK`` (it has read the ``GOODBYE``, hence everything before
it) or has said ``GOODBYE`` itself (it finished and needs nothing more). Only then are the sockets
closed: lingering alone is not enough, since a receiver whose queue is full drops what it had not
yet queued when the connection closes.

Failure. A ``DEALER`` whose connection drops (socket monitor; ZMTP heartbeats catch silent hosts)
while that peer has not said ``GOODBYE`` makes ``receive``/``release``/``await_events`` raise
:class:`PeerLost` naming the peer, after ``goodbye_grace`` seconds without any message from it. A
peer that fails sends ``ABORT`` with a reason first, when it can.
"""
from __future__ import annotations

import hmac
import os
import sys
import time
from collections import deque
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .allocator import LocalPuller, LoopbackPusher, Puller, Pusher
from .endpoints import ipc_path_in_use
from .framing import (
    HEADER,
    MAX_CHANNEL,
    MAX_SOURCE,
    VERSION,
    FramingError,
    Kind,
    decode,
    encode,
    pack_header,
    unpack_header,
)

# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_DATA, _GOODBYE, _ABORT = int(Kind.DATA), int(Kind.GOODBYE), int(Kind.ABORT)

#: Seconds between checks of the connection monitors on the non-blocking ``receive`` path.
WATCH_INTERVAL = 0.02


class CommError(RuntimeError):
    """A fatal communication failure: the job cannot continue."""


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


class _Peer:
    """Connection state for one other worker."""

    __slots__ = ("index", "endpoint", "dealer", "monitor", "backlog", "backlog_bytes", "send_seq",
                 "recv_seq", "rid", "hello", "welcomed", "goodbye", "acked", "lost_deadline")

    def __init__(self, index: int, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.dealer: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        # Frames ZeroMQ could not take yet, oldest first; sent strictly in this order (FIFO).
        self.backlog: deque[tuple[bytes, bytes]] = deque()
        self.backlog_bytes = 0
        self.send_seq = 0          # next DATA sequence number we send to this peer
        self.recv_seq = 0          # next DATA sequence number we expect from this peer
        self.rid: bytes | None = None  # routing id of its inbound connection on our ROUTER
        self.hello = False         # it greeted our ROUTER
        self.welcomed = False      # its ROUTER accepted our DEALER
        self.goodbye = False       # it closed cleanly: it sends and needs nothing more
        self.acked = False         # it read our GOODBYE (and so all our data)
        self.lost_deadline: float | None = None  # its connection dropped; PeerLost unless GOODBYE by then


class _RemotePusher:
    """Pushes to another worker over its connection (serialised at push time)."""

    __slots__ = ("_alloc", "_peer", "_channel")

    def __init__(self, alloc: ZmqAllocator, peer: _Peer, channel: int) -> None:
        self._alloc = alloc
        self._peer = peer
        self._channel = channel

    def push(self, message: Any) -> None:
        """Serialise ``message`` and send it (or queue it in the peer's backlog)."""
        self._alloc._send_data(self._peer, self._channel, message)


class ZmqAllocator:
    """An :class:`~timely.comm.allocator.Allocator` for worker ``index`` of ``peers`` over ZeroMQ.

    ``endpoints[j]`` is the address worker ``j`` listens on (``ipc://path`` or ``tcp://host:port``);
    this worker binds ``bind`` if given, else ``endpoints[index]``. ``token`` identifies the job:
    every worker of a job must use the same one. The constructor blocks until every peer is
    connected (at most ``startup_timeout`` seconds). Create it after any ``fork``.

    Tuning: ``hwm`` messages may queue inside ZeroMQ per direction and side of a pair;
    ``backlog_bytes`` more may wait per peer before ``release`` blocks; ``heartbeat_ivl`` /
    ``heartbeat_timeout`` seconds (ZMTP PING/PONG) detect a silent peer host (generous: a peer
    busy in one long step stops reading once its inbound queue is full, and then does not answer
    PINGs either; a crashed process is noticed at once by its closed connection); ``goodbye_grace``
    seconds separate a dropped connection from :class:`PeerLost`; ``close_timeout`` bounds the
    wait for acknowledgements in ``close``; ``receive`` moves at most ``receive_batch`` messages
    or about ``receive_bytes`` of payload per call (the rest waits in ZeroMQ, which keeps
    backpressure on fast senders; small steps also decode faster, in memory still in cache).
    """

    def __init__(self, index: int, peers: int, endpoints: list[str], token: str, *,
                 bind: str | None = None, hwm: int = 256, backlog_bytes: int = 16 << 20,
                 startup_timeout: float = 30.0, heartbeat_ivl: float = 1.0, heartbeat_timeout: float = 30.0,
                 goodbye_grace: float = 1.0, close_timeout: float = 30.0, receive_batch: int = 256,
                 receive_bytes: int = 256 << 10) -> None:
        if not 0 <= index < peers:
            raise ValueError(f"worker index {index} out of range for {peers} workers")
        if peers - 1 > MAX_SOURCE:
            raise ValueError(f"at most {MAX_SOURCE + 1} workers are supported, not {peers}")
        if len(endpoints) != peers:
            raise ValueError(f"{len(endpoints)} endpoints given for {peers} workers")
        self.index = index
        self.peers = peers
        self._token = token
        self._hwm = hwm
        self._backlog_bound = backlog_bytes
        self._heartbeat = (heartbeat_ivl, heartbeat_timeout)
        self._grace = goodbye_grace
        self._close_timeout = close_timeout
        self._receive_batch = receive_batch
        self._receive_bytes = receive_bytes
        self._pullers: dict[int, LocalPuller] = {}
        self._pending: dict[int, list[Any]] = {}  # messages for channels not allocated yet
        self._pending_from: dict[int, int] = {}  # the first worker that sent on such a channel
        self._events: set[int] = set()
        self._last = -1
        self._peers: list[_Peer | None] = [None if j == index else _Peer(j, endpoints[j]) for j in range(peers)]
        self._others: list[_Peer] = [p for p in self._peers if p is not None]
        self._by_rid: dict[bytes, _Peer] = {}
        self._backlogged: set[_Peer] = set()
        self._suspects: list[_Peer] = []
        self._rejections: list[str] = []
        self._failure: CommError | None = None
        self._next_watch = 0.0
        self._closed = False
        self._router: zmq.Socket | None = None
        self._poller = zmq.Poller()  # everything: ROUTER, monitors, DEALERs (POLLOUT while backlogged)
        self._router_poller = zmq.Poller()  # the ROUTER alone
        self._monitors: dict[zmq.Socket, _Peer] = {}
        self._dealers: dict[zmq.Socket, _Peer] = {}
        self._ctx = zmq.Context(1)
        try:
            if self._others:
                self._open(bind or endpoints[index])
                self._handshake(time.monotonic() + startup_timeout)
        except BaseException:
            self._teardown(graceful=False)
            raise

    # -- set-up ------------------------------------------------------------------------------
    def _configure(self, sock: zmq.Socket) -> None:
        ivl, timeout = self._heartbeat
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        if ivl > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(ivl * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 10) * 100)  # a multiple of 100 ms

    def _open(self, bind: str) -> None:
        router = self._router = self._ctx.socket(zmq.ROUTER)
        self._configure(router)
        # ROUTER_MANDATORY: a reply that cannot be routed fails instead of vanishing silently.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bind(router, bind)
        self._poller.register(router, zmq.POLLIN)
        self._router_poller.register(router, zmq.POLLIN)
        hello = encode({"token": self._token, "index": self.index, "peers": self.peers, "version": VERSION})
        for peer in self._others:
            dealer = peer.dealer = self._ctx.socket(zmq.DEALER)
            self._configure(dealer)
            peer.monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[peer.monitor] = peer
            self._dealers[dealer] = peer
            self._poller.register(peer.monitor, zmq.POLLIN)
            self._poller.register(dealer, zmq.POLLIN)  # POLLOUT is added while it has a backlog
            try:
                dealer.connect(peer.endpoint)
            except zmq.ZMQError as exc:
                raise CommError(f"worker {self.index}: cannot connect to worker {peer.index} at "
                                f"{peer.endpoint}: {exc}") from None
            # Queued until the connection is up (ZMQ_IMMEDIATE is off), then sent first.
            dealer.send_multipart([pack_header(Kind.HELLO, self.index), hello], _NOBLOCK)

    def _bind(self, sock: zmq.Socket, address: str) -> None:
        where = f"worker {self.index} cannot listen on {address}"
        if address.startswith("ipc://"):
            path = address[len("ipc://"):]
            if ipc_path_in_use(path):
                raise AddressInUse(f"{where}: another process is listening there "
                                   "(another job using the same ipc directory?)")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise AddressInUse(f"{where}: address already in use (another job on this port? "
                                   "choose another base port)") from None
            raise CommError(f"{where}: {exc}") from None

    def _handshake(self, deadline: float) -> None:
        while True:
            # A peer that already said GOODBYE needs no WELCOME: it may have finished and closed
            # its ROUTER (and dropped our WELCOME) while ours was still in flight.
            no_welcome = [p.index for p in self._others if not (p.welcomed or p.goodbye)]
            no_hello = [p.index for p in self._others if not p.hello]
            if not no_welcome and not no_hello:
                return
            self._raise_if_failed()
            self._check_suspects()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                msg = (f"worker {self.index}: start-up timed out; no answer from workers {no_welcome}, "
                       f"no greeting from workers {no_hello} (endpoints: "
                       + ", ".join(self._peers[j].endpoint for j in sorted(set(no_welcome + no_hello))) + ")")
                if self._rejections:
                    msg += "; rejected connections: " + "; ".join(self._rejections)
                raise HandshakeError(msg)
            self._dispatch(self._poller.poll(int(min(remaining, 0.2) * 1000) + 1))

    def _on_dealer(self, peer: _Peer) -> None:
        """Handle what a listener sends back on our DEALER: WELCOME / REJECT, and ACK at the end."""
        while True:
            try:
                frames = peer.dealer.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, _, _, _ = unpack_header(frames[0])
                body = decode(frames[1]) if len(frames) == 2 else None
            except (FramingError, ValueError, IndexError) as exc:
                raise HandshakeError(f"worker {self.index}: {peer.endpoint} (worker {peer.index}) "
                                     f"does not speak this protocol: {exc}") from None
            if kind == Kind.WELCOME:
                peer.welcomed = True
            elif kind == Kind.ACK:
                peer.acked = True
            elif kind == Kind.REJECT:
                raise HandshakeError(f"worker {self.index}: the process listening on {peer.endpoint} "
                                     f"(worker {peer.index}'s address) rejected us: {body}")

    def _on_hello(self, rid: bytes, source: int, payload: bytes) -> None:
        try:
            info = decode(payload)
            if not isinstance(info, dict):
                raise ValueError("not a map")
        except Exception:
            info = {}
        token = info.get("token")
        peer = self._peers[source] if 0 <= source < self.peers else None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token.encode()):
            reason = "wrong job token (the connection belongs to another job)"
        elif info.get("version") != VERSION:
            reason = f"protocol version {info.get('version')}, expected {VERSION}"
        elif info.get("peers") != self.peers:
            reason = f"job size mismatch: this job has {self.peers} workers, the peer expects {info.get('peers')}"
        elif peer is None or info.get("index") != source:
            reason = f"bad worker index {source}"
        elif peer.hello:
            reason = f"worker {source} is already connected"
        else:
            reason = None
        if reason is not None:
            self._rejections.append(f"a connection claiming to be worker {source}: {reason}")
            self._router_send(rid, Kind.REJECT, encode(reason))
            return
        peer.rid = rid
        peer.hello = True
        self._by_rid[rid] = peer
        self._router_send(rid, Kind.WELCOME, encode(None))

    def _router_send(self, rid: bytes, kind: Kind, payload: bytes) -> None:
        try:
            self._router.send_multipart([rid, pack_header(kind, self.index), payload], _NOBLOCK)
        except zmq.ZMQError:
            pass  # the connector vanished (EHOSTUNREACH) or is flooded: it will time out on its own

    # -- the Allocator protocol --------------------------------------------------------------
    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        """Return one pusher per worker (by index) and this worker's puller for ``channel``."""
        if channel <= self._last:
            raise ValueError(f"channel {channel} allocated out of creation order (last was {self._last})")
        if channel > MAX_CHANNEL:
            raise ValueError(f"channel id {channel} does not fit the wire header")
        early = [c for c in self._pending if c < channel]
        if early:
            self._fail(self._mismatch(early[0], channel, self._pending_from[early[0]]))
        self._last = channel
        puller = LocalPuller(channel)
        self._pullers[channel] = puller
        # A peer may be ahead of us: what it already sent on this channel is waiting here.
        waiting = self._pending.pop(channel, None)
        self._pending_from.pop(channel, None)
        if waiting:
            puller.queue.extend(waiting)
            self._events.add(channel)
        pushers: list[Pusher] = [
            LoopbackPusher(puller, self._events) if p is None else _RemotePusher(self, p, channel)
            for p in self._peers
        ]
        return pushers, puller

    def receive(self) -> None:
        """Move every message that has arrived into its channel's puller."""
        self._raise_if_failed()
        if self._router is None:
            return
        # The hot path (every worker step) only reads the ROUTER (backlogs are retried by
        # release); the rest (monitors, DEALER replies, POLLOUT) every WATCH_INTERVAL seconds.
        if self._router_poller.poll(0):  # the cheapest readiness test pyzmq offers
            self._drain_router()
        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + WATCH_INTERVAL
            self._dispatch(self._poller.poll(0))
        if self._suspects:
            self._check_suspects()

    def release(self) -> None:
        """Flush queued sends; while some peer's backlog is over its bound, wait (receiving)."""
        self._raise_if_failed()
        for peer in list(self._backlogged):
            self._flush(peer)
        if self._backlogged and self._over_bound():
            self._wait_until(lambda: not self._over_bound(), None)

    def events(self) -> list[int]:
        """Return (and clear) the ids of channels that received messages since the last call."""
        ev = sorted(self._events)
        self._events.clear()
        return ev

    def await_events(self, timeout: float | None) -> None:
        """Park on the ZeroMQ poller until a message arrives or ``timeout`` seconds pass.

        Backlogged sends keep flowing while parked (a parked worker must not withhold data or
        progress its peers wait for).
        """
        self._raise_if_failed()
        if self._events or self._router is None:
            if not self._events and timeout:
                time.sleep(min(timeout, 0.01))
            return
        self._wait_until(lambda: False, timeout, wake_on_message=True)

    def close(self, abort: str | None = None) -> None:
        """Say goodbye and release the sockets.

        Normal close: send ``GOODBYE`` after the last queued message and wait (receiving, at most
        ``close_timeout`` seconds) until every live peer has read it or said goodbye itself. A peer
        lost meanwhile is not an error here: this worker's work is done, and the lost worker's own
        failure is reported by whoever supervises it. With ``abort`` (a one-line reason), tell the
        peers this worker failed, and close without waiting.
        """
        if self._closed:
            return
        graceful = abort is None and self._failure is None
        try:
            if self._others and self._router is not None:
                if graceful:
                    self._say_goodbye()
                else:
                    self._send_abort(abort or str(self._failure) or "communication failure")
        finally:
            self._teardown(graceful)

    # -- receiving ---------------------------------------------------------------------------
    def _drain_router(self) -> None:
        router = self._router
        recv = router.recv
        by_rid = self._by_rid
        unpack = HEADER.unpack
        budget = self._receive_bytes
        for _ in range(self._receive_batch):
            if budget <= 0:
                return
            try:
                rid = recv(_NOBLOCK)
            except zmq.Again:
                return
            peer = by_rid.get(rid)
            if peer is None:
                self._on_stranger(rid)
                continue
            # Invariant: a routing id is bound to one of our DEALERs at its HELLO, and our DEALERs
            # always send exactly two frames (header, payload), so no RCVMORE check is needed.
            head = recv(_NOBLOCK)
            payload = recv(_NOBLOCK)
            budget -= len(payload)
            if len(head) != HEADER.size:
                self._fail(CommError(f"worker {self.index}: corrupt header from worker {peer.index}"))
            version, kind, _source, channel, seq = unpack(head)
            if kind == _DATA:
                if seq != peer.recv_seq:
                    self._fail(CommError(f"worker {self.index}: message {seq} from worker {peer.index} arrived "
                                         f"when {peer.recv_seq} was expected (lost or duplicated message)"))
                peer.recv_seq = seq + 1
                self._deliver(peer.index, channel, decode(payload))
                if peer.lost_deadline is not None:
                    # Its data still flows in (it is lingering to deliver it): not lost yet.
                    peer.lost_deadline = time.monotonic() + self._grace
            elif kind == _GOODBYE:
                peer.goodbye = True
                self._drop_backlog(peer)
                # It waits for this before closing its sockets: it has delivered everything to us.
                self._router_send(rid, Kind.ACK, encode(None))
            elif kind == _ABORT:
                self._fail(PeerLost(peer.index, f"worker {self.index}: worker {peer.index} failed: "
                                                f"{decode(payload)}"))

    def _on_stranger(self, rid: bytes) -> None:
        """A message from a connection that has not greeted us: only a HELLO is acceptable."""
        frames = [rid]
        while self._router.getsockopt(_RCVMORE):
            frames.append(self._router.recv(_NOBLOCK))
        if len(frames) != 3:
            return  # not our protocol
        try:
            kind, source, _, _ = unpack_header(frames[1])
        except FramingError:
            return
        if kind == Kind.HELLO:
            self._on_hello(rid, source, frames[2])

    def _deliver(self, source: int, channel: int, message: Any) -> None:
        puller = self._pullers.get(channel)
        if puller is not None:
            puller.queue.append(message)
            self._events.add(channel)
        elif channel > self._last:
            if channel not in self._pending:  # the sender is ahead of us
                self._pending[channel] = []
                self._pending_from[channel] = source
            self._pending[channel].append(message)
        else:
            self._fail(self._mismatch(channel, self._last, source))

    def _mismatch(self, channel: int, allocated: int, source: int | None = None) -> ChannelMismatch:
        who = "a peer" if source is None else f"worker {source}"
        return ChannelMismatch(
            f"worker {self.index}: {who} sent a message on channel {channel}, which this worker never "
            f"allocated (it has reached channel {allocated}); channels are matched by creation order, "
            "so every worker must build the same dataflows in the same order")

    def _on_monitor(self, peer: _Peer) -> None:
        while True:
            try:
                event = recv_monitor_message(peer.monitor, _NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and not peer.goodbye and peer.lost_deadline is None:
                # Its GOODBYE travels on the other connection of the pair: give it a moment.
                peer.lost_deadline = time.monotonic() + self._grace
                self._suspects.append(peer)

    def _check_suspects(self) -> None:
        now = time.monotonic()
        for peer in self._suspects:
            if not peer.goodbye and now >= peer.lost_deadline:
                self._fail(PeerLost(peer.index, (
                    f"worker {self.index}: lost worker {peer.index} ({peer.endpoint}): its connection closed "
                    "without a goodbye (the worker crashed or was killed, or the network failed)")))
        self._suspects = [p for p in self._suspects if not p.goodbye]

    def _fail(self, error: CommError) -> None:
        self._failure = error
        raise error

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CommError(f"worker {self.index}: the allocator is closed")

    # -- sending -----------------------------------------------------------------------------
    def _send_data(self, peer: _Peer, channel: int, message: Any) -> None:
        if peer.goodbye:
            return  # it closed after finishing every dataflow: nothing it could still need
        try:
            payload = encode(message)
        except Exception as exc:
            raise TypeError(f"cannot send a message to worker {peer.index} on channel {channel}: "
                            f"{exc} (messages must be msgpack-serialisable)") from exc
        head = pack_header(Kind.DATA, self.index, channel, peer.send_seq)
        peer.send_seq += 1
        self._send(peer, head, payload)

    def _send(self, peer: _Peer, head: bytes, payload: bytes) -> None:
        # FIFO: a message goes straight out only when nothing older is waiting for this peer.
        if not peer.backlog:
            send = peer.dealer.send
            try:
                # EAGAIN is only possible on the first frame: once it is taken, ZeroMQ takes the
                # whole multipart message (atomic delivery), so a message is never half-sent.
                send(head, _NOBLOCK_MORE)
            except zmq.Again:
                pass
            else:
                send(payload, 0, copy=False)
                return
            self._backlogged.add(peer)
            self._poller.register(peer.dealer, zmq.POLLIN | zmq.POLLOUT)
        peer.backlog.append((head, payload))
        peer.backlog_bytes += len(payload) + HEADER.size

    def _flush(self, peer: _Peer) -> None:
        backlog = peer.backlog
        send = peer.dealer.send
        try:
            while backlog:
                head, payload = backlog[0]
                send(head, _NOBLOCK_MORE)  # as in _send: only the first frame can fail
                send(payload, 0, copy=False)
                backlog.popleft()
                peer.backlog_bytes -= len(payload) + HEADER.size
        except zmq.Again:
            return
        self._backlogged.discard(peer)
        self._poller.register(peer.dealer, zmq.POLLIN)

    def _drop_backlog(self, peer: _Peer) -> None:
        peer.backlog.clear()
        peer.backlog_bytes = 0
        if peer in self._backlogged:
            self._backlogged.discard(peer)
            self._poller.register(peer.dealer, zmq.POLLIN)

    def _over_bound(self) -> bool:
        bound = self._backlog_bound
        return any(p.backlog_bytes > bound for p in self._backlogged)

    def _dispatch(self, ready: list[tuple[Any, int]], drain: bool = True) -> bool:
        """Handle poll results; return True if the ROUTER has messages (drained if ``drain``)."""
        inbound = False
        for sock, flags in ready:
            if sock is self._router:
                inbound = True
                if drain:
                    self._drain_router()
            elif sock in self._monitors:
                self._on_monitor(self._monitors[sock])
            else:
                peer = self._dealers[sock]
                if flags & zmq.POLLIN:
                    self._on_dealer(peer)
                if flags & zmq.POLLOUT:
                    self._flush(peer)
        return inbound

    def _wait_until(self, done: Any, timeout: float | None, wake_on_message: bool = False) -> bool:
        """Poll (receiving, flushing, watching peers) until ``done()``, a message arrives with
        ``wake_on_message``, or ``timeout`` seconds pass. Return ``done()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            now = time.monotonic()
            wait = None if deadline is None else max(0.0, deadline - now)
            if self._suspects:
                first = min(p.lost_deadline for p in self._suspects)
                wait = max(0.0, first - now) if wait is None else min(wait, max(0.0, first - now))
            ready = self._poller.poll(None if wait is None else int(wait * 1000) + 1)
            woke = self._dispatch(ready, drain=not wake_on_message) and wake_on_message
            if self._suspects:
                self._check_suspects()
            if woke or (deadline is not None and time.monotonic() >= deadline):
                break
        return done()

    # -- shutdown ----------------------------------------------------------------------------
    def _say_goodbye(self) -> None:
        goodbye = encode(None)
        for peer in self._others:
            if not peer.goodbye and peer.lost_deadline is None:
                self._send(peer, pack_header(Kind.GOODBYE, self.index), goodbye)

        def settled() -> bool:
            # A peer is settled once it read our GOODBYE (ACK), finished itself (GOODBYE), or is gone.
            return all(p.acked or p.goodbye or p.lost_deadline is not None for p in self._others)

        try:
            # Keep receiving while waiting: a peer blocked sending to us must be able to finish,
            # and its GOODBYE must be acknowledged.
            ok = self._wait_until(settled, self._close_timeout)
        except CommError:
            return  # a peer failed meanwhile: its own failure is reported where it ran
        if not ok:
            waiting = [p.index for p in self._others if not (p.acked or p.goodbye or p.lost_deadline is not None)]
            sys.stderr.write(f"timely: worker {self.index}: workers {waiting} did not acknowledge the end of "
                             f"the job within {self._close_timeout} s; closing anyway\n")

    def _send_abort(self, reason: str) -> None:
        payload = encode(reason.splitlines()[0][:500] if reason else "failed")
        for peer in self._others:
            if peer.dealer is not None and not peer.goodbye:
                try:
                    peer.dealer.send_multipart((pack_header(Kind.ABORT, self.index), payload), _NOBLOCK)
                except zmq.ZMQError:
                    pass  # its queue is full or gone: it will see the connection drop instead

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        # After a graceful goodbye every settled peer has read all we sent: nothing needs to
        # linger on its DEALER. Otherwise a short linger still lets a final ABORT (or ACK) out;
        # ctx.term() waits for that, bounded by the linger.
        for peer in self._others:
            if peer.monitor is not None:
                try:
                    peer.dealer.disable_monitor()
                except zmq.ZMQError:
                    pass
                peer.monitor.close(0)
            if peer.dealer is not None:
                settled = peer.acked or peer.goodbye or peer.lost_deadline is not None
                peer.dealer.close(0 if graceful and settled else 500)
        if self._router is not None:
            self._router.close(500)  # WELCOME / REJECT / ACK replies travel here
        self._ctx.term()

    def __repr__(self) -> str:
        return f"ZmqAllocator(index={self.index}, peers={self.peers})"
