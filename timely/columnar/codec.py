"""Record batches as a small msgpack head plus their Arrow buffers, for the wire.

:func:`encode` turns a list of ``pyarrow.RecordBatch`` objects of one schema into ``(meta,
buffers)``: ``meta`` is a small msgpack-able tuple (the schema, once, and per batch its length and
per column the shape of its buffers) and ``buffers`` are the columns' own Arrow buffers, which the
transport sends as ZeroMQ frames without copying them. :func:`decode` rebuilds the batches over the
received frames, again without copying (``pyarrow.Array.from_buffers``; only a frame that ZeroMQ
left unaligned, which happens to small ones, is copied).

The zero-copy form covers the flat types (numbers, booleans, temporal types, decimals, utf8 and
binary in their small and large forms) and dictionary arrays of them. A slice (a worker's part of a
batch gathered once for all workers) sends only its rows' bytes: its buffers are cut, and only the
offsets of a string slice that does not start at the parent's first byte are rewritten (a copy of
4 or 8 bytes per row). A batch with any other column (lists, structs, view types, extension types)
goes as one Arrow IPC stream instead: one copy.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.types as pt

#: A batch whose cut buffers still exceed its rows' bytes by more than this goes as IPC.
_SLACK_BYTES = 4096

_FLAT, _DICT = 0, 1  # column forms in the meta
_ZERO_COPY, _IPC = 0, 1  # batch forms in the meta

_recent: list[tuple[pa.Schema, bytes]] = []
_schemas: dict[bytes, pa.Schema] = {}


def _is_flat(t: pa.DataType) -> bool:
    """True for a type whose arrays are a fixed list of buffers and no children."""
    return (t.num_fields == 0 and not isinstance(t, pa.ExtensionType) and not pt.is_dictionary(t)
            and not pt.is_string_view(t) and not pt.is_binary_view(t))


def _zero_copy(t: pa.DataType) -> bool:
    if pt.is_dictionary(t):
        return _is_flat(t.index_type) and _is_flat(t.value_type)
    return _is_flat(t)


def _bit_width(t: pa.DataType) -> int | None:
    """Bits per value of a fixed-width type (``None`` for variable-width and null types)."""
    try:
        return t.bit_width if t.num_buffers == 2 else None
    except ValueError:
        return None


def _bits(buf: pa.Buffer | None, start: int, n: int) -> pa.Buffer | None:
    """The bytes of a bitmap holding bits ``start .. start + n`` (``start`` a multiple of 8)."""
    return None if buf is None else buf.slice(start // 8, (start % 8 + n + 7) // 8)


def _flat_buffers(arr: pa.Array) -> tuple[list, int]:
    """``arr``'s buffers cut to its rows where the type allows (a slice must not send its parent's
    bytes), and the offset that then applies: the first row's offset modulo 8 (bitmaps cannot be
    cut inside a byte)."""
    bufs = arr.buffers()
    offset, n = arr.offset, len(arr)
    if offset == 0 and n == 0:
        return bufs, 0
    r = offset % 8
    start = offset - r
    width = _bit_width(arr.type)
    if width is not None:  # validity, values
        values = _bits(bufs[1], start, r + n) if width == 1 else \
            bufs[1].slice(start * width // 8, (r + n) * width // 8)
        return [_bits(bufs[0], start, r + n), values], r
    if arr.type.num_buffers == 3:  # validity, offsets, data: the data cut to the rows' bytes
        large = pt.is_large_string(arr.type) or pt.is_large_binary(arr.type)
        offsets = np.frombuffer(bufs[1], np.int64 if large else np.int32)[start:offset + n + 1]
        first, last = int(offsets[0]), int(offsets[-1])
        data = None if bufs[2] is None else bufs[2].slice(first, last - first)
        if first:
            offsets = np.subtract(offsets, first, dtype=offsets.dtype)  # a copy of the offsets only
        return [_bits(bufs[0], start, r + n), pa.py_buffer(offsets), data], r
    return bufs, offset


def _flat(arr: pa.Array, buffers: list) -> tuple:
    """Append ``arr``'s buffers; return its meta ``(form, length, null_count, offset, present)``,
    ``present`` a bit mask of the buffers that exist (a validity bitmap may be absent)."""
    bufs, offset = _flat_buffers(arr)
    present = 0
    for i, buf in enumerate(bufs):
        if buf is not None:
            present |= 1 << i
            buffers.append(buf)
    return (_FLAT, len(arr), arr.null_count, offset, present)


def _column(arr: pa.Array, buffers: list) -> tuple:
    if pt.is_dictionary(arr.type):
        return (_DICT, _flat(arr.indices, buffers), _flat(arr.dictionary, buffers))
    return _flat(arr, buffers)


def _schema_to_bytes(schema: pa.Schema) -> bytes:
    # The schemas recently sent, compared with equals() (hashing a schema costs microseconds).
    for known, b in _recent:
        if known.equals(schema, check_metadata=True):
            return b
    b = schema.serialize().to_pybytes()
    _recent.insert(0, (schema, b))
    del _recent[8:]
    return b


def _ipc(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def encode(batches: Sequence[pa.RecordBatch]) -> tuple[tuple, list]:
    """``(meta, buffers)`` for ``batches`` (one schema, at least one batch); see the module doc."""
    schema = batches[0].schema
    buffers: list = []
    metas: list[tuple] = []
    # A batch without columns goes as IPC, which keeps its row count.
    flat = len(schema) > 0 and all(_zero_copy(f.type) for f in schema)
    for batch in batches:
        if flat:
            mine: list = []
            columns = [_column(c, mine) for c in batch.columns]
            if sum(b.size for b in mine) <= batch.nbytes + _SLACK_BYTES:
                buffers.extend(mine)
                metas.append((_ZERO_COPY, batch.num_rows, columns))
                continue
        buffers.append(_ipc(batch))  # (not expected: a safety net should buffers exceed the rows)
        metas.append((_IPC,))
    return (_schema_to_bytes(schema), metas), buffers


def _schema_from_bytes(b: bytes) -> pa.Schema:
    schema = _schemas.get(b)
    if schema is None:
        if len(_schemas) > 256:
            _schemas.clear()
        schema = _schemas[b] = pa.ipc.read_schema(pa.py_buffer(b))
    return schema


def _aligned(frame: Any) -> pa.Buffer:
    """``frame`` as an Arrow buffer, copied only when it is not 8-byte aligned (ZeroMQ places
    small frames anywhere in its receive buffer; Arrow's kernels assume aligned values)."""
    buf = pa.py_buffer(frame)
    return buf if buf.address % 8 == 0 else pa.py_buffer(bytes(frame))


def _rebuild(t: pa.DataType, meta: tuple, frames: Any) -> pa.Array:
    form, length, null_count, offset, present = meta
    bufs = [_aligned(next(frames)) if present >> i & 1 else None for i in range(t.num_buffers)]
    return pa.Array.from_buffers(t, length, bufs, null_count, offset)


def decode(meta: tuple, buffers: Sequence[Any]) -> list[pa.RecordBatch]:
    """The batches :func:`encode` described by ``meta``, over ``buffers`` (no copy)."""
    schema_bytes, metas = meta
    schema = _schema_from_bytes(schema_bytes)
    frames = iter(buffers)
    out = []
    for m in metas:
        if m[0] == _IPC:
            with pa.ipc.open_stream(_aligned(next(frames))) as reader:  # (Acero warns of every unaligned buffer)
                out.append(reader.read_next_batch())
            continue
        columns = []
        for field, col in zip(schema, m[2]):
            t = field.type
            if col[0] == _DICT:
                indices = _rebuild(t.index_type, col[1], frames)
                dictionary = _rebuild(t.value_type, col[2], frames)
                columns.append(pa.DictionaryArray.from_arrays(indices, dictionary, ordered=t.ordered))
            else:
                columns.append(_rebuild(t, col, frames))
        out.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return out


def nbytes(buffers: Sequence[Any]) -> int:
    """The bytes ``buffers`` take on the wire."""
    return sum(b.size if isinstance(b, pa.Buffer) else memoryview(b).nbytes for b in buffers)


def to_ipc(batch: pa.RecordBatch) -> bytes:
    """``batch`` as one Arrow IPC stream (schema, dictionaries, batch): the msgpack extension form."""
    return _ipc(batch).to_pybytes()


def from_ipc(data: bytes) -> pa.RecordBatch:
    """The batch of :func:`to_ipc` (over ``data``, without copying it)."""
    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        return reader.read_next_batch()
