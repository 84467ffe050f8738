"""Wire protocol between Spark processes and timely workers (ZeroMQ, msgpack headers, Arrow IPC).

Two kinds of endpoint, both ZeroMQ ROUTER sockets bound by the workers; clients are DEALERs.

**Coordinator** (worker 0 only; the address the user chooses). One frame in, one frame out, each a
msgpack map. Requests carry ``op``, a :class:`Request`:

- ``hello {worker, endpoint, generation, job}``: a worker registers its data endpoint (workers
  1..N-1 at start-up; answered only by a refusal: ``job`` names another run of a job, or the
  worker is registered already).
- ``plan {stream, kind: "write"|"read", schema, key}``: the data endpoints of every worker, the
  stream's declared schema, ``max_message_bytes`` (the largest frame a worker accepts); checks the
  stream exists and the schema matches.
- ``commit {stream, query, batch, tokens, final, progress}``: publish a staged batch as the next
  epoch. Answered once every worker's source has emitted the epoch (its frontier passed it). With
  ``progress: true`` a commit that is decided but not yet emitted everywhere is also answered at
  once (and again on every repeat) by ``{"ok": False, "kind": "pending", "epoch": E or None}``,
  so that a client tells a slow commit from an unreachable coordinator; the final reply follows.
- ``abort {stream, query, batch, tokens, final}``: discard the staged data of a batch.
- ``expire {stream, query, batch, tokens}``: (from the job's own workers, never answered) these
  staged attempts saw no write activity on the sender for the expiry time: discard them on every
  worker unless the batch is decided, and refuse a later commit listing one of them (see
  :mod:`spark_bridge.ledger`).
- ``close {stream}``: close a source (its frontier becomes empty once pending commits are out).
- ``shutdown {}``: close every source, stop accepting data, release sinks.
- ``status {}``: streams, worker endpoints and per-source counters.

Replies are ``{"ok": True, ...}`` or ``{"ok": False, "kind": ..., "error": message}``.

Every message from outside is checked (:mod:`spark_bridge.checks`) before it touches the bridge's
state: a malformed one is refused (``kind: "refused"`` on the coordinator; logged, unanswered on a
data endpoint). A frame over the job's ``max_message_bytes`` disconnects its sender. With a job
secret both endpoints are CURVE servers (:mod:`timely.comm.secret`).

**Data** (every worker). Multipart messages whose first frame is an :class:`Op`:

- ``B token header schema``: a write task begins a staged write (header: stream, query, batch,
  partition, attempt, generation, timeout (the write's, in seconds: its staged rows expire after a
  multiple of it); schema: Arrow IPC schema bytes).
- ``D token rows body``: one Arrow record batch (``RecordBatch.serialize()``), ``rows`` as int64.
- ``E token summary``: end of the task's data for this worker; answered ``A token reply`` once staged
  (``A`` also rejects a write early, as soon as the worker knows it failed).
- ``S reqid {sink}``: status of a sink here; answered ``s reqid reply``.
- ``R reqid {sink, start, end}``: the outputs of epochs in [start, end); answered by zero or more
  ``r reqid (epoch, rows) body`` frames and a final ``z reqid reply``.
- ``L reqid {sink, upto}``: a reader committed every epoch before ``upto``; answered ``l reqid reply``.
- ``X reqid {}``: shutdown (sent to every worker by ``spark_bridge.shutdown``); answered ``x reqid reply``.
"""
from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

ROWS = struct.Struct("<q")


class Request(str, enum.Enum):
    """The ``op`` of a coordinator request. ``COMMIT``, ``ABORT``, ``EXPIRE`` and ``CLOSE`` also name the
    decisions the coordinator takes on such requests (see :class:`spark_bridge.ledger.Decision`)."""

    HELLO = "hello"
    PLAN = "plan"
    COMMIT = "commit"
    ABORT = "abort"
    CLOSE = "close"
    SHUTDOWN = "shutdown"
    STATUS = "status"
    EXPIRE = "expire"


class Op(bytes, enum.Enum):
    """The first frame of a data-endpoint message: what it is."""

    # staged writes: Spark task -> worker, and the worker's answer
    BEGIN = b"B"
    DATA = b"D"
    END = b"E"
    ACK = b"A"
    # requests of readers and of spark_bridge.shutdown, each with its reply
    STATUS, STATUS_REPLY = b"S", b"s"
    READ, READ_BATCH, READ_END = b"R", b"r", b"z"
    RELEASE, RELEASE_REPLY = b"L", b"l"
    STOP, STOP_REPLY = b"X", b"x"

    @property
    def reply(self) -> Op:
        """The op answering this request (``STATUS``, ``RELEASE`` and ``STOP`` only)."""
        return _REPLIES[self]


_REPLIES = {Op.STATUS: Op.STATUS_REPLY, Op.RELEASE: Op.RELEASE_REPLY, Op.STOP: Op.STOP_REPLY}


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``tcp://[IPV6]:PORT``: ZeroMQ binds or connects it only on a socket with
    ``zmq.IPV6`` set (which the bridge sets on no other: it would report an IPv4 endpoint it binds
    as ``tcp://[::ffff:a.b.c.d]:PORT``)."""
    return endpoint.startswith("tcp://[")


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (str as str, bytes as bin)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    """The object packed in ``data`` (bytes or a buffer such as a ZeroMQ frame's)."""
    return msgpack.unpackb(bytes(data) if not isinstance(data, bytes) else data, raw=False, strict_map_key=False)


def ok(**fields: Any) -> dict:
    """A success reply carrying ``fields``."""
    fields["ok"] = True
    return fields


def error(message: str, kind: str = "error", **fields: Any) -> dict:
    """A failure reply; ``kind`` selects the client's exception (see :func:`spark_bridge.errors.from_reply`)."""
    fields.update(ok=False, kind=kind, error=message)
    return fields
