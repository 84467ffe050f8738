"""Loops seen from the user API: ``scope.feedback`` at the top level and in nested scopes
(``scope.iterative``), against plain Python oracles of where each record lands in time.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque

import pytest
from conftest import norm, property_on_workers, run
from dataflows import halving_loop
from epoch_input import STEP_TIMEOUT, epochs_of, mine, send_epoch
from hypothesis import strategies as st
from oracles import merged

import timely
from timely.dataflow import Exchange
from timely.progress import less_than

pytestmark = pytest.mark.timeout(60)


@property_on_workers(epochs=epochs_of(st.integers(0, 300), max_size=10))
def test_top_level_feedback_halving(workers, epochs):
    """README loop: each trip adds 1 to the epoch. x at epoch e is at (e + i) as x >> i; it reaches 1
    at epoch e + bit_length(x) - 1 (0 never does)."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            values = halving_loop(scope, inp.stream)
            ones = values.filter(lambda x: x == 1)
            c_values, c_ones = values.capture(), ones.capture()
            probe = ones.probe()
        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
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


@property_on_workers(epochs=epochs_of(st.integers(1, 1000), max_size=10))
def test_nested_scope_halving(workers, epochs):
    """Same computation in a nested scope: inner times are (epoch, iteration); leave() restores the
    epoch."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            with scope.iterative() as inner:
                body = halving_loop(inner, inp.stream.enter(inner))
                p_inner = body.probe()
                done = body.filter(lambda x: x == 1).map(lambda x: "one")
                c_inner = done.capture()
                left = done.leave()
            c_left = left.capture()
            probe = left.probe()
        for t, recs in epochs:
            send_epoch(worker, inp, t, recs)
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


@property_on_workers(single=20, multi=3, graphs=st.lists(graph, min_size=1, max_size=3))
def test_nested_scope_reachability(workers, graphs):
    """Breadth-first reachability in a nested scope, one random graph per epoch: a node is first
    reported at inner time (epoch, BFS distance); the left stream has each reachable node once per
    epoch. A binary_notify inside the loop checks that notified times complete in product order."""

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



def _endless_loop(step):
    """A loop whose inner counter runs past 2**64 - 1 after a few rounds of ``step``."""
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            with scope.iterative() as inner:
                handle, looped = inner.feedback(step)
                body = inp.stream.enter(inner).concat(looped).exchange(lambda x: x)
                body.connect_loop(handle)
                body.leave().probe()
        if worker.index == 0:
            inp.send_batch([1])
        inp.close()
        worker.finish()
    return main


@pytest.mark.parametrize("workers", [1, 2])
def test_a_loop_time_beyond_64_bits_fails_alike_on_any_number_of_workers(workers):
    # Times travel as uint64: on several workers such a time failed as "can not serialize 'int'"
    # with no operator named, while one worker ran on. Now both name the loop and the time.
    with pytest.raises(timely.OperatorError) as ei:
        run(_endless_loop(2**62), workers)
    assert "operator 'Feedback': time (0, 18446744073709551616) has a coordinate beyond 18446744073709551615" \
        in str(ei.value)


def test_feedback_step_must_be_a_positive_integer():
    def main(worker):
        with worker.dataflow() as scope:
            for step in (0, 0.5, True, 2**64):
                with pytest.raises(timely.BuildError, match=f"feedback step must be a positive integer.*not {step!r}"):
                    scope.feedback(step)
        return "checked"
    assert run(main, 1) == ["checked"]


def test_a_summary_that_does_not_fit_its_ports_fails_at_build():
    from timely.dataflow.builder import OperatorBuilder
    from timely.progress import Summary

    def main(worker):
        with pytest.raises(timely.BuildError, match="operator 'Step': the summary .* does not fit the ports"):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                with scope.iterative() as inner:
                    b = OperatorBuilder(inner, "Step")
                    b.new_input(inp.stream.enter(inner), connection=[[Summary.feedback(1, 1)]])  # depth 1 in depth 2
                    b.new_output()
                    b.build(lambda caps: None)
        return "checked"
    assert run(main, 1) == ["checked"]
