"""Workers that build different dataflows get a loud error, never a hang (ARCHITECTURE 2.8)."""
from __future__ import annotations

import pytest

import timely

TIMEOUT = 60  # a hang would be the bug: the run is bounded and raises TimeoutError instead


def shared(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.map(lambda x: x + 1).exchange().probe()
    inp.send_batch(list(range(10)))
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=TIMEOUT)


def extra_dataflow_on(extra: int):
    def main(worker):
        shared(worker)
        if worker.index == extra:
            with worker.dataflow() as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: x).probe()
            inp.close()
        worker.finish()
        return worker.index

    return main


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [0, 1])
def test_a_worker_with_one_more_dataflow_raises_instead_of_idling(extra):
    with pytest.raises(timely.WorkerError) as ei:
        timely.execute(extra_dataflow_on(extra), workers=2, timeout=TIMEOUT)
    message = str(ei.value)
    assert "ProgressMismatchError" in message and f"worker {1 - extra} finished without building it" in message


@pytest.mark.timeout(120)
def test_a_loop_of_plain_steps_raises_too():
    """``while worker.step(): ...`` (steps that never wait) gets the same error: the check runs on
    an idle step whether or not it would park."""
    def main(worker):
        shared(worker)
        if worker.index == 1:
            with worker.dataflow() as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: x).probe()
            inp.close()
            while worker.step():
                pass
        return worker.index

    with pytest.raises(timely.WorkerError) as ei:
        timely.execute(main, workers=2, timeout=TIMEOUT)
    assert "ProgressMismatchError" in str(ei.value) and "worker 0 finished without building it" in str(ei.value)


@pytest.mark.timeout(120)
def test_workers_with_the_same_dataflows_finish():
    def main(worker):
        shared(worker)
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.map(lambda x: x).probe()
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=TIMEOUT)
        worker.finish()
        return worker.index

    assert timely.execute(main, workers=3, timeout=TIMEOUT) == [0, 1, 2]


@pytest.mark.timeout(120)
def test_a_worker_with_another_operator_is_a_mismatch():
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            stream = inp.stream.map(lambda x: x) if worker.index == 0 else inp.stream
            stream.exchange().probe()
        inp.send_batch([1, 2, 3])
        worker.finish()

    with pytest.raises(timely.WorkerError) as ei:
        timely.execute(main, workers=2, timeout=TIMEOUT)
    assert "Mismatch" in str(ei.value) or "different dataflow" in str(ei.value)


@pytest.mark.timeout(120)
def test_workers_whose_loops_advance_by_different_steps_raise():
    """The shape digest named operators and edges only: workers whose feedback loops advance by
    different steps (the same operators, other summaries) applied each other's updates."""
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            handle, loop = scope.feedback(1 + worker.index)  # worker 1's loop steps by 2
            body = inp.stream.concat(loop)
            body.filter(lambda x: x > 1).map(lambda x: x // 2).exchange(None).connect_loop(handle)
            probe = body.probe()
        inp.send_batch([8, 5])
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=TIMEOUT)
        return worker.index

    with pytest.raises(timely.WorkerError, match="ProgressMismatchError.*built a different dataflow"):
        timely.execute(main, workers=2, timeout=TIMEOUT)
