"""Migration plans: every strategy turns current into target, moving each changed bin exactly once.

Batched plans: each step is a matching (every worker sends at most one bin and receives at most one),
and the number of steps is exactly D = max over workers of max(#bins sent, #bins received), the lower
bound for any plan of matchings. Plain repeated maximum matching (the reference implementation) does
NOT always reach D (see ``test_plain_repeated_maximum_matching_can_miss_the_bound``), which is why
``megaphone.plan`` pads the move multigraph to a D-regular one before matching.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from networkx.algorithms.bipartite import hopcroft_karp_matching

from megaphone.plan import STRATEGIES, plan
from megaphone.table import (
    MAX_K,
    TableError,
    apply,
    balanced,
    move_updates,
    moved_bins,
    skewed,
    validate_k,
    validate_move,
    validate_table,
    validate_update,
)
from timely.errors import TimelyError


@st.composite
def table_pairs(draw, max_peers: int = 6, max_nbins: int = 64):
    peers = draw(st.integers(1, max_peers))
    nbins = draw(st.integers(0, max_nbins))
    worker = st.integers(0, peers - 1)
    current = draw(st.lists(worker, min_size=nbins, max_size=nbins))
    target = draw(st.lists(worker, min_size=nbins, max_size=nbins))
    return peers, current, target


def max_degree(current, target) -> int:
    sends: Counter = Counter()
    receives: Counter = Counter()
    for c, t in zip(current, target):
        if c != t:
            sends[c] += 1
            receives[t] += 1
    return max([0, *sends.values(), *receives.values()])


def apply_steps(current, steps):
    table = list(current)
    for step in steps:
        for b, w in step.items():
            table[b] = w
    return table


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(table_pairs(), st.sampled_from(STRATEGIES))
def test_steps_turn_current_into_target(pair, strategy):
    peers, current, target = pair
    steps = plan(current, target, strategy, peers=peers)
    assert apply_steps(current, steps) == list(target)
    moved = [b for step in steps for b in step]
    assert len(moved) == len(set(moved)), "a bin moved twice"
    assert sorted(moved) == moved_bins(current, target), "only (and all) changed bins move"
    assert all(w == target[b] for step in steps for b, w in step.items()), "every bin moves straight to its target"
    assert all(step for step in steps), "no empty steps"
    if strategy == "all_at_once":
        assert len(steps) <= 1
    if strategy == "fluid":
        assert all(len(step) == 1 for step in steps)
        assert len(steps) == len(moved_bins(current, target))


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(table_pairs(max_peers=8, max_nbins=128))
def test_batched_steps_are_matchings_with_the_optimal_count(pair):
    peers, current, target = pair
    steps = plan(current, target, "batched")
    table = list(current)
    for step in steps:
        senders = [table[b] for b in step]
        receivers = list(step.values())
        assert len(senders) == len(set(senders)), f"a worker sends two bins in {step}"
        assert len(receivers) == len(set(receivers)), f"a worker receives two bins in {step}"
        for b, w in step.items():
            table[b] = w
    assert len(steps) == max_degree(current, target)


def repeated_maximum_matching(current, target) -> list[dict[int, int]]:
    """The reference implementation's batched plan: a maximum matching of the outstanding moves,
    repeated (networkx's Hopcroft-Karp on the simple graph of outstanding (sender, receiver) pairs)."""
    pending: dict[tuple[int, int], list[int]] = defaultdict(list)
    for b, (c, t) in enumerate(zip(current, target)):
        if c != t:
            pending[c, t].append(b)
    steps = []
    while any(pending.values()):
        g = nx.Graph()
        top = {("s", s) for (s, _), bins in pending.items() if bins}
        g.add_nodes_from(top)
        g.add_edges_from((("s", s), ("r", r)) for (s, r), bins in pending.items() if bins)
        m = hopcroft_karp_matching(g, top_nodes=top)
        steps.append({pending[s, m[("s", s)][1]].pop(0): m[("s", s)][1] for (_, s) in top if ("s", s) in m})
    return steps


@pytest.mark.timeout(120)
@settings(max_examples=200, deadline=None)
@given(table_pairs(max_peers=8, max_nbins=96))
def test_batched_never_worse_than_plain_repeated_matching(pair):
    _, current, target = pair
    reference = repeated_maximum_matching(current, target)
    assert apply_steps(current, reference) == list(target)
    assert max_degree(current, target) <= len(plan(current, target, "batched")) <= len(reference)


@pytest.mark.timeout(30)
def test_plain_repeated_maximum_matching_can_miss_the_bound():
    # Moves 0->3, 1->3, 1->4, 2->4: worker 1 sends 2, workers 3 and 4 receive 2 each, so D = 2.
    current = [0, 1, 1, 2]
    target = [3, 3, 4, 4]
    assert max_degree(current, target) == 2
    # {0->3, 2->4} is a maximum matching (size 2 = the number of receivers) ...
    g = nx.Graph([(("s", 0), ("r", 3)), (("s", 1), ("r", 3)), (("s", 1), ("r", 4)), (("s", 2), ("r", 4))])
    assert len(nx.max_weight_matching(g, maxcardinality=True)) == 2
    # ... after which worker 1 still has two bins to send: three steps, one more than D.
    after = apply_steps(current, [{0: 3, 3: 4}])
    assert max_degree(after, target) == 2
    # megaphone.plan reaches D: worker 1 sends in both steps.
    steps = plan(current, target, "batched")
    assert len(steps) == 2
    assert all(any(current[b] == 1 for b in step) for step in steps)


@pytest.mark.timeout(30)
def test_paper_uniform_to_uniform_skew():
    # 16 workers, 4096 bins: a quarter of the bins move, each odd worker to one even worker.
    current = balanced(4096, 16)
    target = skewed(current)
    assert len(moved_bins(current, target)) == 1024
    assert [len(s) for s in plan(current, target, "all_at_once")] == [1024]
    assert len(plan(current, target, "fluid")) == 1024
    batched = plan(current, target, "batched")
    assert len(batched) == 128 and all(len(s) == 8 for s in batched)
    # Two workers (the benchmark): worker 1 gives half of its bins to worker 0.
    two = balanced(256, 2)
    sk = skewed(two)
    assert Counter(sk) == Counter({0: 192, 1: 64})
    assert all(two[b] == 1 and sk[b] == 0 for b in moved_bins(two, sk))
    assert skewed(sk, fraction=0.0) == sk
    assert skewed(balanced(8, 1)) == balanced(8, 1)


@pytest.mark.timeout(30)
def test_helpers():
    assert balanced(6, 4) == (0, 1, 2, 3, 0, 1)
    assert balanced(0, 3) == ()
    assert moved_bins([0, 1, 2], [0, 2, 2]) == [1]
    assert skewed([1, 1, 1, 1], peers=2) == (0, 0, 1, 1)
    assert plan([0, 1], [0, 1], "batched") == []
    assert plan([], [], "all_at_once") == []
    with pytest.raises(TableError, match="peers"):
        balanced(4, 0)
    with pytest.raises(TableError, match="nbins"):
        balanced(-1, 2)
    with pytest.raises(ValueError, match="fraction"):
        skewed([0, 1], fraction=1.5)


@pytest.mark.timeout(30)
def test_errors():
    with pytest.raises(ValueError, match="unknown migration strategy 'sudden'"):
        plan([0, 1], [1, 0], "sudden")
    with pytest.raises(TableError, match=r"target table has 3 entries, expected one per bin \(2\)"):
        plan([0, 1], [0, 1, 0], "fluid")
    with pytest.raises(TableError, match="different lengths"):
        moved_bins([0], [])
    with pytest.raises(TableError, match=r"current table, bin 1: worker -1 does not exist \(workers are numbered from 0\)"):
        plan([0, -1], [0, 0], "batched")
    with pytest.raises(TableError, match="target table, bin 1: worker -2"):
        plan([0, 1], [0, -2], "all_at_once")
    with pytest.raises(TableError, match="worker '1' is not an integer"):
        plan([0, 1], [0, "1"], "fluid")
    with pytest.raises(TableError, match=r"worker 2 does not exist \(there are 2 workers\)"):
        plan([0, 1], [0, 2], "batched", peers=2)
    with pytest.raises(TableError, match="current table, bin 0: worker True is not an integer"):
        skewed([True, 1])


@pytest.mark.timeout(60)
def test_large_batched_plan_is_fast():
    # 2^16 bins between two workers: one matching computation, repeated.
    current = balanced(1 << 16, 2)
    steps = plan(current, [1 - w for w in current], "batched")
    assert len(steps) == 1 << 15 and all(len(s) == 2 for s in steps)


# -- the routing table module -------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_table_error_is_a_timely_error_and_a_value_error():
    assert issubclass(TableError, TimelyError) and issubclass(TableError, ValueError)


@pytest.mark.timeout(30)
def test_validate_k():
    assert [validate_k(k) for k in (0, 8, MAX_K)] == [0, 8, 16]
    for bad in (-1, MAX_K + 1, 2.0, True, "3"):
        with pytest.raises(TableError, match="exponent of 2\\^k bins"):
            validate_k(bad)


@pytest.mark.timeout(30)
def test_validate_move_and_table():
    validate_move(3, 1, 4, 2)
    for (b, w), msg in [((4, 0), "bin 4 does not exist (there are 4 bins)"),
                        ((-1, 0), "bin -1 does not exist (bins are numbered from 0)"),
                        ((0, 2), "worker 2 does not exist (there are 2 workers)"),
                        ((0, False), "worker False is not an integer"),
                        ((None, 0), "bin None is not an integer")]:
        with pytest.raises(TableError) as e:
            validate_move(b, w, 4, 2)
        assert str(e.value) == f"move of bin {b!r} to worker {w!r}: {msg}"
    assert validate_table([0, 1, 1]) == (0, 1, 1)
    assert validate_table((0, 1), 2, 2) == (0, 1)
    for table, nbins, peers, msg in [
        ([0, 1], 3, None, "routing table has 2 entries, expected one per bin (3)"),
        ([0, 2], 2, 2, "routing table, bin 1: worker 2 does not exist (there are 2 workers)"),
        ("01", None, None, "routing table must be a sequence of workers, one per bin, not str '01'"),
        (5, None, None, "routing table must be a sequence of workers, one per bin, not int 5"),
    ]:
        with pytest.raises(TableError) as e:
            validate_table(table, nbins, peers)
        assert str(e.value) == msg


@pytest.mark.timeout(30)
def test_validate_update_and_apply():
    good = [("move", 1, 0), ["move", 3, 1], ("table", (1, 1, 0, 0)), ("table", [0, 0, 0, 0])]
    for u in good:
        validate_update(u, 4, 2)
    for u, msg in [
        (("move", 4, 0), "bin 4 does not exist"),
        (("move", 0, 2), "worker 2 does not exist"),
        (("table", (0, 1)), "routing table has 2 entries, expected one per bin (4)"),
        (("table", (0, 1, 0, 7)), "routing table, bin 3: worker 7 does not exist"),
        (("table", "0101"), "must be a sequence of 4 workers"),
        (("move", 1), "is not ('move' | 'precopy' | 'replica', bin, worker) or ('table'"),
        (("swap", 1, 2), "is not ('move' | 'precopy' | 'replica', bin, worker) or ('table'"),
        ((), "is not ('move' | 'precopy' | 'replica', bin, worker)"),
        ("move", "is not ('move' | 'precopy' | 'replica', bin, worker)"),
    ]:
        with pytest.raises(TableError, match=re.escape(msg)):
            validate_update(u, 4, 2)
    start = balanced(4, 2)
    assert apply(start, []) == start == (0, 1, 0, 1)
    assert apply(start, good) == (0, 0, 0, 0)
    assert apply(start, good[:2]) == (0, 0, 0, 1)
    assert apply(start, move_updates({3: 0, 0: 1})) == (1, 1, 0, 0)
    assert apply(start, good[:3]) == (1, 1, 0, 0)
    assert move_updates({3: 0, 0: 1}) == [("move", 0, 1), ("move", 3, 0)]
    assert balanced(5, 2) == (0, 1, 0, 1, 0)


@pytest.mark.timeout(30)
def test_moved_bins_from_one_source():
    old, new = (0, 1, 2, 0, 1, 2), (1, 1, 0, 2, 0, 2)
    assert moved_bins(old, new) == [0, 2, 3, 4]
    assert moved_bins(old, new, source=0) == [0, 3]
    assert moved_bins(old, new, source=2) == [2]
    assert moved_bins(old, new, source=5) == []
