"""Megaphone on columns: migratable running aggregates over streams of ``pyarrow.RecordBatch``.

:func:`aggregate` is F and S of :mod:`megaphone.operators` with two parts swapped:

* the pact from F to S splits each batch by bin (the top ``k`` bits of the key column's
  ``hash64``, the very bin the row operators give the same key: :func:`bins_of_column`) and sends
  each part to the worker that the routing table in force at the batch's time gives its bins
  (:class:`timely.columnar.ColumnDistribute`: Arrow buffers, no per-row Python);
* the state of a bin is one ``RecordBatch`` (key, then the partial aggregates ``{column}_{state}``:
  sum, count, min, max as the aggregations need), merged per complete time with one
  ``pyarrow`` group-by over the touched bins, and shipped in chunks of rows as a ``RecordBatch``
  inside the state records (Arrow IPC, the msgpack extension of :mod:`timely.columnar`).

Everything else, and with it ARCHITECTURE.md section 5 (state installed before any later record of
its bin, times applied in order), is the row operators' machinery, unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from timely import BuildError, Pact, Stream
from timely.columnar import (
    Aggregation,
    BatchStream,
    ColumnDistribute,
    bins_of_hashes,
    grouped,
    hash_columns,
    same_columns,
    schema_difference,
    take_rows,
)

from .bins import MegaphoneError, Shared, StateCodec
from .control import ControlInput
from .operators import DEFAULT_CHUNK, Migratable, _build

FUNCTIONS = ("sum", "count", "min", "max", "mean")
_STATES = {"sum": ("sum",), "count": ("count",), "min": ("min",), "max": ("max",), "mean": ("sum", "count")}
_MERGE = {"sum": "sum", "count": "sum", "min": "min", "max": "max"}  # how two partial states combine
_NEW = "__megaphone_new"  # in a merge: 1 on the rows of the time being applied, 0 on the bins' state


def bins_of_column(batch: pa.RecordBatch | pa.Table, key: str, k: int) -> np.ndarray:
    """The Megaphone bin (of ``2**k``) of each row's ``key`` value, as int64: the bin that
    ``megaphone.bins_of`` gives the same value in a row. KeyError or TypeError naming the column if
    it is missing or of a type that cannot be hashed."""
    return bins_of_hashes(hash_columns(batch, key), k)


class ColumnMigratable(Migratable):
    """The handle of :func:`aggregate`: a :class:`~megaphone.Migratable` whose ``stream`` carries
    record batches, also offered as the columnar stream ``batches``."""

    def __init__(self, migratable: Migratable, schema: pa.Schema | None) -> None:
        super().__init__(migratable.stream, migratable.probe, migratable._shared, migratable.copied)
        self.batches = BatchStream(migratable.stream, schema)


class RunningAggregates(StateCodec):
    """The state of :func:`aggregate`: per bin one ``RecordBatch`` of partial aggregates (or None
    while empty), how a complete time is merged into it, and how it is shipped (Arrow, never rows)."""

    def __init__(self, name: str, key: str, aggregations: Mapping[str, str | Sequence[str]],
                 schema: pa.Schema | None) -> None:
        self.name = name
        self.key = key
        self.outputs = [(c, fn) for c, fns in aggregations.items() for fn in ([fns] if isinstance(fns, str) else fns)]
        for column, fn in self.outputs:
            if fn not in FUNCTIONS:
                raise BuildError(f"'{name}': aggregation of column {column!r}: unsupported function {fn!r} "
                                 f"(supported: {', '.join(FUNCTIONS)})")
        states: dict[str, list[str]] = {}
        for column, fn in self.outputs:
            states.setdefault(column, [])
            states[column] += [s for s in _STATES[fn] if s not in states[column]]
        self.states = states  # column -> the partial states kept for it
        self.state_columns = [f"{c}_{s}" for c, ss in states.items() for s in ss]
        self.schema = schema
        self.out_schema: pa.Schema | None = None
        self.state_schema: pa.Schema | None = None
        if schema is not None:
            self._check_schema(schema, BuildError)

    def _check_schema(self, schema: pa.Schema, error: type[Exception]) -> None:
        """Check the key column and the aggregations against ``schema``; derive the output and state
        schemas. Raises ``error`` naming this operator and the column."""
        try:
            hash_columns(schema.empty_table(), self.key)
            out = Aggregation(self.key, {c: [fn for cc, fn in self.outputs if cc == c] for c in self.states},
                              schema).schema
            state = Aggregation(self.key, self.states, schema).schema
        except (KeyError, TypeError, ValueError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise error(f"'{self.name}': {message}") from None
        self.out_schema = out.remove_metadata()
        self.state_schema = state.remove_metadata()

    def check(self, batch: Any) -> None:
        """Raise :class:`MegaphoneError` naming this operator unless ``batch`` is a record batch of
        the stream's schema (the first batch's, when the stream declared none)."""
        if type(batch) is not pa.RecordBatch:
            raise MegaphoneError(f"'{self.name}': records of a columnar stream are pyarrow.RecordBatch, "
                                 f"got {type(batch).__name__}")
        if self.schema is None:
            self.schema = batch.schema
            self._check_schema(batch.schema, MegaphoneError)
        elif batch.schema is not self.schema and not same_columns(batch.schema, self.schema):
            raise MegaphoneError(f"'{self.name}': batch schema does not match the stream's: "
                                 f"{schema_difference(self.schema, batch.schema)}")

    # -- routing (F -> S) ------------------------------------------------------------------------

    def pact(self, key: Any, shared: Shared) -> Pact:
        """Rows go to the worker that the table in force at their batch's time gives their bin."""
        cached: list[Any] = [None, None]  # the table last routed by, as a numpy array

        def partition(time: Any, batches: list, peers: int) -> list:
            table = shared.table_at(time)
            if cached[0] is not table:
                cached[:] = [table, np.asarray(table, np.int64)]
            parts: list[list] = [[] for _ in range(peers)]
            for b in batches:
                self.check(b)
                if b.num_rows:
                    _split(b, cached[1][self._bins(b, shared.k)], peers, parts)
            return parts

        return ColumnDistribute(partition)

    def _bins(self, batch: pa.RecordBatch, k: int) -> np.ndarray:
        try:
            return bins_of_column(batch, self.key, k)
        except (KeyError, TypeError) as e:
            raise MegaphoneError(f"'{self.name}': {e.args[0] if e.args else e}") from None

    # -- applying a complete time (S) ------------------------------------------------------------

    def apply_time(self, t: Any, batches: list[list], shared: Shared) -> list:
        """Merge the rows of time ``t`` into their bins; the running aggregates of the keys that
        had rows at ``t`` (one batch, or nothing)."""
        rows = []
        for delivered in batches[0]:
            for b in delivered:
                self.check(b)
                if b.num_rows:
                    rows.append(b)  # (received buffers are aligned by timely.columnar's codec)
        if not rows:
            return []
        assert self.schema is not None and self.state_schema is not None  # set by check()
        partial = Aggregation(self.key, self.states, self.schema)
        for b in rows:
            partial.update(b)
            shared.bin_records += np.bincount(self._bins(b, shared.k), minlength=shared.nbins)  # load (metrics)
        new = partial.finish()
        new = pa.RecordBatch.from_arrays(new.columns, schema=self.state_schema)
        bins = self._bins(new, shared.k)
        touched = np.unique(bins)
        if shared.dirty is not None:
            shared.dirty.update(touched.tolist())
        held = [shared.bins[b] for b in touched]
        for b, bin_ in zip(touched, held):
            if bin_ is None:
                shared.bin_for_record(int(b), t)  # raises: the routing invariant was violated
        olds = [bin_.state for bin_ in held if bin_ is not None and bin_.state is not None]
        if olds:
            merged = self._merge(olds, new)
            bins = self._bins(merged, shared.k)
        else:
            merged = new.append_column(_NEW, pa.array(np.ones(new.num_rows, np.int8)))
        # New state per touched bin: its rows, copied (no bin keeps a larger buffer alive).
        order = np.argsort(bins, kind="stable")
        sorted_bins = bins[order]
        los = np.searchsorted(sorted_bins, touched, "left")
        his = np.searchsorted(sorted_bins, touched, "right")
        state = merged.drop_columns([_NEW])
        for b, bin_, lo, hi in zip(touched, held, los, his):
            assert bin_ is not None
            bin_.state = take_rows(state, order[lo:hi])
        fresh = take_rows(merged, np.flatnonzero(merged.column(_NEW).to_numpy() == 1)).drop_columns([_NEW])
        return [self._finish(fresh)]

    def _merge(self, olds: list[pa.RecordBatch], new: pa.RecordBatch) -> pa.RecordBatch:
        """One row per key of ``olds`` (bins' states) and ``new`` (a time's partial aggregates), the
        partial states combined; column ``_NEW`` is 1 on the keys of ``new``."""
        zeros = [o.append_column(_NEW, pa.array(np.zeros(o.num_rows, np.int8))) for o in olds]
        ones = new.append_column(_NEW, pa.array(np.ones(new.num_rows, np.int8)))
        table = pa.Table.from_batches([*zeros, ones])
        aggs = [(c, _MERGE[c.rsplit("_", 1)[1]]) for c in self.state_columns] + [(_NEW, "max")]
        try:
            counts = [f"{c}_count" for c, states in self.states.items() if "count" in states]
            names = {f"{c}_sum": c for c in self.states}
            merged = grouped(table, [self.key], aggs, counts, names)  # (an integer sum leaving its type raises)
        except OverflowError as e:
            raise MegaphoneError(f"'{self.name}': {e}") from None
        merged = merged.rename_columns([self.key, *self.state_columns, _NEW])
        combined = merged.combine_chunks().to_batches()
        assert self.state_schema is not None
        schema = self.state_schema.append(pa.field(_NEW, pa.int8()))
        return pa.RecordBatch.from_arrays(combined[0].columns, schema=schema) if combined else schema.empty_table()

    def _finish(self, state: pa.RecordBatch | pa.Table) -> Any:
        """The output form of partial states: the key, then ``{column}_{function}`` per aggregation
        (mean = sum / count)."""
        columns = [state.column(self.key)]
        for column, fn in self.outputs:
            if fn == "mean":
                total = pc.cast(state.column(f"{column}_sum"), pa.float64(), safe=False)  # (beyond 2**53: rounded)
                columns.append(pc.divide(total, state.column(f"{column}_count").cast(pa.float64())))
            else:
                columns.append(state.column(f"{column}_{fn}"))
        # The schema is unknown only on a worker that got bins but no batch yet.
        names = None if self.out_schema is not None else [self.key, *(f"{c}_{fn}" for c, fn in self.outputs)]
        kind = pa.Table if isinstance(state, pa.Table) else pa.RecordBatch
        return kind.from_arrays(columns, names=names, schema=self.out_schema)

    # -- the state codec: a bin's RecordBatch ships as record batches of at most `chunk` rows ----

    def empty(self) -> Any:
        """An empty bin holds None (no batch)."""
        return None

    def size(self, part: Any) -> int:
        """Rows (keys) of a bin's batch or chunk."""
        return 0 if part is None else int(part.num_rows)

    def chunks(self, state: Any, chunk: int) -> list[Any]:
        """Slices of at most ``chunk`` rows (``[None]`` for an empty bin: the receiver still takes it)."""
        if state is None or state.num_rows <= chunk:
            return [state]
        return [state.slice(i, chunk) for i in range(0, state.num_rows, chunk)]

    def pack(self, part: Any, timers: list) -> Any:
        """``(batch, timers)``: the batch travels as Arrow IPC (timely.columnar's msgpack extension)."""
        return (part, timers)

    def unpack(self, payload: Any) -> tuple[Any, list]:
        """The ``(batch, timers)`` of a payload of :meth:`pack`."""
        part, timers = payload
        return part, list(timers)

    def nbytes(self, payload: Any) -> int:
        """Bytes of the payload's batch."""
        return 0 if payload[0] is None else int(payload[0].nbytes)

    def install(self, state: Any, part: Any) -> Any:
        """The bin's batch with the chunk's rows appended (the chunks of a bin hold distinct keys)."""
        if part is None:
            return state
        return part if state is None else pa.concat_batches([state, part])

    def dumps(self, state: Any, timers: list) -> bytes:
        """A bin's batch as one Arrow IPC stream (empty bytes for an empty bin); no timers here."""
        if timers:
            raise MegaphoneError(f"'{self.name}': running aggregates have no timers")
        if state is None:
            return b""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, state.schema) as writer:
            writer.write_batch(state)
        return sink.getvalue().to_pybytes()

    def loads(self, data: bytes) -> tuple[Any, list]:
        """The ``(batch or None, [])`` of :meth:`dumps`'s bytes."""
        if not data:
            return None, []
        return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch(), []

    def merged(self, states: Sequence[Any]) -> Any:
        """The running aggregates of every key of ``states``, in the output form, as a ``pyarrow.Table``."""
        batches = [s for s in states if s is not None]
        if not batches:
            return (self.out_schema or pa.schema([])).empty_table()
        return self._finish(pa.Table.from_batches(batches))


def _split(batch: pa.RecordBatch, workers: np.ndarray, peers: int, parts: list[list]) -> None:
    """Append to ``parts[w]`` the rows of ``batch`` whose entry in ``workers`` is ``w``."""
    counts = np.bincount(workers, minlength=peers)
    if counts.max() == batch.num_rows:
        parts[int(workers[0])].append(batch)  # all of it: no copy
        return
    order = np.argsort(workers, kind="stable")
    ends = np.cumsum(counts)
    for w in np.flatnonzero(counts):
        parts[w].append(take_rows(batch, order[ends[w] - counts[w]:ends[w]]))


def aggregate(stream: BatchStream | Stream, control: ControlInput | Stream, key: str,
              aggregations: Mapping[str, str | Sequence[str]], k: int | None = None,
              name: str = "MegaphoneAggregate", chunk: int = DEFAULT_CHUNK) -> ColumnMigratable:
    """Migratable running aggregates per ``key`` over a columnar stream.

    At each complete time, for each key that had rows at that time, one output row: the key, then
    ``{column}_{function}`` per aggregation (``aggregations`` maps a column to ``"sum"``,
    ``"count"``, ``"min"``, ``"max"``, ``"mean"`` or a list of them), aggregated over all rows of
    the key up to and including that time. ``count`` counts non-null values; ``sum``, ``min``,
    ``max`` and ``mean`` ignore nulls (null until a value arrives); null keys form their own group.
    The schema of the output is that of ``BatchStream.aggregate_by`` with the same arguments.

    ``key`` is one column (integers, floats, booleans, strings or binary, dictionary-encoded or
    not); its bin is the one the row operators give the same value, and bins move between workers
    as ``control`` says (``k``: ``2**k`` bins, default the control input's). ``chunk`` bounds the
    rows of one state message. A missing or unhashable key column fails naming the operator and
    the column: at build when ``stream`` has a schema, else at the first batch.
    """
    if not isinstance(key, str):
        raise BuildError(f"'{name}': key must be the name of one column, not {key!r}")
    if not isinstance(aggregations, Mapping) or not aggregations:
        raise BuildError(f"'{name}': aggregations must be a non-empty {{column: function}} mapping")
    batches = stream if isinstance(stream, BatchStream) else BatchStream(stream, None)
    state = RunningAggregates(name, key, aggregations, batches.schema)
    m = _build([batches.stream], control, [key], None, k, name, chunk, per_time=state.apply_time,
               pact=state.pact, codec=state)
    return ColumnMigratable(m, state.out_schema)
