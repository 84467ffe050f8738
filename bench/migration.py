"""Live migration of a keyed count: Megaphone's strategies against stop-and-restart (issue 4).

The paper's migration microbenchmark (Megaphone, section 5.3; DESIGN.md section 7) on worker processes:

* a keyed count (``megaphone.state_machine`` summing per key) over ``--keys`` keys, all pre-loaded
  (one record per key at time 0) before the measured phase;
* an open-loop generator at ``--rate`` records/s in total: each worker feeds its share, records'
  scheduled times are fixed in advance from the rate, the logical time of a record is the elapsed
  millisecond at which its ``--epoch-ms`` epoch starts, and the control input advances in lockstep
  with the data;
* latency of a record = wall time at which the output probe passes its epoch minus its scheduled
  time (queueing included: no coordinated omission), computed with numpy from per-epoch
  completion times;
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
at which the first step was issued (restart: the first epoch held back by the pause), ``done`` the
wall time at which the controller saw the probe pass the last step (restart: the new dataflow was
built and the input resumed), and ``end`` the wall time at which the probe passed the epoch that was
being fed at ``done`` (so the backlog present at ``done`` has drained). "duration" is ``done`` minus
the wall time of the first step's issue (restart: of the pause); max and p99 latency are over every
record scheduled in the window. Steady state = records scheduled in ``[--warmup, begin)``.

    .venv/bin/python bench/migration.py                       # defaults: all strategies, 3 runs
    .venv/bin/python bench/migration.py --strategies batched,restart --runs 1 --duration 8

Writes ``<out>/migration.png`` (per-250 ms p50/p99/max timelines, one panel per strategy, from the
median run) and ``<out>/migration.json`` (every run's figures and timelines).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import shlex
import statistics
import sys
import time
from itertools import repeat
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import megaphone
import timely
from timely import routing
from timely.dataflow import Distribute

try:
    from bench import latency as L
    from bench.plotting import plot_timelines
except ImportError:  # run from bench/
    import latency as L  # type: ignore
    from plotting import plot_timelines  # type: ignore

STRATEGIES = ("all_at_once", "fluid", "batched")
MODES = (*STRATEGIES, "restart", "none")  # none: Megaphone without a migration (steady-state overhead)
DEFAULT_MODES = (*STRATEGIES, "restart")
CHUNK = megaphone.operators.DEFAULT_CHUNK  # state entries per shipped message (Megaphone's default)


def logical(e: int, epoch_ms: int) -> int:
    """Dataflow time of measured epoch ``e``: the elapsed millisecond at which it starts, plus 1
    (time 0 is the pre-load)."""
    return 1 + e * epoch_ms


def half_swap(table: tuple[int, ...], peers: int) -> tuple[int, ...]:
    """Every worker gives the first half of its bins (in bin order) to the next worker: half of all
    bins move and the load stays balanced."""
    owned: dict[int, list[int]] = {}
    for b, w in enumerate(table):
        owned.setdefault(w, []).append(b)
    new = list(table)
    for w, bins in owned.items():
        for b in bins[: len(bins) // 2]:
            new[b] = (w + 1) % peers
    return tuple(new)


def fold(key, value, state):
    """The keyed count: add the value to the key's sum (no output records)."""
    return (value if state is None else state + value), ()


# -- the plain (non-migratable) operator of the stop-and-restart baseline ----------------------------

def table_partitioner(table: tuple[int, ...], k: int):
    """A static exchange by the bin routing table (the same Cython routing Megaphone uses)."""

    def partition(time, batch, peers):
        return routing.route_bins(batch, 0, k, table, peers)[0]

    return partition


def build_plain(worker: timely.Worker, table: tuple[int, ...] | None, k: int, state: dict):
    """A dataflow: input -> exchange -> keyed count applying complete times in time order into
    ``state``. The exchange is timely's plain ``Exchange`` by key (``hash64(key) % peers``) when
    ``table`` is None, else by the bin routing ``table``. Returns ``(input, probe)``."""

    def count(cap, info):
        cap.drop()
        pending: dict = {}  # time -> (capability, batches)

        def logic(inp, out):
            for c, batch in inp:
                entry = pending.get(c.time)
                if entry is None:
                    pending[c.time] = (c.retain(), [batch])
                else:
                    entry[1].append(batch)
            if pending:
                for t in sorted(pending):
                    if inp.frontier.less_equal(t):
                        break
                    c, batches = pending.pop(t)
                    get = state.get
                    outputs: list = []
                    for b in batches:
                        for key, value in b:
                            new, outs = fold(key, value, get(key))
                            state[key] = new
                            if outs:
                                outputs.extend(outs)
                    if outputs:
                        out.give_batch(c, outputs)
                    c.drop()

        return logic

    with worker.dataflow() as scope:
        data = scope.new_input("Data")
        pact = 0 if table is None else Distribute(table_partitioner(table, k))
        probe = data.stream.unary_frontier(count, name="PlainCount", exchange=pact).probe()
    return data, probe


def transfer_state(worker: timely.Worker, state: dict, table: tuple[int, ...], k: int) -> tuple[dict, dict]:
    """Stop-and-restart's state move: serialise every entry of ``state``, send it to its owner under
    ``table`` through a dataflow built now, rebuild. Returns ``(new state, timings)``."""
    t0 = time.perf_counter()
    items = list(state.items())
    state.clear()
    parts = routing.route_bins(items, 0, k, table, worker.peers)[0]
    del items
    msgs = [(w, pickle.dumps(part[lo:lo + CHUNK], protocol=5))
            for w, part in enumerate(parts) for lo in range(0, len(part), CHUNK)]
    del parts
    t1 = time.perf_counter()
    nbytes = sum(len(m[1]) for m in msgs)
    new_state: dict = {}

    def install(cap, info):
        cap.drop()

        def logic(inp, out):
            for _, batch in inp:
                for _, payload in batch:
                    new_state.update(pickle.loads(payload))

        return logic

    def by_owner(time, batch, peers):
        parts = [[] for _ in range(peers)]
        for m in batch:
            parts[m[0]].append(m)
        return parts

    with worker.dataflow() as scope:
        inp = scope.new_input("StateIn")
        probe = inp.stream.unary(install, name="StateInstall", exchange=Distribute(by_owner)).probe()
    while msgs:
        inp.send_batch([msgs.pop()])
    inp.close()
    worker.step_while(lambda: not probe.done())
    t2 = time.perf_counter()
    return new_state, {"serialise_s": t1 - t0, "exchange_install_s": t2 - t1, "bytes": nbytes,
                       "entries": len(new_state)}


# -- one run on one worker -----------------------------------------------------------------------

def job(worker: timely.Worker) -> dict:
    cfg = json.loads(worker.args[0])
    mode, k, epoch_ms = cfg["mode"], cfg["bins"], cfg["epoch_ms"]
    index, peers = worker.index, worker.peers
    rss = L.RssSampler(0.05, start=0.0)  # absolute time.time() stamps
    nbins = 1 << k
    table0 = megaphone.default_table(nbins, peers)
    target = half_swap(table0, peers)
    sched = L.OpenLoopSchedule(cfg["rate"] / peers, cfg["duration"], epoch_ms / 1000, index, peers)
    rng = np.random.default_rng([cfg["seed"], index])
    keys = rng.integers(0, cfg["keys"], len(sched))

    with worker.dataflow() as scope:  # broadcasts worker 0's start time
        sync_in = scope.new_input("Sync")
        got: list = []
        sync_in.stream.broadcast().inspect(got.append)

    control = mig = None
    state: dict = {}
    if mode == "restart":
        data, probe = build_plain(worker, None, k, state)  # timely's plain exchange until the restart
    else:
        with worker.dataflow() as scope:
            data = scope.new_input("Data")
            control = megaphone.ControlInput(scope, bins=k)
            mig = megaphone.state_machine(data.stream, control, 0, fold)
            probe = mig.probe

    # Pre-load: one record per key at time 0.
    t_load = time.time()
    mine = np.arange(index, cfg["keys"], peers)
    for lo in range(0, len(mine), 1 << 16):
        part = mine[lo:lo + (1 << 16)].tolist()
        data.send_batch(list(zip(part, repeat(1, len(part)))))
    del mine
    data.advance_to(1)
    if control is not None:
        control.advance_to(1)
    worker.step_while(lambda: probe.less_equal(0))
    preload_s = time.time() - t_load
    if cfg["gc"] != "default":
        gc.collect()
        gc.freeze()  # the pre-loaded state and schedule are never garbage: keep the collector off them
        if cfg["gc"] == "off":
            gc.disable()  # the measured phase creates no cycles worth collecting

    if index == 0:
        sync_in.send(time.time() + 0.3)
    sync_in.close()
    worker.step_while(lambda: not got)
    start = got[0]
    while time.time() < start:
        worker.step_or_park(start - time.time())

    E = epoch_ms / 1000
    tracker = L.CompletionTracker(sched.epochs, lambda e: logical(e, epoch_ms), start)
    tracker.watch(probe)
    controller = megaphone.Controller(control, probe) if mig is not None and index == 0 else None
    migrate_at = cfg["migrate_at"]
    pause_epoch = int(math.ceil(migrate_at / E))
    info: dict = {}
    cpu = {"start": time.process_time(), "wait_start": L.runqueue_wait()}
    profiler = None
    if cfg.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    sent = 0
    closed = started = restarted = False
    while tracker.next < sched.epochs:
        now = time.time() - start
        due = sched.due(now)
        if now >= migrate_at and "migrate" not in cpu:
            cpu["migrate"], cpu["wait_migrate"] = time.process_time(), L.runqueue_wait()
        if mode == "restart" and not restarted and due > pause_epoch:
            due = pause_epoch  # paused: records keep being scheduled, not sent
            info.setdefault("pause", pause_epoch * E)  # records scheduled from here on are held
        while sent < due:
            lo, hi = sched.records(sent)
            if hi > lo:
                data.send_batch(list(zip(keys[lo:hi].tolist(), repeat(1, hi - lo))))
            sent += 1
            data.advance_to(logical(sent, epoch_ms))
            if control is not None:
                control.advance_to(logical(sent, epoch_ms))
        if controller is not None:
            if not started and now >= migrate_at and mode != "none":
                controller.start(megaphone.plan(table0, target, mode, peers=peers))
                started = True
            controller.tick()
        if sent == sched.epochs and not closed:
            data.close()
            if control is not None:
                control.close()
            closed = True
        tracker.step_started()
        worker.step_or_park(max(0.0, (due + 1) * E - (time.time() - start)) if sent == due else 0)
        tracker.poll()
        if mode == "restart" and not restarted and "pause" in info and tracker.next >= pause_epoch:
            info["drained"] = time.time() - start
            tracker.unwatch()
            data.close()
            worker.step_while(lambda: not probe.done())
            state, info["transfer"] = transfer_state(worker, state, target, k)
            data, probe = build_plain(worker, target, k, state)
            tracker.watch(probe)
            data.advance_to(logical(sent, epoch_ms))
            restarted = True
            info["resume"] = time.time() - start
    end_wall = time.time() - start
    cpu["end"], cpu["wait_end"] = time.process_time(), L.runqueue_wait()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(cfg["profile"], f"migration-{mode}-w{index}.prof"))
    tracker.unwatch()
    worker.step_while(lambda: not probe.done())
    samples = rss.stop()

    if mig is not None:
        bins = [b for b in mig._shared.bins if b is not None]  # sanity check only (private field)
        total, distinct = sum(sum(b.state.values()) for b in bins), sum(len(b.state) for b in bins)
        owned = len(bins)
    else:
        total, distinct, owned = sum(state.values()), len(state), None
    result = {
        "index": index, "start": start, "preload_s": preload_s, "completion": tracker.completion.tolist(),
        "end": end_wall, "rss": [(t - start, b) for t, b in samples], "max_rss": L.max_rss_bytes(),
        "total": total, "distinct": distinct, "cpu": cpu, "owned_bins": owned, "info": info,
        "events": [dict(e, worker=index) for e in (mig.events if mig is not None else [])],
    }
    if controller is not None:
        result["steps"] = [{"index": e.index, "bins": len(e.moves), "time": e.issue_time,
                            "issued": None if e.issued_at is None else e.issued_at - start,
                            "completed": None if e.completed_at is None else e.completed_at - start,
                            "duration": e.duration} for e in controller.events]
        result["all_steps_done"] = not controller.busy
    return result


# -- analysis --------------------------------------------------------------------------------------

def analyse(cfg: dict, results: list[dict]) -> dict:
    """Figures of one run from its workers' results."""
    peers = len(results)
    E = cfg["epoch_ms"] / 1000
    scheds, lats = [], []
    for r in results:
        s = L.OpenLoopSchedule(cfg["rate"] / peers, cfg["duration"], E, r["index"], peers)
        comp = np.asarray(r["completion"])
        scheds.append(s.scheduled)
        lats.append(L.latencies(s.scheduled, s.epoch_of, comp))
    sched = np.concatenate(scheds)
    lat = np.concatenate(lats)
    comp_all = np.nanmax(np.vstack([np.asarray(r["completion"]) for r in results]), axis=0)
    w0 = results[0]
    out: dict = {"mode": cfg["mode"], "records": int(len(sched)),
                 "preload_s": max(r["preload_s"] for r in results)}
    if cfg["mode"] == "restart":
        issue, done = min(r["info"]["pause"] for r in results), max(r["info"]["resume"] for r in results)
        first = int(round(issue / E))  # the first epoch held back
        out["steps"], out["bins_moved"] = 1, (1 << cfg["bins"]) // 2
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
        issue = steps[0]["issued"]
        first = (steps[0]["time"] - 1) // cfg["epoch_ms"]  # the epoch the first step was issued at
        out["complete"] = bool(w0["all_steps_done"]) and steps[-1]["completed"] is not None
        done = steps[-1]["completed"] if out["complete"] else w0["end"]
        out["steps"], out["bins_moved"] = len(steps), sum(s["bins"] for s in steps)
        ev = [e for r in results for e in r["events"]]
        out["bytes"] = sum(e["bytes"] for e in ev if e["kind"] == "extract")
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
    ws, ss = L.summary(lat[win]), L.summary(lat[steady])
    after = L.summary(lat[sched >= end])
    out.update(mig_max=ws["max"], mig_p99=ws["p99"], mig_p50=ws["p50"], steady_p50=ss["p50"], steady_p99=ss["p99"],
               steady_max=ss["max"], after_p99=after["p99"], after_max=after["max"], overall_max=float(np.nanmax(lat)))
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
    out["rss_before"] = [L.peak_between(r["rss"], issue - 0.5, issue) for r in results]
    out["rss_window_peak"] = [L.peak_between(r["rss"], issue, end + 0.1) for r in results]
    expected_total = cfg["keys"] + len(sched)
    got_total = sum(r["total"] for r in results)
    out["count_ok"] = got_total == expected_total and sum(r["distinct"] for r in results) == cfg["keys"]
    if not out["count_ok"]:
        out["count_error"] = f"sum of counts {got_total} (expected {expected_total}), distinct " \
                             f"{sum(r['distinct'] for r in results)} (expected {cfg['keys']})"
    tl = L.timeline(sched, lat, end=cfg["duration"])
    out["timeline"] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in tl.items()}
    return out


# -- driver ----------------------------------------------------------------------------------------

def fmt_ms(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    ms = x * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def median(values: list[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else float("nan")


COLUMNS = [  # (header, key, formatter)
    ("max lat ms", "mig_max", fmt_ms), ("p99 lat ms", "mig_p99", fmt_ms),
    ("duration s", "duration", lambda x: f"{x:.2f}"), ("window s", "window", lambda x: f"{x:.2f}"),
    ("steady p99 ms", "steady_p99", fmt_ms), ("steady max ms", "steady_max", fmt_ms),
    ("tput rec/s", "throughput", lambda x: f"{x:,.0f}"),
    ("peak RSS MiB", "peak_rss_max", lambda x: f"{x / 2**20:,.0f}"),
    ("RSS +MiB", "rss_delta", lambda x: f"{x / 2**20:+,.0f}"),
    ("runq wait", "runq", lambda x: f"{x:.0%}"),
]


def row_values(m: dict) -> dict:
    m = dict(m)
    m["peak_rss_max"] = max(m["peak_rss"])
    m["rss_delta"] = max(p - b for p, b in zip(m["rss_window_peak"], m["rss_before"]))
    m["runq"] = max(m["runq_steady"] + m["runq_after"])
    return m


def print_table(title: str, rows: list[tuple[str, dict]]) -> None:
    print(f"\n{title}")
    head = f"{'strategy':<12} {'steps':>5} " + " ".join(f"{h:>13}" for h, _, _ in COLUMNS)
    print(head)
    print("-" * len(head))
    for label, m in rows:
        print(f"{label:<12} {m.get('steps', 0):>5} " + " ".join(f"{f(m[k]):>13}" for _, k, f in COLUMNS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--rate", type=int, default=100_000, help="records per second, all workers (default 100000)")
    ap.add_argument("--duration", type=float, default=16.0, help="seconds of input per run (default 16)")
    ap.add_argument("--migrate-at", type=float, default=5.0, help="seconds after the start (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds cut before the steady state (default 1)")
    ap.add_argument("--keys", type=int, default=4_000_000, help="distinct keys, all pre-loaded (default 4M)")
    ap.add_argument("--bins", type=int, default=10, help="k: 2^k bins (default 10)")
    ap.add_argument("--epoch-ms", type=int, default=5, help="epoch length in ms (default 5)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})")
    ap.add_argument("--runs", type=int, default=3, help="runs per strategy; medians reported (default 3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gc", choices=("freeze", "off", "default"), default="freeze",
                    help="worker GC after the pre-load: gc.freeze() (default), also gc.disable(), or untouched")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"),
                    help="output directory for migration.png/.json (default bench/out, git-ignored)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--profile", metavar="DIR", help="cProfile each worker's measured phase into DIR/*.prof")
    args = ap.parse_args(argv)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    modes = [m.strip() for m in args.strategies.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown strategy {m!r} (one of {', '.join(MODES)})")
    migrate_at = args.migrate_at
    if not 0 < args.warmup < migrate_at < args.duration:
        ap.error("need 0 < --warmup < --migrate-at < --duration")
    command = shlex.join([sys.executable, *sys.argv])
    print("command:", command)
    print(f"os.cpu_count() = {os.cpu_count()}; load average at start {os.getloadavg()[0]:.2f}; "
          f"{args.workers} workers; {args.rate:,} rec/s for {args.duration:g} s; {args.keys:,} keys pre-loaded; "
          f"2^{args.bins} bins; {args.epoch_ms} ms epochs; gc {args.gc}; migration of half the bins at {migrate_at:g} s; "
          f"{args.runs} run(s)", flush=True)

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    t_all = time.time()
    for run in range(args.runs):
        for mode in modes:  # interleaved, so that machine noise spreads over the strategies
            cfg = {"mode": mode, "rate": args.rate, "duration": args.duration, "migrate_at": migrate_at,
                   "warmup": args.warmup, "keys": args.keys, "bins": args.bins, "epoch_ms": args.epoch_ms,
                   "gc": args.gc, "seed": args.seed + run,
                   "profile": os.path.abspath(args.profile) if args.profile else None}
            t0 = time.time()
            results = timely.execute(job, workers=args.workers, args=[json.dumps(cfg)])
            m = analyse(cfg, results)
            m["run"], m["wall_s"], m["load"] = run, time.time() - t0, os.getloadavg()[0]
            runs[mode].append(m)
            print(f"run {run} {mode:<11}: max {fmt_ms(m['mig_max'])} ms, p99 {fmt_ms(m['mig_p99'])} ms in the "
                  f"migration ({m['steps']} steps, {m['bins_moved']} bins, {m['bytes'] / 2**20:,.1f} MiB, "
                  f"duration {m['duration']:.2f} s, window {m['window']:.2f} s"
                  f"{', median step %.1f ms' % (m['median_step_s'] * 1e3) if 'median_step_s' in m else ''}); steady p99 {fmt_ms(m['steady_p99'])} ms; "
                  f"{m['throughput']:,.0f} rec/s; peak RSS {max(m['peak_rss']) / 2**20:,.0f} MiB; "
                  f"pre-load {m['preload_s']:.1f} s; steady CPU {'/'.join(f'{c:.0%}' for c in m['cpu_steady'])}, run-queue wait "
                  f"{'/'.join(f'{c:.0%}' for c in m['runq_steady'])}; counts {'OK' if m['count_ok'] else 'WRONG: ' + m['count_error']}"
                  f"{'' if m['complete'] else '; MIGRATION DID NOT FINISH (%s steps done)' % m.get('steps_completed')}; load {m['load']:.1f}; "
                  f"{m['wall_s']:.0f} s", flush=True)

    medians = {}
    for mode in modes:
        rows = [row_values(m) for m in runs[mode]]
        med = {k: median([r[k] for r in rows]) for _, k, _ in COLUMNS}
        med["steps"] = rows[0]["steps"]
        med["steady_p50"] = median([r["steady_p50"] for r in rows])
        medians[mode] = med
    print_table(f"Median over {args.runs} run(s) (latency during the migration window; steady = "
                f"[{args.warmup:g} s, window start))", [(m, medians[m]) for m in modes])

    if "restart" in medians:
        m = medians["restart"]
        print(f"plain exchange, no migration (restart runs before the pause): steady p50 {fmt_ms(m['steady_p50'])} ms, "
              f"p99 {fmt_ms(m['steady_p99'])} ms, max {fmt_ms(m['steady_max'])} ms")
    print("runq wait = share of wall time a worker was runnable but waiting for a CPU taken by other processes "
          "(/proc schedstat; max over workers and phases)")
    verdict = []
    if "batched" in medians and "all_at_once" in medians:
        r = medians["all_at_once"]["mig_max"] / medians["batched"]["mig_max"]
        verdict.append(f"batched max latency {fmt_ms(medians['batched']['mig_max'])} ms vs all-at-once "
                       f"{fmt_ms(medians['all_at_once']['mig_max'])} ms: {r:.1f}x lower (target >= 10x): "
                       f"{'MET' if r >= 10 else 'NOT met'}")
    if "batched" in medians and "restart" in medians:
        plain = medians["restart"]["steady_p99"]
        r = medians["batched"]["mig_max"] / plain
        verdict.append(f"batched max latency {fmt_ms(medians['batched']['mig_max'])} ms vs plain exchange steady "
                       f"p99 {fmt_ms(plain)} ms: {r:.2f}x (target <= 2x): {'MET' if r <= 2 else 'NOT met'}")
    for v in verdict:
        print(v)
    print(f"load average at end {os.getloadavg()[0]:.2f}; total {time.time() - t_all:.0f} s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "migration.json", "w") as f:
        json.dump({"command": command, "cpu_count": os.cpu_count(), "args": vars(args), "migrate_at": migrate_at,
                   "medians": medians, "verdict": verdict, "runs": runs}, f, default=float)
    if not args.no_plot:
        panels = []
        plain = medians.get("restart", {}).get("steady_p99")
        for mode in modes:
            ms = sorted(runs[mode], key=lambda m: m["mig_max"])
            m = ms[len(ms) // 2]  # the median run by max latency
            panels.append({
                "label": f"{mode} (run {m['run']})", "timeline": m["timeline"],
                "spans": [(m["begin"], m["done"], "migration"), (m["done"], m["end"], "drain")],
                "hlines": [(plain, "plain steady p99")] if plain and math.isfinite(plain) else [],
                "note": f"max {fmt_ms(m['mig_max'])} ms, p99 {fmt_ms(m['mig_p99'])} ms, {m['steps']} steps, "
                        f"duration {m['duration']:.2f} s",
            })
        path = plot_timelines(panels, str(out / "migration.png"),
                              title=f"keyed count, {args.keys:,} keys, 2^{args.bins} bins, {args.rate:,} rec/s, "
                                    f"{args.epoch_ms} ms epochs, {args.workers} workers: latency per 250 ms")
        print(f"plot: {path}")
    print(f"json: {out / 'migration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
