"""The Spark bridge across a cluster failure (jobs with checkpoints: spark_bridge.durable).

Without Spark: the commit log (complete epochs only, duplicates answered from the restored
ledger, truncation, a corrupt file refused naming it) and the sink's saved epochs and durable
release point. With Spark (skipped without Java or pyspark): a 2-worker cluster under
``timely.launch --checkpoint --restarts`` loses a worker (SIGKILL) mid-stream, after a checkpoint
and with a committed epoch it does not cover; Spark keeps writing (retrying what failed while the
cluster was down) and reads back totals equal to Spark SQL's, every write in exactly one epoch.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spark_bridge import protocol as P
from spark_bridge.durable import CommitLog, SinkDurability, SourceDurability, ledger_blobs, ledger_entries
from spark_bridge.ledger import REPLAY, CommitLedger, Staging
from spark_bridge.protocol import Request
from spark_bridge.sinkbuffer import SinkBuffer
from timely.checkpoint import Checkpointer, CheckpointError, Store
from timely.checkpoint.checkpointer import JOB

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "key bigint, value bigint"


def _log(tmp_path: Path, index: int, peers: int) -> CommitLog:
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(tmp_path / "ck"))
    return CommitLog(fs, root, "events", index, peers)


def _commit(epoch: int, query: str | None = None) -> tuple:
    """A commit record of ``query`` (default ``q<epoch>``) with one attempt of 2 rows on each of 2 workers."""
    return (Request.COMMIT, query or f"q{epoch}", 0, [["tok", [[0, 2], [1, 2]]]], True)


def _frames(epoch: int, worker: int) -> list:
    return [(2, f"rows of epoch {epoch} on worker {worker}".encode())]


def test_only_epochs_every_worker_logged_are_committed(tmp_path):
    logs = [_log(tmp_path, w, 2) for w in range(2)]
    for e in range(4):
        for w in range(2 if e < 3 else 1):  # epoch 3: worker 1 died before logging it
            logs[w].append(e, _commit(e), b"schema", _frames(e, w))
    assert [x.epoch for x in logs[1].committed(0)] == [0, 1, 2]
    assert [x.epoch for x in logs[0].committed(1)] == [1, 2]
    assert logs[0].committed(4) == []
    logged = logs[1].committed(2)[0]
    assert (logged.query, logged.batch, logged.final, logged.total) == ("q2", 0, True, 4)
    schema, frames = logs[1].frames(logged)
    assert schema == b"schema" and [(r, bytes(b)) for r, b in frames] == _frames(2, 1)
    # A restarted run reuses epoch 3 for another batch; worker 1's file of it with a stale worker 0
    # file (another decision) is not a complete epoch.
    logs[1].append(3, _commit(3, "other"), b"schema", _frames(3, 1))
    assert [x.epoch for x in logs[0].committed(0)] == [0, 1, 2]
    # Rescaled to one worker: it replays both old workers' rows.
    one = _log(tmp_path, 0, 1)
    _, frames = one.frames(one.committed(1)[0])
    assert [bytes(b) for _, b in frames] == [b for w in range(2) for _, b in _frames(1, w)]


def test_a_logged_batch_committed_again_is_a_duplicate():
    ledger, staging = CommitLedger("events"), Staging("events", 0)
    entries = [("write-a", 0, True, 0), ("stream-s", 0, False, 1), ("stream-s", 1, False, 2)]
    restored = list(ledger_entries(ledger_blobs(entries, {"write-a", "stream-s"})))
    assert sorted(restored) == sorted(entries)
    ledger.restore(restored)
    staging.restore(restored)
    assert ledger.request_commit("r", "write-a", 0, [["t", [[0, 1]]]], True) == P.ok(epoch=0, duplicate=True, rows=0)
    assert ledger.request_commit("r", "stream-s", 1, [], False)["duplicate"]
    assert ledger.request_commit("r", "stream-s", 2, [["t", [[0, 1]]]], False) is None  # a new batch
    assert staging.begin("t2", "write-a", 0, b"", None).discard  # Spark retrying a task of it
    assert sorted(ledger.history()) == sorted(entries)


def test_a_restarted_source_replays_its_log_and_answers_logged_commits_as_duplicates(tmp_path):
    logs = [_log(tmp_path, w, 2) for w in range(2)]
    for e in range(3):
        for w in range(2 if e < 2 else 1):  # epoch 2: not logged by worker 1, never acknowledged
            logs[w].append(e, _commit(e), b"schema", _frames(e, w))
    ck = Checkpointer(Store(str(tmp_path / "ck"), JOB), 2, 0, 2)
    try:
        ledger, staging = CommitLedger("events"), Staging("events", 0)
        durable = SourceDurability(ck, "events", 0, 2, ledger, staging)
        replays = [ledger.next_decision() for _ in range(2)]
        assert [(d.kind, d.query, d.epoch) for d in replays if d] == [(REPLAY, "q0", 0), (REPLAY, "q1", 1)]
        assert not ledger.pending
        assert ledger.request_commit("spark", "q1", 0, _commit(1)[3], True)["duplicate"]  # Spark retrying
        # q2's rows died with the workers: Spark's retried commit is refused (write it again).
        refused = ledger.request_commit("spark", "q2", 0, _commit(2)[3], True, unstaged=lambda: "gone")
        assert refused is not None and not refused["ok"]
        schema, frames = durable.replayed(1)
        assert schema == b"schema" and [bytes(b) for _, b in frames] == [b for _, b in _frames(1, 0)]
    finally:
        ck.close()


def test_truncation_deletes_only_covered_epochs_of_its_own_workers(tmp_path):
    logs = [_log(tmp_path, w, 2) for w in range(2)]
    for e in range(5):
        for w in range(2):
            logs[w].append(e, _commit(e), None, [])
    logs[0].truncate(3)
    left = {w: sorted(int(p.name[1:-4]) for p in (tmp_path / "ck" / "spark" / "events" / f"w{w:05d}").iterdir())
            for w in range(2)}
    assert left == {0: [3, 4], 1: [0, 1, 2, 3, 4]}
    assert [x.epoch for x in logs[1].committed(3)] == [3, 4]


def test_a_corrupt_log_is_refused_naming_the_file(tmp_path):
    logs = [_log(tmp_path, w, 2) for w in range(2)]
    for w in range(2):
        logs[w].append(0, _commit(0), b"schema", _frames(0, w))
    path = Path(logs[1].path(1, 0))
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF
    path.write_bytes(bytes(blob))
    logged = logs[1].committed(0)[0]  # the header is intact: the body is checked when it is read
    with pytest.raises(CheckpointError, match=f"{path}.*corrupt"):
        logs[1].frames(logged)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"{path}.*corrupt"):
        logs[0].committed(0)


def test_sink_keeps_unreleased_epochs_and_never_serves_a_released_one_again(tmp_path):
    url = str(tmp_path / "ck")
    fields = [("key", "bigint")]

    def start() -> tuple[Checkpointer, SinkBuffer, SinkDurability]:
        ck = Checkpointer(Store(url, JOB), 2, 0, 1)
        buffer = SinkBuffer("out", fields, False, 0)
        return ck, buffer, SinkDurability(ck, "out", 0, 1, buffer)

    ck, buffer, durable = start()
    for e in range(5):
        buffer.add(e, [(e * 10 + i,) for i in range(3)])
    buffer.advance(5)
    durable.offer_through(5)
    buffer.release(1)  # a reader committed epoch 0
    ck.flush()
    ck.close()
    # Restart from the checkpoint at 4: epochs 1..3 come back; 0 (released) does not, even when
    # the restarted job produces it again.
    ck, buffer, _ = start()
    assert ck.resume_epoch == 4 and buffer.released == 1 and sorted(buffer.complete) == [1, 2, 3]
    buffer.add(0, [(0,)])
    buffer.add(4, [(40,)])
    buffer.advance(5)
    assert sorted(buffer.complete) == [1, 2, 3, 4]
    buffer.request_read("r", 0, 5)
    (_, batches, reply), = buffer.answer_reads()
    assert not reply["ok"] and "released" in reply["error"]
    buffer.request_read("r", 1, 4)
    (_, batches, reply), = buffer.answer_reads()
    assert [e for e, _, _ in batches] == [1, 2, 3] and reply["rows"] == 9
    ck.close()


# -- with Spark ------------------------------------------------------------------------------------
JOB_FILE = '''
import json, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
import spark_bridge
from timely.checkpoint import Store
from timely.checkpoint.checkpointer import JOB

ENDPOINT, MARKER, CKDIR, KILL_AT = {endpoint!r}, {marker!r}, {ckdir!r}, {kill_at!r}


def die_now(epoch):
    """Worker 1, first run, emitting epoch KILL_AT (so it has logged it), holding the epoch back
    (Spark's commit of it waits): once a checkpoint exists and worker 0 has logged the epoch too,
    SIGKILL this worker."""
    deadline = time.time() + 20
    m = None
    while time.time() < deadline and (m is None or m.epoch < 2):
        m = Store(CKDIR, JOB).latest()
        time.sleep(0.02)
    logged = f"{{CKDIR}}/spark/events/w00000/e{{epoch:012d}}.log"
    deadline = time.time() + 5
    while time.time() < deadline and not os.path.exists(logged):
        time.sleep(0.02)
    Path(MARKER).write_text(json.dumps({{"epoch": epoch, "checkpoint": m and m.epoch,
                                        "logged": os.path.exists(logged)}}))
    os.kill(os.getpid(), signal.SIGKILL)


def main(worker):
    armed = worker.index == 1 and not os.path.exists(MARKER)
    fired = []

    def watch(t, batch):
        if armed and t >= KILL_AT and not fired:
            fired.append(t)
            die_now(t)

    with worker.dataflow() as scope:
        ev = spark_bridge.source(scope, "events", "key bigint, value bigint", coordinator=ENDPOINT)
        agg = (ev.inspect_batch(watch, name="Watch")
               .map(lambda r: (r[0], (1, r[1])))
               .reduce_by_key(lambda a, b: (a[0] + b[0], a[1] + b[1]))
               .map(lambda kv: (kv[0], kv[1][0], kv[1][1])))
        spark_bridge.sink(agg, "agg", "key bigint, n bigint, total bigint")
    worker.finish()
'''


@pytest.fixture(scope="module")
def spark():
    """A loopback-only local Spark (two cores, a task may be attempted twice), stopped with its JVM
    after the module; a session another module started (and stops) is used as it is."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        pytest.skip("Spark needs Java 17+ (no java on PATH, no JAVA_HOME)")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from sparkjob import stop_jvm

    from spark_bridge.session import local_session

    running = SparkSession.getActiveSession()
    if running is not None:
        yield running
        return
    session = local_session("local[2,2]", "timely-recovery-tests", python_path=str(ROOT), register=False)
    yield session
    session.stop()
    stop_jvm()


WRITES = 9
KILL_AT = 5  # the epoch whose emission on worker 1 kills it (checkpoints every 2 epochs)


def frame(spark, i: int):
    """Write ``i``: 150 rows, keys spread over 13, every value ``i`` (so an epoch's totals name it)."""
    from pyspark.sql import functions as F

    return spark.range(150, numPartitions=3).select(((F.col("id") * 7 + i) % 13).alias("key"),
                                                    F.lit(i).cast("bigint").alias("value"))


def write_retrying(df, ep: str, deadline: float) -> int:
    """Write ``df`` as one epoch; a write that failed (the cluster was down: its commit was refused
    or never reached a live cluster) is written again. Returns the attempts made."""
    attempts = 0
    while True:
        attempts += 1
        try:
            (df.write.format("timely").mode("append").option("endpoint", ep).option("stream", "events")
             .option("timeout", "15").save())
            return attempts
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_spark_totals_survive_a_worker_killed_mid_stream(spark, tmp_path):
    from procs import no_leftover_children
    from pyspark.sql import functions as F
    from sparkjob import LaunchedJob

    ckdir, marker = tmp_path / "ck", tmp_path / "killed"
    job = LaunchedJob(tmp_path)
    jobfile = tmp_path / "job.py"
    jobfile.write_text(textwrap.dedent(JOB_FILE.format(root=str(ROOT), endpoint=job.endpoint, marker=str(marker),
                                                       ckdir=str(ckdir), kill_at=KILL_AT)))
    job.cmd = [sys.executable, "-m", "timely.launch", "-w", "2", "--checkpoint", str(ckdir),
               "--checkpoint-every", "2", "--restarts", "2", str(jobfile)]
    deadline = time.monotonic() + 240
    with no_leftover_children(), job:
        attempts = [write_retrying(frame(spark, i), job.endpoint, deadline) for i in range(WRITES)]
        killed = json.loads(marker.read_text())
        got = (spark.read.format("timely").option("endpoint", job.endpoint).option("stream", "agg")
               .option("startingEpoch", "0").option("endingEpoch", str(WRITES)).option("epochColumn", "epoch")
               .option("timeout", "60").load().collect())
        job.stop()
    log = job.log.read_text()
    assert "was killed by signal SIGKILL; restart 1 of 2" in log, log
    # Killed after a checkpoint, with epochs committed after it (the log replays them) and Spark's
    # commit of epoch KILL_AT in flight: it survived the restart (answered from the log), no rewrite.
    assert killed["epoch"] == KILL_AT and killed["logged"] and 2 <= killed["checkpoint"] < KILL_AT, killed
    assert f"resumes from the checkpoint of epoch {killed['checkpoint']}" in log, log
    assert attempts[KILL_AT] == 1, attempts
    # Every write is in exactly one epoch, whole: an epoch's totals are n * (its write's index).
    per_epoch: dict[int, dict[int, tuple]] = {}
    for r in got:
        per_epoch.setdefault(r["epoch"], {})[r["key"]] = (r["n"], r["total"])
    writes = {}
    for epoch, rows in per_epoch.items():
        (i,) = {total // n for n, total in rows.values()}
        assert all(total == n * i for n, total in rows.values())
        writes[epoch] = i
    assert sorted(writes) == list(range(WRITES)) and sorted(writes.values()) == list(range(WRITES)), (writes, attempts)
    for epoch, i in writes.items():
        want = {r["key"]: r["n"] for r in frame(spark, i).groupBy("key").agg(F.count("*").alias("n")).collect()}
        assert {k: n for k, (n, _) in per_epoch[epoch].items()} == want, epoch
    # Totals read back equal Spark SQL's over the same input.
    union = frame(spark, 0)
    for i in range(1, WRITES):
        union = union.unionByName(frame(spark, i))
    sql = {r["key"]: (r["n"], r["total"]) for r in
           union.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")).collect()}
    back: dict[int, list[int]] = {}
    for rows in per_epoch.values():
        for k, (n, total) in rows.items():
            acc = back.setdefault(k, [0, 0])
            acc[0] += n
            acc[1] += total
    assert {k: tuple(v) for k, v in back.items()} == sql
