"""``python -m timely.launch`` and ``timely.cluster.execute_cluster`` end to end.

Every test bounds its run time, starts at most 4 worker processes at once, and the ``no_leftovers``
fixture (this process becomes the reaper of orphans) kills and reaps anything left behind, then
asserts that nothing was.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from procs import no_leftover_children

import timely
from timely.cluster import WorkerError, WorkerOperatorError, execute_cluster
from timely.comm.endpoints import free_loopback_ports
from timely.errors import OperatorError, TimelyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_leftovers():
    """After the test, kill and reap every child (orphaned workers included) and fail if any."""
    with no_leftover_children():
        started: list[subprocess.Popen] = []
        yield started
        for proc in started:  # launchers the test could not finish with
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _job(tmp_path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _launch(started, *argv: str, timeout: float = 40.0) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    started.append(proc)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# A deterministic job: each worker keys records by field 0, exchanges them, and prints what it got.
EXCHANGE_JOB = """
    import sys

    def main(worker):
        n = int(worker.args[0])
        with worker.dataflow() as scope:
            inp = scope.new_input()
            got = []
            probe = inp.stream.exchange(0).inspect(got.append).probe()
        for epoch in range(3):
            inp.send_batch([(k, epoch) for k in range(worker.index, n, worker.peers)])
            inp.advance_to(epoch + 1)
            worker.step_while(lambda: probe.less_than(inp.time))
        inp.close()
        worker.finish()
        sys.stdout.write(f"RESULT {worker.index}/{worker.peers} {worker.args} {sorted(got)}\\n")
        sys.stdout.flush()
"""

FOREVER_JOB = """
    import sys

    def main(worker):
        sys.stdout.write(f"ready {worker.index}\\n")
        sys.stdout.flush()
        worker.step_while(lambda: True)
"""


def _results(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("RESULT"))


# -- python -m timely.launch --------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_job_runs_on_two_workers(tmp_path, no_leftovers):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    run = _launch(no_leftovers, "-w", "2", job, "40", "--flag")
    assert run.returncode == 0, run.stderr
    lines = _results(run.stdout)
    assert [line.split()[1] for line in lines] == ["0/2", "1/2"]
    assert all("['40', '--flag']" in line for line in lines)
    records = sum(line.count("(") for line in lines)
    assert records == 40 * 3  # every record arrived exactly once, on one worker


def free_port_block(offsets: tuple[int, ...]) -> int:
    """A base port below the kernel's ephemeral range (where the workers' outgoing connections take
    their ports, one of which could take a worker's port between this check and its bind) such
    that ``base + o`` is free on 127.0.0.1 for every offset ``o`` (racy; a moment ago)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for base in range(low - 1000 - max(offsets), 10000, -97):
        socks = []
        try:
            for o in offsets:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", base + o))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of loopback ports")


@pytest.mark.timeout(60)
def test_two_hosts_on_loopback_match_one_host(tmp_path, no_leftovers):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    one = _launch(no_leftovers, "-w", "4", job, "50")
    assert one.returncode == 0, one.stderr
    base = free_port_block((0, 1, 10, 11))  # two workers on each host, from base and base + 10
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"127.0.0.1:{base}\nlocalhost:{base + 10}\n")
    procs = []
    for host in (1, 0):
        proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", "--hostfile", str(hostfile),
                                 "--host-index", str(host), job, "50"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        no_leftovers.append(proc)
        procs.append(proc)
    outputs = [p.communicate(timeout=40) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    two = _results("".join(out for out, _ in outputs))
    assert [line.replace("/4", "") for line in two] == [line.replace("/4", "") for line in _results(one.stdout)]
    assert [line.split()[1] for line in two] == ["0/4", "1/4", "2/4", "3/4"]


@pytest.mark.timeout(60)
def test_a_worker_that_raises_stops_the_job(tmp_path, no_leftovers):
    job = _job(tmp_path, "boom.py", """
        def main(worker):
            if worker.index == 1:
                raise ValueError("bad thing on purpose")
            worker.step_while(lambda: True)
    """)
    start = time.monotonic()
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 1
    assert "worker 1 failed" in run.stderr
    assert "boom.py\", line 4, in main" in run.stderr and "ValueError: bad thing on purpose" in run.stderr
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_a_worker_killed_by_a_signal_is_reported(tmp_path, no_leftovers):
    job = _job(tmp_path, "kill.py", """
        import os, signal

        def main(worker):
            if worker.index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            worker.step_while(lambda: True)
    """)
    start = time.monotonic()
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 1
    assert "worker 1 was killed by signal SIGKILL" in run.stderr
    assert time.monotonic() - start < 15


@pytest.mark.timeout(30)
def test_syntax_error_starts_no_worker(tmp_path, no_leftovers):
    job = _job(tmp_path, "syn.py", """
        def main(worker):
            return (1,
    """)
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 2
    assert f"{job}:3" in run.stderr and "SyntaxError" in run.stderr


@pytest.mark.timeout(30)
def test_job_without_main(tmp_path, no_leftovers):
    job = _job(tmp_path, "nomain.py", """
        def mian(worker):
            pass
    """)
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 2
    assert "nomain.py" in run.stderr and "no main(worker)" in run.stderr
    missing = _launch(no_leftovers, "-w", "2", str(tmp_path / "absent.py"))
    assert missing.returncode == 2 and "absent.py" in missing.stderr


@pytest.mark.timeout(30)
def test_a_timeout_that_is_not_positive_is_a_usage_error(tmp_path, no_leftovers):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    run = _launch(no_leftovers, "-w", "2", "--timeout", "0", job, "10")
    assert run.returncode == 2 and "--timeout must be a positive number of seconds, not 0" in run.stderr
    run = _launch(no_leftovers, "-w", "2", "--heartbeat-timeout", "-1", job, "10")
    assert run.returncode == 2 and "--heartbeat-timeout must be a positive number of seconds, not -1" in run.stderr


@pytest.mark.timeout(60)
def test_two_jobs_at_once_on_one_host(tmp_path, no_leftovers):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    procs = [subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job, str(n)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for n in (30, 60)]
    no_leftovers.extend(procs)
    outputs = [p.communicate(timeout=40) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    for (out, _), n in zip(outputs, (30, 60)):
        assert sum(line.count("(") for line in _results(out)) == 3 * n


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error(tmp_path, no_leftovers):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    (port,) = free_loopback_ports(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        run = _launch(no_leftovers, "-w", "2", "--transport", "tcp", "--port", str(port), job, "10")
    finally:
        holder.close()
    assert run.returncode == 1
    assert f"tcp://127.0.0.1:{port}" in run.stderr and "already in use" in run.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_worker(tmp_path, no_leftovers, sig, status):
    job = _job(tmp_path, "forever.py", FOREVER_JOB)
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    no_leftovers.append(proc)
    seen = b""
    deadline = time.monotonic() + 20
    while seen.count(b"ready") < 2 and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)  # unbuffered: select must see what is left
            if not chunk:
                break
            seen += chunk
    assert seen.count(b"ready") == 2, seen
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal does: the whole foreground group
    else:
        proc.send_signal(sig)
    start = time.monotonic()
    proc.communicate(timeout=20)
    assert proc.returncode == status
    assert time.monotonic() - start < 10


# -- execute_cluster / timely.execute ----------------------------------------------------------------
def _sum_job(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        got = []
        probe = inp.stream.exchange(None).inspect(got.append).probe()
    inp.send_batch(list(range(worker.index * 100, worker.index * 100 + 100)))
    inp.advance_to(1)
    worker.step_while(lambda: probe.less_than(inp.time))
    inp.close()
    return (worker.index, worker.peers, worker.args, sum(got), len(got))


@pytest.mark.timeout(60)
def test_execute_cluster_returns_results_by_index(no_leftovers):
    results = execute_cluster(_sum_job, 3, ["x"])
    assert [r[:3] for r in results] == [(0, 3, ["x"]), (1, 3, ["x"]), (2, 3, ["x"])]
    assert sum(r[3] for r in results) == sum(range(300)) and sum(r[4] for r in results) == 300


@pytest.mark.timeout(60)
def test_execute_cluster_over_tcp(no_leftovers):
    results = execute_cluster(_sum_job, 2, transport="tcp")
    assert sum(r[4] for r in results) == 200


@pytest.mark.timeout(60)
def test_timely_execute_uses_the_cluster(no_leftovers):
    results = timely.execute(_sum_job, workers=2)
    assert [r[0] for r in results] == [0, 1] and sum(r[4] for r in results) == 200


@pytest.mark.timeout(60)
def test_execute_cluster_reports_the_failing_worker(no_leftovers):
    def main(worker):
        if worker.index == 2:
            raise KeyError("missing on purpose")
        worker.step_while(lambda: True)

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        execute_cluster(main, 3)
    assert info.value.index == 2
    assert "KeyError: 'missing on purpose'" in info.value.remote_traceback
    assert "test_launch.py" in info.value.remote_traceback
    assert str(info.value).startswith("worker 2 failed")
    assert time.monotonic() - start < 15


class _JobError(Exception):
    """An exception class with a constructor pickle cannot call back (it takes two arguments)."""

    def __init__(self, what: str, n: int) -> None:
        super().__init__(f"{what} {n}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unpicklable", [False, True])
def test_execute_cluster_reports_the_failing_operator(no_leftovers, unpicklable):
    def fail(record):
        if record == 7:
            raise _JobError("bad record", record) if unpicklable else KeyError(record)
        return record

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.map(fail, name="Checker").probe()
        if worker.index == 1:
            inp.send_batch(list(range(10)))
        inp.advance_to(1)
        worker.step_while(lambda: probe.less_than(inp.time))

    with pytest.raises(WorkerOperatorError) as info:
        execute_cluster(main, 2)
    err = info.value
    assert isinstance(err, WorkerError) and isinstance(err, OperatorError) and isinstance(err, TimelyError)
    assert err.index == err.worker == 1 and err.operator == "Checker"
    if unpicklable:  # rebuilt from its text
        assert type(err.cause) is RuntimeError and "_JobError: bad record 7" in str(err.cause)
    else:
        assert type(err.cause) is KeyError and err.cause.args == (7,)


@pytest.mark.timeout(60)
def test_execute_cluster_reports_a_killed_worker(no_leftovers):
    def main(worker):
        if worker.index == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        worker.step_while(lambda: True)

    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker 0 was killed by signal SIGKILL") as info:
        execute_cluster(main, 2)
    assert info.value.index == 0 and info.value.signal == signal.SIGKILL
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_execute_cluster_unpicklable_result(no_leftovers):
    # Only worker 0's result cannot be pickled (were both, either could be the first to report).
    with pytest.raises(WorkerError, match="worker 0 failed: .*pickle"):
        execute_cluster(lambda worker: (lambda: None) if worker.index == 0 else None, 2)


# -- hardening (issue 13, item 7) -------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_main_that_is_not_a_function_is_a_usage_error(tmp_path, no_leftovers):
    job = _job(tmp_path, "fortytwo.py", "main = 42\n")
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 2, run.stderr
    assert "main is int 42, not a function" in run.stderr


@pytest.mark.timeout(60)
def test_a_worker_terminated_from_outside_is_the_reported_failure(tmp_path, no_leftovers):
    job = _job(tmp_path, "term.py", """
        import os, signal, time

        def main(worker):
            if worker.index == 1:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGTERM)
            worker.step_while(lambda: True)
    """)
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 1
    first = run.stderr.splitlines()[0]
    assert "worker 1 was killed by signal SIGTERM" in first, run.stderr


@pytest.mark.timeout(60)
def test_a_worker_stopped_while_reporting_its_failure_exits_quietly(no_leftovers):
    # The supervisor, having chosen which failure to report, SIGTERMs a worker that is still
    # sending the report of its own (secondary) failure: CI once saw a traceback on stderr here.
    script = textwrap.dedent("""
        import os, signal, time
        from timely.cluster import _child

        class StoppedWhileSending:
            def send_bytes(self, data):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the signal arrives here, as in a pipe write
            def close(self):
                pass

        def entry(index, report):
            raise RuntimeError("secondary failure")

        _child(entry, 0, StoppedWhileSending(), os.getppid())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    no_leftovers.append(proc)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and err == "", err


@pytest.mark.timeout(60)
def test_hangup_stops_every_worker_and_removes_the_socket_folder(tmp_path, no_leftovers):
    job = _job(tmp_path, "forever.py", FOREVER_JOB)
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    no_leftovers.append(proc)
    seen = b""
    deadline = time.monotonic() + 20
    while seen.count(b"ready") < 2 and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
    assert seen.count(b"ready") == 2, seen
    assert [p for p in tmp_path.iterdir() if p.is_dir()]  # the ipc socket folder exists while it runs
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGHUP and b"SIGHUP received" in err
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


@pytest.mark.timeout(60)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, no_leftovers):
    job = _job(tmp_path, "chatty.py", """
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                inp.stream.inspect(print).probe()
            for epoch in range(200):
                inp.send_batch(list(range(1000)))
                inp.advance_to(epoch + 1)
                worker.step()
            worker.finish()
    """)
    launcher = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    no_leftovers.append(launcher)
    head = subprocess.run(["head", "-n", "3"], stdin=launcher.stdout, capture_output=True, timeout=30)
    launcher.stdout.close()  # the launcher's workers write into a pipe nobody reads any more
    _, err = launcher.communicate(timeout=30)
    assert len(head.stdout.splitlines()) == 3
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err
    assert launcher.returncode == 128 + signal.SIGPIPE


@pytest.mark.timeout(60)
def test_an_operator_traceback_is_printed_once(tmp_path, no_leftovers):
    job = _job(tmp_path, "divide.py", """
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: 1 / 0, name="Divide").probe()
            inp.send(1)
            worker.finish()
    """)
    run = _launch(no_leftovers, "-w", "2", job)
    assert run.returncode == 1
    assert run.stderr.count("ZeroDivisionError: division by zero") == 1, run.stderr
    assert run.stderr.count("1 / 0") == 1 and "operator 'Divide' failed" in run.stderr
