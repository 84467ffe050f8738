"""NEXMark: the generator, and every query (native and Megaphone) against the sequential reference.

Each query runs on 6000 events (60 epochs) on 1, 2 and 3 workers; its output, a multiset of
``(epoch, record)``, must equal :mod:`nexmark.reference` on the same events. The Megaphone variant
must give the same output while worker 0 moves random bins to random workers at random epochs.
Event time runs 3x faster than epochs (time dilation 3). A third test stamps runs of 1-4 epochs at
their first epoch, as a driver that falls behind does (each worker its own runs); both variants must
still match.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from conftest import workers_param

from nexmark.generator import Generator
from nexmark.harness import CHECK_CONFIG, CHECK_PARAMS, Run, diff, execute, expected, random_moves
from nexmark.model import Config, Params
from nexmark.queries import QUERIES

queries_param = pytest.mark.parametrize("query", sorted(QUERIES))

EVENTS = 6000
CONFIG = replace(CHECK_CONFIG, seed=11)
PARAMS = CHECK_PARAMS["wide"]
_expected: dict = {}


def reference(run: Run) -> Counter:
    """The reference output, cached per query and stamping (each worker stamps its own share with
    ``batching``)."""
    key = (run.query, run.config, run.params, run.events, run.batching, run.workers if run.batching is not None else None)
    if key not in _expected:
        _expected[key] = expected(run)
    return _expected[key]


def check(run: Run) -> None:
    want = reference(run)
    assert sum(want.values()) > 0, "the test configuration yields no output for this query"
    got = execute(run)
    assert got == want, f"{run.query} ({'megaphone' if run.flex else 'native'}, {run.workers} workers):\n" + diff(got, want)


# -- the generator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["native", "numpy"])
@pytest.mark.timeout(60)
def test_generator_is_deterministic_and_split_by_event_number(backend):
    config = Config(rate=1_000_000, seed=3)
    whole = Generator(config, backend=backend).events(0, 20_000)
    assert whole == Generator(config, backend=backend).events(0, 20_000)
    for peers in (2, 3):
        parts = [Generator(config, i, peers, chunk=333, backend=backend) for i in range(peers)]
        merged: list[list] = [[], [], []]
        for hi in (1, 17, 4000, 4001, 12_345, 20_000):  # uneven cursor steps across chunk edges
            for g in parts:
                for kind, recs in zip(merged, g.until(hi)):
                    kind.extend(recs)
        for kind, recs in zip(merged, whole):
            assert sorted(kind) == sorted(recs)
    assert Generator(Config(rate=1_000_000, seed=4), backend=backend).events(0, 20_000) != whole


@pytest.mark.timeout(60)
def test_native_and_numpy_generators_agree():
    for config in (Config(rate=1_000_000), Config(rate=50_000, time_dilation=79, seed=-5, in_flight_auctions=7),
                   Config(seed=2**63 + 11), Config(seed=2**64 + 3), Config(seed=-(2**63) - 1)):  # any seed: its low 64 bits
        assert Generator(config, backend="native").events(0, 200_000) == \
            Generator(config, backend="numpy").events(0, 200_000)
        for peers in (2, 3):
            native = Generator(config, peers - 1, peers, backend="native")
            numpy = Generator(config, peers - 1, peers, chunk=1000, backend="numpy")
            for hi in (5, 999, 1000, 7777, 30_000):
                assert native.until(hi) == numpy.until(hi)


@pytest.mark.timeout(60)
def test_generator_proportions_ids_and_times():
    config = Config(rate=50_000, time_dilation=2)
    persons, auctions, bids = Generator(config).events(0, 50_000)
    assert (len(persons), len(auctions), len(bids)) == (1000, 3000, 46_000)
    assert [p[0] for p in persons] == list(range(1000, 2000))
    assert [a[0] for a in auctions] == list(range(1000, 4000))
    assert all(a[6] > a[5] and a[4] >= a[3] > 0 for a in auctions)
    assert all(100 <= b[2] <= 100_000_000 for b in bids)
    assert bids[-1][3] == config.date_time(49_999) == (49_999 * 1000 * 2) // 50_000
    hot = Counter(a[7] for a in auctions).most_common(1)[0]
    assert hot[0] % 100 == 0 and hot[1] > len(auctions) // 20  # hot sellers are multiples of 100
    assert Counter(b[0] % 100 == 0 for b in bids)[True] > len(bids) // 3  # half the bids: hot auctions
    open_now = [a for a in auctions if a[5] <= bids[-1][3] < a[6]]
    assert 0 < len(open_now) < 4 * config.in_flight_auctions


# -- the queries -------------------------------------------------------------------------------------

@workers_param
@queries_param
@pytest.mark.timeout(120)
def test_native_query_matches_reference(query, workers):
    check(Run(query, CONFIG, EVENTS, PARAMS, workers=workers))


@workers_param
@queries_param
@pytest.mark.timeout(120)
def test_megaphone_query_with_migrations_matches_reference(query, workers):
    run = Run(query, CONFIG, EVENTS, PARAMS, workers=workers, flex=True, k=4)
    run.moves = random_moves(seed=int(query[1:]) * 10 + workers, epochs=run.epochs, k=run.k,
                             workers=workers, count=6)
    if workers > 1:  # some bin really leaves its initial worker (bin b starts on b % workers)
        assert any(w != b % workers for m in run.moves.values() for b, w in m.items())
    check(run)


@workers_param
@queries_param
@pytest.mark.timeout(120)
def test_queries_with_batched_stamps(query, workers):
    """Runs of epochs stamped early (a lagging driver): native and Megaphone both match."""
    for flex in (False, True):
        run = Run(query, CONFIG, EVENTS, PARAMS, workers=workers, flex=flex, batching=workers + 17)
        if flex:
            run.moves = random_moves(seed=workers, epochs=run.epochs, k=run.k, workers=workers)
        check(run)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("migration, lead", [("batched", 1), ("batched", 0), ("batched+replica", 1)])
def test_driver_history_then_measured_phase_with_migration(migration, lead):
    """``bench/nexmark_bench.py --history``: the first second of events is replayed before measuring, the
    measured phase continues the same stream (and migrates bins while it runs). The measured phase
    sends exactly its own events, and its output is exactly the reference output at its epochs
    (a pair of Q3 is emitted in the measured phase iff one of its records belongs to it). With
    ``+replica`` the bins have standby replicas, requested in the history's last round, on the
    workers the migration moves them to. The control input runs ``lead`` epochs ahead of the data
    (the default 1) or in lockstep (0)."""
    from nexmark.driver import Spec, run

    spec = Spec(query="q3", flex=True, rate=20_000, duration=1.5, history=1.0, workers=2, k=4,
                migration=migration, migrate_at=[0.5], progress=False, drain_timeout=60, control_lead=lead)
    results = run(spec)
    first, end = spec.config().first_event(1000), spec.config().first_event(2500)
    assert sum(r["sent"] for r in results) == end - first
    want = expected(Run("q3", spec.config(), end, spec.query_params()))
    measured = sum(n for (epoch, _), n in want.items() if epoch >= 1000)
    assert measured > 0
    assert sum(r["produced"] for r in results) == measured
    steps = results[0]["steps"]
    assert steps and all(s["completed_rel"] is not None for s in steps)


def test_median_table_medians_and_all_at_once_ratio():
    """``--runs``: each figure is the median over a configuration's runs, and a strategy's ratio is
    all-at-once's median migration maximum over its own (same query and rate)."""
    from nexmark.report import Summary, median_table

    def run(strategy, mig_max, p50):
        s = Summary(label=f"q3-megaphone-{strategy}", rate=1000, duration=1.0, workers=2, sent=1000, produced=1,
                    elapsed=1.0, cpu=1.0, overall=[0.001, p50, 0.003, 0.004, 0.005, 0.006, mig_max], timeline=[],
                    acked=[], peak_rss=[1 << 20])
        s.query, s.strategy = "q3", strategy
        s.migration = {0: {"max_latency": mig_max, "duration": 0.5, "max_step": mig_max / 2}}
        return s

    text = median_table([[run("all_at_once", x, 0.002) for x in (0.3, 0.1, 0.2)],
                         [run("batched", x, p) for x, p in ((0.02, 0.001), (0.05, 0.009), (0.01, 0.003))]])
    aao, batched = text.splitlines()[2:]
    assert aao.split()[-2:] == ["1.0x", "3/3"] and "200.0ms" in aao
    assert "20.0ms" in batched and "3.0ms" in batched  # median max latency, median p50
    assert batched.split()[-2] == "10.0x"  # 200 ms / 20 ms


@pytest.mark.parametrize("field", ["active_people", "in_flight_auctions", "hot_seller_ratio", "hot_auction_ratio",
                                   "hot_bidder_ratio", "hot_ratio_2", "num_categories", "person_proportion",
                                   "auction_proportion"])
def test_config_refuses_a_zero_divisor(field):
    # A zero here killed a worker with SIGFPE in the native generator (and made the numpy one wrong).
    with pytest.raises(ValueError, match=f"Config.{field} must be at least 1, not 0"):
        Config(**{field: 0})
    with pytest.raises(ValueError, match="Config.bid_proportion must not be negative"):
        Config(bid_proportion=-1)


@pytest.mark.parametrize("query", ["q4", "q6"])
def test_megaphone_closed_auctions_keep_auction_zero(query):
    """Config accepts first_auction_id=0; the Megaphone closed-auction timers encoded 'close' and
    'expire' by the auction id's sign, so auction 0 never closed (its winning bid never reached
    Q4 or Q6) and its pending bids never expired."""
    config = replace(CHECK_CONFIG, seed=11, first_auction_id=0)
    run = Run(query, config, 3000, CHECK_PARAMS["wide"], workers=1, flex=True)
    got, want = execute(run), expected(run)
    assert got == want, diff(got, want)


def test_params_refuse_a_zero_q2_skip():
    # Q2 keeps the auctions whose id is a multiple of q2_skip: zero failed inside the operator.
    with pytest.raises(ValueError, match="q2_skip must be at least 1, not 0"):
        Params(q2_skip=0).check()


def test_the_benchmarks_param_option_parses_q3_states():
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    sys.path.insert(0, bench)
    try:
        from nexmark_bench import parse_params
    finally:
        sys.path.remove(bench)
    assert parse_params(["q3_states=OR, WA", "q2_skip=7"]) == {"q3_states": ("OR", "WA"), "q2_skip": 7}
    with pytest.raises(SystemExit, match="q2_skip needs an integer, not 'x'"):
        parse_params(["q2_skip=x"])


def test_query_builders_check_their_params():
    """Params that Params.check() refuses were accepted by the builders: Q5 with a window not a
    multiple of its slide silently used window // slide slices, a zero window failed with a bare
    ZeroDivisionError inside an operator."""
    from nexmark.columnar import COLUMNAR_QUERIES
    from nexmark.model import Params
    from nexmark.queries import QUERIES

    for name, params, message in (("q5", Params(d=3, q5_window_ms=10, q5_slide_ms=4), "multiple of q5_slide_ms"),
                                  ("q7", Params(d=3, q7_window_ms=0), "q7_window_ms")):
        for control in (None, object()):
            with pytest.raises(ValueError, match=message):
                QUERIES[name].build(None, params, control)  # (checked before the streams are touched)
        col = COLUMNAR_QUERIES.get(f"{name}-col")
        if col is not None:
            with pytest.raises(ValueError, match=message):
                col.build(None, params)


def test_a_precopied_migration_starts_at_its_first_copy_ahead():
    """NEXMark's migration figures began at the first hand-over, leaving out the first step's
    copy ahead (bench/migration.py counts from the copy): shorter by construction."""
    from types import SimpleNamespace

    from nexmark.report import migration_metrics

    steps = [{"migration": 0, "moves": [[0, 1]], "copy_rel": 4.0, "issued_rel": 5.0, "completed_rel": 5.5,
              "duration": 0.5},
             {"migration": 0, "moves": [[1, 1]], "copy_rel": 5.0, "issued_rel": 6.0, "completed_rel": 6.5,
              "duration": 0.5},
             {"migration": 1, "moves": [[2, 0]], "copy_rel": None, "issued_rel": 8.0, "completed_rel": 8.2,
              "duration": 0.2}]
    # timeline rows: (bucket start, p50, p99, max)
    timeline = [(t / 4, 1.0, 2.0, 30.0 if t == 16 else 3.0) for t in range(40)]
    got = migration_metrics(SimpleNamespace(steps=steps, timeline=timeline, duration=10.0))
    assert got[0]["start"] == 4.0 and got[0]["duration"] == pytest.approx(2.5)
    assert got[0]["max_latency"] == 30.0  # the bucket at 4.0 s, during the first copy
    assert got[1]["start"] == 8.0 and got[1]["duration"] == pytest.approx(0.2) and got[1]["max_latency"] == 3.0
