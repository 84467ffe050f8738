"""The schedule fuzzer: what it does to deliveries, and what it must never do."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, launch_counting_job, property_on_workers
from hypothesis import strategies as st

import timely
from timely.testing import bag, run_epochs

EPOCHS = st.lists(st.lists(st.integers(0, 50), max_size=40), min_size=1, max_size=4)


def deliveries(fuzz, epochs):
    """The ``(time, batch size)`` sequence one operator saw, and how often it ran with nothing to do."""

    def main(worker):
        seen, idle = [], [0]

        def recorder(cap, info):
            cap.drop()

            def logic(inp, out):
                got = False
                for c, batch in inp:
                    got = True
                    seen.append((c.time, len(batch)))
                    out.give_batch(c, batch)
                idle[0] += not got

            return logic

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.unary(recorder, name="Recorder").probe()
        for records in epochs:
            for r in records:
                inp.send_batch([r] * 8)  # one batch of 8 per record: many batches per time
            inp.advance_to(inp.time + 1)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=30)
        return seen, idle[0]

    return timely.execute(main, fuzz=fuzz)[0]


@property_on_workers(single=25, multi=4, epochs=EPOCHS, seed=st.integers(0, 2**32 - 1))
def test_nothing_is_lost_duplicated_or_moved_to_another_time(workers, epochs, seed):
    got = run_epochs(lambda s: s.exchange(None).map(lambda x: x + 1), epochs, workers=workers, fuzz=seed)
    want = [(e, sorted(x + 1 for x in r)) for e, r in enumerate(epochs) if r]
    assert got == want


def test_batches_are_split_reordered_and_delayed_and_operators_run_idle():
    epochs = [[1, 2, 3, 4], [5, 6, 7]]
    plain, plain_idle = deliveries(None, epochs)
    assert plain == [(0, 32), (1, 24)]  # a time's small batches queued together reach the logic as one
    split = reordered = idle = False
    for seed in range(20):
        seen, idle_runs = deliveries(seed, epochs)
        assert sorted(t for t, n in seen for _ in range(n)) == sorted(t for t, n in plain for _ in range(n))
        split |= any(n < 8 for _, n in seen)
        reordered |= any(a[0] > b[0] for a, b in zip(seen, seen[1:]))
        idle |= idle_runs > plain_idle
    assert split and reordered and idle


def test_a_seed_reproduces_its_schedule_on_one_worker():
    epochs = [[1, 2, 3, 4, 5], [6, 7, 8]]
    assert deliveries(7, epochs) == deliveries(7, epochs)
    assert any(deliveries(s, epochs) != deliveries(7, epochs) for s in range(8, 12))


def test_an_order_dependent_operator_fails_under_some_seed():
    """An operator that takes the first batch of a time as all of it is right on the plain schedule
    and wrong under the fuzzer: the fuzzer finds what it is for."""

    def first_batch_only(stream):
        def ctor(cap, info):
            cap.drop()
            seen = set()

            def logic(inp, out):
                for c, batch in inp:
                    if c.time not in seen:
                        seen.add(c.time)
                        out.give(c, len(batch))

            return logic

        return stream.unary(ctor, name="FirstBatch")

    epochs = [[1, 2, 3, 4, 5, 6]]
    assert run_epochs(first_batch_only, epochs) == [(0, [6])]
    assert any(run_epochs(first_batch_only, epochs, fuzz=seed) != [(0, [6])] for seed in range(10))


@pytest.mark.timeout(120)
def test_an_operator_that_keeps_the_last_record_of_a_time_fails_under_some_seed():
    """Records of one time have no order: a 'last write wins' operator, right when its input comes
    as one batch in the order sent, is wrong for some seed (the fuzzer delivers a split batch's
    later part first)."""

    def last_wins(stream):
        def ctor(cap, info):
            cap.drop()
            last = {}

            def logic(inp, out):
                for c, batch in inp:
                    if batch:
                        kept = last[c.time][0] if c.time in last else c.retain()
                        last[c.time] = (kept, batch[-1])
                for t in [t for t in last if not inp.frontier.less_equal(t)]:
                    c, record = last.pop(t)
                    out.give(c, record)
                    c.drop()

            return logic

        return stream.unary_frontier(ctor, name="LastWins")

    epochs = [list(range(10))]
    assert run_epochs(last_wins, epochs) == [(0, [9])]
    assert any(run_epochs(last_wins, epochs, fuzz=seed) != [(0, [9])] for seed in range(20))


def test_the_launcher_takes_a_fuzz_seed(tmp_path):
    """The counts are right under ``--fuzz``, and the workers run under the seed given (the counts
    alone would pass with the option dropped)."""
    counted = launch_counting_job(tmp_path, 2, "--fuzz", "3")
    assert len(counted) == 2 and sum(counted) == 2 * 5 * 10
    job = tmp_path / "seed.py"
    job.write_text("import sys\n"
                   "def main(worker):\n"
                   "    sys.stdout.write(f'worker {worker.index} fuzz {worker.fuzz}\\n')\n")
    out = subprocess.run([sys.executable, "-m", "timely.launch", "-w", "2", "--fuzz", "3", "--timeout", "60", str(job)],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["worker 0 fuzz 3", "worker 1 fuzz 3"]


def test_an_operator_that_assumes_it_runs_only_with_work_fails_under_some_seed():
    """An operator that takes a run without data for a frontier that passed everything it holds is
    right on the plain schedule; the fuzzer schedules operators whose data it holds back (one
    random operator per step found it for 1-2 seeds in 20)."""

    def idle_means_complete(stream):
        def ctor(cap, info):
            cap.drop()
            pending = {}

            def logic(inp, out):
                got = False
                for c, batch in inp:
                    got = True
                    if c.time not in pending:
                        pending[c.time] = [c.retain(), 0]
                    pending[c.time][1] += len(batch)
                if not got:
                    for t in sorted(pending):
                        c, n = pending.pop(t)
                        out.give(c, n)
                        c.drop()

            return logic

        return stream.unary_frontier(ctor, name="IdleMeansComplete")

    epochs = [list(range(6)), list(range(4)), list(range(5))]
    expected = [(t, [len(recs)]) for t, recs in enumerate(epochs)]
    assert run_epochs(idle_means_complete, epochs) == expected
    assert sum(run_epochs(idle_means_complete, epochs, fuzz=seed) != expected for seed in range(20)) >= 3


def test_bag_of_fuzzed_keyed_counts_matches_the_plain_run():
    epochs = [[i % 7 for i in range(100)], [i % 3 for i in range(30)]]
    plain = run_epochs(lambda s: s.count_by_key(), epochs, workers=2)
    for seed in range(3):
        fuzzed = run_epochs(lambda s: s.count_by_key(), epochs, workers=2, fuzz=seed)
        assert bag(r for _, rs in fuzzed for r in rs) == bag(r for _, rs in plain for r in rs)
        assert fuzzed == plain
