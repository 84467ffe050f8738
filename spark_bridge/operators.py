"""``spark_bridge.source`` and ``spark_bridge.sink``: the bridge's dataflow operators.

A source named N is three operators, built identically on every worker::

    SparkCommits[N]  (a source; only worker 0's holds a capability, at the next epoch)
        -> broadcast
        -> SparkSource[N]  (stages nothing itself; turns commit records into rows)
        -> the user's stream  (+ a probe the coordinator watches)

Worker 0's :class:`~spark_bridge.ledger.CommitLedger` turns a Spark commit into a decision; the
control operator sends its record ``(Request.COMMIT, query, batch, tokens, final)`` at the stream's
next epoch ``e``, downgrades its capability to ``e + 1`` and tells the ledger. The broadcast delivers
the record to every worker's ``SparkSource``, which applies the records of each epoch once the epoch
is complete, epoch by epoch (the order they were published in, whatever order they arrive in): its
:class:`~spark_bridge.ledger.Staging` yields the rows its worker staged for the winning tokens
(emitted at ``e``, with a capability retained while a large batch is emitted in slices) and drops
every other attempt. So a batch enters the dataflow atomically, timestamped and ordered like any
data, and the stream's frontier passes ``e`` exactly when every worker has emitted it; the ledger
releases Spark's commit reply then. An expiry record (attempts no commit or abort decided in time:
see :mod:`spark_bridge.ledger`) takes no epoch and is applied when it arrives. Every batch a source
emits has the wire schema of :mod:`spark_bridge.schema` (Spark's session time zone and large types
conformed).

A sink named N is one operator per worker: it feeds the records of each time to a
:class:`~spark_bridge.sinkbuffer.SinkBuffer`, which converts them to Arrow IPC and serves an epoch
once the input frontier has passed it, until a reader releases it. The operator holds a capability
on an unused output so that the worker keeps serving reads after the input is complete, until a
shutdown (or, with ``keep_alive=False``, until every epoch was released).
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from . import schema as S
from .durable import SinkDurability, SourceDurability
from .ledger import REPLAY
from .protocol import Request
from .server import BridgeServer, serve

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    import pyarrow as pa

    from timely import Capability, OperatorInfo, OperatorInput, OperatorOutput

_EMIT_ROWS = 1 << 18  # rows emitted per activation before yielding to downstream operators
_FAST, _MEDIUM, _SLOW = 0.001, 0.01, 0.05  # poll intervals: traffic within 0.1 s, within 1 s, idle


class Wakeup:
    """Re-activates one operator after the bridge's current poll interval (one pending timer at most)."""

    def __init__(self, server: BridgeServer, activator: Any) -> None:
        self.server = server
        self.activator = activator
        self.at = 0.0

    def rearm(self) -> None:
        """Schedule the operator again; the back-off grows while no message arrives."""
        now = time.monotonic()
        idle = now - self.server.last_activity
        iv = _FAST if idle < 0.1 else _MEDIUM if idle < 1.0 else _SLOW
        if self.at <= now or self.at > now + iv + 0.0005:
            self.activator.activate_after(iv)
            self.at = now + iv


def _server_for(scope: Any, coordinator: str | None, host: str | None, secret: Any,
                max_message_bytes: int | None) -> BridgeServer:
    if getattr(scope, "levels", 1) != 1:
        raise ValueError("spark_bridge sources and sinks live in the top-level scope (integer epochs)")
    return serve(scope.worker, coordinator, host, secret=secret, max_message_bytes=max_message_bytes)


def _pylist(col: Any) -> list:
    import pyarrow.types as pt

    t = col.type
    if col.null_count == 0 and (pt.is_integer(t) or pt.is_floating(t)) and not hasattr(col, "chunks"):
        return col.to_numpy().tolist()  # the same Python ints / floats, a little faster
    return col.to_pylist()


def arrow_to_rows(batch: Any) -> list[tuple]:
    """The rows of an Arrow RecordBatch (or Table) as a list of tuples."""
    cols = [_pylist(c) for c in batch.columns]
    if len(cols) == 1:
        return [(x,) for x in cols[0]]
    return list(zip(*cols))


def source(scope: Any, name: str, schema: Any = None, *, arrow: bool = False,
           coordinator: str | None = None, host: str | None = None, secret: Any = None,
           max_message_bytes: int | None = None) -> Any:
    """A stream of the rows Spark writes to the stream ``name`` (``df.write.format("timely")``).

    ``schema`` (a Spark DDL string such as ``"key bigint, value double"``, ``(name, type)`` pairs,
    a ``pyarrow.Schema`` or a ``StructType``) is checked against every DataFrame written; ``None``
    accepts any. Rows are tuples in column order; with ``arrow=True`` the records are
    ``pyarrow.RecordBatch`` objects instead (for columnar operators; keep them on their worker,
    they are not msgpack-serialisable), with exactly the wire types of :mod:`spark_bridge.schema`
    whatever Spark's session time zone (timestamps are ``timestamp[us, UTC]``, aware datetimes in
    UTC in rows). Each committed Spark write (a batch write, or one
    micro-batch of a streaming write) is one epoch: 0, 1, 2, ... in commit order. The stream's
    frontier passes an epoch once every worker has emitted its rows. The source stays open until
    Spark calls ``spark_bridge.close_stream``/``shutdown`` (or the worker calls
    ``spark_bridge.stop``). In a job with checkpoints (``worker.checkpoint``) every committed epoch
    is logged durably before Spark's commit returns and replayed after a restart, so the write
    stays exactly once across a cluster failure (see :mod:`spark_bridge.durable`).
    ``secret`` and ``max_message_bytes`` configure the worker's bridge
    endpoints (see :func:`spark_bridge.serve`): with a secret (default: the worker's, else
    ``$TIMELY_SECRET``), only Spark clients given the same one can write, read or shut down.
    """
    server = _server_for(scope, coordinator, host, secret, max_message_bytes)
    fields = None if schema is None else S.parse(schema)
    src = server.streams.add_source(name, fields, arrow)
    ledger, staging = src.ledger, src.staging
    ck = getattr(scope.worker, "checkpoint", None)
    durable = None if ck is None else SourceDurability(ck, name, server.index, server.peers, ledger, staging)

    def control(cap: Capability, info: OperatorInfo) -> Callable[[OperatorOutput], None]:
        src.control = info.activator
        if server.index != 0:
            cap.drop()
            return lambda out: None
        server.op_started()
        if ck is not None:
            cap.downgrade(ck.resume_epoch)  # the epochs before it are in the checkpoint
        held: list[Capability | None] = [cap]
        wakeup = Wakeup(server, info.activator)

        def logic(out: OperatorOutput) -> None:
            if ledger.done:
                return
            server.pump()
            # A stopping bridge keeps answering writes in flight for a moment before it closes.
            may_close = not server.stopping or server.grace_over()
            while (decision := ledger.next_decision(may_close)) is not None:
                cap = cast("Capability", held[0])  # (None only after the close)
                if decision.kind == Request.CLOSE:  # invariant: the ledger's last decision
                    cap.drop()
                    held[0] = None
                    continue
                if decision.kind == REPLAY and decision.epoch != cap.time:
                    raise RuntimeError(f"spark_bridge source '{name}': logged epoch {decision.epoch} replayed at "
                                       f"epoch {cap.time}")
                out.session(cap).give(decision.record())
                out.flush()
                if decision.publishes:
                    ledger.committed(decision, cap.time)
                    cap.downgrade(cap.time + 1)
            # ``probe`` is bound below, before the dataflow runs.
            server.answer(ledger.acknowledge(lambda epoch: not probe.less_equal(epoch)))
            if ledger.settled:
                server.answer(ledger.finish())
                server.op_done()
                return
            wakeup.rearm()

        return logic

    commits = scope.source(control, name=f"SparkCommits[{name}]").broadcast(name=f"SparkCommitBroadcast[{name}]")

    def data(cap: Capability, info: OperatorInfo) -> Callable[[OperatorInput, OperatorOutput], None]:
        cap.drop()
        src.data = info.activator
        server.op_started()
        decided: dict[int, tuple[Any, list]] = {}  # epoch -> (its retained capability, decision records)
        pending: deque = deque()  # [retained capability, iterator of RecordBatches]
        wakeup = Wakeup(server, info.activator)
        finished = [False]

        def batches(frames: Iterable[tuple[int, Any]], schema_bytes: bytes | None) -> Iterator[pa.RecordBatch]:
            import pyarrow as pa

            schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
            # Invariant: the stream's batches have exactly the wire schema (schema.py's table:
            # timestamp[us, UTC], utf8, ...), whatever variant the writer sent: Spark stages its
            # session time zone (timestamp[us, tz=Etc/UTC], America/...) and, with
            # useLargeVarTypes, large_utf8. A zone is metadata only: the instants do not change.
            wire = S.arrow_schema(fields if fields is not None else S.parse(schema))
            for _rows, frame in frames:  # ZeroMQ frames, or memory from the commit log
                yield S.conform(pa.ipc.read_record_batch(pa.py_buffer(getattr(frame, "buffer", frame)), schema), wire)

        def logic(inp: OperatorInput, out: OperatorOutput) -> None:
            if finished[0]:
                return
            server.pump()
            for icap, recs in inp:
                # Expiry records are applied on arrival: no commit (which would complete their epoch)
                # need ever come, and the ledger decides none for an attempt that a commit lists,
                # before or after, so their order with the commits does not matter.
                for rec in recs:
                    if rec[0] == Request.EXPIRE:
                        staging.apply(rec)
                recs = [rec for rec in recs if rec[0] != Request.EXPIRE]
                if not recs:
                    continue
                entry = decided.get(icap.time)
                if entry is None:
                    entry = decided[icap.time] = (icap.retain(), [])
                entry[1].extend(recs)
            # Invariant: decisions are applied in the order the control operator published them
            # (a later commit of a query drops the attempts of its earlier batches): epoch by
            # epoch, each once complete, and within an epoch its aborts before the commit that
            # ended it. Timely delivers the records of several epochs, or of one, in any order.
            for epoch in sorted(decided):
                if inp.frontier.less_equal(epoch):
                    break
                cap, recs = decided.pop(epoch)
                for rec in sorted(recs, key=lambda r: r[0] in (Request.COMMIT, REPLAY)):
                    if rec[0] == REPLAY:
                        assert durable is not None, "replays come from the commit log"
                        schema_bytes, frames = durable.replayed(rec[3])
                    else:
                        frames, schema_bytes = staging.apply(rec)
                        if durable is not None and rec[0] == Request.COMMIT:
                            # Invariant: logged (durably) before this worker emits the epoch, so
                            # before Spark's commit reply, which waits for every worker to emit it.
                            durable.log.append(epoch, rec, schema_bytes, frames)
                    if frames:
                        pending.append([cap.delayed(epoch), batches(frames, schema_bytes)])
                cap.drop()
            if durable is not None:
                least = inp.frontier.elements()
                durable.offer_through(least[0] if least else None)
            budget = _EMIT_ROWS
            while pending and budget > 0:
                cap, it = pending[0]
                group: list = []
                for rb in it:
                    budget -= rb.num_rows
                    if arrow:
                        group.append(rb)
                    elif rb.num_rows:
                        out.give_batch(cap, arrow_to_rows(rb))
                    if budget <= 0:
                        break
                else:
                    pending.popleft()
                    if group:
                        out.give_batch(cap, group)
                    out.flush()
                    cap.drop()
                    continue
                if group:
                    out.give_batch(cap, group)
            if pending:
                info.activator.activate()
                return
            if inp.frontier.is_empty():
                finished[0] = True
                staging.close()
                if durable is not None:
                    durable.close()
                server.op_done()
                return
            wakeup.rearm()

        return logic

    stream = commits.unary_frontier(data, name=f"SparkSource[{name}]")
    probe = stream.probe()
    return stream


def sink(stream: Any, name: str, schema: Any, *, arrow: bool = False, keep_alive: bool = True,
         coordinator: str | None = None, host: str | None = None, secret: Any = None,
         max_message_bytes: int | None = None) -> None:
    """Serve the records of ``stream`` to Spark readers (``spark.read.format("timely")``) as the
    output named ``name``, per completed epoch.

    Records are tuples (or lists) in the column order of ``schema`` (a Spark DDL string, pairs, a
    ``pyarrow.Schema`` or a ``StructType``); with ``arrow=True`` they are ``pyarrow.RecordBatch``
    or ``Table`` objects. An epoch is served once the stream's frontier has passed it, and kept
    until a reader commits it (a streaming reader does so when Spark commits its batch); with
    checkpoints, the epochs no reader committed are kept in them, and an epoch a reader committed is
    never served again after a restart (see :mod:`spark_bridge.durable`). With
    ``keep_alive=True`` (default) the worker keeps serving until ``spark_bridge.shutdown`` (or
    ``spark_bridge.stop`` in the job); with ``False``, until the stream is complete and every epoch
    was released by a reader. ``secret`` and ``max_message_bytes``: as for :func:`source`.
    """
    server = _server_for(stream.scope, coordinator, host, secret, max_message_bytes)
    sink_ = server.streams.add_sink(name, S.parse(schema), arrow)  # fails now if a type has no Arrow equivalent
    buffer = sink_.buffer
    ck = getattr(stream.scope.worker, "checkpoint", None)
    durable = None if ck is None else SinkDurability(ck, name, server.index, server.peers, buffer)

    def ctor(cap: Capability, info: OperatorInfo) -> Callable[[OperatorInput, OperatorOutput], None]:
        sink_.activator = info.activator
        server.op_started()
        keep: list[Capability | None] = [cap]
        wakeup = Wakeup(server, info.activator)

        def logic(inp: OperatorInput, out: OperatorOutput) -> None:
            if buffer.done:
                return
            server.pump()
            for icap, batch in inp:
                t = icap.time
                if not isinstance(t, int):
                    raise TypeError(f"spark_bridge.sink '{name}': times must be integer epochs, not {t!r}")
                buffer.add(t, batch)
            least = inp.frontier.elements()  # ascending: integer epochs have one least time
            buffer.advance(least[0] if least else None)
            if durable is not None:
                durable.offer_through(buffer.frontier)
                if buffer.frontier is None:
                    durable.close()
            server.serve_reads(sink_)
            input_done = buffer.frontier is None
            if keep[0] is not None and (server.grace_over() or (not keep_alive and input_done and buffer.drained)):
                keep[0].drop()
                keep[0] = None
            if keep[0] is None and input_done:
                buffer.done = True
                server.serve_reads(sink_)
                server.op_done()
                return
            wakeup.rearm()

        return logic

    stream.unary_frontier(ctor, name=f"SparkSink[{name}]")
