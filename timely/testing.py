"""Helpers for testing your own dataflows (as bytewax's ``testing`` module does for bytewax).

Run a dataflow over given epochs on one or several workers and get its output back as one sorted
list, to compare with a plain sequential computation of the same data::

    from collections import Counter
    from timely.testing import run_epochs

    epochs = [["a", "b", "a"], ["b"]]
    got = run_epochs(lambda s: s.count_by_key(), epochs, workers=3)
    want = [(e, sorted(Counter(recs).items())) for e, recs in enumerate(epochs)]
    assert got == want

Records that cross processes come back as tuples (msgpack has no lists); :func:`normalize` and
:func:`bag` turn lists into tuples on the expected side too.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import execute
from .dataflow import Stream
from .worker import Worker

#: Seconds a test run may take by default before it fails with :class:`TimeoutError`.
DEFAULT_TIMEOUT = 60.0


def normalize(x: Any) -> Any:
    """Lists and tuples become tuples, recursively (how records come back from other workers)."""
    if isinstance(x, (list, tuple)):
        return tuple(normalize(y) for y in x)
    return x


def bag(items: Iterable[Any]) -> Counter:
    """A multiset of normalised items: compares outputs whose order does not matter."""
    return Counter(normalize(x) for x in items)


def _sorted(records: list) -> list:
    try:
        return sorted(records)
    except TypeError:
        return sorted(records, key=repr)


def run_epochs(build: Callable[[Stream], Stream], epochs: Sequence[Iterable[Any]], workers: int = 1,
               timeout: float = DEFAULT_TIMEOUT, fuzz: int | None = None, progress: str = "direct"
               ) -> list[tuple[Any, list]]:
    """Feed ``epochs[e]`` at epoch ``e`` into ``build(stream)`` on ``workers`` workers; return the
    output as ``[(time, sorted records), ...]`` in time order, merged over all workers.

    The records of each epoch are dealt round-robin to the workers (worker ``i`` sends records
    ``i, i + workers, ...``). Output records are normalised (lists become tuples). Raises
    :class:`TimeoutError` if the dataflow has not completed ``timeout`` seconds after the last
    epoch was closed, and the worker's error if the dataflow fails. ``fuzz=SEED`` runs it under
    the schedule fuzzer (see :func:`timely.execute`): an operator that is correct only for some
    orders of delivery fails for some seed. ``progress`` is the workers' progress mode
    (``"direct"`` or ``"relay"``, see :func:`timely.execute`).
    """
    batches = [list(records) for records in epochs]

    def main(worker: Worker) -> list[tuple[Any, list]]:
        with worker.dataflow("run_epochs") as scope:
            inp = scope.new_input("TestInput")
            out = build(inp.stream)
            captured = out.capture()
        for epoch, records in enumerate(batches):
            mine = records[worker.index::worker.peers]
            if mine:
                inp.send_batch(mine)
            inp.advance_to(epoch + 1)
        inp.close()
        # Until the whole dataflow completed, not just the probe: the capture beside it may still
        # wait for batches in flight (a probe speaks for its own input only).
        worker.step_while(worker.has_dataflows, timeout=timeout)
        return captured.batches

    by_time: dict[Any, list] = defaultdict(list)
    for result in execute(main, workers=workers, fuzz=fuzz, progress=progress):
        for time, records in result:
            by_time[normalize(time)].extend(normalize(r) for r in records)
    return [(t, _sorted(by_time[t])) for t in sorted(by_time)]


__all__ = ["DEFAULT_TIMEOUT", "bag", "normalize", "run_epochs"]
