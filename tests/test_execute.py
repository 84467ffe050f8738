"""``timely.execute``: the one process runner (start methods, timeouts, argument checks).

Every multi-process test bounds its run time, and the ``no_leftovers`` fixture (this process
becomes the reaper of orphans) kills and reaps anything left behind, then asserts that nothing was.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import alive, children, new_children, no_leftover_children

import timely
from timely.cluster import WorkerError, WorkerOperatorError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Set in this (the test) process before a run: a spawned worker imports this module afresh and
#: sees it empty, a forked one inherits it.
_MARKS: list[str] = []


@pytest.fixture
def no_leftovers():
    """After the test, kill and reap every child (orphaned workers included) and fail if any."""
    with no_leftover_children():
        yield


def _exchange(worker: timely.Worker, scale: int = 1) -> tuple:
    """Each worker sends 100 records through an exchange; returns what it saw and where it ran."""
    with worker.dataflow() as scope:
        inp = scope.new_input()
        got: list = []
        probe = inp.stream.exchange(None).inspect(got.append).probe()
    inp.send_batch([scale * x for x in range(worker.index * 100, worker.index * 100 + 100)])
    inp.close()
    worker.step_while(lambda: not probe.done())
    return worker.index, worker.peers, worker.args, sum(got), os.getpid(), list(_MARKS)


def _forever(worker: timely.Worker) -> None:
    worker.step_while(lambda: True)


def _fail_in_operator(worker: timely.Worker) -> None:
    def check(record: int) -> int:
        if record == 7:
            raise KeyError(record)
        return record

    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.map(check, name="Checker").probe()
    if worker.index == worker.peers - 1:
        inp.send_batch(list(range(10)))
    inp.advance_to(1)
    worker.step_while(lambda: probe.less_than(inp.time))


def _kill_self(worker: timely.Worker) -> None:
    if worker.index == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    worker.step_while(lambda: True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [1, 2])
def test_spawn_runs_a_module_level_main_in_fresh_interpreters(no_leftovers, workers):
    _MARKS.append("parent")
    try:
        results = timely.execute(_exchange, workers, args=["x"], start="spawn", timeout=60)
    finally:
        _MARKS.clear()
    assert [r[:3] for r in results] == [(i, workers, ["x"]) for i in range(workers)]
    assert sum(r[3] for r in results) == sum(range(100 * workers))
    pids = {r[4] for r in results}
    assert len(pids) == workers and os.getpid() not in pids
    assert all(r[5] == [] for r in results)  # nothing of this process's state: a fresh interpreter


@pytest.mark.timeout(60)
def test_fork_workers_inherit_the_callers_state(no_leftovers):
    _MARKS.append("parent")
    try:
        results = timely.execute(_exchange, 2)
    finally:
        _MARKS.clear()
    assert [r[5] for r in results] == [["parent"], ["parent"]]


@pytest.mark.timeout(60)
def test_spawn_takes_a_partial_of_a_module_level_function(no_leftovers):
    results = timely.execute(functools.partial(_exchange, scale=2), 2, start="spawn", timeout=50)
    assert sum(r[3] for r in results) == 2 * sum(range(200))


@pytest.mark.timeout(30)
def test_spawn_rejects_a_main_that_cannot_be_pickled(no_leftovers):
    def closure(worker):
        return worker.index

    before = {pid for pid, _ in children(os.getpid())}
    for main in (closure, lambda worker: None, functools.partial(closure)):
        with pytest.raises(TypeError, match=r"start='spawn' .* main must be picklable \(a module-level function"):
            timely.execute(main, 2, start="spawn")
    assert new_children(before) == []  # refused before any worker started


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 0}, "workers must be at least 1, not 0"),
    ({"start": "forkserver"}, "start must be one of 'fork', 'spawn', not 'forkserver'"),
    ({"workers": 2, "start": "thread"}, "start must be one of"),
    ({"timeout": -1.0}, "timeout must be a positive number of seconds or None, not -1.0"),
    ({"timeout": 0, "start": "spawn"}, "timeout must be a positive"),
])
def test_invalid_arguments_are_clear_errors(no_leftovers, kwargs, message):
    before = {pid for pid, _ in children(os.getpid())}
    with pytest.raises(ValueError, match=message):
        timely.execute(_exchange, **kwargs)
    assert new_children(before) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers, start", [(1, "fork"), (2, "fork"), (1, "spawn"), (2, "spawn")])
def test_a_timeout_stops_and_reaps_every_worker(no_leftovers, workers, start):
    before = {pid for pid, _ in children(os.getpid())}
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running after 3(\.0)? s"):
        timely.execute(_forever, workers, start=start, timeout=3)
    assert time.monotonic() - began < 3 + 10  # the timeout, then SIGTERM and at most the grace
    assert new_children(before) == []  # stopped and reaped before it raised


def _stuck_in_a_named_place(worker: timely.Worker) -> None:
    time.sleep(600)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_timeout_prints_where_each_worker_is_stuck(no_leftovers, capfd, start):
    with pytest.raises(TimeoutError, match=r"still running after 2(\.0)? s \(their stacks are on standard error\)"):
        timely.execute(_stuck_in_a_named_place, 2, start=start, timeout=2)
    err = capfd.readouterr().err
    for w in range(2):  # each worker's stack under its own line, at the line it is stuck on
        stacks = err.split(f"timely: worker {w} (pid ")[1].split("timely: worker")[0]
        assert "in _stuck_in_a_named_place" in stacks, err


@pytest.mark.timeout(30)
def test_one_forked_worker_with_a_timeout_runs_a_closure_in_a_child(no_leftovers):
    def main(worker):
        return os.getpid(), worker.peers

    ((pid, peers),) = timely.execute(main, timeout=20)
    assert pid != os.getpid() and peers == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_an_operator_error_under_spawn_carries_its_cause(no_leftovers, workers):
    with pytest.raises(WorkerOperatorError) as info:
        timely.execute(_fail_in_operator, workers, start="spawn", timeout=50)
    err = info.value
    assert err.index == err.worker == workers - 1 and err.operator == "Checker"
    assert type(err.cause) is KeyError and err.cause.args == (7,)
    assert "test_execute.py" in err.remote_traceback and "KeyError: 7" in err.remote_traceback


@pytest.mark.timeout(60)
def test_a_killed_spawned_worker_stops_the_others(no_leftovers):
    began = time.monotonic()
    with pytest.raises(WorkerError, match="worker 0 was killed by signal SIGKILL") as info:
        timely.execute(_kill_self, 2, start="spawn", timeout=50)
    assert info.value.signal == signal.SIGKILL
    assert time.monotonic() - began < 20


# A driver script whose spawned workers print their pids and run until stopped.
DRIVER = """
    import os
    import timely

    def main(worker):
        os.write(1, f"worker {os.getpid()}\\n".encode())  # one write: lines of two workers never mix
        worker.step_while(lambda: True)

    if __name__ == "__main__":
        timely.execute(main, 2, start="spawn")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_spawned_workers_end_with_their_caller(tmp_path, no_leftovers, sig):
    """Ctrl-C (the caller stops and reaps its workers), SIGTERM (the default action: the caller
    dies at once) and SIGKILL: no worker outlives the caller."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        proc.wait(20)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


# -- the job secret --------------------------------------------------------------------------------
def _secret_of(worker: timely.Worker):
    return worker.secret


@pytest.mark.timeout(60)
def test_worker_secret_is_none_without_one_and_the_job_secret_with_one(no_leftovers, monkeypatch):
    from timely.comm.secret import ENV, ENV_FILE, JobSecret

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    assert timely.execute(_secret_of, workers=1) == [None]
    assert timely.execute(_secret_of, workers=2, timeout=50) == [None, None]
    keys = JobSecret.from_text("s3cret")
    assert timely.execute(_secret_of, workers=1, secret="s3cret") == [keys]  # in process
    assert timely.execute(_secret_of, workers=1, secret=keys) == [keys]
    monkeypatch.setenv(ENV, "s3cret")
    assert timely.execute(_secret_of, workers=1) == [keys]  # the environment's, as the launcher's

    def assign(worker):
        worker.secret = keys

    with pytest.raises(AttributeError):
        timely.execute(assign, workers=1)
    assert timely.execute(_secret_of, workers=2, timeout=50, secret="s3cret") == [keys, keys]


SECRET_JOB = """
    import sys

    from timely.comm.secret import JobSecret

    def main(worker):
        expected = JobSecret.from_text(worker.args[0]) if worker.args else None
        # one write per line: the workers share the launcher's stdout
        sys.stdout.write(f"SECRET {worker.index} {worker.secret == expected} {worker.secret is None}\\n")
        sys.stdout.flush()
"""


def _launch(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIMELY_SECRET")}
    return subprocess.run([sys.executable, "-m", "timely.launch", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=50, env={**clean, **(env or {})})


@pytest.mark.timeout(120)
def test_the_launcher_resolves_the_secret_once_and_refuses_a_bad_file(tmp_path, no_leftovers):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(SECRET_JOB))
    run = _launch("-w", "1", str(job))
    assert run.returncode == 0 and "SECRET 0 True True" in run.stdout, run.stderr
    missing = tmp_path / "no-such-secret"
    run = _launch("-w", "2", "--secret-file", str(missing), str(job))
    assert run.returncode == 2 and not run.stdout
    assert f"cannot read the job secret file {missing}" in run.stderr, run.stderr
    empty = tmp_path / "empty-secret"
    empty.write_text("\n")
    run = _launch("-w", "2", str(job), env={"TIMELY_SECRET_FILE": str(empty)})
    assert run.returncode == 2 and f"the job secret is empty (file {empty})" in run.stderr, run.stderr
    good = tmp_path / "secret"
    good.write_text("s3cret\n")
    run = _launch("-w", "2", "--secret-file", str(good), str(job), "s3cret")
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.splitlines()) == ["SECRET 0 True False", "SECRET 1 True False"]


@pytest.mark.timeout(60)
def test_the_workers_of_one_run_share_a_job_id_that_no_other_run_has():
    first = timely.execute(lambda worker: worker.job_id, workers=2)
    second = timely.execute(lambda worker: worker.job_id, workers=2)
    alone = timely.execute(lambda worker: worker.job_id, workers=1)
    assert first[0] == first[1] and second[0] == second[1]
    assert len({first[0], second[0], alone[0]}) == 3
    assert all(isinstance(j, str) and len(j) >= 16 for j in first + second + alone)


def _write_into_a_closed_socket(worker: timely.Worker) -> str:
    import socket

    mine, theirs = socket.socketpair()
    theirs.close()  # a client that went away mid-reply, as a browser closing the dashboard's page
    try:
        mine.sendall(b"x" * 100_000)
    except BrokenPipeError:
        return "BrokenPipeError"
    finally:
        mine.close()
    return "sent"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_socket_whose_peer_closed_raises_in_the_worker_instead_of_killing_it(no_leftovers, start):
    """The dashboard's server runs in worker 0: a client closing early must not end the job."""
    assert timely.execute(_write_into_a_closed_socket, 2, start=start, timeout=50) == ["BrokenPipeError"] * 2


@pytest.mark.timeout(60)
def test_completed_dataflows_are_freed_while_main_runs():
    """A job that builds, runs and completes dataflows one after another keeps none of them (their
    operators and state) alive once complete: a closed input no longer holds its dataflow."""
    import gc
    import weakref

    class State:  # (weakly referenceable, unlike a bytearray)
        data = bytearray(100_000)

    def main(worker):
        refs = []
        for _ in range(20):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                state = State()
                inp.stream.map(lambda x, s=state: x + len(s.data)).probe()
            refs.append(weakref.ref(state))
            inp.send(1)
            inp.close()
            worker.step_while(worker.has_dataflows, timeout=10)
            del inp, state
        gc.collect()
        return sum(r() is not None for r in refs)

    (alive,) = timely.execute(main, workers=1)
    assert alive <= 1  # (the last one may linger in the step's locals)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_completed_dataflow_is_freed_while_main_keeps_its_handles(no_leftovers, workers):
    """The usual locals of ``main`` (the closed input, a stream, the probe) kept a completed
    dataflow's operators and their state alive until ``main`` returned."""
    import gc
    import weakref

    class State:
        data = bytearray(100_000)

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            state = State()
            stream = inp.stream.map(lambda x, s=state: x + len(s.data)).exchange(lambda x: x)
            probe = stream.probe()
        ref = weakref.ref(state)
        del state
        inp.send_batch(list(range(10)))
        inp.close()
        worker.step_while(worker.has_dataflows, timeout=20)
        gc.collect()
        return ref() is None and inp.closed and probe.done() and stream is not None

    assert timely.execute(main, workers=workers, timeout=50 if workers > 1 else None) == [True] * workers


@pytest.mark.timeout(60)
def test_the_channels_of_completed_dataflows_are_let_go(no_leftovers):
    def main(worker):
        for _ in range(30):
            with worker.dataflow("q") as scope:
                inp = scope.new_input()
                probe = inp.stream.exchange(lambda x: x).probe()
            inp.send_batch([worker.index, 5, 7])
            inp.close()
            worker.step_while(lambda: not probe.done(), timeout=20)
        worker.step_while(worker.has_dataflows, timeout=20)
        return len(worker.allocator._mailbox._pullers)  # (each dataflow had a progress and an exchange channel)

    assert timely.execute(main, workers=2, timeout=50) == [0, 0]


def test_a_late_message_on_a_retired_channel_is_dropped():
    from timely.comm.errors import ChannelMismatch
    from timely.comm.mailbox import Mailbox

    box = Mailbox(0)
    for channel in range(4):
        box.open(channel)
    box.retire([0, 1, 3])
    assert box._retired_below == 2 and box._retired == {3}
    box.deliver(1, 0, "late", 10)  # below the watermark
    box.deliver(1, 3, "late", 10)  # retired above it
    assert box.unread_bytes == 0 and box.take_events() == []
    box.deliver(1, 2, "live", 10)
    assert box.take_events() == [2]
    box.retire([2])
    assert box._retired_below == 4 and box._retired == set()
    skipped = Mailbox(0)
    skipped.open(0)
    skipped.open(2)  # channel 1 skipped: a message on it can never be read, and is not retired
    with pytest.raises(ChannelMismatch):
        skipped.deliver(1, 1, "lost", 1)


def test_repeated_dataflow_names_are_numbered_once_each():
    def main(worker):
        labels = []
        for name in ("q", "q #2", "q", "q", "other", "q"):
            with worker.dataflow(name) as scope:
                scope.new_input().close()
            labels.append(worker._dataflows[-1].label)
        return labels

    (labels,) = timely.execute(main, workers=1)
    assert labels == ["q", "q #2", "q #3", "q #4", "other", "q #5"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_step_or_park_without_a_dataflow_returns_at_once(no_leftovers, workers):
    def main(worker):
        started = time.monotonic()
        more = worker.step_or_park(None)
        unbounded = time.monotonic() - started < 5
        # A bounded park still waits (a caller pacing itself must not spin): count the calls a
        # 0.3 s wait takes, as nexmark.openloop.start_together waits for its start line.
        calls, until = 0, time.monotonic() + 0.3
        while time.monotonic() < until:
            worker.step_or_park(until - time.monotonic())
            calls += 1
        return more, unbounded and calls < 1000

    assert timely.execute(main, workers=workers, timeout=30 if workers > 1 else None) == [(False, True)] * workers


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_watchdog_limit_that_is_not_positive_is_refused_before_any_worker_starts(no_leftovers, workers):
    before = {pid for pid, _ in children(os.getpid())}
    with pytest.raises(ValueError, match="the watchdog limit must be a positive number of seconds, not 0"):
        timely.execute(_exchange, workers, watchdog=0)
    assert new_children(before) == []


def test_a_failed_worker_construction_leaves_no_watchdog_behind(tmp_path):
    import threading

    (tmp_path / "file").write_text("")
    handler = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Exception, match="cannot be used"):
        timely.execute(lambda w: 1, workers=1, watchdog=5, checkpoint=str(tmp_path / "file" / "ckpt"))
    assert [t.name for t in threading.enumerate() if "watchdog" in t.name] == []
    assert signal.getsignal(signal.SIGUSR1) == handler


@pytest.mark.timeout(60)
def test_send_batch_takes_a_numpy_array_as_python_records(no_leftovers):
    import numpy as np

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            got = inp.stream.exchange(lambda x: x).capture()
        if worker.index == 0:
            inp.send(0)
            inp.send_batch(np.arange(1, 5))  # after a buffered record, and alone
            inp.send_batch(np.arange(5, 8))
        inp.close()
        worker.finish()
        return sorted((type(x).__name__, x) for _, batch in got.extract() for x in batch)

    results = timely.execute(main, workers=2, timeout=50)
    assert sorted(r for res in results for r in res) == [("int", i) for i in range(8)]


@pytest.mark.parametrize("kwargs, message", [
    ({"args": "abc"}, "args must be a sequence of strings .* not one string: 'abc'"),
    ({"fuzz": "x"}, "fuzz must be an integer seed or None, not 'x'"),
    ({"fuzz": True}, "fuzz must be an integer seed or None, not True"),
])
def test_a_string_for_args_or_fuzz_is_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        timely.execute(_exchange, 1, **kwargs)


def test_a_numpy_integer_is_a_fuzz_seed():
    import numpy as np

    assert timely.execute(lambda worker: worker.fuzz, 1, fuzz=np.int64(7)) == [7]
