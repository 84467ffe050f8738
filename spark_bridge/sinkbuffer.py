"""The outputs of one bridge sink on one worker: no sockets, no dataflow.

Records arrive per epoch and are converted to Arrow IPC at once (so the worker never holds an
epoch as Python objects, and finishing one costs nothing). An epoch is *complete* once the sink's
input frontier has passed it; complete epochs are served to readers and kept until a reader
releases them. Reads wait here until every epoch they ask for is complete.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import protocol as P
from . import schema as S
from .errors import BridgeError

Batch = tuple[int, int, Any]  # (epoch, rows, serialized RecordBatch)


class SinkBuffer:
    """Epochs of one sink on one worker, as Arrow IPC batches, until released."""

    def __init__(self, name: str, fields: list, arrow: bool, worker: int) -> None:
        self.name = name
        self.fields = fields
        self.arrow = arrow  # records are RecordBatches / Tables, not tuples
        self.worker = worker
        self.schema = S.arrow_schema(fields)
        self._open: dict[int, list] = {}  # epoch -> [(rows, body)] not complete yet
        self.complete: dict[int, list] = {}  # epoch -> [(rows, body)]
        self.frontier: int | None = 0  # minimal time the sink may still see; None: input complete
        self._last_frontier = 0  # the frontier before it became empty
        self.max_seen = -1
        self.released = 0  # every epoch before this was released by a reader
        self.on_release: Callable[[int], None] | None = None  # makes a new release point durable
        self.done = False  # no epoch will be added or completed any more
        self._reads: list[tuple[Any, int, int]] = []  # (reader, start, end) waiting for their epochs

    # -- input --------------------------------------------------------------------------------------
    def add(self, epoch: int, records: Any) -> None:
        """Convert one received batch of ``epoch`` (tuples, or Arrow batches/tables) to Arrow IPC."""
        import pyarrow as pa

        self.max_seen = max(self.max_seen, epoch)
        out = self._open.setdefault(epoch, [])
        if self.arrow:
            for rb in records:
                for part in rb.to_batches() if isinstance(rb, pa.Table) else [rb]:
                    if not isinstance(part, pa.RecordBatch):
                        raise BridgeError(f"sink '{self.name}' (arrow=True): records must be pyarrow RecordBatch "
                                          f"or Table objects, not {type(part).__name__}")
                    part = S.conform(part, self.schema)
                    if part.num_rows:
                        out.append((part.num_rows, part.serialize()))
            return
        if not records:
            return
        struct = pa.struct(list(self.schema))
        try:
            try:
                columns = pa.array(records, type=struct).flatten()
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
                # Arrow takes a struct value as a tuple or a dict, not a list: records given as lists
                # are converted only when the fast path fails (tuples cost nothing extra).
                if not any(type(r) is list for r in records):
                    raise
                columns = pa.array([tuple(r) if type(r) is list else r for r in records], type=struct).flatten()
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            raise BridgeError(self._explain(epoch, records, e)) from e
        rb = pa.RecordBatch.from_arrays(columns, schema=self.schema)
        out.append((rb.num_rows, rb.serialize()))

    def _explain(self, epoch: int, records: Any, error: Exception) -> str:
        import pyarrow as pa

        width = len(self.fields)
        for r in records:
            if not isinstance(r, (tuple, list)) or len(r) != width:
                return (f"sink '{self.name}': record {r!r:.200} at epoch {epoch} does not have the {width} fields "
                        f"of the sink's schema ({S.ddl(self.fields)})")
        for i, ((name, t), field) in enumerate(zip(self.fields, self.schema)):
            try:
                pa.array([r[i] for r in records], type=field.type)
            except Exception as e:
                return f"sink '{self.name}': column '{name}' ({t}) at epoch {epoch}: {e}"
        return f"sink '{self.name}': records at epoch {epoch} do not fit {S.ddl(self.fields)}: {error}"

    def advance(self, frontier: int | None) -> None:
        """The input frontier is now ``frontier`` (its least time; None once empty): every epoch
        before it is complete."""
        self.frontier = frontier
        if frontier is not None:
            self._last_frontier = frontier
        for t in sorted(t for t in self._open if frontier is None or t < frontier):
            parts = self._open.pop(t)
            # Invariant: an epoch a reader released is never served again (a restart recomputes it).
            if parts and t >= self.released:
                self.complete.setdefault(t, []).extend(parts)

    def complete_before(self) -> int:
        """Every epoch below this is complete here."""
        if self.frontier is None:
            return max(self.max_seen + 1, self._last_frontier)
        return self.frontier

    @property
    def drained(self) -> bool:
        """Nothing is buffered: every epoch seen was released (or was empty)."""
        return not self.complete and not self._open

    # -- readers ------------------------------------------------------------------------------------
    def status(self) -> dict:
        """The reply to a status request."""
        return P.ok(empty=self.frontier is None, frontier=self.frontier, max_seen=self.max_seen,
                    released=self.released, retained=sorted(self.complete))

    def release(self, upto: int) -> None:
        """A reader committed every epoch before ``upto``: forget them (a new release point is
        made durable first, with checkpoints)."""
        if upto > self.released and self.on_release is not None:
            self.on_release(upto)
        self.released = max(self.released, upto)
        for t in [t for t in self.complete if t < self.released]:
            del self.complete[t]

    def request_read(self, reader: Any, start: int, end: int) -> None:
        """Queue a read of the epochs in ``[start, end)``; :meth:`answer_reads` answers it."""
        self._reads.append((reader, start, end))

    @property
    def reads_waiting(self) -> bool:
        """Whether a read waits for epochs to complete."""
        return bool(self._reads)

    def answer_reads(self, stopping: str | None = None) -> list[tuple[Any, list[Batch], dict]]:
        """``(reader, batches, final reply)`` for every read that can be answered now: its epochs are
        complete, or the sink's input is complete or done (the epochs that exist), or the bridge is
        ``stopping`` (the message refusing the rest)."""
        limit = self.complete_before()
        answers, keep = [], []
        for reader, start, end in self._reads:
            # Invariant: a read waits only while an epoch it asks for may still come or complete;
            # once the input is complete (frontier None) every epoch that exists is served.
            if end > limit and stopping is None and not self.done and self.frontier is not None:
                keep.append((reader, start, end))
            else:
                answers.append((reader, *self._answer(start, end, stopping)))
        self._reads = keep
        return answers

    def _answer(self, start: int, end: int, stopping: str | None) -> tuple[list[Batch], dict]:
        if stopping is not None and end > self.complete_before() and not self.done and self.frontier is not None:
            return [], P.error(stopping, "stopping")
        if start < self.released:
            return [], P.error(f"sink '{self.name}': epochs before {self.released} were already released by a "
                               f"reader commit on worker {self.worker}; cannot read from epoch {start}")
        batches = [(t, rows, body) for t in sorted(t for t in self.complete if start <= t < end)
                   for rows, body in self.complete[t]]
        return batches, P.ok(rows=sum(b[1] for b in batches), batches=len(batches))
