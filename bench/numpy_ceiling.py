"""The hand-rolled ceiling of a keyed count on numpy columns: processes, pyzmq, no engine.

Each of ``--processes`` processes generates its share of int64 keys (``--keys`` distinct, outside
the timed section), then, per batch of ``--batch`` keys: hashes them with numpy (the splitmix64
finalizer), keeps the keys of its own part, sends each other process the raw int64 bytes of that
process's part (one ZeroMQ message, ``copy=False``, PUSH to the peer's PULL over tcp loopback),
drains what has arrived, and counts with ``np.bincount``. An empty message ends a sender's stream.
No timestamps, progress tracking or operators: what
``../shared/reference/nexmark-and-costs.md`` section 4.5 calls the speed of light on this machine.

Throughput = all keys / (last process done - first process's start); CPU = user + system time of
all processes (``time.process_time``, every thread) between their start and end. The counts are
checked (every key counted once).

    .venv/bin/python bench/numpy_ceiling.py                       # 2 processes, batches of 4096 and 65536
    .venv/bin/python bench/numpy_ceiling.py --batch 4096 --json   # + the runs as JSON (last line)

``bench/columnar.py`` runs :func:`run_once` for its ceiling rows.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import shlex
import statistics
import sys
import time
from typing import Any

import numpy as np
import zmq

from timely.comm.endpoints import free_loopback_ports

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _owner(keys: np.ndarray, peers: int) -> np.ndarray:
    """The process of each key: the splitmix64 finalizer of the key, modulo ``peers``."""
    z = keys.view(np.uint64)
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z ^= z >> _S31
    return z % np.uint64(peers)


def _process(index: int, peers: int, ports: list[int], per_process: int, keys: int, batch: int,
             barrier: Any, out: Any) -> None:
    """One process: bind a PULL socket, PUSH to every other; send, drain and count."""
    data = np.random.default_rng(index).integers(0, keys, per_process, dtype=np.int64)
    counts = np.zeros(keys, dtype=np.int64)
    ctx = zmq.Context(1)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1000)
    pull.bind(f"tcp://127.0.0.1:{ports[index]}")
    pushes: dict[int, zmq.Socket] = {}
    for p in range(peers):
        if p != index:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.setsockopt(zmq.LINGER, 10_000)
            s.connect(f"tcp://127.0.0.1:{ports[p]}")
            pushes[p] = s
    for s in pushes.values():  # connected both ways before the clock starts
        s.send(b"hello")
    for _ in pushes:
        pull.recv()
    ended = [0]

    def drain(block: bool) -> None:
        # Counts every message that has arrived (blocking for one when ``block``); an empty one
        # is a peer's end of stream.
        flags = 0 if block else zmq.NOBLOCK
        while True:
            try:
                frame = pull.recv(flags, copy=False)
            except zmq.Again:
                return
            if len(frame.buffer) == 0:
                ended[0] += 1
            else:
                counts[:] += np.bincount(np.frombuffer(frame.buffer, dtype=np.int64), minlength=keys)
            if block:
                return

    def send(p: int, payload: Any) -> None:
        # Never blocks while the peer is blocked on us: drain our own queue while waiting.
        while True:
            try:
                pushes[p].send(payload, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                drain(False)
                zmq.select([pull], [pushes[p]], [], 0.01)

    barrier.wait()
    start, cpu = time.time(), time.process_time()
    for lo in range(0, per_process, batch):
        part = data[lo:lo + batch]
        owner = _owner(part, peers)
        for p in range(peers):
            mine = part[owner == p]
            if p == index:
                counts += np.bincount(mine, minlength=keys)
            else:
                send(p, mine)  # zero-copy: a fresh array (mask indexing), held by zmq until sent
        drain(False)
    for p in pushes:
        send(p, b"")
    while ended[0] < peers - 1:
        drain(True)
    end, cpu = time.time(), time.process_time() - cpu
    out.put((start, end, cpu, counts.tobytes()))
    for s in pushes.values():
        s.close()
    pull.close()
    ctx.term()


def run_once(processes: int, per_process: int, keys: int, batch: int, timeout: float = 300) -> dict:
    """One run: ``{"records", "elapsed", "cpu"}`` (the counts are checked here)."""
    ctx = multiprocessing.get_context("fork")
    barrier, results_q = ctx.Barrier(processes), ctx.Queue()
    ports = free_loopback_ports(processes)
    procs = [ctx.Process(target=_process, args=(i, processes, ports, per_process, keys, batch, barrier, results_q))
             for i in range(processes)]
    for p in procs:
        p.start()
    results: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < processes:
            try:
                results.append(results_q.get(timeout=0.5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    statuses = [p.exitcode for p in procs]
                    raise RuntimeError(f"ceiling processes failed or hung: exit statuses {statuses}") from None
    finally:
        for p in procs:  # every process is reaped, killed if it hangs
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    total = sum(int(np.frombuffer(r[3], dtype=np.int64).sum()) for r in results)
    records = per_process * processes
    if total != records:
        raise RuntimeError(f"ceiling counted {total:,} keys, expected {records:,}")
    return {"records": records, "elapsed": max(r[1] for r in results) - min(r[0] for r in results),
            "cpu": sum(r[2] for r in results)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--records", type=int, default=4_000_000, help="keys per process")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct keys")
    parser.add_argument("--batch", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the runs as JSON on the last line")
    opts = parser.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; {opts.processes} processes; {opts.records:,} keys per process "
          f"({opts.keys:,} distinct); median of {opts.runs} runs", flush=True)
    out = []
    for batch in opts.batch:
        runs = [run_once(opts.processes, opts.records, opts.keys, batch) for _ in range(opts.runs)]
        rate = statistics.median(r["records"] / r["elapsed"] for r in runs)
        per_cpu = statistics.median(r["records"] / r["cpu"] for r in runs)
        print(f"batch {batch:>6}: {rate:>14,.0f} rec/s  {per_cpu:>14,.0f} rec/CPU-s", flush=True)
        out.append({"batch": batch, "runs": runs})
    if opts.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
