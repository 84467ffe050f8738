"""Load shift: hot keys appear mid-run in bins that one worker owns.

A keyed count (``megaphone.state_machine``, each record costing ``--work`` iterations of a small
loop) is fed open-loop at ``--rate`` records per second in epochs of ``--epoch-ms`` (records are
due at fixed wall-clock times whether or not the job keeps up). From ``--shift-at`` seconds on,
``--hot-share`` of the records go to a few hot keys (4, or one per worker if there are more workers)
whose bins worker 0 owns. Modes:

* ``none``: no rebalancing;
* ``auto``: ``megaphone.AutoBalancer`` (threshold ``--threshold``) on the metrics hub;
* ``static``: the best static table for the shifted load (:func:`megaphone.autobalance.even`),
  installed before any record (the bins are empty then).

Per mode: records acknowledged per second and the latency of each epoch (its completion on the
output minus its due time: the end of the epoch, when every worker sends its records, from one
common start) before the shift, during it (until the AutoBalancer's migration
completed, or 3 s), after, and from 10 s after the shift on (``*_10s``: issue 18's target compares
that p99 with the best static table's); for ``auto`` the seconds from the shift to the decision and
to the migration's completion. Medians over ``--runs``.

    python bench/autobalance.py --seconds 20 --runs 3
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import megaphone
import timely
from megaphone.autobalance import even
from nexmark.openloop import start_together
from timely import routing
from timely.metrics import ENV, MetricsConfig

K = 6


def hot_keys(table: Any, n: int = 4) -> list[int]:
    """``n`` keys in distinct bins that ``table`` gives worker 0."""
    keys: list[int] = []
    bins: set[int] = set()
    key = 1_000_000
    while len(keys) < n:
        b = routing.bins_of([(key, 0)], 0, K)[0]
        if table[b] == 0 and b not in bins:
            keys.append(key)
            bins.add(b)
        key += 1
    return keys


def epoch_batch(e: int, n: int, hot: list[int], shifted: bool, share: float, index: int) -> list[tuple[int, int]]:
    """Worker ``index``'s ``n`` records of epoch ``e``: uniform keys, or ``share`` of them hot."""
    nhot = int(n * share) if shifted else 0
    cold = [((e * 7919 + i * 104729 + index) % 5000, 1) for i in range(n - nhot)]
    return cold + [(hot[i % len(hot)], 1) for i in range(nhot)]


def job(worker: timely.Worker) -> Any:
    """One worker's part; worker 0 returns its per-epoch completion times and the balancer's events."""
    mode = worker.args[0]
    rate, work, epoch_ms = (int(a) for a in (worker.args[1], worker.args[5], worker.args[6]))
    seconds, shift_at, share, threshold, interval = (float(a) for a in (worker.args[2], worker.args[3], worker.args[4],
                                                                         worker.args[7], worker.args[8]))
    target = None if worker.args[9] == "None" else float(worker.args[9])
    epoch_s = epoch_ms / 1000

    def fold(key: Any, value: int, state: int | None) -> tuple[int, tuple]:
        for _ in range(work):
            pass
        return (value if state is None else state + value), ()

    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=K)
        m = megaphone.state_machine(data.stream, control, 0, fold, name="Count")
    hot = hot_keys(control.initial, max(4, worker.peers))  # enough hot keys for an even spread
    controller = megaphone.Controller(control, m.probe) if worker.index == 0 else None
    balancer = None
    if controller is not None and mode == "auto":
        balancer = megaphone.AutoBalancer(controller, worker, threshold=threshold, target=target, hold=2, window=2,
                                          cooldown=30, interval=interval)
    if controller is not None and mode == "static":
        loads = [0.0] * (1 << K)
        for key, _ in epoch_batch(0, 1000, hot, True, share, 0):
            loads[routing.bins_of([(key, 0)], 0, K)[0]] += 1
        controller.rebalance(even(loads, controller.current_table, worker.peers, 0.02), "all_at_once")
    epochs = int(seconds / epoch_s)
    per_epoch = max(1, int(rate * epoch_s / worker.peers))
    done = np.full(epochs, np.nan)
    # One start for all (after every worker's own set-up: worker 0 builds the controller and
    # imports networkx, ~0.2 s): with a start of their own the others ran ahead, and the latency,
    # measured against worker 0's schedule, left their records' wait out.
    start = start_together(worker)
    e = 0
    seen = 0
    while e < epochs:
        due = min(epochs, int((time.time() - start) / epoch_s))
        while e < due:
            data.send_batch(epoch_batch(e, per_epoch, hot, e * epoch_s >= shift_at, share, worker.index))
            e += 1
            data.advance_to(e)
            control.advance_to(e)
        if controller is not None:
            controller.tick()
        worker.step_or_park(0.002)
        now = time.time()
        while seen < e and not m.probe.less_equal(seen):
            done[seen] = now
            seen += 1
    data.close()
    control.close()
    while controller is not None and controller.busy:
        controller.tick()
        worker.step_or_park(0.01)
    while not m.probe.done():
        worker.step_or_park(0.01)
        now = time.time()
        while seen < epochs and not m.probe.less_equal(seen):
            done[seen] = now
            seen += 1
    if worker.index != 0:
        return None
    completed = [ev.completed_at for ev in controller.events] if controller is not None else []
    decided = [d["at"] for d in balancer.decisions] if balancer is not None else []
    return start, done.tolist(), decided, completed, per_epoch * worker.peers


def summarise(result: Any, shift_at: float, epoch_s: float, mode: str) -> dict[str, float]:
    start, done, decided, completed, records = result
    done = np.array(done)
    due = start + (np.arange(len(done)) + 1) * epoch_s
    lat = done - due
    t = np.arange(len(done)) * epoch_s
    shift = start + shift_at
    settled = shift_at + 3.0
    if mode == "auto" and completed and completed[-1] is not None:
        settled = max(shift_at, completed[-1] - start)
    out: dict[str, float] = {}
    phases = [("before", t < shift_at), ("during", (t >= shift_at) & (t < settled)), ("after", t >= settled),
              # the target's window: from 10 s after the shift on (needs --seconds beyond --shift-at + 10)
              ("10s", t >= shift_at + 10.0)]
    for name, sel in phases:
        if sel.any():
            out[f"p50_{name}_ms"] = float(np.percentile(lat[sel], 50) * 1000)
            out[f"p99_{name}_ms"] = float(np.percentile(lat[sel], 99) * 1000)
            # Throughput: the phase's records over the time from its first record's due time (its
            # first epoch's start) to its last completion (not the spread of its completions, which
            # is near zero where one frontier move completes a backlog of epochs at once).
            span = done[sel].max() - (start + t[sel].min())
            out[f"rate_{name}"] = float(sel.sum() * records / max(span, epoch_s))
    if mode == "auto":
        out["detect_s"] = decided[0] - shift if decided else float("nan")
        out["converge_s"] = completed[-1] - shift if completed and completed[-1] is not None else float("nan")
    return out


def main(argv: list[str] | None = None) -> None:
    """Run every mode ``--runs`` times, round-robin, and print the medians."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["none", "auto", "static"], choices=["none", "auto", "static"])
    p.add_argument("--rate", type=int, default=16_000, help="records per second, all workers")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--shift-at", type=float, default=3.0)
    p.add_argument("--hot-share", type=float, default=0.9)
    p.add_argument("--work", type=int, default=5000, help="loop iterations per record in the fold")
    p.add_argument("--epoch-ms", type=int, default=10)
    p.add_argument("--threshold", type=float, default=0.25)
    p.add_argument("--target", type=float, default=None,
                   help="the AutoBalancer's target imbalance after a move (default: half the threshold)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.25, help="seconds between the AutoBalancer's evaluations")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    opts = p.parse_args(argv)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"os.cpu_count() = {os.cpu_count()}; {opts.workers} workers; {opts.rate:,} records/s; "
          f"shift at {opts.shift_at:g} s to {opts.hot_share:.0%} hot; median of {opts.runs} run(s)")
    # Round-robin over the modes (auto, static, auto, static, ...): a drift of the machine's load
    # during the invocation falls on every mode alike, not on whichever block ran first.
    runs: dict[str, list[dict]] = {mode: [] for mode in opts.modes}
    for _ in range(opts.runs):
        for mode in opts.modes:
            with tempfile.TemporaryDirectory() as d:
                os.environ[ENV] = MetricsConfig(hub=f"ipc://{d}/hub", interval=0.1).to_env()
                args = [mode, opts.rate, opts.seconds, opts.shift_at, opts.hot_share, opts.work, opts.epoch_ms,
                        opts.threshold, opts.interval, opts.target]
                result = timely.execute(job, workers=opts.workers, args=[str(a) for a in args], start="spawn",
                                        timeout=opts.seconds + 120)[0]
                del os.environ[ENV]
            runs[mode].append(summarise(result, opts.shift_at, opts.epoch_ms / 1000, mode))
            r = runs[mode][-1]
            print(f"  run {len(runs[mode])} {mode:7s} p99 before {r.get('p99_before_ms', float('nan')):,.1f} ms, "
                  f"from 10 s on {r.get('p99_10s_ms', float('nan')):,.1f} ms", flush=True)
    if "auto" in runs and "static" in runs and all("p99_10s_ms" in r for r in runs["auto"] + runs["static"]):
        # The target's reliability: each round's AutoBalancer against the static table of the same round.
        ratios = [a["p99_10s_ms"] / s["p99_10s_ms"] for a, s in zip(runs["auto"], runs["static"], strict=True)]
        print("p99 from 10 s on, AutoBalancer / static table, per round: "
              + ", ".join(f"{x:.2f}x" for x in ratios)
              + f"; within 1.5x in {sum(x <= 1.5 for x in ratios)} of {len(ratios)}")
    for mode, done in runs.items():
        keys = sorted({k for r in done for k in r})
        med = {k: statistics.median(r[k] for r in done if k in r) for k in keys}
        print(f"{mode:7s} " + "  ".join(f"{k}={v:,.1f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
