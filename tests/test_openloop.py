"""The open-loop measurement harness (nexmark.openloop, nexmark.metrics) shared by
bench/nexmark_bench.py and bench/migration.py, and the keyed-count run (nexmark.keyed)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import timely
from nexmark.metrics import INTERVAL, Timeline, percentiles, quantiles
from nexmark.model import Config
from nexmark.openloop import Completions, Schedule, acknowledged, latencies, start_together


@pytest.mark.parametrize("rate", [1, 999, 1000, 123_457, 1_000_000])
def test_schedule_epochs_match_the_nexmark_time_base(rate):
    """With 1 ms epochs, an epoch's first record is ``Config.first_event``; a measured phase that
    starts at ``origin`` continues the same numbering and counts its seconds from its start."""
    config = Config(rate=rate)
    for origin in (0, 37):
        s = Schedule(rate, 1, origin=origin)
        assert [s.first(e) for e in range(50)] == [config.first_event(origin + e) for e in range(50)]
        n = s.first(10)
        assert s.seconds(n) == pytest.approx(n / rate - origin / 1000)


def test_schedule_splits_every_epoch_between_the_workers():
    """Worker ``i`` of ``p`` owns records ``i, i + p, ...``: over the workers, an epoch's records are
    exactly ``[first(e), first(e + 1))``, each once, and positions run on without gaps."""
    rate, epoch_ms, peers, epochs = 7_919, 5, 3, 40
    scheds = [Schedule(rate, epoch_ms, i, peers) for i in range(peers)]
    for e in range(epochs):
        numbers = np.concatenate([s.numbers(e, e + 1) for s in scheds])
        assert sorted(numbers.tolist()) == list(range(scheds[0].first(e), scheds[0].first(e + 1)))
    for s in scheds:
        ends = [s.records(e)[1] for e in range(epochs)]
        assert [s.records(e)[0] for e in range(1, epochs)] == ends[:-1]
        assert s.records(0, epochs) == (0, ends[-1]) == (0, int(s.counts(0, epochs).sum()))
        assert (s.numbers(0, epochs) % peers == s.index).all()
    assert scheds[0].due(0.0) == 0 and scheds[0].due(0.0049) == 0 and scheds[0].due(0.005) == 1


class Probe:
    """A probe whose frontier is set by hand (times below ``at`` have passed)."""

    def __init__(self) -> None:
        self.at = 0
        self.watcher = None

    def less_equal(self, t: int) -> bool:
        return self.at <= t

    def watch(self, activator) -> None:
        self.watcher = activator

    def move(self, at: int) -> None:
        self.at = at
        if self.watcher is not None:
            self.watcher.activate()


def test_completions_follow_the_rounds_stamps():
    """A round's epochs complete together once the probe passes the round's stamp (which may be
    earlier than its epochs: a lagging driver's backlog), in order, at the time they were seen."""
    start = time.time()
    c = Completions(10, start)
    probe = Probe()
    c.sent(2, 0)  # epochs 0, 1 at time 0
    c.sent(2, 1)  # nothing new: ignored
    c.sent(6, 2)  # epochs 2..5 stamped 2
    assert c.poll(probe) == 0
    probe.move(1)
    assert c.poll(probe) == 2
    assert list(c.rounds) == [(2, 6)]
    c.watch(probe)
    c.step_started()
    stepped = c._step_start - start
    probe.move(3)  # the watched probe polls: charged at the step's start
    assert c.next == 6 and not c.rounds
    assert (c.completion[2:6] == stepped).all() and (c.completion[:2] <= stepped).all()
    assert np.isnan(c.completion[6:]).all()
    c.unwatch()
    c.sent(10, 3)
    probe.move(9)
    assert c.next == 6  # no longer watching
    assert c.poll(probe) == 10


def test_latencies_are_completion_minus_scheduled_time():
    s = Schedule(1000, 5, index=1, peers=2)  # 5 records per epoch: 2 or 3 of them (1, 3, 5, ...) here
    completion = np.array([0.010, 0.010, 0.030, np.nan])
    scheduled, lat = latencies(s, completion)
    assert np.allclose(scheduled, s.numbers(0, 4) / 1000)
    epoch_of = (scheduled * 1000 // 5).astype(int)
    assert np.allclose(lat[epoch_of < 3], completion[epoch_of[epoch_of < 3]] - scheduled[epoch_of < 3])
    assert np.isnan(lat[epoch_of == 3]).all()
    part = latencies(s, completion, 1, 3)
    assert np.allclose(part[1], lat[(epoch_of >= 1) & (epoch_of < 3)])
    acked = acknowledged(s, completion, 0.01)
    assert acked.tolist() == [0, int(s.counts(0, 2).sum()), 0, int(s.counts(2, 3).sum())]


def test_timeline_and_quantiles():
    """Histogram quantiles are bucket upper bounds within 4.4% above the exact ones; rows skip
    empty intervals; NaN samples are not counted."""
    rng = np.random.default_rng(1)
    scheduled = np.sort(rng.uniform(0, 3.0, 20_000))
    lat = rng.exponential(0.01, len(scheduled))
    lat[::100] = np.nan
    tl = Timeline(4.0)
    tl.record(scheduled, lat)
    rows = tl.rows()
    assert [r[0] for r in rows] == [i * INTERVAL for i in range(12)]
    assert sum(r[4] for r in rows) == np.isfinite(lat).sum()
    exact = percentiles(lat)
    p50, p99, mx = quantiles(tl.per_interval.sum(axis=0), (0.5, 0.99, 1.0))
    for approx, want in ((p50, exact["p50"]), (p99, exact["p99"]), (mx, exact["max"])):
        assert want <= approx * 1.001 and approx <= want * 1.045
    merged = Timeline.merged([tl.to_bytes(), tl.to_bytes()])
    assert merged.rows()[0][4] == 2 * rows[0][4]


def _starts(worker: timely.Worker) -> float:
    if worker.index == 1:
        time.sleep(0.3)  # late: the others wait for it
    return start_together(worker, delay=0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_start_together_agrees_on_one_start_after_everyone_is_ready(workers):
    before = time.time()
    starts = timely.execute(_starts, workers=workers)
    assert len(set(starts)) == 1
    assert starts[0] >= before + 0.05 + (0.3 if workers > 1 else 0.0)
    assert time.time() >= starts[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["batched", "restart"])
def test_keyed_count_run_counts_every_record_and_completes_every_epoch(mode):
    """``bench/migration.py``'s run (nexmark.keyed) on 2 workers, each a fresh interpreter as there:
    every scheduled record is counted once, across the migration or the restart, and every epoch's
    completion is recorded."""
    from nexmark.keyed import execute

    cfg = {"mode": mode, "rate": 4000, "duration": 1.0, "migrate_at": 0.5, "warmup": 0.1, "keys": 1000, "k": 4,
           "epoch_ms": 5, "gc": "freeze", "seed": 1, "profile": None}
    results = execute(cfg, 2, start="spawn", timeout=100)
    records = sum(Schedule(4000, 5, r["index"], 2).records(0, 200)[1] for r in results)
    assert records == Schedule(4000, 5).first(200) == 4000
    assert sum(r["total"] for r in results) == cfg["keys"] + records
    assert sum(r["distinct"] for r in results) == cfg["keys"]
    for r in results:
        completion = np.asarray(r["completion"])
        assert len(completion) == 200 and np.isfinite(completion).all() and (np.diff(completion) >= 0).all()
    if mode == "restart":
        assert all(r["info"]["transfer"]["entries"] > 0 for r in results)
    else:
        steps = results[0]["steps"]
        assert results[0]["all_steps_done"] and sum(s["bins"] for s in steps) == 8  # half of 2^4 bins
