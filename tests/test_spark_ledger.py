"""The bridge's exactly-once bookkeeping driven directly, without sockets, Spark or a dataflow.

``Cluster`` wires W workers' :class:`Staging` and worker 0's :class:`CommitLedger` the way the
bridge's operators do: a publish step takes the ledger's decisions in order, applies each record to
every worker's staging and gives a commit the next epoch; the frontier then passes the published
epochs and the ledger releases the commit replies. A hypothesis test drives random interleavings of
writes (ended or not), commits, duplicate commits, aborts, publishing, frontier moves and a close,
and checks the outcome against what exactly-once means.
"""
from __future__ import annotations

import itertools

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_bridge.errors import BridgeError
from spark_bridge.ledger import CommitLedger, Staging
from spark_bridge.protocol import Request
from timely import TimelyError

W = 2


class Cluster:
    """W workers' staging and the coordinator's ledger of one source named ``ev``."""

    def __init__(self) -> None:
        self.stagings = [Staging("ev", w) for w in range(W)]
        self.ledger = CommitLedger("ev")
        self.epoch = 0  # the control operator's capability
        self.frontier = 0  # every worker emitted every epoch below this
        self.capability = True
        self.published: dict[int, tuple[tuple, list]] = {}  # epoch -> (key, frames emitted)
        self.replies: dict[int, list[dict]] = {}  # commit requester -> replies
        self.sent: dict[str, list] = {}  # token -> [(worker, frame)] sent
        self.final: set[str] = set()  # batch-write queries committed or aborted
        self.watermark: dict[str, int] = {}  # streaming query -> highest committed batch
        self._ids = itertools.count()

    # -- Spark's side ---------------------------------------------------------------------------------
    def write(self, query: str, batch: int, rows: list[int], end: bool = True) -> tuple[str, list[dict]]:
        """One task attempt sends ``rows[w]`` one-row frames to each worker w; the end replies."""
        token = f"t{next(self._ids)}"
        self.sent[token] = []
        replies = []
        for w, n in enumerate(rows):
            if not n:
                continue
            s = self.stagings[w]
            s.begin(token, query, batch, b"schema", ("task", token))
            for i in range(n):
                assert s.receive(token, 1, (token, w, i), ("task", token)) is None
                self.sent[token].append((w, (token, w, i)))
            if end:
                replies.append(s.end(token, n, n))
        return token, replies

    def tokens(self, *tokens: str) -> list:
        """The ``tokens`` field of a commit listing these attempts."""
        out = []
        for t in tokens:
            per: dict[int, int] = {}
            for w, _ in self.sent[t]:
                per[w] = per.get(w, 0) + 1
            out.append([t, [[w, r] for w, r in sorted(per.items())]])
        return out

    def commit(self, query: str, batch: int, tokens: list, final: bool, stopping: str | None = None) -> int:
        """A commit request; returns the requester (its replies collect in ``self.replies``)."""
        rid = next(self._ids)
        self.replies[rid] = []
        reply = self.ledger.request_commit(rid, query, batch, tokens, final, stopping)
        if reply is not None:
            self.replies[rid].append(reply)
        return rid

    # -- the operators ----------------------------------------------------------------------------
    def publish(self, limit: int = 1 << 30, may_close: bool = True) -> None:
        """The control operator's loop, and every worker's SparkSource applying the records."""
        while limit > 0 and (d := self.ledger.next_decision(may_close)) is not None:
            limit -= 1
            if d.kind == Request.CLOSE:
                assert self.capability and not self.ledger.pending, "close is the last decision"
                self.capability = False
                continue
            assert d.query is not None and d.batch is not None
            frames = []
            for s in self.stagings:
                got, _schema = s.apply(over_the_wire(d.record()))
                frames.extend(got)
            if d.final:
                self.final.add(d.query)
            elif d.kind == Request.COMMIT:
                self.watermark[d.query] = max(d.batch, self.watermark.get(d.query, -1))
            if d.kind == Request.COMMIT:
                self.ledger.committed(d, self.epoch)
                self.published[self.epoch] = ((d.query, d.batch), [f for _, f in frames])
                self.epoch += 1
            else:
                assert frames == []

    def decided(self, query: str, batch: int) -> bool:
        """Whether a published record decided the fate of every attempt of ``(query, batch)``."""
        return query in self.final or batch <= self.watermark.get(query, -1)

    def advance(self, to: int | None = None) -> list:
        """The probe's frontier moves to ``to`` (default: every published epoch); replies released."""
        self.frontier = self.epoch if to is None else max(self.frontier, min(to, self.epoch))
        released = self.ledger.acknowledge(lambda e: e < self.frontier)
        for rid, reply in released:
            assert reply["epoch"] < self.frontier, "a commit was answered before its epoch was emitted"
            self.replies[rid].append(reply)
        return released

    def finish(self) -> None:
        for rid, reply in self.ledger.finish():
            self.replies[rid].append(reply)
        for s in self.stagings:
            s.close()


def over_the_wire(record: tuple) -> tuple:
    """The record as another worker receives it from the broadcast (msgpack: plain str, tuples)."""
    return msgpack.unpackb(msgpack.packb(record, use_bin_type=True), use_list=False, raw=False)


def ok(reply: dict) -> bool:
    return bool(reply["ok"])


# -- examples ---------------------------------------------------------------------------------------------
def test_only_the_winning_attempt_is_published_and_losers_are_dropped():
    c = Cluster()
    loser, _ = c.write("q", 0, [2, 1])
    unfinished, _ = c.write("q", 0, [1, 0], end=False)
    winner, replies = c.write("q", 0, [1, 2])
    assert all(ok(r) and r["rows"] for r in replies)
    rid = c.commit("q", 0, c.tokens(winner), final=True)
    assert c.replies[rid] == []  # answered once the epoch is emitted everywhere
    c.publish()
    assert c.published == {0: (("q", 0), [f for _, f in c.sent[winner]])}
    assert all(not s.tokens for s in c.stagings), "every other attempt of the batch is dropped"
    assert sum(s.dropped_rows for s in c.stagings) == 3 + 1
    c.advance()
    assert c.replies[rid] == [{"ok": True, "epoch": 0, "rows": 3}]
    assert loser != unfinished


def test_commit_of_a_committed_or_pending_batch_is_idempotent():
    c = Cluster()
    t, _ = c.write("q", 0, [1, 1])
    first = c.commit("q", 0, c.tokens(t), final=True)
    again = c.commit("q", 0, c.tokens(t), final=True)  # Spark's driver retried while we publish
    c.publish()
    assert c.ledger.epochs == 1 and c.ledger.rows == 2
    c.advance()
    assert c.replies[first] == c.replies[again] == [{"ok": True, "epoch": 0, "rows": 2}]
    late = c.commit("q", 0, c.tokens(t), final=True)
    assert c.replies[late] == [{"ok": True, "epoch": 0, "duplicate": True, "rows": 0}]
    assert not c.ledger.pending
    # a late attempt of the committed batch is discarded and acknowledged as a duplicate
    _, replies = c.write("q", 0, [2, 0])
    assert replies == [{"ok": True, "rows": 2, "duplicate": True}]
    assert c.stagings[0].duplicate_rows == 2 and not c.stagings[0].tokens


def test_streaming_replays_below_the_watermark_are_duplicates():
    c = Cluster()
    for b in range(3):
        t, _ = c.write("s", b, [1, 0])
        c.commit("s", b, c.tokens(t), final=False)
    c.publish()
    c.advance()
    t, replies = c.write("s", 2, [1, 0])  # Spark's replay of its latest batch after a restart
    assert replies[0]["duplicate"]
    replay = c.commit("s", 2, c.tokens(t), final=False)
    assert c.replies[replay] == [{"ok": True, "epoch": 2, "duplicate": True, "rows": 0}]
    # an older batch: still a duplicate; its epoch is not kept (the ledger keeps a query's newest)
    t, replies = c.write("s", 1, [1, 0])
    assert replies[0]["duplicate"]
    replay = c.commit("s", 1, c.tokens(t), final=False)
    assert c.replies[replay] == [{"ok": True, "epoch": None, "duplicate": True, "rows": 0}]
    # a batch id skipped by the query but below its watermark: nothing to publish
    skipped = c.commit("s", -1, [], final=False)
    assert c.replies[skipped] == [{"ok": True, "epoch": None, "duplicate": True, "rows": 0}]
    assert c.ledger.epochs == 3 and not c.ledger.pending


def test_aborts_drop_attempts_and_never_undo_a_commit():
    c = Cluster()
    a, _ = c.write("s", 0, [1, 1])
    keep, _ = c.write("s", 0, [0, 1])
    assert c.ledger.request_abort("s", 0, c.tokens(a), final=False) == {"ok": True}
    c.publish()
    assert a not in c.stagings[0] and a not in c.stagings[1] and keep in c.stagings[1]
    assert c.published == {}
    c.commit("s", 0, c.tokens(keep), final=False)  # the retried batch commits
    c.publish()
    assert c.ledger.request_abort("s", 0, c.tokens(keep), final=False) == {"ok": True, "ignored": True}
    assert not c.ledger.pending
    # a batch write's abort closes its query: every attempt goes, later ones are discarded
    b, _ = c.write("b", 0, [2, 2])
    assert c.ledger.request_abort("b", 0, [], final=True) == {"ok": True}
    c.publish()
    assert b not in c.stagings[0]
    _, replies = c.write("b", 0, [1, 0])
    assert replies[0]["duplicate"]
    assert [k for k, _ in c.published.values()] == [("s", 0)]


def test_replies_wait_until_the_frontier_passes_the_epoch():
    c = Cluster()
    rids = []
    for q in ("a", "b", "c"):
        t, _ = c.write(q, 0, [1, 0])
        rids.append(c.commit(q, 0, c.tokens(t), final=True))
    c.publish()
    assert c.epoch == 3
    assert c.advance(0) == [] and all(c.replies[r] == [] for r in rids)
    assert [rid for rid, _ in c.advance(2)] == rids[:2]
    assert c.replies[rids[2]] == []
    assert [rid for rid, _ in c.advance()] == rids[2:]
    assert [c.replies[r][0]["epoch"] for r in rids] == [0, 1, 2]


def test_close_rejects_new_commits_and_fails_waiting_ones_at_finish():
    c = Cluster()
    t, _ = c.write("q", 0, [1, 1])
    pending = c.commit("q", 0, c.tokens(t), final=True)
    c.ledger.request_close()
    c.ledger.request_close()  # idempotent
    assert not c.ledger.open
    u, _ = c.write("r", 0, [1, 0])
    refused = c.commit("r", 0, c.tokens(u), final=True)
    assert c.replies[refused][0]["kind"] == "stopping" and "is closed" in c.replies[refused][0]["error"]
    retry = c.commit("q", 0, c.tokens(t), final=True)  # a retry of the pending commit still waits
    assert c.replies[retry] == []
    assert c.ledger.request_abort("r", 0, c.tokens(u), final=True) == {"ok": True}
    c.publish(limit=1)
    assert c.capability and not c.ledger.settled
    c.publish(may_close=False)  # a stopping bridge holds the close for its grace period
    assert c.capability
    c.publish()
    assert not c.capability and not c.ledger.settled  # the commit's reply still waits on the frontier
    c.advance()
    assert c.ledger.settled
    c.finish()
    assert c.replies[pending] == c.replies[retry] == [{"ok": True, "epoch": 0, "rows": 2}]
    assert all(not s.tokens for s in c.stagings)


def test_finish_fails_commits_that_never_published():
    ledger = CommitLedger("ev")
    assert ledger.request_commit("spark", "q", 0, [], final=True) is None
    ledger.request_close()
    assert ledger.next_decision().kind == Request.COMMIT
    assert ledger.next_decision().kind == Request.CLOSE
    assert ledger.settled  # the commit was taken but never told committed: its requester still waits
    assert ledger.finish() == [("spark", {"ok": False, "kind": "stopping",
                                          "error": "stream 'ev' closed before the commit"})]
    assert ledger.done and not ledger.open


def test_a_stopping_bridge_refuses_new_commits_but_answers_committed_ones():
    c = Cluster()
    t, _ = c.write("q", 0, [1, 0])
    c.commit("q", 0, c.tokens(t), final=True)
    c.publish()
    again = c.commit("q", 0, c.tokens(t), final=True, stopping="shutting down")
    assert c.replies[again] == []  # decided, not yet emitted everywhere: waits, never refused
    c.advance()
    assert c.replies[again] == [{"ok": True, "epoch": 0, "rows": 1}]
    late = c.commit("q", 0, c.tokens(t), final=True, stopping="shutting down")
    assert c.replies[late][0]["duplicate"]
    new = c.commit("r", 0, [], final=True, stopping="shutting down")
    assert c.replies[new] == [{"ok": False, "kind": "stopping", "error": "shutting down"}]


# -- staging --------------------------------------------------------------------------------------------
def test_staging_refuses_writes_when_stopping_or_closed_and_tells_the_writer_once():
    s = Staging("ev", 0)
    st = s.begin("t1", "q", 0, b"", "task", stopping="bye")
    assert st.rejection() == {"ok": False, "kind": "stopping", "error": "bye"}
    assert s.receive("t1", 5, "frame", "task") is None  # already told
    assert s.end("t1", 5, 1, stopping="bye")["kind"] == "stopping" and "t1" not in s
    s.close()
    st = s.begin("t2", "q", 0, b"", None)
    assert st.rejection() is None  # nobody to tell yet
    reply = s.receive("t2", 1, "frame", "task")  # the writer's next batch learns it at once
    assert reply["kind"] == "error" and "stream 'ev' is closed" in reply["error"]
    assert s.receive("t2", 1, "frame", "task") is None
    assert s.dropped_rows == 0 and s.tokens["t2"].rows == 0


def test_end_with_counts_that_differ_from_what_arrived_fails_the_write():
    s = Staging("ev", 3)
    s.begin("t", "q", 0, b"", "task")
    s.receive("t", 4, "f", "task")
    reply = s.end("t", 5, 1)
    assert not reply["ok"] and "worker 3 received 4 rows in 1 batches of write t, the task sent 5 in 1" in reply["error"]
    assert "t" not in s and s.dropped_rows == 4


def test_a_commit_listing_rows_this_worker_did_not_stage_is_refused_not_fatal():
    s = Staging("ev", 1)
    told: list[str] = []
    s.report = told.append
    s.begin("t", "q", 0, b"", "task")
    s.receive("t", 2, "f", "task")
    assert s.apply((Request.COMMIT.value, "q", 0, [["t", [[1, 2]]]], True)) == ([], None)
    assert "lists 2 rows of task attempt t on worker 1, but this worker staged 2 rows (not ended)" in told[0]
    assert s.apply(("commit", "q", 1, [["gone", [[1, 1]]]], True)) == ([], None)
    assert "staged nothing" in told[1]
    assert s.apply(("commit", "q", 1, [["elsewhere", [[0, 9]]]], True)) == ([], None)  # not ours
    assert len(told) == 2 and s.refused_rows == 3 and not s.tokens


def test_streaming_commits_out_of_batch_order_are_refused():
    c = Cluster()
    t5, _ = c.write("s", 5, [1, 1])
    t4, _ = c.write("s", 4, [1, 0])
    first = c.commit("s", 5, c.tokens(t5), final=False)
    late = c.commit("s", 4, c.tokens(t4), final=False)  # queued behind batch 5: refused at once
    assert c.replies[late][0]["ok"] is False and "after its batch 5" in c.replies[late][0]["error"]
    c.publish()
    c.advance()
    assert c.replies[first] == [{"ok": True, "epoch": 0, "rows": 2}]
    assert c.ledger.epochs == 1 and all(not s.tokens for s in c.stagings)


def test_fail_open_rejects_unfinished_writes_only():
    s = Staging("ev", 0)
    s.begin("done", "q", 0, b"", "a")
    s.end("done", 0, 0)
    s.begin("open", "q", 0, b"", "b")
    assert list(s.fail_open("stopping now")) == [("b", "open", {"ok": False, "kind": "stopping",
                                                                "error": "stopping now"})]
    assert list(s.fail_open("again")) == []


def test_bridge_errors_are_timely_errors():
    assert issubclass(BridgeError, TimelyError) and issubclass(BridgeError, RuntimeError)


# -- random interleavings against the definition of exactly-once -------------------------------------------
KEYS = [("s", 0), ("s", 1), ("b1", 0), ("b2", 0)]  # "s" streams; "b1", "b2" are batch writes
FINAL = {"s": False, "b1": True, "b2": True}

ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.sampled_from(KEYS), st.lists(st.integers(0, 2), min_size=W, max_size=W),
              st.booleans()),
    st.tuples(st.just("commit"), st.sampled_from(KEYS), st.integers(-1, 3)),
    st.tuples(st.just("abort"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("publish"), st.integers(1, 3)),
    st.tuples(st.just("advance"), st.integers(0, 4)),
    st.just(("close",)),
), max_size=40)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_interleavings_publish_each_batch_once_with_its_winning_rows(script):
    c = Cluster()
    staged: dict[tuple, list[str]] = {k: [] for k in KEYS}  # ended attempts Spark may still commit
    aborted: set[str] = set()
    aborted_final: set[str] = set()
    highest: dict[str, int] = {}  # streaming: Spark commits a query's batches in order
    first: dict[tuple, list] = {}  # key -> tokens of the commit request that was queued first
    requests: list[tuple[int, tuple]] = []
    for op in script:
        if op[0] == "write":
            _, key, rows, end = op
            decided = c.decided(*key)
            token, replies = c.write(*key, rows, end)
            assert all(r.get("duplicate", False) == decided for r in replies), "a replay must be discarded"
            if end and replies and all(ok(r) and not r.get("duplicate") for r in replies):
                staged[key].append(token)
        elif op[0] == "commit":
            _, key, pick = op
            query, batch = key
            if (FINAL[query] and query in aborted_final) or batch < highest.get(query, -1):
                continue  # Spark commits no aborted batch write, and a stream's batches in order
            live = [t for t in staged[key] if t not in aborted]
            tokens = [] if pick < 0 or not live else c.tokens(live[pick % len(live)])
            highest[query] = max(batch, highest.get(query, -1))
            rid = c.commit(query, batch, tokens, FINAL[query])
            if not c.replies[rid] and key not in first:
                first[key] = tokens
            requests.append((rid, key))
        elif op[0] == "abort":
            _, key, pick = op
            query, batch = key
            live = [t for t in staged[key] if t not in aborted]
            tokens = c.tokens(live[pick % len(live)]) if live else []
            reply = c.ledger.request_abort(query, batch, tokens, FINAL[query])
            if not reply.get("ignored") and c.ledger.open:
                aborted.update(t for t, _ in tokens)
                if FINAL[query]:
                    aborted_final.add(query)
        elif op[0] == "publish":
            c.publish(op[1])
        elif op[0] == "advance":
            c.advance(c.frontier + op[1])
        else:
            c.ledger.request_close()
        for s in c.stagings:  # invariant: no attempt of a decided batch stays staged
            assert not any(not a.discard and c.decided(a.query, a.batch) for a in s.tokens.values())
    c.ledger.request_close()
    c.publish()
    c.advance()
    assert c.ledger.settled
    c.finish()

    # each batch is published at most once, at consecutive epochs, with the rows of the attempts its
    # first queued commit listed, every row once
    keys = [k for k, _ in c.published.values()]
    assert sorted(c.published) == list(range(len(keys))) and len(set(keys)) == len(keys)
    emitted = [f for _, frames in c.published.values() for f in frames]
    assert len(emitted) == len(set(emitted))
    for key, frames in c.published.values():
        assert sorted(frames) == sorted(f for t, _ in first[key] for _, f in c.sent[t])
    assert set(first) == set(keys), "a queued commit was lost"
    # every commit request got exactly one reply, consistent with the epoch its batch was published at
    epoch_of = {k: e for e, (k, _) in c.published.items()}
    for rid, key in requests:
        [reply] = c.replies[rid]
        if ok(reply) and reply["epoch"] is not None:
            assert reply["epoch"] == epoch_of[key]
        elif ok(reply):
            assert reply["duplicate"] and not FINAL[key[0]]
        else:
            assert reply["kind"] == "stopping" and key not in first
    # nothing stays staged, and every row sent was published, dropped or counted as a duplicate
    assert all(not s.tokens for s in c.stagings)
    sent = sum(len(frames) for frames in c.sent.values())
    dropped = sum(s.dropped_rows + s.duplicate_rows for s in c.stagings)
    assert sent == len(emitted) + dropped
