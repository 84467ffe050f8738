"""Weak scaling: a fixed amount of work per worker, over 1, 2, 4, 8 and 16 workers.

Workloads: ``count``, the keyed count of ``bench/exchange.py`` (``exchange(0).count_by_key(0)``,
``--records`` per worker); ``q1``, ``q3``, ``q5`` (native) and ``q3-flex`` (Megaphone, 2^12 bins),
NEXMark on ``--events`` events per worker.

Every workload first runs **closed loop** (input pushed as fast as the workers take it, one epoch
at a time in flight; NEXMark as in ``bench/peers.py``) for records/s in total and per worker and
**records per CPU-second** (user + system time of all worker processes, every thread, between the
common start and the end): the figure that shows scaling on a machine with fewer cores than
workers, as it must not fall as workers are added. The NEXMark workloads then run **open loop**
at ``--rate`` events/s per worker (``bench/nexmark_bench.py``'s driver) for p50 and p99 latency
and the CPU a worker spends per round (one 1 ms epoch while the workers keep up), unless
``--no-latency``: with more workers than cores these measure the time slicing of the
cores rather than the engine. Every figure is the median of ``--runs`` runs; every worker is a
fresh interpreter (``start="spawn"``).

``--progress direct relay`` runs every configuration in both progress modes (``timely.execute``'s
``progress``), alternating run by run, and prints a row for each.

With more workers than cores, the same instructions may cost more CPU time (the processes evict
each other's caches and are switched in and out). The *control* column measures that alone: the
CPU time of a fixed engine-free job (msgpack encoding and decoding of keyed records) run in as many
processes at once as there are workers, relative to one process.

    .venv/bin/python bench/scaling.py                               # everything, 1..16 workers
    .venv/bin/python bench/scaling.py --workload count --workers 2 8 16 --runs 3
    .venv/bin/python bench/scaling.py --workload q3-flex --rate 5000 --duration 10
    .venv/bin/python bench/scaling.py --workload q3 --workers 8 16 --progress direct relay
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import timely

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exchange import keyed_count  # bench/ is not a package
from peers import _ours_nexmark

WORKLOADS = ("count", "q1", "q3", "q5", "q3-flex")
#: NEXMark closed loop: events per worker by default (the columnar queries take 10-30 M events per
#: CPU-second, Q5's sliding windows about 1 M: each run should take a CPU-second or more).
EVENTS = {"q1": 4_000_000, "q3": 4_000_000, "q3-flex": 4_000_000, "q5": 1_000_000}


@dataclass
class Figures:
    """One closed-loop run's figures."""

    records: int
    elapsed: float
    cpu: float

    @property
    def rate(self) -> float:
        """Records per second, all workers together."""
        return self.records / self.elapsed

    @property
    def per_cpu_s(self) -> float:
        """Records per CPU-second of all workers."""
        return self.records / self.cpu


def run_count(workers: int, per_worker: int, keys: int, batch: int, epoch_batches: int,
              progress: str = "direct") -> Figures:
    """The keyed count with ``per_worker`` records on each of ``workers`` workers."""
    records = per_worker * workers
    results = timely.execute(keyed_count, workers=workers, start="spawn", timeout=900, progress=progress,
                             args=[str(records), str(keys), str(batch), str(epoch_batches), "freeze"])
    return Figures(records, max(r[1] for r in results) - min(r[0] for r in results), sum(r[3] for r in results))


def run_nexmark(workload: str, workers: int, per_worker: int, batch: int, epoch_batches: int,
                progress: str = "direct") -> Figures:
    """A NEXMark query over ``per_worker`` events on each of ``workers`` workers, closed loop."""
    args = [workload, "freeze", str(per_worker * workers), str(batch), str(epoch_batches)]
    results = timely.execute(_ours_nexmark, workers=workers, start="spawn", timeout=900, args=args,
                             progress=progress)
    return Figures(sum(r["inputs"] for r in results), max(r["end"] for r in results) - min(r["start"] for r in results),
                   sum(r["cpu"] for r in results))


def run_latency(workload: str, workers: int, rate: int, duration: float,
                progress: str = "direct") -> tuple[float, float, float]:
    """p50 and p99 latency (seconds) of a NEXMark query at ``rate`` events/s per worker, open loop,
    and the CPU-seconds a worker spends per round (an epoch, or several where the workers fell
    behind): the cost that bounds how short epochs can be with a core per worker."""
    from nexmark.driver import Spec, run
    from nexmark.metrics import QUANTILES
    from nexmark.report import summarise

    query, _, flex = workload.partition("-")
    spec = Spec(query=query, flex=bool(flex), rate=rate * workers, duration=duration, workers=workers, k=12,
                progress=False, progress_mode=progress)
    results = run(spec, start="spawn", timeout=duration + 600)
    s = summarise(workload, spec, results)
    p50, p99 = s.overall[QUANTILES.index(0.5)], s.overall[QUANTILES.index(0.99)]
    return p50, p99, sum(r["cpu"] for r in results) / max(1, sum(r["rounds"] for r in results))


def _control_job(_: int) -> float:
    import msgpack

    rnd = random.Random(1)
    data = [(rnd.randrange(10_000), 1) for _ in range(1_000_000)]  # as much as a worker holds
    packer = msgpack.Packer(use_bin_type=True)
    start = time.process_time()
    for _ in range(2):
        for i in range(0, len(data), 4096):
            msgpack.unpackb(packer.pack(data[i:i + 4096]), use_list=False)
    return time.process_time() - start


def control(processes: int, alone: float | None = None) -> float:
    """Median CPU seconds of the engine-free control job in each of ``processes`` processes run at
    once, divided by ``alone`` (the same in one process; measured when ``None``)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        cpu = statistics.median(pool.map(_control_job, range(processes), chunksize=1))
    return cpu / (alone if alone is not None else control(1, 1.0))


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:,.0f} us"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--records", type=int, default=1_000_000, help="keyed count: records per worker")
    parser.add_argument("--keys", type=int, default=10_000, help="keyed count: distinct keys")
    parser.add_argument("--events", type=int, default=None,
                        help=f"NEXMark closed loop: events per worker (default {EVENTS})")
    parser.add_argument("--batch", type=int, default=4096, help="records (events) per input batch and worker")
    parser.add_argument("--epoch-batches", type=int, default=16,
                        help="NEXMark closed loop: batches per epoch and worker (the keyed count: 64, as bench/exchange.py)")
    parser.add_argument("--rate", type=int, default=2_000, help="NEXMark open loop: events/s per worker")
    parser.add_argument("--duration", type=float, default=8.0, help="NEXMark open loop: seconds of input")
    parser.add_argument("--progress", nargs="+", choices=["direct", "relay"], default=["direct"],
                        help="progress mode(s); with two, runs alternate between them (default direct)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--no-latency", action="store_true", help="skip the open-loop latency runs")
    mode.add_argument("--latency-only", action="store_true", help="NEXMark: only the open-loop latency runs")
    opts = parser.parse_args(argv)
    if opts.latency_only and "count" in opts.workload:
        parser.error("--latency-only measures NEXMark queries only (the keyed count has no open loop)")
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; median of {opts.runs} runs; closed loop: keyed count "
          f"{opts.records:,} records per worker ({opts.keys:,} keys), NEXMark {opts.events or EVENTS} events per worker; "
          f"open loop: {opts.rate:,} events/s per worker for {opts.duration:g} s", flush=True)
    alone = control(1, 1.0)
    factors = {w: control(w, alone) for w in opts.workers}
    modes = opts.progress
    print(f"{'workload':<9} {'workers':>7} {'progress':>8} {'records/s':>12} {'per worker':>12} {'per CPU-s':>11} {'vs 2':>5} "
          f"{'CPU-s':>6} {'p50':>9} {'p99':>9} {'CPU/round':>9} {'control':>8}")
    for workload in opts.workload:
        base: dict[str, float] = {}
        for workers in opts.workers:
            got: dict[str, tuple[list[Figures], list[tuple[float, float, float]]]] = {m: ([], []) for m in modes}
            for _ in range(opts.runs):
                for progress in modes:  # alternating: a drift of the machine's load falls on every mode
                    runs, lat = got[progress]
                    if workload == "count":
                        runs.append(run_count(workers, opts.records, opts.keys, opts.batch, 64, progress))
                    else:
                        events = opts.events or EVENTS[workload]
                        if not opts.latency_only:
                            runs.append(run_nexmark(workload, workers, events, opts.batch, opts.epoch_batches,
                                                    progress))
                        if not opts.no_latency:
                            lat.append(run_latency(workload, workers, opts.rate, opts.duration, progress))
                    time.sleep(0.5)  # let the previous run's processes go
            for progress in modes:
                _print_row(workload, workers, progress, *got[progress], base, factors[workers])


def _print_row(workload: str, workers: int, progress: str, runs: list[Figures], lat: list[tuple[float, float, float]],
               base: dict[str, float], factor: float) -> None:
    """One configuration's medians (``base``: records per CPU-second at 2 workers, by mode)."""
    p50 = statistics.median(x[0] for x in lat) if lat else None
    p99 = statistics.median(x[1] for x in lat) if lat else None
    per_round = statistics.median(x[2] for x in lat) if lat else None
    if not runs:  # --latency-only
        print(f"{workload:<9} {workers:>7} {progress:>8} {'-':>12} {'-':>12} {'-':>11} {'-':>5} {'-':>6} "
              f"{_fmt_ms(p50):>9} {_fmt_ms(p99):>9} {_fmt_us(per_round):>9} {factor:>7.2f}x", flush=True)
        return
    rate = statistics.median(r.rate for r in runs)
    per_cpu = statistics.median(r.per_cpu_s for r in runs)
    if workers == 2:
        base[progress] = per_cpu
    share = f"{per_cpu / base[progress]:.0%}" if progress in base and workers > 2 else "-"
    print(f"{workload:<9} {workers:>7} {progress:>8} {rate:>12,.0f} {rate / workers:>12,.0f} {per_cpu:>11,.0f} "
          f"{share:>5} {statistics.median(r.cpu for r in runs):>6.1f} {_fmt_ms(p50):>9} {_fmt_ms(p99):>9} "
          f"{_fmt_us(per_round):>9} {factor:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
