"""``spark_bridge.source`` and ``spark_bridge.sink``: the bridge's dataflow operators.

A source named N is three operators, built identically on every worker::

    SparkCommits[N]  (a source; only worker 0's holds a capability, at the next epoch)
        -> broadcast
        -> SparkSource[N]  (stages nothing itself; turns commit records into rows)
        -> the user's stream  (+ a probe the coordinator watches)

Worker 0's coordinator turns a Spark commit into a record ``("commit", query, batch, tokens,
final)`` sent at the stream's next epoch ``e``; the control operator then downgrades its capability
to ``e + 1``. The broadcast delivers the record to every worker's ``SparkSource``, which emits the
rows its worker staged for the winning tokens at ``e`` (with the record's input capability, retained
while a large batch is emitted in slices) and drops every other attempt. So a batch enters the
dataflow atomically, timestamped and ordered like any data, and the stream's frontier passes ``e``
exactly when every worker has emitted it; the coordinator answers Spark's commit at that moment.

A sink named N is one operator per worker: it collects the records of each time, and once its input
frontier passes a time it converts them to Arrow IPC batches kept until a reader releases them. It
holds a capability on an unused output so that the worker keeps serving reads after the input is
complete, until a shutdown (or, with ``keep_alive=False``, until every epoch was released).
"""
from __future__ import annotations

from collections import deque
from typing import Any

from . import schema as S
from .server import BridgeServer, serve

_EMIT_ROWS = 1 << 18  # rows emitted per activation before yielding to downstream operators


def _server_for(scope: Any, coordinator: str | None, host: str | None) -> BridgeServer:
    if getattr(scope, "levels", 1) != 1:
        raise ValueError("spark_bridge sources and sinks live in the top-level scope (integer epochs)")
    return serve(scope.worker, coordinator, host)


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
           coordinator: str | None = None, host: str | None = None) -> Any:
    """A stream of the rows Spark writes to the stream ``name`` (``df.write.format("timely")``).

    ``schema`` (a Spark DDL string such as ``"key bigint, value double"``, ``(name, type)`` pairs,
    a ``pyarrow.Schema`` or a ``StructType``) is checked against every DataFrame written; ``None``
    accepts any. Rows are tuples in column order; with ``arrow=True`` the records are
    ``pyarrow.RecordBatch`` objects instead (for columnar operators; keep them on their worker,
    they are not msgpack-serialisable). Each committed Spark write (a batch write, or one
    micro-batch of a streaming write) is one epoch: 0, 1, 2, ... in commit order. The stream's
    frontier passes an epoch once every worker has emitted its rows. The source stays open until
    Spark calls ``spark_bridge.close_stream``/``shutdown`` (or the worker calls
    ``spark_bridge.stop``).
    """
    server = _server_for(scope, coordinator, host)
    fields = None if schema is None else S.parse(schema)
    state = server.add_source(name, fields, arrow)
    worker_index = server.index

    def control(cap, info):
        state.ctl_core = info.activator
        if worker_index != 0:
            cap.drop()
            return lambda out: None
        server.op_started()
        held = [cap]
        wake = [0.0]

        def logic(out) -> None:
            if state.ctl_done:
                return
            server.pump()
            decisions = state.decisions
            while decisions:
                kind, query, batch, tokens, final, rows = decisions.popleft()
                cap = held[0]
                if cap is None:
                    continue
                if kind == "commit":
                    epoch = cap.time
                    out.session(cap).give(("commit", query, batch, tokens, final))
                    out.flush()
                    cap.downgrade(epoch + 1)
                    state.committed[(query, batch)] = epoch
                    if not final:
                        state.cwatermark[query] = max(batch, state.cwatermark.get(query, -1))
                    state.acks.append((epoch, (query, batch), rows))
                    state.epochs += 1
                    state.rows_committed += rows
                elif kind == "abort":
                    out.session(cap).give(("abort", query, batch, tokens, final))
                    out.flush()
                elif kind == "close":
                    if server.stopping and not server.grace_over():
                        decisions.appendleft((kind, query, batch, tokens, final, rows))
                        break  # keep the worker answering in-flight writes for a moment
                    cap.drop()
                    held[0] = None
            if state.acks:
                done = [a for a in state.acks if not state.probe.less_equal(a[0])]
                for a in done:
                    state.acks.remove(a)
                    epoch, key, rows = a
                    for ident in state.waiting.pop(key, []):
                        server._reply_coord(ident, {"ok": True, "epoch": epoch, "rows": rows})
            if held[0] is None and not state.acks and not decisions:
                state.ctl_done = True
                for key, idents in state.waiting.items():
                    for ident in idents:
                        server._reply_coord(ident, {"ok": False, "kind": "stopping",
                                                    "error": f"stream '{name}' closed before the commit"})
                state.waiting.clear()
                server.op_done()
                return
            server.rearm(info.activator, wake)

        return logic

    commits = scope.source(control, name=f"SparkCommits[{name}]").broadcast(name=f"SparkCommitBroadcast[{name}]")

    def data(cap, info):
        cap.drop()
        state.data_core = info.activator
        server.op_started()
        pending: deque = deque()  # [retained capability, iterator of RecordBatches]
        wake = [0.0]
        finished = [False]

        def batches(frames, schema_bytes):
            import pyarrow as pa

            schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
            for _rows, frame in frames:
                yield pa.ipc.read_record_batch(pa.py_buffer(frame.buffer), schema)

        def logic(inp, out) -> None:
            if finished[0]:
                return
            server.pump()
            for icap, recs in inp:
                for rec in recs:
                    kind, query, batch, tokens, final = rec
                    if kind == "commit":
                        frames, schema_bytes = state.take(query, batch, tokens, final)
                        if frames:
                            pending.append([icap.retain(), batches(frames, schema_bytes)])
                    elif kind == "abort":
                        state.abort(query, batch, tokens, final)
            budget = _EMIT_ROWS
            while pending and budget > 0:
                cap, it = pending[0]
                group: list = []
                for rb in it:
                    budget -= rb.num_rows
                    if state.arrow:
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
            if not inp.frontier.frontier:
                finished[0] = True
                state.close_local()
                server.op_done()
                return
            server.rearm(info.activator, wake)

        return logic

    stream = commits.unary_frontier(data, name=f"SparkSource[{name}]")
    state.probe = stream.probe()
    return stream


def sink(stream: Any, name: str, schema: Any, *, arrow: bool = False, keep_alive: bool = True,
         coordinator: str | None = None, host: str | None = None) -> None:
    """Serve the records of ``stream`` to Spark readers (``spark.read.format("timely")``) as the
    output named ``name``, per completed epoch.

    Records are tuples (or lists) in the column order of ``schema`` (a Spark DDL string, pairs, a
    ``pyarrow.Schema`` or a ``StructType``); with ``arrow=True`` they are ``pyarrow.RecordBatch``
    or ``Table`` objects. An epoch is served once the stream's frontier has passed it, and kept
    until a reader commits it (a streaming reader does so when Spark commits its batch). With
    ``keep_alive=True`` (default) the worker keeps serving until ``spark_bridge.shutdown`` (or
    ``spark_bridge.stop`` in the job); with ``False``, until the stream is complete and every epoch
    was released by a reader.
    """
    server = _server_for(stream.scope, coordinator, host)
    fields = S.parse(schema)
    S.arrow_schema(fields)  # fail now if a type has no Arrow equivalent
    state = server.add_sink(name, fields, arrow, keep_alive)

    def ctor(cap, info):
        state.core = info.activator
        server.op_started()
        keep = [cap]
        wake = [0.0]

        def logic(inp, out) -> None:
            if state.done:
                return
            server.pump()
            for icap, batch in inp:
                t = icap.time
                if not isinstance(t, int):
                    raise TypeError(f"spark_bridge.sink '{name}': times must be integer epochs, not {t!r}")
                state.add(t, batch)
                if t > state.max_seen:
                    state.max_seen = t
            state.observe(inp.frontier)
            state.serve_reads()
            input_done = state.frontier is None
            if keep[0] is not None and (server.grace_over() or (
                    not keep_alive and input_done and not state.complete and not state.buffers)):
                keep[0].drop()
                keep[0] = None
            if keep[0] is None and input_done:
                state.done = True
                state.serve_reads(force=True)
                server.op_done()
                return
            server.rearm(info.activator, wake)

        return logic

    stream.unary_frontier(ctor, name=f"SparkSink[{name}]")
