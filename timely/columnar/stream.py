"""Columnar streams: timely streams whose records are ``pyarrow.RecordBatch`` objects of one schema.

A :class:`BatchStream` wraps a :class:`timely.Stream` and the schema of its batches. Its operators
work on whole batches with ``pyarrow.compute`` and numpy, never on rows in Python: a user whose data
is tabular pays per batch, not per record. Every operator checks the schema of what it receives
and fails naming itself and the column that differs.

Counting: a batch is one record for progress tracking (channels count batches, not rows).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.acero as ac
import pyarrow.compute as pc

from ..dataflow import Stream
from ..dataflow.handles import Notificator, OperatorInput, OperatorOutput
from ..errors import BuildError
from .channels import ColumnExchange
from .kernels import SUPPORTED_TYPES, Aggregation, _hashable

Columns = str | Sequence[str]


def schema_difference(expected: pa.Schema, got: pa.Schema) -> str:
    """One line naming the first column where ``got`` differs from ``expected``."""
    names = set(got.names)
    for field in expected:
        if field.name not in names:
            return f"column '{field.name}' is missing (the batch has {got.names})"
        other = got.field(got.names.index(field.name))
        if not other.type.equals(field.type):
            return f"column '{field.name}' is {other.type}, expected {field.type}"
    extra = [n for n in got.names if n not in set(expected.names)]
    if extra:
        return f"column '{extra[0]}' is not in the stream's schema {expected.names}"
    return f"columns are in the order {got.names}, expected {expected.names}"


def same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    """Same column names and types, in order (nullability and metadata aside: Spark, for one,
    marks columns ``not null`` that a declared schema leaves nullable)."""
    return a.names == b.names and all(x.type.equals(y.type) for x, y in zip(a, b))


def _checker(name: str, schema: pa.Schema | None) -> Callable[[pa.RecordBatch], None]:
    """A check that a record is a batch of ``schema`` (any schema when ``None``)."""

    def check(batch: Any) -> None:
        if type(batch) is not pa.RecordBatch:
            raise TypeError(f"operator '{name}': records of a columnar stream are pyarrow.RecordBatch, "
                            f"got {type(batch).__name__}: {batch!r:.200}")
        if schema is not None and batch.schema is not schema and not same_columns(batch.schema, schema):
            raise ValueError(f"operator '{name}': batch schema does not match the stream's: "
                             f"{schema_difference(schema, batch.schema)}")

    return check


def _as_batch(result: Any, name: str) -> pa.RecordBatch:
    """A user function's result (batch, table, or mapping of columns) as one record batch."""
    if isinstance(result, pa.RecordBatch):
        return result
    if isinstance(result, pa.Table):
        return result.combine_chunks().to_batches()[0] if result.num_rows else _empty(result.schema)
    if isinstance(result, Mapping):
        return pa.RecordBatch.from_pydict(dict(result))
    raise TypeError(f"operator '{name}': expected a pyarrow.RecordBatch, Table or mapping of columns, "
                    f"got {type(result).__name__}")


class BatchStream:
    """A stream of ``pyarrow.RecordBatch`` records of one ``schema`` (``None``: not known yet).

    Build one with :func:`from_batches` (a stream of batches, for example
    ``spark_bridge.source(..., arrow=True)`` or an input fed with ``send(batch)``) or
    :func:`from_rows`; leave with :meth:`to_rows` or use :attr:`stream` with any row operator.
    """

    def __init__(self, stream: Stream, schema: pa.Schema | None) -> None:
        self.stream = stream
        self.schema = schema

    @property
    def scope(self) -> Any:
        """The scope the stream lives in."""
        return self.stream.scope

    def _name(self, kind: str, name: str | None, f: Any = None) -> str:
        return name or self.stream.scope.default_name(kind, f)

    def _column_names(self, name: str, columns: Iterable[str]) -> None:
        """Fail at build when the schema is known and lacks a column."""
        if self.schema is None:
            return
        for c in columns:
            if c not in self.schema.names:
                raise BuildError(f"operator '{name}': no column '{c}' in the stream's schema {self.schema.names}")

    def _key_columns(self, name: str, columns: Sequence[str]) -> None:
        """Fail at build when the schema is known and lacks a key column or has one of a type
        that cannot be hashed (else the first batch fails, naming the operator and the column)."""
        self._column_names(name, columns)
        if self.schema is None:
            return
        for c in columns:
            t = self.schema.field(c).type
            if not _hashable(t):
                raise BuildError(f"operator '{name}': key column '{c}' has type {t}, which cannot be hashed "
                                 f"(supported: {SUPPORTED_TYPES})")

    def _map(self, name: str, f: Callable[[pa.RecordBatch], pa.RecordBatch], schema: pa.Schema | None) -> BatchStream:
        check = _checker(name, self.schema)

        def each(batches: Sequence) -> list:
            out = []
            for b in batches:
                check(b)
                out.append(f(b))
            return out

        return BatchStream(self.stream.map_batch(each, name), schema)

    def select(self, *columns: str, name: str | None = None, **expressions: pc.Expression) -> BatchStream:
        """Keep ``columns`` and add one column per ``name=expression`` (``pyarrow.compute``
        expressions over the input's columns, for example ``total=pc.field("price") * 2``)."""
        name = self._name("Select", name)
        self._column_names(name, columns)
        if not columns and not expressions:
            raise BuildError(f"operator '{name}': select needs at least one column or expression")
        projection = {c: pc.field(c) for c in columns}
        projection.update(expressions)
        names, exprs = list(projection), list(projection.values())
        node = ac.ProjectNodeOptions(exprs, names)
        project = (lambda b: b.select(list(columns))) if not expressions else (lambda b: _run(b, "project", node))
        schema = None
        if self.schema is not None:
            try:
                schema = project(_empty(self.schema)).schema
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError) as e:
                raise BuildError(f"operator '{name}': {e}") from None
        return self._map(name, project, schema)

    def filter(self, predicate: pc.Expression, name: str | None = None) -> BatchStream:
        """Keep the rows where the boolean ``pyarrow.compute`` expression ``predicate`` is true
        (null counts as false)."""
        name = self._name("Filter", name)
        if not isinstance(predicate, pc.Expression):
            raise BuildError(f"operator '{name}': filter takes a pyarrow.compute expression, "
                             f"not {type(predicate).__name__}")
        node = ac.FilterNodeOptions(predicate)
        if self.schema is not None:
            views = [f.name for f in self.schema if pa.types.is_string_view(f.type) or pa.types.is_binary_view(f.type)]
            if views:  # (the check below on an empty batch passes: Acero has no filter kernel for them)
                raise BuildError(f"operator '{name}': filter does not take string_view or binary_view columns yet "
                                 f"(column {views[0]!r}): cast them to large_string or large_binary first")
            try:
                _run(_empty(self.schema), "filter", node)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError) as e:
                raise BuildError(f"operator '{name}': {e}") from None
        return self._map(name, lambda b: _run(b, "filter", node), self.schema)

    def map_columns(self, f: Callable[[pa.RecordBatch], Any], schema: pa.Schema | None = None,
                    name: str | None = None) -> BatchStream:
        """``f(batch)`` per batch, returning a ``RecordBatch``, a ``Table`` or a mapping of column
        name to array (numpy or Arrow). With ``schema``, every result is checked against it."""
        name = self._name("MapColumns", name, f)
        check_out = _checker(name, schema)

        def apply(b: pa.RecordBatch) -> pa.RecordBatch:
            out = _as_batch(f(b), name)
            check_out(out)
            return out

        return self._map(name, apply, schema)

    def exchange_by(self, columns: Columns, name: str | None = None) -> BatchStream:
        """Send each row to the worker of its key (the hash of ``columns``' values): the same worker
        the row path's ``exchange`` picks for the same key."""
        name = self._name("ExchangeBy", name)
        pact = ColumnExchange(columns)
        self._key_columns(name, pact.columns)
        check = _checker(name, self.schema)

        def constructor(cap: Any, info: Any) -> Callable:
            cap.drop()

            def logic(inp: OperatorInput, out: OperatorOutput) -> None:
                for cap, batches in inp:
                    for b in batches:
                        check(b)
                    out.give_batch(cap, batches)

            return logic

        return BatchStream(self.stream.unary(constructor, name, pact), self.schema)

    def aggregate_by(self, keys: Columns, aggregations: Mapping[str, str | Sequence[str]],
                     name: str | None = None) -> BatchStream:
        """Per time, once it is complete, one batch with a row per distinct key: the key columns and
        ``{column}_{function}`` per aggregation (``"sum"``, ``"count"``, ``"min"``, ``"max"``,
        ``"mean"``; ``count`` counts non-null values). Rows are exchanged by key first, so each key
        is aggregated on one worker. Null keys form their own group."""
        name = self._name("AggregateBy", name)
        key_list = [keys] if isinstance(keys, str) else list(keys)
        pact = ColumnExchange(key_list)
        self._key_columns(name, key_list)
        self._column_names(name, aggregations)
        out_schema = None
        if self.schema is not None:
            try:
                out_schema = Aggregation(key_list, aggregations, self.schema).schema
            except ValueError as e:
                raise BuildError(f"operator '{name}': {e}") from None
        check = _checker(name, self.schema)
        in_schema = self.schema

        def logic(inp: OperatorInput, out: OperatorOutput, notificator: Notificator) -> None:
            for cap, batches in inp:
                acc = pending.get(cap.time)
                for b in batches:
                    check(b)
                    if acc is None:
                        acc = pending[cap.time] = Aggregation(key_list, aggregations, in_schema or b.schema)
                        notificator.notify_at(cap.retain())
                    acc.update(b)
            for done in notificator:
                result = pending.pop(done.time).finish()
                if result.num_rows:
                    out.give(done, result)

        pending: dict[Any, Aggregation] = {}
        return BatchStream(self.stream.unary_notify(logic, name, pact), out_schema)

    def to_rows(self, name: str | None = None) -> Stream:
        """A row stream: each row a tuple of Python values in column order."""
        name = self._name("ToRows", name)
        check = _checker(name, self.schema)

        def rows(batches: Sequence) -> list:
            out: list = []
            for b in batches:
                check(b)
                out.extend(rows_of(b))
            return out

        return self.stream.map_batch(rows, name)

    def inspect_batch(self, f: Callable[[Any, Sequence[pa.RecordBatch]], Any], name: str | None = None) -> BatchStream:
        """Call ``f(time, batches)`` for every delivery; the batches pass on unchanged."""
        return BatchStream(self.stream.inspect_batch(f, name), self.schema)

    def concat(self, *others: BatchStream, name: str | None = None) -> BatchStream:
        """One stream of this stream's and ``others``' batches (their schemas must have the same column
        names and types, in order: nullability and metadata are not compared, as everywhere else)."""
        for o in others:
            if self.schema is not None and o.schema is not None and not same_columns(o.schema, self.schema):
                raise BuildError(f"concat: schemas differ: {schema_difference(self.schema, o.schema)}")
        return BatchStream(self.stream.concat(*(o.stream for o in others), name=name), self.schema)

    def probe(self) -> Any:
        """A probe on this stream (see :meth:`timely.Stream.probe`)."""
        return self.stream.probe()


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)


def _run(b: pa.RecordBatch, kind: str, options: Any) -> pa.RecordBatch:
    """``b`` through one Acero node (``"project"`` or ``"filter"``), on this thread, as one batch."""
    source = ac.Declaration("table_source", ac.TableSourceNodeOptions(pa.Table.from_batches([b])))
    table = ac.Declaration.from_sequence([source, ac.Declaration(kind, options)]).to_table(use_threads=False)
    return table.combine_chunks().to_batches()[0] if table.num_rows else _empty(table.schema)


def rows_of(batch: pa.RecordBatch) -> list[tuple]:
    """The rows of ``batch`` as tuples of Python values in column order."""
    cols = [c.to_numpy().tolist() if c.null_count == 0 and (pa.types.is_integer(c.type) or pa.types.is_floating(c.type))
            else c.to_pylist() for c in batch.columns]
    if not cols:
        return [() for _ in range(batch.num_rows)]
    return list(zip(*cols))


class BatchInput:
    """An input of record batches: :meth:`send` checks a batch against the schema *before* it is
    accepted, so a bad batch raises in the caller (naming the input and the column) and nothing
    already sent is lost. ``stream`` is the :class:`BatchStream` it feeds."""

    def __init__(self, handle: Any, schema: pa.Schema) -> None:
        self._handle = handle
        self.schema = schema
        self.stream = BatchStream(handle.stream, schema)
        self._check = _checker(handle.name, schema)

    @property
    def time(self) -> Any:
        """The epoch batches are sent at."""
        return self._handle.time

    def send(self, batch: pa.RecordBatch | pa.Table | Mapping[str, Any]) -> None:
        """Send a batch (a ``Table`` is sent as its batches; a mapping of columns is converted with
        the input's schema) at the current epoch."""
        if isinstance(batch, Mapping):
            batch = self._from_columns(batch)
        if isinstance(batch, pa.Table):
            # (checked as a whole: an empty table has no batches to check)
            if batch.schema is not self.schema and not same_columns(batch.schema, self.schema):
                raise ValueError(f"operator '{self._handle.name}': table schema does not match the stream's: "
                                 f"{schema_difference(self.schema, batch.schema)}")
            batches = batch.to_batches()
        else:
            batches = [batch]
        for b in batches:
            self._check(b)  # all checked before any is sent
        self._handle.send_batch(batches)

    def _from_columns(self, columns: Mapping[str, Any]) -> pa.RecordBatch:
        """A mapping of columns as a batch of the schema; ValueError naming the input and the
        column (unknown, missing, of another length, or of values that do not convert)."""
        name = self._handle.name
        unknown = [c for c in columns if c not in self.schema.names]
        if unknown:
            raise ValueError(f"input '{name}': column {unknown[0]!r} is not in the schema {self.schema.names}")
        missing = [c for c in self.schema.names if c not in columns]
        if missing:
            raise ValueError(f"input '{name}': column {missing[0]!r} of the schema is missing")
        lengths = {}
        for c, values in columns.items():
            try:
                lengths[c] = len(values)
            except TypeError:
                raise ValueError(f"input '{name}': column {c!r} is not a sequence of values: {values!r:.100}") from None
        first = self.schema.names[0] if self.schema.names else ""  # (a schema of no columns: no rows)
        for c, n in lengths.items():
            if n != lengths[first]:
                raise ValueError(f"input '{name}': column {c!r} has {n} values, column {first!r} {lengths[first]}")
        arrays = []
        for field in self.schema:
            try:
                arrays.append(pa.array(columns[field.name], type=field.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"input '{name}': column {field.name!r} does not convert to {field.type}: "
                                 f"{type(e).__name__}: {e}") from None
        try:
            return pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:  # (a non-nullable field's nulls)
            raise ValueError(f"input '{name}': columns do not fit the schema: {e}") from None

    def advance_to(self, time: Any) -> None:
        """Promise that no more batches will be sent at times before ``time``."""
        self._handle.advance_to(time)

    def close(self) -> None:
        """Send nothing more."""
        self._handle.close()


def new_input(scope: Any, schema: pa.Schema, name: str | None = None) -> BatchInput:
    """A :class:`BatchInput` of ``schema`` in ``scope``."""
    return BatchInput(scope.new_input(name), schema)


def from_batches(stream: Stream, schema: pa.Schema | None = None, name: str | None = None) -> BatchStream:
    """The stream ``stream`` of ``RecordBatch`` records as a :class:`BatchStream`; with ``schema``,
    every batch is checked against it (a mismatch fails naming the operator and the column)."""
    name = name or stream.scope.default_name("FromBatches")
    check = _checker(name, schema)

    def each(batches: Sequence) -> Sequence:
        for b in batches:
            check(b)
        return batches

    return BatchStream(stream.map_batch(each, name), schema)


def from_rows(stream: Stream, schema: pa.Schema, name: str | None = None) -> BatchStream:
    """Each delivered batch of tuple rows (values in ``schema``'s column order) as one
    ``RecordBatch``. A row that does not fit the schema fails naming the operator, the row and the
    column."""
    name = name or stream.scope.default_name("FromRows")
    width = len(schema)

    def convert(rows: Sequence) -> list:
        if not rows:
            return []
        try:
            if any(len(r) != width for r in rows):
                raise ValueError("width")
            if not width:  # (from_arrays and from_pylist would give no rows at all)
                return [_no_columns(len(rows), schema)]
            arrays = [pa.array(col, type=f.type) for col, f in zip(zip(*rows), schema)]
            return [pa.RecordBatch.from_arrays(arrays, schema=schema)]
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            raise ValueError(f"operator '{name}': {_bad_row(rows, schema)}") from None

    return BatchStream(stream.map_batch(convert, name), schema)


def _no_columns(n: int, schema: pa.Schema) -> pa.RecordBatch:
    """A batch of ``n`` rows and no columns, of the zero-column ``schema`` (its metadata kept)."""
    return pa.RecordBatch.from_arrays([pa.nulls(n)], names=["_"]).select([]).replace_schema_metadata(schema.metadata)


def _bad_row(rows: Sequence, schema: pa.Schema) -> str:
    """Name the first row (and column) of ``rows`` that does not fit ``schema``."""
    for row in rows:
        if not isinstance(row, (tuple, list)) or len(row) != len(schema):
            return f"row {row!r:.200} does not have the {len(schema)} columns {schema.names}"
        for value, field in zip(row, schema):
            try:
                pa.array([value], type=field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
                return f"row {row!r:.200}: column '{field.name}' ({field.type}) cannot hold {value!r:.100} ({e})"
    return "rows do not fit the schema"
