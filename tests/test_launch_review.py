"""Supervision defects found in review of ``python -m timely.launch`` and ``timely.execute``: the
worker blamed for a failure, mains that never run, job-file errors, restarts after a closed output
pipe, ``--autobalance`` after an option's value, torn output lines, and the job's own forked
processes.

Every multi-process test bounds its run time, and the ``launched`` fixture kills and reaps
anything left behind, then asserts that nothing was.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import timely
from timely.cluster import Outcome, WorkerError, WorkerOperatorError, execute_cluster
from timely.comm.errors import PeerLost
from timely.errors import OperatorError
from timely.launch import _parser
from timely.recovery import retryable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


from test_launch import _job  # noqa: E402  (the launcher tests' job writer)


def _launch(started, *argv: str, timeout: float = 60.0, env: dict[str, str] | None = None,
            stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", *argv], cwd=ROOT, stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    started.append(proc)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# -- 1. the worker that only lost a peer is not the root cause ---------------------------------------
# Worker 0's FlatMap floods worker 1, whose Map raises after a second: worker 0 is then inside its
# operator, in a send waiting for room, when it learns that worker 1 failed (PeerLost).
BLAME_JOB = """
    import time

    def boom(x):
        time.sleep(1)
        raise ValueError("the real failure, on worker 1")

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = (inp.stream.flat_map(lambda x: [x] * 100000, name="Flood")
                     .exchange(lambda x: 1).map(boom, name="Boom").probe())
        for epoch in range(5):
            if worker.index == 0:
                inp.send_batch(["x" * 400] * 10)
            inp.advance_to(epoch + 1)
            worker.step_while(lambda: probe.less_than(inp.time))
"""


def _blame_main(worker):
    namespace: dict = {}
    exec(textwrap.dedent(BLAME_JOB), namespace)
    return namespace["main"](worker)


@pytest.mark.timeout(90)
def test_a_worker_that_lost_a_peer_inside_an_operator_is_not_blamed(launched):
    with pytest.raises(WorkerOperatorError) as info:
        execute_cluster(_blame_main, 2, timeout=60)
    assert info.value.index == 1 and info.value.operator.startswith("Boom"), str(info.value)
    assert isinstance(info.value.cause, ValueError)
    assert "Remote traceback (worker 1)" in str(info.value)


@pytest.mark.timeout(90)
def test_the_launcher_prints_the_traceback_of_the_real_failure(tmp_path, launched):
    job = _job(tmp_path, "blame.py", BLAME_JOB)
    run = _launch(launched, "-w", "2", "--timeout", "60", job)
    assert run.returncode == 1, run.stderr
    first = run.stderr.splitlines()[0]
    assert first == "timely.launch: worker 1 failed:", run.stderr
    assert "ValueError: the real failure, on worker 1" in run.stderr
    assert "worker 0 failed: timely.comm.errors.PeerLost" in run.stderr


def test_an_operator_error_caused_by_a_lost_peer_is_a_consequence():
    from timely.cluster import _lost_a_peer

    assert _lost_a_peer(PeerLost(1, "worker 1 failed"))
    assert _lost_a_peer(OperatorError("Map", 0, PeerLost(1, "worker 1 failed")))
    assert not _lost_a_peer(OperatorError("Map", 0, ValueError("mine")))


# -- 2. an async or generator main is refused --------------------------------------------------------
NOT_RUN_JOBS = {
    "async": ("async def main(worker):\n    print('RAN')\n", "is an async function"),
    "generator": ("def main(worker):\n    print('RAN')\n    yield\n", "is a generator function"),
    "async-generator": ("async def main(worker):\n    print('RAN')\n    yield\n", "is an async generator function"),
    "returns-a-coroutine": ("async def run(worker):\n    print('RAN')\n\ndef main(worker):\n    return run(worker)\n",
                            "returned a coroutine"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(NOT_RUN_JOBS))
def test_the_launcher_refuses_a_main_that_would_not_run(tmp_path, launched, kind):
    source, message = NOT_RUN_JOBS[kind]
    job = _job(tmp_path, "job.py", source)
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 2, run.stderr
    assert "JobFileError" in run.stderr and message in run.stderr, run.stderr
    assert "RAN" not in run.stdout
    assert "never awaited" not in run.stderr


async def _async_main(worker):
    return worker.index


def _generator_main(worker):
    yield worker.index


def _returns_a_generator(worker):
    return _generator_main(worker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("main", [_async_main, _generator_main])
def test_execute_refuses_an_async_or_generator_main(launched, workers, main):
    with pytest.raises(TypeError, match="neither awaits nor iterates"):
        timely.execute(main, workers=workers)


@pytest.mark.timeout(60)
def test_execute_refuses_a_main_that_returns_a_generator(launched):
    with pytest.raises(TypeError, match="returned a generator"):
        timely.execute(_returns_a_generator)
    with pytest.raises(WorkerError, match="returned a generator"):
        timely.execute(_returns_a_generator, workers=2, timeout=30)


# -- 3. a job file that cannot run is a usage error, however fast each worker imports it ------------
@pytest.mark.timeout(60)
def test_main_not_a_function_is_a_usage_error_when_the_others_still_import(tmp_path, launched):
    marker = tmp_path / "first"
    job = _job(tmp_path, "slow.py", f"""
        import os, time

        try:
            os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))  # the first worker to import
        except FileExistsError:
            time.sleep(10)  # the others: heavy imports, stopped before they end
        main = None
    """)
    run = _launch(launched, "-w", "3", job)
    assert "was stopped" in run.stderr, run.stderr
    assert run.returncode == 2, run.stderr
    assert "main is NoneType None, not a function" in run.stderr


def test_job_file_failure_ignores_stopped_workers_and_lost_peers():
    from timely.launch import _job_file_failure

    job_file = Outcome(0, "error", summary="JobFileError: job.py: main is int 5, not a function of the worker")
    assert _job_file_failure([job_file, Outcome(1, "stopped"), Outcome(2, "stopped")])
    assert _job_file_failure([job_file, Outcome(1, "error", summary="PeerLost: worker 0 failed", secondary=True)])
    assert not _job_file_failure([job_file, Outcome(1, "error", summary="ValueError: other")])
    assert not _job_file_failure([job_file, Outcome(1, "killed", signal=signal.SIGKILL)])
    assert not _job_file_failure([Outcome(0, "stopped"), Outcome(1, "stopped")])


# -- 4. a job whose output pipe was closed is not restarted -----------------------------------------
def test_a_worker_killed_by_sigpipe_is_not_retryable():
    assert not retryable(Outcome(0, "killed", signal=signal.SIGPIPE))
    assert retryable(Outcome(0, "killed", signal=signal.SIGKILL))


@pytest.mark.timeout(90)
def test_output_into_a_closed_pipe_is_not_restarted(tmp_path, launched):
    job = _job(tmp_path, "loud.py", """
        def main(worker):
            for i in range(200000):
                print(f"w{worker.index} line {i}")
    """)
    launcher = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", "--checkpoint",
                                 str(tmp_path / "ck"), "--restarts", "3", job], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    launched.append(launcher)
    head = subprocess.run(["head", "-n", "1"], stdin=launcher.stdout, capture_output=True, timeout=60)
    launcher.stdout.close()
    _, err = launcher.communicate(timeout=60)
    assert len(head.stdout.splitlines()) == 1
    assert b"restart" not in err, err
    assert launcher.returncode == 128 + signal.SIGPIPE, err


# -- 5. --autobalance after an option's value --------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["-w", "2", "--autobalance", "job.py", "a"], ["-w", "2", "--autobalance=", "job.py", "a"]),
    (["--workers", "2", "--timeout", "9", "--autobalance", "job.py"],
     ["--workers", "2", "--timeout", "9", "--autobalance=", "job.py"]),
    (["-w2", "--autobalance", "job.py"], ["-w2", "--autobalance=", "job.py"]),
    (["--workers=2", "--autobalance", "job.py"], ["--workers=2", "--autobalance=", "job.py"]),
    (["--work", "2", "--autobalance", "job.py"], ["--work", "2", "--autobalance=", "job.py"]),
    (["--watchdog-warn", "--autobalance", "job.py"], ["--watchdog-warn", "--autobalance=", "job.py"]),
    (["--autobalance", "threshold=2", "job.py"], ["--autobalance", "threshold=2", "job.py"]),
    (["-w", "2", "job.py", "--autobalance", "x.py"], ["-w", "2", "job.py", "--autobalance", "x.py"]),
])
def test_a_bare_autobalance_after_options_with_values(argv, expected):
    from timely.launch import _bare_autobalance

    assert _bare_autobalance(argv, _parser()) == expected


@pytest.mark.timeout(60)
def test_the_launcher_runs_with_workers_then_a_bare_autobalance(tmp_path, launched):
    job = _job(tmp_path, "job.py", "def main(worker):\n    print('ran', worker.index, worker.args)\n")
    run = _launch(launched, "-w", "2", "--autobalance", job, "x=1")
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.split("\n")[:2]) == ["ran 0 ['x=1']", "ran 1 ['x=1']"]


# -- 6. workers' lines stay whole ----------------------------------------------------------------------
LOUD_JOB = """
    def main(worker):
        for i in range(30000):
            print(f"w{worker.index} line {i}", "." * (i % 50))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("into", ["file", "pipe"])
def test_workers_lines_are_not_torn(tmp_path, launched, unbuffered, into):
    job = _job(tmp_path, "loud.py", LOUD_JOB)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    if into == "file":
        with open(tmp_path / "out.txt", "w") as out:
            run = _launch(launched, "-w", "2", job, env=env, stdout=out)
        text = (tmp_path / "out.txt").read_text()
    else:
        run = _launch(launched, "-w", "2", job, env=env)
        text = run.stdout
    assert run.returncode == 0, run.stderr
    lines = text.splitlines()
    torn = [line for line in lines if not re.fullmatch(r"w[01] line \d+ \.*", line)]
    assert not torn, torn[:3]
    assert len(lines) == 60000


# -- 7. processes the job forks are not workers ----------------------------------------------------
def _forks_a_child(worker):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 3)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.timeout(60)
def test_a_process_forked_by_the_job_has_the_default_sigterm(launched):
    assert execute_cluster(_forks_a_child, 2, timeout=30) == [0, 0]
