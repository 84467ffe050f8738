"""NEXMark on columns: bids as Arrow record batches and columnar variants of Q1, Q2, Q5 and Q7.

:class:`BidColumns` generates a worker's bids straight into ``pyarrow.RecordBatch`` columns of
:data:`BID_SCHEMA` (the generator's numpy columns, no Python object per bid). ``COLUMNAR_QUERIES``
maps ``"q1-col"``, ``"q2-col"``, ``"q5-col"`` and ``"q7-col"`` to a :class:`ColumnarQuery`; each
computes, on ``timely.columnar`` operators, the same output as the row query it names in
``same_as`` (rows of a batch in column order equal the row query's tuples, at the same epochs).
The harness and the driver run them by name next to the row queries; they have no Megaphone
variant.

The windowed queries assign each bid to its window(s) with numpy, re-stamp each row at the epoch
its window is reported at (:func:`at_column_time`, the row queries' ``last_epoch`` rule), then
reduce per epoch: Q5 counts bids per ``(window, auction)`` with ``aggregate_by`` and keeps the top
auction per window; Q7 keeps the top bid per window (:func:`top_by`, a sort per epoch).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import timely
from timely.columnar import BatchStream, ColumnExchange, from_batches, rows_of

from .generator import EventBatch, Generator
from .model import Config, Params
from .queries import QUERIES, Query, Streams
from .queries.common import per_time_groups

#: The columns of a bid batch: a row is the row path's bid tuple ``(auction, bidder, price, date_time)``.
BID_SCHEMA = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
                        ("date_time", pa.int64())])


class ColumnEvents(EventBatch):
    """An :class:`~nexmark.generator.EventBatch` whose ``bids`` hold at most one RecordBatch of
    :data:`BID_SCHEMA` (and no persons or auctions); ``total`` counts bids, not batches."""

    __slots__ = ()

    @property
    def total(self) -> int:
        """The number of bids."""
        return sum(b.num_rows for b in self.bids)


class BidColumns:
    """The bids among the events of worker ``index`` of ``peers`` (the same events as
    :class:`~nexmark.generator.Generator`), as record batches of :data:`BID_SCHEMA`."""

    def __init__(self, config: Config, index: int = 0, peers: int = 1) -> None:
        self.gen = Generator(config, index, peers, backend="numpy")
        self.next = index  # the next event number this worker generates (a cursor, as Generator's)

    def batch(self, lo: int, hi: int) -> pa.RecordBatch:
        """This worker's bids with event numbers in ``[lo, hi)`` (in event-number order)."""
        c = self.gen.config
        n = self.gen.numbers(lo, hi)
        n = n[n % c.denominator >= c.person_proportion + c.auction_proportion]
        return pa.RecordBatch.from_arrays(list(self.gen.bid_columns(n)), schema=BID_SCHEMA)

    def until(self, hi: int) -> ColumnEvents:
        """This worker's bids from the cursor up to (excluding) event ``hi``, as one batch (none
        when there is no bid); advances the cursor."""
        if hi <= self.next:
            return ColumnEvents([], [], [])
        batch = self.batch(self.next, hi)
        peers, index = self.gen.peers, self.gen.index
        self.next = hi + (index - hi) % peers
        return ColumnEvents([], [], [batch] if batch.num_rows else [])


# -- operators the windowed queries share -------------------------------------------------------

def at_column_time(bs: BatchStream, column: str, name: str) -> BatchStream:
    """Each row at the epoch in its int64 column ``column`` (at least the time it arrives at; the
    column is dropped): a row whose result is due later waits in the dataflow, not in state."""
    schema = bs.schema
    if schema is None or schema.field(column).type != pa.int64():
        raise ValueError(f"operator '{name}': column '{column}' must be a known int64 column")
    out_schema = schema.remove(schema.get_field_index(column))

    def constructor(cap: Any, info: Any) -> Callable:
        cap.drop()

        def logic(inp: Any, out: Any) -> None:
            for icap, batches in inp:
                for b in batches:
                    due = b.column(column).to_numpy()
                    rest = b.drop_columns([column])
                    order = np.argsort(due, kind="stable")
                    times, starts = np.unique(due[order], return_index=True)
                    # ``delayed`` fails for a time before the batch's: the column's invariant.
                    for t, rows in zip(times.tolist(), np.split(order, starts[1:])):
                        with icap.delayed(t) as cap:  # counted until dropped (at the block's end)
                            out.give(cap, rest.take(rows))

        return logic

    return BatchStream(bs.stream.unary(constructor, name), out_schema)


def top_by(bs: BatchStream, group: str, order: Sequence[tuple[str, str]], name: str,
           exchange: bool = True) -> BatchStream:
    """Per time, once it is complete, the first row of each value of ``group`` in ``order``
    (``(column, "ascending"|"descending")`` pairs, later pairs breaking ties). With ``exchange``
    rows are exchanged by ``group`` first (a global top); without, each worker keeps its own."""
    keys = [(group, "ascending"), *order]

    def top(time: Any, batches: list) -> list:
        parts = [b for b in batches if b.num_rows]
        if not parts:
            return []
        table = pa.Table.from_batches(parts).sort_by(keys)
        g = table.column(group).to_numpy()
        firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])  # sorted: the first row of each group
        return [table.take(firsts).combine_chunks().to_batches()[0]]

    # per_time_groups hands its key to the operator as the exchange: a pact routes batches by column.
    pact = ColumnExchange(group) if exchange else None
    return BatchStream(per_time_groups(bs.stream, pact, top, name), bs.schema)


def _last_epoch(end: np.ndarray, d: int) -> np.ndarray:
    """:func:`nexmark.model.last_epoch` on a column of window ends."""
    return (end - 1) // d


# -- the queries -------------------------------------------------------------------------------

def q1_col(bids: BatchStream, p: Params) -> BatchStream:
    """Q1: every bid with its price converted to euros, ``price * 89 // 100`` (as the row Q1)."""
    f = pc.field
    return bids.select(auction=f("auction"), bidder=f("bidder"), price=f("price") * 89 / 100,
                       date_time=f("date_time"), name="Q1 columns")


def q2_col(bids: BatchStream, p: Params) -> BatchStream:
    """Q2: ``(auction, price)`` of the bids on auctions whose id is a multiple of ``q2_skip``."""
    auction = pc.field("auction")
    multiple = auction - auction / p.q2_skip * p.q2_skip == 0  # integer division: ids are positive
    return bids.filter(multiple, name="Q2 filter").select("auction", "price", name="Q2 columns")


_Q5_WINDOWS = pa.schema([("end", pa.int64()), ("auction", pa.int64()), ("due", pa.int64())])


def q5_col(bids: BatchStream, p: Params) -> BatchStream:
    """Q5: every ``q5_slide_ms`` the auction with the most bids in the last ``q5_window_ms``,
    ``(window_end, auction, count)`` (ties to the lower auction). A bid is counted in each of the
    ``window / slide`` windows holding it (one row per bid and window)."""
    slide, span, d = p.q5_slide_ms, p.q5_window_ms // p.q5_slide_ms, p.d

    def windows(b: pa.RecordBatch) -> pa.RecordBatch:
        first_end = (b.column("date_time").to_numpy() // slide + 1) * slide
        end = (first_end[:, None] + np.arange(span, dtype=np.int64) * slide).ravel()
        auction = np.repeat(b.column("auction").to_numpy(), span)
        return pa.RecordBatch.from_arrays([end, auction, _last_epoch(end, d)], schema=_Q5_WINDOWS)

    per_window = bids.map_columns(windows, _Q5_WINDOWS, name="Q5 windows")
    counts = at_column_time(per_window, "due", "Q5 at window epoch").aggregate_by(
        ["end", "auction"], {"auction": "count"}, name="Q5 counts")
    top = top_by(counts, "end", [("auction_count", "descending"), ("auction", "ascending")], "Q5 top auction")
    return top.select("end", "auction", count=pc.field("auction_count"), name="Q5 columns")


def q7_col(bids: BatchStream, p: Params) -> BatchStream:
    """Q7: per tumbling window of ``q7_window_ms`` the highest bid, ``(window_end, auction,
    bidder, price, date_time)``; ties to the earlier bid, then the lower auction, then bidder."""
    width, d = p.q7_window_ms, p.d
    schema = pa.schema([("end", pa.int64()), *BID_SCHEMA, ("due", pa.int64())])

    def window(b: pa.RecordBatch) -> pa.RecordBatch:
        end = (b.column("date_time").to_numpy() // width + 1) * width
        return pa.RecordBatch.from_arrays([end, *b.columns, _last_epoch(end, d)], schema=schema)

    order = [("price", "descending"), ("date_time", "ascending"), ("auction", "ascending"), ("bidder", "ascending")]
    stamped = at_column_time(bids.map_columns(window, schema, name="Q7 windows"), "due", "Q7 at window epoch")
    local = top_by(stamped, "end", order, "Q7 local top", exchange=False)  # a pre-reduce per worker
    return top_by(local, "end", order, "Q7 maximum")


class ColumnarQuery(NamedTuple):
    """A columnar query: its builder over the bid batches, the row query it equals, a description."""

    name: str
    columnar: Callable[[BatchStream, Params], BatchStream]
    same_as: str
    description: str

    def build(self, streams: Streams, params: Params, control: Any = None) -> timely.Stream:
        """The output, a stream of RecordBatches, over ``streams.bids`` carrying batches of
        :data:`BID_SCHEMA` (fed by :class:`BidColumns`); ``control`` must be ``None``."""
        if control is not None:
            raise ValueError(f"{self.name} has no Megaphone variant")
        params.check()
        return self.columnar(from_batches(streams.bids, BID_SCHEMA, name="Bid batches"), params).stream


COLUMNAR_QUERIES: dict[str, ColumnarQuery] = {q.name: q for q in (
    ColumnarQuery("q1-col", q1_col, "q1", "currency conversion on columns"),
    ColumnarQuery("q2-col", q2_col, "q2", "selection on columns"),
    ColumnarQuery("q5-col", q5_col, "q5", "hot items on columns (aggregate_by per window epoch)"),
    ColumnarQuery("q7-col", q7_col, "q7", "highest bid on columns (sort per window epoch)"),
)}


def lookup(name: str) -> Query | ColumnarQuery:
    """The row query (``nexmark.queries.QUERIES``) or columnar query named ``name``."""
    found = QUERIES.get(name) or COLUMNAR_QUERIES.get(name)
    if found is None:
        raise KeyError(f"unknown query {name!r} (one of {', '.join(sorted([*QUERIES, *COLUMNAR_QUERIES]))})")
    return found


def event_source(query: str, config: Config, index: int, peers: int) -> Generator | BidColumns:
    """What feeds ``query`` on worker ``index`` of ``peers``: bid batches for a columnar query,
    else the row generator (both have ``until(hi)`` returning an EventBatch and a ``next`` cursor)."""
    if query in COLUMNAR_QUERIES:
        return BidColumns(config, index, peers)
    return Generator(config, index, peers)


def output_rows(records: Sequence) -> list:
    """Output records as rows: a RecordBatch's rows (tuples in column order), others unchanged."""
    return [row for r in records for row in (rows_of(r) if isinstance(r, pa.RecordBatch) else (r,))]
