"""The ZeroMQ allocator between real processes: ordering, loss, backpressure, handshake, failures.

Every multi-process test forks at most 3 workers through :func:`timely.cluster.supervise`, has a
timeout, and the ``no_leftovers`` fixture kills and reaps anything left behind, then asserts that
nothing was.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from procs import no_leftover_children

from timely.cluster import supervise
from timely.comm import framing
from timely.comm.endpoints import free_loopback_ports, hostfile_endpoints, ipc_endpoints, parse_hostfile
from timely.comm.errors import AddressInUse, ChannelMismatch, HandshakeError, HostfileError, PeerLost
from timely.comm.zmq_allocator import ZmqAllocator
from timely.errors import TimelyError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_leftovers():
    """After the test, kill and reap every child (orphaned workers included) and fail if any."""
    with no_leftover_children():
        yield


@pytest.fixture
def endpoints(tmp_path):
    """Three ipc endpoints in a private directory."""
    return ipc_endpoints(str(tmp_path), 3)


def _run(entry, n, collect=0.5):
    outcomes = supervise(entry, range(n), collect=collect, timeout=50)
    return outcomes


def _results(outcomes):
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"{o.describe()}\n{o.traceback}" for o in bad)
    return [o.result for o in outcomes]


def _drain_until(alloc, pullers, done, timeout=30.0, events=None):
    """Receive and yield what ``pullers`` get until ``done()``; add the channels reported to ``events``."""
    deadline = time.monotonic() + timeout
    while not done():
        alloc.receive()
        reported = alloc.events()  # as the worker does: what it reports counts as read (the mailbox bound)
        if events is not None:
            events.update(reported)
        for puller in pullers:
            yield from puller.drain()
        alloc.release()
        if time.monotonic() > deadline:
            raise TimeoutError("messages did not arrive")
        alloc.await_events(0.05)
    for puller in pullers:
        yield from puller.drain()


def _greet_all(alloc):
    """Every worker sends its pid to every worker on channel 0; return the pids by worker index."""
    pushers, puller = alloc.allocate(0)
    for p in pushers:
        p.push((alloc.index, os.getpid()))
    alloc.release()
    pids: dict[int, int] = {}
    for who, pid in _drain_until(alloc, [puller], lambda: len(pids) >= alloc.peers):
        pids[who] = pid
    return pids


def _until_peer_lost(alloc, limit=20.0):
    """Receive until :class:`PeerLost` (return it and the seconds it took) or for about ``limit``
    seconds (return None)."""
    start = time.monotonic()
    try:
        while time.monotonic() - start < limit:
            alloc.receive()
            alloc.await_events(None)
    except PeerLost as exc:
        return exc, time.monotonic() - start
    return None


# -- framing and endpoints (no processes) ---------------------------------------------------------
def test_header_roundtrip_and_payload_types():
    head = framing.pack_header(framing.Kind.DATA, 7, 123456, 2**40)
    assert len(head) == framing.HEADER.size == 16
    assert framing.unpack_header(head) == (framing.Kind.DATA, 7, 123456, 2**40)
    value = {"t": (1, (2, 3)), "l": [1, [2]], 5: b"\x00raw", (1, 2): "s", "big": 2**64 - 1}
    out = framing.decode(framing.encode(value))
    assert out == {"t": (1, (2, 3)), "l": (1, (2,)), 5: b"\x00raw", (1, 2): "s", "big": 2**64 - 1}
    assert type(out["t"]) is tuple and type(out["l"]) is tuple  # lists arrive as tuples
    with pytest.raises(framing.FramingError):
        framing.unpack_header(b"\x09" + head[1:])
    with pytest.raises(TypeError):
        framing.encode(object())
    assert framing.decode(framing.encode([1, 2])) == (1, 2)  # the packer recovered


def test_comm_errors_are_timely_errors_with_their_builtin_base():
    for cls in (AddressInUse, ChannelMismatch, HandshakeError, PeerLost, framing.FramingError):
        assert issubclass(cls, TimelyError) and issubclass(cls, RuntimeError)
    assert issubclass(HostfileError, TimelyError) and issubclass(HostfileError, ValueError)
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile("# nothing\n")


def test_hostfile_endpoints():
    hosts = parse_hostfile("# cluster\nnode1:3000\n\nnode2   # default port\n", 2101)
    assert hosts == [("node1", 3000), ("node2", 2101)]
    assert hostfile_endpoints(hosts, 2) == ["tcp://node1:3000", "tcp://node1:3001", "tcp://node2:2101",
                                            "tcp://node2:2102"]


def test_single_worker_is_loopback_only():
    alloc = ZmqAllocator(0, 1, ["ipc:///nonexistent/unused"], "t")
    try:
        (me,), puller = alloc.allocate(0)
        batch = [(1, 2)]
        me.push(batch)
        assert alloc.events() == [0]
        assert puller.pull() is batch  # by reference: no serialisation on the loopback
        with pytest.raises(ValueError):
            alloc.allocate(0)
    finally:
        alloc.close()


def test_address_in_use_tcp_names_the_address():
    (port,) = free_loopback_ports(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        with pytest.raises(AddressInUse, match=f"tcp://127.0.0.1:{port}.*already in use"):
            ZmqAllocator(0, 2, [f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1"], "t", startup_timeout=1)
    finally:
        holder.close()


def test_address_in_use_ipc(tmp_path):
    path = str(tmp_path / "w0")
    holder = socket.socket(socket.AF_UNIX)
    holder.bind(path)
    holder.listen()
    try:
        with pytest.raises(AddressInUse, match="w0.*another process is listening"):
            ZmqAllocator(0, 2, [f"ipc://{path}", f"ipc://{tmp_path}/w1"], "t", startup_timeout=1)
    finally:
        holder.close()


# -- between processes -----------------------------------------------------------------------------
def test_fifo_no_loss_no_duplicates_several_channels(no_leftovers, endpoints):
    n, count, channels = 3, 3000, (0, 2, 5)

    def entry(index, report):
        alloc = ZmqAllocator(index, n, endpoints, "job")
        try:
            chans = [alloc.allocate(c) for c in channels]
            for k in range(count):
                for c, (pushers, _) in zip(channels, chans):
                    for pusher in pushers:
                        pusher.push((index, c, k, [k, "x"], {"k": (k,)}))
                if k % 50 == 0:
                    alloc.release()
            alloc.release()
            seen: dict[tuple[int, int], list[int]] = {}
            total = n * count * len(channels)
            got = 0
            pullers = [p for _, p in chans]
            events = set()
            for msg in _drain_until(alloc, pullers, lambda: got >= total, events=events):
                src, c, k, lst, dct = msg
                assert type(msg) is tuple and dct == {"k": (k,)}
                # Remote lists arrive as tuples; the loopback passes the very object pushed.
                assert lst == ([k, "x"] if src == index else (k, "x"))
                seen.setdefault((src, c), []).append(k)
                got += 1
            ok = sorted(seen) == [(s, c) for s in range(n) for c in channels] and all(
                v == list(range(count)) for v in seen.values())
            report((ok, got, sorted(events)))
        finally:
            alloc.close()

    for ok, got, events in _results(_run(entry, n)):
        assert ok and got == n * count * len(channels)
        assert set(events) == set(channels)


def test_messages_for_a_channel_not_yet_allocated_are_kept(no_leftovers, endpoints):
    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job")
        try:
            if index == 1:
                pushers, _ = alloc.allocate(4)
                for k in range(100):
                    pushers[0].push(k)
                alloc.close()
                report(None)
                return
            time.sleep(0.5)  # worker 1 is ahead: its messages arrive before we allocate
            alloc.receive()
            _, puller = alloc.allocate(4)
            assert 4 in alloc.events()
            got: list[int] = []
            for m in _drain_until(alloc, [puller], lambda: len(got) >= 100):
                got.append(m)
            report(got)
        finally:
            alloc.close()

    assert _results(_run(entry, 2))[0] == list(range(100))


def test_channel_mismatch_is_a_loud_error(no_leftovers, endpoints):
    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job")
        try:
            if index == 1:
                alloc.allocate(1)[0][0].push("hello")
                alloc.release()
                time.sleep(1.0)
                report(None)
                return
            alloc.allocate(0)
            try:
                time.sleep(0.3)
                alloc.receive()
                alloc.allocate(2)  # skipped 1: built a different dataflow
                for _ in range(100):
                    alloc.receive()
                    alloc.await_events(0.05)
            except ChannelMismatch as exc:
                report(str(exc))
                return
            report(None)
        finally:
            alloc.close()

    message = _results(_run(entry, 2))[0]
    assert message and "worker 1 sent a message on channel 1" in message and "same order" in message


def test_clean_close_delivers_everything_to_a_late_reader(no_leftovers, endpoints):
    """The sender closes right after pushing; the receiver starts reading a second later."""
    count = 20000

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job", hwm=16)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 0:
                for k in range(count):
                    pushers[1].push((k, list(range(10))))
                alloc.release()
                report(None)
                return
            time.sleep(1.0)
            got: list[int] = []
            for m in _drain_until(alloc, [puller], lambda: len(got) >= count):
                got.append(m[0])
            report(got == list(range(count)))
        finally:
            alloc.close()

    assert _results(_run(entry, 2)) == [None, True]


def test_slow_consumer_bounds_the_producer_backlog(no_leftovers, endpoints):
    bound, batches, size = 256 << 10, 300, 1000

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job", hwm=4, backlog_bytes=bound)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 0:
                peer = alloc._links.peer(1)
                worst = 0
                start = time.monotonic()
                for b in range(batches):
                    pushers[1].push([(b, i) for i in range(size)])
                    alloc.release()
                    worst = max(worst, peer.backlog_bytes)
                report((worst, time.monotonic() - start))
                return
            got = 0
            while got < batches:  # a slow consumer: about 4 ms per batch
                alloc.receive()
                for batch in puller.drain():
                    assert batch[0] == (got, 0) and len(batch) == size
                    got += 1
                    time.sleep(0.004)
                alloc.await_events(0.05)
            report(got)
        finally:
            alloc.close()

    (worst, elapsed), got = _results(_run(entry, 2))
    assert got == batches
    assert worst <= bound, f"backlog grew to {worst} bytes, bound {bound}"
    assert elapsed > batches * 0.004 * 0.5, "the producer was not slowed down by its consumer"


def test_two_workers_flooding_each_other_do_not_deadlock(no_leftovers, endpoints):
    batches, size = 200, 10000

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job", hwm=4, backlog_bytes=1 << 20)
        try:
            pushers, puller = alloc.allocate(0)
            other = 1 - index
            batch = [(index, i) for i in range(size)]
            for _ in range(batches):  # never receives explicitly: only release() does, when full
                pushers[other].push(batch)
                alloc.release()
            got = []
            for b in _drain_until(alloc, [puller], lambda: len(got) >= batches):
                got.append(len(b))
            report(sum(got))
        finally:
            alloc.close()

    assert _results(_run(entry, 2)) == [batches * size] * 2


def test_wrong_token_is_rejected(no_leftovers, endpoints):
    def entry(index, report):
        try:
            ZmqAllocator(index, 2, endpoints[:2], f"job-{index}", startup_timeout=5).close()
        except HandshakeError as exc:
            report(str(exc))
            return
        report(None)

    for message in _results(_run(entry, 2, collect=10)):
        assert message is not None and "token" in message, message


def test_killed_peer_raises_peer_lost_quickly(no_leftovers, endpoints):
    def entry(index, report):
        alloc = ZmqAllocator(index, 3, endpoints, "job")
        try:
            _greet_all(alloc)
            if index == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            lost = _until_peer_lost(alloc)
            report(None if lost is None else (lost[0].peer, str(lost[0]), lost[1]))
        finally:
            alloc.close()

    outcomes = _run(entry, 3, collect=15)
    assert outcomes[2].status == "killed" and outcomes[2].signal == signal.SIGKILL
    lost = []
    for o in outcomes[:2]:
        assert o.status == "ok", o.traceback
        peer, message, elapsed = o.result
        # Each survivor either notices worker 2 itself, or first hears the other survivor's ABORT,
        # whose reason names worker 2.
        assert "lost worker 2" in message, message
        assert elapsed < 5.0
        lost.append(peer)
    assert 2 in lost


def test_abort_tells_peers_why(no_leftovers, endpoints):
    def entry(index, report):
        if index == 1:
            ZmqAllocator(index, 2, endpoints[:2], "job").close(abort="ValueError: the reason")
            report(None)
            return
        alloc = None
        try:
            # The ABORT may even arrive while the constructor still waits for worker 1's WELCOME.
            alloc = ZmqAllocator(index, 2, endpoints[:2], "job")
            while True:
                alloc.receive()
                alloc.await_events(None)
        except PeerLost as exc:
            report(str(exc))
        finally:
            if alloc is not None:
                alloc.close()

    message = _results(_run(entry, 2))[0]
    assert "worker 1 failed: ValueError: the reason" in message


def test_an_idle_worker_uses_no_cpu(no_leftovers, endpoints):
    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job")
        try:
            alloc.allocate(0)
            cpu = time.process_time()
            alloc.await_events(1.0)
            report(time.process_time() - cpu)
        finally:
            alloc.close()

    for cpu in _results(_run(entry, 2)):
        assert cpu < 0.05


def test_links_probe_liveness_with_tcp_keepalive_not_zmtp_heartbeats():
    """Host liveness is the kernel's (keepalive every ``heartbeat_ivl`` s, ``TCP_USER_TIMEOUT`` of
    ``heartbeat_timeout``), never ZMTP heartbeats (see the next test). A cut link is detected
    end to end in tests/test_hosts.py."""
    import zmq

    from timely.comm.peer import Tuning

    tuning = Tuning(hwm=4, max_message_bytes=1 << 20, backlog_bytes=1 << 20, mailbox_bytes=1 << 20,
                    startup_timeout=1.0, heartbeat_ivl=0.75, heartbeat_timeout=3.0, goodbye_grace=1.0,
                    close_timeout=1.0, receive_batch=8, receive_bytes=1 << 20)
    ctx = zmq.Context()
    try:
        for kind in (zmq.DEALER, zmq.ROUTER):
            sock = ctx.socket(kind)
            tuning.apply(sock)
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            assert (sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE), sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL)) == (1, 1)
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_CNT) == 3 and sock.getsockopt(zmq.TCP_MAXRT) == 3000
            sock.close(0)
    finally:
        ctx.term()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_peer_lost_while_our_queue_from_it_is_full_is_reported(no_leftovers, endpoints, transport):
    """A peer that dies while this worker is not reading (its inbound queue from that peer full:
    ordinary backpressure) is reported as lost, by name. With ZMTP heartbeats libzmq aborted the
    whole process here (``Assertion failed: !_io_error``): a connection whose input is stopped
    was closed, then a heartbeat of it fell due."""
    if transport == "tcp":
        endpoints = [f"tcp://127.0.0.1:{port}" for port in free_loopback_ports(2)]

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job", hwm=1)
        try:
            _greet_all(alloc)
            pushers, _ = alloc.allocate(1)
            if index == 0:
                peer = alloc._links.peer(1)
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:  # worker 1 reads nothing: its queues fill, then ours
                    if peer.backlog_bytes < 4 << 20:
                        pushers[1].push(b"x" * 65536)
                    peer.flush()
                    time.sleep(0.001)
                assert peer.backlog, "worker 1's queues never filled"
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1.0)  # not reading: the connection closes under a full queue
            lost = _until_peer_lost(alloc)
            report(None if lost is None else str(lost[0]))
        finally:
            alloc.close()

    outcomes = _run(entry, 2, collect=15)
    assert outcomes[0].status == "killed", outcomes[0].traceback
    assert outcomes[1].status == "ok", outcomes[1].describe()
    assert outcomes[1].result is not None and "lost worker 0" in outcomes[1].result, outcomes[1].result


@given(parts=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=40)), max_size=8))
def test_a_bundle_carries_its_parts_in_order(parts):
    assert [(c, bytes(p)) for c, p in framing.unbundle(framing.bundle(parts))] == parts
    assert len(framing.bundle(parts)) == framing.bundle_overhead(len(parts)) + sum(len(p) for _, p in parts)


@pytest.mark.parametrize("damage", [lambda b: b[:-1], lambda b: b + b"x", lambda b: b[:3],
                                    lambda b: b"\xff\xff\xff\x00" + b[4:]])
def test_a_malformed_bundle_is_a_framing_error(damage):
    with pytest.raises(framing.FramingError, match="malformed bundle"):
        framing.unbundle(damage(framing.bundle([(1, b"abc"), (2, b"defg")])))


def test_corked_pushes_arrive_in_order_as_one_message_per_peer(no_leftovers, endpoints):
    """Pushes on several channels while corked (as a dataflow's flush does) reach the peer in push
    order, one message per uncork (more only where max_message_bytes would be exceeded), and a
    buffer message pushed in between stays in its place."""
    limit = 64 << 10

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job", max_message_bytes=limit)
        try:
            channels = [alloc.allocate(c) for c in range(3)]
            if index == 0:
                peer = alloc._links.peer(1)
                pushers = [p[1] for p, _ in channels]
                sent = []
                for round_ in range(20):
                    before = peer.send_seq
                    alloc.cork()
                    for i in range(5):
                        c = (round_ + i) % 3
                        payload = (round_, i, "x" * (20_000 if round_ % 7 == 6 else 10))
                        pushers[c].push(payload)
                        sent.append((c, payload))
                        if round_ % 5 == 4 and i == 2:
                            pushers[0].push_buffers(("buffers", round_), [b"\x01" * 8])
                            sent.append((0, ("buffers", round_)))
                    alloc.uncork()
                    alloc.release()
                    messages = peer.send_seq - before
                    # 5 x 20 KB do not fit 64 KiB: 3 and 2; a buffer message splits a bundle: 3, 1, 2.
                    expected = 2 if round_ % 7 == 6 else 3 if round_ % 5 == 4 else 1
                    assert messages == expected, (round_, messages)
                report(sent)
                return
            got = []
            pullers = [p for _, p in channels]
            deadline = time.monotonic() + 30
            while len(got) < 20 * 5 + 4:
                alloc.receive()
                alloc.events()
                for c, puller in enumerate(pullers):
                    for msg in puller.drain():
                        is_buffers = isinstance(msg[0], tuple) and msg[0][0] == "buffers"
                        got.append((c, tuple(msg[0]) if is_buffers else tuple(msg)))
                assert time.monotonic() < deadline, f"{len(got)} messages arrived"
                alloc.await_events(0.05)
            report(got)
        finally:
            alloc.close()

    sent, got = _results(_run(entry, 2))
    assert len(got) == len(sent)
    # Per channel, the order is the push order (channels are read in turn, so only per channel).
    for c in range(3):
        assert [m for ch, m in got if ch == c] == [tuple(m) for ch, m in sent if ch == c]


def test_hostfile_ipv6_lines_need_brackets_and_ports_must_fit():
    assert parse_hostfile("[::1]\n[fe80::2]:4000\n", 2101) == [("::1", 2101), ("fe80::2", 4000)]
    assert hostfile_endpoints([("::1", 2101)], 2) == ["tcp://[::1]:2101", "tcp://[::1]:2102"]
    with pytest.raises(HostfileError, match=r"hosts:1: an IPv6 address needs brackets"):
        parse_hostfile("::1\n", source="hosts")
    with pytest.raises(HostfileError, match=r"hosts:2: expected \[address\] or \[address\]:port"):
        parse_hostfile("node1\n[::1\n", source="hosts")
    with pytest.raises(HostfileError, match=r"hosts:1: its 2 worker\(s\) would listen on ports 65535 to 65536"):
        parse_hostfile("node1:65535\n", source="hosts", workers=2)
    assert parse_hostfile("node1:65535\n") == [("node1", 65535)]


def _fake_peer_case(endpoints, send) -> str:
    """A real worker 0 (a child process) against this process playing a *greeted* worker 1 with
    pyzmq: ``send(dealer, header)`` sends one message after a good one; worker 0's error, or "ok"."""
    import struct

    import zmq

    from timely.comm.framing import VERSION, Kind, encode, pack_header

    def entry(index, report):
        alloc = None
        try:  # (the bad message may arrive while the constructor ends its handshake)
            alloc = ZmqAllocator(0, 2, endpoints[:2], "job", startup_timeout=10)
            _, puller = alloc.allocate(0)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                alloc.receive()
                alloc.events()
                puller.drain()
                alloc.release()
                alloc.await_events(0.05)
            report("ok")
        except TimelyError as exc:
            report(f"{type(exc).__name__}: {exc}")
        finally:
            if alloc is not None:
                alloc.close(abort="done")

    import threading
    results: list = []
    runner = threading.Thread(target=lambda: results.append(supervise(entry, [0], collect=1, timeout=20)))
    runner.start()
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind(endpoints[1])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoints[0])
        dealer.send_multipart([pack_header(Kind.HELLO, 1), encode(
            {"token": "job", "index": 1, "peers": 2, "version": VERSION, "max_message_bytes": 8 << 20})])
        rid, _, _ = router.recv_multipart()  # worker 0's HELLO
        router.send_multipart([rid, pack_header(Kind.WELCOME, 1), encode(None)])
        dealer.recv_multipart()  # its WELCOME: we are greeted
        dealer.send_multipart([struct.pack("<BBHIQ", VERSION, Kind.DATA, 1, 0, 0), encode("good")])
        send(dealer, lambda version=VERSION, kind=Kind.DATA: struct.pack("<BBHIQ", version, kind, 1, 0, 1))
        runner.join(30)
    finally:
        ctx.destroy(0)
    (outcome,) = results[0]
    assert outcome.status == "ok", outcome.describe()
    return outcome.result


@pytest.mark.parametrize("case,expected", [
    (lambda d, h: d.send_multipart([h(), b"\xc1"]), "worker 1 sent an undecodable payload (FormatError"),
    (lambda d, h: d.send_multipart([h(), framing.encode("abc")[:-1]]), "worker 1 sent an undecodable payload"),
    (lambda d, h: d.send(h()), "worker 1 sent a message without its header and payload frames"),
    (lambda d, h: d.send_multipart([h(), framing.encode("x"), b"extra"]), "a DATA message of more than two frames"),
    (lambda d, h: d.send_multipart([h(version=9), framing.encode("x")]), "protocol version 9"),
    (lambda d, h: d.send_multipart([h(kind=200), b""]), "a message of kind 200"),
    (lambda d, h: d.send_multipart([h(kind=framing.Kind.ABORT), b"\xc1"]), "worker 1 failed: (an undecodable"),
], ids=["garbage", "truncated", "one-frame", "three-frames", "version", "unknown-kind", "abort-garbage"])
def test_a_malformed_message_from_a_greeted_peer_fails_the_worker_naming_the_peer(no_leftovers, endpoints, case,
                                                                                    expected):
    """Frames no worker of this build sends, from a peer that passed the handshake (corruption,
    another build): a TimelyError naming that peer, not a raw msgpack or zmq exception, nor a
    message accepted or ignored (a third frame was read as the next message's routing id, a
    header alone took the next message's first frame for its payload)."""
    result = _fake_peer_case(endpoints, case)
    assert expected in result and ("FramingError" in result or "PeerLost" in result), result


def test_workers_meet_over_ipv6_from_a_hostfile(no_leftovers):
    """A hostfile's ``[addr]:port`` lines are IPv6 endpoints; the sockets need ZMQ_IPV6 for them
    (without it every worker failed to bind, ENODEV)."""
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
        probe.close()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    eps = hostfile_endpoints(parse_hostfile(f"[::1]:{port}\n", workers=2), 2)
    assert all(e.startswith("tcp://[::1]:") for e in eps)

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, eps, "job", startup_timeout=10)
        try:
            report(_greet_all(alloc))
        finally:
            alloc.close()

    results = _results(_run(entry, 2))
    assert all(sorted(r) == [0, 1] for r in results)


def _resetting_proxy(listen_port: int, target_port: int, cut: threading.Event) -> None:
    """Forward 127.0.0.1:listen_port to target_port; on ``cut``, reset the connections open then
    (RST on both legs: a NAT or firewall flush), and keep forwarding new ones."""
    import struct

    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", listen_port))
    ls.listen(8)
    ls.settimeout(0.1)
    conns: list = []

    def pump(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if cut.is_set():
            for sock in [s for pair in conns for s in pair]:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            conns.clear()
            cut.clear()
        try:
            client, _ = ls.accept()
        except OSError:
            continue
        for _ in range(100):  # the target may not listen yet
            try:
                upstream = socket.create_connection(("127.0.0.1", target_port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            client.close()
            continue
        conns.append((client, upstream))
        threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
    ls.close()


def test_a_link_reset_and_reconnected_by_zeromq_fails_the_job_naming_the_peer(no_leftovers):
    """ZeroMQ reconnects a dropped connection by itself, and the listener's ROUTER takes the new one
    for a stranger's (it refuses all it carries): the messages in flight and after were lost while
    both workers ran on and ended without an error. The sender now fails, naming the peer."""
    p0, p1, px = free_loopback_ports(3)
    endpoints = [f"tcp://127.0.0.1:{p0}", f"tcp://127.0.0.1:{px}"]  # worker 1 is reached through the proxy
    binds = [endpoints[0], f"tcp://127.0.0.1:{p1}"]
    cut = threading.Event()
    threading.Thread(target=_resetting_proxy, args=(px, p1, cut), daemon=True).start()

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", bind=binds[index], startup_timeout=10)
        try:
            pushers, puller = alloc.allocate(0)
            sent = 0
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                pushers[1 - index].push(sent)
                sent += 1
                alloc.release()
                alloc.receive()
                alloc.events()
                puller.drain()
                alloc.await_events(0.02)
            report("no error")
        except TimelyError as exc:
            report(f"{type(exc).__name__}: {exc}")
        finally:
            alloc.close()

    def cut_soon():
        time.sleep(2.0)  # both workers are exchanging messages by then
        cut.set()

    threading.Thread(target=cut_soon, daemon=True).start()
    outcomes = supervise(entry, [0, 1], collect=2, timeout=30)
    results = [o.result for o in outcomes]
    assert outcomes[0].status == "ok", outcomes[0].describe()
    assert "PeerLost" in results[0] and "connection to worker 1" in results[0] and "reset" in results[0], results


def _one_large_step_to_a_slow_peer(worker):
    """Worker 0 sends about 10 MB to worker 1 in one step while worker 1 reads nothing for 2 s;
    returns the backlog's peak (recorded by the test's Peer._queue) and its bound."""
    from timely.comm.peer import Peer

    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.exchange(lambda x: 1).probe()  # everything to worker 1
    if worker.index == 1:
        time.sleep(2)  # a slow consumer
        inp.close()
        return None
    inp.send_batch([("x" * 90, i) for i in range(100_000)])
    inp.advance_to(1)
    worker.step()  # the whole batch is flushed in this step
    inp.close()
    return Peer.peak


def test_the_backlog_bound_holds_within_one_step(no_leftovers, monkeypatch):
    """README: at most ``backlog_bytes`` plus one message waits in a worker's backlog for a peer,
    whatever the size of the batches. Only the step's release waited for room, so a step that
    flushed a large batch queued all of it first (19 MB against a 1 MiB bound)."""
    from timely.cluster import execute_cluster
    from timely.comm.peer import Peer

    queue = Peer._queue
    monkeypatch.setattr(Peer, "peak", 0, raising=False)

    def recording(self, *args):
        queue(self, *args)
        Peer.peak = max(Peer.peak, self.backlog_bytes)

    monkeypatch.setattr(Peer, "_queue", recording)
    bound, message = 1 << 20, 64 << 10
    peak, _ = execute_cluster(_one_large_step_to_a_slow_peer, 2, timeout=60, backlog_bytes=bound,
                              max_message_bytes=message, hwm=4)
    assert 0 < peak <= bound + message, peak


def test_a_closed_worker_leaves_no_ipc_socket_file(no_leftovers, endpoints):
    """libzmq leaves an ipc ROUTER's socket file behind; a closed worker removes its own."""

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints[:2], "job")
        try:
            report(_greet_all(alloc))
        finally:
            alloc.close()

    _results(_run(entry, 2))
    left = [e for e in endpoints[:2] if os.path.exists(e[len("ipc://"):])]
    assert not left, left
