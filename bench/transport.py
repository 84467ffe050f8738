"""The raw ceiling of the transport: msgpack batches of (int, int) tuples between two processes.

No engine: one process packs batches (``msgpack``) and sends them, the other receives and unpacks
them (``use_list=False``), counting records. Measured both over bare pyzmq (``raw``: two DEALER
sockets, blocking sends) and through :class:`timely.comm.zmq_allocator.ZmqAllocator` (``allocator``:
header frame, backlog, loss checks), one direction and both directions at once. Reports records/s,
the median over ``--runs`` runs (both directions: the sum of the two directions).

    .venv/bin/python bench/transport.py                       # defaults: 1k and 10k batches, 5 runs
    .venv/bin/python bench/transport.py --transport tcp --records 4000000
    .venv/bin/python bench/transport.py --layers raw --directions both --json   # + the rates as JSON

``bench/exchange.py`` runs it (``--layers raw --directions both --json``) for its raw ceiling.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import tempfile
import time

import msgpack
import zmq

from timely.comm.endpoints import free_loopback_ports
from timely.comm.zmq_allocator import ZmqAllocator


def _batch(size: int) -> list[tuple[int, int]]:
    return [(i, i * 7) for i in range(size)]


def _raw(index: int, endpoints: list[str], batches: int, size: int, both: bool, barrier, out) -> None:
    """Bare pyzmq: worker 0 binds, worker 1 connects; DEALER <-> DEALER."""
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.LINGER, 5000)
    if index == 0:
        sock.bind(endpoints[0])
    else:
        sock.connect(endpoints[0])
    sock.send(b"sync")
    sock.recv()
    batch = _batch(size)
    sends = batches if (both or index == 0) else 0
    expect = batches if (both or index == 1) else 0
    packb, unpackb = msgpack.packb, msgpack.unpackb
    barrier.wait()
    start = time.monotonic()
    sent = received = records = 0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
    while sent < sends or received < expect:
        if sent < sends:
            try:
                sock.send(packb(batch), zmq.NOBLOCK, copy=False)
                sent += 1
                continue
            except zmq.Again:
                pass
        if received < expect:
            try:
                records += len(unpackb(sock.recv(zmq.NOBLOCK, copy=False).buffer, use_list=False))
                received += 1
                continue
            except zmq.Again:
                pass
        poller.modify(sock, (zmq.POLLIN if received < expect else 0) | (zmq.POLLOUT if sent < sends else 0))
        poller.poll(100)
    end = time.monotonic()
    out.send((start, end, records))
    sock.send(b"done")  # do not close before the peer has everything (see ZmqAllocator's goodbye)
    sock.recv()
    sock.close()
    ctx.term()


def _allocator(index: int, endpoints: list[str], batches: int, size: int, both: bool, barrier, out) -> None:
    """Through the engine's allocator: push / release / receive / drain."""
    alloc = ZmqAllocator(index, 2, endpoints, "bench")
    pushers, puller = alloc.allocate(0)
    target = pushers[1 - index]
    batch = _batch(size)
    sends = batches if (both or index == 0) else 0
    expect = batches if (both or index == 1) else 0
    barrier.wait()
    start = time.monotonic()
    received = records = 0
    for _ in range(sends):
        target.push(batch)
        alloc.release()
        alloc.receive()
        alloc.events()
        for b in puller.drain():
            records += len(b)
            received += 1
    while received < expect:
        alloc.receive()
        alloc.events()  # as the worker loop does: consumed events let await_events park
        for b in puller.drain():
            records += len(b)
            received += 1
        if received < expect:
            alloc.await_events(0.1)
    end = time.monotonic()
    out.send((start, end, records))
    alloc.close()


def run_once(layer: str, endpoints: list[str], batches: int, size: int, both: bool) -> float:
    """One run; return records/s delivered (summed over directions)."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    target = _raw if layer == "raw" else _allocator
    procs = [ctx.Process(target=target, args=(i, endpoints, batches, size, both, barrier, pipes[i][1]))
             for i in range(2)]
    for p in procs:
        p.start()
    try:
        results = []
        deadline = time.monotonic() + 120
        for (reader, _), proc in zip(pipes, procs):
            while not reader.poll(0.2):
                if proc.exitcode not in (None, 0) or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark process failed or hung (exit status {proc.exitcode})")
            results.append(reader.recv())
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    records = sum(r[2] for r in results)
    return records / (end - start)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark matrix and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--records", type=int, default=2_000_000, help="records per direction per run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.add_argument("--layers", nargs="+", choices=["raw", "allocator"], default=["raw", "allocator"])
    parser.add_argument("--directions", nargs="+", choices=["one-way", "both"], default=["one-way", "both"])
    parser.add_argument("--json", action="store_true",
                        help="end with one line of JSON: every row's layer, batch, direction and rates")
    opts = parser.parse_args(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}, pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}, "
          f"msgpack {'.'.join(map(str, msgpack.version))}, python {sys.version.split()[0]}")
    print(f"transport {opts.transport}; {opts.records} records per direction per run; median of {opts.runs} runs")
    print(f"{'layer':<10} {'batch':>6} {'direction':<10} {'records/s (median)':>19} {'min':>12} {'max':>12}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="timely-bench-") as tmp:
        for layer in opts.layers:
            for size in opts.batch_sizes:
                for direction in opts.directions:
                    both = direction == "both"
                    rates = []
                    for run in range(opts.runs):
                        if opts.transport == "ipc":
                            endpoints = [f"ipc://{tmp}/{layer}-{size}-{both:d}-{run}-w{i}" for i in range(2)]
                        else:
                            endpoints = [f"tcp://127.0.0.1:{p}" for p in free_loopback_ports(2)]
                        rates.append(run_once(layer, endpoints, max(1, opts.records // size), size, both))
                    rows.append({"layer": layer, "batch": size, "direction": direction, "rates": rates})
                    print(f"{layer:<10} {size:>6} {direction:<10} "
                          f"{statistics.median(rates):>19,.0f} {min(rates):>12,.0f} {max(rates):>12,.0f}",
                          flush=True)
    if opts.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
