"""The ``python -m megaphone.rebalance`` CLI: it follows a live migration to completion, reports
rejections, and times out naming the endpoint; against a fake job in a thread and live jobs on one
and two workers.
"""
from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import norm
from megaphone_jobs import FakeControl, FakeProbe, LiveCount, observed_count, running_job, sequential_count

import timely
from megaphone.controller import Controller
from megaphone.endpoint import ControlEndpoint, EndpointError, request
from megaphone.plan import plan
from megaphone.rebalance import main as cli_main
from megaphone.table import balanced, skewed
from timely.errors import TimelyError

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "megaphone.rebalance", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


class FakeJob:
    """A fake job in a thread: control time advances and the probe follows it two ticks behind."""

    def __init__(self, k: int = 3, peers: int = 3) -> None:
        self.control, self.probe = FakeControl(k, peers), FakeProbe()
        self.ctl = Controller(self.control, self.probe)
        self.ep = ControlEndpoint(self.ctl, "tcp://127.0.0.1:*")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.control.time += 1
            self.probe.frontier = self.control.time - 2
            self.ctl.tick()
            time.sleep(0.002)

    def __enter__(self) -> FakeJob:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ep.close()


@pytest.mark.timeout(90)
def test_cli_follows_a_migration_to_completion():
    with FakeJob(k=3, peers=3) as job:
        r = run_cli("--endpoint", job.ep.endpoint, "--table", "2,2,2,0,0,0,1,1", "--strategy", "batched",
                    "--status")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        steps = plan(balanced(8, 3), [2, 2, 2, 0, 0, 0, 1, 1], "batched")
        assert lines[0] == f"migration 0: {sum(map(len, steps))} bins in {len(steps)} steps (batched)"
        step_lines = [ln for ln in lines if ln.startswith("step ")]
        assert len(step_lines) == len(steps)
        for i, (ln, step) in enumerate(zip(step_lines, steps)):
            assert ln.startswith(f"step {i + 1}/{len(steps)}: {len(step)} bins {sorted(step)}".replace("'", ""))
            assert ln.endswith(" ms")
        assert any(ln.startswith("migration 0 complete") for ln in lines)
        assert "table (8 bins, 3 workers): 2,2,2,0,0,0,1,1" in r.stdout
        assert job.ctl.current_table == (2, 2, 2, 0, 0, 0, 1, 1) and not job.ctl.busy

        r = run_cli("--endpoint", job.ep.endpoint, "--move", "0:1", "--move", "7:0", "--strategy", "fluid")
        assert r.returncode == 0, r.stderr
        assert "migration 1: 2 bins in 2 steps (fluid)" in r.stdout
        assert job.ctl.current_table == (1, 2, 2, 0, 0, 0, 1, 0)

        r = run_cli("--endpoint", job.ep.endpoint, "--balanced", "--no-wait")
        assert r.returncode == 0 and "migration 2:" in r.stdout
        r = run_cli("--endpoint", job.ep.endpoint, "--status")
        assert r.returncode == 0 and "table (8 bins, 3 workers)" in r.stdout

        r = run_cli("--endpoint", job.ep.endpoint, "--move", "3:7")
        assert r.returncode == 1
        assert "rejected" in r.stderr and "worker 7 does not exist" in r.stderr


@pytest.mark.timeout(60)
def test_cli_times_out_naming_the_endpoint():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = run_cli("--endpoint", endpoint, "--balanced", "--timeout", "0.5")
    assert r.returncode == 3
    assert f"control endpoint {endpoint} did not answer within 0.5 s" in r.stderr
    assert time.monotonic() - t0 < 30
    r = run_cli("--endpoint", endpoint)
    assert r.returncode == 2 and "give --table, --balanced, --move or --status" in r.stderr
    r = run_cli("--endpoint", endpoint, "--move", "3-1")
    assert r.returncode == 2 and "BIN:WORKER" in r.stderr
    r = run_cli("--endpoint", endpoint, "--table", "0,,1,1")  # an empty entry was dropped silently
    assert r.returncode == 2 and "--table expects comma-separated worker indices" in r.stderr

def endpoint_job(worker, k: int, ready: threading.Event, stop: threading.Event, box: dict):
    """A live one-worker keyed count exposing a control endpoint until ``stop`` is set."""
    job = LiveCount(worker, k)
    ctl = Controller(job.control, job.machine.probe)
    ep = ControlEndpoint(ctl, "tcp://127.0.0.1:*", routing_table=job.machine.routing_table)
    box["endpoint"] = ep.endpoint
    box["controller"] = ctl
    ready.set()
    try:
        while not stop.is_set() or ctl.busy:
            job.advance([(job.epoch % 5, 1), (job.epoch % 3, 1)], ctl)
            time.sleep(0.001)
    finally:
        ep.close()
    box["outputs"] = job.finish()
    box["sent"] = job.sent
    return None


@pytest.mark.timeout(90)
def test_cli_against_a_live_job():
    ready, stop, box = threading.Event(), threading.Event(), {}
    errors: list[BaseException] = []

    def target():
        try:
            timely.execute(functools.partial(endpoint_job, k=4, ready=ready, stop=stop, box=box), workers=1)
        except BaseException as e:  # surfaced below
            errors.append(e)
            ready.set()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        assert ready.wait(30) and not errors, errors
        ep = box["endpoint"]
        r = run_cli("--endpoint", ep, "--status")
        assert r.returncode == 0, r.stderr
        assert f"table (16 bins, 1 workers): {','.join(['0'] * 16)}" in r.stdout
        assert f"operator routing table: {','.join(['0'] * 16)}" in r.stdout
        # One worker: every table maps to worker 0, so a rebalance has no moves ...
        r = run_cli("--endpoint", ep, "--balanced")
        assert r.returncode == 0 and "migration 0: nothing to move" in r.stdout, r.stderr
        # ... and a move elsewhere is rejected, changing nothing.
        r = run_cli("--endpoint", ep, "--move", "3:1")
        assert r.returncode == 1 and "worker 1 does not exist (there are 1 workers)" in r.stderr
        reply = request(ep, {"op": "table"}, 10)
        assert reply["ok"] and reply["routing_table"] == [0] * 16
        # The endpoint keeps the job running: data flowed the whole time.
        s = request(ep, {"op": "status"}, 10)
        assert s["ok"] and s["control_time"] > 0
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    assert observed_count(box["outputs"]) == sequential_count(box["sent"])


@pytest.mark.timeout(30)
def test_cli_main_in_process_reports_timeout(capsys):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    assert cli_main(["--endpoint", endpoint, "--status", "--timeout", "0.2"]) == 3
    assert endpoint in capsys.readouterr().err
    assert cli_main(["--endpoint", "nowhere://at-all", "--balanced"]) == 3  # cannot even connect
    assert "cannot talk to control endpoint nowhere://at-all" in capsys.readouterr().err
    with pytest.raises(EndpointError) as e:
        request("nowhere://at-all", {"op": "table"})
    assert isinstance(e.value, TimelyError) and isinstance(e.value, OSError)

@pytest.mark.timeout(30)
def test_cli_with_an_unusable_secret_file_is_a_usage_error(tmp_path, capsys):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    missing = tmp_path / "no-such-secret"
    assert cli_main(["--endpoint", endpoint, "--status", "--secret-file", str(missing)]) == 2
    assert f"cannot read the job secret file {missing}" in capsys.readouterr().err


def cli_cluster_job(worker, k: int, port: int, epochs: int):
    """Worker 0 serves a control endpoint on ``port`` and runs until one migration requested through
    it has completed (or 60 s pass); the other workers send their data and close their inputs."""
    job = LiveCount(worker, k)
    if worker.index == 0:
        ctl = Controller(job.control, job.machine.probe)
        ep = ControlEndpoint(ctl, f"tcp://127.0.0.1:{port}", routing_table=job.machine.routing_table)
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not (ctl.events and not ctl.busy):
                e = job.epoch
                job.advance([(f"k{(e * 7 + i) % 50}", 1) for i in range(10)] if e < epochs else [], ctl)
                time.sleep(0.002)
            for _ in range(20):  # answer the CLI's last status polls
                ctl.tick()
                time.sleep(0.01)
        finally:
            ep.close()
    outputs = job.finish()
    return {"sent": job.sent, "outputs": outputs, "table": list(job.machine.routing_table()),
            "owned": job.machine.owned_bins()}


@pytest.mark.timeout(300)
def test_cli_against_a_live_two_worker_job():
    k, port = 4, free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with running_job(functools.partial(cli_cluster_job, k=k, port=port, epochs=200), 2, endpoint, join=120) as box:
        goal = skewed(balanced(1 << k, 2))
        r = run_cli("--endpoint", endpoint, "--table", ",".join(map(str, goal)), "--strategy", "batched",
                    "--timeout", "20")
        assert r.returncode == 0, r.stderr
        steps = plan(balanced(1 << k, 2), goal, "batched")
        assert len([ln for ln in r.stdout.splitlines() if ln.startswith("step ")]) == len(steps)
    results = box["results"]
    sent = results[0]["sent"]
    assert observed_count([o for r in results for o in r["outputs"]]) == sequential_count(sent)
    assert all(list(norm(r["table"])) == list(goal) for r in results)
    assert all(goal[b] == w for w, r in enumerate(results) for b in r["owned"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("option", ["--timeout", "--interval"])
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_cli_refuses_a_timeout_or_interval_that_is_not_positive_and_finite(option, value, capsys):
    """A usage error (status 2) naming the option: a negative --timeout used to wait forever for
    the answer (zmq's poll with a negative timeout), 0 or nan failed later or polled without pause."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    other = ["--interval", "0.1"] if option == "--timeout" else ["--timeout", "0.2"]
    with pytest.raises(SystemExit) as e:
        cli_main(["--endpoint", endpoint, "--status", option, value, *other])
    assert e.value.code == 2
    assert f"argument {option}: expected a positive, finite number of seconds, not {value!r}" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_request_refuses_a_timeout_that_would_wait_forever():
    for timeout in (-1, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
            request(f"tcp://127.0.0.1:{free_port()}", {"op": "table"}, timeout=timeout)


@pytest.mark.timeout(30)
def test_cli_refuses_one_bin_moved_to_two_workers(capsys):
    """--move 3:0 --move 3:1 is a usage error (it was sent, and the last move won); the same move
    twice is still sent (here: to no job, so status 3)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as e:
        cli_main(["--endpoint", endpoint, "--move", "3:0", "--move", "3:1", "--timeout", "0.2"])
    assert e.value.code == 2
    assert "--move: bin 3 is moved to both worker 0 and worker 1" in capsys.readouterr().err
    assert cli_main(["--endpoint", endpoint, "--move", "3:1", "--move", "3:1", "--timeout", "0.2"]) == 3
