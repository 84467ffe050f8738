"""The Spark side: a Python Data Source named ``timely`` (PySpark 4.1+ ``pyspark.sql.datasource``).

Writes use the Arrow writer variants, so rows never become Python objects: each Spark task sends
the serialized Arrow record batches Spark hands it straight to the timely workers (by key hash with
``keyColumn``, round-robin otherwise), where they are staged under a random token of that task
attempt. ``commit`` (on Spark's driver) asks the coordinator to publish the winning tokens as one
epoch; ``abort`` discards them. Reads fetch the Arrow IPC batches each worker keeps for completed
epochs and yield them as ``pyarrow.RecordBatch``.

Where each method runs (see shared/reference/spark.md): ``writer``/``streamWriter``/``schema``/
``partitions`` and the stream reader's offset methods on driver-side Python workers; ``write`` and
``read`` on executors; ``commit``/``abort`` in another driver-side Python process that gets a copy of
the writer (batch) or a fresh writer from ``streamWriter`` (streaming). So everything a commit needs
is derived from the options or carried in the pickled writer, never from process state.
"""
from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from timely.comm.secret import JobSecret

from . import options as O
from . import protocol as P
from . import schema as S
from .checks import DEFAULT_MAX_MESSAGE_BYTES
from .client import ABORT_WAIT, Coordinator, WorkerLink, from_reply, read_epochs, request_worker
from .errors import BridgeError, SchemaMismatch
from .protocol import Op, Request

NAME = "timely"


def _fields_of(schema: Any) -> list:
    return [list(f) for f in S.parse(schema)]


# -- writes --------------------------------------------------------------------------------------------
@dataclass
class TimelyCommitMessage(WriterCommitMessage):
    """What a write task reports: its token and the rows it staged on each worker."""

    token: str
    partition: int
    attempt: int
    rows: list = field(default_factory=list)


@dataclass
class WritePlan:
    """Everything a write needs, planned on the driver from the options and the coordinator's answer;
    pickled with the writer to the executors and to the commit."""

    endpoint: str
    stream: str
    query: str
    batch: int | None  # None: streaming (the batch id comes from the task / commit)
    final: bool  # a batch write: its query id is never reused
    endpoints: list  # [[data endpoint, generation] per worker]
    key_index: int | None
    timeout: float
    secret: JobSecret | None = None  # pickled with the plan to the executors
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # the workers' limit of one frame

    @property
    def coordinator(self) -> Coordinator:
        """A client of the job's coordinator, as the plan's options configured it."""
        return Coordinator(self.endpoint, self.timeout, self.secret)


def _plan_write(options: Any, schema: Any, overwrite: bool, query: str, batch: int | None) -> WritePlan:
    if overwrite:
        raise BridgeError("format('timely') is append-only: a write adds one epoch to a timely stream; "
                          "use mode('append') (or outputMode('append'/'update') for streams)")
    coordinator, stream = O.coordinator(options), O.stream(options)
    fields = _fields_of(schema)
    key = O.opt(options, "keyColumn", "key.column", "timely.keyColumn")
    reply = coordinator.request(Request.PLAN, stream=stream, kind="write", schema=fields, key=key)
    names = [n for n, _ in fields]
    return WritePlan(coordinator.endpoint, stream, query, batch, batch is not None, reply["endpoints"],
                     names.index(key) if key is not None else None, coordinator.timeout, coordinator.secret,
                     int(reply.get("max_message_bytes") or DEFAULT_MAX_MESSAGE_BYTES))


#: Room left in a frame for the Arrow IPC message header around a batch's buffers.
_FRAME_MARGIN = 64 << 10


def _fitting(rb: Any, limit: int) -> Iterator[tuple[Any, Any]]:
    """``(batch, serialized)`` pieces of ``rb`` that each fit the workers' frame ``limit``."""
    body = rb.serialize()
    if body.size <= limit:
        yield rb, body
        return
    if rb.num_rows <= 1:
        raise BridgeError(f"a row of {body.size} bytes exceeds the timely bridge's message limit of {limit} bytes "
                          f"(the job's max_message_bytes)")
    half = rb.num_rows // 2
    yield from _fitting(rb.slice(0, half), limit)
    yield from _fitting(rb.slice(half), limit)


def _write(plan: WritePlan, iterator: Iterator[Any], batch: int) -> TimelyCommitMessage:
    from pyspark import TaskContext

    tc = TaskContext.get()
    partition = tc.partitionId() if tc else 0
    attempt = tc.attemptNumber() if tc else 0
    token = uuid.uuid4().hex
    tok = token.encode()
    peers = len(plan.endpoints)
    rows = [0] * peers
    batches = [0] * peers
    links: dict[int, WorkerLink] = {}
    timeout = plan.timeout
    schema_ipc = None

    def send(w: int, rb: Any) -> None:
        link = links.get(w)
        if link is None:
            link = links[w] = WorkerLink.get(plan.endpoints[w][0], plan.secret)
            # (timeout: the workers expire staged rows no commit or abort decided after a multiple of it)
            header = {"stream": plan.stream, "query": plan.query, "batch": batch, "partition": partition,
                      "attempt": attempt, "generation": plan.endpoints[w][1], "timeout": timeout}
            link.send([Op.BEGIN, tok, P.pack(header), schema_ipc], timeout, w)
        for piece, body in _fitting(rb, max(plan.max_message_bytes - _FRAME_MARGIN, plan.max_message_bytes // 2)):
            link.send([Op.DATA, tok, P.ROWS.pack(piece.num_rows), body], timeout, w)
            rows[w] += piece.num_rows
            batches[w] += 1
        link.check(tok)

    rr = partition % peers
    key = plan.key_index
    for rb in iterator:
        if not rb.num_rows:
            continue
        if schema_ipc is None:
            schema_ipc = rb.schema.serialize()
        if peers == 1:
            send(0, rb)
        elif key is None:
            send(rr, rb)
            rr = (rr + 1) % peers
        else:
            import numpy as np
            import pyarrow as pa

            from .routing import owners

            try:
                own = owners(rb.column(key), peers)
            except TypeError as e:  # planning refuses such key columns; this guards a hand-made plan
                raise SchemaMismatch(f"stream '{plan.stream}': key column '{rb.schema.names[key]}' "
                                     f"({rb.schema.field(key).type}) cannot be hashed to a worker: {e}") from None
            for w in range(peers):
                idx = np.flatnonzero(own == w)
                if len(idx) == len(own):
                    send(w, rb)
                elif len(idx):
                    send(w, rb.take(pa.array(idx)))
    for w, link in links.items():
        link.send([Op.END, tok, P.pack({"rows": rows[w], "batches": batches[w]})], timeout, w)
    for w, link in links.items():
        frames = link.recv_reply((Op.ACK,), tok, timeout, w, f"staging {rows[w]} rows of stream '{plan.stream}'")
        reply = P.unpack(frames[2].bytes)
        if not reply.get("ok"):
            raise from_reply(reply)
    return TimelyCommitMessage(token, partition, attempt, rows)


def _tokens(messages: list) -> list:
    out = []
    for m in messages:
        if isinstance(m, TimelyCommitMessage) and any(m.rows):
            out.append([m.token, [[w, r] for w, r in enumerate(m.rows) if r]])
    return out


def _commit(plan: WritePlan, messages: list, batch: int) -> dict:
    # Sent again while unanswered: a batch is decided once, and a cluster that restarted from a
    # checkpoint answers a batch it logged as a duplicate (see spark_bridge.durable).
    # The workers' generations the rows were staged with: a job restarted since (new workers, the
    # staged rows gone) refuses the commit rather than publish an epoch without them.
    return plan.coordinator.request_until_answered(
        Request.COMMIT, stream=plan.stream, query=plan.query, batch=batch, tokens=_tokens(messages), final=plan.final,
        generations=[str(g) for _, g in plan.endpoints])


def _abort(plan: WritePlan, messages: list, batch: int) -> None:
    try:
        plan.coordinator.request(Request.ABORT, ABORT_WAIT, stream=plan.stream, query=plan.query, batch=batch,
                                 tokens=_tokens(messages), final=plan.final)
    except BridgeError as e:  # Spark is failing the write already; do not hide its error
        print(f"spark_bridge: abort of stream '{plan.stream}' batch {batch} not delivered: {e}", file=sys.stderr)


class TimelyBatchWriter(DataSourceArrowWriter):
    """``df.write.format("timely")``: the whole write is one epoch."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> TimelyCommitMessage:
        """Stage this task's Arrow batches on the workers under a fresh token (on an executor)."""
        return _write(self.plan, iterator, 0)

    def commit(self, messages: list) -> None:
        """Ask the coordinator to publish the tasks' staged rows as one epoch."""
        _commit(self.plan, messages, 0)

    def abort(self, messages: list) -> None:
        """Ask the coordinator to discard the tasks' staged rows (errors are printed, not raised)."""
        _abort(self.plan, messages, 0)


class TimelyStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("timely")``: each micro-batch is one epoch; replays are no-ops."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> TimelyCommitMessage:
        """Stage this task's Arrow batches on the workers under the task's micro-batch id (on an executor)."""
        from pyspark import TaskContext

        tc = TaskContext.get()
        batch = tc.getLocalProperty("streaming.sql.batchId") if tc else None
        if batch is None:
            raise BridgeError("spark_bridge: no streaming.sql.batchId in the task context of a streaming write")
        return _write(self.plan, iterator, int(batch))

    def commit(self, messages: list, batchId: int) -> None:
        """Ask the coordinator to publish micro-batch ``batchId`` as one epoch (a replayed batch is a no-op)."""
        _commit(self.plan, messages, batchId)

    def abort(self, messages: list, batchId: int) -> None:
        """Ask the coordinator to discard micro-batch ``batchId``'s staged rows (errors are printed, not raised)."""
        _abort(self.plan, messages, batchId)


# -- reads ---------------------------------------------------------------------------------------------
@dataclass
class ReadPartition(InputPartition):
    """One worker's part of a read: epochs ``start`` .. ``end - 1`` of sink ``sink`` held by worker ``worker``."""

    worker: int
    endpoint: str
    sink: str
    start: int
    end: int
    fields: list
    epoch_column: str | None
    timeout: float
    secret: JobSecret | None = None

    def __post_init__(self) -> None:
        self.value = self.worker


def _read(p: ReadPartition) -> Iterator[Any]:
    import pyarrow as pa

    if p.end <= p.start:
        return
    schema = S.arrow_schema([tuple(f) for f in p.fields])
    for epoch, frame in read_epochs(p.endpoint, p.worker, p.sink, p.start, p.end, p.timeout, p.secret):
        rb = pa.ipc.read_record_batch(pa.py_buffer(frame.buffer), schema)
        if p.epoch_column:
            rb = rb.append_column(p.epoch_column, pa.array([epoch] * rb.num_rows, pa.int64()))
        yield rb


class _SinkClient:
    """Planning for reads: the sink's workers, its completed epochs, releases."""

    def __init__(self, options: Any) -> None:
        coordinator = O.coordinator(options)
        self.endpoint, self.timeout, self.secret = coordinator.endpoint, coordinator.timeout, coordinator.secret
        self.sink = O.stream(options)
        self.epoch_column = O.opt(options, "epochColumn", "timely.epochColumn")
        plan = coordinator.request(Request.PLAN, stream=self.sink, kind="read")
        self.endpoints = [e[0] for e in plan["endpoints"]]
        self.fields = plan["fields"]

    def statuses(self) -> list[dict]:
        return [request_worker(ep, i, Op.STATUS, {"sink": self.sink}, self.timeout, self.secret)
                for i, ep in enumerate(self.endpoints)]

    def latest(self, statuses: list[dict] | None = None) -> int:
        """Every epoch below the result is complete on every worker."""
        st = statuses or self.statuses()
        open_ = [s["frontier"] for s in st if not s["empty"]]
        if open_:
            return min(open_)
        return max(max(s["max_seen"] + 1, s["frontier"] or 0) for s in st)

    def released(self, statuses: list[dict] | None = None) -> int:
        return max(s["released"] for s in (statuses or self.statuses()))

    def partitions(self, start: int, end: int) -> list[ReadPartition]:
        return [ReadPartition(i, ep, self.sink, start, end, self.fields, self.epoch_column, self.timeout, self.secret)
                for i, ep in enumerate(self.endpoints)]

    def release(self, upto: int) -> None:
        for i, ep in enumerate(self.endpoints):
            request_worker(ep, i, Op.RELEASE, {"sink": self.sink, "upto": upto}, self.timeout, self.secret)


class TimelyBatchReader(DataSourceReader):
    """``spark.read.format("timely")``: every retained completed epoch (or ``startingEpoch`` ..
    ``endingEpoch``; an ``endingEpoch`` not yet complete is waited for, up to ``timeout``)."""

    def __init__(self, options: Any) -> None:
        self.options = dict(options)

    def partitions(self) -> list[ReadPartition]:
        """One partition per worker over the epochs to read (waiting for ``endingEpoch`` to complete)."""
        import time

        c = _SinkClient(self.options)
        st = c.statuses()
        start = O.integer(self.options, "startingEpoch")
        start = c.released(st) if start is None else start
        end = O.integer(self.options, "endingEpoch")
        if end is None:
            end = c.latest(st)
        else:
            deadline = time.monotonic() + c.timeout
            while c.latest(st) < end:
                if all(s["empty"] for s in st):
                    break
                if time.monotonic() > deadline:
                    raise BridgeError(f"sink '{c.sink}': epoch {end - 1} did not complete within {c.timeout:g} s "
                                      f"(complete before {c.latest(st)})")
                time.sleep(0.02)
                st = c.statuses()
        return c.partitions(start, end)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """The partition's worker's batches of its epochs, as ``pyarrow.RecordBatch`` (on an executor)."""
        return _read(cast(ReadPartition, partition))


class TimelyStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("timely")``: offsets are ``{"epoch": E}`` (every epoch below E);
    Spark's commit of a batch releases its epochs on the workers."""

    def __init__(self, options: Any) -> None:
        self.options = dict(options)
        self._client: _SinkClient | None = None
        self._target: int | None = None

    @property
    def client(self) -> _SinkClient:
        """The sink's planning client, made on first use."""
        if self._client is None:
            self._client = _SinkClient(self.options)
        return self._client

    def initialOffset(self) -> dict:
        """``{"epoch": startingEpoch}``, by default the first epoch not yet released on the workers."""
        start = O.integer(self.options, "startingEpoch")
        return {"epoch": self.client.released() if start is None else start}

    def latestOffset(self, start: dict, limit: Any) -> dict:
        """The end of the next micro-batch: the newest complete epoch, at most ``maxEpochsPerTrigger``
        past ``start`` (and not past the Trigger.AvailableNow target); ``limit`` is not used."""
        latest = self.client.latest()
        if self._target is not None:
            latest = min(latest, self._target)
        most = O.integer(self.options, "maxEpochsPerTrigger", 1)
        if most is not None:
            latest = min(latest, int(start["epoch"]) + most)
        return {"epoch": max(int(start["epoch"]), latest)}

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the target of Trigger.AvailableNow: the epochs complete now."""
        self._target = self.client.latest()

    def partitions(self, start: dict, end: dict) -> list[ReadPartition]:
        """One partition per worker over the epochs from ``start`` to ``end`` (exclusive)."""
        return self.client.partitions(int(start["epoch"]), int(end["epoch"]))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """The partition's worker's batches of its epochs, as ``pyarrow.RecordBatch`` (on an executor)."""
        return _read(cast(ReadPartition, partition))

    def commit(self, end: dict) -> None:
        """Release every epoch below ``end`` on the workers (they no longer keep them)."""
        self.client.release(int(end["epoch"]))


# -- the data source -----------------------------------------------------------------------------------
class TimelyDataSource(DataSource):
    """``format("timely")``. Options (case-insensitive):

    ``endpoint`` (required): the coordinator, e.g. ``tcp://127.0.0.1:7447``.
    ``stream`` (required): the source (writes) or sink (reads) name.
    ``keyColumn``: writes route each row to the worker owning ``hash64(row[keyColumn])``.
    ``queryId``: streaming writes: the query's stable identity (default: ``checkpointLocation``,
    else ``queryName``). ``timeout``: seconds to wait for the cluster (a positive number, default
    30; an unanswered commit is sent again for that long, so that it reaches a job restarting from a
    checkpoint; a commit the coordinator reports as decided is waited for up to ``timeout`` more).
    ``startingEpoch`` / ``endingEpoch``: reads. ``epochColumn``: reads add the epoch as a bigint column.
    ``maxEpochsPerTrigger``: streaming reads. ``secret`` (the text) or ``secretFile`` (a file
    holding it): the job's secret, when it has one (default: ``$TIMELY_SECRET`` /
    ``$TIMELY_SECRET_FILE``); Spark redacts options named like ``secret`` in its logs and UI.
    """

    @classmethod
    def name(cls) -> str:
        """The format's name, ``"timely"``."""
        return NAME

    def schema(self) -> str:
        """The sink's schema as DDL, from the coordinator (with the ``epochColumn`` as bigint when set)."""
        plan = O.coordinator(self.options).request(Request.PLAN, stream=O.stream(self.options), kind="read")
        fields = [tuple(f) for f in plan["fields"]]
        col = O.opt(self.options, "epochColumn", "timely.epochColumn")
        if col:
            fields.append((col, "bigint"))
        return S.ddl(fields)

    def writer(self, schema: Any, overwrite: bool) -> TimelyBatchWriter:
        """A batch writer, its write planned now under a fresh query id (append only: ``overwrite`` raises)."""
        return TimelyBatchWriter(_plan_write(self.options, schema, overwrite, "write-" + uuid.uuid4().hex, 0))

    def streamWriter(self, schema: Any, overwrite: bool) -> TimelyStreamWriter:
        """A streaming writer, its query identified by ``queryId`` (or ``checkpointLocation``, ``queryName``)."""
        query = O.opt(self.options, "queryId", "timely.queryId", "checkpointLocation", "queryName")
        if not query:
            raise BridgeError("a streaming write to format('timely') needs a stable query identity for "
                              "exactly-once: set option('checkpointLocation', ...) (or option('queryId', ...))")
        return TimelyStreamWriter(_plan_write(self.options, schema, overwrite, "stream-" + str(query), None))

    def _check_read_schema(self, schema: Any) -> None:
        declared = S.parse(self.schema())
        bad = S.mismatch(O.stream(self.options), declared, S.parse(schema), side="the schema given to the read")
        if bad:
            raise SchemaMismatch(bad)

    def reader(self, schema: Any) -> TimelyBatchReader:
        """A batch reader, once ``schema`` is checked against the sink's."""
        self._check_read_schema(schema)
        return TimelyBatchReader(self.options)

    def streamReader(self, schema: Any) -> TimelyStreamReader:
        """A streaming reader, once ``schema`` is checked against the sink's."""
        self._check_read_schema(schema)
        return TimelyStreamReader(self.options)


def register(spark: Any) -> None:
    """Register ``format("timely")`` with a SparkSession (not needed when ``pyspark_timely`` is on the
    Python path of Spark's Python workers: Spark then registers it by itself)."""
    spark.dataSource.register(TimelyDataSource)
