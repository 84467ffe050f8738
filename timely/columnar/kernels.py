"""Vectorised kernels of the columnar operators: key hashing, splitting rows by worker, Megaphone
bins, and partial aggregation. No function here runs Python code per row.

Key hashing agrees with the row path: ``hash_columns(batch, "k")[i] == hash64(batch["k"][i].as_py())``
for every supported type, so a key lands on the same worker (``hash % peers``) and in the same
Megaphone bin (the top k bits) whether it travels in a row or in a RecordBatch.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from timely._native import hashing as _native
from timely.errors import raise_with_context

__all__ = ["Aggregation", "bins_of_hashes", "filter_rows", "hash_array", "hash_columns", "take_rows", "worker_order",
           "worker_parts"]

ArrayLike: TypeAlias = "pa.Array | pa.ChunkedArray"
Columns: TypeAlias = "str | Sequence[str]"

SUPPORTED_TYPES = ("int8..int64, uint8..uint64, bool, float16/32/64, utf8, large_utf8, binary, "
                   "large_binary, string/binary views, null, and dictionaries of these")


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------

def _hashable(t: pa.DataType) -> bool:
    """True when hash_array supports arrays of type ``t``."""
    if pa.types.is_dictionary(t):
        return _hashable(t.value_type)
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_null(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_string_view(t) or pa.types.is_binary_view(t))


def _validity(arr: pa.Array) -> np.ndarray | None:
    """The array's validity bitmap as uint8 (bit ``arr.offset + i`` is row i), or None if no null."""
    if arr.null_count == 0:
        return None
    return np.frombuffer(arr.buffers()[0], np.uint8)


def _hash_chunk(arr: pa.Array) -> np.ndarray:
    """hash64 of every row of one (possibly sliced) Arrow array, as uint64."""
    t, n, off = arr.type, len(arr), arr.offset
    out = np.empty(n, np.uint64)
    if n == 0:
        return out
    if pa.types.is_dictionary(t):
        # Hash each dictionary entry once, then gather by index; a null index is a null row.
        dict_hashes = _hash_chunk(arr.dictionary)
        indices = arr.indices
        if indices.null_count == len(indices) or len(dict_hashes) == 0:
            _native.hash_none_column(out)
            return out
        out[:] = dict_hashes[pc.fill_null(indices, 0).to_numpy()]
        if indices.null_count:
            out[~indices.is_valid().to_numpy(zero_copy_only=False)] = _native.hash64(None)
        return out
    if pa.types.is_null(t) or arr.null_count == n:
        _native.hash_none_column(out)
        return out
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        return _hash_chunk(arr.cast(pa.large_string() if pa.types.is_string_view(t) else pa.large_binary()))
    buffers = arr.buffers()
    if pa.types.is_boolean(t):  # bit-packed values: unpack to 0/1, which hash as False/True do
        values = np.unpackbits(np.frombuffer(buffers[1], np.uint8), bitorder="little")[off:off + n]
        _native.hash_numeric_column(values, _validity(arr), off, out)
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        dtype = np.dtype(t.to_pandas_dtype())
        values = np.frombuffer(buffers[1], dtype, count=off + n)[off:]
        if dtype == np.float16:  # float16 -> float32 is exact
            values = values.astype(np.float32)
        _native.hash_numeric_column(values, _validity(arr), off, out)
    else:  # utf8 / binary, 32- or 64-bit offsets
        wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        offsets = np.frombuffer(buffers[1], np.int64 if wide else np.int32, count=off + n + 1)[off:]
        data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
        is_str = pa.types.is_string(t) or pa.types.is_large_string(t)
        _native.hash_binary_column(offsets, data, _validity(arr), off, is_str, out)
    return out


def hash_array(array: ArrayLike) -> np.ndarray:
    """``[hash64(v) for v in array.to_pylist()]`` as a uint64 numpy array, computed in C.

    Accepts an Array or a ChunkedArray (sliced or not) of the types in ``SUPPORTED_TYPES``;
    nulls hash as ``hash64(None)``. Raises TypeError naming any other type.
    """
    if not _hashable(array.type):
        raise TypeError(f"cannot hash Arrow type {array.type} (supported: {SUPPORTED_TYPES})")
    if isinstance(array, pa.ChunkedArray):
        parts = [_hash_chunk(c) for c in array.chunks]
        return np.concatenate(parts) if parts else np.empty(0, np.uint64)
    return _hash_chunk(array)


def _column(batch: pa.RecordBatch | pa.Table, name: str) -> ArrayLike:
    """The column ``name`` of ``batch``; KeyError naming the batch's columns if it has none."""
    index = batch.schema.get_field_index(name)
    if index < 0:
        raise KeyError(f"column {name!r} not in the batch (columns: {', '.join(batch.schema.names)})")
    return batch.column(index)


def hash_columns(batch: pa.RecordBatch | pa.Table, columns: Columns) -> np.ndarray:
    """Per row of ``batch``, the uint64 ``hash64`` of its key.

    ``columns`` is one column name (or a sequence of exactly one): the key is that column's value,
    as the row path's ``hash64(value)``. Several names: the key is the tuple of their values,
    ``hash64((v1, v2, ...))``. A missing column raises KeyError, an unsupported type TypeError,
    both naming the column.
    """
    names = [columns] if isinstance(columns, str) else list(columns)
    if not names:
        raise ValueError("hash_columns needs at least one column")
    hashes = []
    for name in names:
        col = _column(batch, name)
        if not _hashable(col.type):
            raise TypeError(f"key column {name!r} has type {col.type}, which cannot be hashed "
                            f"(supported: {SUPPORTED_TYPES})")
        hashes.append(hash_array(col))
    if len(names) == 1:
        return hashes[0]
    out = np.empty(batch.num_rows, np.uint64)
    _native.hash_tuple_columns(hashes, out)
    return out


def worker_order(hashes: np.ndarray, peers: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, starts)``: the row numbers sorted by worker (``hashes[i] % peers``), stably, and
    where each worker's rows begin: worker ``w``'s rows are ``order[starts[w]:starts[w + 1]]``
    (a counting sort in C)."""
    h = np.ascontiguousarray(hashes, dtype=np.uint64)
    order = np.empty(len(h), np.int64)
    starts = np.empty(peers + 1, np.int64) if peers >= 1 else np.empty(0, np.int64)
    _native.worker_order(h, peers, order, starts)
    return order, starts


def worker_parts(hashes: np.ndarray, peers: int) -> list[np.ndarray]:
    """Per worker ``w`` in ``range(peers)``, the ascending int64 row numbers ``i`` with
    ``hashes[i] % peers == w`` (views of :func:`worker_order`'s one buffer)."""
    order, starts = worker_order(hashes, peers)
    return [order[starts[w]:starts[w + 1]] for w in range(peers)]


def bins_of_hashes(hashes: np.ndarray, k: int) -> np.ndarray:
    """Megaphone bin of each hash: its top ``k`` bits (``timely.routing.bins_of``), as int64;
    k in 0..MAX_BIN_BITS, and k == 0 puts every row in bin 0."""
    if not isinstance(k, int) or not 0 <= k <= _native.MAX_BIN_BITS:
        raise ValueError(f"k (bin bits) must be an int in 0..{_native.MAX_BIN_BITS}, got {k!r}")
    h = np.asarray(hashes, dtype=np.uint64)
    if k == 0:
        return np.zeros(len(h), np.int64)
    return (h >> np.uint64(64 - k)).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Gathering rows (take / filter), view types included
# ---------------------------------------------------------------------------------------------

@functools.cache
def _without_views(t: pa.DataType) -> pa.DataType:
    """``t`` with every string_view / binary_view in it (at any depth of lists, structs and maps)
    made large_string / large_binary: the types pyarrow can ``take`` and ``filter`` (it has no
    such kernels for the view types; a cast there and back keeps the values)."""
    if pa.types.is_string_view(t):
        return pa.large_string()
    if pa.types.is_binary_view(t):
        return pa.large_binary()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_without_views(f.type)) for f in t.fields])
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_without_views(t.key_type)),
                       t.item_field.with_type(_without_views(t.item_type)), t.keys_sorted)
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_without_views(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_without_views(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_without_views(t.value_type)), t.list_size)
    return t  # (dictionaries take their indices only; list views take without touching values)


def _gather(batch: pa.RecordBatch, how: str, arg: object) -> pa.RecordBatch:
    """``batch.take(arg)`` or ``batch.filter(arg)``, column by column where a column has a view type;
    a pyarrow error names the column it came from."""
    plain = [_without_views(f.type) for f in batch.schema]
    if all(p == f.type for p, f in zip(plain, batch.schema)):
        try:
            return getattr(batch, how)(arg)
        except pa.ArrowException:
            pass  # (again column by column below, to name the column)
    columns = []
    for field, col, p in zip(batch.schema, batch.columns, plain):
        try:
            columns.append(getattr(col, how)(arg) if p == col.type else getattr(col.cast(p), how)(arg).cast(col.type))
        except pa.ArrowException as e:
            raise_with_context(e, f"{how} of column {field.name!r} ({field.type})")
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def take_rows(batch: pa.RecordBatch, indices: object) -> pa.RecordBatch:
    """``batch.take(indices)``, also for string_view / binary_view columns (taken as their large
    forms and cast back: the schema is kept)."""
    return _gather(batch, "take", indices)


def filter_rows(batch: pa.RecordBatch, mask: object) -> pa.RecordBatch:
    """``batch.filter(mask)``, also for string_view / binary_view columns (as :func:`take_rows`)."""
    return _gather(batch, "filter", mask)


# ---------------------------------------------------------------------------------------------
# Partial aggregation
# ---------------------------------------------------------------------------------------------

FUNCTIONS = ("count", "sum", "min", "max", "mean")
# The partial state each function needs, and how two partial states of that kind merge.
_STATES = {"count": ("count",), "sum": ("sum",), "min": ("min",), "max": ("max",),
           "mean": ("sum", "count")}
_MERGE = {"count": "sum", "sum": "sum", "min": "min", "max": "max"}
BUFFER_ROWS = 1 << 18   # raw rows buffered before they are aggregated together (measured: 64k rows
                        # gave half the rate of 256k with 10k keys; each group_by call costs per key)
MAX_PARTIALS = 8        # partial tables kept before they are merged into one


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


@functools.cache
def _orderable(t: pa.DataType) -> bool:
    """True when pyarrow has a grouped min/max for type ``t`` (asked of pyarrow itself, on an empty
    table: it has none for float16, durations and intervals, for one)."""
    probe = pa.table({"k": pa.array([], pa.int8()), "v": pa.array([], t)})
    try:
        probe.group_by("k", use_threads=False).aggregate([("v", "min")])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        return False
    return True


def _sum_type(t: pa.DataType) -> pa.DataType:
    """The type of a sum of a column of type ``t``: uint64 for uint64, int64 for other integers,
    float64 for floating point."""
    if pa.types.is_uint64(t):
        return pa.uint64()
    return pa.int64() if pa.types.is_integer(t) else pa.float64()


def _without_negative_zero(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A floating key column with -0.0 made 0.0 (``x + 0.0``; NaN stays NaN): ``hash64`` and the
    row operators take them as one key, and so must a group-by."""
    if pa.types.is_float16(col.type):  # (no add kernel for halffloat: float32 holds it exactly)
        return pc.add(col.cast(pa.float32()), pa.scalar(0.0, pa.float32())).cast(pa.float16())
    if pa.types.is_floating(col.type):
        return pc.add(col, pa.scalar(0.0, col.type))
    return col


def _grouped_wraps(table: pa.Table, keys: list[str], aggs: list[tuple[str, str]],
                   checked: Mapping[str, ArrayLike]) -> tuple[pa.Table, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``table.group_by(keys).aggregate(aggs)`` (columns ``keys`` then ``f"{column}_{function}"``) and,
    per integer column of ``checked`` (summed in ``aggs``; mapped to the float64 approximation of
    each row's true value), per group ``(wraps, approx)``: how many times 2**64 the true sum
    exceeds Arrow's wrapped one, and the true sum in float64. The wrapped sum differs from the
    float64 one by a multiple of 2**64 exactly when it wrapped, as the float64 sum is far closer
    than 2**63 to the true one."""
    shadows = []
    for column, approx in checked.items():
        shadow = f"{column}__float"
        table = table.append_column(shadow, approx)
        shadows.append((column, shadow))
    result = table.group_by(keys, use_threads=False).aggregate(aggs + [(s, "sum") for _, s in shadows])
    out = {}
    for column, shadow in shadows:
        wrapped = result.column(f"{column}_sum").to_numpy(zero_copy_only=False)
        approx = result.column(f"{shadow}_sum").to_numpy(zero_copy_only=False)
        valid = ~np.isnan(approx)  # (a group of nulls only sums to null)
        wraps = np.zeros(len(approx), np.int64)
        wraps[valid] = np.rint((approx[valid] - wrapped[valid].astype(np.float64)) / 2.0 ** 64)
        out[column] = (wraps, approx)
    return result.select(keys + [f"{c}_{fn}" for c, fn in aggs]), out


def _overflow(result: pa.Table, keys: list[str], column: str, sum_type: pa.DataType, wraps: np.ndarray,
              approx: np.ndarray, name: Mapping[str, str]) -> None:
    """Raise OverflowError naming ``column`` and the first key of ``result`` whose sum wrapped."""
    if wraps.any():
        i = int(np.flatnonzero(wraps)[0])
        key = {name.get(k, k): result.column(k)[i].as_py() for k in keys}
        raise OverflowError(
            f"the sum of column {name.get(column, column)!r} leaves {sum_type} (key {key}: about "
            f"{approx[i]:.6g}); cast the column to float64 before aggregating")


def grouped(table: pa.Table, keys: list[str], aggs: list[tuple[str, str]],
            unchecked: Sequence[str] = (), names: Mapping[str, str] | None = None) -> pa.Table:
    """``table.group_by(keys).aggregate(aggs)`` (columns ``keys`` then ``f"{column}_{function}"``),
    except that an integer ``sum`` which leaves its type raises ``OverflowError`` naming the column
    and the key instead of wrapping around, as Arrow's grouped sum does (but for the ``unchecked``
    columns: sums of counts, say). Each checked sum is also taken in float64: the wrapped sum
    differs from the float64 one by a multiple of 2**64 exactly when it wrapped, as the float64 sum
    is far closer than 2**63 to the true one. ``names`` gives the user's names of internal columns
    for the message."""
    checked = {column: pc.cast(table.column(column), pa.float64(), safe=False) for column, fn in aggs
               if fn == "sum" and column not in unchecked and pa.types.is_integer(table.schema.field(column).type)}
    result, wraps = _grouped_wraps(table, keys, aggs, checked)
    for column, (w, approx) in wraps.items():
        _overflow(result, keys, column, table.schema.field(column).type, w, approx, names or {})
    return result


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


class Aggregation:
    """Grouped count/sum/min/max/mean over a stream of RecordBatches, folded in partially.

    ``Aggregation(keys, {column: function or [functions]}, schema)`` validates against the input
    ``schema`` at construction (ValueError naming the column and function). Output (``.schema``):
    the key columns (dictionary keys decoded), then per (column, function), in the order given, a
    column ``f"{column}_{function}"``: count int64 (non-null values), sum int64 for integer (uint64
    for uint64) and float64 for floating columns (an integer sum that leaves its type raises
    ``OverflowError`` naming the column and the key, never wraps around), mean float64 (the merged
    integer sum, exact until then, over the merged count), min/max of the column's type. Null keys
    form their own group; a floating key's -0.0 and 0.0 are one key (0.0), as in ``hash64`` and the
    row operators; sum/min/max/mean of only nulls is null.

    Memory is bounded by the distinct keys: raw rows are buffered up to ``BUFFER_ROWS`` and then
    reduced to one partial row per key; at most ``MAX_PARTIALS`` partial tables are kept.
    """

    def __init__(self, keys: Columns, aggregations: Mapping[str, str | Sequence[str]],
                 schema: pa.Schema) -> None:
        self._keys = [keys] if isinstance(keys, str) else list(keys)
        if not self._keys:
            raise ValueError("Aggregation needs at least one key column")
        self._input = schema
        for k in self._keys:
            if schema.get_field_index(k) < 0:
                raise ValueError(f"key column {k!r} is not in the schema (columns: {', '.join(schema.names)})")
        self._outputs: list[tuple[str, str]] = []   # (column, function), in output order
        for column, fns in aggregations.items():
            for fn in [fns] if isinstance(fns, str) else list(fns):
                self._outputs.append((column, self._check(column, fn)))
        self._values = list(dict.fromkeys(c for c, _ in self._outputs))  # aggregated columns
        # Partial tables: columns k0.. (the keys), then f"v{j}_{state}" per value column j.
        self._states = list(dict.fromkeys((self._values.index(c), s)
                                          for c, fn in self._outputs for s in _STATES[fn]))
        # The integer sums: a partial table also counts, in column f"v{j}_wraps", how many times
        # 2**64 each wrapped sum is short of the true one; only the final sum must fit its type (so
        # the order of the batches never matters).
        self._checked = [j for j, state in self._states
                         if state == "sum" and pa.types.is_integer(_value_type(schema.field(self._values[j]).type))]
        fields = [pa.field(k, _value_type(schema.field(k).type)) for k in self._keys]
        fields += [pa.field(f"{c}_{fn}", self._output_type(c, fn)) for c, fn in self._outputs]
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"Aggregation output columns collide: {names}")
        self.schema: pa.Schema = pa.schema(fields)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._partials: list[pa.Table] = []

    def _check(self, column: str, fn: object) -> str:
        if fn not in FUNCTIONS:
            raise ValueError(f"aggregation of column {column!r}: unsupported function {fn!r} "
                             f"(supported: {', '.join(FUNCTIONS)})")
        index = self._input.get_field_index(column)
        if index < 0:
            raise ValueError(f"aggregation {fn!r} of column {column!r}: no such column "
                             f"(columns: {', '.join(self._input.names)})")
        t = _value_type(self._input.field(index).type)
        numeric = pa.types.is_integer(t) or pa.types.is_floating(t)
        if fn in ("sum", "mean") and not numeric:
            raise ValueError(f"aggregation {fn!r} of column {column!r}: needs a numeric column, not {t}")
        if fn in ("min", "max") and not _orderable(t):
            raise ValueError(f"aggregation {fn!r} of column {column!r}: pyarrow has no grouped min/max for type {t}")
        return str(fn)

    def _output_type(self, column: str, fn: str) -> pa.DataType:
        t = _value_type(self._input.field(column).type)
        if fn == "count":
            return pa.int64()
        if fn == "mean":
            return pa.float64()
        if fn == "sum":
            return _sum_type(t)
        return t

    def update(self, batch: pa.RecordBatch) -> None:
        """Fold ``batch`` (a RecordBatch or Table of the input schema) into the aggregate."""
        for name in self._keys + self._values:
            got = _column(batch, name).type
            if got != self._input.field(name).type:
                raise ValueError(f"Aggregation: column {name!r} has type {got}, "
                                 f"expected {self._input.field(name).type}")
        if batch.num_rows == 0:
            return
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        self._pending.extend(batches)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= BUFFER_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Reduce the buffered rows to one partial table; merge partials past MAX_PARTIALS."""
        if self._pending:
            raw = pa.Table.from_batches(self._pending)
            self._pending, self._pending_rows = [], 0
            cols, names = [], []
            for i, k in enumerate(self._keys):
                cols.append(_without_negative_zero(self._decoded(raw.column(k))))
                names.append(f"k{i}")
            for j, c in enumerate(self._values):
                cols.append(self._decoded(raw.column(c)))
                names.append(f"v{j}")
            table = pa.table(cols, names=names)
            aggs = []
            for j, state in self._states:
                t = table.schema.field(f"v{j}").type
                if state == "sum":  # sum in the output's type: int64 or uint64 (exact) or float64
                    table = table.append_column(f"v{j}_wide", table.column(f"v{j}").cast(_sum_type(t)))
                    aggs.append((f"v{j}_wide", "sum"))
                else:
                    aggs.append((f"v{j}", state))
            checked = {j: (f"v{j}_wide", pc.cast(table.column(f"v{j}"), pa.float64(), safe=False))
                       for j in self._checked}
            self._partials.append(self._grouped(table, aggs, checked))
        if len(self._partials) > MAX_PARTIALS:
            self._merge()

    def _merge(self) -> None:
        """Merge all partial tables into one (partial states of equal keys combine)."""
        if len(self._partials) > 1:
            table = pa.concat_tables(self._partials)
            aggs = [(name, _MERGE[state]) for (_, state), name in zip(self._states, self._state_names())]
            checked = {j: (f"v{j}_sum", self._true_sums(table, j)) for j in self._checked}
            self._partials = [self._grouped(table, aggs, checked)]

    @staticmethod
    def _true_sums(partial: pa.Table, j: int) -> pa.ChunkedArray:
        """The true sums of value column ``j`` in a partial table, in float64 (wrapped + wraps * 2**64)."""
        wrapped = pc.cast(partial.column(f"v{j}_sum"), pa.float64(), safe=False)
        return pc.add(wrapped, pc.multiply(pc.cast(partial.column(f"v{j}_wraps"), pa.float64()), 2.0 ** 64))

    def _grouped(self, table: pa.Table, aggs: list[tuple[str, str]],
                 checked: Mapping[int, tuple[str, ArrayLike]]) -> pa.Table:
        """``table`` grouped by k0.. with ``aggs`` (one per partial state, in order), as a partial
        table: columns k0.., then the state columns, then ``v{j}_wraps`` per integer sum ``j``
        (``checked[j]``: the column summed, and the float64 approximation of its true values)."""
        keys = self._key_names()
        result, wraps = _grouped_wraps(table, keys, aggs, dict(checked.values()))
        result = result.rename_columns(keys + self._state_names())
        for j in self._checked:
            result = result.append_column(f"v{j}_wraps", pa.array(wraps[checked[j][0]][0]))
        return result

    @staticmethod
    def _decoded(col: pa.ChunkedArray) -> pa.ChunkedArray:
        return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col

    def _key_names(self) -> list[str]:
        return [f"k{i}" for i in range(len(self._keys))]

    def _state_names(self) -> list[str]:
        return [f"v{j}_{state}" for j, state in self._states]

    def finish(self) -> pa.RecordBatch:
        """The aggregate of every batch folded in so far: one row per distinct key tuple, in no
        particular order, of ``.schema`` (an empty batch when nothing was folded in). The state is
        kept: more batches may be folded in and ``finish`` called again."""
        self._flush()
        self._merge()
        if not self._partials:
            return _empty(self.schema)
        part = self._partials[0].combine_chunks()
        for j in self._checked:  # an integer sum must fit its type in the end
            sums = part.column(f"v{j}_sum")
            _overflow(part, self._key_names(), f"v{j}_sum", sums.type,
                      part.column(f"v{j}_wraps").to_numpy(), self._true_sums(part, j).to_numpy(zero_copy_only=False),
                      {**{f"k{i}": k for i, k in enumerate(self._keys)}, f"v{j}_sum": self._values[j]})
        cols = [part.column(f"k{i}") for i in range(len(self._keys))]
        for column, fn in self._outputs:
            j = self._values.index(column)
            if fn == "mean":
                total = pc.cast(part.column(f"v{j}_sum"), pa.float64(), safe=False)  # (beyond 2**53: rounded)
                cols.append(pc.divide(total, part.column(f"v{j}_count").cast(pa.float64())))
            else:
                cols.append(part.column(f"v{j}_{fn}"))
        table = pa.Table.from_arrays(cols, schema=self.schema).combine_chunks()
        batches = table.to_batches()
        return batches[0] if batches else _empty(self.schema)
