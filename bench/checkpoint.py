"""Checkpoints (issue 16): steady-state cost, bytes and duration per checkpoint, recovery, rescaling.

The job (``bench/ckjobs.py``) is a Megaphone keyed count (``megaphone.state_machine``, 2^``--k``
bins) over ``--keys`` pre-loaded keys on ``--workers`` worker processes (``timely.execute``,
forked), fed open loop at ``--rate`` records/s in epochs of ``--epoch-ms`` ms (``nexmark.openloop``:
latency = wall time at which the output probe passes a record's epoch minus the record's scheduled
time, queueing included). With checkpoints, ``checkpoint_every=--every`` logical epochs (10 x
100 ms = 1 s), in a fresh local directory per run. The issue asks for 4 M keys; the default here is
1 M (``--keys``) so that a full run fits in about 5 minutes on a 2-core machine.

1. **steady**: the same run without checkpoints and with them, ``--runs`` times interleaved:
   p50/p99/max latency of records scheduled in ``[--warmup, --duration)``, throughput (records /
   time to the last completion) and records per CPU-second of the workers from the warm-up on (the
   CPU checkpoints take, which an open loop below saturation does not show as throughput); the
   stall per worker: Megaphone's offers on the dataflow thread (of which pickling the dirty bins,
   ``StateCodec.dumps``), ``offer_block_s`` (the dataflow waiting for the writer's queue) against
   ``write_s`` (the background writer). **capacity**: both at ``--capacity-rate`` offered, above
   what the workers take, for ``--capacity-s`` s: throughput = records / time to the last output.
   Targets: p99 at most 1.3x, throughput loss at most 5%.
2. **bytes**: per checkpoint, bytes written (part files, all workers) and duration (from the cut,
   the completion of the last epoch before the checkpoint epoch, to the manifest's commit), full
   (uniform keys: every bin touched every second) against incremental (``--hot`` keys only, so at
   most that many bins touched); the first checkpoint after the pre-load (every bin) apart.
3. **recovery**: SIGKILL of worker 1 at ``--kill-at`` s (or later, once the second checkpoint is
   complete), ``timely.execute(..., checkpoint=..., restarts=1)``: the survivors stopped, new
   processes forked, their job entered, the state loaded (the dataflow built: its bins read from
   the checkpoint), the first output epoch after the kill, and recovered (from the kill until every
   later epoch completes within ``--recovered-ms`` of its end), for each of ``--recovery-keys``.
   Target: 10 M keys under 10 s.
4. **rescale**: ``--workers`` workers stop at ``--stop-at`` s, at the next checkpoint epoch, and
   one worker resumes from that checkpoint (every bin, a balanced table), against a live Megaphone
   migration (``--strategy``) of the same bins (worker 1's to worker 0) at the same moment: duration
   (stop to recovered, or first step issued to last step done) and the maximum latency of the
   records scheduled from then on.

    .venv/bin/python bench/checkpoint.py                   # everything, about 5 minutes
    .venv/bin/python bench/checkpoint.py --quick           # about 40 s, smaller figures
    .venv/bin/python bench/checkpoint.py --parts steady,bytes --runs 1 --keys 4000000
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import timely

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckjobs import job  # bench/ is not a package

from nexmark.metrics import percentiles
from nexmark.openloop import Schedule, latencies
from nexmark.report import align

PARTS = ("steady", "capacity", "bytes", "recovery", "rescale")


def run_job(args: argparse.Namespace, folder: Path, workers: int, checkpoint: bool, restarts: int = 0,
            **extra: object) -> list[dict]:
    """One run of :func:`ckjobs.job` on ``workers`` workers; each worker's result."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"dir": str(folder), "rate": args.rate, "epoch_ms": args.epoch_ms, "every": args.every, "k": args.k,
           "keys": args.keys, "hot": 0, "warmup": args.warmup, "strategy": args.strategy, "seed": args.seed,
           "epochs": round(args.duration * 1000 / args.epoch_ms)}
    cfg.update(extra)
    return timely.execute(job, workers=workers, args=[json.dumps(cfg)], timeout=args.timeout, restarts=restarts,
                          checkpoint=str(folder / "ck") if checkpoint else None, checkpoint_every=args.every)


def merged_completion(results: list[dict]) -> np.ndarray:
    """Per measured epoch, when every worker's probe had passed it (NaN: not in these runs)."""
    return np.fmax.reduce(np.vstack([np.asarray(r["completion"], dtype=float) for r in results]), axis=0)


def record_latencies(args: argparse.Namespace, results: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(scheduled, latency)`` of every record of the epochs these runs completed."""
    peers = results[0]["peers"]
    parts = [latencies(Schedule(args.rate, args.epoch_ms, r["index"], peers), np.asarray(r["completion"], dtype=float))
             for r in results]
    return np.concatenate([s for s, _ in parts]), np.concatenate([x for _, x in parts])


def recovered(args: argparse.Namespace, completion: np.ndarray, since: float) -> float:
    """The wall time (schedule seconds) from which every epoch ending after ``since`` completes
    within ``--recovered-ms`` of its end (NaN if never)."""
    E = args.epoch_ms / 1000
    ends = (np.arange(len(completion)) + 1) * E
    lag = completion - ends
    late = np.nonzero((ends > since) & ~(lag <= args.recovered_ms / 1000))[0]  # NaN counts as late
    if not len(late):
        return float(completion[np.nonzero(ends > since)[0][0]])
    last = late[-1]
    return float(completion[last + 1]) if last + 1 < len(completion) else float("nan")


def count_check(args: argparse.Namespace, results: list[dict]) -> str:
    """"OK" when the counts hold every pre-loaded key and every scheduled record exactly once."""
    epochs = round(args.duration * 1000 / args.epoch_ms)
    want = args.keys + int(Schedule(args.rate, args.epoch_ms).first(epochs))
    got = sum(r["total"] for r in results)
    return "OK" if got == want else f"WRONG ({got:,} counted, {want:,} expected)"


# -- 1 and 2: steady state, bytes and duration per checkpoint ------------------------------------------

def steady_figures(args: argparse.Namespace, results: list[dict]) -> dict:
    """Latency, throughput, capacity and checkpoint costs of one steady-state run."""
    sched, lat = record_latencies(args, results)
    warm = sched >= args.warmup
    p = percentiles(lat[warm])
    last = float(np.nanmax(merged_completion(results)))
    cpu = sum(r["cpu_s"] for r in results)  # from the end of the warm-up on
    out = {"p50": p["p50"], "p99": p["p99"], "max": p["max"], "tput": len(sched) / last,
           "per_cpu": int(warm.sum()) / cpu,
           "counts": count_check(args, results)}
    if results[0]["stats"] is not None:
        offers = [r["log"]["offers"] for r in results]
        first = min((o[0] for os_ in offers for o in os_), default=0)  # holds every pre-loaded bin
        out["ser_s"] = [sum(o[1] for o in os_) for os_ in offers]
        out["pickle_s"] = [sum(o[3] for o in os_) for os_ in offers]
        out["ser_max"] = [max((o[1] for o in os_ if o[0] != first), default=0.0) for os_ in offers]
        out["cow_s"] = [sum(r["log"].get("cow", [])) for r in results]
        out["cow_max"] = [max(r["log"].get("cow", []), default=0.0) for r in results]
        out["block_s"] = [r["stats"]["offer_block_s"] for r in results]
        out["write_s"] = [r["stats"]["write_s"] for r in results]
        out["write_cpu_s"] = [r["stats"]["write_cpu_s"] + r["stats"]["commit_cpu_s"] for r in results]
        out["checkpoints"] = checkpoints(args, results)
    return out


def checkpoints(args: argparse.Namespace, results: list[dict]) -> list[dict]:
    """Per committed checkpoint: epoch, bytes of its parts, the longest part write, the duration
    from its cut (every worker's completion of the last epoch before it) to the commit."""
    completion = merged_completion(results)
    out = []
    for epoch, _, wall in results[0]["log"]["commits"]:
        parts = [p for r in results for p in r["log"]["parts"] if p[0] == epoch]
        cut = epoch - 2  # the measured epoch of logical time epoch - 1
        begin = float(completion[cut]) if 0 <= cut < len(completion) else float("nan")
        out.append({"epoch": epoch, "bytes": sum(p[2] for p in parts), "write_max": max(p[1] for p in parts),
                    "duration": wall - results[0]["start"] - begin})
    return out


def per_checkpoint(cks: list[dict], key: str) -> float:
    """Median of ``key`` over the checkpoints after the first (which holds every pre-loaded bin)."""
    xs = [c[key] for c in cks[1:] if math.isfinite(c[key])]
    return statistics.median(xs) if xs else float("nan")


def steady(args: argparse.Namespace, scratch: Path) -> list[str]:
    """Part 1 (and the full half of part 2): runs without and with checkpoints, interleaved."""
    runs: dict[str, list[dict]] = {"none": [], "checkpoints": []}
    for run in range(args.runs):
        for mode in runs:
            t0 = time.time()
            res = run_job(args, scratch / f"steady-{mode}-{run}", args.workers, mode == "checkpoints")
            m = steady_figures(args, res)
            runs[mode].append(m)
            extra = ""
            if "ser_s" in m:
                extra = (f"; offers {fmt_list(m['ser_s'])} s (pickling {fmt_list(m['pickle_s'])} s, max "
                         f"{fmt_list(m['ser_max'], 1e3, '.0f')} ms), "
                         f"offer_block_s {fmt_list(m['block_s'])}, write_s {fmt_list(m['write_s'])} per worker; "
                         f"{len(m['checkpoints'])} checkpoints, first {m['checkpoints'][0]['bytes'] / 2**20:.1f} MiB"
                         if m["checkpoints"] else "; NO CHECKPOINT COMMITTED")
            print(f"run {run} {mode:<11}: p50 {m['p50'] * 1e3:.0f} ms, p99 {m['p99'] * 1e3:.0f} ms, max "
                  f"{m['max'] * 1e3:.0f} ms, {m['tput']:,.0f} rec/s, {m['per_cpu']:,.0f} rec/CPU-s, counts "
                  f"{m['counts']}{extra}; load {os.getloadavg()[0]:.1f}; {time.time() - t0:.0f} s", flush=True)
    med = {mode: {k: statistics.median(m[k] for m in ms) for k in ("p50", "p99", "max", "tput", "per_cpu")}
           for mode, ms in runs.items()}
    ck = runs["checkpoints"]
    rows = [[mode, f"{m['p50'] * 1e3:.0f}", f"{m['p99'] * 1e3:.0f}", f"{m['max'] * 1e3:.0f}", f"{m['tput']:,.0f}",
             f"{m['per_cpu']:,.0f}"] for mode, m in med.items()]
    print(f"\n1. steady state, median of {args.runs} run(s)\n"
          + align([["checkpoints", "p50 ms", "p99 ms", "max ms", "rec/s", "rec/CPU-s"], *rows]))
    stall = [[f"worker {w}", fmt_med(ck, "ser_s", w), fmt_med(ck, "pickle_s", w), fmt_med(ck, "ser_max", w, 1e3),
              fmt_med(ck, "cow_s", w), fmt_med(ck, "cow_max", w, 1e3), fmt_med(ck, "block_s", w),
              fmt_med(ck, "write_s", w), fmt_med(ck, "write_cpu_s", w)] for w in range(args.workers)]
    print(f"stall per worker over the {args.duration:g} s run (median; offers: Megaphone's, on the dataflow thread, "
          f"of which pickling on that thread; max: one offer after the first; copy on write: whole bins S "
          f"touched before the writer serialised them, pickled on the dataflow thread):\n"
          + align([["", "offers s", "pickling s", "offer max ms", "copy-on-write s", "cow max ms", "offer_block_s",
                    "write_s (background)", "its CPU s (with commits)"], *stall]))
    r99 = med["checkpoints"]["p99"] / med["none"]["p99"]
    loss = 1 - med["checkpoints"]["tput"] / med["none"]["tput"]
    loss_cpu = 1 - med["checkpoints"]["per_cpu"] / med["none"]["per_cpu"]
    verdicts = [f"p99 with checkpoints every {args.every * args.epoch_ms / 1000:g} s: {r99:.2f}x of none (target "
                f"<= 1.3x): {'MET' if r99 <= 1.3 else 'NOT met'}",
                f"throughput loss {loss:.1%} at {args.rate:,} rec/s offered; records per CPU-second {loss_cpu:.1%} "
                f"lower (the CPU checkpoints take, from the end of the warm-up)"]
    for v in verdicts:
        print(v)
    full = [c for m in ck for c in m["checkpoints"]]
    args._full = {"first": statistics.median(m["checkpoints"][0]["bytes"] for m in ck if m["checkpoints"]),
                  "bytes": per_checkpoint(full, "bytes"), "duration": per_checkpoint(full, "duration"),
                  "write": per_checkpoint(full, "write_max"), "p99": med["checkpoints"]["p99"],
                  "ser_max": statistics.median(max(m["ser_max"]) for m in ck)}
    return verdicts


def capacity(args: argparse.Namespace, scratch: Path) -> list[str]:
    """Part 1b: the most the job sustains, without and with checkpoints: ``--capacity-rate`` offered
    (above what 2 cores take) for ``--capacity-s`` s; throughput = records / time to the last output."""
    sub = argparse.Namespace(**{**vars(args), "rate": args.capacity_rate, "duration": args.capacity_s})
    got: dict[str, list[float]] = {"none": [], "checkpoints": []}
    for run in range(args.runs):
        for mode in got:
            res = run_job(sub, scratch / f"capacity-{mode}-{run}", args.workers, mode == "checkpoints")
            sched, _ = record_latencies(sub, res)
            got[mode].append(len(sched) / float(np.nanmax(merged_completion(res))))
            print(f"run {run} {mode:<11}: {got[mode][-1]:,.0f} rec/s of {sub.rate:,} offered; counts "
                  f"{count_check(sub, res)}; load {os.getloadavg()[0]:.1f}", flush=True)
    none, ck = statistics.median(got["none"]), statistics.median(got["checkpoints"])
    loss = 1 - ck / none
    verdict = (f"capacity {ck:,.0f} rec/s with checkpoints against {none:,.0f} without ({args.capacity_rate:,} offered "
               f"for {args.capacity_s:g} s, median of {args.runs}): loss {loss:.1%} (target <= 5%): "
               f"{'MET' if loss <= 0.05 else 'NOT met'}")
    print(verdict)
    return [verdict]


def incremental(args: argparse.Namespace, scratch: Path) -> None:
    """Part 2: bytes and duration per checkpoint, ``--hot`` keys against every bin touched."""
    rows = []
    if getattr(args, "_full", None) is None:
        m = steady_figures(args, run_job(args, scratch / "bytes-full", args.workers, True))
        cks = m["checkpoints"]
        args._full = {"first": cks[0]["bytes"], "bytes": per_checkpoint(cks, "bytes"),
                      "duration": per_checkpoint(cks, "duration"), "write": per_checkpoint(cks, "write_max"),
                      "p99": m["p99"], "ser_max": max(m["ser_max"])}
    res = run_job(args, scratch / "bytes-hot", args.workers, True, hot=args.hot)
    m = steady_figures(args, res)
    cks = m["checkpoints"]
    hot = {"first": cks[0]["bytes"], "bytes": per_checkpoint(cks, "bytes"), "duration": per_checkpoint(cks, "duration"),
           "write": per_checkpoint(cks, "write_max"), "p99": m["p99"], "ser_max": max(m["ser_max"])}
    for label, m in ((f"full (uniform over {args.keys:,} keys)", args._full), (f"incremental ({args.hot} hot keys)", hot)):
        rows.append([label, f"{m['first'] / 2**20:.1f}", f"{m['bytes'] / 2**20:.2f}", f"{m['write'] * 1e3:.0f}",
                     f"{m['duration'] * 1e3:.0f}", f"{m['ser_max'] * 1e3:.0f}", f"{m['p99'] * 1e3:.0f}"])
    print("\n2. per checkpoint (median over the checkpoints after the first; bytes: part files of all workers; "
          "offer max: the longest Megaphone offer on a dataflow thread after the first; p99 of the run)\n"
          + align([["", "first MiB", "MiB", "longest part write ms", "cut to commit ms", "offer max ms", "p99 ms"],
                   *rows]))


# -- 3 and 4: recovery, rescaling -------------------------------------------------------------------

def recovery(args: argparse.Namespace, scratch: Path) -> list[str]:
    """Part 3: SIGKILL worker 1, restart from the checkpoint, per state size."""
    rows, verdicts = [], []
    for keys in args.recovery_keys:
        sub = argparse.Namespace(**{**vars(args), "keys": keys,
                                        "duration": max(args.duration, args.kill_at + (4 if args.quick else 10))})
        t0 = time.time()
        res = run_job(sub, scratch / f"recovery-{keys}", args.workers, True, restarts=1, kill_at=args.kill_at, victim=1)
        killed = res[0]["killed"]
        if killed is None or res[0]["resume"] == 0:
            print(f"{keys:,} keys: no restart from a checkpoint (killed {killed}, resume {res[0]['resume']})")
            continue
        kill = killed["at"]
        completion = merged_completion(res)
        stopped = max(res[0]["stopped"], default=float("nan"))  # the survivors got SIGTERM
        forked = min(r["forked"] for r in res)
        entry, load = max(r["entered"] for r in res), max(r["built"] - r["entered"] for r in res)
        first = float(np.nanmin(completion))
        back = recovered(sub, completion, kill)
        _, lat = record_latencies(sub, res)
        replay = kill - (res[0]["resume"] - 1) * args.epoch_ms / 1000  # input since the checkpoint's cut
        rows.append([f"{keys:,}", str(res[0]["resume"]), f"{replay:.1f}", f"{stopped - kill:.2f}",
                     f"{forked - stopped:.2f}", f"{entry - forked:.2f}", f"{load:.2f}", f"{first - kill:.2f}",
                     f"{back - kill:.2f}", f"{np.nanmax(lat):.2f}", count_check(sub, res), f"{time.time() - t0:.0f}"])
        if keys >= 10_000_000:
            verdicts.append(f"recovery of {keys:,} keys in {back - kill:.1f} s (target < 10 s): "
                            f"{'MET' if back - kill < 10 else 'NOT met'}")
    print(f"\n3. recovery after SIGKILL of worker 1 at {args.kill_at:g} s (seconds: the survivors SIGTERMed, new "
          f"processes forked, their job entered, the dataflow built (state loaded), each after the previous step; "
          f"first epoch out and recovered after the kill, recovered = every later epoch done within "
          f"{args.recovered_ms} ms of its end)\n"
          + align([["keys", "resume epoch", "replayed s", "survivors stopped", "new processes", "job entry", "state load",
                    "first epoch out", "recovered", "max lat s", "counts", "wall s"], *rows]))
    for v in verdicts:
        print(v)
    return verdicts


def rescale(args: argparse.Namespace, scratch: Path) -> None:
    """Part 4: stop and resume on one worker from the checkpoint, against a live migration."""
    E = args.epoch_ms / 1000
    folder = scratch / "rescale-checkpoint"
    first = run_job(args, folder, args.workers, True, stop_at=args.stop_at)
    ended = time.time() - first[0]["start"]  # the first run's processes have exited
    second = run_job(args, folder, 1, True)
    r = second[0]
    stop = first[0]["stopped_at"] * E  # the scheduled start of the first epoch the second run feeds
    back = recovered(args, merged_completion(second), stop)
    sched, lat = record_latencies(args, second)
    print(f"\n4. through a checkpoint: {args.workers} workers stop at {stop:.1f} s (checkpoint of epoch {r['resume']}), "
          f"exited {ended - stop:.2f} s later; 1 worker forked {r['forked'] - ended:.2f} s after that, job entered "
          f"{r['entered'] - r['forked']:.2f} s, state of every bin loaded in {r['built'] - r['entered']:.2f} s, "
          f"recovered {back - stop:.2f} s after the stop")
    ck_row = [f"through a checkpoint ({args.workers} -> 1 workers)", f"{back - stop:.2f}",
              f"{np.nanmax(lat[sched >= stop]) * 1e3:,.0f}", count_check(args, second)]
    live = run_job(args, scratch / "rescale-live", args.workers, False, migrate_at=stop)
    steps = live[0]["steps"]
    began, done = steps[0][0], steps[-1][1]
    sched, lat = record_latencies(args, live)
    duration = f"{done - began:.2f}" if done is not None else "unfinished"
    live_row = [f"live migration ({args.strategy}, {len(steps)} steps, {args.workers} workers)", duration,
                f"{np.nanmax(lat[sched >= began - E]) * 1e3:,.0f}", count_check(args, live)]
    print(f"moving worker 1's bins to worker 0 at {stop:.1f} s (duration: stop to recovered, or first step "
          f"issued to last step done; latency of records scheduled from then on)\n"
          + align([["", "duration s", "max lat ms", "counts"], ck_row, live_row]))


# -- driver -----------------------------------------------------------------------------------------

def fmt_list(xs: list[float], scale: float = 1.0, spec: str = ".2f") -> str:
    """Per-worker figures joined by ``/``."""
    return "/".join(format(x * scale, spec) for x in xs)


def fmt_med(runs: list[dict], key: str, w: int, scale: float = 1.0) -> str:
    """The median over runs of worker ``w``'s ``key``."""
    return f"{statistics.median(m[key][w] for m in runs) * scale:.3f}"


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    ap.add_argument("--quick", action="store_true", help="about 40 s: 200k keys, 4 s runs, 1 run, recovery of 200k keys")
    ap.add_argument("--keys", type=int, default=1_000_000, help="pre-loaded keys (default 1M; the issue's 4M fits "
                    "in memory but makes a full run longer)")
    ap.add_argument("--rate", type=int, default=50_000, help="records/s, all workers (default 50000)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of input per run (default 10)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds cut before the steady state (default 2)")
    ap.add_argument("--capacity-rate", type=int, default=1_000_000, help="capacity: records/s offered (default 1M)")
    ap.add_argument("--capacity-s", type=float, default=3.0, help="capacity: seconds of input (default 3)")
    ap.add_argument("--epoch-ms", type=int, default=100, help="epoch length (default 100 ms)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N epochs (default 10: 1 s)")
    ap.add_argument("--k", type=int, default=10, help="2^k bins (default 10)")
    ap.add_argument("--hot", type=int, default=64, help="keys of the incremental run (default 64)")
    ap.add_argument("--recovery-keys", default="1000000,10000000",
                    help="comma-separated state sizes (default 1000000,10000000)")
    ap.add_argument("--kill-at", type=float, default=4.0, help="seconds into the schedule (default 4); a recovery "
                    "run lasts at least 10 s more")
    ap.add_argument("--recovered-ms", type=int, default=500, help="epoch lag counted as recovered (default 500)")
    ap.add_argument("--stop-at", type=float, default=4.0, help="rescale: seconds into the schedule (default 4)")
    ap.add_argument("--strategy", default="all_at_once", help="the live migration's strategy (default "
                    "all_at_once: batched and fluid take a step per epoch, 512 epochs of 100 ms)")
    ap.add_argument("--runs", type=int, default=3, help="steady-state runs per mode; medians (default 3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts; print the figures and the verdicts."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.keys, args.duration, args.runs, args.warmup, args.kill_at, args.stop_at = 200_000, 4.0, 1, 1.0, 2.5, 2.0
        args.capacity_s = 2.0
        args.recovery_keys = "200000"
    args.recovery_keys = [int(x) for x in str(args.recovery_keys).split(",") if x.strip()]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if any(p not in PARTS for p in parts):
        ap.error(f"--parts: one of {', '.join(PARTS)}")
    if args.workers < 2 and {"recovery", "rescale"} & set(parts):
        ap.error("recovery and rescale kill or move worker 1: --workers must be at least 2")
    if "rescale" in parts and not 0 < args.stop_at < args.duration - args.every * args.epoch_ms / 1000:
        ap.error("--stop-at: the stop (at the next checkpoint epoch) must leave time to run after it")
    args._full = None
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; load average at start {os.getloadavg()[0]:.2f}; {args.workers} workers; "
          f"{args.keys:,} keys pre-loaded; 2^{args.k} bins; {args.rate:,} rec/s for {args.duration:g} s; "
          f"{args.epoch_ms} ms epochs; checkpoint every {args.every} epochs", flush=True)
    began = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="ckbench-"))
    try:
        verdicts = []
        if "steady" in parts:
            verdicts += steady(args, scratch)
        if "capacity" in parts:
            verdicts += capacity(args, scratch)
        if "bytes" in parts:
            incremental(args, scratch)
        if "recovery" in parts:
            verdicts += recovery(args, scratch)
        if "rescale" in parts:
            rescale(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}; total {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
