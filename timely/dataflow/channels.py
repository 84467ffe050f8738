"""Parallelization contracts (pacts) and the channels that carry batches along dataflow edges.

A channel moves ``(time, batch)`` messages from one operator output to one operator input. It
reports how many records it delivered, summed over all workers, so that the produced count at the
input (+n at its Target) always equals what the receivers will consume (-n): an exchange conserves
the record count per time (ARCHITECTURE.md section 2.9).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import routing

Key = Callable[[Any], Any] | int | None


class Pact:
    """How records of an edge are distributed among workers.

    ``channel(df, target)`` makes the sending end of an edge into input port ``target`` of dataflow
    ``df``; with a single worker every pact is a pipeline. Subclasses implement :meth:`remote`.
    """

    def channel(self, df: Any, target: Any) -> Channel:
        """The sending end of an edge into ``target``."""
        return PipelineChannel(target) if df.peers == 1 else self.remote(df, target)

    def remote(self, df: Any, target: Any) -> Channel:
        """The sending end of an edge that crosses workers."""
        raise NotImplementedError


class Pipeline(Pact):
    """Records stay on the worker that produced them."""

    def remote(self, df: Any, target: Any) -> Channel:
        return PipelineChannel(target)

    def __repr__(self) -> str:
        return "Pipeline"


class Exchange(Pact):
    """Records go to the worker chosen by a deterministic 64-bit hash of their key.

    ``key`` is a field index (records are tuples), a function of the record, or ``None`` for the
    whole record.
    """

    def __init__(self, key: Key) -> None:
        if not (key is None or isinstance(key, int) or callable(key)):
            raise TypeError(f"exchange key must be a field index, a function or None, not {key!r}")
        self.key = key

    def remote(self, df: Any, target: Any) -> Channel:
        return ExchangeChannel(df, target, self.key)

    def __repr__(self) -> str:
        # Part of the dataflow's shape digest: never include addresses (they differ per process).
        return f"Exchange({self.key!r})" if self.key is None or isinstance(self.key, int) else "Exchange(fn)"


class Broadcast(Pact):
    """Every record goes to every worker."""

    def remote(self, df: Any, target: Any) -> Channel:
        return BroadcastChannel(df, target)

    def __repr__(self) -> str:
        return "Broadcast"


class Distribute(Pact):
    """Records go where ``partitioner(time, batch, peers)`` says: it returns one list per worker.

    For operators that route by their own rules (for example by a routing table that changes over
    time). The partitioner must put every record in exactly one list.
    """

    def __init__(self, partitioner: Callable[[Any, Sequence, int], list]) -> None:
        self.partitioner = partitioner

    def remote(self, df: Any, target: Any) -> Channel:
        return DistributeChannel(df, target, self.partitioner)

    def __repr__(self) -> str:
        return "Distribute"


def pact_of(exchange: Key | Pact | bool) -> Pact:
    """Turn the ``exchange=`` argument of operators into a pact (``None``/``False``: pipeline)."""
    if isinstance(exchange, Pact):
        return exchange
    if exchange is None or exchange is False:
        return Pipeline()
    return Exchange(exchange)


class Channel:
    """The sending end of one edge on one worker."""

    def push(self, time: Any, batch: Sequence) -> int:
        """Send ``batch`` at ``time``; return the number of records all receivers will consume."""
        raise NotImplementedError


class PipelineChannel(Channel):
    """Appends straight to the target input's queue on this worker."""

    __slots__ = ("target",)

    def __init__(self, target: Any) -> None:
        self.target = target

    def push(self, time: Any, batch: Sequence) -> int:
        self.target.deliver(time, batch)
        return len(batch)


class _RemoteChannel(Channel):
    def __init__(self, df: Any, target: Any) -> None:
        self.target = target
        self.index = df.index
        self.op_name = target.op.name
        self.pushers, puller = df.allocate_channel(target)

    def _send(self, worker: int, time: Any, part: Sequence) -> None:
        if worker == self.index:
            self.target.deliver(time, part)  # the local share skips the allocator
            return
        try:
            self.pushers[worker].push((time, part))
        except (TypeError, ValueError, OverflowError) as e:
            bad = next((r for r in part if not routing.serialisable(r)), None)
            raise TypeError(
                f"operator '{self.op_name}': record {bad!r:.200} at time {time!r} cannot be sent to "
                f"worker {worker}: records must be msgpack-serialisable ({e})"
            ) from e


class ExchangeChannel(_RemoteChannel):
    """Partitions each batch by key hash and sends one message per non-empty part."""

    def __init__(self, df: Any, target: Any, key: Key) -> None:
        super().__init__(df, target)
        self.key = key
        self.peers = df.peers

    def push(self, time: Any, batch: Sequence) -> int:
        try:
            parts = routing.partition(batch, self.peers, self.key)
        except Exception as e:
            raise type(e)(f"operator '{self.op_name}': exchange key failed: {e}") from e
        for w, part in enumerate(parts):
            if part:
                self._send(w, time, part)
        return len(batch)


class BroadcastChannel(_RemoteChannel):
    """Sends every batch to every worker."""

    def __init__(self, df: Any, target: Any) -> None:
        super().__init__(df, target)
        self.peers = df.peers

    def push(self, time: Any, batch: Sequence) -> int:
        for w in range(self.peers):
            self._send(w, time, batch)
        return len(batch) * self.peers


class DistributeChannel(_RemoteChannel):
    """Sends the per-worker lists computed by a partitioner."""

    def __init__(self, df: Any, target: Any, partitioner: Callable[[Any, Sequence, int], list]) -> None:
        super().__init__(df, target)
        self.partitioner = partitioner
        self.peers = df.peers

    def push(self, time: Any, batch: Sequence) -> int:
        parts = self.partitioner(time, batch, self.peers)
        if len(parts) != self.peers or sum(map(len, parts)) != len(batch):
            raise ValueError(
                f"operator '{self.op_name}': partitioner must split a batch of {len(batch)} records into "
                f"{self.peers} lists, got {len(parts)} lists holding {sum(map(len, parts))} records"
            )
        for w, part in enumerate(parts):
            if part:
                self._send(w, time, part)
        return len(batch)
