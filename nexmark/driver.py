"""The open-loop driver of one worker in ``bench/nexmark.py`` (Megaphone's ``nexmark/src/bin/timely.rs``).

Every worker keeps its own clock. Epochs are wall-clock milliseconds since the worker started;
event ``n`` is scheduled at ``n / rate`` seconds (interleaved: worker ``i`` of ``p`` sends events
``n = i, i + p, ...``). Each round, at epoch ``target``, the worker sends every one of its events
scheduled before ``target`` at its inputs' current epoch, then advances the inputs to ``target``.
Like the reference harness it sends a new round only once the output probe has passed the previous
round's epoch, so a stalled dataflow gets the backlog in one larger batch, charged from the
scheduled times.

A round's records are acknowledged when the probe passes the epoch they were sent at; each record's
latency is the acknowledgement time minus its scheduled time.

Worker 0 owns the migration controller: at each ``migrate_at`` time it plans a move to the next
target table (alternately ``skewed`` and back to ``balanced``) with the chosen strategy and issues
its steps one at a time.

``history`` seconds of the schedule can be replayed before the measured phase, as fast as the
dataflow takes them (closed loop, not measured): the query then starts the measured phase with the
state it would have after running that long (the paper migrates after 400 s). The measured phase
continues the same event stream and epochs where the history ends; its times (latency samples,
``migrate_at``) count from its own start.
"""
from __future__ import annotations

import gc
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import megaphone
import timely

from .generator import Generator
from .metrics import INTERVAL, GcPauses, Timeline, rss_bytes
from .model import Config, Params
from .queries import QUERIES, Streams


@dataclass
class Spec:
    """One benchmark run."""

    query: str
    flex: bool = False
    rate: int = 100_000  # events per second, all workers together
    duration: float = 10.0  # seconds of input
    workers: int = 1
    time_dilation: int = 1
    seed: int = 0
    bins: int = 8  # k: 2^k Megaphone bins
    migration: str | None = None  # "all_at_once" | "fluid" | "batched" (Megaphone variants only)
    migrate_at: list[float] = field(default_factory=list)  # seconds after the start
    params: dict = field(default_factory=dict)  # overrides of Params fields
    in_flight_auctions: int = 100
    progress: bool = True  # a progress bar on worker 0
    drain_timeout: float = 120.0  # seconds to wait for the output after the input ends
    gc: str = "tuned"  # "tuned" (freeze + rare collections), "paced", "off" or "default"
    history: float = 0.0  # seconds of the schedule replayed closed-loop before the measured phase
    skew: float = 0.5  # migrations: the fraction of its bins each odd worker gives away (0.5: 25% of all)

    def config(self) -> Config:
        """The generator configuration."""
        return Config(rate=self.rate, time_dilation=self.time_dilation, seed=self.seed,
                      in_flight_auctions=self.in_flight_auctions)

    def query_params(self) -> Params:
        """The query parameters (time dilation included)."""
        return Params(**{**self.params, "d": self.time_dilation}).check()

    def as_dict(self) -> dict:
        """A msgpack-friendly copy."""
        return asdict(self)


class _Progress:
    """A progress bar over the run's seconds (tqdm if installed, else a line on stderr)."""

    def __init__(self, total: float, label: str, enabled: bool) -> None:
        self.total = total
        self.shown = 0
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=int(total), desc=label, unit="s", file=sys.stderr, leave=False)
            except ImportError:
                self.bar = None
        self.label = label

    def update(self, elapsed: float, note: str = "") -> None:
        sec = int(min(elapsed, self.total))
        if not self.enabled or sec <= self.shown:
            return
        if self.bar is not None:
            self.bar.update(sec - self.shown)
            if note:
                self.bar.set_postfix_str(note)
        else:
            print(f"\r{self.label}: {sec}/{int(self.total)} s {note}", end="", file=sys.stderr, flush=True)
        self.shown = sec

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def _targets(controller: Any, peers: int, count: int, fraction: float) -> list[tuple[int, ...]]:
    """Target tables of successive migrations: skewed, balanced, skewed, ..."""
    from megaphone.plan import balanced, skewed

    base = balanced(controller.bins, peers)
    return [skewed(base, fraction, peers) if i % 2 == 0 else base for i in range(count)]


PACE = 0.05  # seconds between the young collections of the ``paced`` collector


def _configure_gc(mode: str) -> None:
    """The collector during the measured phase: ``tuned`` freezes everything built so far and
    collects young objects rarely (full collections over large query state cost pauses that grow
    with the state); ``paced`` freezes too and leaves collections to :func:`_paced_collection`;
    ``off`` disables it; ``default`` leaves Python's settings."""
    if mode == "default":
        return
    gc.collect()
    gc.freeze()
    if mode in ("off", "paced"):
        gc.disable()
    elif mode == "tuned":
        gc.set_threshold(50_000, 50, 1000)
    else:
        raise ValueError(f"gc mode must be 'tuned', 'paced', 'off' or 'default', not {mode!r}")


def _paced_collection() -> None:
    """The ``paced`` collector's beat: collect the young generation (the objects allocated since
    the last beat, so the pause stays proportional to ``PACE``, not to how long the run has gone),
    then freeze the survivors: they are long-lived state, which no later collection traverses.
    Cyclic garbage among survivors is not reclaimed (the trade-off of ``gc.freeze``)."""
    gc.collect(0)
    gc.freeze()


class WorkerRun:
    """One worker's part of a run: builds the dataflow, then drives it open-loop."""

    def __init__(self, spec: Spec, worker: timely.Worker) -> None:
        self.spec = spec
        self.worker = worker
        self.config = spec.config()
        self.gen = Generator(self.config, worker.index, worker.peers)
        with worker.dataflow("start barrier") as scope:
            self.barrier = scope.new_input("Barrier")
            self.barrier_probe = self.barrier.stream.probe()
        with worker.dataflow() as scope:
            self.inputs = [scope.new_input(name) for name in ("Persons", "Auctions", "Bids")]
            streams = Streams(*(i.stream for i in self.inputs))
            self.control = megaphone.ControlInput(scope, bins=spec.bins) if spec.flex else None
            out = QUERIES[spec.query].build(streams, spec.query_params(), self.control)
            self.produced = 0
            out = out.inspect_batch(self._count, name="Count")
            self.probe = out.probe()
        self.controller: Any = None
        self.targets: list = []
        if self.control is not None and worker.index == 0 and spec.migration:
            from megaphone.controller import Controller

            self.controller = Controller(self.control, self.probe)
            self.targets = _targets(self.controller, worker.peers, len(spec.migrate_at), spec.skew)
        self.migrations = sorted(spec.migrate_at)
        self.timeline = Timeline(spec.duration)
        self.history = int(spec.history * 1000)  # epochs replayed before the measured phase
        self.end_epoch = self.history + int(spec.duration * 1000)
        self.acked = [0] * (int(spec.duration / INTERVAL) + 8)  # records acknowledged per 250 ms
        self.rounds: deque = deque()  # (epoch sent at, first event number, end event number)
        self.rss: list[tuple[float, int]] = []
        self.stamp = 0  # the inputs' current epoch
        self.last_stamp = 0  # the epoch the previous round was sent at
        self.sent = 0
        self.done_sending = False
        self.start = 0.0

    def _count(self, time: Any, batch: Any) -> None:
        self.produced += len(batch)

    def _feed(self, target: int) -> int:
        """Send every event scheduled before ``target`` at the current epoch, advance the inputs
        (and the control input) to ``target``; return the number of events sent."""
        batch = self.gen.until(self.config.first_event(target))
        for inp, recs in zip(self.inputs, batch):
            if recs:
                inp.send_batch(recs)
        self.last_stamp, self.stamp = self.stamp, target
        for inp in self.inputs:
            inp.advance_to(target)
        if self.control is not None:
            self.control.advance_to(target)
        return batch.total

    def send_round(self, target: int, now: float) -> None:
        """A measured round: :meth:`_feed`, remembered for its latencies; start a due migration."""
        lo, stamp = self.gen.next, self.stamp
        self.sent += self._feed(target)
        self.rounds.append((stamp, lo, self.gen.next))
        self.done_sending = target >= self.end_epoch
        if self.controller is not None and self.migrations and now >= self.migrations[0]:
            self.migrations.pop(0)
            self.controller.rebalance(self.targets.pop(0), self.spec.migration)

    def acknowledge(self) -> None:
        """Record the latencies of the rounds the output probe has passed."""
        while self.rounds and not self.probe.less_equal(self.rounds[0][0]):
            ack = time.perf_counter() - self.start
            _, lo, hi = self.rounds.popleft()
            n = np.arange(lo, hi, self.worker.peers, dtype=np.int64)
            self.timeline.record(n / self.config.rate - self.history / 1000, ack)
            self.acked[min(int(ack / INTERVAL), len(self.acked) - 1)] += len(n)

    def replay_history(self, round_epochs: int = 20, in_flight: int = 3) -> None:
        """Send the history's events (epochs ``[0, history)``) as fast as the dataflow takes them,
        ``round_epochs`` epochs per round and at most ``in_flight`` rounds ahead of the output probe;
        return once the probe has passed the history."""
        probe, worker = self.probe, self.worker
        progress = _Progress(self.history / 1000, f"{self.spec.query} history",
                             self.spec.progress and worker.index == 0)
        started = time.perf_counter()
        while self.stamp < self.history:
            target = min(self.stamp + round_epochs, self.history)
            self._feed(target)
            worker.step_while(lambda: probe.less_than(target - in_flight * round_epochs), timeout=600)
            progress.update(target / 1000, f"{(time.perf_counter() - started):.0f} s")
        worker.step_while(lambda: probe.less_than(self.history), timeout=600)
        self.last_stamp = self.stamp
        self.produced = 0  # the measured phase counts its own output
        progress.close()
        if worker.index == 0 and self.spec.progress:
            print(f"history: {self.history / 1000:g} s of events ({self.gen.next:,} in all) "
                  f"replayed in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    def drive(self) -> dict:
        """Synchronise the workers' clocks, run the schedule, then run the dataflow to completion."""
        spec, worker, probe = self.spec, self.worker, self.probe
        if self.history:
            self.replay_history()
        progress = _Progress(spec.duration, f"{spec.query}{'-flex' if spec.flex else ''}",
                             spec.progress and worker.index == 0)
        # The collector first (a full collection over a large state takes seconds, and longer on one
        # worker than on another), then start every worker's clock together: the barrier's probe
        # passes 1 once all have advanced. Every epoch needs every worker's clock to reach it, so
        # an offset between the clocks would add to the latency of the workers ahead.
        _configure_gc(spec.gc)
        self.barrier.advance_to(1)
        worker.step_while(lambda: self.barrier_probe.less_than(1), timeout=60)
        self.barrier.close()
        self.start = start = time.perf_counter()
        gc_pauses = GcPauses()
        gc_pauses.start(start)
        cpu_start = time.process_time()
        wall_start = time.time()
        next_rss = 0.0
        next_gc = PACE if spec.gc == "paced" else float("inf")
        while True:
            now = time.perf_counter() - start
            target = min(self.history + int(now * 1000), self.end_epoch)
            # A new round once the probe has passed the previous round's epoch (as the reference).
            if not self.done_sending and target > self.stamp and not probe.less_than(self.last_stamp):
                self.send_round(target, now)
            if self.controller is not None:
                self.controller.tick()
            self.acknowledge()
            if now >= next_rss:
                self.rss.append((now, rss_bytes()))
                next_rss = now + 0.1
                progress.update(now, f"backlog {len(self.rounds)} rounds")
            if now >= next_gc:
                _paced_collection()
                next_gc = now + PACE
            if self.done_sending and not self.rounds:
                break  # every record sent has been through the output
            if self.done_sending and now > spec.duration + spec.drain_timeout:
                raise TimeoutError(f"worker {worker.index}: output incomplete {spec.drain_timeout} s after the input "
                                   f"(output frontier {probe.frontier()}, input at {self.stamp}, "
                                   f"{len(self.rounds)} rounds unacknowledged, oldest at {self.rounds[0][0]})")
            if self.done_sending or self.rounds or probe.less_than(self.stamp):
                worker.step_or_park(0.0005)
            else:  # caught up: wait for the next millisecond (or a message)
                next_ms = (self.stamp - self.history + 1) / 1000  # the next epoch, in measured seconds
                worker.step_or_park(max(0.0, next_ms - (time.perf_counter() - start)))
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        gc_pauses.stop()
        progress.close()
        steps = []
        for e in (self.controller.events if self.controller is not None else []):
            d = e.as_dict()
            d["issued_rel"] = None if e.issued_at is None else e.issued_at - wall_start
            d["completed_rel"] = None if e.completed_at is None else e.completed_at - wall_start
            steps.append(d)
        # Close the inputs (windows still open flush now; not measured) and run to completion.
        for inp in self.inputs:
            inp.close()
        if self.control is not None:
            self.control.close()  # a migration still running at the end is cut short
        worker.finish()
        return {"worker": worker.index, "sent": self.sent, "produced": self.produced, "elapsed": elapsed,
                "cpu": cpu, "timeline": self.timeline.to_bytes(), "acked_per_interval": self.acked,
                "rss": self.rss, "peak_rss": max([rss_bytes(), *(r for _, r in self.rss)]), "steps": steps,
                "gc": gc_pauses.as_dict()}


def job(spec: Spec) -> Any:
    """The per-worker ``main`` for ``timely.execute``."""

    def main(worker: timely.Worker) -> dict:
        return WorkerRun(spec, worker).drive()

    return main


def run(spec: Spec) -> list[dict]:
    """Run ``spec`` on ``spec.workers`` workers; one result dict per worker."""
    return timely.execute(job(spec), workers=spec.workers)


def _child(spec: Spec, conn: Any) -> None:
    try:
        conn.send(("ok", run(spec)))
    except BaseException as e:  # report, do not hang the parent
        import traceback

        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_isolated(spec: Spec) -> list[dict]:
    """Like :func:`run`, in a fresh process (so that peak memory and the heap belong to this run)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, child), name=f"nexmark-{spec.query}")
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"benchmark process for {spec.query} died (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark run failed: {payload}")
    return payload
