"""The ZeroMQ connections of one worker to all the others.

:class:`Links` owns a worker's ZeroMQ context, its ``ROUTER`` (inbound) and one :class:`Peer`
(``DEALER``, outbound) per other worker. It greets the peers, moves received ``DATA`` messages into
a :class:`~timely.comm.mailbox.Mailbox` (not while it is full), sends with bounded backlogs,
watches the connections and says goodbye; the wire protocol is described in
:mod:`timely.comm.zmq_allocator`. It knows channels only as numbers in message headers. With a job
secret, the ``ROUTER`` is a CURVE server guarded by the secret's ZAP handler and every ``DEALER`` a
CURVE client (:mod:`timely.comm.secret`).
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import ChannelMismatch, CommError, FramingError, HandshakeError, PeerLost
from .framing import HEADER, VERSION, Kind, decode, encode, pack_header, recv_buffer_frames, unbundle, unpack_header
from .gate import Refusals, hello_rejection, read_hello
from .mailbox import Mailbox
from .peer import HANDSHAKE_FAILED, NOBLOCK, Peer, Tuning, bind_router, connect_peer

if TYPE_CHECKING:
    from .secret import Guard, JobSecret

_DATA, _DATA_BUFFERS, _GOODBYE, _ABORT = int(Kind.DATA), int(Kind.DATA_BUFFERS), int(Kind.GOODBYE), int(Kind.ABORT)
_RCVMORE = int(zmq.RCVMORE)
_BUNDLE = int(Kind.BUNDLE)

#: Seconds between checks of the connection monitors on the non-blocking ``receive`` path.
WATCH_INTERVAL = 0.02


class Links:
    """Worker ``index``'s connections to the workers listening on ``endpoints`` (``len(endpoints)``
    workers, at least two). It listens on ``bind`` and delivers what peers send into ``mailbox``;
    the constructor returns once every peer has been greeted in both directions (or raises
    :class:`HandshakeError` after ``tuning.startup_timeout`` seconds). ``secret``: see the module.
    """

    def __init__(self, index: int, endpoints: list[str], token: str, bind: str, mailbox: Mailbox,
                 tuning: Tuning, secret: JobSecret | None = None) -> None:
        self.index = index
        self._size = len(endpoints)
        self._token = token
        self._mailbox = mailbox
        self._tuning = tuning
        self._secret = secret
        # The ROUTER is not read while the mailbox holds this many unread bytes; no limit during
        # the start-up handshake (every HELLO must be read) and the goodbye (nothing is read after).
        self._unread_limit = math.inf
        self._peers: dict[int, Peer] = {}  # by worker index
        self._others: list[Peer] = []  # the same, in index order
        self._by_rid: dict[bytes, Peer] = {}
        self._monitors: dict[zmq.Socket, Peer] = {}
        self._dealers: dict[zmq.Socket, Peer] = {}
        self._backlogged: set[Peer] = set()
        self._suspects: list[Peer] = []
        self.finished: set[int] = set()  # peers that said GOODBYE (after all their data)
        self.refusals = Refusals(index)  # messages refused before a handshake
        self._rejections: deque[str] = deque(maxlen=4)  # the latest rejected HELLOs, for start-up errors
        self._failure: CommError | None = None
        self._next_watch = 0.0
        self._closed = False
        self._poller = zmq.Poller()  # everything: ROUTER, monitors, DEALERs (POLLOUT while backlogged)
        self._router_poller = zmq.Poller()  # the ROUTER alone
        self._ctx = zmq.Context(1)
        self._guard: Guard | None = None
        try:
            if secret is not None:
                self._guard = secret.guard(self._ctx)  # before the ROUTER binds
            self._router = bind_router(self._ctx, tuning, secret, index, bind)
            self._bind = bind
        except BaseException:
            self._end_context()
            raise
        self._poller.register(self._router, zmq.POLLIN)
        self._router_poller.register(self._router, zmq.POLLIN)
        try:
            for j, endpoint in enumerate(endpoints):
                if j != index:
                    self._add(connect_peer(self._ctx, tuning, secret, index, self._size, token, j, endpoint))
            self._handshake(time.monotonic() + tuning.startup_timeout)
        except BaseException:
            self._teardown(graceful=False)
            raise
        self._unread_limit = tuning.mailbox_bytes

    def peer(self, index: int) -> Peer:
        """The connection to worker ``index`` (not this worker)."""
        return self._peers[index]

    # -- the allocator's calls ---------------------------------------------------------------
    def readable(self) -> bool:
        """True when a message from a peer can be read now (about 2 us: the cheapest readiness
        test pyzmq offers)."""
        return bool(self._router_poller.poll(0))

    def receive(self) -> None:
        """Deliver what has arrived (a bounded amount per call) and watch the connections."""
        self.raise_if_failed()
        # The hot path (every worker step) only reads the ROUTER (backlogs are retried by
        # release); the rest (monitors, DEALER replies, POLLOUT) every WATCH_INTERVAL seconds.
        if self.readable():
            self._drain_router()
        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + WATCH_INTERVAL
            self._dispatch(self._poller.poll(0))
        if self._suspects:
            self._check_suspects()

    def release(self) -> None:
        """Flush the backlogs; while one is over its bound, wait for room (receiving meanwhile).

        The wait also ends once the mailbox is full: the worker must read it before anything more
        can be received, and two workers waiting for each other to receive would deadlock."""
        self.raise_if_failed()
        for peer in list(self._backlogged):
            self._flush(peer)
        if self._backlogged and self._over_bound():
            self._wait_until(lambda: not self._over_bound() or self._mailbox_full(), None)

    def cork(self) -> None:
        """Gather what is pushed to each peer until :meth:`uncork` (see :meth:`Peer.cork`)."""
        for peer in self._others:
            peer.cork()

    def uncork(self) -> None:
        """Send what each peer gathered since :meth:`cork` as one message per peer."""
        self.raise_if_failed()
        for peer in self._others:
            peer.uncork()

    def wait_for_message(self, timeout: float | None) -> None:
        """Park until a message arrives or ``timeout`` seconds pass, flushing backlogs meanwhile
        (a parked worker must not withhold data or progress its peers wait for)."""
        self.raise_if_failed()
        self._wait_until(lambda: False, timeout, wake_on_message=True)

    def fail(self, error: CommError) -> NoReturn:
        """Record ``error`` (every later call raises it again, ``close`` aborts) and raise it."""
        self._failure = error
        raise error

    def raise_if_failed(self) -> None:
        """Raise the recorded failure, or :class:`CommError` once closed."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CommError(f"worker {self.index}: the allocator is closed")

    def close(self, abort: str | None = None) -> None:
        """Say goodbye (or, with ``abort`` or after a failure, tell the peers why) and close."""
        if self._closed:
            return
        self._unread_limit = math.inf  # nobody reads the mailbox any more: never stop receiving
        graceful = abort is None and self._failure is None
        try:
            if graceful:
                self._say_goodbye()
            else:
                self._send_abort(abort or str(self._failure) or "communication failure")
        finally:
            self._teardown(graceful)

    # -- handshake ---------------------------------------------------------------------------
    def _add(self, peer: Peer) -> None:
        self._peers[peer.index] = peer
        self._others.append(peer)
        self._monitors[peer.monitor] = peer
        self._dealers[peer.dealer] = peer
        peer.on_backlog = self._watch
        peer.backlog_bound = self._tuning.backlog_bytes
        peer.on_over_bound = self._wait_for_room
        self._poller.register(peer.monitor, zmq.POLLIN)
        self._poller.register(peer.dealer, zmq.POLLIN)  # POLLOUT is added while it has a backlog

    def _handshake(self, deadline: float) -> None:
        while True:
            # A peer that already said GOODBYE needs no WELCOME: it may have finished and closed
            # its ROUTER (and dropped our WELCOME) while ours was still in flight.
            no_welcome = [p.index for p in self._others if not (p.welcomed or p.goodbye)]
            no_hello = [p.index for p in self._others if not p.hello]
            if not no_welcome and not no_hello:
                return
            self.raise_if_failed()
            now = time.monotonic()
            for peer in self._suspects:
                if not (peer.welcomed or peer.goodbye) and now >= peer.lost_deadline:
                    # Closed before accepting us: a start-up failure (another job's token, a worker
                    # that could not start), not a lost peer of a running job.
                    raise HandshakeError(
                        f"worker {self.index}: worker {peer.index} ({peer.endpoint}) closed its connection during "
                        "the start-up handshake, before accepting us (another job's token, or it failed to start)")
            self._check_suspects()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = sorted(set(no_welcome + no_hello))
                msg = (f"worker {self.index}: start-up timed out; no answer from workers {no_welcome}, "
                       f"no greeting from workers {no_hello} (endpoints: "
                       + ", ".join(self._peers[j].endpoint for j in silent) + ")")
                if self._rejections:
                    msg += "; rejected connections: " + "; ".join(self._rejections)
                msg += ("; the workers' job secrets may differ" if self._secret is not None
                        else "; if the other workers use a job secret, this one needs it too")
                raise HandshakeError(msg)
            self._dispatch(self._poller.poll(int(min(remaining, 0.2) * 1000) + 1))

    def _on_dealer(self, peer: Peer) -> None:
        """Handle what a listener sends back on our DEALER: WELCOME / REJECT, and ACK at the end."""
        while True:
            try:
                frames = peer.dealer.recv_multipart(NOBLOCK)
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
                # Answer the greetings already here first: a peer that is rejecting us is likely
                # being rejected by us too, and should hear why rather than see us vanish.
                self._drain_router()
                raise HandshakeError(f"worker {self.index}: the process listening on {peer.endpoint} "
                                     f"(worker {peer.index}'s address) rejected us: {body}")

    def _on_stranger(self, rid: bytes) -> None:
        """A message from a connection that has not greeted us: only a valid HELLO is acceptable;
        anything else is refused and logged (rate-limited), never fatal."""
        hello = read_hello(self._router)
        if isinstance(hello, str):
            self.refusals.refuse(hello)
            return
        source, info = hello
        peer = self._peers.get(source)
        reason = hello_rejection(info, source, self._token, self._size, self._tuning.max_message_bytes,
                                 peer is not None, peer is not None and peer.hello)
        if reason is not None or peer is None:  # (a reason is always given when peer is None)
            self.refusals.refuse(f"a HELLO claiming to be worker {source} ({reason})")
            self._rejections.append(f"a connection claiming to be worker {source}: {reason}")
            self._router_send(rid, Kind.REJECT, encode(reason))
            return
        peer.rid = rid
        peer.hello = True
        self._by_rid[rid] = peer
        self._router_send(rid, Kind.WELCOME, encode(None))

    def _router_send(self, rid: bytes, kind: Kind, payload: bytes) -> None:
        try:
            self._router.send_multipart([rid, pack_header(kind, self.index), payload], NOBLOCK)
        except zmq.ZMQError:
            pass  # the connector vanished (EHOSTUNREACH) or is flooded: it will time out on its own

    # -- receiving ---------------------------------------------------------------------------
    def _drain_router(self) -> None:
        recv = self._router.recv
        by_rid = self._by_rid
        mailbox = self._mailbox
        deliver = mailbox.deliver
        unpack = HEADER.unpack
        budget = self._tuning.receive_bytes
        limit = self._unread_limit
        more = self._router.get  # more(_RCVMORE): another frame of this message follows

        for _ in range(self._tuning.receive_batch):
            # Backpressure: what stays in ZeroMQ fills its queues, and then the sender's backlog.
            if budget <= 0 or mailbox.unread_bytes >= limit:
                return
            try:
                rid = recv(NOBLOCK)
            except zmq.Again:
                return
            peer = by_rid.get(rid)
            if peer is None:
                self._on_stranger(rid)
                continue
            # A routing id is bound to one of our DEALERs at its HELLO, and our DEALERs send two
            # frames (header, payload) but for DATA_BUFFERS, whose further frames its branch reads.
            # A greeted peer that sends otherwise (corruption, another build) is failed, naming it:
            # reading on would take the next message's frames for this one's.
            head = recv(NOBLOCK)  # (a frame always follows the routing id: no message is empty)
            payload = recv(NOBLOCK) if more(_RCVMORE) else None
            if len(head) != HEADER.size or payload is None:
                self._malformed(peer, "a message without its header and payload frames")
            budget -= len(payload)
            version, kind, _source, channel, seq = unpack(head)
            if version != VERSION:
                self._malformed(peer, f"protocol version {version}, expected {VERSION}")
            if kind == _DATA or kind == _BUNDLE:
                if more(_RCVMORE):
                    self._malformed(peer, "a DATA message of more than two frames")
                if seq != peer.recv_seq:
                    self._out_of_order(peer, seq)
                peer.recv_seq = seq + 1
                try:
                    parts = ((channel, payload),) if kind == _DATA else unbundle(payload)
                    for part_channel, part in parts:
                        deliver(peer.index, part_channel, decode(part), len(part))
                except ChannelMismatch as exc:
                    self.fail(exc)
                except FramingError as exc:
                    self.fail(FramingError(f"worker {self.index}: from worker {peer.index}: {exc}"))
                except Exception as exc:  # msgpack's errors of a corrupt payload
                    self._malformed(peer, f"an undecodable payload ({type(exc).__name__}: {exc})")
                if peer.dropped:
                    self._still_sending(peer)
            elif kind == _DATA_BUFFERS:
                budget -= self._deliver_buffers(peer, channel, seq, payload)
            elif kind == _GOODBYE:
                peer.goodbye = True
                self.finished.add(peer.index)
                self._drop_backlog(peer)
                # It waits for this before closing its sockets: it has delivered everything to us.
                self._router_send(rid, Kind.ACK, encode(None))
            elif kind == _ABORT:
                try:
                    reason = decode(payload)
                except Exception as exc:
                    reason = f"(an undecodable reason: {type(exc).__name__})"
                self.fail(PeerLost(peer.index, f"worker {self.index}: worker {peer.index} failed: {reason}"))
            else:
                self._malformed(peer, f"a message of kind {kind}, which a running worker does not send")

    def _malformed(self, peer: Peer, what: str) -> NoReturn:
        """A greeted peer sent what no worker of this build sends: fail, naming it."""
        while self._router.get(zmq.RCVMORE):  # (the rest of its frames: nothing else is read anyway)
            self._router.recv(NOBLOCK)
        self.fail(FramingError(f"worker {self.index}: worker {peer.index} sent {what}"))

    def _deliver_buffers(self, peer: Peer, channel: int, seq: int, payload: bytes) -> int:
        """Read the buffer frames of a ``DATA_BUFFERS`` message whose header and ``payload`` (its
        head) were read and deliver ``(head, buffers)``; return the bytes of its buffers."""
        buffers, size = recv_buffer_frames(self._router)
        if seq != peer.recv_seq:
            self._out_of_order(peer, seq)
        peer.recv_seq = seq + 1
        try:
            self._mailbox.deliver(peer.index, channel, (decode(payload), buffers), size + len(payload))
        except ChannelMismatch as exc:
            self.fail(exc)
        except Exception as exc:  # a corrupt head
            self._malformed(peer, f"an undecodable payload ({type(exc).__name__}: {exc})")
        if peer.dropped:
            self._still_sending(peer)
        return size

    def _out_of_order(self, peer: Peer, seq: int) -> NoReturn:
        self.fail(CommError(f"worker {self.index}: message {seq} from worker {peer.index} arrived "
                            f"when {peer.recv_seq} was expected (lost or duplicated message)"))

    def _still_sending(self, peer: Peer) -> None:
        """Data from a peer whose connection dropped: it is lingering to deliver it, not lost yet."""
        peer.lost_deadline = time.monotonic() + self._tuning.goodbye_grace

    def _on_monitor(self, peer: Peer) -> None:
        while True:
            try:
                event = recv_monitor_message(peer.monitor, NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & HANDSHAKE_FAILED and not peer.welcomed:
                raise HandshakeError(self._security_failure(peer, str(zmq.Event(event["event"]).name)))
            if event["event"] == zmq.EVENT_CONNECTED:
                peer.connections += 1
                if peer.connections > 1 and not peer.goodbye:
                    # ZeroMQ reconnected a dropped link by itself; the peer's ROUTER takes the new
                    # connection for a stranger's and refuses what it carries, and what was in
                    # flight when the link dropped is gone: delivery is no longer complete.
                    self.fail(PeerLost(peer.index, (
                        f"worker {self.index}: the connection to worker {peer.index} ({peer.endpoint}) was "
                        "reset and reconnected; messages in flight were lost (the network failed)")))
            if event["event"] == zmq.EVENT_DISCONNECTED and not peer.goodbye and not peer.dropped:
                # Its GOODBYE travels on the other connection of the pair: give it a moment.
                peer.lost_deadline = time.monotonic() + self._tuning.goodbye_grace
                self._suspects.append(peer)

    def _security_failure(self, peer: Peer, event: str) -> str:
        cause = ("the workers' job secrets differ, or that worker has none" if self._secret is not None
                 else "that worker may require a job secret, and this one has none")
        return (f"worker {self.index}: the ZeroMQ security handshake with worker {peer.index} ({peer.endpoint}) "
                f"failed ({event}): {cause}")

    def _check_suspects(self) -> None:
        now = time.monotonic()
        for peer in self._suspects:
            if not peer.goodbye and now >= peer.lost_deadline:
                self.fail(PeerLost(peer.index, (
                    f"worker {self.index}: lost worker {peer.index} ({peer.endpoint}): its connection closed "
                    "without a goodbye (the worker crashed or was killed, or the network failed)")))
        self._suspects = [p for p in self._suspects if not p.goodbye]

    # -- sending -----------------------------------------------------------------------------
    def _watch(self, peer: Peer) -> None:
        """``peer`` has a backlog now: watch its ``DEALER`` for room."""
        self._backlogged.add(peer)
        self._poller.register(peer.dealer, zmq.POLLIN | zmq.POLLOUT)

    def _flush(self, peer: Peer) -> None:
        if peer.flush():
            self._unwatch(peer)

    def _drop_backlog(self, peer: Peer) -> None:
        peer.drop_backlog()
        if peer in self._backlogged:
            self._unwatch(peer)

    def _unwatch(self, peer: Peer) -> None:
        self._backlogged.discard(peer)
        self._poller.register(peer.dealer, zmq.POLLIN)

    def _wait_for_room(self, peer: Peer) -> None:
        """``peer``'s backlog passed its bound while a message was queued (within a step): wait
        for room, receiving meanwhile, as :meth:`release` does (and until the mailbox is full)."""
        self._watch(peer)
        self._wait_until(lambda: not self._over_bound() or self._mailbox_full(), None)

    def _over_bound(self) -> bool:
        bound = self._tuning.backlog_bytes
        return any(p.backlog_bytes > bound for p in self._backlogged)

    def _mailbox_full(self) -> bool:
        return self._mailbox.unread_bytes >= self._unread_limit

    # -- polling -----------------------------------------------------------------------------
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

    def _wait_until(self, done: Callable[[], bool], timeout: float | None, wake_on_message: bool = False) -> bool:
        """Poll (receiving, flushing, watching peers) until ``done()``, a message arrives with
        ``wake_on_message``, or ``timeout`` seconds pass. Return ``done()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            now = time.monotonic()
            wait = None if deadline is None else max(0.0, deadline - now)
            if self._suspects:
                first = max(0.0, min(p.lost_deadline for p in self._suspects) - now)
                wait = first if wait is None else min(wait, first)
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
            if not peer.goodbye and not peer.dropped:
                if peer.send(pack_header(Kind.GOODBYE, self.index), goodbye):
                    self._watch(peer)
        try:
            # Keep receiving while waiting: a peer blocked sending to us must be able to finish,
            # and its GOODBYE must be acknowledged.
            ok = self._wait_until(lambda: all(p.settled for p in self._others), self._tuning.close_timeout)
        except CommError:
            return  # a peer failed meanwhile: its own failure is reported where it ran
        if not ok:
            waiting = [p.index for p in self._others if not p.settled]
            sys.stderr.write(f"timely: worker {self.index}: workers {waiting} did not acknowledge the end of "
                             f"the job within {self._tuning.close_timeout} s; closing anyway\n")

    def _send_abort(self, reason: str) -> None:
        payload = encode(reason.splitlines()[0][:500] if reason else "failed")
        for peer in self._others:
            if not peer.goodbye:
                try:
                    peer.dealer.send_multipart((pack_header(Kind.ABORT, self.index), payload), NOBLOCK)
                except zmq.ZMQError:
                    pass  # its queue is full or gone: it will see the connection drop instead

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        # After a graceful goodbye every settled peer has read all we sent: nothing needs to
        # linger on its DEALER. Otherwise a short linger still lets a final ABORT (or ACK) out;
        # ctx.term() waits for that, bounded by the linger.
        for peer in self._others:
            peer.close(0 if graceful and peer.settled else 500)
        self._router.close(500)  # WELCOME / REJECT / ACK replies travel here
        self.refusals.flush()
        self._end_context()
        if self._bind.startswith("ipc://"):
            # libzmq leaves the socket file of an ipc ROUTER behind; nothing listens on it now.
            try:
                os.unlink(self._bind[len("ipc://"):])
            except OSError:
                pass

    def _end_context(self) -> None:
        """Terminate the context once our sockets are closed; its ZAP handler (a socket of the
        context too) stops first, or the termination would wait for it forever. ``destroy`` closes,
        without lingering, any socket of the context still open (one a failed start-up left
        behind), which would also make the termination wait forever; the sockets closed before
        keep their own linger."""
        if self._guard is not None:
            self._guard.stop()
        self._ctx.destroy(linger=0)

    def __repr__(self) -> str:
        return f"Links(index={self.index}, workers={self._size})"
