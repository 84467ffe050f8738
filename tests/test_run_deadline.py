"""``timeout`` bounds the whole run, restarts included, in ``timely.execute`` and in the launcher
(``--timeout S``): every attempt gets what the earlier ones left, and a failure once the time is up
is not restarted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import no_leftover_children

import timely
from timely.cluster import STOP_GRACE, Outcome, WorkerError, supervise
from timely.recovery import run_restarting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Seconds of work before each attempt fails, and the run's timeout: one attempt fits in the
#: timeout, two do not (an attempt also needs its workers started, a few tenths of a second).
WORK, TIMEOUT = 2.0, 3.5

FAILING_JOB = f"""
    import time

    def main(worker):
        with worker.dataflow() as scope:
            scope.new_input().stream.probe()
        started = time.monotonic()
        while time.monotonic() - started < {WORK}:  # work, then a failure a restart may cure
            worker.step_or_park(0.05)
        raise RuntimeError("transient failure")
"""


def _failing_main(worker):
    with worker.dataflow() as scope:
        scope.new_input().stream.probe()
    started = time.monotonic()
    while time.monotonic() - started < WORK:
        worker.step_or_park(0.05)
    raise RuntimeError("transient failure")


@pytest.mark.timeout(60)
def test_execute_timeout_bounds_the_run_with_its_restarts(tmp_path, capfd):
    """Each attempt fails after WORK s, within TIMEOUT: with the timeout bounding each attempt on
    its own, all 3 restarts ran and the run failed with the worker's error after about 4 * WORK s.
    With one deadline, the first restart runs out of time."""
    with no_leftover_children():
        began = time.monotonic()
        with pytest.raises(TimeoutError, match=f"still running after {TIMEOUT} s"):
            timely.execute(_failing_main, workers=2, timeout=TIMEOUT, checkpoint=str(tmp_path), restarts=3)
        elapsed = time.monotonic() - began
    err = capfd.readouterr().err
    assert "restart 1 of 3" in err and "restart 2 of 3" not in err
    assert TIMEOUT <= elapsed < TIMEOUT + STOP_GRACE + 2.0


@pytest.mark.timeout(60)
def test_launch_timeout_bounds_the_job_with_its_restarts(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(FAILING_JOB))
    with no_leftover_children():
        proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", "--timeout", str(TIMEOUT),
                                 "--checkpoint", str(tmp_path / "ck"), "--restarts", "3", str(job)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            began = time.monotonic()
            _, err = proc.communicate(timeout=40)
            elapsed = time.monotonic() - began
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
    assert proc.returncode == 1, err
    assert "restart 1 of 3" in err and "restart 2 of 3" not in err, err
    assert f"timely.launch: timeout: workers [0, 1] still running after {TIMEOUT} s" in err, err
    assert elapsed < TIMEOUT + STOP_GRACE + 5.0  # (the launcher's own start-up counts here too)


def test_a_failure_after_the_deadline_is_not_restarted(tmp_path):
    from timely.checkpoint.checkpointer import CheckpointConfig

    config = CheckpointConfig(str(tmp_path), 2)
    failed = [Outcome(0, "ok"), Outcome(1, "killed", signal=9)]
    lines: list[str] = []
    calls: list[int] = []
    outcomes = run_restarting(lambda c: calls.append(c.attempt) or failed, 3, config, lines.append,
                              deadline=time.monotonic() - 0.1)
    assert outcomes == failed and calls == [0]
    assert lines == ["worker 1 was killed by signal SIGKILL; not restarted: the run's timeout has expired"]
    # Time left: restarted as before.
    calls.clear()
    lines.clear()
    run_restarting(lambda c: calls.append(c.attempt) or failed, 2, config, lines.append,
                   deadline=time.monotonic() + 60)
    assert calls == [0, 1, 2] and len(lines) == 2


def _never_called(index, report):
    raise AssertionError("no worker may start once the timeout has expired")


def test_supervise_counts_the_timeout_from_since():
    with no_leftover_children():
        with pytest.raises(TimeoutError, match="not started"):
            supervise(_never_called, [0, 1], timeout=1.0, since=time.monotonic() - 1.5)


@pytest.mark.timeout(60)
def test_execute_without_restarts_still_reports_the_failure(tmp_path):
    """One attempt within the timeout: the worker's error, as before."""
    with no_leftover_children():
        with pytest.raises(WorkerError, match="transient failure"):
            timely.execute(_failing_main, workers=2, timeout=TIMEOUT)
