"""The Spark bridge's timely-side operators (the ``SparkCommits`` control operator, ``SparkSource``
and the sink) under the schedule fuzzer, without a JVM: the bridge's client functions drive a
timely job running in a thread (``sparkjob.ThreadJob(build, fuzz=SEED)``).

Exactly once, whatever the delivery order: every committed batch enters the dataflow as one epoch,
in commit order, with the rows of its winning attempt only; a replay adds nothing; the sink serves
each epoch's rows once the epoch is complete. Commits are pipelined (sent without waiting for the
previous reply, as Spark's asynchronous progress tracking may), so that the decision records of
several epochs are in flight at once and the fuzzer delivers them in any order.
"""
from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")
zmq = pytest.importorskip("zmq")

from conftest import FUZZ_SEEDS  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sparkjob import ThreadJob  # noqa: E402
from test_spark_unit import SCHEMA, batch, capture_job, read_all  # noqa: E402

import spark_bridge  # noqa: E402
from spark_bridge import client, protocol  # noqa: E402
from spark_bridge import datasource as D  # noqa: E402
from spark_bridge.protocol import Request  # noqa: E402


def pipelined_commits(plan, attempts: list[list]) -> list[dict]:
    """Commit batch ``b`` with the commit messages ``attempts[b]``, for every ``b`` in order, on one
    socket without waiting for replies in between; the replies, in the order they came."""
    sock = client.context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(plan.endpoint)
        for b, messages in enumerate(attempts):
            sock.send(protocol.pack({"op": Request.COMMIT.value, "stream": plan.stream, "query": plan.query,
                                     "batch": b, "tokens": D._tokens(messages), "final": plan.final}))
        replies = []
        for _ in attempts:
            assert sock.poll(20_000), "a commit was not answered"
            replies.append(protocol.unpack(sock.recv()))
        return replies
    finally:
        sock.close(linger=0)


#: Per Spark batch: the keys of its rows, cut into RecordBatches, and whether a losing attempt
#: (never committed) also wrote rows for it.
BATCHES = st.lists(st.tuples(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=4), min_size=1, max_size=3),
                             st.booleans()), min_size=1, max_size=4)


@pytest.mark.timeout(120)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=FUZZ_SEEDS, batches=BATCHES)
def test_pipelined_streaming_commits_enter_once_in_order(seed, batches):
    with ThreadJob(capture_job, fuzz=seed) as job:
        plan = D._plan_write({"endpoint": job.endpoint, "stream": "events", "timeout": "20"}, SCHEMA, False,
                             "stream-fuzz", None)
        winners, lost = [], 0
        for b, (parts, loser) in enumerate(batches):
            if loser:
                D._write(plan, iter([batch([k + 1000 for k in parts[0]])]), b)
                lost += len(parts[0])
            winners.append([D._write(plan, iter([batch(keys) for keys in parts]), b)])
        replies = pipelined_commits(plan, winners)
        assert all(r["ok"] and not r.get("duplicate") for r in replies), replies
        assert sorted(r["epoch"] for r in replies) == list(range(len(batches)))
        assert D._commit(plan, winners[0], 0)["duplicate"]  # a replay adds nothing
        rows = [sorted(k for keys in parts for k in keys) for parts, _ in batches]
        assert read_all(job.endpoint, "tenfold", 0, len(batches)) == sorted(
            (e, k, 10 * k) for e, keys in enumerate(rows) for k in keys)
        stats = spark_bridge.status(job.endpoint)["stats"]["events"]
        assert (stats["epochs"], stats["rows"], stats["dropped_rows"]) == (len(batches), sum(map(len, rows)), lost)
        assert stats["staged_tokens"] == 0
        result = job.stop()
    assert result == [(e, [(k, k) for k in keys]) for e, keys in enumerate(rows)]


# -- frames thrown at every bridge port of a running 2-worker job ---------------------------------------------
def _fuzz_message(rng, target: int) -> list[bytes]:
    """A random message for the coordinator (``target`` 0) or a data endpoint: random frames, or a
    plausible request with random fields, cut short or with bytes flipped. Never a well-formed
    close, shutdown or stop (those are legitimate requests: the job would end as asked), and only
    made-up tokens, queries and sinks."""
    def word() -> str:
        return rng.choice(["events", "counts", "", "x" * rng.randint(1, 40), "é"])

    def num() -> object:
        return rng.choice([0, 1, -1, 2**40, "1", None, 1.5, [1]])

    if rng.random() < 0.3:
        return [rng.randbytes(rng.choice([0, 1, 8, 100, 5000])) for _ in range(rng.randint(1, 6))]
    if target == 0:
        op = rng.choice(["hello", "plan", "commit", "abort", "status", "nope", 7])
        body = {"op": op, "stream": word(), "kind": rng.choice(["write", "read", "x"]), "query": word(),
                "batch": num(), "worker": num(), "endpoint": word(), "generation": word(), "job": word(),
                "tokens": rng.choice([[], [[rng.randbytes(4).hex(), [[rng.randint(0, 2), rng.randint(0, 9)]]]],
                                      [["t", "x"]], None]), "final": rng.choice([True, False, None])}
        frames = [protocol.pack({k: v for k, v in body.items() if rng.random() < 0.8})]
    else:
        op = rng.choice([b"B", b"D", b"E", b"S", b"R", b"L", b"Q"])
        key = rng.randbytes(rng.randint(0, 20))
        body = {"stream": word(), "query": word(), "batch": num(), "partition": num(), "attempt": num(),
                "generation": word(), "rows": num(), "batches": num(), "sink": word() + "?", "start": num(),
                "end": num(), "upto": num()}
        frames = [op, key, protocol.pack(body), rng.randbytes(rng.randint(0, 300))]
    frames = frames[:rng.randint(1, len(frames))] if rng.random() < 0.3 else frames
    if rng.random() < 0.3:
        i = rng.randrange(len(frames))
        f = bytearray(frames[i])
        if f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(f[:rng.randint(0, len(f))])
    return frames


@pytest.mark.timeout(120)
def test_random_frames_at_every_bridge_port_leave_the_output_exact(tmp_path):
    import random
    import threading
    import time
    from collections import Counter

    from procs import no_leftover_children
    from sparkjob import LaunchedJob

    rng = random.Random(13)
    with no_leftover_children(), LaunchedJob(tmp_path) as job:
        targets = [job.endpoint, *spark_bridge.status(job.endpoint)["endpoints"]]
        stop = threading.Event()
        sent = [0]

        def fuzz():
            socks = [client.context().socket(zmq.DEALER) for _ in targets]
            for s, ep in zip(socks, targets):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(ep)
            while not stop.is_set():
                i = rng.randrange(len(targets))
                socks[i].send_multipart(_fuzz_message(rng, i))
                sent[0] += 1
                while socks[i].poll(0):  # replies and refusals
                    socks[i].recv_multipart()
                if sent[0] % 50 == 0:
                    time.sleep(0.005)
            for s in socks:
                s.close(linger=0)

        fuzzer = threading.Thread(target=fuzz, daemon=True)
        fuzzer.start()
        written: dict[int, list[int]] = {}  # epoch -> keys (value = key)
        deadline = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < deadline or i < 3:
            keys = [(i * 7 + j) % 23 for j in range(50 + i)]
            opts = {"endpoint": job.endpoint, "stream": "events", "timeout": "20", "keyColumn": "key"}
            plan = D._plan_write(opts, SCHEMA, False, f"real-{i}", 0)
            m = D._write(plan, iter([batch(keys[:20]), batch(keys[20:])]), 0)
            written[int(D._commit(plan, [m], 0)["epoch"])] = keys
            i += 1
        stop.set()
        fuzzer.join(10)
        info = spark_bridge.status(job.endpoint)
        assert sent[0] > 100 and info["refused"] > 0, (sent[0], info["refused"])
        # forged commits of made-up attempts may have taken epochs, but with no rows in them
        epochs = max(written) + 1
        r = D.TimelyBatchReader({"endpoint": job.endpoint, "stream": "counts", "startingEpoch": "0",
                                 "endingEpoch": str(epochs), "epochColumn": "epoch", "timeout": "20"})
        counts = sorted((row["epoch"], row["key"], row["count"]) for p in r.partitions() for b in r.read(p)
                        for row in b.to_pylist())
        captures = job.stop()
    assert counts == sorted((e, k, n) for e, keys in written.items() for k, n in Counter(keys).items())
    seen = Counter((e, tuple(r)) for c in captures for e, recs in c["epochs"] for r in recs)
    assert seen == Counter((e, (k, k)) for e, keys in written.items() for k in keys)
    assert "refused a message" in job.log.read_text()
