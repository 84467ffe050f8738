"""The Spark bridge against hostile and faulty peers (issue 13), without a JVM: the bridge's client
functions play Spark against timely jobs in a thread (:class:`sparkjob.ThreadJob`) or launched as
a 2-worker cluster (:class:`sparkjob.LaunchedJob`).

- a second launch on the same coordinator endpoint fails and leaves the first one working;
- malformed, forged and over-size messages to the coordinator and data ports are refused and
  logged, never fatal; batches larger than the job's frame limit are split by the writer;
- a write to a cluster that died fails after its timeout, not twice it;
- with a job secret, clients without it (or with another) can do nothing.

The frame fuzzer over every bridge port of a running job is ``test_fuzz_spark.py``'s.
"""
from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")
zmq = pytest.importorskip("zmq")

from procs import no_leftover_children  # noqa: E402
from sparkjob import ROOT, LaunchedJob, ThreadJob  # noqa: E402
from test_spark_unit import SCHEMA, batch, capture_job, read_all  # noqa: E402

import spark_bridge  # noqa: E402
from spark_bridge import client  # noqa: E402
from spark_bridge import datasource as D  # noqa: E402
from spark_bridge import protocol as P  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def send_raw(endpoint: str, frames: list, secret=None) -> None:
    """Send one multipart message from a fresh DEALER, as any process that can reach the port may."""
    sock = client.context().socket(zmq.DEALER)
    if secret is not None:
        secret.connect(sock)
    sock.connect(endpoint)
    sock.send_multipart(frames)
    sock.close(linger=2000)


def write_epoch(ep: str, query: str, keys: list[int], secret: str | None = None, timeout: str = "10") -> int:
    """Write ``keys`` (value = key) as one batch write through the client path; its epoch."""
    opts = {"endpoint": ep, "stream": "events", "timeout": timeout, **({"secret": secret} if secret else {})}
    plan = D._plan_write(opts, SCHEMA, False, query, 0)
    m = D._write(plan, iter([batch(keys)]), 0)
    return int(D._commit(plan, [m], 0)["epoch"])


def wait_refused(ep: str, at_least: int, secret=None) -> int:
    deadline = time.monotonic() + 10
    while (n := spark_bridge.status(ep, secret=secret)["refused"]) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


# -- item 1: a second launch on the same coordinator endpoint -------------------------------------------
@pytest.mark.timeout(120)
def test_a_second_launch_on_the_same_endpoint_fails_and_leaves_the_first_working(tmp_path):
    ep = f"tcp://127.0.0.1:{free_port()}"
    with no_leftover_children(), LaunchedJob(tmp_path / "first", endpoint=ep) as first:
        before = spark_bridge.status(ep)["endpoints"]
        second = subprocess.run(LaunchedJob(tmp_path / "second", endpoint=ep).cmd, cwd=ROOT, timeout=60,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert second.returncode != 0
        assert f"cannot bind the coordinator endpoint {ep}" in second.stdout, second.stdout
        assert "in use" in second.stdout
        # whether or not the second job's worker 1 got to register, a registration from another
        # job (here one forged for worker 1) is refused and changes nothing
        send_raw(ep, [P.pack({"op": "hello", "worker": 1, "endpoint": "tcp://127.0.0.1:9", "generation": "g",
                              "job": "another"})])
        assert wait_refused(ep, 1) >= 1
        assert spark_bridge.status(ep)["endpoints"] == before
        assert write_epoch(ep, "after", [1, 2, 2, 3]) == 0  # write, read and shutdown still work
        got = {(k, n) for e, k, n in read_counts(ep, 1)}
        assert got == {(1, 1), (2, 2), (3, 1)}
        captures = first.stop()
    assert sorted(tuple(r) for c in captures for _, recs in c["epochs"] for r in recs) == [(1, 1), (2, 2), (2, 2), (3, 3)]
    assert "refused the registration of worker 1 at tcp://127.0.0.1:9: it belongs to another job" in \
        first.log.read_text()


def read_counts(ep: str, epochs: int, timeout: str = "10") -> list[tuple[int, int, int]]:
    """``(epoch, key, count)`` of the sink ``counts`` of examples/spark_pipeline.py."""
    r = D.TimelyBatchReader({"endpoint": ep, "stream": "counts", "startingEpoch": "0", "endingEpoch": str(epochs),
                             "epochColumn": "epoch", "timeout": timeout})
    return sorted((row["epoch"], row["key"], row["count"]) for p in r.partitions() for b in r.read(p)
                  for row in b.to_pylist())


# -- item 2: malformed messages ------------------------------------------------------------------------------
GOOD_BEGIN = {"stream": "events", "query": "q", "batch": 0, "partition": 0, "attempt": 0, "generation": "g"}
MALFORMED_DATA = [
    [b"D"], [b"D", b"tok"], [b"D", b"tok", b"\x01", b"body"], [b"B", b"t", b"\xc1", b"x"], [b"B", b"t", P.pack([1]), b""],
    [b"B", b"t", P.pack({**GOOD_BEGIN, "batch": "0"}), b""], [b"E", b"t", P.pack({"rows": -1, "batches": 0})],
    [b"R", b"r", P.pack({"sink": "tenfold", "start": "a", "end": 2})], [b"S", b"", P.pack({"sink": "tenfold"})],
    [b"L", b"r", P.pack({"sink": "tenfold"})], [b"X"], [b"Z", b"r", b"{}"], [b""], [b"\x00" * 100] * 7,
    [b"B", "é".encode(), P.pack(GOOD_BEGIN), b"schema"],
]
MALFORMED_COORDINATOR = [
    [b""], [b"\xc1"], [P.pack([1, 2])], [P.pack({"op": "commit"})], [P.pack({"op": 7})], [P.pack({"op": "nope"})],
    [P.pack({"op": "commit", "stream": "events", "query": "q", "batch": "0", "tokens": [], "final": True})],
    [P.pack({"op": "commit", "stream": "events", "query": "q", "batch": 0, "tokens": [["t", [[0, "x"]]]]})],
    [P.pack({"op": "plan", "stream": ["events"], "kind": "write"})], [P.pack({"op": "status"}), b"second frame"],
    [P.pack({"op": "hello", "worker": 0, "endpoint": "tcp://x:1", "generation": "g"})],
]


@pytest.mark.timeout(60)
def test_malformed_and_forged_messages_are_refused_and_logged_never_fatal(capfd):
    with ThreadJob(capture_job) as job:
        data = spark_bridge.status(job.endpoint)["endpoints"][0]
        for frames in MALFORMED_DATA:
            send_raw(data, frames)
        for frames in MALFORMED_COORDINATOR:
            send_raw(job.endpoint, frames)
        assert wait_refused(job.endpoint, len(MALFORMED_DATA) + len(MALFORMED_COORDINATOR)) >= \
            len(MALFORMED_DATA) + len(MALFORMED_COORDINATOR)
        # a well-formed write whose batch does not decode, or does not fit the declared schema
        opts = {"endpoint": job.endpoint, "stream": "events", "timeout": "5"}
        plan = D._plan_write(opts, SCHEMA, False, "bad", 0)
        link = client.WorkerLink.get(data)
        good = batch([1])
        for name, schema, body in [("garbled", good.schema.serialize(), b"\x00" * 64),
                                   ("widened", pa.schema([("key", pa.string())]).serialize(), None)]:
            tok = name.encode()
            link.send([P.Op.BEGIN, tok, P.pack({**GOOD_BEGIN, "generation": plan.endpoints[0][1]}), schema], 5, 0)
            if body is not None:
                link.send([P.Op.DATA, tok, P.ROWS.pack(1), body], 5, 0)
            reply = P.unpack(link.recv_reply((P.Op.ACK,), tok, 5, 0, "staging")[2].bytes)
            assert not reply["ok"] and ("does not decode" in reply["error"] or "column 'key'" in reply["error"])
        # a forged commit of attempts worker 0 never staged is refused before it is decided
        with pytest.raises(spark_bridge.BridgeError, match="staged nothing: commit refused"):
            client.Coordinator(job.endpoint, 5).request(P.Request.COMMIT, stream="events", query="forged", batch=0,
                                                        tokens=[["nope", [[0, 3]]]], final=True)
        assert write_epoch(job.endpoint, "real", [4, 5]) == 0
        assert read_all(job.endpoint, "tenfold", 0, 1) == [(0, 4, 40), (0, 5, 50)]
        result = job.stop()
    assert result == [(0, [(4, 4), (5, 5)])]
    err = capfd.readouterr().err
    assert "refused a message to the data endpoint" in err and "data message of 1 frames" in err
    assert "refused a message to the coordinator" in err


def capture_job_limited(scope, ep):
    """``capture_job`` whose bridge admits frames of at most 1 MiB."""
    ev = spark_bridge.source(scope, "events", SCHEMA, coordinator=ep, max_message_bytes=1 << 20)
    cap = ev.capture()
    spark_bridge.sink(ev.map(lambda r: (r[0], r[1] * 10)), "tenfold", SCHEMA)
    return cap.extract


@pytest.mark.timeout(60)
def test_over_size_frames_are_dropped_and_large_batches_split_to_fit():
    with ThreadJob(capture_job_limited) as job:
        data = spark_bridge.status(job.endpoint)["endpoints"][0]
        big = b"\x00" * (2 << 20)
        send_raw(data, [P.Op.DATA, b"t", P.ROWS.pack(1), big])
        send_raw(job.endpoint, [big])
        send_raw(job.endpoint, [b"small garbage"])
        # ZeroMQ dropped the over-size messages (and their senders) before the bridge saw them
        assert wait_refused(job.endpoint, 1) == 1
        time.sleep(0.2)
        assert spark_bridge.status(job.endpoint)["refused"] == 1
        keys = list(range(300_000))  # 4.8 MB of Arrow: sent in pieces of at most 1 MiB
        assert write_epoch(job.endpoint, "big", keys) == 0
        result = job.stop()
    assert [e for e, _ in result] == [0] and sorted(k for k, _ in result[0][1]) == keys


# -- item 6: a write to a cluster that died ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_write_fails_after_its_timeout_not_twice_when_the_cluster_dies():
    ctx = zmq.Context()
    coord, data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    ep = f"tcp://127.0.0.1:{coord.bind_to_random_port('tcp://127.0.0.1')}"
    data_ep = f"tcp://127.0.0.1:{data.bind_to_random_port('tcp://127.0.0.1')}"

    def plan_answer():  # the cluster answers the driver's plan, then dies
        ident, _ = coord.recv_multipart()
        coord.send_multipart([ident, P.pack(P.ok(fields=None, peers=1, endpoints=[[data_ep, "g"]]))])

    t = threading.Thread(target=plan_answer)
    t.start()
    timeout = 3.0
    plan = D._plan_write({"endpoint": ep, "stream": "events", "timeout": str(timeout)}, SCHEMA, False, "q", 0)
    t.join()
    for s in (coord, data):
        s.close(linger=0)
    ctx.term()
    t0 = time.monotonic()
    with pytest.raises(spark_bridge.WorkerUnreachable, match=f"accepted no data for {timeout:g} s"):
        D._write(plan, iter([batch(list(range(1000)))] * 100), 0)  # a task of the write
    D._abort(plan, [], 0)  # what Spark's driver does next
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + client.ABORT_WAIT + 0.7, f"the write failed after {elapsed:.1f} s"


# -- the job secret ------------------------------------------------------------------------------------------
def secret_job(scope, ep):
    ev = spark_bridge.source(scope, "events", SCHEMA, coordinator=ep, secret="open sesame")
    cap = ev.capture()
    spark_bridge.sink(ev.map(lambda r: (r[0], r[1] * 10)), "tenfold", SCHEMA)  # the server's secret
    return cap.extract


@pytest.mark.timeout(60)
@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_without_the_secret_nothing_can_be_written_read_shut_down_or_crashed():
    from timely.comm.secret import JobSecret

    with ThreadJob(secret_job, secret="open sesame") as job:
        ep = job.endpoint
        data = spark_bridge.status(ep, secret="open sesame")["endpoints"][0]
        for wrong in (None, "open barley"):
            t0 = time.monotonic()
            with pytest.raises(spark_bridge.CoordinatorUnreachable, match="same one: option 'secret'"):
                spark_bridge.shutdown(ep, timeout=0.5, secret=wrong)
            assert time.monotonic() - t0 < 1.5
            with pytest.raises(spark_bridge.CoordinatorUnreachable):
                write_epoch(ep, "intruder", [66], secret=wrong, timeout="0.5")
            with pytest.raises(spark_bridge.CoordinatorUnreachable):
                read_all_with(ep, wrong)
            keys = None if wrong is None else JobSecret.from_text(wrong)
            # straight to the data port: a stop request, and the message that once crashed a job
            send_raw(data, [P.Op.STOP, b"r", P.pack({})], keys)
            send_raw(data, [b"D"], keys)
            with pytest.raises(spark_bridge.WorkerUnreachable):
                client.request_worker(data, 0, P.Op.STATUS, {"sink": "tenfold"}, 0.5, keys)
        time.sleep(0.3)
        info = spark_bridge.status(ep, secret="open sesame")
        assert not info["stopping"] and info["refused"] == 0  # nothing reached the bridge
        assert write_epoch(ep, "real", [7, 8], secret="open sesame") == 0
        assert read_all_with(ep, "open sesame") == [(0, 7, 70), (0, 8, 80)]
        result = job.stop()
    assert result == [(0, [(7, 7), (8, 8)])]


def read_all_with(ep: str, secret: str | None) -> list:
    opts = {"endpoint": ep, "stream": "tenfold", "startingEpoch": "0", "endingEpoch": "1", "epochColumn": "epoch",
            "timeout": "0.5" if secret != "open sesame" else "10", **({"secret": secret} if secret else {})}
    r = D.TimelyBatchReader(opts)
    return sorted((row["epoch"], row["key"], row["value"]) for p in r.partitions() for b in r.read(p)
                  for row in b.to_pylist())

