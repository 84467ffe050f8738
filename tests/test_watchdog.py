"""Hung workers: a stuck operator is named, with its stack, and ends the job; a worker stopped by
SIGSTOP ends it too, while a stop and continue of the whole job (Ctrl-Z, fg) does not."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import timely

ROOT = Path(__file__).resolve().parent.parent


def sleepy(seconds: float):
    """A job whose operator ``Sleeper`` sleeps ``seconds`` in its first invocation with data."""

    def main(worker):
        def nap(x):
            time.sleep(seconds)
            return x

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.map(nap, name="Sleeper").probe()
        if worker.index == 0:
            inp.send(1)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=120)
        return "done"

    return main


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_stuck_operator_ends_the_job_with_its_name_and_stack(workers, capfd):
    started = time.monotonic()
    # One worker without a timeout runs in this process (pytest's timeout bounds it); two as processes.
    bound = {} if workers == 1 else {"timeout": 50}
    with pytest.raises(timely.OperatorError) as ei:
        timely.execute(sleepy(10**6), workers=workers, watchdog=1.0, **bound)
    assert time.monotonic() - started < 30
    message = str(ei.value)
    assert "Sleeper" in message and "watchdog limit of 1 s" in message
    if workers == 1:
        assert isinstance(ei.value, timely.OperatorStuckError) and "time.sleep(seconds)" in ei.value.stack
    else:
        assert isinstance(ei.value, timely.WorkerOperatorError) and "worker 0" in message
        assert isinstance(ei.value.cause, TimeoutError)
    assert "time.sleep(seconds)" in capfd.readouterr().err  # the report names the stuck line


@pytest.mark.timeout(60)
def test_a_quick_job_is_left_alone_and_the_signal_handler_restored():
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    assert timely.execute(sleepy(0.01), workers=1, watchdog=5.0) == ["done"]
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.timeout(90)
def test_the_launcher_warns_only_when_asked(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(
        "import time\n"
        "def main(worker):\n"
        "    with worker.dataflow() as scope:\n"
        "        inp = scope.new_input()\n"
        "        inp.stream.map(lambda x: time.sleep(2.5) or x, name='Slow').probe()\n"
        "    inp.send(1)\n"
        "    inp.close()\n"
        "    worker.finish()\n"
    )
    base = [sys.executable, "-m", "timely.launch", "-w", "1", "--timeout", "60", "--watchdog", "1"]
    warned = subprocess.run([*base, "--watchdog-warn", str(job)], cwd=ROOT, capture_output=True, text=True,
                            timeout=80)
    assert warned.returncode == 0, warned.stderr
    assert "operator 'Slow' has run for" in warned.stderr
    failed = subprocess.run([*base, str(job)], cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert failed.returncode == 1 and "Slow" in failed.stderr and "watchdog limit" in failed.stderr
    bad = subprocess.run([*base[:-2], "--watchdog", "0", str(job)], cwd=ROOT, capture_output=True, text=True,
                         timeout=80)
    assert bad.returncode == 2 and "--watchdog must be a positive" in bad.stderr


# -- stopped workers (SIGSTOP / SIGTSTP) ------------------------------------------------------------
STEADY_JOB = """
import os, signal, sys, time

def main(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        got = []
        probe = inp.stream.exchange(lambda x: x).inspect(got.append).probe()
    sys.stdout.write(f"ready {worker.index}\\n")
    sys.stdout.flush()
    if worker.index == 1 and worker.args == ["stop-self"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    for epoch in range(20):  # about 2 s of work, then the result
        inp.send_batch([epoch * 10 + k for k in range(worker.index, 10, worker.peers)])
        inp.advance_to(epoch + 1)
        worker.step_while(lambda: probe.less_than(inp.time))
        time.sleep(0.1)
    inp.close()
    worker.finish()
    sys.stdout.write(f"RESULT {worker.index} {len(got)} {sum(got)}\\n")  # one write: stdout is shared
    sys.stdout.flush()
"""


@contextlib.contextmanager
def _launched(tmp_path, *argv: str) -> Iterator[subprocess.Popen]:
    """The launcher running STEADY_JOB on two workers; killed with its workers if the test left it running."""
    job = tmp_path / "steady.py"
    job.write_text(STEADY_JOB)
    # A session of its own: the test signals the launcher's process group, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", "--stopped-grace", "1", str(job),
                             *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    seen = ""
    while seen.count("ready") < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        seen += line


@pytest.mark.timeout(30)
def test_a_worker_stopped_by_sigstop_ends_the_job_naming_it(tmp_path):
    started = time.monotonic()
    with _launched(tmp_path, "stop-self") as proc:
        out, err = proc.communicate(timeout=25)
    assert proc.returncode == 1, err
    assert "worker 1 was stopped by a signal (SIGSTOP or SIGTSTP) and stayed stopped for" in err, err
    assert "crashed or was killed" not in err
    assert time.monotonic() - started < 15


@pytest.mark.timeout(40)
def test_a_job_stopped_and_continued_as_a_whole_goes_on(tmp_path):
    with _launched(tmp_path) as proc:
        _wait_ready(proc)
        os.killpg(proc.pid, signal.SIGSTOP)  # Ctrl-Z: the launcher and every worker stop ...
        time.sleep(3)  # ... for longer than --stopped-grace ...
        os.killpg(proc.pid, signal.SIGCONT)  # ... and `fg` continues them all
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    expected = sum(epoch * 10 + k for epoch in range(20) for k in range(10))
    results = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT"))
    assert [r[0] for r in results] == ["0", "1"] and sum(int(r[1]) for r in results) == 200
    assert sum(int(r[2]) for r in results) == expected


# -- an operator that catches OperatorStuckError -----------------------------------------------------
def catching(tries: int | None, nap: float = 100.0):
    """A job whose operator ``Catcher`` calls ``time.sleep(nap)`` in a retry loop that catches every
    ``Exception``: ``tries`` times (then it fails, saying how many errors it caught), or for ever
    (``None``)."""

    def main(worker):
        def logic(x):
            caught = attempts = 0
            while tries is None or attempts < tries:
                attempts += 1
                try:
                    time.sleep(nap)  # a call that blocks (a network call without a timeout)
                except Exception:  # "retry on any error"
                    caught += 1
            raise RuntimeError(f"caught {caught}")

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.map(logic, name="Catcher").probe()
        if worker.index == 0:
            inp.send(1)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=120)

    return main


@pytest.mark.timeout(60)
def test_an_operator_that_catches_the_error_gets_it_again_every_limit_in_process(capfd):
    # In the caller's process the watchdog never ends the process: it raises again every limit
    # seconds, past GIVE_UP_AFTER, for as long as the invocation lasts.
    from timely.watchdog import GIVE_UP_AFTER

    tries = GIVE_UP_AFTER + 2
    started = time.monotonic()
    with pytest.raises(timely.OperatorError) as ei:
        timely.execute(catching(tries, nap=6.0), workers=1, watchdog=0.5)
    assert f"caught {tries}" in str(ei.value)  # every sleep was cut short by the watchdog
    assert time.monotonic() - started < 6  # (about tries * 0.5 s; one error only: 0.5 + (tries - 1) * 6 s)
    err = capfd.readouterr().err
    assert err.count("operator 'Catcher' caught the OperatorStuckError") == tries - 1
    assert "the worker runs in the caller's process, which the watchdog does not end" in err


@pytest.mark.timeout(60)
def test_a_worker_process_whose_operator_swallows_the_error_is_ended_naming_the_operator(capfd):
    from timely.watchdog import GIVE_UP_AFTER

    started = time.monotonic()
    # The timeout bounds a watchdog that fails (TimeoutError); supervise reaps the workers either way.
    with pytest.raises(timely.WorkerOperatorError) as ei:
        timely.execute(catching(None), workers=2, watchdog=0.5, timeout=20)
    assert time.monotonic() - started < 12  # about (GIVE_UP_AFTER + 1) * 0.5 s
    message = str(ei.value)
    assert message.startswith("worker 0 failed:") and "operator 'Catcher'" in message
    assert "watchdog limit of 0.5 s" in message and "Remote traceback" in message
    assert isinstance(ei.value.cause, TimeoutError) and ei.value.operator == "Catcher"
    err = capfd.readouterr().err
    assert f"operator 'Catcher' caught the OperatorStuckError {GIVE_UP_AFTER} times" in err
    assert "ending worker 0's process" in err and "time.sleep(nap)" in err


# -- time stopped does not count ---------------------------------------------------------------------
PAUSED_JOB = """
import sys, time, timely

def main(worker):
    def work(x):
        print("in", flush=True)  # the test stops this process now, for longer than the limit
        end = time.process_time() + 0.5  # 0.5 s of the process's own time: well under the 3 s limit
        while time.process_time() < end:
            pass
        return x

    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.map(work, name="Busy").probe()
    inp.send(1)
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=60)
    return "done"

try:
    print("result", timely.execute(main, workers=1, watchdog=3.0), flush=True)  # in this process
except Exception as e:
    print("raised", type(e).__name__, flush=True)
"""


@pytest.mark.timeout(60)
def test_time_the_process_spent_stopped_does_not_count():
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_JOB], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "in\n", proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGSTOP)  # Ctrl-Z (or a debugger) in the middle of the invocation ...
        time.sleep(4.5)  # ... for longer than the limit ...
        os.kill(proc.pid, signal.SIGCONT)  # ... then fg
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert out.splitlines()[-1] == "result ['done']", err
    assert "timely watchdog" not in err


@pytest.mark.timeout(90)
def test_a_long_computation_holding_the_gil_is_still_reported():
    # The watchdog thread cannot run during a C call that holds the GIL, so it wakes late, as after
    # a pause; but the process used CPU time meanwhile: that time counts, the operator is reported.
    from timely.watchdog import SELF_PAUSE

    n = 10**6
    while True:  # a sum(range(n)) (one C call) using more CPU time than a pause the watchdog would not count
        t = time.process_time()
        sum(range(n))
        if time.process_time() - t > SELF_PAUSE + 0.5:
            break
        n *= 2

    def main(worker):
        def crunch(x):
            while True:
                sum(range(n))

        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.map(crunch, name="Crunch").probe()
        inp.send(1)
        inp.close()
        worker.step_while(lambda: not probe.done(), timeout=60)

    with pytest.raises(timely.OperatorStuckError) as ei:
        timely.execute(main, workers=1, watchdog=0.4)
    assert ei.value.operator == "Crunch"
    # Reported once the first call returned, with its whole length (taken for a pause, it would
    # not count, and the report would come calls later, just past the limit of counted time).
    assert ei.value.seconds > SELF_PAUSE


# -- the error lands only in the invocation it names -------------------------------------------------
@pytest.mark.timeout(60)
def test_an_error_that_arrives_after_its_invocation_returned_is_dropped(monkeypatch):
    class SlowReport:
        """Standard error on which the watchdog's report takes 2 s to write (a slow terminal or
        pipe): the invocation returns, and the job reaches Worker.close(), before the error is sent."""

        def __init__(self, stream):
            self.stream = stream

        def write(self, text):
            if "timely watchdog" in text:
                time.sleep(2.0)
            return self.stream.write(text)

        def flush(self):
            self.stream.flush()

    import threading

    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(sys, "stderr", SlowReport(sys.stderr))
    try:
        # Sleeper naps 1.6 s: past the 1 s limit, but done before the report is written.
        assert timely.execute(sleepy(1.6), workers=1, watchdog=1.0) == ["done"]
        assert signal.getsignal(signal.SIGUSR1) is before  # Worker.close() restored it
        assert not [t for t in threading.enumerate() if t.name.startswith("timely-watchdog")]
    finally:
        signal.signal(signal.SIGUSR1, before)
