"""The timely side's sockets: one :class:`BridgeServer` per worker process.

Every worker binds a ZeroMQ ROUTER *data endpoint* that Spark tasks push Arrow batches to and
readers fetch outputs from; worker 0 also binds the *coordinator endpoint* the user chose, which
answers planning, commit, abort, close and shutdown requests (see :mod:`spark_bridge.protocol`).
Workers 1..N-1 register their data endpoints with the coordinator (``hello``) so that a plan can
list every worker.

The server only moves messages: it decodes a request, hands it to the stream's socket-free state
(:class:`~spark_bridge.ledger.Staging` and :class:`~spark_bridge.ledger.CommitLedger` for a
source, :class:`~spark_bridge.sinkbuffer.SinkBuffer` for a sink) and sends the replies that state
returns. It owns no thread: the bridge's operators call :meth:`BridgeServer.pump` from their logic
and re-activate themselves through a :class:`Wakeup` (1 ms while traffic flows, backing off to
50 ms when idle), so the worker parks on its allocator between polls and an idle bridge costs
nothing measurable.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import zmq

from . import protocol as P
from .errors import BridgeError
from .ledger import Staging
from .protocol import Op, Request
from .streams import Sink, Source, Streams

_SERVERS: weakref.WeakKeyDictionary[Any, BridgeServer] = weakref.WeakKeyDictionary()

_FAST, _MEDIUM, _SLOW = 0.001, 0.01, 0.05
GRACE = 0.5  # seconds a stopping bridge keeps answering, so writes in flight fail with a clear message


def _now() -> float:
    return time.monotonic()


class Wakeup:
    """Re-activates one operator after the bridge's current poll interval (one pending timer at most)."""

    def __init__(self, server: BridgeServer, activator: Any) -> None:
        self.server = server
        self.activator = activator
        self.at = 0.0

    def rearm(self) -> None:
        """Schedule the operator again; the back-off grows while no message arrives."""
        now = _now()
        idle = now - self.server.last_activity
        iv = _FAST if idle < 0.1 else _MEDIUM if idle < 1.0 else _SLOW
        if self.at <= now or self.at > now + iv + 0.0005:
            self.activator.activate_after(iv)
            self.at = now + iv


class BridgeServer:
    """The sockets of the bridge on one worker, and its streams by name."""

    def __init__(self, worker: Any, coordinator: str, host: str | None = None, endpoint_file: str | None = None) -> None:
        self.worker = worker
        self.index: int = worker.index
        self.peers: int = worker.peers
        self.requested_endpoint = coordinator  # as given; coordinator_endpoint is the one bound
        self.generation = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.stopping = False
        self.stop_time = 0.0
        self.closed = False
        self.streams = Streams(self.index)
        self.live_ops = 0
        self.last_activity = _now()
        self.deferred_plans: list = []  # plans asked before every worker registered
        self.orphans = Staging("<unknown>", self.index)  # writes naming no known stream
        self.data = self._router()
        self.data.bind(f"tcp://{host or _host_of(coordinator)}:*")
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coord: zmq.Socket | None = None
        self.hello: zmq.Socket | None = None
        self.endpoints: dict[int, tuple[str, str]] = {self.index: (self.data_endpoint, self.generation)}
        if self.index == 0:
            self.coord = self._router()
            bind = coordinator[:-2] + ":*" if coordinator.startswith("tcp://") and coordinator.endswith(":0") else coordinator
            try:
                self.coord.bind(bind)
            except zmq.ZMQError as e:
                self.close()
                raise BridgeError(f"spark_bridge: cannot bind the coordinator endpoint {coordinator}: {e}") from e
            self.coordinator_endpoint = self.coord.getsockopt_string(zmq.LAST_ENDPOINT)
            if endpoint_file:
                tmp = f"{endpoint_file}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(self.coordinator_endpoint + "\n")
                os.replace(tmp, endpoint_file)
            return
        if coordinator.startswith("tcp://") and (coordinator.endswith(":0") or coordinator.endswith(":*")):
            self.close()
            raise BridgeError(
                f"spark_bridge: with {self.peers} workers the coordinator endpoint must be fixed "
                f"(not {coordinator!r}): workers 1..N-1 connect to it to register their data endpoints")
        self.coordinator_endpoint = coordinator
        self.hello = self.ctx.socket(zmq.DEALER)
        self.hello.setsockopt(zmq.LINGER, 1000)
        self.hello.connect(coordinator)
        self.hello.send(P.pack({"op": Request.HELLO.value, "worker": self.index, "endpoint": self.data_endpoint,
                                "generation": self.generation}))

    def _router(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 200)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop a reply or an output batch at a high-water mark
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise (and are ignored) instead of vanishing
        return s

    # -- operators ----------------------------------------------------------------------------
    def op_started(self) -> None:
        """A bridge operator of this worker started; the sockets stay open until every one is done."""
        self.live_ops += 1

    def op_done(self) -> None:
        """A bridge operator finished (the last one closes the sockets)."""
        self.live_ops -= 1
        if self.live_ops <= 0:
            self.close()

    def grace_over(self) -> bool:
        """True once a stopping bridge has answered in-flight writes long enough."""
        return self.stopping and _now() >= self.stop_time + GRACE

    def stopping_message(self, what: str) -> str:
        """Why a request about the stream ``what`` is refused while the bridge stops."""
        return (f"the timely cluster (coordinator {self.coordinator_endpoint}) is shutting down: "
                f"write to '{what}' rejected, nothing of it was applied")

    def _refusal(self, what: str) -> str | None:
        return self.stopping_message(what) if self.stopping else None

    # -- polling ------------------------------------------------------------------------------
    def pump(self, budget: int = 4096) -> bool:
        """Handle every waiting request (up to ``budget`` messages); True when something arrived."""
        if self.closed:
            return False
        n = 0
        for sock, handler in ((self.coord, self._on_coord), (self.data, self._on_data), (self.hello, None)):
            while sock is not None and n < budget:
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                n += 1
                if handler is not None:
                    handler(msg)
        if self.deferred_plans and len(self.endpoints) == self.peers:
            plans, self.deferred_plans = self.deferred_plans, []
            for ident, req in plans:
                self.answer([(ident, self._plan_reply(req))])
        if n:
            self.last_activity = _now()
        return n > 0

    def _send(self, sock: zmq.Socket | None, frames: list) -> None:
        if sock is None:
            return  # worker 1..N-1 has no coordinator socket: nothing asked it
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.ZMQError:
            pass  # the peer went away (ROUTER_MANDATORY): nobody to answer

    def answer(self, replies: Iterable[tuple[bytes, dict]]) -> None:
        """Send coordinator replies: ``(requester identity, reply)`` pairs."""
        for ident, reply in replies:
            self._send(self.coord, [ident, P.pack(reply)])

    def _ack(self, ident: bytes, token: str, reply: dict) -> None:
        self._send(self.data, [ident, Op.ACK, token.encode(), P.pack(reply)])

    # -- coordinator requests -----------------------------------------------------------------
    def _on_coord(self, msg: list) -> None:
        ident = msg[0].bytes
        try:
            req = P.unpack(msg[-1].bytes)
            handler = self._coordinator_ops.get(req.get("op"))
            reply = P.error(f"unknown request {req.get('op')!r}") if handler is None else handler(self, ident, req)
        except Exception as e:  # a malformed request must not take the worker down
            reply = P.error(f"bad request: {e!r}")
        if reply is not None:
            self.answer([(ident, reply)])

    def _hello(self, ident: bytes, req: dict) -> None:
        self.endpoints[int(req["worker"])] = (req["endpoint"], req["generation"])

    def _plan(self, ident: bytes, req: dict) -> dict | None:
        if len(self.endpoints) < self.peers and not self.stopping:
            self.deferred_plans.append((ident, req))
            return None
        return self._plan_reply(req)

    def _plan_reply(self, req: dict) -> dict:
        if self.stopping:
            return P.error(self.stopping_message(str(req.get("stream"))), "stopping")
        reply = self.streams.plan(req, self.coordinator_endpoint)
        if reply["ok"]:
            reply.update(peers=self.peers, endpoints=[list(self.endpoints[i]) for i in range(self.peers)])
        return reply

    def _decide(self, req: dict, request: Callable[[Source], dict | None]) -> dict | None:
        """Pass a request to the source's ledger and wake the control operator to publish."""
        src = self.streams.source(req.get("stream"), self.coordinator_endpoint)
        if isinstance(src, dict):
            return src
        reply = request(src)
        if src.ledger.pending and src.control is not None:
            src.control.activate()
        return reply

    def _commit(self, ident: bytes, req: dict) -> dict | None:
        return self._decide(req, lambda src: src.ledger.request_commit(
            ident, req["query"], int(req["batch"]), req["tokens"], bool(req.get("final")), self._refusal(src.name)))

    def _abort(self, ident: bytes, req: dict) -> dict | None:
        return self._decide(req, lambda src: src.ledger.request_abort(
            req["query"], int(req["batch"]), req.get("tokens") or [], bool(req.get("final"))))

    def _close(self, ident: bytes, req: dict) -> dict | None:
        return self._decide(req, lambda src: src.ledger.request_close())

    def _shutdown(self, ident: bytes, req: dict) -> dict:
        self.stop()
        return P.ok()

    def _status(self, ident: bytes, req: dict) -> dict:
        return P.ok(peers=self.peers, sources=sorted(self.streams.sources), sinks=sorted(self.streams.sinks),
                    registered=len(self.endpoints), stopping=self.stopping,
                    endpoints=[self.endpoints.get(i, (None,))[0] for i in range(self.peers)],
                    stats=self.streams.stats())

    _coordinator_ops: ClassVar[dict[str, Callable[..., dict | None]]] = {
        Request.HELLO: _hello, Request.PLAN: _plan, Request.COMMIT: _commit, Request.ABORT: _abort,
        Request.CLOSE: _close, Request.SHUTDOWN: _shutdown, Request.STATUS: _status,
    }

    def stop(self) -> None:
        """Shut the bridge down on this worker: close sources, refuse data, release sinks."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_time = _now()
        for src in self.streams.sources.values():
            if self.index == 0:
                src.ledger.request_close()
            for writer, token, reply in src.staging.fail_open(self.stopping_message(src.name)):
                self._ack(writer, token, reply)
            for core in (src.control, src.data):
                if core is not None:
                    core.activate()
        for sink in self.streams.sinks.values():
            if sink.activator is not None:
                sink.activator.activate()
        plans, self.deferred_plans = self.deferred_plans, []
        self.answer((ident, P.error(self.stopping_message(str(req.get("stream"))), "stopping")) for ident, req in plans)

    # -- data requests ------------------------------------------------------------------------
    def _on_data(self, msg: list) -> None:
        try:
            handler = self._data_ops[Op(msg[1].bytes)]
            handler(self, msg[0].bytes, msg)
        except Exception as e:  # a malformed message must not take the worker down
            print(f"spark_bridge worker {self.index}: bad data message {msg[1].bytes!r}: {e!r}", file=sys.stderr)

    def _staging_of(self, token: str) -> Staging | None:
        for staging in [*(s.staging for s in self.streams.sources.values()), self.orphans]:
            if token in staging:
                return staging
        return None

    def _begin(self, ident: bytes, msg: list) -> None:
        token, header = msg[2].bytes.decode(), P.unpack(msg[3].bytes)
        src = self.streams.sources.get(header.get("stream"))
        staging = self.orphans if src is None else src.staging
        staged = staging.begin(token, header["query"], header["batch"], msg[4].bytes, ident,
                               self._refusal(staging.name))
        if src is None:
            staged.fail(f"unknown stream '{header.get('stream')}' on worker {self.index}",
                        "stopping" if self.stopping else "error")
        elif header.get("generation") != self.generation and staged.error is None:
            staged.fail(f"the timely worker {self.index} at {self.data_endpoint} restarted since the write was "
                        f"planned; retry the write")
        reply = staged.rejection()
        if reply is not None:
            self._ack(ident, token, reply)

    def _data_frame(self, ident: bytes, msg: list) -> None:
        token = msg[2].bytes.decode()
        staging = self._staging_of(token)
        if staging is None:
            return  # unknown token: reported at the end of the write
        reply = staging.receive(token, P.ROWS.unpack(msg[3].bytes)[0], msg[4], ident)
        if reply is not None:
            self._ack(ident, token, reply)

    def _end(self, ident: bytes, msg: list) -> None:
        token, summary = msg[2].bytes.decode(), P.unpack(msg[3].bytes)
        staging = self._staging_of(token)
        if staging is None:
            reply = P.error(f"worker {self.index} has no staged write {token} (it was discarded or the worker "
                            f"restarted)")
        else:
            reply = staging.end(token, int(summary["rows"]), int(summary["batches"]), self._refusal(staging.name))
        self._ack(ident, token, reply)

    def _sink_request(self, ident: bytes, msg: list, op: Op) -> tuple[Sink | None, dict]:
        req = P.unpack(msg[3].bytes)
        sink = self.streams.sinks.get(req.get("sink"))
        if sink is None:
            self._send(self.data, [ident, op, msg[2], P.pack(P.error(
                f"unknown sink '{req.get('sink')}' on worker {self.index}; {self.streams.known()}", "unknown_stream"))])
        return sink, req

    def _sink_status(self, ident: bytes, msg: list) -> None:
        sink, _ = self._sink_request(ident, msg, Op.STATUS_REPLY)
        if sink is not None:
            self._send(self.data, [ident, Op.STATUS_REPLY, msg[2], P.pack(sink.buffer.status())])

    def _read(self, ident: bytes, msg: list) -> None:
        sink, req = self._sink_request(ident, msg, Op.READ_END)
        if sink is not None:
            sink.buffer.request_read((ident, msg[2].bytes), int(req["start"]), int(req["end"]))
            self.serve_reads(sink)
            if sink.buffer.reads_waiting and sink.activator is not None:
                sink.activator.activate()

    def _release(self, ident: bytes, msg: list) -> None:
        req = P.unpack(msg[3].bytes)
        sink = self.streams.sinks.get(req.get("sink"))
        if sink is not None:
            sink.buffer.release(int(req["upto"]))
            if sink.activator is not None:
                sink.activator.activate()
        self._send(self.data, [ident, Op.RELEASE_REPLY, msg[2], P.pack(P.ok())])

    def _stop_request(self, ident: bytes, msg: list) -> None:
        self.stop()
        self._send(self.data, [ident, Op.STOP_REPLY, msg[2], P.pack(P.ok())])

    _data_ops: ClassVar[dict[Op, Callable[..., None]]] = {
        Op.BEGIN: _begin, Op.DATA: _data_frame, Op.END: _end, Op.STATUS: _sink_status, Op.READ: _read,
        Op.RELEASE: _release, Op.STOP: _stop_request,
    }

    def serve_reads(self, sink: Sink) -> None:
        """Answer the reads of ``sink`` whose epochs are complete (all of them once it is done or stopping)."""
        for (ident, reqid), batches, reply in sink.buffer.answer_reads(self._refusal(sink.buffer.name)):
            for epoch, rows, body in batches:
                self._send(self.data, [ident, Op.READ_BATCH, reqid, P.pack((epoch, rows)), body])
            self._send(self.data, [ident, Op.READ_END, reqid, P.pack(reply)])

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the sockets (when the last bridge operator of this worker finished)."""
        if self.closed:
            return
        self.closed = True
        try:
            # Let final replies (shutdown and commit acks) leave before the sockets go.
            for sock in (self.coord, self.data, self.hello):
                if sock is not None:
                    sock.close(linger=200)
            self.ctx.term()
        finally:
            if _SERVERS.get(self.worker) is self:
                del _SERVERS[self.worker]


def _host_of(endpoint: str) -> str:
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0", ""):
            return "127.0.0.1"
        return host.strip("[]")
    return "127.0.0.1"


def serve(worker: Any, coordinator: str | None = None, host: str | None = None,
          endpoint_file: str | None = None) -> BridgeServer:
    """The bridge server of ``worker``, started on first use.

    ``coordinator`` is the endpoint worker 0 binds for Spark (``tcp://127.0.0.1:7447``, or
    ``tcp://127.0.0.1:0`` for any free port with one worker; ``ipc:///path`` works too); it defaults
    to the environment variable ``TIMELY_SPARK_COORDINATOR``. ``host`` is the interface the data
    endpoints bind (default: the coordinator's host, or 127.0.0.1). ``endpoint_file``: worker 0
    writes the coordinator's actual endpoint there once bound.
    """
    server = server_of(worker)
    if server is not None:
        if coordinator is not None and coordinator not in (server.coordinator_endpoint, server.requested_endpoint):
            raise ValueError(f"spark_bridge: this worker already serves coordinator "
                             f"{server.coordinator_endpoint}, not {coordinator}")
        return server
    coordinator = coordinator or os.environ.get("TIMELY_SPARK_COORDINATOR")
    if not coordinator:
        raise ValueError("spark_bridge needs a coordinator endpoint: pass coordinator='tcp://127.0.0.1:PORT' "
                         "(to source/sink or spark_bridge.serve) or set TIMELY_SPARK_COORDINATOR")
    server = _SERVERS[worker] = BridgeServer(worker, coordinator, host, endpoint_file)
    return server


def server_of(worker: Any) -> BridgeServer | None:
    """The running bridge server of ``worker``, if any."""
    s = _SERVERS.get(worker)
    return s if s is not None and not s.closed else None
