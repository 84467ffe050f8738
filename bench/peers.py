"""Peers in the same run: our engine against bytewax on the keyed count and NEXMark Q1, Q2, Q3.

Both engines run on the same machine in the same invocation, each run in fresh processes: ours
with the interpreter running this script (``timely.execute(..., start="spawn")``: every worker a
fresh interpreter), bytewax with ``.venv-bench/bin/python`` (bytewax
from PyPI, not a project dependency; ``run_main`` for 1 worker, ``cluster_main`` in one process
per worker, 1 worker each, for more). Every process pre-generates its input outside the timed
section, then the input is pushed through as fast as possible (closed loop). Both engines handle
each batch as it is read (bytewax reads one ``next_batch`` per activation of its input; ours steps
the worker after every batch or round) and start their clocks once every worker is ready
(bytewax's ``cluster_main`` connects them all first; ours agree on a start with
``nexmark.openloop.start_together``). Both set the collector with ``timely.collector`` under
``--gc`` (default ``freeze``) once their input is generated:

* keyed count: ``--records`` ``(key, 1)`` records over ``--keys`` keys (``random.Random(worker)``
  per worker, as ``bench/exchange.py``); ours ``exchange(0).count_by_key(0)`` with one epoch per
  ``--epoch-rounds`` batches, bytewax ``count_final`` (keys pre-generated as ``str``, as bytewax
  requires). Check: total count and a key-weighted checksum agree.
* NEXMark Q1 (``price * 89 // 100``), Q2 (``auction % 123 == 0``), Q3 (auctions in category 10
  joined with persons in OR/ID/CA on seller = id): the events ``[0, --events)`` of our generator,
  worker ``i`` of ``p`` holding ``n = i, i + p, ...``, in rounds of ``--round`` events per worker.
  Ours: the native queries of ``nexmark/queries`` (all three streams fed, one epoch per
  ``--epoch-rounds`` rounds, at most one epoch in flight); bytewax: the same batch functions in
  ``flat_map_batch`` (Q1, Q2) and a ``stateful_flat_map`` join keyed by ``str(person id)`` (Q3),
  fed only the streams the query reads. Check: output record counts agree.

Throughput = input records / (last worker done - first worker's first batch).

    .venv/bin/python bench/peers.py --setup   # create .venv-bench, install bytewax==0.21.1 numpy into it
    .venv/bin/python bench/peers.py           # keyed count (2 workers), Q1-Q3 (1 and 2 workers), 3 runs
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_VENV = os.path.join(ROOT, ".venv-bench")
BENCH_PY = os.path.join(BENCH_VENV, "bin", "python")
BENCH_PACKAGES = ["bytewax==0.21.1", "numpy"]
THIS = os.path.abspath(__file__)

Q2_SKIP = 123
Q3_CATEGORY = 10
Q3_STATES = frozenset(("OR", "ID", "CA"))


# -- shared by both engines ---------------------------------------------------------------------
def _q1(batch):  # the same function as nexmark/queries/stateless.py
    return [(a, b, price * 89 // 100, t) for a, b, price, t in batch]


def _q2(batch):  # the same function as nexmark/queries/stateless.py (q2_skip = 123)
    return [(a, price) for a, _, price, _ in batch if a % Q2_SKIP == 0]


def _scramble(key: int) -> int:
    return (key * 2654435761) % (1 << 32)


def _count_batches(records: int, keys: int, batch: int, index: int, peers: int, as_str: bool) -> list:
    """This worker's ``(key, 1)`` records in batches (the same data for both engines)."""
    mine = records // peers
    rnd = random.Random(index)
    data: list[tuple] = [(rnd.randrange(keys), 1) for _ in range(mine)]
    if as_str:
        data = [(str(k), v) for k, v in data]
    return [data[i:i + batch] for i in range(0, mine, batch)]


def _nexmark_rounds(events: int, round_events: int, index: int, peers: int) -> tuple[list, bool]:
    """This worker's events ``[0, events)`` as rounds of EventBatch (persons, auctions, bids)."""
    from nexmark.generator import Generator
    from nexmark.model import Config
    gen = Generator(Config(), index, peers)
    step = round_events * peers
    rounds = [gen.until(min(events, hi)) for hi in range(step, events + step, step)]
    return rounds, gen.native is not None


# -- our engine (runs under the project's interpreter) ------------------------------------------
# The clocks start together once every worker is ready (start_together), as bytewax's do
# (``cluster_main`` connects every worker before the first ``next_batch``), not while a slower
# worker is still generating its input.
def _ours_count(worker):
    from nexmark.openloop import start_together
    from timely import collector

    records, keys, batch, epoch_rounds = (int(a) for a in worker.args[2:])
    batches = _count_batches(records, keys, batch, worker.index, worker.peers, False)
    acc = [0, 0]  # total, checksum

    def seen(t, b):
        for k, c in b:
            acc[0] += c
            acc[1] += c * _scramble(k)

    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.exchange(0).count_by_key(0).inspect_batch(seen).probe()
    collector.configure(worker.args[1])
    start, cpu = start_together(worker, delay=0.0), _cpu()
    for i, b in enumerate(batches):
        inp.send_batch(b)
        worker.step()  # process the batch now, as bytewax does after each next_batch
        if i % epoch_rounds == epoch_rounds - 1:
            inp.advance_to(inp.time + 1)
            worker.step_while(lambda: probe.less_than(inp.time - 1))
    inp.close()
    worker.step_while(lambda: not probe.done())
    return {"start": start, "end": time.time(), "inputs": sum(map(len, batches)), "outputs": acc[0],
            "checksum": acc[1], "native_gen": None, "cpu": _cpu() - cpu}


def _ours_nexmark(worker):
    import megaphone
    from nexmark.model import Params
    from nexmark.openloop import start_together
    from nexmark.queries import QUERIES, Streams
    from timely import collector

    query, _, flex = worker.args[0].partition("-")  # "q3-flex": Q3 on Megaphone, 2^12 bins
    events, round_events, epoch_rounds = (int(a) for a in worker.args[2:])
    rounds, native = _nexmark_rounds(events, round_events, worker.index, worker.peers)
    counted = [0]
    with worker.dataflow() as scope:
        inputs = [scope.new_input(name) for name in ("Persons", "Auctions", "Bids")]
        control = megaphone.ControlInput(scope, k=12) if flex else None
        out = QUERIES[query].build(Streams(*(i.stream for i in inputs)), Params(), control)
        probe = out.inspect_batch(lambda t, b: counted.__setitem__(0, counted[0] + len(b))).probe()
        if control is not None:
            inputs.append(control)  # kept in step with the data inputs (advance_to, close)
    collector.configure(worker.args[1])
    start, cpu = start_together(worker, delay=0.0), _cpu()
    for i, batch in enumerate(rounds):
        for inp, recs in zip(inputs, batch):
            if recs:
                inp.send_batch(recs)
        worker.step()  # process the round now, as bytewax does after each next_batch
        if i % epoch_rounds == epoch_rounds - 1:
            for inp in inputs:
                inp.advance_to(inp.time + 1)
            worker.step_while(lambda: probe.less_than(inputs[0].time - 1))
    for inp in inputs:
        inp.close()
    worker.step_while(lambda: not probe.done())
    return {"start": start, "end": time.time(), "inputs": sum(r.total for r in rounds), "outputs": counted[0],
            "checksum": 0, "native_gen": native, "cpu": _cpu() - cpu}


def _cpu() -> float:
    """CPU seconds (user + system, every thread) this process has used."""
    t = os.times()
    return t.user + t.system


# -- bytewax (runs under .venv-bench/bin/python) ------------------------------------------------
def _import_without_engine() -> None:
    """Make ``nexmark.generator`` (and the native generator) and ``timely.collector`` importable
    without the package ``__init__`` files, which pull in the engine (msgpack, zmq) that .venv-bench
    does not have."""
    for name in ("nexmark", "timely"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(ROOT, name)]
            sys.modules[name] = mod


def _bytewax_main(workload: str, workers: int, proc_id: int, addresses: list[str], params: list[str]) -> None:
    import bytewax.operators as op
    from bytewax.dataflow import Dataflow
    from bytewax.inputs import DynamicSource, StatelessSourcePartition
    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.testing import cluster_main, run_main

    _import_without_engine()
    from timely.collector import configure

    marks = {"start": None, "end": None}
    acc = [0, 0]  # outputs (records, or the total count for the keyed count), checksum

    class Part(StatelessSourcePartition):
        def __init__(self, batches):
            self.it = iter(batches)

        def next_batch(self):
            if marks["start"] is None:
                marks["start"] = time.time()
            for b in self.it:  # skip empty batches (an empty batch costs bytewax a 1 ms pause)
                if b:
                    return b
            raise StopIteration()

    class Source(DynamicSource):
        def __init__(self, batches):
            self.batches = batches

        def build(self, step_id, worker_index, worker_count):
            assert (worker_index, worker_count) == (proc_id, workers), (worker_index, worker_count)
            return Part(self.batches)

    class SinkPart(StatelessSinkPartition):
        def __init__(self, keyed):
            self.keyed = keyed

        def write_batch(self, items):
            if self.keyed:
                for k, c in items:
                    acc[0] += c
                    acc[1] += c * _scramble(int(k))
            else:
                acc[0] += len(items)

        def close(self):
            marks["end"] = time.time()

    class Sink(DynamicSink):
        def __init__(self, keyed=False):
            self.keyed = keyed

        def build(self, step_id, worker_index, worker_count):
            return SinkPart(self.keyed)

    flow = Dataflow(f"peers_{workload}")
    native = None
    if workload == "count":
        records, keys, batch = (int(a) for a in params[1:4])
        batches = _count_batches(records, keys, batch, proc_id, workers, True)
        inputs = sum(map(len, batches))
        s = op.input("records", flow, Source(batches))
        op.output("out", op.count_final("count", s, lambda x: x[0]), Sink(keyed=True))
    else:
        events, round_events = (int(a) for a in params[1:3])
        rounds, native = _nexmark_rounds(events, round_events, proc_id, workers)
        inputs = sum(r.total for r in rounds)
        persons, auctions, bids = ([r[k] for r in rounds] for k in range(3))
        if workload == "q1":
            out = op.flat_map_batch("q1", op.input("bids", flow, Source(bids)), _q1)
        elif workload == "q2":
            out = op.flat_map_batch("q2", op.input("bids", flow, Source(bids)), _q2)
        elif workload == "q3":
            a = op.flat_map_batch("q3 auctions", op.input("auctions", flow, Source(auctions)),
                                  lambda b: [(str(x[7]), (0, x[0])) for x in b if x[8] == Q3_CATEGORY])
            p = op.flat_map_batch("q3 persons", op.input("persons", flow, Source(persons)),
                                  lambda b: [(str(x[0]), (1, x[1], x[4], x[5])) for x in b if x[5] in Q3_STATES])

            def join(state, v):
                # state: the person (name, city, state) once seen, else the auctions waiting for it
                if v[0] == 0:
                    if state is None:
                        return [v[1]], ()
                    if type(state) is list:
                        state.append(v[1])
                        return state, ()
                    return state, ((*state, v[1]),)
                person = v[1:]
                if type(state) is list:
                    return person, [(*person, aid) for aid in state]
                return person, ()

            out = op.stateful_flat_map("q3 join", op.merge("q3 merge", a, p), join)
        else:
            raise SystemExit(f"unknown workload {workload}")
        op.output("out", out, Sink())
    configure(params[0])
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, addresses, proc_id, worker_count_per_proc=1)
    end = marks["end"] or time.time()
    print(json.dumps({"start": marks["start"], "end": end, "inputs": inputs, "outputs": acc[0],
                      "checksum": acc[1], "native_gen": native}), flush=True)


# -- the driver ---------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _collect(procs: list[subprocess.Popen], timeout: float, what: str) -> list[dict]:
    """Each process's last line of output (JSON), once all have exited; on a failure or after
    ``timeout`` seconds, every process is killed and reaped and the run abandoned."""
    out = []
    try:
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{what}: timed out after {timeout:.0f} s") from None
            if p.returncode != 0:
                raise SystemExit(f"{what}: exit status {p.returncode}\n{stderr[-3000:]}")
            res = json.loads(stdout.strip().splitlines()[-1])
            out.extend(res if isinstance(res, list) else [res])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _summarise(results: list[dict]) -> dict:
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    inputs = sum(r["inputs"] for r in results)
    return {"rate": inputs / (end - start), "seconds": end - start, "inputs": inputs,
            "outputs": sum(r["outputs"] for r in results), "checksum": sum(r["checksum"] for r in results),
            "native_gen": [r["native_gen"] for r in results]}


def run_ours(workload: str, workers: int, params: list[str], timeout: float) -> dict:
    """One run of ours, every worker a fresh interpreter; its summary."""
    import timely

    job = _ours_count if workload == "count" else _ours_nexmark
    return _summarise(timely.execute(job, workers, args=[workload, *params], start="spawn", timeout=timeout))


def run_bytewax(workload: str, workers: int, params: list[str], timeout: float) -> dict:
    """One run of bytewax, one process per worker under .venv-bench; its summary."""
    addresses = [f"127.0.0.1:{port}" for port in _free_ports(workers)] if workers > 1 else []
    procs = [subprocess.Popen([BENCH_PY, THIS, "--_bytewax", workload, str(workers), str(i), ",".join(addresses),
                               *params], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(workers)]
    return _summarise(_collect(procs, timeout, f"bytewax {workload} x{workers}"))


def setup() -> None:
    if not os.path.exists(BENCH_PY):
        cmd = [sys.executable, "-m", "venv", BENCH_VENV]
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    cmd = [BENCH_PY, "-m", "pip", "install", "-q", *BENCH_PACKAGES]
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    ver = subprocess.run([BENCH_PY, "-c", "import importlib.metadata as m; print(m.version('bytewax'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    print(f"installed into {BENCH_VENV}: {', '.join(BENCH_PACKAGES)} (bytewax {ver})", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_bytewax":
        return _bytewax_main(argv[1], int(argv[2]), int(argv[3]), [a for a in argv[4].split(",") if a], argv[5:])
    from timely import collector  # here: the bytewax side above runs without the engine's packages

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create .venv-bench, install bytewax into it, exit")
    parser.add_argument("--workloads", nargs="+", default=["count", "q1", "q2", "q3"],
                        choices=["count", "q1", "q2", "q3"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts for Q1-Q3")
    parser.add_argument("--count-workers", type=int, default=2, help="workers for the keyed count")
    parser.add_argument("--records", type=int, default=4_000_000, help="keyed count: records per run")
    parser.add_argument("--keys", type=int, default=10_000, help="keyed count: distinct keys")
    parser.add_argument("--events", type=int, default=8_000_000, help="NEXMark: events per run")
    parser.add_argument("--round", type=int, default=4096, help="records (events) per batch and worker")
    parser.add_argument("--epoch-rounds", type=int, default=16, help="ours: batches per epoch and worker")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--gc", choices=collector.POLICIES, default="freeze",
                        help="both engines' collector once the input is generated (timely.collector; default freeze)")
    opts = parser.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    if opts.setup:
        return setup()
    if not os.path.exists(BENCH_PY):
        raise SystemExit(f"{BENCH_PY} is missing: run `{shlex.join([sys.executable, THIS])} --setup` first")
    ver = subprocess.run([BENCH_PY, "-c", "import importlib.metadata as m; print(m.version('bytewax'))"],
                         capture_output=True, text=True).stdout.strip() or "not installed"
    print(f"os.cpu_count() = {os.cpu_count()}; ours: {sys.executable}; bytewax {ver}: {BENCH_PY}")
    print(f"median of {opts.runs} runs; keyed count {opts.records:,} records over {opts.keys:,} keys; "
          f"NEXMark {opts.events:,} events; batches of {opts.round} per worker; ours: {opts.epoch_rounds} "
          f"batches per epoch; gc {opts.gc}", flush=True)

    plan = []
    for w in opts.workloads:
        if w == "count":
            plan.append(("count", opts.count_workers,
                         [opts.gc, str(opts.records), str(opts.keys), str(opts.round), str(opts.epoch_rounds)]))
        else:
            plan += [(w, n, [opts.gc, str(opts.events), str(opts.round), str(opts.epoch_rounds)]) for n in opts.workers]
    rows, failures = [], []
    for workload, workers, params in plan:
        ours, theirs = [], []
        for run in range(opts.runs):
            o = run_ours(workload, workers, params, opts.timeout)
            b = run_bytewax(workload, workers, params, opts.timeout)
            ours.append(o)
            theirs.append(b)
            agree = (o["inputs"], o["outputs"], o["checksum"]) == (b["inputs"], b["outputs"], b["checksum"])
            if not agree:
                failures.append((workload, workers, run, o, b))
            print(f"  {workload} x{workers} run {run + 1}: ours {o['rate']:>12,.0f}/s ({o['seconds']:.2f} s), "
                  f"bytewax {b['rate']:>12,.0f}/s ({b['seconds']:.2f} s); inputs {o['inputs']:,}; "
                  f"outputs ours {o['outputs']:,} bytewax {b['outputs']:,} -> {'agree' if agree else 'DIFFER'}"
                  + (f"; native generator ours {o['native_gen']} bytewax {b['native_gen']}" if run == 0
                     and workload != "count" else ""), flush=True)
        name = f"keyed count ({opts.keys:,} keys)" if workload == "count" else f"NEXMark {workload.upper()}"
        rows.append((name, workers, statistics.median(r["rate"] for r in ours),
                     statistics.median(r["rate"] for r in theirs), ours[0]["outputs"]))

    unit = "records/s"
    print()
    print(f"| workload | workers | ours {unit} | bytewax {unit} | ratio (ours/bytewax) | outputs (equal) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, workers, o, b, outputs in rows:
        print(f"| {name} | {workers} | {o:,.0f} | {b:,.0f} | {o / b:.2f}x | {outputs:,} |")
    print(f"(records/s = input records, or NEXMark events, per second of wall time; medians of {opts.runs} runs)")
    if failures:
        for workload, workers, run, o, b in failures:
            print(f"MISMATCH {workload} x{workers} run {run + 1}: ours {o} bytewax {b}", file=sys.stderr)
        raise SystemExit(1)
    print("outputs agree between the engines on every run")


if __name__ == "__main__":
    main()
