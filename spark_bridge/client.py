"""The Spark side's connections to a timely cluster (no PySpark needed here).

Used by the data source in Spark's driver and executor Python workers, and by user code
(``spark_bridge.shutdown``, ``close_stream``, ``status``). ZeroMQ sockets are cached per process,
endpoint and secret: Spark reuses its Python workers across tasks, so a task finds its sockets open.
The context is created lazily and re-created after a fork (never shared across ``fork``). With a
job secret (:class:`~timely.comm.secret.JobSecret`) every socket is a CURVE client of the job.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, cast

import zmq

from timely.comm.secret import JobSecret, resolve

from . import protocol as P
from .errors import (
    BadEndpoint,
    BridgeError,
    ClusterStopping,
    CommitPending,
    CommitUnconfirmed,
    CoordinatorUnreachable,
    WorkerUnreachable,
    from_reply,
)
from .protocol import Op, Request

DEFAULT_TIMEOUT = 30.0
#: The longest an abort waits for the coordinator's answer: Spark aborts a write that already
#: failed, typically because the cluster stopped answering, so the abort must not add another
#: ``timeout`` to the failure (the request still leaves in the background if the cluster answers).
ABORT_WAIT = 1.0
#: The longest time between the sends of a commit (:meth:`Coordinator.request_until_answered`).
RETRY_WAIT = 5.0
_SECRET_HINT = "(a job with a secret answers only clients given the same one: option 'secret' or $TIMELY_SECRET)"

_ctx: zmq.Context | None = None
_ctx_pid: int | None = None
_links: dict[tuple, WorkerLink] = {}  # (thread, endpoint, secret) -> link: ZeroMQ sockets are not thread-safe
#: Links a thread keeps open at most (the least recently used is closed for a new one): each timely
#: job, and each restart of one, has new data endpoints, and a long-lived process (a reused Spark
#: Python worker, a notebook) would otherwise run out of file descriptors.
MAX_LINKS_PER_THREAD = 64


_ctx_lock = threading.Lock()  # held to create the context (threads making their first call at once)


def _after_fork_in_child() -> None:
    global _ctx_lock
    _ctx_lock = threading.Lock()  # (a thread of the parent may have held it at the fork)


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def context() -> zmq.Context:
    """This process's ZeroMQ context (created after any fork; one per process, whatever the
    threads asking at once)."""
    global _ctx, _ctx_pid, _links
    pid = os.getpid()
    if _ctx_pid == pid:  # (read before _ctx: both are set, _ctx first, under the lock)
        ctx = _ctx
        if ctx is not None:
            return ctx
    with _ctx_lock:
        if _ctx is None or _ctx_pid != pid:
            _ctx = zmq.Context()
            _ctx_pid = pid
            _links = {}
        return _ctx


def seconds(value: Any, name: str = "timeout") -> float:
    """``value`` (a number or its text) as a positive, finite number of seconds; a
    :class:`BridgeError` naming the option ``name`` and the value otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    # Invariant: every wait of the bridge is bounded (a negative poll timeout waits forever).
    if not (0 < out < math.inf):
        raise BridgeError(f"option '{name}' must be a positive number of seconds, not {str(value)!r}")
    return out


_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")


def checked_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is ``tcp://HOST:PORT`` (``[IPV6]`` as a host too) or ``ipc://PATH``, else
    :class:`BadEndpoint` naming the option (ZeroMQ's own error named neither)."""
    example = "the timely coordinator, e.g. tcp://127.0.0.1:7447 or ipc:///tmp/job/coordinator"
    if not endpoint:
        raise BadEndpoint(f"the 'endpoint' option ({example}) is required")
    tcp = _TCP.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if tcp is not None and 0 < int(tcp.group(2)) < 65536:
        return endpoint
    if isinstance(endpoint, str) and endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    raise BadEndpoint(f"the 'endpoint' option {endpoint!r} is not tcp://HOST:PORT or ipc://PATH ({example})")


def _dealer(endpoint: str) -> zmq.Socket:
    """A DEALER socket of this process's context for ``endpoint``, closed without lingering (an IPv6
    one, ``tcp://[::1]:7447``, needs ``zmq.IPV6``: see :func:`spark_bridge.protocol.is_ipv6`)."""
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if P.is_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class Coordinator:
    """Requests to worker 0's coordinator endpoint; each gets a fresh socket and a deadline."""

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, secret: JobSecret | None = None) -> None:
        self.endpoint = checked_endpoint(endpoint)
        self.timeout = seconds(timeout)
        self.secret = secret

    def request(self, op: Request, wait: float | None = None, **fields: Any) -> dict:
        """Send one request, wait for its reply (at most ``wait`` seconds, default the timeout);
        raise the reply's error (see ``errors.from_reply``). A request whose reply is not awaited
        keeps being sent in the background for up to the timeout."""
        fields["op"] = op.value
        wait = self.timeout if wait is None else min(wait, self.timeout)
        sock = _dealer(self.endpoint)
        if self.secret is not None:
            self.secret.connect(sock)
        linger = 0
        try:
            sock.connect(self.endpoint)
            sock.send(P.pack(fields))
            if not sock.poll(int(wait * 1000)):
                linger = int((self.timeout - wait) * 1000)
                raise CoordinatorUnreachable(
                    f"timely coordinator at {self.endpoint} did not answer a '{op.value}' request within "
                    f"{wait:g} s: is the timely job running and serving that endpoint? {_SECRET_HINT}")
            reply = P.unpack(sock.recv())
        finally:
            sock.close(linger=linger)
        if not reply.get("ok"):
            raise from_reply(reply)
        return reply

    def request_until_answered(self, op: Request, **fields: Any) -> dict:
        """A commit: :meth:`request` on one socket, sent again every :func:`retry_wait` s while
        unanswered. Only for requests the coordinator answers the same however often they come (a
        batch is decided once), so that one survives a restart of the cluster: a job with
        checkpoints comes back on the same coordinator endpoint and answers a commit it logged as a
        duplicate, and refuses one it did not (its staged rows are gone: write again).

        The request asks for ``pending`` replies (``progress``): once the coordinator says the
        commit is decided, this waits up to the timeout once more for the final reply (every
        worker emitted the epoch). Raises :class:`CoordinatorUnreachable` when the request never
        went out (no connection to the coordinator within the timeout: nothing can have been
        applied), and :class:`CommitUnconfirmed` when it went out and no final reply came: the
        coordinator decided the commit and did not confirm it within the timeout after, or it
        never answered (a coordinator busy in a long step decides it later). A commit that may
        have been decided is never reported as failed, and never waited for without bound."""
        fields.update(op=op.value, progress=True)
        msg = P.pack(fields)
        step = retry_wait(self.timeout)
        sock = _dealer(self.endpoint)
        # A message is queued only on a completed connection, so a send that succeeds may reach the
        # coordinator: it answers from its worker's step, and one busy in a long step reads the
        # request later and decides it, however long after we gave up (closing our socket cannot
        # take it back). Only a request that never went out is known to have applied nothing.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.secret is not None:
            self.secret.connect(sock)
        decided: CommitPending | None = None
        delivered = False  # some send went out on a live connection
        try:
            sock.connect(self.endpoint)
            now = time.monotonic()
            deadline, resend = now + self.timeout, now  # deadline: no answer at all until then
            while True:
                now = time.monotonic()
                if now >= deadline:
                    if decided is not None:
                        raise CommitUnconfirmed(
                            f"{decided}, but the timely coordinator at {self.endpoint} did not confirm it within "
                            f"{self.timeout:g} s: the outcome is unknown (the write is applied unless the timely "
                            f"cluster fails first); do not write the batch again, that would duplicate its rows; "
                            f"see spark_bridge.status(endpoint)['stats'] for its epoch") from None
                    if delivered:
                        raise CommitUnconfirmed(
                            f"the timely coordinator at {self.endpoint} received the '{op.value}' request but did "
                            f"not answer within {self.timeout:g} s (its worker busy in a long step, or the cluster "
                            "failing): the outcome is unknown, it may still decide the commit; do not write the "
                            "batch again before spark_bridge.status(endpoint)['stats'] shows it was not applied")
                    raise CoordinatorUnreachable(
                        f"timely coordinator at {self.endpoint} did not answer a '{op.value}' request within "
                        f"{self.timeout:g} s: is the timely job running and serving that endpoint? {_SECRET_HINT}")
                if now >= resend:
                    # A restarted cluster gets it; a live one answers 'pending' at once. No
                    # connection yet: try again shortly.
                    try:
                        sock.send(msg, zmq.NOBLOCK)
                        delivered = True
                        resend = now + step
                    except zmq.Again:
                        resend = now + min(0.01, step)
                if not sock.poll(max(1, int((min(deadline, resend) - now) * 1000))):
                    continue
                reply = P.unpack(sock.recv())
                if reply.get("ok"):
                    return reply
                error = from_reply(reply)
                if not isinstance(error, CommitPending):
                    raise error
                # Invariant: a commit the coordinator decided is never reported as failed while
                # the coordinator answers; the final reply comes on this socket.
                if decided is None:  # the final reply gets one more timeout, not one per 'pending'
                    deadline = time.monotonic() + self.timeout
                decided = error
        finally:
            sock.close(linger=0)  # an unanswered commit must not reach the job after we gave up


def retry_wait(timeout: float) -> float:
    """Seconds between the sends of a commit (:meth:`Coordinator.request_until_answered`): at most
    :data:`RETRY_WAIT`, and short enough that a live coordinator answers several within ``timeout``."""
    return min(RETRY_WAIT, timeout / 4)


class WorkerLink:
    """A DEALER socket to one worker's data endpoint (cached per process)."""

    def __init__(self, endpoint: str, secret: JobSecret | None = None) -> None:
        self.endpoint = endpoint
        self.sock = _dealer(endpoint)
        if secret is not None:
            secret.connect(self.sock)
        self.sock.setsockopt(zmq.SNDHWM, 256)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a worker that is not connected
        # A cached link outlives its cluster (Spark reuses its Python workers): once the worker's port
        # refuses, stop reconnecting, or the link would greet whatever listens on that port later
        # (a JVM's Python-worker socket failed on this greeting). A send then fails, and the link is
        # discarded and made again.
        with contextlib.suppress(AttributeError, zmq.ZMQError):  # (libzmq < 4.3.3: no such option)
            self.sock.setsockopt(zmq.RECONNECT_STOP, zmq.RECONNECT_STOP_CONN_REFUSED)
        self.sock.connect(endpoint)
        self._sndtimeo: int | None = None
        self.key: tuple | None = None  # where the per-process cache holds this link

    @staticmethod
    def get(endpoint: str, secret: JobSecret | None = None) -> WorkerLink:
        """This thread's link to ``endpoint`` (a CURVE client with ``secret``)."""
        context()
        key = (threading.get_ident(), endpoint, secret)
        link = _links.get(key)
        if link is not None and not cast(int, link.sock.get(zmq.EVENTS)) & zmq.POLLOUT:
            # No connection to send on (IMMEDIATE: nothing queues without one; between requests a
            # link's queue is empty): its worker went away and, the port refused, it stopped
            # reconnecting. A later job's worker may listen on that port now: a new link reaches it.
            link.discard()
            link = None
        if link is None:
            mine = [k for k in _links if k[0] == key[0]]  # (in the order last used)
            for old in mine[:max(0, len(mine) - MAX_LINKS_PER_THREAD + 1)]:
                _links[old].discard()  # this thread's own: no other thread uses its sockets
            link = _links[key] = WorkerLink(endpoint, secret)
            link.key = key
        else:
            _links[key] = _links.pop(key)  # the most recently used last
        return link

    def discard(self) -> None:
        """Forget this link (after an error: queued messages must not reach a later worker)."""
        if self.key is not None and _links.get(self.key) is self:
            del _links[self.key]
        self.sock.close(linger=0)

    def send(self, frames: Sequence[Any], timeout: float, worker: int) -> None:
        """Send ``frames`` to worker ``worker``; raise :class:`WorkerUnreachable` (and discard the link)
        if it accepts nothing within ``timeout`` seconds."""
        ms = max(1, int(timeout * 1000))
        if self._sndtimeo != ms:
            self.sock.setsockopt(zmq.SNDTIMEO, ms)
            self._sndtimeo = ms
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self.discard()
            raise WorkerUnreachable(
                f"timely worker {worker} at {self.endpoint} accepted no data for {timeout:g} s: "
                f"the cluster stopped or is stuck {_SECRET_HINT}") from None

    def check(self, key: bytes) -> None:
        """Raise at once if the worker already rejected the write ``key`` (non-blocking)."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) >= 3 and frames[0].bytes == Op.ACK and frames[1].bytes == key:
                reply = P.unpack(frames[2].bytes)
                if not reply.get("ok"):
                    raise from_reply(reply)

    def recv_reply(self, kinds: tuple[Op, ...], key: bytes, timeout: float, worker: int, what: str) -> list:
        """The next reply of one of ``kinds`` for ``key`` (older replies for other keys are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                self.discard()
                raise WorkerUnreachable(
                    f"timely worker {worker} at {self.endpoint} did not answer ({what}) within {timeout:g} s: "
                    f"the cluster stopped or is stuck {_SECRET_HINT}")
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) >= 3 and frames[1].bytes == key and frames[0].bytes in kinds:
                return frames


def request_worker(endpoint: str, worker: int, op: Op, body: dict, timeout: float,
                   secret: JobSecret | None = None) -> dict:
    """One request/reply exchange with a worker's data endpoint (``Op.STATUS``, ``RELEASE``, ``STOP``)."""
    link = WorkerLink.get(endpoint, secret)
    reqid = uuid.uuid4().bytes
    link.send([op, reqid, P.pack(body)], timeout, worker)
    frames = link.recv_reply((op.reply,), reqid, timeout, worker, op.name.lower())
    reply = P.unpack(frames[2].bytes)
    if not reply.get("ok"):
        raise from_reply(reply)
    return reply


def read_epochs(endpoint: str, worker: int, sink: str, start: int, end: int, timeout: float,
                secret: JobSecret | None = None) -> Iterator[tuple[int, Any]]:
    """``(epoch, body)`` for every output batch of ``sink`` at ``start <= epoch < end`` on one worker
    (body: a ZeroMQ frame holding a serialized RecordBatch)."""
    link = WorkerLink.get(endpoint, secret)
    reqid = uuid.uuid4().bytes
    link.send([Op.READ, reqid, P.pack({"sink": sink, "start": start, "end": end})], timeout, worker)
    while True:
        frames = link.recv_reply((Op.READ_BATCH, Op.READ_END), reqid, timeout, worker,
                                 f"read of '{sink}' epochs {start}..{end - 1}")
        if frames[0].bytes == Op.READ_END:
            reply = P.unpack(frames[2].bytes)
            if not reply.get("ok"):
                raise from_reply(reply)
            return
        epoch, _rows = P.unpack(frames[2].bytes)
        yield epoch, frames[3]


# -- cluster-wide operations --------------------------------------------------------------------------
Secret = str | JobSecret | None  # a job secret's text or keys; None: from the environment (resolve())


def status(endpoint: str, timeout: float = 10.0, secret: Secret = None) -> dict:
    """The coordinator's view: ``peers``, ``sources``, ``sinks``, ``endpoints`` (once registered),
    ``refused`` (malformed messages refused so far). ``secret``: the job's (default: the environment)."""
    return Coordinator(endpoint, timeout, resolve(secret)).request(Request.STATUS)


def close_stream(endpoint: str, stream: str, timeout: float = 10.0, secret: Secret = None) -> None:
    """Close the source ``stream``: no more writes; its frontier empties once pending commits are out."""
    Coordinator(endpoint, timeout, resolve(secret)).request(Request.CLOSE, stream=stream)


def shutdown(endpoint: str, timeout: float = 10.0, secret: Secret = None) -> None:
    """Stop the bridge on every worker: sources close, writes in flight fail, sinks stop serving.

    The timely job's dataflows can then complete, so its workers finish.
    """
    keys = resolve(secret)
    coord = Coordinator(endpoint, timeout, keys)
    info = coord.request(Request.STATUS)
    for i, ep in enumerate(info.get("endpoints") or []):
        if ep and i != 0:  # worker 0 stops on the coordinator's request, last
            try:
                request_worker(ep, i, Op.STOP, {}, timeout, keys)
            except ClusterStopping:
                pass
    coord.request(Request.SHUTDOWN)
