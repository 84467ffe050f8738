"""Spark bridge regressions from review 6: sources emit the wire types whatever time zone the writer
staged (Spark's session zone), the bridge works on IPv6 addresses, staged rows that no commit or abort
ever decides expire (exactly once still), a commit reaching a coordinator before every worker
registered is refused clearly, options a running bridge would ignore are refused, and
``submit`` clears its ``publish`` URL and refuses it without the bridge.

Most run without a JVM (the bridge's client functions against a job in a thread, or bridge servers
driven directly); two run on a local Spark session (loopback only: test_spark_recovery's fixture).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import socket
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")
zmq = pytest.importorskip("zmq")

import test_spark_recovery  # noqa: E402
from sparkjob import ThreadJob  # noqa: E402
from test_spark_ledger import Cluster  # noqa: E402

import spark_bridge  # noqa: E402
from spark_bridge import barrier, ledger  # noqa: E402
from spark_bridge import datasource as D  # noqa: E402
from spark_bridge import protocol as P  # noqa: E402
from spark_bridge import schema as S  # noqa: E402
from spark_bridge.errors import BridgeError  # noqa: E402
from spark_bridge.server import BridgeServer, serve  # noqa: E402
from timely import columnar  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TS_SCHEMA = "k bigint, ts timestamp, s string"
INSTANTS = [dt.datetime(2024, 3, 10, 9, 30, tzinfo=dt.timezone.utc), dt.datetime(2024, 11, 3, 8, 59, tzinfo=dt.timezone.utc)]


class Stand:
    """A stand-in worker for a bridge server driven without a dataflow."""

    def __init__(self, index: int, peers: int, job_id: str = "job-a") -> None:
        self.index, self.peers, self.job_id = index, peers, job_id


def write(ep: str, stream: str, rb, query: str, timeout: float = 10.0, commit: bool = True):
    """One batch write as Spark's writer makes it (plan, one task's write, commit), without Spark."""
    opts = {"endpoint": ep, "stream": stream, "timeout": str(timeout)}
    plan = D._plan_write(opts, S.parse(rb.schema), False, query, 0)
    msg = D._write(plan, iter([rb]), 0)
    if commit:
        D._commit(plan, [msg], 0)
    return plan, msg


def zoned_batch(zone: str = "America/Los_Angeles"):
    """Rows as Spark's Arrow writer stages them under that session zone (and with useLargeVarTypes)."""
    return pa.record_batch([pa.array([1, 2], pa.int64()), pa.array(INSTANTS, pa.timestamp("us", tz=zone)),
                            pa.array(["a", None], pa.large_string())], names=["k", "ts", "s"])


# -- 1. the wire types, whatever zone the writer staged ---------------------------------------------------------
def _tz_job(scope, ep):
    declared = S.arrow_schema(S.parse(TS_SCHEMA))
    rows = spark_bridge.source(scope, "rows", TS_SCHEMA, coordinator=ep).capture()
    cols = spark_bridge.source(scope, "cols", TS_SCHEMA, coordinator=ep, arrow=True)
    columnar.from_batches(cols, declared).stream.probe()  # the README's pattern: fails on another type
    seen = cols.map(lambda rb: rb.schema.equals(declared)).capture()
    anything = spark_bridge.source(scope, "any", None, coordinator=ep, arrow=True)
    untyped = anything.map(lambda rb: rb.schema.equals(declared)).capture()
    return lambda: (rows.extract(), seen.extract(), untyped.extract())


@pytest.mark.timeout(60)
def test_sources_emit_timestamps_in_utc_and_the_wire_types_whatever_the_writer_staged():
    with ThreadJob(_tz_job) as job:
        for stream in ("rows", "cols", "any"):
            write(job.endpoint, stream, zoned_batch(), f"write-{stream}")
        rows, seen, untyped = job.stop()
    got = [r for _, rs in rows for r in rs]
    assert got == [(1, INSTANTS[0], "a"), (2, INSTANTS[1], None)]
    assert [r[1].tzname() for r in got] == ["UTC", "UTC"]  # not the writer's America/Los_Angeles
    assert [x for _, xs in seen for x in xs] == [True]  # timestamp[us, UTC] and utf8, as declared
    assert [x for _, xs in untyped for x in xs] == [True]  # a source without a schema too


# -- 2. IPv6 ----------------------------------------------------------------------------------------------------
def _ipv6_loopback() -> str | None:
    """Why this machine cannot test on [::1], or None."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"no IPv6 loopback on this machine (binding [::1] fails: {e})"
    return None


needs_ipv6 = pytest.mark.skipif(_ipv6_loopback() is not None, reason=str(_ipv6_loopback()))


def _ipv6_job(scope, _ep):
    return spark_bridge.source(scope, "events", "key bigint, value bigint", coordinator="tcp://[::1]:0").capture().extract


@needs_ipv6
@pytest.mark.timeout(60)
def test_a_job_serves_the_bridge_on_an_ipv6_coordinator_and_spark_writes_through_it():
    with ThreadJob(_ipv6_job) as job:
        assert job.endpoint.startswith("tcp://[::1]:")
        rb = pa.record_batch([pa.array([1, 2, 3], pa.int64()), pa.array([4, 5, 6], pa.int64())], names=["key", "value"])
        plan, _ = write(job.endpoint, "events", rb, "write-v6")
        assert plan.endpoints[0][0].startswith("tcp://[::1]:")  # the data endpoint binds [::1] too
        assert spark_bridge.status(job.endpoint, timeout=5)["stats"]["events"]["rows"] == 3
        got = job.stop()
    assert sorted(r for _, rs in got for r in rs) == [(1, 4), (2, 5), (3, 6)]


@needs_ipv6
@pytest.mark.timeout(30)
def test_workers_register_with_an_ipv6_coordinator():
    w0 = BridgeServer(Stand(0, 2), "tcp://[::1]:0")
    w1 = None
    try:
        w1 = BridgeServer(Stand(1, 2), w0.coordinator_endpoint, host="::1")  # a barrier task's bare address
        assert w1.data_endpoint.startswith("tcp://[::1]:")
        deadline = time.monotonic() + 10
        while not w0.registry.complete and time.monotonic() < deadline:
            w0.pump()
            time.sleep(0.01)
        assert w0.registry.known() == [w0.data_endpoint, w1.data_endpoint]
    finally:
        for s in (w1, w0):
            if s is not None:
                s.close()


# -- 3. staged rows of a write never decided expire ----------------------------------------------------------
def _events_job(scope, ep):
    return spark_bridge.source(scope, "events", "key bigint, value bigint", coordinator=ep).capture().extract


@pytest.mark.timeout(60)
def test_staged_rows_of_a_write_whose_driver_died_expire_and_its_late_commit_is_refused(monkeypatch):
    monkeypatch.setattr(ledger, "EXPIRY_FACTOR", 1)  # expire after 1 x the write's timeout (2 s)
    dead = pa.record_batch([pa.array(range(1000), pa.int64()), pa.array(range(1000), pa.int64())],
                           names=["key", "value"])
    with ThreadJob(_events_job) as job:
        # The tasks staged their rows; the driver died before its commit or abort.
        plan, msg = write(job.endpoint, "events", dead, "write-dead", timeout=2, commit=False)
        assert job.stats()["staged_tokens"] == 1
        deadline = time.monotonic() + 20
        while job.stats()["staged_tokens"] and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = job.stats()
        assert stats["staged_tokens"] == 0 and stats["expired_rows"] == 1000 and stats["epochs"] == 0
        # A commit that comes after all (a driver that was only slow) is refused: nothing applied.
        with pytest.raises(BridgeError, match=r"commit of query write-dead batch 0 refused: .* expired"):
            D._commit(plan, [msg], 0)
        write(job.endpoint, "events", dead.slice(0, 3), "write-ok", timeout=2)  # later writes work
        got = job.stop()
    assert [r for _, rs in got for r in rs] == [(0, 0), (1, 1), (2, 2)]


def test_an_expiry_and_a_commit_of_the_same_attempts_are_ordered_by_the_ledger_exactly_once():
    c = Cluster()
    stale, _ = c.write("write-a", 0, [1, 2])  # rows on both workers
    later = c.stagings[1].clock() + 10_000
    assert c.stagings[1].expired(later) == [("write-a", 0, [stale])]
    assert c.stagings[1].expired(later + 1) == []  # proposed again only after another expiry time
    assert c.ledger.request_expire("write-a", 0, [stale]) == {"ok": True}
    c.publish()  # the expiry record reaches every worker, in order with the commits
    assert all(stale not in s for s in c.stagings)
    assert [s.expired_rows for s in c.stagings] == [1, 2]
    rid = c.commit("write-a", 0, c.tokens(stale), final=True)
    assert not c.replies[rid][0]["ok"] and "expired" in c.replies[rid][0]["error"]
    c.publish()
    assert c.epoch == 0  # nothing of it was published
    # A streaming query's batch runs again after a restart (new attempts): it commits.
    old, _ = c.write("stream-q", 3, [2, 0])
    assert c.ledger.request_expire("stream-q", 3, [old]) == {"ok": True}
    c.publish()
    again, _ = c.write("stream-q", 3, [1, 1])
    rid = c.commit("stream-q", 3, c.tokens(again), final=False)
    c.publish()
    c.advance()
    assert c.replies[rid] == [{"ok": True, "epoch": 0, "rows": 2}]
    # A commit decided first wins: the expiry proposal of its attempts is ignored.
    won, _ = c.write("write-b", 0, [1, 1])
    rid = c.commit("write-b", 0, c.tokens(won), final=True)
    assert c.ledger.request_expire("write-b", 0, [won]) == {"ok": True, "ignored": True}
    c.publish()
    c.advance()
    assert c.replies[rid] == [{"ok": True, "epoch": 1, "rows": 2}] and len(c.published[1][1]) == 2


KEYS = [("s", 0), ("s", 1), ("b1", 0), ("b2", 0)]  # "s" streams; "b1", "b2" are batch writes
FINAL = {"s": False, "b1": True, "b2": True}
expiry_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.sampled_from(KEYS), st.lists(st.integers(0, 2), min_size=2, max_size=2)),
    st.tuples(st.just("commit"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("expire"), st.integers(0, 1)),
    st.tuples(st.just("publish"), st.integers(1, 3)),
), max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expiry_ops)
def test_random_expiries_and_commits_publish_each_row_once_and_never_an_expired_one(script):
    """Workers propose expiry at any moment; the expiry record is applied on every worker at once
    (as on arrival: possibly before commits decided earlier are applied there)."""
    c = Cluster()
    staged: dict[tuple, list[str]] = {k: [] for k in KEYS}
    highest: dict[str, int] = {}
    clock = [0.0]
    for op in script:
        if op[0] == "write":
            token, replies = c.write(*op[1], op[2])
            if replies and all(r["ok"] and not r.get("duplicate") for r in replies):
                staged[op[1]].append(token)
        elif op[0] == "commit":
            (query, batch), pick = op[1], op[2]
            if staged[op[1]] and batch >= highest.get(query, -1):
                highest[query] = batch
                c.commit(query, batch, c.tokens(staged[op[1]][pick % len(staged[op[1]])]), FINAL[query])
        elif op[0] == "expire":
            clock[0] += 1e6  # long after every write so far
            for query, batch, tokens in c.stagings[op[1]].expired(clock[0]):
                before = len(c.ledger._decisions)
                c.ledger.request_expire(query, batch, tokens)
                for d in list(c.ledger._decisions)[before:]:
                    for s in c.stagings:  # applied on arrival, ahead of decisions queued before it
                        s.apply(d.record())
        else:
            c.publish(op[1])
    c.publish()
    c.advance()
    keys = [k for k, _ in c.published.values()]
    assert len(set(keys)) == len(keys)  # each batch published at most once
    emitted = [f for _, frames in c.published.values() for f in frames]
    assert len(emitted) == len(set(emitted))
    for rid, replies in c.replies.items():
        assert len(replies) == 1
    gone = c.ledger._expired
    for _, frames in c.published.values():
        assert not {t for t, _, _ in frames} & gone, "an expired attempt's rows were published"
    for key, frames in c.published.values():  # whole: every row of the committed attempts, none lost
        tokens = {t for t, _, _ in frames}
        assert sorted(frames) == sorted(f for t in tokens for _, f in c.sent[t])
    assert sum(s.refused_rows for s in c.stagings) == 0  # no commit met rows a worker had dropped


@pytest.mark.timeout(30)
def test_a_worker_proposes_expiry_to_the_coordinator_which_declines_while_it_sees_the_write_alive():
    w0 = BridgeServer(Stand(0, 2), "tcp://127.0.0.1:0")
    w1 = None
    try:
        w1 = BridgeServer(Stand(1, 2), w0.coordinator_endpoint)
        for s in (w0, w1):
            s.streams.add_source("events", None, False)
        lg = w0.streams.sources["events"].ledger

        def proposed(later: float) -> list:
            """What worker 1 proposes ``later`` seconds from now, once worker 0 has read it."""
            w1.expire_idle(time.monotonic() + later)
            deadline = time.monotonic() + 2
            while not lg.pending and time.monotonic() < deadline:
                w0.pump()
                time.sleep(0.01)
            w1.pump()  # (a reply on its registration socket would raise here)
            return [(d.kind, d.query, d.batch, d.tokens) for d in iter(lg.next_decision, None)]

        w1.streams.sources["events"].staging.begin("t1", "q", 0, b"", None, expiry=5.0)
        w0.streams.sources["events"].staging.begin("t0", "q", 0, b"", None, expiry=5.0)
        assert proposed(1000) == []  # worker 0 saw the write within its expiry time: alive
        w0.streams.sources["events"].staging.drop(["t0"])
        assert proposed(2000) == [(P.Request.EXPIRE, "q", 0, ["t1"])]
        assert w0.refused.count == 0
    finally:
        for s in (w1, w0):
            if s is not None:
                s.close()


# -- 4. a commit before every worker registered ---------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_commit_reaching_a_coordinator_before_every_worker_registered_is_refused_as_restarted():
    s = BridgeServer(Stand(0, 2), "tcp://127.0.0.1:0")
    try:
        s.streams.add_source("events", None, False)
        got: list = []
        s.answer = lambda replies: got.extend(replies)
        req = {"op": "commit", "stream": "events", "query": "write-x", "batch": 0, "final": True, "progress": True,
               "tokens": [["tok", [[1, 5]]]], "generations": ["old-gen-0", "old-gen-1"]}
        s._on_coord([zmq.Frame(b"spark-driver"), zmq.Frame(P.pack(req))])
        reply = got[0][1]
        assert reply["kind"] == "error" and s.refused.count == 0  # not a malformed request
        assert "the timely job restarted since the rows were staged (workers [1] are new processes ([1] not " \
               "registered yet)" in reply["error"]
    finally:
        s.close()


# -- 5. options a running bridge would ignore ---------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_running_bridge_refuses_another_max_message_bytes_or_host(monkeypatch):
    monkeypatch.delenv("TIMELY_SECRET", raising=False)
    monkeypatch.delenv("TIMELY_SECRET_FILE", raising=False)
    w = Stand(0, 1)
    s = serve(w, "tcp://127.0.0.1:0", max_message_bytes=1 << 20)
    try:
        # (IPv4 endpoints stay as they were: zmq.IPV6 is set for IPv6 ones only)
        assert s.coordinator_endpoint.startswith("tcp://127.0.0.1:") and s.data_endpoint.startswith("tcp://127.0.0.1:")
        assert serve(w, max_message_bytes=1 << 20, host="127.0.0.1") is s  # the same: fine
        with pytest.raises(ValueError, match="max_message_bytes=1048576, not 1073741824"):
            serve(w, max_message_bytes=1 << 30)
        with pytest.raises(ValueError, match="on host '127.0.0.1', not '127.0.0.2'"):
            serve(w, host="127.0.0.2")
    finally:
        s.close()


# -- 6. submit's publish ---------------------------------------------------------------------------------------
def test_submit_refuses_publish_without_the_bridge(tmp_path):
    with pytest.raises(ValueError, match="publish=.* needs bridge=True"):
        barrier.submit(None, str(tmp_path / "job.py"), 1, bridge=False, publish=str(tmp_path / "endpoint"))
    assert not (tmp_path / "endpoint").exists()


# -- with Spark (local mode: test_spark_recovery's fixture, one JVM for the module or an active session) -----------
spark = test_spark_recovery.spark  # the fixture: a loopback-only local Spark, or the session running already
needs_java = pytest.mark.skipif(not (os.environ.get("JAVA_HOME") or shutil.which("java")),
                                reason="Spark needs Java 17+ (no java on PATH, no JAVA_HOME)")


@needs_java
@pytest.mark.timeout(120)
def test_spark_timestamps_arrive_in_utc_under_any_session_time_zone(spark):
    from zoneinfo import ZoneInfo

    spark.conf.set("spark.sql.session.timeZone", "America/Los_Angeles")
    try:
        df = spark.sql("SELECT id AS k, TIMESTAMP'2024-03-10 01:30:00' + make_interval(0,0,0,0,id,0,0) AS ts, "
                       "CAST(id AS STRING) AS s FROM range(2)")
        with ThreadJob(_tz_job) as job:
            for stream in ("rows", "cols"):
                (df.write.format("timely").mode("append").option("endpoint", job.endpoint).option("stream", stream)
                 .option("timeout", "30").save())
            rows, seen, _ = job.stop()
    finally:
        spark.conf.unset("spark.sql.session.timeZone")
    got = sorted(r for _, rs in rows for r in rs)
    la = ZoneInfo("America/Los_Angeles")
    # 01:30 and 02:30 wall-clock in Los Angeles on the day of the DST switch: 09:30 and 10:30 UTC
    assert [(k, ts, s) for k, ts, s in got] == [
        (0, dt.datetime(2024, 3, 10, 1, 30, tzinfo=la), "0"), (1, dt.datetime(2024, 3, 10, 9, 30, tzinfo=dt.timezone.utc)
                                                              + dt.timedelta(hours=1), "1")]
    assert [r[1].tzname() for r in got] == ["UTC", "UTC"]
    flags = [x for _, xs in seen for x in xs]
    assert flags and all(flags)  # every batch in the declared wire schema: from_batches accepted them


PUBLISHED_JOB = """
import spark_bridge
from spark_bridge.server import server_of

def main(worker):
    with worker.dataflow() as scope:
        spark_bridge.source(scope, "events", "k bigint", max_message_bytes=int(worker.args[0])).probe()
    limit = server_of(worker).max_message_bytes
    spark_bridge.stop(worker)
    return limit
"""


@needs_java
@pytest.mark.timeout(180)
def test_submit_publishes_this_jobs_endpoint_not_the_previous_one_and_passes_max_message_bytes(spark, tmp_path):
    job_file = tmp_path / "published_job.py"
    job_file.write_text(textwrap.dedent(PUBLISHED_JOB))
    url = tmp_path / "pub" / "coordinator"
    url.parent.mkdir()
    url.write_text("tcp://127.0.0.1:1\n")  # what an earlier submission published
    job = barrier.submit(spark, str(job_file), 1, [str(1 << 20)], publish=str(url), max_message_bytes=1 << 20,
                         timeout=90)
    try:
        endpoint = barrier.published(str(url), timeout=60)
        assert endpoint != "tcp://127.0.0.1:1"
        assert endpoint == job.coordinator(60)
        assert job.result(90) == [1 << 20]  # the job's source asked for the limit submit set
    finally:
        with contextlib.suppress(Exception):
            job.cancel()


def test_submit_checks_slot_wait_and_the_heartbeat_timeouts_bound_on_the_driver(tmp_path):
    """A heartbeat timeout over the workers' bound failed in every task (Spark's error, not ours);
    a negative or nan slot_wait was accepted."""
    from timely.launch import MAX_HEARTBEAT_TIMEOUT

    job = str(tmp_path / "job.py")
    with pytest.raises(ValueError, match=f"heartbeat_timeout must be at most {MAX_HEARTBEAT_TIMEOUT} seconds"):
        barrier.submit(None, job, 1, heartbeat_timeout=3e6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="slot_wait must be a number of seconds, 0 or more"):
            barrier.submit(None, job, 1, slot_wait=bad)


def test_the_command_line_answers_2_when_the_job_file_cannot_run():
    """As timely.launch does (the README's exit-status table); every worker error was 1."""
    from spark_bridge.launch import worker_error_status
    from timely import WorkerError

    assert worker_error_status(WorkerError(0, "worker 0 failed: JobFileError: job.py: importing it raised "
                                              "ModuleNotFoundError: No module named 'nope'\n\nThen: ...")) == 2
    assert worker_error_status(WorkerError(1, "worker 1 failed: ZeroDivisionError: x\n\nThen: worker 0 "
                                              "failed: JobFileError: ...")) == 1
