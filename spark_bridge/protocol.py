"""Wire protocol between Spark processes and timely workers (ZeroMQ, msgpack headers, Arrow IPC).

Two kinds of endpoint, both ZeroMQ ROUTER sockets bound by the workers; clients are DEALERs.

**Coordinator** (worker 0 only; the address the user chooses). One frame in, one frame out, each a
msgpack map. Requests carry ``op``:

- ``hello {worker, endpoint}``: a worker registers its data endpoint (workers 1..N-1 at start-up).
- ``plan {stream, kind: "write"|"read", schema, key}``: the data endpoints of every worker, the
  stream's declared schema; checks the stream exists and the schema matches.
- ``commit {stream, query, batch, tokens, generation}``: publish a staged batch as the next epoch.
  Answered once every worker's source has emitted the epoch (its frontier passed it).
- ``abort {stream, query, batch, final}``: discard the staged data of a batch.
- ``close {stream}``: close a source (its frontier becomes empty once pending commits are out).
- ``shutdown {}``: close every source, stop accepting data, release sinks.

Replies are ``{"ok": True, ...}`` or ``{"ok": False, "kind": ..., "error": message}``.

**Data** (every worker). Multipart messages whose first frame is a one-letter kind:

- ``B token header schema``: a write task begins a staged write (header: stream, query, batch,
  partition, attempt, generation; schema: Arrow IPC schema bytes).
- ``D token rows body``: one Arrow record batch (``RecordBatch.serialize()``), ``rows`` as int64.
- ``E token summary``: end of the task's data for this worker; answered ``A token reply`` once staged.
- ``S reqid {sink}``: status of a sink here; answered ``s reqid reply``.
- ``R reqid {sink, start, end}``: the outputs of epochs in [start, end); answered by zero or more
  ``r reqid (epoch, rows) body`` frames and a final ``z reqid reply``.
- ``L reqid {sink, upto}``: a reader committed every epoch before ``upto``; answered ``l reqid reply``.
- ``X reqid {}``: shutdown (sent to every worker by ``spark_bridge.shutdown``); answered ``x reqid reply``.
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack

ROWS = struct.Struct("<q")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    return msgpack.unpackb(bytes(data) if not isinstance(data, bytes) else data, raw=False, strict_map_key=False)


def ok(**fields: Any) -> dict:
    fields["ok"] = True
    return fields


def error(message: str, kind: str = "error", **fields: Any) -> dict:
    fields.update(ok=False, kind=kind, error=message)
    return fields
