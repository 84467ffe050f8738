"""Progress seen from the user API: frontiers never go backwards, probes pass a time exactly when
its records have been processed, a held capability holds back downstream probes, no batch arrives
behind its operator's frontier, and every dataflow runs to completion when the job finishes.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import norm, property_on_workers, run, workers_param
from dataflows import halving_loop
from epoch_input import STEP_TIMEOUT, epochs_of, mine, send_epoch
from hypothesis import strategies as st

from timely.progress import less_equal

pytestmark = pytest.mark.timeout(60)


def frontier_regressions(history):
    """Pairs of consecutive frontiers where the later one is not >= the earlier one: each element of
    the new frontier must be >= some element of the old one (an empty frontier stays empty)."""
    bad = []
    for old, new in zip(history, history[1:]):
        for t in new:
            if not any(less_equal(s, t) for s in old):
                bad.append((old, new))
                break
    return bad


@property_on_workers(epochs=epochs_of(st.integers(0, 40), max_size=10))
def test_frontiers_never_go_backwards(workers, epochs):
    """Record every probe's frontier before each step (top level, after an exchange and an
    aggregation, and inside a nested loop): each is monotone in the partial order and ends empty."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            p_top = inp.stream.exchange(None).probe()
            p_count = inp.stream.count_by_key().probe()
            with scope.iterative() as inner:
                body = halving_loop(inner, inp.stream.enter(inner))
                p_inner = body.probe()
                p_left = body.filter(lambda x: x == 1).leave().probe()
        probes = [p_top, p_count, p_inner, p_left]
        history = [[] for _ in probes]

        def record():
            for hist, p in zip(history, probes):
                f = list(p.frontier)  # a snapshot: p.frontier is a live view
                if not hist or hist[-1] != f:
                    hist.append(f)
            return True

        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
            worker.step_while(lambda: record() and p_left.less_than(t + 1), timeout=STEP_TIMEOUT)
        inp.close()
        worker.step_while(lambda: record() and not all(p.done() for p in probes), timeout=STEP_TIMEOUT)
        record()
        return history

    for w, history in enumerate(run(main, workers)):
        for i, hist in enumerate(history):
            hist = [[norm(t) for t in f] for f in hist]
            assert frontier_regressions(hist) == [], f"worker {w} probe {i}: {hist}"
            assert hist[-1] == [], f"worker {w} probe {i} did not complete"
            # The inner probe really saw product times.
            if i == 2 and len(hist) > 1:
                assert all(isinstance(t, tuple) and len(t) == 2 for f in hist for t in f)


@property_on_workers(epochs=epochs_of(st.integers(-5, 5), max_epochs=5, max_size=10))
def test_probe_passes_exactly_when_epoch_processed(workers, epochs):
    """``probe.less_than(t + 1)`` stays true while the input holds ``t`` (however long we step), and
    once it turns false every record at times <= t has gone through the operators before the probe."""

    def main(worker):
        seen = defaultdict(int)
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = (inp.stream.broadcast()
                     .map(lambda x: x * 2)
                     .inspect_batch(lambda t, b: seen.__setitem__(t, seen[t] + len(b)))
                     .probe())
        log = []
        for t, recs in epochs:
            inp.advance_to(t)
            assert probe.less_than(t + 1) and probe.less_equal(t)
            inp.send_batch(mine(recs, worker))
            for _ in range(10):
                worker.step()
                assert probe.less_than(t + 1) and probe.less_equal(t), "probe passed an open epoch"
                assert not probe.done()
            inp.advance_to(t + 1)
            worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            assert not probe.less_equal(t)
            assert probe.less_equal(t + 1)
            # Our own input still holds t + 1, so the frontier is exactly {t + 1}.
            log.append((t, list(probe.frontier), sum(n for s, n in seen.items() if s <= t)))
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
        assert probe.frontier == [] and not probe.less_than(10 ** 9)
        return log

    for w, log in enumerate(run(main, workers)):
        running = 0
        for (t, recs), (t2, frontier, n_seen) in zip(epochs, log):
            running += len(recs)
            assert t2 == t
            assert list(frontier) == [t + 1]
            assert n_seen == running, f"worker {w}: probe passed {t} before all records were seen"


@property_on_workers(single=10, multi=2, release=st.integers(1, 4), data=st.lists(st.integers(0, 9), min_size=6, max_size=6))
def test_held_capability_blocks_downstream_probe(workers, release, data):
    """A ``unary_frontier`` operator holding its initial capability keeps the downstream probe at 0,
    while the upstream probe advances; once it drops the capability (on seeing the marker -1 at epoch
    ``release``) the downstream probe catches up. Records still flow meanwhile."""

    def main(worker):
        holds = []

        def gate(cap, info):
            held = [cap]

            def logic(inp, out):
                for c, batch in inp:
                    out.give_batch(c, [x for x in batch if x >= 0])
                    if -1 in batch and held:
                        held.pop().drop()
                holds.append(bool(held))
            return logic

        with worker.dataflow() as scope:
            inp = scope.new_input()
            upstream = inp.stream.broadcast()
            p_up = upstream.probe()
            gated = upstream.unary_frontier(gate, name="Gate")
            cap = gated.capture()
            p_down = gated.probe()
        log = []
        for t in range(6):
            if worker.index == 0:
                inp.send(data[t])
                if t == release:
                    inp.send(-1)
            inp.advance_to(t + 1)
            worker.step_while(lambda: p_up.less_than(t + 1), timeout=STEP_TIMEOUT)
            if t < release:
                for _ in range(5):
                    worker.step()
                if t < release - 1:
                    assert p_down.frontier == [0], p_down.frontier
                    assert p_down.less_than(1)
                else:
                    # Worker 0 may already be sending the marker (it is at most one epoch
                    # ahead): either still held, or released with the input at `release`.
                    f = p_down.frontier
                    assert f == [0] or (f and min(f) >= release), f
            else:
                worker.step_while(lambda: p_down.less_than(t + 1), timeout=STEP_TIMEOUT)
                assert p_down.frontier == [t + 1]
                for _ in range(3):
                    worker.step()
            # (another worker may be one epoch ahead: look at times <= t only)
            log.append(sorted(x for tt, recs in cap.extract() if tt <= t for x in recs))
        inp.close()
        worker.step_while(lambda: not p_down.done(), timeout=STEP_TIMEOUT)
        return log

    for w, log in enumerate(run(main, workers)):
        for t, seen in enumerate(log):
            # records went through while the capability was held (broadcast: every worker has all)
            assert seen == sorted(data[: t + 1]), (w, t)


@property_on_workers(epochs=epochs_of(st.tuples(st.integers(0, 5), st.integers(0, 100)), max_size=10))
def test_batches_never_arrive_behind_the_frontier(workers, epochs):
    """Safety: when an operator reads a batch at time t, its input frontier has not passed t."""
    def main(worker):
        violations = []

        def watch(cap, info):
            cap.drop()

            def logic(inp, out):
                for c, batch in inp:
                    if not inp.frontier.less_equal(c.time):
                        violations.append((c.time, list(inp.frontier)))
                    out.give_batch(c, batch)
            return logic

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = (inp.stream.unary(watch, exchange=0)
                     .unary_frontier(watch, exchange=1)
                     .probe())
        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
            # no waiting for the probe: let epochs overlap
            worker.step()
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
        return violations

    assert [v for v in run(main, workers) if v] == []



# ---------------------------------------------------------------------------------------------
# Completion
# ---------------------------------------------------------------------------------------------

@workers_param
def test_finish_completes_every_dataflow(workers):
    """Open inputs keep dataflows alive; ``worker.finish()`` closes them and runs every dataflow
    (including one with a loop and one whose input was never used) to completion."""

    def main(worker):
        with worker.dataflow() as scope:
            a = scope.new_input()
            h, loop = scope.feedback(2)
            a.stream.concat(loop).filter(lambda x: x > 0).map(lambda x: x - 1).connect_loop(h)
            p1 = a.stream.probe()
        with worker.dataflow() as scope:
            b = scope.new_input()
            p2 = b.stream.map(lambda x: x).probe()
        a.send(5)
        for _ in range(20):
            worker.step()
        before = (worker.has_dataflows(), p1.done(), p2.done())
        worker.finish()
        after = (worker.has_dataflows(), p1.done(), p2.done(), a.closed, b.closed)
        return before, after

    for before, after in run(main, workers):
        assert tuple(before) == (True, False, False)
        assert tuple(after) == (False, True, True, True, True)


@workers_param
def test_execute_finishes_after_main_returns(workers, tmp_path):
    """``main`` may return with open inputs and unprocessed data: execute closes the inputs and runs
    the dataflow to completion, so the per-epoch counts are still produced (written to files here,
    since worker processes share no memory)."""

    def main(worker):
        out = tmp_path / f"worker{worker.index}.txt"

        def write(kv):
            with open(out, "a") as f:
                f.write(f"{kv[0]} {kv[1]}\n")

        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.count_by_key().inspect(write)
        inp.send_batch(["x"] * (worker.index + 1) + ["y"])
        inp.advance_to(3)
        inp.send("x")
        return worker.index

    assert run(main, workers) == list(range(workers))
    lines = Counter()
    for f in tmp_path.iterdir():
        lines.update(f.read_text().split("\n")[:-1])
    expected = Counter([f"x {workers * (workers + 1) // 2}", f"y {workers}", f"x {workers}"])
    assert lines == expected


@workers_param
def test_a_probe_is_scheduled_on_frontier_changes_only_once_watched(workers):
    """Reading a probe needs no operator run: an unwatched probe operator is not scheduled when the
    frontier moves (it runs for records only). Once watched, it is, and each move wakes the watcher,
    also a watcher added while the dataflow runs."""

    def main(worker):
        woken = []

        class Watcher:
            def activate(self) -> None:
                woken.append(worker_probe.frontier.elements())

        with worker.dataflow() as scope:
            inp = scope.new_input()
            worker_probe = inp.stream.probe()
        core = worker._dataflows[0].operators[-1]  # the probe operator
        runs = []
        for epoch in range(1, 4):
            inp.advance_to(epoch)
            worker.step_while(lambda: worker_probe.less_than(epoch), timeout=STEP_TIMEOUT)
            runs.append(core.activations)
        worker_probe.watch(Watcher())
        for epoch in range(4, 7):
            inp.advance_to(epoch)
            worker.step_while(lambda: worker_probe.less_than(epoch) or len(woken) < epoch - 3,
                              timeout=STEP_TIMEOUT)
        inp.close()
        worker.finish()
        return runs, woken

    for runs, woken in run(main, workers):
        assert runs == [0, 0, 0], "an unwatched probe ran on frontier changes alone"
        assert woken == [[4], [5], [6], []]
