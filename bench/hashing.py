"""Micro-benchmark of the native routing hot paths (``timely.routing``, Cython).

Measures, on one batch of N (int, int) tuples:
  * partition by int field 0 into P peers (the exchange fast path; target >= 20 M records/s),
  * partition by a Python key callable (one Python call per record),
  * route_bins by field 0 with k bin bits and a routing table (Megaphone's routing step).
Each case runs R times; the median is reported in M records/s. Freeing a result is not timed.

    .venv/bin/python bench/hashing.py [--records 1000000] [--runs 5] [--peers 2] [--k 8]
"""
from __future__ import annotations

import argparse
import array
import gc
import os
import shlex
import statistics
import sys
import time

from timely import routing


def measure(fn, runs: int) -> float:
    """Median wall time of fn() over `runs` runs; the result is dropped outside the timed region."""
    times = []
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        del result
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000, help="batch size N (default 1000000)")
    ap.add_argument("--runs", type=int, default=5, help="runs per case; the median is reported")
    ap.add_argument("--peers", type=int, default=2, help="number of target workers P")
    ap.add_argument("--k", type=int, default=8, help="bin bits for route_bins (0..16)")
    args = ap.parse_args(argv)

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"os.cpu_count(): {os.cpu_count()}  python: {sys.version.split()[0]}  "
          f"records: {args.records}  runs: {args.runs} (median)  peers: {args.peers}  k: {args.k}")

    records = [(i, i) for i in range(args.records)]
    table = array.array("I", [b % args.peers for b in range(1 << args.k)])
    cases = [
        ("partition, int field 0", lambda: routing.partition(records, args.peers, 0)),
        ("partition, key callable", lambda: routing.partition(records, args.peers, lambda r: r[0])),
        (f"route_bins, field 0, k={args.k}",
         lambda: routing.route_bins(records, 0, args.k, table, args.peers)),
    ]
    for name, fn in cases:
        t = measure(fn, args.runs)
        print(f"{name:32s} {args.records / t / 1e6:8.1f} M records/s   (median {t * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
