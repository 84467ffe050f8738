"""timely.collector: the workers' young-generation threshold and the benchmarks' named policies."""
from __future__ import annotations

import gc
import time
import weakref

import pytest

from timely import collector


class Node:
    pass


@pytest.fixture
def clean_gc():
    """Every test starts from, and leaves, the interpreter's collector as it was (nothing frozen by
    the test remains frozen)."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


def test_batch_gc_raises_the_young_threshold_and_restores_it(clean_gc):
    gc.set_threshold(700, 10, 10)
    with collector.batch_gc():
        assert gc.get_threshold() == (collector.GC_YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(0, 10, 10)  # automatic collection off: stays off
    with collector.batch_gc():
        assert gc.get_threshold()[0] == 0


@pytest.mark.parametrize("policy, enabled, young", [
    ("tuned", True, collector.TUNED_THRESHOLDS[0]), ("paced", False, 700), ("freeze", True, 700),
    ("off", False, 700), ("default", True, 700),
])
def test_policies_set_and_restore_the_collector(clean_gc, policy, enabled, young):
    gc.set_threshold(700, 10, 10)
    gc.enable()
    before = gc.get_freeze_count()
    survivors = [[i] for i in range(100)]  # alive, tracked: frozen by every policy but default
    with collector.configure(policy) as c:
        assert c.policy == policy
        assert gc.isenabled() == enabled
        assert gc.get_threshold()[0] == young
        frozen = gc.get_freeze_count() - before
        assert (frozen >= len(survivors)) == (policy != "default")
    assert gc.isenabled() and gc.get_threshold() == (700, 10, 10)
    assert survivors


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="tuned, paced, freeze, off, default"):
        collector.configure("sometimes")


def test_collect_young_reclaims_young_cycles_and_freezes_survivors(clean_gc):
    """``paced``'s beat: the young generation is collected (cyclic garbage in it is freed) and what
    survives is frozen, so that no later collection traverses it."""
    gc.disable()
    frozen_before = gc.get_freeze_count()
    cyclic = Node()
    cyclic.self = cyclic
    ref = weakref.ref(cyclic)
    del cyclic
    survivors = [[i] for i in range(1000)]
    collector.collect_young()
    assert ref() is None  # the young cycle was collected
    assert gc.get_count()[0] == 0
    assert all(gc.is_tracked(x) for x in survivors)
    assert gc.get_freeze_count() >= frozen_before + len(survivors)  # survivors went to the permanent generation


def test_paced_ticks_collect_once_per_pace(clean_gc):
    with collector.configure("paced") as c:
        cyclic = Node()
        cyclic.self = cyclic
        ref = weakref.ref(cyclic)
        del cyclic
        c.tick()  # within the first pace: nothing collected
        assert ref() is not None
        time.sleep(collector.PACE)
        c.tick()
        assert ref() is None
    for other in ("tuned", "freeze", "off", "default"):
        with collector.configure(other) as c:
            cyclic = Node()
            cyclic.self = cyclic
            ref = weakref.ref(cyclic)
            del cyclic
            gc.disable()  # only a tick could collect it now
            time.sleep(collector.PACE)
            c.tick()
            assert ref() is not None, other
            gc.collect()
