"""The open-loop driver of one worker in ``bench/nexmark_bench.py`` (Megaphone's ``nexmark/src/bin/timely.rs``).

The workers agree on a common start (:func:`nexmark.openloop.start_together`). Epochs are
wall-clock milliseconds since the start; event ``n`` is scheduled at ``n / rate`` seconds
(interleaved: worker ``i`` of ``p`` sends events ``n = i, i + p, ...``; see
:class:`nexmark.openloop.Schedule`). Each round, at epoch ``target``, the worker sends every one of
its events scheduled before ``target`` at its inputs' current epoch, then advances the inputs to
``target``. Like the reference harness it sends a new round only once the output probe has passed
the previous round's epoch, so a stalled dataflow gets the backlog in one larger batch, charged
from the scheduled times.

A round's records are acknowledged when the probe passes the epoch they were sent at
(:class:`nexmark.openloop.Completions`); each record's latency is the acknowledgement time minus
its scheduled time, binned into histograms after the measured phase.

Worker 0 owns the migration controller: at each ``migrate_at`` time it plans a move to the next
target table (alternately ``skewed`` and back to ``balanced``) with the chosen strategy and issues
its steps one at a time. The control input runs ``control_lead`` epochs (default 1) ahead of the
inputs, so a step's table is final before its epoch's events arrive. ``+precopy`` copies each
step's bins ahead; ``+replica`` keeps a standby replica of every bin, requested in the history's
last round (staged before the measured phase) on the worker the first migration moves it to, so
that migration ships only what changed since the replica's last refresh.

``history`` seconds of the schedule can be replayed before the measured phase, as fast as the
dataflow takes them (closed loop, not measured): the query then starts the measured phase with the
state it would have after running that long (the paper migrates after 400 s). The measured phase
continues the same event stream and epochs where the history ends; its times (latency samples,
``migrate_at``) count from its own start.
"""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import megaphone
import timely
from timely import collector

from .columnar import COLUMNAR_QUERIES, event_source, lookup
from .keyed import CONTROL_LEAD, replica_table
from .metrics import INTERVAL, GcPauses, Timeline, rss_bytes
from .model import Config, Params
from .openloop import Completions, Schedule, acknowledged, latencies, start_together
from .queries import Streams

#: Epochs (ms) of latencies binned at a time after the measured phase (bounds the memory it takes).
CHUNK = 1000


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
    k: int = 8  # 2^k Megaphone bins
    migration: str | None = None  # "all_at_once" | "fluid" | "batched" (Megaphone variants only)
    migrate_at: list[float] = field(default_factory=list)  # seconds after the start
    params: dict = field(default_factory=dict)  # overrides of Params fields
    in_flight_auctions: int = 100
    progress: bool = True  # a progress bar on worker 0
    drain_timeout: float = 120.0  # seconds to wait for the output after the input ends
    gc: str = "tuned"  # the collector in the measured phase: one of timely.collector.POLICIES
    history: float = 0.0  # seconds of the schedule replayed closed-loop before the measured phase
    skew: float = 0.5  # migrations: the fraction of its bins each odd worker gives away (0.5: 25% of all)
    checkpoint: str | None = None  # take checkpoints there (timely.checkpoint): Megaphone's bins
    checkpoint_every: int = 1000  # epochs (of 1 ms) between checkpoints
    progress_mode: str = "direct"  # how progress travels between the workers (timely.execute's progress)
    control_lead: int = CONTROL_LEAD  # epochs the control input runs ahead of the data (0: in lockstep)

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
    base = megaphone.balanced(controller.nbins, peers)
    return [megaphone.skewed(base, fraction, peers) if i % 2 == 0 else base for i in range(count)]


class WorkerRun:
    """One worker's part of a run: builds the dataflow, then drives it open-loop."""

    def __init__(self, spec: Spec, worker: timely.Worker) -> None:
        self.spec = spec
        self.worker = worker
        self.config = spec.config()
        self.gen = event_source(spec.query, self.config, worker.index, worker.peers)
        with worker.dataflow() as scope:
            self.inputs = [scope.new_input(name) for name in ("Persons", "Auctions", "Bids")]
            streams = Streams(*(i.stream for i in self.inputs))
            self.control = megaphone.ControlInput(scope, k=spec.k) if spec.flex else None
            out = lookup(spec.query).build(streams, spec.query_params(), self.control)
            self.produced = 0
            count = self._count_rows if spec.query in COLUMNAR_QUERIES else self._count
            out = out.inspect_batch(count, name="Count")
            self.probe = out.probe()
        self.controller: Any = None
        self.targets: list = []
        if self.control is not None and worker.index == 0 and spec.migration:
            self.controller = megaphone.Controller(self.control, self.probe)  # copies ahead: control.copied
            self.targets = _targets(self.controller, worker.peers, len(spec.migrate_at), spec.skew)
        self.migrations = sorted(spec.migrate_at)
        self.strategy, _, self.extra = str(spec.migration).partition("+")  # "batched+precopy", "batched+replica"
        if self.extra == "replica" and not spec.migrate_at:  # (the replicas are of the first migration's target)
            raise ValueError(f"migration {spec.migration!r} needs a time to migrate at (migrate_at is empty)")
        self.replica_time: int | None = None  # when the standby replicas were requested
        self.history = int(spec.history * 1000)  # epochs replayed before the measured phase
        self.schedule = Schedule(spec.rate, 1, worker.index, worker.peers, origin=self.history)
        self.epochs = int(spec.duration * 1000)  # measured epochs
        self.completions = Completions(self.epochs, 0.0)
        self.rss: list[tuple[float, int]] = []
        self.stamp = 0  # the inputs' current epoch
        self.last_stamp = 0  # the epoch the previous round was sent at
        self.sent = 0
        self.rounds = 0  # measured rounds sent
        self.done_sending = False

    def _count(self, time: Any, batch: Any) -> None:
        self.produced += len(batch)

    def _count_rows(self, time: Any, batch: Any) -> None:
        """:meth:`_count` for a columnar query, whose records are RecordBatches."""
        self.produced += sum(b.num_rows for b in batch)

    def _feed(self, target: int) -> int:
        """Send every event scheduled before epoch ``target`` at the current epoch, advance the
        inputs to ``target`` and the control input to ``target`` plus the spec's ``control_lead``;
        return the number of events this worker generated (a columnar query's batches hold its
        bids only: counted as events, as the schedule and ``rate`` count them)."""
        before = self.gen.next
        batch = self.gen.until(self.config.first_event(target))
        for inp, recs in zip(self.inputs, batch):
            if recs:
                inp.send_batch(recs)
        self.last_stamp, self.stamp = self.stamp, target
        for inp in self.inputs:
            inp.advance_to(target)
        if self.control is not None:
            # Ahead of the data: a step issued now goes out at a time whose events are not sent
            # yet, so its table is final while the epoch before it completes (README, "Control
            # one time ahead of the data").
            self.control.advance_to(target + self.spec.control_lead)
        # (the cursor steps by peers: this worker's events are every peers-th event number)
        return (self.gen.next - before) // self.worker.peers

    def send_round(self, due: int, now: float) -> None:
        """A measured round up to measured epoch ``due``: :meth:`_feed`, announced to the
        completions; start a due migration."""
        stamp = self.stamp
        self.sent += self._feed(self.history + due)
        self.rounds += 1
        self.completions.sent(due, stamp)
        self.done_sending = due >= self.epochs
        if self.controller is not None and self.migrations and now >= self.migrations[0]:
            self.migrations.pop(0)
            self.controller.rebalance(self.targets.pop(0), self.strategy, precopy=self.extra == "precopy")

    def request_replicas(self) -> None:
        """Worker 0 asks for a standby replica of every bin (``+replica``), at the control input's
        current time: on the worker the first planned migration moves it to, else on the next worker."""
        assert self.control is not None
        self.replica_time = self.control.time  # the request's time (ahead of the inputs by the lead)
        if self.controller is not None:
            self.control.replicate(replica_table(self.controller.planned_table, self.targets[0], self.worker.peers))

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
            if target == self.history and self.extra == "replica" and self.control is not None:
                self.request_replicas()  # of the state the history built, before its last round
            self._feed(target)
            worker.step_while(lambda: probe.less_than(target - in_flight * round_epochs), timeout=600)
            progress.update(target / 1000, f"{(time.perf_counter() - started):.0f} s")
        worker.step_while(lambda: probe.less_than(self.history), timeout=600)
        if self.replica_time is not None and self.control is not None:  # replicas staged before measuring
            copied, asked = self.control.copied, self.replica_time
            worker.step_while(lambda: copied.less_equal(asked), timeout=600)
        self.last_stamp = self.stamp
        self.produced = 0  # the measured phase counts its own output
        progress.close()
        if worker.index == 0 and self.spec.progress:
            print(f"history: {self.history / 1000:g} s of events ({self.gen.next:,} in all) "
                  f"replayed in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    def drive(self) -> dict:
        """Replay the history, start with the other workers, run the schedule, then run the
        dataflow to completion; the worker's figures."""
        spec, worker, probe, completions = self.spec, self.worker, self.probe, self.completions
        if self.history:
            self.replay_history()
        elif self.extra == "replica" and self.control is not None:
            self.request_replicas()  # no history: replicas of empty bins, copied in the first round
        progress = _Progress(spec.duration, f"{spec.query}{'-flex' if spec.flex else ''}",
                             spec.progress and worker.index == 0)
        # The collector first (a full collection over a large state takes seconds, and longer on one
        # worker than on another), then the common start.
        with collector.configure(spec.gc) as gc_policy:
            completions.start = start = start_together(worker)
            gc_pauses = GcPauses()
            gc_pauses.start(time.perf_counter())
            cpu_start = time.process_time()
            next_rss = 0.0
            while True:
                now = time.time() - start
                due = min(self.schedule.due(now), self.epochs)
                # A new round once the probe has passed the previous round's epoch (as the reference).
                if not self.done_sending and self.history + due > self.stamp and not probe.less_than(self.last_stamp):
                    self.send_round(due, now)
                if self.controller is not None:
                    self.controller.tick()
                completions.poll(probe)
                if now >= next_rss:
                    self.rss.append((now, rss_bytes()))
                    next_rss = now + 0.1
                    progress.update(now, f"backlog {len(completions.rounds)} rounds")
                gc_policy.tick()
                if self.done_sending and not completions.rounds:
                    break  # every record sent has been through the output
                if self.done_sending and now > spec.duration + spec.drain_timeout:
                    raise TimeoutError(f"worker {worker.index}: output incomplete {spec.drain_timeout} s after the "
                                       f"input ({probe!r}, input at {self.stamp}, "
                                       f"{len(completions.rounds)} rounds unacknowledged, oldest at "
                                       f"{completions.rounds[0][0]})")
                if self.done_sending or completions.rounds or probe.less_than(self.stamp):
                    worker.step_or_park(0.0005)
                else:  # caught up: wait for the next millisecond (or a message)
                    worker.step_or_park(max(0.0, (due + 1) / 1000 - (time.time() - start)))
            elapsed = time.time() - start
            cpu = time.process_time() - cpu_start
            gc_pauses.stop()
        progress.close()
        steps = []
        for e in (self.controller.events if self.controller is not None else []):
            d = e.as_dict()
            d["issued_rel"] = None if e.issued_at is None else e.issued_at - start
            d["copy_rel"] = None if e.copy_at is None else e.copy_at - start  # its copy ahead requested
            d["completed_rel"] = None if e.completed_at is None else e.completed_at - start
            steps.append(d)
        # Close the inputs (windows still open flush now; not measured) and run to completion.
        for inp in self.inputs:
            inp.close()
        if self.control is not None:
            self.control.close()  # a migration still running at the end is cut short
        worker.finish()
        peak_rss = max([rss_bytes(), *(r for _, r in self.rss)])
        timeline = Timeline(spec.duration)
        for lo in range(0, self.epochs, CHUNK):
            timeline.record(*latencies(self.schedule, completions.completion, lo, min(lo + CHUNK, self.epochs)))
        return {"worker": worker.index, "sent": self.sent, "produced": self.produced, "elapsed": elapsed,
                "cpu": cpu, "rounds": self.rounds, "timeline": timeline.to_bytes(),
                "acked_per_interval": acknowledged(self.schedule, completions.completion, INTERVAL).tolist(),
                "rss": self.rss, "peak_rss": peak_rss, "steps": steps,
                "gc": gc_pauses.as_dict()}


def worker_main(spec: Spec, worker: timely.Worker) -> dict:
    """One worker's run of ``spec``: its figures (:func:`run` hands ``functools.partial(worker_main,
    spec)`` to ``timely.execute``, picklable for ``start="spawn"``)."""
    return WorkerRun(spec, worker).drive()


def run(spec: Spec, *, start: str = "fork", timeout: float | None = None) -> list[dict]:
    """Run ``spec`` on ``spec.workers`` workers; one result dict per worker. ``start`` and
    ``timeout`` are ``timely.execute``'s: ``start="spawn"`` makes every worker a fresh interpreter,
    so that its memory readings are its own run's."""
    return timely.execute(functools.partial(worker_main, spec), workers=spec.workers, start=start, timeout=timeout,
                          checkpoint=spec.checkpoint, checkpoint_every=spec.checkpoint_every,
                          progress=spec.progress_mode)
