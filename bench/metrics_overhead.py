"""What the always-on metrics cost: a Megaphone keyed count with and without its per-record part.

The metrics are counted per batch and per operator invocation (records in and out, busy time), except
Megaphone's per-bin load, which counts every record: :func:`timely.routing.bins_of` adds each
record to its bin's counter in the pass that computes the bins. This runs the cheapest Megaphone
job there is (``megaphone.state_machine`` summing ``--records`` records over ``--keys`` keys on one
worker, a fold that does nothing else), so that the counting's share is as large as it can be,
alternately as shipped ("on") and with the per-bin counting switched off ("off": ``bins_of`` called
without its counter array), in ``--runs`` alternating pairs; it prints the median seconds of each
and the overhead.

    .venv/bin/python bench/metrics_overhead.py --runs 9
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from itertools import repeat
from typing import Any

import megaphone
import megaphone.state
import timely
from timely import routing


class _Uncounted:
    """``megaphone.state``'s view of :mod:`timely.routing` with the per-bin counting left out."""

    @staticmethod
    def bins_of(records: Any, key: Any, k: int, counts: Any = None) -> list[int]:
        return routing.bins_of(records, key, k)


def run(records: int, keys: int, k: int, counted: bool) -> float:
    """Seconds (process CPU time) to fold ``records`` records through ``state_machine`` on one worker."""
    megaphone.state.routing = routing if counted else _Uncounted  # type: ignore[assignment]
    batches = [list(zip(((i * 7919 + j) % keys for j in range(4096)), repeat(1))) for i in range(records // 4096)]

    def fold(key: Any, value: int, state: int | None) -> tuple[int, tuple]:
        return (value if state is None else state + value), ()

    def job(worker: timely.Worker) -> float:
        with worker.dataflow() as scope:
            data = scope.new_input()
            control = megaphone.ControlInput(scope, k=k)
            m = megaphone.state_machine(data.stream, control, 0, fold)
        start = time.process_time()
        for i, b in enumerate(batches):
            data.send_batch(b)
            if i % 16 == 15:
                data.advance_to(data.time + 1)
                control.advance_to(data.time)
                worker.step_while(lambda: m.probe.less_than(data.time))
        data.close()
        control.close()
        worker.step_while(lambda: not m.probe.done())
        return time.process_time() - start

    try:
        return timely.execute(job, workers=1)[0]
    finally:
        megaphone.state.routing = routing


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_200_000)
    p.add_argument("--keys", type=int, default=10_000)
    p.add_argument("--k", type=int, default=8, help="2^k bins (default 8)")
    p.add_argument("--runs", type=int, default=9, help="alternating pairs of runs (default 9)")
    opts = p.parse_args(argv)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"os.cpu_count() = {os.cpu_count()}; 1 worker; {opts.records:,} records, {opts.keys:,} keys, "
          f"2^{opts.k} bins; median of {opts.runs} alternating runs", flush=True)
    on: list[float] = []
    off: list[float] = []
    for _ in range(opts.runs):
        on.append(run(opts.records, opts.keys, opts.k, True))
        off.append(run(opts.records, opts.keys, opts.k, False))
    a, b = statistics.median(on), statistics.median(off)
    print(f"metrics on  {a:.3f} s  ({opts.records / a / 1e6:.2f} M records per CPU-second)")
    print(f"metrics off {b:.3f} s  ({opts.records / b / 1e6:.2f} M records per CPU-second)")
    print(f"overhead {100 * (a / b - 1):+.1f}%")


if __name__ == "__main__":
    main()
