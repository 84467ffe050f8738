"""Exactly-once bookkeeping of one bridge source: no sockets, no dataflow.

The server and the bridge's operators feed these objects events and get replies back:

* :class:`Staging` (every worker): the rows each Spark task attempt sent to this worker, under the
  attempt's random *token*, until a commit or abort record decides their fate.
* :class:`CommitLedger` (worker 0's coordinator): turns commit, abort and close requests into an
  ordered queue of :class:`Decision`\\ s, remembers the epoch at which each ``(query, batch)`` was
  committed, and holds the replies to a commit until the stream's frontier has passed its epoch.

Exactly-once rests on two facts. A commit decision lists the winning tokens with their row counts
per worker, so only those attempts' rows are ever emitted, and every other attempt of the batch is
dropped when the decision arrives. And a batch is decided at most once: the ledger answers a
repeated commit from ``committed`` (or, for streaming queries, from the watermark of the highest
committed batch) without a new decision.

The ledger stays bounded for streaming queries, which commit a micro-batch per trigger for as long
as the job runs: a streaming query's batch at or below its watermark is a duplicate whatever its
number, so the ledger keeps only its newest committed batch (the one Spark retries after a restart,
answered with its epoch as before; an older one is answered as a duplicate without its epoch), and,
with checkpoints, the batches a checkpoint not yet offered needs (:meth:`CommitLedger.retain_from`).
A batch-write query's batch is kept for good.

Staged rows that no commit or abort ever decides (the Spark driver died between its tasks' writes
and its commit) *expire*: once the attempts of a ``(query, batch)`` saw no write activity on a
worker for :data:`EXPIRY_FACTOR` times their write's ``timeout`` option (10 minutes with the
default 30 s), that worker proposes them to the coordinator, whose ledger decides an expiry record
unless the batch is already decided. The record reaches every worker through the dataflow, which
drops those attempts when it arrives; the ledger refuses any later commit that lists one of them
(nothing of it is applied: Spark fails the write, which can be written again). So no commit is
ever decided for rows a worker dropped, and exactly-once holds. A write whose tasks send a worker
nothing for that long while the write still runs fails the same way: raise its ``timeout``.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, NamedTuple

from . import protocol as P
from .protocol import Request

Key = tuple[str, int]  # (query, batch)
Reply = tuple[Any, dict]  # (requester, reply)
Entry = tuple[str, int, bool, int]  # (query, batch, final, epoch) of a committed batch
#: The kind of a decision that publishes again an epoch committed before a restart (its rows come
#: from the commit log: :class:`spark_bridge.durable.SourceDurability`).
REPLAY = "replay"
#: Staged attempts of a ``(query, batch)`` expire after this many times their write's ``timeout``
#: without write activity on a worker (see the module's docstring).
EXPIRY_FACTOR = 20
#: The ``timeout`` of a write whose header does not say (``spark_bridge.client.DEFAULT_TIMEOUT``).
DEFAULT_WRITE_TIMEOUT = 30.0


def expiry_seconds(timeout: float | None) -> float:
    """Seconds without activity after which the staged attempts of a write with that ``timeout`` expire."""
    return EXPIRY_FACTOR * (DEFAULT_WRITE_TIMEOUT if timeout is None else float(timeout))


class Staged:
    """The rows one write task attempt sent to this worker for one batch."""

    __slots__ = ("query", "batch", "schema", "frames", "rows", "ended", "discard", "error", "kind", "writer",
                 "notified")

    def __init__(self, query: str, batch: int, schema: bytes, writer: Any) -> None:
        self.query = query
        self.batch = batch
        self.schema = schema  # Arrow IPC schema of the frames
        self.frames: list = []  # [(rows, serialized RecordBatch)]
        self.rows = 0
        self.ended = False  # the task sent its end-of-data and it matched what arrived
        self.discard = False  # a replay of a batch already decided: its rows are counted, not kept
        self.error: str | None = None
        self.kind = "error"  # the reply kind of ``error``
        self.writer = writer  # whom to tell early that the write failed (opaque to this module)
        self.notified = False

    def fail(self, message: str, kind: str = "error") -> None:
        """Mark the write failed; its rows are refused from now on."""
        self.error = message
        self.kind = kind

    def rejection(self) -> dict | None:
        """The error reply to send the writer now: once, and only if the write failed."""
        if self.error is None or self.writer is None or self.notified:
            return None
        self.notified = True
        return P.error(self.error, self.kind)


class Staging:
    """The staged write attempts of one source on one worker."""

    def __init__(self, name: str, worker: int) -> None:
        self.name = name
        self.worker = worker
        self.tokens: dict[str, Staged] = {}
        self._by_batch: dict[Key, set[str]] = {}  # the live (undecided) tokens of each batch
        self._watermark: dict[str, int] = {}  # query -> highest committed batch (streaming queries)
        self._final: set[str] = set()  # batch-write queries already committed or aborted
        self.closed = False  # this worker's source is complete: no write is accepted any more
        self.dropped_rows = 0  # rows of losing, failed or aborted attempts
        self.duplicate_rows = 0  # rows of replays of batches already committed
        self.refused_rows = 0  # rows a commit listed for attempts this worker did not stage whole
        self.expired_rows = 0  # rows of attempts dropped by an expiry record (also in dropped_rows)
        self.report: Callable[[str], None] = _stderr  # where a refused part of a commit is told
        self.clock: Callable[[], float] = time.monotonic
        # Of each live batch: its last write activity here, its expiry time (the longest of its
        # attempts'), and when its attempts were last proposed for expiry.
        self._touched: dict[Key, float] = {}
        self._expiry: dict[Key, float] = {}
        self._proposed: dict[Key, float] = {}

    def __contains__(self, token: str) -> bool:
        return token in self.tokens

    def _decided(self, query: str, batch: int) -> bool:
        return query in self._final or batch <= self._watermark.get(query, -1)

    def restore(self, entries: Iterable[Entry]) -> None:
        """Batches committed before a restart: a replay of one is discarded like any decided batch."""
        for query, batch, final, _ in entries:
            if final:
                self._final.add(query)
            else:
                self._watermark[query] = max(batch, self._watermark.get(query, -1))

    def begin(self, token: str, query: str, batch: int, schema: bytes, writer: Any,
              stopping: str | None = None, expiry: float | None = None) -> Staged:
        """A task attempt starts writing ``(query, batch)``; ``stopping``: the message refusing it
        because the bridge is shutting down; ``expiry``: seconds without activity after which the
        batch's attempts here expire (default: :func:`expiry_seconds` of the default timeout)."""
        st = Staged(query, batch, schema, writer)
        self.tokens[token] = st
        if stopping is not None:
            st.fail(stopping, "stopping")
        elif self.closed:
            st.fail(f"stream '{self.name}' is closed: the timely job accepts no more writes to it")
        elif self._decided(query, batch):
            st.discard = True
        else:
            key = (query, batch)
            self._by_batch.setdefault(key, set()).add(token)
            self._expiry[key] = max(self._expiry.get(key, 0.0), expiry_seconds(None) if expiry is None else expiry)
            self._touched[key] = self.clock()
        return st

    def _touch(self, st: Staged) -> None:
        key = (st.query, st.batch)
        if key in self._touched:
            self._touched[key] = self.clock()

    def expired(self, now: float) -> list[tuple[str, int, list[str]]]:
        """``(query, batch, tokens)`` of every undecided batch whose attempts saw no write activity
        here for their expiry time: to propose to the coordinator (again after another expiry time
        if they are still staged then)."""
        out = []
        for key, tokens in self._by_batch.items():
            last = max(self._touched.get(key, now), self._proposed.get(key, -1.0))
            if now - last >= self._expiry.get(key, 0.0):
                self._proposed[key] = now
                out.append((key[0], key[1], sorted(tokens)))
        return out

    def idle(self, query: str, batch: int, now: float) -> bool:
        """Whether ``(query, batch)`` saw no write activity here for its expiry time (or has nothing staged here)."""
        key = (query, batch)
        return key not in self._touched or now - self._touched[key] >= self._expiry[key]

    def receive(self, token: str, rows: int, frame: Any, writer: Any) -> dict | None:
        """One record batch of a staged write arrived; returns the rejection to send, if any."""
        st = self.tokens[token]
        self._touch(st)
        if st.discard:
            self.duplicate_rows += rows
        elif st.error is None:
            st.frames.append((rows, frame))
            st.rows += rows
        else:
            if not st.notified:
                st.writer = writer
            return st.rejection()
        return None

    def end(self, token: str, rows: int, batches: int, stopping: str | None = None) -> dict:
        """The task says it sent ``rows`` in ``batches`` for ``token``: the reply to its end-of-data."""
        st = self.tokens[token]
        self._touch(st)
        if stopping is not None and not st.discard:
            self.drop([token])
            return P.error(stopping, "stopping")
        if st.error is not None:
            self.drop([token])
            return P.error(st.error, st.kind)
        if st.discard:
            del self.tokens[token]
            return P.ok(rows=rows, duplicate=True)
        if st.rows != rows or len(st.frames) != batches:
            self.drop([token])
            return P.error(f"worker {self.worker} received {st.rows} rows in {len(st.frames)} batches "
                           f"of write {token}, the task sent {rows} in {batches}")
        st.ended = True
        return P.ok(rows=st.rows)

    def drop(self, tokens: Iterable[str]) -> None:
        """Forget these attempts (their rows count as dropped)."""
        for t in list(tokens):
            st = self.tokens.pop(t, None)
            if st is None:
                continue
            self.dropped_rows += st.rows
            key = (st.query, st.batch)
            live = self._by_batch.get(key)
            if live is not None:
                live.discard(t)
                if not live:
                    del self._by_batch[key]
                    for times in (self._touched, self._expiry, self._proposed):
                        times.pop(key, None)

    def apply(self, record: tuple) -> tuple[list, bytes | None]:
        """Apply a decision record (see :meth:`Decision.record`): the frames it publishes here, in
        token order, and their schema (``([], None)`` for an abort)."""
        kind, query, batch, tokens, final = record
        if kind == Request.COMMIT:
            return self._take(query, batch, tokens, final)
        if kind == Request.EXPIRE:  # tokens: the attempts' tokens, no rows
            self.expired_rows += sum(self.tokens[t].rows for t in tokens if t in self.tokens)
            self.drop(tokens)
            return [], None
        if final:
            self._final.add(query)
            self.drop(list(self._by_batch.get((query, batch), ())))
        else:
            self.drop(t for t, _ in tokens)
        return [], None

    def unstaged(self, query: str, batch: int, tokens: list) -> Iterator[tuple[str, int, str]]:
        """``(token, rows, message)`` for each attempt a commit lists with rows on this worker that
        this worker did not stage whole (never from Spark, which commits only attempts every worker
        acknowledged as staged: a forged or corrupted commit)."""
        for token, per_worker in tokens:
            want = {int(w): int(r) for w, r in per_worker}.get(self.worker, 0)
            st = self.tokens.get(token)
            if want and (st is None or not st.ended or st.rows != want):
                have = "nothing" if st is None else f"{st.rows} rows{'' if st.ended else ' (not ended)'}"
                yield token, want, (f"stream '{self.name}': commit of query {query} batch {batch} lists {want} rows "
                                    f"of task attempt {token} on worker {self.worker}, but this worker staged {have}")

    def _take(self, query: str, batch: int, tokens: list, final: bool) -> tuple[list, bytes | None]:
        skip = set()  # refused attempts, and those taken already (a commit listing one twice)
        for token, rows, message in self.unstaged(query, batch, tokens):
            # Refused here (worker 0's coordinator refuses such commits for its own share first):
            # a bad commit must not take the job down.
            self.refused_rows += rows
            skip.add(token)
            self.report(f"{message}: refused, those rows are not emitted")
        frames: list = []
        schema = None
        for token, per_worker in tokens:
            if token in skip or not {int(w): int(r) for w, r in per_worker}.get(self.worker, 0):
                continue
            skip.add(token)
            st = self.tokens[token]
            frames.extend(st.frames)
            schema = st.schema
            st.rows = 0  # taken: dropped below with the other attempts, uncounted
        if final:
            self._final.add(query)
        else:
            self._watermark[query] = max(batch, self._watermark.get(query, -1))
        # Invariant: once a batch is decided, no attempt of it (or of an earlier batch of a
        # streaming query) stays staged, and begin() discards any that arrives later.
        self.drop([t for (q, b), ts in self._by_batch.items() if q == query and (final or b <= batch) for t in ts])
        return frames, schema

    def fail_open(self, message: str) -> Iterator[tuple[Any, str, dict]]:
        """Fail every write still in progress (the bridge stops): ``(writer, token, rejection)`` to send."""
        for token, st in list(self.tokens.items()):
            if not st.ended and not st.discard:
                st.fail(message, "stopping")
                reply = st.rejection()
                if reply is not None:
                    yield st.writer, token, reply

    def close(self) -> None:
        """This worker's source is complete: drop every staged attempt, accept no more."""
        self.closed = True
        self.drop(list(self.tokens))


def _stderr(message: str) -> None:
    print(f"spark_bridge: {message}", file=sys.stderr, flush=True)


class Decision(NamedTuple):
    """What the coordinator decided, in the order the control operator must publish it."""

    kind: Request | str  # COMMIT, ABORT, EXPIRE, CLOSE or REPLAY
    query: str | None = None
    batch: int | None = None
    tokens: list | None = None  # [[token, [[worker, rows], ...]], ...] (EXPIRE: [token, ...])
    final: bool = False  # a batch write (its query is never reused), not a streaming micro-batch
    rows: int = 0
    epoch: int | None = None  # REPLAY: the epoch it was committed at (and is published at again)

    def record(self) -> tuple:
        """The dataflow record broadcast to every worker's :meth:`Staging.apply` (a REPLAY's: to
        the source's :meth:`~spark_bridge.durable.SourceDurability.replayed`, its epoch in place of tokens)."""
        return (self.kind, self.query, self.batch, self.epoch if self.kind == REPLAY else self.tokens, self.final)

    @property
    def publishes(self) -> bool:
        """Whether the decision takes an epoch of its own (a commit, or the replay of one)."""
        return self.kind in (Request.COMMIT, REPLAY)


class CommitLedger:
    """Worker 0's decisions for one source, and the replies that wait on them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._decisions: deque[Decision] = deque()
        # -> epoch: every batch-write query's batch, and the batches of each streaming query that
        # ``_floor`` keeps (``_batches``; the ones below them are answered from the watermark)
        self._committed: dict[Key, int] = {}
        self._batches: dict[str, deque[int]] = {}  # streaming query -> its batches in ``_committed``, ascending
        self._floor: int | None = None  # see retain_from
        self._finals: set[str] = set()  # the batch-write queries among them
        self._watermark: dict[str, int] = {}  # query -> highest committed batch (streaming queries)
        self._queued: dict[str, int] = {}  # query -> highest batch with a commit decision (streaming queries)
        self._waiting: dict[Key, list] = {}  # requesters of a commit decided or queued, not yet answered
        self._acks: list[tuple[int, Key, int]] = []  # (epoch, key, rows) published, not yet passed
        # Attempts an expiry decision discarded: a commit listing one is refused. (Random tokens,
        # one per task attempt of a write whose Spark driver never committed: a few bytes each.)
        self._expired: set[str] = set()
        self.close_requested = False
        self._close_taken = False  # the close decision left the queue: the capability is gone
        self.done = False
        self.epochs = 0
        self.rows = 0

    @property
    def open(self) -> bool:
        """Whether new writes, commits and aborts are accepted."""
        return not (self.close_requested or self.done)

    def request_commit(self, requester: Hashable, query: str, batch: int, tokens: list, final: bool,
                       stopping: str | None = None, unstaged: Callable[[], str | None] | None = None,
                       progress: bool = False) -> dict | None:
        """A commit request: its reply now, or None when it is answered later by :meth:`acknowledge`
        or :meth:`finish`. ``stopping``: the message refusing new commits (the bridge is stopping);
        ``unstaged()``: why a new commit lists attempts that were not staged, if it does (refused).
        ``progress``: the requester accepts a ``pending`` error reply now for a commit that is
        decided but not yet acknowledged (and still gets the final reply later, once)."""
        key = (query, batch)
        if key in self._waiting:
            # Decided (queued or published), not yet emitted everywhere: never answered as a
            # success before the frontier passes its epoch (with checkpoints: before it is logged).
            if requester not in self._waiting[key] or not progress:
                self._waiting[key].append(requester)
            return self._pending(key) if progress else None
        if key in self._committed:
            return P.ok(epoch=self._committed[key], duplicate=True, rows=0)
        if not final and batch <= self._watermark.get(query, -1):
            # Decided: a committed batch of a streaming query older than its newest is not kept.
            return P.ok(epoch=None, duplicate=True, rows=0)
        if stopping is not None:
            return P.error(stopping, "stopping")
        if not self.open:
            return P.error(f"stream '{self.name}' is closed: commit of batch {batch} rejected", "stopping")
        if not final and batch < self._queued.get(query, -1):
            # Invariant: a streaming query's commits are decided in batch order (publishing a batch
            # drops the staged attempts of every earlier batch of the query on every worker).
            return P.error(f"stream '{self.name}': commit of batch {batch} of streaming query {query} after its "
                           f"batch {self._queued[query]}: micro-batches commit in batch order; refused")
        gone = [t for t, _ in tokens if t in self._expired]
        if gone:
            # Invariant: no commit is decided after an expiry decision of one of its attempts (every
            # worker drops the attempt when that decision's record arrives).
            return P.error(f"stream '{self.name}': commit of query {query} batch {batch} refused: the rows staged "
                           f"for its task attempt {gone[0]}{f' (and {len(gone) - 1} more)' if len(gone) > 1 else ''} "
                           f"expired, no write activity for {EXPIRY_FACTOR} times the write's 'timeout' option "
                           f"without a commit, and were discarded; nothing of the write was applied: write it again")
        bad = unstaged() if unstaged is not None else None
        if bad is not None:
            return P.error(f"{bad}: commit refused")
        if not final:
            self._queued[query] = batch
        self._waiting[key] = [requester]
        rows = sum(int(r) for _, per in tokens for _, r in per)
        self._decisions.append(Decision(Request.COMMIT, query, batch, tokens, final, rows))
        return self._pending(key) if progress else None

    def _pending(self, key: Key) -> dict:
        """The ``pending`` reply of a decided commit that waits for every worker to emit its epoch."""
        epoch = self._committed.get(key)
        if epoch is None:  # a published streaming batch that a newer one of its query superseded
            epoch = next((e for e, k, _ in self._acks if k == key), None)
        at = "queued for the next epoch" if epoch is None else f"published at epoch {epoch}"
        return P.error(f"stream '{self.name}': the commit of query {key[0]} batch {key[1]} is decided ({at}) and "
                       f"waits for every worker to emit it", "pending", epoch=epoch)

    def request_abort(self, query: str, batch: int, tokens: list, final: bool) -> dict:
        """An abort request: queues an abort decision unless the batch is (being) committed."""
        key = (query, batch)
        if key in self._committed or key in self._waiting or (not final and batch <= self._watermark.get(query, -1)):
            return P.ok(ignored=True)  # (a streaming query's batches below its newest are not kept)
        if self.open:
            self._decisions.append(Decision(Request.ABORT, query, batch, tokens, final))
        return P.ok()

    def request_expire(self, query: str, batch: int, tokens: list[str]) -> dict:
        """A worker's proposal to discard the staged attempts ``tokens`` of ``(query, batch)``, which
        saw no write activity there for their expiry time: queues an expiry decision unless the
        batch is (being) committed, whose record drops them anyway. Any later commit listing one
        of them is refused."""
        if not self.open or (query, batch) in self._waiting or self.is_committed(query, batch):
            return P.ok(ignored=True)
        new = [t for t in tokens if t not in self._expired]
        if new:
            self._expired.update(new)
            self._decisions.append(Decision(Request.EXPIRE, query, batch, new))
        return P.ok()

    def request_close(self) -> dict:
        """Close the source once the decisions queued so far are published (idempotent)."""
        if not self.close_requested:
            self.close_requested = True
            self._decisions.append(Decision(Request.CLOSE))
        return P.ok()

    @property
    def pending(self) -> bool:
        """Whether a decision waits to be published."""
        return bool(self._decisions)

    def next_decision(self, may_close: bool = True) -> Decision | None:
        """The next decision to publish, or None; a close stays queued while ``may_close`` is False."""
        if not self._decisions or (self._decisions[0].kind == Request.CLOSE and not may_close):
            return None
        d = self._decisions.popleft()
        if d.kind == Request.CLOSE:
            self._close_taken = True
        return d

    def committed(self, decision: Decision, epoch: int) -> None:
        """The commit ``decision`` was published at ``epoch``."""
        query, batch = decision.query, decision.batch
        assert query is not None and batch is not None, "only commit decisions are committed"
        new = (query, batch) not in self._committed  # not new: the replay of a restored batch
        self._committed[(query, batch)] = epoch
        if decision.final:
            self._finals.add(query)
        else:
            self._watermark[query] = max(batch, self._watermark.get(query, -1))
            if new:
                self._keep(query, [batch])
            self._prune(query)
        self._acks.append((epoch, (query, batch), decision.rows))
        self.epochs += 1
        self.rows += decision.rows

    def restore(self, entries: Iterable[Entry], replay: Iterable[Any] = ()) -> None:
        """After a restart: the batches committed before it (``entries``), answered as duplicates
        from now on, and the logged epochs to publish again first (``replay``: objects with
        ``query``, ``batch``, ``final``, ``total`` and ``epoch``, in epoch order)."""
        streaming: dict[str, list[int]] = {}
        for query, batch, final, epoch in entries:
            if not final and (query, batch) not in self._committed:
                streaming.setdefault(query, []).append(batch)
            self._committed[(query, batch)] = epoch
            if final:
                self._finals.add(query)
            else:
                self._watermark[query] = max(batch, self._watermark.get(query, -1))
                self._queued[query] = max(batch, self._queued.get(query, -1))
        for query, batches in streaming.items():
            self._keep(query, batches)  # pruned at retain_from or the query's next commit
        for r in replay:
            self._decisions.append(Decision(REPLAY, r.query, r.batch, None, r.final, r.total, r.epoch))

    def _keep(self, query: str, batches: list[int]) -> None:
        """Track these new batches of streaming ``query`` (already in ``_committed``) in ``_batches``."""
        kept = self._batches.setdefault(query, deque())
        kept.extend(batches)
        if any(a >= b for a, b in zip(kept, itertools.islice(kept, 1, None))):
            self._batches[query] = deque(sorted(set(kept)))

    def _prune(self, query: str) -> None:
        """Forget the batches of streaming ``query`` that neither answer a retry with their epoch (its
        newest) nor belong to a checkpoint still to be offered (see :meth:`retain_from`). A query's
        batches are committed in batch order, so its epochs ascend with its batches."""
        kept = self._batches.get(query)
        while kept is not None and len(kept) > 1 and (
                self._floor is None or self._committed[(query, kept[1])] < self._floor):
            del self._committed[(query, kept.popleft())]

    def retain_from(self, epoch: int | None) -> None:
        """Which batches of streaming queries :meth:`history` keeps. ``epoch``: the checkpoint epoch
        offered last (the next checkpoint, at ``c > epoch``, saves each query's newest batch committed
        before ``c``): each query's batches committed at ``epoch`` or later, and its newest before
        ``epoch``. None (the default: no checkpoint to come): each query's newest batch only."""
        self._floor = epoch
        for query in self._batches:
            self._prune(query)

    def history(self) -> Iterator[Entry]:
        """The committed batches kept (restored ones included): every batch-write query's, and the
        batches of each streaming query that :meth:`retain_from` keeps (its newest at least)."""
        for (query, batch), epoch in self._committed.items():
            yield query, batch, query in self._finals, epoch

    def is_committed(self, query: str, batch: int) -> bool:
        """Whether ``(query, batch)`` is decided as committed: published, or for a streaming query at
        or below its watermark (its older batches are not kept, and a retry of one is a duplicate)."""
        return (query, batch) in self._committed or (
            query not in self._finals and batch <= self._watermark.get(query, -1))

    def acknowledge(self, passed: Callable[[int], bool]) -> list[Reply]:
        """Answer the commits whose epoch every worker has emitted (``passed(epoch)``)."""
        replies: list[Reply] = []
        for ack in [a for a in self._acks if passed(a[0])]:
            self._acks.remove(ack)
            epoch, key, rows = ack
            replies.extend((r, P.ok(epoch=epoch, rows=rows)) for r in self._waiting.pop(key, []))
        return replies

    @property
    def settled(self) -> bool:
        """The close was taken and every published commit answered: the ledger can :meth:`finish`."""
        return self._close_taken and not self._acks and not self._decisions

    def finish(self) -> list[Reply]:
        """Mark the ledger done; the failure replies of commit requests still waiting."""
        self.done = True
        msg = P.error(f"stream '{self.name}' closed before the commit", "stopping")
        replies = [(r, dict(msg)) for rs in self._waiting.values() for r in rs]
        self._waiting.clear()
        return replies
