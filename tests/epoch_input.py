"""Random epoch-structured input for the dataflow tests, and the loop that feeds it to the workers.

An epoch list is ``[(time, records), ...]`` with strictly increasing times (two inputs on one time
grid: ``[(time, (records1, records2)), ...]``). Each worker sends its slice ``records[index::peers]``
of every epoch (:func:`mine`), so with several workers the pipeline operators see different data on
each worker and the exchanging ones really move records.
"""
from __future__ import annotations

from hypothesis import strategies as st

STEP_TIMEOUT = 20  # seconds: a hang becomes a TimeoutError instead of a stuck test

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


def send_epoch(worker, inp, t, records) -> None:
    """Send this worker's slice of ``records`` at ``t`` in one batch, then close ``t`` on ``inp``."""
    inp.advance_to(t)
    inp.send_batch(mine(records, worker))
    inp.advance_to(t + 1)


def feed(worker, inputs, epochs, probe, pipelined: bool | None = None):
    """Drive ``inputs`` through ``epochs`` (``[(t, [recs per input])]``), then close them and
    :func:`finish`. One epoch at a time (the next once ``probe`` has passed it), or ``pipelined``:
    every epoch sent before any is waited for, so that batches of several times are in flight at
    once and the schedule fuzzer delivers them in any order across times (one at a time, only one
    time is ever incomplete: an operator that assumes batches come in time order, or keeps one
    buffer for all times, would pass). ``None``: pipelined under the fuzzer when its seed is odd
    (hypothesis draws the seed, so it explores both), else one at a time."""
    if pipelined is None:
        pipelined = worker.fuzz is not None and worker.fuzz % 2 == 1
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
        if not pipelined:
            worker.step_while(lambda: probe.less_than(t + 1), timeout=STEP_TIMEOUT)
            assert not probe.less_equal(t)
    for inp in inputs:
        inp.close()
    finish(worker)


def finish(worker) -> None:
    """Step until every dataflow of ``worker`` has completed (a hang raises :class:`TimeoutError`).

    A probe being done is not enough before reading a capture: the probe speaks for its own input
    only, and a capture beside it on the same stream may still wait for batches in flight (each
    input gets its batches on its own schedule, which the fuzzer varies). A completed dataflow has
    nothing in flight anywhere.
    """
    worker.step_while(worker.has_dataflows, timeout=STEP_TIMEOUT)


def feed1(worker, inp, epochs, probe):
    """:func:`feed` for a single input: ``epochs`` is ``[(t, records)]``."""
    feed(worker, [inp], [(t, [recs]) for t, recs in epochs], probe)
