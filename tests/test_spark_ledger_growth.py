"""The bridge's ledger of committed batches stays bounded for streaming queries.

A streaming query commits a micro-batch every trigger for as long as the job runs. A batch at or
below its query's watermark is a duplicate whatever its number, so worker 0's ledger keeps only a
streaming query's newest committed batch (the one Spark retries after a restart, answered with its
epoch) and, with checkpoints, the batches a checkpoint not yet offered needs; each checkpoint saves
one batch per streaming query. Batch-write (final) queries keep every batch. Without Spark, sockets
or a dataflow: :class:`Source` drives a source's ledger, staging and durability the way the
bridge's operators do, on one worker.
"""
from __future__ import annotations

import json
from pathlib import Path

from spark_bridge import protocol as P
from spark_bridge.durable import SourceDurability
from spark_bridge.ledger import REPLAY, CommitLedger, Staging
from spark_bridge.protocol import Request
from timely.checkpoint import Checkpointer, Store
from timely.checkpoint.checkpointer import JOB


class Source:
    """One worker's source ``events`` with checkpoints every ``every`` epochs under ``root``: the
    control operator's publishing, the data operator's logging and offers, Spark's commits."""

    def __init__(self, root: Path, every: int) -> None:
        self.ck = Checkpointer(Store(str(root), JOB), every, 0, 1)
        self.ledger, self.staging = CommitLedger("events"), Staging("events", 0)
        self.durable = SourceDurability(self.ck, "events", 0, 1, self.ledger, self.staging)
        self.epoch = self.ck.resume_epoch
        self.offers: list[tuple[int, dict]] = []  # (checkpoint epoch, changed blobs)
        offer = self.durable.participant.offer

        def spy(epoch: int, changed: dict, meta: object = None) -> None:
            self.offers.append((epoch, dict(changed)))
            offer(epoch, changed, meta)

        self.durable.participant.offer = spy
        self.epochs_of: dict[tuple[str, int], int] = {}  # (query, batch) -> epoch, committed here
        while (d := self.ledger.next_decision()) is not None:  # the logged epochs, published again
            assert d.kind == REPLAY and d.epoch == self.epoch
            self.durable.replayed(self.epoch)
            self.ledger.committed(d, self.epoch)
            self.epoch += 1
        self.ledger.acknowledge(lambda e: True)

    def write(self, token: str, query: str, batch: int) -> bool:
        """A task attempt writes one row of ``(query, batch)``; whether it was discarded as a replay."""
        st = self.staging.begin(token, query, batch, b"", None)
        self.staging.receive(token, 1, b"row", None)
        reply = self.staging.end(token, 1, 1)
        assert reply["ok"]
        return st.discard

    def commit(self, query: str, batch: int, final: bool = False, log: bool = True) -> int:
        """Spark writes and commits ``(query, batch)``; it is published (and logged) at the next epoch."""
        token = f"{query}/{batch}/{self.epoch}"
        assert not self.write(token, query, batch)
        assert self.ledger.request_commit("spark", query, batch, [[token, [[0, 1]]]], final) is None
        d = self.ledger.next_decision()
        assert d is not None and d.kind == Request.COMMIT
        frames, _ = self.staging.apply(d.record())
        assert len(frames) == 1
        if log:
            self.durable.log.append(self.epoch, d.record(), None, [])
        self.ledger.committed(d, self.epoch)
        self.epochs_of[(query, batch)] = self.epoch
        self.epoch += 1
        assert self.ledger.acknowledge(lambda e: True) == [("spark", P.ok(epoch=self.epoch - 1, rows=1))]
        return self.epoch - 1

    def offer(self, frontier: int) -> None:
        """The source's frontier reached ``frontier``: offer the checkpoints up to it."""
        self.durable.offer_through(frontier)
        self.ck.poll()

    def blob(self, query: str) -> bytes:
        """The newest blob of ``query`` offered to a checkpoint."""
        return next(c[f"q/{query}"] for _, c in reversed(self.offers) if f"q/{query}" in c)

    def kept(self, query: str) -> list[int]:
        """The batches of ``query`` the ledger keeps."""
        return sorted(b for q, b, _, _ in self.ledger.history() if q == query)

    def stop(self) -> None:
        """The job ends: every offered checkpoint is committed."""
        try:
            self.ck.flush()
        finally:
            self.ck.close()


def _duplicate(ledger: CommitLedger, query: str, batch: int, final: bool = False) -> dict | None:
    return ledger.request_commit("spark", query, batch, [["retry", [[0, 1]]]], final)


def test_a_streaming_querys_checkpoint_blob_and_ledger_stay_bounded(tmp_path):
    src = Source(tmp_path / "ck", every=10)
    try:
        sizes = {}
        for n in (1000, 10000):
            while src.epoch < n:  # one micro-batch per epoch, the frontier right behind it
                src.commit("stream-q", src.epoch, log=False)
                src.offer(src.epoch)
            sizes[n] = len(src.blob("stream-q"))
            assert json.loads(src.blob("stream-q")) == {"final": False, "batches": {str(n - 1): n - 1}}
            assert src.kept("stream-q") == [n - 1]
        assert sizes[10000] <= sizes[1000] + 2, f"the checkpoint blob grows with the query's age: {sizes}"
        assert sum(len(b or b"") for _, c in src.offers for b in c.values()) < 100 * len(src.offers)
    finally:
        src.stop()


def test_without_checkpoints_the_ledger_keeps_a_streaming_querys_newest_batch_only():
    ledger, staging = CommitLedger("ev"), Staging("ev", 0)
    for b in range(10_000):
        assert ledger.request_commit("spark", "s", b, [], False) is None
        d = ledger.next_decision()
        assert d is not None
        staging.apply(d.record())
        ledger.committed(d, b)
        assert ledger.acknowledge(lambda e: True) == [("spark", P.ok(epoch=b, rows=0))]
    assert list(ledger.history()) == [("s", 9999, False, 9999)]
    assert _duplicate(ledger, "s", 9999) == P.ok(epoch=9999, duplicate=True, rows=0)  # Spark's retry
    for old in (0, 17, 9998):
        assert _duplicate(ledger, "s", old) == P.ok(epoch=None, duplicate=True, rows=0)
        assert ledger.request_abort("s", old, [], False) == P.ok(ignored=True)  # never undoes a commit
        assert ledger.is_committed("s", old)
        assert staging.begin(f"late{old}", "s", old, b"", None).discard
    assert not ledger.is_committed("s", 10_000)
    assert not ledger.pending
    # a stopping bridge still answers a committed batch as a duplicate, and refuses a new one
    assert ledger.request_commit("spark", "s", 3, [], False, stopping="bye") == P.ok(epoch=None, duplicate=True,
                                                                                      rows=0)
    assert ledger.request_commit("spark", "s", 10_000, [], False, stopping="bye")["kind"] == "stopping"


def test_a_superseded_batch_still_waiting_for_its_reply_keeps_its_epoch_in_pending_replies():
    ledger = CommitLedger("ev")
    for b in range(2):  # published, not yet emitted everywhere
        ledger.request_commit(f"spark{b}", "s", b, [], False)
        d = ledger.next_decision()
        assert d is not None
        ledger.committed(d, 10 + b)
    assert [b for _, b, _, _ in ledger.history()] == [1]
    pending = ledger.request_commit("again", "s", 0, [], False, progress=True)
    assert pending is not None and pending["kind"] == "pending" and pending["epoch"] == 10
    assert "published at epoch 10" in pending["error"]
    replies = ledger.acknowledge(lambda e: True)
    assert replies == [("spark0", P.ok(epoch=10, rows=0)), ("again", P.ok(epoch=10, rows=0)),
                       ("spark1", P.ok(epoch=11, rows=0))]


def _checks(src: Source, streams: dict[str, int], writes: list[str]) -> None:
    """Spark retrying: each streaming query's latest batch (answered with its epoch), older batches
    (duplicates), and every batch write (with its epoch); replayed task attempts are discarded."""
    ledger = src.ledger
    for query, latest in streams.items():
        assert _duplicate(ledger, query, latest) == P.ok(epoch=src.epochs_of[(query, latest)], duplicate=True, rows=0)
        for old in (0, latest // 2, latest - 1):
            # (its epoch while a checkpoint still to be offered needs the batch)
            assert _duplicate(ledger, query, old) in (P.ok(epoch=None, duplicate=True, rows=0),
                                                      P.ok(epoch=src.epochs_of[(query, old)], duplicate=True, rows=0))
            assert ledger.request_abort(query, old, [], False) == P.ok(ignored=True)
            assert src.write(f"replay/{query}/{old}", query, old)
        assert src.write(f"replay/{query}/{latest}", query, latest)
    for query in writes:
        assert _duplicate(ledger, query, 0, final=True) == P.ok(epoch=src.epochs_of[(query, 0)], duplicate=True,
                                                                rows=0)
        assert src.write(f"replay/{query}", query, 0)
    assert not ledger.pending


def test_dedupe_of_latest_and_older_batches_survives_a_restore_and_batch_writes_keep_every_batch(tmp_path):
    src = Source(tmp_path / "ck", every=5)
    streams = {"stream-a": -1, "stream-b": -1}
    writes: list[str] = []
    try:
        for i in range(60):  # two streaming queries and batch writes, interleaved
            if i % 7 == 3:
                writes.append(f"write-{i}")
                src.commit(writes[-1], 0, final=True)
            else:
                query = "stream-a" if i % 3 else "stream-b"
                streams[query] += 1
                src.commit(query, streams[query])
            src.offer(src.epoch - 3)  # the source's frontier lags the ledger, as in a real job
            for query in streams:  # what the next checkpoint needs, and the newest: bounded
                assert len(src.kept(query)) <= 1 + 5 + 3
        _checks(src, streams, writes)
        assert sorted(q for q, _, final, _ in src.ledger.history() if final) == sorted(writes)
        for query in streams:  # a checkpoint saves one batch of a streaming query: its newest before it
            c, changed = next((c, ch) for c, ch in reversed(src.offers) if f"q/{query}" in ch)
            newest = max(b for (q, b), e in src.epochs_of.items() if q == query and e < c)
            assert json.loads(changed[f"q/{query}"]) == {"final": False,
                                                         "batches": {str(newest): src.epochs_of[(query, newest)]}}
        for query in writes:  # (those committed before the newest checkpoint; the log holds the others)
            if src.epochs_of[(query, 0)] >= max(c for c, _ in src.offers):
                continue
            assert json.loads(src.blob(query)) == {"final": True, "batches": {"0": src.epochs_of[(query, 0)]}}
    finally:
        src.stop()
    resumed = max(c for c, _ in src.offers)
    assert resumed < src.epoch  # the log holds the epochs after the checkpoint, published again
    again = Source(tmp_path / "ck", every=5)
    try:
        assert again.ck.resume_epoch == resumed and again.epoch == src.epoch
        again.epochs_of = src.epochs_of
        for query in streams:  # its newest batch before the checkpoint, and those the log replayed
            epochs = {b: e for (q, b), e in src.epochs_of.items() if q == query}
            newest = max(b for b, e in epochs.items() if e < resumed)
            assert again.kept(query) == sorted({newest, *(b for b, e in epochs.items() if e >= resumed)})
        assert sorted(q for q, _, final, _ in again.ledger.history() if final) == sorted(writes)
        _checks(again, streams, writes)
        # Spark goes on: the next micro-batch is a new commit
        assert again.commit("stream-a", streams["stream-a"] + 1) == src.epoch
        assert again.kept("stream-a")[-1] == streams["stream-a"] + 1
    finally:
        again.stop()


def test_a_checkpoint_taken_while_the_ledger_ran_ahead_keeps_the_watermark_of_its_epoch(tmp_path):
    src = Source(tmp_path / "ck", every=5)
    try:
        for b in range(12):  # epochs 10 and 11 are never logged everywhere: never acknowledged to Spark
            src.commit("stream-q", b, log=b < 10)
        src.offer(10)  # checkpoints 5 and 10, with the ledger at epoch 12 already
        assert json.loads(src.blob("stream-q")) == {"final": False, "batches": {"9": 9}}
    finally:
        src.stop()
    again = Source(tmp_path / "ck", every=5)
    try:
        assert again.ck.resume_epoch == 10 and again.epoch == 10
        assert _duplicate(again.ledger, "stream-q", 9) == P.ok(epoch=9, duplicate=True, rows=0)
        assert _duplicate(again.ledger, "stream-q", 4) == P.ok(epoch=None, duplicate=True, rows=0)
        assert again.commit("stream-q", 10) == 10  # batch 10 was lost with the workers: Spark writes it again
    finally:
        again.stop()


def test_a_checkpoint_of_an_older_version_holding_every_batch_is_restored_and_pruned():
    ledger = CommitLedger("ev")
    entries = [("s", b, False, b) for b in range(100)] + [("w", 0, True, 100)]
    ledger.restore(entries)
    ledger.retain_from(60)  # the checkpoint resumed from is at epoch 60
    assert sorted(ledger.history()) == [*[("s", b, False, b) for b in range(59, 100)], ("w", 0, True, 100)]
    ledger.retain_from(None)
    assert sorted(ledger.history()) == [("s", 99, False, 99), ("w", 0, True, 100)]
    assert _duplicate(ledger, "s", 99) == P.ok(epoch=99, duplicate=True, rows=0)
    assert _duplicate(ledger, "s", 42) == P.ok(epoch=None, duplicate=True, rows=0)
    assert _duplicate(ledger, "w", 0, final=True) == P.ok(epoch=100, duplicate=True, rows=0)
