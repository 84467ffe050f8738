"""Misuse of the dataflow API fails loudly with a clear message (types AND message contents).

Errors raised inside operator logic reach the caller as ``timely.OperatorError`` wrapping the
original exception (README: user-code errors name the operator and worker); ``raised_cause`` digs
the original error out of that chain so both forms are accepted for capability misuse.
"""
from __future__ import annotations

import pytest
from conftest import run

import timely
from timely import OperatorBuilder
from timely.errors import CycleError
from timely.progress import Summary

pytestmark = pytest.mark.timeout(60)


def raised_cause(excinfo, kind):
    """The first exception of type ``kind`` in the raised exception's cause chain."""
    e = excinfo.value
    while e is not None:
        if isinstance(e, kind):
            return e
        e = getattr(e, "cause", None) or e.__cause__
    raise AssertionError(f"no {kind.__name__} in the chain of {excinfo.value!r}")


def error_message(main, kind) -> str:
    """The message of the ``kind`` error that running ``main`` on one worker must raise."""
    with pytest.raises(kind) as ei:
        run(main, 1)
    return str(ei.value)


def build_error(build, kind) -> str:
    """:func:`error_message` of a job that only builds a dataflow: ``build(scope, inp)`` with the
    dataflow's scope and one new input in it."""

    def main(worker):
        with worker.dataflow() as scope:
            build(scope, scope.new_input())

    return error_message(main, kind)


def run_unary(constructor, records=(1, 2, 3), name="Bad"):
    """Run ``constructor`` as a unary operator over ``records`` at epoch 0 on one worker."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.unary(constructor, name=name)
        inp.send_batch(list(records))
        inp.close()
        worker.finish()

    return run(main, 1)


# ---------------------------------------------------------------------------------------------
# Capabilities
# ---------------------------------------------------------------------------------------------

def test_send_with_dropped_capability():
    def ctor(cap, info):
        cap.drop()

        def logic(inp, out):
            for c, batch in inp:
                out.session(cap).give_batch(batch)
        return logic

    with pytest.raises((timely.CapabilityError, timely.OperatorError)) as ei:
        run_unary(ctor, name="Dropper")
    err = raised_cause(ei, timely.CapabilityError)
    assert "dropped" in str(err) and "Dropper" in str(err)


def test_capability_used_after_drop():
    def ctor(cap, info):
        cap.drop()
        cap.delayed(1)
        return lambda inp, out: None

    with pytest.raises(timely.CapabilityError, match=r"'Twice'.*used after drop"):
        run_unary(ctor, name="Twice")
    with pytest.raises(timely.CapabilityError, match="used after drop"):
        run_unary(lambda cap, info: (cap.drop(), cap.drop()), name="Twice")


def test_capability_for_another_output():
    """An operator with two outputs sends on output 1 with output 0's capability."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            b = OperatorBuilder(scope, "TwoOutputs")
            b.new_input(inp.stream)
            b.new_output()
            out1, _ = b.new_output()

            def constructor(caps):
                def logic():
                    out1.session(caps[0]).give(1)
                return logic

            b.build(constructor)
        inp.send(1)  # schedules the logic (no frontier interest)
        for _ in range(10):  # the held capabilities keep the dataflow alive: no finish()
            worker.step()

    with pytest.raises((timely.CapabilityError, timely.OperatorError)) as ei:
        run(main, 1)
    err = str(raised_cause(ei, timely.CapabilityError))
    assert "TwoOutputs" in err and "output 0" in err and "output 1" in err


def test_capability_of_another_operator():
    """A capability smuggled from operator 'Owner' into operator 'Thief' (same output number) is
    rejected, and the message says it belongs to another operator instead of the self-contradictory
    'capability for output 0 used on output 0'."""

    def main(worker):
        stolen = []

        def owner(cap, info):
            stolen.append(cap)
            return lambda inp, out: None

        def thief(cap, info):
            cap.drop()

            def logic(inp, out):
                for c, batch in inp:
                    out.give_batch(stolen[0], batch)
            return logic

        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.unary(owner, name="Owner")
            inp.stream.unary(thief, name="Thief")
        inp.send(1)
        inp.close()
        # 'Owner' holds its capability forever, so run a few steps rather than finish().
        for _ in range(10):
            worker.step()

    with pytest.raises((timely.CapabilityError, timely.OperatorError)) as ei:
        run(main, 1)
    err = str(raised_cause(ei, timely.CapabilityError))
    assert "Thief" in err
    assert "Owner" in err or "another operator" in err or "different operator" in err, err


def test_input_capability_through_non_identity_summary():
    """An operator whose input reaches its output only through a +1 summary cannot send at the
    input batch's time with the input capability."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            b = OperatorBuilder(scope, "Delayer")
            inp_h = b.new_input(inp.stream, connection=[[Summary(1, 1)]])
            out, _ = b.new_output()

            def constructor(caps):
                caps[0].drop()

                def logic():
                    for c, batch in inp_h:
                        out.session(c).give_batch(batch)
                return logic

            b.build(constructor)
        inp.send(1)
        worker.finish()

    with pytest.raises((timely.CapabilityError, timely.OperatorError)) as ei:
        run(main, 1)
    err = str(raised_cause(ei, timely.CapabilityError))
    assert "Delayer" in err and "identity summary" in err


@pytest.mark.parametrize("method", ["delayed", "downgrade"])
def test_capability_moved_backwards(method):
    def ctor(cap, info):
        cap.downgrade(5)
        getattr(cap, method)(3)
        return lambda inp, out: None

    with pytest.raises(timely.CapabilityError) as ei:
        run_unary(ctor, name="Backwards")
    msg = str(ei.value)
    assert "Backwards" in msg and "earlier" in msg and "5" in msg and "3" in msg


def test_input_capability_delayed_to_earlier_time():
    def ctor(cap, info):
        cap.drop()

        def logic(inp, out):
            for c, batch in inp:
                c.delayed(c.time - 1)
        return logic

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.unary(ctor, name="Rewind")
        inp.advance_to(4)
        inp.send(1)
        worker.finish()

    with pytest.raises((timely.CapabilityError, timely.OperatorError)) as ei:
        run(main, 1)
    err = str(raised_cause(ei, timely.CapabilityError))
    assert "Rewind" in err and "3" in err and "4" in err


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _input_misuse(action):
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input("Numbers")
            inp.stream.probe()
        action(inp)

    return run(main, 1)


def test_advance_to_backwards():
    def action(inp):
        inp.advance_to(5)
        inp.advance_to(2)

    with pytest.raises(timely.InputError) as ei:
        _input_misuse(action)
    msg = str(ei.value)
    assert "Numbers" in msg and "backwards" in msg and "5" in msg and "2" in msg


@pytest.mark.parametrize("what", ["send", "send_batch", "advance_to"])
def test_use_after_close(what):
    def action(inp):
        inp.send(1)
        inp.close()
        inp.close()  # idempotent
        {"send": lambda: inp.send(2), "send_batch": lambda: inp.send_batch([2, 3]),
         "advance_to": lambda: inp.advance_to(3)}[what]()

    with pytest.raises(timely.InputError) as ei:
        _input_misuse(action)
    assert "Numbers" in str(ei.value) and "closed" in str(ei.value)


# ---------------------------------------------------------------------------------------------
# Cycles and scopes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [0, -1])
def test_feedback_step_must_be_positive(step):
    def main(worker):
        with worker.dataflow() as scope:
            scope.feedback(step)

    msg = error_message(main, ValueError)
    assert "positive" in msg and str(step) in msg


def test_identity_cycle_with_operator_builder():
    """An operator fed by its own downstream through identity summaries: CycleError at build."""

    def build(scope, inp):
        b = OperatorBuilder(scope, "CycleHead")
        _, head = b.new_output()
        tail = inp.stream.concat(head).map(lambda x: x, name="CycleBody")
        b.new_input(tail)
        b.build(lambda caps: (lambda: None))

    msg = build_error(build, CycleError)
    assert "does not advance time" in msg and ("CycleHead" in msg or "CycleBody" in msg)


def test_identity_cycle_through_leave_and_enter():
    """A cycle leave() -> enter() through a nested scope, with no feedback in the outer scope: the
    outer epoch is unchanged all the way round, so it is an identity cycle (CycleError)."""

    def build(scope, inp):
        b = OperatorBuilder(scope, "OuterHead")
        _, head = b.new_output()
        with scope.iterative() as inner:
            back = inp.stream.concat(head).enter(inner).map(lambda x: x).leave()
        b.new_input(back)
        b.build(lambda caps: (lambda: None))

    msg = build_error(build, CycleError)
    assert "OuterHead" in msg


def test_cycle_through_leave_enter_and_inner_feedback():
    """An inner feedback(1) whose loop goes out of the nested scope and back in (leave -> enter).
    Round the cycle, (e, i) becomes (e, 0) + 1 = (e, 1): for i >= 1 the cycle does not advance time
    (ARCHITECTURE 2.7), so building it must fail with CycleError, not be accepted."""

    def build(scope, inp):
        with scope.iterative() as inner:
            h, loop = inner.feedback(1, name="InnerLoop")
            body = inp.stream.enter(inner).concat(loop)
            back = body.leave().enter(inner)
            back.filter(lambda x: x > 0).map(lambda x: x - 1).connect_loop(h)

    msg = build_error(build, CycleError)
    assert "does not advance time" in msg


def test_feedback_never_connected():
    def build(scope, inp):
        h, loop = scope.feedback(1, name="Dangling")
        inp.stream.concat(loop).probe()

    msg = build_error(build, timely.errors.BuildError)
    # The message must say what to do about a *feedback*, not just "operators never built".
    assert "Dangling" in msg and ("never connected" in msg or "connect_loop" in msg), msg


def test_feedback_connected_twice():
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            h, loop = scope.feedback(1, name="Twice")
            s = inp.stream.concat(loop).filter(lambda x: x > 0)
            s.connect_loop(h)
            s.connect_loop(h)

    with pytest.raises(ValueError, match="'Twice' is already connected"):
        run(main, 1)


def test_outer_stream_in_inner_scope_without_enter():
    def build(scope, inp):
        with scope.iterative() as inner:
            h, loop = inner.feedback(1)
            loop.concat(inp.stream, name="Mixer")  # inp.stream is not entered

    msg = build_error(build, ValueError)
    assert "Mixer" in msg and "enter()" in msg


def test_inner_stream_in_outer_scope_without_leave():
    def build(scope, inp):
        with scope.iterative() as inner:
            inside = inp.stream.enter(inner)
        inp.stream.binary(inside, lambda cap, info: None, name="Joiner")

    msg = build_error(build, ValueError)
    assert "Joiner" in msg and "leave()" in msg


def test_stream_of_sibling_scope_without_leave_enter():
    """A stream of one nested scope used directly in a sibling nested scope (same depth, different
    scope): it must be rejected like any other stream from another scope, not silently mixed into
    the sibling's loop coordinates."""

    def build(scope, inp):
        with scope.iterative() as first:
            s = inp.stream.enter(first).map(lambda x: x)
        with scope.iterative() as second:
            inp.stream.enter(second).concat(s, name="SiblingMixer").leave().probe()

    msg = build_error(build, ValueError)
    assert "SiblingMixer" in msg


def test_stream_of_another_dataflow():
    def main(worker):
        with worker.dataflow() as scope:
            first = scope.new_input().stream
        with worker.dataflow() as scope:
            scope.new_input().stream.concat(first, name="Crosser")

    msg = error_message(main, ValueError)
    assert "Crosser" in msg and "another dataflow" in msg


def test_enter_needs_a_directly_nested_scope():
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            with scope.iterative() as inner:
                with inner.iterative() as deeper:
                    inp.stream.enter(deeper)

    with pytest.raises(ValueError, match="nested directly"):
        run(main, 1)


def test_new_input_in_nested_scope():
    def main(worker):
        with worker.dataflow() as scope:
            with scope.iterative() as inner:
                inner.new_input()

    with pytest.raises(ValueError, match="enter"):
        run(main, 1)


def test_partition_route_out_of_range():
    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.partition(2, lambda x: x, name="Splitter")
        inp.send_batch([0, 1, 7])
        worker.finish()

    msg = error_message(main, timely.OperatorError)
    assert "Splitter" in msg and "7" in msg and "0..1" in msg


# ---------------------------------------------------------------------------------------------
# Exceptions in user code
# ---------------------------------------------------------------------------------------------

def _failing_main(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = (inp.stream
                 .map(lambda x: 100 // x, name="Divider")
                 .probe())
    # Only the last worker sends the 0 that breaks the map.
    inp.send_batch([1, 2, 0] if worker.index == worker.peers - 1 else [4, 5])
    inp.advance_to(1)
    worker.step_while(lambda: probe.less_than(1), timeout=20)
    return "unreachable"


@pytest.mark.parametrize("workers", [1, 2], ids=["w1", "w2"])
def test_exception_in_user_code(workers):
    with pytest.raises(timely.OperatorError) as ei:
        run(_failing_main, workers)
    msg = str(ei.value)
    assert "'Divider'" in msg
    assert f"worker {workers - 1}" in msg
    assert "ZeroDivisionError" in msg
    assert "Traceback" in msg and "100 // x" in msg  # the traceback reaches into user code


def test_exception_in_notify_logic_names_operator():
    def logic(inp, out, notificator):
        for c, batch in inp:
            notificator.notify_at(c.retain())
        for c in notificator:
            raise KeyError(f"missing state for {c.time}")

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.unary_notify(logic, name="Notifier")
        inp.send(1)
        worker.finish()

    with pytest.raises(timely.OperatorError) as ei:
        run(main, 1)
    assert "Notifier" in str(ei.value) and "missing state for 0" in str(ei.value)
    assert isinstance(ei.value.cause, KeyError) and ei.value.operator == "Notifier" and ei.value.worker == 0


def _stale_capability_job(use):
    """A unary_frontier that keeps its first batch's input capability and, a call later, hands it
    to ``use(cap, batch, out)``."""

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()

            def constructor(cap, info):
                cap.drop()
                kept = []

                def logic(i, out):
                    for c, b in i:
                        kept.append((c, list(b)))
                    if len(kept) > 1:
                        use(kept[0][0], kept[0][1], out)
                return logic

            inp.stream.unary_frontier(constructor, name="Late").probe()
        inp.send("a")
        inp.advance_to(1)
        for _ in range(20):  # the first batch's call, and the frontier passes its time
            worker.step()
        inp.send("b")
        inp.close()
        worker.finish()

    return main


def test_an_input_capability_used_after_its_invocation_is_refused():
    """A batch's capability is valid in the invocation that received it: used later, after the
    frontier may have passed its time, it would send records at a completed time."""
    expected = "operator 'Late': the input capability at 0 was used after the invocation that received its batch"
    for use in (lambda cap, batch, out: out.give_batch(cap, batch), lambda cap, batch, out: cap.retain().drop()):
        with pytest.raises(timely.OperatorError) as ei:
            run(_stale_capability_job(use), 1)
        assert expected in str(raised_cause(ei, timely.CapabilityError))


@pytest.mark.parametrize("workers", [2])  # (on one worker every pact is a pipeline: no key is taken)
def test_an_exchange_key_that_raises_is_named_with_the_record_and_time(workers):
    class BadRecord(Exception):
        def __init__(self, record, why):  # a constructor of two arguments: cannot be rebuilt from one message
            super().__init__(f"{record}: {why}")

    def key(x):
        if x == 3:
            raise BadRecord(x, "no key")
        return x

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            inp.stream.map(lambda x: x, name="Up").exchange(key).probe()
        if worker.index == 0:
            inp.send_batch([1, 2, 3, 4])
        inp.close()
        worker.finish()

    with pytest.raises((timely.OperatorError, timely.WorkerError)) as ei:
        run(main, workers)
    # (BadRecord, defined here, cannot be rebuilt in this process: the worker's traceback tells)
    assert "BadRecord: 3: no key" in str(ei.value)
    assert "operator 'Exchange#2': exchange key failed for record 3 at time 0" in str(ei.value)
    with pytest.raises((timely.OperatorError, timely.WorkerError)) as ei:
        run(_keyerror_job, workers)
    assert "KeyError: \"operator 'Exchange#1': exchange key failed for record 'b' at time 0: 'b'\"" in str(ei.value)
    # A field index on a record that is not a tuple or list (a dict here): the error names it,
    # not "record None" (the native rule accepts an int key only for tuple or list records).
    with pytest.raises((timely.OperatorError, timely.WorkerError)) as ei:
        run(_dict_record_job, workers)
    assert "exchange key failed for record {0: 'a'} at time 0" in str(ei.value)


def _dict_record_job(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.exchange(0).probe()
    if worker.index == 0:
        inp.send_batch([{0: "a"}])
    inp.close()
    worker.finish()


def _keyerror_job(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.exchange(lambda x: {"a": 1}[x]).probe()
    if worker.index == 0:
        inp.send_batch(["a", "b"])
    inp.close()
    worker.finish()
