"""The garbage collector's settings: while a worker runs, and the named policies of the benchmarks.

:func:`batch_gc` is what every worker runs under (a young-generation threshold with room for a few
batches). The benchmarks choose a *policy* for their measured phase with :func:`configure`, whose
names are :data:`POLICIES` (the one ``--gc`` choice list of every script under ``bench/``):

* ``tuned``: collect once, freeze everything alive (what the start-up built is never garbage, and no
  later collection traverses it), then collect young objects rarely (threshold 50,000): a full
  collection over a large query state costs a pause that grows with the state;
* ``paced``: collect and freeze, disable the automatic collector, and let :meth:`Collector.tick`
  collect the young generation every :data:`PACE` seconds and freeze what survives (pauses stay
  proportional to the pace, not to how long the run has gone; cyclic garbage that survives a beat
  is never reclaimed);
* ``freeze``: collect and freeze, and keep the thresholds (those of :func:`batch_gc` in a worker);
* ``off``: collect and freeze, then disable the collector;
* ``default``: leave Python's settings alone.
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

#: CPython's young-generation threshold while a worker runs (its default is 700). A collection
#: starts when container allocations minus deallocations pass it, and costs time per young object
#: still alive. Records are containers (tuples) made by the thousand per batch and freed by
#: reference counting once their batch has passed through the dataflow: at 700 every batch in
#: flight sets off collections that scan its records; with room for a few batches, a dataflow that
#: keeps up sets off almost none. Much larger is slower again when batches queue up (a collection
#: then scans objects that have left the CPU cache) and lets cyclic garbage wait longer.
GC_YOUNG_THRESHOLD = 10_000


@contextlib.contextmanager
def batch_gc() -> Iterator[None]:
    """Run the block with the young-generation threshold at least :data:`GC_YOUNG_THRESHOLD`;
    restore the previous thresholds afterwards."""
    previous = gc.get_threshold()
    young = previous[0] and max(previous[0], GC_YOUNG_THRESHOLD)  # 0: automatic collection is off
    gc.set_threshold(young, *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)


#: The policies :func:`configure` knows, for ``argparse`` ``choices``.
POLICIES = ("tuned", "paced", "freeze", "off", "default")
#: Seconds between the young collections of the ``paced`` policy.
PACE = 0.05
#: The ``tuned`` policy's thresholds.
TUNED_THRESHOLDS = (50_000, 50, 1000)


def collect_young() -> None:
    """One beat of the ``paced`` policy: collect the young generation (the objects allocated since
    the last beat), then freeze the survivors: they are long-lived state, which no later
    collection traverses."""
    gc.collect(0)
    gc.freeze()


class Collector:
    """The collector under one policy, applied by :func:`configure`.

    Call :meth:`tick` from the measured loop (it collects only under ``paced``, when a beat is due);
    :meth:`restore` (or leaving the ``with`` block) puts the thresholds and the enabled state back.
    Objects frozen meanwhile stay frozen.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"gc policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self._threshold = gc.get_threshold()
        self._enabled = gc.isenabled()
        self._next = float("inf")
        if policy == "default":
            return
        gc.collect()
        gc.freeze()
        if policy in ("off", "paced"):
            gc.disable()
        elif policy == "tuned":
            gc.set_threshold(*TUNED_THRESHOLDS)
        if policy == "paced":  # the first beat a pace after the start-up collection (which can be long)
            self._next = time.perf_counter() + PACE

    def tick(self) -> None:
        """Under ``paced``: :func:`collect_young` if :data:`PACE` seconds have passed since the last beat."""
        now = time.perf_counter()
        if now >= self._next:
            collect_young()
            self._next = now + PACE

    def restore(self) -> None:
        """Put back the thresholds and the enabled state found when the policy was applied."""
        gc.set_threshold(*self._threshold)
        if self._enabled:
            gc.enable()
        else:
            gc.disable()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def configure(policy: str) -> Collector:
    """Apply ``policy`` (one of :data:`POLICIES`) now; the returned :class:`Collector` paces it
    (``tick``) and undoes it (``restore``, or use it as a context manager)."""
    return Collector(policy)
