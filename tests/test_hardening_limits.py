"""Limits of the worker links that used to fail late or misleadingly: a message at
``max_message_bytes`` under CURVE, an empty ``TIMELY_SECRET``, allocator options out of range, a
long ``heartbeat_timeout`` and an over-long job token.

Pairs of allocators run in two threads of this process (each has its own ZeroMQ context); the
launcher tests start ``python -m timely.launch`` through the ``launched`` fixture, which kills and
reaps whatever is left; ``no_leftovers`` checks that the API calls refused start no process.
"""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import zmq
from procs import no_leftover_children

import timely.cluster
from timely.cluster import execute_cluster
from timely.comm.endpoints import free_loopback_ports, ipc_endpoints, loopback_endpoints
from timely.comm.framing import VERSION, encode
from timely.comm.gate import MAX_HELLO_BYTES, MAX_TOKEN_BYTES, check_token
from timely.comm.peer import MAX_KEEPALIVE_PROBES, MAX_KEEPALIVE_SECONDS, Tuning
from timely.comm.secret import ENV, ENV_FILE, JobSecret, SecretError, resolve
from timely.comm.zmq_allocator import MAX_HEARTBEAT_TIMEOUT, MAX_MESSAGE_BYTES, MIN_MESSAGE_BYTES, ZmqAllocator, check_options

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = "def main(worker):\n    print('ran', worker.index, flush=True)\n"


@pytest.fixture
def no_leftovers():
    """After the test, kill and reap every child (orphaned workers included) and fail if any."""
    with no_leftover_children():
        yield


def _pair(endpoints: list[str], token: str = "job", **options) -> list[ZmqAllocator]:
    """Two connected allocators, built in two threads (each constructor waits for the other)."""
    made: list = [None, None]

    def make(index: int) -> None:
        try:
            made[index] = ZmqAllocator(index, 2, endpoints, token, **options)
        except BaseException as exc:  # re-raised below, in the test's thread
            made[index] = exc

    threads = [threading.Thread(target=make, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [m for m in made if isinstance(m, BaseException) or m is None]
    if errors:
        _close([m for m in made if isinstance(m, ZmqAllocator)], abort="test failed")
        raise AssertionError(f"the allocators did not connect: {errors!r}")
    return made


def _close(allocs: list[ZmqAllocator], abort: str | None = None) -> None:
    """Close the allocators together (a normal close waits for the other's acknowledgement)."""
    threads = [threading.Thread(target=a.close, args=(abort,), daemon=True) for a in allocs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _launch(launched, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "timely.launch", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    launched.append(proc)
    out, err = proc.communicate(timeout=40)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def job(tmp_path) -> str:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return str(path)


# -- 1. a message of max_message_bytes under CURVE -------------------------------------------------------
@pytest.mark.parametrize("secret", [None, "s3cr3t"], ids=["plain", "curve"])
def test_a_message_of_exactly_max_message_bytes_crosses_a_link_with_or_without_a_secret(tmp_path, secret):
    """The receiver's frame limit counts a frame as it travels: under CURVE, 33 bytes more than its
    payload. A message the sender allows (encoded size == max_message_bytes) must arrive, not reset
    the connection (which failed the job with a misleading PeerLost)."""
    limit = 1024
    blob = b"x" * (limit - 3)  # bin16: a 3-byte prefix
    assert len(encode(blob)) == limit
    allocs = _pair(ipc_endpoints(str(tmp_path), 2), max_message_bytes=limit,
                   secret=None if secret is None else JobSecret.from_text(secret), goodbye_grace=0.5)
    try:
        pushers, _ = allocs[0].allocate(0)
        _, puller = allocs[1].allocate(0)
        pushers[1].push(blob)
        pushers[1].push(b"after")
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            allocs[0].receive()
            allocs[0].release()
            allocs[1].receive()  # (PeerLost here when the frame was refused)
            allocs[1].events()
            got.extend(puller.drain())
            allocs[1].await_events(0.01)
        assert got == [blob, b"after"]
    finally:
        _close(allocs)


def test_a_job_under_a_secret_fills_its_bundles_up_to_max_message_bytes():
    """An ordinary job: a step's flush packs its messages to a peer (three exchanges, progress) into
    bundles right up to the limit."""
    def main(worker):
        rnd = random.Random(worker.index)
        got = [0, 0, 0]
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probes = [inp.stream.exchange(lambda x, k=k: hash((x, k)))
                      .inspect(lambda x, k=k: got.__setitem__(k, got[k] + 1)).probe() for k in range(3)]
        sent = 0
        for epoch in range(300):
            for _ in range(rnd.randrange(1, 12)):
                inp.send("x" * rnd.randrange(5, 300) + str(epoch))
                sent += 1
            inp.advance_to(epoch + 1)
            worker.step_while(lambda: any(p.less_than(inp.time) for p in probes))
        inp.close()
        worker.finish()
        return sent, got

    with no_leftover_children():
        results = execute_cluster(main, 2, timeout=40, secret="s3cr3t", max_message_bytes=1024, goodbye_grace=0.5)
    sent = sum(s for s, _ in results)
    assert [sum(got[k] for _, got in results) for k in range(3)] == [sent] * 3


# -- 2. an empty TIMELY_SECRET ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "  \n"], ids=["empty", "blank"])
def test_a_set_but_empty_timely_secret_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(SecretError, match=f"the job secret is empty \\(environment variable {ENV}\\)"):
        resolve()
    monkeypatch.delenv(ENV)
    monkeypatch.setenv(ENV_FILE, value)
    with pytest.raises(SecretError, match=f"{ENV_FILE} is set but empty"):
        resolve()
    monkeypatch.delenv(ENV_FILE)
    assert resolve() is None  # unset: no secret, as before


def test_the_launcher_refuses_an_empty_timely_secret(launched, job):
    run = _launch(launched, "-w", "2", job, env={ENV: ""})
    assert run.returncode == 2, run.stderr
    assert f"the job secret is empty (environment variable {ENV})" in run.stderr and "ran" not in run.stdout


# -- 3. allocator options --------------------------------------------------------------------------------
BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"max_message_bytes": 16e6}, TypeError, "max_message_bytes must be an integer, not 16000000.0"),
    ({"max_message_bytes": True}, TypeError, "max_message_bytes must be an integer, not True"),
    ({"inflight_bytes": 1e9}, TypeError, "inflight_bytes must be an integer, not 1000000000.0"),
    ({"max_message_bytes": 2**63}, ValueError, f"max_message_bytes must be at most {MAX_MESSAGE_BYTES}, not {2**63}"),
    ({"max_message_bytes": 1000}, ValueError, "max_message_bytes must be at least 1024, not 1000"),
    ({"mailbox_bytes": 0}, ValueError, "mailbox_bytes must be at least 1, not 0"),
    ({"mailbox_bytes": -5}, ValueError, "mailbox_bytes must be at least 1, not -5"),
    ({"receive_batch": 0}, ValueError, "receive_batch must be at least 1, not 0"),
    ({"receive_bytes": 0}, ValueError, "receive_bytes must be at least 1, not 0"),
    ({"backlog_bytes": -1}, ValueError, "backlog_bytes must be at least 0, not -1"),
    ({"inflight_bytes": 0}, ValueError, "inflight_bytes must be at least 1, not 0"),
    ({"hwm": 0}, ValueError, "hwm must be at least 1, not 0"),
    ({"hwm": 2**40}, ValueError, f"hwm must be at most {2**31 - 1}, not {2**40}"),
    ({"heartbeat_timeout": 3e6}, ValueError,
     f"heartbeat_timeout must be at most {MAX_HEARTBEAT_TIMEOUT} seconds, not 3000000.0"),
    ({"heartbeat_timeout": 0}, ValueError, "heartbeat_timeout must be a positive number of seconds, not 0"),
    ({"heartbeat_ivl": math.inf}, ValueError, "heartbeat_ivl must be a finite number of seconds"),
    ({"startup_timeout": math.nan}, ValueError, "startup_timeout must be a positive number of seconds, not nan"),
    ({"goodbye_grace": -1}, ValueError, "goodbye_grace must be a non-negative number of seconds, not -1"),
    ({"close_timeout": "3"}, TypeError, "close_timeout must be a number of seconds, not '3'"),
]
BAD_IDS = [" ".join(f"{k}={v!r}" for k, v in options.items()) for options, _, _ in BAD_OPTIONS]


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS, ids=BAD_IDS)
def test_a_bad_allocator_option_fails_execute_cluster_before_any_worker_starts(no_leftovers, monkeypatch, options,
                                                                               error, message):
    """Used to hang (a zero mailbox or batch), wait out the start-up timeout, or fail inside every
    forked worker with a bare TypeError / OverflowError."""
    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(timely.cluster, "supervise", no_workers)
    began = time.monotonic()
    with pytest.raises(error) as caught:
        execute_cluster(lambda worker: None, 2, timeout=10, **options)
    assert message in str(caught.value) and time.monotonic() - began < 5


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS, ids=BAD_IDS)
def test_a_bad_allocator_option_fails_the_allocator_at_once(tmp_path, options, error, message):
    """Other callers (the Spark bridge's tasks, run_worker) construct the allocator directly."""
    with pytest.raises(error) as caught:
        ZmqAllocator(0, 2, ipc_endpoints(str(tmp_path), 2), "job", **{"startup_timeout": 1, **options})
    assert message in str(caught.value)


def test_the_allocator_options_in_range_are_accepted():
    check_options({})
    check_options({"max_message_bytes": MIN_MESSAGE_BYTES, "inflight_bytes": 1, "hwm": None, "backlog_bytes": 0,
                   "mailbox_bytes": 1, "receive_batch": 1, "receive_bytes": 1, "startup_timeout": math.inf,
                   "heartbeat_ivl": 0, "heartbeat_timeout": MAX_HEARTBEAT_TIMEOUT, "goodbye_grace": 0,
                   "close_timeout": 0, "transport": "not an allocator option: ignored"})
    check_options({"max_message_bytes": MAX_MESSAGE_BYTES, "hwm": 2**31 - 1, "heartbeat_ivl": 0.25,
                   "heartbeat_timeout": 0.5})
    alloc = ZmqAllocator(0, 1, ["ipc:///nowhere"], "job", max_message_bytes=MAX_MESSAGE_BYTES, inflight_bytes=2**80)
    alloc.close()


# -- 4. a long heartbeat_timeout -------------------------------------------------------------------------
def test_the_launcher_refuses_a_heartbeat_timeout_too_long_for_tcp_maxrt(launched, job):
    run = _launch(launched, "-w", "2", "--heartbeat-timeout", "3e6", job)
    assert run.returncode == 2, run.stderr
    assert f"--heartbeat-timeout must be at most {MAX_HEARTBEAT_TIMEOUT} seconds (about 24 days), not 3e+06" \
        in run.stderr and "ran" not in run.stdout


@pytest.mark.parametrize("timeout", [30.0, 200.0, float(MAX_HEARTBEAT_TIMEOUT)])
def test_keepalive_options_stay_within_the_kernels_bounds(timeout):
    """Linux refuses more than 127 probes or an interval over 32767 s, and libzmq then drops every
    connection attempt: a long timeout spaces the probes out instead."""
    tuning = Tuning(hwm=4, max_message_bytes=1 << 20, backlog_bytes=1 << 20, mailbox_bytes=1 << 20,
                    startup_timeout=1.0, heartbeat_ivl=1.0, heartbeat_timeout=timeout, goodbye_grace=1.0,
                    close_timeout=1.0, receive_batch=8, receive_bytes=1 << 20)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        tuning.apply(sock)
        idle, ivl, probes = (sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE), sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL),
                             sock.getsockopt(zmq.TCP_KEEPALIVE_CNT))
        assert idle == 1 and 1 <= ivl <= MAX_KEEPALIVE_SECONDS and 1 <= probes <= MAX_KEEPALIVE_PROBES
        assert timeout <= ivl * probes < timeout + ivl  # the probes span the timeout
        assert sock.getsockopt(zmq.TCP_MAXRT) == int(timeout * 1000)
        if timeout == 30.0:
            assert (ivl, probes) == (1, 30)  # as before
        sock.close(0)
    finally:
        ctx.term()


def test_workers_with_a_long_heartbeat_timeout_connect_over_tcp():
    """A heartbeat timeout over 127 s made TCP_KEEPCNT invalid: the job never started."""
    endpoints = [loopback_endpoints(port, 1)[0] for port in free_loopback_ports(2)]
    allocs = _pair(endpoints, startup_timeout=10, heartbeat_ivl=1.0, heartbeat_timeout=200.0)
    _close(allocs)


# -- 5. an over-long job token ---------------------------------------------------------------------------
def test_the_longest_token_fits_the_largest_hello():
    hello = encode({"token": "é" * (MAX_TOKEN_BYTES // 2), "index": 0xFFFF, "peers": 0x10000, "version": VERSION,
                    "max_message_bytes": MAX_MESSAGE_BYTES})
    assert len(hello) <= MAX_HELLO_BYTES
    check_token("x" * MAX_TOKEN_BYTES)
    with pytest.raises(ValueError, match=f"the job token is {MAX_TOKEN_BYTES + 1} bytes long .*at most {MAX_TOKEN_BYTES}"):
        check_token("x" * (MAX_TOKEN_BYTES + 1))
    with pytest.raises(ValueError, match="the job token is 1000 bytes long"):
        check_token("é" * 500)


def test_an_over_long_token_fails_the_allocator_at_once(tmp_path):
    began = time.monotonic()
    with pytest.raises(ValueError, match=f"the job token is 1000 bytes long \\(UTF-8\\); at most {MAX_TOKEN_BYTES}"):
        ZmqAllocator(0, 2, ipc_endpoints(str(tmp_path), 2), "t" * 1000, startup_timeout=10)
    assert time.monotonic() - began < 5


def test_workers_with_the_longest_token_connect(tmp_path):
    _close(_pair(ipc_endpoints(str(tmp_path), 2), token="t" * MAX_TOKEN_BYTES, startup_timeout=10))


@pytest.mark.parametrize("where", ["option", "environment"])
def test_the_launcher_refuses_an_over_long_token(launched, job, where):
    token = "t" * 1000
    argv, env = (["--token", token], None) if where == "option" else ([], {"TIMELY_TOKEN": token})
    began = time.monotonic()
    run = _launch(launched, "-w", "2", "--startup-timeout", "20", *argv, job, env=env)
    assert run.returncode == 2, run.stderr
    assert f"--token (or TIMELY_TOKEN) is 1000 bytes long (UTF-8); at most {MAX_TOKEN_BYTES} are allowed" \
        in run.stderr and "ran" not in run.stdout
    assert time.monotonic() - began < 15
