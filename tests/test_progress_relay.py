"""Progress through a relay (``progress="relay"``): every worker sends its progress batches to
worker 0, which forwards them, several to a message, to every other worker.

Real multi-process runs, plain and under the schedule fuzzer, against sequential oracles: an
exchange, a keyed count, a loop, several dataflows one after another; the launcher's
``--progress``; and a clear error where workers disagree on the mode. The protocol itself (safety
and completion under every interleaving, with 3 to 16 workers) is checked by
``test_progress_simulation.py`` in both modes.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
from conftest import launch_counting_job
from hypothesis import given, settings
from hypothesis import strategies as st
from test_megaphone_ops import check_pipelined_migrations, check_state_machine
from test_progress_simulation import SimAllocator, SimNetwork

import timely
from timely.errors import ProgressMismatchError
from timely.testing import run_epochs

EPOCHS = st.lists(st.lists(st.integers(0, 30), max_size=30), min_size=1, max_size=4)

pytestmark = pytest.mark.timeout(180)


@settings(max_examples=4, deadline=None)
@given(epochs=EPOCHS, seed=st.one_of(st.none(), st.integers(0, 2**32 - 1)), workers=st.integers(3, 5))
def test_an_exchange_and_a_keyed_count_match_the_sequential_result(epochs, seed, workers):
    got = run_epochs(lambda s: s.exchange(None).map(lambda x: x + 1), epochs, workers=workers, fuzz=seed,
                     progress="relay")
    assert got == [(e, sorted(x + 1 for x in r)) for e, r in enumerate(epochs) if r]
    counted = run_epochs(lambda s: s.map(lambda x: x % 7).count_by_key(), epochs, workers=workers, fuzz=seed,
                         progress="relay")
    want = [(e, sorted(Counter(x % 7 for x in r).items())) for e, r in enumerate(epochs) if r]
    assert counted == want


def _collatz_steps(worker):
    """A loop: every number walks its Collatz sequence to 1 through a feedback edge, exchanged by
    value at every round; the result is each start's number of steps."""
    starts = [int(a) for a in worker.args]
    with worker.dataflow() as scope:
        inp = scope.new_input()
        handle, back = scope.feedback(1)
        body = inp.stream.map(lambda n: (n, n, 0)).concat(back)
        step = body.filter(lambda r: r[1] != 1).map(
            lambda r: (r[0], r[1] // 2 if r[1] % 2 == 0 else 3 * r[1] + 1, r[2] + 1)).exchange(1)
        step.connect_loop(handle)
        done = body.filter(lambda r: r[1] == 1).capture()
    inp.send_batch(starts[worker.index::worker.peers])
    inp.close()
    worker.step_while(worker.has_dataflows, timeout=60)
    return [(s, n) for _, recs in done.batches for s, _, n in recs]


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


@pytest.mark.parametrize("fuzz", [None, 11, 12])
def test_a_loop_on_four_workers_matches_the_sequential_result(fuzz):
    starts = list(range(1, 60))
    results = timely.execute(_collatz_steps, workers=4, args=[str(s) for s in starts], fuzz=fuzz,
                             progress="relay", timeout=120)
    assert sorted(r for rs in results for r in rs) == [(s, _collatz(s)) for s in starts]


def _dataflows_in_turn(worker):
    """Three dataflows one after another, each run to completion, then one left to ``finish``."""
    totals = []
    for d in range(4):
        with worker.dataflow(f"round {d}") as scope:
            inp = scope.new_input()
            counts = inp.stream.map(lambda x: (x % 3, x)).reduce_by_key(lambda a, b: a + b).capture()
        inp.send_batch([x for x in range(100 * d, 100 * (d + 1)) if x % worker.peers == worker.index])
        inp.close()
        if d < 3:
            worker.step_while(worker.has_dataflows, timeout=60)
        else:
            worker.finish()
        totals.append(sorted(r for _, recs in counts.batches for r in recs))
    return totals


def test_dataflows_one_after_another_complete_on_every_worker():
    results = timely.execute(_dataflows_in_turn, workers=3, progress="relay", timeout=120)
    for d in range(4):
        want = sorted(Counter({k: sum(x for x in range(100 * d, 100 * (d + 1)) if x % 3 == k)
                               for k in range(3)}).items())
        assert sorted(r for res in results for r in res[d]) == want


@settings(max_examples=3, deadline=None)
@given(data=st.data(), seed=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_megaphone_migrations_match_the_sequential_result(data, seed):
    """Megaphone's state machine under random migrations, and with every epoch in flight, on 3
    workers: the running sums equal the sequential oracle, and every bin ends where the table says."""
    check_state_machine(3, data, fuzz=seed, progress="relay")
    check_pipelined_migrations(3, data, fuzz=seed, progress="relay")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="progress must be one of 'direct', 'relay', not 'gossip'"):
        timely.execute(lambda w: None, workers=2, progress="gossip")
    with pytest.raises(ValueError, match="not 'gossip'"):
        timely.execute(lambda w: None, progress="gossip")


@pytest.mark.parametrize("relay_is_direct", [True, False])
def test_workers_that_disagree_on_the_mode_get_a_clear_error(relay_is_direct):
    """Worker 0 (the relay) in one mode, the others in the other: the first worker to receive a
    batch that its mode cannot explain raises ProgressMismatchError naming both."""
    net = SimNetwork(3, random.Random(0))
    modes = ["direct", "relay", "relay"] if relay_is_direct else ["relay", "direct", "direct"]
    workers = [timely.Worker(SimAllocator(net, i), progress=m) for i, m in enumerate(modes)]
    for w in workers:
        with w.dataflow() as scope:
            scope.new_input().stream.exchange(None).probe()
    net.progress_channels.add(0)
    with pytest.raises(ProgressMismatchError, match="every worker must use the same progress mode"):
        for _ in range(50):
            for w in workers:
                w.step()
            while net.pending():
                net.deliver(net.pending()[0])


def test_the_launcher_takes_the_mode(tmp_path):
    counted = launch_counting_job(tmp_path, 3, "--progress", "relay")
    assert len(counted) == 3 and sum(counted) == 3 * 5 * 10


def _many_times_held(worker: timely.Worker) -> int:
    """An operator holds capabilities for 400 times, then drops them all in one step: each
    worker's progress batch of that step is ~3 KB, and the relay gets all of them at once."""
    with worker.dataflow() as scope:
        inp = scope.new_input()

        def constructor(cap, info):
            held = [cap.delayed(t) for t in range(1, 400)]
            cap.drop()

            def logic(input, output):
                for _ in input:
                    pass
                if input.frontier.is_empty():
                    while held:
                        held.pop().drop()

            return logic

        probe = inp.stream.unary_frontier(constructor).probe()
    inp.send(1)
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=30)
    return worker.index


@pytest.mark.timeout(120)
@pytest.mark.parametrize("progress", ["direct", "relay"])
def test_forwarded_batches_beyond_one_message_are_split(progress):
    """The relay forwards what it received in a step as several messages when together they exceed
    ``max_message_bytes`` (each batch whole); before, worker 0 failed with MessageTooLarge."""
    from timely.cluster import execute_cluster

    assert execute_cluster(_many_times_held, 3, progress=progress, timeout=60, max_message_bytes=4096) == [0, 1, 2]
