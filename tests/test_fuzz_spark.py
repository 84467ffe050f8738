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
