"""Raw buffers between workers (issue 15, the transport of columnar dataflows): ``push_buffers``
sends a msgpack head and each buffer as a ZeroMQ frame of its own, received without copying;
``framing.register_extension`` packs registered types inside any message.

Every multi-process test forks through :func:`timely.cluster.supervise`, has a timeout, and the
``no_leftovers`` fixture (of ``test_comm_limits``) kills and reaps anything left behind, then
asserts that nothing was.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
import zlib

import msgpack
import numpy as np
import pytest
import zmq
from test_comm_limits import _results, no_leftovers  # noqa: F401 (the fixture, used by pytestmark)

from timely.cluster import supervise
from timely.comm import framing
from timely.comm.allocator import ThreadAllocator
from timely.comm.endpoints import free_loopback_ports, ipc_endpoints
from timely.comm.errors import FramingError, MessageTooLarge
from timely.comm.zmq_allocator import ZmqAllocator

# Every test kills and reaps what it forked (and fails if anything was left running).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftovers")]

MiB = 1 << 20


def _pump(alloc, pullers, until, timeout=30.0, unread=None):
    """Receive into ``pullers`` (draining them) until ``until()`` or ``timeout``; yield
    ``(channel, message)``. ``unread``: a list to which the mailbox's unread bytes after every
    receive are appended."""
    deadline = time.monotonic() + timeout
    while True:
        alloc.receive()
        if unread is not None:
            unread.append(alloc._mailbox.unread_bytes)
        alloc.events()
        for puller in pullers:
            for message in puller.drain():
                yield puller.channel, message
        alloc.release()
        if until():
            return
        assert time.monotonic() < deadline, "messages did not arrive"
        alloc.await_events(0.02)


def _buffers(sender: int, channel: int, i: int) -> list:
    """The buffers of message ``i``: every kind of buffer object, zero-length ones included."""
    seed = sender * 1000 + channel * 100 + i
    return [np.arange(seed, seed + 1000 + i, dtype=np.int64), b"", bytes([seed % 256]) * (i * 37),
            memoryview(bytearray(b"mv%d" % seed)), np.empty(0, dtype=np.float64)]


def _as_bytes(buffers) -> list[bytes]:
    return [memoryview(b).cast("B").tobytes() for b in buffers]


# -- two real allocators ----------------------------------------------------------------------------
def test_buffers_arrive_intact_in_fifo_order_with_other_messages(tmp_path):
    """Both workers interleave plain, gathered and buffer messages on three channels; each
    channel's messages arrive in order, the buffers byte for byte, as read-only memoryviews over
    the received ZeroMQ frames (not copied into bytes). Heads carry a registered extension type."""
    framing.register_extension(120, _Point, _pack_point, _unpack_point)  # before the workers fork
    endpoints = ipc_endpoints(str(tmp_path), 2)
    channels, count = (0, 1, 2), 40

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job")
        try:
            wired = [alloc.allocate(c) for c in channels]
            other = 1 - index
            for i in range(count):
                for c, (pushers, _) in zip(channels, wired):
                    pusher = pushers[other]
                    if i % 3 == 0:
                        pusher.push((("plain", c, i), None))
                    elif i % 3 == 1:
                        pusher.push_items(("gathered", c, i), [pusher.encode_items([i, i + 1])], 2)
                    pusher.push_buffers(("buffers", c, i, _Point(index, i)), _buffers(index, c, i))
                alloc.release()
            got: dict[int, list] = {c: [] for c in channels}
            total = sum(1 + (i % 3 != 2) for i in range(count)) * len(channels)
            for c, message in _pump(alloc, [p for _, p in wired], lambda: sum(map(len, got.values())) >= total):
                head, body = message
                if head[0] == "buffers":
                    assert type(body) is tuple and all(type(b) is memoryview and b.readonly for b in body)
                    # Zero-copy: each view is over the received frame itself.
                    assert all(isinstance(b.obj, zmq.Frame) for b in body), [type(b.obj) for b in body]
                    assert _as_bytes(body) == _as_bytes(_buffers(other, c, head[2])), head
                    assert head[3] == _Point(other, head[2])
                    head = head[:3]
                got[c].append(head)
            report(got)
        finally:
            alloc.close()

    for index, got in enumerate(_results(supervise(entry, range(2), timeout=50))):
        for c in channels:
            expected = []
            for i in range(count):
                expected += [("plain", c, i)] if i % 3 == 0 else [("gathered", c, i)] if i % 3 == 1 else []
                expected.append(("buffers", c, i))
            assert got[c] == expected, (index, c)


def test_large_buffers_under_backpressure_arrive_complete_and_in_order(tmp_path):
    """60 messages of two buffers (2.5 MiB and 1.5 MiB) through a 2-message ZeroMQ queue and a 2
    MiB backlog to a slow reader: the sender backlogs (whole multi-frame messages), drops its own
    references at once (ZeroMQ keeps them until sent), and everything arrives intact, in order,
    with the mailbox bound counting the buffers."""
    endpoints = ipc_endpoints(str(tmp_path), 2)
    messages, mailbox = 60, 4 * MiB

    def make(i: int) -> list:
        rng = np.random.default_rng(i)
        return [rng.integers(0, 1 << 62, 5 * MiB // 16, dtype=np.int64), rng.bytes(3 * MiB // 2)]

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", hwm=2, backlog_bytes=2 * MiB, mailbox_bytes=mailbox)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 0:
                backlogged = 0
                for i in range(messages):
                    pushers[1].push_buffers(i, make(i))  # no reference kept here
                    backlogged = max(backlogged, alloc._links.peer(1).backlog_bytes)
                    if i % 2:
                        pushers[1].push(("plain", i))
                    alloc.release()
                report(backlogged)
                return
            got, unread = [], []
            for _, message in _pump(alloc, [puller], lambda: len(got) >= messages * 3 // 2, 45, unread):
                if isinstance(message[0], int):
                    i, buffers = message
                    expected = [zlib.crc32(b) for b in make(i)]
                    got.append((i, [zlib.crc32(b) for b in buffers] == expected))
                    time.sleep(0.005)
                else:
                    got.append(message)
            report((got, max(unread)))
        finally:
            alloc.close()

    backlogged, (got, worst) = _results(supervise(entry, range(2), timeout=55))
    assert backlogged > 0  # the backlog held multi-frame messages
    expected: list = []
    for i in range(messages):
        expected.append((i, True))
        if i % 2:
            expected.append(("plain", i))
    assert got == expected
    assert 0 < worst <= mailbox + 4 * MiB + 100, worst  # counted with their buffers; bound + one message


def test_push_buffers_over_the_limit_raises_and_sends_nothing(tmp_path):
    """The head's encoding and the buffers together are bounded: the refused message sends no
    frame and takes no sequence number; the next messages arrive in order."""
    endpoints = ipc_endpoints(str(tmp_path), 2)
    limit = 64 << 10

    def entry(index, report):
        alloc = ZmqAllocator(index, 2, endpoints, "job", max_message_bytes=limit)
        try:
            pushers, puller = alloc.allocate(0)
            if index == 0:
                pushers[1].push_buffers("first", [b"a"])
                caught = []
                for head, buffers in [("big", [bytes(40 << 10), bytes(30 << 10)]),  # each fits, not both
                                      ("x" * (limit - 100), [bytes(200)])]:  # the head counts too
                    try:
                        pushers[1].push_buffers(head, buffers)
                    except MessageTooLarge as exc:
                        caught.append((exc.size, exc.limit))
                pushers[1].push_buffers("fits", [bytes(limit - 100), b""])
                pushers[1].push("last")
                alloc.release()
                report(caught)
                return
            got: list = []
            for _, m in _pump(alloc, [puller], lambda: len(got) >= 3):
                got.append(m if isinstance(m, str) else (m[0], [len(b) for b in m[1]]))
            report(got)
        finally:
            alloc.close()

    caught, got = _results(supervise(entry, range(2), timeout=40))
    assert [lim for _, lim in caught] == [limit, limit]
    assert caught[0][0] == len(framing.encode("big")) + (70 << 10)
    assert caught[1][0] > limit
    assert got == [("first", [1]), ("fits", [limit - 100, 0]), "last"]


def test_a_stranger_sending_multi_frame_messages_is_refused():
    """Before its HELLO, a connection's DATA_BUFFERS messages (spoofing a worker of the job),
    HELLOs with extra frames and many-frame garbage are refused and counted; the job's own
    buffer messages still flow."""
    ports = free_loopback_ports(2)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    fuzzing = multiprocessing.get_context("fork").Event()
    fuzzing.set()
    strange = [
        [framing.pack_header(framing.Kind.DATA_BUFFERS, 0, 0, 0), framing.encode("head"), b"buf", b""],
        [framing.pack_header(framing.Kind.DATA_BUFFERS, 1, 0, 0), framing.encode("head")],
        [framing.pack_header(framing.Kind.HELLO, 0), framing.encode({"token": "job"}), b"extra"],
        [b"junk"] * 50,
        [framing.pack_header(framing.Kind.HELLO, 0),
         msgpack.packb({"token": msgpack.ExtType(121, b"x")})],  # no extension decodes a stranger's bytes
    ]

    def entry(index, report):
        if index == 2:
            ctx = zmq.Context(1)
            try:
                for port in ports:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 1000)
                    s.connect(f"tcp://127.0.0.1:{port}")
                    for frames in strange:
                        s.send_multipart(frames)
                    s.close()
            finally:
                ctx.term()
                fuzzing.clear()
            return report(len(strange))
        alloc = ZmqAllocator(index, 2, endpoints, "job")
        try:
            pushers, puller = alloc.allocate(0)
            got: list = []
            for _, (who, buffers) in _pump(alloc, [puller], lambda: not fuzzing.is_set() and
                                           alloc.refused >= len(strange)):
                got.append((who, _as_bytes(buffers)))  # (the other worker may be done waiting already)
            pushers[1 - index].push_buffers(index, [b"ok", np.arange(3)])
            for _, (who, buffers) in _pump(alloc, [puller], lambda: bool(got)):
                got.append((who, _as_bytes(buffers)))
            report((alloc.refused, got))
        finally:
            alloc.close()

    *results, sent = _results(supervise(entry, range(3), timeout=50))
    assert sent == len(strange)
    for index in range(2):
        refused, got = results[index]
        assert refused == len(strange)
        assert got == [(1 - index, [b"ok", np.arange(3).tobytes()])]


# -- loopback -------------------------------------------------------------------------------------
def test_loopback_buffers_are_queued_by_reference():
    for alloc in (ThreadAllocator(), ZmqAllocator(0, 1, ["ipc:///nonexistent/unused"], "job")):
        pushers, puller = alloc.allocate(0)
        array, raw = np.arange(5), b"raw"
        pushers[0].push_buffers({"n": 5}, iter([array, raw, b""]))
        assert alloc.events() == [0]
        head, buffers = puller.pull()
        assert head == {"n": 5} and type(buffers) is tuple
        assert buffers[0] is array and buffers[1] is raw and buffers[2] == b""
        alloc.close()


# -- extensions -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Point:
    x: int
    y: int


class _Point3(_Point):
    pass


def _pack_point(p: _Point) -> bytes:
    return framing.encode((p.x, p.y))  # nested in the encoding of the message holding p


def _unpack_point(data: bytes) -> _Point:
    return _Point(*framing.decode(data))


def test_register_extension_round_trip_in_any_message():
    framing.register_extension(120, _Point, _pack_point, _unpack_point)
    framing.register_extension(120, _Point, _pack_point, _unpack_point)  # the same again: allowed
    message = {"state": [(_Point(1, 2), "a")], 7: _Point(-3, 2**40)}
    out = framing.decode(framing.encode(message))
    assert out == {"state": ((_Point(1, 2), "a"),), 7: _Point(-3, 2**40)}
    # A subclass is packed as its registered base and comes back as what the decoder makes.
    assert framing.decode(framing.encode([_Point3(4, 5)])) == (_Point(4, 5),)
    items = [_Point(i, i) for i in range(20)]
    gathered = framing.encode_gathered(_Point(0, 1), [framing.encode_items(items)], len(items))
    assert framing.decode(gathered) == (_Point(0, 1), tuple(items))
    with pytest.raises(TypeError):
        framing.encode(object())  # still an error for unknown types
    assert framing.decode(framing.encode([1, b"2"])) == (1, b"2")  # the packer recovered


def test_unknown_extension_code_and_duplicate_registration_are_errors():
    with pytest.raises(FramingError, match="extension type 97"):
        framing.decode(msgpack.packb([1, msgpack.ExtType(97, b"data")]))

    class A:
        pass

    class B:
        pass

    framing.register_extension(123, A, lambda a: b"", lambda d: A())
    with pytest.raises(ValueError, match="code 123 is already registered"):
        framing.register_extension(123, B, lambda b: b"", lambda d: B())
    with pytest.raises(ValueError, match="already registered under extension code 123"):
        framing.register_extension(124, A, lambda a: b"", lambda d: A())
    for bad in (-1, 128, "1"):
        with pytest.raises(ValueError, match="0..127"):
            framing.register_extension(bad, B, lambda b: b"", lambda d: B())
    assert type(framing.decode(framing.encode(A()))) is A
    with pytest.raises(FramingError):  # what a stranger sends is never handed to an extension
        framing.decode_untrusted(framing.encode({"token": A()}))
