"""Run a query on a finite event range and compare it with the reference (tests and ``--check``).

Events are sent at their own epoch (``epoch(n)``), or with ``batching`` in runs of 1-4 epochs
stamped with the run's first epoch (as an open-loop driver that falls behind sends them); every
worker generates its interleaved share, and with ``batching`` draws its own runs (each driver
falls behind on its own, so a later epoch may bring an earlier event time than an earlier one).
For the Megaphone variants worker 0 may issue random bin moves at random epochs; the output must
not change. ``fuzz`` runs the workers under the engine's schedule fuzzer (``timely.execute(...,
fuzz=SEED)``: batches split, reordered and delayed, operators scheduled with nothing to do).
"""
from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import megaphone
import timely

from .columnar import COLUMNAR_QUERIES, event_source, lookup, output_rows
from .generator import Generator
from .model import Config, Params
from .queries import Streams
from .reference import REFERENCE, Stamped

#: The small event stream of the checks (tests and ``--check``): 100 events per epoch, event time
#: 3x faster than epochs, 20 auctions in flight.
CHECK_CONFIG = Config(rate=100_000, time_dilation=3, in_flight_auctions=20)

#: Query parameters of the checks (``d=3``: an epoch spans 3 ms of event time): windows of several
#: epochs; windows and slides of exactly one epoch; windows shorter than one epoch (then an epoch,
#: and a batch, holds several slices and window ends).
CHECK_PARAMS: dict[str, Params] = {
    "wide": Params(d=3, q5_window_ms=36, q5_slide_ms=9, q7_window_ms=15, q8_window_ms=60, q2_skip=7),
    "epoch": Params(d=3, q5_window_ms=3, q5_slide_ms=3, q7_window_ms=3, q8_window_ms=3, q2_skip=7),
    "sub-epoch": Params(d=3, q5_window_ms=2, q5_slide_ms=1, q7_window_ms=2, q8_window_ms=2, q2_skip=7),
}


@dataclass
class Run:
    """One harness run: the query, the events ``[0, events)``, and how to run it."""

    query: str
    config: Config
    events: int
    params: Params = field(default_factory=Params)
    workers: int = 1
    flex: bool = False
    k: int = 4  # 2^k bins for the Megaphone variants
    moves: dict[int, dict[int, int]] = field(default_factory=dict)  # epoch -> {bin: worker} (worker 0 issues)
    lag: int = 2  # epochs the driver lets the output fall behind before stepping
    batching: int | None = None  # seed: send runs of 1-4 epochs at the run's first epoch (lagging drivers)
    fuzz: int | None = None  # seed of the engine's schedule fuzzer (``timely.execute(..., fuzz=)``)
    timeout: float | None = None  # seconds the run may take (``timely.execute``'s: stops the workers)

    @property
    def epochs(self) -> int:
        """Epochs spanned by the events."""
        return self.config.epoch(self.events - 1) + 1 if self.events else 0

    def rounds(self, worker: int) -> list[tuple[int, int]]:
        """``(stamp, end)`` per round of ``worker``: its events of epochs ``[stamp, end)`` are sent
        at epoch ``stamp``."""
        if self.batching is None:
            return [(e, e + 1) for e in range(self.epochs)]
        rng = random.Random(f"{self.batching}:{worker}")
        out, e = [], 0
        while e < self.epochs:
            step = rng.randint(1, 4)
            out.append((e, e + step))
            e += step
        return out


def random_moves(seed: int, epochs: int, k: int, workers: int, count: int = 4) -> dict[int, dict[int, int]]:
    """``count`` random migrations (1-4 of the ``2^k`` bins each to random workers) at random epochs."""
    rng = random.Random(seed)
    nbins = 1 << k
    moves: dict[int, dict[int, int]] = {}
    for e in sorted(rng.sample(range(epochs), min(count, epochs))):
        moves[e] = {rng.randrange(nbins): rng.randrange(workers) for _ in range(rng.randint(1, 4))}
    return moves


def stamped_events(run: Run) -> Stamped:
    """The events ``[0, run.events)``, each with the epoch the harness sends it at."""
    out = Stamped([], [], [])
    for worker in range(run.workers):
        gen = Generator(run.config, worker, run.workers)
        for stamp, end in run.rounds(worker):
            for kind, recs in zip(out, gen.until(min(run.config.first_event(end), run.events))):
                kind.extend((stamp, r) for r in recs)
    return out


def _main(run: Run, worker: timely.Worker) -> list:
    """One worker's part of :func:`execute`: its captured output batches."""
    gen = event_source(run.query, run.config, worker.index, worker.peers)
    with worker.dataflow() as scope:
        inputs = [scope.new_input(name) for name in ("Persons", "Auctions", "Bids")]
        streams = Streams(*(i.stream for i in inputs))
        control = megaphone.ControlInput(scope, k=run.k) if run.flex else None
        out = lookup(run.query).build(streams, run.params, control)
        captured = out.capture()
        probe = out.probe()
    for stamp, end in run.rounds(worker.index):
        moves = {b: w for e in range(stamp, end) for b, w in run.moves.get(e, {}).items()}
        if control is not None and worker.index == 0 and moves:
            control.moves(moves)
        batch = gen.until(min(run.config.first_event(end), run.events))
        for inp, recs in zip(inputs, batch):
            if recs:
                inp.send_batch(recs)
        for inp in inputs:
            inp.advance_to(end)
        if control is not None:
            control.advance_to(end)
        worker.step_while(lambda: probe.less_than(end - run.lag), timeout=120)
    for inp in inputs:
        inp.close()
    if control is not None:
        control.close()
    worker.finish()
    return [(t, output_rows(recs)) for t, recs in captured.batches]


def _norm(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_norm(y) for y in x)
    return x


def execute(run: Run) -> Counter:
    """The query's output over all workers, as a multiset of ``(epoch, record)``."""
    results = timely.execute(functools.partial(_main, run), workers=run.workers, fuzz=run.fuzz,
                               timeout=run.timeout)
    return Counter((t, _norm(r)) for per_worker in results for t, recs in per_worker for r in recs)


def expected(run: Run) -> Counter:
    """The reference output for the same events (it depends on ``run.workers`` only with
    ``batching``: each worker stamps its share on its own)."""
    query = COLUMNAR_QUERIES[run.query].same_as if run.query in COLUMNAR_QUERIES else run.query
    return REFERENCE[query](stamped_events(run), run.params)


def diff(got: Counter, want: Counter, limit: int = 5) -> str:
    """A short description of how two outputs differ ('' if equal)."""
    if got == want:
        return ""
    extra, missing = got - want, want - got
    lines = [f"{sum(extra.values())} unexpected, {sum(missing.values())} missing (of {sum(want.values())})"]
    lines += [f"  unexpected {x!r}" for x in sorted(extra, key=repr)[:limit]]
    lines += [f"  missing    {x!r}" for x in sorted(missing, key=repr)[:limit]]
    return "\n".join(lines)
