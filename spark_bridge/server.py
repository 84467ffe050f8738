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
and re-activate themselves through a :class:`~spark_bridge.operators.Wakeup` (1 ms while traffic
flows, backing off to 50 ms when idle), so the worker parks on its allocator between polls and an
idle bridge costs nothing measurable.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import zmq

from timely.comm.secret import CURVE_OVERHEAD, JobSecret, resolve

from . import checks
from . import protocol as P
from .errors import BridgeError
from .ledger import Staging, expiry_seconds
from .protocol import Op, Request
from .registry import Registry, job_identity
from .streams import Sink, Source, Streams

_SERVERS: weakref.WeakKeyDictionary[Any, BridgeServer] = weakref.WeakKeyDictionary()

GRACE = 0.5  # seconds a stopping bridge keeps answering, so writes in flight fail with a clear message
EXPIRY_CHECK = 1.0  # seconds between two looks for staged writes that expired (see ledger.EXPIRY_FACTOR)


def _now() -> float:
    return time.monotonic()


class BridgeServer:
    """The sockets of the bridge on one worker, and its streams by name."""

    def __init__(self, worker: Any, coordinator: str, host: str | None = None, endpoint_file: str | None = None,
                 secret: JobSecret | None = None, max_message_bytes: int = checks.DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.worker = worker
        self.index: int = worker.index
        self.peers: int = worker.peers
        self.requested_endpoint = coordinator  # as given; coordinator_endpoint is the one bound
        self.generation = uuid.uuid4().hex
        self.secret = secret
        self.max_message_bytes = int(max_message_bytes)
        self.refused = checks.RefusalLog(self.index)
        self.ctx = zmq.Context()
        # With a secret, the context's ZAP handler admits only CURVE clients that hold it; it must
        # run before the servers bind, and stops in close() after their sockets are closed.
        self.guard = secret.guard(self.ctx) if secret is not None else None
        self.stopping = False
        self.stop_time = 0.0
        self.closed = False
        self.streams = Streams(self.index)
        self.live_ops = 0
        self.last_activity = _now()
        self.deferred_plans: list = []  # plans asked before every worker registered
        self.orphans = Staging("<unknown>", self.index)  # writes naming no known stream
        self.next_expiry_check = _now() + EXPIRY_CHECK
        self.coord: zmq.Socket | None = None
        self.hello: zmq.Socket | None = None
        #: The interface the data endpoint binds (an IPv6 address without brackets).
        self.host = (host or _host_of(coordinator)).strip("[]")
        self.data = self._router(":" in self.host)
        try:
            self.data.bind(f"tcp://{_bracketed(self.host)}:*")
        except zmq.ZMQError as e:
            self.close()
            raise BridgeError(f"spark_bridge: cannot bind a data endpoint on host {self.host!r}: {e}") from e
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        job = job_identity(worker)
        self.registry = Registry(self.peers, job, self.index, (self.data_endpoint, self.generation))
        if self.index == 0:
            self.coord = self._router(P.is_ipv6(coordinator))
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
        if P.is_ipv6(coordinator):
            self.hello.setsockopt(zmq.IPV6, 1)
        if secret is not None:
            secret.connect(self.hello)
        self.hello.connect(coordinator)
        self.hello.send(P.pack({"op": Request.HELLO.value, "worker": self.index, "endpoint": self.data_endpoint,
                                "generation": self.generation, "job": job}))

    def _router(self, ipv6: bool) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        if self.secret is not None:
            self.secret.serve(s)
        # ZeroMQ disconnects a peer sending a larger frame, before buffering it whole; the limit
        # counts a frame as it travels, so under CURVE with its encryption's overhead.
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + (CURVE_OVERHEAD if self.secret is not None else 0))
        s.setsockopt(zmq.LINGER, 200)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop a reply or an output batch at a high-water mark
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise (and are ignored) instead of vanishing
        if ipv6:
            s.setsockopt(zmq.IPV6, 1)  # (see protocol.is_ipv6)
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
        for sock, handler in ((self.coord, self._on_coord), (self.data, self._on_data),
                              (self.hello, self._on_hello_reply)):
            # Ask the socket first: an idle worker pumps often, and a failed receive costs a
            # ZMQError (tens of microseconds) where reading EVENTS costs well under one.
            while sock is not None and n < budget and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                n += 1
                handler(msg)
        if self.deferred_plans and self.registry.complete:
            plans, self.deferred_plans = self.deferred_plans, []
            for ident, req in plans:
                self.answer([(ident, self._plan_reply(req))])
        now = _now()
        if now >= self.next_expiry_check and not self.closed:
            self.next_expiry_check = now + EXPIRY_CHECK
            self.expire_idle(now)
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
            req = checks.coordinator_request(msg)
            reply = self._coordinator_ops[req["op"]](self, ident, req)
        except Exception as e:  # invariant: nothing a client sends takes the worker down
            self.refused(f"the coordinator {self.coordinator_endpoint}", str(e) or repr(e))
            reply = P.error(f"timely coordinator {self.coordinator_endpoint} refused the request: {e}", "refused")
        if reply is not None:
            self.answer([(ident, reply)])

    def _hello(self, ident: bytes, req: dict) -> dict | None:
        """Register a worker's data endpoint: the first registration of each worker 1..N-1 of this
        job wins; another job's (a second launch on the same coordinator endpoint) is refused."""
        problem = self.registry.register(req)
        if problem is None:
            return None
        why = (f"the timely job serving the coordinator endpoint {self.coordinator_endpoint} refused the "
               f"registration of worker {req['worker']} at {req['endpoint']}: {problem}")
        self.refused(f"the coordinator {self.coordinator_endpoint}", why)
        return P.error(why, "refused")

    def _on_hello_reply(self, msg: list) -> None:
        # Only the coordinator this worker registered with can send here; it answers a refusal only.
        try:
            reply = P.unpack(msg[-1].bytes)
        except Exception:
            return
        if isinstance(reply, dict) and reply.get("ok") is False:
            raise BridgeError(f"spark_bridge worker {self.index}: {reply.get('error')}")

    def _plan(self, ident: bytes, req: dict) -> dict | None:
        if not self.registry.complete and not self.stopping:
            self.deferred_plans.append((ident, req))
            return None
        return self._plan_reply(req)

    def _plan_reply(self, req: dict) -> dict:
        if self.stopping:
            return P.error(self.stopping_message(str(req.get("stream"))), "stopping")
        reply = self.streams.plan(req, self.coordinator_endpoint)
        if reply["ok"]:
            reply.update(peers=self.peers, endpoints=self.registry.plan(),
                         max_message_bytes=self.max_message_bytes)
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
        query, batch, tokens = req["query"], req["batch"], req["tokens"]

        def unstaged(src: Source) -> str | None:  # this worker's share of the commit, checked before deciding
            strangers = sorted({w for _, per in tokens for w, _ in per if w >= self.peers})
            if strangers:
                return f"stream '{src.name}': a commit lists rows on workers {strangers} of a {self.peers}-worker job"
            generations = req.get("generations")
            if generations is not None:  # the other workers' shares: staged by the processes running now?
                # A worker not registered (yet) is a new process too: the write was planned when
                # every worker had registered, and a coordinator forgets no registration, so this
                # coordinator restarted since (Spark's commit retry reaching a restarted job).
                now = self.registry.generations()
                gone = sorted({w for _, per in tokens for w, rows in per
                               if rows and (w >= len(generations) or now[w] is None or generations[w] != now[w])})
                if gone:
                    unknown = [w for w in gone if now[w] is None]
                    waiting = f" ({unknown} not registered yet)" if unknown else ""
                    return (f"stream '{src.name}': the timely job restarted since the rows were staged (workers "
                            f"{gone} are new processes{waiting}; what was staged there is gone)")
            return next((why for _, _, why in src.staging.unstaged(query, batch, tokens)), None)

        return self._decide(req, lambda src: src.ledger.request_commit(
            ident, query, batch, tokens, bool(req.get("final")), self._refusal(src.name), lambda: unstaged(src),
            bool(req.get("progress"))))

    def _abort(self, ident: bytes, req: dict) -> dict | None:
        return self._decide(req, lambda src: src.ledger.request_abort(
            req["query"], int(req["batch"]), req.get("tokens") or [], bool(req.get("final"))))

    def _close(self, ident: bytes, req: dict) -> dict | None:
        return self._decide(req, lambda src: src.ledger.request_close())

    def expire_idle(self, now: float) -> None:
        """Propose to discard the staged writes of this worker that expired (no activity on this
        worker for ``EXPIRY_FACTOR`` times their write's timeout: a Spark driver that died before
        its commit or abort). Only worker 0's ledger decides, so that no commit is ever decided
        for rows a worker dropped: the proposal goes to the coordinator (over the registration
        socket from workers 1..N-1), which publishes an expiry record that every worker applies
        when it arrives, and refuses any later commit listing those attempts."""
        for src in self.streams.sources.values():
            for query, batch, tokens in src.staging.expired(now):
                req = {"op": Request.EXPIRE.value, "stream": src.name, "query": query, "batch": batch, "tokens": tokens}
                if self.coord is not None:
                    self._expire(b"", req)
                elif self.hello is not None:
                    with contextlib.suppress(zmq.Again):  # (never blocks; proposed again later)
                        self.hello.send(P.pack(req), zmq.NOBLOCK)
        # A write to no known stream fails at once and is never committed: forget it here.
        for _query, _batch, tokens in self.orphans.expired(now):
            self.orphans.drop(tokens)

    def _expire(self, ident: bytes, req: dict) -> None:
        """A worker's proposal to discard idle staged attempts (never answered: the proposer is a
        worker of this job, whose registration socket takes any reply as a refusal of its hello)."""
        src = self.streams.sources.get(req["stream"])
        if src is not None and src.staging.idle(req["query"], req["batch"], _now()):
            # (Staged here too and written to recently: the write is alive; the proposal comes again.)
            self._decide(req, lambda src: src.ledger.request_expire(req["query"], req["batch"], req["tokens"]))
        return None

    def _shutdown(self, ident: bytes, req: dict) -> dict:
        self.stop()
        return P.ok()

    def _status(self, ident: bytes, req: dict) -> dict:
        return P.ok(peers=self.peers, sources=sorted(self.streams.sources), sinks=sorted(self.streams.sinks),
                    registered=len(self.registry.endpoints), stopping=self.stopping, refused=self.refused.count,
                    endpoints=self.registry.known(),
                    stats=self.streams.stats())

    _coordinator_ops: ClassVar[dict[str, Callable[..., dict | None]]] = {
        Request.HELLO: _hello, Request.PLAN: _plan, Request.COMMIT: _commit, Request.ABORT: _abort,
        Request.CLOSE: _close, Request.SHUTDOWN: _shutdown, Request.STATUS: _status, Request.EXPIRE: _expire,
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
            op, key, body = checks.data_message(msg)
            self._data_ops[op](self, msg[0].bytes, key, body, msg)
        except Exception as e:  # invariant: nothing a client sends takes the worker down
            self.refused(f"the data endpoint {self.data_endpoint}", str(e) or repr(e))

    def _staging_of(self, token: str) -> Staging | None:
        for staging in [*(s.staging for s in self.streams.sources.values()), self.orphans]:
            if token in staging:
                return staging
        return None

    def _begin(self, ident: bytes, key: bytes, header: dict, msg: list) -> None:
        token, schema = key.decode(), msg[4].bytes
        src = self.streams.sources.get(header["stream"])
        staging = self.orphans if src is None else src.staging
        staged = staging.begin(token, header["query"], header["batch"], schema, ident, self._refusal(staging.name),
                               expiry_seconds(header.get("timeout")))
        if src is None:
            staged.fail(f"unknown stream '{header['stream']}' on worker {self.index}",
                        "stopping" if self.stopping else "error")
        elif header.get("generation") != self.generation and staged.error is None:
            staged.fail(f"the timely worker {self.index} at {self.data_endpoint} restarted since the write was "
                        f"planned; retry the write")
        elif staged.error is None:
            bad = checks.arrow_schema(src.name, src.fields, schema)
            if bad is not None:
                staged.fail(bad, "schema")
        reply = staged.rejection()
        if reply is not None:
            self._ack(ident, token, reply)

    def _data_frame(self, ident: bytes, key: bytes, _: None, msg: list) -> None:
        token = key.decode()
        staging = self._staging_of(token)
        if staging is None:
            return  # unknown token: reported at the end of the write
        rows = P.ROWS.unpack(msg[3].bytes)[0]
        staged = staging.tokens[token]
        if staged.error is None and not staged.discard:
            bad = checks.arrow_batch(staged.schema, msg[4], rows)
            if bad is not None:
                staged.fail(f"write {token} to worker {self.index}: {bad}")
        reply = staging.receive(token, rows, msg[4], ident)
        if reply is not None:
            self._ack(ident, token, reply)

    def _end(self, ident: bytes, key: bytes, summary: dict, msg: list) -> None:
        token = key.decode()
        staging = self._staging_of(token)
        if staging is None:
            reply = P.error(f"worker {self.index} has no staged write {token} (it was discarded: aborted, expired "
                            f"without a commit, or the worker restarted)")
        else:
            reply = staging.end(token, summary["rows"], summary["batches"], self._refusal(staging.name))
        self._ack(ident, token, reply)

    def _sink_request(self, ident: bytes, key: bytes, req: dict, op: Op) -> Sink | None:
        sink = self.streams.sinks.get(req["sink"])
        if sink is None:
            self._send(self.data, [ident, op, key, P.pack(P.error(
                f"unknown sink '{req['sink']}' on worker {self.index}; {self.streams.known()}", "unknown_stream"))])
        return sink

    def _sink_status(self, ident: bytes, key: bytes, req: dict, msg: list) -> None:
        sink = self._sink_request(ident, key, req, Op.STATUS_REPLY)
        if sink is not None:
            self._send(self.data, [ident, Op.STATUS_REPLY, key, P.pack(sink.buffer.status())])

    def _read(self, ident: bytes, key: bytes, req: dict, msg: list) -> None:
        sink = self._sink_request(ident, key, req, Op.READ_END)
        if sink is not None:
            sink.buffer.request_read((ident, key), req["start"], req["end"])
            self.serve_reads(sink)
            if sink.buffer.reads_waiting and sink.activator is not None:
                sink.activator.activate()

    def _release(self, ident: bytes, key: bytes, req: dict, msg: list) -> None:
        sink = self.streams.sinks.get(req["sink"])
        if sink is not None:
            sink.buffer.release(req["upto"])
            if sink.activator is not None:
                sink.activator.activate()
        self._send(self.data, [ident, Op.RELEASE_REPLY, key, P.pack(P.ok())])

    def _stop_request(self, ident: bytes, key: bytes, req: dict, msg: list) -> None:
        self.stop()
        self._send(self.data, [ident, Op.STOP_REPLY, key, P.pack(P.ok())])

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
            if self.guard is not None:
                self.guard.stop()  # its own socket lives in self.ctx: stopped before term()
            self.ctx.term()
        finally:
            if _SERVERS.get(self.worker) is self:
                del _SERVERS[self.worker]


def _host_of(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (an IPv6 address without its brackets), else 127.0.0.1."""
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0", ""):
            return "127.0.0.1"
        return host.strip("[]")
    return "127.0.0.1"


def _bracketed(host: str) -> str:
    """``host`` as the host of a ZeroMQ tcp endpoint: an IPv6 address in brackets (``[::1]``)."""
    return f"[{host}]" if ":" in host else host


def serve(worker: Any, coordinator: str | None = None, host: str | None = None,
          endpoint_file: str | None = None, *, secret: str | JobSecret | None = None,
          max_message_bytes: int | None = None) -> BridgeServer:
    """The bridge server of ``worker``, started on first use.

    ``coordinator`` is the endpoint worker 0 binds for Spark (``tcp://127.0.0.1:7447``, or
    ``tcp://127.0.0.1:0`` for any free port with one worker; ``ipc:///path`` works too); it defaults
    to the environment variable ``TIMELY_SPARK_COORDINATOR``. ``host`` is the interface the data
    endpoints bind (default: the coordinator's host, or 127.0.0.1). ``endpoint_file``: worker 0
    writes the coordinator's actual endpoint there once bound. ``secret`` (text or
    :class:`~timely.comm.secret.JobSecret`; default: the worker's ``secret``, else the environment,
    see :func:`timely.comm.secret.resolve`) makes every endpoint a CURVE server that admits only
    clients holding it. ``max_message_bytes`` (default :data:`~spark_bridge.checks.DEFAULT_MAX_MESSAGE_BYTES`)
    bounds one frame a client may send; a larger one disconnects the client.
    """
    server = server_of(worker)
    if server is not None:
        if coordinator is not None and coordinator not in (server.coordinator_endpoint, server.requested_endpoint):
            raise ValueError(f"spark_bridge: this worker already serves coordinator "
                             f"{server.coordinator_endpoint}, not {coordinator}")
        if secret is not None and resolve(secret) != server.secret:
            raise ValueError("spark_bridge: this worker already serves the bridge with another secret")
        # Invariant: an option given is an option applied (a bridge started first, as a barrier
        # task's is before the job's main, binds and limits as it was told).
        if max_message_bytes is not None and int(max_message_bytes) != server.max_message_bytes:
            raise ValueError(f"spark_bridge: this worker already serves the bridge with max_message_bytes="
                             f"{server.max_message_bytes}, not {max_message_bytes} (the first source, sink or "
                             f"serve of a worker sets it; under spark_bridge.run/submit pass max_message_bytes= "
                             f"to submit)")
        if host is not None and host.strip("[]") != server.host:
            raise ValueError(f"spark_bridge: this worker's bridge already binds its data endpoint on host "
                             f"{server.host!r}, not {host!r} (the first source, sink or serve of a worker sets "
                             f"it; under spark_bridge.run/submit each worker binds its own host)")
        return server
    coordinator = coordinator or os.environ.get("TIMELY_SPARK_COORDINATOR")
    if not coordinator:
        raise ValueError("spark_bridge needs a coordinator endpoint: pass coordinator='tcp://127.0.0.1:PORT' "
                         "(to source/sink or spark_bridge.serve) or set TIMELY_SPARK_COORDINATOR")
    keys = resolve(secret) if secret is not None else getattr(worker, "secret", None) or resolve()
    server = _SERVERS[worker] = BridgeServer(worker, coordinator, host, endpoint_file, keys,
                                             max_message_bytes or checks.DEFAULT_MAX_MESSAGE_BYTES)
    return server


def server_of(worker: Any) -> BridgeServer | None:
    """The running bridge server of ``worker``, if any."""
    s = _SERVERS.get(worker)
    return s if s is not None and not s.closed else None
