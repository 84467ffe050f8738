"""Live migration of a keyed count: Megaphone's strategies against stop-and-restart (issue 4).

The paper's migration microbenchmark (Megaphone, section 5.3; ARCHITECTURE.md section 9) on worker processes:

* a keyed count (``megaphone.state_machine`` summing per key) over ``--keys`` keys, all pre-loaded
  (one record per key at time 0) before the measured phase;
* an open-loop generator at ``--rate`` records/s in total (``nexmark.openloop``): each worker
  feeds its share, records' scheduled times are fixed in advance from the rate, the logical time
  of a record is the elapsed millisecond at which its ``--epoch-ms`` epoch starts, and the control
  input runs ``--control-lead`` epochs ahead of the data (default 1; 0: in lockstep);
* latency of a record = wall time at which the output probe passes its epoch minus its scheduled
  time (queueing included: no coordinated omission), computed with numpy from per-epoch
  completion times;
* every worker of a run a fresh interpreter (``timely.execute(..., start="spawn")``), the
  collector under ``--gc`` after the pre-load (``timely.collector``);
* at ``--migrate-at`` seconds, half of the bins move (each worker gives the first half of its bins to
  the next worker), once per strategy (``all_at_once``, ``fluid``, ``batched``), issued step by step
  by a ``megaphone.Controller`` on worker 0 (a step goes out once the probe shows the previous one
  applied and the backlog behind it drained);
* ``restart``: the stop-and-restart baseline on a plain (non-migratable) operator: timely's plain
  ``Exchange`` by key into a keyed count that applies complete times in order, as the state machine
  does (and as ``count_by_key`` does). At the migration time the input
  pauses (records keep being scheduled), the dataflow drains, every worker serialises *all* its
  state (pickled chunks, as Megaphone ships bins), a second dataflow built at that moment by every
  worker exchanges it to the owners of the new configuration (the bin table Megaphone migrates
  to, so about half of the entries change worker), the state is rebuilt, a new dataflow routing by
  that table (a static ``Distribute`` through the same Cython bin routing) is built and the input
  resumes with the backlog. Its steady state before the pause is the
  "plain exchange, no migration" reference of the targets.

The migration window, in scheduled time, is ``[begin, end)``: ``begin`` is the start of the epoch
at which the first step was issued, or its copy ahead requested where the strategy copies ahead
(restart: the first epoch held back by the pause), ``done`` the
wall time at which the controller saw the probe pass the last step (restart: the new dataflow was
built and the input resumed), and ``end`` the wall time at which the probe passed the epoch that was
being fed at ``done`` (so the backlog present at ``done`` has drained). "duration" is ``done`` minus
the wall time of the first step's issue or copy request (restart: of the pause); max and p99 latency are over every
record scheduled in the window. Steady state = records scheduled in ``[--warmup, begin)``.

    .venv/bin/python bench/migration.py                       # defaults: all strategies, 3 runs
    .venv/bin/python bench/migration.py --strategies batched,restart --runs 1 --duration 8

Writes ``<out>/migration.png`` (per-250 ms p50/p99/max timelines, one panel per strategy, from the
median run) and ``<out>/migration.json`` (every run's figures and timelines).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from nexmark.keyed import CONTROL_LEAD, DEFAULT_MODES, MODES, epoch_of, execute
from nexmark.metrics import Timeline, peak_between, percentiles
from nexmark.openloop import Schedule, latencies
from nexmark.report import align, median, plot_timelines
from timely import collector

# -- analysis --------------------------------------------------------------------------------------

#: Window lengths (seconds) of a no-migration run's null maxima (``null_max``).
NULL_STEP = 0.25


def analyse(cfg: dict, results: list[dict]) -> dict:
    """Figures of one run from its workers' results."""
    peers = len(results)
    E = cfg["epoch_ms"] / 1000
    per_worker = [latencies(Schedule(cfg["rate"], cfg["epoch_ms"], r["index"], peers), np.asarray(r["completion"]))
                  for r in results]
    sched = np.concatenate([s for s, _ in per_worker])
    lat = np.concatenate([x for _, x in per_worker])
    comp_all = np.nanmax(np.vstack([np.asarray(r["completion"]) for r in results]), axis=0)
    w0 = results[0]
    out: dict = {"mode": cfg["mode"], "records": int(len(sched)),
                 "preload_s": max(r["preload_s"] for r in results)}
    if cfg["mode"] == "restart":
        issue, done = min(r["info"]["pause"] for r in results), max(r["info"]["resume"] for r in results)
        first = int(round(issue / E))  # the first epoch held back
        out["steps"], out["bins_moved"] = 1, (1 << cfg["k"]) // 2
        out["bytes"] = sum(r["info"]["transfer"]["bytes"] for r in results)
        out["transfer"] = [r["info"]["transfer"] for r in results]
        out["drain_s"] = max(r["info"]["drained"] for r in results) - issue
        out["complete"] = True
    elif cfg["mode"] == "none":
        issue = done = cfg["migrate_at"]
        first = int(math.ceil(issue / E))
        out.update(steps=0, bins_moved=0, bytes=0, complete=True)
    else:
        steps = w0["steps"]
        copied = steps[0].get("copy") is not None  # the first step copied its bins ahead: it began then
        issue = steps[0]["copy"] if copied else steps[0]["issued"]
        # The epoch being sent when it went out: the control input runs `control_lead` epochs ahead.
        went_out = steps[0]["copy_time"] if copied else steps[0]["time"]
        first = epoch_of(went_out, cfg["epoch_ms"]) - cfg.get("control_lead", CONTROL_LEAD)
        out["complete"] = bool(w0["all_steps_done"]) and steps[-1]["completed"] is not None
        done = steps[-1]["completed"] if out["complete"] else w0["end"]
        out["steps"], out["bins_moved"] = len(steps), sum(s["bins"] for s in steps)
        ev = [e for r in results for e in r["events"]]
        out["bytes"] = sum(e["bytes"] for e in ev if e["kind"] == "extract")  # at the hand-overs
        out["ahead_bytes"] = sum(e.get("bytes", 0) for e in ev if e["kind"] == "precopy" and not e.get("replica"))
        # Standby replicas: their copies (before the measured phase) and refreshes up to the migration.
        out["replica_bytes"] = sum(e.get("bytes", 0) for e in ev if e["kind"] == "precopy" and e.get("replica"))
        out["refresh_bytes"] = sum(r["info"].get("replicas", {}).get("bytes", 0) for r in results)
        out["refreshes"] = sum(r["info"].get("replicas", {}).get("refreshes", 0) for r in results)
        out["fallbacks"] = sum(e["kind"] == "fallback" for e in ev)
        out["handover_s_max"] = max((e["seconds"] for e in ev if e["kind"] in ("extract", "install")), default=0.0)
        durations = [s["duration"] for s in steps if s["duration"] is not None] or [float("nan")]
        out["steps_completed"] = sum(s["completed"] is not None for s in steps)
        out["longest_step_s"] = max(durations)
        out["median_step_s"] = statistics.median(durations)
        out["extract_s_max"] = max((e["seconds"] for e in ev if e["kind"] == "extract"), default=0.0)
        out["install_s_max"] = max((e["seconds"] for e in ev if e["kind"] == "install"), default=0.0)
        out["install_s_sum"] = sum(e["seconds"] for e in ev if e["kind"] == "install")
    e_done = min(int(done / E), len(comp_all) - 1)
    end = float(comp_all[e_done]) if np.isfinite(comp_all[e_done]) else float(np.nanmax(comp_all))
    if cfg["mode"] == "none":
        end = issue  # no migration: an empty window
    # Records of the epoch at which the first step goes out are held by it even if they were
    # scheduled a little before the issue: the window starts with that epoch.
    begin = first * E
    out.update(issue=issue, begin=begin, done=done, end=end, duration=done - issue, window=end - begin)
    win = (sched >= begin) & (sched < end)
    steady = (sched >= cfg["warmup"]) & (sched < begin)
    ws, ss, after = percentiles(lat[win]), percentiles(lat[steady]), percentiles(lat[sched >= end])
    # The longest collector pause of any worker that began in the migration window (and when).
    pauses = [(s, t) for r in results for t, _gen, s in r.get("gc", {}).get("long", []) if begin <= t < end]
    out["gc_max_s"], out["gc_max_at"] = max(pauses, default=(0.0, None))
    out.update(mig_max=ws["max"], mig_p99=ws["p99"], mig_p50=ws["p50"], steady_p50=ss["p50"], steady_p99=ss["p99"],
               steady_p999=ss["p99.9"], steady_max=ss["max"], after_p99=after["p99"], after_max=after["max"],
               overall_max=float(np.nanmax(lat)))
    if cfg["mode"] == "none":
        # The null reference of the pre-copy target: the maximum over windows of every length (in
        # steps of NULL_STEP s) from the migration time, with nothing migrating.
        out["null_max"] = {int(w * 1000): percentiles(lat[(sched >= begin) & (sched < begin + w)])["max"]
                           for w in np.arange(NULL_STEP, cfg["duration"] - begin + 1e-9, NULL_STEP)}
    last = float(np.nanmax(comp_all))
    out["throughput"] = len(sched) / last
    out["offered"] = cfg["rate"]
    out["finish_lag_s"] = last - cfg["duration"]
    # CPU use of each worker process (its cores' share) before the migration and over the run.
    out["cpu_steady"] = [(r["cpu"]["migrate"] - r["cpu"]["start"]) / cfg["migrate_at"] for r in results]
    out["cpu_total"] = [(r["cpu"]["end"] - r["cpu"]["start"]) / r["end"] for r in results]
    # Time the worker was runnable but other processes had the CPU, per second of wall time.
    out["runq_steady"] = [(r["cpu"]["wait_migrate"] - r["cpu"]["wait_start"]) / cfg["migrate_at"] for r in results]
    out["runq_after"] = [(r["cpu"]["wait_end"] - r["cpu"]["wait_migrate"]) / (r["end"] - cfg["migrate_at"])
                         for r in results]
    out["peak_rss"] = [max(b for _, b in r["rss"]) for r in results]
    out["max_rss"] = [r["max_rss"] for r in results]
    out["rss_before"] = [peak_between(r["rss"], issue - 0.5, issue) for r in results]
    out["rss_window_peak"] = [peak_between(r["rss"], issue, end + 0.1) for r in results]
    expected_total = cfg["keys"] + len(sched)
    got_total = sum(r["total"] for r in results)
    out["count_ok"] = got_total == expected_total and sum(r["distinct"] for r in results) == cfg["keys"]
    if not out["count_ok"]:
        out["count_error"] = f"sum of counts {got_total} (expected {expected_total}), distinct " \
                             f"{sum(r['distinct'] for r in results)} (expected {cfg['keys']})"
    tl = Timeline(cfg["duration"])
    tl.record(sched, lat)
    out["timeline"] = tl.rows()
    return out


# -- driver ----------------------------------------------------------------------------------------

def fmt_ms(x: float | None) -> str:
    """Seconds as milliseconds (no unit; ``-`` for none)."""
    if x is None or not math.isfinite(x):
        return "-"
    ms = x * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


COLUMNS = [  # (header, key, formatter)
    ("max lat ms", "mig_max", fmt_ms), ("p99 lat ms", "mig_p99", fmt_ms),
    ("duration s", "duration", lambda x: f"{x:.2f}"), ("window s", "window", lambda x: f"{x:.2f}"),
    ("steady p99 ms", "steady_p99", fmt_ms), ("steady p99.9 ms", "steady_p999", fmt_ms),
    ("steady max ms", "steady_max", fmt_ms),
    ("tput rec/s", "throughput", lambda x: f"{x:,.0f}"),
    ("peak RSS MiB", "peak_rss_max", lambda x: f"{x / 2**20:,.0f}"),
    ("RSS +MiB", "rss_delta", lambda x: f"{x / 2**20:+,.0f}"),
    ("runq wait", "runq", lambda x: f"{x:.0%}"),
]


def row_values(m: dict) -> dict:
    """A run's figures with the table's per-run maxima over workers added."""
    m = dict(m)
    m["peak_rss_max"] = max(m["peak_rss"])
    m["rss_delta"] = max(p - b for p, b in zip(m["rss_window_peak"], m["rss_before"]))
    m["runq"] = max(m["runq_steady"] + m["runq_after"])
    return m


def run_line(run: int, mode: str, m: dict) -> str:
    """One run's figures on a line."""
    step = f", median step {m['median_step_s'] * 1e3:.1f} ms" if "median_step_s" in m else ""
    counts = "OK" if m["count_ok"] else "WRONG: " + m["count_error"]
    unfinished = "" if m["complete"] else f"; MIGRATION DID NOT FINISH ({m.get('steps_completed')} steps done)"
    if m.get("ahead_bytes"):
        step += f", {m['ahead_bytes'] / 2**20:,.1f} MiB copied ahead"
    if m.get("replica_bytes"):
        step += (f", replicas: {m['replica_bytes'] / 2**20:,.1f} MiB copied before, {m['refresh_bytes'] / 2**20:,.1f} MiB "
                 f"in {m['refreshes']} refreshes until the migration")
    return (f"run {run} {mode:<11}: max {fmt_ms(m['mig_max'])} ms, p99 {fmt_ms(m['mig_p99'])} ms in the migration "
            f"({m['steps']} steps, {m['bins_moved']} bins, {m['bytes'] / 2**20:,.1f} MiB, duration "
            f"{m['duration']:.2f} s, window {m['window']:.2f} s{step}); steady p99 {fmt_ms(m['steady_p99'])} ms; "
            f"{m['throughput']:,.0f} rec/s; peak RSS {max(m['peak_rss']) / 2**20:,.0f} MiB; pre-load "
            f"{m['preload_s']:.1f} s; longest collector pause in the window {m.get('gc_max_s', 0.0) * 1e3:.1f} ms; "
            f"steady CPU {'/'.join(f'{c:.0%}' for c in m['cpu_steady'])}, run-queue wait "
            f"{'/'.join(f'{c:.0%}' for c in m['runq_steady'])}; counts {counts}{unfinished}; load {m['load']:.1f}; "
            f"{m['wall_s']:.0f} s")


def null_reference(mode: str, runs: dict[str, list[dict]]) -> str | None:
    """How often a run without migration (``none``) meets ``mode``'s target by itself: its maximum
    over a window as long as ``mode``'s median migration window, from the migration time, against
    its own steady p99.9. None without ``none`` runs."""
    if not runs.get("none") or not runs.get(mode):
        return None
    window = statistics.median(m["window"] for m in runs[mode])
    pairs = []
    for m in runs["none"]:
        lengths = sorted(m["null_max"])
        w = min(lengths, key=lambda x: abs(x - window * 1000))
        pairs.append((m["null_max"][w], m["steady_p999"]))
    within = sum(x <= p for x, p in pairs)
    return (f"{mode}: a run without migration over the same window ({window:.2f} s from the migration time) had a max "
            f"of {'/'.join(fmt_ms(x) for x, _ in pairs)} ms against its steady p99.9 "
            f"{'/'.join(fmt_ms(p) for _, p in pairs)} ms: within in {within} of {len(pairs)} (the noise floor of "
            f"the target); the migration's max {'/'.join(fmt_ms(m['mig_max']) for m in runs[mode])} ms")


def verdicts(medians: dict[str, dict], runs: dict[str, list[dict]] | None = None) -> list[str]:
    """The targets: batched's maximum latency against all-at-once's and the plain exchange's p99;
    pre-copy's and replicas' maximum against their steady p99.9 (with ``runs`` holding ``none``
    runs, against what a run without migration gives over the same window) and stop-and-restart's."""
    out = []
    if "batched" in medians and "all_at_once" in medians:
        r = medians["all_at_once"]["mig_max"] / medians["batched"]["mig_max"]
        out.append(f"batched max latency {fmt_ms(medians['batched']['mig_max'])} ms vs all-at-once "
                   f"{fmt_ms(medians['all_at_once']['mig_max'])} ms: {r:.1f}x lower (target >= 10x): "
                   f"{'MET' if r >= 10 else 'NOT met'}")
    if "batched" in medians and "restart" in medians:
        plain = medians["restart"]["steady_p99"]
        r = medians["batched"]["mig_max"] / plain
        out.append(f"batched max latency {fmt_ms(medians['batched']['mig_max'])} ms vs plain exchange steady "
                   f"p99 {fmt_ms(plain)} ms: {r:.2f}x (target <= 2x): {'MET' if r <= 2 else 'NOT met'}")
    for mode in (m for m in medians if m.endswith(("+precopy", "+replica"))):
        m = medians[mode]
        done = "" if m.get("complete", 1) else " (the migration did not finish within the run)"
        out.append(f"{mode} max latency {fmt_ms(m['mig_max'])} ms vs its steady p99.9 {fmt_ms(m['steady_p999'])} ms "
                   f"(target: within): {'MET' if m['mig_max'] <= m['steady_p999'] else 'NOT met'}{done}")
        null = null_reference(mode, runs or {})
        if null is not None:
            out.append(null)
        if "restart" in medians:
            r = medians["restart"]["mig_max"] / m["mig_max"]
            out.append(f"{mode} max latency {r:.0f}x below stop-and-restart's {fmt_ms(medians['restart']['mig_max'])} ms "
                       f"(target >= 100x): {'MET' if r >= 100 else 'NOT met'}{done}")
    return out


def plot(args: argparse.Namespace, modes: list[str], runs: dict[str, list[dict]], medians: dict[str, dict]) -> str:
    """One timeline panel per strategy, from its median run by maximum latency; the PNG's path."""
    panels = []
    plain = medians.get("restart", {}).get("steady_p99")
    for mode in modes:
        m = sorted(runs[mode], key=lambda m: m["mig_max"])[len(runs[mode]) // 2]
        panels.append({
            "label": f"{mode} (run {m['run']})", "timeline": m["timeline"],
            "spans": [(m["begin"], m["done"], "migration"), (m["done"], m["end"], "drain")],
            "hlines": [(plain, "plain steady p99")] if plain and math.isfinite(plain) else [],
            "note": f"max {fmt_ms(m['mig_max'])} ms, p99 {fmt_ms(m['mig_p99'])} ms, {m['steps']} steps, "
                    f"duration {m['duration']:.2f} s",
        })
    return plot_timelines(panels, str(Path(args.out) / "migration.png"),
                          title=f"keyed count, {args.keys:,} keys, 2^{args.k} bins, {args.rate:,} rec/s, "
                                f"{args.epoch_ms} ms epochs, {args.workers} workers: latency per 250 ms")


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--rate", type=int, default=100_000, help="records per second, all workers (default 100000)")
    ap.add_argument("--duration", type=float, default=16.0, help="seconds of input per run (default 16)")
    ap.add_argument("--migrate-at", type=float, default=5.0, help="seconds after the start (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds cut before the steady state (default 1)")
    ap.add_argument("--keys", type=int, default=4_000_000, help="distinct keys, all pre-loaded (default 4M)")
    ap.add_argument("--k", type=int, default=10, help="2^k bins (default 10)")
    ap.add_argument("--epoch-ms", type=int, default=5, help="epoch length in ms (default 5)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})")
    ap.add_argument("--runs", type=int, default=3, help="runs per strategy; medians reported (default 3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--control-lead", type=int, default=CONTROL_LEAD, metavar="EPOCHS",
                    help=f"epochs the control input runs ahead of the data (default {CONTROL_LEAD}; 0: in lockstep, a "
                         "hand-over then delays its own epoch by a round of messages)")
    ap.add_argument("--spare", type=int, default=0,
                    help="workers that hold no bin before the migration, which then moves half of every other "
                         "worker's bins onto them (the paper's scale-out, e.g. --workers 8 --spare 4: 4 -> 8; default 0: "
                         "half of the bins move between the workers)")
    ap.add_argument("--precopy-share", type=float, default=None,
                    help="the share of a worker's time the copies ahead may take (megaphone.precopy.SHARE, "
                         "default 0.05)")
    ap.add_argument("--precopy-chunk", type=int, default=None, metavar="ENTRIES",
                    help="entries per pre-copy chunk (default megaphone.precopy.CHUNK); a slice gives way "
                         "to a peer's message after the chunk it is sending")
    ap.add_argument("--precopy-arrears", type=float, default=None, metavar="SECONDS",
                    help="the most a late slice on an idle worker runs beyond its budget to catch up on its pace "
                         "(megaphone.precopy.MAX_ARREARS, default 0.001; 0: give way after min_slice as before)")
    ap.add_argument("--precopy-max-share", type=float, default=None,
                    help="the most of an idle worker's time the copies may take (megaphone.precopy.MAX_SHARE, "
                         "default 0.25; at most --precopy-share: a fixed share)")
    ap.add_argument("--gc", choices=collector.POLICIES, default="freeze",
                    help="the workers' collector after the pre-load (timely.collector; default freeze: gc.freeze() "
                         "and the workers' thresholds)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"),
                    help="output directory for migration.png/.json (default bench/out, git-ignored)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--profile", metavar="DIR", help="cProfile each worker's measured phase into DIR/*.prof")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds a run may take before its workers are stopped (default 3600)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run every strategy ``--runs`` times (interleaved); print and write the figures."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    modes = [m.strip() for m in args.strategies.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown strategy {m!r} (one of {', '.join(MODES)})")
    if not 0 < args.warmup < args.migrate_at < args.duration:
        ap.error("need 0 < --warmup < --migrate-at < --duration")
    if not 0 <= args.spare < args.workers:
        ap.error(f"--spare must be from 0 to {args.workers - 1} (--workers less one), not {args.spare}")
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command)
    print(f"os.cpu_count() = {os.cpu_count()}; load average at start {os.getloadavg()[0]:.2f}; "
          f"{args.workers} workers; {args.rate:,} rec/s for {args.duration:g} s; {args.keys:,} keys pre-loaded; "
          f"2^{args.k} bins; {args.epoch_ms} ms epochs; control {args.control_lead} epoch(s) ahead; gc {args.gc}; "
          + (f"scale-out {args.workers - args.spare} -> {args.workers} workers at " if args.spare
             else "migration of half the bins at ")
          + f"{args.migrate_at:g} s; {args.runs} run(s)", flush=True)

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    t_all = time.time()
    for run in range(args.runs):
        for mode in modes:  # interleaved, so that machine noise spreads over the strategies
            cfg = {"mode": mode, "rate": args.rate, "duration": args.duration, "migrate_at": args.migrate_at,
                   "warmup": args.warmup, "keys": args.keys, "k": args.k, "epoch_ms": args.epoch_ms,
                   "gc": args.gc, "seed": args.seed + run, "spare": args.spare, "control_lead": args.control_lead,
                   "precopy_share": args.precopy_share, "precopy_max_share": args.precopy_max_share,
                   "precopy_chunk": args.precopy_chunk, "precopy_arrears": args.precopy_arrears,
                   "profile": os.path.abspath(args.profile) if args.profile else None}
            t0 = time.time()
            m = analyse(cfg, execute(cfg, args.workers, start="spawn", timeout=args.timeout))
            m["run"], m["wall_s"], m["load"] = run, time.time() - t0, os.getloadavg()[0]
            runs[mode].append(m)
            print(run_line(run, mode, m), flush=True)

    medians = {}
    for mode in modes:
        rows = [row_values(m) for m in runs[mode]]
        medians[mode] = {k: median([r[k] for r in rows]) for k in ("steady_p50", *(k for _, k, _ in COLUMNS))}
        medians[mode]["complete"] = all(r.get("complete", True) for r in runs[mode])
        medians[mode]["steps"] = rows[0]["steps"]
    print(f"\nMedian over {args.runs} run(s) (latency during the migration window; steady = "
          f"[{args.warmup:g} s, window start))")
    print(align([["strategy", "steps", *(h for h, _, _ in COLUMNS)]]
                + [[mode, str(m["steps"]), *(f(m[k]) for _, k, f in COLUMNS)] for mode, m in medians.items()]))
    if "restart" in medians:
        m = medians["restart"]
        print(f"plain exchange, no migration (restart runs before the pause): steady p50 {fmt_ms(m['steady_p50'])} ms, "
              f"p99 {fmt_ms(m['steady_p99'])} ms, max {fmt_ms(m['steady_max'])} ms")
    print("runq wait = share of wall time a worker was runnable but waiting for a CPU taken by other processes "
          "(/proc schedstat; max over workers and phases)")
    verdict = verdicts(medians, runs)
    for v in verdict:
        print(v)
    print(f"load average at end {os.getloadavg()[0]:.2f}; total {time.time() - t_all:.0f} s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "migration.json", "w") as f:
        json.dump({"command": command, "cpu_count": os.cpu_count(), "args": vars(args), "migrate_at": args.migrate_at,
                   "medians": medians, "verdict": verdict, "runs": runs}, f, default=float)
    if not args.no_plot:
        print(f"plot: {plot(args, modes, runs, medians)}")
    print(f"json: {out / 'migration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
