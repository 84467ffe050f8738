"""Megaphone operators under random inputs and random migrations, against sequential oracles.

For each run: random keyed records per epoch, random migrations (moves at random epochs, issued by
worker 0 over the control input at the same times as data), on 1, 2 and 3 workers. The ``check_*``
functions take ``fuzz=SEED`` (``test_fuzz_megaphone.py`` runs them under the schedule fuzzer). The outputs
must equal a sequential computation and the run without migration; no record is lost or applied
twice; after each epoch every bin lives on exactly one worker, the one the routing table names.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pyarrow as pa
import pytest
from conftest import norm, property_on_workers, run
from hypothesis import strategies as st
from megaphone_jobs import STEP_TIMEOUT

import megaphone
from timely import BuildError, columnar

keys = st.integers(0, 40)
records = st.lists(st.tuples(keys, st.integers(1, 5)), max_size=25)


def drive(worker, data_inputs, control, handle, epochs, moves, check_bins=True):
    """Feed ``epochs`` (per epoch: one record list per data input) and ``moves``: per epoch a
    ``{bin: worker}`` dict that worker 0 sends, or a list of them, the ``i``-th sent by worker ``i``."""
    owned = []
    for e, per_input in enumerate(epochs):
        senders = moves[e] if isinstance(moves[e], list) else [moves[e]]
        if worker.index < len(senders) and senders[worker.index]:
            control.moves(senders[worker.index])
        for inp, recs in zip(data_inputs, per_input):
            inp.send_batch(recs[worker.index::worker.peers])
        for inp in data_inputs:
            inp.advance_to(e + 1)
        control.advance_to(e + 1)
        worker.step_while(lambda: handle.probe.less_than(e + 1), timeout=STEP_TIMEOUT)
        if check_bins:
            owned.append((handle.owned_bins(), list(handle.routing_table())))
    return owned


def draw_moves(data, k: int, workers: int, epochs: int) -> list[dict]:
    """Per epoch, up to 4 random moves ``{bin: worker}`` of the ``2^k`` bins (for worker 0 to issue)."""
    return [data.draw(st.dictionaries(st.integers(0, (1 << k) - 1), st.integers(0, workers - 1), max_size=4),
                      label=f"moves{e}") for e in range(epochs)]


def draw_moves_and_driver(data, k: int, workers: int, epochs: int):
    """Moves (:func:`draw_moves`) and the driver: :func:`drive` (one epoch at a time, the bins
    observed after each) or, as hypothesis draws, :func:`drive_pipelined` (every epoch in flight at
    once, so the schedule fuzzer reorders batches across times; no move at epoch 0)."""
    moves = draw_moves(data, k, workers, epochs)
    if data.draw(st.booleans(), label="pipelined"):
        return [{}] + moves[1:], drive_pipelined
    return moves, drive


def drive_pipelined(worker, data_inputs, control, handle, epochs, moves):
    """:func:`drive` with every epoch and move sent before the first step: nothing waits for an
    epoch to complete, so F compiles a move while S has earlier epochs still to finish, and only S's
    output frontier moving tells F when it may ship the bins (its own inputs have stopped moving).
    Observes the bins once, at the end."""
    for e, per_input in enumerate(epochs):
        if worker.index == 0 and moves[e]:
            control.moves(moves[e])
        for inp, recs in zip(data_inputs, per_input):
            inp.send_batch(recs[worker.index::worker.peers])
        for inp in (*data_inputs, control):
            inp.advance_to(e + 1)
    for h in (*data_inputs, control):
        h.close()
    worker.step_while(lambda: not handle.probe.done(), timeout=STEP_TIMEOUT)
    return [(handle.owned_bins(), list(handle.routing_table()))]


def megaphone_job(epochs, moves, k: int, build, inputs: int = 1, driver=drive):
    """The job of one test run: ``build(streams, control)`` makes the megaphone operator over
    ``inputs`` data inputs and a control input of ``2^k`` bins; ``driver`` (:func:`drive`) feeds
    ``epochs`` and ``moves``. Each worker returns its captured output and what the driver observed."""

    def main(worker):
        with worker.dataflow() as scope:
            data = [scope.new_input() for _ in range(inputs)]
            control = megaphone.ControlInput(scope, k=k)
            m = build([d.stream for d in data], control)
            cap = m.stream.capture()
        owned = driver(worker, data, control, m, epochs, moves)
        for h in (*data, control):
            h.close()
        worker.finish()
        return cap.extract(), owned

    return main


def run_normalized(main, workers: int, fuzz: int | None = None, progress: str = "direct") -> list:
    """:func:`run` (under the schedule fuzzer seeded ``fuzz`` if given, in ``progress`` mode), each
    worker's ``(output, owned)`` normalised (lists become tuples)."""
    return [(norm(r[0]), norm(r[1])) for r in run(main, workers, fuzz, progress)]


def check_ownership(results, peers: int, k: int):
    """After every epoch, each bin lives on exactly one worker: the one the routing table names."""
    epochs = len(results[0][1])
    for e in range(epochs):
        tables = {tuple(r[1][e][1]) for r in results}
        assert len(tables) == 1, f"workers disagree on the routing table after epoch {e}"
        table = tables.pop()
        holders = defaultdict(list)
        for w, r in enumerate(results):
            for b in r[1][e][0]:
                holders[b].append(w)
        for b in range(1 << k):
            assert holders[b] == [table[b]], f"epoch {e}: bin {b} held by {holders[b]}, table says {table[b]}"


def outputs(results) -> Counter:
    """Every output record of every worker, as a multiset of ``(time, *record)``."""
    return Counter((t, *r) for caps, _ in results for t, recs in caps for r in recs)


def running_counts(epochs):
    """Sequential oracle of a per-key running sum, per (time, key): the sum after the time and the
    number of outputs (records of one key at one time may be applied in any order)."""
    totals: Counter = Counter()
    out = Counter()
    for t, (recs,) in enumerate(epochs):
        by_key = defaultdict(list)
        for k, v in recs:
            by_key[k].append(v)
        for k, vs in by_key.items():
            totals[k] += sum(vs)
            out[(t, k, totals[k], len(vs))] += 1
    return out


def running_sum(key, value, state):
    """The state machine's fold: a running sum per key, emitted at every record."""
    state = (state or 0) + value
    return state, [(key, state)]


def sm_job(epochs, moves, k, driver=drive):
    """A running sum per key in a state machine whose bins migrate in many chunks (``chunk=4``)."""
    return megaphone_job(epochs, moves, k,
                         lambda s, control: megaphone.state_machine(s[0], control, None, running_sum, chunk=4),
                         driver=driver)


def summarise_sm(results):
    """Per (time, key): the last running sum and the number of outputs."""
    per = defaultdict(list)
    for caps, _ in results:
        for t, recs in caps:
            for key, s in recs:
                per[(t, key)].append(s)
    return Counter({(t, key, max(s), len(s)): 1 for (t, key), s in per.items()})


def check_state_machine(workers, data, fuzz=None, progress="direct"):
    """A running sum per key under random migrations equals the sequential oracle and the same job
    without migration; bins are where the table says (``fuzz``: under the schedule fuzzer;
    ``progress``: the workers' progress mode)."""
    k = data.draw(st.integers(1, 5), label="k")
    n = data.draw(st.integers(1, 5), label="epochs")
    epochs = [(data.draw(records, label=f"records{e}"),) for e in range(n)]
    moves = draw_moves(data, k, workers, n)
    results = run_normalized(sm_job(epochs, moves, k), workers, fuzz, progress)
    expected = running_counts(epochs)
    assert summarise_sm(results) == expected
    check_ownership(results, workers, k)
    # The same job without migration gives the same outputs.
    plain = run_normalized(sm_job(epochs, [{}] * n, k), workers, fuzz, progress)
    assert summarise_sm(plain) == summarise_sm(results)


@pytest.mark.timeout(300)
@property_on_workers(data=st.data())
def test_state_machine_with_random_migrations(workers, data):
    check_state_machine(workers, data)


def check_pipelined_migrations(workers, data, fuzz=None, progress="direct"):
    """Moves compiled while earlier epochs are still in flight complete (F wakes on S's output
    frontier, megaphone.route.ExtractionWaker) and the running sums equal the sequential oracle;
    at the end every bin is on the worker the table names (``fuzz``: under the schedule fuzzer;
    ``progress``: the workers' progress mode)."""
    k = data.draw(st.integers(1, 5), label="k")
    n = data.draw(st.integers(2, 6), label="epochs")
    epochs = [(data.draw(records, label=f"records{e}"),) for e in range(n)]
    moves = [{}] + draw_moves(data, k, workers, n - 1)  # nothing at epoch 0: S has an epoch to finish first
    results = run_normalized(sm_job(epochs, moves, k, driver=drive_pipelined), workers, fuzz, progress)
    assert summarise_sm(results) == running_counts(epochs)
    check_ownership(results, workers, k)


@pytest.mark.timeout(300)
@property_on_workers(data=st.data())
def test_migrations_with_every_epoch_in_flight(workers, data):
    check_pipelined_migrations(workers, data)


def timers_job(epochs, moves, k, delay, driver=drive):
    """A unary operator with timers: each record (key, v) at t is echoed at t + delay through a
    timer (data travels with the bin), and a per-key total is kept in the bin's state."""

    def fold(time, recs, timers, state, notificator):
        out = []
        for key, v in recs:
            state[key] = state.get(key, 0) + v
            notificator.notify_at(time + delay, (key, v))
        for key, v in timers:
            out.append(("echo", key, v, state[key] >= v))
        return out

    return megaphone_job(epochs, moves, k, lambda s, control: megaphone.unary(s[0], control, 0, fold), driver=driver)


def check_unary_timers(workers, data, fuzz=None):
    """Every record is echoed by its bin's timer ``delay`` epochs later, wherever the bin moved
    meanwhile (``fuzz``: under the schedule fuzzer)."""
    k = data.draw(st.integers(1, 4), label="k")
    n = data.draw(st.integers(1, 5), label="epochs")
    delay = data.draw(st.integers(1, 3), label="delay")
    epochs = [(data.draw(records, label=f"records{e}"),) for e in range(n)]
    moves, driver = draw_moves_and_driver(data, k, workers, n)
    results = run_normalized(timers_job(epochs, moves, k, delay, driver), workers, fuzz)
    got = outputs(results)
    expected = Counter()
    for t, (recs,) in enumerate(epochs):
        for key, v in recs:
            expected[(t + delay, "echo", key, v, True)] += 1
    assert got == expected
    check_ownership(results, workers, k)


@pytest.mark.timeout(300)
@property_on_workers(data=st.data())
def test_unary_timers_migrate_with_their_bin(workers, data):
    check_unary_timers(workers, data)


def join_job(epochs, moves, k, driver=drive):
    """A symmetric hash join on key: emits (key, a, b) for every pair, at the later of the two times."""

    def fold(time, left, right, timers, state, notificator):
        lefts = state.setdefault("L", {})
        rights = state.setdefault("R", {})
        out = []
        for key, a in left:
            out.extend((key, a, b) for b in rights.get(key, ()))
        for key, a in left:
            lefts.setdefault(key, []).append(a)
        for key, b in right:
            out.extend((key, a, b) for a in lefts.get(key, ()))
            rights.setdefault(key, []).append(b)
        return out

    return megaphone_job(epochs, moves, k, lambda s, control: megaphone.binary(s[0], s[1], control, 0, 0, fold),
                         inputs=2, driver=driver)


def check_binary_join(workers, data, fuzz=None):
    """A symmetric join under random migrations emits every matching pair once, at the later of its
    two times (``fuzz``: under the schedule fuzzer)."""
    k = data.draw(st.integers(1, 4), label="k")
    n = data.draw(st.integers(1, 4), label="epochs")
    side = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 99)), max_size=8)
    epochs = [(data.draw(side, label=f"left{e}"), data.draw(side, label=f"right{e}")) for e in range(n)]
    moves, driver = draw_moves_and_driver(data, k, workers, n)
    results = run_normalized(join_job(epochs, moves, k, driver), workers, fuzz)
    got = outputs(results)
    expected = Counter()
    for t1, (left, _) in enumerate(epochs):
        for t2, (_, right) in enumerate(epochs):
            for ka, a in left:
                for kb, b in right:
                    if ka == kb:
                        expected[(max(t1, t2), ka, a, b)] += 1
    assert got == expected
    check_ownership(results, workers, k)


@pytest.mark.timeout(300)
@property_on_workers(data=st.data())
def test_binary_join_with_random_migrations(workers, data):
    check_binary_join(workers, data)


def tracked_job(k):
    """A state machine whose states are ints (atomic: a plain dict of them would be untracked by a
    full collection); every bin moves to the last worker at epoch 1. Returns, per held bin, whether its
    state is still tracked by the collector after a full collection, and the states."""

    def fold(key, value, state):
        return (state or 0) + value, []

    def main(worker):
        import gc

        with worker.dataflow() as scope:
            data = scope.new_input()
            control = megaphone.ControlInput(scope, k=k)
            m = megaphone.state_machine(data.stream, control, 0, fold)
        epochs = [[[(key, 1) for key in range(200)]]] * 3
        moves = [{}, {b: worker.peers - 1 for b in range(1 << k)}, {}]
        drive(worker, [data], control, m, epochs, moves, check_bins=False)
        gc.collect()
        tracked = [gc.is_tracked(b.state) for b in m._shared.bins if b is not None]
        state = m.state()
        data.close()
        control.close()
        worker.finish()
        return tracked, state

    return main


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2], ids=["w1", "w2"])
def test_bin_state_stays_tracked_through_full_collections(workers):
    """A bin's state dict is never untracked by the collector, also after it was installed by a
    migration (an untracked dict goes back to the young generation whole on its next insert)."""
    results = run(tracked_job(3), workers)
    tracked, _ = results[-1]  # the last worker holds every bin after epoch 1
    assert len(tracked) == 8 and all(tracked)
    merged = {}
    for _, state in results:
        merged.update(state)
    assert merged == {key: 3 for key in range(200)}


def build_only(build, control_k: int = 3):
    """A job that builds ``build(scope, stream, control)`` on a ``ControlInput`` of ``k=control_k``
    and ends at once (every input closed)."""

    def main(worker):
        with worker.dataflow() as scope:
            data = scope.new_input()
            control = megaphone.ControlInput(scope, k=control_k)
            build(scope, data.stream, control)
        data.close()
        control.close()
        worker.finish()

    return main


def fold_nothing(*args):
    return []


def sm_nothing(key, value, state):
    return state, []


BUILDERS = {
    "unary": lambda s, st, c, **kw: megaphone.unary(st, c, 0, fold_nothing, **kw),
    "binary": lambda s, st, c, **kw: megaphone.binary(st, st, c, 0, 0, fold_nothing, **kw),
    "state_machine": lambda s, st, c, **kw: megaphone.state_machine(st, c, 0, sm_nothing, **kw),
    "aggregate": lambda s, st, c, **kw: megaphone.aggregate(
        columnar.from_batches(st, pa.schema([("key", pa.int64()), ("v", pa.int64())])), c, "key", {"v": "sum"}, **kw),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_an_operator_k_other_than_its_control_inputs_is_refused_at_build(op):
    """The control input validates bins against its own 2^k: an operator of another k would take
    moves of bins it does not have and fail every worker at the first; it is refused at build,
    naming the operator and both k. The control input's own k, given or left out, builds."""
    name = {"unary": "MegaphoneUnary", "binary": "MegaphoneBinary", "state_machine": "StateMachine",
            "aggregate": "MegaphoneAggregate"}[op]
    with pytest.raises(BuildError, match=rf"'{name}': k=2 \(2\^2 bins\) differs from k=3 .*'Control'"):
        run(build_only(lambda s, st, c: BUILDERS[op](s, st, c, k=2)), 1)
    for k in (3, None):
        run(build_only(lambda s, st, c: BUILDERS[op](s, st, c, k=k)), 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", sorted(BUILDERS))
@pytest.mark.parametrize("chunk", [0, -1, True, 1.5, "2", None])
def test_a_chunk_that_is_not_a_positive_integer_is_refused_at_build(op, chunk):
    """``chunk`` (state entries per state message) is an integer >= 1: 0 failed the first migration
    and -1 shipped no chunk of a moving bin, losing it. Refused at build, naming the operator."""
    with pytest.raises(BuildError, match=rf"'\w+': chunk must be an integer >= 1 .*not {chunk!r}"):
        run(build_only(lambda s, st, c: BUILDERS[op](s, st, c, chunk=chunk)), 1)
