"""Limits of the ZeroMQ allocator in bytes, and who may talk to a job (issue 13, item 5 and the
job secret): message size limit, strangers' huge messages, memory with a slow consumer, the mailbox
bound, and CURVE-secured worker links.

Every multi-process test forks through :func:`timely.cluster.supervise` (or ``execute_cluster``),
has a timeout, and the ``no_leftovers`` fixture kills and reaps anything left behind, then asserts
that nothing was. Memory is the peak resident set of a worker process (``VmHWM``, reset through
``/proc/self/clear_refs`` when the measurement starts).
"""
from __future__ import annotations

import collections
import multiprocessing
import os
import time

import pytest
import zmq
from procs import no_leftover_children

from timely.cluster import execute_cluster, supervise
from timely.comm.endpoints import free_loopback_ports, ipc_endpoints
from timely.comm.errors import HandshakeError, MessageTooLarge
from timely.comm.framing import Kind, encode, pack_header
from timely.comm.secret import JobSecret
from timely.comm.zmq_allocator import ZmqAllocator

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture
def no_leftovers():
    """After the test, kill and reap every child (orphaned workers included) and fail if any."""
    with no_leftover_children():
        yield


def _results(outcomes):
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"{o.describe()}\n{o.traceback}" for o in bad)
    return [o.result for o in outcomes]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0) and return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _pump(alloc, pullers, until, timeout=30.0):
    """Receive into ``pullers`` (draining them) until ``until()`` or ``timeout``; yield messages."""
    deadline = time.monotonic() + timeout
    while True:
        alloc.receive()
        alloc.events()
        for puller in pullers:
            yield from puller.drain()
        alloc.release()
        if until():
            return
        assert time.monotonic() < deadline, "messages did not arrive"
        alloc.await_events(0.02)


def test_a_push_over_the_limit_raises_and_sends_nothing(no_leftovers, tmp_path):
    endpoints = ipc_endpoints(str(tmp_path), 2)
    limit = 64 << 10

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", max_message_bytes=limit)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 0:
                pushers[1].push(("small", 0))
                try:
                    pushers[1].push(("big", b"x" * (limit + 1)))
                except MessageTooLarge as exc:
                    caught = (exc.size, exc.limit, str(exc))
                pushers[1].push(("fits", b"y" * (limit - 64)))
                pushers[1].push(("small", 1))
                alloc.release()
                report(caught)
                return
            got: list = []
            for m in _pump(alloc, [puller], lambda: len(got) >= 3):
                got.append(m)
            report([(tag, len(x) if isinstance(x, bytes) else x) for tag, x in got])
        finally:
            alloc.close()

    (size, lim, message), got = _results(supervise(entry, range(2), timeout=40))
    assert lim == limit and size > limit and "max_message_bytes" in message
    # The refused message took no sequence number: the rest arrived in order, nothing lost.
    assert got == [("small", 0), ("fits", limit - 64), ("small", 1)]


def test_a_stranger_cannot_make_a_worker_buffer_a_huge_message(no_leftovers):
    """Before the handshake, a 256 MiB message is dropped at its size header (MAXMSGSIZE): the
    workers' peak memory does not grow by it, and their exchange is exactly right."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_loopback_ports(2)]
    sent = multiprocessing.get_context("fork").Event()
    huge = 256 * MiB

    def stranger(report):
        ctx = zmq.Context(1)
        socks = []
        for endpoint in endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(endpoint)
            # bytes(n) is calloc'd zero pages: cheap for this process to hold and to send.
            s.send_multipart([pack_header(Kind.HELLO, 0), bytes(huge)], copy=False)
            socks.append((s, monitor))
        deadline = time.monotonic() + 5
        # each worker hangs up on us as soon as it reads the size
        dropped = sum(bool(m.poll(max(0, int((deadline - time.monotonic()) * 1000)))) for _, m in socks)
        for s, m in socks:
            m.close(0)
            s.close(0)
        ctx.term()
        sent.set()
        report(dropped)

    def entry(index, report):
        if index == 2:
            return stranger(report)
        alloc = ZmqAllocator(index, 2, endpoints, "job")
        try:
            base = _reset_peak()
            pushers, puller = alloc.allocate(0)
            got: list = []
            for m in _pump(alloc, [puller], sent.is_set):
                got.append(m)
            for k in range(1000):
                pushers[k % 2].push((index, k))
            for m in _pump(alloc, [puller], lambda: len(got) >= 1000):
                got.append(m)
            report((_status("VmHWM") - base, sorted(got), alloc.refused))
        finally:
            alloc.close()

    (grew0, got0, _), (grew1, got1, _), dropped = _results(supervise(entry, range(3), timeout=50))
    assert max(grew0, grew1) < 32 * MiB, f"workers grew by {grew0 >> 20} and {grew1 >> 20} MiB"
    assert dropped == 2
    assert got0 == sorted((w, k) for w in (0, 1) for k in range(0, 1000, 2))
    assert got1 == sorted((w, k) for w in (0, 1) for k in range(1, 1000, 2))


def test_a_slow_consumer_of_large_batches_keeps_memory_bounded(no_leftovers, tmp_path):
    """160 batches of 1 MiB to a consumer taking 10 ms each: ZeroMQ's queues hold ``hwm``
    messages, not all of them (the default ``hwm`` of 256 held every batch on both sides)."""
    endpoints = ipc_endpoints(str(tmp_path), 2)
    batches, size = 160, MiB

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", max_message_bytes=2 * MiB, inflight_bytes=32 * MiB,
                             backlog_bytes=4 * MiB)
        try:
            pushers, puller = alloc.allocate(0)
            base = _reset_peak()
            if index == 0:
                for b in range(batches):
                    pushers[1].push((b, os.urandom(16) + bytes(size - 16)))
                    alloc.release()
                alloc.receive()
                report(_status("VmHWM") - base)
                return
            got = []
            for b, payload in _pump(alloc, [puller], lambda: len(got) >= batches):
                assert len(payload) == size
                got.append(b)
                time.sleep(0.01)
            report((_status("VmHWM") - base, got))
        finally:
            alloc.close()

    producer, (consumer, got) = _results(supervise(entry, range(2), timeout=50))
    assert got == list(range(batches))  # nothing lost, in order
    # hwm = 16 (the floor): at most 16 MiB queued on each side, 4 MiB + 1 MiB in the backlog.
    assert producer < 48 * MiB, f"the producer grew by {producer >> 20} MiB"
    assert consumer < 48 * MiB, f"the consumer grew by {consumer >> 20} MiB"


def test_the_mailbox_stops_reading_when_full_and_nothing_is_lost(no_leftovers, tmp_path):
    """Two workers flood each other and read nothing until the end: what each has received but
    not taken stays under ``mailbox_bytes`` (plus one message), and everything arrives."""
    endpoints = ipc_endpoints(str(tmp_path), 2)
    batches, size = 200, 10000

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", hwm=4, backlog_bytes=256 << 10, mailbox_bytes=MiB)
        try:
            pushers, puller = alloc.allocate(0)
            batch = [(index, i) for i in range(size)]
            worst = 0
            for _ in range(batches):
                pushers[1 - index].push(batch)
                alloc.release()
                worst = max(worst, alloc._mailbox.unread_bytes)
            got = []
            for b in _pump(alloc, [puller], lambda: len(got) >= batches):
                got.append(len(b))
            report((worst, sum(got)))
        finally:
            alloc.close()

    for worst, total in _results(supervise(entry, range(2), timeout=50)):
        assert total == batches * size
        assert 0 < worst <= MiB + 200_000, worst



def test_messages_for_a_channel_not_allocated_yet_do_not_stop_reading(no_leftovers, tmp_path):
    """Worker 1 runs ahead and sends 4 MiB on channel 1, which worker 0 has not allocated; worker 2
    then sends the message worker 0 needs on channel 0 before it can go on (its last progress, say).
    Worker 0 must read it although it holds more than ``mailbox_bytes`` for channel 1: counting
    those bytes stopped it reading for good. Then channel 1 gets everything, in order."""
    endpoints = ipc_endpoints(str(tmp_path), 3)
    flood = 64

    def entry(index, report):
        alloc = ZmqAllocator(index, 3, endpoints, "job", mailbox_bytes=MiB)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 1:
                ahead, _ = alloc.allocate(1)
                for i in range(flood):
                    ahead[0].push((i, b"x" * 65536))
                    alloc.release()
            elif index == 2:
                time.sleep(0.5)  # after the flood has arrived
                pushers[0].push("the last word on channel 0")
            else:
                got = []
                for m in _pump(alloc, [puller], lambda: bool(got), timeout=20):
                    got.append(m)
                _, later = alloc.allocate(1)
                seen: list = []
                for i, _ in _pump(alloc, [later], lambda: len(seen) >= flood, timeout=20):
                    seen.append(i)
                report((got, seen))
                return
            report(None)
        finally:
            alloc.close()

    results = _results(supervise(entry, range(3), timeout=60))
    assert results[0] == (["the last word on channel 0"], list(range(flood)))


# -- the job secret ------------------------------------------------------------------------------
def _count_job(worker):
    """Each worker sends 300 keyed records through an exchange; per-key counts come back."""
    with worker.dataflow() as scope:
        inp = scope.new_input()
        out: list = []
        probe = inp.stream.count_by_key().inspect(out.append).probe()
    inp.send_batch([(worker.index * 300 + i) % 37 for i in range(300)])
    inp.close()
    worker.step_while(lambda: not probe.done())
    return out


def _expected_counts(workers):
    return collections.Counter((w * 300 + i) % 37 for w in range(workers) for i in range(300))


def test_a_job_with_a_secret_computes_exactly_over_tcp(no_leftovers):
    outs = execute_cluster(_count_job, 3, transport="tcp", timeout=50, secret=JobSecret.from_text("s3cret"))
    counts = collections.Counter()
    for out in outs:
        for key, count in out:
            counts[key] += count
    assert counts == _expected_counts(3) and sum(len(o) for o in outs) == 37


@pytest.mark.parametrize("secrets", [("a", "b"), ("a", None), (None, "b")], ids=["differ", "first", "second"])
def test_a_worker_with_another_secret_cannot_join(no_leftovers, secrets):
    """The failed security handshake is reported at once; a worker whose peer left before that
    handshake could even start times out instead, and both messages say the secret may differ."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_loopback_ports(2)]

    def entry(index, report):
        text = secrets[index]
        try:
            ZmqAllocator(index, 2, endpoints, "job", startup_timeout=4,
                         secret=None if text is None else JobSecret.from_text(text)).close()
        except HandshakeError as exc:
            report(str(exc))
            return
        report(None)

    messages = _results(supervise(entry, range(2), timeout=30, collect=15))
    for message in messages:
        assert message is not None and "secret" in message, message
    assert any("security handshake with worker" in m for m in messages), messages


def test_a_stranger_without_the_secret_is_never_seen_by_the_job(no_leftovers):
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_loopback_ports(2)]
    done = multiprocessing.get_context("fork").Event()
    secret = JobSecret.from_text("s3cret")

    def stranger(report):
        ctx = zmq.Context(1)
        sent = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for endpoint in endpoints:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                if sent % 2:  # a CURVE client with keys of its own
                    public, private = zmq.curve_keypair()
                    s.setsockopt(zmq.CURVE_SERVERKEY, secret.server_public)
                    s.setsockopt(zmq.CURVE_PUBLICKEY, public)
                    s.setsockopt(zmq.CURVE_SECRETKEY, private)
                s.connect(endpoint)
                hello = encode({"token": "guess", "index": 1, "peers": 2, "version": 1})
                for frames in ([b"junk"], [pack_header(Kind.HELLO, 1), hello], [pack_header(Kind.DATA, 1), b"\x90"]):
                    try:
                        s.send_multipart(frames, zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:  # (its connection refused by the secret: no pipe to queue on)
                        pass
                time.sleep(0.02)
                s.close(0)
        ctx.term()
        done.set()
        report(sent)

    def entry(index, report):
        if index == 2:
            return stranger(report)
        alloc = ZmqAllocator(index, 2, endpoints, "job", secret=secret)
        try:
            pushers, puller = alloc.allocate(0)
            got: list = []
            for m in _pump(alloc, [puller], done.is_set):
                got.append(m)
            for k in range(100):
                pushers[1 - index].push(k)
            for m in _pump(alloc, [puller], lambda: len(got) >= 100):
                got.append(m)
            report((got, alloc.refused))
        finally:
            alloc.close()

    (got0, refused0), (got1, refused1), sent = _results(supervise(entry, range(3), timeout=50))
    assert sent > 0 and got0 == got1 == list(range(100))
    assert refused0 == refused1 == 0  # nothing the stranger sent reached the workers' code

