"""Keyed count through ``exchange`` on worker processes, next to the raw transport ceiling.

Each worker pre-generates its share of ``(key, 1)`` records (``--keys`` distinct keys), then feeds
them in batches through ``exchange(0).count_by_key(0)``, one epoch per ``--epoch-batches`` batches,
keeping at most one epoch in flight. Throughput = all records / wall time from the first record
sent to the last epoch complete on every worker. The collector is set by ``--gc`` once the
records are generated (``timely.collector``; default ``freeze``). The raw ceiling is msgpack
batches over pyzmq between two processes with no engine, measured in the same run by
``bench/transport.py`` (``--layers raw --directions both``).

    python bench/exchange.py            # 10k and 1M keys, 2 workers, 5 runs each
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

import timely
from nexmark.openloop import start_together
from timely import collector

TRANSPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transport.py")


def keyed_count(worker: timely.Worker) -> tuple[float, float, int, float]:
    """One worker's part: returns (start, end, distinct keys counted here in the last epoch, CPU
    seconds (user + system) this worker used between start and end)."""
    records, keys, batch, epoch_batches = (int(a) for a in worker.args[:4])
    mine = records // worker.peers
    rnd = random.Random(worker.index)
    data = [(rnd.randrange(keys), 1) for _ in range(mine)]
    batches = [data[i:i + batch] for i in range(0, mine, batch)]
    del data
    collector.configure(worker.args[4])  # the pre-generated records are never garbage (freeze)
    counted = [0]
    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = (inp.stream.exchange(0).count_by_key(0)
                 .inspect_batch(lambda t, b: counted.__setitem__(0, counted[0] + len(b))).probe())
    # A common start: each worker's data generation and build end at a different moment, and a
    # clock started at each would count the others' set-up into the run's wall time.
    start, cpu = start_together(worker, delay=0.0), _cpu()
    for i, b in enumerate(batches):
        inp.send_batch(b)
        if i % epoch_batches == epoch_batches - 1:
            inp.advance_to(inp.time + 1)
            # At most one epoch in flight: bounded memory, and the measurement includes progress.
            worker.step_while(lambda: probe.less_than(inp.time - 1))
    inp.close()
    worker.step_while(lambda: not probe.done())
    return start, time.time(), counted[0], _cpu() - cpu


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def run_engine(workers: int, records: int, keys: int, batch: int, epoch_batches: int, gc: str) -> float:
    """One engine run; records/s over all workers."""
    results = timely.execute(keyed_count, workers=workers,
                             args=[str(records), str(keys), str(batch), str(epoch_batches), gc])
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    return (records // workers * workers) / (end - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--records", type=int, default=4_000_000, help="records in total per run")
    parser.add_argument("--keys", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--epoch-batches", type=int, default=64, help="batches per epoch and worker")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-ceiling", action="store_true", help="skip the raw transport ceiling")
    parser.add_argument("--gc", choices=collector.POLICIES, default="freeze",
                        help="the workers' collector once the records are generated (default freeze)")
    opts = parser.parse_args(argv)
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; {opts.workers} workers; {opts.records:,} records per run; "
          f"batch {opts.batch}; gc {opts.gc}; median of {opts.runs} runs")
    rows = []
    for keys in opts.keys:
        rates = [run_engine(opts.workers, opts.records, keys, opts.batch, opts.epoch_batches, opts.gc)
                 for _ in range(opts.runs)]
        rows.append((f"keyed count, {keys:,} keys", rates))
        print(f"{rows[-1][0]:<36} {statistics.median(rates):>14,.0f} rec/s  (min {min(rates):,.0f}, max {max(rates):,.0f})",
              flush=True)
    if not opts.no_ceiling:
        rates = raw_ceiling(opts.records // 2, opts.batch, opts.runs)
        rows.append(("raw ceiling (msgpack+pyzmq, both ways)", rates))
        print(f"{rows[-1][0]:<36} {statistics.median(rates):>14,.0f} rec/s  (min {min(rates):,.0f}, max {max(rates):,.0f})",
              flush=True)


def raw_ceiling(records: int, batch: int, runs: int) -> list[float]:
    """``bench/transport.py``'s raw layer, both directions at once: records/s of each run."""
    cmd = [sys.executable, TRANSPORT, "--layers", "raw", "--directions", "both", "--batch-sizes", str(batch),
           "--records", str(records), "--runs", str(runs), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])[0]["rates"]


if __name__ == "__main__":
    main()
