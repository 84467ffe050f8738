"""One worker's part of ``bench/checkpoint.py`` (which describes the measurements).

A Megaphone keyed count (``megaphone.state_machine`` summing per key, 2^k bins) over ``keys``
pre-loaded keys, fed open loop (:mod:`nexmark.openloop`: records scheduled in advance from the
rate, whether or not the job keeps up) in epochs of ``epoch_ms``; measured epoch ``m`` is logical
time ``m + 1`` (time 0 is the pre-load), so checkpoint epochs every ``every`` logical times are
every ``every * epoch_ms`` ms. The wall-clock origin of the schedule is written to
``<dir>/start.json`` by the first run and read by every later one (a restart after a kill, or
the second half of a rescale): one schedule over every run, so records scheduled while the job
was down are a backlog and their latency counts the outage.

Measurement hooks (this process only): :func:`instrument` wraps the checkpoint store's
``write_part`` and ``commit`` and Megaphone's offer (the serialisation of dirty bins, on the
dataflow thread) to time each call; the runtime keeps only totals (``Checkpointer.stats()``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

import megaphone
import timely
from nexmark.openloop import Schedule, start_together
from timely import collector


def fold(key: Any, value: int, state: int | None) -> tuple[int, tuple]:
    """The keyed count: add the value to the key's sum (no output records)."""
    return (value if state is None else state + value), ()


@contextlib.contextmanager
def instrument(log: dict[str, list]) -> Iterator[None]:
    """While active, append ``[epoch, seconds, bytes, wall time]`` of every part write to
    ``log["parts"]``, ``[epoch, seconds, wall time]`` of every commit to ``log["commits"]`` and
    ``[epoch, seconds, dirty bins, seconds pickling]`` of every Megaphone offer (serialising the
    dirty bins (:class:`~megaphone.checkpoint.BinDump`) on the dataflow thread, then handing them over) to
    ``log["offers"]``, and the seconds of every whole bin serialised on the dataflow thread outside
    an offer (copy on write: S touched it before the writer thread got to it) to ``log["cow"]``."""
    from megaphone.checkpoint import BinCheckpoint, BinDump
    from timely.checkpoint.store import Store

    write_part, commit, offer, dumps = Store.write_part, Store.commit, BinCheckpoint._offer, BinDump.__call__
    pickling = [0.0]  # seconds serialising bins on the dataflow thread so far

    def timed_write(self: Store, epoch: int, worker: int, states: Any, meta: Any = None) -> dict:
        t0 = time.perf_counter()
        record = write_part(self, epoch, worker, states, meta)
        took = time.perf_counter() - t0
        size = os.path.getsize(self._path("parts", record["file"])) if self._local else -1
        log["parts"].append([epoch, took, size, time.time()])
        return record

    def timed_commit(self: Store, epoch: int, peers: int, parts: Any) -> Any:
        t0 = time.perf_counter()
        manifest = commit(self, epoch, peers, parts)
        log["commits"].append([epoch, time.perf_counter() - t0, time.time()])
        return manifest

    in_offer = [False]

    def timed_dumps(self: BinDump) -> bytes:
        if threading.current_thread() is not threading.main_thread() or self.blob is not None:
            return dumps(self)  # the checkpoint writer's thread (no stall), or serialised already
        t0 = time.perf_counter()
        try:
            return dumps(self)
        finally:
            took = time.perf_counter() - t0
            pickling[0] += took
            if not in_offer[0]:
                log.setdefault("cow", []).append(took)

    def timed_offer(self: BinCheckpoint, e: int) -> None:
        dirty = len(self.shared.dirty or ())
        t0, p0 = time.perf_counter(), pickling[0]
        in_offer[0] = True
        try:
            offer(self, e)
        finally:
            in_offer[0] = False
        log["offers"].append([e, time.perf_counter() - t0, dirty, pickling[0] - p0])

    patched = (timed_write, timed_commit, timed_offer, timed_dumps)
    Store.write_part, Store.commit, BinCheckpoint._offer, BinDump.__call__ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        Store.write_part, Store.commit, BinCheckpoint._offer, BinDump.__call__ = (  # type: ignore[method-assign]
            write_part, commit, offer, dumps)


def process_started() -> float:
    """When this process was started (``time.time()`` scale, about 10 ms resolution; NaN if unknown):
    its start in clock ticks since boot (``/proc/self/stat``) against the uptime (``/proc/uptime``)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float("nan")


def shared_start(worker: timely.Worker, folder: Path) -> float:
    """The schedule's wall-clock origin: agreed now by the first run (and written), read by later ones."""
    agreed = start_together(worker)  # every run builds this dataflow: the same shapes on a restart
    path = folder / "start.json"
    if path.exists():
        return float(json.loads(path.read_text())["start"])
    if worker.index == 0:
        tmp = folder / f"start.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"start": agreed}))
        tmp.replace(path)
    return agreed


@contextlib.contextmanager
def noting_stop(path: Path) -> Iterator[None]:
    """Write the wall time to ``path`` if the supervisor stops this worker (SIGTERM) inside."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ == "_Stopped":  # timely.cluster's SIGTERM exception
            path.write_text(json.dumps({"at": time.time()}))
        raise


def job(worker: timely.Worker) -> dict:
    """One worker's run of the configuration in ``worker.args[0]`` (JSON); its measurements."""
    entered = time.time()
    cfg = json.loads(worker.args[0])
    folder = Path(cfg["dir"])
    k = cfg["k"]
    index, peers = worker.index, worker.peers
    ck = worker.checkpoint
    resume = 0 if ck is None else ck.resume_epoch
    marker = folder / "killed.json"
    log: dict[str, list] = {"parts": [], "commits": [], "offers": []}
    with instrument(log), noting_stop(folder / f"stopped-{index}.json"):
        with worker.dataflow() as scope:
            data = scope.new_input("Data")
            control = megaphone.ControlInput(scope, k=k)
            mig = megaphone.state_machine(data.stream, control, 0, fold, name="Counts")  # restores its bins here
            probe = mig.probe
        built = time.time()
        preload_s = 0.0
        if resume == 0:  # pre-load: one record per key at time 0, this worker's share of the keys
            for part in np.array_split(np.arange(index, cfg["keys"], peers), max(1, cfg["keys"] >> 17)):
                data.send_batch([(key, 1) for key in part.tolist()])
            data.advance_to(1)
            control.advance_to(1)
            worker.step_while(lambda: probe.less_equal(0))
            preload_s = time.time() - built
        else:  # the checkpoint holds every time before `resume`
            data.advance_to(resume)
            control.advance_to(resume)
        gc_policy = collector.configure("freeze")  # the pre-loaded state is never garbage
        start = shared_start(worker, folder)
        result = drive(worker, cfg, data, control, probe, start, max(0, resume - 1))
        gc_policy.restore()
        if cfg.get("stop_at") is not None:  # rescale: let the checkpoint at the stop epoch be offered
            stop = result["stopped_at"] + 1  # the logical time after the last measured epoch sent
            data.advance_to(stop + 1)
            control.advance_to(stop + 1)
            worker.step_while(lambda: probe.less_equal(stop))
        data.close()
        control.close()
        worker.step_while(lambda: not probe.done())
        if ck is not None:
            ck.flush()  # the last parts written (and, on worker 0, committed) before we read the log
        state = mig.state()
    result.update(index=index, peers=peers, start=start, resume=resume, forked=process_started() - start,
                  entered=entered - start, built=built - start,
                  preload_s=preload_s, total=sum(state.values()), distinct=len(state), log=log,
                  killed=json.loads(marker.read_text()) if marker.exists() else None,
                  stopped=[json.loads(p.read_text())["at"] - start for p in sorted(folder.glob("stopped-*.json"))],
                  stats=None if ck is None else ck.stats())
    return result


def checkpointed(worker: timely.Worker, epoch: int) -> bool:
    """True once the job's newest complete checkpoint is of ``epoch`` or later."""
    ck = worker.checkpoint
    m = None if ck is None else ck.store.latest()
    return m is not None and m.epoch >= epoch


def drive(worker: timely.Worker, cfg: dict, data: Any, control: Any, probe: Any, start: float, first: int) -> dict:
    """Feed measured epochs ``first, ...`` on schedule (the backlog at once), until ``cfg["epochs"]``
    or the stop; kill this worker (at ``kill_at`` s, or later once a checkpoint after the pre-load's
    is complete) or migrate bins when ``cfg`` says; note when each epoch completes."""
    index, peers, epoch_ms, epochs = worker.index, worker.peers, cfg["epoch_ms"], cfg["epochs"]
    E = epoch_ms / 1000
    sched = Schedule(cfg["rate"], epoch_ms, index, peers)
    rng = np.random.default_rng([cfg["seed"], index, peers])
    keys = rng.integers(0, cfg["hot"] or cfg["keys"], sched.records(0, epochs)[1])
    completion = np.full(epochs, np.nan)
    last = epochs
    if cfg.get("stop_at") is not None:  # stop after the epochs before a checkpoint epoch (logical `stop`)
        every = cfg["every"]
        stop = max(every, math.ceil((cfg["stop_at"] / E + 1) / every) * every)
        last = min(epochs, stop - 1)  # measured epochs < stop - 1 have logical times < stop
    kill = cfg.get("kill_at") if index == cfg.get("victim") and not (Path(cfg["dir"]) / "killed.json").exists() else None
    controller = None
    if cfg.get("migrate_at") is not None and index == 0:
        controller = megaphone.Controller(control, probe)
    migrating = False
    cpu0 = None  # the process's CPU time (every thread) when the warm-up ended
    sent = done = first
    while done < last:
        now = time.time() - start
        if cpu0 is None and now >= cfg["warmup"]:
            cpu0 = time.process_time()
        due = min(sched.due(now), last)
        if kill is not None and now >= kill:
            kill = now + 0.25  # (the next look at the store)
            if checkpointed(worker, 2 * cfg["every"]):
                (Path(cfg["dir"]) / "killed.json").write_text(json.dumps({"at": time.time() - start, "worker": index}))
                os.kill(os.getpid(), signal.SIGKILL)
        while sent < due:
            lo, hi = sched.records(sent)
            if hi > lo:
                data.send_batch(list(zip(keys[lo:hi].tolist(), repeat(1, hi - lo))))
            sent += 1
            data.advance_to(sent + 1)
            control.advance_to(sent + 1)
        if controller is not None:
            if not migrating and now >= cfg["migrate_at"]:
                table = megaphone.balanced(1 << cfg["k"], peers)
                controller.start(megaphone.plan(table, tuple(0 for _ in table), cfg["strategy"], peers=peers))
                migrating = True
            controller.tick()
        worker.step_or_park(max(0.0, (due + 1) * E - (time.time() - start)) if sent == due else 0)
        now = time.time() - start
        while done < sent and not probe.less_equal(done + 1):  # measured epoch `done` is logical time done + 1
            completion[done] = now
            done += 1
    cpu_s = time.process_time() - (cpu0 or time.process_time())
    out: dict = {"first": first, "completion": completion.tolist(), "cpu_s": cpu_s,
                 "end": time.time() - start, "stopped_at": last if last < epochs else None}
    if controller is not None:  # (a step still in flight at the end has no completion)
        out["steps"] = [[e.issued_at - start if e.issued_at else None, e.completed_at - start if e.completed_at else None]
                        for e in controller.events]
    return out
