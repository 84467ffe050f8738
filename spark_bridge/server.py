"""The timely side of the bridge: one :class:`BridgeServer` per worker process.

Every worker binds a ZeroMQ ROUTER *data endpoint* that Spark tasks push Arrow batches to and
readers fetch outputs from; worker 0 also binds the *coordinator endpoint* the user chose, which
answers planning, commit, abort, close and shutdown requests (see :mod:`spark_bridge.protocol`).
Workers 1..N-1 register their data endpoints with the coordinator (``hello``) so that a plan can
list every worker.

The server owns no thread: the bridge's operators call :meth:`BridgeServer.pump` from their logic
and re-activate themselves with ``activate_after`` (1 ms while traffic flows, backing off to
50 ms when idle), so the worker parks on its allocator between polls and an idle bridge costs
nothing measurable.

Staging and exactly-once (see ``SourceState``): a write task's rows are staged under a random
*token* (one per task attempt and worker). Only a commit decision, which travels through the
dataflow as a timestamped, broadcast record, moves staged rows into the stream; the commit lists
the winning tokens, so failed, retried, zombie and replayed attempts contribute nothing.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
import weakref
from collections import deque
from typing import Any

import zmq

from . import protocol as P
from . import schema as S
from .errors import BridgeError

_SERVERS: weakref.WeakKeyDictionary[Any, BridgeServer] = weakref.WeakKeyDictionary()

_FAST, _MEDIUM, _SLOW = 0.001, 0.01, 0.05
GRACE = 0.5  # seconds a stopping bridge keeps answering, so writes in flight fail with a clear message


def _now() -> float:
    return time.monotonic()


class Staged:
    """The rows one write task attempt sent to this worker for one batch."""

    __slots__ = ("query", "batch", "frames", "rows", "schema", "ended", "discard", "error", "partition", "attempt",
                 "ident", "notified")

    def __init__(self, query: str, batch: int, schema: bytes, partition: int, attempt: int) -> None:
        self.query = query
        self.batch = batch
        self.frames: list = []  # (rows, zmq.Frame with the serialized RecordBatch)
        self.rows = 0
        self.schema = schema
        self.ended = False
        self.discard = False
        self.error: str | None = None
        self.partition = partition
        self.attempt = attempt
        self.ident: bytes | None = None  # the task's socket, to reject the write early
        self.notified = False


class SourceState:
    """One named source on one worker: staged writes, and (worker 0) the commit bookkeeping."""

    def __init__(self, server: BridgeServer, name: str, fields: list | None, arrow: bool) -> None:
        self.server = server
        self.name = name
        self.fields = fields
        self.arrow = arrow
        self.ctl_core: Any = None
        self.data_core: Any = None
        self.probe: Any = None
        self.closed = False  # this worker's source saw its frontier become empty
        # staging (every worker)
        self.tokens: dict[str, Staged] = {}
        self.by_qb: dict[tuple, set] = {}
        self.watermark: dict[str, int] = {}  # query -> highest committed batch (from commit records)
        self.final: set[str] = set()  # batch-write queries that were committed or aborted
        # coordinator (worker 0)
        self.decisions: deque = deque()
        self.committed: dict[tuple, int] = {}
        self.cwatermark: dict[str, int] = {}
        self.waiting: dict[tuple, list] = {}  # (query, batch) -> identities awaiting the commit reply
        self.acks: list = []  # (epoch, (query, batch), rows)
        self.close_requested = False
        self.ctl_done = False
        self.epochs = 0
        self.rows_committed = 0
        self.dropped_rows = 0  # staged rows of losing, failed or aborted attempts (this worker)
        self.duplicate_rows = 0  # rows of replayed, already committed batches (this worker)

    # -- staging ------------------------------------------------------------------------------
    def closed_batch(self, query: str, batch: int) -> bool:
        return query in self.final or batch <= self.watermark.get(query, -1)

    def begin(self, token: str, header: dict, schema: bytes) -> Staged:
        st = Staged(header["query"], header["batch"], schema, header.get("partition", -1), header.get("attempt", -1))
        self.tokens[token] = st
        if self.closed or self.server.stopping:
            st.error = self.server.stopping_message(self.name) if self.server.stopping else (
                f"stream '{self.name}' is closed: the timely job accepts no more writes to it")
        elif self.closed_batch(st.query, st.batch):
            st.discard = True  # a replay of a batch that was already committed: nothing to do
        else:
            self.by_qb.setdefault((st.query, st.batch), set()).add(token)
        return st

    def _drop_tokens(self, tokens) -> None:
        for t in list(tokens):
            st = self.tokens.pop(t, None)
            if st is not None:
                self.dropped_rows += st.rows
                s = self.by_qb.get((st.query, st.batch))
                if s is not None:
                    s.discard(t)
                    if not s:
                        del self.by_qb[(st.query, st.batch)]

    def take(self, query: str, batch: int, tokens: list, final: bool) -> tuple[list, bytes | None]:
        """Apply a commit record: return the winning frames staged here (in token order) and drop
        every other attempt of this batch (and of earlier batches of the query)."""
        me = self.server.index
        frames: list = []
        schema = None
        for token, per_worker in tokens:
            want = dict((int(w), int(r)) for w, r in per_worker).get(me, 0)
            if not want:
                continue
            st = self.tokens.get(token)
            if st is None or not st.ended or st.rows != want:
                have = "nothing" if st is None else f"{st.rows} rows{'' if st.ended else ' (not ended)'}"
                raise BridgeError(
                    f"stream '{self.name}': commit of query {query} batch {batch} lists {want} rows of task "
                    f"attempt {token} on worker {me}, but this worker staged {have}")
            frames.extend(st.frames)
            schema = st.schema
            st.rows = 0  # taken (dropped below with the other attempts, uncounted)
        if final:
            self.final.add(query)
        else:
            self.watermark[query] = max(batch, self.watermark.get(query, -1))
        stale = [t for (q, b), ts in self.by_qb.items() if q == query and (final or b <= batch) for t in ts]
        self._drop_tokens(stale)
        return frames, schema

    def abort(self, query: str, batch: int, tokens: list, final: bool) -> None:
        if final:
            self.final.add(query)
            self._drop_tokens(list(self.by_qb.get((query, batch), ())))
        else:
            self._drop_tokens([t for t, _ in tokens])

    def close_local(self) -> None:
        self.closed = True
        self._drop_tokens(list(self.tokens))

    # -- coordinator --------------------------------------------------------------------------
    def request_commit(self, ident: bytes, req: dict) -> dict | None:
        q, b = req["query"], int(req["batch"])
        key = (q, b)
        if key in self.committed:
            return P.ok(epoch=self.committed[key], duplicate=True, rows=0)
        if not req.get("final") and b <= self.cwatermark.get(q, -1):
            return P.ok(epoch=None, duplicate=True, rows=0)
        if key in self.waiting:
            self.waiting[key].append(ident)
            return None
        if self.close_requested or self.ctl_done:
            return P.error(f"stream '{self.name}' is closed: commit of batch {b} rejected", "stopping")
        self.waiting[key] = [ident]
        rows = sum(int(r) for _, per in req["tokens"] for _, r in per)
        self.decisions.append(("commit", q, b, req["tokens"], bool(req.get("final")), rows))
        if self.ctl_core is not None:
            self.ctl_core.activate()
        return None


class SinkState:
    """One named sink on one worker: completed epochs kept (as Arrow IPC) until a reader releases them."""

    def __init__(self, server: BridgeServer, name: str, fields: list, arrow: bool, keep_alive: bool) -> None:
        self.server = server
        self.name = name
        self.fields = fields
        self.arrow = arrow
        self.keep_alive = keep_alive
        self.core: Any = None
        self.buffers: dict[int, list] = {}
        self.complete: dict[int, list] = {}  # epoch -> [(rows, body bytes)]
        self.frontier: int | None = 0  # minimal time the sink may still see; None: input complete
        self.max_seen = -1
        self.released = 0
        self.reads: list = []  # (ident, reqid, start, end)
        self.done = False
        self._schema = None

    @property
    def schema(self):
        if self._schema is None:
            self._schema = S.arrow_schema(self.fields)
        return self._schema

    def status(self) -> dict:
        return P.ok(empty=self.frontier is None, frontier=self.frontier, max_seen=self.max_seen,
                    released=self.released, retained=sorted(self.complete))

    def complete_before(self) -> int:
        """Every epoch below this is complete here."""
        if self.frontier is None:
            return max(self.max_seen + 1, self._last_frontier)
        return self.frontier

    _last_frontier = 0

    def add(self, epoch: int, records: Any) -> None:
        """Convert one received batch (tuples, or Arrow batches/tables) to Arrow IPC at once, so
        finishing an epoch costs nothing and the worker never holds an epoch as Python objects."""
        import pyarrow as pa

        out = self.buffers.setdefault(epoch, [])
        schema = self.schema
        if self.arrow:
            for rb in records:
                parts = rb.to_batches() if isinstance(rb, pa.Table) else [rb]
                for part in parts:
                    if not isinstance(part, pa.RecordBatch):
                        raise BridgeError(f"sink '{self.name}' (arrow=True): records must be pyarrow RecordBatch "
                                          f"or Table objects, not {type(part).__name__}")
                    part = S.conform(part, schema)
                    if part.num_rows:
                        out.append((part.num_rows, part.serialize()))
            return
        if not records:
            return
        try:
            columns = pa.array(records, type=self._struct).flatten()
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            raise BridgeError(self._explain(epoch, records, e)) from e
        rb = pa.RecordBatch.from_arrays(columns, schema=schema)
        out.append((rb.num_rows, rb.serialize()))

    @property
    def _struct(self):
        import pyarrow as pa

        return pa.struct(list(self.schema))

    def _explain(self, epoch: int, records: Any, error: Exception) -> str:
        import pyarrow as pa

        width = len(self.fields)
        for r in records:
            if not isinstance(r, (tuple, list)) or len(r) != width:
                return (f"sink '{self.name}': record {r!r:.200} at epoch {epoch} does not have the {width} fields "
                        f"of the sink's schema ({S.ddl(self.fields)})")
        for i, ((name, t), field) in enumerate(zip(self.fields, self.schema)):
            try:
                pa.array([r[i] for r in records], type=field.type)
            except Exception as e:
                return f"sink '{self.name}': column '{name}' ({t}) at epoch {epoch}: {e}"
        return f"sink '{self.name}': records at epoch {epoch} do not fit {S.ddl(self.fields)}: {error}"

    def finalize(self, epoch: int) -> None:
        parts = self.buffers.pop(epoch, None)
        if parts:
            self.complete.setdefault(epoch, []).extend(parts)

    def observe(self, frontier) -> None:
        """Record the input frontier (a MutableAntichain) and finalize the epochs it passed."""
        times = list(frontier.frontier)
        if times:
            f = min(times)
            self.frontier = f
            self._last_frontier = f
        else:
            self.frontier = None
        done = [t for t in self.buffers if self.frontier is None or t < self.frontier]
        for t in sorted(done):
            self.finalize(t)

    def release(self, upto: int) -> None:
        if upto > self.released:
            self.released = upto
        for t in [t for t in self.complete if t < self.released]:
            del self.complete[t]

    def serve_reads(self, force: bool = False) -> None:
        if not self.reads:
            return
        limit = self.complete_before()
        keep = []
        for ident, reqid, start, end in self.reads:
            if end > limit and not (self.server.stopping or force):
                keep.append((ident, reqid, start, end))
                continue
            self.server.answer_read(self, ident, reqid, start, end)
        self.reads = keep


class BridgeServer:
    """The sockets and per-stream state of the bridge on one worker."""

    def __init__(self, worker: Any, coordinator: str, host: str | None = None, endpoint_file: str | None = None) -> None:
        self.worker = worker
        self.index = worker.index
        self.peers = worker.peers
        self.generation = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.stopping = False
        self.stop_time = 0.0
        self.closed = False
        self.sources: dict[str, SourceState] = {}
        self.sinks: dict[str, SinkState] = {}
        self.live_ops = 0
        self.last_activity = _now()
        self.deferred_plans: list = []
        self.orphans = SourceState(self, "<unknown>", None, False)  # writes naming no known stream
        host = host or _host_of(coordinator)
        self.data = self._router()
        self.data.bind(f"tcp://{host}:*")
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coord = None
        self.hello = None
        self.endpoints: dict[int, tuple[str, str]] = {self.index: (self.data_endpoint, self.generation)}
        if self.index == 0:
            self.coord = self._router()
            bind = coordinator
            if bind.startswith("tcp://") and bind.endswith(":0"):
                bind = bind[:-2] + ":*"
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
        else:
            if coordinator.startswith("tcp://") and (coordinator.endswith(":0") or coordinator.endswith(":*")):
                self.close()
                raise BridgeError(
                    f"spark_bridge: with {self.peers} workers the coordinator endpoint must be fixed "
                    f"(not {coordinator!r}): workers 1..N-1 connect to it to register their data endpoints")
            self.coordinator_endpoint = coordinator
            self.hello = self.ctx.socket(zmq.DEALER)
            self.hello.setsockopt(zmq.LINGER, 1000)
            self.hello.connect(coordinator)
            self.hello.send(P.pack({"op": "hello", "worker": self.index, "endpoint": self.data_endpoint,
                                    "generation": self.generation}))

    def _router(self):
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 200)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop a reply or an output batch at a high-water mark
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise (and are ignored) instead of vanishing
        return s

    # -- registration -------------------------------------------------------------------------
    def add_source(self, name: str, fields: list | None, arrow: bool) -> SourceState:
        self._check_name(name)
        st = SourceState(self, name, fields, arrow)
        self.sources[name] = st
        return st

    def add_sink(self, name: str, fields: list, arrow: bool, keep_alive: bool) -> SinkState:
        self._check_name(name)
        st = SinkState(self, name, fields, arrow, keep_alive)
        self.sinks[name] = st
        return st

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"spark_bridge: a stream name must be a non-empty string, not {name!r}")
        if name in self.sources or name in self.sinks:
            raise ValueError(f"spark_bridge: a source or sink named '{name}' already exists on this worker")

    def op_started(self) -> None:
        self.live_ops += 1

    def op_done(self) -> None:
        self.live_ops -= 1
        if self.live_ops <= 0:
            self.close()

    # -- scheduling ---------------------------------------------------------------------------
    def interval(self) -> float:
        idle = _now() - self.last_activity
        return _FAST if idle < 0.1 else _MEDIUM if idle < 1.0 else _SLOW

    def rearm(self, core: Any, wake: list) -> None:
        """Schedule ``core`` again after the current poll interval (one pending timer per operator)."""
        now = _now()
        iv = self.interval()
        if wake[0] <= now or wake[0] > now + iv + 0.0005:
            core.activate_after(iv)
            wake[0] = now + iv

    def stopping_message(self, what: str) -> str:
        return (f"the timely cluster (coordinator {self.coordinator_endpoint}) is shutting down: "
                f"write to '{what}' rejected, nothing of it was applied")

    # -- polling ------------------------------------------------------------------------------
    def pump(self, budget: int = 4096) -> bool:
        """Handle every waiting request (up to ``budget`` messages); True when something arrived."""
        if self.closed:
            return False
        n = 0
        for sock, handler in ((self.coord, self._on_coord), (self.data, self._on_data), (self.hello, None)):
            if sock is None:
                continue
            while n < budget:
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
                self._reply_coord(ident, self._plan(req))
        if n:
            self.last_activity = _now()
        return n > 0

    def _send(self, sock, frames: list) -> None:
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.ZMQError:
            pass  # the peer went away (ROUTER_MANDATORY): nobody to answer

    def _reply_coord(self, ident: bytes, reply: dict) -> None:
        self._send(self.coord, [ident, P.pack(reply)])

    # -- coordinator requests -----------------------------------------------------------------
    def _on_coord(self, msg: list) -> None:
        ident = msg[0].bytes
        try:
            req = P.unpack(msg[-1].bytes)
            op = req.get("op")
            if op == "hello":
                self.endpoints[int(req["worker"])] = (req["endpoint"], req["generation"])
                reply = None
            elif op == "plan":
                if len(self.endpoints) < self.peers and not self.stopping:
                    self.deferred_plans.append((ident, req))
                    reply = None
                else:
                    reply = self._plan(req)
            elif op == "commit":
                reply = self._commit(ident, req)
            elif op == "abort":
                reply = self._abort(req)
            elif op == "close":
                st = self._source(req.get("stream"))
                if isinstance(st, dict):
                    reply = st
                else:
                    self._close_source(st)
                    reply = P.ok()
            elif op == "shutdown":
                self.stop()
                reply = P.ok()
            elif op == "status":
                reply = P.ok(peers=self.peers, sources=sorted(self.sources), sinks=sorted(self.sinks),
                             registered=len(self.endpoints), stopping=self.stopping,
                             endpoints=[self.endpoints.get(i, (None,))[0] for i in range(self.peers)],
                             stats={n: {"epochs": s.epochs, "rows": s.rows_committed, "dropped_rows": s.dropped_rows,
                                        "duplicate_rows": s.duplicate_rows, "staged_tokens": len(s.tokens)}
                                    for n, s in self.sources.items()})
            else:
                reply = P.error(f"unknown request {op!r}")
        except Exception as e:  # a malformed request must not take the worker down
            reply = P.error(f"bad request: {e!r}")
        if reply is not None:
            self._reply_coord(ident, reply)

    def _known(self) -> str:
        return (f"sources: {', '.join(sorted(self.sources)) or '(none)'}; "
                f"sinks: {', '.join(sorted(self.sinks)) or '(none)'}")

    def _source(self, name: Any) -> SourceState | dict:
        st = self.sources.get(name)
        if st is None:
            where = " (it is a sink: read it with spark.read)" if name in self.sinks else ""
            return P.error(f"unknown stream '{name}': the timely job at {self.coordinator_endpoint} has no "
                           f"source of that name{where}; {self._known()}", "unknown_stream")
        return st

    def _plan(self, req: dict) -> dict:
        if self.stopping:
            return P.error(self.stopping_message(req.get("stream")), "stopping")
        name, kind = req.get("stream"), req.get("kind")
        endpoints = [list(self.endpoints[i]) for i in range(self.peers)]
        if kind == "write":
            st = self._source(name)
            if isinstance(st, dict):
                return st
            if st.close_requested or st.ctl_done:
                return P.error(f"stream '{name}' is closed: the timely job accepts no more writes to it", "stopping")
            actual = [tuple(f) for f in req.get("schema") or []]
            if st.fields is not None:
                bad = S.mismatch(name, st.fields, actual)
                if bad:
                    return P.error(bad, "schema")
            key = req.get("key")
            if key is not None and key not in [n for n, _ in actual]:
                return P.error(f"stream '{name}': key column '{key}' is not a column of the DataFrame "
                               f"({', '.join(n for n, _ in actual)})", "schema")
            return P.ok(peers=self.peers, endpoints=endpoints, fields=st.fields)
        if kind == "read":
            st = self.sinks.get(name)
            if st is None:
                where = " (it is a source: write it with df.write)" if name in self.sources else ""
                return P.error(f"unknown stream '{name}': the timely job at {self.coordinator_endpoint} has no "
                               f"sink of that name{where}; {self._known()}", "unknown_stream")
            return P.ok(peers=self.peers, endpoints=endpoints, fields=st.fields)
        return P.error(f"unknown plan kind {kind!r}")

    def _commit(self, ident: bytes, req: dict) -> dict | None:
        st = self._source(req.get("stream"))
        if isinstance(st, dict):
            return st
        if self.stopping and (req["query"], int(req["batch"])) not in st.committed:
            return P.error(self.stopping_message(st.name), "stopping")
        return st.request_commit(ident, req)

    def _abort(self, req: dict) -> dict:
        st = self._source(req.get("stream"))
        if isinstance(st, dict):
            return st
        key = (req["query"], int(req["batch"]))
        if key in st.committed or key in st.waiting:
            return P.ok(ignored=True)  # already committed (or being committed): keep it
        if not (st.close_requested or st.ctl_done):
            st.decisions.append(("abort", req["query"], int(req["batch"]), req.get("tokens") or [],
                                 bool(req.get("final")), 0))
            if st.ctl_core is not None:
                st.ctl_core.activate()
        return P.ok()

    def _close_source(self, st: SourceState) -> None:
        if not st.close_requested:
            st.close_requested = True
            st.decisions.append(("close", None, None, None, None, 0))
            if st.ctl_core is not None:
                st.ctl_core.activate()

    def stop(self) -> None:
        """Shut the bridge down on this worker: close sources, refuse data, release sinks."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_time = _now()
        for st in self.sources.values():
            if self.index == 0:
                self._close_source(st)
            for t, staged in list(st.tokens.items()):
                if not staged.ended and not staged.discard:
                    staged.error = self.stopping_message(st.name)
                    self._reject(t, staged)
            if st.data_core is not None:
                st.data_core.activate()
        for sk in self.sinks.values():
            if sk.core is not None:
                sk.core.activate()
        for ident, req in self.deferred_plans:
            self._reply_coord(ident, P.error(self.stopping_message(req.get("stream")), "stopping"))
        self.deferred_plans = []

    # -- data requests ------------------------------------------------------------------------
    def _on_data(self, msg: list) -> None:
        ident = msg[0].bytes
        kind = msg[1].bytes
        if kind == b"D":
            token = msg[2].bytes.decode()
            for st in self._all_sources():
                staged = st.tokens.get(token)
                if staged is not None:
                    rows = P.ROWS.unpack(msg[3].bytes)[0]
                    if staged.discard:
                        st.duplicate_rows += rows
                    elif not staged.error:
                        staged.frames.append((rows, msg[4]))
                        staged.rows += rows
                    elif not staged.notified:
                        staged.ident = ident
                        self._reject(token, staged)
                    return
            return  # unknown token: reported at E
        try:
            if kind == b"B":
                token = msg[2].bytes.decode()
                header = P.unpack(msg[3].bytes)
                st = self.sources.get(header.get("stream"))
                if st is None:
                    st = self.orphans
                    staged = st.begin(token, header, b"")
                    staged.error = f"unknown stream '{header.get('stream')}' on worker {self.index}"
                else:
                    staged = st.begin(token, header, msg[4].bytes)
                if header.get("generation") != self.generation and not staged.error:
                    staged.error = (f"the timely worker {self.index} at {self.data_endpoint} restarted since the "
                                    f"write was planned; retry the write")
                staged.ident = ident
                if staged.error:
                    self._reject(token, staged)
            elif kind == b"E":
                self._on_end(ident, msg[2].bytes.decode(), P.unpack(msg[3].bytes))
            elif kind == b"S":
                sk = self.sinks.get(P.unpack(msg[3].bytes).get("sink"))
                reply = sk.status() if sk is not None else P.error(
                    f"unknown sink on worker {self.index}; {self._known()}", "unknown_stream")
                self._send(self.data, [ident, b"s", msg[2], P.pack(reply)])
            elif kind == b"R":
                req = P.unpack(msg[3].bytes)
                sk = self.sinks.get(req.get("sink"))
                if sk is None:
                    self._send(self.data, [ident, b"z", msg[2], P.pack(P.error(
                        f"unknown sink '{req.get('sink')}' on worker {self.index}", "unknown_stream"))])
                else:
                    sk.reads.append((ident, msg[2].bytes, int(req["start"]), int(req["end"])))
                    sk.serve_reads()
                    if sk.reads and sk.core is not None:
                        sk.core.activate()
            elif kind == b"L":
                req = P.unpack(msg[3].bytes)
                sk = self.sinks.get(req.get("sink"))
                if sk is not None:
                    sk.release(int(req["upto"]))
                    if sk.core is not None:
                        sk.core.activate()
                self._send(self.data, [ident, b"l", msg[2], P.pack(P.ok())])
            elif kind == b"X":
                self.stop()
                self._send(self.data, [ident, b"x", msg[2], P.pack(P.ok())])
        except Exception as e:  # pragma: no cover - malformed message
            print(f"spark_bridge worker {self.index}: bad data message {kind!r}: {e!r}", file=sys.stderr)

    def grace_over(self) -> bool:
        """True once a stopping bridge has answered in-flight writes long enough."""
        return self.stopping and _now() >= self.stop_time + GRACE

    def _reject(self, token: str, staged: Staged) -> None:
        """Tell the task writing ``token`` at once that its write failed (it checks between batches)."""
        if staged.ident is not None and not staged.notified:
            staged.notified = True
            self._send(self.data, [staged.ident, b"A", token.encode(),
                                   P.pack(P.error(staged.error, "stopping" if self.stopping else "error"))])

    def _all_sources(self):
        yield from self.sources.values()
        yield self.orphans

    def _on_end(self, ident: bytes, token: str, summary: dict) -> None:
        staged = None
        for st in self._all_sources():
            staged = st.tokens.get(token)
            if staged is not None:
                break
        if staged is None:
            reply = P.error(f"worker {self.index} has no staged write {token} (it was discarded or the worker "
                            f"restarted)")
        elif self.stopping and not staged.discard:
            reply = P.error(self.stopping_message(st.name), "stopping")
            st._drop_tokens([token])
        elif staged.error:
            reply = P.error(staged.error, "stopping" if self.stopping else "error")
            st._drop_tokens([token])
        elif staged.discard:
            st.tokens.pop(token, None)
            reply = P.ok(rows=int(summary.get("rows", 0)), duplicate=True)
        elif staged.rows != int(summary["rows"]) or len(staged.frames) != int(summary["batches"]):
            reply = P.error(f"worker {self.index} received {staged.rows} rows in {len(staged.frames)} batches "
                            f"of write {token}, the task sent {summary['rows']} in {summary['batches']}")
            st._drop_tokens([token])
        else:
            staged.ended = True
            reply = P.ok(rows=staged.rows)
        self._send(self.data, [ident, b"A", token.encode(), P.pack(reply)])

    def answer_read(self, sink: SinkState, ident: bytes, reqid: bytes, start: int, end: int) -> None:
        if self.stopping and end > sink.complete_before() and not sink.done:
            self._send(self.data, [ident, b"z", reqid, P.pack(P.error(self.stopping_message(sink.name), "stopping"))])
            return
        if start < sink.released:
            self._send(self.data, [ident, b"z", reqid, P.pack(P.error(
                f"sink '{sink.name}': epochs before {sink.released} were already released by a reader commit on "
                f"worker {self.index}; cannot read from epoch {start}"))])
            return
        rows = n = 0
        for epoch in sorted(t for t in sink.complete if start <= t < end):
            for r, body in sink.complete[epoch]:
                self._send(self.data, [ident, b"r", reqid, P.pack((epoch, r)), body])
                rows += r
                n += 1
        self._send(self.data, [ident, b"z", reqid, P.pack(P.ok(rows=rows, batches=n))])

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
    server = _SERVERS.get(worker)
    if server is not None and not server.closed:
        if coordinator is not None and coordinator not in (server.coordinator_endpoint, _requested(server)):
            raise ValueError(f"spark_bridge: this worker already serves coordinator "
                             f"{server.coordinator_endpoint}, not {coordinator}")
        return server
    coordinator = coordinator or os.environ.get("TIMELY_SPARK_COORDINATOR")
    if not coordinator:
        raise ValueError("spark_bridge needs a coordinator endpoint: pass coordinator='tcp://127.0.0.1:PORT' "
                         "(to source/sink or spark_bridge.serve) or set TIMELY_SPARK_COORDINATOR")
    server = BridgeServer(worker, coordinator, host, endpoint_file)
    server._requested = coordinator
    _SERVERS[worker] = server
    return server


def _requested(server: BridgeServer) -> str | None:
    return getattr(server, "_requested", None)


def server_of(worker: Any) -> BridgeServer | None:
    """The running bridge server of ``worker``, if any."""
    s = _SERVERS.get(worker)
    return s if s is not None and not s.closed else None
