"""Progress tracking seen from the user API: frontiers, probes, held capabilities, notifications,
loops (``scope.feedback``) and nested scopes (``scope.iterative``), against plain Python oracles.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque

import pytest
from conftest import WORKER_COUNTS, WORKER_IDS, examples, norm, run
from hypothesis import given
from hypothesis import strategies as st

from timely.dataflow import Exchange
from timely.progress import less_equal, less_than
from timely.routing import hash64

STEP_TIMEOUT = 20
workers_param = pytest.mark.parametrize("workers", WORKER_COUNTS, ids=WORKER_IDS)


def to_zero(record):  # module level: the same function in every forked worker
    return 0


def mine(records, worker):
    return records[worker.index::worker.peers]


def timed(extracted) -> Counter:
    return Counter((norm(t), norm(r)) for t, recs in extracted for r in recs)


def merged(results, i=None) -> Counter:
    total = Counter()
    for res in results:
        total += timed(res if i is None else res[i])
    return total


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


# Epochs: (time, records) with strictly increasing times.
def epochs_of(elements, max_epochs=4, max_size=10):
    def times(raw):
        out, t = [], -1
        for gap, recs in raw:
            t += 1 + gap
            out.append((t, recs))
        return out

    return st.lists(st.tuples(st.integers(0, 2), st.lists(elements, max_size=max_size)), min_size=1,
                    max_size=max_epochs).map(times)


# ---------------------------------------------------------------------------------------------
# Frontiers and probes
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@workers_param
def test_frontiers_never_go_backwards(workers):
    """Record every probe's frontier before each step (top level, after an exchange and an
    aggregation, and inside a nested loop): each is monotone in the partial order and ends empty."""

    @examples(workers)
    @given(epochs=epochs_of(st.integers(0, 40)))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                p_top = inp.stream.exchange(None).probe()
                p_count = inp.stream.count_by_key().probe()
                with scope.iterative() as inner:
                    h, loop = inner.feedback(1)
                    body = inp.stream.enter(inner).concat(loop)
                    p_inner = body.probe()
                    body.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(h)
                    p_left = body.filter(lambda x: x == 1).leave().probe()
            probes = [p_top, p_count, p_inner, p_left]
            history = [[] for _ in probes]

            def record():
                for hist, p in zip(history, probes):
                    f = p.frontier
                    if not hist or hist[-1] != f:
                        hist.append(f)
                return True

            for t, recs in epochs:
                inp.advance_to(t)
                inp.send_batch(mine(recs, worker))
                inp.advance_to(t + 1)
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

    check()


@pytest.mark.timeout(60)
@workers_param
def test_probe_passes_exactly_when_epoch_processed(workers):
    """``probe.less_than(t + 1)`` stays true while the input holds ``t`` (however long we step), and
    once it turns false every record at times <= t has gone through the operators before the probe."""

    @examples(workers)
    @given(epochs=epochs_of(st.integers(-5, 5), max_epochs=5))
    def check(epochs):
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

    check()


@pytest.mark.timeout(60)
@workers_param
def test_held_capability_blocks_downstream_probe(workers):
    """A ``unary_frontier`` operator holding its initial capability keeps the downstream probe at 0,
    while the upstream probe advances; once it drops the capability (on seeing the marker -1 at epoch
    ``release``) the downstream probe catches up. Records still flow meanwhile."""

    @examples(workers, single=10, multi=2)
    @given(release=st.integers(1, 4), data=st.lists(st.integers(0, 9), min_size=6, max_size=6))
    def check(release, data):
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

    check()


@pytest.mark.timeout(60)
@workers_param
def test_batches_never_arrive_behind_the_frontier(workers):
    """Safety: when an operator reads a batch at time t, its input frontier has not passed t."""

    @examples(workers)
    @given(epochs=epochs_of(st.tuples(st.integers(0, 5), st.integers(0, 100))))
    def check(epochs):
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
                inp.advance_to(t)
                inp.send_batch(mine(recs, worker))
                inp.advance_to(t + 1)
                # no waiting for the probe: let epochs overlap
                worker.step()
            inp.close()
            worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
            return violations

        assert [v for v in run(main, workers) if v] == []

    check()


# ---------------------------------------------------------------------------------------------
# Notifications
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@workers_param
def test_notifications_in_order_once_complete(workers):
    """Times are delivered once each (even when requested for every batch), in increasing order, only
    once the frontier has passed them and after all their records arrived; the output sent with the
    delivered capability carries the per-time totals."""

    @examples(workers)
    @given(epochs=epochs_of(st.integers(0, 30)), overlap=st.booleans())
    def check(epochs, overlap):
        def main(worker):
            counts = defaultdict(int)
            log = []

            def logic(inp, out, notificator):
                for c, batch in inp:
                    counts[c.time] += len(batch)
                    notificator.notify_at(c.retain())  # possibly many requests for one time
                for c in notificator:
                    log.append((c.time, not inp.frontier.less_equal(c.time), counts[c.time]))
                    out.session(c).give((c.time, counts.pop(c.time)))

            with worker.dataflow() as scope:
                inp = scope.new_input()
                out = inp.stream.unary_notify(logic, name="Notify", exchange=None)
                cap = out.capture()
                probe = out.probe()
            for t, recs in epochs:
                inp.advance_to(t)
                part = mine(recs, worker)
                for i in range(0, len(part), 2):  # several batches per time
                    inp.send_batch(part[i:i + 2])
                    worker.step()
                inp.advance_to(t + 1)
                if not overlap:
                    worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            inp.close()
            worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
            return log, cap.extract()

        for w, (log, res) in enumerate(run(main, workers)):
            expected = {t: len(recs[w::workers]) for t, recs in epochs if recs[w::workers]}
            times = [t for t, _, _ in log]
            assert times == sorted(expected), f"worker {w}: delivered {times}"
            assert all(passed for _, passed, _ in log), "delivered before the frontier passed"
            assert {t: n for t, _, n in log} == expected, "delivered before all records arrived"
            assert timed(res) == Counter((t, (t, n)) for t, n in expected.items())

    check()


@pytest.mark.timeout(60)
@workers_param
def test_binary_notify_waits_for_both_inputs(workers):
    """With input A ahead of input B, times are not delivered until B passes them too."""

    @examples(workers, single=15, multi=2)
    @given(data=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4))
    def check(data):
        def main(worker):
            log = []
            sums = defaultdict(int)

            def logic(in1, in2, out, notificator):
                for inp in (in1, in2):
                    for c, batch in inp:
                        if c.time not in sums:
                            notificator.notify_at(c.retain())
                        sums[c.time] += sum(batch)
                for c in notificator:
                    ok = not in1.frontier.less_equal(c.time) and not in2.frontier.less_equal(c.time)
                    log.append((c.time, ok))
                    out.session(c).give((c.time, sums.pop(c.time)))

            with worker.dataflow() as scope:
                a, b = scope.new_input("A"), scope.new_input("B")
                out = a.stream.binary_notify(b.stream, logic, exchange1=to_zero, exchange2=to_zero)
                cap = out.capture()
                probe = out.probe()
            stalls = []
            for t, (x, y) in enumerate(data):
                if worker.index == 0:
                    a.send(x)
                    b.send(y)
                a.advance_to(t + 1)
                for _ in range(10):
                    worker.step()
                stalls.append([tt for tt, _ in log if tt >= t])  # must stay empty: B still at t
                b.advance_to(t + 1)
                worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            a.close()
            b.close()
            worker.step_while(lambda: not probe.done(), timeout=STEP_TIMEOUT)
            return log, stalls, cap.extract()

        results = run(main, workers)
        home = hash64(0) % workers  # every record has key 0
        log, stalls, res = results[home]
        assert all(s == [] for s in stalls)
        assert [t for t, _ in log] == list(range(len(data)))
        assert all(ok for _, ok in log)
        assert timed(res) == Counter((t, (t, x + y)) for t, (x, y) in enumerate(data))
        for log2, stalls2, res2 in results[:home] + results[home + 1:]:
            assert not log2 and not res2

    check()


# ---------------------------------------------------------------------------------------------
# Loops and nested scopes
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@workers_param
def test_top_level_feedback_halving(workers):
    """README loop: each trip adds 1 to the epoch. x at epoch e is at (e + i) as x >> i; it reaches 1
    at epoch e + bit_length(x) - 1 (0 never does)."""

    @examples(workers)
    @given(epochs=epochs_of(st.integers(0, 300)))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                handle, loop = scope.feedback(1)
                values = inp.stream.concat(loop)
                values.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(handle)
                ones = values.filter(lambda x: x == 1)
                c_values, c_ones = values.capture(), ones.capture()
                probe = ones.probe()
            for t, recs in epochs:
                inp.advance_to(t)
                inp.send_batch(mine(recs, worker))
                inp.advance_to(t + 1)
                worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            inp.close()
            worker.finish()
            return c_values.extract(), c_ones.extract(), worker.has_dataflows()

        results = run(main, workers)
        exp_values, exp_ones = Counter(), Counter()
        for e, recs in epochs:
            for x in recs:
                if x == 0:
                    exp_values[(e, 0)] += 1
                    continue
                k = x.bit_length() - 1
                for i in range(k + 1):
                    exp_values[(e + i, x >> i)] += 1
                exp_ones[(e + k, 1)] += 1
        assert merged(results, 0) == exp_values
        assert merged(results, 1) == exp_ones
        assert not any(r[2] for r in results)

    check()


@pytest.mark.timeout(60)
@workers_param
def test_nested_scope_halving(workers):
    """Same computation in a nested scope: inner times are (epoch, iteration); leave() restores the
    epoch."""

    @examples(workers)
    @given(epochs=epochs_of(st.integers(1, 1000)))
    def check(epochs):
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                with scope.iterative() as inner:
                    h, loop = inner.feedback(1)
                    body = inp.stream.enter(inner).concat(loop)
                    p_inner = body.probe()
                    body.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(h)
                    done = body.filter(lambda x: x == 1).map(lambda x: "one")
                    c_inner = done.capture()
                    left = done.leave()
                c_left = left.capture()
                probe = left.probe()
            for t, recs in epochs:
                inp.advance_to(t)
                inp.send_batch(mine(recs, worker))
                inp.advance_to(t + 1)
                worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
                # once the outer probe passes t, the loop has finished every iteration of epoch t
                assert all(tt[0] > t for tt in p_inner.frontier), p_inner.frontier
            inp.close()
            worker.finish()
            return c_inner.extract(), c_left.extract()

        results = run(main, workers)
        exp_inner = Counter(((e, x.bit_length() - 1), "one") for e, recs in epochs for x in recs)
        exp_left = Counter((e, "one") for e, recs in epochs for x in recs)
        assert merged(results, 0) == exp_inner
        assert merged(results, 1) == exp_left

    check()


def bfs(nodes, edges, roots):
    adj = defaultdict(list)
    for s, d in edges:
        adj[s].append(d)
    dist = {}
    queue = deque()
    for r in roots:
        if r not in dist:
            dist[r] = 0
            queue.append(r)
    while queue:
        n = queue.popleft()
        for m in adj[n]:
            if m not in dist:
                dist[m] = dist[n] + 1
                queue.append(m)
    return dist


graph = st.integers(2, 12).flatmap(lambda n: st.tuples(
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n),
    st.lists(st.integers(0, n - 1), min_size=0, max_size=3),
))


@pytest.mark.timeout(60)
@workers_param
def test_nested_scope_reachability(workers):
    """Breadth-first reachability in a nested scope, one random graph per epoch: a node is first
    reported at inner time (epoch, BFS distance); the left stream has each reachable node once per
    epoch. A binary_notify inside the loop checks that notified times complete in product order."""

    @examples(workers, single=20, multi=3)
    @given(graphs=st.lists(graph, min_size=1, max_size=3))
    def check(graphs):
        def main(worker):
            adj = defaultdict(lambda: defaultdict(list))
            pending = {}
            reached = defaultdict(set)
            delivered = []

            def explore(in1, in2, out, notificator):
                for c, batch in in1:
                    for s, d in batch:
                        adj[c.time[0]][s].append(d)
                for c, batch in in2:
                    if c.time not in pending:
                        pending[c.time] = []
                        notificator.notify_at(c.retain())
                    pending[c.time].extend(batch)
                for c in notificator:
                    t = c.time
                    delivered.append((t, not in1.frontier.less_equal(t) and not in2.frontier.less_equal(t)))
                    e = t[0]
                    with out.session(c) as s:
                        for n in pending.pop(t):
                            if n not in reached[e]:
                                reached[e].add(n)
                                s.give(("new", n))
                                for m in adj[e].get(n, ()):
                                    s.give(("nbr", m))

            with worker.dataflow() as scope:
                edges_in, roots_in = scope.new_input("Edges"), scope.new_input("Roots")
                with scope.iterative() as inner:
                    h, loop = inner.feedback(1)
                    frontier = roots_in.stream.enter(inner).concat(loop)
                    step = edges_in.stream.enter(inner).binary_notify(
                        frontier, explore, name="Explore", exchange1=0, exchange2=Exchange(None))
                    new, nbrs = step.partition(2, lambda r: 0 if r[0] == "new" else 1)
                    nbrs.map(lambda r: r[1]).connect_loop(h)
                    new_nodes = new.map(lambda r: r[1])
                    c_inner = new_nodes.capture()
                    left = new_nodes.leave()
                c_left = left.capture()
                probe = left.probe()
            for e, (edges, roots) in enumerate(graphs):
                edges_in.send_batch(mine(edges, worker))
                roots_in.send_batch(mine(roots, worker))
                edges_in.advance_to(e + 1)
                roots_in.advance_to(e + 1)
                worker.step_while(lambda: probe.less_than(e + 1), timeout=STEP_TIMEOUT)
            worker.finish()
            return c_inner.extract(), c_left.extract(), delivered

        results = run(main, workers)
        exp_inner, exp_left = Counter(), Counter()
        for e, (edges, roots) in enumerate(graphs):
            for n, d in bfs(None, edges, roots).items():
                exp_inner[((e, d), n)] += 1
                exp_left[(e, n)] += 1
        assert merged(results, 0) == exp_inner
        assert merged(results, 1) == exp_left
        for w, (_, _, delivered) in enumerate(results):
            times = [norm(t) for t, _ in delivered]
            assert all(ok for _, ok in delivered), f"worker {w}: notified before completion"
            assert len(times) == len(set(times)), f"worker {w}: a time was notified twice"
            for i, a in enumerate(times):
                for b in times[i + 1:]:
                    assert not less_than(b, a), f"worker {w}: {b} notified after {a}"

    check()


# ---------------------------------------------------------------------------------------------
# Completion
# ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
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


@pytest.mark.timeout(60)
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
