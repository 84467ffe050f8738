"""NEXMark Q0-Q8 at a fixed open-loop rate, native and with Megaphone, with optional migrations.

For each query and variant: run for ``--duration`` seconds at ``--rate`` events/s (all workers
together) on ``--workers`` workers; report throughput, latency percentiles (latency = wall time when
the output probe passes a record's epoch minus the record's scheduled time), a per-250 ms timeline
(CSV + PNG), migration maximum latency and duration, and peak memory; a summary table at the end.
A run "sustains" its rate when the output is complete within 1 s of the end of the schedule and
p99 latency stays under 1 s. "per CPU-s" is events per CPU-second used by all workers (a capacity
estimate that contention from other processes distorts less than wall-clock throughput). Every
worker of a run is a fresh interpreter (``timely.execute(..., start="spawn")``), so that its peak
memory and collector state are that run's alone.

    .venv/bin/python bench/nexmark_bench.py --query q1,q3 --variant both --rate 100000 --duration 20
    .venv/bin/python bench/nexmark_bench.py --query q3 --variant megaphone --workers 2 --rate 50000 \\
        --duration 30 --migration batched --migrate-at 15
    .venv/bin/python bench/nexmark_bench.py --check        # every query and variant vs the reference

Event time runs ``--time-dilation`` times faster than wall time (the paper uses 60 for Q5 and 79
for Q8). Windows are in event time: ``--param q5_window_ms=60000`` etc. (see nexmark.model.Params).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import megaphone
from nexmark.driver import Spec, run
from nexmark.harness import CHECK_CONFIG, CHECK_PARAMS, Run, diff, execute, expected, random_moves
from nexmark.keyed import CONTROL_LEAD
from nexmark.model import Params
from nexmark.queries import QUERIES
from nexmark.report import Summary, fmt_s, median_table, plot, summarise, table, timeline_text, write_csv
from timely import collector


def parse_params(items: list[str]) -> dict:
    """``name=value`` overrides of :class:`nexmark.model.Params` (integers; ``q3_states`` a
    comma-separated list of states)."""
    out: dict = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in Params._fields or name == "d":
            raise SystemExit(f"unknown query parameter {name!r} (one of {', '.join(Params._fields[1:])})")
        if name == "q3_states":
            out[name] = tuple(s.strip() for s in value.split(",") if s.strip())
            continue
        try:
            out[name] = int(value)
        except ValueError:
            raise SystemExit(f"query parameter {name} needs an integer, not {value!r}") from None
    return out


def check(queries: list[str], variants: list[bool], workers: list[int], events: int, seed: int,
          fuzz: bool = True) -> bool:
    """Every query's output on a small seed against the reference, for each parameter set of
    :data:`nexmark.harness.CHECK_PARAMS` (windows of several epochs, of one epoch, of less than
    one) on each worker count; the Megaphone variants with random moves. The wide windows get each
    event at its own epoch, the small ones runs of epochs stamped early by each worker on its own
    (lagging drivers). With ``fuzz`` every run is under the engine's schedule fuzzer (batches
    split, reordered and delayed; operators run with nothing to do)."""
    config = replace(CHECK_CONFIG, seed=seed)
    ok = True
    for q in queries:
        for name, params in CHECK_PARAMS.items():
            batching = None if name == "wide" else seed
            for w in workers:
                want = expected(Run(q, config, events, params, workers=w, batching=batching))
                for flex in variants:
                    r = Run(q, config, events, params, workers=w, flex=flex, batching=batching,
                            fuzz=seed * 10 + w if fuzz else None, timeout=None if w == 1 else 120)
                    if flex:
                        r.moves = random_moves(seed + w, r.epochs, r.k, w, count=6)
                    started = time.perf_counter()
                    try:
                        problem = diff(execute(r), want)
                    except Exception as e:  # a failed run is a failed check; the others still run
                        problem = f"{type(e).__name__}: {e}"
                    ok = ok and not problem
                    print(f"check {q:3} {name:9} {'megaphone' if flex else 'native':9} workers={w}: "
                          f"{'OK' if not problem else 'FAIL'} ({sum(want.values())} records, "
                          f"{time.perf_counter() - started:.2f} s)" + (f"\n{problem}" if problem else ""),
                          flush=True)
    return ok


def bench_one(args: argparse.Namespace, q: str, flex: bool, rate: int, params: dict, out_dir: Path,
              migration: str | None = None, run_no: int = 0) -> Summary:
    """Run one query variant at one rate (with ``migration``, the Megaphone variant only); print
    its figures; write its CSV, JSON and PNG."""
    spec = Spec(query=q, flex=flex, rate=rate, duration=args.duration, workers=args.workers,
                time_dilation=args.time_dilation, seed=args.seed, k=args.k,
                migration=migration if flex else None, migrate_at=args.migrate_at if flex else [],
                params=params, in_flight_auctions=args.in_flight_auctions, progress=not args.no_progress, gc=args.gc,
                history=args.history, skew=args.skew, control_lead=args.control_lead,
                # a fresh directory per run: a run never resumes another's checkpoint
                checkpoint=tempfile.mkdtemp(prefix="run-", dir=args.checkpoint) if args.checkpoint else None,
                checkpoint_every=args.checkpoint_every)
    label = (f"{q}-{'megaphone' if flex else 'native'}" + (f"-{migration}" if spec.migration else "")
             + ("-checkpoints" if spec.checkpoint else ""))
    runs = f" (run {run_no + 1} of {args.runs})" if args.runs > 1 else ""
    print(f"\n== {label}{runs}: {rate:,} events/s for {args.duration:g} s on {args.workers} worker(s)"
          + (f" after {args.history:g} s of history" if args.history else ""), flush=True)
    s = summarise(label, spec, run(spec, start="spawn" if args.isolate else "fork", timeout=args.timeout))
    o = s.overall
    print(f"sent {s.sent:,} events, {s.produced:,} output records; throughput {s.throughput:,.0f} events/s "
          f"({s.throughput / s.workers:,.0f} per worker); {s.per_cpu_second:,.0f} events per CPU-second; "
          f"drain {fmt_s(s.drain)}; {'sustained' if s.sustained else 'NOT sustained'}")
    print(f"latency p25 {fmt_s(o[0])}  p50 {fmt_s(o[1])}  p75 {fmt_s(o[2])}  p95 {fmt_s(o[3])}  "
          f"p99 {fmt_s(o[4])}  p99.9 {fmt_s(o[5])}  max {fmt_s(o[6])}")
    print(f"peak RSS per worker: {', '.join(f'{x / 2**20:,.0f} MiB' for x in s.peak_rss)}")
    longest = max(s.gc_long, key=lambda x: x[3], default=None)
    print(f"garbage collections (gen 0/1/2, all workers): {'/'.join(map(str, s.gc_counts))}; "
          f"{len(s.gc_long)} over 2 ms" + (f", longest {fmt_s(longest[3])} (gen {longest[2]}, worker {longest[0]}, "
                                          f"at {longest[1]:.2f} s)" if longest else ""))
    for mid, m in s.migration.items():
        print(f"migration {mid}: {m['bins']} bins in {m['steps']} steps from {m['start']:.2f} s, "
              f"duration {fmt_s(m['duration'])}, longest step {fmt_s(m['max_step'])}, "
              f"max latency {fmt_s(m['max_latency'])}, worst 250 ms p99 {fmt_s(m['p99_latency'])}")
    if args.timeline:
        print(timeline_text(s))
    stem = out_dir / (f"{label}-w{args.workers}-r{rate}" + (f"-run{run_no + 1}" if args.runs > 1 else ""))
    write_csv(s, f"{stem}.csv")
    with open(f"{stem}.json", "w") as f:
        json.dump({"command": shlex.join([sys.executable, *sys.argv]), "spec": spec.as_dict(),
                   "summary": dict(s.__dict__)}, f, default=str)
    if not args.no_plot:
        plot(s, f"{stem}.png", f"{label}: {rate:,} ev/s, {args.workers} worker(s), d={args.time_dilation}")
        print(f"plot: {stem}.png")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--query", default=None,
                    help="comma-separated queries (q0..q8) or 'all' (default q1; with --check all)")
    ap.add_argument("--variant", choices=("native", "megaphone", "both"), default=None,
                    help="default native; with --check both")
    ap.add_argument("--rate", default="100000",
                    help="events per second, all workers (default 100000); a comma-separated list runs each rate in "
                         "turn, up to the first one a query does not sustain")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of input (default 10)")
    ap.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--time-dilation", type=int, default=1, help="event time / wall time (default 1)")
    ap.add_argument("--k", type=int, default=8, help="2^k Megaphone bins (default 8)")
    ap.add_argument("--migration", default=None,
                    help="migration strategy: all_at_once, fluid or batched (each also with +precopy: copied ahead; "
                         "or +replica: standby replicas on the targets, requested in the history's last round), "
                         "or a comma-separated list run in turn (Megaphone variant; needs --migrate-at)")
    ap.add_argument("--runs", type=int, default=1,
                    help="runs of each configuration; with more than one, a table of medians follows (default 1)")
    ap.add_argument("--migrate-at", type=float, action="append", default=[],
                    help="seconds after the start at which to migrate (repeatable: skewed, then balanced, ...)")
    ap.add_argument("--history", type=float, default=0.0,
                    help="seconds of the schedule replayed as fast as possible before the measured phase, so that "
                         "the query holds that much state when measuring starts (default 0)")
    ap.add_argument("--skew", type=float, default=0.5,
                    help="migrations: the fraction of its bins each odd worker gives to an even one "
                         "(default 0.5: a quarter of all bins, the paper's uniform -> uniform_skew)")
    ap.add_argument("--control-lead", type=int, default=CONTROL_LEAD, metavar="EPOCHS",
                    help=f"epochs the control input runs ahead of the inputs (default {CONTROL_LEAD}; 0: in lockstep)")
    ap.add_argument("--in-flight-auctions", type=int, default=100,
                    help="auctions open at any time (default 100, as Beam's NEXMark); the state of Q4 and Q6")
    ap.add_argument("--checkpoint", metavar="DIR", default=None,
                    help="take checkpoints (Megaphone's bins) under DIR, a fresh directory per run")
    ap.add_argument("--checkpoint-every", type=int, default=1000, metavar="N",
                    help="epochs (of 1 ms) between checkpoints (default 1000: every second)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param", action="append", default=[], help="query parameter override, e.g. q8_window_ms=60000")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "nexmark"),
                    help="directory for PNG/CSV/JSON per run (default bench/out/nexmark, git-ignored)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--timeline", action="store_true", help="print the per-250 ms timeline (p50, p99, max, samples)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--gc", choices=collector.POLICIES, default="tuned",
                    help="worker garbage collector in the measured phase (timely.collector; default tuned: freeze + "
                         "rare collections; paced: freeze + a young collection every 50 ms, survivors frozen)")
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="fork the workers from this process instead of starting each as a fresh interpreter "
                         "(their peak RSS then includes what they inherit from this process)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds a run may take before its workers are stopped (default 3600)")
    ap.add_argument("--check", action="store_true",
                    help="verify the queries against the reference (several window sizes and worker counts, under "
                         "the schedule fuzzer) and exit")
    ap.add_argument("--check-events", type=int, default=6000)
    ap.add_argument("--check-workers", default="1,2,3", help="comma-separated worker counts for --check (default 1,2,3)")
    ap.add_argument("--check-no-fuzz", dest="check_fuzz", action="store_false",
                    help="run --check on the engine's ordinary schedule instead of the schedule fuzzer")
    args = ap.parse_args(argv)
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"os.cpu_count(): {os.cpu_count()}  python: {sys.version.split()[0]}", flush=True)
    query = args.query or ("all" if args.check else "q1")
    queries = sorted(QUERIES) if query == "all" else query.split(",")
    for q in queries:
        if q not in QUERIES:
            raise SystemExit(f"unknown query {q!r} (one of {', '.join(sorted(QUERIES))} or 'all')")
    variant = args.variant or ("both" if args.check else "native")
    variants = {"native": [False], "megaphone": [True], "both": [False, True]}[variant]

    if args.check:
        ok = check(queries, variants, [int(w) for w in args.check_workers.split(",")], args.check_events, args.seed,
                   args.check_fuzz)
        print("check:", "all OK" if ok else "FAILED")
        return 0 if ok else 1

    strategies: list[str | None] = args.migration.split(",") if args.migration else [None]
    known = (*megaphone.STRATEGIES, *(f"{s}+{x}" for x in ("precopy", "replica") for s in megaphone.STRATEGIES))
    for m in strategies:
        if m is not None and m not in known:
            raise SystemExit(f"--migration: unknown strategy {m!r} ({', '.join(known)})")
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    if args.migration and not args.migrate_at:
        raise SystemExit("--migration needs --migrate-at SECONDS")
    if args.migration and args.workers == 1:
        print("warning: with 1 worker every bin stays on worker 0: the migration moves nothing", flush=True)
    if args.migration and variant == "native":
        print("warning: --migration applies to the Megaphone variant only (--variant megaphone|both)", flush=True)
    params = parse_params(args.param)
    rates = [int(float(r)) for r in args.rate.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries: list[Summary] = []
    groups: list[list[Summary]] = []
    for q in queries:
        for flex in variants:
            active = list(strategies if flex else [None])  # the strategies still swept to higher rates
            for rate in rates:
                if not active:
                    break
                by_strategy: dict[str | None, list[Summary]] = {m: [] for m in active}
                for i in range(args.runs):
                    for m in active:  # alternating: a drift of the machine's load falls on every strategy
                        by_strategy[m].append(bench_one(args, q, flex, rate, params, out_dir, m, i))
                for group in by_strategy.values():
                    summaries += group
                    groups.append(group)
                # A strategy most of whose runs fell behind is not run at higher rates.
                active = [m for m in active if 2 * sum(s.sustained for s in by_strategy[m]) > len(by_strategy[m])]
    print("\n" + table(summaries))
    print("(p50 .. max: records scheduled after a warm-up and before a cool-down of 2 s each, a quarter of "
          "the run at most; migr. max: see nexmark.report.migration_metrics)")
    if args.runs > 1:
        print(f"\nmedians over {args.runs} runs:\n" + median_table(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
