"""Where a worker's time goes at a given number of workers: a cProfile of worker 0 and the CPU of
every thread of every worker process.

For each ``--workers`` count the workload runs once, as ``bench/scaling.py`` runs it: ``count``
and ``q3`` closed loop (worker 0 profiled over the measured phase only), ``q3-flex`` open loop at
``--rate`` events/s per worker (worker 0 profiled over its whole run). While it runs, the parent
samples ``/proc`` twice, ``--window`` seconds apart, from ``--at`` seconds after the start, and
prints the CPU each kind of thread used in that window (the worker's Python thread, ZeroMQ's I/O
thread, the others) and the cores all workers used together: on a machine with a core per worker,
more cores in use than the machine has means the workers queue for CPU. Then worker 0's top
functions by own time (CPU clock), with their share of its profiled CPU.

    .venv/bin/python bench/worker_profile.py --workload q3 --workers 2 16
    .venv/bin/python bench/worker_profile.py --workload q3-flex --workers 2 16 --rate 125000 --duration 6
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import shlex
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import timely

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exchange  # noqa: F401  (bench/ is not a package; the jobs look these up by name)
import peers  # noqa: F401

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _between_cpu_calls(module_name: str, job: str, path: str, worker: timely.Worker) -> Any:
    """Run ``module.job(worker)``, profiled between its first and second call of ``module._cpu``
    (the measured phase of the closed-loop jobs): worker 0 only, or every worker where ``path``
    holds ``{index}`` (each to its own file)."""
    module: Any = sys.modules[module_name]
    inner = getattr(module, job)
    every = "{index}" in path
    if worker.index != 0 and not every:
        return inner(worker)
    path = path.format(index=worker.index)
    prof, real, calls = cProfile.Profile(time.process_time), module._cpu, [0]

    def hooked() -> float:
        calls[0] += 1
        if calls[0] == 1:
            prof.enable()
        elif calls[0] == 2:
            prof.disable()
            prof.dump_stats(path)
        return real()

    module._cpu = hooked
    try:
        return inner(worker)
    finally:
        module._cpu = real


def _whole(inner: Callable[[timely.Worker], Any], path: str, worker: timely.Worker) -> Any:
    """Run ``inner(worker)``, on worker 0 under cProfile from start to end."""
    if worker.index != 0:
        return inner(worker)
    prof = cProfile.Profile(time.process_time)
    try:
        return prof.runcall(inner, worker)
    finally:
        prof.dump_stats(path)


def _children() -> list[int]:
    """The worker processes of this run: the spawned children of this process."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"spawn_main" in cmd:
            found.append(int(pid))
    return found


def _thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds (user + system) so far of every thread of ``pids``: (pid, tid) -> (name, s)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def _kind(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "python"
    if name.startswith("ZMQbg/IO"):
        return "zmq-io"
    return "other"


class Sampler(threading.Thread):
    """Samples the worker threads' CPU over ``window`` seconds from ``at`` seconds after all
    ``workers`` worker processes exist."""

    def __init__(self, workers: int, at: float, window: float) -> None:
        super().__init__(daemon=True)
        self.workers, self.at, self.window = workers, at, window
        self.result: tuple[int, float, dict[str, list[float]], float] | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while len(pids := _children()) < self.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(self.at)
        t0, before = time.monotonic(), _thread_cpu(pids)
        time.sleep(self.window)
        after, wall = _thread_cpu(pids), time.monotonic() - t0
        per_kind: dict[str, list[float]] = defaultdict(list)
        per_worker: dict[int, float] = defaultdict(float)
        for key, (name, cpu) in after.items():
            used = cpu - before.get(key, (name, 0.0))[1]
            per_kind[_kind(*key, name)].append(used / wall)
            per_worker[key[0]] += used / wall
        self.result = (len(pids), wall, dict(per_kind), sum(per_worker.values()))


def _report_threads(sampler: Sampler) -> None:
    if sampler.result is None:
        print("  threads: not sampled (the run ended before the window)")
        return
    processes, wall, per_kind, cores = sampler.result
    print(f"  threads over {wall:.1f} s: {processes} worker processes used {cores:.2f} cores "
          f"(os.cpu_count() = {os.cpu_count()})")
    for kind, shares in sorted(per_kind.items()):
        print(f"    {kind:7s}: {len(shares):3d} threads, median {statistics.median(shares):.2f} core, "
              f"max {max(shares):.2f}, sum {sum(shares):.2f}")


def _report_every(paths: list[str], top: int) -> tuple[float, float, float]:
    """Print every worker's profiles together, per worker; return the profiled CPU per worker,
    the dataflow steps per worker and the microseconds per ``dict.get`` call (a fixed piece of
    work: what it costs shows how much slower the same code runs, as on a machine with fewer
    cores than workers, where processes evict each other's caches)."""
    st = pstats.Stats(*paths)
    n = len(paths)
    total = st.total_tt  # type: ignore[attr-defined]
    stats = st.stats  # type: ignore[attr-defined]
    steps = sum(v[1] for (f, _, fn), v in stats.items() if fn == "step" and f.endswith("dataflow/dataflow.py"))
    gets = [v for (_, _, fn), v in stats.items() if fn == "<method 'get' of 'dict' objects>"]
    per_get = 1e6 * gets[0][2] / gets[0][1] if gets and gets[0][1] else float("nan")
    print(f"  every worker profiled: {total / n:.3f} s CPU per worker, {steps / n:.0f} dataflow steps per worker, "
          f"{per_get:.2f} us per dict.get call; top {top} by own time, per worker:")
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows:
        where = f"{os.path.basename(file)}:{line}({fn})" if line else fn
        print(f"    {100 * tt / total:5.1f}% own {tt / n:7.3f} s  cum {ct / n:7.3f} s  calls {nc // n:9d}  {where}")
    return total / n, steps / n, per_get


def _report_profile(path: str, top: int) -> None:
    if not os.path.exists(path):
        print("  profile: worker 0 wrote none")
        return
    st = pstats.Stats(path)
    total = st.total_tt  # type: ignore[attr-defined]  # (pstats' attributes are not in its stubs)
    print(f"  worker 0 profiled CPU: {total:.3f} s; top {top} by own time:")
    rows = sorted(st.stats.items(),  # type: ignore[attr-defined]
                  key=lambda kv: kv[1][2], reverse=True)[:top]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows:
        where = f"{os.path.basename(file)}:{line}({fn})" if line else fn
        print(f"    {100 * tt / total:5.1f}% own {tt:7.3f} s  cum {ct:7.3f} s  calls {nc:9d}  {where}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["count", "q3", "q3-flex"], default="q3")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--records", type=int, default=2_000_000, help="count: records per worker")
    parser.add_argument("--events", type=int, default=4_000_000, help="q3: events per worker")
    parser.add_argument("--rate", type=int, default=125_000, help="q3-flex: events/s per worker")
    parser.add_argument("--duration", type=float, default=6.0, help="q3-flex: seconds of input")
    parser.add_argument("--at", type=float, default=None,
                        help="seconds after the workers started that the thread sample begins (default: "
                             "half the open loop's duration; 1 s closed loop)")
    parser.add_argument("--window", type=float, default=2.0,
                        help="seconds the thread sample spans (0: no thread sample)")
    parser.add_argument("--top", type=int, default=20, help="functions listed")
    parser.add_argument("--dir", default="/tmp", help="where the .prof files go")
    parser.add_argument("--progress", choices=["direct", "relay"], default="direct")
    parser.add_argument("--every-worker", action="store_true",
                        help="count, q3: profile every worker, not worker 0 alone (a profiled worker is slower, "
                             "and the others wait for it), and compare the worker counts per worker")
    args = parser.parse_args(argv)
    if args.every_worker and args.workload == "q3-flex":
        parser.error("--every-worker profiles the closed-loop workloads (count, q3)")
    summary = []
    print("command:", shlex.join([os.path.basename(sys.executable), *sys.argv]))
    print(f"os.cpu_count() = {os.cpu_count()}; load average at start {os.getloadavg()[0]:.2f}")
    os.makedirs(args.dir, exist_ok=True)
    for workers in args.workers:
        path = os.path.join(args.dir, f"{args.workload}-w{workers}" + ("-{index}" if args.every_worker else "") + ".prof")
        paths = [path.format(index=i) for i in range(workers)] if args.every_worker else [path]
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
        at = args.at if args.at is not None else (args.duration / 2 if args.workload == "q3-flex" else 1.0)
        sampler = Sampler(workers, at, args.window)
        if args.window > 0:
            sampler.start()
        t0 = time.monotonic()
        if args.workload == "count":
            job = functools.partial(_between_cpu_calls, "exchange", "keyed_count", path)
            timely.execute(job, workers=workers, start="spawn", timeout=900, progress=args.progress,
                           args=[str(args.records * workers), "10000", "4096", "64", "freeze"])
        elif args.workload == "q3":
            job = functools.partial(_between_cpu_calls, "peers", "_ours_nexmark", path)
            timely.execute(job, workers=workers, start="spawn", timeout=900, progress=args.progress,
                           args=["q3", "freeze", str(args.events * workers), "4096", "16"])
        else:
            from nexmark.driver import Spec, worker_main
            spec = Spec(query="q3", flex=True, rate=args.rate * workers, duration=args.duration, workers=workers,
                        k=12, progress=False, progress_mode=args.progress)
            job = functools.partial(_whole, functools.partial(worker_main, spec), path)
            timely.execute(job, workers=workers, start="spawn", timeout=args.duration + 600,
                           progress=args.progress)
        if args.window > 0:
            sampler.join(timeout=0)
        print(f"== {args.workload}, {workers} workers ({time.monotonic() - t0:.1f} s)")
        _report_threads(sampler)
        if args.every_worker:
            summary.append((workers, *_report_every(paths, args.top)))
        else:
            _report_profile(path, args.top)
        sys.stdout.flush()
    if len(summary) > 1:
        base = summary[0]
        print(f"per worker, against {base[0]} workers: profiled CPU, dataflow steps, us per dict.get call")
        for workers, cpu, steps, per_get in summary:
            print(f"  {workers:3d} workers: {cpu:.3f} s ({cpu / base[1]:.2f}x), {steps:.0f} steps "
                  f"({steps / base[2]:.2f}x), {per_get:.2f} us ({per_get / base[3]:.2f}x)")


if __name__ == "__main__":
    main()
