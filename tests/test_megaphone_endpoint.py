"""The controller's control endpoint (``megaphone.endpoint``): it answers table / status / rebalance
requests in msgpack or JSON from a controller's ``tick``, and rejects bad requests and undecodable
payloads without changing anything. Driven against a fake control input and probe; then a job
secret (CURVE) and a live job under a flood of random, truncated, oversized and misframed messages.
"""
from __future__ import annotations

import functools
import json
import random
import socket
import threading
import time

import msgpack
import pytest
import zmq
from conftest import norm
from megaphone_jobs import FakeControl, FakeProbe, LiveCount, observed_count, running_job, sequential_count

import timely
from megaphone.control import ControlInput
from megaphone.controller import Controller
from megaphone.endpoint import ControlEndpoint, EndpointError, call, request
from megaphone.table import balanced, skewed
from timely.comm.endpoints import free_loopback_ports
from timely.comm.secret import ENV, ENV_FILE, JobSecret


def ask(ctl: Controller, ep: ControlEndpoint, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw ``payload`` to the endpoint and tick the controller until the reply arrives."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(ep.endpoint)
        s.send(payload)
        deadline = time.monotonic() + timeout
        while not s.poll(5):
            ctl.tick()
            assert time.monotonic() < deadline, "no reply from the endpoint"
        return s.recv()
    finally:
        s.close(0)


def ask_msgpack(ctl, ep, req):
    return msgpack.unpackb(ask(ctl, ep, msgpack.packb(req)), raw=False, strict_map_key=False)


def ask_json(ctl, ep, req):
    return json.loads(ask(ctl, ep, json.dumps(req).encode()))


@pytest.fixture
def fake_endpoint():
    control, probe = FakeControl(k=3, peers=3), FakeProbe()
    ctl = Controller(control, probe)
    ep = ControlEndpoint(ctl, "tcp://127.0.0.1:*")
    try:
        yield ctl, ep, control, probe
    finally:
        ep.close()


@pytest.mark.timeout(30)
def test_endpoint_table_status_rebalance(fake_endpoint):
    ctl, ep, control, probe = fake_endpoint
    assert ep.endpoint.startswith("tcp://127.0.0.1:")
    r = ask_msgpack(ctl, ep, {"op": "table"})
    assert r == {"ok": True, "table": [0, 1, 2, 0, 1, 2, 0, 1], "planned": [0, 1, 2, 0, 1, 2, 0, 1],
                 "nbins": 8, "peers": 3}
    r = ask_json(ctl, ep, {"op": "rebalance", "table": [0, 0, 0, 0, 1, 2, 0, 1], "strategy": "fluid"})
    assert r == {"ok": True, "migration": 0, "steps": 2, "moves": 2, "strategy": "fluid"}
    # The tick that answered the request also issued the first step (nothing was in flight).
    assert control.sent == [(0, {1: 0})]
    assert not ctl.tick()  # the probe has not passed time 0
    s = ask_msgpack(ctl, ep, {"op": "status"})
    assert s["ok"] and s["busy"] and not s["done"] and s["steps"] == 2
    assert [e["bins"] for e in s["in_flight"]] == [[1]] and [e["bins"] for e in s["queued"]] == [[2]]
    assert s["in_flight"][0]["elapsed"] >= 0
    probe.frontier = 1
    control.time = 1
    ctl.tick()
    probe.frontier = 2
    ctl.tick()
    s = ask_json(ctl, ep, {"op": "status", "migration": 0})
    assert s["done"] and [e["bins"] for e in s["completed"]] == [[1], [2]]
    assert all(e["duration"] >= 0 for e in s["completed"])
    s = ask_json(ctl, ep, {"op": "status", "migration": 0, "since": 1})  # paging: from the 2nd on
    assert [e["bins"] for e in s["completed"]] == [[2]] and s["completed_count"] == 2
    s = ask_msgpack(ctl, ep, {"op": "status", "limit": 1})
    assert [e["bins"] for e in s["completed"]] == [[1]] and s["completed_count"] == 2
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "moves": {3: 2, 5: 1}})  # int keys (msgpack)
    assert r["ok"] and r["moves"] == 2 and r["steps"] == 1  # batched: 0->2 and 2->1 form one matching
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": [[3, 2]]})  # already planned there: no step
    assert r["ok"] and r["steps"] == 0
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": {"0": 1}})  # JSON object keys are strings
    assert r["ok"] and r["moves"] == 1
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "balanced": True, "strategy": "all_at_once"})
    assert r["ok"] and r["steps"] == 1
    assert ctl.planned_table == balanced(8, 3)
    assert ask_msgpack(ctl, ep, {"op": "table"})["planned"] == list(balanced(8, 3))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("req, error", [
    ({"op": "explode"}, "unknown op 'explode'"),
    ({"nop": 1}, "unknown op None"),
    ([1, 2], "must be a map"),
    ({"op": "rebalance", "table": [0] * 7}, "7 entries, expected one per bin (8)"),
    ({"op": "rebalance", "table": [0] * 7 + [3]}, "target table, bin 7: worker 3 does not exist (there are 3 workers)"),
    ({"op": "rebalance", "table": [0] * 7 + ["x"]}, "worker 'x' is not an integer"),
    ({"op": "rebalance", "table": "0,1"}, "'table' must be a list"),
    ({"op": "rebalance", "moves": [[8, 0]]}, "bin 8 does not exist (there are 8 bins)"),
    ({"op": "rebalance", "moves": [[1, -1]]}, "worker -1 does not exist"),
    ({"op": "rebalance", "moves": [[1, 0], [2, 3]]}, "move of bin 2 to worker 3: worker 3 does not exist"),
    ({"op": "rebalance", "moves": [[1]]}, "not a [bin, worker] pair"),
    ({"op": "rebalance", "moves": 5}, "'moves' must be"),
    ({"op": "rebalance"}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "moves": [[0, 1]]}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "strategy": "sudden"}, "unknown strategy 'sudden'"),
    ({"op": "rebalance", "balanced": "no"}, "'balanced' must be true or false, not 'no'"),  # (read as true)
    ({"op": "rebalance", "moves": []}, "'moves' is empty"),  # (started an empty migration)
    ({"op": "rebalance", "moves": {}}, "'moves' is empty"),
    ({"op": "status", "migration": 4}, "migration 4 does not exist"),
    ({"op": "status", "since": -1}, "'since' must be >= 0"),
    ({"op": "status", "limit": "all"}, "limit 'all' is not an integer"),
])
def test_endpoint_rejects_bad_requests(fake_endpoint, req, error):
    ctl, ep, control, probe = fake_endpoint
    before = (ctl.planned_table, len(ctl.events))
    r = ask_msgpack(ctl, ep, req)
    assert r["ok"] is False and error in r["error"]
    r = ask_json(ctl, ep, req) if isinstance(req, dict) else r
    assert r["ok"] is False and error in r["error"]
    assert (ctl.planned_table, len(ctl.events)) == before and control.sent == []


@pytest.mark.timeout(30)
def test_endpoint_rejects_undecodable_payloads(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    assert "not valid JSON" in json.loads(ask(ctl, ep, b"{not json"))["error"]
    r = msgpack.unpackb(ask(ctl, ep, b"\xc1"), raw=False)
    assert r["ok"] is False and "not valid msgpack" in r["error"]


@pytest.mark.timeout(30)
def test_endpoint_poll_never_blocks(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    t0 = time.monotonic()
    for _ in range(200):
        ctl.tick()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(EndpointError, match="cannot bind"):
        ControlEndpoint(ctl, ep.endpoint)  # the address is taken


# -- hostile clients: a job secret, and random frames ---------------------------------------------------
class Ticking:
    """A controller ticked by a thread, with an endpoint built by ``make(controller)``."""

    def __init__(self, make) -> None:
        self.control, self.probe = FakeControl(k=3, peers=3), FakeProbe()
        self.ctl = Controller(self.control, self.probe)
        self.make = make
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.ctl.tick()
            time.sleep(0.002)

    def __enter__(self):
        self.ep = self.make(self.ctl)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        self.ep.close()


@pytest.mark.timeout(30)
def test_with_a_secret_the_endpoint_answers_only_its_holders(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    keys = JobSecret.from_text("s3cret")

    def with_the_controls_secret(ctl):
        ctl.control.secret = keys  # what a ControlInput built on a worker with a secret holds
        return ControlEndpoint(ctl, "tcp://127.0.0.1:*")

    with Ticking(with_the_controls_secret) as job:
        ep = job.ep.endpoint
        assert request(ep, {"op": "table"}, 10, secret="s3cret")["ok"]
        assert request(ep, {"op": "table"}, 10, secret=keys)["ok"]
        for wrong in (None, "guess"):
            with pytest.raises(EndpointError, match="did not answer within 0.5 s"):
                request(ep, {"op": "rebalance", "balanced": True}, 0.5, secret=wrong)
        monkeypatch.setenv(ENV, "s3cret")  # the client's default, as the rebalance CLI's
        assert call(ep, {"op": "status"}, 10)["ok"]
        assert job.ctl.migrations == 0 and job.ep.requests == 3


def _secret_of_control(worker):
    with worker.dataflow() as scope:
        control = ControlInput(scope, k=1)
    control.close()
    return control.secret


@pytest.mark.timeout(30)
def test_a_control_input_carries_its_workers_secret(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    assert timely.execute(_secret_of_control, secret="s3cret") == [JobSecret.from_text("s3cret")]
    assert timely.execute(_secret_of_control) == [None]


def fuzzed_job(worker, k: int, port: int, epochs: int):
    """Worker 0 serves a control endpoint (requests of at most 4 KiB) on ``port`` and counts until a
    migration requested through it has completed; the other workers only take part."""
    job = LiveCount(worker, k)
    dropped = 0
    if worker.index == 0:
        ctl = Controller(job.control, job.machine.probe)
        ep = ControlEndpoint(ctl, f"tcp://127.0.0.1:{port}", max_message_bytes=4096)
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not (ctl.events and not ctl.busy):
                e = job.epoch
                job.advance([(f"k{(e * 7 + i) % 50}", 1) for i in range(10)] if e < epochs else [], ctl)
                time.sleep(0.002)
            for _ in range(20):  # answer the test's last polls
                ctl.tick()
                time.sleep(0.01)
            dropped = ep.dropped
        finally:
            ep.close()
    outputs = job.finish()
    return {"sent": job.sent, "outputs": outputs, "table": list(job.machine.routing_table()), "dropped": dropped}


def _fuzz(port: int, seconds: float, seed: int) -> int:
    """Throw random, truncated, oversized and misframed messages at ``port`` for ``seconds``; return how
    many. Never a valid rebalance request: the job's routing must stay the test's."""
    rng = random.Random(seed)
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    dealers = []
    for _ in range(3):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        dealers.append(d)
    valid = [msgpack.packb({"op": "rebalance", "balanced": True}), json.dumps({"op": "rebalance", "moves": [[1, 0]]}).encode()]
    sent = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            kind = rng.randrange(6)
            d = rng.choice(dealers)
            if kind == 0:  # random frames
                d.send_multipart([rng.randbytes(rng.randrange(64)) for _ in range(rng.randrange(1, 5))])
            elif kind == 1:  # a valid request cut short
                whole = rng.choice(valid)
                d.send(whole[:rng.randrange(len(whole))])
            elif kind == 2:  # more than the limit: ZeroMQ drops the connection (the DEALER reconnects)
                d.send(b"{" + rng.randbytes(8192))
            elif kind == 3:  # a request behind a wrong envelope
                d.send_multipart([b"x", b"", rng.choice(valid)])
            elif kind == 4:  # read-only requests are fine to answer
                d.send_multipart([b"", msgpack.packb({"op": rng.choice(["table", "status", "nope"])})])
            else:  # not ZeroMQ at all
                with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                    raw.sendall(rng.choice([b"\xff" + rng.randbytes(20), rng.randbytes(rng.randrange(1, 200))]))
            sent += 1
            for s in dealers:  # drain the replies
                while s.poll(0):
                    s.recv_multipart()
            time.sleep(0.001)
    finally:
        for d in dealers:
            d.close(0)
        ctx.term()
    return sent


@pytest.mark.timeout(120)
def test_random_frames_never_hurt_the_job(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    k, port = 4, free_loopback_ports(1)[0]
    endpoint = f"tcp://127.0.0.1:{port}"
    job = functools.partial(fuzzed_job, k=k, port=port, epochs=200)
    with running_job(job, 2, endpoint, join=90, timeout=100) as box:
        assert _fuzz(port, 2.0, seed=13) > 100
        goal = skewed(balanced(1 << k, 2))
        assert call(endpoint, {"op": "rebalance", "table": list(goal)}, 10)["ok"]
    results = box["results"]
    assert observed_count([o for r in results for o in r["outputs"]]) == sequential_count(results[0]["sent"])
    assert all(list(norm(r["table"])) == list(goal) for r in results)
    assert results[0]["dropped"] > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("req, error", [
    ({"op": "rebalance", "moves": [[3, 0], [3, 1]]}, "bin 3 is moved to both worker 0 and worker 1"),
    ({"op": "rebalance", "moves": {"3": 2, 3: 0}}, "bin 3 is moved to both worker 2 and worker 0"),
    ({"op": "status", "since": "--1"}, "since '--1' is not an integer"),
    ({"op": "rebalance", "moves": [["²", 1]]}, "bin '²' is not an integer"),
    ({"op": "rebalance", "table": ["0", "1", "--2", "0", "1", "2", "0", "1"]}, "worker '--2' is not an integer"),
])
def test_endpoint_refuses_conflicting_moves_and_strings_that_only_look_like_integers(fake_endpoint, req, error):
    """A bin moved to two different workers in one request is refused (it was: the last one won);
    a string that passes ``isdigit`` but not ``int`` ("--1", "²") is refused naming the field and
    the value (it was: an internal error). Nothing is queued. (msgpack only: JSON has no int keys.)"""
    ctl, ep, control, probe = fake_endpoint
    before = (ctl.planned_table, len(ctl.events))
    r = ask_msgpack(ctl, ep, req)
    assert r == {"ok": False, "error": error}
    assert (ctl.planned_table, len(ctl.events)) == before and control.sent == []


@pytest.mark.timeout(30)
def test_endpoint_and_dashboard_accept_the_same_move_twice_and_refuse_two_targets(fake_endpoint):
    from megaphone.autobalance import Steering

    ctl, ep, control, probe = fake_endpoint
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": [[3, 1], [3, 1]]})
    assert r["ok"] and r["moves"] == 1
    steering = Steering(ctl)
    with pytest.raises(ValueError, match="bin 5 is moved to both worker 0 and worker 1"):
        steering.rebalance({"moves": [[5, 0], [5, 1]]})
    assert steering.rebalance({"moves": [[5, 0], [5, 0]]})["moves"] == 1


def test_under_a_secret_a_request_near_the_limit_is_answered(monkeypatch):
    """The endpoint's frame limit counted a request as sent, but under CURVE it travels 33 bytes
    longer: one within that of ``max_message_bytes`` dropped the connection (no answer)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    keys = JobSecret.from_text("s3cret")

    def near_the_limit(ctl):
        ctl.control.secret = keys
        return ControlEndpoint(ctl, "tcp://127.0.0.1:*", max_message_bytes=1024)

    with Ticking(near_the_limit) as job:
        req = {"op": "table", "pad": ""}
        req["pad"] = "x" * (1024 - len(msgpack.packb(req)) - 2)  # (a str8 header became a str16)
        assert len(msgpack.packb(req)) == 1024
        reply = request(job.ep.endpoint, req, 10, secret=keys)
        assert reply["ok"] or "pad" in reply.get("error", "")  # answered, whatever it says of the field
