"""Columnar dataflows: streams of ``pyarrow.RecordBatch`` and operators that never touch rows in Python.

::

    import pyarrow as pa, pyarrow.compute as pc
    from timely import columnar

    with worker.dataflow() as scope:
        inp = columnar.new_input(scope, schema)       # inp.send(record_batch), checked on the spot
        totals = (inp.stream.filter(pc.field("price") > 100)
                      .aggregate_by("auction", {"price": ["sum", "count"]}))
        totals.to_rows().inspect(print)

:class:`BatchStream` holds the operators; :class:`ColumnExchange` and :class:`ColumnDistribute` are
the pacts that route rows of batches between workers, sending the Arrow buffers as ZeroMQ frames
without copies. A ``RecordBatch`` may also travel inside ordinary (msgpack) records, for example as
Megaphone state: it is then sent as an Arrow IPC stream.
"""
from __future__ import annotations

import pyarrow as pa

from ..comm.framing import register_extension
from . import codec
from .channels import ColumnDistribute, ColumnExchange
from .kernels import Aggregation, bins_of_hashes, filter_rows, grouped, hash_columns, take_rows, worker_parts
from .stream import (
    BatchInput,
    BatchStream,
    from_batches,
    from_rows,
    new_input,
    rows_of,
    same_columns,
    schema_difference,
)

__all__ = ["Aggregation", "BatchInput", "BatchStream", "ColumnDistribute", "ColumnExchange", "bins_of_hashes",
           "filter_rows", "from_batches", "from_rows", "grouped", "hash_columns", "new_input", "rows_of",
           "same_columns", "schema_difference", "take_rows", "worker_parts"]

#: The msgpack extension code of a RecordBatch inside an ordinary record.
RECORD_BATCH_EXT = 1

register_extension(RECORD_BATCH_EXT, pa.RecordBatch, codec.to_ipc, codec.from_ipc)
