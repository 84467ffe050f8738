"""Live state migration: a keyed count whose bins move between workers while data keeps flowing.

    python -m timely.launch -w 2 examples/migrate.py [epochs] [strategy] [endpoint]

Worker 0 plans a migration from the balanced routing table to a skewed one (half of worker 1's bins
move to worker 0) with the given strategy (all_at_once, fluid or batched, default batched) and a
Controller issues its steps one at a time while every worker keeps sending records. At the end
each worker checks its counts against a sequential count of the same records. With an endpoint
(for example tcp://127.0.0.1:6100), `python -m megaphone.rebalance --endpoint ... --balanced`
can move the bins back while the job runs.
"""
from __future__ import annotations

import random
from collections import Counter

import megaphone
import timely

KEYS = 5_000
PER_EPOCH = 2_000
K = 6  # 2^6 = 64 bins


def records(epoch: int, worker: int) -> list[tuple[int, int]]:
    """The ``(key, 1)`` records ``worker`` sends in ``epoch`` (deterministic, so any worker can recount them)."""
    rnd = random.Random(epoch * 1000 + worker)
    return [(rnd.randrange(KEYS), 1) for _ in range(PER_EPOCH)]


def main(worker: timely.Worker) -> int:
    """One worker: count keys while worker 0 migrates bins; check the state; return the keys held."""
    epochs = int(worker.args[0]) if worker.args else 40
    strategy = worker.args[1] if len(worker.args) > 1 else "batched"
    endpoint = worker.args[2] if len(worker.args) > 2 else None

    def fold(key, value, count):
        count = (count or 0) + value
        return count, [(key, count)]

    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=K)
        counts = megaphone.state_machine(data.stream, control, 0, fold)

    controller = None
    if worker.index == 0:
        controller = megaphone.Controller(control, counts.probe)
        if endpoint:
            megaphone.ControlEndpoint(controller, endpoint)
            print(f"control endpoint: {endpoint}", flush=True)
        target = megaphone.skewed(controller.current_table, peers=worker.peers)
        controller.rebalance(target, strategy)
        def progress(event, what):
            if what == "completed":
                print(f"step {event.index + 1}/{event.steps}: bins {event.bins} moved in {event.duration * 1000:.1f} ms",
                      flush=True)

        controller.on_progress = progress

    for epoch in range(epochs):
        data.send_batch(records(epoch, worker.index))
        data.advance_to(epoch + 1)
        control.advance_to(epoch + 1)
        if controller:
            controller.tick()
        worker.step_while(lambda: counts.probe.less_than(epoch))  # at most one epoch in flight
    # Worker 0 keeps time moving until the last step completed; the others are done sending.
    while controller and controller.busy:
        epoch += 1
        data.advance_to(epoch + 1)
        control.advance_to(epoch + 1)
        controller.tick()
        worker.step_while(lambda: counts.probe.less_than(epoch))
    data.close()
    control.close()
    worker.step_while(lambda: not counts.probe.done())

    expected: Counter[int] = Counter()
    for epoch in range(epochs):
        for w in range(worker.peers):
            for key, value in records(epoch, w):
                expected[key] += value
    # The state this worker holds now: exactly the sequential counts of the keys of its bins.
    owned = set(counts.owned_bins())
    bins = megaphone.bins_of(list(expected), None, K)
    mine = {key: c for key, c, b in zip(expected, expected.values(), bins) if b in owned}
    state = counts.state()
    bad = [(key, state.get(key), c) for key, c in mine.items() if state.get(key) != c]
    assert not bad and len(state) == len(mine), (
        f"worker {worker.index}: state differs from the sequential count: {len(bad)} keys, e.g. {bad[:5]}")
    print(f"worker {worker.index}: {len(mine)} keys, counts match; owns {len(counts.owned_bins())} of {1 << K} bins; "
          f"routing table {''.join(map(str, counts.routing_table()))}", flush=True)
    return len(mine)


if __name__ == "__main__":
    print(timely.execute(main, workers=2))
