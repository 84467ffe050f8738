"""Frame fuzzing of the worker ports (issue 13): for a few seconds, a stranger throws random and
truncated multi-frame messages (random kinds and headers, HELLOs with wrong tokens, spoofed DATA,
frames over the size limit, raw bytes that are not ZeroMQ at all) at every worker's ``ROUTER`` of a
running 3-worker tcp job. The job's output must equal a plain sequential computation, every worker
must end cleanly, and nothing may be left running.

The stranger is a fourth supervised process (index 3), so it is reaped like the workers; the
workers keep their dataflow open, feeding one epoch at a time, until it is done.
"""
from __future__ import annotations

import collections
import functools
import multiprocessing
import random
import secrets
import socket
import time

import pytest
import zmq
from procs import no_leftover_children

from timely.cluster import run_worker, supervise
from timely.comm.endpoints import free_loopback_ports
from timely.comm.framing import HEADER, VERSION, Kind, encode, pack_header

pytestmark = pytest.mark.timeout(90)

WORKERS = 3
EPOCHS = 6
PER_EPOCH = 500
KEYS = 41
FUZZ_SECONDS = 3.0
LIMIT = 1 << 20  # the workers' max_message_bytes (small, so that frames over it are cheap to send)


def _records(index: int, epoch: int) -> list[int]:
    return [(index * 7919 + epoch * 104729 + i * 31) % KEYS for i in range(PER_EPOCH)]


def _job(fuzzing, worker):
    """Per epoch, count the records of every key (exchanged by key); feed one epoch at a time
    while the stranger is at work. Returns the counts, the messages refused and the growth of the
    peak resident set (bytes)."""
    base = _reset_peak()
    with worker.dataflow() as scope:
        inp = scope.new_input()
        out: list = []
        probe = inp.stream.count_by_key().inspect_batch(lambda t, b: out.extend((t, k, c) for k, c in b)).probe()
    pause = FUZZ_SECONDS / EPOCHS
    for epoch in range(EPOCHS):
        inp.advance_to(epoch)
        inp.send_batch(_records(worker.index, epoch))
        until = time.monotonic() + pause
        worker.step_while(lambda: time.monotonic() < until)
    inp.close()
    worker.step_while(fuzzing.is_set, timeout=30)  # the stranger still at work
    worker.step_while(lambda: not probe.done(), timeout=30)
    return out, worker.allocator.refused, _peak() - base


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> int:
    """Reset the peak resident set to the current one (Linux >= 4.0); return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak()


def _frames(rng: random.Random) -> list[bytes]:
    """One random message, as the stranger sends it."""
    choice = rng.randrange(10)
    header = pack_header(Kind(rng.randrange(len(Kind))), rng.randrange(WORKERS + 2), rng.randrange(4),
                         rng.randrange(3))
    if choice == 0:  # random frames
        return [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(1, 6))]
    if choice == 1:  # a truncated or overlong header, alone or with a payload
        cut = header[:rng.randrange(HEADER.size)] if rng.random() < 0.5 else header + b"\x00"
        return [cut] if rng.random() < 0.5 else [cut, encode(None)]
    if choice == 2:  # a valid header of any kind, a random payload
        return [header, rng.randbytes(rng.randrange(64))]
    if choice == 3:  # a HELLO that looks right but for its token
        source = rng.randrange(WORKERS)
        info = {"token": secrets.token_hex(16), "index": source, "peers": WORKERS, "version": VERSION,
                "max_message_bytes": LIMIT}
        return [pack_header(Kind.HELLO, source), encode(info)]
    if choice == 4:  # a HELLO with junk fields, or too many frames
        info = {"token": rng.randbytes(8), "index": "x", "peers": -1, "version": [VERSION]}
        return [pack_header(Kind.HELLO, 0), encode(info)] + [b""] * rng.randrange(2)
    if choice == 5:  # spoofed DATA and GOODBYE / ABORT from a worker of the job
        kind = rng.choice([Kind.DATA, Kind.GOODBYE, Kind.ABORT, Kind.ACK])
        return [pack_header(kind, rng.randrange(WORKERS), 0, 0), encode(((0,), [1, 2, 3]))]
    if choice == 6:  # a frame over the workers' size limit (the sender is disconnected)
        return [pack_header(Kind.HELLO, 0), bytes(LIMIT + 1 + rng.randrange(1000))]
    if choice == 7:  # a HELLO just under the size limit
        return [pack_header(Kind.HELLO, 0), bytes(rng.randrange(1025, 64 << 10))]
    if choice == 8 and rng.random() < 0.1:  # far over it (zero pages: cheap for the stranger)
        return [pack_header(Kind.HELLO, 0), bytes(32 * LIMIT)]
    return [header]  # a lone header


def _raw_garbage(rng: random.Random, port: int) -> None:
    """Bytes that are not ZeroMQ at all, or a ZMTP greeting cut short, then hang up."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16)
            s.sendall(greeting[:rng.randrange(len(greeting))] if rng.random() < 0.5 else rng.randbytes(200))
    except OSError:
        pass


def _stranger(ports: list[int], fuzzing, report) -> None:
    rng = random.Random(13)
    ctx = zmq.Context(1)
    socks: list[zmq.Socket] = []
    sent = 0
    deadline = time.monotonic() + FUZZ_SECONDS
    try:
        while time.monotonic() < deadline:
            if not socks or rng.random() < 0.05:  # new connections now and then (new routing ids)
                if len(socks) >= 2 * len(ports):
                    socks.pop(0).close(0)
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100)
                s.connect(f"tcp://127.0.0.1:{rng.choice(ports)}")
                socks.append(s)
            if rng.random() < 0.02:
                _raw_garbage(rng, rng.choice(ports))
            try:
                rng.choice(socks).send_multipart(_frames(rng), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            if sent % 50 == 0:
                time.sleep(0.002)  # leave the workers some CPU on a small machine
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        fuzzing.clear()
    report(sent)


def _entry(ports, token, fuzzing, index, report):
    if index == WORKERS:
        return _stranger(ports, fuzzing, report)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    run_worker(functools.partial(_job, fuzzing), index, WORKERS, endpoints, token, [], report,
               max_message_bytes=LIMIT)


def test_random_frames_at_every_worker_port_change_nothing():
    fuzzing = multiprocessing.get_context("fork").Event()
    fuzzing.set()
    ports = free_loopback_ports(WORKERS)
    with no_leftover_children():
        entry = functools.partial(_entry, ports, secrets.token_hex(16), fuzzing)
        outcomes = supervise(entry, range(WORKERS + 1), timeout=80)
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"{o.describe()}\n{o.traceback}" for o in bad)
    *results, sent = [o.result for o in outcomes]
    expected = collections.Counter((e, k) for w in range(WORKERS) for e in range(EPOCHS) for k in _records(w, e))
    got: collections.Counter = collections.Counter()
    for out, _, _ in results:
        for t, k, c in out:
            assert (t, k) not in got, f"key {k} counted twice at time {t}"
            got[t, k] = c
    assert got == expected
    assert sent > 500
    assert all(refused > 0 for _, refused, _ in results), [r for _, r, _ in results]  # the fuzz reached every worker
    grown = [g >> 20 for _, _, g in results]
    assert max(grown) < 24, f"the workers' peak memory grew by {grown} MiB"  # no frame over the limit was held
