"""The ends of a dataflow: a probe shared by two streams (``probe_with``), ``capture`` and ``sink``,
over several epochs of random input, against sequential per-epoch oracles."""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import bag, norm, property_on_workers, run
from epoch_input import STEP_TIMEOUT, epochs_of, epochs_of2, feed1, mine, small_ints, words
from oracles import global_oracle, hash_worker, sliced_pair_oracle, timed

import timely

pytestmark = pytest.mark.timeout(60)


@property_on_workers(epochs=epochs_of2(small_ints, words))
def test_probe_with_and_capture(workers, epochs):
    """One probe over two streams: it only passes ``t`` when both have; ``probe_with`` passes records
    on unchanged; ``capture().extract()`` groups by ascending time and ``records()`` has them all."""

    def main(worker):
        with worker.dataflow() as scope:
            a, b = scope.new_input("A"), scope.new_input("B")
            probe = timely.ProbeHandle()
            sa = a.stream.exchange(None).probe_with(probe)
            sb = b.stream.probe_with(probe)
            ca, cb = sa.capture(), sb.capture()
            # Records observed upstream of the probe, to check completeness when it passes t.
            seen = []
            a.stream.exchange(None).inspect_batch(lambda t, bt: seen.append((t, len(bt)))).probe_with(probe)
        complete_at = []
        for t, (ra, rb) in epochs:
            a.advance_to(t)
            b.advance_to(t)
            a.send_batch(mine(ra, worker))
            b.send_batch(mine(rb, worker))
            a.advance_to(t + 1)
            # b still holds t: the shared probe must not pass t however long we step.
            for _ in range(5):
                worker.step()
            assert probe.less_equal(t) and probe.less_than(t + 1)
            b.advance_to(t + 1)
            worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            complete_at.append((t, sum(n for s, n in seen if s <= t)))
        a.close()
        b.close()
        worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
        assert probe.frontier == []
        return ca.extract(), ca.records(), cb.extract(), complete_at

    results = run(main, workers)
    all_a = Counter()
    for w, (xa, ra, xb, complete_at) in enumerate(results):
        times = [norm(t) for t, _ in xa]
        assert times == sorted(set(times))
        assert bag(ra) == Counter(r for (_, r), n in timed(xa).items() for _ in range(n))
        all_a += timed(xa)
        assert timed(xb) == sliced_pair_oracle(epochs, w, workers, lambda recs: recs[1])
    assert all_a == global_oracle(epochs, lambda recs: recs[0])
    # When the probe passed t, every record at times <= t had been seen upstream of it (all workers).
    total_upto = [sum(n for (t2, _), n in global_oracle(epochs, lambda r: r[0]).items() if t2 <= t)
                  for t, _ in epochs]
    got_upto = [sum(res[3][i][1] for res in results) for i in range(len(epochs))]
    assert got_upto == total_upto


@property_on_workers(epochs=epochs_of(words))
def test_sink(workers, epochs):
    def main(worker):
        got = []
        frontiers = []

        def logic(inp):
            for cap, batch in inp:
                got.append((cap.time, list(batch)))
            frontiers.append(list(inp.frontier))

        with worker.dataflow() as scope:
            inp = scope.new_input()
            s = inp.stream.exchange(None)
            s.sink(logic, name="MySink")
            probe = s.probe()
        feed1(worker, inp, epochs, probe)
        worker.finish()
        return got, frontiers

    results = run(main, workers)
    total = Counter()
    for w, (got, frontiers) in enumerate(results):
        total += timed(got)
        for t, recs in got:
            for r in recs:
                assert hash_worker(r, workers) == w
        assert frontiers and not frontiers[-1]  # the sink was scheduled once its input completed
    assert total == global_oracle(epochs, lambda recs: recs)
