"""Channels gather the records for each other worker into large messages (issue 14), split what
exceeds the allocator's message limit, and name the operator and record when one cannot be sent.

The gathered encoding is checked against msgpack's own encoding of the same message; a channel is
driven directly with recording pushers (every message it sends is seen); and whole jobs check that
splitting and errors behave end to end.
"""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timely import routing
from timely.cluster import WorkerError, execute_cluster
from timely.comm.framing import decode, encode, encode_gathered, encode_items
from timely.dataflow.channels import BUFFER_RECORDS, EAGER_RECORDS, BroadcastChannel, DistributeChannel, ExchangeChannel

records = st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=5), st.binary(max_size=5),
                    st.tuples(st.integers(0, 10**6), st.text(max_size=3)))


@given(head=st.one_of(st.integers(0, 2**40), st.tuples(st.integers(0, 9), st.integers(0, 9))),
       items=st.lists(records, max_size=70), cuts=st.lists(st.integers(0, 70), max_size=6))
def test_a_gathered_message_decodes_as_the_whole_message_would(head, items, cuts):
    bounds = sorted({0, len(items), *(c for c in cuts if c <= len(items))})
    pieces = [items[a:b] for a, b in zip(bounds, bounds[1:])]
    gathered = encode_gathered(head, [encode_items(p) for p in pieces], len(items))
    assert gathered == encode((head, items))
    assert decode(gathered) == decode(encode((head, items)))


def test_array_headers_of_every_size_class():
    for n in (0, 15, 16, 65535, 65536):
        items = [1] * n
        assert encode_gathered(7, [encode_items(items[: n // 2]), encode_items(items[n // 2:])], n) == encode((7, items))


class RecordingPusher:
    """A remote pusher that encodes as the ZeroMQ one does and records every message it sends."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.messages: list[tuple[object, tuple, int]] = []  # (time, records, encoded bytes)

    encode_items = staticmethod(encode_items)

    def push_items(self, head, bodies, count):
        payload = encode_gathered(head, bodies, count)
        time, items = decode(payload)
        assert len(items) == count
        self.messages.append((time, items, len(payload)))

    def push(self, message):  # pragma: no cover - channels only gather
        raise AssertionError("a channel sends records only through push_items")


def make_channel(kind, peers: int, index: int = 0, max_bytes: int | None = 8 << 20, **kw):
    """A channel of ``kind`` on worker ``index`` of ``peers``, with recording pushers and a local target."""
    pushers = [RecordingPusher(max_bytes) for _ in range(peers)]
    delivered: list[tuple[object, list]] = []
    target = SimpleNamespace(op=SimpleNamespace(name="Sink#7"), deliver=lambda t, b: delivered.append((t, list(b))))
    df = SimpleNamespace(index=index, peers=peers, ctx=SimpleNamespace(pending=[]),
                         allocate_channel=lambda target: (pushers, None))
    return kind(df, target, **kw), pushers, delivered, df.ctx.pending


def flush(pending):
    while pending:
        pending.pop().flush()


def test_an_exchange_among_16_workers_sends_messages_of_thousands_of_records():
    peers = 16
    channel, pushers, delivered, pending = make_channel(ExchangeChannel, peers, key=0)
    rnd = random.Random(3)
    sent = []
    for _ in range(40):  # 40 batches of 4096: each cut into 16 parts of ~256
        batch = [(rnd.randrange(10**6), i) for i in range(4096)]
        sent += batch
        assert channel.push(5, batch) == len(batch)
    assert pending == [channel]
    flush(pending)
    got: Counter = Counter()
    for t, recs in delivered:
        assert t == 5
        got.update(recs)
    for w, pusher in enumerate(pushers[1:], start=1):
        sizes = [len(items) for _, items, _ in pusher.messages]
        assert sizes and all(s >= BUFFER_RECORDS for s in sizes[:-1]), sizes  # only the flushed tail is smaller
        for t, items, _ in pusher.messages:
            assert t == 5
            assert all(routing.hash64(r[0]) % peers == w for r in items)
            got.update(items)
    assert got == Counter(sent)
    assert sum(len(p.messages) for p in pushers) < 40 * 15 / 10  # vs one message per part before


def test_records_of_another_time_send_what_was_gathered_first():
    channel, pushers, _, pending = make_channel(ExchangeChannel, 2, key=None)
    remote = [r for r in range(200) if routing.hash64(r) % 2 == 1]
    channel.push(1, remote[:10])
    channel.push(2, remote[10:20])
    assert [(t, list(items)) for t, items, _ in pushers[1].messages] == [(1, remote[:10])]
    flush(pending)
    assert [(t, list(items)) for t, items, _ in pushers[1].messages] == [(1, remote[:10]), (2, remote[10:20])]


def test_a_batch_larger_than_a_message_is_sent_in_pieces_under_the_limit():
    limit = 16 << 10
    channel, pushers, delivered, pending = make_channel(BroadcastChannel, 3, max_bytes=limit)
    batch = [("x" * 100, i) for i in range(3000)]  # ~320 KB encoded
    assert channel.push(0, batch) == 3 * len(batch)
    flush(pending)
    assert delivered == [(0, batch)]
    for pusher in pushers[1:]:
        assert all(size <= limit for _, _, size in pusher.messages)
        assert [r for _, items, _ in pusher.messages for r in items] == batch  # in order, each once


def test_a_record_larger_than_a_message_is_an_error_naming_operator_and_record():
    # A large part is encoded at the push, a small one when its message is sent: both name it.
    big = [("huge", "y" * 20_000)] + [("small", i) for i in range(EAGER_RECORDS - 1)]
    for batch, when in ((big, "push"), (big[:1], "flush")):
        channel, _, _, pending = make_channel(DistributeChannel, 2, max_bytes=8 << 10,
                                              partitioner=lambda t, b, peers: [[], list(b)])
        with pytest.raises(ValueError, match=r"operator 'Sink#7': record \('huge', 'yyyy.*at time 3 is .* bytes "
                                             r"encoded, more than one message may carry \(max_message_bytes\)"):
            channel.push(3, batch)
            assert when == "flush"
            flush(pending)


def test_an_unserialisable_record_in_a_small_part_is_an_error_naming_it_when_its_message_is_sent():
    channel, _, _, pending = make_channel(DistributeChannel, 2, partitioner=lambda t, b, peers: [[], list(b)])
    channel.push(4, [(1, 2), (1, {2})])  # fewer than EAGER_RECORDS: gathered unencoded
    with pytest.raises(TypeError, match=r"operator 'Sink#7': record \(1, \{2\}\) at time 4 cannot be sent to another "
                                        r"worker: records must be msgpack-serialisable"):
        flush(pending)


def test_small_parts_of_large_records_are_encoded_and_sent_before_they_pile_up():
    # 400 records of ~20 KB, one per batch (a part of one record each): at most EAGER_RECORDS wait
    # unencoded, and the encoded ones leave in messages under the limit, before any flush.
    limit = 256 << 10
    channel, pushers, _, pending = make_channel(DistributeChannel, 2, max_bytes=limit,
                                                partitioner=lambda t, b, peers: [[], list(b)])
    for i in range(400):
        channel.push(0, [(i, "z" * 20_000)])
    sent = [r for _, items, _ in pushers[1].messages for r in items]
    assert len(sent) >= 400 - EAGER_RECORDS - limit // 20_000
    assert all(size <= limit for _, _, size in pushers[1].messages)
    flush(pending)
    assert [r[0] for _, items, _ in pushers[1].messages for r in items] == list(range(400))


@settings(max_examples=60, deadline=None)
@given(peers=st.integers(2, 5), limit=st.sampled_from([1024, 4096, None]),
       steps=st.lists(st.one_of(st.tuples(st.integers(0, 3), st.integers(0, 3 * EAGER_RECORDS)), st.none()),
                      max_size=25))
def test_an_exchange_delivers_every_record_once_at_its_time_in_messages_under_the_limit(peers, limit, steps):
    """Random pushes (small parts gathered unencoded, large ones encoded at once), times and
    flushes (None), against the sequential routing of the same records."""
    channel, pushers, delivered, pending = make_channel(ExchangeChannel, peers, max_bytes=limit, key=0)
    expected: Counter = Counter()
    serial = 0
    for step in steps:
        if step is None:
            flush(pending)
            continue
        t, n = step
        batch = [(serial + i, "v" * (i % 7)) for i in range(n)]
        serial += n
        channel.push(t, batch)
        expected.update((routing.hash64(r[0]) % peers, t, r) for r in batch)
    flush(pending)
    assert not pending
    got: Counter = Counter((0, t, r) for t, recs in delivered for r in recs)
    for w, pusher in enumerate(pushers[1:], start=1):
        for t, items, size in pusher.messages:
            assert items and (limit is None or size <= limit)
            got.update((w, t, r) for r in items)
    assert got == expected


def test_an_unserialisable_record_is_an_error_naming_operator_and_record():
    channel, _, _, _ = make_channel(BroadcastChannel, 2)
    with pytest.raises(TypeError, match=r"operator 'Sink#7': record \(1, \{2\}\) at time 0 cannot be sent to another "
                                        r"worker: records must be msgpack-serialisable"):
        channel.push(0, [(1, 2), (1, {2})])


def test_the_record_blamed_is_the_one_that_cannot_be_encoded_not_one_holding_an_extension_type():
    """A record holding a registered extension type (an Arrow batch, which crosses workers) was
    blamed for another record's fault: the check used plain msgpack."""
    pa = pytest.importorskip("pyarrow")
    import timely.columnar  # noqa: F401  (registers pyarrow.RecordBatch)

    channel, _, _, _ = make_channel(BroadcastChannel, 2)
    batch = pa.RecordBatch.from_pydict({"a": [1, 2]})
    with pytest.raises(TypeError, match=r"record \(2, <object object at .*>\) at time 0 cannot be sent"):
        channel.push(0, [(1, batch), (2, object())])


def test_exchange_true_is_refused_not_taken_for_field_1():
    from timely.dataflow.channels import Exchange, pact_of

    for key in (True, False):
        with pytest.raises(TypeError, match=f"exchange key must be a field index, a function or None, not {key}"):
            Exchange(key)
    with pytest.raises(TypeError, match="not True"):
        pact_of(True)


# -- end to end -------------------------------------------------------------------------------------
def _exchange_job(worker):
    n = int(worker.args[0])
    got: list = []
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.exchange(1).inspect_batch(lambda t, b: got.extend((t, r) for r in b)).probe()
    for t in range(2):
        inp.send_batch([("x" * 200, i, worker.index) for i in range(n)])  # ~210 B each, over many messages
        inp.advance_to(t + 1)
    inp.close()
    worker.finish()
    return got


@pytest.mark.timeout(60)
def test_a_job_with_a_small_message_limit_moves_every_record_exactly_once():
    results = execute_cluster(_exchange_job, 2, ["3000"], max_message_bytes=32 << 10)
    got = Counter(x for res in results for x in res)
    assert got == Counter((t, ("x" * 200, i, w)) for t in range(2) for i in range(3000) for w in range(2))
    for w, res in enumerate(results):
        assert all(routing.hash64(r[1]) % 2 == w for _, r in res)


@pytest.mark.timeout(60)
def test_a_job_with_the_smallest_message_limit_still_exchanges_records():
    # max_message_bytes may be as small as 1 KiB: the records' share of a message must stay positive.
    results = execute_cluster(_exchange_job, 2, ["20"], max_message_bytes=1024)
    got = Counter(x for res in results for x in res)
    assert got == Counter((t, ("x" * 200, i, w)) for t in range(2) for i in range(20) for w in range(2))


def _huge_record_job(worker):
    other = next(k for k in range(100) if routing.hash64(k) % 2 != worker.index)  # a key of the other worker
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.exchange(0).probe()
    inp.send((other, "z" * 100_000))
    inp.close()
    worker.finish()


@pytest.mark.timeout(60)
def test_a_job_refuses_a_record_over_the_message_limit_by_name():
    with pytest.raises(WorkerError, match="more than one message may carry"):
        execute_cluster(_huge_record_job, 2, max_message_bytes=32 << 10)


def _unserialisable_record_job(worker):
    other = next(k for k in range(100) if routing.hash64(k) % 2 != worker.index)
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.map(lambda r: (r, {r}), name="Setter").exchange(0).probe()
    inp.send(other)  # one record: gathered unencoded, encoded when the dataflow sends its messages
    inp.close()
    worker.finish()


@pytest.mark.timeout(60)
def test_a_job_blames_the_operator_that_produced_an_unserialisable_record():
    with pytest.raises(WorkerError, match=r"operator 'Setter' failed: .*record \(\d+, \{\d+\}\) at time 0 cannot be "
                                          r"sent to another worker"):
        execute_cluster(_unserialisable_record_job, 2)


def _many_epochs_in_one_step_job(worker):
    """Worker 0 sends records at 300 epochs before it steps: its first step's progress batch is
    far larger than a message of 1 KiB. Per key, the count of each epoch."""
    out = []
    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.map(lambda x: (x, 1)).count_by_key(0).inspect(out.append).probe()
    for e in range(300):
        if worker.index == 0:
            inp.send_batch([e, e + 1, e + 2, e + 3])
        inp.advance_to(e + 1)
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=40)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("progress", ["direct", "relay"])
def test_a_progress_batch_larger_than_a_message_is_sent_in_pieces(progress):
    """A step's progress batch went as one message: past max_message_bytes (many epochs in one
    step) the job failed with MessageTooLarge. It goes in pieces, the positive updates first."""
    results = execute_cluster(_many_epochs_in_one_step_job, 3, timeout=60, progress=progress, max_message_bytes=1024)
    got = sorted(r for result in results for r in result)
    assert got == sorted((e + k, 1) for e in range(300) for k in range(4))
