"""``python -m timely.launch`` and ``timely.cluster.execute_cluster`` end to end.

Every test bounds its run time, starts at most 4 worker processes at once, and the ``launched``
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
from procs import alive

import timely
from timely.cluster import WorkerError, WorkerOperatorError, execute_cluster
from timely.comm.endpoints import free_loopback_ports
from timely.errors import OperatorError, TimelyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
def test_job_runs_on_two_workers(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    run = _launch(launched, "-w", "2", job, "40", "--flag")
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
def test_two_hosts_on_loopback_match_one_host(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    one = _launch(launched, "-w", "4", job, "50")
    assert one.returncode == 0, one.stderr
    base = free_port_block((0, 1, 10, 11))  # two workers on each host, from base and base + 10
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"127.0.0.1:{base}\nlocalhost:{base + 10}\n")
    procs = []
    for host in (1, 0):
        proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", "--hostfile", str(hostfile),
                                 "--host-index", str(host), job, "50"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        launched.append(proc)
        procs.append(proc)
    outputs = [p.communicate(timeout=40) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    two = _results("".join(out for out, _ in outputs))
    assert [line.replace("/4", "") for line in two] == [line.replace("/4", "") for line in _results(one.stdout)]
    assert [line.split()[1] for line in two] == ["0/4", "1/4", "2/4", "3/4"]


@pytest.mark.timeout(60)
def test_a_worker_that_raises_stops_the_job(tmp_path, launched):
    job = _job(tmp_path, "boom.py", """
        def main(worker):
            if worker.index == 1:
                raise ValueError("bad thing on purpose")
            worker.step_while(lambda: True)
    """)
    start = time.monotonic()
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 1
    assert "worker 1 failed" in run.stderr
    assert "boom.py\", line 4, in main" in run.stderr and "ValueError: bad thing on purpose" in run.stderr
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_a_worker_killed_by_a_signal_is_reported(tmp_path, launched):
    job = _job(tmp_path, "kill.py", """
        import os, signal

        def main(worker):
            if worker.index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            worker.step_while(lambda: True)
    """)
    start = time.monotonic()
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 1
    assert "worker 1 was killed by signal SIGKILL" in run.stderr
    assert time.monotonic() - start < 15


@pytest.mark.timeout(30)
def test_syntax_error_starts_no_worker(tmp_path, launched):
    job = _job(tmp_path, "syn.py", """
        def main(worker):
            return (1,
    """)
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 2
    assert f"{job}:3" in run.stderr and "SyntaxError" in run.stderr


@pytest.mark.timeout(30)
def test_job_without_main(tmp_path, launched):
    job = _job(tmp_path, "nomain.py", """
        def mian(worker):
            pass
    """)
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 2
    assert "nomain.py" in run.stderr and "no main(worker)" in run.stderr
    missing = _launch(launched, "-w", "2", str(tmp_path / "absent.py"))
    assert missing.returncode == 2 and "absent.py" in missing.stderr


@pytest.mark.timeout(30)
def test_a_timeout_that_is_not_positive_is_a_usage_error(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    run = _launch(launched, "-w", "2", "--timeout", "0", job, "10")
    assert run.returncode == 2 and "--timeout must be a positive number of seconds, not 0" in run.stderr
    run = _launch(launched, "-w", "2", "--heartbeat-timeout", "-1", job, "10")
    assert run.returncode == 2 and "--heartbeat-timeout must be a positive number of seconds, not -1" in run.stderr


@pytest.mark.timeout(60)
def test_ports_and_timeouts_out_of_range_are_usage_errors(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1:65535\n")
    # Every line must resolve, not only this host's (a peer's that did not waited out the start-up
    # timeout, blamed on secrets); a line with spaces is not a host (a ZeroMQ error before).
    unresolved = tmp_path / "unresolved"
    unresolved.write_text("127.0.0.1\n# a comment\nno.such.host.invalid\n")
    spaced = tmp_path / "spaced"
    spaced.write_text("127.0.0.1\nnot a host name\n")
    for argv, message in [
        (["--hostfile", str(unresolved)], "cannot resolve host 'no.such.host.invalid' (host 2 of "),
        (["--hostfile", str(spaced)], "spaced:2: expected host[:port], got 'not a host name'"),
        (["--transport", "tcp", "--port", "70000"], "--port 70000: the 2 worker(s) of a host would listen on ports "
                                                     "70000 to 70001, which must lie within 1-65535"),
        (["--transport", "tcp", "--port", "0"], "--port 0:"),
        (["--transport", "tcp", "--port", "65535"], "--port 65535:"),
        (["--hostfile", str(hostfile)], "hosts:1: its 2 worker(s) would listen on ports 65535 to 65536"),
        (["--startup-timeout", "0"], "--startup-timeout must be a positive number of seconds, not 0"),
        (["--startup-timeout", "nan"], "--startup-timeout must be a positive number of seconds, not nan"),
        (["--heartbeat-timeout", "inf"], "--heartbeat-timeout must be a positive number of seconds, not inf"),
    ]:
        run = _launch(launched, "-w", "2", *argv, job, "10")
        assert run.returncode == 2 and message in run.stderr, (argv, run.stderr)


@pytest.mark.timeout(60)
def test_two_jobs_at_once_on_one_host(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    procs = [subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job, str(n)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for n in (30, 60)]
    launched.extend(procs)
    outputs = [p.communicate(timeout=40) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    for (out, _), n in zip(outputs, (30, 60)):
        assert sum(line.count("(") for line in _results(out)) == 3 * n


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error(tmp_path, launched):
    job = _job(tmp_path, "job.py", EXCHANGE_JOB)
    (port,) = free_loopback_ports(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        run = _launch(launched, "-w", "2", "--transport", "tcp", "--port", str(port), job, "10")
    finally:
        holder.close()
    assert run.returncode == 1
    assert f"tcp://127.0.0.1:{port}" in run.stderr and "already in use" in run.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_worker(tmp_path, launched, sig, status):
    job = _job(tmp_path, "forever.py", FOREVER_JOB)
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    launched.append(proc)
    _wait_ready(proc)
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
def test_execute_cluster_returns_results_by_index(launched):
    results = execute_cluster(_sum_job, 3, ["x"])
    assert [r[:3] for r in results] == [(0, 3, ["x"]), (1, 3, ["x"]), (2, 3, ["x"])]
    assert sum(r[3] for r in results) == sum(range(300)) and sum(r[4] for r in results) == 300


@pytest.mark.timeout(60)
def test_execute_cluster_over_tcp(launched):
    results = execute_cluster(_sum_job, 2, transport="tcp")
    assert sum(r[4] for r in results) == 200


@pytest.mark.timeout(60)
def test_timely_execute_uses_the_cluster(launched):
    results = timely.execute(_sum_job, workers=2)
    assert [r[0] for r in results] == [0, 1] and sum(r[4] for r in results) == 200


@pytest.mark.timeout(60)
def test_execute_cluster_reports_the_failing_worker(launched):
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
def test_execute_cluster_reports_the_failing_operator(launched, unpicklable):
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
def test_execute_cluster_reports_a_killed_worker(launched):
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
def test_execute_cluster_unpicklable_result(launched):
    # Only worker 0's result cannot be pickled (were both, either could be the first to report).
    with pytest.raises(WorkerError, match="worker 0 failed: .*pickle"):
        execute_cluster(lambda worker: (lambda: None) if worker.index == 0 else None, 2)


# -- hardening (issue 13, item 7) -------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_main_that_is_not_a_function_is_a_usage_error(tmp_path, launched):
    job = _job(tmp_path, "fortytwo.py", "main = 42\n")
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 2, run.stderr
    assert "main is int 42, not a function" in run.stderr


@pytest.mark.timeout(60)
def test_a_worker_terminated_from_outside_is_the_reported_failure(tmp_path, launched):
    job = _job(tmp_path, "term.py", """
        import os, signal, time

        def main(worker):
            if worker.index == 1:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGTERM)
            worker.step_while(lambda: True)
    """)
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 1
    first = run.stderr.splitlines()[0]
    assert "worker 1 was killed by signal SIGTERM" in first, run.stderr


@pytest.mark.timeout(60)
def test_a_worker_stopped_while_reporting_its_failure_exits_quietly(launched):
    # The supervisor, having chosen which failure to report, SIGTERMs a worker that is still
    # sending the report of its own (secondary) failure: CI once saw a traceback on stderr here.
    script = textwrap.dedent("""
        import os, signal, time
        from timely.cluster import _child

        class StoppedWhileSending:
            def fileno(self):  # (asked for just before the report is written)
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
    launched.append(proc)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and err == "", err


@pytest.mark.timeout(60)
def test_hangup_stops_every_worker_and_removes_the_socket_folder(tmp_path, launched):
    job = _job(tmp_path, "forever.py", FOREVER_JOB)
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    launched.append(proc)
    _wait_ready(proc)
    assert [p for p in tmp_path.iterdir() if p.is_dir()]  # the ipc socket folder exists while it runs
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGHUP and b"SIGHUP received" in err
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


@pytest.mark.timeout(60)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, launched):
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
    launched.append(launcher)
    head = subprocess.run(["head", "-n", "3"], stdin=launcher.stdout, capture_output=True, timeout=30)
    launcher.stdout.close()  # the launcher's workers write into a pipe nobody reads any more
    _, err = launcher.communicate(timeout=30)
    assert len(head.stdout.splitlines()) == 3
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err
    assert launcher.returncode == 128 + signal.SIGPIPE


@pytest.mark.timeout(60)
def test_an_operator_traceback_is_printed_once(tmp_path, launched):
    job = _job(tmp_path, "divide.py", """
        def main(worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: 1 / 0, name="Divide").probe()
            inp.send(1)
            worker.finish()
    """)
    run = _launch(launched, "-w", "2", job)
    assert run.returncode == 1
    assert run.stderr.count("ZeroDivisionError: division by zero") == 1, run.stderr
    assert run.stderr.count("1 / 0") == 1 and "operator 'Divide' failed" in run.stderr


def _half_a_report_then_stop(index: int, report) -> None:
    """Worker 1 writes half of its large result to the supervisor, then stops (as a ``kill -STOP``
    landing at that moment would)."""
    if index == 1:
        from timely import cluster

        def half_then_stop(conn, data: bytes) -> None:
            view = memoryview(cluster._REPORT_LENGTH.pack(len(data)) + data)[: len(data) // 2]
            while view:
                view = view[os.write(conn.fileno(), view):]
            os.kill(os.getpid(), signal.SIGSTOP)

        cluster._send_report = half_then_stop
    report(bytes(4 << 20))


@pytest.mark.timeout(60)
def test_a_worker_stopped_halfway_through_its_result_does_not_stop_the_supervisor(launched):
    """The supervisor reads reports without blocking: with a worker stopped halfway through a
    large result, its stopped-worker check (and its timeout) still run."""
    from timely.cluster import supervise

    started = time.monotonic()
    first, second = supervise(_half_a_report_then_stop, [0, 1], timeout=30, stopped_grace=1)
    assert first.status == "ok" and first.result == bytes(4 << 20)
    assert second.status == "suspended" and second.result is None
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_a_second_interrupt_during_the_grace_kills_and_reaps_every_worker(tmp_path, launched):
    """Ctrl-C, then Ctrl-C again while execute waits for workers busy in C code to stop: execute
    raises KeyboardInterrupt with every worker killed and reaped, in a process that goes on (a
    REPL's, a notebook's)."""
    script = textwrap.dedent(f"""
        import hashlib, os, signal, sys, threading, time
        import timely

        def main(worker):
            with open(os.path.join({str(tmp_path)!r}, f"pid{{worker.index}}"), "w") as f:
                f.write(str(os.getpid()))
            hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**9)  # minutes in C: SIGTERM waits for it

        def interrupt_twice():
            while len([n for n in os.listdir({str(tmp_path)!r}) if n.startswith("pid")]) < 2:
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # within the grace (3 s)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_twice, daemon=True).start()
        try:
            timely.execute(main, workers=2)
        except KeyboardInterrupt:
            pass
        alive = []
        for n in (0, 1):
            pid = int(open(os.path.join({str(tmp_path)!r}, f"pid{{n}}")).read())
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        print("ALIVE", alive)
        time.sleep(0.5)  # still running: the workers die with it only now
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    launched.append(proc)
    out, err = proc.communicate(timeout=40)
    assert "ALIVE []" in out, (out, err)


@pytest.mark.timeout(60)
def test_sighup_ignored_by_nohup_stays_ignored_and_a_worker_hung_up_is_reported_as_such(tmp_path, launched):
    job = _job(tmp_path, "job.py", """
        import os, signal, sys, time

        def main(worker):
            sys.stdout.write(f"ready {worker.index} {os.getpid()}\\n")
            sys.stdout.flush()
            time.sleep(3)
            sys.stdout.write(f"RESULT {worker.index}\\n")
            sys.stdout.flush()
    """)

    def started(ignore_hup: bool) -> tuple[subprocess.Popen, list[int]]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None)
        launched.append(proc)
        assert proc.stdout is not None
        pids = [int(proc.stdout.readline().split()[2]) for _ in range(2)]
        return proc, pids

    proc, _ = started(ignore_hup=True)  # nohup python -m timely.launch ...; the terminal closes
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.count("RESULT") == 2, err

    proc, pids = started(ignore_hup=False)
    os.kill(pids[1], signal.SIGHUP)  # one worker alone is hung up
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "killed by signal SIGHUP" in err, err


SIGTERM_IGNORING_JOB = '''
import os, signal, subprocess, sys, time
def main(worker):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a library that masks SIGTERM, or a long C call
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (not our pipes)
    print("ready", worker.index, helper.pid, flush=True)
    time.sleep(300)
'''


def _wait_ready(proc: subprocess.Popen, workers: int = 2) -> bytes:
    """What the launcher printed until every worker printed "ready" (asserted, within 20 s)."""
    seen = b""
    deadline = time.monotonic() + 20
    while seen.count(b"ready") < workers and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)  # unbuffered: select must see what is left
            if not chunk:
                break
            seen += chunk
    assert seen.count(b"ready") == workers, seen
    return seen


def _start_and_wait_ready(tmp_path, launched, source: str) -> tuple[subprocess.Popen, list[int]]:
    job = _job(tmp_path, "job.py", source)
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", "-w", "2", job], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    launched.append(proc)
    seen = _wait_ready(proc)
    helpers = [int(line.split()[2]) for line in seen.decode().splitlines() if line.startswith("ready")]
    return proc, helpers


@pytest.mark.timeout(60)
def test_a_second_sigterm_during_the_stop_grace_kills_the_workers_and_exits(tmp_path, launched):
    # The workers ignore SIGTERM: the first one starts the grace, the second ends it. The launcher
    # then escaped without killing them, and waited for them for ever at its exit.
    proc, helpers = _start_and_wait_ready(tmp_path, launched, SIGTERM_IGNORING_JOB)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 143
    for pid in helpers:  # (the job's own helpers: not children of the launcher, killed here)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_programs_the_job_started(tmp_path, launched):
    # Workers ignored SIGINT with SIG_IGN, which every program they exec inherits: Ctrl-C (SIGINT
    # to the whole foreground group) left the job's helpers running, orphaned.
    proc, helpers = _start_and_wait_ready(tmp_path, launched, SIGTERM_IGNORING_JOB.replace(
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)", "pass"))
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=20)
    assert proc.returncode == 130
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in helpers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the job's helper processes survived Ctrl-C"


@pytest.mark.timeout(60)
def test_a_job_file_that_fails_to_import_is_not_restarted(tmp_path, launched):
    job = _job(tmp_path, "job.py", "import no_such_module_here\ndef main(worker):\n    pass\n")
    run = _launch(launched, "-w", "2", "--checkpoint", str(tmp_path / "ck"), "--restarts", "3", job)
    assert run.returncode == 2, run.stderr
    assert "importing the job file raised ModuleNotFoundError: No module named 'no_such_module_here'" in run.stderr
    assert "restart" not in run.stderr  # it would fail again: 3 identical runs before


@pytest.mark.timeout(60)
def test_a_checkpoint_url_without_its_fsspec_package_is_a_clear_error_with_restarts(tmp_path, launched):
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here: an s3:// URL would reach the network")
    job = _job(tmp_path, "job.py", "def main(worker):\n    pass\n")
    run = _launch(launched, "-w", "2", "--checkpoint", "s3://bucket/ck", "--restarts", "2", job)
    assert run.returncode == 1, run.stderr
    assert "checkpoint storage 's3://bucket/ck' cannot be used: Install s3fs" in run.stderr
    assert "recovery.py" not in run.stderr and "restart" not in run.stderr


@pytest.mark.timeout(60)
def test_the_same_port_for_metrics_and_dashboard_is_a_usage_error(tmp_path, launched):
    job = _job(tmp_path, "job.py", "def main(worker):\n    pass\n")
    run = _launch(launched, "-w", "1", "--metrics-port", "9123", "--dashboard", "9123", job)
    assert run.returncode == 2 and "--metrics-port and --dashboard are both 9123" in run.stderr
