"""Megaphone under the schedule fuzzer, on 1-3 workers, with random migrations running:
``state_machine``, ``unary`` with timers and ``binary`` (the drivers and oracles of
``test_megaphone_ops.py``, with hypothesis drawing the fuzz seed, the data and the moves).

F and S must not depend on the order in which the batches of one time arrive, on how they are cut,
on which batch of a time comes first, or on being scheduled only with work. The control records of
one time are the case in point: several senders (or one sender's several calls) at one time arrive
in a different order on every worker, so F applies them in a canonical order
(:func:`megaphone.table.canonical`), and :class:`~megaphone.ControlInput` refuses updates whose
effect would depend on their order.
"""
from __future__ import annotations

import pytest
from conftest import FUZZ_SEEDS, property_on_workers, run
from hypothesis import strategies as st
from test_megaphone_ops import (
    check_binary_join,
    check_ownership,
    check_pipelined_migrations,
    check_state_machine,
    check_unary_timers,
    records,
    run_normalized,
    running_counts,
    sm_job,
    summarise_sm,
)

import megaphone
from megaphone.table import TableError, apply, balanced, canonical, move_updates

pytestmark = pytest.mark.timeout(300)


@property_on_workers(single=25, multi=4, data=st.data(), seed=FUZZ_SEEDS)
def test_state_machine(workers, data, seed):
    check_state_machine(workers, data, fuzz=seed)


@property_on_workers(single=25, multi=4, data=st.data(), seed=FUZZ_SEEDS)
def test_migrations_with_every_epoch_in_flight(workers, data, seed):
    check_pipelined_migrations(workers, data, fuzz=seed)


@property_on_workers(single=25, multi=4, data=st.data(), seed=FUZZ_SEEDS)
def test_unary_with_timers(workers, data, seed):
    check_unary_timers(workers, data, fuzz=seed)


@property_on_workers(single=25, multi=4, data=st.data(), seed=FUZZ_SEEDS)
def test_binary_join(workers, data, seed):
    check_binary_join(workers, data, fuzz=seed)


@property_on_workers(single=25, multi=4, data=st.data(), seed=FUZZ_SEEDS)
def test_moves_of_one_time_from_several_senders(workers, data, seed):
    """Every worker sends moves at the same epochs, often of the same bins to different workers:
    they arrive in a different order on every worker, yet every worker compiles the same table (that
    of the canonical order) and the state machine stays exact."""
    k = data.draw(st.integers(1, 3), label="k")
    n = data.draw(st.integers(1, 4), label="epochs")
    epochs = [(data.draw(records, label=f"records{e}"),) for e in range(n)]
    sender = st.dictionaries(st.integers(0, (1 << k) - 1), st.integers(0, workers - 1), max_size=3)
    moves = [data.draw(st.lists(sender, min_size=workers, max_size=workers), label=f"moves{e}") for e in range(n)]
    results = run_normalized(sm_job(epochs, moves, k), workers, seed)
    assert summarise_sm(results) == running_counts(epochs)
    check_ownership(results, workers, k)
    table = balanced(1 << k, workers)
    for e, senders in enumerate(moves):
        table = apply(table, canonical([u for m in senders for u in move_updates(m)]))
        assert results[0][1][e][1] == table, f"epoch {e}"


def control_job(worker):
    """Worker 0 sends updates at times 0-2, some refused; returns the refusals and what was sent."""
    with worker.dataflow() as scope:
        control = megaphone.ControlInput(scope, k=2)
        captured = control.stream.capture()
    refused = []

    def attempt(update):
        try:
            update()
        except TableError as e:
            refused.append(str(e))

    if worker.index == 0:
        for update in (lambda: control.moves({0: 1, 1: 0}), lambda: control.move(0, 1),  # the same move again
                       lambda: control.move(0, 0), lambda: control.install([0, 0, 0, 0])):
            attempt(update)
        control.advance_to(1)
        for update in (lambda: control.install([1, 1, 1, 1]), lambda: control.install([1, 1, 1, 1]),
                       lambda: control.move(2, 0), lambda: control.install([0, 0, 0, 0])):
            attempt(update)
        control.advance_to(2)
        attempt(lambda: control.move(0, 0))  # a new time: bin 0 may go elsewhere again
    control.close()
    worker.finish()
    return refused, captured.extract()


@pytest.mark.timeout(60)
def test_control_input_refuses_updates_whose_effect_depends_on_their_order():
    refused, sent = run(control_job, 2)[0]
    assert refused == ["control input 'Control', move(): bin 0 was already moved to worker 1 at time 0",
                       "control input 'Control', install(): a routing table at time 0 must be the first and only "
                       "one of its time",
                       "control input 'Control', install(): a routing table at time 1 must be the first and only "
                       "one of its time"]
    table = ("table", (1, 1, 1, 1))
    assert [(t, sorted(map(tuple, batch), key=repr)) for t, batch in sent] == [
        (0, [("move", 0, 1), ("move", 0, 1), ("move", 1, 0)]),
        (1, [("move", 2, 0), table, table]),
        (2, [("move", 0, 0)])]
