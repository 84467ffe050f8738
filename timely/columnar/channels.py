"""Pacts for streams of record batches: rows routed by key, buffers sent without copies.

A columnar channel splits each ``pyarrow.RecordBatch`` it is given into one part per worker
(a ``take`` of that worker's rows), delivers this worker's part at once, and gathers the
parts for each other worker per time. It sends them as one message of Arrow buffers
(:mod:`timely.columnar.codec`, the comm layer's ``push_buffers``: each buffer one ZeroMQ frame, no
msgpack, no copy) once they reach :data:`GATHER_BYTES`, when parts of another time arrive for that
worker, or when the dataflow flushes the channel with its progress.

Counting (ARCHITECTURE.md section 2.9): a record of these streams is a whole batch. ``push``
returns the number of non-empty parts it made, and the receivers consume exactly those parts:
a message carries its parts as separate batches, never merged (parts without rows are dropped
before they are counted).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..dataflow.channels import Channel, Pact, PipelineChannel, body_limit
from ..errors import raise_with_context
from . import codec, kernels

#: Bytes of parts gathered for one other worker before they are sent (the message size limit
#: permitting): messages of hundreds of kilobytes keep per-message costs negligible per row.
GATHER_BYTES = 1 << 20
#: Bytes a message may take beyond its buffers (its msgpack head: time, schema, buffer shapes).
_SLACK = 64 << 10
#: Bytes a part may add to its rows' bytes in a message, at most: its head, and its buffers'
#: excess over its rows (``codec``: at most 4 KiB before the part goes as IPC instead).
PART_SLACK = 8 << 10

Partitioner = Callable[[Any, list, int], list]


class ColumnExchange(Pact):
    """Rows go to the worker chosen by the 64-bit hash of their key column(s): the same worker the
    row path's ``Exchange`` picks for the same key (``hash64`` of the value, or of the tuple of
    values for several columns)."""

    def __init__(self, columns: str | Sequence[str]) -> None:
        self.columns = [columns] if isinstance(columns, str) else list(columns)
        if not self.columns or not all(isinstance(c, str) for c in self.columns):
            raise TypeError(f"exchange columns must be column names, not {columns!r}")

    def channel(self, df: Any, target: Any) -> Channel:
        # One worker: nothing to route, but the key columns are still checked.
        """The sending end of an edge into ``target``: routed by the key columns, or with one worker a pipeline
        that still checks them."""
        return _CheckedPipeline(target, self.columns) if df.peers == 1 else self.remote(df, target)

    def remote(self, df: Any, target: Any) -> Channel:
        """A channel routing each batch's rows by the hash of the key columns."""
        columns = self.columns
        key = columns[0] if len(columns) == 1 else columns

        def partition(time: Any, batches: list, peers: int) -> list:
            parts: list[list] = [[] for _ in range(peers)]
            for batch in batches:
                n = batch.num_rows
                order, starts = kernels.worker_order(kernels.hash_columns(batch, key), peers)
                sizes = np.diff(starts)
                if n and sizes.max() == n:  # all of it to one worker: no copy
                    parts[int(sizes.argmax())].append(batch)
                    continue
                # One gather for all workers; each worker's part is a slice of it (the codec sends
                # only the slice's bytes).
                grouped = kernels.take_rows(batch, order)  # (view columns too)
                for w in np.flatnonzero(sizes).tolist():
                    parts[w].append(grouped.slice(int(starts[w]), int(sizes[w])))
            return parts

        return ColumnChannel(df, target, partition)

    def __repr__(self) -> str:
        return f"ColumnExchange({self.columns!r})"


class ColumnDistribute(Pact):
    """Batches (or parts of them) go where ``partitioner(time, batches, peers)`` says: it returns,
    per worker, a list of record batches; together they must hold every row once."""

    def __init__(self, partitioner: Partitioner) -> None:
        self.partitioner = partitioner

    def remote(self, df: Any, target: Any) -> Channel:
        """A channel sending the per-worker lists of ``partitioner``."""
        return ColumnChannel(df, target, self.partitioner)

    def __repr__(self) -> str:
        return "ColumnDistribute"


class _CheckedPipeline(PipelineChannel):
    """The one-worker form of :class:`ColumnExchange`: batches stay, their key columns are checked
    as the routed form would (so a job fails the same way on 1 worker as on many)."""

    __slots__ = ("columns",)

    def __init__(self, target: Any, columns: list[str]) -> None:
        super().__init__(target)
        self.columns = columns

    def push(self, time: Any, batch: Sequence) -> int:
        for b in batch:
            try:
                kernels.hash_columns(b.slice(0, 0), self.columns)
            except (KeyError, TypeError) as e:  # a missing or unhashable column
                raise_with_context(e, f"operator '{self.target.op.name}': cannot route a batch at time {time!r}")
        return super().push(time, batch)


class _Decoder:
    """A puller whose messages ``((time, meta), buffers)`` come out as ``(time, batches)``."""

    __slots__ = ("_pull",)

    def __init__(self, puller: Any) -> None:
        self._pull = puller.pull

    def pull(self) -> tuple[Any, list] | None:
        msg = self._pull()
        if msg is None:
            return None
        (time, meta), buffers = msg
        return time, codec.decode(meta, buffers)


class ColumnChannel(Channel):
    """The sending end of a columnar edge that crosses workers (see the module docstring)."""

    def __init__(self, df: Any, target: Any, partitioner: Partitioner) -> None:
        self.target = target
        self.index = df.index
        self.peers = df.peers
        self.op_name = target.op.name
        self.partitioner = partitioner
        self.pushers, _ = df.allocate_channel(target, _Decoder)
        self._limit = self.pushers[(self.index + 1) % self.peers].max_bytes  # (the same for every peer)
        self._max_body = body_limit(self._limit, _SLACK)
        self._gather = min(GATHER_BYTES, self._max_body)
        self._pending: list[Channel] = df.ctx.pending
        self._parts: list[list | None] = [None] * df.peers  # per worker: the parts gathered for it
        self._bytes = [0] * df.peers
        self._times: list[Any] = [None] * df.peers
        self._flagged = False  # listed in ``_pending``

    def push(self, time: Any, batch: Sequence) -> int:
        """Split the record batches in ``batch`` with the partitioner, deliver this worker's parts at once and
        gather the others'; return the number of non-empty parts sent (checked to hold every row once)."""
        batches = batch if type(batch) is list else list(batch)
        try:
            parts = self.partitioner(time, batches, self.peers)
        except (KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise_with_context(e, f"operator '{self.op_name}': cannot route a batch at time {time!r}")
        if len(parts) != self.peers:
            raise ValueError(f"operator '{self.op_name}': partitioner returned {len(parts)} lists for "
                             f"{self.peers} workers")
        rows_in = sum(b.num_rows for b in batches)
        count = rows = 0
        for w, part in enumerate(parts):
            part = [b for b in part if b.num_rows]
            if not part:
                continue
            if w != self.index:
                part = [piece for b in part for piece in self._fit(time, b)]
            count += len(part)
            rows += sum(b.num_rows for b in part)
            if w == self.index:
                self.target.deliver(time, part)  # the local share skips the transport
            else:
                for b in part:
                    self._add(w, time, b)
        if rows != rows_in:
            raise ValueError(f"operator '{self.op_name}': partitioner must place each of {rows_in} rows "
                             f"once, placed {rows}")
        return count

    def _fit(self, time: Any, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        """``batch`` in slices small enough for one message each (counted before they are sent)."""
        # (the buffers' total bounds the rows' bytes, and costs nothing to read; a slice's own
        # bytes cost microseconds: asked only when the bound is not enough)
        if batch.get_total_buffer_size() + PART_SLACK <= self._max_body or batch.nbytes + PART_SLACK <= self._max_body:
            return [batch]
        # Near the limit (a small max_message_bytes): a part's message carries more than its rows'
        # bytes (its head, and a slice's buffers from the byte-aligned start), so measure it.
        size = batch.nbytes
        if size <= self._max_body:  # (so there is a limit: without one every batch fits above)
            size = self._message_size(time, *codec.encode([batch]))
            if size <= self._limit:
                return [batch]
            compact = batch.take(pa.array(range(batch.num_rows)))  # its own buffers, from offset 0
            size = self._message_size(time, *codec.encode([compact]))
            if size <= self._limit:
                return [compact]
        if batch.num_rows == 1:
            raise ValueError(f"operator '{self.op_name}': a row at time {time!r} is {size:,} bytes in a message, "
                             f"more than one message may carry (max_message_bytes)")
        half = batch.num_rows // 2
        return self._fit(time, batch.slice(0, half)) + self._fit(time, batch.slice(half))

    def _message_size(self, time: Any, meta: Any, buffers: list) -> int:
        """Bytes of the message carrying a codec's ``meta`` and ``buffers`` at ``time``."""
        return sum(b.size for b in buffers) + len(self.pushers[(self.index + 1) % self.peers].encode_items([(time, meta)]))

    def _add(self, worker: int, time: Any, batch: pa.RecordBatch) -> None:
        size = batch.nbytes
        parts = self._parts[worker]
        # One message holds parts of one time and one schema: its receiver decodes every part with
        # the first part's schema (a stream that declared none may carry batches of several).
        if parts is not None and (self._times[worker] != time or self._bytes[worker] + size > self._max_body
                                  or not parts[0].schema.equals(batch.schema)):
            self._ship(worker)
            parts = None
        if parts is None:
            parts = self._parts[worker] = []
            self._times[worker] = time
            if not self._flagged:
                self._flagged = True
                self._pending.append(self)
        parts.append(batch)
        self._bytes[worker] += size
        if self._bytes[worker] >= self._gather:
            self._ship(worker)

    def flush(self) -> None:
        """Send every gathered part."""
        self._flagged = False
        for worker, parts in enumerate(self._parts):
            if parts is not None:
                self._ship(worker)

    def _ship(self, worker: int) -> None:
        parts = self._parts[worker]
        assert parts is not None
        gathered = self._bytes[worker]
        self._parts[worker] = None
        self._bytes[worker] = 0
        self._send(worker, self._times[worker], parts, gathered)

    def _send(self, worker: int, time: Any, parts: list, gathered: int) -> None:
        """``parts`` (of ``gathered`` rows' bytes) as one message, or as halves where that message
        would exceed the limit: each part adds a head (its columns' shapes) and its buffers may
        exceed its rows' bytes (up to :data:`PART_SLACK` in all), which the gathering did not
        count; many tiny parts could otherwise add up to more than a message may carry."""
        meta, buffers = codec.encode(parts)
        pusher = self.pushers[worker]
        limit = self._limit
        if limit is not None and len(parts) > 1 and gathered + len(parts) * PART_SLACK > limit:
            if self._message_size(time, meta, buffers) > limit:
                half = len(parts) // 2
                self._send(worker, time, parts[:half], sum(p.nbytes for p in parts[:half]))
                self._send(worker, time, parts[half:], sum(p.nbytes for p in parts[half:]))
                return
        pusher.push_buffers((time, meta), buffers)
