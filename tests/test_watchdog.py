"""The stuck-operator watchdog: a long operator invocation is named, with its stack, and ends the job."""
from __future__ import annotations

import subprocess
import sys
import time
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
