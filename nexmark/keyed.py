"""The keyed-count migration benchmark on one worker (``bench/migration.py``, which describes it).

A keyed count over pre-loaded keys, fed open-loop (:mod:`nexmark.openloop`) and measured while
half of its bins move: with Megaphone's state machine and one of its strategies, or with the
stop-and-restart baseline on a plain (non-migratable) operator. :func:`execute` runs one
configuration on worker processes; :func:`job` is one worker's part.
"""
from __future__ import annotations

import cProfile
import json
import math
import os
import pickle
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

import megaphone
import timely
from timely import collector, routing

from .metrics import GcPauses, RssSampler, max_rss_bytes, runqueue_wait
from .openloop import Completions, Schedule, start_together

#: Megaphone's strategies, each also with its bins copied ahead ("+precopy", megaphone.precopy) or
#: moved onto standby replicas kept since the pre-load ("+replica"); restart: stop-and-restart;
#: none: Megaphone without a migration (steady-state overhead).
MODES = (*megaphone.STRATEGIES, *(f"{s}+{x}" for x in ("precopy", "replica") for s in megaphone.STRATEGIES),
         "restart", "none")
DEFAULT_MODES = (*megaphone.STRATEGIES, "batched+precopy", "restart")
CHUNK = megaphone.operators.DEFAULT_CHUNK  # state entries per shipped message (Megaphone's default)


#: Dataflow time of the first measured epoch: time 0 is the pre-load, time 1 the standby replicas' request.
ORIGIN = 2
#: Epochs the control input runs ahead of the data by default (README, "Control one time ahead of
#: the data"); ``cfg["control_lead"]`` overrides it.
CONTROL_LEAD = 1


def logical(e: int, epoch_ms: int) -> int:
    """Dataflow time of measured epoch ``e``: the elapsed millisecond at which it starts, plus :data:`ORIGIN`."""
    return ORIGIN + e * epoch_ms


def epoch_of(time: int, epoch_ms: int) -> int:
    """The measured epoch of dataflow time ``time`` (the inverse of :func:`logical`)."""
    return (time - ORIGIN) // epoch_ms


def replica_table(table: tuple[int, ...], target: tuple[int, ...], peers: int) -> dict[int, int]:
    """A standby replica of every bin: on the worker a planned migration to ``target`` moves it to,
    else on the next worker."""
    return {b: t if t != w else (w + 1) % peers for b, (w, t) in enumerate(zip(table, target))}


def give_half(table: tuple[int, ...], to: Callable[[int], int]) -> tuple[int, ...]:
    """Every worker ``w`` that holds bins gives the first half of them (in bin order) to ``to(w)``."""
    owned: dict[int, list[int]] = {}
    for b, w in enumerate(table):
        owned.setdefault(w, []).append(b)
    new = list(table)
    for w, bins in owned.items():
        for b in bins[: len(bins) // 2]:
            new[b] = to(w)
    return tuple(new)


def scale_out(table: tuple[int, ...], active: int, peers: int) -> tuple[int, ...]:
    """The Megaphone paper's scale-out: every one of the ``active`` workers that hold bins gives the
    first half of its bins to a spare worker (``active + w % (peers - active)``)."""
    return give_half(table, lambda w: active + w % (peers - active))


def half_swap(table: tuple[int, ...], peers: int) -> tuple[int, ...]:
    """Every worker gives the first half of its bins to the next worker: half of all bins move and
    the load stays balanced."""
    return give_half(table, lambda w: (w + 1) % peers)


def fold(key: Any, value: int, state: int | None) -> tuple[int, tuple]:
    """The keyed count: add the value to the key's sum (no output records)."""
    return (value if state is None else state + value), ()


# -- the plain (non-migratable) operator of the stop-and-restart baseline ----------------------------

def table_partitioner(table: tuple[int, ...], k: int) -> Callable[[Any, Sequence, int], list]:
    """A static exchange by the bin routing table (the same Cython routing Megaphone uses)."""

    def partition(time: Any, batch: Sequence, peers: int) -> list:
        return routing.route_bins(batch, 0, k, table, peers)[0]

    return partition


def build_plain(worker: timely.Worker, table: tuple[int, ...] | None, k: int,
                state: dict) -> tuple[timely.InputHandle, timely.ProbeHandle]:
    """A dataflow: input -> exchange -> keyed count applying complete times in time order into
    ``state``. The exchange is timely's plain ``Exchange`` by key (``hash64(key) % peers``) when
    ``table`` is None, else by the bin routing ``table``. Returns ``(input, probe)``."""

    def count(cap: Any, info: Any) -> Callable[[Any, Any], None]:
        cap.drop()
        pending: dict = {}  # time -> (capability, batches)

        def logic(inp: Any, out: Any) -> None:
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
        pact = 0 if table is None else timely.Distribute(table_partitioner(table, k))
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

    def install(cap: Any, info: Any) -> Callable[[Any, Any], None]:
        cap.drop()

        def logic(inp: Any, out: Any) -> None:
            for _, batch in inp:
                for _, payload in batch:
                    new_state.update(pickle.loads(payload))

        return logic

    def by_owner(time: Any, batch: Sequence, peers: int) -> list:
        return [[m for m in batch if m[0] == w] for w in range(peers)]  # a message goes to the worker it names

    with worker.dataflow() as scope:
        inp = scope.new_input("StateIn")
        probe = inp.stream.unary(install, name="StateInstall", exchange=timely.Distribute(by_owner)).probe()
    while msgs:
        inp.send_batch([msgs.pop()])
    inp.close()
    worker.step_while(lambda: not probe.done())
    t2 = time.perf_counter()
    return new_state, {"serialise_s": t1 - t0, "exchange_install_s": t2 - t1, "bytes": nbytes,
                       "entries": len(new_state)}


# -- one run on one worker -----------------------------------------------------------------------

def job(worker: timely.Worker) -> dict:
    """One worker's run of the configuration in ``worker.args[0]`` (JSON); its measurements."""
    cfg = json.loads(worker.args[0])
    mode, k, epoch_ms = cfg["mode"], cfg["k"], cfg["epoch_ms"]
    index, peers = worker.index, worker.peers
    rss = RssSampler(0.05, start=0.0)  # absolute time.time() stamps
    lead = cfg.get("control_lead", CONTROL_LEAD)  # epochs the control input runs ahead of the data
    spare = cfg.get("spare", 0)  # workers that hold no bin until the migration scales out onto them
    active = peers - spare
    if not 0 <= spare < peers:
        raise ValueError(f"spare workers must be from 0 to {peers - 1} (the job's workers less one), not {spare}")
    table0 = megaphone.balanced(1 << k, active)
    target = scale_out(table0, active, peers) if spare else half_swap(table0, peers)
    sched = Schedule(cfg["rate"], epoch_ms, index, peers)
    epochs = math.ceil(cfg["duration"] * 1000 / epoch_ms - 1e-9)  # (float noise: 4.1 s of 5 ms is 820)
    keys = np.random.default_rng([cfg["seed"], index]).integers(0, cfg["keys"], sched.records(0, epochs)[1])

    if cfg.get("precopy_share") is not None:  # the copies' share of a worker's time (megaphone.precopy)
        megaphone.precopy.SHARE = cfg["precopy_share"]
    if cfg.get("precopy_max_share") is not None:  # and of an idle worker's time
        megaphone.precopy.MAX_SHARE = cfg["precopy_max_share"]
    if cfg.get("precopy_chunk") is not None:  # entries per copy chunk: what a peer's message may wait for
        megaphone.precopy.CHUNK = cfg["precopy_chunk"]
    if cfg.get("precopy_arrears") is not None:  # how long a late slice may catch up on its pace
        megaphone.precopy.MAX_ARREARS = cfg["precopy_arrears"]
    control = mig = None
    state: dict = {}
    if mode == "restart":
        # timely's plain exchange until the restart (by the bin table when some workers are spare)
        data, probe = build_plain(worker, table0 if spare else None, k, state)
    else:
        with worker.dataflow() as scope:
            data = scope.new_input("Data")
            control = megaphone.ControlInput(scope, k=k, workers=active if spare else None)
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
    strategy, _, extra = mode.partition("+")
    if control is not None and extra == "replica":  # standby replicas of the pre-loaded bins, staged
        if index == 0:
            control.replicate(replica_table(table0, target, peers))
        data.advance_to(ORIGIN)
        control.advance_to(ORIGIN)
        assert mig is not None
        copied = mig.copied
        worker.step_while(lambda: copied.less_equal(1))
    preload_s = time.time() - t_load
    controller = None
    if control is not None and index == 0:  # before the common start: it imports networkx (~0.2 s)
        assert mig is not None
        controller = megaphone.Controller(control, probe, copied=mig.copied)
    gc_policy = collector.configure(cfg["gc"])  # the pre-loaded state and schedule are never garbage
    start = start_together(worker)

    E = epoch_ms / 1000
    completions = Completions(epochs, start)
    completions.watch(probe)
    migrate_at = cfg["migrate_at"]
    pause_epoch = int(math.ceil(migrate_at / E))
    info: dict = {}
    cpu = {"start": time.process_time(), "wait_start": runqueue_wait()}
    gc_pauses = GcPauses()  # collector pauses, timed from the common start
    gc_pauses.start(time.perf_counter() - (time.time() - start))
    profiler = cProfile.Profile() if cfg.get("profile") else None
    if profiler is not None:
        profiler.enable()
    sent = 0
    closed = started = restarted = False
    while completions.next < epochs:
        now = time.time() - start
        due = min(sched.due(now), epochs)
        if now >= migrate_at and "migrate" not in cpu:
            cpu["migrate"], cpu["wait_migrate"] = time.process_time(), runqueue_wait()
            if mig is not None and extra == "replica":  # what the replicas' refreshes cost so far
                reps = mig.replicas().values()
                info["replicas"] = {"bins": len(reps), "refreshes": sum(r["refreshes"] for r in reps),
                                    "entries": sum(r["entries"] for r in reps),
                                    "bytes": sum(r["bytes"] for r in reps)}
        if mode == "restart" and not restarted and due > pause_epoch:
            due = pause_epoch  # paused: records keep being scheduled, not sent
            info.setdefault("pause", pause_epoch * E)  # records scheduled from here on are held
        while sent < due:
            lo, hi = sched.records(sent)
            if hi > lo:
                data.send_batch(list(zip(keys[lo:hi].tolist(), repeat(1, hi - lo))))
            completions.sent(sent + 1, logical(sent, epoch_ms))
            sent += 1
            data.advance_to(logical(sent, epoch_ms))
            if control is not None:
                # Ahead of the data by `lead` epochs: a step goes out at a time whose records are
                # not sent yet, so its table is final, and its bins can leave, while the epoch
                # before it completes (README, "Control one time ahead of the data").
                control.advance_to(logical(sent + lead, epoch_ms))
        if controller is not None:
            if not started and now >= migrate_at and mode != "none":
                controller.start(megaphone.plan(table0, target, strategy, peers=peers), precopy=extra == "precopy")
                started = True
            controller.tick()
        if sent == epochs and not closed:
            data.close()
            if control is not None:
                control.close()
            closed = True
        gc_policy.tick()
        completions.step_started()
        worker.step_or_park(max(0.0, (due + 1) * E - (time.time() - start)) if sent == due else 0)
        completions.poll()
        if mode == "restart" and not restarted and "pause" in info and completions.next >= pause_epoch:
            info["drained"] = time.time() - start
            completions.unwatch()
            data.close()
            worker.step_while(lambda: not probe.done())
            state, info["transfer"] = transfer_state(worker, state, target, k)
            data, probe = build_plain(worker, target, k, state)
            completions.watch(probe)
            data.advance_to(logical(sent, epoch_ms))
            restarted = True
            info["resume"] = time.time() - start
    end_wall = time.time() - start
    cpu["end"], cpu["wait_end"] = time.process_time(), runqueue_wait()
    gc_pauses.stop()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(cfg["profile"], f"migration-{mode}-w{index}.prof"))
    completions.unwatch()
    gc_policy.restore()
    worker.step_while(lambda: not probe.done())
    samples = rss.stop()

    if mig is not None:
        state, owned = mig.state(), len(mig.owned_bins())
    else:
        owned = None
    total, distinct = sum(state.values()), len(state)
    result = {
        "index": index, "start": start, "preload_s": preload_s, "completion": completions.completion.tolist(),
        "end": end_wall, "rss": [(t - start, b) for t, b in samples], "max_rss": max_rss_bytes(),
        "total": total, "distinct": distinct, "cpu": cpu, "owned_bins": owned, "info": info,
        "gc": gc_pauses.as_dict(),
        "events": [dict(e, worker=index) for e in (mig.events if mig is not None else [])],
    }
    if controller is not None:
        result["steps"] = [{"index": e.index, "bins": len(e.moves), "time": e.issue_time, "copy_time": e.copy_time,
                            "copy": None if e.copy_at is None else e.copy_at - start,
                            "issued": None if e.issued_at is None else e.issued_at - start,
                            "completed": None if e.completed_at is None else e.completed_at - start,
                            "duration": e.duration} for e in controller.events]
        result["all_steps_done"] = not controller.busy
    return result


def execute(cfg: dict, workers: int, *, start: str = "fork", timeout: float | None = None) -> list[dict]:
    """One run on ``workers`` workers; each worker's measurements. ``start`` and ``timeout`` are
    ``timely.execute``'s (``bench/migration.py`` starts every worker as a fresh interpreter)."""
    return timely.execute(job, workers=workers, args=[json.dumps(cfg)], start=start, timeout=timeout)
