"""Every stream operator over several epochs of random input, against a sequential per-epoch oracle.

Each worker sends its slice ``records[worker.index::peers]`` of every epoch, so with several workers
the pipeline operators see different data on each worker and the exchanging ones really move records.
Results come back from every worker (through msgpack when workers > 1: lists arrive as tuples, hence
``norm``) and are compared per worker where the placement is defined (pipeline, exchange by hash,
broadcast), or merged otherwise.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from conftest import WORKER_COUNTS, WORKER_IDS, bag, examples, norm, run
from hypothesis import given
from hypothesis import strategies as st

import timely

STEP_TIMEOUT = 20  # seconds: a hang becomes a TimeoutError instead of a stuck test

workers_param = pytest.mark.parametrize("workers", WORKER_COUNTS, ids=WORKER_IDS)

small_ints = st.integers(-20, 20)
words = st.sampled_from(["a", "b", "c", "dd", "e", "ff", "g"])
pairs = st.tuples(st.integers(0, 6), st.integers(-50, 50))
word_pairs = st.tuples(words, st.integers(-9, 9))


def _times(raw):
    out, t = [], -1
    for gap, recs in raw:
        t += 1 + gap
        out.append((t, recs))
    return out


def epochs_of(elements, max_epochs: int = 4, max_size: int = 12):
    """``[(time, records), ...]`` with strictly increasing times starting anywhere in 0..2."""
    raw = st.lists(st.tuples(st.integers(0, 2), st.lists(elements, max_size=max_size)), min_size=1,
                   max_size=max_epochs)
    return raw.map(_times)


def epochs_of2(elements1, elements2, max_epochs: int = 4, max_size: int = 10):
    """Epochs for two inputs sharing a time grid: ``[(time, (records1, records2)), ...]``."""
    raw = st.lists(
        st.tuples(st.integers(0, 2),
                  st.tuples(st.lists(elements1, max_size=max_size), st.lists(elements2, max_size=max_size))),
        min_size=1, max_size=max_epochs)
    return raw.map(_times)


def mine(records, worker):
    """The slice of an epoch's records this worker sends."""
    return records[worker.index::worker.peers]


def feed(worker, inputs, epochs, probe):
    """Drive ``inputs`` through ``epochs`` (``[(t, [recs per input])]``), one epoch at a time."""
    for t, per_input in epochs:
        for inp, recs in zip(inputs, per_input):
            inp.advance_to(t)
            part = mine(recs, worker)
            # Several batches per time, with steps in between, so that operators waiting for a
            # time to complete really have to wait.
            if t % 2:
                for i, r in enumerate(part):
                    inp.send(r)
                    if i % 2:
                        worker.step()
            else:
                half = len(part) // 2
                inp.send_batch(part[:half])
                worker.step()
                inp.send_batch(part[half:])
            inp.advance_to(t + 1)
        worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
        assert not probe.less_equal(t)
    for inp in inputs:
        inp.close()
    worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)


def feed1(worker, inp, epochs, probe):
    feed(worker, [inp], [(t, [recs]) for t, recs in epochs], probe)


def timed(extracted) -> Counter:
    """A capture's ``extract()`` (possibly msgpack round-tripped) as a multiset of (time, record)."""
    return Counter((norm(t), norm(r)) for t, recs in extracted for r in recs)


def merged(results) -> Counter:
    total = Counter()
    for res in results:
        total += timed(res)
    return total


def per_worker_oracle(epochs, w, peers, f) -> Counter:
    """(time, output) multiset for worker ``w`` of a pipeline operator: ``f`` maps a slice to outputs."""
    return Counter((t, norm(y)) for t, recs in epochs for y in f(recs[w::peers]))


def sliced_pair_oracle(epochs, w, peers, f) -> Counter:
    """Like :func:`per_worker_oracle` for two inputs: ``f`` maps ``(slice1, slice2)`` to outputs."""
    return Counter((t, norm(y)) for t, (ra, rb) in epochs for y in f((ra[w::peers], rb[w::peers])))


def global_oracle(epochs, f) -> Counter:
    """(time, output) multiset when ``f`` maps a whole epoch to its outputs."""
    return Counter((t, norm(y)) for t, recs in epochs for y in f(recs))


# Exchange keys are module-level functions: they exist before the cluster forks, so they are the
# same object in every worker (see test_exchange_key_defined_inside_main for keys made in main).
def to_zero(record):
    return 0


def first_field(record):
    return record[0]


def hash_worker(key, peers):
    from timely.routing import hash64

    return hash64(key) % peers


# ---------------------------------------------------------------------------------------------
# Record-at-a-time pipeline operators: per-worker equality with the oracle on that worker's slice.
# ---------------------------------------------------------------------------------------------

PIPELINE_CASES = {
    "map": (lambda s: s.map(lambda x: x * 3 - 1, name="M"), lambda recs: [x * 3 - 1 for x in recs]),
    "map_batch": (lambda s: s.map_batch(lambda b: [(x, x % 2) for x in b]),
                  lambda recs: [(x, x % 2) for x in recs]),
    "flat_map": (lambda s: s.flat_map(lambda x: [(x, i) for i in range(x % 4)]),
                 lambda recs: [(x, i) for x in recs for i in range(x % 4)]),
    "filter": (lambda s: s.filter(lambda x: x % 3 == 0), lambda recs: [x for x in recs if x % 3 == 0]),
    "chain": (lambda s: s.map(lambda x: x + 1).filter(lambda x: x > 0).flat_map(lambda x: [x, -x]),
              lambda recs: [y for x in recs if x + 1 > 0 for y in (x + 1, -(x + 1))]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
@workers_param
def test_pipeline_operator(workers, case):
    build, oracle = PIPELINE_CASES[case]

    @examples(workers)
    @given(epochs=epochs_of(small_ints))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = build(inp.stream)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        results = run(main, workers)
        assert len(results) == workers
        for w, res in enumerate(results):
            assert timed(res) == per_worker_oracle(epochs, w, workers, oracle), f"worker {w}"

    check()


@pytest.mark.timeout(60)
@workers_param
def test_map_batch_sees_batches(workers):
    """``map_batch`` gets whole batches (lists or tuples): the sum of batch lengths per time is the
    number of records this worker sent at that time."""

    @examples(workers)
    @given(epochs=epochs_of(small_ints))
    def check(epochs):
        def main(worker):
            kinds = set()

            def f(batch):
                kinds.add(type(batch).__name__)
                return [len(batch)]

            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.map_batch(f)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract(), sorted(kinds)

        results = run(main, workers)
        for w, (res, kinds) in enumerate(results):
            assert set(kinds) <= {"list", "tuple"}
            sums = defaultdict(int)
            for t, lens in res:
                sums[t] += sum(lens)
            expected = {t: len(recs[w::workers]) for t, recs in epochs if recs[w::workers]}
            assert {t: n for t, n in sums.items() if n} == expected

    check()


@pytest.mark.timeout(60)
@workers_param
def test_inspect_and_inspect_batch(workers):
    @examples(workers)
    @given(epochs=epochs_of(small_ints))
    def check(epochs):
        def main(worker):
            seen, seen_batches = [], []
            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = (inp.stream
                       .inspect(seen.append)
                       .inspect_batch(lambda t, b: seen_batches.append((t, list(b)))))
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return seen, seen_batches, cap.extract()

        results = run(main, workers)
        for w, (seen, seen_batches, res) in enumerate(results):
            expected = per_worker_oracle(epochs, w, workers, lambda recs: recs)
            assert bag(seen) == Counter(r for (_, r), n in expected.items() for _ in range(n))
            assert timed(seen_batches) == expected
            assert timed(res) == expected  # records pass through unchanged

    check()


# ---------------------------------------------------------------------------------------------
# Exchange and broadcast: placement by hash, conservation, every record on every worker.
# ---------------------------------------------------------------------------------------------

EXCHANGE_CASES = {
    "field0": (pairs, 0, lambda r: r[0]),
    "callable": (pairs, lambda r: r[1] % 5, lambda r: r[1] % 5),
    "none_int": (small_ints, None, lambda r: r),
    "none_str": (words, None, lambda r: r),
    "field0_str": (word_pairs, 0, lambda r: r[0]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(EXCHANGE_CASES))
@workers_param
def test_exchange(workers, case):
    elements, key, keyfn = EXCHANGE_CASES[case]

    @examples(workers)
    @given(epochs=epochs_of(elements))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.exchange(key)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        results = run(main, workers)
        # Conservation: every record arrives exactly once, at its own time.
        assert merged(results) == global_oracle(epochs, lambda recs: recs)
        # Placement: record r is on worker hash64(key(r)) % peers (README), so each key on one worker.
        for w, res in enumerate(results):
            for t, recs in res:
                for r in recs:
                    assert hash_worker(keyfn(r), workers) == w, (r, w)

    check()


@pytest.mark.timeout(60)
@workers_param
def test_broadcast(workers):
    @examples(workers)
    @given(epochs=epochs_of(pairs))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.broadcast()
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        results = run(main, workers)
        expected = global_oracle(epochs, lambda recs: recs)
        for w, res in enumerate(results):
            assert timed(res) == expected, f"worker {w} did not see every record once"

    check()


@pytest.mark.timeout(60)
@workers_param
def test_exchange_key_defined_inside_main(workers):
    """README style: ``exchange=lambda ...`` written inside ``main``. Each worker process creates its
    own function object, so nothing about the dataflow may depend on its identity or address."""

    def main(worker):
        # Workers typically do worker-dependent work (load their share of the input) before they
        # build the dataflow, so their heaps differ; the function objects below then differ too.
        share = [[i] for i in range(100 * worker.index)]
        with worker.dataflow() as scope:
            inp = scope.new_input()
            out = inp.stream.exchange(lambda r: r % 7).count_by_key(lambda r: r % 3)
            cap = out.capture()
            probe = out.probe()
        feed1(worker, inp, [(0, list(range(30))), (2, list(range(10)))], probe)
        del share
        return cap.extract()

    expected = Counter()
    for t, recs in [(0, list(range(30))), (2, list(range(10)))]:
        expected += Counter((t, kv) for kv in Counter(r % 3 for r in recs).items())
    assert merged(run(main, workers)) == expected


# ---------------------------------------------------------------------------------------------
# Stream plumbing: concat, partition, probe_with, capture, sink.
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@workers_param
def test_concat(workers):
    @examples(workers)
    @given(epochs=epochs_of2(small_ints, small_ints))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                a, b = scope.new_input("A"), scope.new_input("B")
                out = a.stream.concat(b.stream.map(lambda x: ("b", x)), a.stream.map(lambda x: ("neg", -x)))
                cap = out.capture()
                probe = out.probe()
            feed(worker, [a, b], epochs, probe)
            return cap.extract()

        results = run(main, workers)
        for w, res in enumerate(results):
            expected = Counter()
            for t, (ra, rb) in epochs:
                ra, rb = ra[w::workers], rb[w::workers]
                expected += Counter((t, norm(y)) for y in ra + [("b", x) for x in rb] + [("neg", -x) for x in ra])
            assert timed(res) == expected

    check()


@pytest.mark.timeout(60)
@workers_param
def test_partition(workers):
    @examples(workers)
    @given(epochs=epochs_of(small_ints), parts=st.integers(1, 4))
    def check(epochs, parts):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                streams = inp.stream.partition(parts, lambda x: x % parts)
                caps = [s.capture() for s in streams]
                probe = timely.ProbeHandle()
                for s in streams:
                    s.probe_with(probe)
            feed1(worker, inp, epochs, probe)
            return [c.extract() for c in caps]

        results = run(main, workers)
        for w, res in enumerate(results):
            assert len(res) == parts
            for i, part in enumerate(res):
                oracle = per_worker_oracle(epochs, w, workers, lambda recs: [x for x in recs if x % parts == i])
                assert timed(part) == oracle, f"worker {w} part {i}"

    check()


@pytest.mark.timeout(60)
@workers_param
def test_probe_with_and_capture(workers):
    """One probe over two streams: it only passes ``t`` when both have; ``probe_with`` passes records
    on unchanged; ``capture().extract()`` groups by ascending time and ``records()`` has them all."""

    @examples(workers)
    @given(epochs=epochs_of2(small_ints, words))
    def check(epochs):
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

    check()


@pytest.mark.timeout(60)
@workers_param
def test_sink(workers):
    @examples(workers)
    @given(epochs=epochs_of(words))
    def check(epochs):
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

    check()


# ---------------------------------------------------------------------------------------------
# Keyed aggregations.
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("keying", ["none", "field", "callable"])
@workers_param
def test_count_by_key(workers, keying):
    @examples(workers)
    @given(epochs=epochs_of(words))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                if keying == "none":
                    counts = inp.stream.count_by_key()
                elif keying == "field":
                    counts = inp.stream.map(lambda w: (w, 1)).count_by_key(0)
                else:
                    counts = inp.stream.map(lambda w: (w.upper(), len(w))).count_by_key(first_field)
                cap = counts.capture()
                probe = counts.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        results = run(main, workers)
        conv = (lambda w: w.upper()) if keying == "callable" else (lambda w: w)
        expected = global_oracle(epochs, lambda recs: Counter(conv(r) for r in recs).items())
        assert merged(results) == expected
        for w, res in enumerate(results):
            for t, recs in res:
                for key, _ in recs:
                    assert hash_worker(key, workers) == w

    check()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["sum", "max", "min_pair"])
@workers_param
def test_reduce_by_key(workers, op):
    reducers = {
        "sum": lambda a, b: a + b,
        "max": max,
        "min_pair": lambda a, b: min(a, b),
    }
    reduce = reducers[op]

    @examples(workers)
    @given(epochs=epochs_of(word_pairs))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                s = inp.stream
                if op == "min_pair":
                    s = s.map(lambda kv: (kv[0], (kv[1], kv[0])))
                out = s.reduce_by_key(reduce)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        def oracle(recs):
            acc = {}
            for k, v in recs:
                if op == "min_pair":
                    v = (v, k)
                acc[k] = reduce(acc[k], v) if k in acc else v
            return acc.items()

        assert merged(run(main, workers)) == global_oracle(epochs, oracle)

    check()


# ---------------------------------------------------------------------------------------------
# Generic operators.
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", [None, 0])
@workers_param
def test_unary(workers, exchange):
    @examples(workers)
    @given(epochs=epochs_of(pairs))
    def check(epochs):
        def main(worker):
            infos = []

            def double(cap, info):
                infos.append((info.name, info.worker, info.peers))
                cap.drop()

                def logic(inp, out):
                    for c, batch in inp:
                        with out.session(c) as s:
                            s.give_batch([(k, 2 * v) for k, v in batch])
                            s.give(("n", len(batch)))
                return logic

            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.unary(double, name="Double", exchange=exchange)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract(), infos

        results = run(main, workers)
        total = Counter()
        for w, (res, infos) in enumerate(results):
            assert norm(infos) == (("Double", w, workers),)
            data = Counter({k: n for k, n in timed(res).items() if k[1][0] != "n"})
            counts = defaultdict(int)
            for (t, r), n in timed(res).items():
                if r[0] == "n":
                    counts[t] += r[1] * n
            # the ("n", len) markers account for every record this worker processed
            assert dict(counts) == {t: c for t, c in Counter(t for t, _ in data.elements()).items()}
            if exchange is None:
                assert data == per_worker_oracle(epochs, w, workers, lambda recs: [(k, 2 * v) for k, v in recs])
            else:
                assert all(hash_worker(r[0], workers) == w for _, r in data)
            total += data
        assert total == global_oracle(epochs, lambda recs: [(k, 2 * v) for k, v in recs])

    check()


def buffer_until_complete(emitted):
    """The README's unary_frontier example, recording each emission's (time, frontier passed)."""

    def constructor(cap, info):
        cap.drop()
        stash = {}

        def logic(inp, out):
            for c, batch in inp:
                if c.time not in stash:
                    stash[c.time] = (c.retain(), [])
                stash[c.time][1].extend(batch)
            for t in sorted(stash):
                if not inp.frontier.less_equal(t):
                    held, records = stash.pop(t)
                    out.give_batch(held, sorted(records))
                    emitted.append(t)
                    held.drop()

        return logic

    return constructor


@pytest.mark.timeout(60)
@workers_param
def test_unary_frontier(workers):
    @examples(workers)
    @given(epochs=epochs_of(pairs))
    def check(epochs):
        def main(worker):
            emitted = []
            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.unary_frontier(buffer_until_complete(emitted), name="Buffer", exchange=0)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.batches, emitted

        results = run(main, workers)
        total = Counter()
        for w, (batches, emitted) in enumerate(results):
            # One sorted batch per time, emitted in time order, each time once.
            assert list(emitted) == sorted(set(emitted))
            assert [norm(t) for t, _ in batches] == list(emitted)
            for t, recs in batches:
                assert list(norm(recs)) == sorted(norm(recs))
                assert all(hash_worker(r[0], workers) == w for r in recs)
            total += timed(batches)
        assert total == global_oracle(epochs, lambda recs: recs)

    check()


@pytest.mark.timeout(60)
@workers_param
def test_unary_notify(workers):
    @examples(workers)
    @given(epochs=epochs_of(small_ints))
    def check(epochs):
        def main(worker):
            totals = {}

            def sum_per_time(inp, out, notificator):
                for c, batch in inp:
                    if c.time not in totals:
                        notificator.notify_at(c.retain())
                    totals[c.time] = totals.get(c.time, 0) + sum(batch)
                for c in notificator:
                    out.session(c).give((c.time, totals.pop(c.time)))

            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.unary_notify(sum_per_time, name="Sum", exchange=to_zero)
                cap = out.capture()
                probe = out.probe()
            feed1(worker, inp, epochs, probe)
            return cap.extract()

        results = run(main, workers)
        expected = Counter((t, (t, sum(recs))) for t, recs in epochs if recs)
        home = hash_worker(0, workers)  # every record has key 0: all on worker hash64(0) % peers
        assert timed(results[home]) == expected
        assert all(not res for w, res in enumerate(results) if w != home)

    check()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", [None, 0])
@workers_param
def test_binary(workers, exchange):
    @examples(workers)
    @given(epochs=epochs_of2(pairs, pairs))
    def check(epochs):
        def main(worker):
            def merge(cap, info):
                cap.drop()

                def logic(in1, in2, out):
                    for c, batch in in1:
                        out.give_batch(c, [("L", k, v) for k, v in batch])
                    for c, batch in in2:
                        out.give_batch(c, [("R", k, -v) for k, v in batch])
                return logic

            with worker.dataflow() as scope:
                a, b = scope.new_input("A"), scope.new_input("B")
                out = a.stream.binary(b.stream, merge, name="Merge", exchange1=exchange, exchange2=exchange)
                cap = out.capture()
                probe = out.probe()
            feed(worker, [a, b], epochs, probe)
            return cap.extract()

        def oracle(recs):
            ra, rb = recs
            return [("L", k, v) for k, v in ra] + [("R", k, -v) for k, v in rb]

        results = run(main, workers)
        for w, res in enumerate(results):
            if exchange is None:
                assert timed(res) == sliced_pair_oracle(epochs, w, workers, oracle), f"worker {w}"
            else:
                assert all(hash_worker(r[1], workers) == w for _, r in timed(res))
        assert merged(results) == global_oracle(epochs, oracle)

    check()


@pytest.mark.timeout(60)
@workers_param
def test_binary_frontier_join(workers):
    """A per-time equi-join held until both input frontiers pass the time."""

    @examples(workers)
    @given(epochs=epochs_of2(pairs, st.tuples(st.integers(0, 6), words)))
    def check(epochs):
        def main(worker):
            def join(cap, info):
                cap.drop()
                left, right = defaultdict(list), defaultdict(list)
                held = {}

                def logic(in1, in2, out):
                    for inp, side in ((in1, left), (in2, right)):
                        for c, batch in inp:
                            if c.time not in held:
                                held[c.time] = c.retain()
                            side[c.time].extend(batch)
                    for t in sorted(held):
                        if not in1.frontier.less_equal(t) and not in2.frontier.less_equal(t):
                            c = held.pop(t)
                            index = defaultdict(list)
                            for k, v in right.pop(t, []):
                                index[k].append(v)
                            out.give_batch(c, [(k, a, b) for k, a in left.pop(t, []) for b in index[k]])
                            c.drop()
                return logic

            with worker.dataflow() as scope:
                a, b = scope.new_input("A"), scope.new_input("B")
                out = a.stream.binary_frontier(b.stream, join, name="Join", exchange1=0, exchange2=0)
                cap = out.capture()
                probe = out.probe()
            feed(worker, [a, b], epochs, probe)
            return cap.extract()

        def oracle(recs):
            ra, rb = recs
            return [(k, x, y) for k, x in ra for k2, y in rb if k == k2]

        results = run(main, workers)
        assert merged(results) == global_oracle(epochs, oracle)
        for w, res in enumerate(results):
            assert all(hash_worker(r[0], workers) == w for _, r in timed(res))

    check()


@pytest.mark.timeout(60)
@workers_param
def test_binary_notify(workers):
    @examples(workers)
    @given(epochs=epochs_of2(small_ints, small_ints))
    def check(epochs):
        def main(worker):
            state = {}

            def logic(in1, in2, out, notificator):
                for sign, inp in ((1, in1), (-1, in2)):
                    for c, batch in inp:
                        if c.time not in state:
                            state[c.time] = [0, 0]
                            notificator.notify_at(c.retain())
                        state[c.time][0] += sign * sum(batch)
                        state[c.time][1] += len(batch)
                for c in notificator:
                    assert not in1.frontier.less_equal(c.time) and not in2.frontier.less_equal(c.time)
                    out.session(c).give((c.time, *state.pop(c.time)))

            with worker.dataflow() as scope:
                a, b = scope.new_input("A"), scope.new_input("B")
                out = a.stream.binary_notify(b.stream, logic, name="Diff",
                                             exchange1=to_zero, exchange2=to_zero)
                cap = out.capture()
                probe = out.probe()
            feed(worker, [a, b], epochs, probe)
            return cap.extract()

        results = run(main, workers)
        expected = Counter((t, (t, sum(ra) - sum(rb), len(ra) + len(rb))) for t, (ra, rb) in epochs if ra or rb)
        home = hash_worker(0, workers)
        assert timed(results[home]) == expected
        assert all(not res for w, res in enumerate(results) if w != home)

    check()
