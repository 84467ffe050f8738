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
from ..errors import raise_with_context

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
        """A pipeline channel: records stay on this worker."""
        return PipelineChannel(target)

    def __repr__(self) -> str:
        return "Pipeline"


class Exchange(Pact):
    """Records go to the worker chosen by a deterministic 64-bit hash of their key.

    ``key`` is a field index (records are tuples), a function of the record, or ``None`` for the
    whole record.
    """

    def __init__(self, key: Key) -> None:
        if isinstance(key, bool) or not (key is None or isinstance(key, int) or callable(key)):
            # (True is an int: it routed tuples by their second field, silently)
            raise TypeError(f"exchange key must be a field index, a function or None, not {key!r}")
        self.key = key

    def remote(self, df: Any, target: Any) -> Channel:
        """An exchange channel routing by the hash of ``key``."""
        return ExchangeChannel(df, target, self.key)

    def __repr__(self) -> str:
        # Part of the dataflow's shape digest: never include addresses (they differ per process).
        return f"Exchange({self.key!r})" if self.key is None or isinstance(self.key, int) else "Exchange(fn)"


class Broadcast(Pact):
    """Every record goes to every worker."""

    def remote(self, df: Any, target: Any) -> Channel:
        """A broadcast channel: every batch goes to every worker."""
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
        """A channel sending the per-worker lists of ``partitioner``."""
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


def halved(encode: Callable[[list], Any], items: list, max_body: float) -> list[tuple[int, Any]]:
    """``items`` encoded as ``(count, body)`` pieces in order, each at most ``max_body`` bytes
    where it can be: the whole list, else its halves, recursively (a single item too large stays a
    piece of its own; the caller decides what that means)."""
    body = encode(items)
    if len(body) <= max_body or len(items) == 1:
        return [(len(items), body)]
    half = len(items) // 2
    return halved(encode, items[:half], max_body) + halved(encode, items[half:], max_body)


class Channel:
    """The sending end of one edge on one worker; ``producer`` names the operator whose output
    feeds it (set when the edge is connected), to blame for a record that fails to send later."""

    producer: str = ""

    def push(self, time: Any, batch: Sequence) -> int:
        """Send ``batch`` at ``time``; return the number of records all receivers will consume."""
        raise NotImplementedError

    def flush(self) -> None:
        """Send whatever :meth:`push` gathered (a channel that gathers lists itself in
        ``Context.pending``, which the dataflow flushes with its progress)."""


class PipelineChannel(Channel):
    """Appends straight to the target input's queue on this worker."""

    __slots__ = ("target", "producer")

    def __init__(self, target: Any) -> None:
        self.target = target
        self.producer = ""

    def push(self, time: Any, batch: Sequence) -> int:
        """Deliver ``batch`` to the target input on this worker; return its length."""
        self.target.deliver(time, batch)
        return len(batch)


#: Records a channel gathers for one other worker before it sends them as one message. Large
#: messages keep the per-message costs (ZeroMQ frames, wake-ups and deliveries at the receiver)
#: small whatever the number of peers: a batch exchanged among 16 workers is cut into 16 small
#: parts, which are gathered here with the parts of the next batches of the same time.
BUFFER_RECORDS = 4096
#: A part of at least this many records is encoded when it is cut, while its records are still in
#: the CPU's cache (for large parts a third of the cost of encoding them later, where the records
#: of one destination lie scattered in memory). A smaller part is gathered as it is and encoded
#: with the other small parts for the same worker once they hold this many records, or when the
#: message is sent: among many peers a batch is cut into many small parts, and one encoding per
#: part would cost more than its records.
EAGER_RECORDS = 128
#: Bytes a message may take beyond its records' encodings (its time, array headers).
SLACK = 4096


def body_limit(limit: int | None, slack: int = SLACK) -> float:
    """The bytes the encoded records of one message may take under a message size ``limit``
    (``None``: unlimited): all but ``slack`` for the message's time and headers, or all but a
    quarter of a limit smaller than four times ``slack`` (a limit of 1 KiB still carries records)."""
    return float("inf") if limit is None else limit - min(slack, limit // 4)


class _RemoteChannel(Channel):
    """A channel whose records may go to other workers: the local share is delivered at once; the
    records for each other worker are gathered per time (a large part encoded at once, small
    parts as they are: :data:`EAGER_RECORDS`), and sent when the gathered records reach
    :data:`BUFFER_RECORDS` or the allocator's message size limit, when records of another time
    arrive for that worker, or when the dataflow flushes the channel with its progress (see
    ``Context.pending``). A record that cannot be encoded raises when its part is encoded: at the
    push for a large part; for a small one, at the push that gathers the :data:`EAGER_RECORDS`-th
    unencoded record for its worker, or when its message is sent."""

    def __init__(self, df: Any, target: Any) -> None:
        self.target = target
        self.index = df.index
        self.peers = df.peers
        self.op_name = target.op.name
        self.pushers, puller = df.allocate_channel(target)
        remote = self.pushers[(self.index + 1) % self.peers]
        self._encode = remote.encode_items
        self._max_body = body_limit(remote.max_bytes)
        self._pending: list[Channel] = df.ctx.pending
        # Per worker, what is gathered for it (all at ``_times[worker]``): encoded pieces in
        # ``_bodies`` (a list while anything is gathered, else None) and unencoded records in
        # ``_raw``; ``_counts`` counts the records of both, ``_sizes`` the bytes of the pieces.
        self._bodies: list[list | None] = [None] * df.peers
        self._raw: list[list] = [[] for _ in range(df.peers)]
        self._counts = [0] * df.peers
        self._sizes = [0] * df.peers
        self._times: list[Any] = [None] * df.peers
        self._flagged = False  # listed in ``_pending``

    def _encoded(self, time: Any, part: list) -> list[tuple[int, Any]]:
        """``part`` as ``(records, body)`` pieces, each small enough for one message."""
        try:
            pieces = halved(self._encode, part, self._max_body)
        except (TypeError, ValueError, OverflowError) as e:
            bad = next((r for r in part if not self._encodes(r)), None)
            raise TypeError(
                f"operator '{self.op_name}': record {bad!r:.200} at time {time!r} cannot be sent to "
                f"another worker: records must be msgpack-serialisable ({e})"
            ) from e
        for i, (count, body) in enumerate(pieces):
            if len(body) > self._max_body:  # (one record: halving cannot help)
                record = part[sum(c for c, _ in pieces[:i])]
                raise ValueError(
                    f"operator '{self.op_name}': record {record!r:.200} at time {time!r} is {len(body):,} bytes "
                    f"encoded, more than one message may carry (max_message_bytes)")
        return pieces

    def _encodes(self, record: Any) -> bool:
        """True when ``record`` encodes as the channel encodes (with the registered extension
        types: a record holding an Arrow batch is not the one to blame)."""
        try:
            self._encode([record])
            return True
        except Exception:
            return False

    def _gathering(self, worker: int, time: Any) -> list:
        """The pieces gathered for ``worker`` at ``time`` (what was gathered at another time is sent first)."""
        bodies = self._bodies[worker]
        if bodies is not None:
            if self._times[worker] == time:
                return bodies
            self._ship(worker)
        bodies = self._bodies[worker] = []
        self._times[worker] = time
        if not self._flagged:
            self._flagged = True
            self._pending.append(self)
        return bodies

    def _gather(self, worker: int, time: Any, part: list) -> None:
        """Gather the records of ``part`` at ``time`` for ``worker`` (not this one)."""
        if len(part) >= EAGER_RECORDS:
            self._send(worker, time, self._encoded(time, part))
            return
        self._gathering(worker, time)
        raw = self._raw[worker]
        raw += part
        self._counts[worker] += len(part)
        if len(raw) >= EAGER_RECORDS:
            self._seal(worker, time)
        elif self._counts[worker] >= BUFFER_RECORDS:
            self._ship(worker)

    def _seal(self, worker: int, time: Any) -> None:
        """Encode the records gathered unencoded for ``worker`` and gather their pieces: at most
        :data:`EAGER_RECORDS` records wait unencoded, so the bytes gathered for a worker stay
        bounded by the message size limit however large the records."""
        raw = self._raw[worker]
        self._raw[worker] = []
        self._counts[worker] -= len(raw)
        self._send(worker, time, self._encoded(time, raw))

    def _send(self, worker: int, time: Any, pieces: list[tuple[int, Any]]) -> None:
        """Gather encoded ``pieces`` of records at ``time`` for ``worker`` (not this one)."""
        bodies = self._gathering(worker, time)
        for count, body in pieces:
            if bodies and self._sizes[worker] + len(body) > self._max_body:
                self._ship(worker)
                bodies = self._gathering(worker, time)
            bodies.append(body)
            self._counts[worker] += count
            self._sizes[worker] += len(body)
            if self._counts[worker] >= BUFFER_RECORDS:
                self._ship(worker)
                bodies = self._gathering(worker, time)

    def flush(self) -> None:
        """Send every gathered record."""
        self._flagged = False
        for worker, bodies in enumerate(self._bodies):
            if bodies is not None:
                self._ship(worker)

    def _ship(self, worker: int) -> None:
        """Send what is gathered for ``worker``: its unencoded records are encoded and join its
        pieces first (sending those that fill a message)."""
        if self._raw[worker]:
            self._seal(worker, self._times[worker])
        bodies, count = self._bodies[worker], self._counts[worker]
        self._bodies[worker] = None
        self._counts[worker] = self._sizes[worker] = 0
        if bodies:
            self.pushers[worker].push_items(self._times[worker], bodies, count)


class ExchangeChannel(_RemoteChannel):
    """Partitions each batch by key hash; each worker's part joins that worker's buffer."""

    def __init__(self, df: Any, target: Any, key: Key) -> None:
        super().__init__(df, target)
        self.key = key

    def push(self, time: Any, batch: Sequence) -> int:
        """Deliver this worker's share of ``batch`` at once and gather the others'; return the batch's length."""
        try:
            parts = routing.partition(batch, self.peers, self.key)
        except Exception as e:
            record = routing.unroutable(batch, self.key)
            raise_with_context(e, f"operator '{self.op_name}': exchange key failed for record {record!r:.200} "
                                  f"at time {time!r}")
        index = self.index
        for w, part in enumerate(parts):
            if part:
                if w == index:
                    self.target.deliver(time, part)  # the local share skips the allocator
                else:
                    self._gather(w, time, part)
        return len(batch)


class BroadcastChannel(_RemoteChannel):
    """Sends every batch to every worker."""

    def push(self, time: Any, batch: Sequence) -> int:
        """Deliver ``batch`` here and gather it for every other worker; return its length times the workers."""
        pieces = self._encoded(time, batch if type(batch) is list else list(batch))  # encoded once for all
        for w in range(self.peers):
            if w == self.index:
                self.target.deliver(time, batch)
            else:
                self._send(w, time, pieces)
        return len(batch) * self.peers


class DistributeChannel(_RemoteChannel):
    """Sends the per-worker lists computed by a partitioner."""

    def __init__(self, df: Any, target: Any, partitioner: Callable[[Any, Sequence, int], list]) -> None:
        super().__init__(df, target)
        self.partitioner = partitioner

    def push(self, time: Any, batch: Sequence) -> int:
        """Deliver this worker's list from the partitioner and gather the others'; return the batch's length."""
        parts = self.partitioner(time, batch, self.peers)
        if len(parts) != self.peers or sum(map(len, parts)) != len(batch):
            raise ValueError(
                f"operator '{self.op_name}': partitioner must split a batch of {len(batch)} records into "
                f"{self.peers} lists, got {len(parts)} lists holding {sum(map(len, parts))} records"
            )
        for w, part in enumerate(parts):
            if part:
                if w == self.index:
                    self.target.deliver(time, part)
                else:
                    self._gather(w, time, part)
        return len(batch)
